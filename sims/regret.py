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
               metric, setting, n_seeds, T: slope of the regret against ln t over the last two
               decades of t with a 95% Student-t interval over seeds
  theory.csv   the theory curves drawn beside the measurements
  cells/       one file per finished cell (written atomically), so a rerun resumes where it stopped
and the figures regret_<experiment>.png (to figures/ for the default --out, else OUT/figures).

Each experiment is a list of independent cells (SPEC section 3):
  offpolicy-tabular   add-beta (KT, Laplace, beta 0.1, 2) on one context: the constant and the
                      round-robin sequence (closed forms) and sample feedback from K = 3 teachers
  offpolicy-sequence  per-state KT / Laplace on prefix-tree teachers (aggregation.examples)
  onpolicy-tabular    FTL and exponentiated gradient on RKL: alternating teachers (1-e, e), (e, 1-e)
                      and i.i.d. teacher pools, sample and full feedback
  onpolicy-sequence   on-policy learners that see the teachers only on their own rollouts:
                      sequence-level RKL (reward-to-go) -> G_seq, per-token RKL -> the local l
  function-approx     log-linear student: OGD, online Newton step (off-policy), OGD on RKL (on-policy)
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from sims.cli import Parser, int_at_least  # noqa: E402
from sims.storage import atomic_write, remove_stale_temps  # noqa: E402

EXPERIMENTS = ("offpolicy-tabular", "offpolicy-sequence", "onpolicy-tabular", "onpolicy-sequence",
               "function-approx")
ROW_COLUMNS = ["experiment", "learner", "feedback", "n_actions", "seed", "t", "regret", "metric", "setting"]
SUMMARY_COLUMNS = ["experiment", "learner", "feedback", "n_actions", "slope", "slope_lo", "slope_hi",
                   "theory_slope", "metric", "setting", "n_seeds", "T"]
THEORY_COLUMNS = ["experiment", "learner", "feedback", "n_actions", "metric", "setting", "curve", "t", "value"]
DEFAULT_OUT = os.path.join("results", "regret")
FLOAT_FORMAT = "%.10g"
PROG = "regret.py"


@dataclass
class Config:
    """Sizes of the suite; ``None`` takes the default of the mode (full or --quick)."""
    quick: bool = False
    seeds: int | None = None               # seeds per stochastic cell (deterministic cells run one)
    n_rounds: int | None = None            # --T: rounds of every cell
    horizon: int | None = None             # --horizon: response length of the sequence experiments
    eps: tuple = (0.1, 1e-2, 1e-3, 1e-4)   # alternating teachers (1-e, e), (e, 1-e)
    base_seed: int = 0
    only: tuple = EXPERIMENTS

    def size(self, full, quick):
        return self.n_rounds if self.n_rounds is not None else (quick if self.quick else full)

    def n_seeds(self, full=20, quick=4):
        return self.seeds if self.seeds is not None else (quick if self.quick else full)


@dataclass
class Cell:
    """One independent unit of work: one learner on one setting, all its seeds."""
    experiment: str
    learner: str
    feedback: str
    n_actions: int
    setting: str
    kind: str                              # which branch of run_cell
    n_rounds: int
    n_seeds: int
    base_seed: int
    params: dict = field(default_factory=dict)

    @property
    def key(self):
        blob = json.dumps(asdict(self), sort_keys=True, default=str)
        return f"{self.experiment}__{hashlib.sha1(blob.encode()).hexdigest()[:16]}"

    @property
    def stream_key(self):
        """What the random streams depend on: the setting, not the sizes (so --T extends a run)."""
        return json.dumps([self.experiment, self.learner, self.feedback, self.n_actions, self.setting])


# ------------------------------------------------------------------------------------------------
# the settings (data, not code)
# ------------------------------------------------------------------------------------------------
ADD_BETA = {"KT": 0.5, "Laplace": 1.0, "add-0.1": 0.1, "add-2": 2.0}
RKL_LEARNERS = {"FTL": ("1/t", 1.0), "EG 1/(t+1)": ("1/(t+1)", 1.0), "EG 1/sqrt(t)": ("1/sqrt(t)", 1.0),
                "EG constant 0.1": ("constant", 0.1)}
TEACHER_WEIGHTS = (0.5, 0.3, 0.2)
POOL = "K=3 w=0.5/0.3/0.2"


def cells_for(config):
    """Every cell of the configured suite, in the canonical order of the output."""
    c = config
    out = []
    if "offpolicy-tabular" in c.only:
        for name, beta in ADD_BETA.items():
            for n in (2, 3, 4, 8):
                for seq in ("constant", "round-robin"):
                    out.append(Cell("offpolicy-tabular", name, seq, n, "one context", "add_beta_tabular",
                                    c.size(10**6, 10**4), 1, c.base_seed, {"beta": beta, "sequence": seq}))
                out.append(Cell("offpolicy-tabular", name, "sample", n, POOL, "add_beta_tabular",
                                c.size(10**6, 10**4), c.n_seeds(), c.base_seed, {"beta": beta, "sequence": None}))
    if "offpolicy-sequence" in c.only:
        for name in ("KT", "Laplace"):
            for n, depth in ((2, 4), (3, 3)):
                depth = c.horizon if c.horizon is not None else depth
                out.append(Cell("offpolicy-sequence", name, "sample", n, f"prefix tree depth={depth} K=3",
                                "add_beta_sequence", c.size(10**5, 10**3), c.n_seeds(), c.base_seed,
                                {"beta": ADD_BETA[name], "depth": depth}))
    if "onpolicy-tabular" in c.only:
        for name, (schedule, eta0) in RKL_LEARNERS.items():
            for e in c.eps:
                out.append(Cell("onpolicy-tabular", name, "alternating", 2, f"e={e:g}", "rkl_tabular",
                                c.size(10**6, 10**4), 1, c.base_seed, {"schedule": schedule, "eta0": eta0, "eps": e}))
            for n in (2, 4):
                for feedback in ("sample", "full"):
                    out.append(Cell("onpolicy-tabular", name, feedback, n, f"pool {POOL}", "rkl_tabular",
                                    c.size(10**5, 10**3), c.n_seeds(), c.base_seed,
                                    {"schedule": schedule, "eta0": eta0, "eps": None}))
    if "onpolicy-sequence" in c.only:
        for name, mode in (("sequence-level RKL", "sequence"), ("per-token RKL", "token")):
            for machine in ("prefix-bias", "tree"):
                H = c.horizon if c.horizon is not None else (6 if machine == "prefix-bias" else 3)
                setting = f"prefix-bias H={H}" if machine == "prefix-bias" else f"prefix tree depth={H} K=2"
                out.append(Cell("onpolicy-sequence", name, "sample", 2, setting, "rkl_sequence",
                                c.size(10**5, 10**3), c.n_seeds(), c.base_seed, {"mode": mode, "machine": machine, "H": H}))
    if "function-approx" in c.only:
        for name, feedback in (("OGD", "sample"), ("ONS", "sample"), ("OGD-RKL", "full")):
            out.append(Cell("function-approx", name, feedback, 3, "X=5 d=4 K=2 lambda=0.1", "loglinear",
                            c.size(10**5, 10**3), c.n_seeds(10, 3), c.base_seed, {"lam": 0.1}))
    return out


# ------------------------------------------------------------------------------------------------
# running one cell
# ------------------------------------------------------------------------------------------------
def _pool(n, seed, K=3):
    """K Dirichlet(1) teachers over n tokens, fixed per (n, seed); (K, n)."""
    return np.random.default_rng(1000 + 17 * n + seed).dirichlet(np.ones(n), size=K)


def _rows(cell, grid, values, metric):
    R, G = values.shape
    return pd.DataFrame({
        "experiment": cell.experiment, "learner": cell.learner, "feedback": cell.feedback,
        "n_actions": cell.n_actions, "seed": np.repeat(np.arange(R), G), "t": np.tile(grid, R),
        "regret": values.ravel(), "metric": metric, "setting": cell.setting})


def _theory(cell, grid, metric, curve, values):
    return pd.DataFrame({"experiment": cell.experiment, "learner": cell.learner, "feedback": cell.feedback,
                         "n_actions": cell.n_actions, "metric": metric, "setting": cell.setting,
                         "curve": curve, "t": grid, "value": np.asarray(values, dtype=float)})


def sequence_kl_local_to_geometric(teachers, weights, horizon):
    """KL_seq(l || G_seq) = sum_h sum_s occ_l(h, s) KL(l(.|s) || g(.|h, s)) (SPEC 2): the per-round
    sequence-level regret of a learner that has converged to the local geometric pool l."""
    import aggregation as ag
    log_g = ag.sequence_geometric_conditionals(teachers, weights, horizon)
    log_l = ag.local_geometric_conditionals(teachers, weights)
    occ = ag.state_occupancy(teachers, weights, horizon, target="local")[:horizon]
    kl = np.sum(np.exp(log_l)[None] * (log_l[None] - log_g), axis=2)
    return float(np.sum(occ * kl))


def run_cell(cell):
    """Run one cell; returns {"rows": DataFrame, "theory": DataFrame, "slopes": {metric: theory slope}}."""
    from aggregation import examples

    from sims import learners as L

    seeds = L.cell_seeds(cell.base_seed, cell.stream_key, cell.n_seeds)
    p, n, T = cell.params, cell.n_actions, cell.n_rounds
    theory = []
    if cell.kind == "add_beta_tabular":
        beta = p["beta"]
        if p["sequence"] is None:
            res = L.add_beta_tabular(_pool(n, 0), TEACHER_WEIGHTS, beta, T, seeds)
            metrics = {"regret": res["regret"], "pseudo": res["pseudo"]}
            slopes = {"regret": (n - 1) / 2, "pseudo": (n - 1) / 2}
        else:
            res = L.add_beta_tabular(np.full((1, n), 1.0 / n), [1.0], beta, T, seeds, sequence=p["sequence"])
            metrics = {"regret": res["regret"]}
            grid = res["grid"]
            if p["sequence"] == "constant":
                slopes = {"regret": (n - 1) * beta}
                theory.append(_theory(cell, grid, "regret", "closed form", L.add_beta_constant_sequence(grid, n, beta)))
                if cell.learner == "KT":
                    theory.append(_theory(cell, grid, "regret", "Shtarkov minimax ln C_t",
                                          [L.shtarkov_log_complexity(int(t), n) for t in grid]))
            else:
                slopes = {"regret": (n - 1) / 2}
                theory.append(_theory(cell, grid, "regret", "closed form", L.add_beta_round_robin(grid, n, beta)))
    elif cell.kind == "add_beta_sequence":
        teachers = examples.prefix_tree(3, p["depth"], n, seed=7 + n)
        res = L.add_beta_sequence(teachers, TEACHER_WEIGHTS, p["depth"], p["beta"], T, seeds)
        metrics = {"regret": res["regret"], "pseudo": res["pseudo"]}
        slope = res["visited"] * (n - 1) / 2
        slopes = {"regret": slope, "pseudo": slope}
        theory.append(_theory(cell, res["grid"], "regret", "sum_s (n-1)/2 ln t", slope * np.log(res["grid"])))
    elif cell.kind == "rkl_tabular":
        if p["eps"] is not None:
            e = p["eps"]
            log_probs, w, feedback = np.log([[1 - e, e], [e, 1 - e]]), [0.5, 0.5], "alternating"
        else:
            log_probs, w, feedback = np.log(_pool(n, 1)), TEACHER_WEIGHTS, cell.feedback
        res = L.rkl_tabular(log_probs, w, feedback, p["schedule"], T, seeds, eta0=p["eta0"])
        metrics = {"regret": res["regret"], "pseudo": res["pseudo"]}
        ftl_like = p["schedule"] in ("1/t", "1/(t+1)")
        if not ftl_like:
            slopes = {"regret": math.nan, "pseudo": math.nan}
        elif feedback == "full":
            slopes = {"regret": 0.0, "pseudo": 0.0}
        elif feedback == "alternating":
            slopes = {"regret": L.alternating_constant(p["eps"]), "pseudo": 0.0}
        else:
            c = L.ftl_constant(log_probs, w)
            slopes = {"regret": c, "pseudo": c}
        if ftl_like and feedback != "full":
            theory.append(_theory(cell, res["grid"], "regret", "c ln t", slopes["regret"] * np.log(res["grid"])))
    elif cell.kind == "rkl_sequence":
        if p["machine"] == "prefix-bias":
            teachers = examples.prefix_bias_teachers([0.9, 0.9], [[0.9, 0.1], [0.1, 0.9]])
            horizon = p["H"] + 1                       # first token C / I, then H more
        else:
            teachers = examples.prefix_tree(2, p["H"], n, seed=11)
            horizon = p["H"]
        w = [0.5, 0.5]
        res = L.rkl_sequence(teachers, w, horizon, p["mode"], T, seeds)
        metrics = {"regret": res["regret"], "pseudo": res["pseudo"], "token": res["token"]}
        slopes = {m: math.nan for m in metrics}
        if p["mode"] == "token":
            gap = sequence_kl_local_to_geometric(teachers, w, horizon)
            theory.append(_theory(cell, res["grid"], "pseudo", "t KL_seq(l || G_seq)", gap * res["grid"]))
    elif cell.kind == "loglinear":
        rng = np.random.default_rng(2024)
        features = rng.normal(size=(5, n, 4))
        probs = rng.dirichlet(np.ones(n), size=(2, 5))
        res = L.loglinear(features, probs, [0.5, 0.5], cell.learner, p["lam"], T, seeds, grid=L.log_grid(T, 8))
        metrics = {"regret": res["regret"]}
        slopes = {"regret": res["bound_slope"] if cell.learner == "OGD" else math.nan}
        if cell.learner == "OGD":
            theory.append(_theory(cell, res["grid"], "regret", "Hazan-Agarwal-Kale bound",
                                  L.hak_bound(res["grid"], res["G"], p["lam"])))
    else:
        raise ValueError(f"unknown cell kind {cell.kind!r}")
    grid = res["grid"]
    rows = pd.concat([_rows(cell, grid, v, m) for m, v in metrics.items()], ignore_index=True)
    theory_df = pd.concat(theory, ignore_index=True) if theory else pd.DataFrame(columns=THEORY_COLUMNS)
    return {"rows": rows[ROW_COLUMNS], "theory": theory_df[THEORY_COLUMNS], "slopes": slopes}


# ------------------------------------------------------------------------------------------------
# results: atomic per-cell files, summary, CSVs
# ------------------------------------------------------------------------------------------------
def _cell_path(out_dir, cell):
    return os.path.join(out_dir, "cells", cell.key + ".pkl")


def save_cell(out_dir, cell, result):
    atomic_write(_cell_path(out_dir, cell), lambda tmp: pd.to_pickle(result, tmp))


def load_cell(out_dir, cell):
    path = _cell_path(out_dir, cell)
    if not os.path.exists(path):
        return None
    try:
        return pd.read_pickle(path)
    except Exception:                           # unreadable: recompute the cell
        return None


def summarise(cells, results):
    """One row per (cell, metric): the fitted slope over the last two decades and the theory slope."""
    from sims.learners import fit_slope
    rows = []
    for cell, res in zip(cells, results):
        df = res["rows"]
        for metric, theory_slope in res["slopes"].items():
            wide = df[df.metric == metric].pivot(index="seed", columns="t", values="regret")
            slope, lo, hi = fit_slope(wide.columns.to_numpy(), wide.to_numpy())
            rows.append({"experiment": cell.experiment, "learner": cell.learner, "feedback": cell.feedback,
                         "n_actions": cell.n_actions, "slope": slope, "slope_lo": lo, "slope_hi": hi,
                         "theory_slope": theory_slope, "metric": metric, "setting": cell.setting,
                         "n_seeds": cell.n_seeds, "T": cell.n_rounds})
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)


def write_outputs(out_dir, cells, results):
    regret = pd.concat([r["rows"] for r in results], ignore_index=True)
    theory = pd.concat([r["theory"] for r in results if len(r["theory"])], ignore_index=True) \
        if any(len(r["theory"]) for r in results) else pd.DataFrame(columns=THEORY_COLUMNS)
    summary = summarise(cells, results)
    for name, df in (("regret.csv", regret), ("summary.csv", summary), ("theory.csv", theory)):
        atomic_write(os.path.join(out_dir, name),
                     lambda tmp, df=df: df.to_csv(tmp, index=False, float_format=FLOAT_FORMAT))
    return regret, summary, theory


# ------------------------------------------------------------------------------------------------
# executors
# ------------------------------------------------------------------------------------------------
def run_local(todo, out_dir, bar):
    for cell in todo:
        bar.set_postfix_str(f"{cell.experiment} {cell.learner} {cell.feedback} n={cell.n_actions}")
        save_cell(out_dir, cell, run_cell(cell))
        bar.update()


def run_dask(todo, out_dir, bar, scheduler):
    """Submit every cell to a dask.distributed cluster (a 2-worker LocalCluster on loopback when no
    scheduler address is given); each result is saved as it arrives, so resume works the same."""
    from dask.distributed import Client, LocalCluster, as_completed
    cluster = None
    if scheduler is None:
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1", processes=True,
                               dashboard_address=None)
        client = Client(cluster)
    else:
        client = Client(scheduler, timeout="20s")
    try:
        futures = {client.submit(run_cell, cell, pure=False): cell for cell in todo}
        for fut in as_completed(futures):
            save_cell(out_dir, futures[fut], fut.result())
            bar.update()
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
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


def _experiments(text):
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    if not names:
        raise argparse.ArgumentTypeError("--only needs at least one experiment")
    for name in names:
        if name not in EXPERIMENTS:
            raise argparse.ArgumentTypeError(f"unknown experiment {name!r} (choose from {', '.join(EXPERIMENTS)})")
    return names


def parse_args(argv):
    ap = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (seconds); the tests use it")
    ap.add_argument("--out", default=DEFAULT_OUT, help="output folder (default results/regret)")
    ap.add_argument("--figures", default=None,
                    help="folder of the PNGs (default figures/, or OUT/figures when --out is given)")
    ap.add_argument("--no-figures", action="store_true", help="write the CSVs only")
    ap.add_argument("--seeds", type=int_at_least(1, "--seeds"), default=None, help="seeds per stochastic cell")
    ap.add_argument("--T", "--rounds", dest="n_rounds", type=int_at_least(1, "--T"), default=None,
                    help="rounds of every cell")
    ap.add_argument("--horizon", type=int_at_least(1, "--horizon"), default=None,
                    help="response length of the sequence experiments")
    ap.add_argument("--eps", type=_eps_list, default=(0.1, 1e-2, 1e-3, 1e-4),
                    help="alternating-teacher values e, each in (0, 1/2), comma-separated")
    ap.add_argument("--only", type=_experiments, default=EXPERIMENTS,
                    help=f"comma-separated subset of: {', '.join(EXPERIMENTS)}")
    ap.add_argument("--base-seed", type=int_at_least(0, "--base-seed"), default=0)
    ap.add_argument("--executor", choices=("local", "dask"), default="local")
    ap.add_argument("--scheduler", default=None, help="address of a running dask scheduler (--executor dask)")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the finished cells in OUT/cells (default on)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    if args.scheduler is not None and args.executor != "dask":
        ap.error("--scheduler needs --executor dask")
    return args


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from tqdm import tqdm
    config = Config(quick=args.quick, seeds=args.seeds, n_rounds=args.n_rounds, horizon=args.horizon,
                    eps=args.eps, base_seed=args.base_seed, only=args.only)
    cells = cells_for(config)
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    remove_stale_temps(os.path.join(out_dir, "cells"))          # left by a killed run
    done = {c.key for c in cells if args.resume and load_cell(out_dir, c) is not None}
    todo = [c for c in cells if c.key not in done]
    start = time.time()
    with tqdm(total=len(cells), desc="regret cells", unit="cell", disable=args.quiet, file=sys.stderr) as bar:
        bar.update(len(done))
        if todo and args.executor == "dask":
            run_dask(todo, out_dir, bar, args.scheduler)
        elif todo:
            run_local(todo, out_dir, bar)
    results = [load_cell(out_dir, c) for c in cells]
    regret, summary, theory = write_outputs(out_dir, cells, results)
    print(f"{PROG}: {len(cells)} cells ({len(done)} resumed) in {time.time() - start:.1f} s -> {out_dir}",
          file=sys.stderr)
    if not args.no_figures:
        default_out = os.path.normpath(out_dir) == os.path.normpath(DEFAULT_OUT)
        fig_dir = args.figures or ("figures" if default_out else os.path.join(out_dir, "figures"))
        from figures.regret import save_all
        for path in save_all(regret, summary, theory, fig_dir):
            if not args.quiet:
                print(f"{PROG}: wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # Import this file as the module sims.regret, so that dask pickles run_cell by reference.
    from sims.regret import main as _main
    sys.exit(_main())
