import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None, max_examples=40)
settings.register_profile("ci", deadline=None, max_examples=60, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else os.environ.get("HYPOTHESIS_PROFILE", "dev"))

ROOT = Path(__file__).resolve().parents[1]
TIERS = ("unit", "property", "integration", "slow")


def pytest_collection_modifyitems(items):
    """Every test has a tier: hypothesis tests are ``property``; a test without a tier mark is ``unit``."""
    for item in items:
        if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
            item.add_marker(pytest.mark.property)
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(pytest.mark.unit)


def run_script(script, *args, check=True, timeout=600):
    """Run ``python <script> args`` from the repository root; returns the CompletedProcess."""
    proc = subprocess.run([sys.executable, str(ROOT / script), *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def assert_usage_error(proc):
    """A command line refused as the CLI rules ask: exit status 2 and one line on stderr, no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in proc.stderr, proc.stderr


@pytest.fixture(scope="session")
def quick_regret(tmp_path_factory):
    """One ``python sims/regret.py --quick`` run (figures included), shared by the tests that read it."""
    out = tmp_path_factory.mktemp("regret-quick")
    run_script("sims/regret.py", "--quick", "--out", out, "--quiet")
    return out


@pytest.fixture(scope="session")
def quick_mechanisms(tmp_path_factory):
    """One ``python sims/mechanisms.py all --quick`` run (figures included)."""
    out = tmp_path_factory.mktemp("mechanisms-quick")
    run_script("sims/mechanisms.py", "all", "--quick", "--out", out)
    return out
