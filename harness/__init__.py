"""The experiment harness: what every experiment script stands on, and nothing else.

    Cell                a frozen unit of work: experiment, kind, settings, seeds (a stable key)
    run_cells           run the cells not yet saved (local or dask), with a progress bar; resume
    atomic_write, write_csv, remove_stale_temps   results that an interrupted run cannot corrupt
    experiment_parser   the shared command line: --quick --out --seeds --only --executor --scheduler
                        --no-resume ...; every bad argument exits 2 with one line
    sizes               pick the full or --quick size of each knob, with command-line overrides
    Config              base of the frozen configuration dataclasses: validated at construction,
                        ``from_dict`` refuses unknown fields (a ValueError naming the field)

A script is its settings as data, one ``run_cell`` per kind in a dict, and a short ``main`` (the
"Adding an experiment" in docs/development.md). The harness imports nothing else of the project.
"""

from .cells import Cell, cell_seeds, sizes
from .config import Config
from .cli import Parser, UsageError, experiment_parser, int_at_least
from .run import run_cells
from .storage import atomic_write, load_cell, remove_stale_temps, save_cell, write_csv

__all__ = ["Cell", "cell_seeds", "sizes", "run_cells", "atomic_write", "write_csv", "remove_stale_temps",
           "save_cell", "load_cell", "Parser", "UsageError", "experiment_parser", "int_at_least", "Config"]
