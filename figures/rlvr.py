"""RL after distillation (E4) and the cost of distillation (E6): pure functions of the CSVs of sims/rlvr.py."""

import os

import numpy as np
import pandas as pd

from .style import (BAND, BLACK, BLUE, GREEN, GREY, PURPLE, SKY, TWO_COLUMNS, VERMILLION, figure, legend_below,
                    log_scale, mean_band, paper)

# colour: where the training samples come from; line style: the objective (FKL solid, RKL dashed)
METHOD_COLOURS = {"offline FKL": BLUE, "offline RKL": BLUE, "on-policy FKL": VERMILLION,
                  "on-policy RKL": VERMILLION, "no distillation": GREY,
                  "offline FKL, 256 traces": SKY, "offline FKL, 4096 traces": PURPLE,
                  "fresh-teacher FKL": GREEN, "fresh-teacher RKL": GREEN}


def _style(method):
    return "--" if "RKL" in method else "-"
MAIN = ("offline FKL", "on-policy FKL", "fresh-teacher FKL", "offline RKL", "on-policy RKL", "fresh-teacher RKL",
        "no distillation")
CONDITION_TITLES = {"shared": "shared skill feature", "unshared": "no shared skill feature"}
STUDENT_NAMES = {"loglinear": "log-linear", "neural": "tiny Qwen2"}


def _runs(df, x, y):
    """(x values, values (runs, checkpoints)) of the runs of one method, on the checkpoints every run has."""
    wide = df.pivot_table(index=["task", "seed"], columns=x, values=y)
    wide = wide.dropna(axis=1)
    return wide.columns.to_numpy(dtype=float), wide.to_numpy()


@paper
def rlvr_figure(curves, e4):
    """A row per student: OOD accuracy through distillation and then RL, per condition (a line per method,
    the band a 95% interval over (task, seed)), and the paired on-policy minus offline OOD accuracy after
    each stage with 95% t-intervals over the task means (e4.csv)."""
    conditions = [c for c in CONDITION_TITLES if c in set(curves.condition)]
    students = [s for s in STUDENT_NAMES if s in set(curves.student)]
    fig = figure(TWO_COLUMNS, 2.5 * len(students) + 0.5)
    grid = np.atleast_2d(fig.subplots(len(students), len(conditions) + 1,
                                      width_ratios=[1.2] * len(conditions) + [1.1], squeeze=False))
    handles = {}
    for row, student in zip(grid, students):
        for ax, condition in zip(row, conditions):
            c = curves[(curves.condition == condition) & (curves.student == student)]
            offset = c[c.stage == "distil"].step.max()
            c = c.assign(t=np.where(c.stage == "rl", c.step + offset, c.step))
            for method in MAIN:
                m = c[(c.method == method) & ~((c.stage == "rl") & (c.step == 0))]
                if len(m):
                    x, v = _runs(m, "t", "ood_accuracy")
                    handles[method] = mean_band(ax, x, v, METHOD_COLOURS[method], label=method, ls=_style(method))
            ax.axvline(offset, color="k", lw=0.6, ls=":")
            ax.text(offset, 1.0, " RL starts", fontsize=6, va="top")
            ax.set_ylim(0, 1.02)
            ax.set_xlabel("step: distillation, then RL")
            ax.set_ylabel(f"OOD accuracy, {STUDENT_NAMES[student]}")
            ax.set_title(f"{STUDENT_NAMES[student]}, {CONDITION_TITLES[condition]}", fontsize=7)
            ax.grid(True)
        ax = row[-1]
        diffs = e4[e4.comparison.str.contains(" - ") & (e4.student == student)].reset_index(drop=True)
        labels = []
        for i, d in diffs.iterrows():
            ax.errorbar(d.ood_accuracy, i, xerr=[[d.ood_accuracy - d.lo], [d.hi - d.ood_accuracy]],
                        fmt="o" if d.stage == "distil" else "s", color=BLACK,
                        ms=3.5, capsize=2, lw=0.8)
            labels.append(f"{'FKL' if 'FKL' in d.comparison else 'RKL'}, {d.condition}, "
                          f"{'after distil.' if d.stage == 'distil' else 'after RL'}")
        ax.axvline(0, color="k", lw=0.6)
        ax.set_yticks(range(len(labels)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlabel("on-policy - offline")
        ax.set_title(f"OOD edge: {int(diffs.runs.max()) if len(diffs) else 0} runs, "
                     f"{int(diffs.tasks.max()) if len(diffs) else 0} tasks", fontsize=7)
        ax.grid(True, axis="x")
    legend_below(fig, list(handles.values()), list(handles), ncol=4, title=BAND)
    fig.suptitle("E4, an on-policy OOD edge that does not survive RL: OOD accuracy through distillation and then RL;\n"
                 "right, the on-policy minus offline edge after each stage (a 95% t-interval over the task means)", fontsize=8)
    return fig


@paper
def cost_figure(curves):
    """Distillation quality against its cost (teacher forward tokens + student generated tokens) for the
    log-linear student in the first condition: (a) KL to A for the FKL methods, (b) KL to l for the RKL methods, (c) ID accuracy.
    An offline method pays for its pool of traces up front, so its points stand at one cost."""
    condition = next(c for c in CONDITION_TITLES if c in set(curves.condition))
    student = next(s for s in STUDENT_NAMES if s in set(curves.student))
    d = curves[(curves.condition == condition) & (curves.student == student) & (curves.stage == "distil")
               & (curves.objective.fillna("") != "")]
    d = d.assign(cost=d.teacher_tokens + d.student_tokens)
    fig = figure(TWO_COLUMNS, 2.5)
    axes = fig.subplots(1, 3)
    handles = {}
    panels = ((axes[0], "fkl", "kl_arithmetic", "KL(q || A) per position"),
              (axes[1], "rkl", "kl_local", "KL(q || l) per position"),
              (axes[2], None, "id_accuracy", "ID accuracy (exact)"))
    for ax, objective, y, ylabel in panels:
        for method, m in d.groupby("method", sort=False):
            if objective and m.objective.iloc[0] != objective:
                continue
            means = m[m.step > 0].groupby("step")[["cost", y]].mean()
            handles[method], = ax.plot(means.cost, means[y], marker=".", ms=3, lw=1.0, color=METHOD_COLOURS[method],
                                       ls=_style(method), label=method)
            ax.plot(means.cost.iloc[-1], means[y].iloc[-1], marker="*", ms=7, color=METHOD_COLOURS[method])
        log_scale(ax, x=True, y=bool(objective))
        ax.set_xlabel("teacher + student tokens")
        ax.set_ylabel(ylabel)
        ax.grid(True)
    axes[0].set_title("FKL: offline vs on-policy")
    axes[1].set_title("RKL: offline vs on-policy")
    axes[2].set_title("ID accuracy (star: end)")
    legend_below(fig, list(handles.values()), list(handles), ncol=4,
                 title=f"{STUDENT_NAMES[student]} student, {CONDITION_TITLES[condition]}; mean over (task, seed) at each step")
    fig.suptitle("E6, offline traces reach on-policy quality at a lower cost: quality against the tokens spent (teacher +\n"
                 "student); offline traces pay for their pool up front, on-policy rollouts as they go", fontsize=8)
    return fig


def figures_from(folder):
    path = os.path.join(folder, "curves.csv")
    if not os.path.exists(path):
        return {}
    curves = pd.read_csv(path, keep_default_na=False, na_values=[""])
    out = {"rlvr_cost": cost_figure(curves)}
    e4_path = os.path.join(folder, "e4.csv")
    if os.path.exists(e4_path):
        out["rlvr"] = rlvr_figure(curves, pd.read_csv(e4_path))
    return out
