"""Atomic writes for long runs (SPEC 7): an interrupted run leaves either the old file or the new one."""

import os
import tempfile

TEMP_PREFIX = ".tmp-"


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
