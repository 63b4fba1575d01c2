"""The diagnosis from each teacher's top k (llm_bridge.topk_bounds): every bound holds against the exact
statistics of the full distributions (llm_bridge.diagnosis.position_stats), on teachers whose tails are
heavy and on teachers that veto; vetoes are exact; the bounds close as k grows to the vocabulary."""

import numpy as np
import pytest
import torch

from llm_bridge.diagnosis import Thresholds, diagnose_stats, position_stats, veto_candidates
from llm_bridge.topk_bounds import rescore_needs, student_candidates, topk_stats


def teachers(seed, K=2, T=12, n=300, scale=3.0, veto=True, similar=False):
    """K random teachers' log-probabilities (K, T, n) with heavy tails; with ``veto`` the last teacher gives a
    token the first one likes ~1e-7 at every third position (a planted veto); ``similar``: every teacher is the
    first one's logits plus a little noise (they list nearly the same tokens)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(K, T, n)) * scale
    if similar:
        logits = logits[:1] + 0.1 * logits
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


def test_a_teacher_whose_top_k_holds_all_its_mass_keeps_the_bounds_finite():
    """A cold (tempered) teacher: 10 tokens at ln 0.1 + 2e-7 (float32's rounding there: their sum is above 1) and the rest
    at -60; the other teacher spreads over the vocabulary, so A(R) > 0 while the cold teacher's known mass says
    nothing is left. KL(A || l) is finite (the cold teacher's tail is 1e-23, not 0): its served lower bound is
    finite and below the exact KL, l's probabilities and TV within their bounds."""
    th = Thresholds()
    n, T = 200, 3
    cold = np.full((T, n), -60.0)
    cold[:, :10] = np.log(0.1) + 2e-7
    assert np.exp(cold[0, :10]).sum() >= 1.0
    warm = torch.log_softmax(torch.tensor(np.random.default_rng(0).normal(size=(T, n))), -1).numpy()
    lp = torch.tensor(np.stack([warm, cold]))
    w, tokens = np.array([0.5, 0.5]), np.array([0, 1, 2])
    exact = position_stats(lp, w, tokens, k=veto_candidates(th))
    got, _ = served_stats(lp, w, tokens, 21, th)
    assert np.isfinite(got["kl"]).all() and (got["kl"] <= exact["kl"] + 1e-9).all()
    assert (got["tv"] <= exact["tv"] + 1e-9).all() and (exact["tv"] <= got["tv_hi"] + 1e-9).all()
    assert ((got["l_token"] <= exact["l_token"] * (1 + 1e-9))
            & (exact["l_token"] <= got["l_token"] * got["l_factor"] * (1 + 1e-9))).all()


@pytest.mark.parametrize("seed", range(3))
def test_a_student_reference_gives_the_vetoes_of_the_full_distributions(seed):
    """With a student as the veto reference (a noisy copy of teacher 0, whose favourite tokens teacher 1 vetoes
    every third position): its candidates (tokens at p >= the veto floor) scored exactly under every teacher,
    the vetoes are the rows the full distributions give (position, teacher, token, the student's probability,
    A's), >= 3 of them; a candidate left unscored is an error, not a silent miss."""
    th = Thresholds()
    w = np.array([0.5, 0.5])
    lp = teachers(seed)
    T, n = lp.shape[1], lp.shape[2]
    student = torch.log_softmax(lp[0] + 0.3 * torch.tensor(np.random.default_rng(seed).normal(size=(T, n))), -1)
    tokens = np.random.default_rng(seed + 7).integers(0, n, T)
    refs = [student_candidates(student[t].numpy(), th.veto_floor, veto_candidates(th)) for t in range(T)]
    ids, lps = truncate(lp, 21)
    own = lp[:, np.arange(T), tokens].numpy()
    extra = {(t, j, a): float(lp[j, t, a]) for t, j, a in rescore_needs(ids, lps, tokens, own, w, n, th, refs)}
    got = topk_stats(ids, lps, tokens, own, w, n, extra, veto_candidates(th), refs)
    exact = position_stats(lp, w, tokens, student, veto_candidates(th))
    a = diagnose_stats(got, w, tokens, thresholds=th)["vetoes"]
    b = diagnose_stats(exact, w, tokens, thresholds=th)["vetoes"]
    assert len(b) >= 3
    assert list(zip(a.position, a.teacher, a.token)) == list(zip(b.position, b.teacher, b.token))
    np.testing.assert_allclose(a.reference_prob, b.reference_prob, rtol=1e-6)
    np.testing.assert_allclose(a.a_prob, b.a_prob, rtol=1e-9)
    with pytest.raises(ValueError, match="not scored under every teacher"):
        topk_stats(ids, lps, tokens, own, w, n, {}, veto_candidates(th), refs)


def test_student_candidates_and_what_they_ask_for():
    """student_candidates: every token at p >= the floor (one exactly at it included), most probable first, ties
    by token id, int64 ids, at most k_cand (the most probable kept). rescore_needs with that reference asks each
    candidate of exactly the positive-weight teachers that do not list it: none for a token every teacher lists,
    every such teacher for one no teacher lists."""
    floor = 0.05
    lp = np.full(10, np.log(1e-3))
    lp[[7, 2, 5, 3]] = np.log([0.4, 0.2, 0.2, floor])
    ids, got = student_candidates(lp, floor, 21)
    assert ids.dtype == np.int64 and ids.tolist() == [7, 2, 5, 3]
    np.testing.assert_array_equal(got, lp[[7, 2, 5, 3]])
    assert student_candidates(lp, floor, 2)[0].tolist() == [7, 2]
    assert student_candidates(np.nextafter(lp, -np.inf), floor, 21)[0].tolist() == [7, 2, 5]
    # three teachers, weights (0.5, 0.5, 0): token 1 listed by all, 4 by teacher 0 only, 8 by none
    w, n = np.array([0.5, 0.5, 0.0]), 10
    ids_k = np.array([[[1, 4, 0]], [[1, 0, 2]], [[1, 0, 2]]])
    lps_k = np.log(np.array([[[0.5, 0.3, 0.1]], [[0.6, 0.2, 0.1]], [[0.6, 0.2, 0.1]]]))
    ref = [(np.array([1, 4, 8]), np.log([0.3, 0.2, 0.1]))]
    need = rescore_needs(ids_k, lps_k, np.array([0]), lps_k[:, :, 2], w, n, Thresholds(), ref)
    assert need == [(0, 0, 8), (0, 1, 4), (0, 1, 8)]


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


def reference_bounds(lp, ids, token, extra, w):
    """The bounds at one position, written out token by token (plain Python over dicts), with KL's least
    value over the unknown normaliser found by a bounded numerical minimisation instead of the closed form."""
    from scipy.optimize import minimize_scalar
    K, n = lp.shape
    keep = [k for k in range(K) if w[k] > 0]
    known = [set(map(int, ids[k])) | {int(token)} | {a for (j, a) in extra if j == k} for k in range(K)]
    p = np.exp(lp)
    tau = [max(0.0, 1.0 - sum(p[k, a] for a in known[k])) for k in range(K)]
    u = [min(p[k, int(ids[k, -1])], tau[k]) for k in range(K)]
    part = [-sum(p[k, a] * lp[k, a] for a in known[k]) for k in range(K)]
    ent_lo = [part[k] + (tau[k] * -np.log(u[k]) if tau[k] > 0 else 0.0) for k in range(K)]
    ent_hi = [part[k] + (tau[k] * np.log((n - len(known[k])) / tau[k]) if tau[k] > 0 else 0.0) for k in range(K)]
    S = sorted(set.intersection(*[known[k] for k in keep]))
    A = {a: sum(w[k] * p[k, a] for k in keep) for a in S}
    g = {a: np.exp(sum(w[k] * lp[k, a] for k in keep)) for a in S}
    z_s = sum(g.values())
    H = np.prod([max(1.0 - sum(p[k, a] for a in S), len(S) * 2.0 ** -20) ** w[k] for k in keep])
    a_r = 1.0 - sum(A.values())

    def coarse_kl(z_r):
        z = z_s + z_r
        return sum(A[a] * np.log(A[a] * z / g[a]) for a in S) + (a_r * np.log(a_r * z / z_r) if a_r > 0 else 0.0)
    kl_lo = minimize_scalar(coarse_kl, bounds=(1e-300, H), method="bounded", options=dict(xatol=1e-14)).fun
    lo = {a: g[a] / (z_s + H) for a in S}
    hi = {a: g[a] / z_s for a in S}
    inside = lambda a: lo[a] <= A[a] <= hi[a]                                             # noqa: E731
    tv_lo = 0.5 * (sum(0.0 if inside(a) else min(abs(A[a] - lo[a]), abs(A[a] - hi[a])) for a in S)
                   + max(0.0, a_r - H / (z_s + H)))
    tv_hi = 0.5 * (sum(max(abs(A[a] - lo[a]), abs(A[a] - hi[a])) for a in S) + a_r + H / (z_s + H))
    best_a = max(S, key=lambda a: A[a])
    best_l = max(S, key=lambda a: g[a])
    by_a = sorted(S, key=lambda a: -A[a])[:21]
    return dict(entropy=ent_lo, entropy_hi=ent_hi, kl=kl_lo, tv=tv_lo, tv_hi=tv_hi, l_factor=(z_s + H) / z_s,
                l_token=lo[int(token)], a_token=A[int(token)], argmax_a=best_a, argmax_a_prob=A[best_a],
                argmax_l=best_l, argmax_l_prob=lo[best_l], cand=by_a, cand_a=[A[a] for a in by_a],
                cand_l=[hi[a] for a in by_a], top_lp=[lp[k, int(ids[k, 0])] for k in range(K)],
                top_a=[A.get(int(ids[k, 0]), np.nan) for k in range(K)],
                top_l=[lo.get(int(ids[k, 0]), np.nan) for k in range(K)])


@pytest.mark.parametrize("seed, k, similar", [(0, 21, False), (1, 40, False), (2, 60, True)])
def test_topk_stats_equal_a_reference_written_token_by_token(seed, k, similar):
    """Every bound and value equals the token-by-token reference (KL's least value by numerical minimisation):
    the bounds are the tightest this algebra gives, not merely valid. Similar teachers share most listed
    tokens, so that more than 21 candidates compete."""
    th = Thresholds()
    w = np.array([0.35, 0.65])
    lp = teachers(seed, T=6, n=200, similar=similar)
    tokens = np.random.default_rng(seed).integers(0, 200, 6)
    got, extra = served_stats(lp, w, tokens, k, th)
    ids, _ = truncate(lp, k)
    for t in range(6):
        ref = reference_bounds(lp[:, t].numpy(), ids[:, t], tokens[t], {(j, a) for s, j, a in extra if s == t}, w)
        for key, want in ref.items():
            have = got[key][t]
            if key == "cand":
                np.testing.assert_array_equal(have[:len(want)], want, err_msg=key)
                assert (have[len(want):] == -1).all() and (got["cand_ref"][t][len(want):] == 0).all()
            elif key in ("cand_a", "cand_l"):
                np.testing.assert_allclose(have[:len(want)], want, rtol=1e-9, err_msg=key)
            else:
                np.testing.assert_allclose(have, want, rtol=1e-7, atol=1e-12, err_msg=key)
    assert max(len(set(ids[0, t]) & set(ids[1, t])) for t in range(6)) > 21 or not similar


def test_a_confident_expert_is_found_through_the_top_k():
    """A teacher sure of a token the other (flat) teacher does not list: rescore_needs asks for exactly that
    token under the other teacher at each position (a veto floor of 0.9 keeps the veto rule from asking it too),
    and the expert rows equal the ones from the full distributions."""
    n, T = 400, 4
    th = Thresholds(veto_floor=0.9)
    rng = np.random.default_rng(9)
    flat = torch.log_softmax(torch.tensor(rng.normal(size=(T, n)) * 0.3), -1)
    sure_logits = rng.normal(size=(T, n))
    star = flat.argsort(-1)[:, n // 2].numpy()                 # a token the flat teacher ranks in the middle
    sure_logits[np.arange(T), star] += 14.0
    lp = torch.stack([torch.log_softmax(torch.tensor(sure_logits), -1), flat])
    w = np.array([0.5, 0.5])
    tokens = star.copy()
    tokens[0] = (star[0] + 1) % n
    ids, lps = truncate(lp, 21)
    own = lp[:, np.arange(T), tokens].numpy()
    assert rescore_needs(ids, lps, tokens, own, w, n, th) == [(0, 1, int(star[0]))]     # elsewhere it is the token
    assert rescore_needs(ids, lps, tokens, own, w, n) == [(0, 1, int(star[0]))]        # the veto rule asks it too
    exact = diagnose_stats(position_stats(lp, w, tokens), w, tokens, thresholds=th)["experts"]
    got, _ = served_stats(lp, w, tokens, 21, th)
    served = diagnose_stats(got, w, tokens, thresholds=th)["experts"]
    assert len(exact) >= 2
    assert list(served.position) == list(exact.position) and list(served.token) == list(exact.token)
    np.testing.assert_allclose(served.a_prob, exact.a_prob, rtol=1e-9)


class TableBackend:
    """A backend over fixed first-position log-probabilities (K, n) per prompt: top_k and score as a server
    gives them (the k most likely, exact scores of given tokens), counting the scores asked."""

    def __init__(self, first):
        self.first, self.scored = first, 0

    def top_k(self, rows, k, models=None):
        out = []
        for p, c in rows:
            lp = torch.as_tensor(self.first[p[0]])[models]
            top = lp.topk(k, dim=-1)
            out.append((top.indices.numpy()[:, None], top.values.numpy()[:, None], lp[:, c[0]].numpy()[:, None]))
        return out

    def score(self, rows, models=None):
        self.scored += len(rows)
        return [np.asarray(self.first[p[0]])[models][:, c] for p, c in rows]


def test_first_token_options_served_equal_the_full_distribution_choice_where_certain():
    """The served first-token options (C: the pool's top over the teachers' top k, every union token scored
    exactly; I: the other teachers' top choice) equal llm_bridge.diagnosis.first_token_options on the full
    distributions wherever the served C is certain; certainty fails only where a token outside the union could
    win; unlisted union tokens were scored (one request each)."""
    from llm_bridge.diagnosis import first_token_options
    from llm_bridge.topk_bounds import first_token_options_served
    cases = [teachers(s, T=1, n=60, scale=s % 3 + 1.0, veto=False, similar=s % 2 == 1)[:, 0].numpy() for s in range(30)]
    w = np.array([0.4, 0.6])
    certain_seen = uncertain_seen = 0
    for k in (2, 5, 60):
        backend = TableBackend(cases)
        got = first_token_options_served(backend, w, [[i] for i in range(len(cases))], [0] * len(cases), k)
        for first, (c, i, certain) in zip(cases, got):
            want = first_token_options(first, w)
            pooled = w @ first
            if certain:
                assert (c, i) == want or pooled[i] == pooled[want[1]]
                certain_seen += 1
            else:                                   # an unlisted token's bound passes the union's best
                assert k < 60
                uncertain_seen += 1
            assert pooled[c] == pytest.approx(max(pooled[a] for a in set(np.argsort(-first, axis=1)[:, :k].ravel())))
        if k == 60:
            assert backend.scored == 0 and all(x[2] for x in got)
        elif k == 2:
            assert backend.scored > 0
    assert certain_seen > 30 and uncertain_seen > 0, (certain_seen, uncertain_seen)


def test_rescore_needs_asks_a_token_whose_bound_reaches_the_veto_floor_exactly():
    """Two sure teachers (top 1 each, all mass listed, so an unlisted token's bound u is 0): the token only the
    first lists has A's upper bound w_0 * 1 + w_1 * 0 = 0.25 exactly. At a veto floor of 0.25 rescore_needs
    asks the second teacher for it ("at least the floor"); one float above, nothing; the thresholds given are
    the ones read (the default floor 0.05 would ask)."""
    a, b, n = 3, 7, 10
    ids = np.array([[[a]], [[b]]])
    lps = np.array([[[np.log1p(-np.exp(-50.0))]], [[0.0]]])       # exp() of the first is 1.0 exactly
    own = np.array([[-50.0], [0.0]])                               # the response's token b under each teacher
    w = np.array([0.25, 0.75])
    ask = lambda floor: rescore_needs(ids, lps, np.array([b]), own, w, n, Thresholds(veto_floor=floor))  # noqa: E731
    assert ask(0.25) == [(0, 1, a)]
    assert ask(np.nextafter(0.25, 1.0)) == []
    assert rescore_needs(ids, lps, np.array([b]), own, w, n) == [(0, 1, a)]


def test_rescore_needs_expert_rule_at_its_thresholds():
    """The confident-expert rule at its edges, with the entropy bounds topk_stats reports for the same top k:
    the sure teacher's lower bound exactly at expert_entropy and the flat teacher's upper bound exactly at
    uninformative_entropy ask the flat teacher for the sure one's top token; either threshold one float
    stricter asks nothing (each condition is needed, not one of them)."""
    n = 400
    rng = np.random.default_rng(9)
    flat = torch.log_softmax(torch.tensor(rng.normal(size=(1, n)) * 0.3), -1)
    sure_logits = rng.normal(size=(1, n))
    star = int(flat[0].argsort()[n // 2])
    sure_logits[0, star] += 14.0
    lp = torch.stack([torch.log_softmax(torch.tensor(sure_logits), -1), flat])
    w, tokens = np.array([0.5, 0.5]), np.array([(star + 1) % n])
    ids, lps = truncate(lp, 21)
    own = lp[:, [0], tokens].numpy()
    stats = topk_stats(ids, lps, tokens, own, w, n)
    lo, hi = float(stats["entropy"][0, 0]), float(stats["entropy_hi"][0, 1])
    assert lo < 0.5 < 2.0 < hi

    def ask(expert, uninformative):
        th = Thresholds(veto_floor=1.0, expert_entropy=expert, uninformative_entropy=uninformative)
        return rescore_needs(ids, lps, tokens, own, w, n, th)

    assert ask(lo, hi) == [(0, 1, star)]
    assert ask(np.nextafter(lo, 0.0), hi) == []
    assert ask(lo, np.nextafter(hi, np.inf)) == []


def test_first_token_certainty_is_the_stated_bound_and_ties_go_to_the_lowest_id():
    """'certain' is exactly: the pool's best union score >= sum_k w_k (teacher k's k-th log-probability), read
    off the full distributions (it must fail for a runner-up and for another listed rank); uniform teachers
    tie every token (C the lowest id of the union, certain: the best equals that bound, and no unlisted
    token can beat it); the default asks each teacher's top 50."""
    from llm_bridge.topk_bounds import first_token_options_served
    cases = [teachers(s, T=1, n=60, scale=s % 3 + 1.0, veto=False, similar=s % 2 == 1)[:, 0].numpy() for s in range(30)]
    w = np.array([0.4, 0.6])
    outcomes = set()
    for k in (2, 5, 20):
        got = first_token_options_served(TableBackend(cases), w, [[i] for i in range(len(cases))], [0] * 30, k)
        for first, (c, _, certain) in zip(cases, got):
            bound = w @ np.sort(first, axis=1)[:, -k]
            assert certain == bool(w @ first[:, c] >= bound)
            outcomes.add(certain)
    assert outcomes == {True, False}
    flat = [np.full((2, 60), -np.log(60.0))]
    for k in (5, 60):
        ((c, i, certain),) = first_token_options_served(TableBackend(flat), w, [[0]], [0], k)
        union = set(torch.as_tensor(flat[0]).topk(k, dim=-1).indices.ravel().tolist())
        assert c == min(union) and certain                 # the best ties the bound: no token can beat it

    class Asked(TableBackend):
        def top_k(self, rows, k, models=None):
            self.k = k
            return super().top_k(rows, k, models)
    backend = Asked([np.log(np.full((2, 60), 1 / 60.0))])
    first_token_options_served(backend, w, [[0]], [0])
    assert backend.k == 50


def test_topk_stats_read_float32_inputs_as_float64_and_keep_the_default_veto_candidates():
    """Servers may hand float32 log-probabilities: topk_stats gives exactly what it gives for the same
    values in float64 (it computes in float64), and by default keeps veto_candidates(Thresholds()) candidates
    per position; student_candidates returns float64 log-probabilities and breaks ties by token id."""
    th = Thresholds()
    w = np.array([0.3, 0.7])
    lp = teachers(3)
    T, n = lp.shape[1], lp.shape[2]
    tokens = np.random.default_rng(103).integers(0, n, T)
    ids, lps = truncate(lp, 30)
    own = lp[:, np.arange(T), tokens].numpy()
    lps32, own32 = lps.astype(np.float32), own.astype(np.float32)
    a = topk_stats(ids.astype(np.int32), lps32, tokens, own32, w, n)
    b = topk_stats(ids, lps32.astype(np.float64), tokens, own32.astype(np.float64), w, n)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    assert a["cand"].shape == (T, veto_candidates(th))
    tied = np.full(40, np.log(0.02), dtype=np.float32)
    tied[[7, 3]] = np.log(0.1)
    at, at_lp = student_candidates(tied, 0.01, 30)
    assert at_lp.dtype == np.float64
    assert list(at) == [3, 7] + [a for a in range(40) if a not in (3, 7)][:28]


def test_tokens_every_teacher_masks_add_nothing():
    """A vocabulary mask shared by the teachers (-inf logits for the last 10 tokens, listed in the top k
    because k = n): those tokens have A = 0 and contribute 0 log 0 = 0; with every token listed the bounds
    close on the exact statistics of the full distributions (finite, not NaN)."""
    th = Thresholds()
    w = np.array([0.3, 0.7])
    logits = torch.tensor(np.random.default_rng(7).normal(size=(2, 4, 60)) * 2.0)
    logits[..., 50:] = -np.inf
    lp = torch.log_softmax(logits, -1)
    tokens = np.array([1, 5, 9, 20])
    exact = position_stats(lp, w, tokens, k=veto_candidates(th))
    got, _ = served_stats(lp, w, tokens, 60, th)
    for key in ("kl", "tv"):
        assert np.isfinite(got[key]).all()
        np.testing.assert_allclose(got[key], exact[key], rtol=1e-9, atol=1e-12, err_msg=key)
        np.testing.assert_allclose(got[key + "_hi"], exact[key], rtol=1e-9, atol=1e-12, err_msg=key)


def test_teachers_whose_supports_do_not_meet_give_unknown_statistics_not_an_error():
    """Two teachers on disjoint supports (every other logit -inf) and a response token only the first
    allows: no known token has mass under both, so the pool's statistics are NaN, as the full distributions
    give them (the geometric pool is empty there); the top-k path used to stop with 'math domain error'."""
    n = 20
    logits = torch.full((2, 1, n), -np.inf, dtype=torch.float64)
    logits[0, 0, :5] = torch.tensor([3.0, 1.0, 0.0, 0.0, 0.0])
    logits[1, 0, 10:15] = torch.tensor([3.0, 1.0, 0.0, 0.0, 0.0])
    lp = torch.log_softmax(logits, -1)
    w, tokens, th = np.array([0.5, 0.5]), np.array([0]), Thresholds()
    exact = position_stats(lp, w, tokens, k=veto_candidates(th))
    got, extra = served_stats(lp, w, tokens, 5, th)
    assert extra                                              # the listed tokens were scored under the other
    for key in ("kl", "tv", "kl_hi", "tv_hi", "l_token"):
        assert np.isnan(got[key]).all(), key
    assert np.isnan(exact["kl"]).all() and np.isnan(exact["tv"]).all()
    np.testing.assert_allclose(got["a_token"], exact["a_token"], rtol=1e-12)
