"""The top-k tail treatments' bias against k (sims.topk_bias): a pure function of topk_bias.csv."""

import os

import pandas as pd

from .style import BAND, PALETTE, TWO_COLUMNS, figure, legend_below, log_axes, paper

TAIL_LABELS = {"tail": "k + 1 categories (exact tail)", "renormalize": "renormalise on the top k",
               "uniform": "tail spread uniformly", "truncate": "truncated sum, clamped at 0"}


@paper
def topk_bias_figure(table):
    """Bias of each treatment (top-k loss minus full-vocabulary loss, mean over positions with its 95%
    interval) against k, forward KL and reverse KL side by side; a symlog y axis keeps both signs."""
    fig = figure(TWO_COLUMNS, 2.9)
    axes = fig.subplots(1, 2)
    for ax, kind in zip(axes, ("forward", "reverse")):
        sub = table[table.kind == kind]
        for i, (tail, label) in enumerate(TAIL_LABELS.items()):
            s = sub[sub["tail"] == tail].sort_values("k")
            if s.empty:
                continue
            ax.plot(s.k, s.bias, "o-", ms=2.5, color=PALETTE[i], label=label)
            ax.fill_between(s.k, s.bias_lo, s.bias_hi, color=PALETTE[i], alpha=0.2, lw=0)
        ax.axhline(0.0, color="black", lw=0.7)
        log_axes(ax)
        ax.set_yscale("symlog", linthresh=1e-3)
        ax.set_xlabel("k, teacher tokens kept")
        ax.set_ylabel("top-k minus full loss (nats)")
        full = float(sub.full.iloc[0]) if len(sub) else float("nan")
        ax.set_title(f"{kind} KL (full vocabulary: {full:.3g} nats per token)")
    handles, labels = axes[0].get_legend_handles_labels()
    legend_below(fig, handles, labels, ncol=4)
    fig.suptitle("Top-k teachers: the exact tail (k + 1 categories) never overestimates the KL (data processing);\n"
                 f"the bias of each tail treatment against k, two personas of one model ({BAND.replace('seeds', 'positions')})",
                 fontsize=8)
    return fig


def figures_from(folder):
    return {"topk_bias": topk_bias_figure(pd.read_csv(os.path.join(folder, "topk_bias.csv")))}
