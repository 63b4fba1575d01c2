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
# the parsers the scripts build on: harness.experiment_parser (sims), llm_bridge.arguments (the bridge's CLIs)
SHARED_PARSERS = (ROOT / "harness" / "cli.py", ROOT / "llm_bridge" / "arguments.py")


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
    """Every ``python sims/X.py ...``, ``python llm_bridge/....py ...`` and ``python -m pkg.mod ...`` in inline
    code or at the start of a line of a code block (backslash continuations joined; a ``#`` comment ends it):
    [(source file, flags)]."""
    found = []
    pattern = r"(?:`|^\s*)(python (?:sims/\w+\.py|llm_bridge/[\w/]+\.py|-m [\w.]+)[^`\n#]*)"
    for cmd in re.findall(pattern, text.replace("\\\n", " "), re.M):
        words = cmd.split()
        if words[1] != "-m":
            path = ROOT / words[1]
        else:
            path = ROOT / (words[2].replace(".", "/") + ".py")
            path = path if path.exists() else path.with_suffix("") / "__main__.py"
        found.append((path, [w.split("=")[0] for w in words if w.startswith("--")]))
    return found


def undefined_flags(path, flags):
    """The flags of a command that neither its script nor the shared parsers define."""
    source = path.read_text() + "".join(p.read_text() for p in SHARED_PARSERS)
    return [flag for flag in flags if f'"{flag}"' not in source]


def test_readme_commands_name_existing_scripts_and_flags():
    found = commands(README.read_text())
    assert len(found) >= 8
    for path, flags in found:
        assert path.exists() and undefined_flags(path, flags) == [], (path, flags)


def test_commands_parser_catches_a_wrong_command():
    """The check above can fail: a script that does not exist, a flag nobody defines."""
    (path, _), = commands("`python sims/no_such_study.py --quick`")
    assert not path.exists()
    (path, flags), = commands("```\npython sims/topk_bias.py \\\n    --teacher x.json  # a typo\n```")
    assert path.exists() and undefined_flags(path, flags) == ["--teacher"]
    (path, flags), = commands("`python -m figures --results DIR`")
    assert path.name == "__main__.py" and undefined_flags(path, flags) == []
