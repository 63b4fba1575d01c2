"""The three mechanisms of multi-teacher distillation, exact and learned (theory section 1-3; claims T6-T8).

    python sims/mechanisms.py [confident-expert | low-prob | prefix-bias | all] [--quick] [--out DIR]

Writes ``OUT/<name>.csv`` (default OUT = results/mechanisms) and ``OUT/figures/mechanism_<name>.png``
(``python -m figures`` rebuilds them from the CSVs). Every CSV is tidy, one row per observation, with
the columns

    mechanism, part, learner, setting, x_name, x, seed, t, quantity, value

``part`` says what a row is: ``exact`` (a closed-form target swept over x), ``spec`` (the the theory's
worked values), ``target`` (the exact value a learned curve should reach), ``learned`` (a learner's
q_t at round t, one row per seed and log-grid round), and per mechanism a few summaries
(``veto-rounds``, ``regret-constant``, ``random-family``). Empty cells mean "not applicable".

confident-expert (T6)  one expert (1-(n-1)d, d, ..., d) and K-1 uniform teachers: A and G top
    probability against d, K, the expert's weight and the vocabulary size n; learned top probability
    of KT on teacher samples (FKL -> A) and of FTL on RKL (-> G), both on sampled teachers.
low-prob (T7)          teachers (0.9, 0.1) x m and (e, 1-e): G(correct) against e (e* = 1/82),
    against m and the vetoing teacher's weight; the learners against the three teachers; rounds until
    the on-policy learner pushes the correct token below 1/2; FTL's regret constant against e.
prefix-bias (T8)       g(C) against H on the theory's prefix-bias rows (H* marked), beside l and the mixture; the
    fraction of random finite-state instances whose g prefers the incorrect first token; the
    sequence-level RKL learner (-> g), the per-token one (-> l) and per-state KT (-> mixture).

Each mechanism is a list of cells (data below); a finished cell is saved atomically to OUT/cells/,
so an interrupted run resumes (--no-resume recomputes). Same seeds, same bytes. The closed forms are
in ``learners.closed_forms``, the learners in ``learners.online``.
"""

import math
import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import experiment_parser  # noqa: E402  (argparse only)

MECHANISMS = ("confident-expert", "low-prob", "prefix-bias")
DEFAULT_OUT = os.path.join("results", "mechanisms")


def parse_args(argv):
    ap = experiment_parser("mechanisms.py", __doc__.split("\n\n")[0], DEFAULT_OUT, MECHANISMS)
    ap.add_argument("mechanism", nargs="?", default="all", choices=MECHANISMS + ("all",),
                    help="which mechanism (default all; --only takes a comma-separated list)")
    args = ap.parse_args(argv)
    if args.only and args.mechanism != "all":
        ap.error("give the mechanism either as the argument or with --only, not both")
    args.names = args.only or (MECHANISMS if args.mechanism == "all" else (args.mechanism,))
    return args


if __name__ == "__main__":      # --help and a bad argument answer here, before numba, torch and pandas load
    parse_args(sys.argv[1:])


import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import aggregation as ag  # noqa: E402
from aggregation import examples  # noqa: E402
import analysis  # noqa: E402
from harness import Cell, run_cells, sizes, write_csv  # noqa: E402
from learners import closed_forms, online  # noqa: E402
from learners.names import FTL, G_SEQ, KT, L_LOCAL, MIXTURE, ROLLOUT, A, G  # noqa: E402

COLUMNS = ["mechanism", "part", "learner", "setting", "x_name", "x", "seed", "t", "quantity", "value"]

# ------------------------------------------------------------------------------------------------
# the settings (data, not code)
# ------------------------------------------------------------------------------------------------
SIZES = {   # full run / --quick
    "seeds": (10, 3),
    "rounds": (100_000, 2_000),               # learned curves
    "kt_vocab_rounds": (1_000_000, 20_000),   # KT needs t >> n/2 rounds to leave its uniform prior
    "ftl_vocab_rounds": (10_000, 500),        # FTL costs O(n) a round
    "rollout_vocab_rounds": (20_000, 500),    # so does the own-rollout learner, which also learns slower
    "veto_rounds": (100_000, 3_000),          # dense grid: every round
    "veto_seeds": (20, 4),
    "alternating_rounds": (1_000_000, 10_000),
    "iid_rounds": (100_000, 5_000),
    "instances": (400, 40),                   # random prefix-bias family, per disagreement level
}

CE_D = (0.05, 1e-2, 1e-4, 1e-8)               # theory section 1 table (K = 2, w = 1/2)
CE_K = (2, 5, 10, 50)                         # theory section 1, d = 1e-4, equal weights
CE_K_D = 1e-4
CE_VOCAB = (3, 100, 10_000)
CE_VOCAB_MASS = 1e-8                          # the expert's total mass off its top token, d = mass/(n-1)
LP_E_SPEC = (0.1, 0.02, 0.01, 1e-3, 1e-6, 0.0)
LP_E_LEARNED = (0.1, 0.02, 0.01, 1e-3, 1e-6)
LP_E_VETO = (1e-2, 5e-3, 2e-3, 1e-3, 1e-4, 1e-6, 1e-9, 1e-12)
LP_E_REGRET = (0.1, 1e-2, 1e-3, 1e-4, 1e-6)
LP_AGREE = (1, 2, 3, 5)
PB_ROWS = (   # theory section 2 table: p_k(C), continuation A_k after C, weights
    ((0.9, 0.9), ((0.9, 0.1), (0.1, 0.9)), (0.5, 0.5)),
    ((0.9, 0.9), ((0.8, 0.2), (0.2, 0.8)), (0.5, 0.5)),
    ((0.99, 0.8), ((0.8, 0.2), (0.2, 0.8)), (0.5, 0.5)),
    ((0.9, 0.9), ((0.8, 0.2), (0.2, 0.8)), (0.8, 0.2)),
)
PB_H_MAX = 30                                 # exact g(C) for H = 0 .. PB_H_MAX
PB_LEARNED = ((0, 2), (0, 8), (2, 6), (2, 20))   # (theory row, H): one H below H*, one above
PB_SIGMAS = (0.25, 0.5, 1.0, 2.0, 4.0)
PB_H = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)


def _cell(mechanism, part, label, base_seed, seeds=1, **params):
    return Cell(mechanism, f"{mechanism} {part}", dict(part=part, label=label, **params), seeds=seeds,
                base_seed=base_seed, stream=(mechanism, part, label))


def cells_for(mechanism, size, base_seed=0):
    """Every cell of one mechanism, in the order of its CSV. ``size``: :func:`harness.sizes` of SIZES."""
    b, seeds, rounds = base_seed, size["seeds"], size["rounds"]
    out = [_cell(mechanism, "exact", "closed forms", b)]
    if mechanism == "confident-expert":
        out += [_cell(mechanism, "learned", f"K={K}", b, seeds, K=K, n_rounds=rounds) for K in CE_K]
        out += [_cell(mechanism, "learned-vocab", f"n={n}", b, seeds, n=n, kt_rounds=size["kt_vocab_rounds"],
                      ftl_rounds=size["ftl_vocab_rounds"], rollout_rounds=size["rollout_vocab_rounds"])
                for n in CE_VOCAB]
    elif mechanism == "low-prob":
        out += [_cell(mechanism, "learned", f"e={e:g}", b, seeds, e=e, n_rounds=rounds) for e in LP_E_LEARNED]
        out += [_cell(mechanism, "veto-rounds", f"e={e:g}, every round", b, size["veto_seeds"], e=e,
                      n_rounds=size["veto_rounds"]) for e in LP_E_VETO]
        out.append(_cell(mechanism, "regret-constant", "FTL", b, seeds, alternating_rounds=size["alternating_rounds"],
                         iid_rounds=size["iid_rounds"]))
    elif mechanism == "prefix-bias":
        out += [_cell(mechanism, "random-family", f"sigma={sigma:g}", b, sigma=sigma, n_instances=size["instances"],
                      H=PB_H) for sigma in PB_SIGMAS]
        out += [_cell(mechanism, "learned", f"row {row + 1}, H={H}", b, seeds, row=row, H=H, n_rounds=rounds)
                for row, H in PB_LEARNED]
    else:
        raise ValueError(f"unknown mechanism {mechanism!r}")
    return out


def _frame(cell, part=None, **cols):
    """A tidy DataFrame of the cell; scalars broadcast, missing columns are empty (NaN)."""
    n = max((np.size(v) for v in cols.values() if not isinstance(v, str)), default=1)
    data = {"mechanism": cell.experiment, "part": part or cell["part"]}
    for name in COLUMNS[2:]:
        v = cols.get(name, np.nan)
        data[name] = v if isinstance(v, str) or np.ndim(v) == 0 else np.asarray(v)
    return pd.DataFrame(data, index=range(n))[COLUMNS]


def _learned_rows(cell, curves, setting, x_name, x, quantity):
    frames = []
    for name, (grid, q) in curves.items():
        R, G = q.shape
        frames.append(_frame(cell, "learned", learner=name, setting=setting, x_name=x_name, x=x,
                             seed=np.repeat(np.arange(R), G), t=np.tile(grid, R), quantity=quantity, value=q.ravel()))
    return frames


def _targets(cell, targets, setting, x_name, x, quantity):
    return [_frame(cell, "target", learner=name, setting=setting, x_name=x_name, x=x, quantity=quantity, value=v)
            for name, v in targets.items()]


TOP = "top-token probability"
CORRECT = "probability of the correct token"
FIRST_C = "first-token probability of C"
VETO_ROUNDS = "rounds until q(correct) < 1/2 for good"


def _pool_rows(cell, setting, x_name, xs, pools, quantity, part="exact"):
    """Rows of A and G, ``pools(x) -> (A, G)``, at every x of ``xs``."""
    values = np.array([pools(x) for x in xs])
    return [_frame(cell, part, learner=lab, setting=setting, x_name=x_name, x=np.asarray(xs), quantity=quantity,
                   value=values[:, j]) for j, lab in enumerate((A, G))]


def run_ce_exact(cell):
    """Exact A and G top probabilities against d, K, the expert's weight and n (theory section 1)."""
    d_grid = np.unique(np.concatenate([np.logspace(-12, math.log10(0.3), 61), CE_D]))
    frames = (_pool_rows(cell, "K=2, w=1/2", "d", d_grid, closed_forms.confident_expert_pools, TOP)
              + _pool_rows(cell, "K=2, w=1/2", "d", CE_D, closed_forms.confident_expert_pools, TOP, part="spec"))
    by_k = lambda K: closed_forms.confident_expert_pools(CE_K_D, K=int(K))               # noqa: E731
    frames += (_pool_rows(cell, f"d={CE_K_D:g}, equal w", "K", np.arange(2, 51), by_k, TOP)
               + _pool_rows(cell, f"d={CE_K_D:g}, equal w", "K", CE_K, by_k, TOP, part="spec"))
    for d in (1e-2, 1e-4, 1e-8):
        frames += _pool_rows(cell, f"K=2, d={d:g}", "expert weight", np.linspace(0.02, 0.98, 49),
                             lambda we, d=d: closed_forms.confident_expert_pools(d, expert_weight=we), TOP)
    n_grid = np.unique(np.round(np.logspace(math.log10(3), 4, 25)).astype(int))
    frames += _pool_rows(cell, f"K=2, expert mass off top={CE_VOCAB_MASS:g}", "n", n_grid,
                         lambda n: closed_forms.confident_expert_pools(CE_VOCAB_MASS / (n - 1), n=int(n)), TOP)
    return frames


def _ce_learned_rows(cell, probs, w, curves, setting, x_name, x):
    targets = {A: float(ag.arithmetic_pool(probs, w)[0]), G: float(ag.geometric_pool(probs, w)[0])}
    return (_learned_rows(cell, curves, setting, x_name, x, TOP)
            + _targets(cell, targets, setting, x_name, x, TOP))


def run_ce_learned(cell):
    """KT, FTL and the own-rollout learner against one expert and K - 1 uniform teachers."""
    K = cell["K"]
    probs, w = examples.confident_expert(CE_K_D, n_uniform=K - 1), np.full(K, 1.0 / K)
    curves = online.learn_one_context(probs, w, cell["n_rounds"], cell.seed_array())
    return _ce_learned_rows(cell, probs, w, curves, f"K={K}, d={CE_K_D:g}", "K", K)


def run_ce_learned_vocab(cell):
    """KT, FTL and the own-rollout learner against an expert and a uniform teacher over n tokens."""
    n = cell["n"]
    probs, w = examples.confident_expert(CE_VOCAB_MASS / (n - 1), n=n), np.array([0.5, 0.5])
    rounds = {KT: cell["kt_rounds"], FTL: cell["ftl_rounds"], ROLLOUT: cell["rollout_rounds"]}
    curves = online.learn_one_context(probs, w, rounds, cell.seed_array())
    return _ce_learned_rows(cell, probs, w, curves, f"n={n}, expert mass off top={CE_VOCAB_MASS:g}", "n", n)


def run_lp_exact(cell):
    """Exact G(correct) against e, the number m of agreeing teachers and the weights (theory section 1)."""
    frames = []
    e_grid = np.unique(np.concatenate([np.logspace(-12, math.log10(0.5), 89), LP_E_SPEC[:-1]]))
    for m in LP_AGREE:
        frames += _pool_rows(cell, f"{m} agreeing, equal w", "e", e_grid,
                             lambda e, m=m: closed_forms.low_prob_pools(e, m), CORRECT)
        frames.append(_frame(cell, learner="e*", setting=f"{m} agreeing, equal w", x_name="e",
                             quantity="veto threshold e*", value=closed_forms.veto_threshold(m)))
    frames += _pool_rows(cell, "2 agreeing, equal w", "e", LP_E_SPEC, closed_forms.low_prob_pools, CORRECT, part="spec")
    w_grid = np.linspace(0.02, 0.98, 49)
    for e in (1e-2, 1e-3, 1e-6):
        frames += _pool_rows(cell, f"2 agreeing, e={e:g}", "veto weight", w_grid,
                             lambda wv, e=e: closed_forms.low_prob_pools(e, 2, wv), CORRECT)
    frames.append(_frame(cell, learner="e*", setting="2 agreeing", x_name="veto weight", x=w_grid,
                         quantity="veto threshold e*", value=[closed_forms.veto_threshold(2, wv) for wv in w_grid]))
    return frames


REGRET_FAMILIES = {   # setting -> (legend, how the teachers arrive)
    "alternating": ("FTL, pair (1-e, e), (e, 1-e) in alternating order", "alternating"),
    "pair i.i.d.": ("FTL, the same pair drawn i.i.d. (k_t ~ w)", "sample"),
    "triple i.i.d.": ("FTL, low-prob triple drawn i.i.d. (k_t ~ w)", "sample"),
}


def run_lp_regret_constant(cell):
    """FTL's regret constant c (R_T ≈ c ln T) against e for three families, each against its formula:
    the pair in alternating order ((1/8) ln^2((1-e)/e), theory section 3), the same pair drawn i.i.d. and the
    low-probability triple drawn i.i.d. (both c = 1/2 sum_k w_k Var_G(ln p_k - r)). The pair's constant
    blows up as e -> 0 in either order: it comes from the teachers' disagreement under G, not from the
    order; the triple's stays bounded because G leaves the token the vetoing teacher disagrees on."""
    frames, seeds = [], cell.seed_array()
    for e in LP_E_REGRET:
        pair, triple = np.log([[1 - e, e], [e, 1 - e]]), np.log(examples.low_probability_teachers(e))
        for setting, (learner, feedback) in REGRET_FAMILIES.items():
            lp, w = (triple, np.full(3, 1 / 3)) if setting == "triple i.i.d." else (pair, np.array([0.5, 0.5]))
            rounds, family_seeds = ((cell["alternating_rounds"], seeds[:1]) if feedback == "alternating"
                                    else (cell["iid_rounds"], seeds))
            res = online.rkl_tabular(lp, w, feedback, "1/t", rounds, family_seeds)
            formula = closed_forms.alternating_constant(e) if feedback == "alternating" else closed_forms.ftl_constant(lp, w)
            frames.append(_frame(cell, learner=learner, setting=setting, x_name="e", x=e,
                                 quantity=["slope", "slope_lo", "slope_hi", "theory slope"],
                                 value=[*analysis.fit_slope(res["grid"], res["regret"]), formula]))
    return frames


def run_lp_learned(cell):
    """KT, FTL and the own-rollout learner against the three teachers (0.9, 0.1) x 2 and (e, 1 - e)."""
    e = cell["e"]
    probs, w = examples.low_probability_teachers(e), np.full(3, 1 / 3)
    curves = online.learn_one_context(probs, w, cell["n_rounds"], cell.seed_array())
    a, g = closed_forms.low_prob_pools(e)
    return (_learned_rows(cell, curves, cell["label"], "e", e, CORRECT)
            + _targets(cell, {A: a, G: g}, cell["label"], "e", e, CORRECT))


def run_lp_veto_rounds(cell):
    """Rounds until the on-policy learners push q_t(correct) below 1/2 for good (every round tracked)."""
    e, T, R = cell["e"], cell["n_rounds"], cell.seeds
    probs, w = examples.low_probability_teachers(e), np.full(3, 1 / 3)
    curves = online.learn_one_context(probs, w, T, cell.seed_array(), learners=(FTL, ROLLOUT), grid=np.arange(1, T + 1))
    d = np.log(probs[:, 0]) - np.log(probs[:, 1])               # per-teacher log-odds of the correct token
    scale = float(np.var(d) / np.mean(d) ** 2)                  # drift-diffusion scale (sigma / mu)^2
    frames = [_frame(cell, learner=name, setting=cell["label"], x_name="e", x=e, seed=np.arange(R), t=T,
                     quantity=VETO_ROUNDS, value=analysis.rounds_to_veto(q, grid))
              for name, (grid, q) in curves.items()]
    frames.append(_frame(cell, "target", learner="(sigma/mu)^2 of the log-odds", setting=cell["label"],
                         x_name="e", x=e, quantity=VETO_ROUNDS, value=scale))
    return frames


def run_pb_exact(cell):
    """Exact g(C) against H on the theory's prefix-bias rows, beside l and the mixture's marginal (theory section 2)."""
    frames = []
    for i, (pc, cont, w) in enumerate(PB_ROWS):
        ex = closed_forms.prefix_bias_exact(pc, cont, w, h_max=PB_H_MAX)
        setting = f"row {i + 1}: p={pc}, A={cont}, w={w}"
        H = np.arange(PB_H_MAX + 1)
        frames += [_frame(cell, learner=G_SEQ, setting=setting, x_name="H", x=H, quantity=FIRST_C, value=ex["g"]),
                   _frame(cell, learner=L_LOCAL, setting=setting, x_name="H", x=H, quantity=FIRST_C,
                          value=ex["local"]),
                   _frame(cell, learner=MIXTURE, setting=setting, x_name="H", x=H, quantity=FIRST_C,
                          value=ex["mixture"]),
                   _frame(cell, "spec", learner=G_SEQ, setting=setting,
                          quantity=["rho", "H*", "first H with g(C) < 1/2"],
                          value=[ex["rho"], ex["h_star"], ex["first_flip"]])]
    return frames


def run_pb_random_family(cell):
    """The fraction of random instances whose g prefers the incorrect first token, at one sigma."""
    sigma = cell["sigma"]
    frac, limit, gap = closed_forms.flip_fractions(sigma, cell["H"], cell["n_instances"], seed=cell.base_seed)
    setting = f"sigma={sigma:g}"
    return [_frame(cell, learner=G_SEQ, setting=setting, x_name="H", x=np.array(cell["H"]),
                   quantity="fraction with g(C) < 1/2", value=frac),
            _frame(cell, "target", learner=G_SEQ, setting=setting, x_name="sigma", x=sigma,
                   quantity=["limit fraction as H -> inf", "mean -ln z per token (nats)", "instances"],
                   value=[limit, gap, cell["n_instances"]])]


def run_pb_learned(cell):
    """The three sequence learners' q_t(C first) on one theory row at one H."""
    row, H = cell["row"], cell["H"]
    pc, cont, w = PB_ROWS[row]
    ex = closed_forms.prefix_bias_exact(pc, cont, w, h_max=max(H, PB_H_MAX))
    setting = f"row {row + 1}, H={H} (H*={ex['h_star']:.2f})"
    curves = online.learn_prefix(ex["teachers"], np.array(w), H + 1, cell["n_rounds"], cell.seed_array())
    targets = {G_SEQ: float(ex["g"][H]), L_LOCAL: ex["local"], MIXTURE: ex["mixture"]}
    return (_learned_rows(cell, curves, setting, "H", H, FIRST_C)
            + _targets(cell, targets, setting, "H", H, FIRST_C))


RUNNERS = {
    "confident-expert exact": run_ce_exact, "confident-expert learned": run_ce_learned,
    "confident-expert learned-vocab": run_ce_learned_vocab,
    "low-prob exact": run_lp_exact, "low-prob learned": run_lp_learned, "low-prob veto-rounds": run_lp_veto_rounds,
    "low-prob regret-constant": run_lp_regret_constant,
    "prefix-bias exact": run_pb_exact, "prefix-bias random-family": run_pb_random_family,
    "prefix-bias learned": run_pb_learned,
}


def run_cell(cell):
    """Run one cell; returns its tidy DataFrame (COLUMNS)."""
    return pd.concat(RUNNERS[cell.kind](cell), ignore_index=True)[COLUMNS]


# ------------------------------------------------------------------------------------------------
# command line
# ------------------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    size = sizes(SIZES, args.quick, seeds=args.seeds)
    cells = {name: cells_for(name, size, args.base_seed) for name in args.names}
    every = [c for name in args.names for c in cells[name]]
    results = dict(zip((c.key for c in every),
                       run_cells(every, run_cell, args.out, resume=args.resume, executor=args.executor,
                                 scheduler=args.scheduler, progress=not args.quiet, desc="mechanisms")))
    for name in args.names:
        path = os.path.join(args.out, f"{name}.csv")
        write_csv(path, pd.concat([results[c.key] for c in cells[name]], ignore_index=True))
        if not args.quiet:
            with pd.option_context("display.width", 200, "display.max_colwidth", 80, "display.max_rows", 100):
                print(f"\n{name}: learned q_T (mean, s.d. over seeds) and exact targets\n"
                      f"{analysis.final_values(pd.read_csv(path)).to_string(index=False, float_format=lambda v: f'{v:.4f}')}",
                      file=sys.stderr)
    if not args.no_figures:
        import figures
        figures.rebuild(args.out, fig_dir=args.figures, quiet=args.quiet)
    print(f"results in {os.path.abspath(args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # Import this file as the module sims.mechanisms, so that dask pickles run_cell by reference.
    from sims.mechanisms import main as _main
    sys.exit(_main())
