"""The configurations of one training run, as frozen dataclasses validated at construction
(``harness.Config``): a run's result rows start with its fields, in this order."""

import math
from dataclasses import dataclass

from harness import Config

from .fixed_points import OBJECTIVES

SCHEDULES = ("constant", "linear", "cosine")       # the learning rate after the warm-up
STORAGES = ("float32", "bf16", "bf16-master")      # how the parameters are kept between steps: bf16-master is
                                                   # mixed precision (float32 master weights, a bf16 forward)
ROLLOUTS = ("offline", "on-policy", "fresh")       # where a goal-task distillation's sequences come from:
                                                   # a pool drawn once, the student, new teacher traces each step
GOAL_OBJECTIVES = ("fkl", "rkl")                   # the goal-task distillation losses ('' = none)


@dataclass(frozen=True)
class SpectrumConfig(Config):
    """One point of the rollout spectrum (theory section 5): the objective (``fixed_points.OBJECTIVES``), the
    probability ``alpha`` that a training sequence is the student's (NaN for the switch-point variant,
    where a teacher writes up to a uniform position and the student after), importance weights on the
    teachers' tokens (truncated at ``truncate`` as practitioners do, e.g. V-trace's rho-bar = 1), and
    per-run gradient-norm clipping."""
    objective: str
    alpha: float = 0.0            # P(a sequence is the student's); NaN when switch
    switch: bool = False          # teacher prefix up to a uniform position, student suffix
    importance: bool = False      # weight teacher tokens by q / mu (prefix products for pg0 / pg1)
    clip: bool = False            # clip each run's gradient to norm 1
    truncate: float = math.inf    # importance weights above this are set to it (inf: never)

    def check(self):
        self.one_of("objective", OBJECTIVES)
        self.between("alpha", 0.0, 1.0, nan_ok=self.switch)
        for name in ("switch", "importance", "clip"):
            self.one_of(name, (False, True))
        if not self.truncate > 0:
            raise ValueError(f"SpectrumConfig.truncate = {self.truncate!r} must be a number > 0 (math.inf: never)")
        if self.truncate < math.inf and not self.importance:
            raise ValueError("SpectrumConfig.truncate needs importance = True (there are no weights to truncate)")


@dataclass(frozen=True)
class ContinualConfig(Config):
    """Phase 2 of continual distillation (distillation.continual): the learning rate's peak, schedule
    and warm-up, the rollout mix, the objective, clipping and parameter storage."""
    lr: float                     # peak learning rate (Adam)
    schedule: str = "constant"    # one of SCHEDULES
    warmup: bool = False          # a linear ramp over the first 10% of the steps
    alpha: float = 0.0            # P(a sequence is the student's)
    objective: str = "fkl"        # one of fixed_points.OBJECTIVES
    clip: bool = False            # clip each run's gradient to norm 1
    storage: str = "float32"      # one of STORAGES: bf16 rounds the parameters after every step,
                                  # bf16-master reads a bf16 copy of float32 master weights

    def check(self):
        self.between("lr", 0.0, float("inf"))
        self.one_of("schedule", SCHEDULES)
        self.one_of("warmup", (False, True))
        self.between("alpha", 0.0, 1.0)
        self.one_of("objective", OBJECTIVES)
        self.one_of("clip", (False, True))
        self.one_of("storage", STORAGES)

    def spectrum(self):
        """The spectrum point this phase trains at (no switch, no importance weights)."""
        return SpectrumConfig(self.objective, self.alpha, clip=self.clip)


@dataclass(frozen=True)
class Method(Config):
    """A goal-task distillation method (distillation.verifiable): its name, objective ('' for none),
    where its sequences come from (``ROLLOUTS``: 'fresh' is offline distillation on new teacher traces
    every step, the control that separates data freshness from on-policy sampling), and the size of an
    offline method's pool of teacher traces."""
    method: str                   # the name in the CSVs
    objective: str = ""           # one of GOAL_OBJECTIVES, or '' for no distillation
    rollouts: str = ""            # one of ROLLOUTS ('' without an objective)
    pool: int = 0                 # teacher traces drawn once (offline only)

    def check(self):
        self.one_of("objective", ("",) + GOAL_OBJECTIVES)
        if self.objective:
            self.one_of("rollouts", ROLLOUTS)
        if self.objective and self.rollouts == "offline":
            self.between("pool", 1, float("inf"))

    @property
    def offline(self):
        return bool(self.objective) and self.rollouts == "offline"

    @property
    def on_policy(self):
        return bool(self.objective) and self.rollouts == "on-policy"

    @property
    def fresh(self):
        return bool(self.objective) and self.rollouts == "fresh"
