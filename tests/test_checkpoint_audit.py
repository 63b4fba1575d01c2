"""The checkpoint audit (llm_bridge.checkpoint_audit): a tiny Qwen2 student distilled from two TabularLM
teachers with forward KL ends closest to A and with reverse KL closest to l, and every per-position KL
equals the one computed from aggregation's exact tables (theory section 1, 2, 6)."""

import numpy as np
import pytest
import torch
from transformers import TrainerState

from llm_bridge.checkpoint_audit import TargetAuditCallback, target_distances
from llm_bridge.losses import forward_kl, reverse_kl
from llm_bridge.tabular import TabularLM, target_log_probs, toy_problem, tree_responses
from llm_bridge.teachers import Teacher, Teachers

WEIGHTS = (0.5, 0.5)
H = 3


def distilled(loss, steps=100):
    machine, teachers, student = toy_problem(0)
    inputs, _, _ = tree_responses(machine, H)
    with torch.no_grad():
        teacher_logits = torch.stack([t(inputs).logits for t in teachers])
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    for _ in range(steps):
        value, _ = loss(student(input_ids=inputs).logits, teacher_logits, WEIGHTS, vocab_size=machine.n)
        opt.zero_grad()
        value.backward()
        opt.step()
    return machine, student


@pytest.fixture(scope="module")
def students():
    return {name: distilled(loss) for name, loss in (("forward", forward_kl), ("reverse", reverse_kl))}


def bridge(machine):
    return Teachers([Teacher(TabularLM(machine, k)) for k in range(machine.K)], WEIGHTS, vocab_size=machine.n)


def responses(machine):
    """The responses ending in token 0: their positions cover every state of the tree once or more."""
    inputs, tokens, states = tree_responses(machine, H)
    keep = tokens[:, -1] == 0
    return inputs[keep], tokens[keep], states[keep]


def audit(machine, student):
    _, tokens, _ = responses(machine)
    return target_distances(student, bridge(machine), [[machine.n]] * len(tokens), tokens.tolist())


@pytest.mark.parametrize("loss, target, table", [("forward", "A", "arithmetic"), ("reverse", "l", "local")])
def test_a_distilled_student_is_closest_to_the_target_its_loss_names(students, loss, target, table):
    machine, student = students[loss]
    out = audit(machine, student)
    assert out["closest"] == target, out["summary"]
    assert out["margin_interval"][0] > 0, out["verdict"]
    # every per-position KL equals KL(q || target) from aggregation's tables along the same path
    inputs, tokens, states = responses(machine)
    with torch.no_grad():
        log_q = torch.log_softmax(student(input_ids=inputs).logits[..., :machine.n].double(), -1).numpy()
    exact = target_log_probs(machine, WEIGHTS, H, table)
    positions = out["positions"]
    for row in positions.itertuples():
        lt = exact[row.t, states[row.prompt, row.t]]
        lq = log_q[row.prompt, row.t]
        assert getattr(row, target) == pytest.approx(float(np.sum(np.exp(lq) * (lq - lt))), abs=2e-6)


def test_the_callback_logs_the_drift_toward_the_target(students):
    machine, _ = students["forward"]
    _, _, student = toy_problem(0)                   # untrained: the audit before and after training
    callback = TargetAuditCallback(bridge(machine), [[machine.n]] * 4, every=2, horizon=H)
    state = TrainerState()
    callback.on_train_begin(None, state, None, model=student)
    state.global_step = 2
    callback.on_step_end(None, state, None, model=students["forward"][1])
    state.global_step = 3
    callback.on_step_end(None, state, None, model=students["forward"][1])     # not a multiple of every
    assert [r["step"] for r in callback.history] == [0, 2]
    assert callback.history[1]["audit/KL to A"] < callback.history[0]["audit/KL to A"] / 5
    assert callback.history[1]["audit/closest"] == "A"
    assert state.log_history == callback.history


def test_bad_input_is_a_value_error_naming_it(students):
    machine, student = students["forward"]
    with pytest.raises(ValueError, match="prompts"):
        target_distances(student, bridge(machine), [])
    with pytest.raises(ValueError, match="responses"):
        target_distances(student, bridge(machine), [[machine.n]], [[0], [1]])
    with pytest.raises(ValueError, match="horizon"):
        target_distances(student, bridge(machine), [[machine.n]], horizon=0)


def test_the_monte_carlo_kl_to_g_matches_the_exact_tables(students):
    """KL(q || g) from sampled ln Z's against aggregation's exact g on the same paths (the student's own
    rollouts, horizon 3): within a few MC standard errors, and g is far from A and l here."""
    machine, student = students["reverse"]
    out = target_distances(student, bridge(machine), [[machine.n]] * 4, horizon=H, seed=3, g_samples=1000)
    exact = target_log_probs(machine, WEIGHTS, H, "geometric")
    positions = out["positions"]
    for i in range(4):
        response = [int(a) for a in out["responses"][i]]
        state, h_rows = machine.start, positions[positions.prompt == i]
        inputs = torch.tensor([[machine.n] + response[:-1]])
        with torch.no_grad():
            log_q = torch.log_softmax(student(input_ids=inputs).logits[0, :, :machine.n].double(), -1).numpy()
        for t, row in zip(range(H), h_rows.itertuples()):
            lt = exact[t, state]
            assert row.g == pytest.approx(float(np.sum(np.exp(log_q[t]) * (log_q[t] - lt))), abs=0.01)
            state = machine.next_state[state, response[t]]
    assert out["summary"].loc["g", "mean KL"] > 0.05 + out["summary"].loc["l", "mean KL"]


def test_the_routed_column_is_the_sequence_level_mixture_of_runs(students):
    """KL(q || routed) at every position equals KL(q || A with posterior weights) from llm_bridge.runs'
    table of the machine (the target of routed teachers on their own traces, theory section 2), and differs from A
    after the first token."""
    from llm_bridge import runs
    machine, student = students["forward"]
    out = audit(machine, student)
    inputs, _, states = responses(machine)
    with torch.no_grad():
        log_q = torch.log_softmax(student(input_ids=inputs).logits[..., :machine.n].double(), -1).numpy()
    routed = runs.target_log_probs(runs.Prediction("A", weights="posterior"), machine, WEIGHTS)
    for row in out["positions"].itertuples():
        lq, lt = log_q[row.prompt, row.t], routed[states[row.prompt, row.t]]
        assert row.routed == pytest.approx(float(np.sum(np.exp(lq) * (lq - lt))), abs=2e-6)
    later = out["positions"][out["positions"].t > 0]
    assert (later.routed - later.A).abs().max() > 0.05
