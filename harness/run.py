"""Running cells: locally or on a dask cluster, with a progress bar, resuming finished cells."""

import os
import sys
import time

from .cli import UsageError
from .storage import cell_path, load_cell, remove_stale_temps, save_cell

EXECUTORS = ("local", "dask")


def run_cells(cells, run_cell, out, resume=True, executor="local", scheduler=None, progress=True, desc=None,
              cost=None):
    """Run every cell of ``cells`` that ``out`` does not hold yet; return all results, in cell order.

    Parameters
    ----------
    cells : list of :class:`harness.Cell`.
    run_cell : a module-level function cell -> result (picklable by reference, for dask).
    out : the results folder; each finished cell is saved atomically to ``out/cells/<key>.pkl`` as
        soon as it finishes, so an interrupted run loses at most the cells in progress.
    resume : reuse saved cells (``--no-resume`` recomputes them all).
    executor : ``"local"`` (one process, in order) or ``"dask"`` (a 2-worker LocalCluster on
        loopback, or the cluster at ``scheduler``, e.g. ``tcp://host:8786``).
    progress : a tqdm bar on stderr (a one-line summary is printed at the end either way).
    cost : cell -> its expected cost (any unit, > 0; default 1 per cell): the bar advances by each finished
        cell's cost, so that its fraction and ETA follow the work, not the count of cells (a few slow cells
        would otherwise sit at the end of a bar that claims to be nearly done); it shows the cells too.

    Raises :class:`harness.UsageError` when the scheduler cannot be reached. Ctrl-C prints one line, how
    many cells are kept and where, and exits 130 (the shell's status for SIGINT) without a traceback.
    """
    if executor not in EXECUTORS:
        raise UsageError(f"executor = {executor!r} must be one of {', '.join(EXECUTORS)}")
    from tqdm import tqdm
    remove_stale_temps(os.path.join(out, "cells"))                # left by a killed run
    done = {c.key for c in cells if resume and load_cell(out, c) is not None}
    todo = [c for c in cells if c.key not in done]
    start = time.time()
    name = desc or (cells[0].experiment if cells else "cells")
    weight = {c.key: float(cost(c)) if cost is not None else 1.0 for c in cells}
    bad = [c.label for c in cells if not (weight[c.key] > 0 and weight[c.key] < float("inf"))]
    if bad:
        raise ValueError(f"cost of cell {bad[0]!r} must be a positive finite number")
    finished = [len(done)]

    def advance(bar, cell):
        finished[0] += 1
        bar.update(weight[cell.key])
        bar.set_postfix_str(f"{finished[0]}/{len(cells)} cells", refresh=False)

    try:
        with tqdm(total=sum(weight.values()), desc=name, disable=not progress, file=sys.stderr,
                  bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}<{remaining}{postfix}]") as bar:
            bar.update(sum(weight[k] for k in done))
            bar.set_postfix_str(f"{len(done)}/{len(cells)} cells", refresh=False)
            if todo and executor == "dask":
                _run_dask(todo, run_cell, out, bar, scheduler, advance)
            elif todo:
                for cell in todo:
                    bar.set_postfix_str(f"{finished[0]}/{len(cells)} cells, {cell.label[:50]}")
                    save_cell(out, cell, run_cell(cell))
                    advance(bar, cell)
    except KeyboardInterrupt:
        kept = sum(os.path.exists(cell_path(out, c)) for c in cells)
        print(f"interrupted; {kept} of {len(cells)} cells kept in {os.path.abspath(out)}; "
              "rerun with --resume to continue", file=sys.stderr)
        raise SystemExit(130) from None
    results = [load_cell(out, c) for c in cells]
    print(f"{name}: {len(cells)} cells ({len(done)} resumed) in {time.time() - start:.1f} s -> {os.path.abspath(out)}",
          file=sys.stderr)
    return results


def _run_dask(todo, run_cell, out, bar, scheduler, advance):
    """Submit every cell; each result is saved as it arrives, so resume works as with local runs."""
    from dask.distributed import Client, LocalCluster, as_completed
    cluster = None
    if scheduler is None:
        cluster = LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1", processes=True,
                               dashboard_address=None)
        client = Client(cluster)
    else:
        try:
            client = Client(scheduler, timeout="20s")
        except (OSError, TimeoutError) as exc:
            raise UsageError(f"cannot connect to the dask scheduler at {scheduler}: {exc}") from None
    try:
        futures = {client.submit(run_cell, cell, pure=False): cell for cell in todo}
        for fut in as_completed(futures):
            save_cell(out, futures[fut], fut.result())
            advance(bar, futures[fut])
    finally:
        client.close()
        if cluster is not None:
            cluster.close()
