"""Speed of the regret kernels (KT and FTL) against vectorised NumPy versions, side by side in one run.

    python benchmarks/bench_regret.py [--rounds 1000000] [--seeds 16] [--repeats 3]

Throughput is rounds x seeds per second of the public wrapper (validation and table set-up
included) and of a NumPy version of the same computation vectorised over rounds (one seed at a
time: one-hot counts by cumsum, log-predictions, losses and pseudo-regret by cumulative sums), which
needs O(T n) memory per seed. Before timing, both are run on the same fixed token / teacher
sequence and must agree to 1e-8. Targets (issue 4): >= 20x NumPy, and >= 5e7 rounds x seeds / s for
KT with n = 16 on 2 cores.
"""

import argparse
import os
import sys

import numpy as np
from scipy.special import logsumexp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import analysis  # noqa: E402
from learners import online  # noqa: E402
from timing import best_time  # noqa: E402  (benchmarks/timing.py, beside this script)


def numpy_kt(tokens, mix, beta, grid):
    """Add-beta regret and pseudo-regret of one token sequence, vectorised over rounds."""
    T, n = tokens.size, mix.size
    onehot = np.zeros((T, n))
    onehot[np.arange(T), tokens] = 1.0
    after = np.cumsum(onehot, axis=0)
    before = after - onehot
    log_q = np.log(before + beta) - np.log(np.arange(T) + n * beta)[:, None]
    loss = np.cumsum(-log_q[np.arange(T), tokens])
    pseudo = np.cumsum(mix @ np.log(mix) - log_q @ mix)
    g = grid - 1
    c = after[g]
    with np.errstate(divide="ignore", invalid="ignore"):
        best = np.where(c > 0, c * np.log(c / grid[:, None]), 0.0).sum(axis=1)
    return loss[g] + best, pseudo[g]


def numpy_ftl(targets, log_g, grid):
    """FTL regret on RKL for a sequence of revealed teacher log-prob rows (T, n), vectorised over rounds."""
    T, n = targets.shape
    csum = np.cumsum(targets, axis=0)
    theta = np.vstack([np.zeros(n), csum[:-1] / np.arange(1, T)[:, None]])
    log_q = theta - logsumexp(theta, axis=1, keepdims=True)
    q = np.exp(log_q)
    loss = np.cumsum(np.sum(q * (log_q - targets), axis=1))
    pseudo = np.cumsum(np.sum(q * (log_q - log_g), axis=1))
    g = grid - 1
    return loss[g] + grid * logsumexp(csum[g] / grid[:, None], axis=1), pseudo[g]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=1_000_000)
    ap.add_argument("--seeds", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    T, R = args.rounds, args.seeds
    rng = np.random.default_rng(0)
    rows = []

    # --- KT, n = 16, sample feedback from K = 3 teachers ------------------------------------
    n = 16
    probs = rng.dirichlet(np.ones(n), size=3)
    w = np.array([0.5, 0.3, 0.2])
    mix = w @ probs
    grid = analysis.log_grid(T)
    check_T = 20_000
    tokens = rng.choice(n, size=check_T, p=mix)
    ours = online.add_beta_tabular(np.vstack([mix]), [1.0], 0.5, check_T, [0], sequence=tokens)
    ref = numpy_kt(tokens, mix, 0.5, ours["grid"])
    assert np.allclose(ours["regret"][0], ref[0], atol=1e-8), "KT: numba and NumPy disagree"
    seeds = np.arange(R)
    t_numba = best_time(lambda: online.add_beta_tabular(probs, w, 0.5, T, seeds), args.repeats)

    def numpy_run():
        g = np.random.default_rng(1)
        for _ in range(R):
            numpy_kt(g.choice(n, size=T, p=mix), mix, 0.5, grid)
    t_numpy = best_time(numpy_run, max(1, args.repeats // 2))
    rows.append(("KT n=16 sample feedback", T * R / t_numba, T * R / t_numpy))

    # --- FTL on RKL, alternating teachers (n = 2) and an i.i.d. pool (n = 8) ------------------
    for label, lp, wts, feedback in [
        ("FTL n=2 alternating e=1e-3", np.log([[1 - 1e-3, 1e-3], [1e-3, 1 - 1e-3]]), np.array([0.5, 0.5]), "alternating"),
        ("FTL n=8 i.i.d. pool K=3", np.log(rng.dirichlet(np.ones(8), size=3)), w, "sample"),
    ]:
        r = wts @ lp
        log_g = r - logsumexp(r)
        ks = np.arange(check_T) % lp.shape[0]
        ours = online.rkl_tabular(lp, wts, "alternating", "1/t", check_T, [0])
        ref = numpy_ftl(lp[ks], log_g, ours["grid"])
        assert np.allclose(ours["regret"][0], ref[0], rtol=1e-9, atol=1e-8), f"{label}: numba and NumPy disagree"
        n_seeds = R    # alternating feedback is deterministic: every seed repeats the same run
        t_numba = best_time(lambda: online.rkl_tabular(lp, wts, feedback, "1/t", T, np.arange(n_seeds)), args.repeats)

        def numpy_run(lp=lp, wts=wts, log_g=log_g, feedback=feedback, n_seeds=n_seeds):
            g = np.random.default_rng(2)
            for _ in range(n_seeds):
                ks = np.arange(T) % lp.shape[0] if feedback == "alternating" else g.choice(lp.shape[0], T, p=wts)
                numpy_ftl(lp[ks], log_g, grid)
        t_numpy = best_time(numpy_run, max(1, args.repeats // 2))
        rows.append((label, T * n_seeds / t_numba, T * n_seeds / t_numpy))

    import numba
    print(f"rounds T = {T}, seeds = {R}, numba threads = {numba.get_num_threads()}, cores = {os.cpu_count()}")
    print(f"{'kernel':32s} {'numba (rounds x seeds / s)':>28s} {'NumPy':>12s} {'ratio':>8s}")
    for label, ours, base in rows:
        print(f"{label:32s} {ours:28.3e} {base:12.3e} {ours / base:8.1f}x")
    kt = rows[0][1]
    print(f"KT n=16 target 5e7 rounds x seeds / s: {'met' if kt >= 5e7 else 'NOT met'} ({kt:.3e})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
