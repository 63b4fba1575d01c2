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

import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import analysis  # noqa: E402
from analysis.verdicts import COLUMNS, effect_verdict, mde_80, power, tost, verdict_row  # noqa: E402
from harness import Cell, experiment_parser, run_cells, sizes, write_csv  # noqa: E402
from distillation import evaluation, tasks, verifiable  # noqa: E402
from distillation.configs import Method  # noqa: E402
from distillation.students import goal_students  # noqa: E402

EXPERIMENTS = ("shared", "unshared")              # the conditions
DEFAULT_OUT = os.path.join("results", "rlvr")

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
EQUIVALENCE_MARGIN = 0.01                    # E4: an OOD-accuracy difference within +-1 point is "no edge" (TOST)
PARITY = 0.001                               # E6: "reached the offline arm's ID accuracy" = within 0.001 of it
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


def verdicts(curves):
    """verdicts.csv of E4 and E6 by stated rules, per student, feature condition and objective, the runs
    clustered by task: 'an on-policy edge exists after distillation' (the t-interval over task means of
    on-policy minus offline OOD accuracy above 0: reproduces; below the margin throughout: does not;
    else inconclusive) and 'the edge does not survive RL' (TOST within +-EQUIVALENCE_MARGIN: reproduces;
    interval after RL above 0: does not reproduce; otherwise inconclusive, with the smallest effect the
    design detects at 80% power and its power to see the edge measured before RL); E6 'offline traces
    reach parity at a lower cost': the on-policy arm's tokens to reach the offline arm's final ID accuracy
    (and KL) over the offline arm's tokens, above 1 throughout the t-interval over task means: reproduces."""
    ends = stage_ends(curves)
    rows = []
    for (student, condition), g in ends.groupby(["student", "condition"], sort=False):
        wide = g.set_index(["task", "seed", "method"]).unstack("method")
        tasks_ = wide.index.get_level_values("task")
        for objective, (on, off) in PAIRS.items():
            if ("ood_accuracy_distil", on) not in wide or ("ood_accuracy_distil", off) not in wide:
                continue
            where = f"{student}, {condition}, {objective.upper()}"
            diff = {stage: wide[(f"ood_accuracy_{stage}", on)] - wide[(f"ood_accuracy_{stage}", off)]
                    for stage in ("distil", "rl")}
            est, lo, hi, se, n = task_clustered(diff["distil"], tasks_)
            rows.append(verdict_row("E4 an on-policy edge in OOD accuracy exists after distillation", where,
                                    f"on-policy minus offline OOD accuracy, mean of {n} task means, 95% t-interval over tasks",
                                    est, lo, hi, "interval above 0: reproduces; below +margin throughout: does not; "
                                    "else inconclusive", effect_verdict(lo, hi, 1, EQUIVALENCE_MARGIN)))
            edge = est
            est, lo, hi, se, n = task_clustered(diff["rl"], tasks_)
            if n < 2:                                  # one task: no between-task spread to test against
                verdict, tests = "inconclusive", "one task: no task-level interval, power or TOST"
            else:
                p, equivalent = tost(est, max(se, 1e-12), EQUIVALENCE_MARGIN, df=n - 1)
                verdict = ("reproduces" if equivalent else "does not reproduce" if lo > 0 else "inconclusive")
                tests = (f"TOST p = {p:.2g} (margin {EQUIVALENCE_MARGIN:g}); smallest effect detectable at 80% power "
                         f"{mde_80(se):.3f}; power to see the pre-RL edge ({edge:+.3f}) {power(edge, max(se, 1e-12)):.2f}")
            rows.append(verdict_row(
                "E4 the edge does not survive RL", where, f"the same difference after RL; {tests}", est, lo, hi,
                f"TOST within +-{EQUIVALENCE_MARGIN:g}: reproduces; interval above 0: does not; else inconclusive",
                verdict))
            fresh = FRESH[objective]
            if ("ood_accuracy_distil", fresh) not in wide:
                continue
            for claim, a, b in (("E4 control: fresh teacher traces carry an OOD edge over the pool (data freshness)",
                                 fresh, off),
                                ("E4 control: on-policy sampling carries an OOD edge beyond fresh teacher data",
                                 on, fresh)):
                est, lo, hi, _, n = task_clustered(wide[("ood_accuracy_distil", a)] - wide[("ood_accuracy_distil", b)],
                                                   tasks_)
                rows.append(verdict_row(claim, where, f"{a} minus {b} OOD accuracy after distillation, mean of {n} "
                                        f"task means, 95% t-interval over tasks", est, lo, hi,
                                        "interval above 0: reproduces; below +margin throughout: does not; else "
                                        "inconclusive", effect_verdict(lo, hi, 1, EQUIVALENCE_MARGIN)))
    if not {"objective", "teacher_tokens", "student_tokens", "kl_arithmetic", "kl_local"} <= set(curves.columns):
        return pd.DataFrame(rows, columns=list(COLUMNS))                 # E4's curves only
    by_pool = {}                                   # E6 against each pool size: {pool: {objective: method}}
    for m in METHODS:
        if m.offline and m.method in set(curves.method):
            by_pool.setdefault(m.pool, {})[m.objective] = m.method
    for pool, references in sorted(by_pool.items()):
        rows += _e6_rows(e6_runs(curves, references), pool)
    return pd.DataFrame(rows, columns=list(COLUMNS))


def _e6_rows(runs, pool):
    """E6's verdict rows: the on-policy arms' cost to parity against the offline arms of ``pool`` traces."""
    rows = []
    for (student, condition, method), g in runs.groupby(["student", "condition", "method"], sort=False):
        if method not in (on for on, _ in PAIRS.values()):
            continue
        for target, column in (("final ID accuracy (within 0.001)", "cost_to_offline_accuracy"),
                               ("final KL to the target", "cost_to_offline_kl")):
            reached = g[column].notna()
            # a run that never reaches it within the budget counts at its whole budget: a lower bound
            ratio = np.where(reached, g[column], g.cost) / g.offline_cost
            est, lo, hi, _, n = task_clustered(np.log(ratio), g.task.to_numpy())
            rows.append(verdict_row(
                f"E6 offline traces reach parity with on-policy distillation at a lower cost ({target})",
                f"{student}, {condition}, {method} against its offline arm ({pool:,} traces)",
                f"on-policy tokens to reach the offline arm's {target} over the offline arm's tokens; reached in "
                f"{int(reached.sum())} of {len(g)} runs (the others at their whole budget, a lower bound); "
                f"geometric mean of {n} task means, 95% t-interval over tasks", float(np.exp(est)), float(np.exp(lo)),
                float(np.exp(hi)),
                "ratio interval above 1 (on-policy costs more): reproduces; below 1: does not; else inconclusive",
                effect_verdict(lo, hi, 1, 0.0)))
    return rows


def _first_at_most(cost, value, threshold):
    """The cost at the first checkpoint where value <= threshold (NaN if never)."""
    hit = np.nonzero(np.asarray(value) <= threshold)[0]
    return float(np.asarray(cost)[hit[0]]) if hit.size else float("nan")


def _last_at_most(value, cost, budget):
    """The value at the last checkpoint whose cost is <= budget (NaN if even the first costs more)."""
    within = np.asarray(value)[np.asarray(cost) <= budget]
    return float(within[-1]) if within.size else float("nan")


def e6_runs(curves, references=None):
    """One row per run of a distilled method: cost = teacher forward tokens + student generated tokens at
    the end of distillation, the KL (per position, on the student's ID rollouts) to its objective's
    target, the ID accuracy; the KL at the reference offline method's cost (``references`` {objective:
    method}, default the pools of 1024 traces of PAIRS; its cost ``offline_cost``), the cost to reach the
    reference's final KL and the cost to reach its final ID accuracy (within PARITY)."""
    references = references or {obj: off for obj, (_, off) in PAIRS.items()}
    d = curves[(curves.stage == "distil") & curves.objective.isin(list(references))].copy()
    d["cost"] = d.teacher_tokens + d.student_tokens
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
            ref_cost, ref_kl, ref_acc = float(ref.cost.iloc[-1]), float(ref.kl_target.iloc[-1]), float(ref.id_accuracy.iloc[-1])
            row = dict(student=student, condition=condition, task=task, seed=seed, method=method,
                       objective=end.objective,
                       cost=end.cost, teacher_tokens=end.teacher_tokens, student_tokens=end.student_tokens,
                       kl_target=end.kl_target, id_accuracy=end.id_accuracy,
                       kl_at_offline_cost=_last_at_most(run.kl_target, run.cost, ref_cost),
                       cost_to_offline_kl=_first_at_most(run.cost, run.kl_target, ref_kl),
                       cost_to_offline_accuracy=_first_at_most(run.cost, -run.id_accuracy, -(ref_acc - PARITY)),
                       offline_cost=ref_cost)
            per_run.append(row)
    return pd.DataFrame(per_run)


def e6_table(curves):
    """:func:`e6_runs` summarised per student, condition and method: means with intervals over (task,
    seed), and how many runs reached the offline arm's KL and ID accuracy."""
    per_run = e6_runs(curves)
    rows = []
    for (student, condition, method), g in per_run.groupby(["student", "condition", "method"], sort=False):
        row = dict(student=student, condition=condition, method=method, objective=g.objective.iloc[0], runs=len(g))
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
    ap = experiment_parser("rlvr.py", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS, full=True)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    size = sizes(SIZES, args.quick, args.full, seeds=args.seeds)
    cells = cells_for(size, args.only or EXPERIMENTS, args.base_seed)
    results = run_cells(cells, run_cell, args.out, resume=args.resume, executor=args.executor,
                        scheduler=args.scheduler, progress=not args.quiet, desc="rlvr")
    curves = pd.concat([r["curves"] for r in results], ignore_index=True)
    write_csv(os.path.join(args.out, "curves.csv"), curves)
    write_csv(os.path.join(args.out, "teachers.csv"), pd.concat([r["teachers"] for r in results], ignore_index=True))
    e4, e6 = e4_table(curves), e6_table(curves)
    write_csv(os.path.join(args.out, "e4.csv"), e4)
    write_csv(os.path.join(args.out, "e6.csv"), e6)
    write_csv(os.path.join(args.out, "verdicts.csv"), verdicts(curves))
    if not args.quiet:
        print(e4[e4.comparison.str.contains(" - ")].to_string(index=False, float_format=lambda v: f"{v:.3f}"),
              file=sys.stderr)
        print(e6[["student", "condition", "method", "cost", "kl_target", "kl_at_offline_cost", "cost_to_offline_kl",
                  "reached_offline_kl"]].to_string(index=False, float_format=lambda v: f"{v:.4g}"), file=sys.stderr)
    if not args.no_figures:
        import figures
        figures.rebuild(args.out, fig_dir=args.figures, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    from sims.rlvr import main as _main
    sys.exit(_main())
