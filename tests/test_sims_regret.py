"""The regret suite end to end (integration): --quick, determinism, dask vs local, resume, bad args."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pandas as pd
import pytest

from conftest import assert_usage_error

pytestmark = pytest.mark.integration

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "sims", "regret.py")


def run(*args, check=True, timeout=300):
    proc = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def read(path):
    with open(path, "rb") as f:
        return f.read()


def test_quick_run_end_to_end(quick_regret):
    out = quick_regret
    regret = pd.read_csv(out / "regret.csv")
    summary = pd.read_csv(out / "summary.csv")
    assert list(regret.columns[:7]) == ["experiment", "learner", "feedback", "n_actions", "seed", "t", "regret"]
    assert list(summary.columns[:8]) == ["experiment", "learner", "feedback", "n_actions", "slope", "slope_lo",
                                         "slope_hi", "theory_slope"]
    assert set(regret.experiment) == {"offpolicy-tabular", "offpolicy-sequence", "onpolicy-tabular",
                                      "onpolicy-sequence", "function-approx"}
    assert np.isfinite(regret.regret).all()
    # KT on the constant sequence: the CSV holds R_KT(t) (10 significant digits)
    from learners.closed_forms import kt_worst_case
    kt = regret[(regret.learner == "KT") & (regret.feedback == "constant") & (regret.n_actions == 3)]
    np.testing.assert_allclose(kt.regret, kt_worst_case(kt.t.to_numpy(), 3), rtol=1e-9)
    # alternating-teacher FTL slopes within 2% of (1/8) ln^2((1-e)/e)
    ftl = summary[(summary.learner == "FTL") & (summary.feedback == "alternating") & (summary.metric == "regret")]
    assert len(ftl) == 4
    np.testing.assert_allclose(ftl.slope, ftl.theory_slope, rtol=0.02)
    for exp in set(regret.experiment):
        assert (out / "figures" / f"regret_{exp}.png").exists()             # content: tests/test_figures.py


def test_same_seed_same_bytes_and_other_seed_differs(tmp_path):
    args = ("--quick", "--only", "offpolicy-sequence,onpolicy-sequence", "--no-figures", "--quiet", "--T", "300")
    run(*args, "--out", str(tmp_path / "a"))
    run(*args, "--out", str(tmp_path / "b"), "--no-resume")
    run(*args, "--out", str(tmp_path / "c"), "--base-seed", "1")
    for name in ("regret.csv", "summary.csv", "theory.csv"):
        assert read(tmp_path / "a" / name) == read(tmp_path / "b" / name)
    assert read(tmp_path / "a" / "regret.csv") != read(tmp_path / "c" / "regret.csv")


def test_dask_executor_gives_the_same_bytes_as_local(tmp_path):
    args = ("--quick", "--only", "offpolicy-tabular,function-approx", "--seeds", "2", "--no-figures", "--quiet", "--T", "500")
    run(*args, "--out", str(tmp_path / "local"))
    run(*args, "--out", str(tmp_path / "dask"), "--executor", "dask")      # LocalCluster, 2 workers, 127.0.0.1
    from dask.distributed import LocalCluster
    with LocalCluster(n_workers=2, threads_per_worker=1, host="127.0.0.1", processes=True,
                      dashboard_address=None) as cluster:                   # an existing scheduler
        run(*args, "--out", str(tmp_path / "remote"), "--executor", "dask", "--scheduler", cluster.scheduler_address)
    for name in ("regret.csv", "summary.csv", "theory.csv"):
        assert read(tmp_path / "local" / name) == read(tmp_path / "dask" / name)
        assert read(tmp_path / "local" / name) == read(tmp_path / "remote" / name)


def test_resume_after_a_killed_run(tmp_path):
    out = tmp_path / "r"
    # cells of about 0.5 s each (T = 1e6), so that the poll below sees the first one long before the last
    args = ["--only", "onpolicy-sequence", "--seeds", "2", "--T", "1000000", "--no-figures", "--quiet"]
    proc = subprocess.Popen([sys.executable, SCRIPT, *args, "--out", str(out)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cells = out / "cells"
    deadline = time.time() + 120
    while time.time() < deadline and not (cells.exists() and any(not p.name.startswith(".tmp-")
                                                                 for p in cells.iterdir())):
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    finished = {p.name: p.stat().st_mtime_ns for p in cells.iterdir() if not p.name.startswith(".tmp-")}
    assert 1 <= len(finished) < 4, "the run should have been killed between cells"
    assert not (out / "regret.csv").exists()
    (cells / ".tmp-killed-mid-write.pkl").write_bytes(b"half a pickle")   # as a kill mid-write leaves
    again = run(*args, "--out", str(out))
    assert f"({len(finished)} resumed)" in again.stderr
    for name, mtime in finished.items():                         # finished cells were not recomputed
        assert (cells / name).stat().st_mtime_ns == mtime
    assert not [p for p in cells.iterdir() if p.name.startswith(".tmp-")]      # stale temp files removed
    run(*args, "--out", str(tmp_path / "fresh"))
    assert read(out / "regret.csv") == read(tmp_path / "fresh" / "regret.csv")


@pytest.mark.parametrize("bad", [["--T", "0"], ["--seeds", "-1"], ["--only", "nope"], ["--eps", "0.7"],
                                 ["--eps", "0"], ["--executor", "mpi"], ["--T", "abc"],
                                 ["--scheduler", "tcp://127.0.0.1:1"],
                                 ["--executor", "dask", "--scheduler", "tcp://127.0.0.1:1"],
                                 ["--executor", "dask", "--scheduler", "not-an-address"],
                                 ["--out", "{file}/sub"], ["--out", "{file}"], ["--figures", "{file}/sub"]])
def test_bad_arguments_exit_2_with_one_line(bad, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    bad = [b.replace("{file}", str(blocker)) for b in bad]
    proc = run(*bad, "--quick", "--only", "offpolicy-tabular", check=False, timeout=60)
    assert_usage_error(proc)


def test_the_progress_weights_are_the_benchmark_s_costs():
    """sims.regret.CELL_COST (the progress bar's weights) is benchmarks/regret_cell_costs.csv's CPU seconds per
    seed x round, for every kind of cell; a function-approximation cell weighs far more than a tabular one."""
    from sims import regret
    table = pd.read_csv(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                     "benchmarks", "regret_cell_costs.csv"))
    assert dict(zip(table.kind, table.cpu_per_seed_round)) == regret.CELL_COST
    assert set(regret.CELL_COST) == set(regret.RUNNERS)
    cells = regret.cells_for(regret.sizes(regret.SIZES, quick=False))
    share = sum(regret.cell_cost(c) for c in cells if c.kind == "loglinear") / sum(map(regret.cell_cost, cells))
    assert share == pytest.approx(table.set_index("kind").share["loglinear"], abs=2e-3) and share > 0.5


def test_the_run_weights_its_progress_bar_by_cell_cost(tmp_path, monkeypatch):
    """main hands cell_cost to run_cells (stopped there: nothing runs)."""
    from sims import regret
    seen = {}

    def stop(cells, run_cell, out, **kw):
        seen.update(kw)
        raise KeyboardInterrupt
    monkeypatch.setattr(regret, "run_cells", stop)
    with pytest.raises(KeyboardInterrupt):
        regret.main(["--quick", "--out", str(tmp_path)])
    assert seen["cost"] is regret.cell_cost
