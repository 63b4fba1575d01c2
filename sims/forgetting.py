"""Forgetting and update sparsity against the learning rate, its schedule and the rollout mix (claim E3).

    python sims/forgetting.py            # about 7 min on 2 cores
    python sims/forgetting.py --quick    # seconds (the tests run this)
    python sims/forgetting.py --full --executor dask --scheduler tcp://HOST:PORT   # a cluster

A student that knows task A is distilled on task B (distillation.continual). The log-linear student runs the
full factorial: learning rate (5 values over 3 decades) x schedule (constant, linear, cosine) x warm-up
(off, on) x alpha (0, 0.5, 1) x objective (FKL and RKL with the full conditionals, the gamma = 1 policy
gradient) x clipping (off, on) x storage (float32, bf16), 3 seeds. The tiny Qwen2 runs a smaller
factorial (learning rate x schedule constant / cosine x alpha 0 / 1 x FKL / RKL x storage; warm-up off,
clipping on), 2 seeds. Which knob governs each outcome is answered by the share of its variance over
the design that each factor and each pair explains (analysis.variance_shares), with 95% intervals
over seeds.

Writes to ``--out`` (default results/forgetting):
  loglinear.csv, neural.csv   one row per run: the config, seed, forgetting (the increase of
                              KL_seq(P_A || q_A)), quality (KL per position to the objective's target on
                              B), sparsity (|dtheta| > 1e-6 (1 + |theta_0|)) and sparsity_bf16
  shares.csv                  student, outcome, term, share, lo, hi (outcomes on the scale analysed:
                              log10 forgetting, log10 quality, the two sparsities as fractions)
  figures/                    forgetting_shares.png, forgetting.png
"""

import itertools
import math
import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import analysis  # noqa: E402
from analysis.verdicts import COLUMNS, bound_verdict, verdict_row  # noqa: E402
from harness import Cell, experiment_parser, run_cells, sizes, write_csv  # noqa: E402
from distillation import continual, tasks  # noqa: E402
from distillation.configs import SCHEDULES, STORAGES, ContinualConfig  # noqa: E402

EXPERIMENTS = ("loglinear", "neural")
DEFAULT_OUT = os.path.join("results", "forgetting")

# ------------------------------------------------------------------------------------------------
# the settings (data, not code)
# ------------------------------------------------------------------------------------------------
SIZES = {                                    # default / --quick / --full
    "loglinear_seeds": (3, 2, 8),
    "neural_seeds": (2, 2, 5),
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
    "storage": STORAGES,
}
QUICK = dict(FACTORS, lr=(1e-3, 1e-1), schedule=("constant", "cosine"), alpha=(0.0, 1.0), objective=("fkl", "rkl"))
NEURAL = dict(FACTORS, schedule=("constant", "cosine"), warmup=(False,), alpha=(0.0, 1.0), objective=("fkl", "rkl"),
              clip=(True,))
NEURAL_QUICK = dict(NEURAL, lr=(1e-4, 1e-2), schedule=("constant",), objective=("fkl",))
BATCH = 32
OUTCOMES = {"forgetting": "log10", "quality": "log10", "sparsity": "fraction", "sparsity_bf16": "fraction"}
FLOOR = 1e-6                                 # log10(max(value, FLOOR)) for the outcomes analysed on a log scale
LEARNED = 0.01                               # a learning rate "learns task B" when its runs' mean quality is below this


def grid(factors):
    """Every combination of the factors' levels, as configurations."""
    names = list(factors)
    return [ContinualConfig.from_dict(dict(zip(names, values)))
            for values in itertools.product(*(factors[n] for n in names))]


def cells_for(size, mode, only, base_seed=0):
    factors = QUICK if mode == "quick" else FACTORS
    neural = NEURAL_QUICK if mode == "quick" else NEURAL
    out = []
    if "loglinear" in only:
        for seed in range(size["loglinear_seeds"]):
            out.append(Cell("loglinear", "loglinear", {"factors": factors, "seed": seed, "steps": size["steps"],
                                                       "a_steps": size["a_steps"]},
                            base_seed=base_seed, stream=("loglinear", seed)))
    if "neural" in only:
        for seed in range(size["neural_seeds"]):
            for storage in neural["storage"]:
                out.append(Cell("neural", "neural", {"factors": dict(neural, storage=(storage,)), "seed": seed,
                                                     "steps": size["steps"], "a_steps": size["neural_a_steps"]},
                                base_seed=base_seed, stream=("neural", seed, storage)))
    return out


# ------------------------------------------------------------------------------------------------
# one function per kind of cell
# ------------------------------------------------------------------------------------------------
def run_student(cell):
    """Phase 1 for the cell's seed, then phase 2 for every configuration of the cell at once."""
    pair = tasks.make_pair(cell.base_seed)
    seed = cell["seed"]
    start = continual.learn_a(pair, continual.students_for(cell.kind, pair, [seed]), steps=cell["a_steps"])
    runs = [(c, seed) for c in grid(cell["factors"])]
    return continual.distil(pair, runs, start, steps=cell["steps"], batch=BATCH, seed=int(cell.seed_array()[0]))


RUNNERS = {"loglinear": run_student, "neural": run_student}


def run_cell(cell):
    return RUNNERS[cell.kind](cell)


# ------------------------------------------------------------------------------------------------
# outputs
# ------------------------------------------------------------------------------------------------
def shares(df, factors, student):
    """The variance shares of every outcome over the factors the design varies."""
    varied = [f for f in factors if df[f].nunique() > 1]
    frames = []
    for outcome, scale in OUTCOMES.items():
        y = np.log10(np.maximum(df[outcome], FLOOR)) if scale == "log10" else df[outcome]
        table = analysis.variance_shares(df.assign(y=y), varied, "y")
        frames.append(table.assign(student=student, outcome=outcome, scale=scale))
    return pd.concat(frames, ignore_index=True)


def learning_rates_that_learn(df):
    """The learning rates whose runs' mean quality on B (KL per position to the objective's target) is
    below LEARNED."""
    quality = df.groupby("lr").quality.mean()
    return sorted(quality[quality < LEARNED].index)


def verdicts(df, student):
    """E3's verdicts for one student: the learning rate's and alpha's shares of the variance of log10
    forgetting over the full design and over the learning rates that learn B (where forgetting is
    compared at a quality worth having), by stated bounds on the seed interval of each share."""
    rows = []
    designs = [("full design", df)]
    learned = learning_rates_that_learn(df)
    if len(learned) >= 2:
        designs.append((f"learning rates that learn B (mean quality < {LEARNED:g}: {', '.join(f'{v:g}' for v in learned)})",
                        df[df.lr.isin(learned)]))
    for design, part in designs:
        table = shares(part, FACTORS, student)
        table = table[table.outcome == "forgetting"].set_index("term")
        for term, claim, tol, at_most in (("lr", "E3 the learning rate governs forgetting (share >= 0.5)", 0.5, False),
                                          ("alpha", "E3 the rollouts (alpha) do not govern forgetting (share <= 0.05)",
                                           0.05, True)):
            share = table.loc[term] if term in table.index else None
            if share is None:
                continue
            rows.append(verdict_row(claim, f"{student}, {design}",
                                    f"share of the variance of log10 forgetting, mean over {int(share.seeds)} seeds, "
                                    f"95% t-interval", share.share, share.lo, share.hi,
                                    f"interval {'<=' if at_most else '>='} {tol:g}: reproduces; on the other side: "
                                    f"does not; else inconclusive", bound_verdict(share.lo, share.hi, tol, at_most)))
    if {0.0, 1.0} <= set(df.alpha):
        rows += alpha_rows(df, student)
    return rows


def alpha_rows(df, student, margin=0.05):
    """Alpha's effect at each fixed learning rate: forgetting at alpha = 1 over forgetting at alpha = 0,
    paired by every other factor, as a geometric mean per seed with a t-interval over seeds; 'alpha leaves
    forgetting unchanged' when the interval lies within 1 +- ``margin``, fails when it lies outside."""
    keys = [f for f in FACTORS if f not in ("alpha",)] + ["seed"]
    wide = df[df.alpha.isin([0.0, 1.0])].pivot_table(index=keys, columns="alpha", values="forgetting")
    log_ratio = np.log(np.maximum(wide[1.0], FLOOR) / np.maximum(wide[0.0], FLOOR)).rename("r").reset_index()
    rows = []
    for lr, g in log_ratio.groupby("lr"):
        per_seed = g.groupby("seed").r.mean().to_numpy()
        mean, lo, hi = (float(x[0]) for x in analysis.mean_interval(per_seed[:, None]))
        lo_r, hi_r = math.exp(lo), math.exp(hi)
        verdict = ("inconclusive" if len(per_seed) < 2 else          # one seed: no interval to decide with
                   "reproduces" if 1 - margin <= lo_r and hi_r <= 1 + margin else
                   "does not reproduce" if hi_r < 1 - margin or lo_r > 1 + margin else "inconclusive")
        rows.append(verdict_row(f"E3 alpha leaves forgetting unchanged at a fixed learning rate (within {margin:.0%})",
                                f"{student}, lr = {lr:g}",
                                f"forgetting at alpha = 1 over alpha = 0, paired by the other factors, geometric mean "
                                f"over {len(per_seed)} seeds, 95% t-interval", math.exp(mean), lo_r, hi_r,
                                f"interval within 1 +- {margin:g}: reproduces; outside it: does not; else inconclusive",
                                verdict))
    return rows


def main(argv=None):
    ap = experiment_parser("forgetting.py", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS, full=True)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    mode = "quick" if args.quick else "full" if args.full else "default"
    size = sizes(SIZES, args.quick, args.full, seeds=args.seeds)
    only = args.only or EXPERIMENTS
    cells = cells_for(size, mode, only, args.base_seed)
    results = run_cells(cells, run_cell, args.out, resume=args.resume, executor=args.executor,
                        scheduler=args.scheduler, progress=not args.quiet, desc="forgetting")
    tables, verdict_rows = [], []
    for kind in EXPERIMENTS:
        parts = [r for c, r in zip(cells, results) if c.kind == kind]
        if parts:
            df = pd.concat(parts, ignore_index=True)
            write_csv(os.path.join(args.out, f"{kind}.csv"), df)
            tables.append(shares(df, FACTORS, kind))
            verdict_rows += verdicts(df, kind)
    if tables:
        table = pd.concat(tables, ignore_index=True)
        write_csv(os.path.join(args.out, "shares.csv"), table)
        write_csv(os.path.join(args.out, "verdicts.csv"), pd.DataFrame(verdict_rows, columns=list(COLUMNS)))
        if not args.quiet:
            top = (table[table.term != "higher order"].sort_values("share", ascending=False)
                   .groupby(["student", "outcome"]).head(3).sort_values(["student", "outcome", "share"],
                                                                         ascending=[True, True, False]))
            print(top.to_string(index=False, float_format=lambda v: f"{v:.3f}"), file=sys.stderr)
    if not args.no_figures:
        import figures
        figures.rebuild(args.out, fig_dir=args.figures, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    from sims.forgetting import main as _main
    sys.exit(_main())
