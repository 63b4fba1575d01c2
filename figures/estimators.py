"""The KL estimators (SPEC 4): pure functions of the CSVs of sims/estimators.py."""

import os

import matplotlib
import numpy as np
import pandas as pd

from .style import TWO_COLUMNS, figure, paper

COLOURS = {"k1": "tab:blue", "k2": "tab:orange", "k3": "tab:green"}


@paper
def estimators_figure(values, gradients, is_horizon, topk):
    """(a) bias and s.d. of each estimator's value against KL(q || p); (b) samples for a 10% gradient
    error per configuration; (c) ln E[w^2] of the sequence importance weight against H; (d) top-k k3."""
    fig = figure(TWO_COLUMNS, 4.8)
    (a, b), (c, d) = fig.subplots(2, 2)
    tok = values[values.kind == "token"]
    for est, grp in tok.groupby("estimator"):
        a.plot(grp.kl, grp.exact_mean - grp.kl, "o", ms=2.5, color=COLOURS[est], label=f"{est}: bias")
        a.plot(grp.kl, grp.sd, "x", ms=3, color=COLOURS[est], label=f"{est}: s.d. of one sample")
    a.axhline(0, color="black", lw=0.7)
    a.set_xscale("log")
    a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a.set_yscale("symlog", linthresh=0.1)
    a.set_xlabel("KL(q || p) (nats)")
    a.set_ylabel("nats")
    a.set_title("values on student samples (exact)")
    a.legend(ncol=2, fontsize=6)
    a.grid(True)
    g = (gradients.groupby(["estimator", "mode", "source", "importance"])
         .agg(samples=("samples_for_10pct", "median"), nearest=("nearest", lambda v: v.mode().iloc[0])).reset_index())
    labels, vals, cols = [], [], []
    for r in g.itertuples():
        labels.append(f"{r.estimator} {r.mode}, {r.source}{' + IS' if r.importance else ''} -> {r.nearest.upper()}")
        vals.append(r.samples)
        cols.append(COLOURS[r.estimator])
    y = np.arange(len(labels))
    finite = np.isfinite(vals)
    b.barh(y[finite], np.array(vals)[finite], color=np.array(cols, dtype=object)[finite])
    top = np.nanmax(np.array(vals)[finite]) if finite.any() else 1
    for yi in y[~finite]:
        b.text(top * 0.9, yi, "biased: never", va="center", ha="right", fontsize=5.5, color="grey")
    b.set_yticks(y, labels, fontsize=5.5)
    b.set_xscale("log")
    b.set_xlabel("samples for a 10% gradient error (median)")
    b.set_title("gradients (exact moments)")
    first = is_horizon[is_horizon.machine == is_horizon.machine.min()] if "machine" in is_horizon else is_horizon
    for k, grp in first.groupby("teacher"):               # per token, so short and long H share a scale
        c.plot(grp.H, grp.log_second_moment / grp.H, "o-", ms=2.5, label=f"teacher {k}: exact")
        mc = grp[np.isfinite(grp.mc_log_second_moment)]
        c.plot(mc.H, mc.mc_log_second_moment / mc.H, "x", ms=4, color="black")
    c.set_xscale("log", base=2)
    c.set_xlabel("response length H")
    c.set_ylabel("ln E_p[w^2] / H (nats per token)")
    c.set_title("sequence importance weights, w = prod q/p (x: Monte Carlo)")
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
    fig.suptitle("Monte-Carlo KL estimators k1, k2, k3 (SPEC 4)", fontsize=9)
    return fig


def figures_from(folder):
    paths = {name: os.path.join(folder, f"{name}.csv") for name in ("values", "gradients", "is_horizon", "topk")}
    read = {name: pd.read_csv(path) for name, path in paths.items() if os.path.exists(path)}
    if len(read) < 4:
        return {}
    return {"estimators": estimators_figure(read["values"], read["gradients"], read["is_horizon"], read["topk"])}
