"""llm_bridge.losses as a TRL / verl user meets it (issue 21): reductions and masks, legitimate inputs
(-inf teacher logits, NaN teachers with weight 0), autograd, and the tests that each catch one of the
deliberate breaks listed in the issue (per-sample weights on the masked path, the finiteness scan,
reduction 'sum', importance weights in reward mode). Every expected value is written out in float64."""

import math
import os

import numpy as np
import pytest
import torch

from llm_bridge.losses import (forward_kl, fused_linear_loss, generalized_jsd, kl_estimator_loss, mask_from_labels,
                               reverse_kl, rkl_policy_gradient, token_log_probs)

W3 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)


def problem(B=3, T=6, V=7, K=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, T, V, generator=g, dtype=torch.float64).requires_grad_()
    t = 2 * torch.randn(K, B, T, V, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) > 0.35
    weights = torch.softmax(torch.randn(B, K, generator=g, dtype=torch.float64), -1)   # non-one-hot (B, K)
    return s, t, mask, weights


def per_position(kind, s, t, weights, beta=0.5):
    """sum_k w_bk D(p_k, q) per position (B, T), float64, written out."""
    lq = torch.log_softmax(s, -1)
    lp = torch.log_softmax(t, -1)
    q = lq.exp()
    out = 0
    for k in range(t.shape[0]):
        p = lp[k].exp()
        if kind == "forward":
            d = torch.where(p > 0, p * (lp[k] - lq), torch.zeros_like(p)).sum(-1)
        elif kind == "reverse":
            d = (q * (lq - lp[k])).sum(-1)
        else:
            m = torch.log(beta * p + (1 - beta) * q)
            d = beta * torch.where(p > 0, p * (lp[k] - m), torch.zeros_like(p)).sum(-1) + (1 - beta) * (q * (lq - m)).sum(-1)
        out = out + weights[:, k, None] * d
    return out


# ------------------------------------------------------------------------------------------------
# per-sample weights with a mask; reductions
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, fn", [("forward", forward_kl), ("reverse", reverse_kl), ("jsd", generalized_jsd)])
def test_per_sample_weights_with_a_mask_and_small_chunks(kind, fn):
    """Non-one-hot (B, K) weights together with a mask and chunks that split samples: each position must
    use its own sample's weights (a lookup by chunk row instead of position changes the value)."""
    s, t, mask, weights = problem()
    kw = dict(beta=0.3) if kind == "jsd" else {}
    want = per_position(kind, s, t, weights, 0.3)
    for chunk in (1, 4, 5, 100):
        got, _ = fn(s, t, weights, mask, reduction="none", chunk_size=chunk, **kw)
        np.testing.assert_allclose(got.detach().numpy(), torch.where(mask, want, 0).detach().numpy(), rtol=1e-12,
                                   atol=1e-14)
        loss, _ = fn(s, t, weights, mask, chunk_size=chunk, **kw)
        (g,) = torch.autograd.grad(loss, s)
        (g_want,) = torch.autograd.grad(want[mask].mean(), s, retain_graph=True)
        np.testing.assert_allclose(g.numpy(), g_want.numpy(), atol=1e-13)


def test_reductions_mean_sum_batchmean_and_num_items_in_batch():
    s, t, mask, weights = problem(seed=1)
    want = torch.where(mask, per_position("forward", s, t, weights), 0).detach()
    n, B = int(mask.sum()), s.shape[0]
    cases = {"mean": want.sum() / n, "sum": want.sum(), "batchmean": want.sum() / B}
    for reduction, value in cases.items():
        for fn in (forward_kl,):
            got, _ = fn(s, t, weights, mask, reduction=reduction, chunk_size=4)
            assert float(got) == pytest.approx(float(value), rel=1e-13), reduction
    # num_items_in_batch: the sum over this micro-batch divided by the whole step's kept positions
    got, _ = forward_kl(s, t, weights, mask, num_items_in_batch=torch.tensor(40))
    assert float(got) == pytest.approx(float(want.sum() / 40), rel=1e-13)
    # two micro-batches with num_items_in_batch add up to the full batch's mean, value and gradient
    full, _ = forward_kl(s, t, weights, mask)
    (g_full,) = torch.autograd.grad(full, s)
    halves = [forward_kl(s[i], t[:, i], weights[i], mask[i], num_items_in_batch=n)[0] for i in (slice(0, 1), slice(1, 3))]
    (g_acc,) = torch.autograd.grad(halves[0] + halves[1], s)
    assert float(halves[0] + halves[1]) == pytest.approx(float(full), rel=1e-13)
    np.testing.assert_allclose(g_acc.numpy(), g_full.numpy(), atol=1e-15)
    with pytest.raises(ValueError, match="num_items_in_batch replaces the denominator"):
        forward_kl(s, t, weights, mask, reduction="sum", num_items_in_batch=5)
    with pytest.raises(ValueError, match="num_items_in_batch = 0"):
        forward_kl(s, t, weights, mask, num_items_in_batch=0)
    with pytest.raises(ValueError, match="reduction = 'avg'"):
        forward_kl(s, t, weights, mask, reduction="avg")


def test_sampled_losses_reduce_like_the_token_losses():
    """reduction 'sum' is the sum (not the mean), 'batchmean' the sum over B, num_items_in_batch divides
    the sum, for kl_estimator_loss and rkl_policy_gradient."""
    s, t, mask, weights = problem(seed=2)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 7, (3, 6), generator=g)
    lp = token_log_probs(t, tokens)
    for fn, kw in ((kl_estimator_loss, {}), (rkl_policy_gradient, {"baseline": None})):
        none, _ = fn(s, tokens, lp, weights, mask, reduction="none", **kw)
        total = float(none.sum())
        assert torch.all(none[~mask] == 0)
        assert float(fn(s, tokens, lp, weights, mask, reduction="sum", **kw)[0]) == pytest.approx(total, rel=1e-13)
        assert float(fn(s, tokens, lp, weights, mask, **kw)[0]) == pytest.approx(total / int(mask.sum()), rel=1e-13)
        assert float(fn(s, tokens, lp, weights, mask, reduction="batchmean", **kw)[0]) == pytest.approx(total / 3, rel=1e-13)
        assert float(fn(s, tokens, lp, weights, mask, num_items_in_batch=50, **kw)[0]) == pytest.approx(total / 50, rel=1e-13)


def test_masks_are_zero_one_and_an_empty_mask_gives_a_zero_loss_that_backpropagates():
    s, t, mask, weights = problem(seed=3)
    want, _ = forward_kl(s, t, weights, mask)
    for m in (mask.int(), mask.long(), mask.double(), mask.float()):
        assert float(forward_kl(s, t, weights, m)[0]) == float(want)
    half = mask.double()
    half[0, 1] = 0.5
    with pytest.raises(ValueError, match=r"mask\[0, 1\] = 0.5 is not 0 or 1"):
        forward_kl(s, t, weights, half)
    labels = torch.randint(0, 5, (3, 6), generator=torch.Generator().manual_seed(0))
    labels[0, 0] = -100
    with pytest.raises(ValueError, match=r"mask\[0, 0\] = -100 is not 0 or 1.*mask_from_labels"):
        forward_kl(s, t, weights, labels)
    assert torch.equal(mask_from_labels(labels), labels != -100)
    assert torch.equal(mask_from_labels(labels, ignore_index=0), labels != 0)
    with pytest.raises(ValueError, match="labels must be an integer"):
        mask_from_labels(labels.double())
    empty = torch.zeros(3, 6, dtype=torch.bool)
    for fn in (forward_kl, reverse_kl):
        loss, metrics = fn(s, t, weights, empty)
        assert float(loss) == 0.0 and metrics["n_positions"] == 0
        (g,) = torch.autograd.grad(loss, s)
        assert torch.all(g == 0)
        with pytest.raises(ValueError, match="mask is all zero"):
            fn(s, t, weights, empty, empty_mask="raise")
    tokens = torch.zeros(3, 6, dtype=torch.long)
    loss, _ = kl_estimator_loss(s, tokens, token_log_probs(t, tokens), weights, empty)
    assert float(loss) == 0.0 and torch.all(torch.autograd.grad(loss, s)[0] == 0)


# ------------------------------------------------------------------------------------------------
# the finiteness scan covers every chunk; importance weights in reward mode
# ------------------------------------------------------------------------------------------------
def test_the_finiteness_check_scans_every_chunk():
    s, t, _, _ = problem(B=2, T=8, seed=4)
    for b, pos in ((0, 0), (1, 7), (1, 2)):
        bad = t.clone()
        bad[1, b, pos, 3] = math.nan
        with pytest.raises(ValueError, match=rf"teacher 1 logits\[{b}, {pos}\] has a non-finite logit"):
            forward_kl(s, bad, W3, chunk_size=3)
        s_bad = s.detach().clone()
        s_bad[b, pos, 2] = math.inf
        with pytest.raises(ValueError, match=rf"student_logits\[{b}, {pos}\]"):
            reverse_kl(s_bad, t, W3, chunk_size=3)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("mode", ["loss", "reward"])
def test_importance_weights_multiply_each_token_in_both_modes(estimator, mode):
    """kl_estimator_loss with importance weights rho against rho k(r) (loss) and rho sg(k(r)) ln q (reward)."""
    s, t, mask, weights = problem(seed=6)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 7, (3, 6), generator=g)
    rho = 2 * torch.rand(3, 6, generator=g, dtype=torch.float64)
    lp = token_log_probs(t, tokens)
    lq = token_log_probs(s, tokens)
    r = (weights.T[:, :, None] * lp).sum(0) - lq
    k = {"k1": -r, "k2": r * r / 2, "k3": torch.expm1(r) - r}[estimator]
    per = rho * (k if mode == "loss" else k.detach() * lq)
    want = per[mask].sum()
    got, _ = kl_estimator_loss(s, tokens, lp, weights, mask, estimator=estimator, mode=mode, importance_weights=rho,
                               reduction="sum")
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    (g_got,) = torch.autograd.grad(got, s)
    (g_want,) = torch.autograd.grad(want, s)
    np.testing.assert_allclose(g_got.numpy(), g_want.numpy(), atol=1e-13)


def test_fused_linear_loss_batchmean_and_per_sample_weights_with_a_mask():
    g = torch.Generator().manual_seed(7)
    B, T, H, V = 3, 5, 4, 9
    h = torch.randn(B, T, H, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(V, H, dtype=torch.float64, generator=g, requires_grad=True)
    t = torch.randn(2, B, T, V, dtype=torch.float64, generator=g)
    weights = torch.softmax(torch.randn(B, 2, generator=g, dtype=torch.float64), -1)
    mask = torch.rand(B, T, generator=g) > 0.3
    fused, _ = fused_linear_loss(h, W, t, weights, mask, chunk_size=2, reduction="batchmean")
    want = torch.where(mask, per_position("forward", h @ W.T, t, weights), 0).sum() / B
    assert float(fused) == pytest.approx(float(want), rel=1e-12)
    for x, y in zip(torch.autograd.grad(fused, (h, W)), torch.autograd.grad(want, (h, W))):
        np.testing.assert_allclose(x.numpy(), y.numpy(), atol=1e-12)


# ------------------------------------------------------------------------------------------------
# legitimate inputs: -inf teacher logits, non-finite teachers with weight 0, permuted teachers
# ------------------------------------------------------------------------------------------------
def with_minus_inf(t, seed=8):
    """Teachers with -inf on about a third of the vocabulary (a vocabulary mask / top-p filter), never a whole row."""
    drop = torch.rand(t.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) < 0.35
    drop[..., 0] = False
    return t.masked_fill(drop, -math.inf)


@pytest.mark.parametrize("kind, fn, kw", [("forward", forward_kl, {}), ("jsd", generalized_jsd, {"beta": 0.3})])
def test_minus_inf_teacher_logits_give_the_exact_divergence(kind, fn, kw):
    """0 log 0 = 0: the value and gradient of the divergence written out with p = 0 there, and equal (to
    rounding) to the same teachers with finfo.min in place of -inf."""
    s, t, mask, weights = problem(seed=9)
    t_inf = with_minus_inf(t)
    want = per_position(kind, s, t_inf, weights, 0.3)
    got, metrics = fn(s, t_inf, weights, mask, chunk_size=4, reduction="none", **kw)
    np.testing.assert_allclose(got.detach().numpy(), torch.where(mask, want, 0).detach().numpy(), rtol=1e-12, atol=1e-14)
    # the floor sum_k w_k KL(p_k || A), written out; the draw has tokens where every teacher is -inf (A = 0)
    lp = torch.log_softmax(t_inf, -1)
    A = torch.einsum("bk,kbtv->btv", weights, lp.exp())
    assert int((A == 0).sum()) >= 2
    floor = sum(weights[:, k, None] * torch.where(lp[k] > -math.inf, lp[k].exp() * (lp[k] - A.log()), 0).sum(-1)
                for k in range(t.shape[0]))
    np.testing.assert_allclose(metrics["teacher_disagreement"][mask].numpy(), floor[mask].numpy(), rtol=1e-12, atol=1e-14)
    (g,) = torch.autograd.grad(got.sum(), s)
    (g_want,) = torch.autograd.grad(torch.where(mask, want, 0).sum(), s)
    np.testing.assert_allclose(g.numpy(), g_want.numpy(), atol=1e-13)
    t_min = t_inf.masked_fill(torch.isneginf(t_inf), torch.finfo(torch.float64).min)
    np.testing.assert_allclose(got.detach().numpy(), fn(s, t_min, weights, mask, reduction="none", **kw)[0].detach().numpy(),
                               rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"teacher 0 logits\[\d, \d\] is -inf at vocabulary index \d+ with weight > 0: "
                                         r"the reverse KL is infinite"):
        reverse_kl(s, t_inf, weights, mask)
    whole = t.clone()
    whole[2, 1, 4] = -math.inf
    with pytest.raises(ValueError, match=r"teacher 2 logits\[1, 4\] is -inf at every vocabulary index"):
        fn(s, whole, weights, **kw)


def test_non_finite_teachers_with_weight_zero_on_that_sample_are_ignored():
    """Routing: teacher 1 is NaN on the samples routed elsewhere; the loss equals the same teachers with
    any finite values there, and a NaN on a sample where the weight is > 0 is still an error."""
    s, t, mask, _ = problem(seed=10)
    route = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0.5, 0, 0.5]], dtype=torch.float64)
    bad = t.clone()
    bad[1, 0] = math.nan
    bad[1, 2, 3] = math.inf
    bad[2, 1] = -math.inf
    for fn in (forward_kl, reverse_kl, generalized_jsd):
        got, _ = fn(s, bad, route, mask, chunk_size=5)
        want, _ = fn(s, t, route, mask, chunk_size=5)
        assert float(got) == pytest.approx(float(want), rel=1e-13)
        np.testing.assert_allclose(torch.autograd.grad(got, s)[0].numpy(), torch.autograd.grad(want, s)[0].numpy(),
                                   atol=1e-14)
    bad[1, 1, 2, 5] = math.nan
    with pytest.raises(ValueError, match=r"teacher 1 logits\[1, 2\] has a non-finite logit \(nan\) at vocabulary index 5"):
        forward_kl(s, bad, route, mask)


def test_permuted_teachers_give_the_same_loss():  # the reads: test_shifted_student_and_teachers_are_read_chunk_by_chunk...
    s, t, mask, weights = problem(seed=11)
    permuted = t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)          # (K, B, T, V) view, T before B
    assert not permuted[0].is_contiguous()
    for fn in (forward_kl, reverse_kl):
        a, _ = fn(s, permuted, weights, mask, chunk_size=4)
        b, _ = fn(s, t, weights, mask, chunk_size=4)
        assert float(a) == float(b)


@pytest.mark.parametrize("fn", [kl_estimator_loss, rkl_policy_gradient])
def test_sampled_losses_name_a_minus_inf_teacher_log_prob_and_ignore_it_at_weight_zero(fn):
    s, t, mask, _ = problem(seed=12)
    tokens = torch.randint(0, 7, (3, 6), generator=torch.Generator().manual_seed(2))
    lp = token_log_probs(t, tokens)
    route = torch.tensor([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]], dtype=torch.float64)
    bad = lp.clone()
    bad[1, 0] = -math.inf                                   # teacher 1 on sample 0: weight 0 there
    b, p = [int(i) for i in torch.nonzero(~mask)[0]]
    bad[0, b, p] = -math.inf if b == 0 else bad[0, b, p]   # a masked position
    got, _ = fn(s, tokens, bad, route, mask, reduction="sum")
    want, _ = fn(s, tokens, lp, route, mask, reduction="sum")
    assert float(got) == pytest.approx(float(want), rel=1e-13)
    assert torch.isfinite(torch.autograd.grad(got, s)[0]).all()
    kept = [int(i) for i in torch.nonzero(mask[1])[0]][0]
    bad[1, 1, kept] = -math.inf
    with pytest.raises(ValueError, match=rf"teacher_log_probs\[1, 1, {kept}\] = -inf with weight 1.0 > 0"):
        fn(s, tokens, bad, route, mask)


# ------------------------------------------------------------------------------------------------
# autograd
# ------------------------------------------------------------------------------------------------
def test_a_second_backward_gives_the_same_gradient_and_double_backward_is_a_clear_error():
    """create_graph=True gives the gradient (tied to the student); differentiating it again raises."""
    s, t, mask, weights = problem(seed=13)
    teachers = t.clone().requires_grad_()
    w = weights.clone().requires_grad_()
    for fn in (forward_kl, reverse_kl, generalized_jsd):
        loss, _ = fn(s, teachers, w, mask)
        (g1,) = torch.autograd.grad(loss, s, retain_graph=True)
        (g2,) = torch.autograd.grad(loss, s, retain_graph=True)
        assert torch.equal(g1, g2)
        loss.backward()
        assert teachers.grad is None and w.grad is None           # teachers and weights are constants
        s.grad = None
        loss, _ = fn(s, teachers, w, mask)
        (g3,) = torch.autograd.grad(loss, s, create_graph=True)     # a graph for other terms: the same gradient
        assert torch.equal(g3, g1) and g3.requires_grad
        with pytest.raises(RuntimeError, match="cannot differentiate twice"):   # a second derivative: never a 0
            torch.autograd.grad((g3 * g3).sum(), s)


# ------------------------------------------------------------------------------------------------
# kl_estimator_loss: the forward direction (torchrl), verl's clamp and k3+; the audit of both
# ------------------------------------------------------------------------------------------------
def sampled_problem(seed=14, scale=3.0):
    s, t, mask, weights = problem(seed=seed)
    tokens = torch.randint(0, 7, (3, 6), generator=torch.Generator().manual_seed(seed))
    return s, scale * t, mask, weights, tokens


def test_forward_direction_clamp_and_k3_plus_against_their_formulas():
    """direction='forward': torchrl's k3_kl_token_estimate(ln q, ln p) = e^d - 1 - d, d = ln q - ln p;
    clamp=10: verl's low_var_kl (d = ln p - ln q clamped to [-20, 20], then the value to [-10, 10]);
    k3+: verl's straight-through, k3's value and k2's gradient. Values and gradients, pool 'after'."""
    s, t, mask, weights, tokens = sampled_problem()
    lp, lq = token_log_probs(t, tokens), token_log_probs(s, tokens)
    d_rev = lp - lq[None]
    cases = {
        ("k3", "forward", None): torch.expm1(-d_rev) + d_rev,
        ("k3", "reverse", 10.0): (torch.expm1(d_rev.clamp(-20, 20)) - d_rev.clamp(-20, 20)).clamp(-10, 10),
        ("k3+", "reverse", None): 0.5 * d_rev ** 2 - (0.5 * d_rev ** 2).detach() + (torch.expm1(d_rev) - d_rev).detach(),
        ("k2", "forward", None): 0.5 * d_rev ** 2,
    }
    for (estimator, direction, clamp), per_teacher in cases.items():
        want = (weights.T[:, :, None] * per_teacher).sum(0)[mask].sum()
        got, _ = kl_estimator_loss(s, tokens, lp, weights, mask, estimator=estimator, direction=direction, clamp=clamp,
                                   pool="after", reduction="sum")
        assert float(got) == pytest.approx(float(want), rel=1e-12), (estimator, direction, clamp)
        (g_got,) = torch.autograd.grad(got, s)
        (g_want,) = torch.autograd.grad(want, s, retain_graph=True)
        np.testing.assert_allclose(g_got.numpy(), g_want.numpy(), atol=1e-12)
    # the clamp binds here (some d > 2.53) and its gradient is zero there
    assert bool(((torch.expm1(d_rev) - d_rev) > 10).any())
    with pytest.raises(ValueError, match="direction"):
        kl_estimator_loss(s, tokens, lp, weights, direction="both")
    with pytest.raises(ValueError, match="clamp"):
        kl_estimator_loss(s, tokens, lp, weights, clamp=-1)


def test_audit_rows_for_the_forward_direction_k3_plus_and_the_clamp():
    from llm_bridge.losses import audit_estimators
    g = torch.Generator().manual_seed(15)
    s = torch.randn(3, 6, dtype=torch.float64, generator=g)
    t = torch.randn(2, 3, 6, dtype=torch.float64, generator=g)
    df = audit_estimators(s, t, [0.6, 0.4]).set_index(["estimator", "mode", "samples", "teachers", "direction"])
    # torchrl's forward direction on teacher samples: k3 as a loss gives the FKL gradient (-> A)
    assert df.loc[("k3", "loss", "teacher", "one", "forward"), "equals"] == "FKL to A"
    assert df.loc[("k3", "loss", "teacher", "routed", "forward"), "equals"] == "FKL to A"
    # verl's k3+ as a loss on student samples gives the RKL gradient (k2's)
    assert df.loc[("k3+", "loss", "student", "pooled", "reverse"), "equals"] == "RKL to l"
    assert df.loc[("k3+", "loss", "student", "one", "reverse"), "err RKL to l"] < 1e-12
    # the clamp: where p / q stays below e^2.53 it changes nothing; where it binds the gradient departs
    mild = audit_estimators(s, t, [0.6, 0.4], clamp=10.0)
    mild = mild[(mild.direction == "reverse") & (mild.samples == "student")]
    k3 = mild[mild.estimator == "k3"].reset_index(drop=True)
    k3c = mild[mild.estimator == "k3 clamp 10"].reset_index(drop=True)
    assert (k3["equals"] == k3c["equals"]).all()
    t_far = t.clone()
    t_far[0, 0, 0] = 8.0                                   # teacher 0 puts ~0.98 on token 0 at position 0,
    s_far = s.clone()
    s_far[0, 0] = -4.0                                     # the student ~0.003: p / q far above e^2.53
    far = audit_estimators(s_far, t_far, [0.6, 0.4], clamp=10.0).set_index(
        ["estimator", "mode", "samples", "teachers", "direction"])
    assert far.loc[("k3", "loss", "student", "one", "reverse"), "equals"] == "FKL to A"
    assert far.loc[("k3 clamp 10", "loss", "student", "one", "reverse"), "err FKL to A"] > 0.05


# ------------------------------------------------------------------------------------------------
# issue 31: what a TRL / Trainer user hits (compile with shifted views, empty steps, low-precision
# weights, numeric temperatures, inference), each against a value written out or the eager result
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.skipif(
    os.environ.get("ATEN_CPU_CAPABILITY") == "default", reason="inductor's C++ code uses at::vec, which the "
    "'default' capability leaves undeclared (a torch build issue, not the loss's)")])])
def test_a_compiled_step_with_shifted_student_and_teacher_views_equals_the_eager_step(backend):
    """TRL's GKD pattern: logits[:, :-1] against teacher_logits[:, :, :-1] (views that no flat view can
    express) inside a torch.compile'd step, with a linear 'model' in front: loss and gradients equal
    the eager step's."""
    g = torch.Generator().manual_seed(31)
    B, T, H, V = 2, 6, 5, 11
    x = torch.randn(B, T + 1, H, generator=g, dtype=torch.float64)
    teachers = torch.randn(3, B, T + 1, V, generator=g, dtype=torch.float64)
    labels = torch.randint(0, V, (B, T + 1), generator=g)
    labels[0, :3] = -100

    def step(head, x, teachers, labels):
        logits = x @ head
        loss, _ = forward_kl(logits[:, :-1], teachers[:, :, :-1], W3, mask_from_labels(labels)[:, 1:], chunk_size=4)
        loss.backward()
        return loss.detach()

    head = torch.randn(H, V, generator=g, dtype=torch.float64).requires_grad_()
    want = step(head, x, teachers, labels)
    g_want, head.grad = head.grad, None
    from torch._inductor import config as inductor_config
    with inductor_config.patch(force_disable_caches=True):  # a kernel cached under another ATEN_CPU_CAPABILITY is wrong here
        torch._dynamo.reset()
        got = torch.compile(step, backend=backend)(head, x, teachers, labels)
    assert float(got) == pytest.approx(float(want), rel=1e-12)
    np.testing.assert_allclose(head.grad.numpy(), g_want.numpy(), rtol=1e-10, atol=1e-14)


def test_an_accumulation_step_of_ignored_labels_gives_a_zero_loss_under_num_items_in_batch_zero():
    """Trainer passes num_items_in_batch = 0 when every label of the step is -100: a zero loss that
    backpropagates zeros (the empty-mask policy), for the token losses and the estimators; 0 with kept
    positions is a ValueError; the estimate of an all-masked batch is 0, not NaN."""
    s, t, _, weights = problem(seed=31)
    empty = torch.zeros(3, 6, dtype=torch.bool)
    tokens = torch.zeros(3, 6, dtype=torch.long)
    for n in (0, torch.tensor(0)):
        for fn in (forward_kl, reverse_kl, generalized_jsd):
            loss, _ = fn(s, t, weights, empty, num_items_in_batch=n)
            assert float(loss) == 0.0 and torch.all(torch.autograd.grad(loss, s)[0] == 0)
        loss, metrics = kl_estimator_loss(s, tokens, token_log_probs(t, tokens), weights, empty, num_items_in_batch=n)
        assert float(loss) == 0.0 and torch.all(torch.autograd.grad(loss, s)[0] == 0)
        assert metrics["estimate"] == 0.0
    with pytest.raises(ValueError, match="num_items_in_batch = 0 but the mask keeps 18 positions"):
        forward_kl(s, t, weights, num_items_in_batch=0)
    with pytest.raises(ValueError, match="num_items_in_batch = -1"):
        forward_kl(s, t, weights, empty, num_items_in_batch=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_weights_from_a_low_precision_softmax_are_accepted_and_renormalised(dtype):
    """A bf16 / fp16 softmax's rows sum to 1 only within the dtype's rounding (1.002, 0.99995): accepted
    within K eps and renormalised, so the loss equals the loss at the float64-renormalised weights; a
    float64 row off by 1e-3 is still refused."""
    s, t, mask, _ = problem(seed=32)
    logits = torch.randn(3, 3, generator=torch.Generator().manual_seed(3)) * 3
    w = torch.softmax(logits.to(dtype), -1)
    sums = w.double().sum(-1)
    assert float((sums - 1).abs().max()) > 1e-6                      # the old tolerance refused these
    exact = w.double() / sums[:, None]
    for fn in (forward_kl, reverse_kl):
        got, _ = fn(s, t, w, mask)
        want, _ = fn(s, t, exact, mask)
        assert float(got) == pytest.approx(float(want), rel=1e-14)
    with pytest.raises(ValueError, match="sum to 1.001"):
        forward_kl(s, t, torch.tensor([0.501, 0.3, 0.2], dtype=torch.float64))
    with pytest.raises(ValueError, match="sum to 1.1"):
        forward_kl(s, t, torch.tensor([0.6, 0.3, 0.2]).to(dtype))


def test_temperatures_may_be_numpy_scalars_or_one_element_tensors():
    s, t, mask, weights = problem(seed=33)
    tokens = torch.randint(0, 7, (3, 6), generator=torch.Generator().manual_seed(4))
    want, _ = forward_kl(s, t, weights, mask, student_temperature=2.0, teacher_temperature=1.5)
    lp = token_log_probs(t, tokens)
    k_want, _ = kl_estimator_loss(s, tokens, lp, weights, mask, student_temperature=2.0)
    for tau_s, tau_t in ((np.float32(2.0), np.float64(1.5)), (torch.tensor(2.0), torch.tensor(1.5)), (np.int64(2), 1.5)):
        got, metrics = forward_kl(s, t, weights, mask, student_temperature=tau_s, teacher_temperature=tau_t)
        assert float(got) == pytest.approx(float(want), rel=1e-14)
        assert metrics["student_temperature"] == 2.0 and isinstance(metrics["student_temperature"], float)
        got, _ = kl_estimator_loss(s, tokens, lp, weights, mask, student_temperature=tau_s)
        assert float(got) == pytest.approx(float(k_want), rel=1e-14)
    for bad in (np.float32(-1.0), torch.tensor(0.0), torch.tensor([1.0, 2.0]), True, "2"):
        with pytest.raises(ValueError, match="student_temperature = .* must be a positive number"):
            forward_kl(s, t, weights, mask, student_temperature=bad)


def test_no_gradient_work_under_no_grad_and_inference_mode(monkeypatch):
    """Evaluation of a student that requires grad: under inference_mode no error, under no_grad no
    gradient computed (the engine is asked for none); the values equal the training-mode values."""
    from llm_bridge.losses import _engine
    s, t, mask, weights = problem(seed=34)
    asked = []
    run = _engine.run
    monkeypatch.setattr(_engine, "run", lambda *a, **kw: asked.append(kw.get("grad_in", False)) or run(*a, **kw))
    for fn in (forward_kl, reverse_kl, generalized_jsd):
        want, _ = fn(s, t, weights, mask)
        assert asked[-1] is True
        for context in (torch.no_grad, torch.inference_mode):
            with context():
                got, metrics = fn(s, t, weights, mask)
            assert asked[-1] is False and not got.requires_grad
            assert float(got) == pytest.approx(float(want), rel=1e-14)
            assert torch.isfinite(metrics["teacher_disagreement"][mask]).all()


def test_shifted_student_and_teachers_are_read_chunk_by_chunk_with_no_whole_copy():
    """Under no_grad (no gradient buffer) no single allocation of the loss comes near one (B, T, V)
    tensor: the shifted student and teachers are gathered a chunk at a time (the profiler records each
    op's allocation); the unchunked arithmetic on the same views does allocate that much, so the
    measurement can fail."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(35)
    B, T, V = 2, 64, 500
    s = torch.randn(B, T + 1, V, generator=g)
    t = torch.randn(3, B, T + 1, V, generator=g)
    whole = B * T * V * 4

    def largest_allocation(fn):
        with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        return max(e.cpu_memory_usage for e in prof.events())

    assert largest_allocation(lambda: torch.log_softmax(s[:, :-1].reshape(-1, V), -1)) >= whole
    for fn in (forward_kl, reverse_kl):
        assert largest_allocation(lambda: fn(s[:, :-1], t[:, :, :-1], W3, chunk_size=8, metrics=False)) < whole / 4
        permuted = t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)[:, :, :-1]
        assert largest_allocation(lambda: fn(s[:, :-1], permuted, W3, chunk_size=8, metrics=False)) < whole / 4


def test_a_shifted_views_chunks_stay_within_a_sample_and_are_read_as_views():
    """The chunks of a view that is not flat never cross a sample's end (where a sample fills a chunk), so
    each chunk's rows are a view of the input (no gather); a chunk that does cross (a slice over two
    samples) is gathered, with the same rows; the shifted loss and gradient equal the contiguous ones with
    chunks that do not divide T."""
    from llm_bridge.losses._engine import Rows, dense_chunks
    assert [(c.start, c.stop) for c in dense_chunks(10, 4, 5, True)] == [(0, 4), (4, 5), (5, 9), (9, 10)]
    assert [(c.start, c.stop) for c in dense_chunks(10, 4, 5, False)] == [(0, 4), (4, 8), (8, 10)]
    g = torch.Generator().manual_seed(36)
    x = torch.randn(2, 7, 5, generator=g)
    rows, flat = Rows(x[:, :-1]), x[:, :-1].reshape(-1, 5)
    view = rows(slice(7, 11))                              # sample 1, positions 1-4
    assert view.data_ptr() == x[1, 1].data_ptr() and torch.equal(view, flat[7:11])
    across = rows(slice(4, 9))                             # sample 0's last two, sample 1's first three
    assert torch.equal(across, flat[4:9])
    B, T, V = 2, 13, 50
    s = torch.randn(B, T + 1, V, generator=g, dtype=torch.float64)
    t = torch.randn(3, B, T + 1, V, generator=g, dtype=torch.float64)
    for fn in (forward_kl, reverse_kl, generalized_jsd):
        a = s.clone().requires_grad_(True)
        want, _ = fn(a[:, :-1].contiguous(), t[:, :, :-1].contiguous(), W3, chunk_size=5)
        want.backward()
        b = s.clone().requires_grad_(True)
        got, _ = fn(b[:, :-1], t[:, :, :-1], W3, chunk_size=5)
        got.backward()
        assert float(got) == pytest.approx(float(want), rel=1e-12)
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-14)


def test_backward_hands_over_the_gradient_without_a_second_full_size_buffer():
    """loss.backward() (upstream gradient 1) allocates nothing near the (B, T, V) gradient: the buffer
    filled in the forward pass becomes the student's .grad (a scaled upstream gradient, or a retained
    graph, costs one copy, and the gradient stays right: 2 x and twice the same)."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(36)
    B, T, V = 2, 64, 500
    s = torch.randn(B, T, V, generator=g).requires_grad_()
    t = torch.randn(3, B, T, V, generator=g)
    whole = B * T * V * 4
    for fn in (forward_kl, reverse_kl, generalized_jsd):
        loss, _ = fn(s, t, W3, chunk_size=8, metrics=False)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss.backward()
        assert max(e.cpu_memory_usage for e in prof.events()) < whole / 4
        once, s.grad = s.grad, None
        loss, _ = fn(s, t, W3, chunk_size=8, metrics=False)
        (twice,) = torch.autograd.grad(2 * loss, s, retain_graph=True)
        torch.testing.assert_close(twice, 2 * once, rtol=1e-6, atol=0)
        assert torch.equal(torch.autograd.grad(loss, s)[0], once)


def test_the_losses_page_snippet_uses_trl_s_shifted_convention():
    """The losses page's first snippet (docs/losses.md) runs, drops the logits' last position and shifts the labels'
    mask: its loss equals the mean over the positions t whose label at t + 1 is kept, written out."""
    import re
    from conftest import ROOT
    page = (ROOT / "docs" / "losses.md").read_text()
    section = page[page.index("## Usage"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    g = torch.Generator().manual_seed(37)
    B, T, V = 2, 6, 7
    labels = torch.randint(0, V, (B, T), generator=g)
    labels[0, 4:] = -100
    labels[1, :2] = -100
    ns = {"student_logits": torch.randn(B, T, V, generator=g, dtype=torch.float64).requires_grad_(),
          "teacher_logits": torch.randn(3, B, T, V, generator=g, dtype=torch.float64), "labels": labels}
    exec(code, ns)
    w = torch.tensor([[0.5, 0.3, 0.2]] * B, dtype=torch.float64)
    per = per_position("forward", ns["student_logits"][:, :-1], ns["teacher_logits"][:, :, :-1], w)
    kept = labels[:, 1:] != -100
    assert float(ns["loss"]) == pytest.approx(float(per[kept].mean()), rel=1e-12)
    assert ns["metrics"]["n_positions"] == int(kept.sum()) == 7
    assert ns["student_logits"].grad is not None and torch.all(ns["student_logits"].grad[:, -1] == 0)


# ------------------------------------------------------------------------------------------------
# autocast, torch.func and meta tensors (issue 46)
# ------------------------------------------------------------------------------------------------
def float32_problem(B=2, T=6, V=32000, K=3, H=48, seed=46):
    """float32 logits at a user's vocabulary (V = 32k), or hidden states and an lm_head for the fused path."""
    g = torch.Generator().manual_seed(seed)
    s = (3 * torch.randn(B, T, V, generator=g)).requires_grad_()
    t = 3 * torch.randn(K, B, T, V, generator=g)
    h = torch.randn(B, T, H, generator=g).requires_grad_()
    w = (torch.randn(V, H, generator=g) / 4).requires_grad_()
    return s, t, h, w


LOSSES = [("forward", lambda s, t: forward_kl(s, t, W3)), ("reverse", lambda s, t: reverse_kl(s, t, W3)),
          ("jsd", lambda s, t: generalized_jsd(s, t, W3, beta=0.3))]


@pytest.mark.parametrize("kind, fn", LOSSES)
def test_values_and_gradients_under_bf16_autocast_equal_the_float32_ones(kind, fn):
    """torch.autocast("cpu", bfloat16) around the loss (a common training set-up) changes nothing: the chunk
    products are computed in float32 whatever autocast says (before the fix a bmm ran in bf16: forward KL
    1.00212 -> 1.0, gradients off by up to 1e-2 relative). Logits and the fused path's lm_head alike."""
    s, t, h, w = float32_problem()
    want, _ = fn(s, t)
    (g_want,) = torch.autograd.grad(want, s)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, metrics = fn(s, t)
    (g_got,) = torch.autograd.grad(got, s)
    assert got.dtype == torch.float32 and metrics["loss_per_position"].dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(g_got, g_want, rtol=1e-6, atol=1e-12)

    def fused():
        return fused_linear_loss(h, w, t, W3, kind=kind, beta=0.3)[0]
    want = fused()
    g_want = torch.autograd.grad(want, (h, w))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fused()
    g_got = torch.autograd.grad(got, (h, w))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("kind, fn", LOSSES)
def test_torch_func_grad_and_jacrev_equal_autograd_and_the_rest_is_a_clear_error(kind, fn):
    """torch.func.grad / vjp / jacrev (reverse mode: the closed-form gradient, through setup_context) equal
    torch.autograd.grad; vmap and forward mode (jvp) are a RuntimeError naming what is supported, and a
    second derivative through torch.func is the same clear error as create_graph=True."""
    s, t, _, _ = float32_problem(V=50)
    loss, metrics = fn(s, t)
    (want,) = torch.autograd.grad(loss, s)
    got = torch.func.grad(lambda x: fn(x, t)[0])(s)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-12)
    value, vjp = torch.func.vjp(lambda x: fn(x, t)[0], s)
    torch.testing.assert_close(value, loss.detach(), rtol=0, atol=0)
    torch.testing.assert_close(vjp(torch.tensor(2.0))[0], 2 * want, rtol=1e-6, atol=1e-12)
    per = torch.func.jacrev(lambda x: fn(x, t)[0])(s)
    torch.testing.assert_close(per, want, rtol=1e-6, atol=1e-12)
    # the metrics come back under a transform too
    def with_aux(x):
        loss, metrics = fn(x, t)
        return loss, metrics["loss_per_position"]
    _, aux = torch.func.grad(with_aux, has_aux=True)(s)
    torch.testing.assert_close(aux, metrics["loss_per_position"], rtol=0, atol=0)
    for transform in (lambda f: torch.func.vmap(f)(torch.stack([s.detach(), s.detach()])),    # two problems
                      lambda f: torch.func.jvp(f, (s.detach(),), (torch.ones_like(s),))):
        with pytest.raises(RuntimeError, match=r"torch\.func\.grad"):
            transform(lambda x: fn(x, t)[0])
    with pytest.raises(RuntimeError, match="cannot differentiate twice"):
        torch.func.grad(lambda x: torch.func.grad(lambda y: fn(y, t)[0])(x).sum())(s)


def test_meta_tensors_are_a_clear_error():
    """Meta tensors (shape tracing) have no values to validate or differentiate: a ValueError that says so,
    not an error from inside .item()."""
    s, t, h, w = float32_problem(V=50)
    for args in ((s.to("meta"), t), (s, t.to("meta")), (s.to("meta"), t.to("meta"))):
        for fn in (forward_kl, reverse_kl, generalized_jsd):
            with pytest.raises(ValueError, match="meta device"):
                fn(*args, W3)
    with pytest.raises(ValueError, match="meta device"):
        fused_linear_loss(h.to("meta"), w.to("meta"), t, W3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_shifted_student_gets_its_gradient_in_one_full_size_buffer(dtype):
    """logits[:, :-1] of a leaf (the HF / TRL call): forward + backward allocate one buffer of the leaf's size
    (its .grad, with zeros in the dropped position), not a (B, T, V) gradient and then the slice's own
    zero-filled copy (issue 46: the peak of the shifted float32 view); the gradient equals that of the
    contiguous copy, a per-position loss ('none') and a permuted view stay right."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(46)
    B, T, V = 2, 64, 500
    leaf = torch.randn(B, T + 1, V, generator=g).to(dtype).requires_grad_()
    t = torch.randn(3, B, T + 1, V, generator=g)
    whole = B * T * V * leaf.element_size()
    for fn in (forward_kl, reverse_kl, generalized_jsd):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn(leaf[:, :-1], t[:, :, :-1], W3, chunk_size=8, metrics=False)[0].backward()
        big = [e for e in prof.events() if e.name.startswith("aten::empty") and e.cpu_memory_usage >= whole / 2]
        assert len(big) == 1, [(e.name, e.cpu_memory_usage) for e in big]
        got, leaf.grad = leaf.grad, None
        copy = leaf.detach()[:, :-1].clone().requires_grad_()
        (want,) = torch.autograd.grad(fn(copy, t[:, :, :-1], W3)[0], copy)
        assert torch.equal(got[:, -1], torch.zeros_like(got[:, -1]))
        torch.testing.assert_close(got[:, :-1], want, rtol=1e-6, atol=0)
        later = leaf.detach()[:, 1:].clone().requires_grad_()
        per, _ = fn(leaf[:, 1:], t[:, :, 1:], W3, reduction="none")
        (got,) = torch.autograd.grad((per * torch.arange(T)).sum(), leaf)
        (want,) = torch.autograd.grad((fn(later, t[:, :, 1:], W3, reduction="none")[0] * torch.arange(T)).sum(), later)
        torch.testing.assert_close(got[:, 1:], want, rtol=1e-6, atol=0)
        perm = leaf.transpose(0, 1)[:-1].transpose(0, 1)              # the same positions, another view chain
        mask = (torch.arange(T) % 3 > 0).expand(B, T)
        (got,) = torch.autograd.grad(fn(perm, t[:, :, :-1], W3, mask)[0], leaf)
        (want,) = torch.autograd.grad(fn(copy, t[:, :, :-1], W3, mask)[0], copy)
        torch.testing.assert_close(got[:, :-1], want, rtol=1e-6, atol=0)
