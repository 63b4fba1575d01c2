"""Peak resident memory of a call, for the memory test and benchmark of ``teacher_log_probs``."""

import ctypes
import threading
import time


def peak_rss_mib(fn, interval=0.0005):
    """Peak resident set size above its starting value while ``fn()`` runs, in MiB.

    A thread samples the resident set every ``interval`` seconds. On glibc the mmap threshold is
    fixed at 64 KiB first, so that freed large blocks leave the resident set at once (with the
    default dynamic threshold, blocks freed by an earlier call would be reused from the heap and hide
    a later call's peak).
    """
    import psutil
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)             # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
    proc = psutil.Process()
    base = proc.memory_info().rss
    top, stop = [base], threading.Event()

    def watch():
        while not stop.is_set():
            top[0] = max(top[0], proc.memory_info().rss)
            time.sleep(interval)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        stop.set()
        thread.join()
    return (max(top[0], proc.memory_info().rss) - base) / 2 ** 20
