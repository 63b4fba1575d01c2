"""The house style of every figure: sized for a paper (one column 3.5 in, two columns 7 in) at 8-9 pt,
bands that are 95% intervals of the mean over seeds, legends outside the data, colours from the
colour-blind-safe Okabe-Ito palette (Okabe & Ito 2008; ordered quantities use viridis-like sequential maps),
and a suptitle that states what the figure shows.

Builders are decorated with :func:`paper`, which applies the style while the Figure is made (text
sizes are fixed when an artist is created) without touching matplotlib's global settings.
"""

import functools

import matplotlib
import numpy as np
from cycler import cycler
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatterSciNotation

# The Okabe-Ito palette: eight colours told apart under the common colour-vision deficiencies.
BLACK, ORANGE, SKY, GREEN, YELLOW, BLUE, VERMILLION, PURPLE = (
    "#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7")
GREY = "#999999"
PALETTE = (BLUE, ORANGE, GREEN, VERMILLION, PURPLE, SKY, YELLOW, BLACK)   # categorical order (yellow late: pale)

ONE_COLUMN, TWO_COLUMNS = 3.5, 7.0           # inches
RC = {
    "font.size": 8, "axes.titlesize": 8, "axes.labelsize": 8, "xtick.labelsize": 7, "ytick.labelsize": 7,
    "legend.fontsize": 7, "legend.title_fontsize": 7, "figure.titlesize": 9, "axes.linewidth": 0.6,
    "lines.linewidth": 1.3, "lines.markersize": 4, "grid.linewidth": 0.4, "grid.alpha": 0.35,
    "xtick.major.width": 0.6, "ytick.major.width": 0.6, "legend.frameon": False, "legend.handlelength": 1.8,
    "axes.titlepad": 3.0, "axes.prop_cycle": cycler(color=PALETTE), "figure.constrained_layout.h_pad": 0.03, "figure.constrained_layout.w_pad": 0.03,
}
BAND = "band: 95% interval of the mean over seeds"


def paper(build):
    """Run a figure builder under the house style."""
    @functools.wraps(build)
    def styled(*args, **kwargs):
        with matplotlib.rc_context(RC):
            return build(*args, **kwargs)
    return styled


def figure(width=TWO_COLUMNS, height=2.4, **kwargs):
    """A constrained-layout Figure of the given size in inches (no pyplot, no global state)."""
    return Figure(figsize=(width, height), layout="constrained", **kwargs)


def colours(names):
    """A stable colour per name from :data:`PALETTE`, in order of first appearance."""
    return {name: PALETTE[i % len(PALETTE)] for i, name in enumerate(dict.fromkeys(names))}


def mean_band(ax, x, values, colour, label=None, lw=1.4, **kwargs):
    """The mean over seeds (rows of ``values``) and its 95% interval as a band; returns the line."""
    from analysis import mean_interval
    mean, lo, hi = mean_interval(values)
    line, = ax.plot(x, mean, color=colour, lw=lw, label=label, **kwargs)
    if np.atleast_2d(values).shape[0] > 1:
        ax.fill_between(x, lo, hi, color=colour, alpha=0.22, lw=0)
    return line


def legend_below(fig, handles, labels, ncol=3, title=None):
    """One legend for the whole figure, under the panels."""
    fig.legend(handles, labels, loc="outside lower center", ncol=ncol, title=title, columnspacing=1.2)


def log_axes(ax, x=True, y=False):
    log_scale(ax, x, y)
    ax.grid(True, which="major")


class SparseMinorLabels(LogFormatterSciNotation):
    """Minor-tick labels of a log axis only where it spans under 1.5 decades, and then only at 2 and 5 times a
    power of ten (matplotlib's default labels up to eight per decade, which collide on a narrow panel)."""

    def __init__(self):
        super().__init__(labelOnlyBase=False, minor_thresholds=(np.inf, np.inf))

    def __call__(self, x, pos=None):
        lo, hi = sorted(self.axis.get_view_interval())
        if x <= 0 or lo <= 0 or np.log10(hi / lo) > 1.5:
            return ""
        mantissa = x / 10 ** np.floor(np.log10(x) + 1e-9)
        return super().__call__(x, pos) if np.isclose(mantissa, (2, 5)).any() else ""


def log_scale(ax, x=True, y=False):
    """Log x and/or y axes with :class:`SparseMinorLabels`."""
    for on, axis in ((x, ax.xaxis), (y, ax.yaxis)):
        if on:
            (ax.set_xscale if axis is ax.xaxis else ax.set_yscale)("log")
            axis.set_minor_formatter(SparseMinorLabels())
