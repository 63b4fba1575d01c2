"""The harness (harness/): each public name by name, against what its docstring promises."""

import os
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import harness
from harness import (Cell, Config, Parser, UsageError, atomic_write, cell_seeds, experiment_parser, int_at_least,
                     load_cell, remove_stale_temps, run_cells, save_cell, sizes, write_csv)
from harness.storage import TEMP_PREFIX


def test_the_public_names_are_these():
    assert sorted(harness.__all__) == sorted(["Cell", "cell_seeds", "sizes", "run_cells", "atomic_write", "write_csv",
                                              "remove_stale_temps", "save_cell", "load_cell", "Parser", "UsageError",
                                              "experiment_parser", "int_at_least", "Config"])


# ------------------------------------------------------------------------------------------------
# Cell, cell_seeds, sizes
# ------------------------------------------------------------------------------------------------
def test_cell_seeds_are_seed_sequence_streams_of_the_key():
    got = cell_seeds(3, "abc", 4)
    import zlib
    want = [np.random.SeedSequence([3, zlib.crc32(b"abc"), i]).generate_state(1, np.uint64)[0] for i in range(4)]
    assert got.dtype == np.uint64 and list(got) == want
    assert list(cell_seeds(3, "abc", 2)) == want[:2]                       # more seeds extend the same stream
    assert cell_seeds(4, "abc", 1)[0] != got[0] and cell_seeds(3, "abd", 1)[0] != got[0]


def test_cell_key_is_stable_and_depends_on_every_field_but_the_stream_key_only_on_the_stream():
    a = Cell("exp", "kind", {"x": 1, "y": [1, 2]}, seeds=3, stream=("s", 1))
    same = Cell("exp", "kind", {"y": [1, 2], "x": 1}, seeds=3, stream=("s", 1))
    assert a.key == same.key and hash(a) == hash(same) and a.key.startswith("exp__")
    for other in (Cell("exp", "kind", {"x": 2, "y": [1, 2]}, seeds=3, stream=("s", 1)),
                  Cell("exp", "kind", {"x": 1, "y": [1, 2]}, seeds=4, stream=("s", 1)),
                  Cell("exp", "kind", {"x": 1, "y": [1, 2]}, seeds=3, base_seed=1, stream=("s", 1))):
        assert other.key != a.key
    longer = Cell("exp", "kind", {"x": 1, "y": [1, 2], "rounds": 10}, seeds=5, stream=("s", 1))
    assert list(longer.seed_array()[:3]) == list(a.seed_array())           # a longer run extends the streams
    assert a["x"] == 1 and a.label == "s 1" and Cell("e", "k").label == "e k"


def test_sizes_picks_the_mode_and_overrides_by_word():
    table = {"rounds": (100, 10, 1000), "veto_rounds": (50, 5), "seeds": (8, 2)}
    assert sizes(table, quick=False) == {"rounds": 100, "veto_rounds": 50, "seeds": 8}
    assert sizes(table, quick=True) == {"rounds": 10, "veto_rounds": 5, "seeds": 2}
    assert sizes(table, quick=False, full=True) == {"rounds": 1000, "veto_rounds": 50, "seeds": 8}
    assert sizes(table, quick=True, rounds=7, seeds=None) == {"rounds": 7, "veto_rounds": 7, "seeds": 2}


# ------------------------------------------------------------------------------------------------
# storage: atomic_write, write_csv, remove_stale_temps, save_cell, load_cell
# ------------------------------------------------------------------------------------------------
def test_atomic_write_leaves_the_old_file_on_error_and_plain_permissions_on_success(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    atomic_write(path, lambda tmp: open(tmp, "w").write("old"))
    assert path.read_text() == "old"

    def half_then_fail(tmp):
        open(tmp, "w").write("ne")
        raise RuntimeError("killed")
    with pytest.raises(RuntimeError):
        atomic_write(path, half_then_fail)
    assert path.read_text() == "old" and os.listdir(path.parent) == ["f.txt"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask


def test_write_csv_has_no_index_and_ten_significant_digits(tmp_path):
    write_csv(tmp_path / "a.csv", pd.DataFrame({"x": [1 / 3, 2.0], "name": ["a", "b"]}))
    assert (tmp_path / "a.csv").read_text() == "x,name\n0.3333333333,a\n2,b\n"


def test_remove_stale_temps_removes_only_the_temporaries(tmp_path):
    (tmp_path / f"{TEMP_PREFIX}x-a.csv").write_text("half")
    (tmp_path / "a.csv").write_text("whole")
    assert remove_stale_temps(tmp_path) == 1 and os.listdir(tmp_path) == ["a.csv"]
    assert remove_stale_temps(tmp_path / "missing") == 0


def test_save_and_load_cell_round_trip_and_an_unreadable_cell_is_none(tmp_path):
    cell = Cell("e", "k", {"a": 1})
    assert load_cell(tmp_path, cell) is None
    df = pd.DataFrame({"v": [1.5, 2.5]})
    save_cell(tmp_path, cell, df)
    pd.testing.assert_frame_equal(load_cell(tmp_path, cell), df)
    (tmp_path / "cells" / f"{cell.key}.pkl").write_bytes(b"not a pickle")
    assert load_cell(tmp_path, cell) is None


# ------------------------------------------------------------------------------------------------
# run_cells
# ------------------------------------------------------------------------------------------------
CALLS = []


def _square(cell):
    CALLS.append(cell["x"])
    return cell["x"] ** 2


def test_run_cells_returns_results_in_order_and_resumes_only_the_missing_cells(tmp_path):
    cells = [Cell("e", "k", {"x": x}) for x in (3, 1, 2)]
    CALLS.clear()
    assert run_cells(cells[:2], _square, str(tmp_path), progress=False) == [9, 1]
    assert run_cells(cells, _square, str(tmp_path), progress=False) == [9, 1, 4]
    assert CALLS == [3, 1, 2]                                            # the first two were resumed
    assert run_cells(cells, _square, str(tmp_path), resume=False, progress=False) == [9, 1, 4]
    assert CALLS == [3, 1, 2, 3, 1, 2]
    with pytest.raises(UsageError, match="executor"):
        run_cells(cells, _square, str(tmp_path), executor="threads")


def test_run_cells_prints_the_results_folder_absolute(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_cells([Cell("e", "k", {"x": 2})], _square, "out", progress=False)
    assert capsys.readouterr().err.strip().endswith(f"-> {tmp_path / 'out'}")


# A run of four cells whose third blocks: Ctrl-C arrives while two cells are saved.
INTERRUPTED_RUN = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)     # also when started with SIGINT ignored
from harness import Cell, run_cells
def run_cell(cell):
    if cell["i"] == 2 and sys.argv[2] == "block":
        time.sleep(120)
    return cell["i"]
print(run_cells([Cell("demo", "k", {"i": i}) for i in range(4)], run_cell, sys.argv[1], progress=False))
"""


@pytest.mark.integration
def test_ctrl_c_prints_one_line_with_the_cells_kept_and_exits_130(tmp_path):
    """SIGINT during a run: no traceback, one line saying how many cells are kept and where, exit 130; the
    rerun resumes them."""
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_RUN, str(tmp_path), "block"], cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    # saved cells only: a cell being written is a .tmp- file with the same suffix, until it is renamed
    while len([p for p in (tmp_path / "cells").glob("*.pkl") if not p.name.startswith(TEMP_PREFIX)]) < 2 \
            and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)    # a loaded machine: no wall-clock limit
    assert proc.returncode == 130, err
    assert err.strip().splitlines() == [f"interrupted; 2 of 4 cells kept in {tmp_path}; rerun with --resume to "
                                        "continue"], err
    rerun = subprocess.run([sys.executable, "-c", INTERRUPTED_RUN, str(tmp_path), "go"], cwd=repo,
                           capture_output=True, text=True, timeout=120)
    assert rerun.stdout.strip() == "[0, 1, 2, 3]" and "(2 resumed)" in rerun.stderr, rerun.stderr


# After the command line is parsed, outside run_cells (a heavy import, a figure rebuild): Ctrl-C arrives
# while the script sleeps; with "fail" it raises another error instead.
INTERRUPTED_ELSEWHERE = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from harness.cli import Parser
Parser(prog="demo").parse_args([])
print("parsed", flush=True)
if sys.argv[1] == "fail":
    raise RuntimeError("a real error")
time.sleep(120)
"""


@pytest.mark.integration
@pytest.mark.parametrize("mode", ["sleep", "fail"])
def test_ctrl_c_outside_run_cells_prints_one_line_and_other_errors_keep_their_traceback(mode):
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED_ELSEWHERE, mode], cwd=repo,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "parsed"
    if mode == "sleep":
        proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=600)    # a loaded machine: no wall-clock limit
    if mode == "sleep":
        assert proc.returncode == 130, err
        assert err.strip().splitlines() == ["interrupted; every finished cell is kept: rerun the same command to resume"]
    else:
        assert proc.returncode == 1 and "Traceback" in err and "RuntimeError: a real error" in err


# ------------------------------------------------------------------------------------------------
# the command line: Parser, UsageError, int_at_least, experiment_parser
# ------------------------------------------------------------------------------------------------
def _exit(parser, args, capsys):
    with pytest.raises(SystemExit) as info:
        parser.parse_args(args)
    err = capsys.readouterr().err.strip().splitlines()
    return info.value.code, err


def test_parser_errors_are_one_line_with_status_2_and_checks_run_after_parsing(capsys):
    p = Parser(prog="p")
    p.add_argument("--n", type=int_at_least(2, "--n"))
    p.add_check(lambda ns: (_ for _ in ()).throw(UsageError("n is odd")) if ns.n % 2 else None)
    assert p.parse_args(["--n", "1e1"]).n == 10
    for args, words in ((["--n", "1"], ">= 2"), (["--n", "2.5"], "integer"), (["--n", "3"], "n is odd"),
                        (["--bogus"], "unrecognized")):
        code, err = _exit(p, args, capsys)
        assert code == 2 and len(err) == 1 and words in err[0] and err[0].startswith("p: error:")
    assert issubclass(UsageError, ValueError)


def test_experiment_parser_flags_and_refusals(tmp_path, capsys):
    p = experiment_parser("sim", "d", str(tmp_path / "out"), experiments=("a", "b"), full=True)
    ns = p.parse_args(["--quick", "--only", "b,a", "--seeds", "3"])
    assert (ns.quick, ns.full, ns.only, ns.seeds, ns.resume, ns.executor) == (True, False, ("b", "a"), 3, True, "local")
    assert (tmp_path / "out").is_dir()                                   # the output folder is created
    blocked = tmp_path / "file"
    blocked.write_text("")
    for args in (["--quick", "--full"], ["--only", "c"], ["--scheduler", "tcp://127.0.0.1:1"],
                 ["--out", str(blocked / "x")], ["--seeds", "0"]):
        code, err = _exit(p, args, capsys)
        assert code == 2 and len(err) == 1, (args, err)
    assert not hasattr(experiment_parser("s", "d", str(tmp_path)).parse_args([]), "only")


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Example(Config):
    name: str
    rate: float = 0.5

    def check(self):
        self.one_of("name", ("a", "b"))
        self.between("rate", 0.0, 1.0, nan_ok=self.name == "b")


def test_config_validates_at_construction_and_names_the_field():
    c = _Example.from_dict({"name": "a", "rate": 0.25})
    assert c.as_dict() == {"name": "a", "rate": 0.25} and c.replace(rate=1.0).rate == 1.0
    assert np.isnan(_Example("b", float("nan")).rate)
    for bad, field in (({"name": "c"}, "name"), ({"name": "a", "rate": 2.0}, "rate"),
                       ({"name": "a", "rate": float("nan")}, "rate"), ({"name": "a", "rate": True}, "rate"),
                       ({"name": "a", "rat": 0.1}, "'rat'")):
        with pytest.raises(ValueError, match=field):
            _Example.from_dict(bad)
    with pytest.raises(ValueError, match="rate"):
        c.replace(rate=-1.0)
    with pytest.raises(AttributeError):
        c.rate = 0.1                                                     # frozen


class RecordingBar:
    """A stand-in for tqdm that records its total and every update."""
    made = []

    def __init__(self, total=None, **kw):
        self.total, self.updates, self.postfix = total, [], ""
        RecordingBar.made.append(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n=1):
        self.updates.append(n)

    def set_postfix_str(self, s, refresh=True):
        self.postfix = s


def test_the_progress_bar_advances_by_each_cell_s_cost(tmp_path, monkeypatch):
    """With ``cost``, the bar's total is the summed cost and each finished cell advances it by its own cost
    (resumed cells first, together), so that its fraction and ETA follow the work; it still counts cells.
    A cost that is not positive and finite is a ValueError."""
    import tqdm
    monkeypatch.setattr(tqdm, "tqdm", RecordingBar)
    cells = [Cell("e", "k", {"x": x}) for x in (3, 1, 2)]
    cost = {3: 10.0, 1: 0.5, 2: 2.0}
    run_cells(cells[:1], _square, str(tmp_path), cost=lambda c: cost[c["x"]])
    bar = RecordingBar.made[-1]
    assert bar.total == 10.0 and bar.updates == [0, 10.0] and bar.postfix == "1/1 cells"
    run_cells(cells, _square, str(tmp_path), cost=lambda c: cost[c["x"]])
    bar = RecordingBar.made[-1]
    assert bar.total == 12.5 and bar.updates == [10.0, 0.5, 2.0] and bar.postfix == "3/3 cells"
    run_cells(cells, _square, str(tmp_path), resume=False)                         # no cost: one per cell
    assert RecordingBar.made[-1].total == 3 and RecordingBar.made[-1].updates == [0, 1.0, 1.0, 1.0]
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="cost"):
            run_cells(cells, _square, str(tmp_path), cost=lambda c: bad)
