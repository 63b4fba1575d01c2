"""Regret figures (SPEC section 3): pure functions of the DataFrames that ``sims/regret.py`` writes.

    fig = regret_figure(regret, summary, theory, "onpolicy-tabular")
    figures_from("results/regret")     # {"regret_<experiment>": Figure} for every experiment in the CSVs

Regret against t on a log axis (and a symlog y axis where one learner's regret is linear), one panel per (feedback, setting, n_actions, metric), one curve
per learner (mean over seeds, band = 5-95% over seeds), the theory curves in black beside them,
the fitted slope with its 95% interval and the theory slope in the legend.
"""

import os

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

METRIC_LABEL = {"regret": "regret vs best in hindsight", "pseudo": "pseudo-regret vs target",
                "token": "per-token regret vs local l"}
THEORY_STYLES = ("--", ":", "-.", (0, (5, 1, 1, 1)))


def _panels(df):
    keys = df[["feedback", "setting", "n_actions", "metric"]].drop_duplicates()
    return [tuple(r) for r in keys.itertuples(index=False)]


def _match(df, experiment, feedback, setting, n, metric):
    return df[(df.experiment == experiment) & (df.feedback == feedback) & (df.setting == setting)
              & (df.n_actions == n) & (df.metric == metric)]


def regret_figure(regret, summary, theory, experiment, ncols=4):
    """One matplotlib Figure for one experiment."""
    df = regret[regret.experiment == experiment]
    if df.empty:
        raise ValueError(f"no rows for experiment {experiment!r}")
    panels = _panels(df)
    ncols = min(ncols, len(panels))
    nrows = int(np.ceil(len(panels) / ncols))
    fig = Figure(figsize=(4.4 * ncols, 3.4 * nrows))
    axes = fig.subplots(nrows, ncols, squeeze=False)
    learners = list(dict.fromkeys(df.learner))
    colours = {name: matplotlib.colormaps["tab10"](i % 10) for i, name in enumerate(learners)}
    for ax, (feedback, setting, n, metric) in zip(axes.flat, panels):
        sel = _match(df, experiment, feedback, setting, n, metric)
        summ = _match(summary, experiment, feedback, setting, n, metric)
        finals = []
        for name in learners:
            sub = sel[sel.learner == name]
            if sub.empty:
                continue
            wide = sub.pivot(index="seed", columns="t", values="regret")
            t, vals = wide.columns.to_numpy(), wide.to_numpy()
            label = name
            s = summ[summ.learner == name]
            if not s.empty:
                r = s.iloc[0]
                label += f": slope {r.slope:.3g} [{r.slope_lo:.3g}, {r.slope_hi:.3g}]"
                if np.isfinite(r.theory_slope):
                    label += f", theory {r.theory_slope:.3g}"
            ax.plot(t, vals.mean(axis=0), color=colours[name], lw=1.6, label=label)
            finals.append(abs(vals.mean(axis=0)[-1]))
            if vals.shape[0] > 1:
                ax.fill_between(t, np.percentile(vals, 5, axis=0), np.percentile(vals, 95, axis=0),
                                color=colours[name], alpha=0.2, lw=0)
        th = _match(theory, experiment, feedback, setting, n, metric)
        for j, ((learner, curve), sub) in enumerate(th.groupby(["learner", "curve"], sort=False)):
            label = curve if curve.startswith("Shtarkov") else f"{curve} ({learner})"
            ax.plot(sub.t, sub.value, color="black", ls=THEORY_STYLES[j % len(THEORY_STYLES)], lw=1.0, label=label)
            finals.append(abs(float(sub.value.iloc[-1])))
        ax.set_xscale("log")
        if finals and max(finals) > 30 * max(min(finals), 1.0):
            # a linear-regret learner beside logarithmic ones: a log-like y axis keeps both readable
            ax.set_yscale("symlog", linthresh=1.0)
            ax.set_ylim(bottom=min(0.0, float(sel.regret.min())))
        ax.set_xlabel("round t")
        ax.set_ylabel(f"{METRIC_LABEL.get(metric, metric)} (nats)", fontsize=8)
        ax.set_title(f"{feedback} | {setting} | n={n}", fontsize=9)
        ax.legend(fontsize=6, loc="upper left")
        ax.grid(alpha=0.3, which="both", lw=0.4)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{experiment}: regret against t (mean, band 5-95% over seeds; black: theory; "
                 f"slopes fitted on ln t over the last two decades)", fontsize=10)
    fig.tight_layout()
    return fig


def figures_from(folder):
    """{"regret_<experiment>": Figure} from regret.csv, summary.csv and theory.csv in ``folder``."""
    regret, summary, theory = (pd.read_csv(os.path.join(folder, f"{name}.csv")) for name in ("regret", "summary", "theory"))
    return {f"regret_{e}": regret_figure(regret, summary, theory, e) for e in dict.fromkeys(regret.experiment)}
