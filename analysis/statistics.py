"""Analysis of learner runs: round grids, fitted slopes of regret against ln t, summaries of q_T."""

import math

import numpy as np
import pandas as pd
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


def _window(t, decades, window):
    t = np.asarray(t, dtype=float)
    lo, hi = window if window is not None else (t.max() / 10.0 ** decades, t.max())
    keep = (t >= lo * (1 - 1e-12)) & (t <= hi * (1 + 1e-12))
    if keep.sum() < 2:
        raise ValueError(f"need at least two grid points in the fitted range [{lo:g}, {hi:g}]")
    return keep


def _t_interval(values, level):
    mean = float(np.mean(values))
    if values.size < 2:
        return mean, mean, mean
    half = stats.t.ppf(0.5 + level / 2, values.size - 1) * values.std(ddof=1) / math.sqrt(values.size)
    return mean, mean - float(half), mean + float(half)


def fit_slope(t, regret, decades=2.0, level=0.95, window=None):
    """Least-squares slope of regret against ln t, per seed, over t in [t_max / 10^decades, t_max] (or
    over ``window = (t_lo, t_hi)``): the constant c of R_T ≈ c ln T + b for logarithmic regret.

    Returns (mean slope, lower, upper): a Student-t interval over seeds (lower = upper = the slope
    with one seed). regret: (R, G) or (G,).
    """
    keep = _window(t, decades, window)
    x = np.log(np.asarray(t, dtype=float)[keep])
    r = np.atleast_2d(np.asarray(regret, dtype=float))[:, keep]
    xc = x - x.mean()
    return _t_interval(r @ xc / (xc @ xc), level)       # xc sums to 0: centring r changes nothing


def fit_exponent(t, regret, decades=2.0, level=0.95, window=None):
    """Least-squares slope of ln R_T against ln T, per seed (the exponent p of R_T ∝ T^p: 1 for linear
    regret, 1/2 for sqrt T), with a Student-t interval over seeds; NaN when some R_T <= 0 in the window."""
    keep = _window(t, decades, window)
    r = np.atleast_2d(np.asarray(regret, dtype=float))[:, keep]
    if np.any(r <= 0):
        return math.nan, math.nan, math.nan
    x = np.log(np.asarray(t, dtype=float)[keep])
    xc = x - x.mean()
    y = np.log(r)
    return _t_interval(y @ xc / (xc @ xc), level)


POWER_EXPONENT = 0.3      # a lower 95% bound above this: the regret grows like a power of T


def growth(t, regret, decades=2.0):
    """How the regret grows over the last ``decades`` of t, from the data.

    ``bounded``: the mean regret moves by less than 1e-6 (1 + |R_T|) over the window, or it converges
    (the slope on the last decade is under a quarter of the slope on the one before, and the exponent
    of R_T against T is below 0.05: increments that shrink like 1/t); a slope on ln t is then noise,
    not a constant. ``power``: the lower 95% bound of the exponent exceeds POWER_EXPONENT (logarithmic
    regret R = c ln T + b has a local exponent c / R, 0.1-0.3 here). ``logarithmic`` otherwise.
    Returns (label, slope triple, exponent triple).
    """
    t = np.asarray(t, dtype=float)
    r = np.atleast_2d(np.asarray(regret, dtype=float))
    keep = _window(t, decades, None)
    mean = r[:, keep].mean(axis=0)
    slope = fit_slope(t, r, decades)
    exponent = fit_exponent(t, r, decades)
    t_max = t.max()
    full_mean = r.mean(axis=0)
    early = fit_slope(t, full_mean, window=(t_max / 10.0 ** decades, t_max / 10.0))[0]
    late = fit_slope(t, full_mean, window=(t_max / 10.0, t_max))[0]
    converging = early > 0 and late < 0.25 * early and np.isfinite(exponent[2]) and exponent[2] < 0.05
    if abs(mean[-1] - mean[0]) <= 1e-6 * (1 + abs(mean[-1])) or converging:
        return "bounded", slope, exponent
    if np.isfinite(exponent[1]) and exponent[1] > POWER_EXPONENT:
        return "power", slope, exponent
    return "logarithmic", slope, exponent


def decade_slopes(t, regret, level=0.95):
    """fit_slope on each full decade [10^j, 10^(j+1)] inside the grid: {(lo, hi): (mean, lower, upper)}.
    Logarithmic regret has the same slope on every decade (within the intervals); a power law's grows."""
    t = np.asarray(t, dtype=float)
    out = {}
    for j in range(int(math.floor(math.log10(t.max()) + 1e-9))):
        lo, hi = 10.0 ** j, 10.0 ** (j + 1)
        if t.min() <= lo * (1 + 1e-12):
            out[(lo, hi)] = fit_slope(t, regret, level=level, window=(lo, hi))
    return out


def mean_interval(values, level=0.95):
    """Mean over seeds (axis 0) and its Student-t interval, each (G,): the bands of the figures."""
    v = np.atleast_2d(np.asarray(values, dtype=float))
    mean = v.mean(axis=0)
    if v.shape[0] < 2:
        return mean, mean, mean
    half = stats.t.ppf(0.5 + level / 2, v.shape[0] - 1) * v.std(axis=0, ddof=1) / math.sqrt(v.shape[0])
    return mean, mean - half, mean + half


def lower_frontier(x, y):
    """The lower frontier of points (x, y): x ascending and the least y among the points at or below each
    x (a running minimum), a step function."""
    order = np.argsort(x)
    return np.asarray(x)[order], np.minimum.accumulate(np.asarray(y)[order])


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


def variance_shares(df, factors, outcome, seed="seed", level=0.95):
    """Share of the variance of ``outcome`` over a balanced factorial design explained by each factor's
    main effect and by each pair's interaction (an ANOVA decomposition), per seed, with a Student-t
    interval over seeds.

    For cell means y (one per combination of ``factors``, averaged within the cell) with grand mean m:
    SS_F = sum_cells (m_F - m)^2, SS_FG = sum_cells (m_FG - m_F - m_G + m)^2 and the total
    sum_cells (y - m)^2; the 'higher order' term is what the main effects and pairs leave. A balanced
    design makes the terms orthogonal, so the shares sum to 1. Returns a DataFrame with term, share
    (mean over seeds), lo, hi and the number of seeds; ValueError if a seed's design is not a full,
    balanced factorial over ``factors``.
    """
    factors = list(factors)
    terms = [(f,) for f in factors] + [(f, g) for i, f in enumerate(factors) for g in factors[i + 1:]]
    per_seed = []
    for s, grp in df.groupby(seed):
        counts = grp.groupby(factors).size()
        levels = [grp[f].nunique() for f in factors]
        if counts.size != math.prod(levels) or counts.nunique() != 1:
            raise ValueError(f"seed {s}: the design over {factors} is not a full balanced factorial "
                             f"({counts.size} cells for {math.prod(levels)} combinations)")
        y = grp.groupby(factors, as_index=False)[outcome].mean()
        m = y[outcome].mean()
        total = float(((y[outcome] - m) ** 2).sum())
        shares = {}
        for term in terms:
            effect = y.groupby(list(term))[outcome].transform("mean") - m
            for sub in [(t,) for t in term] if len(term) == 2 else []:
                effect = effect - (y.groupby(list(sub))[outcome].transform("mean") - m)
            shares[" x ".join(term)] = float((effect ** 2).sum()) / total if total > 0 else 0.0
        shares["higher order"] = max(1.0 - sum(shares.values()), 0.0)
        per_seed.append(shares)
    rows = []
    for term in per_seed[0]:
        v = np.array([p[term] for p in per_seed])
        mean, lo, hi = _t_interval(v, level)
        rows.append(dict(term=term, share=mean, lo=max(lo, 0.0), hi=min(hi, 1.0), seeds=v.size))
    return pd.DataFrame(rows)
