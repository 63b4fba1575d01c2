"""Forgetting and update sparsity (E3): pure functions of the CSVs of sims/forgetting.py."""

import os

import numpy as np
import pandas as pd

from analysis import lower_frontier

from .style import (BLACK, BLUE, GREEN, GREY, ORANGE, PURPLE, SKY, TWO_COLUMNS, VERMILLION, figure, legend_below,
                    log_scale, paper)

OUTCOME_LABELS = {"forgetting": "forgetting on A (log10 nats)", "quality": "distance to B's target (log10)",
                  "sparsity": "share of parameters changed", "sparsity_bf16": "share changed in bf16"}
SCHEDULE_COLOURS = {"constant": PURPLE, "linear": GREEN, "cosine": ORANGE}
STUDENTS = {"loglinear": ("log-linear (shared features)", BLUE), "neural": ("tiny Qwen2", ORANGE)}


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
                    error_kw=dict(lw=0.6, capsize=1.5, ecolor=BLACK))
        ax.set_yticks(y, order, fontsize=6)
        ax.set_xlim(0, 1)
        ax.set_xlabel("share of the variance over the sweep")
        ax.set_title(label)
        ax.grid(True, axis="x")
    legend_below(fig, *axes[0].get_legend_handles_labels(), ncol=2)
    fig.suptitle("E3, the learning rate and not the rollout mix alpha governs forgetting: the share of each outcome's\n"
                 "variance over the factorial sweep explained by each factor and pair of factors (ANOVA)", fontsize=8)
    return fig


def _by(df, x, line, y):
    return df.groupby([line, x])[y].mean().unstack(0)


FLOOR = 1e-6               # forgetting at or below this is drawn at it (sims/forgetting.py's FLOOR)
LEARNED = 0.01             # quality below this "learns B" (sims/forgetting.py's LEARNED): the frontiers' range
STORAGE_STYLES = {("float32", "sparsity"): ("float32", GREY, "s"),
                  ("bf16", "sparsity"): ("bf16 storage", VERMILLION, "o"),
                  ("bf16-master", "sparsity"): ("mixed: float32 master", BLUE, "^"),
                  ("bf16-master", "sparsity_bf16"): ("mixed: its bf16 copy", SKY, "v")}
ALPHA_STYLES = ((BLUE, "o", 5), (ORANGE, "s", 3.5), (GREEN, "^", 2.5))   # colour, marker, size: coinciding lines stay visible
OBJECTIVE_COLOURS = {"fkl": BLUE, "rkl": VERMILLION, "pg1": GREEN}


def _alpha_panel(ax, df, alphas):
    """Forgetting against the learning rate, a line per alpha (mean over the runs at each rate)."""
    for al, col in _by(df, "lr", "alpha", "forgetting").items():
        colour, marker, ms = ALPHA_STYLES[alphas.index(al) % len(ALPHA_STYLES)]
        ax.plot(col.index, np.maximum(col, FLOOR), marker=marker, ms=ms, mfc="none", color=colour, label=f"alpha = {al:g}")
    ax.legend(fontsize=6, loc="lower right")


def _frontier_panel(ax, df):
    """Each objective's quality-forgetting frontier (quality: KL to that objective's own target), alpha = 0
    solid and alpha = 1 dashed: the least forgetting among the configurations (means over seeds) at or
    below each quality; shaded beyond LEARNED, where a configuration does not learn B."""
    keys = [k for k in ("lr", "schedule", "warmup", "alpha", "objective", "clip", "storage") if k in df]
    pts = df.groupby(keys, as_index=False)[["forgetting", "quality"]].mean()
    for (objective, al), grp in pts.groupby(["objective", "alpha"]):
        if al in (0, 1):
            q, best = lower_frontier(np.maximum(grp.quality, FLOOR), np.maximum(grp.forgetting, FLOOR))
            ax.step(q, best, where="post", color=OBJECTIVE_COLOURS.get(objective, BLACK), ls="-" if al == 0 else "--",
                    lw=1.6 if al == 0 else 1.0, label=f"{objective.upper()}, alpha = {al:g}")
    ax.axvspan(LEARNED, max(pts.quality.max(), LEARNED) * 1.5, color=GREY, alpha=0.15, lw=0)
    log_scale(ax, x=True, y=True)
    ax.set_xlabel(f"KL/position to its target (grey: > {LEARNED:g})")
    ax.legend(fontsize=6, loc="best")


@paper
def forgetting_figure(loglinear, neural, precision=None):
    """Top row: forgetting against the learning rate, a line per alpha, for the log-linear student and the
    tiny Qwen2; the share of parameters an update moves against the learning rate per storage
    (precision.csv when given, mixed precision included; else the bf16 view of the factorial's runs).
    Bottom row: each objective's quality-forgetting frontier at alpha = 0 and 1, per student; forgetting
    against the learning rate per schedule."""
    students = [(name, df) for name, df in (("log-linear", loglinear), ("tiny Qwen2", neural)) if len(df)]
    fig = figure(TWO_COLUMNS, 5.0)
    axes = fig.subplots(2, 3)
    alphas = sorted(set(loglinear.alpha) | set(neural.alpha if len(neural) else []))
    for col, (name, df) in enumerate(students):
        top, bottom = axes[0, col], axes[1, col]
        _alpha_panel(top, df, alphas)
        log_scale(top, x=True, y=True)
        top.set_xlabel("peak learning rate")
        top.set_title(f"{name}: forgetting by alpha")
        _frontier_panel(bottom, df)
        bottom.set_title(f"{name}: frontier per objective")
    for ax in axes[:, 0]:
        ax.set_ylabel("forgetting on A (nats)")
    for ax in axes[:, :2].ravel():
        ax.grid(True)
    if len(students) < 2:
        axes[0, 1].set_visible(False)
        axes[1, 1].set_visible(False)
    d = axes[0, 2]
    styles = {k: v for k, v in STORAGE_STYLES.items() if precision is not None or k[0] != "bf16-master"}
    source = precision if precision is not None else loglinear
    for (storage, column), (label, colour, marker) in styles.items():
        if precision is None:                           # the factorial's runs: the bf16 view of each
            column = "sparsity_bf16"
        part = source[source.storage == storage]
        if len(part):
            m = part.groupby("lr")[column].mean()
            d.plot(m.index, m.to_numpy(), marker=marker, ms=3, color=colour, label=label)
    log_scale(d)
    d.set_ylim(0, 1.05)
    d.set_xlabel("peak learning rate")
    d.set_ylabel("share of parameters moved")
    d.set_title("update sparsity by storage")
    d.legend(fontsize=6, loc="best")
    d.grid(True)
    e = axes[1, 2]
    for (name, df), ls in zip(students, ("-", "--")):
        for schedule, col in _by(df, "lr", "schedule", "forgetting").items():   # hollow markers: cosine and
            marker = {"cosine": "s", "linear": "^"}.get(schedule, "o")             # linear often coincide
            e.plot(col.index, np.maximum(col, FLOOR), ls=ls, marker=marker, ms=4, mfc="none",
                   color=SCHEDULE_COLOURS[schedule], label=f"{schedule} ({name})")
    log_scale(e, x=True, y=True)
    e.set_xlabel("peak learning rate")
    e.set_ylabel("forgetting on A (nats)")
    e.set_title("forgetting by schedule")
    e.legend(fontsize=5.5, loc="lower right")
    e.grid(True)
    fig.suptitle("E3, the learning rate and not the rollout mix alpha governs forgetting: forgetting by alpha against the\n"
                 "learning rate, and each objective's frontier at alpha = 1 (dashed) and 0 (solid) at equal quality on B")
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
