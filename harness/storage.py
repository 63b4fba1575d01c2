"""Results that an interrupted run cannot corrupt (theory section 7): atomic writes, per-cell files, CSVs.

An interrupted run leaves either the old file or the new one, never half of one; a rerun finds the
finished cells and skips them.
"""

import os
import tempfile

TEMP_PREFIX = ".tmp-"
FLOAT_FORMAT = "%.10g"           # every CSV of the project: 10 significant digits


def atomic_write(path, write):
    """Call ``write(tmp)`` on a temporary file beside ``path``, then rename it over ``path``.

    The temporary file gets the permissions a plain ``open(path, "w")`` would (mkstemp makes it
    0600); on any error it is removed and ``path`` is left as it was.
    """
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=TEMP_PREFIX, suffix="-" + os.path.basename(path))
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def remove_stale_temps(folder):
    """Delete the temporary files of ``atomic_write`` that a killed run left in ``folder``; returns
    how many. Call it at the start of a run that owns the folder (two runs must not share one)."""
    if not os.path.isdir(folder):
        return 0
    stale = [name for name in os.listdir(folder) if name.startswith(TEMP_PREFIX)]
    for name in stale:
        os.remove(os.path.join(folder, name))
    return len(stale)


def write_csv(path, df):
    """Write ``df`` to ``path`` atomically, without the index, floats to 10 significant digits."""
    atomic_write(path, lambda tmp: df.to_csv(tmp, index=False, float_format=FLOAT_FORMAT))


def cell_path(out_dir, cell):
    return os.path.join(out_dir, "cells", cell.key + ".pkl")


def save_cell(out_dir, cell, result):
    """Pickle one finished cell's result to OUT/cells/<key>.pkl, atomically."""
    import pandas as pd        # here, not at the top: a script's --help and argument errors load no pandas
    atomic_write(cell_path(out_dir, cell), lambda tmp: pd.to_pickle(result, tmp))


def load_cell(out_dir, cell):
    """The saved result of ``cell``, or None when it is missing or unreadable (then it is recomputed)."""
    path = cell_path(out_dir, cell)
    if not os.path.exists(path):
        return None
    import pandas as pd
    try:
        return pd.read_pickle(path)
    except Exception:
        return None

