"""The README's API tour runs and prints what its comments say."""

import pathlib
import re

import numpy as np
import pytest

pytestmark = pytest.mark.integration

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_api_tour_values():
    code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
    ns = {}
    exec(code, ns)
    ag, p, w, t = ns["ag"], ns["p"], ns["w"], ns["t"]
    assert ag.arithmetic_pool(p, w).max() == pytest.approx(0.6666, abs=1e-4)
    assert ag.geometric_pool(p, w).max() == pytest.approx(0.9804, abs=1e-4)
    assert np.exp(ag.sequence_geometric_conditionals(t, w, horizon=6)[0, 0, 0]) == pytest.approx(0.412, abs=1e-3)
    assert np.exp(ag.local_geometric_conditionals(t, w)[0, 0]) == pytest.approx(0.9)
