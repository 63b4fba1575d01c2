"""The teachers file's key checks and the pre-training diagnosis (llm_bridge.diagnosis, python -m
llm_bridge.diagnose) on exact machines: TabularLM teachers with planted vetoes, a planted confident
expert and a planted prefix flip, against aggregation's exact values."""

import json

import numpy as np
import pytest

from llm_bridge.models import read_teachers_file

GOOD = {"format": "chat", "teachers": [{"name": "a", "system": "One word.", "weight": 0.5, "temperature": 1.0},
                                       {"name": "b", "system": "Explain.", "weight": 0.5}]}


def write(tmp_path, spec, name="teachers.json"):
    path = tmp_path / name
    path.write_text(json.dumps(spec))
    return path


def with_key(where, old, new):
    spec = json.loads(json.dumps(GOOD))
    target = spec if where == "file" else spec["teachers"][1]
    target[new] = target.pop(old, 0.5)
    return spec


@pytest.mark.parametrize("where, old, typo, message", [
    ("file", None, "weigths", "unknown key 'weigths' in the file (did you mean 'weight', a key of each teacher?)"),
    ("teacher", "system", "sytem", "unknown key 'sytem' in teachers[1] (did you mean 'system'?)"),
    ("teacher", "weight", "wieght", "unknown key 'wieght' in teachers[1] (did you mean 'weight'?)"),
    ("teacher", "temperature", "temprature", "unknown key 'temprature' in teachers[1] (did you mean 'temperature'?)"),
    ("file", "format", "fromat", "unknown key 'fromat' in the file (did you mean 'format'?)"),
    ("teacher", None, "colour", "unknown key 'colour' in teachers[1] (valid keys: name, system, weight, temperature)"),
])
def test_unknown_keys_in_the_teachers_file_name_the_key_and_the_nearest(tmp_path, where, old, typo, message):
    path = write(tmp_path, with_key(where, old, typo))
    with pytest.raises(ValueError) as exc:
        read_teachers_file(path)
    assert message in str(exc.value) and str(path) in str(exc.value)


def test_a_valid_teachers_file_reads_and_bad_values_are_named(tmp_path):
    fmt, personas, weights = read_teachers_file(write(tmp_path, GOOD))
    assert fmt == "chat" and [p["name"] for p in personas] == ["a", "b"] and weights == [0.5, 0.5]
    for bad, message in (([1, 2], "must hold a JSON object"),
                         ({"teachers": [{"system": "x", "weight": "0.5"}]}, "teachers[0].weight = '0.5' must be a number"),
                         ({"teachers": [{"system": "x", "name": ""}]}, "teachers[0].name = '' must be a non-empty")):
        with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
            read_teachers_file(write(tmp_path, bad))


def test_shipped_teachers_files_are_valid():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1] / "llm_bridge" / "examples"
    files = sorted(root.rglob("teachers*.json"))
    assert files
    for f in files:
        read_teachers_file(f)


@pytest.mark.parametrize("typo", ["sytem", "wieght", "temprature"])
def test_probe_cli_refuses_a_teachers_file_typo_with_exit_2(tmp_path, capsys, typo):
    from llm_bridge import probe_prefix_bias
    path = write(tmp_path, with_key("teacher", {"sytem": "system", "wieght": "weight"}.get(typo, "temperature"), typo))
    with pytest.raises(SystemExit) as exc:
        probe_prefix_bias.main(["--teachers", str(path), "--model", "/nonexistent/model", "--question", "Q?",
                                "--options", "a", "b", "--correct", "a"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and f"unknown key '{typo}'" in err, err
