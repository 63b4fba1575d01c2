"""Speed of the aggregation engine against NumPy / SciPy / torch baselines, side by side in one run.

    python benchmarks/bench_aggregation.py [--threads 2] [--repeats 15] [--markdown]

Each row times the public function (validation included) and the fastest straightforward
implementation of the same result in each baseline library, as the minimum over interleaved
repeats, on float64 with the same thread count everywhere. Also reported: the fraction of the
memory-bandwidth bound (bytes the computation must touch / time, against a measured np.copyto
bandwidth) and whether a second process finds every kernel in numba's cache.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
from scipy.special import logsumexp
from timing import best_time  # (benchmarks/timing.py, beside this script)


def copy_bandwidth(nbytes, repeats):
    src = np.ones(nbytes // 8)
    dst = np.empty_like(src)
    t = best_time({"copy": lambda: np.copyto(dst, src)}, repeats)["copy"]
    return 2 * src.nbytes / t          # read + write


def pool_rows(repeats):
    import torch
    import aggregation as ag

    K, M, n = 4, 4096, 512
    rng = np.random.default_rng(0)
    lp = np.log(rng.dirichlet(np.ones(n), size=(K, M)))
    w = rng.dirichlet(np.ones(K))
    tl, tw = torch.from_numpy(lp), torch.from_numpy(w)
    log_w = np.log(w)[:, None, None]

    def numpy_geometric():
        s = np.tensordot(w, lp, axes=1)
        m = s.max(axis=-1, keepdims=True)
        return s - (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))

    geometric = {
        "ours": lambda: ag.log_geometric_pool(lp, w),
        "numpy": numpy_geometric,
        "scipy": lambda: (lambda s: s - logsumexp(s, axis=-1, keepdims=True))(np.tensordot(w, lp, axes=1)),
        "torch": lambda: torch.log_softmax(torch.tensordot(tw, tl, dims=1), dim=-1),
    }
    arithmetic = {
        "ours": lambda: ag.log_arithmetic_pool(lp, w),
        "numpy": lambda: (lambda x, m: m + np.log(np.exp(x - m).sum(axis=0)))(lp + log_w, (lp + log_w).max(axis=0)),
        "scipy": lambda: logsumexp(lp, axis=0, b=w[:, None, None]),
        "torch": lambda: torch.logsumexp(tl + tw.log()[:, None, None], dim=0),
    }
    np.testing.assert_allclose(geometric["ours"](), numpy_geometric(), atol=1e-12)
    np.testing.assert_allclose(arithmetic["ours"](), arithmetic["scipy"](), atol=1e-12)
    nbytes = lp.nbytes + lp.nbytes // K            # read (K, M, n), write (M, n)
    return [("log_geometric_pool", f"({K}, {M}, {n})", best_time(geometric, repeats), nbytes, None),
            ("log_arithmetic_pool", f"({K}, {M}, {n})", best_time(arithmetic, repeats), nbytes, None)]


def sequence_row(repeats):
    import torch
    import aggregation as ag
    from aggregation import examples

    K, S, n, H = 4, 10_000, 64, 256
    t = examples.random_teachers(K, S, n, seed=0, end_prob=0.05)
    w = np.full(K, 1.0 / K)
    ended = t.next_state < 0
    idx = np.where(ended, 0, t.next_state)

    def numpy_log():
        r = np.tensordot(w, t.log_probs, axes=1)
        out = np.zeros((H + 1, S))
        for h in range(H - 1, -1, -1):
            v = r + np.where(ended, 0.0, out[h + 1][idx])
            m = v.max(axis=1)
            out[h] = m + np.log(np.exp(v - m[:, None]).sum(axis=1))
        return out

    def numpy_linear():
        weight = np.exp(np.tensordot(w, t.log_probs, axes=1))
        idx_end = np.where(ended, S, t.next_state)
        z = np.ones(S + 1)
        out = np.zeros((H + 1, S))
        log_c = 0.0
        for h in range(H - 1, -1, -1):
            z_new = (weight * z[idx_end]).sum(axis=1)
            c = z_new.max()
            log_c += np.log(c)
            z[:S] = z_new / c
            z[S] = np.exp(-log_c)
            out[h] = np.log(z[:S]) + log_c
        return out

    tlp, tw_ = torch.from_numpy(t.log_probs), torch.from_numpy(w)
    tidx, tend = torch.from_numpy(idx), torch.from_numpy(ended)

    def torch_log():
        r = torch.tensordot(tw_, tlp, dims=1)
        out = torch.zeros(H + 1, S, dtype=torch.float64)
        for h in range(H - 1, -1, -1):
            out[h] = torch.logsumexp(r + torch.where(tend, 0.0, out[h + 1][tidx]), dim=1)
        return out

    fns = {"ours": lambda: ag.sequence_log_partition(t, w, H), "numpy": numpy_log,
           "numpy-linear": numpy_linear, "torch": torch_log}
    ref = numpy_log()
    np.testing.assert_allclose(fns["ours"](), ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(numpy_linear(), ref, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(torch_log().numpy(), ref, rtol=1e-9, atol=1e-9)
    times = best_time(fns, max(3, repeats // 3))
    # each step reads the weights and transitions and gathers Z: S n (8 + 8) bytes
    nbytes = H * S * n * 16
    ns_per = times["ours"] / (S * n * H) * 1e9
    return [("sequence_log_partition", f"S={S}, n={n}, K={K}, H={H}", times, nbytes, ns_per)]


CACHE_PROBE = """
import json, numpy as np, aggregation as ag
from aggregation import _kernels, examples
t = examples.random_teachers(3, 20, 4, seed=0)
w = np.full(3, 1 / 3)
ag.log_geometric_pool(t.log_probs, w); ag.log_arithmetic_pool(t.log_probs, w)
ag.sequence_geometric_conditionals(t, w, 5); ag.sample_paths(t, w, 5, 3, 0); ag.state_occupancy(t, w, 5)
stats = {}
for name in dir(_kernels):
    f = getattr(_kernels, name)
    if hasattr(f, "stats") and f.signatures:
        stats[name] = (sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))
print(json.dumps(stats))
"""


def cache_check():
    """Run the probe twice in fresh processes: the second must load every kernel from the cache."""
    runs = [json.loads(subprocess.run([sys.executable, "-c", CACHE_PROBE], check=True, capture_output=True,
                                      text=True).stdout) for _ in range(2)]
    second = runs[1]
    misses = sum(m for _, m in second.values())
    return len(second), misses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.repeats < 1:
        parser.exit(2, "bench_aggregation: --threads and --repeats must be >= 1\n")

    import numba
    import torch
    numba.set_num_threads(args.threads)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    bandwidth = copy_bandwidth(64 << 20, args.repeats)
    rows = pool_rows(args.repeats) + sequence_row(args.repeats)
    n_kernels, misses = cache_check()

    header = ("| function | shape | ours (ms) | baselines (ms) | speed-up vs fastest | "
              "bandwidth bound | ns / (state, token, step) | threads |")
    print(f"# bench_aggregation  {time.strftime('%Y-%m-%d')}  {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cpus, numpy {np.__version__}, numba {numba.__version__}, torch {torch.__version__}")
    print(f"np.copyto bandwidth: {bandwidth / 1e9:.1f} GB/s (read + write)")
    print(header)
    print("|" + "---|" * 8)
    for name, shape, times, nbytes, ns_per in rows:
        ours = times["ours"]
        base = {k: v for k, v in times.items() if k != "ours"}
        fastest = min(base, key=base.get)
        base_txt = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in base.items())
        frac = nbytes / ours / bandwidth
        ns_txt = f"{ns_per:.2f}" if ns_per is not None else "-"
        print(f"| {name} | {shape} | {ours * 1e3:.2f} | {base_txt} | {base[fastest] / ours:.2f}x vs {fastest} | "
              f"{frac:.0%} | {ns_txt} | {numba.get_num_threads()} |")
    print(f"\nsecond process: {n_kernels} kernels used, {misses} compiled anew "
          f"({'all cache hits' if misses == 0 else 'RECOMPILED'})")


if __name__ == "__main__":
    main()
