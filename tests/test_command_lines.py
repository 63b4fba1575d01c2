"""Every command line of the project says no fast: ``--help`` and a bad argument are answered before numba,
torch, transformers or pandas load (issue 34 item 5), and every command the documents show parses (item 4).
"""
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import PORTABLE_NUMERICS, ROOT, assert_usage_error

pytestmark = pytest.mark.integration

HEAVY = ("numba", "torch", "transformers", "pandas")
# every script of sims/, found rather than listed: a new study is checked as soon as its file is there
COMMANDS = sorted(f"sims/{p.name}" for p in (ROOT / "sims").glob("*.py") if not p.name.startswith("_"))
KNOWN = ("regret", "mechanisms", "rollout_spectrum", "estimators", "forgetting", "rlvr",       # the studies
         "flip_horizon", "probe_prefix_bias", "probe_batch", "topk_bias", "diagnose")          # the bridge's
TEMPLATE = ROOT / "docs" / "study_template.py"


def argv(command):
    """The interpreter's arguments for a script path or a ``python -m`` module."""
    return [command] if command.endswith(".py") else ["-m", command]


def run(args, **kw):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          env=os.environ | PORTABLE_NUMERICS | {"HF_HUB_OFFLINE": "1"}, timeout=300, **kw)


def imported(stderr):
    """The top-level packages a ``python -X importtime`` run imported."""
    return {line.split("|")[-1].strip().split(".")[0] for line in stderr.splitlines()
            if line.startswith("import time:")}


@pytest.mark.parametrize("command", COMMANDS)
def test_help_and_bad_arguments_load_no_heavy_package(command):
    """A bad argument: exit 2, one line, and none of numba, torch, transformers, pandas imported; --help
    the same with exit 0."""
    bad = run(["-X", "importtime", *argv(command), "--no-such-flag"])
    heavy = sorted(imported(bad.stderr).intersection(HEAVY))
    bad.stderr = "\n".join(line for line in bad.stderr.splitlines() if not line.startswith("import time:"))
    assert_usage_error(bad)
    assert not heavy, f"{command} imports {heavy} before refusing an argument"
    helped = run(["-X", "importtime", *argv(command), "--help"])
    assert helped.returncode == 0 and "usage:" in helped.stdout, helped.stderr[-2000:]
    assert not imported(helped.stderr).intersection(HEAVY)


def test_every_script_of_sims_is_found_and_listed_in_the_layout():
    """The scripts are discovered (the known ones among them), and docs/development.md's layout names each."""
    names = {Path(c).stem for c in COMMANDS}
    assert set(KNOWN) <= names
    layout = (ROOT / "docs" / "development.md").read_text()
    assert not [n for n in names if f"`{n}.py`" not in layout], "add the new script to docs/development.md"


def test_the_study_template_copied_and_renamed_runs(tmp_path):
    """docs/study_template.py (docs/development.md, "A minimal study"), copied as sims/my_study.py: --help and a
    bad argument answer before the heavy packages load, and --quick writes gaps.csv, where the gap of every
    random student equals KL(A || q) >= 0 (theory section 1)."""
    (tmp_path / "sims").mkdir()
    (tmp_path / "sims" / "__init__.py").write_text("")
    script = tmp_path / "sims" / "my_study.py"
    script.write_text(TEMPLATE.read_text())

    def go(*args):
        return subprocess.run([sys.executable, *args], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                              env=os.environ | PORTABLE_NUMERICS | {"PYTHONPATH": str(ROOT)})
    bad = go("-X", "importtime", str(script), "--no-such-flag")
    assert not imported(bad.stderr).intersection(HEAVY)
    bad.stderr = "\n".join(line for line in bad.stderr.splitlines() if not line.startswith("import time:"))
    assert_usage_error(bad)
    helped = go(str(script), "--help")
    assert helped.returncode == 0 and "my_study.py" in helped.stdout and "--no-figures" in helped.stdout
    done = go(str(script), "--quick", "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.strip().endswith(str(tmp_path / "results" / "my_study"))
    import pandas as pd
    table = pd.read_csv(tmp_path / "results" / "my_study" / "gaps.csv")
    assert len(table) == 3 * 50 and (table.gap > 0).all()
    np_close = (table.gap - table.kl_a_q).abs() <= 1e-12 * (1 + table.kl_a_q)
    assert np_close.all()


def best_of(n, args):
    """The shortest wall time of ``n`` runs (the least disturbed by other load on the machine)."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        run(args)
        times.append(time.perf_counter() - start)
    return min(times)


@pytest.mark.parametrize("command, module", [("sims/rollout_spectrum.py", "sims.rollout_spectrum"),
                                             ("sims/regret.py", "sims.regret"),
                                             ("sims/topk_bias.py", "sims.topk_bias")])
def test_refusing_an_argument_costs_a_fraction_of_importing_the_script(command, module):
    """Measured as a ratio, not a wall-clock limit: refusing an argument takes under half the time of
    importing the script's own module (numba, torch, pandas and the project's libraries); before the
    fix it took the whole import and more (27 s on a loaded machine for rollout_spectrum)."""
    refuse = best_of(3, [*argv(command), "--no-such-flag"])
    load = best_of(2, ["-c", f"import {module}"])
    assert refuse < 0.5 * load, f"{command}: refusing took {refuse:.2f} s, importing {module} {load:.2f} s"


def test_topk_bias_runs_as_documented_and_lists_only_its_flags():
    """``python sims/topk_bias.py`` (the README's command) needs no argument: the example teachers
    are the default; --help shows no probe flag it never reads."""
    from sims import topk_bias
    _, args = topk_bias.parse_args([])
    assert Path(args.teachers).is_file() and args.teachers.endswith(os.path.join("examples", "teachers.json"))
    helped = run(["sims/topk_bias.py", "--help"]).stdout
    for flag in ("--horizons", "--n-samples", "--batch-size", "--seed"):
        assert flag not in helped, flag
    for flag in ("--model", "--teachers", "--device", "--dtype", "--text", "--out"):
        assert flag in helped, flag


def test_one_spelling_of_the_figures_flag():
    """--no-figures everywhere; the probe's old --no-figure still works, unlisted."""
    from sims import probe_batch, probe_prefix_bias
    base = ["--teachers", "t.json", "--question", "Q?", "--options", "a", "b", "--correct", "a"]
    for spelling in ("--no-figures", "--no-figure"):
        _, args = probe_prefix_bias.parse_args(base + [spelling])
        assert args.no_figures
    assert not probe_prefix_bias.parse_args(base)[1].no_figures
    _, args = probe_batch.parse_args(["--teachers", "t.json", "--questions", "q.jsonl"])
    assert not args.no_figures                                # figures by default, as in every sim
    assert probe_batch.parse_args(["--teachers", "t.json", "--questions", "q.jsonl", "--no-figures"])[1].no_figures
    for command in COMMANDS:
        helped = run([*argv(command), "--help"]).stdout
        assert "--no-figures" in helped and "--no-figure " not in helped, command


def test_diagnose_help_states_the_thresholds_defaults(tmp_path):
    """diagnose states its thresholds' defaults without importing llm_bridge.diagnosis (torch): they are
    Thresholds' own, and a flag left out keeps its default."""
    import math
    from llm_bridge.diagnosis import Thresholds
    from sims import diagnose
    stated = {flag[2:].replace("-", "_"): text.split(" = ")[-1] for flag, text, _ in diagnose.THRESHOLD_FLAGS}
    for name, value in Thresholds().as_dict().items():
        assert math.isclose(float(stated[name]), value, rel_tol=5e-3), name
    teachers = ROOT / "llm_bridge" / "examples" / "diagnose" / "teachers_end_veto.json"
    prompts = ROOT / "llm_bridge" / "examples" / "diagnose" / "prompts.jsonl"
    args = diagnose.parse(["--teachers", str(teachers), "--prompts", str(prompts), "--expert-gap", "0.2",
                           "--out", str(tmp_path)])
    assert args.thresholds == Thresholds(expert_gap=0.2)


def test_diagnose_default_batch_keeps_batch_times_length_bounded():
    """Without --batch, 8 prompts per batch up to 64 tokens, then 512 // --max-tokens (2 at 256 tokens, the
    length whose 2-prompt batch was measured under 2 GB), never 0; an explicit --batch wins."""
    from sims import diagnose
    assert [diagnose.default_batch(t) for t in (1, 16, 64, 65, 256, 511, 512, 8000)] == [8, 8, 8, 7, 2, 1, 1, 1]
    assert diagnose.default_batch(8000, served=True) == diagnose.default_batch(16, served=True) == 32


# ------------------------------------------------------------------------------------------------
# every documented command parses against its command line (issue 34 item 4)
# ------------------------------------------------------------------------------------------------
DOCUMENTS = ["README.md", "paper_repro.md", "Makefile",
             *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")),
             *COMMANDS]
COMMAND = re.compile(r"(?:python|\$\(PY\)) +(sims/\w+\.py|-m +llm_bridge\.\w+)((?:\\\n|[^`\n#|;&])*)")
NEEDS_INPUT = ("sims.probe_prefix_bias", "sims.probe_batch", "sims.diagnose")   # the user's files


def documented_commands():
    """(document, command line) for every ``python sims/X.py ...`` in the documents (and any ``python -m
    llm_bridge.X ...`` left from before the bridge's command lines moved: it fails), continuation lines
    joined, optional parts in [brackets] dropped; a command with an ellipsis or a placeholder in capitals
    is left out (it is not meant to run as written)."""
    found = []
    for doc in DOCUMENTS:
        text = (ROOT / doc).read_text()
        for m in COMMAND.finditer(text):
            target, rest = m.group(1), re.sub(r"\\\n\s*", " ", m.group(2))
            rest = re.sub(r"\[[^\]]*\]", "", rest).strip()
            if "[" in rest or "..." in rest or re.search(r"\b[A-Z]{3,}\b", rest) or "$" in rest or "{" in rest:
                continue
            found.append((doc, f"{target} {rest}".strip()))
    return found


def test_the_documents_show_commands():
    docs = {doc for doc, _ in documented_commands()}
    assert {"README.md", "Makefile"} <= docs and len(documented_commands()) >= 20


@pytest.mark.parametrize("doc, command", documented_commands())
def test_every_documented_command_parses(doc, command, tmp_path, monkeypatch):
    """Each command of the documents is accepted by its command line (parsed, not run: the output
    folders it would create are made under a temporary folder). A bare mention of a command that needs
    the user's files (a probe's questions, diagnose's prompts) names it and is not meant to run."""
    import importlib
    words = shlex.split(command)
    name = words[1] if words[0] == "-m" else "sims." + Path(words[0]).stem
    args = words[2:] if words[0] == "-m" else words[1:]
    if name in NEEDS_INPUT and not args:
        return
    module = importlib.import_module(name)
    (tmp_path / "llm_bridge").symlink_to(ROOT / "llm_bridge")      # the example files, at the paths shown
    monkeypatch.chdir(tmp_path)
    try:
        (getattr(module, "parse", None) or module.parse_args)(args)       # diagnose's parse reads the files
    except SystemExit as exc:
        pytest.fail(f"{doc}: `{command}` is refused (exit {exc.code})")
