"""sims/mechanisms.py: cells, determinism, the command line."""

import os
import shutil
import subprocess
import sys

import pandas as pd
import pytest

from harness import sizes
from harness.storage import FLOAT_FORMAT
from sims import mechanisms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "sims", "mechanisms.py")
Z = 4.0          # tolerance in s.d. of the mean over seeds (the seeds are fixed: this is a margin, not a p-value)


# ------------------------------------------------------------------------------------------------
# the sim: cells, determinism, command line
# ------------------------------------------------------------------------------------------------
def test_same_seed_same_rows_other_seed_differs():
    size = sizes(mechanisms.SIZES, quick=True)
    cell = next(c for c in mechanisms.cells_for("prefix-bias", size) if c["part"] == "learned")
    a, b = mechanisms.run_cell(cell), mechanisms.run_cell(cell)
    assert a.to_csv(float_format=FLOAT_FORMAT) == b.to_csv(float_format=FLOAT_FORMAT)
    other = mechanisms.cells_for("prefix-bias", size, base_seed=1)
    c = mechanisms.run_cell(next(x for x in other if x["part"] == "learned"))
    assert not a.value.equals(c.value)
    assert list(a.columns) == mechanisms.COLUMNS


@pytest.mark.integration
def test_quick_run_end_to_end_and_resume(quick_mechanisms, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(quick_mechanisms, out)
    for name in mechanisms.MECHANISMS:
        df = pd.read_csv(out / f"{name}.csv")
        assert list(df.columns) == mechanisms.COLUMNS
        assert {"exact", "learned", "target"} <= set(df.part)
        assert (out / "figures" / f"mechanism_{name}.png").exists()         # content: tests/test_figures.py
        assert (out / "figures" / f"mechanism_{name}_learned.png").exists()
    lp = pd.read_csv(out / "low-prob.csv")
    spec = lp[(lp.part == "spec") & (lp.learner == "G")].set_index("x").value
    assert spec[0.01] == pytest.approx(0.4833, abs=1e-4) and spec[0.0] == 0.0
    pb = pd.read_csv(out / "prefix-bias.csv")
    fam = pb[(pb.part == "random-family") & (pb.x == 0)]
    assert len(fam) == len(mechanisms.PB_SIGMAS) and (fam.value == 0).all()
    before = {name: (out / f"{name}.csv").read_bytes() for name in mechanisms.MECHANISMS}
    again = subprocess.run([sys.executable, SCRIPT, "low-prob", "--quick", "--out", str(out), "--quiet",
                            "--no-figures"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "resumed" in again.stderr
    assert (out / "low-prob.csv").read_bytes() == before["low-prob"]


@pytest.mark.parametrize("bad", [["nope"], ["all", "--seeds", "0"], ["--bogus"], ["low-prob", "prefix-bias"],
                                 ["--base-seed", "x"], ["--out", ""]])
def test_bad_arguments_exit_2_with_one_line(bad, capsys):
    with pytest.raises(SystemExit) as exc:
        mechanisms.parse_args(bad)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0]


@pytest.mark.integration
def test_bad_out_folder_exits_2_from_the_command_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out in (blocker, blocker / "sub"):
        proc = subprocess.run([sys.executable, SCRIPT, "low-prob", "--quick", "--out", str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "--out" in lines[0] and "Traceback" not in proc.stderr
