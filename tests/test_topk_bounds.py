"""The diagnosis from each teacher's top k (llm_bridge.topk_bounds): every bound holds against the exact
statistics of the full distributions (llm_bridge.diagnosis.position_stats), on teachers whose tails are
heavy and on teachers that veto; vetoes are exact; the bounds close as k grows to the vocabulary."""

import numpy as np
import pytest
import torch

from llm_bridge.diagnosis import Thresholds, diagnose_stats, position_stats, veto_candidates
from llm_bridge.topk_bounds import rescore_needs, topk_stats


def teachers(seed, K=2, T=12, n=300, scale=3.0, veto=True):
    """K random teachers' log-probabilities (K, T, n) with heavy tails; with ``veto`` the last teacher gives a
    token the first one likes ~1e-7 at every third position (a planted veto)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(K, T, n)) * scale
    if veto:
        fav = logits[0].argmax(-1)
        logits[-1, np.arange(0, T, 3), fav[::3]] -= 40.0
    return torch.log_softmax(torch.tensor(logits), -1)


def truncate(lp, k):
    top = lp.topk(k, dim=-1)
    return top.indices.numpy(), top.values.numpy()


def served_stats(lp, w, tokens, k, th):
    """What the served path computes: top k, then the exact scores rescore_needs asks for, then the stats."""
    ids, lps = truncate(lp, k)
    own = lp[:, np.arange(lp.shape[1]), tokens].numpy()
    n = lp.shape[-1]
    extra = {(t, j, a): float(lp[j, t, a]) for t, j, a in rescore_needs(ids, lps, tokens, own, w, n, th)}
    return topk_stats(ids, lps, tokens, own, w, n, extra, veto_candidates(th)), extra


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [21, 40])
def test_topk_bounds_hold_against_the_full_distributions(seed, k):
    th = Thresholds()
    w = np.array([0.3, 0.7]) if seed % 2 else np.array([0.5, 0.5])
    lp = teachers(seed)
    T, n = lp.shape[1], lp.shape[2]
    tokens = np.random.default_rng(seed + 100).integers(0, n, T)
    exact = position_stats(lp, w, tokens, k=veto_candidates(th))
    got, _ = served_stats(lp, w, tokens, k, th)
    eps = 1e-9
    assert (got["kl"] <= exact["kl"] + eps).all() and (exact["kl"] <= got["kl_hi"] + eps).all()
    assert (got["kl"] > 0.2 * exact["kl"]).mean() > 0.5            # the lower bound is not vacuous
    assert (got["tv"] <= exact["tv"] + eps).all() and (exact["tv"] <= got["tv_hi"] + eps).all()
    assert ((got["entropy"] <= exact["entropy"] + eps) & (exact["entropy"] <= got["entropy_hi"] + eps)).all()
    np.testing.assert_allclose(got["a_token"], exact["a_token"], rtol=1e-9)
    assert ((got["l_token"] <= exact["l_token"] * (1 + eps))
            & (exact["l_token"] <= got["l_token"] * got["l_factor"] * (1 + eps))).all()
    np.testing.assert_array_equal(got["top"], exact["top"])
    sure = got["argmax_certain"]
    assert sure.any()
    np.testing.assert_array_equal(got["argmax_a"][sure], exact["argmax_a"][sure])
    np.testing.assert_array_equal(got["argmax_l"][sure], exact["argmax_l"][sure])
    # vetoes: the same rows as from the full distributions
    a = diagnose_stats(got, w, tokens, thresholds=th)["vetoes"]
    b = diagnose_stats(exact, w, tokens, thresholds=th)["vetoes"]
    assert len(b) >= 3
    assert list(zip(a.position, a.teacher, a.token)) == list(zip(b.position, b.teacher, b.token))
    np.testing.assert_allclose(a.teacher_log_prob, b.teacher_log_prob, atol=1e-5)
    np.testing.assert_allclose(a.a_prob, b.a_prob, rtol=1e-9)
    assert (a.l_prob.to_numpy() >= b.l_prob.to_numpy() * (1 - 1e-9)).all()      # "l gives it at most": an upper bound


def test_vetoes_need_the_exact_scores_and_ask_for_few():
    """Without the rescored log-probabilities a planted veto is missed (the vetoing teacher does not list the
    token); rescore_needs asks for it, and for under half of the listed tokens some teacher does not list."""
    th = Thresholds()
    w = np.array([0.5, 0.5])
    lp = teachers(3)
    T, n = lp.shape[1], lp.shape[2]
    tokens = np.zeros(T, dtype=np.int64)
    got, extra = served_stats(lp, w, tokens, 21, th)
    ids, lps = truncate(lp, 21)
    bare = topk_stats(ids, lps, tokens, lp[:, np.arange(T), tokens].numpy(), w, n, None, veto_candidates(th))
    with_scores = diagnose_stats(got, w, tokens, thresholds=th)["vetoes"]
    without = diagnose_stats(bare, w, tokens, thresholds=th)["vetoes"]
    assert len(with_scores) >= 3 and len(without) < len(with_scores)
    union_missing = sum(len(set(ids[j, t]) - set(ids[i, t])) for t in range(T) for i, j in ((0, 1), (1, 0)))
    assert 0 < len(extra) < 0.5 * union_missing        # only the tokens that may reach the floor


def test_bounds_close_when_k_is_the_vocabulary():
    """k = n: every bound is the exact value (no tail), to rounding."""
    th = Thresholds()
    w = np.array([0.4, 0.6])
    lp = teachers(5, n=64)
    tokens = np.arange(lp.shape[1])
    exact = position_stats(lp, w, tokens, k=veto_candidates(th))
    got, _ = served_stats(lp, w, tokens, 64, th)
    for key in ("kl", "kl_hi"):
        np.testing.assert_allclose(got[key], exact["kl"], atol=1e-9)
    for key in ("tv", "tv_hi"):
        np.testing.assert_allclose(got[key], exact["tv"], atol=1e-9)
    np.testing.assert_allclose(got["entropy"], exact["entropy"], atol=1e-9)
    np.testing.assert_allclose(got["entropy_hi"], exact["entropy"], atol=1e-9)
    np.testing.assert_allclose(got["l_factor"], 1.0)
    assert got["argmax_certain"].all()


def test_entropy_bounds_are_attained_by_a_uniform_tail():
    """A teacher uniform over the vocabulary has its tail at both extremes at once (every unlisted token at
    the bound u and the tail spread evenly): both entropy bounds equal ln n."""
    n, T = 200, 3
    lp = torch.stack([torch.full((T, n), -np.log(n), dtype=torch.float64), teachers(1, K=1, T=T, n=n)[0]])
    tokens = np.zeros(T, dtype=np.int64)
    got, _ = served_stats(lp, np.array([0.5, 0.5]), tokens, 21, Thresholds())
    np.testing.assert_allclose(got["entropy"][:, 0], np.log(n), rtol=1e-12)
    np.testing.assert_allclose(got["entropy_hi"][:, 0], np.log(n), rtol=1e-12)
