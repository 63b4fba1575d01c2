"""Golden outputs: the ``--quick`` CSVs of sims/regret.py and sims/mechanisms.py against stored copies.

A refactor must change no result. Labels (every text column) must match exactly; numbers to 1e-9
relative (the CSVs keep 10 significant digits, so that is one unit in the last printed digit) or
1e-12 absolute (values that are rounding noise around 0). The stored copies are updated only by a
commit that means to change a result and says which and why:

    python tests/golden/refresh.py        # reruns both --quick suites into tests/golden/
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


@pytest.mark.parametrize("name", ["regret.csv", "summary.csv", "theory.csv"])
def test_regret_quick_matches_golden(quick_regret, name):
    assert_same_table(pd.read_csv(quick_regret / name), golden("regret", name), name)


@pytest.mark.parametrize("name", ["confident-expert.csv", "low-prob.csv", "prefix-bias.csv"])
def test_mechanisms_quick_matches_golden(quick_mechanisms, name):
    assert_same_table(pd.read_csv(quick_mechanisms / name), golden("mechanisms", name), name)
