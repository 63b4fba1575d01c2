"""The one timer of the benchmarks: the minimum wall time over interleaved repeats (ratios, not
absolute times, are what the benchmarks report; the minimum is the least noisy on a shared machine); and
the measurement of a whole command in a fresh child process (wall, its own CPU seconds and peak RSS)."""

import os
import subprocess
import tempfile
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


def child_usage(cmd, cwd):
    """(wall s, CPU s, peak RSS MB) of one fresh child process running ``cmd`` in ``cwd`` (``os.wait4``: the
    child's own rusage; ``PYTHONPATH=cwd``, offline); it must succeed, else SystemExit with its last line."""
    with tempfile.TemporaryFile("w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err,
                                env=dict(os.environ, PYTHONPATH=str(cwd), HF_HUB_OFFLINE="1"))
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            lines = err.read().strip().splitlines()
            raise SystemExit(f"{' '.join(map(str, cmd))} failed: {lines[-1] if lines else status}")
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024          # Linux: kilobytes
