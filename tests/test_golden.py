"""Golden outputs: the ``--quick`` CSVs of every experiment script (conftest.QUICK_RUNS) against stored
copies, run with conftest.PORTABLE_NUMERICS so that torch's results do not depend on the CPU (but for the sims
that train students: see TRAINED below).

A refactor must change no result. Labels (every text column) must match exactly; numbers to 1e-9
relative (the CSVs keep 10 significant digits, so that is one unit in the last printed digit) or
1e-12 absolute (values that are rounding noise around 0). The stored copies are updated only by a
commit that means to change a result and says which and why:

    python tests/golden/refresh.py [NAME ...]   # reruns the --quick suites into tests/golden/
"""

import gzip
import re

import numpy as np
import pandas as pd
import pytest

from conftest import ROOT, cpu_signature

GOLDEN = ROOT / "tests" / "golden"
pytestmark = pytest.mark.integration


# The sims that train torch students in float32: across CPU models their outputs differ even under PORTABLE_NUMERICS
# (conftest: from 1e-4 relative to whole runs that diverge). On the CPU that wrote their golden copies
# (golden/<name>/cpu.txt) their numbers are compared to TRAINED_RTOL / TRAINED_ATOL (measured there: two runs are
# identical), and a number printed inside a text to that or to one unit of its last printed decimal; on any other CPU
# only what does not depend on the trajectory: the columns, the rows, the texts with their numbers masked, and where
# the numbers are missing (assert_same_layout).
TRAINED = {"rollout_spectrum", "rlvr", "forgetting"}
TRAINED_RTOL, TRAINED_ATOL = 1e-4, 1e-6
NUMBER = re.compile(r"[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?")


def _last_unit(text):
    """One unit of a printed number's last decimal (0 for an integer: counts must match exactly)."""
    mantissa, _, exponent = text.lower().partition("e")
    if "." not in mantissa:
        return 0.0 if not exponent else 10.0 ** int(exponent)
    return 10.0 ** (int(exponent or 0) - len(mantissa.split(".")[1]))


def same_text(got, want, rtol, atol):
    """Equal texts but for their numbers, which agree to rtol / atol or to one unit of the last printed decimal."""
    if NUMBER.sub("#", got) != NUMBER.sub("#", want):
        return False
    return all(abs(float(x) - float(y)) <= max(atol, rtol * abs(float(y)), 1.0001 * _last_unit(y))
               for x, y in zip(NUMBER.findall(got), NUMBER.findall(want)))


def assert_same_shape(got, want, name):
    assert list(got.columns) == list(want.columns), name
    assert len(got) == len(want), f"{name}: {len(got)} rows, golden {len(want)}"


def assert_same_table(got, want, name, rtol=1e-9, atol=1e-12):
    assert_same_shape(got, want, name)
    for col in want.columns:
        a, b = got[col], want[col]
        if pd.api.types.is_numeric_dtype(b) and pd.api.types.is_numeric_dtype(a):
            np.testing.assert_allclose(a.to_numpy(float), b.to_numpy(float), rtol=rtol, atol=atol,
                                       equal_nan=True, err_msg=f"{name}: column {col}")
            continue
        a, b = a.fillna("<NA>").astype(str), b.fillna("<NA>").astype(str)
        if rtol == 1e-9:
            mismatch = (a != b).to_numpy()
        else:
            mismatch = np.array([not same_text(x, y, rtol, atol) for x, y in zip(a, b)], dtype=bool)
        assert not mismatch.any(), f"{name}: column {col} row {np.flatnonzero(mismatch)[0]}: " \
                                   f"{a.iloc[np.flatnonzero(mismatch)[0]]!r} != {b.iloc[np.flatnonzero(mismatch)[0]]!r}"


def golden(experiment, name):
    with gzip.open(GOLDEN / experiment / f"{name}.gz", "rt") as f:
        return pd.read_csv(f)


GOLDEN_CSVS = sorted((path.parent.name, path.name[:-len(".gz")]) for path in GOLDEN.glob("*/*.csv.gz"))


def test_every_sim_has_golden_outputs():
    from conftest import QUICK_RUNS
    assert sorted({name for name, _ in GOLDEN_CSVS}) == sorted(QUICK_RUNS)


def assert_same_layout(got, want, name):
    """The same columns and rows, the same texts once their numbers are masked, NaN in the same places."""
    assert_same_shape(got, want, name)
    for col in want.columns:
        a, b = got[col], want[col]
        if pd.api.types.is_numeric_dtype(b) and pd.api.types.is_numeric_dtype(a):
            np.testing.assert_array_equal(a.isna().to_numpy(), b.isna().to_numpy(), err_msg=f"{name}: column {col}")
            continue
        a, b = (c.fillna("<NA>").astype(str).str.replace(NUMBER, "#", regex=True) for c in (a, b))
        mismatch = np.flatnonzero((a != b).to_numpy())
        assert not mismatch.size, f"{name}: column {col} row {mismatch[0]}: {a.iloc[mismatch[0]]!r} != {b.iloc[mismatch[0]]!r}"


def golden_cpu(experiment):
    path = GOLDEN / experiment / "cpu.txt"
    return path.read_text().strip() if path.exists() else None


@pytest.mark.parametrize("experiment, name", GOLDEN_CSVS)
def test_quick_run_matches_golden(quick_run, experiment, name):
    got, want = pd.read_csv(quick_run(experiment) / name), golden(experiment, name)
    if experiment not in TRAINED:
        assert_same_table(got, want, name)
    elif golden_cpu(experiment) == cpu_signature():
        assert_same_table(got, want, name, TRAINED_RTOL, TRAINED_ATOL)
    else:
        assert_same_layout(got, want, name)


def test_trained_golden_copies_name_their_cpu_and_the_layout_check_can_fail():
    assert all(golden_cpu(experiment) for experiment in TRAINED)
    want = pd.DataFrame({"verdict": ["reproduces (0.52 [0.4, 0.6])", "does not"], "x": [0.1, np.nan]})
    assert_same_layout(pd.DataFrame({"verdict": ["reproduces (0.61 [0.5, 0.7])", "does not"], "x": [0.3, np.nan]}),
                       want, "t")
    for bad in ({"verdict": ["inconclusive (0.52 [0.4, 0.6])", "does not"], "x": [0.1, np.nan]},
                {"verdict": ["reproduces (0.52 [0.4, 0.6])", "does not"], "x": [0.1, 0.2]},
                {"verdict": ["reproduces (0.52 [0.4, 0.6])"], "x": [0.1]}):
        with pytest.raises(AssertionError):
            assert_same_layout(pd.DataFrame(bad), want, "t")


def test_text_numbers_are_compared_to_their_printed_precision():
    assert same_text("0.678 [0.5, 0.8] over 8 tasks", "0.679 [0.5, 0.8] over 8 tasks", 1e-4, 1e-6)
    assert not same_text("0.676 [0.5, 0.8] over 8 tasks", "0.678 [0.5, 0.8] over 8 tasks", 1e-4, 1e-6)
    assert not same_text("0.678 [0.5, 0.8] over 7 tasks", "0.678 [0.5, 0.8] over 8 tasks", 1e-4, 1e-6)
    assert not same_text("reproduces", "does not reproduce", 1e-4, 1e-6)
    assert same_text("1.0000005e-3", "1.0e-3", 1e-4, 1e-6) and not same_text("1.2e-3 nats", "1.0e-3 nats", 1e-4, 1e-9)
    assert same_text("0.0649831", "0.0649832", 1e-4, 1e-6)
