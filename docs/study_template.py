"""A minimal study: the forward-KL minimiser on random teachers (theory section 1). For K teachers p_k with
weights w_k, sum_k w_k KL(p_k || q) - sum_k w_k KL(p_k || A) = KL(A || q) for every student q, where A is the
arithmetic pool: the gap is >= 0 and 0 only at q = A.

Copy this file to ``sims/<your_study>.py``, rename the study in EXPERIMENTS / DEFAULT_OUT, and run it:

    python sims/your_study.py --quick
    python sims/your_study.py            # the default sizes, to results/<your_study>

The tests pick it up from its place in sims/ (tests/test_command_lines.py: --help and a bad argument answer
before numba, torch and pandas load). Writes ``gaps.csv`` (n, student, gap, kl_a_q) to ``--out``.
"""

import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import experiment_parser  # noqa: E402  (argparse only)

NAME = os.path.splitext(os.path.basename(__file__))[0]          # the study is named after its file
EXPERIMENTS = ("fkl-minimiser",)
DEFAULT_OUT = os.path.join("results", NAME)


def parse_args(argv):
    return experiment_parser(f"{NAME}.py", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS).parse_args(argv)


if __name__ == "__main__":      # --help and a bad argument answer here, before numba, torch and pandas load
    parse_args(sys.argv[1:])

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

import aggregation as ag  # noqa: E402
from harness import Cell, run_cells, sizes, write_csv  # noqa: E402

# 1. settings as data: each knob (default, quick)
SIZES = {"students": (2000, 50)}
N_TOKENS = (2, 10, 100)
WEIGHTS = np.array([0.5, 0.3, 0.2])


def cells_for(size, base_seed=0):
    return [Cell("fkl-minimiser", "gap", dict(n=n, students=size["students"]), base_seed=base_seed,
                 stream=("fkl-minimiser", n)) for n in N_TOKENS]


# 2. one function per kind of cell
def kl(p, q):
    return np.sum(p * (np.log(p) - np.log(q)), axis=-1)


def run_gap(cell):
    rng = np.random.default_rng(cell.seed_array()[0])
    teachers = rng.dirichlet(np.ones(cell["n"]), size=len(WEIGHTS))            # (K, n)
    pool = ag.arithmetic_pool(teachers, WEIGHTS)
    students = rng.dirichlet(np.ones(cell["n"]), size=cell["students"])        # (S, n)
    loss = sum(w * kl(p, students) for w, p in zip(WEIGHTS, teachers))
    floor = sum(w * kl(p, pool) for w, p in zip(WEIGHTS, teachers))
    return pd.DataFrame(dict(n=cell["n"], student=np.arange(len(students)), gap=loss - floor,
                             kl_a_q=kl(pool, students)))


RUNNERS = {"gap": run_gap}


def run_cell(cell):
    return RUNNERS[cell.kind](cell)


# 3. a short main
def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cells = cells_for(sizes(SIZES, args.quick), args.base_seed)
    results = run_cells(cells, run_cell, args.out, resume=args.resume, executor=args.executor,
                        scheduler=args.scheduler, progress=not args.quiet, desc=NAME)
    table = pd.concat(results, ignore_index=True)
    write_csv(os.path.join(args.out, "gaps.csv"), table)
    if not args.quiet:
        print(f"largest |gap - KL(A || q)|: {np.abs(table.gap - table.kl_a_q).max():.1e}; "
              f"smallest gap: {table.gap.min():.3g}")
    print(f"results in {os.path.abspath(args.out)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # run as sims.<name>, so that dask pickles run_cell by reference (as every script does)
    import importlib
    sys.exit(importlib.import_module(f"sims.{NAME}").main())
