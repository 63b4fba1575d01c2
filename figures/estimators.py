"""The KL estimators (theory section 4): pure functions of the CSVs of sims/estimators.py."""

import os

import numpy as np
import pandas as pd
from matplotlib.patches import Rectangle
from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

from .style import BLUE, GREEN, GREY, ORANGE, TWO_COLUMNS, figure, paper

COLOURS = {"k1": BLUE, "k2": ORANGE, "k3": GREEN}
SOURCES = {(False, "student"): "student samples", (False, "teacher"): "teacher samples",
           (True, "teacher"): "teacher + IS weights"}


def gradient_grid(ax, gradients):
    """(b) a cell per (estimator used as loss or reward, sample source): the gradient it estimates in
    expectation and the median samples for a 10% error, 'zero gradient', or 'biased' (then the nearest
    reference)."""
    g = (gradients.groupby(["estimator", "mode", "source", "importance"])
         .agg(samples=("samples_for_10pct", "median"), nearest=("nearest", lambda v: v.mode().iloc[0])).reset_index())
    rows = list(dict.fromkeys(zip(g.estimator, g["mode"])))
    cols = [k for k in SOURCES if k in set(zip(g.importance, g.source))]
    for r in g.itertuples():
        x, y = cols.index((r.importance, r.source)), rows.index((r.estimator, r.mode))
        if np.isfinite(r.samples):
            ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, color=COLOURS[r.estimator], alpha=0.35, lw=0))
            text, colour = f"{r.nearest.upper()} gradient\n{r.samples:,.0f} samples", "black"
        elif r.nearest == "zero":
            text, colour = "zero gradient\nin expectation", GREY
        else:
            text, colour = f"biased\n(nearest: {r.nearest.upper()})", GREY
        ax.text(x, y, text, ha="center", va="center", fontsize=5.5, color=colour)
    ax.set_xlim(-0.5, len(cols) - 0.5)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xticks(range(len(cols)), [SOURCES[c] for c in cols], fontsize=6)
    ax.set_yticks(range(len(rows)), [f"{e} {m}" for e, m in rows], fontsize=6)
    ax.tick_params(length=0)
    for edge in np.arange(len(rows) + 1) - 0.5:
        ax.axhline(edge, color="white", lw=1.5)
    ax.set_title("gradient estimated, samples for a 10% error (exact)")


@paper
def estimators_figure(values, gradients, is_horizon, topk):
    """(a) bias and s.d. of each estimator's value against KL(q || p); (b) the gradient each loss or
    reward estimates per sample source, with the samples for a 10% error; (c) ln E[w^2] / H of the
    sequence importance weight against H; (d) top-k k3."""
    fig = figure(TWO_COLUMNS, 4.8)
    (a, b), (c, d) = fig.subplots(2, 2)
    tok = values[values.kind == "token"]
    for est, grp in tok.groupby("estimator"):
        a.plot(grp.kl, grp.sd, "x", ms=3, color=COLOURS[est], label=f"{est}: s.d. of one sample")
        bias = grp.exact_mean - grp.kl
        if (bias.abs() > 1e-12).any():                 # k1 and k3 are unbiased: nothing to draw on a log axis
            a.plot(grp.kl, bias, "o", ms=2.5, color=COLOURS[est], label=f"{est}: bias")
    a.set_xscale("log")
    a.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    a.xaxis.set_major_formatter(ScalarFormatter())
    a.xaxis.set_minor_formatter(NullFormatter())
    a.set_yscale("log")
    a.set_xlabel("KL(q || p) (nats)")
    a.set_ylabel("nats")
    a.set_title("values on student samples (exact); k1, k3: bias 0")
    a.legend(fontsize=6, loc="upper left")
    a.grid(True)
    gradient_grid(b, gradients)
    first = is_horizon[is_horizon.machine == is_horizon.machine.min()] if "machine" in is_horizon else is_horizon
    for k, grp in first.groupby("teacher"):               # per token, so short and long H share a scale
        c.plot(grp.H, grp.log_second_moment / grp.H, "o-", ms=2.5, label=f"teacher {k}: exact")
        mc = grp[np.isfinite(grp.mc_log_second_moment)]
        c.plot(mc.H, mc.mc_log_second_moment / mc.H, "x", ms=4, color="black")
    c.set_xscale("log", base=2)
    c.set_xlabel("response length H")
    c.set_ylabel("ln E_p[w^2] / H (nats per token)")
    c.set_title("sequence IS weight w = prod q/p (x: Monte Carlo)")
    c.legend()
    c.grid(True)
    m = topk.groupby("k")[["e_k3", "kl", "teacher_tail"]].mean()
    d.plot(m.index, m.kl, "o-", ms=2.5, label="KL(q~ || p)")
    d.plot(m.index, m.e_k3, "s-", ms=2.5, label="E_q~[k3]")
    d.plot(m.index, m.kl - m.teacher_tail, "k:", label="KL - p(V \\ S)")
    d.set_xscale("log")
    d.set_xlabel("k: the student samples its top k of V = 1000")
    d.set_ylabel("nats")
    d.set_title("top-k samplers: E[k3] = KL - p(V \\ S)")
    d.legend()
    d.grid(True)
    fig.suptitle("KL estimators (theory section 4): k1, k3 unbiased, k2 biased; k3 spreads less than k1 only when q is near p;\n"
                 "on student samples the k2 loss gives the RKL gradient, the k3 loss the FKL one (teacher samples need IS)",
                 fontsize=8)
    return fig


def figures_from(folder):
    paths = {name: os.path.join(folder, f"{name}.csv") for name in ("values", "gradients", "is_horizon", "topk")}
    read = {name: pd.read_csv(path) for name, path in paths.items() if os.path.exists(path)}
    if len(read) < 4:
        return {}
    return {"estimators": estimators_figure(read["values"], read["gradients"], read["is_horizon"], read["topk"])}
