"""The test run's own machinery: tests that share an xdist group run on one worker.

``make test`` runs ``pytest -n 2 --dist loadgroup``; the served tier (tests/test_served.py) and the tests that
read one sim's quick run rely on their group to start one vLLM server and run each quick run once. Under
pytest 9.2 with pytest-xdist 3.8 the groups were silently ignored (xdist rewrites a node id attribute that pytest
no longer reads), which doubled the served tier and every quick run; pyproject.toml pins pytest below 9.2.
"""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_tests_of_one_xdist_group_run_on_one_worker(tmp_path):
    """Eight tests of one group among four ungrouped ones, two workers: every grouped test reports the same
    worker and carries its group in its id; the ungrouped ones run too."""
    (tmp_path / "test_grouped.py").write_text(
        "import time, pytest\n"
        "pytestmark = pytest.mark.xdist_group('server')\n"
        "@pytest.mark.parametrize('i', range(8))\n"
        "def test_grouped(i):\n    time.sleep(0.05)\n")
    (tmp_path / "test_free.py").write_text(
        "import time, pytest\n"
        "@pytest.mark.parametrize('i', range(4))\n"
        "def test_free(i):\n    time.sleep(0.05)\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    r = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
                        "-p", "no:randomly", str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env=os.environ | {"PYTHONDONTWRITEBYTECODE": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    grouped = re.findall(r"\[(gw\d+)\].*PASSED test_grouped\.py::test_grouped\[\d\](\S*)", r.stdout)
    free = re.findall(r"\[(gw\d+)\].*PASSED test_free\.py::test_free\[\d\]", r.stdout)
    assert len(grouped) == 8 and len(free) == 4, r.stdout
    assert {w for w, _ in grouped} == {grouped[0][0]}, f"one group spread over several workers:\n{r.stdout}"
    assert {suffix for _, suffix in grouped} == {"@server"}, r.stdout


def skip_unless_loadgroup(request):
    if not os.environ.get("PYTEST_XDIST_WORKER") or not request.config.getvalue("loadgroup"):
        pytest.skip("not a `-n N --dist loadgroup` run")


@pytest.mark.parametrize("experiment", ["tiers-probe"])
def test_a_group_given_by_the_conftest_reaches_the_test_id(request, experiment):
    """The groups conftest gives at collection (a sim's name, here a parameter named ``experiment``) are in the
    test ids that xdist schedules by: otherwise each worker would run the same quick sim."""
    skip_unless_loadgroup(request)
    assert request.node.nodeid.endswith("@tiers-probe"), request.node.nodeid


def test_this_run_keeps_its_groups(request):
    """Under ``--dist loadgroup`` (as ``make test`` runs), a test of this module's own group has it in its id."""
    skip_unless_loadgroup(request)
    assert request.node.nodeid.endswith("@tiers"), request.node.nodeid


test_this_run_keeps_its_groups = pytest.mark.xdist_group("tiers")(test_this_run_keeps_its_groups)
