"""Regret of off-policy (FKL) and on-policy (RKL) learners, tabular and with function approximation.

    python sims/regret.py                 # the default suite, about 30 s on 2 cores
    python sims/regret.py --quick         # seconds (the tests run this)
    python sims/regret.py --only onpolicy-tabular --T 1000000 --executor dask

Writes to ``--out`` (default results/regret):
  regret.csv   experiment, learner, feedback, n_actions, seed, t, regret, metric, setting
               (one row per cell x seed x t, t on a log grid; metric: ``regret`` against the best
               fixed predictor in hindsight, ``pseudo`` against the target, ``token`` the per-token
               RKL regret against the local geometric pool)
  summary.csv  experiment, learner, feedback, n_actions, slope, slope_lo, slope_hi, theory_slope,
               metric, setting, n_seeds, T, growth, exponent, exponent_lo, exponent_hi: over the last
               two decades of t, how the regret grows (``logarithmic``, ``power`` or ``bounded``, from
               the data: analysis.growth), the slope c of R_T ≈ c ln T + b (logarithmic rows
               only) and the exponent p of R_T ∝ T^p, each with a 95% Student-t interval over seeds;
               theory_slope is the closed-form c where the theory gives one
  theory.csv   the theory curves drawn beside the measurements
  cells/       one file per finished cell (written atomically), so a rerun resumes where it stopped
  figures/     regret_<experiment>.png (``python -m figures`` rebuilds them from the CSVs)

Each experiment is a list of independent cells (docs/theory.md section 3):
  offpolicy-tabular   add-beta (KT, Laplace, beta 0.1, 2) on one context: the constant and the
                      round-robin sequence (closed forms) and sample feedback from K = 3 teachers
  offpolicy-sequence  per-state KT / Laplace on prefix-tree teachers (aggregation.examples)
  onpolicy-tabular    FTL and exponentiated gradient on RKL: alternating teachers (1-e, e), (e, 1-e)
                      and i.i.d. teacher pools, sample and full feedback
  onpolicy-sequence   on-policy plug-in learners that see the teachers only on their own rollouts:
                      soft-Bellman on the estimated rewards (sequence-level RKL) -> G_seq, per-token
                      (discount 0) -> the local l
  function-approx     log-linear student: OGD, online Newton step with the theory's constants, a
                      Newton-style variant, a constant step and a frozen student (off-policy log
                      loss); OGD and a frozen student on the on-policy RKL loss
"""

import argparse
import math
import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import experiment_parser, int_at_least  # noqa: E402  (argparse only)

EXPERIMENTS = ("offpolicy-tabular", "offpolicy-sequence", "onpolicy-tabular", "onpolicy-sequence",
               "function-approx")
DEFAULT_OUT = os.path.join("results", "regret")
EPS = (0.1, 1e-2, 1e-3, 1e-4)               # alternating teachers (1-e, e), (e, 1-e)

def _eps_list(text):
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--eps must be comma-separated numbers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("--eps must list at least one value")
    for v in values:
        if not (0.0 < v < 0.5):
            raise argparse.ArgumentTypeError(f"every e must lie in (0, 1/2), got {v:g}")
    return values

def parse_args(argv):
    ap = experiment_parser("regret.py", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS)
    ap.add_argument("--T", "--rounds", dest="n_rounds", type=int_at_least(1, "--T"), default=None,
                    help="rounds of every cell")
    ap.add_argument("--horizon", type=int_at_least(1, "--horizon"), default=None,
                    help="response length of the sequence experiments")
    ap.add_argument("--eps", type=_eps_list, default=EPS,
                    help="alternating-teacher values e, each in (0, 1/2), comma-separated")
    return ap.parse_args(argv)

if __name__ == "__main__":      # --help and a bad argument answer here, before numba, torch and pandas load
    parse_args(sys.argv[1:])

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import aggregation as ag  # noqa: E402
from aggregation import examples  # noqa: E402
import analysis  # noqa: E402
from harness import Cell, run_cells, sizes, write_csv  # noqa: E402
from learners import closed_forms, names, online  # noqa: E402

ROW_COLUMNS = ["experiment", "learner", "feedback", "n_actions", "seed", "t", "regret", "metric", "setting"]
SUMMARY_COLUMNS = ["experiment", "learner", "feedback", "n_actions", "slope", "slope_lo", "slope_hi",
                   "theory_slope", "metric", "setting", "n_seeds", "T", "growth", "exponent", "exponent_lo",
                   "exponent_hi"]
THEORY_COLUMNS = ["experiment", "learner", "feedback", "n_actions", "metric", "setting", "curve", "t", "value"]

# ------------------------------------------------------------------------------------------------
# the settings (data, not code)
# ------------------------------------------------------------------------------------------------
SIZES = {                                   # full run / --quick; --T sets every *rounds*, --seeds every *seeds*
    "long_rounds": (10**6, 10**4),          # one-context cells, and per-state add-beta (Laplace's slope
    "rounds": (10**5, 10**3),               # reaches (n-1)/2 per state only by T ~ 1e6: paper_repro T3)
    "seeds": (20, 4),
    "fa_seeds": (10, 3),                    # function approximation: a comparator fit per seed and round
}
ADD_BETA = {"KT": 0.5, "Laplace": 1.0, "add-0.1": 0.1, "add-2": 2.0}
RKL_LEARNERS = {"FTL": ("1/t", 1.0), "EG 1/(t+1)": ("1/(t+1)", 1.0), "EG 1/sqrt(t)": ("1/sqrt(t)", 1.0),
                "EG constant 0.1": ("constant", 0.1)}
TEACHER_WEIGHTS = (0.5, 0.3, 0.2)
POOL = "K=3 w=0.5/0.3/0.2"
SEQUENCE_TREES = ((2, 4), (3, 3))           # (n, depth) of the prefix-tree teachers
ONPOLICY_MACHINES = {"prefix-bias": 6, "tree": 3}   # default horizon H of each machine
LOGLINEAR = {"OGD": "sample", "ONS": "sample", "Newton-style": "sample", "constant step": "sample",
             "frozen": "sample", "OGD-RKL": "full", "frozen-RKL": "full"}

def _cell(experiment, kind, learner, feedback, n, setting, n_rounds, seeds, base_seed, **params):
    return Cell(experiment, kind, dict(learner=learner, feedback=feedback, n_actions=n, setting=setting,
                                       n_rounds=n_rounds, **params),
                seeds=seeds, base_seed=base_seed, stream=(experiment, learner, feedback, n, setting))

def cells_for(size, only=EXPERIMENTS, eps=EPS, horizon=None, base_seed=0):
    """Every cell of the suite, in the order of the output. ``size``: :func:`harness.sizes` of SIZES."""
    b, out = base_seed, []
    if "offpolicy-tabular" in only:
        for name, beta in ADD_BETA.items():
            for n in (2, 3, 4, 8):
                for seq in ("constant", "round-robin"):
                    out.append(_cell("offpolicy-tabular", "add_beta_tabular", name, seq, n, "one context",
                                     size["long_rounds"], 1, b, beta=beta, sequence=seq))
                out.append(_cell("offpolicy-tabular", "add_beta_tabular", name, "sample", n, POOL,
                                 size["long_rounds"], size["seeds"], b, beta=beta, sequence=None))
    if "offpolicy-sequence" in only:
        for name in ("KT", "Laplace"):
            for n, depth in SEQUENCE_TREES:
                depth = horizon if horizon is not None else depth
                out.append(_cell("offpolicy-sequence", "add_beta_sequence", name, "sample", n,
                                 f"prefix tree depth={depth} K=3", size["long_rounds"], size["seeds"], b,
                                 beta=ADD_BETA[name], depth=depth))
    if "onpolicy-tabular" in only:
        for name, (schedule, eta0) in RKL_LEARNERS.items():
            for e in eps:
                out.append(_cell("onpolicy-tabular", "rkl_tabular", name, "alternating", 2, f"e={e:g}",
                                 size["long_rounds"], 1, b, schedule=schedule, eta0=eta0, eps=e))
            for n in (2, 4):
                for feedback in ("sample", "full"):
                    out.append(_cell("onpolicy-tabular", "rkl_tabular", name, feedback, n, f"pool {POOL}",
                                     size["rounds"], size["seeds"], b, schedule=schedule, eta0=eta0, eps=None))
    if "onpolicy-sequence" in only:
        for name, mode in ((names.SEQ_RKL, "sequence"), (names.TOKEN_RKL, "token")):
            for machine, default_h in ONPOLICY_MACHINES.items():
                H = horizon if horizon is not None else default_h
                setting = f"prefix-bias H={H}" if machine == "prefix-bias" else f"prefix tree depth={H} K=2"
                out.append(_cell("onpolicy-sequence", "rkl_sequence", name, "sample", 2, setting, size["rounds"],
                                 size["seeds"], b, mode=mode, machine=machine, H=H))
    if "function-approx" in only:
        for method, feedback in LOGLINEAR.items():
            out.append(_cell("function-approx", "loglinear", names.LOGLINEAR[method], feedback, 3,
                             "X=5 d=4 K=2 lambda=0.1", size["rounds"], size["fa_seeds"], b, lam=0.1, method=method))
    return out

# ------------------------------------------------------------------------------------------------
# one function per kind of cell; each returns {"rows", "theory", "slopes" (metric -> theory slope)}
# ------------------------------------------------------------------------------------------------
def _pool(n, seed, K=3):
    """K Dirichlet(1) teachers over n tokens, fixed per (n, seed); (K, n)."""
    return np.random.default_rng(1000 + 17 * n + seed).dirichlet(np.ones(n), size=K)

def _theory(cell, grid, metric, curve, values):
    c = cell.settings
    return pd.DataFrame({"experiment": cell.experiment, "learner": c["learner"], "feedback": c["feedback"],
                         "n_actions": c["n_actions"], "metric": metric, "setting": c["setting"],
                         "curve": curve, "t": grid, "value": np.asarray(values, dtype=float)})

def _result(cell, grid, metrics, slopes, curves=()):
    c = cell.settings

    def rows(values, metric):
        R, G = values.shape
        return pd.DataFrame({
            "experiment": cell.experiment, "learner": c["learner"], "feedback": c["feedback"],
            "n_actions": c["n_actions"], "seed": np.repeat(np.arange(R), G), "t": np.tile(grid, R),
            "regret": values.ravel(), "metric": metric, "setting": c["setting"]})
    frame = pd.concat([rows(v, m) for m, v in metrics.items()], ignore_index=True)
    curves = pd.concat(curves, ignore_index=True) if curves else pd.DataFrame(columns=THEORY_COLUMNS)
    return {"rows": frame[ROW_COLUMNS], "theory": curves[THEORY_COLUMNS], "slopes": slopes}

def run_add_beta_tabular(cell):
    c, n, T, seeds = cell.settings, cell["n_actions"], cell["n_rounds"], cell.seed_array()
    beta, sequence = c["beta"], c["sequence"]
    if sequence is None:
        res = online.add_beta_tabular(_pool(n, 0), TEACHER_WEIGHTS, beta, T, seeds)
        return _result(cell, res["grid"], {"regret": res["regret"], "pseudo": res["pseudo"]},
                       {"regret": (n - 1) / 2, "pseudo": (n - 1) / 2})
    res = online.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, T, seeds, sequence=sequence)
    grid = res["grid"]
    if sequence == "constant":
        curves = [_theory(cell, grid, "regret", "closed form", closed_forms.add_beta_constant_sequence(grid, n, beta))]
        if c["learner"] == "KT":
            curves.append(_theory(cell, grid, "regret", "Shtarkov minimax ln C_t",
                                  [closed_forms.shtarkov_log_complexity(int(t), n) for t in grid]))
        return _result(cell, grid, {"regret": res["regret"]}, {"regret": (n - 1) * beta}, curves)
    curves = [_theory(cell, grid, "regret", "closed form", closed_forms.add_beta_round_robin(grid, n, beta))]
    return _result(cell, grid, {"regret": res["regret"]}, {"regret": (n - 1) / 2}, curves)

def run_add_beta_sequence(cell):
    n, depth = cell["n_actions"], cell["depth"]
    teachers = examples.prefix_tree(3, depth, n, seed=7 + n)
    res = online.add_beta_sequence(teachers, TEACHER_WEIGHTS, depth, cell["beta"], cell["n_rounds"], cell.seed_array())
    slope = res["visited"] * (n - 1) / 2
    curves = [_theory(cell, res["grid"], "regret", "sum_s (n-1)/2 ln t", slope * np.log(res["grid"]))]
    return _result(cell, res["grid"], {"regret": res["regret"], "pseudo": res["pseudo"]},
                   {"regret": slope, "pseudo": slope}, curves)

def run_rkl_tabular(cell):
    c, n, e = cell.settings, cell["n_actions"], cell["eps"]
    if e is not None:
        log_probs, w, feedback = np.log([[1 - e, e], [e, 1 - e]]), [0.5, 0.5], "alternating"
    else:
        log_probs, w, feedback = np.log(_pool(n, 1)), TEACHER_WEIGHTS, c["feedback"]
    res = online.rkl_tabular(log_probs, w, feedback, c["schedule"], c["n_rounds"], cell.seed_array(), eta0=c["eta0"])
    ftl_like = c["schedule"] in ("1/t", "1/(t+1)")
    if not ftl_like:
        slopes = {"regret": math.nan, "pseudo": math.nan}
    elif feedback == "full":
        slopes = {"regret": 0.0, "pseudo": 0.0}
    elif feedback == "alternating":
        slopes = {"regret": closed_forms.alternating_constant(e), "pseudo": 0.0}
    else:
        const = closed_forms.ftl_constant(log_probs, w)
        slopes = {"regret": const, "pseudo": const}
    grid = res["grid"]
    if feedback == "full":              # exact for every schedule: R_T = sum_t KL(q_t || G)
        exact = closed_forms.full_feedback_regret(log_probs, w, c["schedule"], int(grid[-1]), c["eta0"])[grid - 1]
        curves = [_theory(cell, grid, m, "exact sum_t KL(q_t || G)", exact) for m in ("regret", "pseudo")]
    else:
        curves = [_theory(cell, grid, "regret", "c ln t", slopes["regret"] * np.log(grid))] if ftl_like else []
    return _result(cell, grid, {"regret": res["regret"], "pseudo": res["pseudo"]}, slopes, curves)

def run_rkl_sequence(cell):
    H, w = cell["H"], [0.5, 0.5]
    if cell["machine"] == "prefix-bias":
        teachers = examples.prefix_bias_teachers([0.9, 0.9], [[0.9, 0.1], [0.1, 0.9]])
        horizon = H + 1                                # first token C / I, then H more
    else:
        teachers = examples.prefix_tree(2, H, cell["n_actions"], seed=11)
        horizon = H
    res = online.rkl_sequence(teachers, w, horizon, cell["mode"], cell["n_rounds"], cell.seed_array())
    metrics = {"regret": res["regret"], "pseudo": res["pseudo"], "token": res["token"]}
    curves = []
    if cell["mode"] == "token":
        gap = ag.sequence_kl(teachers, w, horizon, ag.local_geometric_conditionals(teachers, w))
        curves.append(_theory(cell, res["grid"], "pseudo", "t KL_seq(l || G_seq)", gap * res["grid"]))
    return _result(cell, res["grid"], metrics, {m: math.nan for m in metrics}, curves)

def loglinear_problem(n):
    """The function-approximation setting: X = 5 contexts, d = 4 shared Gaussian features, K = 2
    Dirichlet teachers per context (fixed seed)."""
    rng = np.random.default_rng(2024)
    return rng.normal(size=(5, n, 4)), rng.dirichlet(np.ones(n), size=(2, 5))

def run_loglinear(cell):
    c, n, T = cell.settings, cell["n_actions"], cell["n_rounds"]
    features, probs = loglinear_problem(n)
    res = online.loglinear(features, probs, [0.5, 0.5], c["method"], c["lam"], T, cell.seed_array(),
                      grid=analysis.log_grid(T, 8))
    # no closed-form constant: the Hazan-Agarwal-Kale bounds hold for every sequence and sit 100x
    # above these curves (paper_repro T5); logarithmic growth is checked decade by decade instead
    return _result(cell, res["grid"], {"regret": res["regret"]}, {"regret": math.nan})

RUNNERS = {"add_beta_tabular": run_add_beta_tabular, "add_beta_sequence": run_add_beta_sequence,
           "rkl_tabular": run_rkl_tabular, "rkl_sequence": run_rkl_sequence, "loglinear": run_loglinear}

def run_cell(cell):
    return RUNNERS[cell.kind](cell)

# CPU seconds per seed x round of each kind of cell at the default sizes (benchmarks/regret_cell_costs.csv,
# written by benchmarks/bench_regret_cells.py): the progress bar's weights. The 7 function-approximation
# cells are about two thirds of the default run's CPU time; counted as 7 of 95 cells, the ETA misled.
CELL_COST = {"add_beta_tabular": 4.42e-07, "add_beta_sequence": 1.78e-07, "rkl_tabular": 4.2e-08,
             "rkl_sequence": 1.51e-06, "loglinear": 5.09e-05}

def cell_cost(cell):
    """The expected cost of a cell (its progress bar weight): CELL_COST of its kind x seeds x rounds."""
    return CELL_COST[cell.kind] * cell.seeds * cell["n_rounds"]

# ------------------------------------------------------------------------------------------------
# outputs
# ------------------------------------------------------------------------------------------------
def summarise(cells, results):
    """One row per (cell, metric): the fitted slope over the last two decades and the theory slope."""
    rows = []
    for cell, res in zip(cells, results):
        df, c = res["rows"], cell.settings
        for metric, theory_slope in res["slopes"].items():
            wide = df[df.metric == metric].pivot(index="seed", columns="t", values="regret")
            kind, slope, exponent = analysis.growth(wide.columns.to_numpy(), wide.to_numpy())
            if kind != "logarithmic":               # a slope on ln t means nothing here
                slope = (math.nan,) * 3
            rows.append({"experiment": cell.experiment, "learner": c["learner"], "feedback": c["feedback"],
                         "n_actions": c["n_actions"], "slope": slope[0], "slope_lo": slope[1], "slope_hi": slope[2],
                         "theory_slope": theory_slope, "metric": metric, "setting": c["setting"],
                         "n_seeds": cell.seeds, "T": c["n_rounds"], "growth": kind, "exponent": exponent[0],
                         "exponent_lo": exponent[1], "exponent_hi": exponent[2]})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)

def write_outputs(out_dir, cells, results):
    theory_frames = [r["theory"] for r in results if len(r["theory"])]
    frames = {"regret.csv": pd.concat([r["rows"] for r in results], ignore_index=True),
              "summary.csv": summarise(cells, results),
              "theory.csv": pd.concat(theory_frames, ignore_index=True) if theory_frames
              else pd.DataFrame(columns=THEORY_COLUMNS)}
    for name, df in frames.items():
        write_csv(os.path.join(out_dir, name), df)

# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    size = sizes(SIZES, args.quick, rounds=args.n_rounds, seeds=args.seeds)
    cells = cells_for(size, args.only or EXPERIMENTS, args.eps, args.horizon, args.base_seed)
    results = run_cells(cells, run_cell, args.out, resume=args.resume, executor=args.executor,
                        scheduler=args.scheduler, progress=not args.quiet, desc="regret", cost=cell_cost)
    write_outputs(args.out, cells, results)
    if not args.no_figures:
        import figures
        figures.rebuild(args.out, fig_dir=args.figures, quiet=args.quiet)
    print(f"results in {os.path.abspath(args.out)}", file=sys.stderr)
    return 0

if __name__ == "__main__":
    # Import this file as the module sims.regret, so that dask pickles run_cell by reference.
    from sims.regret import main as _main
    sys.exit(_main())
