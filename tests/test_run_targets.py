"""What a distillation run converges to (llm_bridge.runs): the run descriptions' validation, and
predict_target verified by minimising each library's own loss on a tabular student (theory section 1, 2, 4).

The library rows need the wheels `make oracle` unpacks (TRL 1.16.0, verl 0.9.1, torchrl 0.14.1,
Liger-Kernel 0.8.5); without them they skip, saying so. tests/run_targets_harness.py holds the harness.
"""

import dataclasses

import numpy as np
import pytest

from llm_bridge import runs
from llm_bridge.runs import LigerRun, OwnRun, TorchRLRun, TRLRun, VerlRun, predict_target

from run_targets_harness import TV_TOLERANCE, candidates, expected_loss, solve, tv, verify, Tabular, machine

WEIGHTS = {1: (1.0,), 2: (0.3, 0.7), 3: (0.2, 0.3, 0.5)}


@pytest.mark.parametrize("make, message", [
    (lambda: TRLRun(beta=1.5), "beta"), (lambda: TRLRun(lmbda=-0.1), "lmbda"), (lambda: TRLRun(temperature=0), "temperature"),
    (lambda: TRLRun(seq_kd=1), "seq_kd"), (lambda: TRLRun(trainer="SFTTrainer"), "trainer"),
    (lambda: TRLRun(trainer="DistillationTrainer", lmbda=0.5), "lmbda"), (lambda: TRLRun(weights=(0.5, 0.6)), "weights"),
    (lambda: TRLRun(weights=[0.5, 0.5]), "weights"), (lambda: TRLRun(weights=(1.5, -0.5)), r"weights\[1\]"),
    (lambda: TRLRun(teachers="averaged"), "teachers"), (lambda: VerlRun(loss_mode="k4"), "loss_mode"),
    (lambda: VerlRun(topk=0), "topk"), (lambda: VerlRun(loss_mode="forward_kl_topk", use_policy_gradient=True),
                                         "use_policy_gradient"),
    (lambda: VerlRun(teachers="pooled"), "teachers"), (lambda: TorchRLRun(kl_direction="both"), "kl_direction"),
    (lambda: LigerRun(beta=float("nan")), "beta"), (lambda: OwnRun(loss="mse"), "loss"), (lambda: OwnRun(gamma=0.5), "gamma"),
    (lambda: OwnRun(loss="rkl_policy_gradient", samples="teacher"), "samples"), (lambda: OwnRun(samples="both"), "samples")])
def test_bad_flags_are_value_errors_naming_them(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_runs_are_frozen_and_predict_target_rejects_other_objects():
    run = TRLRun()
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.beta = 0.0
    with pytest.raises(ValueError, match="run"):
        predict_target({"beta": 0.5})


@pytest.mark.parametrize("run, label", [
    (TRLRun(beta=0.0, lmbda=1.0, weights=(0.5, 0.5)), "A"), (TRLRun(beta=1.0, lmbda=1.0, weights=(0.5, 0.5)), "l"),
    (TRLRun(beta=0.5, weights=(0.5, 0.5)), "J_0.5"), (TRLRun(beta=0.5), "A"),
    (TRLRun(beta=0.0, lmbda=0.0, seq_kd=True, weights=(0.5, 0.5)), "A (posterior weights)"),
    (TRLRun(beta=0.0, lmbda=0.0, seq_kd=True, weights=(0.5, 0.5), teachers="pooled"), "A"),
    (TRLRun(beta=0.0, lmbda=0.5, seq_kd=True, weights=(0.5, 0.5)), "A (visitation weights)"),
    (TRLRun(beta=0.0, temperature=2.0), "A at temperature 2"),
    (VerlRun(loss_mode="k3"), "A"), (VerlRun(loss_mode="low_var_kl", weights=(0.5, 0.5)), "A"),
    (VerlRun(loss_mode="k2", weights=(0.5, 0.5)), "l"), (VerlRun(loss_mode="k3+"), "l"), (VerlRun(loss_mode="k1"), "none"),
    (VerlRun(loss_mode="k1", use_policy_gradient=True), "l"), (VerlRun(loss_mode="k3", use_policy_gradient=True), "none"),
    (VerlRun(loss_mode="forward_kl_topk", topk=32), "none"), (VerlRun(loss_mode="forward_kl_topk", topk=3, vocab_size=3), "A"),
    (TorchRLRun(kl_direction="reverse", weights=(0.5, 0.5)), "A"),
    (TorchRLRun(kl_direction="forward", weights=(0.5, 0.5)), "A (posterior weights)"),
    (OwnRun(loss="rkl_policy_gradient", gamma=1), "g"), (OwnRun(loss="rkl_policy_gradient", gamma=0), "l"),
    (OwnRun(loss="kl_estimator_loss", estimator="k3", pool="before", weights=(0.5, 0.5)), "l"),
    (OwnRun(loss="kl_estimator_loss", estimator="k1", samples="teacher"), "diverges")])
def test_predict_target_names_the_theory(run, label):
    prediction = predict_target(run)
    assert prediction.label == label
    assert prediction.reason and prediction.source


# ------------------------------------------------------------------------------------------------
# verification: the minimiser of the library's own loss against the prediction
# ------------------------------------------------------------------------------------------------
def check_reaches(run, K):
    prediction = predict_target(run)
    log_q, residual, m, tab = verify(run, K)
    assert residual < 1e-10, f"no fixed point found (largest gradient entry {residual:.2e})"
    tau = prediction.temperature                # the target is between the temperature-tau conditionals
    if tau != 1.0:
        log_q = log_q / tau - np.logaddexp.reduce(log_q / tau, axis=-1, keepdims=True)
        prediction = dataclasses.replace(prediction, temperature=1.0)
    predicted = runs.target_log_probs(prediction, machine(K, temperature=tau), run.weights)
    err = tv(log_q, predicted).max()
    assert err <= TV_TOLERANCE, f"{prediction.label}: TV {err:.2e}"
    # the verdict can fail: every other named target is far from the minimiser (K >= 2)
    if K > 1:
        others = {name: tv(log_q, lp).max() for name, lp in candidates(K, run.weights, temperature=tau).items()
                  if tv(lp, predicted).max() > 1e-3}
        assert min(others.values()) > 1e-3, others
    return err


def check_none(run, K):
    """No divergence's gradient: either the expected gradient vanishes everywhere (the student does not
    move), or no named target is a fixed point of it."""
    import torch
    m = machine(K)
    tab = Tabular(m, run.weights)
    loss = expected_loss(run, tab)

    def grad_at(log_q):
        theta = torch.tensor(log_q).requires_grad_()
        g, = torch.autograd.grad(loss(theta), theta)
        return float(g.abs().max())
    random = np.random.default_rng(0).normal(size=(m.S, 3))
    if grad_at(random) < 1e-12:
        return "zero"
    at = {name: grad_at(lp) for name, lp in candidates(K, run.weights).items()}
    assert min(at.values()) > 1e-4, at
    return "none"


def check(run, K):
    run = dataclasses.replace(run, weights=WEIGHTS[K])
    prediction = predict_target(run)
    if prediction.target in ("none",):
        return check_none(run, K)
    if prediction.target == "diverges":
        return check_diverges(run, K)
    return check_reaches(run, K)


def check_diverges(run, K):
    """The expected gradient is minus the forward-KL gradient to A: a step raises KL(A || q)."""
    import torch
    m = machine(K)
    tab = Tabular(m, run.weights)
    loss = expected_loss(run, tab)
    theta = torch.zeros(m.S, 3, dtype=torch.float64, requires_grad=True)
    g, = torch.autograd.grad(loss(theta), theta)
    A = runs.target_log_probs(runs.Prediction("A"), m, run.weights)
    q = torch.softmax(theta.detach(), -1).numpy()
    c = predict_target(run)
    # minus (q - A) per state, up to a positive per-state factor
    ref = -(q - np.exp(A))
    ratio = (g.numpy() * ref).sum(-1) / (ref * ref).sum(-1)
    assert np.all(ratio > 0) and np.abs(g.numpy() - ratio[:, None] * ref).max() < 1e-12, c.label
    return "diverges"


LIBRARY_CASES = [
    TRLRun(beta=0.0, lmbda=1.0), TRLRun(beta=1.0, lmbda=1.0), TRLRun(beta=0.5, lmbda=1.0),
    TRLRun(beta=0.5, lmbda=0.5),                                          # docs/losses.md's example
    TRLRun(beta=0.0, lmbda=0.0, seq_kd=True), TRLRun(beta=1.0, lmbda=0.0, seq_kd=True),
    TRLRun(beta=0.0, lmbda=0.5, seq_kd=True), TRLRun(beta=0.0, lmbda=0.0, seq_kd=True, teachers="pooled"),
    TRLRun(trainer="DistillationTrainer", beta=1.0, lmbda=1.0),
    TRLRun(beta=0.0, lmbda=1.0, temperature=2.0), TRLRun(beta=1.0, lmbda=1.0, temperature=0.9),
    LigerRun(beta=0.0), LigerRun(beta=1.0), LigerRun(beta=0.5),
    VerlRun(loss_mode="k3"), VerlRun(loss_mode="low_var_kl"), VerlRun(loss_mode="k2"), VerlRun(loss_mode="k3+"),
    VerlRun(loss_mode="k1"), VerlRun(loss_mode="k1", use_policy_gradient=True),
    VerlRun(loss_mode="k3", use_policy_gradient=True), VerlRun(loss_mode="forward_kl_topk", topk=2, vocab_size=3),
    VerlRun(loss_mode="forward_kl_topk", topk=3, vocab_size=3),
    TorchRLRun(kl_direction="reverse"), TorchRLRun(kl_direction="forward"),
]


@pytest.mark.oracle
@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("run", LIBRARY_CASES, ids=lambda r: runs.describe(r))
def test_library_loss_reaches_the_predicted_target(run, K):
    check(run, K)


OWN_CASES = [
    OwnRun(loss="forward_kl"), OwnRun(loss="reverse_kl"), OwnRun(loss="generalized_jsd", beta=0.5),
    OwnRun(loss="forward_kl", teachers="routed", samples="teacher"),
    OwnRun(loss="rkl_policy_gradient", gamma=1), OwnRun(loss="rkl_policy_gradient", gamma=0),
    OwnRun(loss="kl_estimator_loss", estimator="k3", pool="before"), OwnRun(loss="kl_estimator_loss", estimator="k3"),
    OwnRun(loss="kl_estimator_loss", estimator="k2"), OwnRun(loss="kl_estimator_loss", estimator="k1"),
    OwnRun(loss="kl_estimator_loss", estimator="k1", mode="reward"),
    OwnRun(loss="kl_estimator_loss", estimator="k1", samples="teacher"),
    OwnRun(loss="kl_estimator_loss", estimator="k3", direction="forward", samples="teacher", teachers="routed"),
]


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("run", OWN_CASES, ids=lambda r: runs.describe(r))
def test_own_loss_reaches_the_predicted_target(run, K):
    check(run, K)


def test_the_committed_table_is_what_the_code_writes():
    from run_targets_harness import TABLE, render_table, table_cases
    assert TABLE.read_text() == render_table(table_cases()), "run `python tests/run_targets_harness.py`"


def test_the_losses_page_example_prints_what_it_says(capsys):
    import re
    from run_targets_harness import TABLE
    text = (TABLE.parent / "losses.md").read_text()
    code = next(block for block in re.findall(r"```python\n(.*?)```", text, re.S) if "predict_target" in block)
    exec(code, {})
    label, reason = capsys.readouterr().out.splitlines()[:2]
    assert label == "J_0.5" and "JSD_beta" in reason
