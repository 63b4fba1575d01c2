"""The architecture, checked by import-linter: the contracts of pyproject.toml ([tool.importlinter]) hold, and
each contract breaks when the import it forbids is added (issue 34 item 7)."""
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.integration

PACKAGES = ("aggregation", "harness", "analysis", "llm_bridge", "learners", "distillation", "figures", "sims")


def lint_imports(cwd):
    """Run ``lint-imports`` (import-linter's command, beside this interpreter) on the project at ``cwd``."""
    command = Path(sys.executable).parent / "lint-imports"
    command = str(command) if command.exists() else shutil.which("lint-imports")
    assert command, "lint-imports is missing: pip install -e '.[test]'"
    return subprocess.run([command, "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_the_import_contracts_hold():
    r = lint_imports(ROOT)
    assert r.returncode == 0 and "0 broken" in r.stdout, r.stdout[-4000:] + r.stderr[-2000:]


@pytest.mark.parametrize("module, line, contract", [
    ("aggregation/validate.py", "import torch", "the math imports neither torch nor matplotlib"),
    ("aggregation/pools.py", "import matplotlib.pyplot", "the math imports neither torch nor matplotlib"),
    ("analysis/__init__.py", "import figures", "layers:"),
    ("llm_bridge/teachers.py", "import learners", "layers:"),
    ("figures/__init__.py", "import sims.regret", "no script is imported"),
    ("sims/regret.py", "import sims.rlvr", "no script imports another script"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, line, contract):
    """A copy of the project with one forbidden import added: lint-imports fails and names the contract."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.json*",
                                                                                         "*.png", "*.csv"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    assert lint_imports(tmp_path).returncode == 0                  # the copy itself keeps every contract
    with open(tmp_path / module, "a") as f:
        f.write(f"\n{line}  # a deliberate violation\n")
    r = lint_imports(tmp_path)
    report = " ".join(r.stdout.split())                         # the tool wraps long contract names
    assert r.returncode == 1 and re.search(re.escape(contract) + r"(?:(?!KEPT).)*? BROKEN", report), r.stdout[-3000:]
