"""Regret figures (docs/theory.md section 3): pure functions of the DataFrames that ``sims/regret.py`` writes.

    fig = regret_figure(regret, summary, theory, "onpolicy-tabular")
    figures_from("results/regret")     # {"regret_<experiment>": Figure} for every experiment in the CSVs

Regret against the round t on a log axis, one panel per setting, one colour per learner (mean over
seeds, band = 95% interval of the mean), the theory beside it as a thin dashed line in the learner's
colour: exact closed forms as they are, slope-only theory (c ln t) matched to the data at t = T/100.
Each panel lists how every learner's regret grows (from ``summary.csv``): the fitted c of c ln T with
the theory's c in brackets, ``bounded``, or the exponent of a power law.
"""

import os

import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from .style import BAND, TWO_COLUMNS, colours, figure, legend_below, log_axes, mean_band, paper

FEEDBACK = {"constant": "constant sequence", "round-robin": "round-robin sequence",
            "sample": "sampled teachers", "alternating": "alternating teachers",
            "full": "full feedback"}
METRIC = {"regret": "regret (nats)", "pseudo": "pseudo-regret (nats)", "token": "per-token regret (nats)"}
EXACT = ("closed form", "Shtarkov minimax ln C_t", "exact sum_t KL(q_t || G)")   # drawn as they are
TITLES = {
    "offpolicy-tabular": "Off-policy (FKL) add-beta learners on one context: regret of the log loss",
    "offpolicy-sequence": "Off-policy per-state add-beta learners on prefix-tree teachers (K = 3)",
    "onpolicy-tabular": "On-policy (RKL) learners on one context: FTL and exponentiated gradient",
    "onpolicy-sequence": "On-policy plug-in learners on finite-state teachers, scored on their own rollouts",
    "function-approx": "Log-linear student with shared features: regret against the best fixed theta",
}
COLUMNS = {"onpolicy-sequence": 3}
# which panels each figure shows (every cell is in the CSVs; the figure keeps one column width)
SHOWN = {
    "offpolicy-tabular": lambda p: p[2] in (2, 8),
    "onpolicy-tabular": lambda p: p[3] == "regret",
}


def _panels(df, experiment):
    keys = [tuple(r) for r in df[["feedback", "setting", "n_actions", "metric"]].drop_duplicates()
            .itertuples(index=False)]
    return [p for p in keys if SHOWN.get(experiment, lambda _: True)(p)]


def _match(df, experiment, feedback, setting, n, metric):
    return df[(df.experiment == experiment) & (df.feedback == feedback) & (df.setting == setting)
              & (df.n_actions == n) & (df.metric == metric)]


def growth_text(row):
    """How one learner's regret grows, for a panel: 'c 0.501 (0.5)', 'bounded' or 'T^0.98'."""
    if row.growth == "bounded":
        return "bounded"
    if row.growth == "power":
        return f"∝ T^{row.exponent:.2f}"
    theory = f" ({row.theory_slope:.3g})" if np.isfinite(row.theory_slope) else ""
    return f"{row.slope:.3g} ln T{theory}"


def _draw_theory(ax, sub, values, colour):
    """Exact closed forms as open black markers on a sparse grid (the data line should pass through
    them), Shtarkov's minimax curve dotted black, slope-only theory dashed in the learner's colour."""
    curve = sub.curve.iloc[0]
    if curve.startswith("Shtarkov"):
        ax.plot(sub.t, values, color="black", ls=":", lw=0.9)
    elif curve in EXACT:
        every = max(1, len(values) // 8)
        ax.plot(sub.t.to_numpy()[::every], values[::every], ls="none", marker="o", ms=3.2, mfc="none",
                mec="black", mew=0.6)
    else:
        ax.plot(sub.t, values, color=colour, ls="--", lw=0.9)


def short_setting(setting):
    """The part of a setting string a panel title needs (the teacher pool is in the figure title)."""
    for drop in ("pool", "K=3 w=0.5/0.3/0.2", " K=3", " K=2", "one context", "X=5 d=4 K=2 lambda=0.1"):
        setting = setting.replace(drop, "")
    return setting.strip(" ,")


def _theory_values(sub, t_data, mean_data):
    """A theory curve as drawn: exact ones as they are, slope-only ones matched to the data at T/100."""
    value = sub.value.to_numpy()
    if sub.curve.iloc[0] in EXACT:
        return value
    t = sub.t.to_numpy()
    at = t.max() / 100.0
    i, j = np.argmin(np.abs(np.log(t / at))), np.argmin(np.abs(np.log(t_data / at)))
    return value + (mean_data[j] - value[i])


@paper
def regret_figure(regret, summary, theory, experiment, ncols=4):
    """One Figure for one experiment (two columns wide)."""
    df = regret[regret.experiment == experiment]
    if df.empty:
        raise ValueError(f"no rows for experiment {experiment!r}")
    panels = _panels(df, experiment)
    ncols = min(COLUMNS.get(experiment, ncols), len(panels))
    nrows = int(np.ceil(len(panels) / ncols))
    fig = figure(TWO_COLUMNS, 1.75 * nrows + 0.75)
    axes = np.atleast_1d(fig.subplots(nrows, ncols, squeeze=False)).ravel()
    colour = colours(df.learner)
    handles = {}
    for ax, (feedback, setting, n, metric) in zip(axes, panels):
        sel = _match(df, experiment, feedback, setting, n, metric)
        summ = _match(summary, experiment, feedback, setting, n, metric).set_index("learner")
        th = _match(theory, experiment, feedback, setting, n, metric)
        notes = []
        finals = []
        for i, name in enumerate(dict.fromkeys(sel.learner)):
            wide = sel[sel.learner == name].pivot(index="seed", columns="t", values="regret")
            t, vals = wide.columns.to_numpy(), wide.to_numpy()
            # later learners thinner, so that identical curves (FTL and EG 1/sqrt t under full
            # feedback both reach G after one round) show as a line inside a wider one
            handles[name] = mean_band(ax, t, vals, colour[name], label=name, lw=max(2.6 - 0.5 * i, 0.9))
            mean = vals.mean(axis=0)
            finals.append(mean[mean > 0].min(initial=np.inf))
            finals.append(mean.max())
            for curve, sub in th[th.learner == name].groupby("curve", sort=False):
                _draw_theory(ax, sub, _theory_values(sub, t, mean), colour[name])
            if name in summ.index:
                notes.append((growth_text(summ.loc[name]), colour[name]))
        log_axes(ax)
        lo, hi = min(finals), max(finals)
        if np.isfinite(lo) and lo > 0 and hi / lo > 300 and (sel.groupby("t").regret.mean() > 0).all():
            ax.set_yscale("log")               # a linear learner beside logarithmic ones
        for k, (text, c) in enumerate(notes):
            ax.text(0.03, 0.96 - 0.085 * k, text, transform=ax.transAxes, va="top", ha="left", color=c,
                    fontsize=6.5)
        extra = short_setting(setting)
        ax.set_title(f"{FEEDBACK.get(feedback, feedback)}, n = {n}" + (f"\n{extra}" if extra else ""), fontsize=7)
        ax.set_xlabel("round t")
        ax.set_ylabel(METRIC.get(metric, metric))
    for ax in axes[len(panels):]:
        ax.axis("off")
    labels = list(handles)
    curves = set(theory[theory.experiment == experiment].curve)
    keys = [("Shtarkov", Line2D([], [], color="black", ls=":", lw=0.9), "Shtarkov minimax ln C_t"),
            ("exact", Line2D([], [], ls="none", marker="o", ms=3.2, mfc="none", mec="black", mew=0.6),
             "exact closed form"),
            ("slope", Line2D([], [], color="grey", ls="--", lw=0.9), "theory c ln t (matched to the data at T/100)")]
    present = {"Shtarkov": any(c.startswith("Shtarkov") for c in curves),
               "exact": any(c in EXACT and not c.startswith("Shtarkov") for c in curves),
               "slope": any(c not in EXACT for c in curves)}
    extra = [(h, lab) for key, h, lab in keys if present[key]]
    legend_below(fig, [handles[k] for k in labels] + [h for h, _ in extra], labels + [lab for _, lab in extra],
                 ncol=3)
    fig.suptitle(f"{TITLES.get(experiment, experiment)}\n{BAND}; in each panel, each learner's growth "
                 f"(theory's constant in brackets)", fontsize=8)
    return fig


def figures_from(folder):
    """{"regret_<experiment>": Figure} from regret.csv, summary.csv and theory.csv in ``folder``."""
    regret, summary, theory = (pd.read_csv(os.path.join(folder, f"{name}.csv")) for name in ("regret", "summary", "theory"))
    out = {}
    for e in dict.fromkeys(regret.experiment):
        out[f"regret_{e}"] = function_approx_figure(regret, summary) if e == "function-approx" \
            else regret_figure(regret, summary, theory, e)
    return out


@paper
def function_approx_figure(regret, summary):
    """Function approximation: R_T on log-log axes (a power law is a straight line, linear regret has
    slope 1) and R_T / ln T (flat or falling for logarithmic regret), off-policy and on-policy."""
    df = regret[regret.experiment == "function-approx"]
    fig = figure(TWO_COLUMNS, 4.4)
    axes = fig.subplots(2, 2)
    colour = colours(df.learner)
    summ = summary[summary.experiment == "function-approx"].set_index("learner")
    handles, notes = {}, {}
    for col, (feedback, title) in enumerate((("sample", "off-policy log loss (sampled teacher tokens)"),
                                             ("full", "on-policy RKL loss"))):
        sub = df[df.feedback == feedback]
        for name in dict.fromkeys(sub.learner):
            wide = sub[sub.learner == name].pivot(index="seed", columns="t", values="regret")
            t, vals = wide.columns.to_numpy(), wide.to_numpy()
            handles[name] = mean_band(axes[0, col], t, vals, colour[name], label=name)
            keep = t >= 10
            mean_band(axes[1, col], t[keep], vals[:, keep] / np.log(t[keep]), colour[name])
            axes[0, col].text(0.03, 0.96 - 0.085 * len(notes.setdefault(col, [])), growth_text(summ.loc[name]),
                              transform=axes[0, col].transAxes, va="top", ha="left", color=colour[name],
                              fontsize=6.5)
            notes[col].append(name)
        for ax in axes[:, col]:
            log_axes(ax, y=True)
            ax.set_xlabel("round t")
        axes[0, col].set_title(title)
        axes[0, col].set_ylabel("regret R_t (nats, log scale)")
        axes[1, col].set_ylabel("R_t / ln t (flat: logarithmic)")
    legend_below(fig, list(handles.values()), list(handles), ncol=3)
    fig.suptitle(f"{TITLES['function-approx']}\n{BAND}", fontsize=8)
    return fig
