"""llm_bridge.horizon (T8's flip horizon) against aggregation's exact dynamic programme on TabularLM
teachers, the batched sampler against full recomputation on a tiny Llama, and the drift fit on
synthetic gaps with known answers."""

import os

import numpy as np
import pandas as pd
import pytest
import torch

import aggregation as ag
from aggregation import examples
from llm_bridge.horizon import (Z_80, detectable_drift, exact_flip_horizon, first_significant_flip, fit_drift,
                                flip_horizon_study, is_saturating, log_partition_curve, running_share,
                                sample_contexts, sample_log_factors_many, torch_geometric_pool)
from llm_bridge.partition import Z_95
from llm_bridge.partition import log_mean_exp_stats
from scipy.special import logsumexp
from llm_bridge.tabular import TabularLM
from llm_bridge.teachers import Teacher, Teachers

os.environ.setdefault("HF_HUB_OFFLINE", "1")

HORIZONS = [0, 1, 2, 4, 8, 16, 32]
# theory section 2's prefix-bias table: (p, A_k, w, H*)
SPEC_ROWS = [([.9, .9], [[.9, .1], [.1, .9]], [.5, .5], 4.301),
             ([.9, .9], [[.8, .2], [.2, .8]], [.5, .5], 9.847),
             ([.99, .8], [[.8, .2], [.2, .8]], [.5, .5], 13.40),
             ([.9, .9], [[.8, .2], [.2, .8]], [.8, .2], 15.80)]


def bridge_of(machine, weights, ends=()):
    return Teachers([Teacher(TabularLM(machine, k), name=f"t{k}") for k in range(machine.K)], weights,
                    vocab_size=machine.n, end_token_ids=ends)


def one_question(machine):
    return [dict(id="q", prompt_ids=[machine.n], correct_ids=[0], incorrect_ids=[1])]


@pytest.mark.parametrize("p, cont, w, h_star", SPEC_ROWS)
def test_spec_prefix_bias_rows_recover_h_star(p, cont, w, h_star):
    """On theory section 2's machine D(H) = H (-ln rho) exactly (the continuation factors are deterministic), so
    the study recovers H* to float32 precision, with a zero-width interval, and the flip is measured
    at the first horizon above H*."""
    t = examples.prefix_bias_teachers(p, cont)
    q, h = flip_horizon_study(bridge_of(t, w), one_question(t), HORIZONS, 8, seed=0)
    row = q.iloc[0]
    assert abs(row.h_star - h_star) < 0.01 * (1 + (h_star > 10))           # the table's rounding
    exact = exact_flip_horizon(t, w, HORIZONS)
    assert abs(row.h_star - exact["h_star"]) < 1e-4 * exact["h_star"]
    assert row.h_star_lo - 1e-4 * h_star <= exact["h_star"] <= row.h_star_hi + 1e-4 * h_star
    assert row.teachers_prefer_correct and row.margin == pytest.approx(exact["margin"], abs=1e-5)
    # measured flips: exactly the horizons above H*
    np.testing.assert_array_equal(h.flip.to_numpy(), np.array(HORIZONS) > h_star)
    assert row.first_flip == min(x for x in HORIZONS if x > h_star)
    assert exact["first_flip"] == int(np.floor(h_star)) + 1


def test_exact_flip_horizon_reads_up_to_h_max_and_returns_the_exact_gap():
    """Theory section 2's machine (H* = 4.301, D(H) = H x drift exactly): the first flip is 5 when h_max >= 5 and
    -1 (none) below; h_max defaults to 4 max(horizons); bad input is refused naming it."""
    p, cont, w, h_star = SPEC_ROWS[0]
    t = examples.prefix_bias_teachers(p, cont)
    exact = exact_flip_horizon(t, w, [0, 1, 2])
    np.testing.assert_allclose(exact["gap"], np.array([0, 1, 2]) * exact["drift"], rtol=1e-9, atol=1e-12)
    assert exact["h_star"] == pytest.approx(h_star, abs=5e-4) and exact["first_flip"] == 5      # default h_max 8
    assert exact_flip_horizon(t, w, [0, 1])["first_flip"] == -1                                  # default h_max 4
    assert exact_flip_horizon(t, w, [0, 1], h_max=5)["first_flip"] == 5
    assert exact_flip_horizon(t, w, [0, 1, 2], h_max=4)["first_flip"] == -1
    assert exact_flip_horizon(t, w, [0, 1, 8], h_max=4)["first_flip"] == -1      # gaps past h_max are not read
    with pytest.raises(ValueError, match=r"^h_max = -1 must be an integer >= 0$"):
        exact_flip_horizon(t, w, [0, 1], h_max=-1)

    def rewired(option, to):
        next_state = t.next_state.copy()
        next_state[t.start, option] = to
        return ag.FiniteStateTeachers(next_state, t.log_probs, t.start)
    for option in (0, 1):                                     # either option ending the response is refused
        with pytest.raises(ValueError, match=r"^the options must not end the response$"):
            exact_flip_horizon(rewired(option, -1), w, [0, 1])
        # an option leading to state 0 is a state like any
        assert np.isfinite(exact_flip_horizon(rewired(option, 0), w, [0, 1])["margin"])


def test_random_family_intervals_cover_the_exact_drift():
    """Random prefix machines (3 teachers, sigma = 1): the 95% interval of the drift (hence of H*)
    covers the exact through-origin drift of aggregation's D(H). 10 machines, N = 300: require >= 8
    covers (P(Bin(10, .95) <= 7) = 0.012); the errors are unbiased against their standard errors."""
    covers, z = 0, []
    for seed in range(10):
        t = examples.random_prefix_teachers(seed, 1.0)
        w = np.full(3, 1 / 3)
        q, _ = flip_horizon_study(bridge_of(t, w), one_question(t), HORIZONS, 300, seed=100 + seed)
        row, exact = q.iloc[0], exact_flip_horizon(t, w, HORIZONS)
        covers += row.drift_lo <= exact["drift"] <= row.drift_hi
        z.append((row.drift - exact["drift"]) / row.drift_se)
        # H* interval and drift interval say the same thing
        if exact["drift"] > 0:
            assert (row.h_star_lo <= exact["h_star"] <= row.h_star_hi) == (row.drift_lo <= exact["drift"] <= row.drift_hi)
        assert row.margin == pytest.approx(exact["margin"], abs=1e-5)
    assert covers >= 8, (covers, z)
    assert abs(np.mean(z)) < 4 / np.sqrt(10), z


def test_partition_curve_matches_the_single_horizon_estimate():
    rng = np.random.default_rng(0)
    f = -rng.gamma(1.0, 0.3, size=(500, 8))
    c = log_partition_curve(f, [0, 2, 8])
    L = np.concatenate([np.zeros((500, 1)), np.cumsum(f, 1)], 1)[:, [0, 2, 8]]
    est, se, ess = log_mean_exp_stats(L)
    np.testing.assert_allclose(c.log_partition, est)
    np.testing.assert_allclose(np.sqrt(np.diag(c.cov)), se, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(c.ess, ess)
    assert c.cov[1, 2] > 0                              # the same rollouts: positively correlated
    with pytest.raises(ValueError, match="exceeds"):
        log_partition_curve(f, [9])
    assert c.horizons == (0, 2, 8)


def test_partition_curve_is_shift_invariant_and_needs_two_samples_for_a_covariance():
    """ln z <= 0 can be large and negative: the covariance of ln Z_hat is that of W / mean W, unchanged
    when every continuation's L_H moves by the same amount, however far (no underflow at any H); one
    sample has no covariance (inf), two have the sample covariance with N - 1."""
    rng = np.random.default_rng(1)
    f = -rng.gamma(1.0, 0.3, size=(40, 8))
    c, far = log_partition_curve(f, [1, 4, 8]), log_partition_curve(f - 300.0, [1, 4, 8])
    np.testing.assert_allclose(far.cov, c.cov, rtol=1e-9)
    np.testing.assert_allclose(far.log_partition, c.log_partition - 300.0 * np.array([1, 4, 8]), rtol=1e-12)
    assert np.isinf(log_partition_curve(f[:1], [1, 4]).cov).all()
    two = f[:2].cumsum(1)[:, [0, 3]]
    r = np.exp(two) / np.exp(two).mean(0)
    np.testing.assert_allclose(log_partition_curve(f[:2], [1, 4]).cov, np.cov(r.T, ddof=1) / 2, rtol=1e-12)


def test_fit_drift_known_answers():
    H = np.array([0, 1, 2, 4, 8])
    exact = fit_drift(H, 0.25 * H, np.zeros((5, 5)), margin=2.0)
    assert exact.drift == pytest.approx(0.25) and exact.h_star == pytest.approx(8.0)
    assert exact.h_star_lo == exact.h_star_hi == pytest.approx(8.0)
    # drift against the correct answer: never flips
    neg = fit_drift(H, -0.1 * H, np.zeros((5, 5)), margin=2.0)
    assert neg.h_star == neg.h_star_lo == neg.h_star_hi == np.inf
    # an interval reaching 0: finite lower end, infinite upper end; se = sqrt(c' S c)
    S = np.diag([0.0, 0.01, 0.01, 0.04, 0.16])
    wide = fit_drift(H, 0.02 * H, S, margin=1.0)
    c = H / np.sum(H ** 2)
    assert wide.drift_se == pytest.approx(np.sqrt(c @ S @ c))
    assert wide.drift_lo < 0 < wide.drift_hi and wide.h_star_hi == np.inf
    assert wide.h_star_lo == pytest.approx(1.0 / wide.drift_hi)
    assert fit_drift(H, 0.25 * H, np.zeros((5, 5)), margin=-1.0).h_star == 0.0
    # a margin of 0 or below: the pool already prefers I, every H* is 0 (also where the interval reaches 0),
    # and the drift keeps its fit
    for margin in (0.0, -1.0):
        at0 = fit_drift(H, 0.02 * H, S, margin=margin)
        assert (at0.drift, at0.drift_se, at0.drift_lo, at0.drift_hi) == (wide.drift, wide.drift_se, wide.drift_lo,
                                                                         wide.drift_hi)
        assert (at0.h_star, at0.h_star_lo, at0.h_star_hi) == (0.0, 0.0, 0.0)
    assert fit_drift([0, 1], [0.0, 0.5], np.zeros((2, 2)), margin=1.0).h_star == pytest.approx(2.0)   # H = 1 counts
    for bad, message in ((dict(horizons=[0, 0]), r"^horizons must be >= 0 with at least one > 0$"),
                         (dict(horizons=[-1, 1]), r"^horizons must be >= 0 with at least one > 0$"),
                         (dict(gap=[0, np.nan]), r"^gap\[1\] is not finite$"),
                         (dict(gap=[0.0, 0.1, 0.2]), r"^horizons \(2,\), gap \(3,\) and gap_cov \(2, 2\) do not match$"),
                         (dict(gap_cov=np.zeros((3, 3))), r"^horizons \(2,\), gap \(2,\) and gap_cov \(3, 3\) do not match$"),
                         (dict(margin=np.inf), r"^margin = inf is not finite$")):
        args = dict(horizons=[0, 1], gap=[0.0, 0.1], gap_cov=np.zeros((2, 2)), margin=1.0)
        args.update(bad)
        with pytest.raises(ValueError, match=message):
            fit_drift(**args)


def test_torch_pool_equals_aggregation():
    rng = np.random.default_rng(1)
    lp = [torch.log_softmax(torch.from_numpy(rng.normal(0, 2, (5, 30))), -1) for _ in range(3)]
    w = np.array([0.5, 0.3, 0.2])
    log_l, log_z = torch_geometric_pool(lp, w)
    ref_l, ref_z = ag.log_geometric_pool(np.stack([x.numpy() for x in lp]), w, return_log_partition=True)
    np.testing.assert_allclose(log_l.numpy(), ref_l, atol=1e-12)
    np.testing.assert_allclose(log_z.numpy(), ref_z, atol=1e-12)


def tiny_llama(vocab=64):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.integration
def test_batched_left_padded_factors_equal_full_recomputation():
    """Tiny Llama, two personas of different template lengths plus a temperature twin sharing a
    forward pass, contexts of different lengths (left padding), several batches: each sampled path's
    factors ln z equal those of a fresh unpadded forward pass along the path, until its end token."""
    model = tiny_llama()
    bridge = Teachers([Teacher(model, [1, 2, 3], name="a"), Teacher(model, [4], temperature=1.7, name="b"),
                       Teacher(model, [4], temperature=0.6, name="c")], [0.5, 0.3, 0.2], 60, end_token_ids=[0, 7])
    contexts = [[9, 10, 11], [12], [13, 14, 15, 16, 17, 18], [20, 21]]
    f, tok = sample_log_factors_many(bridge, contexts, 6, 5, np.random.default_rng(3), max_rows=10,
                                     return_tokens=True)
    assert f.shape == (4, 5, 6) and (tok >= 0).any()
    for c, ctx in enumerate(contexts):
        for i in range(5):
            path = []
            for a in tok[c, i]:
                path.append(int(a))
                if a in (0, 7):
                    break
            n_factors = len(path) if path and path[-1] in (0, 7) else len(path) + 1
            lz = []
            for h in range(n_factors):
                lp, _ = zip(*[bridge.prefill(k, ctx + path[:h]) for k in range(3)])
                lz.append(ag.log_partition(np.stack([x.double().numpy() for x in lp]), bridge.weights))
            np.testing.assert_allclose(f[c, i, :len(lz)], lz, atol=2e-5)
            np.testing.assert_array_equal(f[c, i, len(lz):], 0.0)


def test_study_bad_input():
    t = examples.prefix_bias_teachers([.9, .9], [[.9, .1], [.1, .9]])
    b = bridge_of(t, [.5, .5])
    q = one_question(t)
    with pytest.raises(ValueError, match="horizon > 0"):
        flip_horizon_study(b, q, [0], 4, 0)
    with pytest.raises(ValueError, match="n_samples"):
        flip_horizon_study(b, q, [0, 2], 1, 0)
    with pytest.raises(ValueError, match="incorrect_ids"):
        flip_horizon_study(b, [dict(q[0], incorrect_ids=[])], [0, 2], 4, 0)
    with pytest.raises(ValueError, match="questions is empty"):
        flip_horizon_study(b, [], [0, 2], 4, 0)
    with pytest.raises(ValueError, match=r"contexts\[1\]"):
        sample_log_factors_many(b, [[t.n], [t.n, 99]], 2, 2, np.random.default_rng(0))


def test_option_scores_from_the_shared_prefill_equal_the_exact_path_analysis():
    """The study scores the options from the same (template-cached, left-padded) forward pass that
    starts the sampling: teacher, l, mixture and pooled margins equal partition.option_log_probs'
    independent unpadded passes, on a tiny Llama (two personas, a temperature twin, a weight-0 teacher)
    and on TabularLM teachers."""
    from llm_bridge.partition import option_log_probs
    model = tiny_llama()
    llama = Teachers([Teacher(model, [1, 2, 3], name="a"), Teacher(model, [4], temperature=1.7, name="b"),
                      Teacher(model, [4], temperature=0.6, name="c"), Teacher(model, [5, 6], name="d")],
                     [0.5, 0.3, 0.2, 0.0], 60, end_token_ids=[0, 7])
    t = examples.random_teachers(3, 12, 6, seed=3, end_prob=0.05)
    tab = Teachers([Teacher(TabularLM(t, k, pad=2), name=f"t{k}") for k in range(3)], [0.5, 0.3, 0.2], vocab_size=t.n)
    cases = [(llama, [dict(id="x", prompt_ids=[9, 10, 11], correct_ids=[12, 13], incorrect_ids=[14]),
                      dict(id="y", prompt_ids=[20], correct_ids=[21], incorrect_ids=[22, 23, 24])]),
             (tab, [dict(id="z", prompt_ids=[t.n], correct_ids=[1, 2], incorrect_ids=[3])])]
    for bridge, questions in cases:
        q, _ = flip_horizon_study(bridge, questions, [0, 2], 3, seed=0, max_rows=3)
        for (_, row), spec in zip(q.iterrows(), questions):
            ex = option_log_probs(bridge, spec["prompt_ids"], [spec["correct_ids"], spec["incorrect_ids"]])
            for k, name in enumerate(bridge.names):
                assert row[f"margin_{name}"] == pytest.approx(ex["teacher"][k, 0] - ex["teacher"][k, 1], abs=2e-5)
            assert row.margin == pytest.approx(ex["reward"][0] - ex["reward"][1], abs=2e-5)
            assert row.margin_local == pytest.approx(ex["local_geometric"][0] - ex["local_geometric"][1], abs=2e-5)
            assert row.margin_mixture == pytest.approx(ex["mixture"][0] - ex["mixture"][1], abs=2e-5)


# ------------------------------------------------------------------------------------------------
# power, measured flips, saturation, the heavy-tail correction, the positive control (issue 30)
# ------------------------------------------------------------------------------------------------
def test_detectable_drift_has_80_percent_power_at_its_best_horizon():
    """(m + (z + z_0.8) se_H) / H minimised over H > 0: at that drift, D(H) ~ N(drift H, se_H) puts g's
    upper bound m - D + z se below 0 with probability 0.8 exactly; H = 0 never counts."""
    from scipy.stats import norm
    H, se = [0, 4, 16], [0.0, 0.1, 0.2]
    d, h = detectable_drift(1.0, se, H)
    assert h == 16 and d == pytest.approx((1.0 + (1.959963984540054 + 0.8416212335729143) * 0.2) / 16, rel=1e-12)
    assert norm.sf((1.0 + 1.959963984540054 * 0.2 - d * 16) / 0.2) == pytest.approx(0.8, abs=1e-9)
    assert Z_80 == pytest.approx(norm.ppf(0.8), abs=1e-12)
    # a horizon with a large s.e. is not the best even though it is longer
    assert detectable_drift(1.0, [0.0, 0.01, 5.0], [0, 8, 16]) == (pytest.approx((1 + 2.801585218 * 0.01) / 8), 8)
    assert detectable_drift(0.5, [0.0, 0.0], [0, 2]) == (pytest.approx(0.25), 2)          # exact: m / H
    assert detectable_drift(1.0, [0.0, np.inf], [0, 4]) == (np.inf, -1)
    assert detectable_drift(1.0, [0.0, 5.0], [1, 2]) == (1.0, 1)          # H = 1 counts: m / 1 beats 7.5
    assert detectable_drift(1.0, [0, 1], [2, 4]) == (pytest.approx(0.5), 2)  # integer s.e. (exact at H = 2)
    for bad, msg in ((dict(gap_se=[0.1]), "do not match"), (dict(gap_se=[-0.1, 0.1]), r"^gap_se must be >= 0$"),
                     (dict(horizons=[-1, 4]), r"^horizons must be >= 0$"), (dict(margin=np.nan), "not finite")):
        args = dict(margin=1.0, gap_se=[0.1, 0.1], horizons=[0, 4])
        args.update(bad)
        with pytest.raises(ValueError, match=msg):
            detectable_drift(**args)


def test_first_significant_flip_and_running_share():
    hs = [0, 1, 2, 4, 8]
    assert first_significant_flip(hs, [1.0, 0.0, 0.2, -0.1, -2.0], True) == 4          # 0 is not below 0
    assert first_significant_flip(hs, [1.0, 0.0, 0.2, -0.1, -2.0], False) == -1
    assert first_significant_flip(hs, [1.0, 0.5, 0.2, 0.1, 0.0], True) == -1
    with pytest.raises(ValueError, match="does not match"):
        first_significant_flip(hs, [1.0, 0.5], True)
    assert not is_saturating(0.5, 1.0) and is_saturating(0.49, 1.0) and is_saturating(1.0, 0.49)
    assert is_saturating(0.6, 0.9, share=0.7) and not is_saturating(0.6, 0.9, share=0.6)
    end = 9
    tokens = np.array([[5, end, 3], [5, 5, 5], [end, -1, -1], [5, 5, end]])      # (N, H_max - 1) for H_max = 4
    np.testing.assert_allclose(running_share(tokens, [end], [0, 1, 2, 3, 4]), [1, 1, 0.75, 0.5, 0.25])
    np.testing.assert_allclose(running_share(tokens, [], [0, 4]), [1, 1])
    np.testing.assert_allclose(running_share(tokens[:, :0], [end], [0, 1]), [1, 1])     # H_max = 1: no tokens
    with pytest.raises(ValueError, match=r"^horizon 5 needs 4 tokens per continuation, got 3$"):
        running_share(tokens, [end], [0, 5])
    with pytest.raises(ValueError, match=r"^tokens must be \(n_samples, horizon - 1\), got shape \(4,\)$"):
        running_share(tokens[:, 0], [end], [0, 1])


def llm_bridge_of(seed, sigma=0.3):
    t = examples.llm_like_prefix_teachers(seed, sigma)
    return t, bridge_of(t, [0.5, 0.5], ends=[t.n - 1])


def test_llm_like_family_is_in_the_real_regime():
    """24 tokens, an end token that ends the response, T8's premise (every teacher prefers C), and
    continuation weights heavy-tailed enough that ESS at N = 8 falls well below 8 on some machines."""
    t = examples.llm_like_prefix_teachers(0)
    assert t.n == 24 and (t.next_state[1:, 23] == -1).all() and (t.next_state[1:, :23] >= 0).all()
    assert (t.log_probs[:, 0, 0] > t.log_probs[:, 0, 1]).all()
    np.testing.assert_allclose(np.exp(t.log_probs).sum(-1), 1.0, atol=1e-12)
    with pytest.raises(ValueError, match="n = 3"):
        examples.llm_like_prefix_teachers(0, n=3)
    ess = []
    for seed in range(6):
        t, b = llm_bridge_of(seed)
        f = sample_log_factors_many(b, [[t.n, 0], [t.n, 1]], 16, 8, np.random.default_rng(seed))
        ess += [log_mean_exp_stats(np.cumsum(x, 1))[2].min() for x in f]
    assert min(ess) < 4 and np.median(ess) > 3, ess


def test_ess_floor_extends_the_plain_samples_until_the_floor():
    """sample_contexts with a floor: each context's samples double (n, 2n, 4n, ... <= max) until its ESS
    at every H reaches the floor, and the first n samples are those of the plain call with the same seed."""
    t, b = llm_bridge_of(3, sigma=0.6)
    contexts = [[t.n, 0], [t.n, 1], [t.n, 0, 5]]
    plain = sample_log_factors_many(b, contexts, 12, 4, np.random.default_rng(7))
    out = sample_contexts(b, contexts, 12, 4, np.random.default_rng(7), ess_floor=3.5, max_samples=32)
    sizes = [len(f) for f, _ in out]
    assert max(sizes) > 4, sizes                     # sigma = 0.6: some context is below the floor at N = 4
    for (f, tok), p in zip(out, plain):
        np.testing.assert_array_equal(f[:4], p)
        assert len(f) in (4, 8, 16, 32) and tok.shape == (len(f), 11)
        ess = log_mean_exp_stats(np.cumsum(f, 1))[2].min()
        assert ess >= 3.5 or len(f) == 32
        if len(f) > 4:                               # it was below the floor with half as many
            assert log_mean_exp_stats(np.cumsum(f[:len(f) // 2], 1))[2].min() < 3.5
    with pytest.raises(ValueError, match="ess_floor"):
        sample_contexts(b, contexts, 4, 4, np.random.default_rng(0), ess_floor=0)
    with pytest.raises(ValueError, match="max_samples"):
        sample_contexts(b, contexts, 4, 4, np.random.default_rng(0), ess_floor=2, max_samples=3)
    # a floor no context can reach: every context doubles up to the default cap 8 N, even at H = 1
    # (where the one factor is deterministic: ESS = N exactly)
    capped = sample_contexts(b, contexts, 1, 2, np.random.default_rng(0), ess_floor=1e9)
    assert [len(f) for f, _ in capped] == [16, 16, 16]
    assert [len(f) for f, _ in sample_contexts(b, contexts, 1, 2, np.random.default_rng(0))] == [2, 2, 2]
    other = bridge_of(t, [0.3, 0.7], ends=[t.n - 1])
    twin_message = r"^after_correct must have the teachers' K, weights, vocabulary and end tokens$"
    with pytest.raises(ValueError, match=twin_message):
        sample_contexts(b, contexts, 4, 4, np.random.default_rng(0), after_correct=other)
    with pytest.raises(ValueError, match=twin_message):                      # the end tokens alone differ
        sample_contexts(b, contexts, 4, 4, np.random.default_rng(0), after_correct=bridge_of(t, [0.5, 0.5]))


def test_sample_contexts_checks_its_arguments_and_passes_them_on(monkeypatch):
    """The refusals name their argument; one sample and a floor below 1 are legitimate; the floor is not
    checked at H = 0 (nothing to weigh) and an ESS exactly at the floor is not below it (ESS = N at H = 1);
    with ``after_correct`` the even contexts are continued by it, the odd ones by the teachers, and
    max_rows reaches the sampler (default 512)."""
    from llm_bridge import horizon
    t, b = llm_bridge_of(3)
    contexts = [[t.n, 0], [t.n, 1], [t.n, 0, 5]]
    rng = np.random.default_rng(0)
    for kwargs, message in ((dict(n_samples=0), r"^n_samples = 0 must be an integer >= 1$"),
                            (dict(ess_floor=2, max_samples=3), r"^max_samples = 3 must be an integer >= 4$")):
        with pytest.raises(ValueError, match=message):
            sample_contexts(b, contexts, 4, **dict(dict(n_samples=4, rng=rng), **kwargs))
    assert [len(f) for f, _ in sample_contexts(b, contexts, 2, 1, rng)] == [1, 1, 1]
    assert [len(f) for f, _ in sample_contexts(b, contexts, 2, 2, rng, ess_floor=0.5)] == [2, 2, 2]
    assert [f.shape for f, _ in sample_contexts(b, contexts, 0, 2, rng, ess_floor=2.0)] == [(2, 0)] * 3
    assert [len(f) for f, _ in sample_contexts(b, contexts, 1, 2, rng, ess_floor=2.0)] == [2, 2, 2]
    calls = []

    def fake(src, ctxs, h, n, rng_, max_rows=512, return_tokens=False):
        calls.append((src, [tuple(c) for c in ctxs], max_rows))
        return [np.zeros((n, h))] * len(ctxs), [np.zeros((n, max(h - 1, 0)), dtype=int)] * len(ctxs)
    monkeypatch.setattr(horizon, "sample_log_factors_many", fake)
    twin = bridge_of(t, [0.5, 0.5], ends=[t.n - 1])
    four = contexts + [[t.n, 1, 5]]
    sample_contexts(b, four, 3, 2, rng, max_rows=7, after_correct=twin)
    assert [(src is twin, c, rows) for src, c, rows in calls] == [
        (False, [tuple(four[1]), tuple(four[3])], 7), (True, [tuple(four[0]), tuple(four[2])], 7)]
    calls.clear()
    sample_contexts(b, four, 3, 2, rng)
    assert [(src is b, len(c), rows) for src, c, rows in calls] == [(True, 4, 512)]

    def one_heavy_row(src, ctxs, h, n, rng_, max_rows=512, return_tokens=False):
        # the context ending in C gets one row of weight 1 and n - 1 of weight e^-50 per call (ESS = calls)
        calls.append((src, [tuple(c) for c in ctxs], n))
        f = np.array([[np.full(h, -50.0 * (i > 0 and c[-1] == 0)) for i in range(n)] for c in ctxs])
        return f, np.zeros((len(ctxs), n, max(h - 1, 0)), dtype=int)
    monkeypatch.setattr(horizon, "sample_log_factors_many", one_heavy_row)
    calls.clear()
    out = sample_contexts(b, contexts[:2], 3, 2, rng, ess_floor=1.5, after_correct=twin)
    assert [len(f) for f, _ in out] == [4, 2]              # only the even context (C, continued by the twin) grows
    assert [(src is twin, c, n) for src, c, n in calls] == [(False, [tuple(contexts[1])], 2),
                                                            (True, [tuple(contexts[0])], 2),
                                                            (True, [tuple(contexts[0])], 2)]


def tempered(row, t2):
    x = np.log(np.asarray(row)) / t2
    return np.exp(x - np.logaddexp.reduce(x))


@pytest.mark.parametrize("t2", [2.0, 1.25])
def test_positive_control_flips_at_the_exact_first_flip(t2):
    """The positive control on TabularLM teachers: two identical teachers (theory section 2's machine, the same
    row after C and after I), the second one's logits divided by T2 after C only (``after_correct``).
    The options are scored by the unchanged teachers (the control's start row differs and must not
    count); D(H) = H (-ln rho) exactly, so the study recovers the exact H* and flips first at the first
    measured horizon above it; without the change there is no gap and no flip."""
    row = [0.94, 0.02, 0.02, 0.02]
    base = examples.prefix_bias_teachers([.6, .6], [row, row], row)
    control = examples.prefix_bias_teachers([.7, .8], [row, tempered(row, t2)], row)
    w = [0.5, 0.5]
    q = one_question(base)
    res, h = flip_horizon_study(bridge_of(base, w), q, HORIZONS, 4, seed=0, after_correct=bridge_of(control, w))
    r = res.iloc[0]
    m = exact_flip_horizon(base, w, HORIZONS)["margin"]
    drift = exact_flip_horizon(control, w, HORIZONS)["drift"]
    assert r.margin == pytest.approx(np.log(1.5), abs=1e-6) and m == pytest.approx(np.log(1.5))
    assert r.drift == pytest.approx(drift, rel=1e-4) and drift > 0
    h_star = m / drift
    assert r.h_star == pytest.approx(h_star, rel=1e-4)
    expected = next((x for x in HORIZONS if x > h_star), -1)
    assert r.first_flip == expected and r.flip == (expected > 0)
    np.testing.assert_array_equal(h.flip.to_numpy(), np.array(HORIZONS) > h_star)
    if t2 == 2.0:
        assert expected == 8                         # H* = 7.0: measured at H = 8
    else:
        assert expected == -1 and h_star > 32        # too weak for H <= 32
    plain, _ = flip_horizon_study(bridge_of(base, w), q, HORIZONS, 4, seed=0)
    assert abs(plain.drift.iloc[0]) < 1e-6 and not plain.flip.iloc[0]


def test_saturating_fits_report_no_extrapolated_h_star():
    """With an end token, D(H) plateaus once most continuations have ended: the study then reports no
    H* (NaN) and flags the fit saturating, exactly when fewer than half of the continuations of C or I
    still run at the largest H; without end tokens every continuation runs and H* is reported."""
    seen = set()
    for seed, end_logit in [(0, 2.0), (1, -4.0), (2, 0.0), (3, -2.0)]:
        t = examples.llm_like_prefix_teachers(seed, 0.3, end_logit=end_logit)
        q, h = flip_horizon_study(bridge_of(t, [0.5, 0.5], ends=[t.n - 1]), one_question(t), [0, 2, 8], 16, seed=seed)
        r, top = q.iloc[0], h.iloc[-1]
        assert r.running_correct == top.running_correct and r.running_incorrect == top.running_incorrect
        assert r.saturating == (min(top.running_correct, top.running_incorrect) < 0.5)
        assert np.isnan(r.h_star) == r.saturating and np.isnan(r.h_star_lo) == r.saturating
        assert np.isfinite(r.drift) and r.detectable_drift > 0
        seen.add(r.saturating)
        if end_logit > 1:                      # 88% end at every step: nothing runs to H = 8
            assert r.saturating and top.running_correct < 0.2
        q2, h2 = flip_horizon_study(bridge_of(t, [0.5, 0.5]), one_question(t), [0, 2, 8], 16, seed=seed)
        assert not q2.saturating.iloc[0] and (h2.running_correct == 1).all() and not np.isnan(q2.h_star.iloc[0])
    assert seen == {True, False}


def test_study_columns_agree_with_the_library_functions():
    """On LLM-like machines with the ESS floor: samples per option as drawn, ess_min the smallest ESS of
    either option at any H, g's interval m - D +- z se, the flags and the first flip from the upper
    bound, the detectable drift from the measured s.e., and the corrected study extends the plain one."""
    for seed in range(4):
        t, b = llm_bridge_of(seed, sigma=0.6)
        q = one_question(t)
        res, h = flip_horizon_study(b, q, [0, 1, 2, 4, 8], 4, seed=seed, ess_floor=3.5, max_samples=16)
        r = res.iloc[0]
        assert r.samples_correct in (4, 8, 16) and r.samples_incorrect in (4, 8, 16)
        assert r.ess_min == pytest.approx(min(h.ess_correct.min(), h.ess_incorrect.min()))
        assert r.ess_min >= 3.5 or 16 in (r.samples_correct, r.samples_incorrect)
        np.testing.assert_allclose(h.margin_g, r.margin - h.gap, atol=1e-12)
        np.testing.assert_allclose(h.margin_g_hi, h.margin_g + Z_95 * h.gap_se, atol=1e-12)
        np.testing.assert_allclose(h.margin_g_lo, h.margin_g - Z_95 * h.gap_se, atol=1e-12)
        np.testing.assert_array_equal(h.flip, r.teachers_prefer_correct & (h.margin_g_hi < 0))
        assert r.first_flip == first_significant_flip([0, 1, 2, 4, 8], h.margin_g_hi, r.teachers_prefer_correct)
        assert r.flip == (r.first_flip >= 0)
        d, dh = detectable_drift(r.margin, h.gap_se, [0, 1, 2, 4, 8])
        assert (r.detectable_drift, r.detectable_horizon) == (pytest.approx(d), dh)
        plain, _ = flip_horizon_study(b, q, [0, 1, 2, 4, 8], 4, seed=seed)
        assert plain.samples_correct.iloc[0] == 4 and plain.margin.iloc[0] == pytest.approx(r.margin, abs=1e-12)
        if r.samples_correct == r.samples_incorrect == 4:          # no extra samples: the same estimate
            assert plain.drift.iloc[0] == pytest.approx(r.drift, abs=1e-12)


# ------------------------------------------------------------------------------------------------
# every column of the study, rebuilt from the library functions on the same draws
# ------------------------------------------------------------------------------------------------
def sharpened_after_correct(machine, t2, n_states=8):
    """An LLM-like machine whose second teacher is sharpened (logits / t2) in the correct option's
    region only (states 1..n_states): a positive control with a drift, on noisy continuations."""
    lp = machine.log_probs.copy()
    rows = lp[1, 1:1 + n_states] / t2
    lp[1, 1:1 + n_states] = rows - np.logaddexp.reduce(rows, axis=-1, keepdims=True)
    return ag.FiniteStateTeachers(machine.next_state, lp)


def expected_study(bridge, questions, hs, n, seed, z, **sampling):
    """flip_horizon_study's two tables rebuilt from the library functions on the same draws: the plain
    study samples every context together with the option scores; with ``sampling`` (sample_contexts'
    options) the options are scored at H = 0 (no draws) and the contexts then sampled with the same
    generator. Every teacher weight is positive here."""
    keys = ("correct_ids", "incorrect_ids")
    contexts = [list(q["prompt_ids"]) + list(q[k]) for q in questions for k in keys]
    last = [len(q[k]) for q in questions for k in keys]
    rng = np.random.default_rng(seed)
    if sampling:
        _, scores = sample_log_factors_many(bridge, contexts, 0, 1, rng, score_last=last)
        drawn = sample_contexts(bridge, contexts, max(hs), n, rng, **sampling)
    else:
        f, tok, scores = sample_log_factors_many(bridge, contexts, max(hs), n, rng, return_tokens=True,
                                                 score_last=last)
        drawn = list(zip(f, tok))
    q_rows, h_rows = [], []
    for i, q in enumerate(questions):
        margins = scores[2 * i][0].sum(1) - scores[2 * i + 1][0].sum(1)
        m, prefer = float(bridge.weights @ margins), bool((margins > 0).all())
        (fc, tc), (fi, ti) = drawn[2 * i], drawn[2 * i + 1]
        cc, ci = log_partition_curve(fc, hs), log_partition_curve(fi, hs)
        rc, ri = running_share(tc, bridge.end_token_ids, hs), running_share(ti, bridge.end_token_ids, hs)
        gap, cov = ci.log_partition - cc.log_partition, ci.cov + cc.cov
        se = np.sqrt(np.diag(cov))
        for j, h in enumerate(hs):
            row = dict(id=q["id"], horizon=h, gap=gap[j], gap_se=se[j], gap_lo=gap[j] - z * se[j],
                       gap_hi=gap[j] + z * se[j], margin_g=m - gap[j], margin_g_lo=m - gap[j] - z * se[j],
                       margin_g_hi=m - gap[j] + z * se[j], flip=prefer and m - gap[j] + z * se[j] < 0,
                       flip_point=prefer and m - gap[j] < 0)
            for name, c, r in (("correct", cc, rc), ("incorrect", ci, ri)):
                s = np.sqrt(c.cov[j, j])
                row.update({f"log_z_{name}": c.log_partition[j], f"log_z_{name}_lo": c.log_partition[j] - z * s,
                            f"log_z_{name}_hi": c.log_partition[j] + z * s, f"ess_{name}": c.ess[j],
                            f"running_{name}": r[j]})
            h_rows.append(row)
        fit = fit_drift(hs, gap, cov, m, z)
        saturating = min(rc[-1], ri[-1]) < 0.5
        first = first_significant_flip(hs, m - gap + z * se, prefer)
        need, need_h = detectable_drift(m, se, hs, z)
        q_rows.append(dict(id=q["id"], margin=m, teachers_prefer_correct=prefer, drift=fit.drift,
                           drift_se=fit.drift_se, drift_lo=fit.drift_lo, drift_hi=fit.drift_hi,
                           h_star=np.nan if saturating else fit.h_star,
                           h_star_lo=np.nan if saturating else fit.h_star_lo,
                           h_star_hi=np.nan if saturating else fit.h_star_hi, flip=first >= 0, first_flip=first,
                           detectable_drift=need, detectable_horizon=need_h, samples_correct=len(fc),
                           samples_incorrect=len(fi), ess_min=min(cc.ess.min(), ci.ess.min()),
                           running_correct=rc[-1], running_incorrect=ri[-1], saturating=saturating,
                           tokens_correct=len(q["correct_ids"]), tokens_incorrect=len(q["incorrect_ids"])))
    return pd.DataFrame(q_rows), pd.DataFrame(h_rows)


def test_every_study_column_equals_the_library_functions_on_the_same_draws():
    """Both tables, column by column, for two questions (the second with a two-token correct option),
    a z other than 1.96, the plain study, the ESS floor with its cap, and the noisy positive control
    (continued by ``after_correct``). The draws are chosen so that the checks can fail: some question's
    first flip differs from where g's *lower* bound first crosses 0, and some H* differs from its bounds."""
    hs, z = [0, 1, 2, 3, 4, 6, 8], 1.5
    seen_lower_first, seen_interval = False, False
    for seed, t2, sampling in [(2, None, {}), (3, None, dict(ess_floor=1e9, max_samples=8)),
                               (1, 3.0, {}), (5, 3.0, dict(ess_floor=3.5, max_samples=16))]:
        t = examples.llm_like_prefix_teachers(seed, 0.6 if t2 is None else 0.3)
        b = bridge_of(t, [0.5, 0.5], ends=[t.n - 1])
        questions = [dict(id="a", prompt_ids=[t.n], correct_ids=[0], incorrect_ids=[1]),
                     dict(id="b", prompt_ids=[t.n], correct_ids=[0, 5], incorrect_ids=[1])]
        if t2 is not None:
            sampling = dict(sampling, after_correct=bridge_of(sharpened_after_correct(t, t2), [0.5, 0.5],
                                                              ends=[t.n - 1]))
        res, h = flip_horizon_study(b, questions, hs, 4, seed=seed, z=z, **sampling)
        want_q, want_h = expected_study(b, questions, hs, 4, seed, z, **sampling)
        pd.testing.assert_frame_equal(h[list(want_h.columns)], want_h, check_dtype=False, rtol=1e-12, atol=1e-12)
        pd.testing.assert_frame_equal(res[list(want_q.columns)], want_q, check_dtype=False, rtol=1e-12, atol=1e-12)
        assert list(res.tokens_correct) == [1, 2] and list(h.id) == ["a"] * len(hs) + ["b"] * len(hs)
        if sampling.get("ess_floor") == 1e9:                     # a floor no context reaches: the cap
            assert (res.samples_correct == 8).all() and (res.samples_incorrect == 8).all()
        for (_, r), (_, g) in zip(res.iterrows(), h.groupby("id", sort=False)):
            lower = next((x for x, v in zip(hs, g.margin_g_lo) if v < 0), -1)
            seen_lower_first |= r.teachers_prefer_correct and lower != r.first_flip
            seen_interval |= bool(np.isfinite(r.h_star) and r.h_star_lo < r.h_star < r.h_star_hi)
    assert seen_lower_first and seen_interval


def test_study_samples_with_its_generator_and_rows_and_scores_without_draws(monkeypatch):
    """The study's calls to the sampler: the plain study draws every context once, with the option
    scores, from ``default_rng(seed)`` and ``max_rows`` (default 512); with the floor or a control the
    options are scored at H = 0 with one row per context (no draws, nothing to repeat), and every call
    uses the same generator and max_rows. A second run with the same seed gives the same tables."""
    from llm_bridge import horizon
    t = examples.llm_like_prefix_teachers(0)
    b = bridge_of(t, [0.5, 0.5], ends=[t.n - 1])
    q = one_question(t)
    first, _ = flip_horizon_study(b, q, [0, 2, 4], 3, seed=11)
    again, _ = flip_horizon_study(b, q, [0, 2, 4], 3, seed=11)
    pd.testing.assert_frame_equal(first, again)
    calls = []
    real = horizon.sample_log_factors_many

    def spy(src, ctxs, h, n, rng, max_rows=512, return_tokens=False, score_last=None):
        calls.append((h, n, rng, max_rows, score_last is not None))
        return real(src, ctxs, h, n, rng, max_rows, return_tokens, score_last)
    monkeypatch.setattr(horizon, "sample_log_factors_many", spy)
    flip_horizon_study(b, q, [0, 2, 4], 3, seed=11)
    assert [c[:2] + c[3:] for c in calls] == [(4, 3, 512, True)] and isinstance(calls[0][2], np.random.Generator)
    for extra in (dict(ess_floor=0.5), dict(after_correct=b)):
        calls.clear()
        flip_horizon_study(b, q, [0, 2, 4], 3, seed=11, max_rows=7, **extra)
        assert [c[:2] + c[3:] for c in calls] == [(0, 1, 7, True)] + [(4, 3, 7, False)] * (len(calls) - 1)
        assert len(calls) == 2 + ("after_correct" in extra)
        assert all(c[2] is calls[0][2] for c in calls) and isinstance(calls[0][2], np.random.Generator)
    calls.clear()
    flip_horizon_study(b, q, [0, 2, 4], 3, seed=11, max_rows=7)
    assert [c[3] for c in calls] == [7]


def test_a_teacher_indifferent_between_the_options_makes_the_question_ineligible():
    """T8's premise is that every teacher strictly prefers C: a teacher with p(C) = p(I) exactly (margin 0)
    makes the question ineligible, so neither flips nor point flips are counted though g's margin
    falls below 0."""
    t = examples.prefix_bias_teachers([.9, .5], [[.9, .1], [.1, .9]])
    res, h = flip_horizon_study(bridge_of(t, [.5, .5]), one_question(t), [0, 4, 16], 2, seed=0)
    assert res.margin_t1.iloc[0] == 0.0 and res.margin_t0.iloc[0] > 0
    assert not res.teachers_prefer_correct.iloc[0] and (h.margin_g_hi < 0).any()
    assert not h.flip.any() and not h.flip_point.any() and res.first_flip.iloc[0] == -1


def test_study_refusals_word_for_word_and_the_smallest_legitimate_study():
    t = examples.prefix_bias_teachers([.9, .9], [[.9, .1], [.1, .9]])
    b = bridge_of(t, [.5, .5])
    q = one_question(t)
    for args, message in (((q, [0], 4), r"^horizons needs one horizon > 0 to fit a drift$"),
                          ((q, [0, 2], 1), r"^n_samples = 1 must be an integer >= 2$"),
                          (([], [0, 2], 4), r"^questions is empty$")):
        with pytest.raises(ValueError, match=message):
            flip_horizon_study(b, *args, seed=0)
    res, h = flip_horizon_study(b, q, [0, 1], 2, seed=0)                    # H = 1 and two samples suffice
    assert list(h.horizon) == [0, 1] and res.samples_correct.iloc[0] == 2
    assert res.drift.iloc[0] == pytest.approx(exact_flip_horizon(t, [.5, .5], [0, 1])["drift"], abs=1e-5)


def test_a_weight_zero_teacher_that_rules_out_an_option_leaves_the_pool_finite():
    """A teacher with weight 0 is reported (its margin) but pools nothing: here it gives I probability 0
    (TabularLM's finite stand-in for -inf, as a real model's logits are finite: a margin of about 1e30),
    and g's margin, the mixture's and the drift stay those of the other teacher alone."""
    t = examples.prefix_bias_teachers([.9, 1.0], [[.8, .2], [.5, .5]])
    res, _ = flip_horizon_study(bridge_of(t, [1.0, 0.0]), one_question(t), [0, 2, 4], 2, seed=0)
    alone = examples.prefix_bias_teachers([.9], [[.8, .2]])
    ref, _ = flip_horizon_study(bridge_of(alone, [1.0]), one_question(alone), [0, 2, 4], 2, seed=0)
    r = res.iloc[0]
    assert r.margin_t1 > 1e29 and r.margin == pytest.approx(np.log(9), abs=1e-6)
    for col in ("margin", "margin_mixture", "margin_local", "drift", "h_star"):
        assert r[col] == pytest.approx(ref[col].iloc[0], rel=1e-9), col


# ------------------------------------------------------------------------------------------------
# the estimator a server can serve: the teachers' own samples with importance weights (issue 43)
# ------------------------------------------------------------------------------------------------
def test_proposal_log_weights_equal_the_machine_along_every_sample():
    """Each sample's L(H) = sum_k w_k ln p_k(c_<=H) - ln sum_j (n_j / N) p_j(c_<=H), recomputed here from the
    machine's own tables along the sample's states; the split n_j = (3, 2, 2) of N = 7 over three teachers
    (the first takes the remainder), each teacher's samples its own; tokens end at an end token."""
    from llm_bridge.backend import InProcess
    from llm_bridge.partition import proposal_log_weights
    t = examples.llm_like_prefix_teachers(1, 0.3)
    t3 = examples.random_prefix_teachers(2, 1.0)
    for machine, w, ends, counts in ((t, [0.5, 0.5], [t.n - 1], (4, 3)), (t3, [0.2, 0.5, 0.3], [], (3, 2, 2))):
        bridge = bridge_of(machine, w, ends)
        H = 6
        contexts = [[machine.n, 0], [machine.n, 1]]
        got = proposal_log_weights(InProcess(bridge), w, contexts, H, 7, [np.random.default_rng(s) for s in (1, 2)])
        log_q = np.log(np.array(counts) / 7)
        for ctx, (inc, tokens) in zip(contexts, got):
            assert inc.shape == (7, H) and tokens.shape == (7, H - 1)
            L = np.concatenate([np.zeros((7, 1)), np.cumsum(inc, axis=1)], axis=1)
            for i in range(7):                  # L(0 .. H - 1): the H - 1 tokens returned
                s, S = int(machine.next_state[machine.start, ctx[1]]), np.zeros((machine.K, H))
                for h, a in enumerate(tokens[i]):
                    S[:, h + 1] = S[:, h] + (machine.log_probs[:, s, a] if a >= 0 else 0.0)
                    s = int(machine.next_state[s, a]) if a >= 0 else s
                want = np.asarray(w) @ S - logsumexp(log_q[:, None] + S, axis=0)
                np.testing.assert_allclose(L[i, :H], want, atol=2e-5)
                ended = np.isin(tokens[i], ends)
                if ended.any():                  # after an end token nothing is added and nothing returned
                    e = int(np.argmax(ended)) + 1
                    assert np.all(inc[i, e:] == 0) and np.all(tokens[i, e:] == -1)
            assert all(np.isin(tokens[:, 0], np.flatnonzero(machine.log_probs[:, int(machine.next_state[
                machine.start, ctx[1]])].max(axis=0) > -np.inf)))


def test_a_context_that_ends_the_response_is_not_sampled():
    """A context whose last token ends the response has nothing after it: L = 0 at every horizon, tokens all
    -1, and no generation or scoring request for it (the other context's rows, and its samples, unchanged)."""
    from llm_bridge.backend import InProcess
    from llm_bridge.partition import proposal_log_weights
    machine = examples.llm_like_prefix_teachers(1, 0.3)
    end, w = machine.n - 1, [0.5, 0.5]

    class Counting(InProcess):
        rows = 0

        def generate(self, rows, max_tokens, rngs):
            Counting.rows += len(rows)
            return super().generate(rows, max_tokens, rngs)
    backend = Counting(bridge_of(machine, w, [end]))
    got = proposal_log_weights(backend, w, [[machine.n, 0], [machine.n, 0, end]], 5, 6,
                               [np.random.default_rng(s) for s in (1, 2)])
    assert Counting.rows == 6
    assert np.all(got[1][0] == 0) and got[1][0].shape == (6, 5) and np.all(got[1][1] == -1)
    alone, = proposal_log_weights(InProcess(bridge_of(machine, w, [end])), w, [[machine.n, 0]], 5, 6,
                                  [np.random.default_rng(1)])
    np.testing.assert_array_equal(got[0][0], alone[0])


def test_proposal_estimate_covers_the_exact_partition():
    """ln Z_H(v) from the teachers' own samples against aggregation's exact recursion, on 8 LLM-like machines
    (an end token, heavy tails) and 8 random ones, N = 400, at H = 1 .. 8: the 95% intervals cover (>= 13 of 16 at
    the largest H: P(Bin(16, .95) <= 12) = 0.007) and the z-scores are centred."""
    from llm_bridge.backend import InProcess
    from llm_bridge.partition import proposal_log_weights
    H, covers, zs = 8, 0, []
    for i in range(16):
        machine = examples.llm_like_prefix_teachers(i, 0.3) if i < 8 else examples.random_prefix_teachers(i, 1.0)
        w = [1 / machine.K] * machine.K
        bridge = bridge_of(machine, w, [machine.n - 1] if i < 8 else ())
        (inc, _), = proposal_log_weights(InProcess(bridge), w, [[machine.n, 0]], H, 400, [np.random.default_rng(i)])
        L = np.concatenate([np.zeros((400, 1)), np.cumsum(inc, axis=1)], axis=1)
        est, se, _ = log_mean_exp_stats(L)
        table = ag.sequence_log_partition(machine, np.asarray(w), H)
        exact = table[H - np.arange(H + 1), int(machine.next_state[machine.start, 0])]
        assert est[0] == 0 and exact[0] == pytest.approx(0, abs=1e-12)
        z = (est[-1] - exact[-1]) / se[-1]
        covers += abs(z) <= Z_95
        zs.append(z)
    assert covers >= 13, zs
    assert abs(np.mean(zs)) < 4 / np.sqrt(16), zs


def test_backend_study_recovers_the_exact_drift_and_margin():
    """flip_horizon_study_backend on the in-process backend of 10 random machines: margins exact, the drift's
    95% interval covers the exact drift on >= 8 of 10 (P(Bin(10, .95) <= 7) = 0.012), l's margin NaN."""
    from llm_bridge.backend import InProcess
    from llm_bridge.horizon import flip_horizon_study_backend
    hs, covers, z = [0, 1, 2, 4, 8, 16], 0, []
    for seed in range(10):
        t = examples.random_prefix_teachers(seed, 1.0)
        w = np.full(3, 1 / 3)
        q, h = flip_horizon_study_backend(InProcess(bridge_of(t, w)), w, one_question(t), hs, 300, seed)
        row, exact = q.iloc[0], exact_flip_horizon(t, w, hs, h_max=256)
        assert row.margin == pytest.approx(exact["margin"], abs=1e-5) and np.isnan(row.margin_local)
        assert row.margin_t0 == pytest.approx(t.log_probs[0, t.start, 0] - t.log_probs[0, t.start, 1], abs=1e-5)
        covers += row.drift_lo <= exact["drift"] <= row.drift_hi
        z.append((row.drift - exact["drift"]) / row.drift_se)
        np.testing.assert_allclose(h.gap_hi - h.gap, Z_95 * h.gap_se)
    assert covers >= 8, z
    assert abs(np.mean(z)) < 4 / np.sqrt(10), z


def test_backend_study_continues_after_the_correct_option_with_the_twin():
    """after_correct: the uC contexts are continued (and weighed) by a second backend, as the positive control
    does. The twin is the same machine with 2.5x the teachers' disagreement after C; the exact gap is then
    ln Z_H(uI) of the machine minus ln Z_H(uC) of the twin (aggregation's recursion on each), and the drift's
    interval covers that drift on >= 8 of 10 machines (the machine's own drift, which differs by > 10 s.e. on
    average, would not be covered); a twin of another vocabulary is refused."""
    from llm_bridge.backend import InProcess
    from llm_bridge.horizon import fit_drift, flip_horizon_study_backend
    hs, top, covers, far = [0, 1, 2, 4, 8, 16], 16, 0, []
    for seed in range(10):
        t, twin = examples.random_prefix_teachers(seed, 1.0), examples.random_prefix_teachers(seed, 2.5)
        w = np.full(3, 1 / 3)
        q, _ = flip_horizon_study_backend(InProcess(bridge_of(t, w)), w, one_question(t), hs, 300, seed,
                                          after_correct=InProcess(bridge_of(twin, w)))
        sc, si = (int(t.next_state[t.start, a]) for a in (0, 1))
        z_t, z_twin = (ag.sequence_log_partition(m, w, top) for m in (t, twin))
        gap = np.array([z_t[top - h, si] - z_twin[top - h, sc] for h in hs])
        row = q.iloc[0]
        drift = fit_drift(hs, gap, np.zeros((len(hs), len(hs))), row.margin).drift
        covers += row.drift_lo <= drift <= row.drift_hi
        far.append(abs(drift - exact_flip_horizon(t, w, hs)["drift"]) / row.drift_se)
    assert covers >= 8 and np.mean(far) > 10, far
    small = examples.random_prefix_teachers(0, 1.0, n_states=2)
    other = Teachers([Teacher(TabularLM(small, k)) for k in range(3)], [1 / 3] * 3, vocab_size=small.n + 1)
    with pytest.raises(ValueError, match="after_correct must have the backend's"):
        flip_horizon_study_backend(InProcess(bridge_of(small, [1 / 3] * 3)), [1 / 3] * 3, one_question(small),
                                   [0, 2], 6, 0, after_correct=InProcess(other))


def test_backend_study_refuses_bad_input():
    from llm_bridge.backend import InProcess
    from llm_bridge.horizon import flip_horizon_study_backend
    t = examples.random_prefix_teachers(0, 1.0)
    backend, w = InProcess(bridge_of(t, [1 / 3] * 3)), [1 / 3] * 3
    for kw, message in ((dict(horizons=[0]), "one horizon > 0"), (dict(n_samples=2), "n_samples"),
                        (dict(weights=[0.5, 0.5, 0.5]), "weights"), (dict(seed=[1, 2]), "seed has 2 entries"),
                        (dict(questions=[]), "questions is empty")):
        args = dict(weights=w, questions=one_question(t), horizons=[0, 2], n_samples=6, seed=0) | kw
        with pytest.raises(ValueError, match=message):
            flip_horizon_study_backend(backend, **args)


# ------------------------------------------------------------------------------------------------
# the gap interval's coverage on a pool of continuations (issue 44, item 10)
# ------------------------------------------------------------------------------------------------
def test_resampled_coverage_is_nominal_on_light_tails_and_fails_on_heavy_ones():
    """On pools whose log-weights are normal with a small s.d. (the delta method's home) the interval covers the
    pool's gap in 95% of replicates (2,000: within 0.93-0.97) and its lower end passes the truth in ~2.5% (<= 4.5%);
    on a heavy-tailed uC pool (one weight in 1,000 carries ~95% of Z) an N = 8 replicate almost never sees it, so
    ln Z(uC) is underestimated with a tiny s.e.: coverage below 10% and nearly every replicate is a false flip;
    a constant pool is exact (se = 0, covered, no false flip)."""
    from llm_bridge.horizon import resampled_coverage
    rng = np.random.default_rng(0)
    light = [rng.normal(-2.0, 0.3, size=(4000, 3)), rng.normal(-1.5, 0.3, size=(4000, 3))]
    r = resampled_coverage(*light, 64, 2000, np.random.default_rng(1))
    assert 0.93 <= r["coverage"] <= 0.97 and r["false_flip"] <= 0.045, r
    want = logsumexp(light[1][:, -1]) - logsumexp(light[0][:, -1])          # the pool's own gap (equal sizes)
    assert r["truth"] == pytest.approx(want, abs=1e-12) and r["samples"] == 64
    heavy = np.full((1000, 3), -10.0)
    heavy[0] = 0.0
    r = resampled_coverage(heavy, np.full((1000, 3), -10.0), 8, 500, np.random.default_rng(2))
    assert r["coverage"] < 0.1 and r["false_flip"] > 0.9, r
    assert 8 <= r["samples"] <= 32 * 0.5 + 8 * 0.5 + 1e-9     # uC doubles (ESS ~1) only when it draws the big one
    const = resampled_coverage(np.full((5, 2), -1.0), np.full((5, 2), -3.0), 4, 10, np.random.default_rng(3))
    assert const == dict(coverage=1.0, false_flip=0.0, samples=4.0, truth=pytest.approx(-2.0), replicates=10,
                         se_median=0.0, planted_flip=0.0)


def test_the_planted_arm_flips_at_the_stated_power_where_the_interval_holds():
    """The control arm planted at the detectable gap D = m + (z + z_80) se: on light-tailed pools, where the
    delta method holds, the rule flags it in 80% of 4,000 replicates (0.77-0.83: the binomial s.d. is 0.006,
    plus the s.e.'s own spread) and a planted gap computed with z_80 = 0 (half the power: the gap at
    m + z se) is flagged in ~50%; the replicates are those of the coverage (the same generator gives the same
    coverage); on the heavy-tailed pool the stated power is not what one gets (the s.e. is ~0 where uC's big
    weight is missed, so nearly every replicate flags)."""
    from llm_bridge.horizon import resampled_coverage
    rng = np.random.default_rng(0)
    light = [rng.normal(-2.0, 0.3, size=(4000, 3)), rng.normal(-1.5, 0.3, size=(4000, 3))]
    r = resampled_coverage(*light, 64, 4000, np.random.default_rng(5))
    assert 0.77 <= r["planted_flip"] <= 0.83, r
    half = resampled_coverage(*light, 64, 4000, np.random.default_rng(5), z_power=0.0)
    assert 0.46 <= half["planted_flip"] <= 0.54 and half["coverage"] == r["coverage"], half
    se = [log_mean_exp_stats(p[:, -1])[1] * np.sqrt(4000 / 64) for p in light]
    assert r["se_median"] == pytest.approx(np.hypot(*se), rel=0.1)
    heavy = np.full((1000, 3), -10.0)
    heavy[0] = 0.0
    r = resampled_coverage(heavy, np.full((1000, 3), -10.0), 8, 500, np.random.default_rng(2))
    assert r["planted_flip"] > 0.9, r


def test_resampled_coverage_doubles_like_the_study_and_refuses_bad_input():
    """A draw whose ESS is below ess_share x N gets as many samples again, up to max_factor x N. A pool of two
    weights e^30 apart: a draw's ESS is its number of large weights (or its size when it has none), so the
    expected samples used follow from the binomial law of that number, enumerated here; bad shapes are
    ValueErrors."""
    from math import comb
    from llm_bridge.horizon import resampled_coverage
    pool = np.array([[0.0], [-30.0]])

    def expected(n, c, cap):          # samples used by a draw of size n holding c large weights
        ess = c if c else n
        if ess >= 0.75 * 4 or 2 * n > cap:
            return n
        return sum(comb(n, j) / 2 ** n * expected(2 * n, c + j, cap) for j in range(n + 1))
    want = sum(comb(4, c) / 16 * expected(4, c, 16) for c in range(5))
    r = resampled_coverage(pool, pool, 4, 4000, np.random.default_rng(0), ess_share=0.75, max_factor=4)
    assert 4 < want < 16 and r["samples"] == pytest.approx(want, abs=0.35), (r, want)
    r1 = resampled_coverage(pool, pool, 4, 200, np.random.default_rng(0), ess_share=0.75, max_factor=1)
    assert r1["samples"] == 4
    # an ESS exactly at the floor is enough (equal weights: ESS = N), and the smallest N and count are taken
    even = resampled_coverage(np.zeros((3, 1)), np.zeros((3, 1)), 2, 1, np.random.default_rng(0), ess_share=1.0)
    assert even["samples"] == 2 and even["replicates"] == 1 and even["coverage"] == 1.0
    z = np.zeros((3, 2))
    for args, message in (((np.zeros((1, 2)), z), "pool_correct must be"), ((z, np.zeros(3)), "pool_incorrect must be"),
                          ((z, np.zeros((3, 1))), "^the two pools need the same horizons$")):
        with pytest.raises(ValueError, match=message):
            resampled_coverage(*args, 4, 5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="n_samples = 1 must"):
        resampled_coverage(z, z, 1, 5, np.random.default_rng(0))
    with pytest.raises(ValueError, match="replicates = 0 must"):
        resampled_coverage(z, z, 2, 0, np.random.default_rng(0))
