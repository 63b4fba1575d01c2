"""Forgetting and update sparsity (E3): pure functions of the CSVs of sims/forgetting.py."""

import os

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from .style import TWO_COLUMNS, figure, legend_below, paper

OUTCOME_LABELS = {"forgetting": "forgetting on A (log10 nats)", "quality": "distance to B's target (log10)",
                  "sparsity": "share of parameters changed", "sparsity_bf16": "share changed in bf16"}
SCHEDULE_COLOURS = {"constant": "tab:purple", "linear": "tab:green", "cosine": "tab:brown"}
STUDENTS = {"loglinear": ("log-linear (shared features)", "tab:blue"), "neural": ("tiny Qwen2", "tab:orange")}


@paper
def shares_figure(shares):
    """One panel per outcome: the share of its variance over the sweep explained by each factor and
    each pair of factors (95% intervals over seeds), for each student."""
    fig = figure(TWO_COLUMNS, 5.2)
    axes = fig.subplots(2, 2).ravel()
    for ax, (outcome, label) in zip(axes, OUTCOME_LABELS.items()):
        s = shares[(shares.outcome == outcome)]
        keep = s.groupby("term").share.max()
        terms = keep[(keep >= 0.01) | keep.index.isin(["alpha", "lr", "schedule", "warmup"])]
        order = terms.sort_values().index.tolist()
        y = np.arange(len(order))
        for i, (student, (name, colour)) in enumerate(STUDENTS.items()):
            part = s[s.student == student].set_index("term").reindex(order)
            ax.barh(y + (i - 0.5) * 0.38, part.share.fillna(0), height=0.38, color=colour, label=name,
                    xerr=np.vstack([(part.share - part.lo).fillna(0), (part.hi - part.share).fillna(0)]),
                    error_kw=dict(lw=0.6, capsize=1.5))
        ax.set_yticks(y, order, fontsize=6)
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of the variance over the sweep")
        ax.set_title(label)
        ax.grid(True, axis="x")
    legend_below(fig, *axes[0].get_legend_handles_labels(), ncol=2)
    fig.suptitle("Which knob governs forgetting, learning and update sparsity (ANOVA over the factorial sweep)",
                 fontsize=8)
    return fig


def _by(df, x, line, y):
    return df.groupby([line, x])[y].mean().unstack(0)


@paper
def forgetting_figure(loglinear, neural):
    """(a) forgetting against the learning rate, a line per alpha (solid: log-linear, dashed: tiny
    Qwen2); (b) the same per schedule; (c) forgetting against the distance to B's target (each point a
    configuration, mean over seeds), coloured by alpha; (d) the bf16 sparsity against the learning rate
    per storage."""
    fig = figure(TWO_COLUMNS, 4.8)
    (a, b), (c, d) = fig.subplots(2, 2)
    alphas = sorted(set(loglinear.alpha) | set(neural.alpha if len(neural) else []))
    cmap = matplotlib.colormaps["viridis"]
    colour = {al: cmap(0.85 * i / max(len(alphas) - 1, 1)) for i, al in enumerate(alphas)}
    for df, ls in ((loglinear, "-"), (neural, "--")):
        if len(df) == 0:
            continue
        for al, col in _by(df, "lr", "alpha", "forgetting").items():
            a.plot(col.index, np.maximum(col, 1e-6), ls=ls, marker="o", ms=2.5, color=colour[al])
        for sc, col in _by(df, "lr", "schedule", "forgetting").items():
            b.plot(col.index, np.maximum(col, 1e-6), ls=ls, marker="o", ms=2.5, color=SCHEDULE_COLOURS[sc],
                   label=sc if ls == "-" else None)
    for ax, title in ((a, "forgetting vs learning rate, by alpha"), (b, "forgetting vs learning rate, by schedule")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("peak learning rate")
        ax.set_ylabel("forgetting on A (nats)")
        ax.set_title(title)
        ax.grid(True)
    b.legend(fontsize=6)
    keys = ["lr", "schedule", "warmup", "alpha", "objective", "clip", "storage"]
    pts = loglinear.groupby(keys, as_index=False)[["forgetting", "quality"]].mean()
    for al, grp in pts.groupby("alpha"):
        c.scatter(np.maximum(grp.quality, 1e-6), np.maximum(grp.forgetting, 1e-6), s=2, color=colour[al], alpha=0.5)
    c.set_xscale("log")
    c.set_yscale("log")
    c.set_xlabel("distance to B's target after distillation (nats / position)")
    c.set_ylabel("forgetting on A (nats)")
    c.set_title("the trade-off: each log-linear configuration")
    c.grid(True)
    for df, ls in ((loglinear, "-"), (neural, "--")):
        if len(df) == 0:
            continue
        for st, col in _by(df, "lr", "storage", "sparsity_bf16").items():
            d.plot(col.index, col, ls=ls, marker="o" if st == "bf16" else "s", ms=3,
                   color="tab:red" if st == "bf16" else "tab:grey")
    d.set_xscale("log")
    d.set_ylim(0, 1.05)
    d.set_xlabel("peak learning rate")
    d.set_ylabel("share changed (bf16 value)")
    d.set_title("update sparsity: bf16 storage swallows small updates")
    d.grid(True)
    handles = [Line2D([], [], color=colour[al], marker="o", ms=2.5) for al in alphas]
    handles += [Line2D([], [], color="grey", ls="-"), Line2D([], [], color="grey", ls="--"),
                Line2D([], [], color="tab:red", marker="o", ms=3), Line2D([], [], color="tab:grey", marker="s", ms=3)]
    legend_below(fig, handles, [f"alpha = {al:g}" for al in alphas] +
                 ["log-linear student", "tiny Qwen2 student", "bf16 storage", "float32 storage"], ncol=4)
    return fig


def figures_from(folder):
    paths = {name: os.path.join(folder, f"{name}.csv") for name in ("loglinear", "neural", "shares")}
    if not os.path.exists(paths["loglinear"]):
        return {}
    loglinear = pd.read_csv(paths["loglinear"])
    neural = pd.read_csv(paths["neural"]) if os.path.exists(paths["neural"]) else loglinear.iloc[:0]
    out = {"forgetting": forgetting_figure(loglinear, neural)}
    if os.path.exists(paths["shares"]):
        out["forgetting_shares"] = shares_figure(pd.read_csv(paths["shares"]))
    return out
