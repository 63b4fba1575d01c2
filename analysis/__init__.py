"""Statistics of experiment outputs: round grids, fitted slopes of regret against ln t, intervals over
seeds, summaries of q_T, a balanced-factorial ANOVA (``variance_shares``), and verdicts from stated decision rules
(``analysis.verdicts``: effect and bound verdicts, power, MDE, TOST, cluster bootstrap)."""

from .statistics import (POWER_EXPONENT, decade_slopes, final_values, fit_exponent, fit_slope, growth, log_grid,
                         lower_frontier, mean_interval, rounds_to_veto, variance_shares)

__all__ = ["log_grid", "fit_slope", "fit_exponent", "growth", "decade_slopes", "mean_interval", "lower_frontier", "rounds_to_veto",
           "final_values", "variance_shares", "POWER_EXPONENT"]
