"""Analysis of learner runs: round grids, fitted slopes of regret against ln t, summaries of q_T."""

import math

import numpy as np
from scipy import stats

from aggregation.validate import check_int


def log_grid(n_rounds, per_decade=10):
    """Rounds 1..n_rounds on a log grid: unique rounded 10^(j / per_decade), always ending at n_rounds."""
    n_rounds = check_int(n_rounds, "n_rounds", 1)
    top = math.log10(n_rounds)
    pts = np.unique(np.round(10.0 ** np.arange(0.0, top + 1e-12, 1.0 / per_decade)).astype(np.int64))
    pts = pts[pts <= n_rounds]
    if pts[-1] != n_rounds:
        pts = np.append(pts, n_rounds)
    return pts


def fit_slope(t, regret, decades=2.0, level=0.95):
    """Least-squares slope of regret against ln t over t in [t_max / 10^decades, t_max], per seed.

    Returns (mean slope, lower, upper): a Student-t interval over seeds (lower = upper = the slope
    with one seed). regret: (R, G) or (G,).
    """
    t = np.asarray(t, dtype=float)
    r = np.atleast_2d(np.asarray(regret, dtype=float))
    keep = t >= t.max() / 10.0 ** decades - 1e-9
    if keep.sum() < 2:
        raise ValueError("fit_slope needs at least two grid points in the fitted range")
    x = np.log(t[keep])
    xc = x - x.mean()
    slopes = (r[:, keep] - r[:, keep].mean(axis=1, keepdims=True)) @ xc / (xc @ xc)
    mean = float(slopes.mean())
    if slopes.size < 2:
        return mean, mean, mean
    half = stats.t.ppf(0.5 + level / 2, slopes.size - 1) * slopes.std(ddof=1) / math.sqrt(slopes.size)
    return mean, mean - float(half), mean + float(half)


def rounds_to_veto(q, grid):
    """First round from which q_t(correct) < 1/2 at every later round of ``grid`` (a dense grid 1..T);
    NaN where q_T >= 1/2 (not vetoed by the end). q: (R, G); returns (R,)."""
    above = np.asarray(q) >= 0.5
    G = above.shape[1]
    last = np.where(above.any(axis=1), G - 1 - np.argmax(above[:, ::-1], axis=1), -1)
    rounds = np.asarray(grid)[np.minimum(last + 1, G - 1)].astype(float)
    rounds[above[:, -1]] = np.nan
    return rounds


def final_values(df):
    """Learned q_T at the last round, mean and s.d. over seeds, beside each target; one row per
    (setting, learner)."""
    learned = df[df.part == "learned"]
    last = learned[learned.t == learned.groupby(["setting", "learner"]).t.transform("max")]
    summary = last.groupby(["setting", "learner"], sort=False).agg(T=("t", "max"), mean=("value", "mean"),
                                                                   sd=("value", "std")).reset_index()
    summary["T"] = summary["T"].astype(int)
    targets = {}
    for row in df[df.part == "target"].itertuples():
        targets.setdefault(row.setting, []).append(f"{row.learner}={row.value:.4g}")
    summary["targets"] = summary.setting.map(lambda s: "; ".join(targets.get(s, [])))
    return summary
