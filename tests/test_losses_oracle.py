"""The oracle tier: llm_bridge.losses against TRL's, verl's, torchrl's and Liger's own functions, run from
their released wheels (torch code path only, nothing but the function and the module it needs).

`make oracle` downloads the wheels (pip download --no-deps) and unpacks them under .cache/oracle/
(or $LOSSES_ORACLE_DIR); without them every test here skips, saying so, so the suite runs offline.
"""

import pytest
import torch

from llm_bridge.losses import (forward_kl, fused_linear_loss, generalized_jsd, kl_estimator_loss, mask_from_labels,
                               token_log_probs)
from llm_bridge.losses import oracle

pytestmark = pytest.mark.oracle


def functions(package, *names, cls=None):
    try:
        return oracle.functions(package, *names, cls=cls)
    except oracle.OracleMissing as missing:
        pytest.skip(str(missing))


def liger_jsd_class():
    try:
        return oracle.liger_jsd_class()
    except oracle.OracleMissing as missing:
        pytest.skip(str(missing))


def problem(seed=0, B=2, T=5, V=11):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, T, V, generator=g, dtype=torch.float64).requires_grad_()
    t = 2 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 1] = labels[1, 3] = labels[1, 4] = -100
    return s, t, labels


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_trl_generalized_jsd_loss_equals_ours(beta, temperature):
    (trl_jsd,) = functions("trl", "generalized_jsd_loss", cls="GKDTrainer")
    s, t, labels = problem()
    kw = dict(beta=beta, student_temperature=temperature, teacher_temperature=temperature)
    for trl_kw, ours_kw in (({"labels": labels}, {"mask": mask_from_labels(labels)}),
                            ({"labels": None}, {"reduction": "batchmean"}),
                            ({"labels": labels, "num_items_in_batch": torch.tensor(17)},
                             {"mask": mask_from_labels(labels), "num_items_in_batch": 17})):
        theirs = trl_jsd(s, t, beta=beta, temperature=temperature, **trl_kw)
        ours, _ = generalized_jsd(s, t[None], [1.0], **kw, **ours_kw)
        assert float(ours) == pytest.approx(float(theirs), rel=1e-12, abs=1e-15)
        g_theirs, = torch.autograd.grad(theirs, s)
        g_ours, = torch.autograd.grad(ours, s)
        torch.testing.assert_close(g_ours, g_theirs, rtol=0, atol=1e-13)


@pytest.mark.parametrize("name, ours_kw", [("k1", dict(estimator="k1")), ("k2", dict(estimator="k2")),
                                           ("low_var_kl", dict(estimator="k3", clamp=10.0)),
                                           ("k3+", dict(estimator="k3+", clamp=10.0))])
def test_verl_kl_penalty_equals_kl_estimator_loss(name, ours_kw):
    kl_penalty, _ = functions("verl", "kl_penalty", "kl_penalty_forward")
    s, t, _ = problem(seed=1)
    t = 3 * t                                               # so that the clamp at 10 binds somewhere
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(2))
    lq, lp = token_log_probs(s, tokens), token_log_probs(t, tokens)
    theirs = kl_penalty(lq, lp, name)
    ours, _ = kl_estimator_loss(s, tokens, lp[None], [1.0], reduction="none", **ours_kw)
    torch.testing.assert_close(ours, theirs, rtol=1e-14, atol=1e-15)
    grad = torch.linspace(0.5, 1.5, 10, dtype=torch.float64).reshape(2, 5)
    g_theirs, = torch.autograd.grad(theirs, s, grad)
    g_ours, = torch.autograd.grad(ours, s, grad)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("direction", ["reverse", "forward"])
def test_torchrl_k3_token_estimate_equals_kl_estimator_loss(direction):
    (k3,) = functions("torchrl", "k3_kl_token_estimate")
    s, t, _ = problem(seed=3)
    tokens = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(4))
    lq, lp = token_log_probs(s, tokens), token_log_probs(t, tokens)
    theirs = k3(lp, lq) if direction == "reverse" else k3(lq, lp)    # DistillationLoss's two directions
    ours, _ = kl_estimator_loss(s, tokens, lp[None], [1.0], estimator="k3", direction=direction, reduction="none")
    torch.testing.assert_close(ours, theirs, rtol=1e-14, atol=1e-15)
    g_theirs, = torch.autograd.grad(theirs.sum(), s)
    g_ours, = torch.autograd.grad(ours.sum(), s)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_liger_fused_linear_jsd_equals_ours_at_the_same_beta(beta):
    """Liger >= 0.5.6 (0.8.5 unpacked by `make oracle`), torch path (compiled=False), on CPU: the same beta."""
    loss_class = liger_jsd_class()
    g = torch.Generator().manual_seed(5)
    B, T, H, V = 2, 6, 8, 13
    h = torch.randn(B * T, H, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, H, generator=g, dtype=torch.float64, requires_grad=True)
    h_t = torch.randn(B * T, H, generator=g, dtype=torch.float64)
    W_t = torch.randn(V, H, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B * T,), generator=g)
    labels[[1, 4, 7]] = -100
    liger = loss_class(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=beta, temperature=1.0, compiled=False,
                       chunk_size=4)
    theirs = liger(h, W, h_t, W_t, labels)
    ours, _ = fused_linear_loss(h.reshape(B, T, H), W, (h_t @ W_t.T).reshape(1, B, T, V), [1.0],
                                mask_from_labels(labels.reshape(B, T)), kind="jsd", beta=beta)
    # Liger accumulates its loss in float32 (its chunk buffers are float32 whatever the inputs): 1e-6
    assert float(ours) == pytest.approx(float(theirs), rel=1e-6)
    for a, b in zip(torch.autograd.grad(ours, (h, W)), torch.autograd.grad(theirs, (h, W))):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-7)
    plain, _ = forward_kl(h.reshape(B, T, H) @ W.T, (h_t @ W_t.T).reshape(1, B, T, V), [1.0])
    assert float(plain) != pytest.approx(float(theirs), rel=1e-3)     # the comparison can fail
