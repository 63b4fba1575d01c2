"""The prefix-bias probe's figure (theory section 6): a pure function of the margins table that the probes
write (``margins.csv``: horizon, scorer, rival, margin, margin_low, margin_high)."""

import json
import os
import textwrap

import pandas as pd

from .style import BLUE, GREEN, TWO_COLUMNS, VERMILLION, figure, paper

POOLS = {"geometric": dict(color=VERMILLION, lw=2.2, marker="o", label="sequence-level geometric g (95% CI)"),
         "local_geometric": dict(color=BLUE, lw=1.5, marker="s", label="local geometric l"),
         "mixture": dict(color=GREEN, lw=1.5, marker="^", label="sequence-level mixture")}
TEACHER_MARKERS = ("v", "D", "P", "X", "*", "h")


def claim(margins):
    """The probe's verdict in words: the first horizon where g prefers an incorrect option while every
    teacher prefers the correct one (a prefix flip, as llm_bridge.probes.summarise flags it), else none."""
    teachers = margins[~margins.scorer.isin(list(POOLS))]
    agree = teachers.groupby("horizon").margin.min() > 0
    g = margins[margins.scorer == "geometric"].set_index("horizon").margin
    flips = [h for h in sorted(g.index) if agree.get(h, False) and g[h] < 0]
    if flips:
        return f"Prefix bias: g prefers an incorrect option from H = {flips[0]} while every teacher prefers the correct one"
    return f"No prefix flip up to H = {margins.horizon.max()}: g prefers the correct option wherever every teacher does"


@paper
def probe_figure(margins, title=""):
    """Each scorer's margin ln s(correct) - max ln s(incorrect) against the horizon H; > 0 prefers
    the correct option. Teachers dashed grey (one marker each), g with its 95% band."""
    fig = figure(TWO_COLUMNS, 3.0)
    ax = fig.subplots()
    teachers = [s for s in dict.fromkeys(margins["scorer"]) if s not in POOLS]
    for j, name in enumerate(teachers):
        grp = margins[margins.scorer == name].sort_values("horizon")
        ax.plot(grp["horizon"], grp["margin"], color=str(0.35 + 0.4 * j / max(len(teachers) - 1, 1)), ls="--",
                lw=1.0, marker=TEACHER_MARKERS[j % len(TEACHER_MARKERS)], ms=4, label=f"teacher {name}")
    for scorer, style in POOLS.items():
        grp = margins[margins.scorer == scorer].sort_values("horizon")
        if grp.empty:
            continue
        ax.plot(grp["horizon"], grp["margin"], **style)
        if scorer == "geometric":
            ax.fill_between(grp["horizon"], grp["margin_low"], grp["margin_high"], color=VERMILLION, alpha=0.2, lw=0)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("horizon H (tokens sampled after the option)")
    ax.set_ylabel("margin: ln s(correct) − max ln s(incorrect)  (nats)")
    ax.set_title(title or "prefix-bias probe")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3, lw=0.4)
    fig.suptitle(claim(margins) + ";\neach scorer's margin against the horizon H (> 0: it prefers the correct option)",
                 fontsize=8)
    return fig


def figures_from(folder):
    """{"probe": Figure} from ``margins.csv`` in ``folder`` (titled with the question of its
    ``summary.json``). A batch keeps one such folder per question, each found by ``python -m figures``."""
    title = ""
    if os.path.exists(os.path.join(folder, "summary.json")):
        with open(os.path.join(folder, "summary.json")) as f:
            title = textwrap.shorten(str(json.load(f).get("question", "")), 80, placeholder=" ...")
    return {"probe": probe_figure(pd.read_csv(os.path.join(folder, "margins.csv")), title)}
