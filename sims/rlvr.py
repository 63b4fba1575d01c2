"""RL from a verifiable reward after distillation, and what each distillation costs (claims E4, E6).

    python sims/rlvr.py            # about 6 min on 2 cores
    python sims/rlvr.py --quick    # seconds (the tests run this)
    python sims/rlvr.py --full --executor dask --scheduler tcp://HOST:PORT   # a cluster

On goal-reaching tasks with a checker (distillation.tasks), a student with shared parameters (log-linear on
shared features, every run of a task in one tensor; and a tiny Qwen2 reading the same features, fewer
runs) is distilled from two teachers on in-distribution contexts, to an equal budget (the same steps
and batch):
offline (FKL or RKL with the full conditionals on minibatches from a pool of teacher traces drawn once:
256, 1024 or 4096 traces for FKL; 1024 for the tiny Qwen2) or on-policy (the same losses on the student's own responses); a
control is not distilled, and another (fresh-teacher) is offline on new teacher traces every step, which
separates data freshness from on-policy sampling. Then every student runs the same policy-gradient RL with the 0/1 reward of
the checker on in-distribution contexts (REINFORCE with a group-relative baseline). Two conditions: the
student's features carry a shared skill (what it learns on one state transfers to others) or do not.

Writes to ``--out`` (default results/rlvr):
  curves.csv     every run at log-spaced checkpoints of both stages: student, condition, task, method, seed, stage,
                 step, teacher_tokens, student_tokens, id_accuracy, ood_accuracy, kl_arithmetic, kl_local
  teachers.csv   the exact outcomes of each teacher and of the targets A and l, per task
  e4.csv         OOD accuracy after distillation and after RL per method (95% intervals over its runs), and
                 the paired on-policy minus offline difference per objective, its runs clustered by task
                 (a t-interval over the task means), with a verdict
  e6.csv         per method: the cost of the run, the KL to its objective's target and the ID accuracy at
                 the end of distillation, the KL at the offline method's cost, and the cost to reach the
                 offline method's final KL
  figures/       rlvr.png (E4), rlvr_cost.png (E6)
"""

import argparse
import math
import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import experiment_parser  # noqa: E402  (argparse only)

EXPERIMENTS = ("shared", "unshared")              # the conditions
DEFAULT_OUT = os.path.join("results", "rlvr")
DEFAULT_STUDENT_TOKEN_COST = 1.0             # E6: a generated student token costs f scored teacher tokens (f = 1) ...
STUDENT_TOKEN_COSTS = (0.0, 1.0, 3.0)        # ... and the verdicts at each of these prices


def _price(text):
    """--student-token-cost: a finite number >= 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"--student-token-cost must be a finite number >= 0, got {text!r}")
    return value


def parse_args(argv):
    ap = experiment_parser("rlvr.py", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS, full=True)
    ap.add_argument("--student-token-cost", type=_price, default=DEFAULT_STUDENT_TOKEN_COST,
                    help=f"E6: the price of a generated student token in scored teacher tokens (default "
                         f"{DEFAULT_STUDENT_TOKEN_COST:g}; the verdicts are also computed at "
                         f"{', '.join(f'{f:g}' for f in STUDENT_TOKEN_COSTS)})")
    return ap.parse_args(argv)


if __name__ == "__main__":      # --help and a bad argument answer here, before numba, torch and pandas load
    parse_args(sys.argv[1:])


import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import analysis  # noqa: E402

from analysis.verdicts import (COLUMNS, QUICK, bound_verdict, check_margin, clusters_for_power, count_verdict,  # noqa: E402
                               effect_verdict, fieller, median_lower_bound, ratio_resolved, t_mde_80, t_power, tost,
                               tost_clusters_for_power, tost_se_for_power, verdict_row)
from harness import Cell, run_cells, sizes, write_csv  # noqa: E402
from distillation import evaluation, tasks, verifiable  # noqa: E402
from distillation.configs import Method  # noqa: E402
from distillation.students import goal_students  # noqa: E402


# ------------------------------------------------------------------------------------------------
# the settings (data, not code)
# ------------------------------------------------------------------------------------------------
SIZES = {                                    # default / --quick / --full
    "tasks": (8, 2, 16),                      # log-linear student: tasks per condition
    "seeds": (8, 2, 16),                      # ... and student seeds per task
    "neural_tasks": (4, 1, 8),                # tiny Qwen2 student
    "neural_seeds": (4, 2, 8),
    "distil_steps": (300, 30, 600),
    "rl_steps": (500, 30, 1000),
}
CONDITIONS = {"shared": dict(signal=1.0), "unshared": dict(signal=0.0)}
METHODS = (
    Method("offline FKL", "fkl", "offline", 1024),
    Method("offline FKL, 256 traces", "fkl", "offline", 256),
    Method("offline FKL, 4096 traces", "fkl", "offline", 4096),
    Method("offline RKL", "rkl", "offline", 1024),
    Method("on-policy FKL", "fkl", "on-policy"),
    Method("on-policy RKL", "rkl", "on-policy"),
    Method("no distillation"),
    Method("fresh-teacher FKL", "fkl", "fresh"),      # the control: new teacher traces every step
    Method("fresh-teacher RKL", "rkl", "fresh"),
)
PAIRS = {"fkl": ("on-policy FKL", "offline FKL"), "rkl": ("on-policy RKL", "offline RKL")}
FRESH = {"fkl": "fresh-teacher FKL", "rkl": "fresh-teacher RKL"}
MARGIN_SHARE = 0.5                           # E4: equivalence / non-superiority margins are half the pre-RL edge
PARITY = 0.001                               # E6: "reached the offline arm's ID accuracy" = within 0.001 of it
VERDICT_COLUMNS = COLUMNS + ("margin", "df", "mde_80", "power", "student_token_cost")
STUDENT_METHODS = {"loglinear": METHODS,                     # the pool sizes (E6) with the cheap student only
                   "neural": tuple(m for m in METHODS if m.pool in (0, 1024))}
TRAINING = dict(batch=32, contexts=8, group=8)
LEARNING_RATES = {"loglinear": (0.03, 0.03), "neural": (3e-3, 1e-3)}   # (distillation, RL): Adam


def cells_for(size, only, base_seed=0):
    prefix = {"loglinear": "", "neural": "neural_"}
    return [Cell(condition, "study", {"condition": condition, "student": student, "task": task,
                                      "seeds": size[f"{prefix[student]}seeds"], "distil_steps": size["distil_steps"],
                                      "rl_steps": size["rl_steps"]},
                 seeds=2, base_seed=base_seed, stream=(condition, student, task))
            for student in STUDENT_METHODS for condition in only for task in range(size[f"{prefix[student]}tasks"])]


# ------------------------------------------------------------------------------------------------
# one function per kind of cell
# ------------------------------------------------------------------------------------------------
def run_study(cell):
    """Both stages for every method and student seed of one student kind on one task."""
    task_id = cell.base_seed * 1000 + cell["task"]
    task = tasks.make_goal_task(task_id, **CONDITIONS[cell["condition"]])
    student = cell["student"]
    runs = [(m, s) for m in STUDENT_METHODS[student] for s in range(cell["seeds"])]
    distil_lr, rl_lr = LEARNING_RATES[student]
    students = goal_students(student, task, [task_id * 100 + s for _, s in runs], lr=distil_lr)
    stream = cell.seed_array()
    rows, costs = verifiable.distil(task, runs, students, steps=cell["distil_steps"], batch=TRAINING["batch"],
                                    seed=int(stream[0]), task_seed=task_id)
    students.lr = rl_lr                                     # RL starts its own Adam at its own rate
    rl_rows = verifiable.reinforce(task, runs, students, costs, steps=cell["rl_steps"], contexts=TRAINING["contexts"],
                          group=TRAINING["group"], seed=int(stream[1]))
    where = dict(condition=cell["condition"], student=student, task=cell["task"])
    return {"curves": pd.DataFrame(rows + rl_rows).assign(**where),
            "teachers": evaluation.teacher_rows(task).assign(condition=cell["condition"], task=cell["task"])}


RUNNERS = {"study": run_study}


def run_cell(cell):
    return RUNNERS[cell.kind](cell)


# ------------------------------------------------------------------------------------------------
# outputs
# ------------------------------------------------------------------------------------------------
def stage_ends(curves):
    """One row per run: OOD and ID accuracy after distillation ('_distil') and after RL ('_rl')."""
    keys = ["student", "condition", "task", "method", "seed"]
    ends = []
    for stage in ("distil", "rl"):
        part = curves[curves.stage == stage]
        last = part[part.step == part.groupby(keys).step.transform("max")]
        ends.append(last.set_index(keys)[["ood_accuracy", "id_accuracy"]].add_suffix(f"_{stage}"))
    return pd.concat(ends, axis=1).reset_index()


def _interval(values):
    mean, lo, hi = analysis.mean_interval(np.asarray(values, dtype=float)[:, None])
    return float(mean[0]), float(lo[0]), float(hi[0])


def e4_table(curves):
    """OOD accuracy per method after each stage (95% interval over its runs), and the paired on-policy
    minus offline differences, their runs clustered by task (:func:`task_clustered`), with a verdict: an
    edge exists where the interval after distillation lies above 0; it survives where the interval after
    RL does too."""
    ends = stage_ends(curves)
    rows = []
    for (student, condition, method), g in ends.groupby(["student", "condition", "method"], sort=False):
        for stage in ("distil", "rl"):
            mean, lo, hi = _interval(g[f"ood_accuracy_{stage}"])
            rows.append(dict(student=student, condition=condition, comparison=method, stage=stage, ood_accuracy=mean,
                             lo=lo, hi=hi, runs=len(g)))
    for (student, condition), g in ends.groupby(["student", "condition"], sort=False):
        wide = g.set_index(["task", "seed", "method"]).unstack("method")
        for objective, (on, off) in PAIRS.items():
            verdict = {}
            for stage in ("distil", "rl"):
                diff = wide[(f"ood_accuracy_{stage}", on)] - wide[(f"ood_accuracy_{stage}", off)]
                mean, lo, hi, _, n_tasks = task_clustered(diff, wide.index.get_level_values("task"))
                verdict[stage] = "above 0" if lo > 0 else "below 0" if hi < 0 else "includes 0"
                rows.append(dict(student=student, condition=condition, comparison=f"{on} - {off}", stage=stage,
                                 ood_accuracy=mean, lo=lo, hi=hi, runs=len(diff), tasks=n_tasks))
            edge = verdict["distil"] == "above 0"
            rows[-1]["verdict"] = rows[-2]["verdict"] = (
                ("edge survives RL" if verdict["rl"] == "above 0" else f"edge does not survive RL (after RL: "
                 f"{verdict['rl']})") if edge else f"no edge after distillation ({verdict['distil']})")
    return pd.DataFrame(rows)


def task_clustered(diff, tasks):
    """A paired difference per run, its runs clustered by task (the seeds of a task share it): (mean of the
    task means, its 95% Student-t interval over the tasks (lo, hi), the cluster standard error, the number
    of tasks). A t-interval on the task means rather than a percentile bootstrap of them: with 4 or 8
    tasks the bootstrap's interval is too narrow (it covers 0.87 of the time at 8, less at 4)."""
    means = pd.Series(np.asarray(diff, dtype=float)).groupby(np.asarray(tasks)).mean()
    estimate, lo, hi = _interval(means)
    se = float(means.std(ddof=1) / np.sqrt(len(means))) if len(means) > 1 else float("nan")
    return estimate, lo, hi, se, len(means)


def _row(claim, condition, statistic, estimate, lo, hi, rule, verdict, **extra):
    """A verdicts.csv row (``VERDICT_COLUMNS``): analysis.verdicts' columns and the test's margin, df, MDE,
    power and the student-token price (NaN where a row has none)."""
    return dict(verdict_row(claim, condition, statistic, estimate, lo, hi, rule, verdict),
                **{k: float(extra.get(k, np.nan)) for k in VERDICT_COLUMNS[len(COLUMNS):]})


def _edge_margin(edge):
    """E4's equivalence and non-superiority margin: MARGIN_SHARE of the pre-RL edge when that is positive
    (``check_margin``: strictly below it), else None (no edge to split or to lose)."""
    return check_margin(MARGIN_SHARE * edge, edge) if edge > 0 else None


def _tost_design(se, n, margin):
    """What TOST within +-``margin`` needs to say 'no effect' here, from the after-RL standard error ``se``
    over ``n`` task means: the s.e. at which it has 80% power at a true difference of 0 (at these n tasks,
    ``analysis.verdicts.tost_power``), how many times smaller that is than ``se``, and the tasks it needs at
    the measured between-task spread (:func:`analysis.verdicts.tost_clusters_for_power`)."""
    sd = max(se, 1e-12) * math.sqrt(n)
    target = tost_se_for_power(margin, n)
    said = f"TOST has 80% power at a true difference of 0 with {n} tasks only if the s.e. is <= {target:.3g}"
    if se <= target:
        return f"{said} (measured {se:.3g}: the design can show 'no effect')"
    need = tost_clusters_for_power(sd, margin)
    return (f"{said}, {se / target:.2g}x smaller than the {se:.3g} measured: this design cannot show 'no effect'; at "
            f"the measured between-task s.d. {sd:.3g} that needs "
            + (f"{need:,} tasks ({need / n:.3g}x the {n})" if need else "more than 10^9 tasks"))


def _t_tests(se, n):
    """(df, the t-test's MDE at 80% power) over ``n`` task means with standard error ``se``."""
    return (n - 1, t_mde_80(se, n - 1)) if n > 1 and se > 0 else (np.nan, np.nan)


def _share_row(num, den, tasks_, where, fresh, on, off):
    """E4's freshness share: (fresh - offline) / (on-policy - offline) over the task means, with its
    Fieller set (t over the tasks); 'not resolved' when the set is unbounded or holds both 0 and 1."""
    means = pd.DataFrame({"num": np.asarray(num, dtype=float), "den": np.asarray(den, dtype=float)}).groupby(
        np.asarray(tasks_)).mean()
    n = len(means)
    claim = "E4 control: data freshness carries most of the edge (share > 0.5)"
    statistic = (f"({fresh} minus {off}) over ({on} minus {off}) OOD accuracy after distillation, a ratio of "
                 f"means of {n} task means")
    rule = ("Fieller 95% set (t over tasks) not resolved (unbounded, or holds both 0 and 1): inconclusive; a "
            "resolved set above 0.5: reproduces; below 0.5: does not; else inconclusive")
    if n < 2:
        return _row(claim, where, statistic + "; one task: no Fieller set", np.nan, np.nan, np.nan, rule,
                    "inconclusive")
    cov = float(np.cov(means.num, means.den, ddof=1)[0, 1]) / n
    se_num, se_den = (float(means[c].std(ddof=1) / np.sqrt(n)) for c in ("num", "den"))
    est, lo, hi, kind = fieller(means.num.mean(), means.den.mean(), se_num, se_den, cov, df=n - 1)
    resolved = ratio_resolved(lo, hi, kind)
    shown = {"interval": f"[{lo:.2f}, {hi:.2f}]", "two rays": f"(-inf, {lo:.2f}] and [{hi:.2f}, inf)",
             "whole line": "the whole line"}[kind]
    verdict = bound_verdict(lo, hi, 0.5, at_most=False) if resolved else "inconclusive"
    lo, hi = (lo, hi) if kind == "interval" else (-np.inf, np.inf)
    return _row(claim, where, f"{statistic}; Fieller 95% set {shown}: {'resolved' if resolved else 'not resolved'}",
                est, lo, hi, rule, verdict, df=n - 1)


def verdicts(curves, student_token_cost=DEFAULT_STUDENT_TOKEN_COST):
    """verdicts.csv of E4 and E6 by stated rules (``VERDICT_COLUMNS``), per student, feature condition and
    objective, the runs clustered by task (t over the task means, df = tasks - 1):

    E4 'an on-policy edge exists after distillation': the interval of on-policy minus offline OOD accuracy
    above 0: reproduces; below 0 throughout: does not; else inconclusive; with the t-test's MDE and the
    tasks 80% power at the measured edge would need (tasks, not seeds: the task means' spread decides).
    'The edge does not survive RL': TOST within +-margin, margin = MARGIN_SHARE x the pre-RL edge (below
    it; no positive edge: no margin, inconclusive): reproduces; interval after RL above 0: does not; with
    the MDE and the power (noncentral t) at the pre-RL edge. The fresh-teacher controls split the edge
    (non-superiority at the same margin, 0 without an edge), and freshness's share of it by Fieller.

    E6 per pool size and per student-token price f in STUDENT_TOKEN_COSTS (and ``student_token_cost``):
    cost = teacher tokens + f x student tokens; the on-policy arm's cost to reach the offline arm's final
    ID accuracy (within PARITY) and its final KL, crossings interpolated log-linearly between checkpoints,
    over the offline arm's cost, a geometric mean over task means; runs that never reach it count at their
    budget and make the estimate 'at least': the median task mean with the sign test's order-statistic lower
    bound (which a censored run's true cost can only raise; a t bound can fall). And the reverse: whether the offline
    arm reaches the on-policy arm's final KL within its steps (f-free)."""
    ends = stage_ends(curves)
    rows = []
    for (student, condition), g in ends.groupby(["student", "condition"], sort=False):
        wide = g.set_index(["task", "seed", "method"]).unstack("method")
        tasks_ = wide.index.get_level_values("task")
        seeds = wide.index.get_level_values("seed").nunique()
        for objective, (on, off) in PAIRS.items():
            if ("ood_accuracy_distil", on) not in wide or ("ood_accuracy_distil", off) not in wide:
                continue
            where = f"{student}, {condition}, {objective.upper()}"
            diff = {stage: wide[(f"ood_accuracy_{stage}", on)] - wide[(f"ood_accuracy_{stage}", off)]
                    for stage in ("distil", "rl")}
            est, lo, hi, se, n = task_clustered(diff["distil"], tasks_)
            df, mde = _t_tests(se, n)
            design = ""
            if n > 1 and se > 0:
                need = clusters_for_power(se * np.sqrt(n), est) if est != 0 else None
                design = (f"; between-task s.d. of the task means {se * np.sqrt(n):.3f}: 80% power at this edge "
                          f"needs {f'{need:,} tasks' if need else 'more than 10^6 tasks'} at {seeds} seeds each")
            rows.append(_row("E4 an on-policy edge in OOD accuracy exists after distillation", where,
                             f"on-policy minus offline OOD accuracy, mean of {n} task means, 95% t-interval over "
                             f"tasks{design}", est, lo, hi,
                             "interval above 0: reproduces; below 0 throughout (margin 0): does not; else inconclusive",
                             effect_verdict(lo, hi, 1, 0.0) if n > 1 else "inconclusive", margin=0.0, df=df,
                             mde_80=mde))
            edge, margin = est, _edge_margin(est)
            est, lo, hi, se, n = task_clustered(diff["rl"], tasks_)
            df, mde = _t_tests(se, n)
            extra = dict(df=df, mde_80=mde)
            if n < 2:                                  # one task: no between-task spread to test against
                verdict, tests = "inconclusive", "one task: no task-level interval, power or TOST"
                rule = "TOST within +-margin: reproduces; interval above 0: does not; else inconclusive"
            elif margin is None:
                verdict, tests = "inconclusive", f"no positive pre-RL edge ({edge:+.3f}): no margin, nothing to lose"
                rule = "TOST within +-margin: reproduces; interval above 0: does not; else inconclusive"
            else:
                p, equivalent = tost(est, max(se, 1e-12), margin, df=n - 1)
                verdict = ("reproduces" if equivalent else "does not reproduce" if lo > 0 else "inconclusive")
                pw = t_power(edge, max(se, 1e-12), n - 1)
                tests = (f"TOST p = {p:.2g}; t-test with {n - 1} df: smallest effect detectable at 80% power "
                         f"{mde:.3f}, power to see the pre-RL edge ({edge:+.3f}) {pw:.2f}; {_tost_design(se, n, margin)}")
                rule = (f"TOST within +-{margin:.2g} ({MARGIN_SHARE:g} x the pre-RL edge): reproduces; interval "
                        f"above 0: does not; else inconclusive")
                extra.update(margin=margin, power=pw)
            rows.append(_row("E4 the edge does not survive RL", where, f"the same difference after RL; {tests}",
                             est, lo, hi, rule, verdict, **extra))
            fresh = FRESH[objective]
            if ("ood_accuracy_distil", fresh) not in wide:
                continue
            control_margin = margin or 0.0
            said = (f"{control_margin:.2g} ({MARGIN_SHARE:g} x the edge {edge:+.3f})" if margin else
                    f"0 (no positive edge: {edge:+.3f})")
            parts = {}
            for claim, a, b in (("E4 control: fresh teacher traces carry an OOD edge over the pool (data freshness)",
                                 fresh, off),
                                ("E4 control: on-policy sampling carries an OOD edge beyond fresh teacher data",
                                 on, fresh)):
                parts[a, b] = wide[("ood_accuracy_distil", a)] - wide[("ood_accuracy_distil", b)]
                est, lo, hi, se, n = task_clustered(parts[a, b], tasks_)
                df, mde = _t_tests(se, n)
                rows.append(_row(claim, where, f"{a} minus {b} OOD accuracy after distillation, mean of {n} task "
                                 f"means, 95% t-interval over tasks", est, lo, hi,
                                 f"interval above 0: reproduces; below +{said} throughout: does not; else "
                                 f"inconclusive",
                                 effect_verdict(lo, hi, 1, control_margin) if n > 1 else "inconclusive",
                                 margin=control_margin, df=df, mde_80=mde))
            rows.append(_share_row(parts[fresh, off], diff["distil"], tasks_, where, fresh, on, off))
    if not {"objective", "teacher_tokens", "student_tokens", "kl_arithmetic", "kl_local"} <= set(curves.columns):
        return pd.DataFrame(rows, columns=list(VERDICT_COLUMNS))                 # E4's curves only
    by_pool = {}                                   # E6 against each pool size: {pool: {objective: method}}
    for m in METHODS:
        if m.offline and m.method in set(curves.method):
            by_pool.setdefault(m.pool, {})[m.objective] = m.method
    prices = sorted(set(STUDENT_TOKEN_COSTS) | {float(student_token_cost)})
    for pool, references in sorted(by_pool.items()):
        for f in prices:
            rows += _e6_rows(e6_runs(curves, references, f), pool, f)
        rows += _reverse_rows(e6_runs(curves, references), pool)
    return pd.DataFrame(rows, columns=list(VERDICT_COLUMNS))


E6_TARGETS = (   # (claim, the offline arm's end point it names, the e6_runs column of the cost to reach it)
    ("E6 offline traces reach parity with on-policy distillation at a lower cost (final ID accuracy (within "
     f"{PARITY:g}))", f"final ID accuracy (within {PARITY:g})", "cost_to_offline_accuracy"),
    ("E6 on-policy distillation needs more tokens than the offline arm to reach the offline arm's final KL",
     "final KL to the target", "cost_to_offline_kl"),
)


def _e6_rows(runs, pool, f):
    """E6's rows at student-token price ``f``: the on-policy arms' cost to reach each end point of the
    offline arm of ``pool`` traces, over the offline arm's cost (:data:`E6_TARGETS`). Censored runs
    (never reached within the budget) count at their budget, a lower bound on their cost: the estimate is
    then 'at least' the median of the task means, with the sign test's 95% lower bound on the median (an
    order statistic, :func:`analysis.verdicts.median_lower_bound`, conservative under censoring; hi = inf),
    and may decide 'reproduces' only if some run reached it."""
    rows = []
    for (student, condition, method), g in runs.groupby(["student", "condition", "method"], sort=False):
        if method not in (on for on, _ in PAIRS.values()):
            continue
        for claim, target, column in E6_TARGETS:
            reached = g[column].notna()
            censored = int((~reached).sum())
            ratio = np.where(reached, g[column], g.cost) / g.offline_cost
            with np.errstate(divide="ignore"):
                log_ratio = np.log(ratio)
            est, lo, hi, se, n = task_clustered(log_ratio, g.task.to_numpy())
            df = n - 1 if n > 1 else np.nan
            where = f"{student}, {condition}, f = {f:g}, {method} against its offline arm ({pool:,} traces)"
            what = (f"on-policy cost (teacher tokens + {f:g} x student tokens) to reach the offline arm's {target} "
                    f"(interpolated log-linearly between checkpoints) over the offline arm's; reached in "
                    f"{int(reached.sum())} of {len(g)} runs")
            if column == "cost_to_offline_accuracy":
                what += (f"; final ID accuracy, mean over runs: offline arm {g.offline_id_accuracy.mean():.4f}, "
                         f"on-policy arm {g.id_accuracy.mean():.4f}")
            if n < 2 or not np.isfinite(se):
                said = ("; one task: no interval" if n < 2 else
                        "; a target reached at no cost makes a log ratio infinite: no interval")
                verdict, lo, hi = "inconclusive", np.nan, np.nan
            elif censored:
                means = pd.Series(log_ratio).groupby(g.task.to_numpy()).mean()
                est, hi = float(means.median()), np.inf
                lo, k, confidence = median_lower_bound(means)
                verdict = "reproduces" if lo > 0 and reached.any() else "inconclusive"
                never = "" if reached.any() else "; never reached: the verdict may not rest on censored runs alone"
                bound = (f"the {_ordinal(k)} smallest as a {confidence:.1%} lower bound on the median (sign test; "
                         f"a censored run's true cost can only raise it)" if k else
                         "too few for a 95% order-statistic lower bound on the median (>= 5 tasks)")
                said = (f" (the other {censored} at their budget, a lower bound on their cost: the estimate is at "
                        f"least the median shown{never}); median of {n} task means, {bound}")
            else:
                verdict = effect_verdict(lo, hi, 1, 0.0)
                said = f"; geometric mean of {n} task means, 95% t-interval over tasks"
            rule = ("ratio interval above 1 (on-policy costs more): reproduces; below 1: does not; else inconclusive; "
                    "censored runs: the sign test's 95% lower bound on the median task ratio (an order statistic: "
                    "conservative under censoring) above 1 decides (reproduces), with a run reached; else inconclusive")
            rows.append(_row(claim, where, ("at least: " if censored else "") + what + said, float(np.exp(est)),
                             float(np.exp(lo)), float(np.exp(hi)), rule, verdict, df=df, student_token_cost=f))
    return rows


def _ordinal(k):
    return {1: "1st", 2: "2nd", 3: "3rd"}.get(k, f"{k}th")


def _reverse_rows(runs, pool):
    """E6 the other way: does the offline arm of ``pool`` traces reach the on-policy arm's final KL at any
    checkpoint of its steps (its budget; its cost does not grow with steps)? Counted over runs; 'never' is a
    result (does not reproduce)."""
    rows = []
    for (student, condition, method), g in runs.groupby(["student", "condition", "method"], sort=False):
        if method not in (on for on, _ in PAIRS.values()):
            continue
        reached = g.offline_reaches_kl.to_numpy(dtype=float)
        verdict, met = count_verdict(reached, 0.5, at_most=False)
        share = reached.mean()
        rows.append(_row(
            "E6 the offline arm reaches the on-policy arm's final KL within its budget",
            f"{student}, {condition}, {method}'s offline arm ({pool:,} traces)",
            f"share of runs whose offline arm's KL falls to the on-policy arm's final KL at some checkpoint: {met} of "
            f"{len(g)} runs ({'never' if met == 0 else 'always' if met == len(g) else 'some'}); [min, max] over "
            f"tasks of the share", share, g.groupby("task").offline_reaches_kl.mean().min(),
            g.groupby("task").offline_reaches_kl.mean().max(),
            "every run reaches it: reproduces; none (never): does not; some: mixed", verdict))
    return rows


def crossing_cost(cost, value, threshold):
    """The cost at which ``value`` first falls to ``threshold`` or below (NaN if never): between the last
    checkpoint above it and the first at or below, value is taken linear in log cost (the checkpoints
    are log-spaced); at the first checkpoint's cost when the one before costs nothing."""
    cost, value = np.asarray(cost, dtype=float), np.asarray(value, dtype=float)
    hit = np.nonzero(value <= threshold)[0]
    if not hit.size:
        return float("nan")
    i = hit[0]
    if i == 0 or cost[i - 1] <= 0 or cost[i] <= cost[i - 1]:
        return float(cost[i])
    t = (value[i - 1] - threshold) / (value[i - 1] - value[i])
    return float(np.exp(np.log(cost[i - 1]) + t * (np.log(cost[i]) - np.log(cost[i - 1]))))


def _last_at_most(value, cost, budget):
    """The value at the last checkpoint whose cost is <= budget (NaN if even the first costs more)."""
    within = np.asarray(value)[np.asarray(cost) <= budget]
    return float(within[-1]) if within.size else float("nan")


def e6_runs(curves, references=None, student_token_cost=DEFAULT_STUDENT_TOKEN_COST):
    """One row per run of a distilled method: cost = teacher forward tokens + f x student generated tokens
    (f = ``student_token_cost``, the price of a generated student token in scored teacher tokens) at the
    end of distillation, the KL (per position, on the student's ID rollouts) to its objective's target, the
    ID accuracy; the KL at the reference offline method's cost (``references`` {objective: method}, default
    the pools of 1024 traces of PAIRS; its cost ``offline_cost``), the cost to reach the reference's final
    KL and its final ID accuracy (within PARITY) (:func:`crossing_cost`), and whether the reference reaches
    this run's final KL at some checkpoint (``offline_reaches_kl``) and its own final ID accuracy
    (``offline_id_accuracy``)."""
    if not (student_token_cost >= 0 and np.isfinite(student_token_cost)):
        raise ValueError(f"student_token_cost = {student_token_cost!r} must be a finite number >= 0")
    references = references or {obj: off for obj, (_, off) in PAIRS.items()}
    d = curves[(curves.stage == "distil") & curves.objective.isin(list(references))].copy()
    d["cost"] = d.teacher_tokens + student_token_cost * d.student_tokens
    d["kl_target"] = np.where(d.objective == "fkl", d.kl_arithmetic, d.kl_local)
    keys = ["student", "condition", "task", "seed"]
    per_run = []
    for (student, condition, task, seed), g in d.groupby(keys, sort=False):
        offline = {obj: g[g.method == off] for obj, off in references.items()}
        for method, run in g.groupby("method", sort=False):
            run = run.sort_values("step")
            end = run.iloc[-1]
            ref = offline[end.objective].sort_values("step")
            if ref.empty:                               # this student does not run that reference arm
                continue
            ref_end = ref.iloc[-1]
            ref_cost, ref_kl, ref_acc = float(ref_end.cost), float(ref_end.kl_target), float(ref_end.id_accuracy)
            row = dict(student=student, condition=condition, task=task, seed=seed, method=method,
                       objective=end.objective,
                       cost=end.cost, teacher_tokens=end.teacher_tokens, student_tokens=end.student_tokens,
                       kl_target=end.kl_target, id_accuracy=end.id_accuracy,
                       kl_at_offline_cost=_last_at_most(run.kl_target, run.cost, ref_cost),
                       cost_to_offline_kl=crossing_cost(run.cost, run.kl_target, ref_kl),
                       cost_to_offline_accuracy=crossing_cost(run.cost, -run.id_accuracy, -(ref_acc - PARITY)),
                       offline_cost=ref_cost, offline_reaches_kl=bool((ref.kl_target <= end.kl_target).any()),
                       offline_id_accuracy=ref_acc,
                       student_token_cost=float(student_token_cost))
            per_run.append(row)
    return pd.DataFrame(per_run)


def e6_table(curves, student_token_cost=DEFAULT_STUDENT_TOKEN_COST):
    """:func:`e6_runs` summarised per student, condition and method: means with intervals over (task,
    seed), and how many runs reached the offline arm's KL and ID accuracy."""
    per_run = e6_runs(curves, student_token_cost=student_token_cost)
    rows = []
    for (student, condition, method), g in per_run.groupby(["student", "condition", "method"], sort=False):
        row = dict(student=student, condition=condition, method=method, objective=g.objective.iloc[0], runs=len(g),
                   student_token_cost=float(student_token_cost))
        for col in ("cost", "teacher_tokens", "student_tokens", "kl_target", "id_accuracy", "kl_at_offline_cost",
                    "cost_to_offline_kl", "cost_to_offline_accuracy"):
            values = g[col].dropna()
            row[col], row[f"{col}_lo"], row[f"{col}_hi"] = _interval(values) if len(values) else (np.nan,) * 3
            if col == "cost_to_offline_kl":
                row["reached_offline_kl"] = f"{len(values)}/{len(g)}"
            if col == "cost_to_offline_accuracy":
                row["reached_offline_accuracy"] = f"{len(values)}/{len(g)}"
        rows.append(row)
    return pd.DataFrame(rows)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    size = sizes(SIZES, args.quick, args.full, seeds=args.seeds)
    cells = cells_for(size, args.only or EXPERIMENTS, args.base_seed)
    results = run_cells(cells, run_cell, args.out, resume=args.resume, executor=args.executor,
                        scheduler=args.scheduler, progress=not args.quiet, desc="rlvr")
    curves = pd.concat([r["curves"] for r in results], ignore_index=True)
    write_csv(os.path.join(args.out, "curves.csv"), curves)
    write_csv(os.path.join(args.out, "teachers.csv"), pd.concat([r["teachers"] for r in results], ignore_index=True))
    e4, e6 = e4_table(curves), e6_table(curves, args.student_token_cost)
    write_csv(os.path.join(args.out, "e4.csv"), e4)
    write_csv(os.path.join(args.out, "e6.csv"), e6)
    table = verdicts(curves, args.student_token_cost)
    if args.quick:                           # 2 tasks and 30 steps check the pipeline, not the claims
        table["verdict"] = QUICK
        if not args.quiet:
            print("a quick run checks the pipeline, not the claims: verdicts.csv decides nothing", file=sys.stderr)
    write_csv(os.path.join(args.out, "verdicts.csv"), table)
    if not args.quiet:
        print(e4[e4.comparison.str.contains(" - ")].to_string(index=False, float_format=lambda v: f"{v:.3f}"),
              file=sys.stderr)
        print(e6[["student", "condition", "method", "cost", "kl_target", "kl_at_offline_cost", "cost_to_offline_kl",
                  "reached_offline_kl"]].to_string(index=False, float_format=lambda v: f"{v:.4g}"), file=sys.stderr)
    if not args.no_figures:
        import figures
        figures.rebuild(args.out, fig_dir=args.figures, quiet=args.quiet)
    print(f"results in {os.path.abspath(args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from sims.rlvr import main as _main
    sys.exit(_main())
