"""Monte-Carlo KL estimators k1, k2, k3: bias and variance of values and gradients, importance weights over
long responses, top-k samplers (theory section 4; claims E2, E5). Exact where a sum over the vocabulary or a
recursion over the machine gives it (distillation.moments), Monte Carlo beside it as a check.

    python sims/estimators.py            # about 10 s on 2 cores
    python sims/estimators.py --quick

Writes to ``--out`` (default results/estimators):
  values.csv      per random pair (q, p) of n = 50 tokens and spread tau: KL(q || p), and for each
                  estimator the exact mean (exact_mean), bias and s.d. under x ~ q, and a Monte-Carlo mean with its
                  standard error (whole responses on finite-state teachers too: kind 'sequence')
  gradients.csv   per pair and configuration (estimator x loss / reward x student / teacher samples x
                  importance weights): relative bias of the expected gradient against the RKL and FKL
                  gradients, ``nearest`` (rkl, fkl, or zero: a mean gradient that vanishes), the per-sample
                  covariance trace, and the samples needed for a 10% error
  is_horizon.csv  ln E_p[w^2] of the sequence-level importance weight against the horizon H on
                  IS_MACHINES random machines (column machine; exact up to 256, Monte Carlo for H <= 16 on
                  the first)
  topk.csv        E_q[k3] for a student sampling its top k only, against KL - p(V \\ S)
  verdicts.csv    each claim of theory section 4 checked on every random pair (every machine and teacher for the
                  weights' growth): the statistic's median and range, how many meet the rule, the verdict
                  (analysis.verdicts.draw_row; "k3 has a smaller variance than k1" per spread)
  figures/estimators.png
"""

import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import experiment_parser  # noqa: E402  (argparse only)

EXPERIMENTS = ("values", "gradients", "is-horizon", "topk")
DEFAULT_OUT = os.path.join("results", "estimators")


def parse_args(argv):
    return experiment_parser("estimators.py", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS).parse_args(argv)


if __name__ == "__main__":      # --help and a bad argument answer here, before numba, torch and pandas load
    parse_args(sys.argv[1:])


import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from scipy.special import logsumexp  # noqa: E402

import aggregation as ag  # noqa: E402
from analysis.verdicts import DRAW_COLUMNS, draw_row  # noqa: E402
from harness import Cell, run_cells, sizes, write_csv  # noqa: E402
from distillation import moments  # noqa: E402

SIZES = {"pairs": (20, 4), "mc_samples": (4000, 500), "mc_seeds": (400, 50)}
N_TOKENS = 50
SPREADS = (0.5, 1.0, 2.0)                     # the logits' standard deviation: how far apart q and p are
HORIZONS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
IS_MACHINES = 4                                # random machines (each with a student and 2 teachers) for the weights' growth
GROWTH_FROM = 64                               # the growth is read as the slope of ln E[w^2] over H >= this
ZERO_GRADIENT = 1e-9                           # a mean gradient this small relative to both references is zero
EXACT = 1e-9                                   # a relative error this small is an identity (float64 sums)
BIASED = 0.1                                   # a relative gradient error this large is a different target
TOPK_V, TOPK_KS = 1000, (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def random_pair(rng, n, spread):
    """(ln q, ln p): two softmaxes of N(0, spread^2) logits."""
    zq, zp = rng.normal(0, spread, n), rng.normal(0, spread, n)
    return zq - logsumexp(zq), zp - logsumexp(zp)


def cells_for(size, only, base_seed=0):
    out = []
    for exp in only:
        for tau in SPREADS if exp in ("values", "gradients", "topk") else (None,):
            settings = {"spread": tau, "pairs": size["pairs"], "mc_samples": size["mc_samples"],
                        "mc_seeds": size["mc_seeds"]}
            out.append(Cell(exp, exp, settings, base_seed=base_seed, stream=(exp, tau)))
    return out


def run_values(cell):
    rng = np.random.default_rng(cell.seed_array()[0])
    rows = []
    for i in range(cell["pairs"]):
        lq, lp = random_pair(rng, N_TOKENS, cell["spread"])
        kl = float(np.exp(lq) @ (lq - lp))
        x = rng.choice(N_TOKENS, size=cell["mc_samples"], p=np.exp(lq))
        r = lp[x] - lq[x]
        mc = moments.estimator_values(r)
        for est, (mean, var) in moments.value_moments(lq, lp).items():
            rows.append(dict(kind="token", spread=cell["spread"], pair=i, estimator=est, kl=kl, exact_mean=mean,
                             bias=mean - kl, sd=np.sqrt(var), mc_mean=float(mc[est].mean()),
                             mc_se=float(mc[est].std(ddof=1) / np.sqrt(x.size))))
    # whole responses: a student policy against the teachers' pool on a finite-state machine
    t = ag.FiniteStateTeachers(*_loop_machine(rng))
    H = 8
    log_q = np.log(rng.dirichlet(np.ones(t.n), size=t.S))
    log_l = ag.local_geometric_conditionals(t, [0.5, 0.5])
    kl_seq = ag.sequence_kl(t, [0.5, 0.5], H, log_q, target=log_l)
    sums = {e: [] for e in moments.ESTIMATORS}
    for _ in range(cell["mc_seeds"]):
        s, acc = t.start, {e: 0.0 for e in moments.ESTIMATORS}
        for _h in range(H):
            a = rng.choice(t.n, p=np.exp(log_q[s]))
            for e, v in moments.estimator_values(log_l[s, a] - log_q[s, a]).items():
                acc[e] += v
            s = t.next_state[s, a]
        for e in moments.ESTIMATORS:
            sums[e].append(acc[e])
    for e, v in sums.items():
        v = np.array(v)
        rows.append(dict(kind="sequence", spread=cell["spread"], pair=0, estimator=e, kl=kl_seq,
                         exact_mean=float("nan"), bias=float("nan"), sd=float(v.std(ddof=1)), mc_mean=float(v.mean()),
                         mc_se=float(v.std(ddof=1) / np.sqrt(v.size))))
    return pd.DataFrame(rows)


def _loop_machine(rng, S=4, n=3):
    """A looping machine of S states over n tokens and two Dirichlet(1) teachers: (next_state, log_probs)."""
    return rng.integers(0, S, size=(S, n)), np.log(rng.dirichlet(np.ones(n), size=(2, S)))


def run_gradients(cell):
    rng = np.random.default_rng(cell.seed_array()[0])
    rows = []
    for i in range(cell["pairs"]):
        lq, lp = random_pair(rng, N_TOKENS, cell["spread"])
        q, p = np.exp(lq), np.exp(lp)
        rkl = q * ((lq - lp) - q @ (lq - lp))                 # grad KL(q || p)
        fkl = q - p                                           # grad KL(p || q)
        for est in moments.ESTIMATORS:
            for mode in ("loss", "reward"):
                for source, imp in (("student", False), ("teacher", False), ("teacher", True)):
                    mean, trace = moments.gradient_moments(lq, lp, est, mode, source, imp)
                    rel = {name: float(np.linalg.norm(mean - ref) / np.linalg.norm(ref))
                           for name, ref in (("rkl", rkl), ("fkl", fkl))}
                    # a mean gradient that vanishes (k1 as a loss on student samples) is near neither: its
                    # two relative errors are 1 up to rounding, which must not pick a side
                    zero = np.linalg.norm(mean) < ZERO_GRADIENT * min(np.linalg.norm(rkl), np.linalg.norm(fkl))
                    target = "zero" if zero else "rkl" if rel["rkl"] <= rel["fkl"] else "fkl"
                    ref = fkl if target == "fkl" else rkl
                    rows.append(dict(spread=cell["spread"], pair=i, estimator=est, mode=mode, source=source,
                                     importance=imp, bias_vs_rkl=rel["rkl"], bias_vs_fkl=rel["fkl"], nearest=target,
                                     cov_trace=trace, samples_for_10pct=moments.samples_needed(mean, trace, ref)))
    return pd.DataFrame(rows)


def run_is_horizon(cell):
    rng = np.random.default_rng(cell.seed_array()[0])
    rows = []
    for m in range(IS_MACHINES):
        rows += _is_horizon_rows(rng, m, cell["mc_seeds"] * 10 if m == 0 else 0)
    return pd.DataFrame(rows)


def _is_horizon_rows(rng, machine, mc_samples):
    """ln E_p[w^2] against H on one random machine with a random student, exact, and by Monte Carlo
    (``mc_samples`` responses; 0: none) for H <= 16 (the first machine only: the check of the recursion)."""
    next_state, log_probs = _loop_machine(rng)
    log_q = np.log(rng.dirichlet(np.ones(3), size=4))             # a student
    rows = []
    for k in range(2):
        exact = moments.sequence_is_second_moment(next_state, 0, max(HORIZONS), log_q, log_probs[k])
        for H in HORIZONS:
            mc = mc_se = float("nan")
            if mc_samples and H <= 16:
                w2 = []
                for _ in range(mc_samples):
                    s, lw = 0, 0.0
                    for _h in range(H):
                        a = rng.choice(3, p=np.exp(log_probs[k, s]))
                        lw += log_q[s, a] - log_probs[k, s, a]
                        s = next_state[s, a]
                    w2.append(np.exp(2 * lw))
                w2 = np.array(w2)
                mc, mc_se = float(np.log(w2.mean())), float(w2.std(ddof=1) / np.sqrt(w2.size) / w2.mean())
            rows.append(dict(machine=machine, teacher=k, H=H, log_second_moment=float(exact[H]),
                             mc_log_second_moment=mc, mc_rel_se=mc_se, per_step=float(exact[H] / H)))
    return rows


def run_topk(cell):
    rng = np.random.default_rng(cell.seed_array()[0])
    rows = []
    for i in range(max(cell["pairs"] // 4, 1)):
        lq, lp = random_pair(rng, TOPK_V, cell["spread"])
        for k in TOPK_KS:
            e_k3, kl, tail = moments.topk_k3_bias(lq, lp, k)
            rows.append(dict(spread=cell["spread"], pair=i, k=k, e_k3=e_k3, kl=kl, teacher_tail=tail,
                             identity_error=e_k3 - (kl - tail)))
    return pd.DataFrame(rows)


def verdicts(values, gradients, topk, horizon, quick=False):
    """verdicts.csv: each claim of theory section 4 on every random pair (``analysis.verdicts.draw_row``, the pairs
    as units; every value here is exact, so every pair decides: every pair meets the rule, none, or some,
    with a stated condition when a property of the pairs separates them), from values.csv,
    gradients.csv, topk.csv and is_horizon.csv. ``quick``: the rows decide nothing."""
    rows = []
    token = values[values.kind == "token"].set_index(["spread", "pair", "estimator"])

    def pairs(claim, condition, statistic, vals, tolerance, at_most=True, unit="random pair"):
        spread = np.asarray(vals.index.get_level_values("spread"), dtype=float) if "spread" in vals.index.names \
            else None
        rows.append(draw_row(claim, condition, statistic, vals.to_numpy(), tolerance, at_most, unit=unit,
                             properties=None if spread is None else {"spread": spread}, quick=quick)[0])

    for est in ("k1", "k3"):
        pairs(f"{est} is unbiased for KL(q || p)", "x ~ q, exact over 50 tokens", "|E_q[estimator] - KL| (nats)",
              token.xs(est, level="estimator").bias.abs(), EXACT)
    pairs("k2 is biased", "x ~ q, exact over 50 tokens", "|E_q[k2] - KL| (nats)",
          token.xs("k2", level="estimator").bias.abs(), EXACT, at_most=False)
    gap = token.xs("k3", level="estimator").sd - token.xs("k1", level="estimator").sd
    for tau in SPREADS:
        pairs("k3 has a smaller variance than k1", f"x ~ q, one sample, exact, spread {tau:g}",
              "s.d.(k3) - s.d.(k1) (nats)", gap.xs(tau, level="spread"), 0.0)
    g = gradients.set_index(["estimator", "mode", "source", "importance"])

    def grad(est, mode, source="student", importance=False):
        return g.loc[(est, mode, source, importance)].set_index(["spread", "pair"])
    pairs("the k1 loss has zero expected gradient", "x ~ q", f"1 where the mean gradient is not below "
          f"{ZERO_GRADIENT:g} of both references", (grad("k1", "loss").nearest != "zero").astype(float), 0.0)
    for est, mode, ref in (("k2", "loss", "rkl"), ("k3", "loss", "fkl"), ("k1", "reward", "rkl")):
        pairs(f"the {est} {mode} gives the {ref.upper()} gradient", "x ~ q",
              f"|E[gradient] - grad {ref.upper()}| / |grad {ref.upper()}|", grad(est, mode)[f"bias_vs_{ref}"], EXACT)
    for est, mode in (("k2", "loss"), ("k1", "reward")):
        pairs(f"the {est} {mode} on teacher samples is biased (RKL needs student rollouts)", "x ~ p, unweighted",
              "|E[gradient] - grad RKL| / |grad RKL|", grad(est, mode, "teacher")["bias_vs_rkl"], BIASED, at_most=False)
        pairs(f"importance weights q / p restore the {est} {mode}'s RKL gradient on teacher samples", "x ~ p, weighted",
              "|E[gradient] - grad RKL| / |grad RKL|", grad(est, mode, "teacher", True)["bias_vs_rkl"], EXACT)
    pairs("E_q~[k3] = KL(q~ || p) - p(V \\ S) for a top-k sampler", f"V = {TOPK_V}, k in {TOPK_KS[0]}..{TOPK_KS[-1]}",
          "|identity error| (nats), largest over k", topk.groupby(["spread", "pair"]).identity_error.agg(
              lambda e: e.abs().max()), EXACT)
    pairs("the sequence importance weight's second moment grows exponentially with H",
          f"random 4-state machines ({horizon.machine.nunique()}) and students, H >= {GROWTH_FROM}",
          f"least-squares slope of ln E_p[w^2] against H over H in {GROWTH_FROM}..{int(horizon.H.max())} "
          "(nats per token; exact recursion)", growth_slopes(horizon), 0.1, at_most=False, unit="machine x teacher")
    return pd.DataFrame(rows, columns=list(DRAW_COLUMNS))


def growth_slopes(horizon):
    """Per (machine, teacher): the least-squares slope of ln E_p[w^2] against H over H >= GROWTH_FROM (an
    exponential growth has a constant positive slope; a polynomial one's falls like 1 / H)."""
    late = horizon[horizon.H >= GROWTH_FROM]
    return late.groupby(["machine", "teacher"]).apply(
        lambda d: float(np.polyfit(d.H.to_numpy(float), d.log_second_moment.to_numpy(float), 1)[0]))


RUNNERS = {"values": run_values, "gradients": run_gradients, "is-horizon": run_is_horizon, "topk": run_topk}


def run_cell(cell):
    return RUNNERS[cell.kind](cell)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    size = sizes(SIZES, args.quick, seeds=args.seeds)
    only = args.only or EXPERIMENTS
    cells = cells_for(size, only, args.base_seed)
    results = run_cells(cells, run_cell, args.out, resume=args.resume, executor=args.executor,
                        scheduler=args.scheduler, progress=not args.quiet, desc="estimators")
    frames = {}
    for exp, name in (("values", "values.csv"), ("gradients", "gradients.csv"), ("is-horizon", "is_horizon.csv"),
                      ("topk", "topk.csv")):
        parts = [r for c, r in zip(cells, results) if c.experiment == exp]
        if parts:
            frames[exp] = pd.concat(parts, ignore_index=True)
            write_csv(os.path.join(args.out, name), frames[exp])
    if len(frames) == len(EXPERIMENTS):
        write_csv(os.path.join(args.out, "verdicts.csv"),
                  verdicts(frames["values"], frames["gradients"], frames["topk"], frames["is-horizon"], quick=args.quick))
        if args.quick and not args.quiet:
            print("a quick run checks the pipeline, not the claims: verdicts.csv decides nothing", file=sys.stderr)
    if not args.no_figures:
        import figures
        figures.rebuild(args.out, fig_dir=args.figures, quiet=args.quiet)
    print(f"results in {os.path.abspath(args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    from sims.estimators import main as _main
    sys.exit(_main())
