"""The rollout spectrum, KL direction and robustness (claims E1, E2, E5) with exact finite-state teachers.

    python sims/rollout_spectrum.py            # the default sweep, about 6.5 min on 2 cores
    python sims/rollout_spectrum.py --quick    # seconds (the tests run this)

Training sequences come from the student with probability alpha and from a teacher k ~ w otherwise
(and a switch-point variant: teacher prefix, student suffix). Objectives (distillation.fixed_points): FKL and RKL
with the teachers' full conditionals, SFT on a sampled teacher token, k1/k2/k3 on the sampled token as
losses (pooled before the estimator, and k3 routed to one teacher), the RKL policy gradient with
gamma = 0 and 1; with and without importance weights where the samples are not the student's;
gradient clipping on and off; K = 1 and K = 2 teachers. Students: a tabular softmax (every run of a
cell in one tensor) and a tiny Qwen2 reading the token prefix, the same loss code and optimiser.

Writes to ``--out`` (default results/rollout_spectrum):
  spectrum.csv     tabular students: config, seed, step, loss, the exact KL_seq(q || P) on the student's
                   own rollouts for every target P (kl_arithmetic, kl_local, kl_geometric, kl_mixture,
                   kl_sft for SFT), kl_named (the objective's own target), accuracy, diverged
  neural.csv       the same for the shared-parameter student (tiny Qwen2)
  robustness.csv   tabular students on a looping machine, H = 16 .. 256, clipping off and on (E5)
  sft_theory.csv   the SFT fixed point against alpha: its KL to A and to the mixture's conditionals
  tasks.csv        E1 and E2 over 8 task draws (column task_seed): the tabular student on the K = 2
                   configurations of TASKS, SFT with one teacher, FKL with a capacity-limited log-linear
                   student (column student: tabular, capacity, exact for SFT's exact fixed points)
  convergence.csv  E5 over the same task draws: k2, k3, pg0 on weighted teacher samples (the weights
                   whole, and truncated at 1 and 10 with the share of steps and tokens where that binds:
                   truncated_steps, truncated_tokens) and on their own samples on the looping machine
                   (H = 16) over 1000 steps, with the importance weights' exact second moments at l (per
                   token and per sequence)
  verdicts.csv     each claim of E1, E2 and E5 per condition: the statistic's median and range over the
                   decidable task draws, how many draws decide and hold, the stated condition, the rule,
                   the verdict and the verdict at half and twice the tolerance (``verdicts``); a --quick
                   run decides nothing
  verdict_draws.csv  the per-draw table behind it: one row per claim x task draw (value, separation of
                   the candidate targets, seed noise, decidable, held)
  summary.csv      per configuration (and per task draw for 'convergence'): final KL per position,
                   accuracy, share diverged, steps_to_tol (the first evaluation within TOL; NaN if never)
  conclusions.csv  each conclusion of the study under each condition, with the numbers and a verdict
  figures/         spectrum.png, spectrum_neural.png
"""

import functools
import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import experiment_parser  # noqa: E402  (argparse only)

EXPERIMENTS = ("tabular", "neural", "robustness", "theory", "tasks", "convergence")
DEFAULT_OUT = os.path.join("results", "rollout_spectrum")


def parse_args(argv):
    ap = experiment_parser("rollout_spectrum.py", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS)
    return ap.parse_args(argv)


if __name__ == "__main__":      # --help and a bad argument answer here, before numba, torch and pandas load
    parse_args(sys.argv[1:])


import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from scipy.special import logsumexp  # noqa: E402

from harness import Cell, run_cells, sizes, write_csv  # noqa: E402
import aggregation as ag  # noqa: E402
from analysis import mean_interval  # noqa: E402
from analysis.verdicts import DRAW_COLUMNS, MIN_DECIDABLE, MULTIPLE, QUICK, draw_row, effect_verdict  # noqa: E402
from distillation import evaluation, fixed_points, moments, tasks, training  # noqa: E402
from distillation.configs import SpectrumConfig  # noqa: E402
from distillation.students import LogLinearStudents, TabularStudents, TokenStudents  # noqa: E402


# ------------------------------------------------------------------------------------------------
# the settings (data, not code)
# ------------------------------------------------------------------------------------------------
SIZES = {                                   # full run / --quick
    "seeds": (2, 1),
    "tabular_steps": (300, 60),
    "neural_steps": (200, 20),
    "robust_steps": (200, 40),
    "neural_seeds": (5, 2),                 # trained together (vmap)
    "neural_draws": (4, 2),                 # the first task draws of 'tasks', for the shared-parameter student
    "task_draws": (8, 2),                   # E1, E2, E5 over task draws (the 'tasks' and 'convergence' experiments)
    "task_seeds": (3, 2),                   # seeds per task draw: the seed-to-seed noise each draw's verdict checks
    "robust_draws": (4, 1),                 # loop tasks of the robustness axis
    "convergence_steps": (1000, 100),
}
ALPHAS = tuple(np.round(np.linspace(0, 1, 11), 2))
QUICK_ALPHAS = (0.0, 0.5, 1.0)
ESTIMATORS = ("k1", "k2", "k3", "k3-teacher", "pg0", "pg1")         # the ones importance weights change
TABULAR_CELLS = ({"K": 2, "clip": False}, {"K": 2, "clip": True}, {"K": 1, "clip": False})
NEURAL = {"objectives": ("fkl", "sft", "rkl", "k3", "pg1"), "alphas": (0.0, 0.5, 1.0)}
ROBUST = {"horizons": (16, 64, 256), "objectives": ("fkl", "rkl", "k2", "k3", "pg0"), "alphas": (0.0, 0.5, 1.0)}
TASKS = {                                   # per task draw (K = 2): objective -> alphas; the weighted ones at alpha 0
    "objectives": {"fkl": (0.0, 0.5, 1.0), "rkl": (0.0, 1.0), "sft": (0.0, 0.5, 1.0), "k1": (0.0, 1.0),
                   "k2": (0.0, 1.0), "k3": (0.0, 1.0), "pg0": (0.0, 1.0)},
    "weighted": ("k2", "k3", "pg0"),
    "one_teacher_sft": (0.0, 1.0),           # the K = 1 control
    "capacity_features": 4,                  # the capacity-limited student: log-linear on 4 shared features
    "capacity_alphas": (0.0, 0.5, 1.0),
}
CONVERGENCE = {"H": 16, "estimators": ("k2", "k3", "pg0"), "evaluations": 20,    # E5: weighted teacher samples, long traces
               "truncate": (1.0, 10.0)}      # truncated weights (1: V-trace's rho-bar), a clip that binds
BATCH, LR, NEURAL_LR = 64, 0.05, 3e-3
SUMMARY_KEYS = (("tabular", ("K", "clip")), ("neural", ("K",)), ("robustness", ("task_seed", "H", "clip")),
                ("convergence", ("task_seed", "H", "truncate")))
TOL = 0.01                                   # nats per position (KL_seq / H): "reached its target"


def spectrum_configs(alphas, objectives=fixed_points.OBJECTIVES, clip=False, switch=True):
    """Every (objective, alpha, importance) of a tabular cell, plus the switch-point variant."""
    out = []
    for obj in objectives:
        for imp in ((False, True) if obj in ESTIMATORS else (False,)):
            for a in alphas:
                if imp and a == 1.0:
                    continue                      # student samples: importance weights are all 1
                out.append(SpectrumConfig(obj, float(a), importance=imp, clip=clip))
            if switch:
                out.append(SpectrumConfig(obj, float("nan"), switch=True, importance=imp, clip=clip))
    return out


def cells_for(size, quick, only, base_seed=0):
    alphas = QUICK_ALPHAS if quick else ALPHAS
    seeds = list(range(size["seeds"]))
    out = []
    if "theory" in only:
        out.append(Cell("theory", "theory", {"alphas": list(ALPHAS)}, base_seed=base_seed))
    if "tabular" in only:
        for c in TABULAR_CELLS[:1] if quick else TABULAR_CELLS:
            settings = dict(c, alphas=list(alphas), seeds=seeds, steps=size["tabular_steps"])
            out.append(Cell("tabular", "tabular", settings,
                            base_seed=base_seed, stream=("tabular", c["K"], c["clip"])))
    if "neural" in only:                    # on task draws of 'tasks' (the same trees, so the same separations)
        objectives = NEURAL["objectives"][:2] if quick else NEURAL["objectives"]
        for t in range(size["neural_draws"]):
            for obj in objectives:
                for a in (QUICK_ALPHAS[::2] if quick else NEURAL["alphas"]):
                    out.append(Cell("neural", "neural", dict(objective=obj, alpha=a, K=2, steps=size["neural_steps"],
                                                             task_seed=base_seed + t,
                                                             seeds=list(range(size["neural_seeds"]))),
                                    base_seed=base_seed, stream=("neural", t, obj, a)))
    task_seeds = list(range(size["task_seeds"]))
    if "tasks" in only:
        for t in range(size["task_draws"]):
            out.append(Cell("tasks", "tasks", dict(task_seed=base_seed + t, seeds=task_seeds, steps=size["tabular_steps"]),
                            seeds=3, base_seed=base_seed, stream=("tasks", t)))
    if "convergence" in only:
        for t in range(size["task_draws"]):
            out.append(Cell("convergence", "convergence", dict(task_seed=base_seed + t, H=CONVERGENCE["H"],
                                                               seeds=task_seeds, steps=size["convergence_steps"]),
                            seeds=3, base_seed=base_seed, stream=("convergence", t)))
    if "robustness" in only:
        for t in range(size["robust_draws"]):
            for H in ROBUST["horizons"][:1] if quick else ROBUST["horizons"]:
                for clip in (False, True):
                    out.append(Cell("robustness", "robustness", dict(task_seed=base_seed + t, H=H, clip=clip,
                                                                     steps=size["robust_steps"], seeds=task_seeds),
                                    base_seed=base_seed, stream=("robustness", t, H, clip)))
    return out


# ------------------------------------------------------------------------------------------------
# one function per kind of cell
# ------------------------------------------------------------------------------------------------
def run_theory(cell):
    task = tasks.make_task("tree", K=2, seed=cell.base_seed)
    A, mix = fixed_points.target_table(task, "arithmetic"), fixed_points.target_table(task, "mixture")
    rows = []
    for a in cell["alphas"]:
        sft = fixed_points.target_table(task, "sft", a)
        for name, ref in (("arithmetic", A), ("mixture", mix)):
            rows.append(dict(alpha=a, reference=name,
                             kl=ag.sequence_kl(task.teachers, task.weights, task.horizon, sft, target=ref)))
    return pd.DataFrame(rows)


def train_tabular(task, configs, seeds, steps, seed, batch=BATCH, eval_every=None, fixed_points=True):
    """Tabular students for configs x seeds, one generator (seeded ``seed``) for their start and rollouts."""
    gen = torch.Generator().manual_seed(seed)
    students = TabularStudents(task, len(configs) * len(seeds), gen, lr=LR)
    return training.train(task, configs, seeds, students, steps=steps, batch=batch,
                          eval_every=eval_every or max(steps // 6, 1), gen=gen, fixed_points=fixed_points)


def run_tabular(cell):
    task = tasks.make_task("tree", K=cell["K"], seed=cell.base_seed)
    configs = spectrum_configs(cell["alphas"], clip=cell["clip"])
    df = train_tabular(task, configs, cell["seeds"], cell["steps"], cell.base_seed)
    return df.assign(K=cell["K"], task=task.name, horizon=task.horizon)


def run_tasks(cell):
    """E1 and E2 on one task draw: the tabular student on the K = 2 configurations of TASKS, SFT with one
    teacher (K = 1), FKL with a capacity-limited log-linear student (4 Gaussian features shared by every
    state, so it cannot represent every state's conditionals), and SFT's exact fixed points."""
    t, seeds, steps = cell["task_seed"], cell["seeds"], cell["steps"]
    stream = [int(x) for x in cell.seed_array()]
    task, one = tasks.make_task("tree", K=2, seed=t), tasks.make_task("tree", K=1, seed=t)
    configs = [SpectrumConfig(o, a) for o, alphas in TASKS["objectives"].items() for a in alphas]
    configs += [SpectrumConfig(o, 0.0, importance=True) for o in TASKS["weighted"]]
    frames = [train_tabular(task, configs, seeds, steps, stream[0], eval_every=steps).assign(student="tabular", K=2),
              train_tabular(one, [SpectrumConfig("sft", a) for a in TASKS["one_teacher_sft"]], seeds, steps, stream[1],
                            eval_every=steps).assign(student="tabular", K=1)]
    capacity = [SpectrumConfig("fkl", a) for a in TASKS["capacity_alphas"]]
    features = np.random.default_rng(10_000 + t).standard_normal((task.teachers.S, TASKS["capacity_features"]))
    students = LogLinearStudents(features, task.teachers.n, [s for _ in capacity for s in seeds], lr=LR)
    frames.append(training.train(task, capacity, seeds, students, steps=steps, batch=BATCH, eval_every=steps,
                                 gen=torch.Generator().manual_seed(stream[2])).assign(student="capacity", K=2))
    evaluate = evaluation.Evaluator(task)
    for a in TASKS["objectives"]["sft"]:                 # SFT's exact fixed point at each alpha (no training)
        out = evaluate(fixed_points.sft_fixed_point(task, a), SpectrumConfig("sft", a))
        frames.append(pd.DataFrame([dict(SpectrumConfig("sft", a).as_dict(), seed=-1, step=steps, **out,
                                         student="exact", K=2)]))
    df = pd.concat(frames, ignore_index=True).assign(task_seed=t, horizon=task.horizon)
    return with_separations(df, evaluate, configs)


def with_separations(df, evaluate, configs):
    """``df`` with how far apart the candidate targets of its task draw are (per position,
    ``Evaluator.separation``: the smaller KL_seq of the two directions over H): sep_A_mixture between A and
    the sequence-level mixture's conditionals (the candidates of the FKL and SFT claims), sep_l between l
    and the nearest of A, g and the mixture (of 'reaches l'), and per configuration sep_fp_l between its
    derived fixed point and l (NaN where none is derived; NaN with fp_solved False where the solver does
    not converge: reported, never a silent value)."""
    tab, H = evaluate.tables, evaluate.task.horizon
    sep = {"sep_A_mixture": evaluate.separation(tab["arithmetic"], tab["mixture"]) / H,
           "sep_l": min(evaluate.separation(tab["local"], tab[n]) for n in ("arithmetic", "geometric", "mixture")) / H}
    fp, solved = {}, {}
    for c in configs:
        key = (c.objective, float(c.alpha), c.importance)
        try:
            table, solved[key] = evaluate.fixed_point(c), True
        except RuntimeError:
            table, solved[key] = None, False
        fp[key] = np.nan if table is None else evaluate.separation(table, tab["local"]) / H
    keys = list(zip(df.objective, df.alpha.astype(float), df.importance))
    return df.assign(**sep, sep_fp_l=[fp.get(k, np.nan) for k in keys], fp_solved=[solved.get(k, True) for k in keys])


def run_neural(cell):
    """The shared-parameter student (a tiny Qwen2 per seed, trained together) on one task draw's tree."""
    task = tasks.make_task("tree", K=cell["K"], seed=cell["task_seed"])
    config = SpectrumConfig(cell["objective"], cell["alpha"], clip=True)
    students = TokenStudents(task, cell["seeds"], vocab=task.teachers.n + 1, bos=task.teachers.n, lr=NEURAL_LR)
    df = training.train(task, [config], cell["seeds"], students, steps=cell["steps"], batch=BATCH,
                        eval_every=max(cell["steps"] // 4, 1), gen=torch.Generator().manual_seed(int(cell.seed_array()[0])))
    return df.assign(K=cell["K"], task=task.name, horizon=task.horizon, task_seed=cell["task_seed"], student="neural")


def weight_moments(task):
    """The importance weights' second moments at the target l on a task, max over its teachers k: per
    token (k2, k3 weight each token by q / p_k: ln E_{p_k}[(l / p_k)^2], the largest over states) and per
    sequence (the policy gradients weight by the product over the response: ln E_{p_k}[w^2] / H, and its
    growth per token over the second half of the horizon, (ln E[w^2](H) - ln E[w^2](H / 2)) / (H / 2): a
    slope that stays positive is exponential growth, a polynomial one's falls like 1 / H)."""
    t, H = task.teachers, task.horizon
    local = fixed_points.target_table(task, "local")[0]
    lp = np.asarray(t.log_probs)
    token = max(float(logsumexp(2 * local - lp[k], axis=-1).max()) for k in range(t.K))
    seq = [moments.sequence_is_second_moment(np.asarray(t.next_state), t.start, H, local, lp[k]) for k in range(t.K)]
    half = H // 2
    return dict(log_w2_token=token, log_w2_sequence_per_token=max(float(m[H]) for m in seq) / H,
                log_w2_sequence_slope=max(float(m[H] - m[half]) for m in seq) / (H - half))


def run_convergence(cell):
    """E5 on one task draw of the looping machine (H = 16): k2, k3 and pg0 on weighted teacher samples
    (alpha = 0), on the same with the weights truncated at each CONVERGENCE['truncate'] (its own random
    stream, with the share of steps and tokens where the truncation binds) and on their own samples
    (alpha = 1), evaluated CONVERGENCE['evaluations'] times over a long budget (steps to the tolerance),
    beside the weights' exact second moments at l; pg0 on unweighted teacher samples (its own stream: no
    fixed point is derived for it, so its distance from l is measured) and the solved unweighted fixed
    points' separation from l for k2, k3 (sep_unweighted_k2, sep_unweighted_k3)."""
    task = tasks.make_task("loop", K=2, seed=cell["task_seed"], horizon=cell["H"])
    configs = [SpectrumConfig(e, 0.0, importance=True) for e in CONVERGENCE["estimators"]]
    configs += [SpectrumConfig(e, 1.0) for e in CONVERGENCE["estimators"]]
    cut = [SpectrumConfig(e, 0.0, importance=True, truncate=c) for c in CONVERGENCE["truncate"]
           for e in CONVERGENCE["estimators"]]
    plain = [SpectrumConfig("pg0", 0.0)]                 # no derived fixed point: its distance from l is measured
    steps, stream = cell["steps"], [int(x) for x in cell.seed_array()]
    every = max(steps // CONVERGENCE["evaluations"], 1)
    df = pd.concat([train_tabular(task, c, cell["seeds"], steps, seed, batch=16, eval_every=every, fixed_points=False)
                    for c, seed in ((configs, stream[0]), (cut, stream[1]), (plain, stream[2]))], ignore_index=True)
    evaluate, local = evaluation.Evaluator(task), fixed_points.target_table(task, "local")
    for e in CONVERGENCE["estimators"]:                  # the unweighted fixed points' separation from l (solved)
        if e != "pg0":
            df[f"sep_unweighted_{e}"] = evaluate.separation(evaluate.fixed_point(SpectrumConfig(e, 0.0)), local) / task.horizon
    return df.assign(task_seed=cell["task_seed"], H=cell["H"], horizon=task.horizon, **weight_moments(task))


def run_robustness(cell):
    task = tasks.make_task("loop", K=2, seed=cell["task_seed"], horizon=cell["H"])
    configs = spectrum_configs(ROBUST["alphas"], ROBUST["objectives"], clip=cell["clip"], switch=False)
    df = train_tabular(task, configs, cell["seeds"], cell["steps"], int(cell.seed_array()[0]), batch=16,
                       eval_every=cell["steps"], fixed_points=False)
    return df.assign(K=2, H=cell["H"], task=task.name, horizon=task.horizon, task_seed=cell["task_seed"])


RUNNERS = {"theory": run_theory, "tabular": run_tabular, "neural": run_neural, "robustness": run_robustness,
           "tasks": run_tasks, "convergence": run_convergence}


def run_cell(cell):
    return RUNNERS[cell.kind](cell)


# ------------------------------------------------------------------------------------------------
# outputs
# ------------------------------------------------------------------------------------------------
def final(df):
    return df[df.step == df.groupby(["objective", "alpha", "switch", "importance", "seed"], dropna=False).step
              .transform("max")]


def summary(df, by):
    """Per configuration (mean over seeds): the final KL to the named target and to the derived fixed point
    per position, accuracy, the
    share of diverged runs, and steps to reach TOL (the first evaluation at or under it; NaN if never)."""
    keys = list(by) + ["objective", "alpha", "switch", "importance"]
    df = df.assign(kl_per_position=df.kl_named / df.horizon, fixed_point_per_position=df.kl_fixed_point / df.horizon)
    trace = df.groupby(keys + ["step"], dropna=False).agg(kl_per_position=("kl_per_position", "mean"),
                                                          fixed_point_per_position=("fixed_point_per_position", "mean"),
                                                          accuracy=("accuracy", "mean"),
                                                          diverged=("diverged", "mean")).reset_index()
    rows = []
    for key, grp in trace.groupby(keys, dropna=False):
        grp = grp.sort_values("step")
        reached = grp.step[grp.kl_per_position <= TOL]
        last = grp.iloc[-1]
        rows.append(dict(zip(keys, key), kl_per_position=last.kl_per_position,
                         fixed_point_per_position=last.fixed_point_per_position, accuracy=last.accuracy,
                         diverged_share=last.diverged, steps=int(last.step),
                         steps_to_tol=float(reached.iloc[0]) if len(reached) else np.nan))
    return pd.DataFrame(rows)


def conclusions(tab, robust):
    """Each conclusion under each condition: (condition, conclusion, holds, evidence)."""
    rows = []
    conditions = []
    for (K, clip), grp in tab.groupby(["K", "clip"]):
        conditions.append((f"tree, K={K}, clipping {'on' if clip else 'off'}", K, final(grp)))
    for (H, clip, t), grp in robust.groupby(["H", "clip", "task_seed"]):
        conditions.append((f"loop draw {t}, H={H}, clipping {'on' if clip else 'off'}", 2, final(grp)))
    for name, K, f in conditions:
        f = f.assign(kl_named=f.kl_named / f.horizon)           # per position, comparable across horizons
        plain = f[~f.switch & ~f.importance]
        mean = plain.groupby(["objective", "alpha"]).kl_named.mean()

        def at(obj, a):
            return float(mean.get((obj, a), np.nan))
        for obj, label in (("fkl", "E1: FKL with full conditionals reaches A at every alpha (flat)"),
                           ("rkl", "RKL with full conditionals reaches l at every alpha (flat)")):
            vals = mean[obj].to_numpy() if obj in mean.index.get_level_values(0) else np.array([np.nan])
            rows.append(dict(condition=name, conclusion=label, holds=bool(np.nanmax(vals) < TOL),
                             evidence=f"max over alpha of KL to its target {np.nanmax(vals):.3g} nats per position "
                                      f"(tolerance {TOL})"))
        for obj in ("k2", "k3", "pg0"):
            if obj not in mean.index.get_level_values(0):
                continue
            student, teacher = at(obj, 1.0), at(obj, 0.0)
            if K == 1:                              # control: one teacher is l, its samples are on target
                rows.append(dict(condition=name, conclusion=f"control: with one teacher {obj} reaches l on the "
                                                            f"teacher's own samples too (they are l's samples)",
                                 holds=bool(max(student, teacher) < TOL),
                                 evidence=f"KL to l: {student:.3g} at alpha = 1, {teacher:.3g} at alpha = 0"))
                continue
            rows.append(dict(condition=name, conclusion=f"E2: {obj} needs student rollouts (reaches l at alpha = 1, "
                                                          f"not on teacher samples without importance weights)",
                             holds=bool(student < TOL <= teacher),
                             evidence=f"KL to l: {student:.3g} at alpha = 1, {teacher:.3g} at alpha = 0"))
            with_is = f[f.importance & (f.objective == obj) & (f.alpha == 0.0)].kl_named.mean()
            if np.isfinite(with_is):
                rows.append(dict(condition=name, conclusion=f"importance weights restore {obj} on teacher samples",
                                 holds=bool(with_is < TOL),
                                 evidence=f"KL to l at alpha = 0 with weights {with_is:.3g}"))
        if "sft" in mean.index.get_level_values(0):
            sft = f[~f.switch & (f.objective == "sft")].assign(kl_arithmetic=lambda d: d.kl_arithmetic / d.horizon)
            to_a = sft.groupby("alpha").kl_arithmetic.mean()
            rows.append(dict(condition=name, conclusion="SFT reaches its own alpha-dependent fixed point",
                             holds=bool(mean["sft"].max() < TOL),
                             evidence=f"max over alpha of KL to SFT(alpha) {mean['sft'].max():.3g}"))
            rows.append(dict(condition=name, conclusion="E1 for SFT: its distance to A is flat in alpha",
                             holds=bool(to_a.max() - to_a.min() < TOL),
                             evidence=f"KL to A {to_a.iloc[0]:.3g} at alpha = 0, {to_a.iloc[-1]:.3g} at alpha = 1"))
        if "kl_fixed_point" in f and f.kl_fixed_point.notna().any():
            fp = (f[f.kl_fixed_point.notna()].assign(kl_fixed_point=lambda d: d.kl_fixed_point / d.horizon)
                  .groupby(["objective", "alpha", "importance"]).kl_fixed_point.mean())
            worst = fp.idxmax()
            rows.append(dict(condition=name, conclusion="every configuration with a derived fixed point reaches it",
                             holds=bool(fp.max() < TOL),
                             evidence=f"{int((fp < TOL).sum())} of {len(fp)} configurations within {TOL}; the farthest "
                                      f"{worst[0]} at alpha = {worst[1]:g}{' (weighted)' if worst[2] else ''}: "
                                      f"{fp.max():.3g}"))
        k1 = plain[(plain.objective == "k1") & (plain.alpha == 0.0)]
        if len(k1):
            rows.append(dict(condition=name, conclusion="k1 as a loss on teacher samples diverges",
                             holds=bool(k1.diverged.any() or (k1.max_logit > evaluation.DIVERGED_LOGIT).any()),
                             evidence=f"largest centred logit {k1.max_logit.max():.3g} (start about 0.3)"))
    return pd.DataFrame(rows)


def per_seed(df):
    """The final evaluation of every run of the 'tasks' experiment, per position: one row per (student, K,
    task draw, objective, alpha, weighting, seed); SFT's exact fixed points have seed -1."""
    exact = df.student == "exact"                       # SFT's exact fixed points: one row each, no training
    runs = df[~exact]                                   # each student's own last step (budgets differ by student)
    keys = ["student", "K", "task_seed", "objective", "alpha", "switch", "importance", "seed"]
    f = pd.concat([runs[runs.step == runs.groupby(keys, dropna=False).step.transform("max")], df[exact]])
    return f.assign(**{c: f[c] / f.horizon for c in ("kl_arithmetic", "kl_local", "kl_mixture", "kl_fixed_point")})


def by_draw(frame, statistic):
    """Per task draw: ``statistic`` (a function of one draw's rows of one seed -> float) computed on each
    seed, its mean over the seeds (value) and their s.d. (noise: the seed-to-seed noise the draw's
    decidability checks; NaN with one seed)."""
    per = pd.Series({key: float(statistic(g)) for key, g in frame.groupby(["task_seed", "seed"])}, dtype=float)
    if per.empty:
        return pd.DataFrame(columns=["value", "noise"], dtype=float)
    per.index = pd.MultiIndex.from_tuples(per.index, names=["task_seed", "seed"])
    g = per.groupby(level="task_seed")
    return pd.DataFrame({"value": g.mean(), "noise": g.std(ddof=1)})


def steps_to(curves, tolerance):
    """Per row of ``curves`` (a task draw x step frame of distances): the first step at or under
    ``tolerance``, inf when no evaluation reaches it."""
    hit = curves.le(tolerance)
    return pd.Series(np.where(hit.any(axis=1), hit.idxmax(axis=1), np.inf), index=curves.index, dtype=float)


def verdicts(df, convergence=None, quick=False, neural=None):
    """verdicts.csv of E1 and E2 from the 'tasks' experiment (E5 from the 'convergence' one and E1 for the
    shared-parameter student from the 'neural' one, when given), and the per-draw table behind it: one row per claim and condition
    (``analysis.verdicts.draw_row``). On each task draw the statistic is computed per seed (its mean is the
    draw's value, its s.d. the draw's noise), and the draw counts only where the design can decide the
    claim there: the candidate targets the claim tells apart are >= MULTIPLE x TOL apart (the
    ``sep_*`` columns of the runs) and the seed noise is below the tolerance. The verdict counts the
    decidable draws; a property of the draws that separates those where the claim holds from those where
    it does not is its stated condition. ``quick``: the rows say a quick run decides nothing.
    (SFT's exact fixed points have the same first-token accuracy at every alpha by construction — at the
    root its labels are A for every alpha — so no row checks it.) Returns (verdicts, draws)."""
    t = per_seed(df if neural is None else pd.concat([df, neural], ignore_index=True))
    rows, tables = [], []

    def pick(student, K, objective, alpha=None, importance=False):
        sel = (t.student == student) & (t.K == K) & (t.objective == objective) & (t.importance == importance)
        if alpha is not None:
            sel &= t.alpha == alpha
        return t[sel]

    draws = sorted(t.task_seed.unique())
    draw_sep = t[t.K == 2].groupby("task_seed")[["sep_A_mixture", "sep_l"]].first().reindex(draws)
    sep_fp = {est: pick("tabular", 2, est, 0.0).groupby("task_seed").sep_fp_l.first().reindex(draws)
              for est in TASKS["weighted"]}

    def row(claim, condition, statistic, stats, separation, at_most=True, tolerance=TOL, properties=None, tree=True,
            units=None):
        """One claim's row over the task draws (``units``: the draws its student ran, all by default); the
        separation is always told apart at TOL (a KL). The tree task's separations are candidate
        conditions of the tree rows only (``tree``): a loop draw is another task."""
        units = draws if units is None else units
        stats, sep = stats.reindex(units), draw_sep.reindex(units)
        if isinstance(separation, pd.Series):
            separation = separation.reindex(units)
        props = ({"A-mixture separation": sep.sep_A_mixture.to_numpy(), "l separation": sep.sep_l.to_numpy()}
                 if tree else {}) | (properties or {})
        r, table = draw_row(claim, condition, statistic, stats.value.to_numpy(), tolerance, at_most,
                            separation=np.asarray(separation, dtype=float), noise=stats.noise.to_numpy(),
                            properties=props, quick=quick, separation_tolerance=TOL)
        rows.append(r)
        tables.append(table.assign(claim=claim, condition=condition, task_seed=units))

    def spread(column):
        return lambda g: g[column].max() - g[column].min()

    ab = draw_sep.sep_A_mixture
    row("E1 FKL is flat across the rollout spectrum", "tabular, K = 2, full conditionals",
        "max over alpha of KL(q || A) per position", by_draw(pick("tabular", 2, "fkl"), lambda g: g.kl_arithmetic.max()), ab)
    row("E1 FKL is flat across the rollout spectrum", "capacity-limited log-linear student (4 shared features)",
        "max - min over alpha of KL(q || A) per position", by_draw(pick("capacity", 2, "fkl"), spread("kl_arithmetic")), ab)
    if (t.student == "neural").any():     # the same trees: the tasks' separations hold for the neural draws
        ran = sorted(t[t.student == "neural"].task_seed.unique())
        row("E1 FKL is flat across the rollout spectrum", "tiny Qwen2 (shared parameters), K = 2, full conditionals",
            "max over alpha of KL(q || A) per position", by_draw(pick("neural", 2, "fkl"), lambda g: g.kl_arithmetic.max()),
            ab, units=ran)
        row("E1 SFT is flat across the rollout spectrum", "tiny Qwen2 (shared parameters), K = 2, against A",
            "max - min over alpha of KL(q || A) per position", by_draw(pick("neural", 2, "sft"), spread("kl_arithmetic")),
            ab, units=ran)
    row("E1 SFT is flat across the rollout spectrum", "control: one teacher (K = 1), separation of the K = 2 draw",
        "max - min over alpha of KL(q || A) per position", by_draw(pick("tabular", 1, "sft"), spread("kl_arithmetic")), ab)
    row("E1 SFT is flat across the rollout spectrum", "K = 2, against A",
        "max - min over alpha of KL(q || A) per position", by_draw(pick("tabular", 2, "sft"), spread("kl_arithmetic")), ab)

    def ends(g):
        return max(g[g.alpha == 0.0].kl_mixture.max(), g[g.alpha == 1.0].kl_arithmetic.max())
    row("SFT is FKL to the sequence-level mixture at alpha = 0 and to A at alpha = 1", "K = 2",
        "max(KL(q || mixture) at alpha 0, KL(q || A) at alpha 1) per position",
        by_draw(pick("tabular", 2, "sft")[lambda d: d.alpha.isin([0.0, 1.0])], ends), ab)
    for est in TASKS["weighted"]:
        fp = sep_fp[est]
        derived = fp.notna().any()
        own = {f"{est}'s unweighted fixed point's separation from l": fp.to_numpy()} if derived else {}
        note = "" if derived else " (no derived fixed point: a draw decides by the seed noise alone)"
        row(f"E2 {est} needs student rollouts", "K = 2, teacher samples (alpha = 0), no weights",
            "KL(q || l) per position" + note, by_draw(pick("tabular", 2, est, 0.0), lambda g: g.kl_local.mean()), fp,
            at_most=False, properties=own)
        if derived:
            row(f"E2 {est} on teacher samples is a biased fixed point, not a divergence", "K = 2, alpha = 0",
                "KL(q || the solved fixed point) per position",
                by_draw(pick("tabular", 2, est, 0.0), lambda g: g.kl_fixed_point.mean()), fp, properties=own)
        row(f"E2 {est} reaches l on its own samples", "K = 2, alpha = 1", "KL(q || l) per position",
            by_draw(pick("tabular", 2, est, 1.0), lambda g: g.kl_local.mean()), draw_sep.sep_l)
        restore = fp if derived else by_draw(pick("tabular", 2, est, 0.0), lambda g: g.kl_local.mean()).value
        row(f"importance weights restore {est} on teacher samples", "K = 2, alpha = 0, weighted",
            "KL(q || l) per position; the separation is the unweighted " +
            ("fixed point's from l" if derived else "runs' measured distance from l (no derived fixed point)"),
            by_draw(pick("tabular", 2, est, 0.0, importance=True), lambda g: g.kl_local.mean()), restore,
            properties={f"{est}'s unweighted distance from l": restore.to_numpy()})
    row("k1 as a loss on teacher samples is not an RKL learner (it drives q to a vertex)", "K = 2, alpha = 0",
        "largest centred logit (no candidate targets: a draw decides by the seed noise alone)",
        by_draw(pick("tabular", 2, "k1", 0.0), lambda g: g.max_logit.max()), np.nan, at_most=False,
        tolerance=evaluation.DIVERGED_LOGIT)     # the project's own vertex: a logit 25 from its row's mean
    if convergence is not None:
        convergence_rows(convergence, functools.partial(row, tree=False), rows, quick)
    return pd.DataFrame(rows, columns=list(DRAW_COLUMNS)), pd.concat(tables, ignore_index=True)


def convergence_rows(c, row, rows, quick):
    """E5's rows (``verdicts``) from the 'convergence' experiment on the looping machine: per draw the
    separation is the unweighted fixed point's from l (solved for k2, k3: the columns sep_unweighted_<est>;
    measured on unweighted runs for pg0): where the unweighted runs already sit near l there is nothing for
    the weights to restore."""
    c = c.assign(kl=c.kl_local / c.horizon)
    steps, H = int(c.step.max()), int(c.H.iloc[0])
    early = int(c.step[c.step >= steps / 5].min())
    unweighted = c[~c.importance & (c.alpha == 0.0)]
    sep = {est: c.groupby("task_seed")[f"sep_unweighted_{est}"].first() for est in ("k2", "k3")}     # by draw, sorted
    sep["pg0"] = by_draw(unweighted[(unweighted.objective == "pg0") & (unweighted.step == steps)],
                         lambda g: g.kl.mean()).value
    weighted = c[c.importance]
    for est in CONVERGENCE["estimators"]:
        w = weighted[(weighted.objective == est) & (weighted["truncate"] == np.inf)]
        at_end = w[w.step == steps]
        how = "solved" if est != "pg0" else "measured on unweighted runs"
        own = {f"{est}'s unweighted distance from l ({how})": sep[est].to_numpy()}
        weights = "per-token weights q / p_k" if est in ("k2", "k3") else "sequence weights (prefix products)"
        cond = f"loop, H = {H}, alpha = 0, weighted"
        row(f"E5 importance weights do not restore l within the budget on long traces ({est}: {weights})",
            f"{cond}, after {steps} steps", "KL(q || l) per position", by_draw(at_end, lambda g: g.kl.mean()),
            sep[est], at_most=False, properties=own)
        curve = w.groupby(["task_seed", "step"]).kl.mean().unstack()
        reach = steps_to(curve, TOL)
        row(f"E5 {est} on weighted teacher samples reaches l within {steps} steps", cond,
            f"steps until the seed-mean KL(q || l) <= {TOL:g} per position (the first of {c.step.nunique() - 1} "
            f"evaluations; inf: not within the budget, a censored value)",
            pd.DataFrame({"value": reach, "noise": np.nan}), sep[est], tolerance=steps, properties=own)

        def ratio(g):
            return g[g.step == steps].kl.mean() / g[g.step == early].kl.mean()
        row(f"E5 {est} on weighted teacher samples is slow, not failing (its distance keeps falling)", cond,
            f"KL(q || l) at step {steps} over KL at step {early}", by_draw(w, ratio), sep[est], tolerance=1.0,
            properties=own)
    for cut in CONVERGENCE["truncate"]:
        for est in CONVERGENCE["estimators"]:
            w = weighted[(weighted.objective == est) & (weighted.step == steps)]
            runs = w[w["truncate"] == cut]
            cond = f"loop, H = {H}, alpha = 0, weights truncated at {cut:g}, after {steps} steps"
            own = {f"{est}'s unweighted distance from l": sep[est].to_numpy()}
            row(f"E5 truncated importance weights restore l on teacher samples ({est}, a clip that binds)", cond,
                f"KL(q || l) per position (the truncation binds in {runs.truncated_steps.median():.0%} of the steps "
                f"and on {runs.truncated_tokens.median():.2%} of the weighted tokens, medians)",
                by_draw(runs, lambda g: g.kl.mean()), sep[est], properties=own)
            rows.append(paired_row(f"E5 truncating the weights brings {est} closer to l than the whole weights",
                                   cond, w, cut, sep[est], quick))
    moments_ = c.groupby("task_seed")[["log_w2_token", "log_w2_sequence_per_token", "log_w2_sequence_slope"]].first()
    row("E5 the sequence weight's second moment grows exponentially with H", f"loop, H = {H}, at q = l",
        f"growth of ln E_p[w^2] per token over the second half of the horizon, (ln E[w^2](H) - ln E[w^2](H/2)) / "
        f"(H/2), w the product of l / p_k over the response (largest over the teachers; exact)",
        pd.DataFrame({"value": moments_.log_w2_sequence_slope, "noise": np.nan}), np.nan, at_most=False, tolerance=0.1)
    row("E5 a per-token weight (k2, k3) has a smaller second moment than the sequence weight (pg0)",
        f"loop, H = {H}, at q = l", "ln E_p[w^2] of the sequence weight minus ln E_p[(l / p_k)^2] of a token weight "
        "at its worst state (nats; exact)",
        pd.DataFrame({"value": moments_.log_w2_sequence_per_token * H - moments_.log_w2_token, "noise": np.nan}),
        np.nan, at_most=False, tolerance=0.0)


def paired_row(claim, condition, final_runs, cut, separation, quick, tolerance=TOL):
    """A paired verdict (``analysis.verdicts.effect_verdict``, claimed sign -1) on ln(KL with the weights
    truncated at ``cut`` / KL with the whole weights): per decidable draw (separation >= MULTIPLE x TOL) the
    mean over seeds of the log ratio (seed i of the one paired with seed i of the other, the same task draw),
    then a t-interval over the decidable draws."""
    per = final_runs.groupby(["task_seed", "truncate", "seed"]).kl.mean().unstack("truncate")
    log_ratio = np.log(per[cut] / per[np.inf]).groupby(level="task_seed").mean()

    def decide(tol):
        x = log_ratio.to_numpy()[(separation.reindex(log_ratio.index) >= MULTIPLE * tol).to_numpy()]
        if len(x) < MIN_DECIDABLE:
            return x, (float(x.mean()) if len(x) else np.nan), np.nan, np.nan, "inconclusive"
        est, lo, hi = (float(v[0]) for v in mean_interval(x[:, None]))
        return x, est, lo, hi, effect_verdict(lo, hi, sign=-1)
    x, est, lo, hi, verdict = decide(tolerance)
    n = len(x)
    base = dict(claim=claim, condition=condition, n_draws=len(log_ratio), n_decidable=n, n_hold=int((x < 0).sum()),
                stated_condition="", condition_p=np.nan)
    rule = (f"a task draw decides when the unweighted fixed point is >= {MULTIPLE:g} x {tolerance:g} from l; 95% "
            f"t-interval over the decidable draws of the mean log ratio; wholly below 0: reproduces; wholly above: "
            f"does not; else inconclusive; fewer than {MIN_DECIDABLE} decidable draws: inconclusive")
    stat = (f"ln(KL(q || l) truncated / KL(q || l) whole), seeds paired, mean over the decidable draws "
            f"({n} of {len(log_ratio)}); exp of it: {np.exp(x.mean()) if n else np.nan:.3g}x")
    half, twice = (decide(f * tolerance)[-1] for f in (0.5, 2.0))
    return dict(base, statistic=stat, estimate=est, lo=lo, hi=hi, rule=rule, verdict=QUICK if quick else verdict,
                verdict_half_tolerance=QUICK if quick else half, verdict_twice_tolerance=QUICK if quick else twice)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    size = sizes(SIZES, args.quick, seeds=args.seeds)
    only = args.only or EXPERIMENTS
    cells = cells_for(size, args.quick, only, args.base_seed)
    results = run_cells(cells, run_cell, args.out, resume=args.resume, executor=args.executor,
                        scheduler=args.scheduler, progress=not args.quiet, desc="rollout spectrum")
    frames = {}
    for kind, name in (("theory", "sft_theory.csv"), ("tabular", "spectrum.csv"), ("neural", "neural.csv"),
                       ("robustness", "robustness.csv"), ("tasks", "tasks.csv"), ("convergence", "convergence.csv")):
        parts = [r for c, r in zip(cells, results) if c.kind == kind]
        if parts:
            frames[kind] = pd.concat(parts, ignore_index=True)
            write_csv(os.path.join(args.out, name), frames[kind])
    summaries = [summary(frames[kind], by).assign(experiment=kind) for kind, by in SUMMARY_KEYS if kind in frames]
    if summaries:
        write_csv(os.path.join(args.out, "summary.csv"), pd.concat(summaries, ignore_index=True))
    if "tasks" in frames:
        table, per_draw = verdicts(frames["tasks"], frames.get("convergence"), quick=args.quick,
                                   neural=frames.get("neural"))
        write_csv(os.path.join(args.out, "verdicts.csv"), table)
        write_csv(os.path.join(args.out, "verdict_draws.csv"), per_draw)
        if args.quick and not args.quiet:
            print("a quick run checks the pipeline, not the claims: verdicts.csv decides nothing", file=sys.stderr)
    if "tabular" in frames and "robustness" in frames:
        table = conclusions(frames["tabular"], frames["robustness"])
        write_csv(os.path.join(args.out, "conclusions.csv"), table)
        if not args.quiet:
            print(table.to_string(index=False), file=sys.stderr)
    if not args.no_figures:
        import figures
        figures.rebuild(args.out, fig_dir=args.figures, quiet=args.quiet)
    print(f"results in {os.path.abspath(args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from sims.rollout_spectrum import main as _main
    sys.exit(_main())
