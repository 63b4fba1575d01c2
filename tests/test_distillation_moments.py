"""Exact moments of the sampled-token KL estimators (distillation/moments.py): closed forms, and Monte Carlo
through llm_bridge.losses."""

import itertools
import math

import numpy as np
import pytest
import torch
from scipy.special import logsumexp

from distillation import moments, tasks
from llm_bridge.losses import kl_estimator_loss

TOL = 0.01


# ------------------------------------------------------------------------------------------------
# estimators: exact moments (closed forms) and Monte Carlo through llm_bridge.losses
# ------------------------------------------------------------------------------------------------
def pair(seed, n=12, spread=1.0):
    rng = np.random.default_rng(seed)
    zq, zp = rng.normal(0, spread, n), rng.normal(0, spread, n)
    return zq - logsumexp(zq), zp - logsumexp(zp)


def test_value_moments_closed_forms_and_monte_carlo():
    lq, lp = pair(0)
    q = np.exp(lq)
    kl = float(q @ (lq - lp))
    m = moments.value_moments(lq, lp)
    assert m["k1"][0] == pytest.approx(kl, abs=1e-14) and m["k3"][0] == pytest.approx(kl, abs=1e-14)
    assert m["k2"][0] == pytest.approx(0.5 * q @ (lq - lp) ** 2)
    rng = np.random.default_rng(1)
    x = rng.choice(lq.size, size=200_000, p=q)
    for name, v in moments.estimator_values(lp[x] - lq[x]).items():
        mean, var = m[name]
        assert abs(v.mean() - mean) < 5 * math.sqrt(var / x.size), name
        assert v.var() == pytest.approx(var, rel=0.05), name


@pytest.mark.parametrize("estimator, source, importance, expected", [
    ("k2", "student", False, "rkl"), ("k3", "student", False, "fkl"), ("k3", "teacher", True, "fkl"),
    ("k2", "teacher", True, "rkl"), ("k1", "student", False, "zero"), ("k1", "teacher", False, "-fkl")])
def test_loss_gradient_expectations_are_the_derived_ones(estimator, source, importance, expected):
    lq, lp = pair(2)
    q, p = np.exp(lq), np.exp(lp)
    ref = {"rkl": q * ((lq - lp) - q @ (lq - lp)), "fkl": q - p, "zero": 0 * q, "-fkl": p - q}[expected]
    mean, _ = moments.gradient_moments(lq, lp, estimator, "loss", source, importance)
    np.testing.assert_allclose(mean, ref, atol=1e-14)


def test_k1_as_a_reward_on_student_samples_is_the_rkl_gradient():
    lq, lp = pair(3)
    q = np.exp(lq)
    mean, _ = moments.gradient_moments(lq, lp, "k1", "reward", "student")
    np.testing.assert_allclose(mean, q * ((lq - lp) - q @ (lq - lp)), atol=1e-14)


@pytest.mark.parametrize("estimator, source, importance", [("k2", "student", False), ("k3", "teacher", True),
                                                           ("k3", "teacher", False), ("k1", "teacher", False)])
def test_gradient_moments_match_monte_carlo_through_the_loss_code(estimator, source, importance):
    """Per-sample gradients of llm_bridge.losses.kl_estimator_loss (autograd) on sampled tokens: their mean
    and covariance trace against gradient_moments."""
    lq, lp = pair(4, n=8)
    N = 40000
    gen = torch.Generator().manual_seed(0)
    s = torch.as_tensor(np.exp(lq if source == "student" else lp))
    x = torch.multinomial(s, N, replacement=True, generator=gen)
    logits = torch.as_tensor(lq).expand(N, 1, -1).clone().requires_grad_()
    t_tok = torch.as_tensor(lp)[x].view(1, N, 1)
    rho = (torch.as_tensor(lq) - torch.log(s))[x].exp().view(N, 1) if importance else None
    loss, _ = kl_estimator_loss(logits, x.view(N, 1), t_tok, torch.ones(1, dtype=torch.float64), None,
                                estimator=estimator, pool="before", importance_weights=rho, reduction="sum")
    (g,) = torch.autograd.grad(loss, logits)
    g = g[:, 0].numpy()
    mean, trace = moments.gradient_moments(lq, lp, estimator, "loss", source, importance)
    se = np.sqrt(g.var(0) / N)
    assert np.all(np.abs(g.mean(0) - mean) < 5 * se + 1e-12)
    assert g.var(0).sum() == pytest.approx(trace, rel=0.05)


def test_sequence_importance_weight_second_moment_against_enumeration():
    rng = np.random.default_rng(5)
    next_state = rng.integers(0, 4, size=(4, 3))
    lq, lp = np.log(rng.dirichlet(np.ones(3), size=4)), np.log(rng.dirichlet(np.ones(3), size=4))
    exact = moments.sequence_is_second_moment(next_state, 0, 5, lq, lp)
    for H in range(6):
        ref = sum(math.exp(sum(2 * lq[s, a] - lp[s, a] for s, a in walk(next_state, path)))
                  for path in itertools.product(range(3), repeat=H))
        assert exact[H] == pytest.approx(math.log(ref), abs=1e-10)
    assert exact[1] == pytest.approx(logsumexp(2 * lq[0] - lp[0]))                    # sum_x q^2 / p


def walk(next_state, path):
    s = 0
    for a in path:
        yield s, a
        s = next_state[s, a]


def test_importance_weights_on_a_tree_with_ends():
    task = tasks.make_task("tree", K=2, seed=0)
    t = task.teachers
    rng = np.random.default_rng(6)
    lq = np.log(rng.dirichlet(np.ones(t.n), size=t.S))
    lp = np.asarray(t.log_probs[0])
    exact = moments.sequence_is_second_moment(t.next_state, t.start, 5, lq, lp)     # the tree ends after 3 tokens
    ref = sum(math.exp(sum(2 * lq[s, a] - lp[s, a] for s, a in walk(t.next_state, path)))
              for path in itertools.product(range(t.n), repeat=3))
    assert exact[3] == pytest.approx(math.log(ref), abs=1e-10)
    assert exact[5] == pytest.approx(exact[3], abs=1e-10)                     # nothing after the end


def test_topk_k3_bias_identity_and_full_vocabulary():
    lq, lp = pair(7, n=40)
    for k in (1, 5, 20, 40):
        e_k3, kl, tail = moments.topk_k3_bias(lq, lp, k)
        top = np.argsort(-lq)[:k]
        qt = np.exp(lq[top]) / np.exp(lq[top]).sum()
        assert kl == pytest.approx(float(qt @ (np.log(qt) - lp[top])), abs=1e-12)
        assert tail == pytest.approx(1 - np.exp(lp[top]).sum(), abs=1e-12)
        assert e_k3 == pytest.approx(kl - tail, abs=1e-12)
    assert tail == pytest.approx(0.0, abs=1e-12) and e_k3 == pytest.approx(float(np.exp(lq) @ (lq - lp)), abs=1e-12)


def test_samples_needed():
    target = np.array([1.0, 0.0])
    assert moments.samples_needed(target, 2.0, target, rel_error=0.1) == pytest.approx(2.0 / 0.01)
    assert moments.samples_needed(np.array([1.2, 0.0]), 2.0, target, rel_error=0.1) == math.inf    # bias alone too big
