"""Forgetting and update sparsity (E3): pure functions of the CSVs of sims/forgetting.py."""

import os

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from analysis import lower_frontier

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


FLOOR = 1e-6               # forgetting at or below this is drawn at it, hollow (sims/forgetting.py's FLOOR)
STORAGE_STYLES = {("float32", "sparsity"): ("float32", "tab:grey", "s"),
                  ("bf16", "sparsity"): ("bf16 storage", "tab:red", "o"),
                  ("bf16-master", "sparsity"): ("mixed precision: float32 master", "tab:blue", "^"),
                  ("bf16-master", "sparsity_bf16"): ("mixed precision: its bf16 copy", "tab:cyan", "v")}


@paper
def forgetting_figure(loglinear, neural, precision=None):
    """(a) forgetting against the learning rate, a line per alpha (solid: log-linear, dashed: tiny
    Qwen2); (b) the same per schedule; (c) forgetting against the distance to B's target (each point a
    configuration, mean over seeds), coloured by alpha, with each alpha's frontier (the least forgetting
    at a quality) and the points at the floor hollow; (d) the share of parameters an update moves
    against the learning rate per storage (precision.csv when given, mixed precision included; else
    the bf16 view of the factorial's runs)."""
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
        floored = grp.forgetting <= FLOOR
        c.scatter(np.maximum(grp.quality[~floored], 1e-6), grp.forgetting[~floored], s=2, color=colour[al], alpha=0.5)
        c.scatter(np.maximum(grp.quality[floored], 1e-6), np.full(int(floored.sum()), FLOOR), s=6,
                  facecolors="none", edgecolors=colour[al], lw=0.5)
        q, best = lower_frontier(grp.quality, np.maximum(grp.forgetting, FLOOR))
        c.step(np.maximum(q, 1e-6), best, where="post", color=colour[al], lw=1.0)
    c.set_xscale("log")
    c.set_yscale("log")
    c.set_xlabel("distance to B's target after distillation (nats / position)")
    c.set_ylabel("forgetting on A (nats)")
    c.set_title(f"the trade-off and its frontier per alpha (hollow: at the floor {FLOOR:g})")
    c.grid(True)
    styles = {k: v for k, v in STORAGE_STYLES.items() if precision is not None or k[0] != "bf16-master"}
    source = precision if precision is not None else loglinear
    for (storage, column), (label, col, marker) in styles.items():
        if precision is None:                           # the factorial's runs: the bf16 view of each
            column = "sparsity_bf16"
        part = source[source.storage == storage]
        if len(part):
            m = part.groupby("lr")[column].mean()
            d.plot(m.index, m.to_numpy(), marker=marker, ms=3, color=col)
    d.set_xscale("log")
    d.set_ylim(0, 1.05)
    d.set_xlabel("peak learning rate")
    d.set_ylabel("share of parameters moved")
    d.set_title("update sparsity: learning rate x storage (log-linear)")
    d.grid(True)
    handles = [Line2D([], [], color=colour[al], marker="o", ms=2.5) for al in alphas]
    handles += [Line2D([], [], color="grey", ls="-"), Line2D([], [], color="grey", ls="--")]
    handles += [Line2D([], [], color=col, marker=marker, ms=3) for _, col, marker in styles.values()]
    legend_below(fig, handles, [f"alpha = {al:g}" for al in alphas] + ["log-linear student", "tiny Qwen2 student"]
                 + [label for label, _, _ in styles.values()], ncol=4)
    return fig


def figures_from(folder):
    paths = {name: os.path.join(folder, f"{name}.csv") for name in ("loglinear", "neural", "shares", "precision")}
    if not os.path.exists(paths["loglinear"]):
        return {}
    loglinear = pd.read_csv(paths["loglinear"])
    neural = pd.read_csv(paths["neural"]) if os.path.exists(paths["neural"]) else loglinear.iloc[:0]
    precision = pd.read_csv(paths["precision"]) if os.path.exists(paths["precision"]) else None
    out = {"forgetting": forgetting_figure(loglinear, neural, precision)}
    if os.path.exists(paths["shares"]):
        out["forgetting_shares"] = shares_figure(pd.read_csv(paths["shares"]))
    return out
