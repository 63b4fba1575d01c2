"""The model-access seam (llm_bridge.backend): the in-process backend against exact finite-state teachers and a
tiny transformers model, and the rule that no analysis calls a teacher model except through it."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def tree_bridge(weights=(0.3, 0.7), templates=((), ())):
    from aggregation import examples
    from llm_bridge import TabularLM, Teacher, Teachers
    tree = examples.prefix_tree(2, 4, 3, seed=3)
    teachers = [Teacher(TabularLM(tree, k), list(templates[k]), name=f"t{k}") for k in range(2)]
    return tree, Teachers(teachers, list(weights), vocab_size=tree.n)


def states_along(machine, tokens):
    s, out = machine.start, []
    for a in tokens:
        out.append(s)
        s = int(machine.next_state[s, a])
    return out


def test_score_and_distributions_equal_the_machine_in_any_block_size():
    from llm_bridge.backend import InProcess
    tree, bridge = tree_bridge()
    backend = InProcess(bridge)
    rows = [([3], [0, 1, 2, 0]), ([3], [2, 2]), ([3], [1, 0, 1])]
    scores = backend.score(rows)
    for (_, c), got in zip(rows, scores):
        st = states_along(tree, c)
        np.testing.assert_allclose(got, tree.log_probs[:, st, c], atol=2e-6)
    for block in (1, 2, 100):
        seen = set()
        for r, t, lp in backend.distributions(rows, block=block):
            assert lp.shape == (2, len(r), tree.n) and len(r) <= block
            for b, (i, s) in enumerate(zip(r, t)):
                st = states_along(tree, rows[i][1])[s]
                np.testing.assert_allclose(lp[:, b].numpy(), tree.log_probs[:, st], atol=2e-6)
                seen.add((int(i), int(s)))
        assert seen == {(i, s) for i, (_, c) in enumerate(rows) for s in range(len(c))}


def test_a_templates_cache_is_shared_without_changing_a_transformers_models_scores():
    """A tiny Qwen2 under two persona templates: the backend's scores (template once, its cache repeated over
    left-padded rows) equal one plain forward pass over template + prompt + continuation per row; generation
    from Streams draws what each row's own generator draws."""
    from llm_bridge import Teacher, Teachers
    from llm_bridge.backend import InProcess, Streams
    from llm_bridge.models import tiny_model
    model = tiny_model(vocab_size=40, seed=1, attention="eager").eval()
    templates = [[5, 6, 7], [8, 9]]
    bridge = Teachers([Teacher(model, t, name=f"p{i}") for i, t in enumerate(templates)], [0.5, 0.5], vocab_size=40)
    rows = [([1, 2, 3], [4, 5]), ([11], [12, 13, 14, 15])]
    got = InProcess(bridge).score(rows)
    with torch.no_grad():
        for (p, c), g in zip(rows, got):
            for k, t in enumerate(templates):
                ids = torch.tensor([t + p + c])
                lp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
                want = [float(lp[len(t) + len(p) - 1 + s, c[s]]) for s in range(len(c))]
                np.testing.assert_allclose(g[k], want, atol=1e-5)
    # generation: both personas in one batch (each row template + prompt), each at its own temperature;
    # every token is what the row's plain forward pass over template + prompt + its tokens so far gives,
    # drawn from the shared generator in row order at each step
    # (a sharper model, so that a template or a temperature changes the tokens drawn)
    temps = [1.0, 0.5]
    model = tiny_model(vocab_size=40, seed=1, attention="eager").eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)
    hot = Teachers([Teacher(model, t, temps[i], name=f"p{i}") for i, t in enumerate(templates)], [0.5, 0.5],
                   vocab_size=40)
    g = np.random.default_rng(4)
    prompts = [(0, [1, 2, 3]), (1, [11])]
    drawn = InProcess(hot).generate(prompts, 5, [g, g])
    assert [len(d) for d in drawn] == [5, 5]
    from llm_bridge.partition import _sample
    ref = np.random.default_rng(4)
    with torch.no_grad():
        for s in range(5):
            for (k, p), d in zip(prompts, drawn):
                logits = model(input_ids=torch.tensor([templates[k] + p + d[:s]])).logits[0, -1].float()
                lp = torch.log_softmax(logits / temps[k], -1)
                assert int(_sample(lp.double().numpy()[None], ref)[0]) == d[s], (s, k)


def test_streams_give_each_generator_its_own_sequence():
    from llm_bridge.backend import Streams
    a, b = np.random.default_rng(7), np.random.default_rng(8)
    s = Streams([(a, 2), (b, 1), (a, 1)])
    got = np.concatenate([s.random(4), s.random(4)])
    ra, rb = np.random.default_rng(7).random(6), np.random.default_rng(8).random(2)
    np.testing.assert_array_equal(got, [ra[0], ra[1], rb[0], ra[2], ra[3], ra[4], rb[1], ra[5]])


ANALYSES = ["llm_bridge/diagnosis.py", "llm_bridge/horizon.py", "llm_bridge/partition.py", "llm_bridge/probes.py",
            "llm_bridge/teachers.py", "llm_bridge/models.py", "sims/diagnose.py", "sims/flip_horizon.py",
            "sims/topk_bias.py", "sims/probe_prefix_bias.py", "sims/probe_batch.py"]


@pytest.mark.parametrize("path", ANALYSES)
def test_no_analysis_calls_a_teacher_model_but_through_the_backend(path):
    """The seam a served backend (issue 43) replaces: outside llm_bridge/backend.py, the diagnosis, the
    flip-horizon study, the probes and the top-k study never run a model's forward pass themselves."""
    code = re.sub(r"``.*?``", "", (ROOT / path).read_text())        # not what the docstrings quote
    calls = [m.group(0) for m in re.finditer(r"\bmodel\s*\(\s*input_ids|\.model\s*\(|\bdecoder\s*\(|\bmodel\.generate\(",
                                             code)]
    assert calls == [], f"{path} calls a model directly: {calls}"
