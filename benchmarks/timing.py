"""The one timer of the benchmarks: the minimum wall time over interleaved repeats (ratios, not
absolute times, are what the benchmarks report; the minimum is the least noisy on a shared machine)."""

import time


def best_time(fns, repeats, warmup=True):
    """Minimum wall time of each callable of the dict ``fns`` over ``repeats`` interleaved rounds
    (after one warm-up call each, unless ``warmup=False``); a single callable gives a single float."""
    if callable(fns):
        return best_time({"": fns}, repeats, warmup)[""]
    if warmup:
        for f in fns.values():
            f()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    return {name: min(ts) for name, ts in times.items()}
