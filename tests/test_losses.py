"""The distillation losses (llm_bridge/losses.py) against aggregation's exact values and float64 autograd of
the exact objectives; the estimator audit against theory section 4's closed forms and a Monte Carlo; bad input."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

import aggregation as ag
from aggregation import examples
from llm_bridge.losses import (TopK, audit_estimators, forward_kl, fused_linear_loss, generalized_jsd,
                               kl_estimator_loss, reverse_kl, rkl_policy_gradient, token_log_probs)
from llm_bridge.tabular import TabularLM

W3 = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)


def random_problem(B=2, T=5, V=7, K=3, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(B, T, V, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    t = (2 * torch.randn(K, B, T, V, generator=g, dtype=torch.float64)).to(dtype)
    return s, t


def exact(kind, s, t, w, beta=0.5, tau_s=1.0, tau_t=1.0):
    """The objective written out in float64 (per position), for autograd."""
    lq = torch.log_softmax(s.double() / tau_s, -1)
    lp = torch.log_softmax(t.double() / tau_t, -1)
    ww = w if w.ndim == 2 else w.expand(s.shape[0], -1)
    out = 0
    for k in range(t.shape[0]):
        p, q = lp[k].exp(), lq.exp()
        if kind == "forward":
            div = (p * (lp[k] - lq)).sum(-1)
        elif kind == "reverse":
            div = (q * (lq - lp[k])).sum(-1)
        else:
            m = torch.log(beta * p + (1 - beta) * q)
            div = beta * (p * (lp[k] - m)).sum(-1) + (1 - beta) * (q * (lq - m)).sum(-1)
        out = out + ww[:, k, None] * div
    return out


@pytest.mark.parametrize("kind, fn", [("forward", forward_kl), ("reverse", reverse_kl), ("jsd", generalized_jsd)])
def test_losses_and_gradients_equal_float64_autograd_of_the_exact_objective(kind, fn):
    s, t = random_problem()
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 0, 1, 1, 1]], dtype=torch.bool)
    for tau_s, tau_t in ((1.0, 1.0), (0.7, 1.6)):
        kwargs = dict(beta=0.3) if kind == "jsd" else {}
        loss, metrics = fn(s, t, W3, mask, student_temperature=tau_s, teacher_temperature=tau_t, chunk_size=3, **kwargs)
        (g,) = torch.autograd.grad(loss, s)
        want = exact(kind, s, t, W3, 0.3, tau_s, tau_t)
        want = want[mask].mean()
        (g_want,) = torch.autograd.grad(want, s)
        assert float(loss) == pytest.approx(float(want), rel=1e-12)
        np.testing.assert_allclose(g.numpy(), g_want.numpy(), rtol=0, atol=1e-12)
        assert metrics["student_temperature"] == tau_s and metrics["teacher_temperature"] == tau_t
        assert torch.isnan(metrics["loss_per_position"][~mask]).all()


def test_generalized_jsd_endpoints_and_scale_near_them():
    s, t = random_problem(seed=1)
    fkl = forward_kl(s, t, W3)[0]
    rkl = reverse_kl(s, t, W3)[0]
    assert float(generalized_jsd(s, t, W3, beta=0.0)[0]) == pytest.approx(float(fkl), rel=1e-14)
    assert float(generalized_jsd(s, t, W3, beta=1.0)[0]) == pytest.approx(float(rkl), rel=1e-14)
    # JSD_beta ≈ beta FKL near 0 and (1 - beta) RKL near 1: the documented shrinking scale
    # (the next order is O(beta sum q^2 / p), large where the teachers are nearly 0: hence beta = 1e-7)
    assert float(generalized_jsd(s, t, W3, beta=1e-7)[0]) / 1e-7 == pytest.approx(float(fkl), rel=1e-4)
    assert float(generalized_jsd(s, t, W3, beta=1 - 1e-7)[0]) / 1e-7 == pytest.approx(float(rkl), rel=1e-4)


def tabular_logits(teachers, paths):
    """Each TabularLM teacher's logits along the paths (BOS first): (K, B, T, n), and the states visited."""
    ids = torch.tensor([[teachers.n] + list(p[:-1]) for p in paths])
    logits = torch.stack([TabularLM(teachers, k)(ids).logits[..., :teachers.n] for k in range(teachers.K)])
    return logits.double(), ids


def test_losses_on_tabular_teachers_equal_aggregations_values():
    """On finite-state teachers served as TabularLM: at every position the forward loss is
    sum_k w_k KL(p_k || q), the reverse loss KL(q || l) - ln z, the metrics sum_k w_k KL(p_k || A) and
    -ln z, with p_k, A, l and z from aggregation's pools (1e-6: TabularLM serves float32 logits)."""
    t = examples.prefix_tree(3, 3, 3, seed=5)
    paths = [[a, b, c] for a in range(3) for b in range(3) for c in range(3)]
    logits, ids = tabular_logits(t, paths)
    student = torch.randn(len(paths), 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    w = W3.numpy()
    fkl, m_f = forward_kl(student, logits, W3, reduction="none")
    rkl, m_r = reverse_kl(student, logits, W3, reduction="none")
    lq = torch.log_softmax(student, -1).numpy()
    for b, path in enumerate(paths):
        s = t.start
        for h, a in enumerate(path):
            p = np.exp(t.log_probs[:, s])
            A = ag.arithmetic_pool(p, w)
            log_l, log_z = ag.log_geometric_pool(t.log_probs[:, s], w, return_log_partition=True)
            q = np.exp(lq[b, h])
            assert float(fkl[b, h]) == pytest.approx(sum(w[k] * np.sum(p[k] * (np.log(p[k]) - lq[b, h]))
                                                          for k in range(3)), abs=1e-6)
            assert float(rkl[b, h]) == pytest.approx(np.sum(q * (lq[b, h] - log_l)) - log_z, abs=1e-6)
            assert float(m_r["neg_log_z"][b, h]) == pytest.approx(-log_z, abs=1e-6)
            assert float(m_f["teacher_disagreement"][b, h]) == pytest.approx(
                sum(w[k] * np.sum(p[k] * np.log(p[k] / A)) for k in range(3)), abs=1e-6)
            s = t.next_state[s, a]
            if s < 0:
                break


def test_one_hot_weights_route_and_one_teacher_is_a_plain_kl():
    s, t = random_problem(B=3, seed=3)
    route = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.float64)
    for fn in (forward_kl, reverse_kl):
        routed = fn(s, t, route, reduction="none")[0]
        for b, k in enumerate((1, 0, 2)):
            alone = fn(s[b:b + 1], t[k:k + 1, b:b + 1], [1.0], reduction="none")[0]
            np.testing.assert_allclose(routed[b].detach().numpy(), alone[0].detach().numpy(), rtol=1e-13)
    # K = 1: a plain single-teacher KL, written out
    lq, lp = torch.log_softmax(s, -1), torch.log_softmax(t[0], -1)
    plain_f = (lp.exp() * (lp - lq)).sum(-1).mean()
    plain_r = (lq.exp() * (lq - lp)).sum(-1).mean()
    assert float(forward_kl(s, t[:1], [1.0])[0]) == pytest.approx(float(plain_f), rel=1e-13)
    assert float(reverse_kl(s, [t[0]], [1.0])[0]) == pytest.approx(float(plain_r), rel=1e-13)


def test_the_targets_the_losses_name_are_their_minimisers():
    """The student set to the arithmetic pool minimises forward_kl (value: the disagreement), the
    student set to l minimises reverse_kl (value: -ln z); each is not the other's minimiser."""
    _, t = random_problem(seed=4)
    lp = torch.log_softmax(t, -1)
    log_a = torch.logsumexp(torch.log(W3)[:, None, None, None] + lp, 0)
    pooled = (W3[:, None, None, None] * lp).sum(0)
    log_l = torch.log_softmax(pooled, -1)
    f_at_a, m = forward_kl(log_a, t, W3, reduction="none")
    np.testing.assert_allclose(f_at_a.numpy(), m["teacher_disagreement"].numpy(), atol=1e-12)
    r_at_l, m = reverse_kl(log_l, t, W3, reduction="none")
    np.testing.assert_allclose(r_at_l.numpy(), m["neg_log_z"].numpy(), atol=1e-12)
    assert float(forward_kl(log_l, t, W3)[0]) > float(forward_kl(log_a, t, W3)[0]) + 1e-3
    assert float(reverse_kl(log_a, t, W3)[0]) > float(reverse_kl(log_l, t, W3)[0]) + 1e-3


@pytest.mark.parametrize("fn", [forward_kl, reverse_kl, generalized_jsd])
def test_neg_log_z_of_teachers_far_apart_underflows_nowhere(fn):
    """-ln z = -lse(r) is summed without a max shift (r <= 0): float32 rows whose every e^r underflows (two teachers
    sure of different tokens, max r about -150), rows near the threshold (max r about -70) and ordinary rows all
    equal the float64 closed form; the row of the far-apart teachers would read +inf without the shifted redo."""
    gen = torch.Generator().manual_seed(11)
    t = torch.randn(2, 1, 3, 50, dtype=torch.float64, generator=gen)
    for k, gap in ((0, 300.0), (1, 140.0)):                  # row 0: r ~ -150; row 1: r ~ -70
        t[0, 0, k, 3] += gap
        t[1, 0, k, 7] += gap
    s = torch.randn(1, 3, 50, dtype=torch.float64, generator=gen)
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    exact = -torch.logsumexp((w[:, None, None, None] * torch.log_softmax(t, -1)).sum(0), -1)[0]
    assert float(exact[0]) > 140 and 60 < float(exact[1]) < 80
    got = fn(s.float(), t.float(), w, reduction="none")[1]["neg_log_z"][0]
    np.testing.assert_allclose(got.double().numpy(), exact.numpy(), rtol=1e-6)


@pytest.mark.parametrize("tail", ["tail", "renormalize", "uniform", "truncate"])
@pytest.mark.parametrize("kind", ["forward", "reverse"])
def test_top_k_treatments_against_their_definitions(tail, kind):
    """Each tail treatment against its definition written out in float64, and its value as k -> V:
    every treatment equals the full-vocabulary divergence when the top k is the whole vocabulary."""
    s, t = random_problem(K=2, V=8, seed=6)
    w = torch.tensor([0.6, 0.4], dtype=torch.float64)
    lp = torch.log_softmax(t, -1)
    lq = torch.log_softmax(s, -1)
    k = 3
    top = [TopK(*reversed(lp[j].topk(k, -1))) for j in range(2)]
    fn = forward_kl if kind == "forward" else reverse_kl
    got, metrics = fn(s, top, w, reduction="none", tail=tail)
    (g,) = torch.autograd.grad(got.sum(), s)
    want = 0
    for j in range(2):
        ids, p_top = top[j].ids, top[j].log_probs
        q_top = lq.gather(-1, ids)
        tail_p = 1 - p_top.exp().sum(-1)
        if tail == "tail":
            a = torch.cat([p_top, tail_p.log()[..., None]], -1)
            b = torch.cat([q_top, torch.log(1 - q_top.exp().sum(-1))[..., None]], -1)
        elif tail == "renormalize":
            a = p_top - torch.logsumexp(p_top, -1, keepdim=True)
            b = q_top if kind == "forward" else q_top - torch.logsumexp(q_top, -1, keepdim=True)
        elif tail == "uniform":
            a = (tail_p / (8 - k)).log()[..., None].expand(lq.shape).scatter(-1, ids, p_top)
            b = lq
        if tail == "truncate":
            div = ((p_top.exp() * (p_top - q_top)) if kind == "forward" else (q_top.exp() * (q_top - p_top))).sum(-1)
            div = div.clamp(min=0)
        elif kind == "forward":
            div = (a.exp() * (a - b)).sum(-1)
        else:
            div = (b.exp() * (b - a)).sum(-1)
        want = want + w[j] * div
    np.testing.assert_allclose(got.detach().numpy(), want.detach().numpy(), rtol=1e-10, atol=1e-12)
    (g_want,) = torch.autograd.grad(want.sum(), s)
    np.testing.assert_allclose(g.numpy(), g_want.numpy(), atol=1e-10)
    np.testing.assert_allclose(metrics["tail_mass"].numpy(),
                               torch.stack([1 - x.log_probs.exp().sum(-1) for x in top]).numpy(), atol=1e-12)
    full = [TopK(*reversed(lp[j].topk(8, -1))) for j in range(2)]
    np.testing.assert_allclose(fn(s, full, w, tail=tail)[0].item(), fn(s, t[:2], w)[0].item(), rtol=1e-9)


def test_fused_linear_path_equals_the_logit_path_and_its_gradients():
    g = torch.Generator().manual_seed(7)
    B, T, H, V = 2, 6, 5, 9
    h = torch.randn(B, T, H, dtype=torch.float64, generator=g, requires_grad=True)
    W = torch.randn(V, H, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(V, dtype=torch.float64, generator=g)
    t = torch.randn(2, B, T, V, dtype=torch.float64, generator=g)
    w = [0.7, 0.3]
    for kind, fn, kw in (("forward", forward_kl, {}), ("reverse", reverse_kl, {}), ("jsd", generalized_jsd, {"beta": 0.4})):
        fused, _ = fused_linear_loss(h, W, t, w, kind=kind, bias=bias, chunk_size=4, **kw)
        gh, gW = torch.autograd.grad(fused, (h, W))
        plain, _ = fn(h @ W.T + bias, t, w, **kw)
        gh2, gW2 = torch.autograd.grad(plain, (h, W))
        assert float(fused) == pytest.approx(float(plain), rel=1e-12)
        np.testing.assert_allclose(gh.numpy(), gh2.numpy(), atol=1e-12)
        np.testing.assert_allclose(gW.numpy(), gW2.numpy(), atol=1e-12)


def test_bfloat16_inputs_are_computed_in_float32():
    s, t = random_problem(B=2, T=16, V=64, seed=8, dtype=torch.float32)
    ref = forward_kl(s, t, W3)[0]
    s16 = s.detach().bfloat16().requires_grad_()
    loss16, _ = forward_kl(s16, t.bfloat16(), W3)
    assert loss16.dtype == torch.float32
    # the only error is rounding the inputs to bf16 (8 bits of mantissa)
    ref16 = forward_kl(s16.detach().float(), t.bfloat16().float(), W3)[0]
    assert float(loss16) == pytest.approx(float(ref16), rel=1e-6)
    assert float(loss16) == pytest.approx(float(ref), rel=2e-2)
    (g,) = torch.autograd.grad(loss16, s16)
    assert g.dtype == torch.bfloat16


# ------------------------------------------------------------------------------------------------
# sampled-token estimators: exact expectations (theory section 4) and Monte Carlo
# ------------------------------------------------------------------------------------------------
def test_audit_matches_spec4_closed_forms():
    g = torch.Generator().manual_seed(9)
    s = torch.randn(3, 6, dtype=torch.float64, generator=g)
    t = torch.randn(2, 3, 6, dtype=torch.float64, generator=g)
    df = audit_estimators(s, t, [0.6, 0.4])
    df = df[df.direction == "reverse"].set_index(["estimator", "mode", "samples", "teachers"])
    one = lambda e, m, s_: df.loc[(e, m, s_, "one"), "equals"]          # noqa: E731
    assert one("k1", "loss", "student") == "zero"                      # zero expected gradient
    assert one("k2", "loss", "student") == "RKL to l"                  # (l = p for one teacher)
    assert one("k3", "loss", "student") == "FKL to A"
    assert one("k1", "reward", "student") == "RKL to l"
    assert one("k1", "loss", "teacher") == "minus FKL to A"            # pushes the teacher's tokens down
    for e, m in (("k2", "loss"), ("k3", "loss"), ("k1", "reward")):
        assert one(e, m, "teacher + IS") == one(e, m, "student")      # importance weights undo the source
    assert df.loc[("k3", "loss", "student", "per-teacher"), "equals"] == "FKL to A"
    assert df.loc[("k3", "loss", "student", "routed"), "equals"] == "FKL to A"
    assert df.loc[("k3", "loss", "student", "pooled"), "equals"].startswith("FKL to l x")
    assert df.loc[("k2", "loss", "student", "pooled"), "equals"] == "RKL to l"
    # a configuration no reference matches, against its own closed form: k3 as a loss on teacher samples,
    # E_p[-(p/q - 1) (e_x - q)] = p (1 - p/q) - q sum_x p (1 - p/q)
    lq, lp = torch.log_softmax(s, -1), torch.log_softmax(t[0], -1)
    q, p = lq.exp(), lp.exp()
    phi = p * (1 - p / q)
    want = phi - q * phi.sum(-1, keepdim=True)
    assert df.loc[("k3", "loss", "teacher", "one"), "equals"] == "none"
    fkl = (q - p).norm()
    assert df.loc[("k3", "loss", "teacher", "one"), "err FKL to A"] == pytest.approx(float((want - (q - p)).norm() / fkl),
                                                                                    rel=1e-10)
    # the numbers behind the labels: the closed forms to 1e-8
    assert df.loc[("k3", "loss", "student", "one"), "err FKL to A"] < 1e-12
    assert df.loc[("k2", "loss", "student", "pooled"), "err RKL to l"] < 1e-12
    assert df.loc[("k1", "loss", "student", "routed"), "err zero"] < 1e-12


@pytest.mark.parametrize("estimator, mode, pool", [("k3", "loss", "after"), ("k2", "loss", "before"),
                                                   ("k1", "reward", "before"), ("k3", "loss", "before")])
def test_monte_carlo_gradients_of_the_sampled_losses_land_on_the_audit(estimator, mode, pool):
    """Tokens sampled from the student (fixed seed), the gradient of kl_estimator_loss by autograd,
    averaged over 40 batches of 2000: within 4 standard errors of the audit's exact expectation."""
    gen = torch.Generator().manual_seed(10)
    V = 5
    z = torch.randn(V, dtype=torch.float64, generator=gen)
    t = torch.randn(2, V, dtype=torch.float64, generator=gen)
    w = [0.7, 0.3]
    lp_full = torch.log_softmax(t, -1)
    grads, values = [], []
    for _ in range(40):
        zz = z.clone().requires_grad_()
        logits = zz.expand(1, 2000, V)
        tokens = torch.multinomial(torch.softmax(z, -1), 2000, replacement=True, generator=gen)[None]
        lp = lp_full[:, tokens[0]][:, None, :]                          # (K, 1, 2000)
        loss, met = kl_estimator_loss(logits, tokens, lp, w, estimator=estimator, mode=mode, pool=pool)
        grads.append(torch.autograd.grad(loss, zz)[0])
        values.append(met["estimate"])
    grads = torch.stack(grads)
    mean, se = grads.mean(0), grads.std(0) / math.sqrt(len(grads))
    df = audit_estimators(z[None], t[:, None], w)
    df = df[df.direction == "reverse"]
    teachers = "per-teacher" if pool == "after" else "pooled"
    row = df[(df.estimator == estimator) & (df["mode"] == mode) & (df.samples == "student") & (df.teachers == teachers)]
    # recompute the expectation the audit reports (its reference gradient, scaled as it says)
    lq = torch.log_softmax(z, -1)
    q = lq.exp()
    pooled = w[0] * lp_full[0] + w[1] * lp_full[1]
    A = w[0] * lp_full[0].exp() + w[1] * lp_full[1].exp()
    expect = {("k3", "after"): q - A, ("k2", "before"): q * ((lq - pooled) - (q * (lq - pooled)).sum()),
              ("k1", "before"): q * ((lq - pooled) - (q * (lq - pooled)).sum())}
    if (estimator, pool) == ("k3", "before"):
        log_z = torch.logsumexp(pooled, -1)
        expect[("k3", "before")] = log_z.exp() * (q - torch.softmax(pooled, -1))
    e = expect[(estimator, pool)]
    assert row["equals"].iloc[0] != "none"
    assert torch.all((mean - e).abs() <= 4 * se + 1e-12), (mean, e, se)
    # the estimates themselves (theory section 4: E_q k1 = E_q k3 = KL for one log-ratio): sum_k w_k KL(q || p_k) =
    # KL(q || l) - ln z, and for k3 on the pooled log-ratio z - 1 + KL(q || l) - ln z (sum_x z l(x) = z)
    rkl = float((q * (lq - pooled)).sum())
    log_z = float(torch.logsumexp(pooled, -1))
    value = {"k1": rkl, "k3": rkl if pool == "after" else math.expm1(log_z) + rkl}.get(estimator)
    if value is not None:
        v = np.array(values)
        assert abs(v.mean() - value) <= 4 * v.std(ddof=1) / math.sqrt(v.size), (v.mean(), value)


def test_rkl_policy_gradient_expected_gradient_by_enumeration():
    """A tabular student (one logit row per prefix) on a depth-2 binary prefix tree: the exact expected
    gradient of the gamma = 1 surrogate is the gradient of sum_k w_k KL_seq(q || p_k) (enumerated over
    the 4 responses); gamma = 0 gives the per-token RKL gradient at q's occupancy. Monte Carlo over
    sampled responses lands within 4 standard errors; the single-step variant with the teacher logits
    has the same expectation and a smaller variance."""
    t = examples.prefix_tree(2, 2, 2, seed=3)
    w = torch.tensor([0.6, 0.4], dtype=torch.float64)
    lp = torch.tensor(t.log_probs)                                     # (K, S, 2); states 0, 1, 2
    theta = torch.randn(3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(4))

    def enumerate_kl(th, per_token=False):
        lq = torch.log_softmax(th, -1)
        total = 0
        for a in range(2):
            s1 = int(t.next_state[0, a])
            for b in range(2):
                logq = lq[0, a] + lq[s1, b]
                prob = logq.exp()
                if per_token:       # occupancy held fixed: only the conditionals' own KL terms move
                    continue
                total = total + prob * sum(w[k] * (logq - lp[k, 0, a] - lp[k, s1, b]) for k in range(2))
        if per_token:
            q = lq.exp().detach()
            occ = {0: 1.0, int(t.next_state[0, 0]): float(q[0, 0]), int(t.next_state[0, 1]): float(q[0, 1])}
            for s, o in occ.items():
                total = total + o * sum(w[k] * (lq[s].exp() * (lq[s] - lp[k, s])).sum() for k in range(2))
        return total
    th = theta.clone().requires_grad_()
    want1 = torch.autograd.grad(enumerate_kl(th), th)[0]
    th = theta.clone().requires_grad_()
    want0 = torch.autograd.grad(enumerate_kl(th, per_token=True), th)[0]
    gen = torch.Generator().manual_seed(5)
    for gamma, want, teacher_logits in ((1.0, want1, False), (0.0, want0, False), (1.0, want1, True)):
        grads = []
        for _ in range(30):
            th = theta.clone().requires_grad_()
            n = 1000
            q = torch.softmax(theta, -1)
            a = torch.multinomial(q[0], n, replacement=True, generator=gen)
            s1 = torch.tensor(t.next_state[0])[a]
            b = torch.multinomial(q[s1], 1, generator=gen)[:, 0]
            states = torch.stack([torch.zeros_like(a), s1], 1)
            logits = th[states]                                        # (n, 2, 2): the student's rows
            tokens = torch.stack([a, b], 1)
            t_lp = lp[:, states, tokens]                                # (K, n, 2)
            extra = {}
            if teacher_logits:
                extra["teacher_logits"] = lp[:, states]                # (K, n, 2, 2) log-probs as logits
            loss, _ = rkl_policy_gradient(logits, tokens, t_lp, w, gamma=gamma, reduction="sum", **extra)
            grads.append(torch.autograd.grad(loss / n, th)[0])
        grads = torch.stack(grads)
        mean, se = grads.mean(0), grads.std(0) / math.sqrt(len(grads))
        assert torch.all((mean - want).abs() <= 4 * se + 1e-9), (gamma, teacher_logits, mean, want, se)
        if teacher_logits:
            assert float(se.norm()) < 0.8 * float(plain_se)
        elif gamma == 1.0:
            plain_se = se.norm()


# ------------------------------------------------------------------------------------------------
# bad input: a ValueError before any work
# ------------------------------------------------------------------------------------------------
def test_bad_input_is_named():
    s, t = random_problem()
    with pytest.raises(ValueError, match=r"the student has 7 logit columns and teacher 0 has 9 \(-2\): pass vocab_size"):
        forward_kl(s, [torch.randn(2, 5, 9, dtype=torch.float64)] * 3, W3)
    padded = torch.cat([t, torch.zeros(3, 2, 5, 2, dtype=torch.float64)], -1)    # Qwen-style padded rows
    np.testing.assert_allclose(float(forward_kl(s, padded, W3, vocab_size=7)[0]), float(forward_kl(s, t, W3)[0]))
    with pytest.raises(ValueError, match=r"teacher 1 has 4 entries on axis 1 \(positions\), the student 5"):
        forward_kl(s, [t[0], t[1, :, :4], t[2]], W3)
    with pytest.raises(ValueError, match=r"weights of sample 0 sum to 0.89999"):
        forward_kl(s, t, [0.5, 0.2, 0.2])
    with pytest.raises(ValueError, match=r"weights\[0, 1\] = -0.1"):
        reverse_kl(s, t, [0.6, -0.1, 0.5])
    bad = t.clone()
    bad[2, 1, 3, 4] = math.nan
    with pytest.raises(ValueError, match=r"teacher 2 logits\[1, 3\] has a non-finite logit \(nan\) at vocabulary index 4"):
        reverse_kl(s, bad, W3)
    s_bad = s.detach().clone()
    s_bad[0, 2, 1] = math.inf
    with pytest.raises(ValueError, match=r"student_logits\[0, 2\] has a non-finite logit"):
        forward_kl(s_bad, t, W3)
    with pytest.raises(ValueError, match="mask is all zero"):
        forward_kl(s, t, W3, torch.zeros(2, 5), empty_mask="raise")
    lp = torch.log_softmax(t, -1)
    ids, vals = lp[0].topk(3, -1).indices, lp[0].topk(3, -1).values
    with pytest.raises(ValueError, match=r"TopK ids\[0, 0, 1\] = 7 is outside the vocabulary \[0, 7\)"):
        forward_kl(s, [TopK(ids.clone().index_put_((torch.tensor(0), torch.tensor(0), torch.tensor(1)), torch.tensor(7)), vals)], [1.0])
    dup = ids.clone()
    dup[1, 2, 2] = dup[1, 2, 0]
    with pytest.raises(ValueError, match=r"TopK ids at position \[1, 2\] repeat token"):
        forward_kl(s, [TopK(dup, vals)], [1.0])
    with pytest.raises(ValueError, match="teacher_temperature must be 1"):
        forward_kl(s, [TopK(ids, vals)], [1.0], teacher_temperature=2.0)
    with pytest.raises(ValueError, match="beta"):
        generalized_jsd(s, t, W3, beta=1.5)
    with pytest.raises(ValueError, match=r"tokens\[0, 1\] = 9 is outside"):
        token_log_probs(s, torch.tensor([[0, 9, 0, 0, 0], [0, 0, 0, 0, 0]]))


# ------------------------------------------------------------------------------------------------
# end to end: a tiny Qwen2 student distilled from two TabularLM teachers reaches the target its loss names
# ------------------------------------------------------------------------------------------------
def run_example(script, *args):
    """Run an example's main() in this process (no subprocess, so no timeout to outrun under load) and
    return the JSON line it prints."""
    import contextlib
    import importlib.util
    import io
    import json
    from conftest import ROOT
    spec = importlib.util.spec_from_file_location(f"example_{script[:-3]}", ROOT / "llm_bridge" / "examples" / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert module.main(list(args)) == 0
    return json.loads(out.getvalue().strip().splitlines()[-1])


@pytest.mark.integration
@pytest.mark.parametrize("script, loss, target", [
    ("distill_loop.py", "forward", "arithmetic"), ("distill_loop.py", "reverse", "local"),
    ("distill_trainer.py", None, "arithmetic")])
def test_a_tiny_student_reaches_the_target_its_loss_names(script, loss, target):
    """300 full-batch steps on the exact objectives (every response of the tree, the teachers' full
    conditionals: no sampling, so no trajectory amplifies the CPU's rounding): the exact KL to the named
    target falls at least fivefold and ends below the KL to each of the other two pools (which differ
    by 0.05-0.4 nats)."""
    res = run_example(script, *(["--loss", loss] if loss else []), "--steps", "300")
    before, after = res["before"], res["after"]
    assert after[target] < before[target] / 5, res
    assert all(after[target] < after[other] for other in after if other != target), res


@pytest.mark.integration
def test_the_sampled_policy_gradient_moves_a_tiny_student_towards_g_seq():
    """The gamma = 1 policy gradient on 256 sampled responses per step, 300 steps: one noisy trajectory,
    whose end point depends on the CPU's rounding (ATEN_CPU_CAPABILITY=default vs avx2 on one machine,
    seed 0: KL_seq to G_seq 0.51 vs 0.25, to l 1.40 vs 0.21). Over seeds 0-2 and both roundings (five
    runs) KL_seq(q || G_seq) fell 2.7-12x, but in one run the student ended closer to l than to G_seq:
    300 steps do not separate the two targets reliably, so this test asserts only the fall, with a
    margin (2x). That gamma = 1 *reaches* G_seq is shown exactly, without sampling noise, by
    test_rkl_policy_gradient_expected_gradient_by_enumeration (its expected gradient is
    grad sum_k w_k KL_seq(q || p_k))."""
    res = run_example("distill_loop.py", "--loss", "pg", "--steps", "300")
    assert res["after"]["geometric"] < res["before"]["geometric"] / 2, res


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.sh runs it on a device)")
def test_losses_on_cuda_in_bf16_match_float32_on_the_cpu():
    """bf16 logits on CUDA, computed in float32 per chunk, against float32 logits on the CPU: the only
    difference is rounding the inputs to bf16 (relative 1e-2 on the loss and the gradient)."""
    s, t = random_problem(B=2, T=64, V=1000, seed=11, dtype=torch.float32)
    for fn in (forward_kl, reverse_kl, generalized_jsd):
        cpu, _ = fn(s, t, W3)
        (g_cpu,) = torch.autograd.grad(cpu, s)
        s_gpu = s.detach().cuda().bfloat16().requires_grad_()
        gpu, _ = fn(s_gpu, t.cuda().bfloat16(), W3.cuda())
        (g_gpu,) = torch.autograd.grad(gpu, s_gpu)
        assert float(gpu) == pytest.approx(float(cpu), rel=1e-2)
        assert float((g_gpu.float().cpu() - g_cpu).norm() / g_cpu.norm()) < 2e-2


def test_rkl_policy_gradient_groups_keep_the_baseline_within_each_group():
    """Two groups in one batch give the per-token losses of the two halves run separately; a bad id fails."""
    g = torch.Generator().manual_seed(3)
    B, T, V, K = 6, 4, 5, 2
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, V, (B, T), generator=g)
    t_lp = torch.log_softmax(torch.randn(K, B, T, V, generator=g, dtype=torch.float64), -1).gather(
        -1, tokens[None, ..., None].expand(K, -1, -1, 1))[..., 0]
    w = torch.tensor([0.7, 0.3], dtype=torch.float64)
    groups = torch.tensor([1, 0, 1, 0, 0, 1])
    together, _ = rkl_policy_gradient(logits, tokens, t_lp, w, groups=groups, reduction="none")
    for gid in (0, 1):
        sel = groups == gid
        alone, _ = rkl_policy_gradient(logits[sel], tokens[sel], t_lp[:, sel], w, reduction="none")
        torch.testing.assert_close(together[sel], alone, rtol=0, atol=1e-12)
    pooled, _ = rkl_policy_gradient(logits, tokens, t_lp, w, reduction="none")
    assert not torch.allclose(pooled, together)                 # the groups change the baseline
    with pytest.raises(ValueError, match="groups"):
        rkl_policy_gradient(logits, tokens, t_lp, w, groups=torch.tensor([0, 1]))
