"""Mechanism figures (theory section 1-3; claims T6-T8): pure functions of the tidy DataFrames of sims/mechanisms.py.

    figures_from("results/mechanisms")   # for each CSV there: mechanism_<name>.png (the exact targets)
                                         # and mechanism_<name>_learned.png (what the learners reach)

Exact figures draw the closed forms of theory section 1-2 with the the theory's worked values as markers. Learned
figures draw q_t of each learner against the round t (mean over seeds, band = 95% interval of the
mean) with the exact targets as black lines; each learner is named with the feedback it gets.
All figures are two columns (7 in) wide at 8 pt.
"""

import os

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.lines import Line2D

from learners.names import G_SEQ, L_LOCAL, MIXTURE, A, G

from .labels import LEARNER_COLOURS, POOL_COLOURS, TARGET_STYLES

from .style import BAND, ORANGE, SKY, TWO_COLUMNS, VERMILLION, figure, legend_below, log_axes, mean_band, paper

POOL_LABEL = {A: "A, arithmetic pool (FKL target)", G: "G, geometric pool (RKL target)",
              G_SEQ: "g, sequence-level geometric", L_LOCAL: "l, local geometric", MIXTURE: "mixture marginal"}


def _sel(df, **eq):
    mask = np.ones(len(df), bool)
    for col, val in eq.items():
        mask &= (df[col] == val).to_numpy()
    return df[mask]


def _pool_lines(ax, df, x_name, setting, labels=(A, G)):
    """Exact A and G (or other pools) against x; theory's worked values as open markers."""
    for lab in labels:
        sub = _sel(df, part="exact", x_name=x_name, setting=setting, learner=lab).sort_values("x")
        ax.plot(sub.x, sub.value, color=POOL_COLOURS[lab], ls="--" if lab == A else "-")
        spec = _sel(df, part="spec", x_name=x_name, setting=setting, learner=lab)
        ax.plot(spec.x, spec.value, "o", color=POOL_COLOURS[lab], mfc="white", ms=3.5, mew=0.9)


def _pool_handles(labels=(A, G), spec=True):
    out = [(Line2D([], [], color=POOL_COLOURS[lab], ls="--" if lab == A else "-"), POOL_LABEL[lab]) for lab in labels]
    if spec:
        out.append((Line2D([], [], ls="none", marker="o", mfc="white", mec="black", ms=3.5), "theory's worked values"))
    return out


def _learned_panel(ax, df, setting, title, ylim=(0.0, 1.02)):
    """q_t of every learner of one setting (mean, 95% band) and its exact targets (black)."""
    handles = {}
    sub = _sel(df, part="learned", setting=setting)
    for name in dict.fromkeys(sub.learner):
        wide = _sel(sub, learner=name).pivot(index="seed", columns="t", values="value")
        handles[name] = mean_band(ax, wide.columns.to_numpy(), wide.to_numpy(), LEARNER_COLOURS.get(name), label=name)
    for row in _sel(df, part="target", setting=setting).itertuples():
        ls, _ = TARGET_STYLES.get(row.learner, ("--", row.learner))
        handles[f"target {row.learner}"] = ax.axhline(row.value, color="black", ls=ls, lw=0.9)
    log_axes(ax)
    ax.set_ylim(*ylim)
    ax.set_title(title, fontsize=7)
    ax.set_xlabel("round t")
    return handles


def _learned_legend(fig, handles, targets):
    learners = [k for k in handles if not k.startswith("target ")]
    items = [(handles[k], k) for k in learners]
    items += [(Line2D([], [], color="black", ls=TARGET_STYLES[t][0], lw=0.9), f"exact {TARGET_STYLES[t][1]}")
              for t in targets]
    legend_below(fig, [h for h, _ in items], [lab for _, lab in items], ncol=2)


# ------------------------------------------------------------------------------------------------
# confident expert (T6)
# ------------------------------------------------------------------------------------------------
@paper
def confident_expert_figure(df):
    """Exact top-token probability of A and G against d, K, the expert's weight and n (theory section 1)."""
    fig = figure(TWO_COLUMNS, 4.6)
    (a, b), (c, d) = fig.subplots(2, 2)
    _pool_lines(a, df, "d", "K=2, w=1/2")
    log_axes(a)
    a.set_xlabel("expert's probability d of each other token")
    a.set_title("expert (1-2d, d, d) and a uniform teacher, w = 1/2")
    _pool_lines(b, df, "K", "d=0.0001, equal w")
    log_axes(b)
    b.set_xticks([2, 5, 10, 20, 50], labels=["2", "5", "10", "20", "50"])
    b.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    b.set_xlabel("number of teachers K (one expert, K - 1 uniform)")
    b.set_title("d = 1e-4, equal weights")
    viridis = matplotlib.colormaps["viridis"]
    for i, setting in enumerate(dict.fromkeys(_sel(df, part="exact", x_name="expert weight").setting)):
        for lab in (G, A):
            s = _sel(df, part="exact", x_name="expert weight", setting=setting, learner=lab)
            c.plot(s.x, s.value, ls="-" if lab == G else "--", color=viridis(i / 3),
                   label=f"{setting.split(', ')[1]}" if lab == G else None)
    c.set_xlabel("expert's weight (K = 2)")
    c.set_title("against the weights (solid G, dashed A)")
    c.legend(loc="lower right", title="expert's d")
    c.grid(True)
    setting_n = next(iter(dict.fromkeys(_sel(df, part="exact", x_name="n").setting)))
    _pool_lines(d, df, "n", setting_n)
    log_axes(d)
    d.set_xlabel("vocabulary size n (uniform teacher over n tokens)")
    d.set_title("expert's top token 1 - 1e-8: G keeps it, A halves it")
    for ax in (a, b, c, d):
        ax.set_ylabel("top-token probability")
        ax.set_ylim(0.3, 1.03)
    handles = _pool_handles()
    legend_below(fig, [h for h, _ in handles], [lab for _, lab in handles], ncol=3)
    fig.suptitle("Confident expert under uninformative feedback (theory section 1, T6): exact targets", fontsize=9)
    return fig


@paper
def confident_expert_learned_figure(df):
    """Learned top-token probability against K and against the vocabulary size n."""
    by_k = list(dict.fromkeys(_sel(df, part="learned", x_name="K").setting))
    by_n = list(dict.fromkeys(_sel(df, part="learned", x_name="n").setting))
    fig = figure(TWO_COLUMNS, 4.9)
    axes = fig.subplots(2, 4)
    handles = {}
    for ax, setting in zip(axes[0], by_k):
        handles.update(_learned_panel(ax, df, setting, f"{setting.split(',')[0].replace('=', ' = ')} teachers"))
    for ax, setting in zip(axes[1], by_n):
        handles.update(_learned_panel(ax, df, setting, f"vocabulary {setting.split(',')[0]}"))
    ax = axes[1, -1]
    setting_n = next(iter(dict.fromkeys(_sel(df, part="exact", x_name="n").setting)))
    _pool_lines(ax, df, "n", setting_n)
    for name in dict.fromkeys(_sel(df, part="learned", x_name="n").learner):
        s = _sel(df, part="learned", x_name="n", learner=name)
        last = s[s.t == s.groupby("setting").t.transform("max")].groupby("x").value
        ax.errorbar(last.mean().index, last.mean(), yerr=1.96 * last.sem(), fmt="s", ms=3.5, capsize=2,
                    color=LEARNER_COLOURS.get(name))
    log_axes(ax)
    ax.set_ylim(0.0, 1.03)
    ax.set_xlabel("vocabulary size n")
    ax.set_title("final q_T (lines: exact A, G)", fontsize=7)
    for row in axes:
        row[0].set_ylabel("learned top-token probability")
    _learned_legend(fig, handles, (A, G))
    fig.suptitle("Confident expert learned from sampled teachers: FKL learners reach A, RKL learners G\n"
                 "(d = 1e-4; bottom: expert's top token 1 - 1e-8, a uniform teacher over n)\n"
                 f"({BAND}; each learner's feedback per round in the legend)", fontsize=8)
    return fig


# ------------------------------------------------------------------------------------------------
# low-probability veto (T7)
# ------------------------------------------------------------------------------------------------
@paper
def low_prob_figure(df):
    """Exact G(correct) against e, the number of agreeing teachers and the weights; the threshold e*."""
    fig = figure(TWO_COLUMNS, 4.6)
    (a, b), (c, d) = fig.subplots(2, 2)
    _pool_lines(a, df, "e", "2 agreeing, equal w")
    e_star = float(_sel(df, learner="e*", setting="2 agreeing, equal w").value.iloc[0])
    a.axvline(e_star, color=VERMILLION, lw=0.9)
    a.text(e_star, 0.05, f" e* = 1/{1 / e_star:.0f}", color=VERMILLION, fontsize=7)
    a.set_xlabel("vetoing teacher's probability e of the correct token")
    a.set_title("teachers (0.9, 0.1) x 2 and (e, 1-e), w = 1/3 each")
    plasma = matplotlib.colormaps["plasma"]
    for i, m in enumerate((1, 2, 3, 5)):
        setting = f"{m} agreeing, equal w"
        s = _sel(df, part="exact", x_name="e", setting=setting, learner=G)
        if s.empty:
            continue
        es = float(_sel(df, learner="e*", setting=setting).value.iloc[0])
        b.plot(s.x, s.value, color=plasma(i / 4), label=f"m = {m}: e* = {es:.1g}")
        b.axvline(es, color=plasma(i / 4), lw=0.7, ls=":")
    b.legend(loc="upper left", title="agreeing teachers")
    b.set_xlabel("e (dotted: e* = 1/(1 + 9^m))")
    b.set_title("G(correct) against m agreeing teachers")
    viridis = matplotlib.colormaps["viridis"]
    for i, setting in enumerate(dict.fromkeys(_sel(df, part="exact", x_name="veto weight", learner=G).setting)):
        for lab in (G, A):
            s = _sel(df, part="exact", x_name="veto weight", setting=setting, learner=lab)
            c.plot(s.x, s.value, color=viridis(i / 3), ls="-" if lab == G else "--",
                   label=setting.split(", ")[1] if lab == G else None)
    c.legend(loc="upper right", title="solid G, dashed A")
    c.set_xlabel("vetoing teacher's weight (the others share the rest)")
    c.set_title("G(correct) against the weights")
    s = _sel(df, part="exact", x_name="veto weight", learner="e*")
    s = s[s.x >= 0.1]
    d.plot(s.x, s.value, color=VERMILLION)
    d.axvline(1 / 3, color="grey", lw=0.8, ls=":")
    d.set_yscale("log")
    d.set_xlabel("vetoing teacher's weight")
    d.set_ylabel("threshold e* (G(correct) < 1/2 below it)")
    d.set_title("e* = 1/(1 + 9^((1 - w)/w)); w = 1/3 gives 1/82")
    for ax in (a, b, c):
        ax.axhline(0.5, color="grey", lw=0.7, ls=":")
        ax.set_ylabel("probability of the correct token")
        if ax is not c:
            log_axes(ax)
    for ax in (c, d):
        ax.grid(True)
    handles = _pool_handles()
    legend_below(fig, [h for h, _ in handles], [lab for _, lab in handles], ncol=3)
    fig.suptitle("Low-probability sensitivity, the veto (theory section 1, T7): exact targets; token 0 is correct",
                 fontsize=9)
    return fig


@paper
def low_prob_learned_figure(df):
    """Learned q_t(correct) for each e; rounds until the veto; FTL's regret constant against e."""
    learned = list(dict.fromkeys(_sel(df, part="learned").setting))
    fig = figure(TWO_COLUMNS, 5.0)
    axes = fig.subplots(2, 4).ravel()
    handles = {}
    for ax, setting in zip(axes, learned):
        handles.update(_learned_panel(ax, df, setting, f"vetoing teacher {setting}", ylim=(0.0, 1.0)))
        ax.axhline(0.5, color="grey", lw=0.7, ls=(0, (1, 3)))
    axes[0].set_ylabel("learned q_t(correct)")
    a, b = axes[len(learned)], axes[len(learned) + 1]
    veto = _sel(df, part="veto-rounds")
    for name in dict.fromkeys(veto.learner):
        q = _sel(veto, learner=name).groupby("x").value.quantile([0.25, 0.5, 0.75]).unstack()
        a.errorbar(q.index, q[0.5], yerr=[q[0.5] - q[0.25], q[0.75] - q[0.5]], fmt="o-", ms=3, capsize=2,
                   color=LEARNER_COLOURS.get(name))
    scale = _sel(df, part="target", quantity="rounds until q(correct) < 1/2 for good").sort_values("x")
    a.plot(scale.x, scale.value, "k--", lw=0.9)
    log_axes(a, y=True)
    a.set_xlabel("e")
    a.set_ylabel("rounds to the veto")
    a.set_title("rounds until q_t(correct) < 1/2 for good", fontsize=7)
    rc = _sel(df, part="regret-constant")
    # the pair's two orders have the same constant: their markers sit side by side (x shifted by 1.3x)
    families = {"alternating": (VERMILLION, "s", 1 / 1.3), "pair i.i.d.": (ORANGE, "o", 1.3),
                "triple i.i.d.": (SKY, "D", 1.0)}
    fam_handles = []
    for setting, (colour, marker, shift) in families.items():
        s = _sel(rc, setting=setting)
        if s.empty:
            continue
        s = s.pivot(index="x", columns="quantity", values="value")
        b.plot(s.index, s["theory slope"], color=colour, lw=0.9)
        h = b.errorbar(s.index * shift, s["slope"], yerr=[s["slope"] - s["slope_lo"], s["slope_hi"] - s["slope"]],
                       fmt=marker, ms=3.5, mfc="white", capsize=2, color=colour)
        fam_handles.append((h, _sel(rc, setting=setting).learner.iloc[0] + " (line: formula)"))
    log_axes(b)
    b.set_xlabel("e")
    b.set_ylabel("c in R_T ≈ c ln T (nats)")
    b.set_title("FTL's regret constant against e", fontsize=7)
    for ax in axes[len(learned) + 2:]:
        ax.axis("off")
    items = [(handles[k], k) for k in handles if not k.startswith("target ")]
    items += [(Line2D([], [], color="black", ls=TARGET_STYLES[t][0], lw=0.9), f"exact {TARGET_STYLES[t][1]}")
              for t in (A, G)]
    items.append((Line2D([], [], color="black", ls="--", lw=0.9),
                  "rounds to the veto: drift-diffusion scale (sigma/mu)^2 of the log-odds"))
    items += fam_handles
    legend_below(fig, [h for h, _ in items], [lab for _, lab in items], ncol=2)
    fig.suptitle("Low-probability veto, learned from the three teachers: RKL learners fall below 1/2 once e < e* = 1/82\n"
                 f"({BAND}; rounds to the veto: median and quartiles over seeds;\n"
                 "FTL's regret constant comes from the teachers' disagreement under G, not from their order)", fontsize=8)
    return fig


# ------------------------------------------------------------------------------------------------
# prefix bias (T8)
# ------------------------------------------------------------------------------------------------
@paper
def prefix_bias_figure(df):
    """Exact g(C) against H on the theory's prefix-bias rows; the random family against H and against disagreement."""
    exact = list(dict.fromkeys(_sel(df, part="exact").setting))
    fig = figure(TWO_COLUMNS, 4.8)
    axes = fig.subplots(2, 3)
    flat = [axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]]
    for i, (ax, setting) in enumerate(zip(flat, exact)):
        for lab in (G_SEQ, L_LOCAL, MIXTURE):
            s = _sel(df, part="exact", setting=setting, learner=lab)
            ax.plot(s.x, s.value, color=POOL_COLOURS[lab], ls={G_SEQ: "-", L_LOCAL: "-.", MIXTURE: "--"}[lab],
                    lw={G_SEQ: 1.5, L_LOCAL: 2.2, MIXTURE: 1.1}[lab])
        spec = _sel(df, part="spec", setting=setting).set_index("quantity").value
        ax.axvline(spec["H*"], color="black", lw=0.8, ls=":")
        flip = int(spec["first H with g(C) < 1/2"])
        g = _sel(df, part="exact", setting=setting, learner=G_SEQ).set_index("x").value
        ax.plot([flip - 1, flip], [g[flip - 1], g[flip]], "o", color=POOL_COLOURS[G_SEQ], mfc="white", ms=3.5)
        ax.text(spec["H*"], 0.05, f" H* = {spec['H*']:.4g}", fontsize=6.5)
        ax.axhline(0.5, color="grey", lw=0.7, ls=(0, (1, 3)))
        ax.set_ylim(0, 1.02)
        ax.set_xlabel("H, tokens after the first")
        ax.set_title(f"theory row {i + 1}: " + setting.split(": ", 1)[1].replace("A=", "\nA="), fontsize=6.5)
        ax.grid(True)
    for ax in (axes[0, 0], axes[1, 0]):
        ax.set_ylabel("probability of C first")
    a, b = axes[0, 2], axes[1, 2]
    fam = _sel(df, part="random-family", quantity="fraction with g(C) < 1/2")
    lim = _sel(df, part="target", quantity="limit fraction as H -> inf").set_index("x").value
    gap = _sel(df, part="target", quantity="mean -ln z per token (nats)").set_index("x").value
    count = _sel(df, part="target", quantity="instances").set_index("x").value
    sigmas = sorted(lim.index)
    viridis = matplotlib.colormaps["viridis"]
    x_inf = 4.0 * float(fam.x.max())
    for i, sigma in enumerate(sigmas):
        colour = viridis(i / max(len(sigmas) - 1, 1))
        s = _sel(fam, setting=f"sigma={sigma:g}").sort_values("x")
        a.plot(s.x, s.value, "o-", ms=2.5, color=colour, label=f"{sigma:g} ({gap[sigma]:.3f})")
        a.plot([x_inf * 1.25 ** (i - 2)], [lim[sigma]], "D", ms=3.5, color=colour)   # the H -> inf limit
    a.set_xscale("symlog", linthresh=1)
    a.set_xticks([0, 1, 10, 100, 1000, x_inf], labels=["0", "1", "10", "100", "1000", "∞"])
    a.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    a.set_xlabel("H (◆ at ∞: the growth-rate limit)")
    a.set_ylabel("fraction with g(C) < 1/2")
    a.set_title(f"random teachers, {int(count.iloc[0])} per sigma", fontsize=7)
    top = min(1.02, max(fam.value.max(), lim.max()) + 0.3)          # headroom for the legend above the curves
    a.set_ylim(-0.02, top)
    a.legend(title="sigma (-ln z, nats)", loc="upper left", fontsize=6, ncol=2)
    a.grid(True)
    x = gap[sigmas].to_numpy()
    magma = matplotlib.colormaps["magma"]
    for j, H in enumerate((1, 4, 16, 64, 1024)):
        y = [_sel(fam, setting=f"sigma={s:g}", x=H).value.iloc[0] for s in sigmas]
        b.plot(x, y, "o-", ms=2.5, color=magma(j / 5.5), label=f"H = {H}")
    b.plot(x, lim[sigmas].to_numpy(), "k--", lw=0.9, label="H -> ∞")
    b.set_xscale("log")
    b.set_xlabel("disagreement: -ln z per token (nats)")
    b.set_ylabel("fraction with g(C) < 1/2")
    b.set_title("against disagreement", fontsize=7)
    b.set_ylim(-0.02, top)
    b.legend(loc="upper left", fontsize=6, ncol=3)
    b.grid(True)
    items = [(Line2D([], [], color=POOL_COLOURS[lab], ls={G_SEQ: "-", L_LOCAL: "-.", MIXTURE: "--"}[lab]),
              POOL_LABEL[lab]) for lab in (G_SEQ, L_LOCAL, MIXTURE)]
    items.append((Line2D([], [], color="black", ls=":", lw=0.8), "H* (g(C) = 1/2 when H passes it)"))
    legend_below(fig, [h for h, _ in items], [lab for _, lab in items], ncol=4)
    fig.suptitle("Prefix bias over long horizons (theory section 2, T8): every teacher prefers C, yet g flips to I "
                 "once H > H*", fontsize=9)
    return fig


@paper
def prefix_bias_learned_figure(df):
    """The three sequence learners' q_t(C first) on theory's prefix-bias rows 1 and 3, one H below and one above H*."""
    learned = list(dict.fromkeys(_sel(df, part="learned").setting))
    fig = figure(TWO_COLUMNS, 2.9)
    axes = fig.subplots(1, len(learned))
    handles = {}
    for ax, setting in zip(np.atleast_1d(axes), learned):
        handles.update(_learned_panel(ax, df, setting, "theory " + setting.replace(", ", "\n", 1)))
        ax.axhline(0.5, color="grey", lw=0.7, ls=(0, (1, 3)))
    np.atleast_1d(axes)[0].set_ylabel("learned q_t(C first)")
    _learned_legend(fig, handles, (G_SEQ, L_LOCAL, MIXTURE))
    fig.suptitle("Prefix bias, learned: only the sequence-level RKL learner follows g to the incorrect prefix\n"
                 f"({BAND})", fontsize=8)
    return fig


FIGURES = {"confident-expert": (confident_expert_figure, confident_expert_learned_figure),
           "low-prob": (low_prob_figure, low_prob_learned_figure),
           "prefix-bias": (prefix_bias_figure, prefix_bias_learned_figure)}


def figures_from(folder):
    """{"mechanism_<name>": Figure, "mechanism_<name>_learned": Figure} for each mechanism CSV in ``folder``."""
    out = {}
    for name, (exact, learned) in FIGURES.items():
        path = os.path.join(folder, f"{name}.csv")
        if os.path.exists(path):
            df = pd.read_csv(path)
            out[f"mechanism_{name}"] = exact(df)
            out[f"mechanism_{name}_learned"] = learned(df)
    return out
