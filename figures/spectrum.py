"""The rollout spectrum (E1, E2, E5): pure functions of the CSVs of sims/rollout_spectrum.py."""

import os

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from .style import (BLACK, BLUE, GREEN, GREY, ORANGE, PURPLE, SKY, TWO_COLUMNS, VERMILLION, YELLOW, figure,
                    legend_below, log_scale, paper)

LABELS = {"fkl": "FKL, full conditionals -> A", "sft": "SFT, sampled token -> SFT(alpha)",
          "rkl": "RKL, full conditionals -> l", "k1": "k1 loss (largest logit)", "k2": "k2 loss -> l",
          "k3": "k3 loss, pooled -> l", "k3-teacher": "k3 loss, one teacher -> A (IS: derived point)",
          "pg0": "policy gradient g=0 -> l", "pg1": "policy gradient g=1 -> g"}
PANELS = (("exact conditionals", ("fkl", "rkl", "sft")), ("sampled-token estimators", ("k2", "k3", "k3-teacher")),
          ("policy gradients and k1", ("pg0", "pg1", "k1")))
TOL = 0.01                 # nats per position: "reached" (sims/rollout_spectrum.py)
TOL_STYLE = dict(color="black", lw=0.7, ls=(0, (1, 2)))


def _final(df):
    last = df[df.step == df.step.max()]
    return last.assign(kl_per_position=last.kl_named / last.horizon)


OBJECTIVE_COLOURS = dict(zip(LABELS, (BLUE, GREEN, VERMILLION, GREY, ORANGE, SKY, PURPLE, YELLOW, BLACK)))


def _colour(obj):
    return OBJECTIVE_COLOURS[obj]


def draw_ranges(draws):
    """{(objective, importance): (alphas, lo, hi)}: the range over the task draws of tasks.csv (tabular
    student, K = 2) of each draw's final distance to the named target per position (k1: its largest
    logit), averaged over its seeds."""
    d = draws[(draws.student == "tabular") & (draws.K == 2)]
    f = _final(d).assign(value=lambda x: np.where(x.objective == "k1", x.max_logit, x.kl_per_position))
    per_draw = f.groupby(["objective", "importance", "alpha", "task_seed"]).value.mean()
    span = per_draw.groupby(["objective", "importance", "alpha"]).agg(["min", "max"])
    return {key: (g.index.get_level_values("alpha").to_numpy(), g["min"].to_numpy(), g["max"].to_numpy())
            for key, g in span.groupby(level=["objective", "importance"])}


@paper
def spectrum_figure(tab, theory, draws=None):
    """Final KL_seq(q || named target) per position against alpha (tabular students, K = 2, clipping
    off, one task draw), importance weights dashed, the distance to the derived fixed point dotted
    (sampled-token losses); the switch-point variant at the right; with ``draws`` (tasks.csv), each
    configuration's range over the task draws as a bar at the alphas it runs; the SFT fixed point's
    distance to A and to the mixture against alpha."""
    tab = tab[(tab.K == tab.K.max()) & (~tab["clip"].astype(bool))]
    f = _final(tab)
    ranges = {} if draws is None else draw_ranges(draws)
    n_draws = 0 if draws is None else draws.task_seed.nunique()
    fig = figure(TWO_COLUMNS, 4.6)
    axes = fig.subplots(2, 2).ravel()
    logit_ax = axes[2].twinx()                            # k1's largest centred logit on its own axis
    for ax, (title, objectives) in zip(axes, PANELS):
        for obj in objectives:
            for imp, ls in ((False, "-"), (True, "--")):
                s = f[(f.objective == obj) & (f.importance == imp) & ~f.switch.astype(bool)]
                if s.empty:
                    continue
                if obj == "k1":
                    m = s.groupby("alpha").max_logit.mean()
                    logit_ax.plot(m.index, m.to_numpy(), ls=ls, marker="o", ms=2.5, color=_colour(obj))
                else:   # the weighted routed k3 is drawn against its derived point (the mixture), not A
                    column = "kl_fixed_point" if (obj == "k3-teacher" and imp) else "kl_per_position"
                    m = (s[column] / (s.horizon if column == "kl_fixed_point" else 1)).groupby(s.alpha).mean()
                    ax.plot(m.index, np.maximum(m.to_numpy(), 1e-6), ls=ls, marker="o", ms=2.5, color=_colour(obj))
                if not imp and obj in ("k2", "k3", "k3-teacher"):
                    fp = (s.kl_fixed_point / s.horizon).groupby(s.alpha).mean()
                    ax.plot(fp.index, np.maximum(fp.to_numpy(), 1e-6), ls=":", lw=1.0, color=_colour(obj))
                if (obj, imp) in ranges:                          # the range over task draws, beside the point
                    a, lo, hi = ranges[obj, imp]
                    target = logit_ax if obj == "k1" else ax
                    floor = 0.0 if obj == "k1" else 1e-6
                    target.vlines(a + (0.02 if imp else -0.02), np.maximum(lo, floor), np.maximum(hi, floor), lw=3,
                                  alpha=0.35, color=_colour(obj))
                sw = f[(f.objective == obj) & (f.importance == imp) & f.switch.astype(bool)]
                if len(sw) and obj != "k1":
                    ax.plot([1.12], [max(sw.kl_per_position.mean(), 1e-6)], marker="s", ms=4, mfc="white",
                            color=_colour(obj))
        ax.axhline(TOL, **TOL_STYLE)
        log_scale(ax, x=False, y=True)
        ax.set_xlabel("alpha (share of student rollouts)")
        ax.set_ylabel("KL to target (nats/position)")
        ax.set_title(title)
        ax.grid(True)
    logit_ax.set_ylabel("k1: largest centred logit", color=_colour("k1"))
    logit_ax.set_ylim(0, None)
    ax = axes[3]
    for ref, colour in (("arithmetic", BLUE), ("mixture", GREEN)):
        s = theory[theory.reference == ref].sort_values("alpha")
        ax.plot(s.alpha, s.kl, color=colour, label=f"KL_seq(SFT fixed point || {ref})")
    ax.set_xlabel("alpha")
    ax.set_ylabel("nats per response")
    ax.set_title("SFT's fixed point moves with alpha (exact)")
    ax.legend(loc="upper center")
    ax.grid(True)
    handles = [Line2D([], [], color=_colour(o), marker="o", ms=2.5) for o in LABELS]
    handles += [Line2D([], [], color="grey", ls="--"), Line2D([], [], color="grey", ls="-"),
                Line2D([], [], color="grey", ls=":"), Line2D([], [], color="grey", ls="", marker="s", mfc="white"),
                Line2D([], [], **TOL_STYLE)]
    labels = list(LABELS.values()) + ["importance-weighted teacher samples", "unweighted",
                                      "unweighted: to the derived point", "switch-point variant (at 1.12)",
                                      f"{TOL} nats/position: 'reached'"]
    if ranges:
        handles.append(Line2D([], [], color="grey", lw=3, alpha=0.35))
        labels.append(f"range over {n_draws} task draws")
    legend_below(fig, handles, labels, ncol=3)
    fig.suptitle("E1, E2: FKL reaches A at every alpha, SFT's fixed point moves with alpha; each objective's distance\n"
                 "to its own target (tabular students, K = 2 finite-state teachers; lines: task draw 0)", fontsize=8)
    return fig


@paper
def neural_figure(neural, tab):
    """The shared-parameter student against the tabular one: final KL to the named target against alpha,
    on the first task draw (the tabular student's draw: mean over seeds) with the range over the task
    draws of each draw's seed mean shaded."""
    f, t = _final(neural), _final(tab[(tab.K == 2) & (~tab["clip"].astype(bool)) & ~tab.importance.astype(bool)
                                      & ~tab.switch.astype(bool)])
    if "task_seed" not in f:
        f = f.assign(task_seed=0)
    first = f.task_seed.min()
    fig = figure(TWO_COLUMNS, 2.8)
    ax = fig.subplots()
    for obj in dict.fromkeys(f.objective):
        per_draw = f[f.objective == obj].groupby(["task_seed", "alpha"]).kl_per_position.mean()
        s = per_draw.loc[first]
        span = per_draw.groupby(level="alpha").agg(["min", "max"])
        ax.plot(s.index, np.maximum(s.to_numpy(), 1e-6), marker="o", color=_colour(obj),
                label=f"{LABELS[obj]} (tiny Qwen2, {f.seed.nunique()} seeds)")
        ax.fill_between(span.index, np.maximum(span["min"].to_numpy(), 1e-6), np.maximum(span["max"].to_numpy(), 1e-6),
                        color=_colour(obj), alpha=0.15, lw=0)
        s2 = t[t.objective == obj].groupby("alpha").kl_per_position.mean()
        ax.plot(s2.index, np.maximum(s2.to_numpy(), 1e-6), ls=":", color=_colour(obj))
    ax.set_yscale("log")
    ax.set_xlabel("alpha: share of student rollouts")
    ax.set_ylabel("KL to its target (nats / position)")
    ax.axhline(TOL, **TOL_STYLE)
    fig.suptitle(f"E1 with shared parameters and a finite budget: the tiny Qwen2's distance to each objective's target\n"
                 f"(solid: task draw {first}, mean over seeds; shaded: range over {f.task_seed.nunique()} task draws; "
                 f"dotted: the tabular student)", fontsize=8)
    ax.grid(True)
    legend_below(fig, *ax.get_legend_handles_labels(), ncol=2)
    return fig


@paper
def verdicts_figure(verdicts, draws=None):
    """Each distance claim of verdicts.csv (KL per position, tolerance 0.01) as its median (dot) and range
    over the decidable task draws (bar), coloured by verdict, beside the tolerance; with ``draws``
    (verdict_draws.csv) every draw's value too: decidable draws filled, the ones that cannot decide the
    claim (candidate targets too close, or seeds too noisy) as hollow grey rings, drawn apart."""
    rows = verdicts[verdicts.statistic.str.contains("per position") & ~verdicts.statistic.str.contains("over KL")
                    & ~verdicts.statistic.str.startswith("steps")]
    colours = {"reproduces": GREEN, "reproduces under stated conditions": ORANGE,
               "does not reproduce": VERMILLION, "mixed": PURPLE, "inconclusive": GREY,
               "not decided (quick run)": "black"}
    fig = figure(TWO_COLUMNS, 0.9 + 0.24 * len(rows))
    text_ax, ax = fig.subplots(1, 2, width_ratios=[1.3, 1], sharey=True)
    y = np.arange(len(rows))[::-1]
    for yi, r in zip(y, rows.itertuples()):
        c = colours[r.verdict]
        if np.isfinite(r.lo) and np.isfinite(r.hi):
            ax.plot([max(r.lo, 1e-7), max(r.hi, 1e-7)], [yi, yi], color=c, lw=2, solid_capstyle="butt")
        ax.plot([max(r.estimate, 1e-7)], [yi], marker="o", ms=3.5, color=c)
        if draws is not None:
            mine = draws[(draws.claim == r.claim) & (draws.condition == r.condition)]
            for decided, shift, style in ((True, 0.22, dict(color=c)), (False, -0.22, dict(mfc="none", color="0.55"))):
                d = mine[mine.decidable == decided]
                ax.plot(np.maximum(d.value, 1e-7), np.full(len(d), yi + shift), "o", ms=1.8, lw=0, **style)
        text_ax.text(1.0, yi, f"{r.claim}\n[{r.condition}]", ha="right", va="center", fontsize=5)
    text_ax.axis("off")
    ax.axvline(TOL, **TOL_STYLE)
    ax.set_xscale("log")
    ax.set_xlabel("nats / position")
    ax.tick_params(axis="y", left=False)
    ax.grid(True, axis="x")
    shown = [v for v in colours if v in set(rows.verdict)]
    handles = [Line2D([], [], color=colours[v], lw=2) for v in shown] + [Line2D([], [], **TOL_STYLE)]
    labels = shown + [f"tolerance {TOL}"]
    if draws is not None:
        handles.append(Line2D([], [], marker="o", ms=3, lw=0, mfc="none", color="0.55"))
        labels.append("a draw that cannot decide")
    legend_below(fig, handles, labels, ncol=4)
    fig.suptitle("E1, E2, E5 over task draws: each distance claim's median (dot) and range over the decidable draws (bar)\n"
                 "against the tolerance, coloured by its verdict (small dots: each draw)", fontsize=8)
    return fig


def figures_from(folder):
    out = {}
    tab = pd.read_csv(os.path.join(folder, "spectrum.csv"))
    if os.path.exists(os.path.join(folder, "sft_theory.csv")):
        draws = os.path.join(folder, "tasks.csv")
        out["spectrum"] = spectrum_figure(tab, pd.read_csv(os.path.join(folder, "sft_theory.csv")),
                                          pd.read_csv(draws) if os.path.exists(draws) else None)
    if os.path.exists(os.path.join(folder, "neural.csv")):
        out["spectrum_neural"] = neural_figure(pd.read_csv(os.path.join(folder, "neural.csv")), tab)
    if os.path.exists(os.path.join(folder, "verdicts.csv")):
        per_draw = os.path.join(folder, "verdict_draws.csv")
        out["spectrum_verdicts"] = verdicts_figure(pd.read_csv(os.path.join(folder, "verdicts.csv")),
                                                   pd.read_csv(per_draw) if os.path.exists(per_draw) else None)
    return out
