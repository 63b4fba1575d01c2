"""docs/mutation.md from the last `mutmut run` (`make mutate` writes it): per mutated file, how many
mutants were killed, survived, timed out or had no covering test, and each survivor with the reason it
is equivalent (EQUIVALENT below) or marked 'unexplained' (a missing test or dead code to remove).

    python tests/mutation_report.py PATTERN ... > docs/mutation.md

PATTERNs are the Makefile's MUTATE globs (mutmut's mutant names, e.g. 'sims.rlvr.x_verdicts*'): only the
mutants they select are counted (mutmut mutates whole files; the rest of a file is not under test here).
"""

import collections
import fnmatch
import re
import subprocess
import sys

# mutant name -> why no test can tell it from the original (an equivalent mutant). Every other survivor
# is unexplained: a test that pins its meaning is missing.
_FLOAT_ARRAY = ("np.asarray(..., dtype=float) -> dtype=None or no dtype: the array enters float arithmetic or a "
                "comparison at once (np.log, @ with a float vector, <= a float), so int or float input gives the same "
                "result")
_Q_SQUARED = "the sign of Fieller's quantile q: q enters only as q ** 2, and ppf(0.5 - level / 2) = -ppf(0.5 + level / 2)"
_BRACKET = ("the search bracket: bisection from any lo with power(lo) < target (lo is never evaluated) to any hi with "
            "power(hi) >= target finds the same first count, t_power being increasing in the number of clusters")
_FALSY = ("an argument None in place of False: the callee reads it only for truth (`if at_most`, `if quick`), "
          "and None is falsy")
_NAN_SEPARATION = ("separation None in place of np.nan: row() passes np.asarray(None, dtype=float), which is NaN, "
                   "the same 'no candidates named' as np.nan")
_MDE_BRACKET = ("_unit_mde's search bracket (t_mde_80 scales its root): brentq finds the one root of power(d) - target on [0, hi] from any hi "
                "with power(hi) >= target (power increasing in the effect), to its tolerance of 2e-12")
_TEN_THOUSAND = ("the switch from .2g to .3g at 1e4: |x| in [1e4, 10001) prints as 1e+04 in both formats, so "
                 "`< 1e4`, `<= 1e4` and `< 10001` print alike")
_RATIO_FLOAT = ("np.asarray(log_ratios, dtype=float) -> dtype=None or no dtype: log_ratios are read only by len() and "
                "analysis.mean_interval, which casts to float itself")
_CONCAT_INDEX = ("pd.concat([df, neural]) keeping the frames' own (overlapping) index: per_seed and pick compare "
                 "identically indexed columns and select by masks; no label of that index is read")
_CONCAT_NONE = ("pd.concat([df, None]) where neural is None: pandas drops the None, and the fresh index is read "
                "by no label (see _CONCAT_INDEX)")
_DRAW_ORDER = ("pd.DataFrame(rows) without columns=DRAW_COLUMNS: rows is never empty and its first row comes from "
               "draw_row, whose dict has exactly DRAW_COLUMNS in that order")
_TABLE_INDEX = ("the per-draw table's index without ignore_index: verdict_draws.csv is written without the index "
                "(write_csv) and no caller reads it")
_COV_DDOF = ("np.cov(..., ddof=1) -> ddof=None or no ddof: numpy's default (bias=False) divides by n - 1 as "
             "ddof=1 does")
EQUIVALENT = {
    "analysis.verdicts.x_decide_draws__mutmut_4": _FLOAT_ARRAY,
    "analysis.verdicts.x_decide_draws__mutmut_6": _FLOAT_ARRAY,
    "analysis.verdicts.x_decide_draws__mutmut_21": _FLOAT_ARRAY,
    "analysis.verdicts.x_decide_draws__mutmut_23": _FLOAT_ARRAY,
    "analysis.verdicts.x_decide_draws__mutmut_37": _FLOAT_ARRAY,
    "analysis.verdicts.x_decide_draws__mutmut_39": _FLOAT_ARRAY,
    "analysis.verdicts.x_decide_draws__mutmut_9": "None given: np.asarray(None, dtype=float) broadcasts to NaN, the same as np.full(n, nan)",
    "analysis.verdicts.x_decide_draws__mutmut_25": "None given: np.asarray(None, dtype=float) broadcasts to NaN, the same as np.full(n, nan)",
    **{f"analysis.verdicts.x_draw_verdict__mutmut_{n}": (
        "the properties' values as read (dtype None) for float: draw_verdict only indexes them and hands them to "
        "separating_condition and separation_p, which cast each to float themselves") for n in (20, 22)},
    **{f"analysis.verdicts.x__splits__mutmut_{n}": (
        "argsort's kind (None, default, 'STABLE' for 'stable'): a set of k units is added only when strictly "
        "separated from the rest, so which of several tied values sorts first never changes the sets")
       for n in (3, 5, 7)},
    "analysis.verdicts.x_median_lower_bound__mutmut_25": (
        "k <= n for k < n: at k = n, P(Binomial(n, 1/2) <= n) = 1 > 1 - level for every level in (0, 1), so the "
        "loop's second test stops it there"),
    "analysis.verdicts.x_tost_power__mutmut_40": (
        "the upper cap of V's normal score at 10 for 9: beyond z = 9 the integrand is below pdf(9) ~ 1e-18, and the "
        "96 nodes over the longer range integrate to within the stated 1e-8 (the adaptive-quadrature test's 1e-7)"),
    **{f"analysis.verdicts.x_tost_power__mutmut_{n}": (
        "the early return at top < -9 (or <= -10) for <= -9: with top <= -9 every node lies in [top, -9], at or "
        "above the score where the bracket reaches 0, so max(inside, 0) = 0 at each: 0 (or -0.0) either way") for n in (41, 43)},
    **{f"analysis.verdicts.x_tost_clusters_for_power__mutmut_{n}": (
        "the search bracket: bisection from any lo with power(lo) < target (lo is never evaluated) to any hi with "
        "power(hi) >= target finds the same first count, tost_power being increasing in the number of clusters")
       for n in (23, 24, 29)},
    "analysis.verdicts.x_tost_clusters_for_power__mutmut_19": (
        "power > target for >= target: a quadrature equal to the target to the last bit is a rounding "
        "coincidence"),
    "analysis.statistics.x__window__mutmut_3": _FLOAT_ARRAY,
    "analysis.statistics.x__window__mutmut_5": _FLOAT_ARRAY,
    "analysis.statistics.x_fit_slope__mutmut_13": _FLOAT_ARRAY,
    "analysis.statistics.x_fit_slope__mutmut_15": _FLOAT_ARRAY,
    "analysis.statistics.x_fit_slope__mutmut_19": _FLOAT_ARRAY,
    "analysis.statistics.x_fit_slope__mutmut_21": _FLOAT_ARRAY,
    "analysis.statistics.x_log_grid__mutmut_28": ("arange up to top + 1 instead of top + 1e-12: the points added "
                                                  "exceed n_rounds (or round to it, which unique() merges) and "
                                                  "`pts <= n_rounds` drops them"),
    **{f"distillation.continual.x_outcome_row__mutmut_{n}": (
        "Evaluator(B, fixed_points=True/None/default): fixed_points adds only kl_fixed_point to the evaluation "
        "(a solve, then unused); outcome_row reads kl_<objective's target>, kl_arithmetic and accuracy")
       for n in (9, 11, 12)},
    "analysis.statistics.x_variance_shares__mutmut_25": "groupby(as_index=None): pandas reads the falsy None as False",
    "analysis.verdicts.x_count_verdict__mutmut_4": _FLOAT_ARRAY,
    "sims.rollout_spectrum.x_steps_to__mutmut_5": "pd.Series(dtype=None): np.where(..., np.inf) is float64 already",
    "sims.rollout_spectrum.x_steps_to__mutmut_8": "pd.Series without dtype: np.where(..., np.inf) is float64 already",
    # convergence_rows numbered as mutmut numbers the code after the dead reindex was removed (83 -> 79, ...)
    "sims.rollout_spectrum.x_convergence_rows__mutmut_7": ("c.H.iloc[1] for iloc[0]: the convergence experiment runs "
                                                           "one H (CONVERGENCE['H']), on every row of its frame"),
    "sims.rollout_spectrum.x_convergence_rows__mutmut_79": _FALSY,
    "sims.rollout_spectrum.x_convergence_rows__mutmut_188": _FALSY,
    "sims.rollout_spectrum.x_convergence_rows__mutmut_209": _NAN_SEPARATION,
    "sims.rollout_spectrum.x_convergence_rows__mutmut_210": _FALSY,
    "sims.rollout_spectrum.x_convergence_rows__mutmut_233": _NAN_SEPARATION,
    "sims.rollout_spectrum.x_convergence_rows__mutmut_234": _FALSY,
    "sims.rollout_spectrum.x_by_draw__mutmut_3": "pd.Series(dtype=None) of float() values: float64 already (empty: returned before)",
    "sims.rollout_spectrum.x_by_draw__mutmut_5": "pd.Series without dtype of float() values: float64 already (empty: returned before)",
    "sims.rollout_spectrum.x_by_draw__mutmut_20": "the name of the seed level: never read (the series is grouped by task_seed)",
    "sims.rollout_spectrum.x_by_draw__mutmut_21": "the name of the seed level: never read (the series is grouped by task_seed)",
    "sims.rollout_spectrum.x_per_seed__mutmut_3": ("student == 'exact' never matching: run_tasks writes SFT's exact fixed points at step = steps, the last "
                                                     "evaluation, alone in their seed -1 group, so final() keeps them anyway"),
    "sims.rollout_spectrum.x_per_seed__mutmut_4": ("student == 'exact' never matching: run_tasks writes SFT's exact fixed points at step = steps, the last "
                                                     "evaluation, alone in their seed -1 group, so final() keeps them anyway"),
    "sims.estimators.x_growth_slopes__mutmut_17": "Series.to_numpy(None) for float: polyfit casts H to float itself",
    "sims.estimators.x_growth_slopes__mutmut_18": "Series.to_numpy(None) for float: ln E[w^2] is a float column already",
    "analysis.verdicts.x_count_verdict__mutmut_6": _FLOAT_ARRAY,
    # forgetting / analysis / figures.verdicts (issues 28, 29)
    "analysis.statistics.x_fit_exponent__mutmut_13": _FLOAT_ARRAY,
    "analysis.statistics.x_fit_exponent__mutmut_15": _FLOAT_ARRAY,
    "analysis.statistics.x_fit_exponent__mutmut_22": _FLOAT_ARRAY,
    "analysis.statistics.x_fit_exponent__mutmut_24": _FLOAT_ARRAY,
    "analysis.statistics.x_mean_interval__mutmut_5": ("np.asarray(values, dtype=float) -> dtype=None or no dtype: "
                                                      "values are read only through .mean and .std, float for int "
                                                      "or bool input alike"),
    "analysis.statistics.x_mean_interval__mutmut_7": ("np.asarray(values, dtype=float) -> dtype=None or no dtype: "
                                                      "values are read only through .mean and .std, float for int "
                                                      "or bool input alike"),
    "analysis.verdicts.x_fieller__mutmut_14": _Q_SQUARED,
    "analysis.verdicts.x_fieller__mutmut_23": _Q_SQUARED,
    "analysis.verdicts.x_clusters_for_power__mutmut_32": _BRACKET + " (hi = 3)",
    "analysis.verdicts.x_clusters_for_power__mutmut_37": _BRACKET + " (tripling instead of doubling)",
    "analysis.verdicts.x__unit_mde__mutmut_16": _MDE_BRACKET + " (hi = 2)",
    "analysis.verdicts.x__unit_mde__mutmut_18": _MDE_BRACKET + " (doubling also while power(hi) == target exactly)",
    "analysis.verdicts.x__unit_mde__mutmut_22": _MDE_BRACKET + " (tripling instead of doubling)",
    "figures.verdicts.x__number__mutmut_9": _TEN_THOUSAND,
    "figures.verdicts.x__number__mutmut_10": _TEN_THOUSAND,
    "figures.verdicts.x_gallery_table__mutmut_18": ("len % 2 -> len / 2: an even count of captions then gets an empty "
                                                    "one appended at an even index, which zip(captions[::2], "
                                                    "captions[1::2]) drops; odd counts append as before"),
    "figures.verdicts.x_markdown_table__mutmut_5": "itertuples(index=None): pandas reads the falsy None as False",
    "figures.verdicts.x_markdown_table__mutmut_6": ("itertuples(index=True) adds an Index field, but the rows are read "
                                                    "by column name only"),
    "figures.verdicts.x_replace_block__mutmut_9": ("stop <= start: stop == start needs the end marker found where the "
                                                   "begin marker is, one a prefix of the other, and no pair of markers "
                                                   "(BEGIN/END, GALLERY_BEGIN/GALLERY_END) is"),
    "figures.verdicts.x_verdict_text__mutmut_16": ("condition_p default None for NaN: both fail `isinstance(p, "
                                                   "float) and p == p`, so a row without the column shows the "
                                                   "condition alone"),
    "figures.verdicts.x_verdict_text__mutmut_5": ("stated_condition default None for '': both fail "
                                                  "`isinstance(condition, str) and condition`"),
    "sims.forgetting.x_ratio_row__mutmut_3": _RATIO_FLOAT,
    "sims.forgetting.x_ratio_row__mutmut_5": _RATIO_FLOAT,
    "sims.forgetting.x_frontier_rows__mutmut_6": "groupby(sort=None): pandas reads the falsy None as False",
    "sims.forgetting.x_verdicts__mutmut_20": ("shares(..., student=None): the student column only labels the table; "
                                              "verdicts() reads its term, share, lo, hi and seeds"),
    "sims.forgetting.x_precision_rows__mutmut_53": _FALSY + " (bound_verdict: `if not at_most`)",
    "analysis.verdicts.x_fieller__mutmut_13": _Q_SQUARED,
    "analysis.verdicts.x_fieller__mutmut_22": _Q_SQUARED,
    "analysis.verdicts.x_clusters_for_power__mutmut_30": _BRACKET + " (lo = 2: read only after enough(2) failed)",
    "analysis.verdicts.x_clusters_for_power__mutmut_31": _BRACKET + " (hi = 3)",
    "analysis.verdicts.x_clusters_for_power__mutmut_36": _BRACKET + " (tripling instead of doubling)",
    # sims.rollout_spectrum / sims.estimators (issue 28)
    # verdicts of sims.rollout_spectrum numbered as mutmut numbers the code after convergence_rows' dead
    # `tables` parameter was removed (its two mutants, 625 and 630, went with it: 633 -> 631, 638 -> 636, ...)
    "sims.rollout_spectrum.x_per_seed__mutmut_29": "groupby(dropna=None): pandas reads the falsy None as False",
    "sims.rollout_spectrum.x_verdicts__mutmut_4": _CONCAT_NONE,
    "sims.rollout_spectrum.x_verdicts__mutmut_8": _CONCAT_INDEX,
    "sims.rollout_spectrum.x_verdicts__mutmut_10": _CONCAT_INDEX,
    "sims.rollout_spectrum.x_verdicts__mutmut_11": _CONCAT_INDEX,
    "sims.rollout_spectrum.x_verdicts__mutmut_29": ("draw_sep.reindex(None) for reindex(draws): row() reindexes "
                                                    "draw_sep and every Series separation by its units before reading them"),
    "sims.rollout_spectrum.x_verdicts__mutmut_104": _FLOAT_ARRAY,
    "sims.rollout_spectrum.x_verdicts__mutmut_106": _FLOAT_ARRAY,
    "sims.rollout_spectrum.x_verdicts__mutmut_398": ("own property given where no fixed point is derived: fp is "
                                                     "then NaN on every draw, and separating_condition skips a "
                                                     "property with a NaN"),
    "sims.rollout_spectrum.x_verdicts__mutmut_410": _FALSY,
    "sims.rollout_spectrum.x_verdicts__mutmut_581": _NAN_SEPARATION,
    "sims.rollout_spectrum.x_verdicts__mutmut_582": _FALSY,
    "sims.rollout_spectrum.x_verdicts__mutmut_631": "functools.partial(row, tree=None): row reads tree only for truth",
    "sims.rollout_spectrum.x_verdicts__mutmut_636": _DRAW_ORDER,
    "sims.rollout_spectrum.x_verdicts__mutmut_638": _DRAW_ORDER,
    "sims.rollout_spectrum.x_verdicts__mutmut_641": _TABLE_INDEX,
    "sims.rollout_spectrum.x_verdicts__mutmut_643": _TABLE_INDEX,
    "sims.rollout_spectrum.x_verdicts__mutmut_644": _TABLE_INDEX,
    "sims.estimators.x_verdicts__mutmut_21": _FLOAT_ARRAY + " (the spread level holds SPREADS, floats)",
    "sims.estimators.x_verdicts__mutmut_23": _FLOAT_ARRAY + " (the spread level holds SPREADS, floats)",
    "sims.estimators.x_verdicts__mutmut_85": _FALSY,
    "sims.estimators.x_verdicts__mutmut_242": _FALSY,
    "sims.estimators.x_verdicts__mutmut_323": _FALSY,
    "sims.estimators.x_verdicts__mutmut_141": ("gap.xs(tau, level=None): xs reads the first index level, which is "
                                               "'spread' (gap is indexed by spread, pair)"),
    "sims.estimators.x_verdicts__mutmut_143": ("gap.xs(tau) without level: xs reads the first index level, which is "
                                               "'spread' (gap is indexed by spread, pair)"),
    "sims.estimators.x_verdicts__mutmut_179": "Series.astype(None) of booleans: numpy's dtype(None) is float64",
    "sims.estimators.x_verdicts__mutmut_344": _DRAW_ORDER,
    "sims.estimators.x_verdicts__mutmut_346": _DRAW_ORDER,
    # sims.rlvr (issue 29)
    **{f"sims.rlvr.x_{f}__mutmut_{n}": ("groupby(sort=None): pandas reads the falsy None as sort=False, the "
                                         "order of first appearance")
       for f, n in (("verdicts", 5), ("e4_table", 5), ("e4_table", 47), ("_e6_rows", 3), ("_reverse_rows", 3),
                    ("e6_table", 8), ("e6_runs", 44), ("e6_runs", 51))},
    **{f"sims.rlvr.x_{f}__mutmut_{n}": ("np.asarray without dtype=float: the values are floats (OOD accuracies, "
                                         "log cost ratios, token costs) or ints that enter true division, np.log, a "
                                         "groupby mean or a comparison, which give the same floats")
       for f, n in (("task_clustered", 5), ("task_clustered", 7), ("_share_row", 7), ("_share_row", 9),
                    ("_share_row", 13), ("_share_row", 15), ("crossing_cost", 3), ("crossing_cost", 5),
                    ("crossing_cost", 7), ("crossing_cost", 9))},
    **{f"sims.rlvr.x_{f}__mutmut_{n}": 'float("NAN") for float("nan"): Python reads both as NaN'
       for f, n in (("task_clustered", 23), ("crossing_cost", 17), ("_last_at_most", 12))},
    **{f"sims.rlvr.x_{f}__mutmut_{n}": ("effect_verdict(lo, hi, 1) without its margin 0.0: the default margin "
                                         "is 0.0")
       for f, n in (("verdicts", 122), ("_e6_rows", 107))},
    **{f"sims.rlvr.x_{f}__mutmut_{n}": ("at_most=None for False: bound_verdict and count_verdict read it only "
                                         "for truth, and None is falsy")
       for f, n in (("_share_row", 110), ("_reverse_rows", 20))},
    **{f"sims.rlvr.x_{f}__mutmut_{n}": ("a test on one task (n = 1) as if it had more: task_clustered's se is "
                                         "NaN there (the std of one task mean), so `se > 0` is False all the same")
       for f, n in (("verdicts", 63), ("_t_tests", 12))},
    **{f"sims.rlvr.x__share_row__mutmut_{n}": _COV_DDOF for n in (34, 37, 56, 59)},
    "sims.rlvr.x_verdicts__mutmut_196": ("'does not reproduce' at lo >= 0 for lo > 0: lo is a t-interval's lower "
                                         "bound est - t se, exactly 0 only where est = t se to the last bit"),
    "sims.rlvr.x_verdicts__mutmut_349": ("the E6 columns a proper subset (<) of the curves' columns for a subset "
                                         "(<=): the curves also hold method, seed, task and step (E4 reads them "
                                         "above), so the five are never all of them"),
    **{f"distillation.continual.x_update_sparsity__mutmut_{n}": (
        "dims = tuple(range(1, ndim)) also at ndim = 1: the empty tuple, and torch's mean over dim=() reduces "
        "every dimension, as (0,) does for a vector") for n in (16, 23)},
    # analysis.statistics.growth / decade_slopes (issue 28: first mutated once tests called them)
    **{f"analysis.statistics.x_{f}__mutmut_{n}": _FLOAT_ARRAY
       for f, n in (("decade_slopes", 4), ("decade_slopes", 6), ("growth", 4), ("growth", 6), ("growth", 10),
                    ("growth", 12))},
    "analysis.statistics.x_decade_slopes__mutmut_21": ("t.min() < lo (1 + 1e-12) for <=: a grid point at lo is "
                                                       "inside both; t.min() equal to lo (1 + 1e-12) itself only "
                                                       "by a rounding coincidence"),
    **{f"analysis.statistics.x_growth__mutmut_{n}": ("fit_slope(...)[1] for [0] on full_mean: one curve (a single "
                                                      "seed), whose triple is (slope, slope, slope)") for n in (52, 62)},
    "analysis.statistics.x_growth__mutmut_67": ("early >= 0 for > 0: a least-squares slope is 0 to the last bit only "
                                                "for R = 0 on the early decade (a constant c != 0 leaves c sum(x - "
                                                "mean x) ~ 1e-16 c), and R = 0 makes the exponent NaN, so converging "
                                                "is False either way"),
    **{f"analysis.statistics.x_growth__mutmut_{n}": ("a threshold test with equality (late <= early / 4, exponent "
                                                      "<= 0.05, exponent >= 0.3): the two sides are computed "
                                                      "least-squares slopes, equal to the last bit only by coincidence")
       for n in (69, 75, 97)},
    "analysis.statistics.x_growth__mutmut_95": ("np.isfinite(exponent[2]) for [1]: fit_exponent's bounds are NaN "
                                                "together (some R_T <= 0 makes the whole triple NaN) or finite together"),
    # llm_bridge.horizon (issue 30)
    **{f"llm_bridge.horizon.x_{f}__mutmut_{n}": _FLOAT_ARRAY
       for f, n in (("fit_drift", 3), ("fit_drift", 5), ("fit_drift", 8), ("fit_drift", 10), ("fit_drift", 13),
                    ("fit_drift", 15), ("first_significant_flip", 3), ("first_significant_flip", 5),
                    ("exact_flip_horizon", 5), ("exact_flip_horizon", 7), ("log_partition_curve", 3),
                    ("log_partition_curve", 5), ("detectable_drift", 3), ("detectable_drift", 5),
                    ("detectable_drift", 8), ("detectable_drift", 10))},
    "llm_bridge.horizon.x_log_partition_curve__mutmut_42": ("np.cov(rowvar=None) for False: numpy reads rowvar only "
                                                            "for truth, and None is falsy"),
    **{f"llm_bridge.horizon.x_log_partition_curve__mutmut_{n}": _COV_DDOF for n in (43, 46)},
    **{f"llm_bridge.horizon.x_running_share__mutmut_{n}": ("the first column of `before` as float zeros instead of "
                                                            "bool: concatenated with the bool columns it makes a float "
                                                            "0/1 array, whose column means are the same shares")
       for n in (29, 31)},
    **{f"llm_bridge.horizon.x_flip_horizon_study__mutmut_{n}": ("g's margin (or its upper bound) <= 0 for < 0: "
                                                                 "m - D(H) (+ z se) is a difference of sums of "
                                                                 "logs, exactly 0 only by a rounding coincidence")
       for n in (316, 319)},
    **{f"llm_bridge.horizon.x_flip_horizon_study__mutmut_{n}": ("flip = first > 0 (or >= 1) for >= 0: the first "
                                                                 "flip is never at H = 0, where D(0) = 0 with s.e. 0 "
                                                                 "exactly, so g's upper bound is m, and m > 0 for "
                                                                 "an eligible question")
       for n in (405, 406)},
    "llm_bridge.horizon.x_torch_geometric_pool__mutmut_14": ("logsumexp over dim=+1 for dim=-1: the pooled "
                                                             "log-probs are (B, n) by contract (every caller passes "
                                                             "one row per sequence), where dims 1 and -1 are one"),
    "llm_bridge.horizon.x_flip_horizon_study__mutmut_124": ("weights >= 0 for > 0 in `pos`: a weight-0 teacher then "
                                                            "enters m with weight 0 (its margin is finite: logits are "
                                                            "finite, TabularLM's -inf a finite -1e30) and the mixture "
                                                            "with log 0 = -inf, i.e. not at all"),
    **{f"llm_bridge.horizon.x_sample_contexts__mutmut_{n}": (
        "check_int(n_samples) without its name or minimum: sample_log_factors_many, called with every n, refuses "
        "the same n_samples with the same message ('n_samples = 0 must be an integer >= 1')") for n in (7, 8)},
    "llm_bridge.horizon.x_sample_contexts__mutmut_22": ("the default cap 9 n for 8 n: a context's samples double "
                                                        "(n, 2n, 4n, 8n), so any cap in [8n, 16n) stops at 8n"),
    "llm_bridge.horizon.x_exact_flip_horizon__mutmut_77": ("m - D(H) <= 0 for < 0: the margin and the exact gap are "
                                                           "sums of logs, equal to the last bit only by construction"),
    **{f"sims.rlvr.x_task_clustered__mutmut_{n}": ("the std of the task means at one task: pandas' std(ddof=1) "
                                                    "of one value is NaN, the same as the NaN written for it")
       for n in (13, 19)},
    "sims.rlvr.x_verdicts__mutmut_69": ("clusters_for_power at an edge of exactly 0 returns None itself (no number of "
                                        "tasks detects it): the guard `if est != 0` changes nothing"),
    "sims.rlvr.x_verdicts__mutmut_77": ("est != 1 for est != 0: at est = 0 clusters_for_power returns None itself; an "
                                        "edge of exactly 1 needs every task mean at 1 (accuracies lie in [0, 1]), "
                                        "so se = 0 and the design is not written"),
    "sims.rlvr.x_verdicts__mutmut_186": ("lo >= 0 for lo > 0 after TOST: lo = est - t se is exactly 0 only with se = 0 "
                                         "and est = 0 (short of a rounding coincidence), and then TOST (se floored at "
                                         "1e-12) finds equivalence first"),
    "sims.rlvr.x_verdicts__mutmut_333": ("a proper subset for a subset: curves always carry stage, step, method, task "
                                         "and seed besides the five E6 columns"),
    "sims.rlvr.x__e6_rows__mutmut_27": ("np.errstate(divide=None) for 'ignore': None leaves numpy's setting ('warn'), "
                                        "so the same values, with a RuntimeWarning for the log of 0"),
    "sims.rollout_spectrum.x_paired_row__mutmut_57": ("condition_p None for NaN: pandas writes both as an empty cell, and "
                                                      "verdict_text reads neither as a p-value (`isinstance(p, float) "
                                                      "and p == p`)"),
    "llm_bridge.horizon.x_resampled_coverage__mutmut_2": ("the default cap 5 n for 4 n: the samples double (n, 2n, 4n), "
                                                          "so any cap in [4n, 8n) stops at 4n"),
    **{f"llm_bridge.horizon.x_resampled_coverage__mutmut_{n}": _FLOAT_ARRAY for n in (5, 7)},
    "sims.rlvr.x__reverse_rows__mutmut_16": ("to_numpy(dtype=None) for float: the bool column's count (count_verdict "
                                             "casts it to float) and mean are the same"),
    "sims.rlvr.x_e6_table__mutmut_54": ("_interval of no values: the mean of an empty array is NaN (with a "
                                        "RuntimeWarning), the same NaN triple as the else branch"),
}


def statuses():
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], capture_output=True,
                         text=True, check=True).stdout
    return dict(re.findall(r"^\s+(\S+): (.+)$", out, flags=re.M))


def main(patterns=()):
    status = {n: st for n, st in statuses().items()
              if not patterns or any(fnmatch.fnmatchcase(n, p) for p in patterns)}
    by_file = collections.defaultdict(collections.Counter)
    for name, st in status.items():
        by_file[name.split(".x_")[0].split(".xǁ")[0]][st] += 1
    kinds = ("killed", "survived", "timeout", "no tests", "suspicious", "skipped", "not checked")
    print("# Mutation testing of the verdict and statistics code\n")
    print("Written by `make mutate` (mutmut 3, `[tool.mutmut]` in pyproject.toml): every mutant of the listed "
          "functions is run against the fast tests that cover it. A surviving mutant is a missing test or "
          "dead code, unless it is equivalent (listed below with why).\n")
    print("| module | " + " | ".join(kinds) + " |")
    print("|---" * (len(kinds) + 1) + "|")
    for module, counts in sorted(by_file.items()):
        print(f"| `{module}` | " + " | ".join(str(counts.get(k, 0)) for k in kinds) + " |")
    survivors = sorted(n for n, st in status.items() if st == "survived")
    unexplained = [n for n in survivors if n not in EQUIVALENT]
    unchecked = sum(st in ("not checked", "suspicious") for st in status.values())
    print(f"\n{len(status)} mutants; {len(survivors)} survived, {len(unexplained)} of them unexplained"
          + (f"; INCOMPLETE: {unchecked} not checked or undecided (rerun `make mutate`).\n" if unchecked else ".\n"))
    for name in survivors:
        print(f"- `{name}`: {EQUIVALENT.get(name, 'unexplained')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
