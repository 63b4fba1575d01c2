"""The documentation site (mkdocs.yml, docs/): it builds with --strict (no broken link, anchor or API
reference), its Getting-started API tour runs and prints what its comments say, and no document points
outside the repository."""

import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_site_builds_strict(tmp_path):
    """``mkdocs build --strict``: any warning (a broken link or anchor, a file missing from the nav, a
    ``:::`` reference that does not resolve, a docstring griffe cannot parse) fails the build. Not with
    ``--quiet``: mkdocs then drops the warnings before strict mode counts them."""
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                       cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stderr[-4000:]
    assert (tmp_path / "site" / "theory" / "index.html").exists()
    api = (tmp_path / "site" / "api" / "aggregation" / "index.html").read_text()
    assert "geometric_pool" in api and "sequence_geometric_conditionals" in api


def test_api_tour_values():
    """The Getting-started API tour runs and its comments state the worked values of the theory page."""
    code = re.search(r"```python\n(.*?)```", (ROOT / "docs" / "index.md").read_text(), re.S).group(1)
    ns = {}
    exec(code, ns)
    ag, p, w, t = ns["ag"], ns["p"], ns["w"], ns["t"]
    assert ag.arithmetic_pool(p, w).max() == pytest.approx(0.6666, abs=1e-4)
    assert ag.geometric_pool(p, w).max() == pytest.approx(0.9804, abs=1e-4)
    assert np.exp(ag.sequence_geometric_conditionals(t, w, horizon=6)[0, 0, 0]) == pytest.approx(0.412, abs=1e-3)
    assert np.exp(ag.local_geometric_conditionals(t, w)[0, 0]) == pytest.approx(0.9)
    for value in ("0.6666", "0.9804", "0.412", "0.9"):
        assert value in code


def test_no_document_points_outside_the_repository():
    """Users clone the repository only: no document names a path above it."""
    documents = [ROOT / "README.md", ROOT / "paper_repro.md", *sorted((ROOT / "docs").rglob("*.md"))]
    offenders = [str(d.relative_to(ROOT)) for d in documents if "../shared" in d.read_text()]
    assert offenders == []
