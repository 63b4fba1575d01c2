"""The rollout spectrum, KL direction and robustness (claims E1, E2, E5) with exact finite-state teachers.

    python sims/rollout_spectrum.py            # the default sweep, about 2.5 min on 2 cores
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
  summary.csv      per configuration: final KL per position, accuracy, share diverged, steps to reach TOL
  conclusions.csv  each conclusion of the study under each condition, with the numbers and a verdict
  figures/         spectrum.png, spectrum_neural.png
"""

import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from harness import Cell, experiment_parser, run_cells, sizes, write_csv  # noqa: E402
import aggregation as ag  # noqa: E402
from distillation import evaluation, fixed_points, tasks, training  # noqa: E402
from distillation.configs import SpectrumConfig  # noqa: E402
from distillation.students import TabularStudents, TokenStudents  # noqa: E402

EXPERIMENTS = ("tabular", "neural", "robustness", "theory")
DEFAULT_OUT = os.path.join("results", "rollout_spectrum")

# ------------------------------------------------------------------------------------------------
# the settings (data, not code)
# ------------------------------------------------------------------------------------------------
SIZES = {                                   # full run / --quick
    "seeds": (2, 1),
    "tabular_steps": (300, 60),
    "neural_steps": (200, 20),
    "robust_steps": (200, 40),
    "neural_seeds": (5, 2),                 # trained together (vmap)
}
ALPHAS = tuple(np.round(np.linspace(0, 1, 11), 2))
QUICK_ALPHAS = (0.0, 0.5, 1.0)
ESTIMATORS = ("k1", "k2", "k3", "k3-teacher", "pg0", "pg1")         # the ones importance weights change
TABULAR_CELLS = ({"K": 2, "clip": False}, {"K": 2, "clip": True}, {"K": 1, "clip": False})
NEURAL = {"objectives": ("fkl", "sft", "rkl", "k3", "pg1"), "alphas": (0.0, 0.5, 1.0)}
ROBUST = {"horizons": (16, 64, 256), "objectives": ("fkl", "rkl", "k2", "k3", "pg0"), "alphas": (0.0, 0.5, 1.0)}
BATCH, LR, NEURAL_LR = 64, 0.05, 3e-3
SUMMARY_KEYS = (("tabular", ("K", "clip")), ("neural", ("K",)), ("robustness", ("H", "clip")))
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
    if "neural" in only:
        objectives = NEURAL["objectives"][:2] if quick else NEURAL["objectives"]
        for obj in objectives:
            for a in (QUICK_ALPHAS[::2] if quick else NEURAL["alphas"]):
                out.append(Cell("neural", "neural", dict(objective=obj, alpha=a, K=2, steps=size["neural_steps"],
                                                         seeds=list(range(size["neural_seeds"]))),
                                base_seed=base_seed, stream=("neural", obj, a)))
    if "robustness" in only:
        for H in ROBUST["horizons"][:1] if quick else ROBUST["horizons"]:
            for clip in (False, True):
                out.append(Cell("robustness", "robustness", dict(H=H, clip=clip, steps=size["robust_steps"],
                                                                 seeds=seeds[:1]),
                                base_seed=base_seed, stream=("robustness", H, clip)))
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


def run_tabular(cell):
    task = tasks.make_task("tree", K=cell["K"], seed=cell.base_seed)
    configs = spectrum_configs(cell["alphas"], clip=cell["clip"])
    gen = torch.Generator().manual_seed(cell.base_seed)      # the students' start, then the rollouts
    students = TabularStudents(task, len(configs) * len(cell["seeds"]), gen, lr=LR)
    df = training.train(task, configs, cell["seeds"], students, steps=cell["steps"], batch=BATCH,
                        eval_every=max(cell["steps"] // 6, 1), gen=gen)
    return df.assign(K=cell["K"], task=task.name, horizon=task.horizon)


def run_neural(cell):
    task = tasks.make_task("tree", K=cell["K"], seed=cell.base_seed)
    config = SpectrumConfig(cell["objective"], cell["alpha"], clip=True)
    students = TokenStudents(task, cell["seeds"], vocab=task.teachers.n + 1, bos=task.teachers.n, lr=NEURAL_LR)
    df = training.train(task, [config], cell["seeds"], students, steps=cell["steps"], batch=BATCH,
                        eval_every=max(cell["steps"] // 4, 1), gen=torch.Generator().manual_seed(int(cell.seed_array()[0])))
    return df.assign(K=cell["K"], task=task.name, horizon=task.horizon)


def run_robustness(cell):
    task = tasks.make_task("loop", K=2, seed=cell.base_seed, horizon=cell["H"])
    configs = spectrum_configs(ROBUST["alphas"], ROBUST["objectives"], clip=cell["clip"], switch=False)
    gen = torch.Generator().manual_seed(cell.base_seed)
    students = TabularStudents(task, len(configs) * len(cell["seeds"]), gen, lr=LR)
    df = training.train(task, configs, cell["seeds"], students, steps=cell["steps"], batch=16, eval_every=cell["steps"],
                        gen=gen, fixed_points=False)
    return df.assign(K=2, H=cell["H"], task=task.name, horizon=task.horizon)


RUNNERS = {"theory": run_theory, "tabular": run_tabular, "neural": run_neural, "robustness": run_robustness}


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
    for (H, clip), grp in robust.groupby(["H", "clip"]):
        conditions.append((f"loop, H={H}, clipping {'on' if clip else 'off'}", 2, final(grp)))
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
                             holds=bool(k1.diverged.any() or (k1.max_logit > 0.8 * evaluation.DIVERGED_LOGIT).any()),
                             evidence=f"largest centred logit {k1.max_logit.max():.3g} (start about 0.3)"))
    return pd.DataFrame(rows)


def main(argv=None):
    ap = experiment_parser("rollout_spectrum.py", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    size = sizes(SIZES, args.quick, seeds=args.seeds)
    only = args.only or EXPERIMENTS
    cells = cells_for(size, args.quick, only, args.base_seed)
    results = run_cells(cells, run_cell, args.out, resume=args.resume, executor=args.executor,
                        scheduler=args.scheduler, progress=not args.quiet, desc="rollout spectrum")
    frames = {}
    for kind, name in (("theory", "sft_theory.csv"), ("tabular", "spectrum.csv"), ("neural", "neural.csv"),
                       ("robustness", "robustness.csv")):
        parts = [r for c, r in zip(cells, results) if c.kind == kind]
        if parts:
            frames[kind] = pd.concat(parts, ignore_index=True)
            write_csv(os.path.join(args.out, name), frames[kind])
    summaries = [summary(frames[kind], by).assign(experiment=kind) for kind, by in SUMMARY_KEYS if kind in frames]
    if summaries:
        write_csv(os.path.join(args.out, "summary.csv"), pd.concat(summaries, ignore_index=True))
    if "tabular" in frames and "robustness" in frames:
        table = conclusions(frames["tabular"], frames["robustness"])
        write_csv(os.path.join(args.out, "conclusions.csv"), table)
        if not args.quiet:
            print(table.to_string(index=False), file=sys.stderr)
    if not args.no_figures:
        import figures
        figures.rebuild(args.out, fig_dir=args.figures, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    from sims.rollout_spectrum import main as _main
    sys.exit(_main())
