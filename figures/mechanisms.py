"""Mechanism figures (SPEC 1-3; claims T6-T8): pure functions of the tidy DataFrames of sims/mechanisms.py.

    fig = confident_expert_figure(df)        # also low_prob_figure, prefix_bias_figure
    figures_from("results/mechanisms")       # {"mechanism_<name>": Figure} for each CSV there

Each figure has a row of exact closed forms (SPEC worked values as markers) and rows of learned
curves: q_t of each learner against the round t on a log axis (mean over seeds, band = min..max over
seeds), with the exact targets as horizontal black lines beside them.
"""

import os

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from sims.labels import G_SEQ, L_LOCAL, LEARNER_COLOURS, MIXTURE, POOL_COLOURS, TARGET_STYLES, A, G

POOL_STYLE = {A: dict(color=POOL_COLOURS[A], ls="--"), G: dict(color=POOL_COLOURS[G], ls="-")}
SMALL = 7


def _sel(df, **eq):
    mask = np.ones(len(df), bool)
    for col, val in eq.items():
        mask &= (df[col] == val).to_numpy()
    return df[mask]


def _grid_rows(fig, counts, height=3.3, width=4.2):
    """Subfigures, one per row, each with ``counts[i]`` axes; returns the list of axis lists."""
    subs = fig.subfigures(len(counts), 1)
    rows = []
    for sub, n in zip(np.atleast_1d(subs), counts):
        axes = sub.subplots(1, n, squeeze=False)[0]
        rows.append((sub, list(axes)))
    return rows


def _figure(counts, width=4.2, height=3.4):
    fig = Figure(figsize=(width * max(counts), height * len(counts)), layout="constrained")
    return fig, _grid_rows(fig, counts)


def _pool_lines(ax, df, x_name, setting, logx=True, labels=("A", "G"), annotate=("A", "G"), g_offset=(3, 4)):
    for lab in labels:
        sub = _sel(df, part="exact", x_name=x_name, setting=setting, learner=lab).sort_values("x")
        ax.plot(sub.x, sub.value, lw=1.6, label=f"{lab} ({'FKL, mixture' if lab == 'A' else 'RKL, geometric'})",
                **POOL_STYLE[lab])
        spec = _sel(df, part="spec", x_name=x_name, setting=setting, learner=lab)
        if len(spec):
            ax.plot(spec.x, spec.value, "o", color=POOL_STYLE[lab]["color"], ms=4.5, mfc="white",
                    label=f"SPEC table ({lab})")
            for x, v in zip(spec.x, spec.value) if lab in annotate else ():
                offset = (3, -9) if lab == "A" else g_offset
                ax.annotate(f"{v:.4g}", (x, v), textcoords="offset points", xytext=offset, fontsize=6,
                            ha="left" if offset[0] >= 0 else "right", color=POOL_STYLE[lab]["color"])
    if logx:
        ax.set_xscale("log")
    ax.grid(alpha=0.3, which="both", lw=0.4)


def _learned_panel(ax, df, setting, quantity_label, legend=True, ylim=None):
    """q_t of every learner of one setting (mean, min..max band) and its exact targets."""
    sub = _sel(df, part="learned", setting=setting)
    for name in dict.fromkeys(sub.learner):
        wide = _sel(sub, learner=name).pivot(index="seed", columns="t", values="value")
        t, vals = wide.columns.to_numpy(), wide.to_numpy()
        colour = LEARNER_COLOURS.get(name)
        ax.plot(t, vals.mean(axis=0), color=colour, lw=1.5, label=f"{name}: {vals[:, -1].mean():.3f}")
        if vals.shape[0] > 1:
            ax.fill_between(t, vals.min(axis=0), vals.max(axis=0), color=colour, alpha=0.18, lw=0)
    for row in _sel(df, part="target", setting=setting).itertuples():
        ls, label = TARGET_STYLES.get(row.learner, ("--", row.learner))
        ax.axhline(row.value, color="black", ls=ls, lw=1.0, label=f"{label} = {row.value:.3f}")
    ax.set_xscale("log")
    ax.set_xlabel("round t (log scale)")
    ax.set_ylabel(quantity_label)
    ax.set_title(setting, fontsize=9)
    if ylim is not None:
        ax.set_ylim(ylim[0], ylim[1] + 0.4 * (ylim[1] - ylim[0]))       # headroom for the legend
        ax.set_yticks([v for v in ax.get_yticks() if ylim[0] <= v <= ylim[1] + 1e-9])
    ax.grid(alpha=0.3, which="both", lw=0.4)
    if legend:
        ax.legend(fontsize=5.5, loc="upper center", ncol=2, columnspacing=0.8, handlelength=1.6)


# ------------------------------------------------------------------------------------------------
# confident expert (T6)
# ------------------------------------------------------------------------------------------------
def confident_expert_figure(df):
    """Exact A and G top probability against d, K, the expert's weight and n; learned curves."""
    learned = list(dict.fromkeys(_sel(df, part="learned", x_name="K").setting))
    vocab = list(dict.fromkeys(_sel(df, part="learned", x_name="n").setting))
    fig, rows = _figure([4, len(learned), len(vocab) + 1])
    fig.suptitle("Confident expert under uninformative feedback (SPEC 1, T6): one expert (1-(n-1)d, d, ..., d) "
                 "and K-1 uniform teachers", fontsize=12)
    sub, (a, b, c, d) = rows[0]
    sub.suptitle("exact targets: top-token probability of the mixture A (FKL) and the geometric pool G (RKL)",
                 fontsize=10)
    _pool_lines(a, df, "d", "K=2, w=1/2", annotate=("G",))
    a.set_xlabel("expert's probability d on each other token (log scale)")
    a.set_title("K = 2, n = 3, w = (1/2, 1/2)", fontsize=9)
    _pool_lines(b, df, "K", "d=0.0001, equal w")
    b.set_xticks([2, 5, 10, 20, 50], labels=["2", "5", "10", "20", "50"])
    b.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    b.set_xlabel("number of teachers K (1 expert + K-1 uniform; log scale)")
    b.set_title("d = 1e-4, n = 3, equal weights", fontsize=9)
    for i, setting in enumerate(dict.fromkeys(_sel(df, part="exact", x_name="expert weight").setting)):
        colour = matplotlib.colormaps["viridis"](i / 3)
        for lab, ls in (("G", "-"), ("A", "--")):
            s = _sel(df, part="exact", x_name="expert weight", setting=setting, learner=lab)
            c.plot(s.x, s.value, ls=ls, color=colour, lw=1.4, label=f"{lab}, {setting.split(', ')[1]}")
    c.set_xlabel("expert's weight w_expert (K = 2)")
    c.set_title("against the weights (n = 3)", fontsize=9)
    c.grid(alpha=0.3, lw=0.4)
    setting_n = next(iter(dict.fromkeys(_sel(df, part="exact", x_name="n").setting)))
    _pool_lines(d, df, "n", setting_n)
    d.set_xlabel("vocabulary size n (log scale)")
    d.set_title("expert top = 1 - 1e-8, uniform over n", fontsize=9)
    for ax in (a, b, c, d):
        ax.set_ylabel("top-token probability")
        ax.set_ylim(0.3, 1.06)
        ax.legend(fontsize=SMALL)
    sub, axes = rows[1]
    sub.suptitle("learned from sampled teachers: KT (off-policy FKL) -> A; FTL on RKL (on-policy) -> G "
                 "(mean over seeds, band = min..max)", fontsize=10)
    for ax, setting in zip(axes, learned):
        _learned_panel(ax, df, setting, "learned top-token probability q_t(top)", ylim=(0.0, 1.02))
    sub, axes = rows[2]
    sub.suptitle("learned with a large vocabulary: the uniform teacher spreads A's mass over n tokens, "
                 "G ignores it", fontsize=10)
    for ax, setting in zip(axes, vocab):
        _learned_panel(ax, df, setting, "learned top-token probability q_t(top)", ylim=(0.0, 1.02))
    ax = axes[-1]
    _pool_lines(ax, df, "n", setting_n)
    for name in dict.fromkeys(_sel(df, part="learned", x_name="n").learner):
        s = _sel(df, part="learned", x_name="n", learner=name)
        last = s[s.t == s.groupby("setting").t.transform("max")].groupby("x").value.agg(["mean", "min", "max"])
        ax.errorbar(last.index, last["mean"], yerr=[last["mean"] - last["min"], last["max"] - last["mean"]],
                    fmt="s", color=LEARNER_COLOURS.get(name), ms=5, capsize=3, label=f"{name}, final q_T")
    ax.set_xlabel("vocabulary size n (log scale)")
    ax.set_ylabel("top-token probability")
    ax.set_title("final learned value vs exact, against n", fontsize=9)
    ax.legend(fontsize=6)
    return fig


# ------------------------------------------------------------------------------------------------
# low-probability veto (T7)
# ------------------------------------------------------------------------------------------------
def low_prob_figure(df):
    """G(correct) against e, the number of agreeing teachers and the weights; learned curves; rounds to
    the veto; FTL's regret constant against e."""
    learned = list(dict.fromkeys(_sel(df, part="learned").setting))
    fig, rows = _figure([4, len(learned), 2], width=4.4)
    fig.suptitle("Low-probability sensitivity, the veto (SPEC 1, T7): teachers (0.9, 0.1) x m and (e, 1-e); "
                 "token 0 is correct", fontsize=12)
    sub, (a, b, c, d) = rows[0]
    sub.suptitle("exact: probability of the correct token under A (FKL) and G (RKL)", fontsize=10)
    _pool_lines(a, df, "e", "2 agreeing, equal w", annotate=("G",), g_offset=(-4, 3))
    e_star = float(_sel(df, learner="e*", setting="2 agreeing, equal w").value.iloc[0])
    a.axvline(e_star, color="red", lw=1.0, label=f"e* = 1/{1 / e_star:.0f} = {e_star:.4g}")
    a.axhline(0.5, color="grey", lw=0.8, ls=":")
    a.set_xlabel("vetoing teacher's probability e of the correct token (log scale)")
    a.set_title("m = 2 agreeing teachers, w = 1/3 each", fontsize=9)
    for i, m in enumerate((1, 2, 3, 5)):
        setting = f"{m} agreeing, equal w"
        s = _sel(df, part="exact", x_name="e", setting=setting, learner="G")
        if s.empty:
            continue
        colour = matplotlib.colormaps["plasma"](i / 4)
        es = float(_sel(df, learner="e*", setting=setting).value.iloc[0])
        b.plot(s.x, s.value, color=colour, lw=1.5, label=f"G, m = {m}: e* = {es:.2g}")
        b.axvline(es, color=colour, lw=0.8, ls="--")
    b.axhline(0.5, color="grey", lw=0.8, ls=":")
    b.set_xscale("log")
    b.set_xlabel("e (log scale); dashed: e* = 1/(1 + 9^m)")
    b.set_title("against the number m of agreeing teachers (equal w)", fontsize=9)
    for i, setting in enumerate(dict.fromkeys(_sel(df, part="exact", x_name="veto weight", learner="G").setting)):
        colour = matplotlib.colormaps["viridis"](i / 3)
        for lab, ls in (("G", "-"), ("A", "--")):
            s = _sel(df, part="exact", x_name="veto weight", setting=setting, learner=lab)
            c.plot(s.x, s.value, color=colour, ls=ls, lw=1.4, label=f"{lab}, {setting.split(', ')[1]}")
    c.axhline(0.5, color="grey", lw=0.8, ls=":")
    c.set_xlabel("vetoing teacher's weight w_veto (agreeing: (1 - w_veto)/2 each)")
    c.set_title("against the weights (m = 2)", fontsize=9)
    s = _sel(df, part="exact", x_name="veto weight", learner="e*")
    s = s[s.x >= 0.1]
    d.plot(s.x, s.value, color="red", lw=1.5, label="e* = 1/(1 + 9^((1 - w_veto)/w_veto))")
    d.axvline(1 / 3, color="grey", lw=0.8, ls=":", label="w_veto = 1/3: e* = 1/82")
    d.set_yscale("log")
    d.set_xlabel("vetoing teacher's weight w_veto")
    d.set_ylabel("veto threshold e* (log scale)")
    d.set_title("the threshold below which G prefers the wrong token", fontsize=9)
    for ax in (a, b, c):
        ax.set_ylabel("probability of the correct token")
    for ax in (a, b, c, d):
        ax.legend(fontsize=SMALL - 1)
        ax.grid(alpha=0.3, which="both", lw=0.4)
    sub, axes = rows[1]
    sub.suptitle("learned against the three teachers (sample feedback): KT -> A stays >= 0.6, the RKL "
                 "learners -> G, below 1/2 once e < e*", fontsize=10)
    for ax, setting in zip(axes, learned):
        _learned_panel(ax, df, setting, "learned q_t(correct token)", ylim=(0.0, 1.0))
        ax.axhline(0.5, color="grey", lw=0.8, ls=(0, (1, 3)))
    sub, (a, b) = rows[2]
    sub.suptitle("how fast the veto acts, and the cost of a sharply disagreeing teacher", fontsize=10)
    veto = _sel(df, part="veto-rounds")
    for name in dict.fromkeys(veto.learner):
        s = _sel(veto, learner=name).groupby("x").value
        q = s.quantile([0.25, 0.5, 0.75]).unstack()
        a.errorbar(q.index, q[0.5], yerr=[q[0.5] - q[0.25], q[0.75] - q[0.5]], fmt="o-", capsize=3,
                   color=LEARNER_COLOURS.get(name), label=f"{name}: median, quartiles over seeds")
    scale = _sel(df, part="target", quantity="rounds until q(correct) < 1/2 for good").sort_values("x")
    a.plot(scale.x, scale.value, "k--", lw=1.0, label="(sigma/mu)^2 of the per-teacher log-odds (drift-diffusion scale)")
    a.axvline(e_star, color="red", lw=1.0, label="e* = 1/82 (never vetoed above it)")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("e (log scale)")
    a.set_ylabel("rounds until q_t(correct) < 1/2 for good")
    a.set_title("rounds until the on-policy learner vetoes the correct token (dense tracking)", fontsize=9)
    a.legend(fontsize=SMALL - 1)
    a.grid(alpha=0.3, which="both", lw=0.4)
    rc = _sel(df, part="regret-constant")
    theory = {"alternating": "c = (1/8) ln^2((1-e)/e)", "i.i.d.": "c = 1/2 sum_k w_k Var_G(ln p_k - r)"}
    for (name, setting), colour in zip(rc[["learner", "setting"]].drop_duplicates().itertuples(index=False),
                                       ("tab:red", "tab:cyan")):
        s = _sel(rc, learner=name).pivot(index="x", columns="quantity", values="value")
        b.plot(s.index, s["theory slope"], color=colour, lw=1.3, label=f"theory {theory.get(setting, '')}")
        b.errorbar(s.index, s["slope"], yerr=[s["slope"] - s["slope_lo"], s["slope_hi"] - s["slope"]], fmt="o",
                   color=colour, ms=5, mfc="white", capsize=3, label=f"measured: {name}")
    b.set_xscale("log")
    b.set_xlabel("e (log scale)")
    b.set_ylabel("regret constant c in R_T ~ c ln T (nats)")
    b.set_title("FTL's regret constant blows up as e -> 0 for alternating teachers, not for i.i.d. ones",
                fontsize=9)
    b.legend(fontsize=SMALL - 1)
    b.grid(alpha=0.3, which="both", lw=0.4)
    return fig


# ------------------------------------------------------------------------------------------------
# prefix bias (T8)
# ------------------------------------------------------------------------------------------------
def prefix_bias_figure(df):
    """g(C) against H on the SPEC rows; learned first-token probabilities; the random family."""
    exact = list(dict.fromkeys(_sel(df, part="exact").setting))
    learned = list(dict.fromkeys(_sel(df, part="learned").setting))
    fig, rows = _figure([len(exact), len(learned), 2], width=4.4)
    fig.suptitle("Prefix bias over long horizons (SPEC 2, T8): every teacher prefers the correct first token C",
                 fontsize=12)
    sub, axes = rows[0]
    sub.suptitle("exact first-token probability of C against the number H of tokens after it", fontsize=10)
    for ax, setting in zip(axes, exact):
        for lab in (G_SEQ, L_LOCAL, MIXTURE):
            colour = POOL_COLOURS[lab]
            s = _sel(df, part="exact", setting=setting, learner=lab)
            style = {"g": dict(ls="-", lw=1.6), "l": dict(ls="-.", lw=2.6, alpha=0.7), "m": dict(ls="--", lw=1.4)}
            ax.plot(s.x, s.value, color=colour, label=TARGET_STYLES[lab][1], **style[lab[0]])
        spec = _sel(df, part="spec", setting=setting).set_index("quantity").value
        ax.axvline(spec["H*"], color="black", lw=1.0, ls=":", label=f"H* = {spec['H*']:.4g} (rho = {spec['rho']:.4g})")
        flip = int(spec["first H with g(C) < 1/2"])
        g = _sel(df, part="exact", setting=setting, learner=G_SEQ).set_index("x").value
        ax.plot([flip - 1, flip], [g[flip - 1], g[flip]], "o", color="tab:red", mfc="white", ms=5,
                label=f"g(C): {g[flip - 1]:.3f} (H={flip - 1}) -> {g[flip]:.3f} (H={flip})")
        ax.axhline(0.5, color="grey", lw=0.8, ls=(0, (1, 3)))
        ax.set_ylim(0, 1.4)
        ax.set_yticks(np.linspace(0, 1, 6))
        ax.set_xlabel("H, tokens after the first (each teacher i.i.d. from A_k)")
        ax.set_ylabel("probability of C first")
        ax.set_title(setting, fontsize=8)
        ax.legend(fontsize=5.5, loc="upper center", ncol=2, columnspacing=0.8, handlelength=1.6)
        ax.grid(alpha=0.3, lw=0.4)
    sub, axes = rows[1]
    sub.suptitle("learned: sequence-level RKL (reward-to-go) -> g, per-token RKL (discount 0) -> l, per-state KT "
                 "(FKL) -> mixture", fontsize=10)
    for ax, setting in zip(axes, learned):
        _learned_panel(ax, df, setting, "learned q_t(C first)", ylim=(0.0, 1.02))
        ax.axhline(0.5, color="grey", lw=0.8, ls=(0, (1, 3)))
    sub, (a, b) = rows[2]
    sub.suptitle("random finite-state teachers (3 teachers, 2 x 4 states, seeded), every teacher prefers C: "
                 "how often does g prefer I?", fontsize=10)
    fam = _sel(df, part="random-family", quantity="fraction with g(C) < 1/2")
    lim = _sel(df, part="target", quantity="limit fraction as H -> inf").set_index("x").value
    gap = _sel(df, part="target", quantity="mean -ln z per token (nats)").set_index("x").value
    count = _sel(df, part="target", quantity="instances").set_index("x").value
    sigmas = sorted(lim.index)
    for i, sigma in enumerate(sigmas):
        colour = matplotlib.colormaps["viridis"](i / max(len(sigmas) - 1, 1))
        s = _sel(fam, setting=f"sigma={sigma:g}").sort_values("x")
        a.plot(s.x, s.value, "o-", ms=3, color=colour, lw=1.3, label=f"sigma = {sigma:g} (-ln z = {gap[sigma]:.3f})")
        a.axhline(lim[sigma], color=colour, lw=0.8, ls="--")
    a.set_xscale("symlog", linthresh=1)
    a.set_xlim(0, 1.3 * float(fam.x.max()))
    a.set_xlabel("H, tokens after the first (symlog scale)")
    a.set_ylabel("fraction of instances with g(C) < 1/2")
    a.set_title(f"against H ({int(count.iloc[0])} instances per sigma; dashed: H -> inf, rate after C < after I)",
                fontsize=9)
    a.legend(fontsize=SMALL - 1, title="teacher disagreement", title_fontsize=7)
    a.grid(alpha=0.3, which="both", lw=0.4)
    x = gap[sigmas].to_numpy()
    for j, H in enumerate((1, 4, 16, 64, 1024)):
        y = [_sel(fam, setting=f"sigma={s:g}", x=H).value.iloc[0] for s in sigmas]
        b.plot(x, y, "o-", color=matplotlib.colormaps["magma"](j / 5.5), lw=1.3, ms=4, label=f"H = {H}")
    b.plot(x, lim[sigmas].to_numpy(), "k--", lw=1.0, label="H -> inf")
    for xi, s in zip(x, sigmas):
        b.annotate(f"sigma={s:g}", (xi, 0.0), textcoords="offset points", xytext=(0, 4), fontsize=6, ha="center")
    b.set_xscale("log")
    b.set_xlabel("teacher disagreement: mean per-token -ln z = min_q sum_k w_k KL(q||p_k) (nats, log scale)")
    b.set_ylabel("fraction of instances with g(C) < 1/2")
    b.set_title("against teacher disagreement (0 at H = 0 and at sigma = 0)", fontsize=9)
    b.legend(fontsize=SMALL - 1)
    b.grid(alpha=0.3, which="both", lw=0.4)
    return fig


FIGURES = {"confident-expert": confident_expert_figure, "low-prob": low_prob_figure,
           "prefix-bias": prefix_bias_figure}


def figures_from(folder):
    """{"mechanism_<name>": Figure} for each mechanism CSV in ``folder``."""
    return {f"mechanism_{name}": build(pd.read_csv(os.path.join(folder, f"{name}.csv")))
            for name, build in FIGURES.items() if os.path.exists(os.path.join(folder, f"{name}.csv"))}
