"""The prefix-bias probe's figure (SPEC 6): a pure function of the margins DataFrame that
``llm_bridge.probe_prefix_bias.margins`` returns (horizon, scorer, margin, margin_low, margin_high)."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

POOLS = {"geometric": dict(color="C3", lw=2.2, marker="o", label="sequence-level geometric g (95% CI)"),
         "local_geometric": dict(color="C0", lw=1.5, marker="s", label="local geometric l"),
         "mixture": dict(color="C2", lw=1.5, marker="^", label="sequence-level mixture")}
TEACHER_MARKERS = ("v", "D", "P", "X", "*", "h")


def probe_figure(margins, title=""):
    """Each scorer's margin ln s(correct) - max ln s(incorrect) against the horizon H; > 0 prefers
    the correct option. Teachers dashed grey (one marker each), g with its 95% band."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    teachers = [s for s in dict.fromkeys(margins["scorer"]) if s not in POOLS]
    for j, name in enumerate(teachers):
        grp = margins[margins.scorer == name].sort_values("horizon")
        ax.plot(grp["horizon"], grp["margin"], color=str(0.35 + 0.4 * j / max(len(teachers) - 1, 1)), ls="--",
                lw=1.0, marker=TEACHER_MARKERS[j % len(TEACHER_MARKERS)], ms=4, label=f"teacher {name}")
    for scorer, style in POOLS.items():
        grp = margins[margins.scorer == scorer].sort_values("horizon")
        if grp.empty:
            continue
        ax.plot(grp["horizon"], grp["margin"], **style)
        if scorer == "geometric":
            ax.fill_between(grp["horizon"], grp["margin_low"], grp["margin_high"], color="C3", alpha=0.2, lw=0)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("horizon H (tokens sampled after the option)")
    ax.set_ylabel("margin: ln s(correct) − max ln s(incorrect)  (nats)", fontsize=8)
    ax.set_title(title or "prefix-bias probe", fontsize=9)
    ax.legend(fontsize=7, loc="best")
    ax.grid(alpha=0.3, lw=0.4)
    fig.tight_layout()
    return fig
