"""The LLM-bridge figures (figures.topk, figures.probe, figures.flip_horizon, figures.diagnosis) pass the checks
every figure of the project passes (tests/figure_checks.py, issue 34): text inside the canvas and apart, a
suptitle stating the claim, Okabe-Ito colours. Built without a model: from the committed CSVs of
docs/flip_horizon and docs/diagnose, from the tables the studies' own pure functions make of random logits
(sims.topk_bias.bias_table, llm_bridge.probes.margins, llm_bridge.diagnosis.diagnose_path), and from synthetic
tables with the columns the figures read -- long ids and configuration names, many configurations, NaN and
infinite values, empty tables where the figure draws one."""

import json
import warnings

import numpy as np
import pandas as pd
import pytest

from conftest import ROOT
from figure_checks import TAB10, colours_used, states_its_claim, text_problems
import figures
from figures import diagnosis as fd
from figures import flip_horizon as ff
from figures import probe as fp
from figures import topk as ft
from sims.flip_horizon import CONFIG_NAMES

FLIP = ROOT / "docs" / "flip_horizon"
DIAGNOSE = ROOT / "docs" / "diagnose"


def write(folder, **tables):
    """Each DataFrame as ``<name>.csv`` under ``folder`` (made); returns the folder as a str."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, df in tables.items():
        df.to_csv(folder / f"{name}.csv", index=False)
    return str(folder)


# ------------------------------------------------------------------------------------------------
# the tables
# ------------------------------------------------------------------------------------------------
def topk_table(vocab=5000, positions=12, seed=0):
    """sims/topk_bias.py's table (every k it measures, four tails, both directions) on random logits: two
    personas' perturbations of one model's. One position: NaN intervals."""
    import torch
    from sims.topk_bias import bias_table
    g = torch.Generator().manual_seed(seed)
    model = 3 * torch.randn(1, positions, vocab, generator=g)
    teacher, student = (model + 0.5 * torch.randn(1, positions, vocab, generator=g) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # a one-position std
        return bias_table(student, teacher)


def probe_margins(teachers=("concise", "teacher"), horizons=(0, 4, 16, 64), se=0.2, seed=0):
    """margins.csv of llm_bridge.probes.margins for a three-option question (option 0 correct): the teachers,
    g (with ln Z standard errors ``se``; NaN as a one-sample run gives), l and the mixture per horizon."""
    from llm_bridge.probes import margins
    rng = np.random.default_rng(seed)
    rows = []
    for h in horizons:
        for scorer in (*teachers, "geometric", "local_geometric", "mixture"):
            for option in range(3):
                rows.append(dict(horizon=h, scorer=scorer, option=option,
                                 log_score=rng.normal(-2.0 + (option == 0) - 0.02 * h, 1.0), log_partition_se=se))
    return margins(pd.DataFrame(rows), 0)


def probe_folder(folder, question=None):
    """A probe's folder: margins.csv, and summary.json with the question when there is one."""
    write(folder, margins=probe_margins())
    if question:
        (folder / "summary.json").write_text(json.dumps(dict(question=question)))
    return str(folder)


def flip_tables(configs):
    """The committed default run's flip_questions / flip_partitions (its first configuration), repeated under
    each name of ``configs``."""
    q = pd.read_csv(FLIP / "flip_questions.csv")
    p = pd.read_csv(FLIP / "flip_partitions.csv")
    first = q.config.iloc[0]
    rename = lambda df, c: df[df.config == first].assign(config=c)       # noqa: E731
    return (pd.concat([rename(q, c) for c in configs], ignore_index=True),
            pd.concat([rename(p, c) for c in configs], ignore_index=True))


END, TEMPLATE = 0, 1
TOKENS = {END: "<|im_end|>", TEMPLATE: "<|im_start|>", 2: "\n", 3: " the", 4: "Ġextraordinarily", 5: "—", 6: "",
          7: " Paris", 8: "   ", 9: "1234567890"}


def diagnosis_tables(ids=("france", "a_prompt_id_as_long_as_a_real_run_might_give_it"),
                     responses=("concise", "teacher"), length=32, vocab=40, seed=0):
    """The tables sims/diagnose.py writes, from llm_bridge.diagnosis.diagnose_path on random teachers: one
    teacher puts mass on the end and template tokens where the other vetoes them, and on odd token texts
    (empty, blank, a newline, long words); flip.csv with a measured flip, a powered bound, no finite s.e."""
    from llm_bridge.diagnosis import Thresholds, diagnose_path
    rng = np.random.default_rng(seed)
    tables = {"positions": [], "vetoes": []}
    for pid in ids:
        for resp in responses:
            logits = 2 * rng.normal(size=(2, length, vocab))
            at = rng.choice(length, size=length // 4, replace=False)
            logits[0, at, rng.choice([END, TEMPLATE, 3], size=len(at))] += 8        # teacher 0 is sure ...
            logits[1, at, :] += np.where(np.arange(vocab) < 4, -30, 0)               # ... teacher 1 vetoes
            lp = logits - np.logaddexp.reduce(logits, axis=2, keepdims=True)
            res = diagnose_path(lp, [0.5, 0.5], rng.integers(0, vocab, size=length), [END], [TEMPLATE], Thresholds(),
                                names=list(responses), decode=lambda a: TOKENS.get(a, f" word{a}"))
            for name in tables:
                df = res[name]
                df.insert(0, "response", resp)
                df.insert(0, "id", pid)
                tables[name].append(df)
    tables = {k: pd.concat(v, ignore_index=True) for k, v in tables.items()}
    n = len(ids)
    tables["flip"] = pd.DataFrame(dict(
        id=list(ids), option_source="first tokens", option_c=" Paris", option_i=" Lyon",
        margin=np.linspace(5.3, 0.2, n), teachers_prefer_correct=True,
        drift=[0.51, -0.008][:n] + [np.nan] * (n - 2), drift_lo=[0.5, -0.05][:n] + [np.nan] * (n - 2),
        drift_hi=[0.52, 0.03][:n] + [np.nan] * (n - 2), flip=[True, False][:n] + [False] * (n - 2),
        first_flip=[4, -1][:n] + [-1] * (n - 2), detectable_drift=[0.3, 0.125][:n] + [np.inf] * (n - 2),
        detectable_horizon=[8, 8][:n] + [-1] * (n - 2), horizons="0,1,2,4,8", flip_bound="(words)"))
    return tables


def diagnosis_folder(folder, **kwargs):
    """A diagnose run's folder: positions.csv, vetoes.csv and flip.csv as the script writes them."""
    return write(folder, **diagnosis_tables(**kwargs))


# ------------------------------------------------------------------------------------------------
# every figure: {case: builder(tmp_path) -> {stem: Figure}}
# ------------------------------------------------------------------------------------------------
CASES = {
    # top-k bias: the script's table; one direction only, with the NaN interval of a one-position text
    "topk": lambda tmp: ft.figures_from(write(tmp, topk_bias=topk_table())),
    "topk, forward only, one position": lambda tmp: {"topk_bias": ft.topk_bias_figure(
        topk_table(positions=1).query("kind == 'forward'"))},
    # the prefix-bias probe: titled by a long question (summary.json), untitled, many teachers with long
    # names and NaN intervals
    "probe": lambda tmp: fp.figures_from(probe_folder(tmp, "Which of these cities has been the capital of France "
                                                           "since the tenth century, give or take a few interruptions?")),
    "probe, untitled": lambda tmp: fp.figures_from(probe_folder(tmp)),
    "probe, seven teachers, NaN intervals": lambda tmp: {"probe": fp.probe_figure(probe_margins(
        teachers=[f"persona-with-a-long-name-{k}" for k in range(7)], horizons=(0, 1, 4, 16, 64, 256), se=np.nan))},
    # the flip-horizon study: the committed default run (questions, partitions, --long tables, validation); six
    # configurations of one table (the longest names), five (one panel hidden) with a long run's curves, one
    "flip horizon, committed default run": lambda tmp: ff.figures_from(str(FLIP)),
    "flip horizon, the default run's six configurations": lambda tmp: ff.figures_from(write(
        tmp, **dict(zip(("flip_questions", "flip_partitions"), flip_tables(CONFIG_NAMES))))),
    "flip horizon, five configurations and a long run of three": lambda tmp: ff.figures_from(write(
        tmp, **dict(zip(("flip_questions", "flip_partitions"), flip_tables(CONFIG_NAMES[1:]))),
        **dict(zip(("flip_long_questions", "flip_long_partitions"), flip_tables(CONFIG_NAMES[-3:]))))),
    "flip horizon, one configuration": lambda tmp: ff.figures_from(write(
        tmp, **dict(zip(("flip_questions", "flip_partitions"), flip_tables(CONFIG_NAMES[-1:]))))),
    # the diagnosis: a run's tables (long prompt ids, odd tokens, a NaN drift), responses of the most tokens
    # labelled one by one and of more (every third labelled), many prompts, the committed runs' vetoes (one
    # end veto; none) and no flip estimates
    "diagnosis": lambda tmp: fd.figures_from(diagnosis_folder(tmp)),
    "diagnosis, 90-token responses": lambda tmp: fd.figures_from(diagnosis_folder(tmp, length=90)),
    "diagnosis, 250-token responses": lambda tmp: fd.figures_from(diagnosis_folder(tmp, length=250)),
    "diagnosis, twelve prompts": lambda tmp: fd.figures_from(diagnosis_folder(
        tmp, ids=[f"prompt_{k}_{'x' * 3 * k}" for k in range(12)], responses=("storyteller", "student"))),
    "diagnosis, committed vetoes": lambda tmp: {
        f"diagnosis_vetoes_{run}": fd.veto_figure(pd.read_csv(DIAGNOSE / run / "vetoes.csv", keep_default_na=False,
                                                              na_values=[""])) for run in ("end_veto", "control")},
    "diagnosis, no flip estimates": lambda tmp: {"diagnosis_flip": fd.flip_figure(pd.DataFrame())},
}
STEMS = {"topk": {"topk_bias"}, "probe": {"probe"},
         "flip horizon, committed default run": {"flip_horizon", "flip_curves", "flip_long_curves", "flip_validation"},
         "flip horizon, five configurations and a long run of three": {"flip_horizon", "flip_curves", "flip_long_curves"},
         "diagnosis": {"diagnosis_strips", "diagnosis_vetoes", "diagnosis_flip"}}

_BUILT = {}


@pytest.fixture(params=list(CASES))
def bridge_figures(request, tmp_path):
    """{stem: Figure} of one case, built once per session."""
    case = request.param
    if case not in _BUILT:
        _BUILT[case] = CASES[case](tmp_path)
    assert _BUILT[case] and set(_BUILT[case]) == STEMS.get(case, set(_BUILT[case])), case
    return _BUILT[case]


def test_the_cases_build_every_figure():
    """Together the cases build every figure the four modules' figures_from make."""
    assert set().union(*STEMS.values()) == {"topk_bias", "probe", "flip_horizon", "flip_curves", "flip_long_curves",
                                            "flip_validation", "diagnosis_strips", "diagnosis_vetoes", "diagnosis_flip"}


def test_every_figure_keeps_its_text_inside_the_canvas_and_apart(bridge_figures):
    problems = [f"{stem}: {p}" for stem, fig in bridge_figures.items() for p in text_problems(fig)]
    if problems:
        pytest.fail("\n".join(problems[:20]), pytrace=False)


def test_every_figure_states_its_claim(bridge_figures):
    for stem, fig in bridge_figures.items():
        assert states_its_claim(fig), stem


def test_every_figure_uses_the_colour_blind_safe_palette(bridge_figures):
    for stem, fig in bridge_figures.items():
        assert not colours_used(fig) & TAB10, (stem, colours_used(fig) & TAB10)


# ------------------------------------------------------------------------------------------------
# the checks themselves can fail
# ------------------------------------------------------------------------------------------------
def test_the_layout_check_can_fail():
    from figures.style import figure
    fig = figure(3.5, 2.0)
    ax = fig.subplots()
    ax.set_title("a title")
    ax.text(0.5, 1.0, "sits on the title", transform=ax.transAxes, ha="center", va="bottom")
    ax.text(1.3, 0.5, "beyond the right edge", transform=ax.transAxes)
    problems = text_problems(fig)
    assert any(p.startswith("overlap") and "a title" in p for p in problems)
    assert any(p.startswith("outside") and "beyond" in p for p in problems)
    ax.texts[-1].remove()
    ax.texts[-1].remove()
    assert text_problems(fig) == []


def test_the_claim_and_palette_checks_can_fail():
    from figures.style import BLUE, figure
    fig = figure(3.5, 2.0)
    ax = fig.subplots()
    ax.plot([0, 1], [0, 1], color=BLUE)
    ax.bar([0], [1], color=BLUE)
    assert not states_its_claim(fig) and not colours_used(fig) & TAB10
    fig.suptitle("short")
    assert not states_its_claim(fig)
    fig.suptitle("a claim of more than twenty characters")
    assert states_its_claim(fig)
    ax.plot([0, 1], [1, 0], "o")               # matplotlib's default cycle outside the house style: tab:blue
    ax.fill_between([0, 1], 0, 1, color="tab:orange")
    assert colours_used(fig) & TAB10 == {"#1f77b4", "#ff7f0e"}


def test_rebuild_skips_a_diagnosis_folder_without_its_per_position_table(tmp_path):
    """docs/diagnose/* keeps the report and vetoes.csv, not positions.csv: `python -m figures` over docs/
    must pass it by, not fail on the missing table."""
    folder = ROOT / "docs" / "diagnose" / "end_veto"
    assert (folder / "vetoes.csv").exists() and not (folder / "positions.csv").exists()
    assert figures.rebuild(str(folder), fig_dir=str(tmp_path)) == []


def test_flip_titles_count_the_positive_control_apart():
    """The suptitles count the real configurations' flips and the positive control's separately (a pooled
    count would credit the control's flips to the real teachers); a panel of one flip says 'flip'."""
    q = pd.read_csv(FLIP / "flip_questions.csv")
    e = q[q.teachers_prefer_correct]
    control = e.config.str.startswith("tempered-after-correct")
    expected = (f"{int(e[~control].flip.sum())} of {int((~control).sum())} eligible questions (positive control: "
                f"{int(e[control].flip.sum())} of {int(control.sum())})")
    figs = ff.figures_from(str(FLIP))
    for stem in ("flip_horizon", "flip_curves"):
        assert expected in figs[stem]._suptitle.get_text(), stem
    # the flagged flips that hold at 4x N (flip_confirm_questions.csv), each side counted apart
    c = pd.read_csv(FLIP / "flip_confirm_questions.csv")
    held = c.merge(e[e.flip][["config", "id"]]).assign(control=lambda x: x.config.str.startswith("tempered"))
    title = figs["flip_horizon"]._suptitle.get_text()
    assert expected in title and (f"{int(held[~held.control].flip.sum())} of them hold at 4x the samples (positive "
                                  f"control: {int(held[held.control].flip.sum())})") in title
    one = q[q.config == q.config.iloc[0]].assign(flip=False)
    one.loc[one.index[0], ["flip", "teachers_prefer_correct"]] = True
    p = pd.read_csv(FLIP / "flip_partitions.csv")
    title = ff.flip_figure(one, p[p.config == one.config.iloc[0]]).axes[0].get_title()
    assert ": 1 flip," in title
