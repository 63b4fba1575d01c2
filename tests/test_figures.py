"""The figures' content, read from the Figure objects built from the --quick CSVs: panels, curves,
theory lines, labels and sizes (a PNG's byte count says nothing about what is drawn)."""

import importlib

import numpy as np
import pandas as pd
import pytest
from matplotlib.collections import PolyCollection

import figures
from conftest import ROOT
from figure_checks import TAB10, colours_used, states_its_claim, text_problems
from figures import mechanisms as fm
from figures import regret as fr
from figures.style import TWO_COLUMNS
from learners import names

pytestmark = pytest.mark.integration


def data_lines(ax):
    """Lines with at least two points (curves), not markers-only or reference lines."""
    return [ln for ln in ax.lines if len(ln.get_xdata()) > 2 and ln.get_linestyle() not in ("None", "")]


def texts(ax):
    return [t.get_text() for t in ax.texts]


@pytest.fixture(scope="module")
def regret_csvs(quick_regret):
    return tuple(pd.read_csv(quick_regret / f"{n}.csv") for n in ("regret", "summary", "theory"))


def test_regret_figures_have_a_curve_per_learner_and_the_theory(regret_csvs):
    regret, summary, theory = regret_csvs
    for experiment in ("offpolicy-tabular", "offpolicy-sequence", "onpolicy-tabular", "onpolicy-sequence"):
        fig = fr.regret_figure(regret, summary, theory, experiment)
        assert fig.get_size_inches()[0] == pytest.approx(TWO_COLUMNS)
        panels = [ax for ax in fig.axes if ax.get_visible() and ax.axison]
        assert len(panels) == len(fr._panels(regret[regret.experiment == experiment], experiment))
        learners = set(regret[regret.experiment == experiment].learner)
        legend = {t.get_text() for leg in fig.legends for t in leg.get_texts()}
        assert learners <= legend
        for ax in panels:
            assert ax.get_xscale() == "log" and ax.get_xlabel() == "round t" and ax.get_ylabel().endswith("(nats)")
            assert ax.get_title()
            # one band per learner (95% interval of the mean) when there are seeds to average
            n_curves = len([ln for ln in data_lines(ax) if ln.get_color() not in ("black",)])
            assert n_curves >= len([t for t in texts(ax) if t])
            # every learner has its growth line: 'c ln T (theory)', 'bounded' or 'T^p'
            assert all(("ln T" in t) or t == "bounded" or "T^" in t for t in texts(ax))
    # the closed forms are drawn: constant-sequence panels carry the exact markers and Shtarkov's curve
    fig = fr.regret_figure(regret, summary, theory, "offpolicy-tabular")
    constant = [ax for ax in fig.axes if ax.get_title().startswith("constant sequence")]
    assert constant and all(any(ln.get_marker() == "o" for ln in ax.lines) for ax in constant)
    assert all(any(ln.get_linestyle() == ":" for ln in ax.lines) for ax in constant)
    # the legends print growth, never a noise slope such as 5.63e-09
    fig = fr.regret_figure(regret, summary, theory, "onpolicy-tabular")
    full = [ax for ax in fig.axes if ax.get_title().startswith("full feedback")]
    assert full and all("bounded" in texts(ax) for ax in full)
    assert not any("e-0" in t for ax in fig.axes for t in texts(ax))


def test_function_approximation_figure(regret_csvs):
    regret, summary, _ = regret_csvs
    fig = fr.function_approx_figure(regret, summary)
    top_off, top_on, low_off, low_on = fig.axes[:4]
    assert [ax.get_yscale() for ax in fig.axes[:4]] == ["log"] * 4
    off = [names.LOGLINEAR[m] for m in ("OGD", "ONS", "Newton-style", "constant step", "frozen")]
    on = [names.LOGLINEAR[m] for m in ("OGD-RKL", "frozen-RKL")]
    assert len(data_lines(top_off)) == len(off) and len(data_lines(top_on)) == len(on)
    assert len(data_lines(low_off)) == len(off)
    assert low_off.get_ylabel().startswith("R_t / ln t")
    assert not any("Hazan" in t.get_text() for leg in fig.legends for t in leg.get_texts())   # no bound drawn
    assert any("T^" in t for t in texts(top_off))                                             # a linear learner


def test_mechanism_figures(quick_mechanisms):
    df = {name: pd.read_csv(quick_mechanisms / f"{name}.csv") for name in fm.FIGURES}
    fig = fm.low_prob_learned_figure(df["low-prob"])
    assert fig.get_size_inches()[0] == pytest.approx(TWO_COLUMNS)
    learned = [ax for ax in fig.axes if ax.get_title().startswith("vetoing teacher")]
    assert len(learned) == 5
    for ax in learned:
        assert len(data_lines(ax)) >= 3                        # the three learners
        assert sum(isinstance(c, PolyCollection) for c in ax.collections) == 3     # their bands
        assert len([ln for ln in ax.lines if ln.get_color() == "black"]) == 2      # exact A and G
    const = [ax for ax in fig.axes if ax.get_title().startswith("FTL's regret constant")][0]
    assert len(data_lines(const)) == 3                         # the formula of each family
    legend = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("drawn i.i.d." in t and "pair" in t for t in legend) and any("alternating" in t for t in legend)
    fig = fm.prefix_bias_figure(df["prefix-bias"])
    rows = [ax for ax in fig.axes if ax.get_title().startswith("theory row")]
    assert len(rows) == 4 and all(len(data_lines(ax)) >= 3 for ax in rows)
    fig = fm.confident_expert_learned_figure(df["confident-expert"])
    vocab = [ax for ax in fig.axes if ax.get_title().startswith("vocabulary")]
    assert len(vocab) == 3 and all(len(data_lines(ax)) == 3 for ax in vocab)   # KT, FTL and own rollout
    assert {names.KT, names.FTL, names.ROLLOUT} <= {t.get_text() for leg in fig.legends for t in leg.get_texts()}
    for f in (fm.confident_expert_figure(df["confident-expert"]), fm.low_prob_figure(df["low-prob"]),
              fm.prefix_bias_learned_figure(df["prefix-bias"])):
        assert f.get_size_inches()[0] == pytest.approx(TWO_COLUMNS)
        assert all(ax.get_xlabel() for ax in f.axes if ax.axison)


def test_rebuild_writes_every_figure_from_the_csvs(quick_regret, quick_mechanisms, tmp_path):
    paths = figures.rebuild(str(quick_mechanisms), fig_dir=str(tmp_path))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == sorted(
        f"mechanism_{n}{s}.png" for n in fm.FIGURES for s in ("", "_learned"))
    from PIL import Image
    width, _ = Image.open(paths[0]).size
    assert width == pytest.approx(TWO_COLUMNS * figures.DPI, abs=2)
    assert set(figures.results_folders(str(quick_regret.parent))) >= {str(quick_regret), str(quick_mechanisms)}


# ------------------------------------------------------------------------------------------------
# every figure of every quick run: text inside the canvas and apart, a stated claim, Okabe-Ito colours
# ------------------------------------------------------------------------------------------------
SIM_FIGURES = {"regret": "regret", "mechanisms": "mechanisms", "rollout_spectrum": "spectrum",
               "estimators": "estimators", "forgetting": "forgetting", "rlvr": "rlvr"}
_BUILT = {}


@pytest.fixture
def quick_figures(experiment, quick_run):
    """{stem: Figure} built once from one sim's quick-run CSVs by its figure module's figures_from (the
    tests take ``experiment`` as their parameter, so conftest puts them in that sim's xdist group)."""
    if experiment not in _BUILT:
        module = importlib.import_module(f"figures.{SIM_FIGURES[experiment]}")
        _BUILT[experiment] = module.figures_from(str(quick_run(experiment)))
    assert _BUILT[experiment], experiment
    return _BUILT[experiment]


each_sim = pytest.mark.parametrize("experiment", list(SIM_FIGURES))


@each_sim
def test_every_figure_keeps_its_text_inside_the_canvas_and_apart(quick_figures):
    problems = [f"{stem}: {p}" for stem, fig in quick_figures.items() for p in text_problems(fig)]
    if problems:
        pytest.fail("\n".join(problems[:20]), pytrace=False)


@each_sim
def test_every_figure_states_its_claim(quick_figures):
    for stem, fig in quick_figures.items():
        assert states_its_claim(fig), stem


@each_sim
def test_every_figure_uses_the_colour_blind_safe_palette(quick_figures):
    for stem, fig in quick_figures.items():
        assert not colours_used(fig) & TAB10, (stem, colours_used(fig) & TAB10)

