"""The command line shared by every experiment script (theory section 7: a bad argument exits 2 with one line on
stderr, never a traceback; it is caught before any work starts)."""

import argparse
import os
import socket
import sys
from urllib.parse import urlparse


class UsageError(ValueError):
    """A bad argument or an unusable setting that a script reports in one line and exits 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit status 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message.splitlines()[0] if message else message}\n")

    def parse_args(self, args=None, namespace=None):
        ns = super().parse_args(args, namespace)
        for check in getattr(self, "_checks", ()):
            try:
                check(ns)
            except UsageError as exc:
                self.error(str(exc))
        sys.excepthook = quiet_interrupt
        return ns

    def add_check(self, check):
        """Run ``check(namespace)`` after parsing; a UsageError it raises becomes the one-line exit 2."""
        self._checks = [*getattr(self, "_checks", ()), check]


def quiet_interrupt(kind, value, traceback, default=sys.__excepthook__):
    """The excepthook of a parsed command line: Ctrl-C anywhere (the imports, a figure rebuild) prints one
    line and exits 130, the shell's status for SIGINT; inside :func:`harness.run_cells` the line also counts
    the cells kept. Any other uncaught exception keeps its traceback."""
    if not issubclass(kind, KeyboardInterrupt):
        return default(kind, value, traceback)
    sys.stdout.flush()
    print("interrupted; every finished cell is kept: rerun the same command to resume", file=sys.stderr)
    sys.stderr.flush()
    os._exit(130)


def int_at_least(minimum, what):
    """An argparse type: an integer (``1e6`` accepted) that is at least ``minimum``."""
    def parse(text):
        try:
            value = float(text)
            if not value.is_integer():
                raise ValueError
            value = int(value)
        except (ValueError, OverflowError):
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{what} must be >= {minimum}, got {value}")
        return value
    return parse


def names_from(choices, noun):
    """An argparse type: a comma-separated, non-empty subset of ``choices`` (each a ``noun``), a tuple."""
    def parse(text):
        names = tuple(v.strip() for v in text.split(",") if v.strip())
        if not names:
            raise argparse.ArgumentTypeError(f"needs at least one {noun}")
        for name in names:
            if name not in choices:
                raise argparse.ArgumentTypeError(f"unknown {noun} {name!r} (choose from {', '.join(choices)})")
        return names
    return parse


def usable_folder(folder, option):
    """Create ``folder`` if needed; UsageError naming ``option`` when that is impossible or not writable."""
    if not str(folder).strip():
        raise UsageError(f"{option} must not be empty")
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UsageError(f"{option} {folder!r} exists and is not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {option} folder {folder!r}: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK):
        raise UsageError(f"{option} folder {folder!r} is not writable")


def check_scheduler(address, timeout=5.0):
    """Raise UsageError unless a TCP connection to the scheduler ``address`` opens within ``timeout`` s."""
    url = urlparse(address if "://" in address else f"tcp://{address}")
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise UsageError(f"--scheduler {address!r} must be tcp://HOST:PORT")
    try:
        socket.create_connection((url.hostname, url.port), timeout=timeout).close()
    except OSError as exc:
        raise UsageError(f"cannot reach the dask scheduler at {address}: {exc.strerror or exc}") from None


def _check_common(ns):
    usable_folder(ns.out, "--out")
    if ns.figures is not None:
        usable_folder(ns.figures, "--figures")
    if ns.scheduler is not None:
        if ns.executor != "dask":
            raise UsageError("--scheduler needs --executor dask")
        check_scheduler(ns.scheduler)


def experiment_parser(prog, description, default_out, experiments=None, full=False):
    """A :class:`Parser` with the flags every experiment script shares.

    --quick, --out (default ``default_out``), --seeds, --only (a comma-separated subset of
    ``experiments``), --executor local|dask, --scheduler ADDRESS, --resume / --no-resume, --base-seed,
    --figures DIR (default OUT/figures), --no-figures, --quiet; with ``full``, --full (cluster-sized,
    exclusive with --quick). After parsing, the output folders are created (or the run exits 2 naming
    the one that cannot be) and a given scheduler is reached once.
    """
    ap = Parser(prog=prog, description=description)
    sizes = ap.add_mutually_exclusive_group()
    sizes.add_argument("--quick", action="store_true", help="small sizes (seconds); the tests use it")
    if full:
        sizes.add_argument("--full", action="store_true", help="cluster-sized sweep (use with --executor dask)")
    else:
        ap.set_defaults(full=False)
    ap.add_argument("--out", default=default_out, help=f"results folder (default {default_out})")
    ap.add_argument("--seeds", type=int_at_least(1, "--seeds"), default=None, help="seeds per stochastic cell")
    if experiments:
        ap.add_argument("--only", type=names_from(experiments, "experiment"), default=None,
                        help=f"comma-separated subset of: {', '.join(experiments)}")
    ap.add_argument("--executor", choices=("local", "dask"), default="local",
                    help="run the cells here, one after another (default), or on a dask cluster")
    ap.add_argument("--scheduler", default=None,
                    help="address of a running dask scheduler, tcp://HOST:PORT (default: a 2-worker "
                         "cluster on this machine)")
    ap.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                    help="reuse the finished cells in OUT/cells (default on; --no-resume recomputes)")
    ap.add_argument("--base-seed", type=int_at_least(0, "--base-seed"), default=0)
    ap.add_argument("--figures", default=None, help="folder of the figures (default OUT/figures)")
    ap.add_argument("--no-figures", action="store_true", help="write the CSVs only")
    ap.add_argument("--quiet", action="store_true", help="no progress bar, no summary")
    ap.add_check(_check_common)
    return ap
