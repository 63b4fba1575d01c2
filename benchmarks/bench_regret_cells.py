"""What each kind of cell of ``sims/regret.py`` costs: the weights of its progress bar (``sims.regret.CELL_COST``,
so that the bar's fraction and ETA follow the work: the function-approximation cells are few and slow).

    python benchmarks/bench_regret_cells.py        # writes benchmarks/regret_cell_costs.csv

For every kind, the first cell of that kind in the default run, with ``--seeds`` seeds (default 1) at the
default rounds, after a short warm-up cell (numba's compile is not counted): CPU seconds of the process
(``time.process_time``: less sensitive than wall time to other jobs on a shared machine), per seed x round.
``share`` is the predicted part of the default run's CPU time (cost x seeds x rounds, summed over its cells).
"""

import argparse
import csv
import dataclasses
import datetime
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from harness import sizes  # noqa: E402
from sims import regret  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=1, help="seeds of each timed cell (default 1)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "regret_cell_costs.csv"))
    args = ap.parse_args()
    cells = regret.cells_for(sizes(regret.SIZES, quick=False))
    rows = []
    for kind in dict.fromkeys(c.kind for c in cells):
        cell = next(c for c in cells if c.kind == kind)
        regret.run_cell(dataclasses.replace(cell, seeds=1, settings={**cell.settings, "n_rounds": 200}))
        timed = dataclasses.replace(cell, seeds=args.seeds)
        load = os.getloadavg()[0]
        t0 = time.process_time()
        regret.run_cell(timed)
        cpu = time.process_time() - t0
        per = cpu / (timed.seeds * timed["n_rounds"])
        of_kind = [c for c in cells if c.kind == kind]
        rows.append(dict(date=datetime.date.today().isoformat(), cores=os.cpu_count(), kind=kind, cell=cell.label,
                         seeds=timed.seeds, rounds=timed["n_rounds"], cpu_s=round(cpu, 3),
                         cpu_per_seed_round=float(f"{per:.3g}"), cells=len(of_kind),
                         run_cpu_s=round(per * sum(c.seeds * c["n_rounds"] for c in of_kind), 1),
                         load_before=load, load_after=os.getloadavg()[0]))
        print(rows[-1], flush=True)
    total = sum(r["run_cpu_s"] for r in rows)
    for r in rows:
        r["share"] = round(r["run_cpu_s"] / total, 3)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"predicted CPU time of the default run: {total:.0f} s -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
