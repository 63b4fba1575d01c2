"""The pre-training diagnosis's figures (issue 33; theory section 1, 2, 6; T6, T7, T8), pure functions of the tables
``python sims/diagnose.py`` writes: ``positions.csv`` (one row per prompt x response x position),
``vetoes.csv`` (one row per vetoed token) and ``flip.csv`` (one row per prompt)."""

import math
import os

import numpy as np
import pandas as pd

from .style import BLUE, GREEN, ORANGE, TWO_COLUMNS, VERMILLION, figure, legend_below, paper

KIND_COLOURS = {"end": VERMILLION, "template": ORANGE, "text": "k"}
KIND_LABELS = {"end": "end token vetoed", "template": "template token vetoed", "text": "other token vetoed"}


def strip_rows(positions, n=8):
    """The (prompt, response) pairs a strip shows: those with an end or template veto first, then by the
    largest KL(A || l), at most ``n``."""
    g = positions.groupby(["id", "response"], sort=False)
    score = pd.DataFrame(dict(special=g.end_vetoes.sum() + g.template_vetoes.sum(), vetoes=g.vetoes.sum(),
                              kl=g.kl_a_l.max()))
    return list(score.sort_values(["special", "vetoes", "kl"], ascending=False).index[:n])


@paper
def strip_figure(positions, rows=None, vetoes=None):
    """One strip per (prompt, response): KL(A || l) at each position (bars, nats, one scale shared by every
    strip so that heights compare), a cross where the targets' argmaxes differ, and a mark above each position
    with a veto (red: the end token, orange: a chat-template token, black: another token), labelled with the
    vetoing teacher and the vetoed token when ``vetoes`` (the veto table) is given. Tick labels are the
    response's tokens with their whitespace visible (␣ a space, ⏎ a newline; every other one, or sparser, past
    90 positions)."""
    rows = strip_rows(positions) if rows is None else rows
    fig = figure(TWO_COLUMNS, 1.35 * max(len(rows), 1) + 0.6)
    axes = np.atleast_1d(fig.subplots(max(len(rows), 1), 1, squeeze=False).ravel())
    shown = positions[[key in set(rows) for key in zip(positions.id, positions.response)]]
    top = max(float(shown.kl_a_l.max()) if len(shown) else 0.0, 1e-3)
    for ax, (pid, resp) in zip(axes, rows):
        p = positions[(positions.id == pid) & (positions.response == resp)].sort_values("position")
        x = p.position.to_numpy()
        ax.bar(x, p.kl_a_l, color=BLUE, width=0.8, label="KL(A || l)")
        d = p[p.argmax_differs]
        ax.plot(d.position, np.full(len(d), -0.08 * top), "x", color=GREEN, ms=3, label="argmax A ≠ argmax l")
        for kind, colour in KIND_COLOURS.items():
            col = {"end": "end_vetoes", "template": "template_vetoes"}.get(kind)
            n = p[col] if col else p.vetoes - p.end_vetoes - p.template_vetoes
            v = p[n > 0]
            ax.plot(v.position, np.full(len(v), 1.12 * top), "v", color=colour, ms=4, label=KIND_LABELS[kind])
        named = ""
        if vetoes is not None and len(vetoes):
            named = _vetoes_named(vetoes[(vetoes["id"] == pid) & (vetoes.response == resp)],
                                  max(0, 105 - len(f"prompt {pid}, response of {resp}; vetoed: ")))
        ax.set_ylim(-0.15 * top, 1.25 * top)
        step = math.ceil(len(x) / 90) if len(x) else 1
        ax.set_xticks(x[::step])
        ax.set_xticklabels([_label(t) for t in p.token_text.fillna("")[::step]], rotation=90, fontsize=5)
        ax.set_xlim(-0.7, max(len(x), 1) - 0.3)
        ax.set_ylabel("nats", fontsize=7)
        ax.set_title(f"prompt {pid}, response of {resp}" + (f"; vetoed: {named}" if named else ""), fontsize=7,
                     loc="left")
    handles, labels = axes[0].get_legend_handles_labels()
    legend_below(fig, handles, labels, ncol=5)
    fig.suptitle(f"A and l teach different tokens at {int(positions.argmax_differs.sum())} of {len(positions)} positions; "
                 f"{int(positions.end_vetoes.sum())} end-token and {int(positions.template_vetoes.sum())} template-token "
                 f"vetoes;\nKL(A || l) along the {len(rows)} responses with the most end and template vetoes, then "
                 "vetoes, then KL (one scale for all)", fontsize=8)
    return fig


def _vetoes_named(vetoes, width=90):
    """'storyteller: <|im_end|> at 6; concise: ␣the at 2, 5 (+3 more)': who vetoes which token where, end and
    template tokens first, cut to about ``width`` characters (vetoes.csv has every one)."""
    rank = vetoes.kind.map({"end": 0, "template": 1, "text": 2})
    groups = (vetoes.assign(rank=rank, text=vetoes.token_text.fillna("").astype(str))
              .groupby(["rank", "teacher", "text"], sort=True).position.apply(lambda p: sorted(set(p))))
    items = [f"{t}: {_label(x)} at {', '.join(map(str, p[:3]))}{'…' * (len(p) > 3)}" for (_, t, x), p in groups.items()]
    shown = []
    for item in items:
        if len("; ".join(shown + [item])) > width:
            break
        shown.append(item)
    rest = len(items) - len(shown)
    return "; ".join(shown) + (f" (+{rest} more)" if rest else "")


def _label(token, width=12):
    """A token's text as a label: whitespace visible (␣ a space, ⏎ a newline, ⇥ a tab), other control
    characters escaped, at most ``width`` characters (… marks a cut)."""
    text = str(token).replace(" ", "␣").replace("\n", "⏎").replace("\t", "⇥")
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text) or "∅"
    return text if len(text) <= width else text[:width - 1] + "…"


def _empty(fig, ax, message, claim):
    """An empty table's figure: the message in the middle, no axes, the claim as the suptitle."""
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    fig.suptitle(claim, fontsize=8)
    return fig


@paper
def veto_figure(vetoes, n=15):
    """The most often vetoed tokens (positions x teachers), coloured by kind (end, template, other)."""
    fig = figure(TWO_COLUMNS / 2 + 0.5, 2.8)
    ax = fig.subplots()
    if vetoes.empty:
        return _empty(fig, ax, "no vetoes", "No teacher vetoes a token\nthe reference gives mass")
    label = vetoes.token_text.fillna("").astype(str).where(vetoes.token_text.fillna("").astype(str) != "",
                                                          vetoes.token.astype(str))
    counts = (vetoes.assign(label=label).groupby(["label", "kind"]).size().reset_index(name="count")
              .sort_values("count", ascending=False).head(n).iloc[::-1])
    ax.barh(np.arange(len(counts)), counts["count"], color=[KIND_COLOURS[k] for k in counts.kind])
    ax.set_yticks(np.arange(len(counts)))
    ax.set_yticklabels([_label(t, 20) for t in counts.label], fontsize=6)
    ax.set_xlabel("vetoes (positions x teachers)")
    from matplotlib.patches import Patch
    fig.legend(handles=[Patch(color=c, label=KIND_LABELS[k]) for k, c in KIND_COLOURS.items()],
               loc="outside lower center", ncol=3, fontsize=6)
    ax.set_title(f"the {len(counts)} tokens vetoed most often", fontsize=7)
    ax.grid(True, axis="x")
    kinds = vetoes.kind.value_counts()
    fig.suptitle(f"Teachers veto {len(vetoes)} times where the reference gives mass:\n{kinds.get('end', 0)} end-token, "
                 f"{kinds.get('template', 0)} template-token and {kinds.get('text', 0)} other vetoes", fontsize=8)
    return fig


@paper
def flip_figure(flips):
    """Each prompt's pooled margin m (x) against the drift of D(H) per token (y, 95% interval), with the
    flip boundary drift = m / H for each measured H > 0 (a prompt above the line of H would flip by H);
    red rings: a flip measured; red bars: where none was, the smallest drift the design detects at 80%
    power (no flip is detectable below it)."""
    fig = figure(TWO_COLUMNS / 2 + 0.5, 3.4)
    ax = fig.subplots()
    if flips.empty:
        return _empty(fig, ax, "no flip estimates", "Prefix flip risk (T8):\nno prompt has a flip estimate")
    x_max = max(float(flips.margin.max()), 0.5) * 1.05
    xs = np.linspace(0, x_max, 50)
    horizons = sorted(int(h) for h in str(flips.horizons.iloc[0]).split(",") if int(h) > 0)
    cmap = __import__("matplotlib").colormaps["viridis"]
    for j, h in enumerate(horizons):
        ax.plot(xs, xs / h, color=cmap(j / max(len(horizons) - 1, 1)), lw=0.8, ls="--", label=f"boundary H = {h}")
    ax.axhline(0, color="k", lw=0.6)
    ax.errorbar(flips.margin, flips.drift, yerr=[flips.drift - flips.drift_lo, flips.drift_hi - flips.drift], fmt="o",
                ms=3, color=BLUE, elinewidth=0.6, lw=0, label="prompt")
    f = flips[flips.flip]
    if len(f):
        ax.plot(f.margin, f.drift, "o", ms=6, mfc="none", mec=VERMILLION, label="flip measured")
    bound = flips[~flips.flip & np.isfinite(flips.detectable_drift)]
    if len(bound):
        ax.plot(bound.margin, bound.detectable_drift, "_", ms=8, mew=1.2, color=VERMILLION,
                label="no flip detectable below (80% power)")
    lo = min(float(flips.drift_lo.min()), -0.05)
    hi = max(float(flips.drift_hi.max()), float(bound.detectable_drift.max()) if len(bound) else 0.0, 0.05)
    ax.set_ylim(lo - 0.05 * (hi - lo), hi + 0.05 * (hi - lo))
    ax.set_xlim(min(float(flips.margin.min()), 0) - 0.1, x_max)
    ax.set_xlabel("pooled margin m (nats)")
    ax.set_ylabel("drift of D(H) per token (nats)")
    fig.legend(loc="outside lower center", ncol=3, fontsize=6)
    ax.grid(True)
    fig.suptitle(f"Prefix flip risk (T8): {int(flips.flip.sum())} of {len(flips)} prompts flip measurably by H = "
                 f"{max(horizons, default=0)};\nred bars: no flip is detectable below them (80% power)", fontsize=8)
    return fig


def figures_from(folder):
    """{"diagnosis_strips", "diagnosis_vetoes", "diagnosis_flip"} from a diagnose run's CSVs."""
    positions = pd.read_csv(os.path.join(folder, "positions.csv"), keep_default_na=False, na_values=[""])
    positions["token_text"] = positions.token_text.fillna("")
    vetoes = pd.read_csv(os.path.join(folder, "vetoes.csv"), keep_default_na=False, na_values=[""])
    out = {"diagnosis_strips": strip_figure(positions, vetoes=vetoes), "diagnosis_vetoes": veto_figure(vetoes)}
    flip = os.path.join(folder, "flip.csv")
    if os.path.exists(flip):
        out["diagnosis_flip"] = flip_figure(pd.read_csv(flip))
    return out
