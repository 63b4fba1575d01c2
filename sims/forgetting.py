"""Forgetting and update sparsity against the learning rate, its schedule and the rollout mix (claim E3).

    python sims/forgetting.py            # about 2 min on 2 cores
    python sims/forgetting.py --quick    # seconds (the tests run this)
    python sims/forgetting.py --full --executor dask --scheduler tcp://HOST:PORT   # a cluster

A student that knows task A is distilled on task B (distillation.continual), on 8 task pairs (A, B) drawn
independently (tasks.make_pair; 2 with --quick), each pair a cluster of the verdicts' intervals, so that a
verdict speaks of task pairs, not of one pair's seeds. The log-linear student runs the full factorial: learning rate (5 values over 3 decades) x schedule (constant, linear, cosine) x warm-up
(off, on) x alpha (0, 0.5, 1) x objective (FKL and RKL with the full conditionals, the gamma = 1 policy
gradient) x clipping (off, on) x storage (float32, bf16), 1 seed per task pair. The tiny Qwen2 runs a smaller
factorial (learning rate x schedule constant / cosine x alpha 0 / 1 x FKL / RKL x storage; warm-up off,
clipping on), 1 seed per task pair. Which knob governs each outcome is answered by the share of its
variance over the design that each factor and each pair of factors explains (analysis.variance_shares,
per task pair on the cell means over its seeds), with 95% t-intervals over the task pairs. A third design ('precision') crosses the learning rate with three storages, float32, bf16
and mixed precision (float32 master weights read through their bf16 copy), for the log-linear student
(constant schedule, FKL, alpha 0 and 1), to separate the learning rate x storage interaction behind
update sparsity.

Writes to ``--out`` (default results/forgetting):
  loglinear.csv, neural.csv,  one row per run: the config, seed, forgetting (the increase of
  precision.csv               KL_seq(P_A || q_A)), quality (KL per position to the objective's target on
                              B), sparsity (|dtheta| > 1e-6 (1 + |theta_0|)) and sparsity_bf16 (the
                              share whose bfloat16 value changed: what a bf16 copy of the weights sees)
  shares.csv                  student, outcome, term, share, lo, hi (outcomes on the scale analysed:
                              log10 forgetting, log10 quality, the two sparsities as fractions)
  verdicts.csv                E3's claims by stated rules (:func:`verdicts`, :func:`precision_rows`); a --quick
                              run's say "not decided (quick run)"
  figures/                    forgetting_shares.png, forgetting.png
"""

import itertools
import math
import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import experiment_parser  # noqa: E402  (argparse only)

EXPERIMENTS = ("loglinear", "neural", "precision")
DEFAULT_OUT = os.path.join("results", "forgetting")


def parse_args(argv):
    ap = experiment_parser("forgetting.py", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS, full=True)
    return ap.parse_args(argv)


if __name__ == "__main__":      # --help and a bad argument answer here, before numba, torch and pandas load
    parse_args(sys.argv[1:])


import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import analysis  # noqa: E402
from analysis.verdicts import COLUMNS, QUICK as NOT_DECIDED, bound_verdict, verdict_row  # noqa: E402
from harness import Cell, run_cells, sizes, write_csv  # noqa: E402
from distillation import continual, tasks  # noqa: E402
from distillation.configs import SCHEDULES, STORAGES, ContinualConfig  # noqa: E402


# ------------------------------------------------------------------------------------------------
# the settings (data, not code)
# ------------------------------------------------------------------------------------------------
SIZES = {                                    # default / --quick / --full
    "pairs": (8, 2, 16),                     # task pairs (A, B): the clusters of every interval
    "loglinear_seeds": (1, 1, 4),            # ... and seeds per pair
    "neural_seeds": (1, 1, 2),
    "steps": (150, 40, 300),
    "a_steps": (400, 100, 400),
    "neural_a_steps": (300, 40, 300),
}
FACTORS = {
    "lr": (1e-4, 5.6e-4, 3.2e-3, 1.8e-2, 1e-1),
    "schedule": SCHEDULES,
    "warmup": (False, True),
    "alpha": (0.0, 0.5, 1.0),
    "objective": ("fkl", "rkl", "pg1"),
    "clip": (False, True),
    "storage": ("float32", "bf16"),
}
PRECISION = dict(lr=FACTORS["lr"], schedule=("constant",), warmup=(False,), alpha=(0.0, 1.0), objective=("fkl",),
                 clip=(False,), storage=STORAGES)   # sparsity: learning rate x storage, mixed precision included
QUICK = dict(FACTORS, lr=(1e-3, 1e-1), schedule=("constant", "cosine"), alpha=(0.0, 1.0), objective=("fkl", "rkl"))
PRECISION_QUICK = dict(PRECISION, lr=(1e-4, 1e-1))
NEURAL = dict(FACTORS, schedule=("constant", "cosine"), warmup=(False,), alpha=(0.0, 1.0), objective=("fkl", "rkl"),
              clip=(True,))
NEURAL_QUICK = dict(NEURAL, lr=(1e-4, 1e-2), schedule=("constant",), objective=("fkl",))
BATCH = 32
OUTCOMES = {"forgetting": "log10", "quality": "log10", "sparsity": "fraction", "sparsity_bf16": "fraction"}
FLOOR = 1e-6                                 # log10(max(value, FLOOR)) for the outcomes analysed on a log scale
LEARNED = 0.01                               # a learning rate "learns task B" when its runs' mean quality is below this
CLUSTER = "pair"                             # the unit of every interval: a task pair (its seeds averaged)


def grid(factors):
    """Every combination of the factors' levels, as configurations."""
    names = list(factors)
    return [ContinualConfig.from_dict(dict(zip(names, values)))
            for values in itertools.product(*(factors[n] for n in names))]


def cells_for(size, mode, only, base_seed=0):
    factors = QUICK if mode == "quick" else FACTORS
    neural = NEURAL_QUICK if mode == "quick" else NEURAL
    out = []
    for pair in range(size["pairs"]):
        common = {"pair": pair, "steps": size["steps"]}
        if "loglinear" in only:
            for seed in range(size["loglinear_seeds"]):
                out.append(Cell("loglinear", "loglinear", {"factors": factors, "seed": seed, "a_steps": size["a_steps"],
                                                           **common},
                                base_seed=base_seed, stream=("loglinear", pair, seed)))
        if "precision" in only:              # the log-linear student on PRECISION's design
            for seed in range(size["loglinear_seeds"]):
                out.append(Cell("precision", "loglinear",
                                {"factors": PRECISION_QUICK if mode == "quick" else PRECISION, "seed": seed,
                                 "a_steps": size["a_steps"], **common},
                                base_seed=base_seed, stream=("precision", pair, seed)))
        if "neural" in only:
            for seed in range(size["neural_seeds"]):
                for storage in neural["storage"]:
                    out.append(Cell("neural", "neural", {"factors": dict(neural, storage=(storage,)), "seed": seed,
                                                         "a_steps": size["neural_a_steps"], **common},
                                    base_seed=base_seed, stream=("neural", pair, seed, storage)))
    return out


# ------------------------------------------------------------------------------------------------
# one function per kind of cell
# ------------------------------------------------------------------------------------------------
def run_student(cell):
    """Phase 1 for the cell's seed, then phase 2 for every configuration of the cell at once, on the cell's
    task pair (draw base_seed x 1000 + pair: pair 0 of base seed 0 is make_pair(0))."""
    pair = tasks.make_pair(cell.base_seed * 1000 + cell["pair"])
    seed = cell["seed"]
    start = continual.learn_a(pair, continual.students_for(cell.kind, pair, [seed]), steps=cell["a_steps"])
    runs = [(c, seed) for c in grid(cell["factors"])]
    out = continual.distil(pair, runs, start, steps=cell["steps"], batch=BATCH, seed=int(cell.seed_array()[0]))
    out.insert(0, CLUSTER, cell["pair"])
    return out


RUNNERS = {"loglinear": run_student, "neural": run_student}


def run_cell(cell):
    return RUNNERS[cell.kind](cell)


# ------------------------------------------------------------------------------------------------
# outputs
# ------------------------------------------------------------------------------------------------
def shares(df, factors, student):
    """The variance shares of every outcome over the factors the design varies: per task pair (CLUSTER) on
    the cell means over its seeds, with a t-interval over the pairs (the column 'seeds' counts them)."""
    varied = [f for f in factors if df[f].nunique() > 1]
    frames = []
    for outcome, scale in OUTCOMES.items():
        y = np.log10(np.maximum(df[outcome], FLOOR)) if scale == "log10" else df[outcome]
        table = analysis.variance_shares(df.assign(y=y), varied, "y", seed=CLUSTER)
        frames.append(table.assign(student=student, outcome=outcome, scale=scale))
    return pd.concat(frames, ignore_index=True)


def learning_rates_that_learn(df):
    """The learning rates whose runs' mean quality on B (KL per position to the objective's target) is
    below LEARNED."""
    quality = df.groupby("lr").quality.mean()
    return sorted(quality[quality < LEARNED].index)


E3_SHARES = (("lr", "E3 the learning rate governs forgetting (share >= 0.5)", 0.5, False),    # (term, claim, bound,
              ("alpha", "E3 the rollouts (alpha) do not govern forgetting (share <= 0.05)", 0.05, True))  # at most)


def verdicts(df, student):
    """E3's verdicts for one student: the learning rate's and alpha's shares of the variance of log10
    forgetting over the full design and over the learning rates that learn B (where forgetting is
    compared at a quality worth having), by stated bounds on the interval of each share over task pairs.
    Fewer than 2 rates that learn B: those rows say so (inconclusive, no estimate) rather than vanish."""
    rows = []
    designs = [("full design", df)]
    learned = learning_rates_that_learn(df)
    among = f"learning rates that learn B (mean quality < {LEARNED:g}: {', '.join(f'{v:g}' for v in learned) or 'none'})"
    if len(learned) >= 2:
        designs.append((among, df[df.lr.isin(learned)]))
    for design, part in designs:
        table = shares(part, FACTORS, student)
        table = table[table.outcome == "forgetting"].set_index("term")
        for term, claim, tol, at_most in E3_SHARES:
            share = table.loc[term] if term in table.index else None
            if share is None:
                continue
            rows.append(verdict_row(claim, f"{student}, {design}",
                                    f"share of the variance of log10 forgetting, mean over {int(share.seeds)} task "
                                    f"pairs, 95% t-interval", share.share, share.lo, share.hi,
                                    f"interval {'<=' if at_most else '>='} {tol:g}: reproduces; on the other side: "
                                    f"does not; else inconclusive", bound_verdict(share.lo, share.hi, tol, at_most)))
    if len(learned) < 2:                     # the rows are written all the same: their absence would hide the answer
        for term, claim, tol, at_most in E3_SHARES:
            if df[term].nunique() > 1:
                rows.append(verdict_row(claim, f"{student}, {among}",
                                        f"no share: fewer than 2 learning rates learn B (over {df[CLUSTER].nunique()} "
                                        f"task pairs), so there is no design among them", np.nan, np.nan, np.nan,
                                        f"interval {'<=' if at_most else '>='} {tol:g}: reproduces; on the other side: "
                                        f"does not; else inconclusive", "inconclusive"))
    if {0.0, 1.0} <= set(df.alpha):
        rows += alpha_rows(df, student)
        rows += frontier_rows(df, student)
    return rows


def frontier(quality, forgetting, at):
    """The quality-forgetting frontier of a set of runs read at the qualities ``at``: the least forgetting
    among the runs whose quality on B is at most each value (NaN where none is)."""
    q, best = analysis.lower_frontier(quality, forgetting)
    i = np.searchsorted(q, at, side="right") - 1
    return np.where(i >= 0, best[np.maximum(i, 0)], np.nan)


def frontier_rows(df, student, margin=0.05, points=9):
    """Forgetting at equal quality on B, per objective (each run's quality is its KL to its own
    objective's target, so objectives are never pooled): per task pair and seed, the frontier of the alpha =
    1 runs over that of the alpha = 0 runs (every other factor free), read at ``points`` log-spaced
    qualities from the best both reach up to LEARNED, as a geometric mean; its mean over the pair's seeds; a
    t-interval over the task pairs where some seed reaches LEARNED at both alphas; 'alpha leaves forgetting
    unchanged at equal quality' within 1 +- ``margin``. A row for every objective, whether or not a pair
    reaches LEARNED (none: no estimate, inconclusive), so that no row's existence hangs on a kernel's last
    bits."""
    rows = []
    pairs = df[CLUSTER].nunique()
    for objective, part in df.groupby("objective", sort=False):
        per_pair = {}
        for (pair, _), g in part.groupby([CLUSTER, "seed"]):
            ends = [g[g.alpha == a] for a in (0.0, 1.0)]
            if any(e.empty for e in ends):
                continue
            lo = max(e.quality.min() for e in ends)
            if lo >= LEARNED:
                continue
            at = np.geomspace(lo, LEARNED, points)
            f0, f1 = (np.maximum(frontier(e.quality, e.forgetting, at), FLOOR) for e in ends)
            per_pair.setdefault(pair, []).append(float(np.mean(np.log(f1 / f0))))
        claim = f"E3 alpha leaves forgetting unchanged at equal quality on B (within {margin:.0%})"
        condition = (f"{student}, {objective.upper()}, the quality-forgetting frontier (quality: KL to the "
                     f"{objective.upper()} target < {LEARNED:g}), every other factor free")
        statistic = (f"least forgetting at a quality on B, alpha = 1 over alpha = 0, geometric mean over {points} "
                     f"qualities; {len(per_pair)} of {pairs} task pairs reach quality < {LEARNED:g} at both alphas")
        if per_pair:
            rows.append(ratio_row(claim, condition, statistic + ", mean",
                                  [np.mean(v) for _, v in sorted(per_pair.items())], margin))
        else:
            rows.append(verdict_row(claim, condition, statistic + ": no frontier to compare", np.nan, np.nan, np.nan,
                                    f"interval within 1 +- {margin:g}: reproduces; outside it: does not; else "
                                    f"inconclusive", "inconclusive"))
    return rows


def ratio_row(claim, condition, statistic, log_ratios, margin):
    """The row of a claim that a ratio is 1 within ``margin``: ``log_ratios`` one per task pair, their mean
    and t-interval over the pairs mapped back to ratios (``statistic`` is completed by 'over N task pairs,
    95% t-interval'); 'reproduces' when the interval lies within 1 +- margin, 'does not reproduce' when it
    lies outside, else (or with one pair) 'inconclusive'. Shared by alpha's claims at a fixed learning
    rate (:func:`alpha_rows`) and at equal quality (:func:`frontier_rows`)."""
    log_ratios = np.asarray(log_ratios, dtype=float)
    mean, lo, hi = (float(x[0]) for x in analysis.mean_interval(log_ratios[:, None]))
    lo_r, hi_r = math.exp(lo), math.exp(hi)
    verdict = ("inconclusive" if len(log_ratios) < 2 else          # one pair: no interval to decide with
               "reproduces" if 1 - margin <= lo_r and hi_r <= 1 + margin else
               "does not reproduce" if hi_r < 1 - margin or lo_r > 1 + margin else "inconclusive")
    return verdict_row(claim, condition, f"{statistic} over {len(log_ratios)} task pairs, 95% t-interval",
                       math.exp(mean), lo_r, hi_r,
                       f"interval within 1 +- {margin:g}: reproduces; outside it: does not; else inconclusive", verdict)


def alpha_rows(df, student, margin=0.05):
    """Alpha's effect at each fixed learning rate: forgetting at alpha = 1 over forgetting at alpha = 0,
    paired by every other factor and seed, as a geometric mean per task pair with a t-interval over the
    pairs; 'alpha leaves forgetting unchanged' when the interval lies within 1 +- ``margin``, fails when it
    lies outside."""
    keys = [f for f in FACTORS if f not in ("alpha",)] + [CLUSTER, "seed"]
    wide = df[df.alpha.isin([0.0, 1.0])].pivot_table(index=keys, columns="alpha", values="forgetting")
    log_ratio = np.log(np.maximum(wide[1.0], FLOOR) / np.maximum(wide[0.0], FLOOR)).rename("r").reset_index()
    rows = []
    for lr, g in log_ratio.groupby("lr"):
        rows.append(ratio_row(f"E3 alpha leaves forgetting unchanged at a fixed learning rate (within {margin:.0%})",
                              f"{student}, lr = {lr:g}", "forgetting at alpha = 1 over alpha = 0, paired by the other "
                              "factors, geometric mean", g.groupby(CLUSTER).r.mean(), margin))
    return rows


SPARSITY_STEP = 0.05       # E3: "the learning rate governs sparsity" when it moves it by at least this


def precision_rows(df):
    """E3's sparsity verdicts per storage condition (precision.csv): the share of parameters an update
    moves at the highest learning rate minus at the lowest, per task pair (mean over its seeds and alpha),
    with a t-interval over the pairs; 'the learning rate governs sparsity' when the interval lies above SPARSITY_STEP, not when
    it lies below. Mixed precision is read twice: its float32 master weights and the bf16 copy it serves."""
    lo_lr, hi_lr = df.lr.min(), df.lr.max()
    conditions = (("float32", "float32", "sparsity"), ("bf16 storage (no master weights)", "bf16", "sparsity"),
                  ("mixed precision: the float32 master weights", "bf16-master", "sparsity"),
                  ("mixed precision: the bf16 copy it serves", "bf16-master", "sparsity_bf16"))
    rows = []
    for name, storage, column in conditions:
        d = df[df.storage == storage].groupby([CLUSTER, "lr"])[column].mean().unstack("lr")
        if d.empty:
            continue
        step = (d[hi_lr] - d[lo_lr]).to_numpy()
        mean, lo, hi = (float(x[0]) for x in analysis.mean_interval(step[:, None]))
        rows.append(verdict_row("E3 the learning rate governs update sparsity", f"loglinear, {name}",
                                f"share of parameters moved at lr = {hi_lr:g} minus at lr = {lo_lr:g} (at lr = "
                                f"{lo_lr:g}: {d[lo_lr].mean():.2f}; at {hi_lr:g}: {d[hi_lr].mean():.2f}), mean over "
                                f"{len(step)} task pairs, 95% t-interval", mean, lo, hi,
                                f"interval >= {SPARSITY_STEP:g}: reproduces; below it: does not; else inconclusive",
                                bound_verdict(lo, hi, SPARSITY_STEP, at_most=False)))
    return rows


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    mode = "quick" if args.quick else "full" if args.full else "default"
    size = sizes(SIZES, args.quick, args.full, seeds=args.seeds)
    only = args.only or EXPERIMENTS
    cells = cells_for(size, mode, only, args.base_seed)
    results = run_cells(cells, run_cell, args.out, resume=args.resume, executor=args.executor,
                        scheduler=args.scheduler, progress=not args.quiet, desc="forgetting")
    tables, verdict_rows = [], []
    for experiment in EXPERIMENTS:
        parts = [r for c, r in zip(cells, results) if c.experiment == experiment]
        if not parts:
            continue
        df = pd.concat(parts, ignore_index=True)
        write_csv(os.path.join(args.out, f"{experiment}.csv"), df)
        if experiment == "precision":
            verdict_rows += precision_rows(df)
        else:
            tables.append(shares(df, FACTORS, experiment))
            verdict_rows += verdicts(df, experiment)
    table = pd.DataFrame(verdict_rows, columns=list(COLUMNS))
    if args.quick:                           # a quick run checks the pipeline, not the claims
        table["verdict"] = NOT_DECIDED
        if not args.quiet:
            print("a quick run checks the pipeline, not the claims: verdicts.csv decides nothing", file=sys.stderr)
    write_csv(os.path.join(args.out, "verdicts.csv"), table)
    if tables:
        table = pd.concat(tables, ignore_index=True)
        write_csv(os.path.join(args.out, "shares.csv"), table)
        if not args.quiet:
            top = (table[table.term != "higher order"].sort_values("share", ascending=False)
                   .groupby(["student", "outcome"]).head(3).sort_values(["student", "outcome", "share"],
                                                                         ascending=[True, True, False]))
            print(top.to_string(index=False, float_format=lambda v: f"{v:.3f}"), file=sys.stderr)
    if not args.no_figures:
        import figures
        figures.rebuild(args.out, fig_dir=args.figures, quiet=args.quiet)
    print(f"results in {os.path.abspath(args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from sims.forgetting import main as _main
    sys.exit(_main())
