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


def repository_files(suffixes):
    """The repository's files ending in ``suffixes``, without descending into hidden folders or build outputs."""
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("mutants", "site", "build", "__pycache__")]
        files += [pathlib.Path(folder) / n for n in names if n.endswith(suffixes)]
    return files


def test_nothing_points_outside_the_repository():
    """Users clone the repository only: no file names the folder beside it where the specification once lay."""
    outside = "../" + "shared"      # spelt so that this file does not name it either
    files = repository_files((".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".txt", "Makefile"))
    assert len(files) > 100
    assert [str(f.relative_to(ROOT)) for f in files if outside in f.read_text(errors="replace")] == []


def api_modules():
    """The modules the API reference renders (``::: module`` lines of docs/api/*.md)."""
    return [m for page in sorted((ROOT / "docs" / "api").glob("*.md"))
            for m in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M)]


def undocumented(module):
    """Public functions, classes and methods defined in ``module`` without a docstring (inherited ones count)."""
    import importlib
    import inspect
    mod = importlib.import_module(module)
    missing = []
    for name in getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]:
        obj = getattr(mod, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)) or getattr(obj, "__module__", "") != module:
            continue
        if not inspect.getdoc(obj):
            missing.append(name)
        if inspect.isclass(obj):
            missing += [f"{name}.{k}" for k, v in vars(obj).items()
                        if not k.startswith("_") and inspect.isfunction(v) and not inspect.getdoc(getattr(obj, k))]
    return missing


def test_every_public_function_in_the_api_reference_is_documented():
    modules = api_modules()
    assert {"aggregation.pools", "analysis.verdicts", "distillation.students", "llm_bridge.losses"} <= set(modules)
    missing = {m: undocumented(m) for m in modules}
    assert {m: names for m, names in missing.items() if names} == {}


def test_undocumented_catches_a_missing_docstring(tmp_path, monkeypatch):
    (tmp_path / "doc_probe_module.py").write_text('def shown():\n    """Has one."""\n\n\ndef bare():\n    pass\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    assert undocumented("doc_probe_module") == ["bare"]


def theory_anchors():
    """The anchors of docs/theory.md's headings, as the site (Python-Markdown's toc) and GitHub make them."""
    from markdown.extensions.toc import slugify
    headings = re.findall(r"^#+ (.+)$", (ROOT / "docs" / "theory.md").read_text(), re.M)
    return {slugify(h, "-") for h in headings}


def test_theory_citations_resolve():
    """Every anchor of docs/theory.md cited (``theory.md#...``) anywhere in the code or the documents names
    one of its headings, and the sections 1-7 the docstrings cite have their anchors."""
    anchors = theory_anchors()
    assert {"1-token-level-pools", "2-sequence-level", "3-learning-protocols-and-regret", "4-monte-carlo-kl-estimators",
            "5-rollout-spectrum-learning-rate-forgetting", "6-llm-bridge", "7-bad-input", "8-the-claims"} <= anchors
    files = repository_files((".py", ".md"))
    cited = {(str(p.relative_to(ROOT)), a) for p in files for a in re.findall(r"theory\.md#([\w-]+)", p.read_text())}
    assert cited and {(f, a) for f, a in cited if a not in anchors} == set()


def test_every_documented_command_names_a_script_and_its_flags():
    """Each command in the README, paper_repro.md and docs/ names a script that exists and flags that it (or
    the shared parser it builds on) defines (tests/test_readme.py's parser)."""
    from test_readme import commands, undefined_flags
    documents = [ROOT / "README.md", ROOT / "paper_repro.md", *sorted((ROOT / "docs").rglob("*.md"))]
    found = [(d.name, path, flags) for d in documents for path, flags in commands(d.read_text())]
    assert len(found) >= 60
    wrong = [(name, str(path.relative_to(ROOT)), flags) for name, path, flags in found
             if not path.exists() or undefined_flags(path, flags)]
    assert wrong == []
