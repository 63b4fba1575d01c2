"""Golden outputs: the ``--quick`` CSVs of every experiment script (conftest.QUICK_RUNS) against stored
copies, run with conftest.PORTABLE_NUMERICS so that torch's results do not depend on the CPU.

A refactor must change no result. Labels (every text column) must match exactly; numbers to 1e-9
relative (the CSVs keep 10 significant digits, so that is one unit in the last printed digit) or
1e-12 absolute (values that are rounding noise around 0). The stored copies are updated only by a
commit that means to change a result and says which and why:

    python tests/golden/refresh.py [NAME ...]   # reruns the --quick suites into tests/golden/
"""

import gzip

import numpy as np
import pandas as pd
import pytest

from conftest import ROOT

GOLDEN = ROOT / "tests" / "golden"
pytestmark = pytest.mark.integration


def assert_same_table(got, want, name):
    assert list(got.columns) == list(want.columns), name
    assert len(got) == len(want), f"{name}: {len(got)} rows, golden {len(want)}"
    for col in want.columns:
        a, b = got[col], want[col]
        if pd.api.types.is_numeric_dtype(b) and pd.api.types.is_numeric_dtype(a):
            np.testing.assert_allclose(a.to_numpy(float), b.to_numpy(float), rtol=1e-9, atol=1e-12,
                                       equal_nan=True, err_msg=f"{name}: column {col}")
        else:
            mismatch = (a.fillna("<NA>").astype(str) != b.fillna("<NA>").astype(str)).to_numpy()
            assert not mismatch.any(), f"{name}: column {col} row {np.flatnonzero(mismatch)[0]}: " \
                                       f"{a.iloc[np.flatnonzero(mismatch)[0]]!r} != {b.iloc[np.flatnonzero(mismatch)[0]]!r}"


def golden(experiment, name):
    with gzip.open(GOLDEN / experiment / f"{name}.gz", "rt") as f:
        return pd.read_csv(f)


GOLDEN_CSVS = sorted((path.parent.name, path.name[:-len(".gz")]) for path in GOLDEN.glob("*/*.csv.gz"))


def test_every_sim_has_golden_outputs():
    from conftest import QUICK_RUNS
    assert sorted({name for name, _ in GOLDEN_CSVS}) == sorted(QUICK_RUNS)


@pytest.mark.parametrize("experiment, name", GOLDEN_CSVS)
def test_quick_run_matches_golden(quick_run, experiment, name):
    assert_same_table(pd.read_csv(quick_run(experiment) / name), golden(experiment, name), name)
