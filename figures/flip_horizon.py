"""T8 on a real model (issue 22): the flip-horizon study's figures, pure functions of its CSVs
(``flip_questions.csv``, ``flip_partitions.csv``, ``flip_validation.csv`` of
``python sims/flip_horizon.py``)."""

import os

import numpy as np
import pandas as pd

from .style import BLUE, PALETTE, TWO_COLUMNS, VERMILLION, figure, paper


CONTROL = "tempered-after-correct"       # sims/flip_horizon.py's positive controls are named CONTROL-<T2>


def _flips(questions):
    """'k of n eligible questions' over the real configurations, then the positive control's count apart."""
    eligible = questions[questions.teachers_prefer_correct]
    control = eligible.config.str.startswith(CONTROL)
    text = f"{int(eligible[~control].flip.sum())} of {int((~control).sum())} eligible questions"
    return text + (f" (positive control: {int(eligible[control].flip.sum())} of {int(control.sum())})" if control.any() else "")


def _held(questions, confirmed):
    """How many of the flagged flips hold at 4x N (``confirmed``: ``flip_confirm_questions.csv``), the real
    configurations' and the positive control's apart; '' without the table."""
    if confirmed is None:
        return ""
    flagged = set(zip(questions.config[questions.flip & questions.teachers_prefer_correct],
                      questions.id[questions.flip & questions.teachers_prefer_correct]))
    held = [c for c, i, f in zip(confirmed.config, confirmed.id, confirmed.flip) if f and (c, i) in flagged]
    control = sum(c.startswith(CONTROL) for c in held)
    return f"{len(held) - control} of them hold at 4x the samples (positive control: {control});\n"


def _count(n, noun):
    return f"{n} {noun}" + ("" if n == 1 else "s")


@paper
def flip_figure(questions, partitions, confirmed=None):
    """One panel per teacher configuration: each question's pooled margin m (x) against the drift of
    D(H) = ln Z_H(uI) - ln Z_H(uC) per token (y, 95% interval), and the flip boundary drift = m / H
    for each measured H > 0: a question above the line of H is predicted to flip by H (H* = m / drift).
    Filled: every teacher prefers the correct option; hollow: not (not eligible); red: a measured flip.
    ``confirmed``: the flagged flips re-measured at 4x N (the title counts those that hold)."""
    configs = list(dict.fromkeys(questions["config"]))
    horizons = sorted(h for h in partitions["horizon"].unique() if h > 0)
    fig = figure(TWO_COLUMNS, 2.3 * ((len(configs) + 1) // 2) + 0.4)
    axes = np.atleast_1d(fig.subplots((len(configs) + 1) // 2, min(2, len(configs)), squeeze=False).ravel())
    x_max = max(float(questions["margin"].max()), 0.5) * 1.05
    cmap = __import__("matplotlib").colormaps["viridis"]
    for ax, config in zip(axes, configs):
        grp = questions[questions.config == config]
        xs = np.linspace(0, x_max, 50)
        for j, h in enumerate(horizons):
            ax.plot(xs, xs / h, color=cmap(j / max(len(horizons) - 1, 1)), lw=0.8, ls="--", label=f"boundary H = {h}")
        ax.axhline(0, color="k", lw=0.6)
        for eligible, face in ((True, BLUE), (False, "none")):
            sub = grp[grp.teachers_prefer_correct == eligible]
            ax.errorbar(sub.margin, sub.drift, yerr=[sub.drift - sub.drift_lo, sub.drift_hi - sub.drift],
                        fmt="o", ms=3, mfc=face, mec=BLUE, ecolor=BLUE, elinewidth=0.6, lw=0,
                        label="every teacher prefers C" if eligible else "not every teacher prefers C")
        flipped = grp[grp.flip]
        if len(flipped):
            ax.plot(flipped.margin, flipped.drift, "o", ms=5, mfc="none", mec=VERMILLION, label="flip measured")
        ax.set_title(f"{config}: {_count(int(grp.flip.sum()), 'flip')}, {int(grp.teachers_prefer_correct.sum())} eligible")
        ax.set_xlabel("pooled margin m = Σ w_k ln p_k(C)/p_k(I)  (nats)")
        ax.set_ylabel("drift of D(H) per token (nats)")
        lo = min(float(questions.drift_lo.min()), -0.05)
        hi = max(float(questions.drift_hi.max()), 0.05)
        ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
        ax.set_xlim(min(float(questions.margin.min()), 0) - 0.1, x_max)
        ax.grid(True)
    for ax in axes[len(configs):]:
        ax.set_visible(False)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=4)
    fig.suptitle(f"Prefix flips on a real model (T8): {_flips(questions)} "
                 f"flip measurably by H = {int(partitions.horizon.max())};\n{_held(questions, confirmed)}a question "
                 "is predicted to flip by H where its drift lies above m / H (dashed)", fontsize=8)
    return fig


@paper
def validation_figure(validation):
    """The study's drift (95% interval) against aggregation's exact drift on TabularLM teachers: theory section 2's
    rows (exact: -ln rho), the random family and the LLM-like family (with and without the heavy-tail
    correction); the diagonal is recovery."""
    fig = figure(TWO_COLUMNS / 2, 3.4)
    ax = fig.subplots()
    v = validation.assign(correction=validation.get("correction", "none"))
    groups = [("spec", None, "none")] + [key for key, _ in v[v.machine != "spec"].groupby(
        ["machine", "samples", "correction"], sort=False)]
    for j, (machine, n, corr) in enumerate(groups):
        sub = v[(v.machine == machine) & ((v.samples == n) if n is not None else True) & (v.correction == corr)]
        name = machine + ("" if n is None else f", N = {n}") + ("" if corr == "none" else f", {corr}")
        ax.errorbar(sub.exact_drift, sub.drift, yerr=[sub.drift - sub.drift_lo, sub.drift_hi - sub.drift], fmt="o",
                    ms=3, color=PALETTE[j % 6], elinewidth=0.6, lw=0, alpha=0.8,
                    label=f"{name}: {int(sub.covered.sum())}/{len(sub)} cover")
    lims = [min(validation.exact_drift.min(), validation.drift_lo.min()), max(validation.exact_drift.max(),
                                                                            validation.drift_hi.max())]
    ax.plot(lims, lims, color="k", lw=0.6)
    ax.set_xlabel("exact drift (aggregation)")
    ax.set_ylabel("estimated drift (TabularLM teachers)")
    fig.legend(loc="outside lower center")
    ax.grid(True)
    fig.suptitle(f"{int(validation.covered.sum())} of {len(validation)} 95% drift intervals cover the exact\n"
                 "drift (TabularLM teachers; the diagonal is recovery)", fontsize=8)
    return fig


@paper
def curves_figure(questions, partitions, y_max=3.0):
    """The measured curves beside any extrapolation: one panel per configuration, g's margin
    m - D(H) against H for every eligible question (grey; red with its 95% band where a flip is
    measured, i.e. the band's upper end falls below 0), the zero line; the y axis is cut at ``y_max``
    nats (questions with larger margins are far from a flip)."""
    configs = list(dict.fromkeys(questions["config"]))
    fig = figure(TWO_COLUMNS, 2.0 * ((len(configs) + 1) // 2) + 0.4)
    axes = np.atleast_1d(fig.subplots((len(configs) + 1) // 2, min(2, len(configs)), squeeze=False).ravel())
    for ax, config in zip(axes, configs):
        grp = questions[(questions.config == config) & questions.teachers_prefer_correct]
        part = partitions[partitions.config == config]
        for _, q in grp.iterrows():
            c = part[part.id == q.id].sort_values("horizon")
            if q.flip:
                ax.fill_between(c.horizon, c.margin_g_lo, c.margin_g_hi, color=VERMILLION, alpha=0.15, lw=0)
            ax.plot(c.horizon, c.margin_g, color=VERMILLION if q.flip else "0.6", lw=1.0 if q.flip else 0.6)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_ylim(min(-1.0, float(part.margin_g.min()) if len(part) else -1.0) - 0.2, y_max)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_title(f"{config}: {int(grp.flip.sum())} of {len(grp)} eligible flip")
        ax.set_xlabel("horizon H (tokens after the option)")
        ax.set_ylabel("g's margin m - D(H) (nats)")
        ax.grid(True)
    for ax in axes[len(configs):]:
        ax.set_visible(False)
    fig.suptitle(f"Measured flips (T8): g's margin m - D(H) falls below 0 for {_flips(questions)} by H = {int(partitions.horizon.max())};\nred, with its 95% band: "
                 f"a flip (the band's upper end below 0); grey: no flip; cut at {y_max:g} nats", fontsize=8)
    return fig


def figures_from(folder):
    out = {}
    q = os.path.join(folder, "flip_questions.csv")
    if os.path.exists(q):
        questions, partitions = pd.read_csv(q), pd.read_csv(os.path.join(folder, "flip_partitions.csv"))
        c = os.path.join(folder, "flip_confirm_questions.csv")
        out["flip_horizon"] = flip_figure(questions, partitions, pd.read_csv(c) if os.path.exists(c) else None)
        out["flip_curves"] = curves_figure(questions, partitions)
    lq = os.path.join(folder, "flip_long_questions.csv")
    if os.path.exists(lq):
        out["flip_long_curves"] = curves_figure(pd.read_csv(lq), pd.read_csv(os.path.join(folder, "flip_long_partitions.csv")))
    v = os.path.join(folder, "flip_validation.csv")
    if os.path.exists(v):
        out["flip_validation"] = validation_figure(pd.read_csv(v))
    return out
