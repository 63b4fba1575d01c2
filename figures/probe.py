"""The prefix-bias probe's figure (theory section 6): a pure function of the margins table that the probes
write (``margins.csv``: horizon, scorer, rival, margin, margin_low, margin_high)."""

import json
import os

import pandas as pd
from matplotlib.figure import Figure

from .style import BLUE, GREEN, VERMILLION

POOLS = {"geometric": dict(color=VERMILLION, lw=2.2, marker="o", label="sequence-level geometric g (95% CI)"),
         "local_geometric": dict(color=BLUE, lw=1.5, marker="s", label="local geometric l"),
         "mixture": dict(color=GREEN, lw=1.5, marker="^", label="sequence-level mixture")}
TEACHER_MARKERS = ("v", "D", "P", "X", "*", "h")


def probe_figure(margins, title=""):
    """Each scorer's margin ln s(correct) - max ln s(incorrect) against the horizon H; > 0 prefers
    the correct option. Teachers dashed grey (one marker each), g with its 95% band."""
    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
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
    ax.set_ylabel("margin: ln s(correct) − max ln s(incorrect)  (nats)", fontsize=8)
    ax.set_title(title or "prefix-bias probe", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3, lw=0.4)
    return fig


def figures_from(folder):
    """{"probe": Figure} from ``margins.csv`` in ``folder`` (titled with the question of its
    ``summary.json``). A batch keeps one such folder per question, each found by ``python -m figures``."""
    title = ""
    if os.path.exists(os.path.join(folder, "summary.json")):
        with open(os.path.join(folder, "summary.json")) as f:
            title = str(json.load(f).get("question", ""))[:80]
    return {"probe": probe_figure(pd.read_csv(os.path.join(folder, "margins.csv")), title)}
