"""Speed of the aggregation engine against the peers a user could pick, at LLM sizes and dtypes, in one run.

    python benchmarks/bench_aggregation.py [--threads 2] [--rounds 5] [--K 2,4,8] [--V 32000,151936]
        [--N 256,2048] [--dtypes float32,float64] [--max-gb 1.3] [--shapes random,tree,llm] [--csv PATH]
    python benchmarks/bench_aggregation.py --table benchmarks/bench_aggregation*.csv     # the README's tables
    python benchmarks/bench_aggregation.py --decide RUN.csv [RUN.csv ...] [--csv OUT]  # issue 45's targets

Sections (every figure is written to the CSV, ``benchmarks/bench_aggregation.csv`` by default):

- STREAM: a numba triad ``a = b + 3 c`` over 3 x 64 MiB arrays on every thread, 24 bytes an element
  (no write-allocate counted), best and median of the rounds: the machine's bandwidth limit.
- pools: ``log_geometric_pool`` and ``log_arithmetic_pool`` (public wrappers, validation included; "ours"
  writes into an ``out=`` array, "ours-fresh" allocates its result) against NumPy, numexpr, torch and JAX
  (each skipped with a note when not installed), and the floor: a numba kernel with the same reads and
  writes and no exp or log (out = sum_k w_k x_k in the input's dtype), read and written in tiles as the pools
  do (a plain loop with the teachers innermost was up to 2x slower). Inputs are (K, N, V) log-probs
  in float32 or float64 (negative normals, not normalised: the pools do not need it).
  "compute": ours on one thread over a slice of the input that L3 holds (4 MiB, or 4 rows), called
  until it has done N V / threads entries: the time ours would take if memory were free and the threads
  scaled perfectly, so compute / floor is the least ours / floor that the same arithmetic can reach.
- recursion: ``sequence_log_partition`` on three machines (a random machine, a prefix tree with S ~ 3e5,
  an LLM-like machine with S = 10^4 and n = 256) against NumPy (log space and linear space) and torch;
  ours at 2 threads and at 1 thread in the same rounds, and again while a spinning process keeps one
  core busy.

Every contender runs once per round, in the same order, for ``--rounds`` rounds after a warm-up call; for
each, wall and CPU time (``time.process_time``: all threads of this process) as min / median / max, and
the ratio peer / ours taken round by round (min / median / max over the rounds). Memory bandwidth
fraction: the bytes a pool must move (read K N V, write N V, in the dtype) over its median time, divided
by the STREAM median. Correctness: every contender is checked against ours before it is timed.

Verdicts (``--decide``): a run's figures move with the machine's state (the memory's speed, what the other
core does), more than the rounds of one run show, so a target is decided over several runs, each a fresh
process: each run gives one statistic per target and size (the median of its round-by-round ratios; for
"the fastest peer", the least of the peers' medians), and the target is met when the 95% Student-t interval
of the statistic's geometric mean over the runs (df = runs - 1) lies on its side of the threshold, missed
when it lies on the other side, inconclusive when it holds the threshold (``TARGETS``).
"""

import argparse
import csv
import os
import platform
import subprocess
import sys
import time

import numpy as np

# issue 45's targets: (name, section, case, what the statistic is, threshold, at_least); "peers": the least
# peer / ours median of the run; "floor": ours / floor; "1thread": ours on one thread / ours on two, with the
# other core busy, where "no worse" is read with a 5% non-inferiority margin (one thread at most 5% faster)
TARGETS = (
    ("geometric >= 1.2x the fastest peer (float32)", "pool", "geometric", "peers", 1.2, True, "float32"),
    ("geometric >= 2x the fastest peer (float64)", "pool", "geometric", "peers", 2.0, True, "float64"),
    ("geometric within 1.3x of the floor", "pool", "geometric", "floor", 1.3, False, None),
    ("mixture >= 3x the fastest peer", "pool", "mixture", "peers", 3.0, True, None),
    ("mixture within 2.5x of the floor", "pool", "mixture", "floor", 2.5, False, None),
    ("recursion >= 5x the best of NumPy and torch", "recursion", None, "peers", 5.0, True, None),
    ("recursion, other core busy: no worse than one thread (5% margin)", "recursion+busy", None, "1thread", 0.95,
     True, None),
)
NOT_PEERS = {"ours", "ours-fresh", "floor", "compute", "ours-1thread"}


def parse_list(text, kind=int):
    return [kind(x) for x in text.split(",") if x]


# ------------------------------------------------------------------------------------------ harness

def interleaved(fns, rounds):
    """{name: (wall array, cpu array)} over ``rounds`` rounds, one call of each per round after a warm-up."""
    for f in fns.values():
        f()
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            c0, t0 = time.process_time(), time.perf_counter()
            f()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    return {k: (np.array(wall[k]), np.array(cpu[k])) for k in fns}


def mmm(x):
    return float(np.min(x)), float(np.median(x)), float(np.max(x))


# ------------------------------------------------------------------------------------------ kernels

def numba_kernels():
    from numba import njit, prange

    @njit(parallel=True, cache=True)
    def triad(a, b, c):
        for i in prange(a.shape[0]):
            a[i] = b[i] + 3.0 * c[i]

    @njit(parallel=True, cache=True, fastmath={"reassoc", "contract"})
    def floor(x, w, out):
        """out[m, a] = sum_k w_k x[k, m, a]: the pools' reads and writes, no exp or log, done as the pools do
        them (blocks of 8,192 entries, each teacher's row read as 1-D slices into a float64 tile of 64)."""
        K, M, n = x.shape
        block = 8192
        nb = (n + block - 1) // block
        for it in prange(M * nb):
            m = it // nb
            a0 = (it % nb) * block
            e = np.empty(64)
            for b0 in range(a0, min(n, a0 + block), 64):
                t = min(64, n - b0)
                xs = x[0, m, b0:b0 + t]
                for i in range(t):
                    e[i] = w[0] * np.float64(xs[i])
                for k in range(1, K):
                    xs = x[k, m, b0:b0 + t]
                    wk = w[k]
                    for i in range(t):
                        e[i] += wk * np.float64(xs[i])
                o = out[m, b0:b0 + t]
                for i in range(t):
                    o[i] = e[i]

    return triad, floor


def stream(triad, rounds):
    n = (64 << 20) // 8
    a, b, c = np.empty(n), np.ones(n), np.full(n, 2.0)
    res = interleaved({"triad": lambda: triad(a, b, c)}, max(rounds, 5))["triad"][0]
    return 24 * n / res


# ------------------------------------------------------------------------------------------ pools

def pool_contenders(pool, x, w, threads):
    """{name: callable} for one pool on x (K, N, V); every callable returns the (N, V) result."""
    import aggregation as ag
    K = x.shape[0]
    dt = x.dtype
    out = np.empty(x.shape[1:], dt)
    wd = w.astype(dt)
    lw = np.log(w).astype(dt)
    fns = {}
    if pool == "geometric":
        fns["ours"] = lambda: ag.log_geometric_pool(x, w, out=out)
        fns["ours-fresh"] = lambda: ag.log_geometric_pool(x, w)

        def numpy_geometric():
            s = np.tensordot(wd, x, axes=1)
            m = s.max(axis=-1, keepdims=True)
            return s - (m + np.log(np.exp(s - m).sum(axis=-1, keepdims=True)))
        fns["numpy"] = numpy_geometric
    else:
        fns["ours"] = lambda: ag.log_arithmetic_pool(x, w, out=out)
        fns["ours-fresh"] = lambda: ag.log_arithmetic_pool(x, w)

        def numpy_mixture():
            t = x + lw[:, None, None]
            m = t.max(axis=0)
            return m + np.log(np.exp(t - m).sum(axis=0))
        fns["numpy"] = numpy_mixture
    try:
        import numexpr as ne
        ne.set_num_threads(threads)
        env = {f"x{k}": x[k] for k in range(K)}
        if pool == "geometric":
            s_expr = " + ".join(f"{float(w[k])!r} * x{k}" for k in range(K))

            def numexpr_geometric():
                s = ne.evaluate(s_expr, local_dict=env)
                m = s.max(axis=-1, keepdims=True)
                lse = np.log(ne.evaluate("sum(exp(s - m), axis=1)", local_dict={"s": s, "m": m}))[:, None] + m
                return ne.evaluate("s - lse", local_dict={"s": s, "lse": lse})
            fns["numexpr"] = numexpr_geometric
        else:
            terms = [f"(x{k} + {float(np.log(w[k]))!r})" for k in range(K)]
            m_expr = terms[0]
            for t in terms[1:]:
                m_expr = f"where({t} > {m_expr}, {t}, {m_expr})"

            def numexpr_mixture():
                m = ne.evaluate(m_expr, local_dict=env)
                return ne.evaluate("m + log(" + " + ".join(f"exp({t} - m)" for t in terms) + ")",
                                   local_dict={**env, "m": m})
            fns["numexpr"] = numexpr_mixture
    except ImportError:
        pass
    try:
        import torch
        torch.set_num_threads(threads)
        tx, tw, tlw = torch.from_numpy(x), torch.from_numpy(wd), torch.from_numpy(lw)
        if pool == "geometric":
            fns["torch"] = lambda: torch.log_softmax(torch.tensordot(tw, tx, dims=1), dim=-1).numpy()
        else:
            fns["torch"] = lambda: torch.logsumexp(tx + tlw[:, None, None], dim=0).numpy()
    except ImportError:
        pass
    try:
        import jax
        import jax.numpy as jnp
        jx, jw, jlw = jnp.asarray(x), jnp.asarray(wd), jnp.asarray(lw)
        if pool == "geometric":
            f = jax.jit(lambda x_, w_: jax.nn.log_softmax(jnp.tensordot(w_, x_, axes=1), axis=-1))
            fns["jax"] = lambda: np.asarray(f(jx, jw).block_until_ready())
        else:
            f = jax.jit(lambda x_, lw_: jax.nn.logsumexp(x_ + lw_[:, None, None], axis=0))
            fns["jax"] = lambda: np.asarray(f(jx, jlw).block_until_ready())
    except ImportError:
        pass
    return fns


def compute_only(fn, x, w, threads):
    """The "compute" contender: ``fn`` (a pool taking ``out=``) on one thread over the first rows of x that fit
    in 4 MiB, at least 4 (a row per work item, as at the full size; at most 20 MB of the 32 MiB L3 at the sizes
    the grid runs), repeated until N V / threads entries are done."""
    import numba
    K, N, V = x.shape
    rows = min(N, max(4, (4 << 20) // (K * V * x.itemsize)))
    xs = np.ascontiguousarray(x[:, :rows])
    out = np.empty(xs.shape[1:], x.dtype)
    reps = max(1, round(N / threads / rows))

    def run():
        numba.set_num_threads(1)
        try:
            for _ in range(reps):
                fn(xs, w, out=out)
        finally:
            numba.set_num_threads(threads)
        return out
    return run


def pool_rows(args, floor, bandwidth, notes, sink):
    import aggregation as ag
    rows = []
    rng = np.random.default_rng(0)
    for dtype in args.dtypes:
        dt = np.dtype(dtype)
        for V in args.V:
            for N in args.N:
                for K in args.K:
                    gb = K * N * V * dt.itemsize / 1e9
                    if gb > args.max_gb:
                        notes.append(f"skipped K={K} V={V} N={N} {dtype}: input {gb:.1f} GB > --max-gb {args.max_gb}")
                        continue
                    x = np.empty((K, N, V), dt)
                    for k in range(K):
                        x[k] = -np.abs(rng.standard_normal((N, V), dtype=np.float32)) * 3.0 - 6.0
                    w = rng.dirichlet(np.ones(K))
                    fl_out = np.empty((N, V), dt)
                    nbytes = (K + 1) * N * V * dt.itemsize
                    for pool in ("geometric", "mixture"):
                        fns = pool_contenders(pool, x, w, args.threads)
                        ref = fns["ours"]().astype(np.float64)
                        tol = 1e-4 if dt == np.float32 else 1e-9
                        for name, f in fns.items():
                            np.testing.assert_allclose(np.asarray(f(), np.float64), ref, rtol=tol, atol=tol,
                                                       err_msg=f"{pool} {name}")
                        fns["floor"] = lambda: floor(x, w, fl_out)
                        ours = ag.log_geometric_pool if pool == "geometric" else ag.log_arithmetic_pool
                        fns["compute"] = compute_only(ours, x, w, args.threads)
                        res = interleaved(fns, args.rounds)
                        ours_wall = res["ours"][0]
                        for name, (wall, cpu) in res.items():
                            ratio = wall / ours_wall          # round by round: > 1 means ours is faster
                            rows.append(dict(section="pool", case=pool, K=K, V=V, N=N, dtype=dtype,
                                             contender=name, threads=args.threads,
                                             wall_min=mmm(wall)[0], wall_med=mmm(wall)[1], wall_max=mmm(wall)[2],
                                             cpu_med=float(np.median(cpu)),
                                             ratio_min=mmm(ratio)[0], ratio_med=mmm(ratio)[1], ratio_max=mmm(ratio)[2],
                                             bw_fraction=nbytes / float(np.median(wall)) / bandwidth))
                        print_rows(rows[-len(res):])
                        sink(rows[-len(res):])
                    del x
    return rows


# ------------------------------------------------------------------------------------------ recursion

def machines(names):
    from aggregation import examples
    out = {}
    if "random" in names:
        out["random"] = (examples.random_teachers(4, 10_000, 64, seed=0, end_prob=0.05), 256)
    if "tree" in names:
        out["tree"] = (examples.prefix_tree(2, 8, 6, seed=0), 7)
    if "llm" in names:
        out["llm"] = (examples.llm_like_prefix_teachers(0, n=256, n_states=5000), 64)
    return out


def recursion_contenders(t, H, skip=()):
    import numba
    import torch
    import aggregation as ag
    K, S = t.K, t.S
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
            with np.errstate(divide="ignore"):
                out[h] = np.log(z[:S]) + log_c
        return out

    tlp, tw_ = torch.from_numpy(np.ascontiguousarray(t.log_probs)), torch.from_numpy(w)
    tidx, tend = torch.from_numpy(idx), torch.from_numpy(ended)

    def torch_log():
        r = torch.tensordot(tw_, tlp, dims=1)
        out = torch.zeros(H + 1, S, dtype=torch.float64)
        for h in range(H - 1, -1, -1):
            out[h] = torch.logsumexp(r + torch.where(tend, 0.0, out[h + 1][tidx]), dim=1)
        return out.numpy()

    threads = numba.get_num_threads()

    def ours_1():
        numba.set_num_threads(1)
        try:
            return ag.sequence_log_partition(t, w, H)
        finally:
            numba.set_num_threads(threads)

    fns = {"ours": lambda: ag.sequence_log_partition(t, w, H), "ours-1thread": ours_1, "numpy": numpy_log,
           "numpy-linear": numpy_linear, "torch": torch_log}
    return {k: f for k, f in fns.items() if k not in skip}


def recursion_rows(args, sink):
    rows = []
    for name, (t, H) in machines(args.shapes).items():
        fns = recursion_contenders(t, H, args.skip_recursion)
        ref = fns["numpy"]()
        for k, f in fns.items():
            np.testing.assert_allclose(f(), ref, rtol=1e-8, atol=1e-8, err_msg=f"{name} {k}")
        for busy in (False, True):
            spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
            try:
                res = interleaved(fns, max(3, args.rounds))
            finally:
                if spinner is not None:
                    spinner.kill()
                    spinner.wait()
            ours_wall = res["ours"][0]
            for k, (wall, cpu) in res.items():
                ratio = wall / ours_wall
                rows.append(dict(section="recursion" + ("+busy" if busy else ""), case=name, K=t.K, V=t.n, N=t.S,
                                 dtype=f"H={H}", contender=k, threads=args.threads,
                                 wall_min=mmm(wall)[0], wall_med=mmm(wall)[1], wall_max=mmm(wall)[2],
                                 cpu_med=float(np.median(cpu)), ratio_min=mmm(ratio)[0],
                                 ratio_med=mmm(ratio)[1], ratio_max=mmm(ratio)[2], bw_fraction=float("nan")))
            print_rows(rows[-len(res):])
            sink(rows[-len(res):])
    return rows


# ------------------------------------------------------------------------------------------ output

FIELDS = ["section", "case", "K", "V", "N", "dtype", "contender", "threads", "wall_min", "wall_med", "wall_max",
          "cpu_med", "ratio_min", "ratio_med", "ratio_max", "bw_fraction"]


def print_rows(rows):
    for r in rows:
        print(f"{r['section']:>14} {r['case']:>9} K={r['K']} V={r['V']} N={r['N']} {r['dtype']:>8} "
              f"{r['contender']:>13}: wall {r['wall_min'] * 1e3:9.2f} / {r['wall_med'] * 1e3:9.2f} / "
              f"{r['wall_max'] * 1e3:9.2f} ms, cpu {r['cpu_med'] * 1e3:9.2f} ms, peer/ours {r['ratio_min']:.2f} / "
              f"{r['ratio_med']:.2f} / {r['ratio_max']:.2f}, bw {r['bw_fraction']:.0%}", flush=True)


def read_rows(path):
    with open(path) as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def table(paths):
    """Markdown tables of one or more CSVs this script wrote: per pool case, ours / floor and each peer / ours
    (median of the round-by-round ratios, [min, max]), the bandwidth fraction, wall and CPU medians."""
    keyed = {}                        # a row of a later CSV replaces the same row of an earlier one
    for path in paths:
        for r in read_rows(path):
            keyed[tuple(r[c] for c in ("section", "case", "K", "V", "N", "dtype", "contender"))] = r
    rows = list(keyed.values())
    pools = [r for r in rows if r["section"] == "pool"]
    peers = sorted({r["contender"] for r in pools} - NOT_PEERS)
    print("| pool | K | V | N | dtype | ours ms (cpu ms) | ours / floor | compute / floor | bw of STREAM | "
          + " | ".join(f"{p} / ours" for p in peers) + " | ours-fresh / ours |")
    print("|" + "---|" * (9 + len(peers)))
    key = lambda r: (r["case"], r["dtype"], int(r["V"]), int(r["N"]), int(r["K"]))
    for k in sorted({key(r) for r in pools}):
        g = {r["contender"]: r for r in pools if key(r) == k}
        o, fl = g["ours"], g["floor"]
        f = lambda r: f"{float(r['ratio_med']):.2f} [{float(r['ratio_min']):.2f}, {float(r['ratio_max']):.2f}]"
        inv = lambda r: (f"{1 / float(r['ratio_med']):.2f} [{1 / float(r['ratio_max']):.2f}, "
                         f"{1 / float(r['ratio_min']):.2f}]")
        print(f"| {k[0]} | {k[4]} | {k[2]} | {k[3]} | {k[1]} | {float(o['wall_med']) * 1e3:.1f} "
              f"({float(o['cpu_med']) * 1e3:.1f}) | {inv(fl)} | "
              + (f"{float(g['compute']['wall_med']) / float(fl['wall_med']):.2f}" if "compute" in g else "-")
              + f" | {float(o['bw_fraction']):.0%} | "
              + " | ".join(f(g[p]) if p in g else "-" for p in peers) + f" | {f(g['ours-fresh'])} |")
    rec = [r for r in rows if r["section"].startswith("recursion")]
    if rec:
        print()
        print("| machine | S, n, H | core busy | ours ms (cpu ms) | ours 1 thread / ours | numpy / ours | "
              "numpy-linear / ours | torch / ours |")
        print("|---|---|---|---|---|---|---|---|")
        rkey = lambda r: (r["case"], r["section"])
        for k in sorted({rkey(r) for r in rec}, key=lambda k: (k[0], k[1])):
            g = {r["contender"]: r for r in rec if rkey(r) == k}
            o = g["ours"]
            f = lambda r: f"{float(r['ratio_med']):.2f} [{float(r['ratio_min']):.2f}, {float(r['ratio_max']):.2f}]"
            print(f"| {k[0]} | {o['N']}, {o['V']}, {o['dtype'][2:]} | {'yes' if 'busy' in k[1] else 'no'} | "
                  f"{float(o['wall_med']) * 1e3:.1f} ({float(o['cpu_med']) * 1e3:.1f}) | "
                  + " | ".join(f(g[c]) if c in g else "-" for c in ("ours-1thread", "numpy", "numpy-linear", "torch"))
                  + " |")


def run_statistics(rows):
    """One run's statistic per (target, case, K, V, N, dtype) of ``TARGETS`` from its CSV rows (see the module
    docstring): the least peer / ours median, ours / floor, or one thread / two threads."""
    out = {}
    by_size = {}                                      # (section, case, K, V, N, dtype) -> {contender: ratio_med}
    for r in rows:
        size = (r["section"], r["case"], r["K"], r["V"], r["N"], r["dtype"])
        by_size.setdefault(size, {})[r["contender"]] = float(r["ratio_med"])
    for name, section, case, kind, _, _, dtype in TARGETS:
        for size, med in sorted(by_size.items()):
            if size[0] != section or (case is not None and size[1] != case) or (dtype is not None and size[5] != dtype):
                continue
            if kind == "peers":
                peers = [v for c, v in med.items() if c not in NOT_PEERS]
                value = min(peers) if peers else None
            elif kind == "floor":
                value = 1.0 / med["floor"] if "floor" in med else None
            else:
                value = med.get("ours-1thread")
            if value is not None:
                out[(name,) + size[1:]] = value
    return out


def decide(paths, level=0.95):
    """Verdict rows on ``TARGETS`` over the runs ``paths`` (one CSV each): per target and size, the runs'
    statistics, their geometric mean and its ``level`` Student-t interval (log scale, df = runs - 1), and
    met / missed / inconclusive (``analysis.verdicts.bound_verdict``); sizes measured in fewer than 2 runs
    are left out."""
    from analysis.statistics import mean_interval
    from analysis.verdicts import bound_verdict
    words = {"reproduces": "met", "does not reproduce": "missed", "inconclusive": "inconclusive"}
    stats = [run_statistics(read_rows(p)) for p in paths]
    rules = {t[0]: t for t in TARGETS}
    out = []
    for key in sorted(set().union(*stats), key=lambda k: (list(rules).index(k[0]),) + k[1:]):
        values = np.array([s[key] for s in stats if key in s])
        if values.size < 2:
            continue
        name, threshold, at_least = key[0], rules[key[0]][4], rules[key[0]][5]
        mean, lo, hi = (float(np.exp(v[0])) for v in mean_interval(np.log(values)[:, None], level))
        out.append(dict(target=name, case=key[1], K=key[2], V=key[3], N=key[4], dtype=key[5], runs=values.size,
                        threshold=threshold, geo_mean=mean, lo=lo, hi=hi, run_min=values.min(), run_max=values.max(),
                        verdict=words[bound_verdict(lo, hi, threshold, at_most=not at_least)]))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--K", type=parse_list, default=[2, 4, 8])
    parser.add_argument("--V", type=parse_list, default=[32000, 151936])
    parser.add_argument("--N", type=parse_list, default=[256, 2048])
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "float64"])
    parser.add_argument("--max-gb", type=float, default=1.3, help="skip pool inputs larger than this")
    parser.add_argument("--shapes", type=lambda s: [x for x in s.split(",") if x], default=["random", "tree", "llm"],
                        help="recursion machines (empty: none)")
    parser.add_argument("--no-pools", action="store_true")
    parser.add_argument("--skip-recursion", type=lambda s: [x for x in s.split(",") if x], default=[],
                        help="recursion contenders to leave out (e.g. torch, when it takes minutes a call)")
    parser.add_argument("--table", nargs="+", metavar="CSV", help="print the Markdown tables of these CSVs and exit")
    parser.add_argument("--decide", nargs="+", metavar="CSV",
                        help="verdicts on issue 45's targets over these runs (one CSV each), written to --csv")
    parser.add_argument("--csv", help="output (default benchmarks/bench_aggregation.csv; with --decide, "
                                      "benchmarks/bench_aggregation_decisions.csv)")
    args = parser.parse_args(argv)
    if args.csv is None:
        args.csv = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                "bench_aggregation_decisions.csv" if args.decide else "bench_aggregation.csv")
    if args.table:
        return table(args.table)
    if args.decide:
        if len(args.decide) < 2:
            parser.exit(2, "bench_aggregation: error: --decide needs the CSVs of at least two runs\n")
        import pandas as pd
        from harness import write_csv
        rows = decide(args.decide)
        write_csv(args.csv, pd.DataFrame(rows))
        print("| target | case | K | V | N | dtype | runs | geometric mean [95% interval] | runs' range | verdict |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['target']} | {r['case']} | {r['K']} | {r['V']} | {r['N']} | {r['dtype']} | {r['runs']} | "
                  f"{r['geo_mean']:.2f} [{r['lo']:.2f}, {r['hi']:.2f}] | {r['run_min']:.2f}-{r['run_max']:.2f} | "
                  f"{r['verdict']} |")
        return 0
    if args.threads < 1 or args.rounds < 1:
        parser.exit(2, "bench_aggregation: --threads and --rounds must be >= 1\n")
    if not set(args.dtypes) <= {"float32", "float64"}:
        parser.exit(2, "bench_aggregation: --dtypes takes float32 and/or float64\n")

    import numba
    numba.set_num_threads(args.threads)
    triad, floor = numba_kernels()
    notes = []
    for mod in ("numexpr", "torch", "jax"):
        try:
            __import__(mod)
        except ImportError:
            notes.append(f"{mod} not installed: its column is skipped")
    bandwidth = float(np.median(stream(triad, args.rounds)))
    load = os.getloadavg()
    from llvmlite import binding
    cpu = binding.get_host_cpu_name()          # the CPU numba compiles for (LLVM's name: the vector width follows)
    print(f"# bench_aggregation {time.strftime('%Y-%m-%d %H:%M')} UTC, {platform.machine()} ({cpu}), "
          f"{os.cpu_count()} cpus, "
          f"numba {numba.__version__}, numpy {np.__version__}, threads {args.threads}, "
          f"load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
    print(f"STREAM triad (median): {bandwidth / 1e9:.1f} GB/s")
    with open(args.csv, "w", newline="") as f:
        f.write(f"# {time.strftime('%Y-%m-%d %H:%M')} UTC; load average at start {load[0]:.1f}; {os.cpu_count()} cpus; "
                f"cpu {cpu}; stream row: bw_fraction = GB/s\n")
        for n in notes:
            f.write(f"# {n}\n")
        wr = csv.DictWriter(f, fieldnames=FIELDS)
        wr.writeheader()

        def sink(rows):
            wr.writerows(rows)
            f.flush()
        sink([dict(section="stream", case="triad", K=0, V=0, N=0, dtype="float64", contender="numba",
                   threads=args.threads, wall_min=0, wall_med=0, wall_max=0, cpu_med=0, ratio_min=0, ratio_med=0,
                   ratio_max=0, bw_fraction=bandwidth / 1e9)])
        if not args.no_pools:
            pool_rows(args, floor, bandwidth, notes, sink)
        if args.shapes:
            recursion_rows(args, sink)
        load_end = os.getloadavg()
        f.write(f"# load average at the end {load_end[0]:.1f}\n")
        for n in notes:
            f.write(f"# {n}\n")
    for n in notes:
        print("note:", n)
    print(f"load average at the end: {load_end[0]:.1f} {load_end[1]:.1f} {load_end[2]:.1f}")
    print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
