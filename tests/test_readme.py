"""The README is one screen that points to the rest: at most 120 lines, every link it makes resolves to a
committed file, every `make` target it names exists, and every study command it shows names a script
that exists and flags that script (or the shared parser it builds on) defines. The API tour moved to
docs/index.md (tests/test_docs.py runs it)."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.unit

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the parsers the scripts build on: harness.experiment_parser (sims), llm_bridge.probes (the bridge's CLIs)
SHARED_PARSERS = (ROOT / "harness" / "cli.py", ROOT / "llm_bridge" / "probes.py")


def test_readme_fits_one_screen():
    assert len(README.read_text().splitlines()) <= 120


def test_readme_links_resolve():
    text = README.read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 10
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert missing == []


def test_readme_make_targets_exist():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    text = README.read_text()
    named = set(re.findall(r"`make (\w+)`", text)) | set(re.findall(r"^make (\w+)", text, re.M))
    assert {"regret", "test", "docs"} <= named
    assert named <= targets


def commands(text):
    """Every ``python sims/X.py ...`` and ``python -m pkg.mod ...`` in backticks: (source file, flags)."""
    found = []
    for cmd in re.findall(r"`(python (?:sims/\w+\.py|-m [\w.]+)[^`]*)`", text):
        words = cmd.split()
        path = ROOT / words[1] if words[1] != "-m" else ROOT / (words[2].replace(".", "/") + ".py")
        found.append((path, [w.split("=")[0] for w in words if w.startswith("--")]))
    return found


def test_readme_commands_name_existing_scripts_and_flags():
    found = commands(README.read_text())
    assert len(found) >= 8
    shared = "".join(p.read_text() for p in SHARED_PARSERS)
    for path, flags in found:
        assert path.exists(), path
        source = path.read_text() + shared
        assert all(f'"{flag}"' in source for flag in flags), (path, flags)


def test_commands_parser_catches_a_wrong_command():
    """The check above can fail: a script that does not exist, a flag nobody defines."""
    (path, _), = commands("`python sims/no_such_study.py --quick`")
    assert not path.exists()
    (path, flags), = commands("`python -m llm_bridge.topk_bias --teacher x.json`")
    assert path.exists() and f'"{flags[0]}"' not in path.read_text() + "".join(p.read_text() for p in SHARED_PARSERS)
