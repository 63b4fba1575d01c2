"""sims/estimators.py: its gradients.csv and is_horizon.csv against exact values computed here by other
routes (autograd over every token, enumeration of every response), not by distillation.moments."""

import itertools
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from analysis import verdicts
from analysis.verdicts import QUICK

from harness import sizes
from sims import estimators


def _cells(experiment):
    return estimators.cells_for(sizes(estimators.SIZES, quick=True), (experiment,))


def _per_token_gradients(log_q, log_p, estimator, mode):
    """(n, n): row x = the gradient w.r.t. the student's logits of the estimator at token x, by autograd
    (loss: k(r) through ln q; reward: k(r) detached times the score ln q(x))."""
    lp = torch.as_tensor(log_p)

    def per_token(z):
        lq = torch.log_softmax(z, -1)
        r = lp - lq
        k = {"k1": -r, "k2": 0.5 * r * r, "k3": torch.expm1(r) - r}[estimator]
        return k if mode == "loss" else k.detach() * lq
    return torch.func.jacrev(per_token)(torch.as_tensor(log_q)).numpy()


@pytest.mark.parametrize("cell", _cells("gradients"), ids=lambda c: f"spread={c['spread']}")
def test_gradients_csv_against_autograd_over_every_token(cell):
    df = estimators.run_cell(cell)
    rng = np.random.default_rng(cell.seed_array()[0])
    pairs = [estimators.random_pair(rng, estimators.N_TOKENS, cell["spread"]) for _ in range(cell["pairs"])]
    for row in df.itertuples():
        lq, lp = pairs[row.pair]
        q, p = np.exp(lq), np.exp(lp)
        s = q if row.source == "student" else p
        c = q / s if row.importance else np.ones_like(q)
        g = _per_token_gradients(lq, lp, row.estimator, row.mode)          # (n, n)
        mean = (s * c) @ g
        trace = float((s * c ** 2) @ (g ** 2).sum(1) - mean @ mean)
        refs = {"rkl": q * ((lq - lp) - q @ (lq - lp)), "fkl": q - p}
        rel = {k: np.linalg.norm(mean - v) / np.linalg.norm(v) for k, v in refs.items()}
        assert row.bias_vs_rkl == pytest.approx(rel["rkl"], rel=1e-6, abs=1e-9)
        assert row.bias_vs_fkl == pytest.approx(rel["fkl"], rel=1e-6, abs=1e-9)
        assert row.cov_trace == pytest.approx(trace, rel=1e-6, abs=1e-9)
        if row.nearest == "zero":                  # a vanishing mean gradient is near neither reference
            assert np.linalg.norm(mean) < 1e-9 * min(np.linalg.norm(v) for v in refs.values())
            assert row.samples_for_10pct == np.inf
            continue
        ref = refs[row.nearest]
        assert rel[row.nearest] == min(rel.values()) and np.linalg.norm(mean) > 1e-6 * np.linalg.norm(ref)
        budget = 0.01 * ref @ ref - (mean - ref) @ (mean - ref)          # 10% root-mean-square error
        want = np.inf if budget <= 0 else max(1.0, trace / budget)
        assert row.samples_for_10pct == pytest.approx(want, rel=1e-5)


def test_is_horizon_csv_against_an_enumeration_of_every_response():
    """ln E_{y ~ p}[w(y)^2], w = prod_h q / p along the response, by listing every response of H tokens."""
    (cell,) = _cells("is-horizon")
    df = estimators.run_cell(cell)
    rng = np.random.default_rng(cell.seed_array()[0])
    next_state, log_probs = estimators._loop_machine(rng)
    log_q = np.log(rng.dirichlet(np.ones(3), size=4))
    for k, H in itertools.product(range(2), (1, 2, 4, 8)):
        total = 0.0
        for tokens in itertools.product(range(3), repeat=H):
            s, log_p_y, log_w = 0, 0.0, 0.0
            for a in tokens:
                log_p_y += log_probs[k, s, a]
                log_w += log_q[s, a] - log_probs[k, s, a]
                s = next_state[s, a]
            total += np.exp(log_p_y + 2 * log_w)
        got = df[(df.machine == 0) & (df.teacher == k) & (df.H == H)] if H in estimators.HORIZONS else None
        if got is not None:
            assert got.log_second_moment.item() == pytest.approx(np.log(total), rel=1e-10, abs=1e-12)
            assert got.per_step.item() == pytest.approx(np.log(total) / H, rel=1e-10, abs=1e-12)
            if got.mc_rel_se.item() < 0.05:     # the Monte-Carlo check, where its spread is small (w^2 is heavy-tailed)
                assert abs(got.mc_log_second_moment.item() - np.log(total)) < 5 * got.mc_rel_se.item() + 1e-3


@pytest.mark.integration
def test_importance_weight_panel_is_per_token_so_the_monte_carlo_points_are_readable(quick_run):
    from figures import estimators as fe
    out = quick_run("estimators")
    fig = fe.figures_from(str(out))["estimators"]
    panel = fig.axes[2]
    h = pd.read_csv(out / "is_horizon.csv")
    exact = h[(h.machine == 0) & (h.teacher == 0)]
    lines = [line for line in panel.get_lines() if line.get_label() == "teacher 0: exact"]
    np.testing.assert_allclose(lines[0].get_ydata(), exact.log_second_moment / exact.H)
    assert panel.get_xscale() == "log" and "per token" in panel.get_ylabel()


@pytest.mark.integration
def test_verdicts_follow_the_csvs_and_flip_when_a_gradient_identity_breaks(quick_run):
    """verdicts.csv of a quick run: theory section 4's identities hold on every pair, and each verdict follows its
    rule: a synthetic k2 loss whose expected gradient misses RKL on one pair, or a k3 no longer unbiased on
    any, turns 'reproduces' into 'under stated conditions' and 'does not reproduce'."""
    out = quick_run("estimators")
    csvs = [pd.read_csv(out / f) for f in ("values.csv", "gradients.csv", "topk.csv", "is_horizon.csv")]
    assert set(pd.read_csv(out / "verdicts.csv").verdict) == {verdicts.QUICK}      # a quick run decides nothing
    v = estimators.verdicts(*csvs).set_index("claim")
    for claim in ("k1 is unbiased for KL(q || p)", "k3 is unbiased for KL(q || p)", "k2 is biased",
                  "the k1 loss has zero expected gradient", "the k2 loss gives the RKL gradient",
                  "the k3 loss gives the FKL gradient", "the k1 reward gives the RKL gradient",
                  "the k2 loss on teacher samples is biased (RKL needs student rollouts)"):
        assert v.loc[claim, "verdict"] == "reproduces", claim
    values, gradients, topk, horizon = csvs
    k2 = (gradients.estimator == "k2") & (gradients["mode"] == "loss") & (gradients.source == "student")
    assert v.loc["the k2 loss gives the RKL gradient", "hi"] == pytest.approx(gradients[k2].bias_vs_rkl.max())
    broken = gradients.copy()
    broken.loc[broken.index[k2][0], "bias_vs_rkl"] = 0.3
    again = estimators.verdicts(values, broken, topk, horizon).set_index("claim")
    assert again.loc["the k2 loss gives the RKL gradient", "verdict"] == "mixed"      # no property separates one pair
    assert again.loc["the k2 loss gives the RKL gradient", "n_hold"] == len(gradients[k2]) - 1
    biased = values.assign(bias=np.where(values.estimator == "k3", 0.01, values.bias))
    again = estimators.verdicts(biased, gradients, topk, horizon).set_index("claim")
    assert again.loc["k3 is unbiased for KL(q || p)", "verdict"] == "does not reproduce"


def test_growth_is_a_slope_over_the_long_horizons_and_fails_without_growth():
    """The weights' growth row reads the slope of ln E[w^2] over H >= GROWTH_FROM per machine and teacher:
    a linear ln E[w^2] of slope 0.5 reproduces; a bounded one (ln E[w^2] = 5 (1 - 1 / H)), which a
    per-token reading at H = 1 would not tell apart, does not; the split of 'k3 has a smaller variance
    than k1' is per spread."""
    H = np.array(estimators.HORIZONS, dtype=float)
    frame = pd.DataFrame([dict(machine=m, teacher=k, H=h, log_second_moment=0.5 * h) for m in range(4) for k in range(2)
                          for h in H])
    slopes = estimators.growth_slopes(frame)
    assert len(slopes) == 8 and slopes.to_numpy() == pytest.approx(0.5)
    bounded = frame.assign(log_second_moment=5 * (1 - 1 / frame.H))
    assert (estimators.growth_slopes(bounded) < 1e-3).all()
    assert bounded[bounded.H == 1].log_second_moment.eq(0).all()


# ------------------------------------------------------------------------------------------------
# the verdict rows on synthetic frames (fast: the mutation run's tier)
# ------------------------------------------------------------------------------------------------
def _estimator_frames(pairs=4):
    """values, gradients, topk and is_horizon frames where every claim of estimators.verdicts holds."""
    sp = [(s, i) for s in estimators.SPREADS for i in range(pairs)]
    values = pd.DataFrame([dict(kind="token", spread=s, pair=i, estimator=e, bias=b, sd=sd)
                           for s, i in sp for e, b, sd in (("k1", 0.0, 1.0), ("k2", 0.05, 0.4), ("k3", 0.0, 0.5))])
    grads = []
    for s, i in sp:
        for est, mode, source, imp, rkl, fkl, nearest in (
                ("k1", "loss", "student", False, 1.0, 1.0, "zero"), ("k2", "loss", "student", False, 0.0, 2.0, "rkl"),
                ("k3", "loss", "student", False, 2.0, 0.0, "fkl"), ("k1", "reward", "student", False, 0.0, 2.0, "rkl"),
                ("k2", "loss", "teacher", False, 0.5, 2.0, "fkl"), ("k1", "reward", "teacher", False, 0.5, 2.0, "fkl"),
                ("k2", "loss", "teacher", True, 0.0, 2.0, "rkl"), ("k1", "reward", "teacher", True, 0.0, 2.0, "rkl")):
            grads.append(dict(spread=s, pair=i, estimator=est, mode=mode, source=source, importance=imp,
                              bias_vs_rkl=rkl, bias_vs_fkl=fkl, nearest=nearest))
    topk = pd.DataFrame([dict(spread=s, pair=i, k=k, identity_error=0.0) for s, i in sp for k in (1, 10)])
    H = np.arange(1, 129)
    horizon = pd.DataFrame([dict(machine=m, teacher=t, H=h, log_second_moment=0.5 * h) for m in range(4)
                            for t in range(2) for h in H])
    return values, pd.DataFrame(grads), topk, horizon


def _estimator_row(frames, claim, condition=""):
    v = estimators.verdicts(*frames)
    return v[v.claim.str.startswith(claim) & v.condition.str.contains(condition, regex=False)].iloc[0]


def test_estimator_verdicts_follow_their_rules_on_synthetic_pairs():
    frames = _estimator_frames()
    v = estimators.verdicts(*frames)
    assert set(v.verdict) == {"reproduces"} and (v.n_hold == v.n_decidable).all() and len(v) == 16
    assert set(estimators.verdicts(*frames, quick=True).verdict) == {QUICK}
    values, grads, topk, horizon = frames
    # k3's s.d. above k1's at the largest spread only: that spread's row fails, the others hold
    wide = values.assign(sd=np.where((values.estimator == "k3") & (values.spread == 2.0), 1.5, values.sd))
    assert _estimator_row((wide, grads, topk, horizon), "k3 has a smaller variance", "spread 2").verdict == \
        "does not reproduce"
    assert _estimator_row((wide, grads, topk, horizon), "k3 has a smaller variance", "spread 0.5").verdict == "reproduces"
    # k1 biased on one pair: a failure on one pair of 12, no spread separates it -> mixed, 11 hold
    biased = values.assign(bias=np.where((values.estimator == "k1") & (values.pair == 0) & (values.spread == 1.0),
                                         0.01, values.bias))
    row = _estimator_row((biased, grads, topk, horizon), "k1 is unbiased")
    assert (row.verdict, row.n_hold, row.n_draws) == ("mixed", 11, 12)
    assert _estimator_row((biased, grads, topk, horizon), "k3 is unbiased").verdict == "reproduces"
    # the k2 loss is read against the RKL gradient, the k3 loss against the FKL one
    swap = grads.assign(bias_vs_fkl=np.where(grads.estimator == "k2", 0.3, grads.bias_vs_fkl))
    assert _estimator_row((values, swap, topk, horizon), "the k2 loss gives").verdict == "reproduces"
    off = grads.assign(bias_vs_fkl=np.where((grads.estimator == "k3") & (grads["mode"] == "loss"), 0.3,
                                            grads.bias_vs_fkl))
    assert _estimator_row((values, off, topk, horizon), "the k3 loss gives").verdict == "does not reproduce"
    # the weighted teacher rows read the weighted runs; the unweighted ones the unweighted runs
    weights = grads.assign(bias_vs_rkl=np.where(grads.importance, 0.5, grads.bias_vs_rkl))
    assert _estimator_row((values, weights, topk, horizon), "importance weights q / p restore the k2").verdict == \
        "does not reproduce"
    assert _estimator_row((values, weights, topk, horizon), "the k2 loss on teacher samples").verdict == "reproduces"
    flat = grads.assign(nearest=np.where((grads.estimator == "k1") & (grads["mode"] == "loss"), "rkl", grads.nearest))
    assert _estimator_row((values, flat, topk, horizon), "the k1 loss has zero").verdict == "does not reproduce"
    # the top-k identity reads the largest error over k
    one_k = topk.assign(identity_error=np.where(topk.k == 10, -1e-6, 0.0))
    assert _estimator_row((values, grads, one_k, horizon), "E_q~[k3]").verdict == "does not reproduce"
    # growth: only H >= GROWTH_FROM counts (steep early, flat late: no exponential growth)
    bent = horizon.assign(log_second_moment=np.minimum(horizon.H, estimators.GROWTH_FROM) * 2.0)
    assert _estimator_row((values, grads, topk, bent), "the sequence importance weight").verdict == "does not reproduce"
    slopes = estimators.growth_slopes(horizon)
    assert len(slopes) == 8 and np.allclose(slopes, 0.5)

@pytest.mark.integration
def test_estimator_figure_has_meaningful_axes_and_no_empty_rows(quick_run):
    """Issue 34: the values panel on log axes (bias and s.d. are never negative: no negative ticks), and
    the gradient panel a full grid: every (estimator, mode) x sample source cell says what it estimates."""
    from figures import estimators as fe
    out = quick_run("estimators")
    fig = fe.figures_from(str(out))["estimators"]
    values, grid = fig.axes[:2]
    assert values.get_yscale() == "log" and values.get_xscale() == "log"
    g = pd.read_csv(out / "gradients.csv")
    cells = g.groupby(["estimator", "mode", "source", "importance"]).ngroups
    assert len(grid.texts) == cells
    assert len(grid.get_yticks()) * len(grid.get_xticks()) == cells
    assert {t.get_text().split("\n")[0] for t in grid.texts} <= {"RKL gradient", "FKL gradient", "zero gradient", "biased"}

def test_growth_slopes_fit_from_growth_from_inclusive_against_polyfit():
    """The fit takes every H >= GROWTH_FROM, the first included: a spike at H = GROWTH_FROM moves the
    slope exactly as numpy's polyfit over those horizons says (and a spike below it does not)."""
    H = np.array(sorted(set(estimators.HORIZONS) | {estimators.GROWTH_FROM, estimators.GROWTH_FROM // 2}), dtype=float)
    y = 0.3 * H + np.where(H == estimators.GROWTH_FROM, 4.0, 0.0) + np.where(H == estimators.GROWTH_FROM // 2, -9.0, 0.0)
    frame = pd.DataFrame(dict(machine=0, teacher=0, H=H, log_second_moment=y))
    keep = H >= estimators.GROWTH_FROM
    assert keep.sum() >= 3 and H[keep].min() == estimators.GROWTH_FROM
    assert estimators.growth_slopes(frame).iloc[0] == pytest.approx(np.polyfit(H[keep], y[keep], 1)[0], rel=1e-12)


# ------------------------------------------------------------------------------------------------
# the texts the verdict rows write are those of the committed default run (docs/verdicts/estimators.csv
# builds the study page and the gallery: a text the code no longer writes is a broken page)
# ------------------------------------------------------------------------------------------------
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _template(text):
    """A statistic's text with every free-standing number (counts of pairs, horizons) replaced by '#'."""
    return _NUMBER.sub("#", text)


def test_verdict_rows_write_the_claims_conditions_rules_and_statistics_of_the_committed_run():
    """Every (claim, condition) of docs/verdicts/estimators.csv in its order (the synthetic frames have
    IS_MACHINES machines, as the default run), each with the same rule (side, tolerance, unit) and the
    same statistic text up to its numbers."""
    values, grads, topk, horizon = _estimator_frames()
    horizon = pd.DataFrame([dict(machine=m, teacher=t, H=h, log_second_moment=0.5 * h)
                            for m in range(estimators.IS_MACHINES) for t in range(2) for h in estimators.HORIZONS])
    v = estimators.verdicts(values, grads, topk, horizon)
    doc = pd.read_csv(Path(__file__).resolve().parents[1] / "docs" / "verdicts" / "estimators.csv", dtype=str,
                      keep_default_na=False)
    assert list(zip(v.claim, v.condition)) == list(zip(doc.claim, doc.condition))
    assert v.rule.tolist() == doc.rule.tolist()
    assert [_template(s) for s in v.statistic] == [_template(s) for s in doc.statistic]


def test_rows_over_every_spread_state_a_spread_that_separates_and_the_growth_row_none():
    """k1 biased on every pair of spread 2 only: 'k1 is unbiased' holds under the stated condition spread
    <= 1.5 (midway between 1 and 2); the growth row has no spread: one machine without growth is 'mixed'."""
    values, grads, topk, horizon = _estimator_frames()
    biased = values.assign(bias=np.where((values.estimator == "k1") & (values.spread == 2.0), 0.01, values.bias))
    row = _estimator_row((biased, grads, topk, horizon), "k1 is unbiased")
    assert (row.verdict, row.n_hold, row.stated_condition) == ("reproduces under stated conditions", 8, "spread <= 1.5")
    flat = horizon.assign(log_second_moment=np.where(horizon.machine == 0, 5.0, horizon.log_second_moment))
    row = _estimator_row((values, grads, topk, flat), "the sequence importance weight")
    assert (row.verdict, row.n_draws, row.n_hold, row.stated_condition) == ("mixed", 8, 6, "")
