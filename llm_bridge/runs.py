"""What a distillation run converges to, from the run as its library names it (theory section 1, 2, 4).

A run is a frozen dataclass per library, with that library's flag names (:class:`TRLRun`,
:class:`VerlRun`, :class:`TorchRLRun`, :class:`LigerRun`, :class:`OwnRun` for this project's
losses), plus the sampling side (``samples``: the student's rollouts, the teachers' traces, or a fixed
data set; TRL's ``lmbda`` mixes them) and the teachers (``weights`` (K,), ``teachers``: "pooled" —
every sample scored against all K with weights w — or "routed" — each sample scored against one
teacher k ~ w, e.g. TRL teacher routing by id, verl's ``teacher_models.*.key``). Bad flags are a
ValueError naming them.

:func:`predict_target` says which target an unrestricted student (one free softmax per context)
reaches at every context the sampling visits, and why:

    A        the arithmetic pool sum_k c_k p_k                       (T1; forward KL)
    l        the local geometric pool ∝ prod_k p_k^{c_k}             (T2; per-token reverse KL)
    J        the generalised-JSD barycentre argmin_q sum_k c_k JSD_beta(p_k, q) (0 < beta < 1, K >= 2;
             no closed form; for one teacher it is the teacher)
    g        the conditionals of the sequence-level geometric pool G_seq (theory section 2: the prefix bias of T8)
    select   one teacher's own conditionals: the teacher of lowest cross-entropy on the batch's tokens
             (NeMo-RL's select_teacher)
    none     no divergence's gradient: the expected gradient vanishes everywhere (the student does not
             move) or equals no divergence's gradient (theory section 4's estimator table)
    diverges the expected gradient is minus a divergence's: the student moves away from the teachers

with weights c_k = w_k ("prior") or, for routed teachers on the routed teacher's own traces, the
posterior c_k(u) ∝ w_k p_k(u) of the prefix u ("posterior": for A this is the sequence-level mixture's
conditional, theory section 2). :func:`target_log_probs` computes a prediction's conditionals on a prefix-tree
machine (aggregation's ``FiniteStateTeachers``), which the verification tests compare the minimiser of
each library's own loss against (tests/test_run_targets.py).
"""

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

import aggregation as ag

SAMPLES = ("student", "teacher", "dataset")
TEACHERS = ("pooled", "routed")
TARGETS = ("A", "l", "J", "g", "select", "none", "diverges")

# Where each library's behaviour was read: (repository, path, version)
SOURCES = {
    "TRL GKDTrainer": ("huggingface/trl", "trl/experimental/gkd/gkd_trainer.py (generalized_jsd_loss, "
                       "training_step)", "1.16.0"),
    "TRL DistillationTrainer": ("huggingface/trl", "trl/trainer/distillation_trainer.py, "
                                "trl/kernels/chunked_divergence.py", "1.16.0"),
    "verl": ("volcengine/verl", "verl/trainer/distillation/losses.py, verl/trainer/ppo/core_algos.py "
             "(kl_penalty)", "0.9.1"),
    "torchrl": ("pytorch/rl", "torchrl/objectives/llm/distillation.py (DistillationLoss, "
                "k3_kl_token_estimate)", "0.14.1"),
    "Liger": ("linkedin/Liger-Kernel", "liger_kernel/chunked_loss/jsd_loss.py (LigerFusedLinearJSDLoss)", "0.8.5"),
    "this project": ("this repository", "llm_bridge/losses/", "this commit"),
    # derived from source (not installable here): repository, path, commit
    "NeMo-RL": ("NVIDIA-NeMo/RL", "nemo_rl/algorithms/loss/loss_functions.py (DistillationLossFn, "
                "CrossTokenizerDistillationLossFn)", "7ea279abfbeb698b092856d0dab61e7cf39bc909"),
    "tinker-cookbook": ("thinking-machines-lab/tinker-cookbook", "tinker_cookbook/distillation/train_on_policy.py "
                        "(incorporate_kl_penalty), tinker_cookbook/rl/metrics.py", "9dfcc3a2cf44432d621a01005073dc6d76a1e87a"),
}
DERIVED = ("NeMo-RL", "tinker-cookbook")


@dataclass(frozen=True)
class Prediction:
    """The target a run reaches (see the module docstring) and why."""
    target: str                 # one of TARGETS
    weights: str = "prior"      # 'prior' (c = w) or 'posterior' (c(u) ∝ w_k p_k(u)) for A, l and J
    beta: float = None          # J's beta
    level: str = "token"        # 'token' (each context on its own) or 'sequence' (g: whole responses)
    reason: str = ""
    source: tuple = ()          # (repository, path, version)
    temperature: float = 1.0    # the target is between the temperature-tau conditionals
    lmbda: float = None         # weights 'visitation': the share of the student's rollouts

    @property
    def label(self):
        """A short name: 'A', 'l (posterior weights)', 'J_0.5', 'g', 'none', 'diverges'."""
        name = f"J_{self.beta:g}" if self.target == "J" else self.target
        if self.target in ("A", "l", "J") and self.weights != "prior":
            name += f" ({self.weights} weights)"
        if self.temperature != 1.0:
            name += f" at temperature {self.temperature:g}"
        return name


# ------------------------------------------------------------------------------------------------
# run descriptions
# ------------------------------------------------------------------------------------------------
def _number(value, name, low=None, high=None, low_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} = {value!r} must be a finite number")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name} = {value!r} must be {'>' if low_open else '>='} {low}")
    if high is not None and value > high:
        raise ValueError(f"{name} = {value!r} must be <= {high}")
    return float(value)


def _choice(value, name, options):
    if value not in options:
        raise ValueError(f"{name} = {value!r} must be one of {options}")
    return value


class _Run:
    """Shared validation: weights on the simplex, teachers pooled / routed, samples."""

    def _check_common(self):
        w = self.weights
        if not isinstance(w, tuple) or not w:
            raise ValueError(f"weights = {w!r} must be a non-empty tuple of K numbers")
        for k, wk in enumerate(w):
            _number(wk, f"weights[{k}]", 0.0)
        if abs(sum(w) - 1.0) > 1e-9:
            raise ValueError(f"weights = {w!r} must sum to 1")
        _choice(self.teachers, "teachers", TEACHERS)
        if "samples" in {f.name for f in fields(self)}:
            _choice(self.samples, "samples", SAMPLES)

    @property
    def K(self):
        return sum(1 for wk in self.weights if wk > 0)


@dataclass(frozen=True)
class TRLRun(_Run):
    """TRL's ``GKDTrainer`` (GKDConfig: beta, lmbda, seq_kd, temperature) or ``DistillationTrainer``
    (always on the student's rollouts: lmbda = 1, no seq_kd). With several teachers TRL has no pooling:
    ``teachers="routed"`` is routing by a teacher id per sample (k ~ w), ``"pooled"`` a wrapper summing
    w_k times the loss against each teacher. ``samples`` is what GKD trains on when it does not
    generate with the student: the teachers' traces (``seq_kd=True`` generates them with the
    (routed) teacher) or the data set's responses."""
    trainer: str = "GKDTrainer"
    beta: float = 0.5
    lmbda: float = 0.5
    seq_kd: bool = False
    temperature: float = 1.0
    weights: tuple = (1.0,)
    teachers: str = "routed"

    def __post_init__(self):
        _choice(self.trainer, "trainer", ("GKDTrainer", "DistillationTrainer"))
        _number(self.beta, "beta", 0.0, 1.0)
        _number(self.lmbda, "lmbda", 0.0, 1.0)
        _number(self.temperature, "temperature", 0.0, low_open=True)
        if not isinstance(self.seq_kd, bool):
            raise ValueError(f"seq_kd = {self.seq_kd!r} must be a bool")
        if self.trainer == "DistillationTrainer" and (self.lmbda != 1.0 or self.seq_kd):
            raise ValueError("DistillationTrainer always trains on the student's rollouts: lmbda must be 1 and "
                             f"seq_kd False (got lmbda = {self.lmbda!r}, seq_kd = {self.seq_kd!r})")
        self._check_common()

    @property
    def samples(self):
        """'student', 'teacher' (seq_kd), 'dataset', or 'mixed' (0 < lmbda < 1)."""
        off = "teacher" if self.seq_kd else "dataset"
        return "student" if self.lmbda == 1.0 else off if self.lmbda == 0.0 else f"mixed:{off}"


VERL_LOSS_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "k1+", "k3+", "forward_kl_topk")


@dataclass(frozen=True)
class VerlRun(_Run):
    """verl's distillation (DistillationLossConfig): ``loss_mode`` (an estimator of kl_penalty on the
    student's sampled token, or ``forward_kl_topk``: the forward KL over the teacher's top ``topk``
    tokens, clamped at 0), ``use_policy_gradient`` (the negative loss as a per-token advantage instead
    of a loss), ``loss_max_clamp``. Samples are the student's rollouts; several teachers are routed by
    ``teacher_models.*.key`` (k ~ w per sample). ``vocab_size``: the vocabulary, to tell a full top-k."""
    loss_mode: str = "k3"
    use_policy_gradient: bool = False
    topk: int = 32
    vocab_size: int = None
    loss_max_clamp: float = None
    weights: tuple = (1.0,)
    teachers: str = "routed"
    samples: str = "student"

    def __post_init__(self):
        _choice(self.loss_mode, "loss_mode", VERL_LOSS_MODES)
        if not isinstance(self.use_policy_gradient, bool):
            raise ValueError(f"use_policy_gradient = {self.use_policy_gradient!r} must be a bool")
        if isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1:
            raise ValueError(f"topk = {self.topk!r} must be a positive integer")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 2):
            raise ValueError(f"vocab_size = {self.vocab_size!r} must be None or an integer >= 2")
        if self.loss_max_clamp is not None:
            _number(self.loss_max_clamp, "loss_max_clamp", 0.0, low_open=True)
        if self.loss_mode == "forward_kl_topk" and self.use_policy_gradient:
            raise ValueError("use_policy_gradient needs an estimator loss_mode, not forward_kl_topk")
        _choice(self.teachers, "teachers", ("routed",))
        _choice(self.samples, "samples", ("student",))
        self._check_common()


@dataclass(frozen=True)
class TorchRLRun(_Run):
    """torchrl's ``DistillationLoss(kl_direction=...)``: k3 on the scored tokens, which must be the
    student's samples ('reverse') or the teacher's ('forward'), as its docstring says. Several
    teachers: routed (k ~ w per sample; 'forward' samples from the routed teacher)."""
    kl_direction: str = "reverse"
    weights: tuple = (1.0,)
    teachers: str = "routed"

    def __post_init__(self):
        _choice(self.kl_direction, "kl_direction", ("reverse", "forward"))
        _choice(self.teachers, "teachers", ("routed",))
        self._check_common()

    @property
    def samples(self):
        return "student" if self.kl_direction == "reverse" else "teacher"


@dataclass(frozen=True)
class LigerRun(_Run):
    """Liger's ``LigerFusedLinearJSDLoss(beta=...)`` (>= 0.5.6; temperature applied to both)."""
    beta: float = 0.5
    temperature: float = 1.0
    weights: tuple = (1.0,)
    teachers: str = "pooled"
    samples: str = "dataset"

    def __post_init__(self):
        _number(self.beta, "beta", 0.0, 1.0)
        _number(self.temperature, "temperature", 0.0, low_open=True)
        self._check_common()


@dataclass(frozen=True)
class NeMoRLRun(_Run):
    """NeMo-RL (derived from source, see SOURCES): ``loss_fn="DistillationLossFn"`` (on-policy distillation,
    one teacher: ``kl_type`` forward / reverse / mixed with ``mixed_kl_weight``, ``zero_outside_topk``,
    the teacher's ``topk`` logits; ``topk=None``: the whole vocabulary) or
    ``"CrossTokenizerDistillationLossFn"`` (X-Token off-policy distillation on a data set, same-vocabulary
    teachers: ``kd_loss_mode`` sum / averaged_logits / select_teacher x ``reverse_kl``, teacher weights)."""
    loss_fn: str = "DistillationLossFn"
    kl_type: str = "mixed"
    mixed_kl_weight: float = 0.5
    zero_outside_topk: bool = False
    topk: int = None
    kd_loss_mode: str = "sum"
    reverse_kl: bool = False
    weights: tuple = (1.0,)
    teachers: str = "pooled"

    def __post_init__(self):
        _choice(self.loss_fn, "loss_fn", ("DistillationLossFn", "CrossTokenizerDistillationLossFn"))
        _choice(self.kl_type, "kl_type", ("forward", "reverse", "mixed"))
        _number(self.mixed_kl_weight, "mixed_kl_weight", 0.0, 1.0)
        _choice(self.kd_loss_mode, "kd_loss_mode", ("sum", "averaged_logits", "select_teacher"))
        for name in ("zero_outside_topk", "reverse_kl"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} = {getattr(self, name)!r} must be a bool")
        if self.topk is not None and (isinstance(self.topk, bool) or not isinstance(self.topk, int) or self.topk < 1):
            raise ValueError(f"topk = {self.topk!r} must be None or a positive integer")
        if self.loss_fn == "DistillationLossFn" and len(self.weights) != 1:
            raise ValueError(f"weights = {self.weights!r}: DistillationLossFn takes one teacher")
        _choice(self.teachers, "teachers", ("pooled",))
        self._check_common()

    @property
    def samples(self):
        return "student" if self.loss_fn == "DistillationLossFn" else "dataset"


@dataclass(frozen=True)
class TinkerRun(_Run):
    """tinker-cookbook's on-policy distillation (derived from source): the per-token advantage
    -kl_penalty_coef (ln q - ln p) on the student's rollouts, summed over the future with
    ``kl_discount_factor``; several teachers are routed by data set (one teacher per data set)."""
    kl_discount_factor: float = 0.0
    kl_penalty_coef: float = 1.0
    weights: tuple = (1.0,)
    teachers: str = "routed"
    samples: str = "student"

    def __post_init__(self):
        _number(self.kl_discount_factor, "kl_discount_factor", 0.0, 1.0)
        _number(self.kl_penalty_coef, "kl_penalty_coef", 0.0, low_open=True)
        _choice(self.teachers, "teachers", ("routed",))
        _choice(self.samples, "samples", ("student",))
        self._check_common()


OWN_LOSSES = ("forward_kl", "reverse_kl", "generalized_jsd", "rkl_policy_gradient", "kl_estimator_loss")


@dataclass(frozen=True)
class OwnRun(_Run):
    """This project's losses (llm_bridge.losses) with their own argument names."""
    loss: str = "forward_kl"
    beta: float = 0.5                 # generalized_jsd
    gamma: float = 1.0                # rkl_policy_gradient: 1 or 0
    estimator: str = "k3"             # kl_estimator_loss
    mode: str = "loss"
    pool: str = "after"
    direction: str = "reverse"
    weights: tuple = (1.0,)
    teachers: str = "pooled"
    samples: str = "student"

    def __post_init__(self):
        _choice(self.loss, "loss", OWN_LOSSES)
        _number(self.beta, "beta", 0.0, 1.0)
        _choice(self.gamma, "gamma", (0.0, 1.0, 0, 1))
        _choice(self.estimator, "estimator", ("k1", "k2", "k3", "k3+"))
        _choice(self.mode, "mode", ("loss", "reward"))
        _choice(self.pool, "pool", ("before", "after"))
        _choice(self.direction, "direction", ("reverse", "forward"))
        if self.loss == "rkl_policy_gradient" and self.samples != "student":
            raise ValueError(f"samples = {self.samples!r}: rkl_policy_gradient trains on the student's rollouts")
        self._check_common()


# ------------------------------------------------------------------------------------------------
# predictions
# ------------------------------------------------------------------------------------------------
T1 = "T1: sum_k c_k KL(p_k || q) = sum_k c_k KL(p_k || A) + KL(A || q), minimised by A (theory section 1)"
T2 = "T2: sum_k c_k KL(q || p_k) = KL(q || l) - ln z, minimised by l (theory section 1)"
JSD = ("sum_k c_k JSD_beta(p_k, q) is strictly convex in q; beta = 0 is T1's forward KL, beta = 1 T2's "
       "reverse KL, in between its minimiser J lies between A and l and has no closed form (one teacher: p)")
SEQ = ("theory section 2: the sequence-level RKL with per-token reward sum_k w_k ln p_k(a|u) credited by reward-to-go is "
       "soft-optimal control, solved by g = l re-weighted by the continuation partition Z(ua) (T8's prefix "
       "bias); with discount 0 each token sees only its own conditional KL, whose minimiser is l (T2)")


def _weights_note(run, samples):
    """Which weights the visited contexts put on the teachers, and why."""
    if run.K == 1:
        return "prior", "one teacher"
    if run.teachers == "pooled":
        return "prior", "pooled: every visited context is scored against all teachers with weights w"
    if samples == "teacher":
        return "posterior", ("routed on the routed teacher's own traces: at a prefix u the sample came from "
                             "teacher k with probability c_k(u) ∝ w_k p_k(u) (theory section 2's posterior weights)")
    if samples.startswith("mixed:teacher"):
        return "visitation", ("routed, the routed teacher's traces mixed with the student's rollouts: at a prefix u "
                              "the weights are c_k(u) ∝ w_k (lmbda q(u) + (1 - lmbda) p_k(u)), q(u) the student's own "
                              "prefix probability, which at the fixed point is the target's along u (solved from the "
                              "start downwards)")
    return "prior", ("routed on samples that do not depend on k (the student's rollouts or the data set's "
                     "responses): every visited context sees teacher k with probability w_k")


def _full_logit(beta, run, samples, source, temperature):
    weights, note = _weights_note(run, samples)
    target = "A" if beta == 0 else "l" if beta == 1 else ("J" if run.K > 1 else "A")
    theory = T1 if target == "A" and beta == 0 else T2 if target == "l" else JSD
    if run.K == 1 and 0 < beta < 1:
        theory = "JSD_beta(p, q) = 0 iff q = p: one teacher is reached at every beta"
    return Prediction(target, weights=weights, beta=beta if target == "J" else None,
                      reason=f"A per-context loss on the full distributions; {note}; {theory}.",
                      source=source, temperature=temperature,
                      lmbda=getattr(run, "lmbda", None) if weights == "visitation" else None)


def _estimator(estimator, use, samples, teachers, run, source, gamma=0.0, direction="reverse"):
    """theory section 4's table (audit_estimators) for a sampled-token estimator on one teacher's log-ratio per
    sample (per-teacher or routed) or on the pooled log-ratio."""
    weights, note = _weights_note(run, samples)
    if use == "reward" and estimator == "k1" and samples == "student":
        if gamma == 1.0:
            return Prediction("g", level="sequence", reason=f"k1 = ln q - ln p as a per-token reward credited by "
                              f"reward-to-go on the student's rollouts; {note}; {SEQ}.", source=source)
        return Prediction("l", weights=weights, reason=f"k1 as a detached per-token advantage (no reward-to-go) on the "
                          f"student's rollouts is the per-token RKL gradient (theory section 4); {note}; {T2}.", source=source)
    if use == "reward":
        return Prediction("none", reason=f"{estimator} as a detached reward gives no divergence's gradient (theory section 4's "
                          "table: only k1 does as a reward)", source=source)
    if estimator == "k1":
        if samples == "student":
            return Prediction("none", reason="k1 as a loss on the student's samples has zero expected gradient "
                              "(E_q grad ln q = 0, theory section 4): the student does not move", source=source)
        return Prediction("diverges", reason="k1 as a loss on the teacher's samples is minus the forward-KL gradient "
                          "(theory section 4's table): it pushes the teacher's tokens down", source=source)
    if estimator in ("k2", "k3+"):
        if samples != "student":
            return Prediction("none", reason=f"{estimator}'s gradient is the RKL gradient only on the student's own "
                              "samples; on the teacher's it is no divergence's gradient (theory section 4)", source=source)
        return Prediction("l", weights=weights, reason=f"{estimator} as a loss on the student's samples has the "
                          f"per-token RKL gradient (theory section 4; k3+ is k3's value with k2's gradient); {note}; {T2}.",
                          source=source)
    # k3
    if direction == "forward":
        if samples != "teacher" or teachers != "routed":
            return Prediction("none", reason="k3 with r = ln q - ln p gives the FKL gradient only on the routed "
                              "teacher's own samples (audit_estimators, direction 'forward')", source=source)
        return Prediction("A", weights=weights, reason=f"k3 of ln q - ln p on the teacher's samples is the forward-KL "
                          f"gradient (theory section 4, torchrl's 'forward'); {note}; {T1}.", source=source)
    if samples != "student":
        return Prediction("none", reason="k3 of ln p - ln q is the FKL gradient only on the student's samples "
                          "(theory section 4)", source=source)
    if teachers == "pooled":
        return Prediction("l", weights=weights, reason="k3 on the pooled log-ratio sum_k w_k ln p_k - ln q: its "
                          "expected gradient is z (q - l), the forward-KL gradient to l scaled by z (theory section 4's "
                          "table), which vanishes only at l.", source=source)
    return Prediction("A", weights=weights, reason=f"k3 of ln p - ln q as a loss on the student's samples has the "
                      f"forward-KL gradient E_q[(1 - p/q) grad ln q] = q - p (theory section 4); {note}; {T1}.", source=source)


def predict_target(run):
    """The :class:`Prediction` for a run description (see the module docstring)."""
    if isinstance(run, TRLRun):
        source = SOURCES[f"TRL {run.trainer}"]
        return _full_logit(run.beta, run, run.samples, source, run.temperature)
    if isinstance(run, LigerRun):
        return _full_logit(run.beta, run, run.samples, SOURCES["Liger"], run.temperature)
    if isinstance(run, TorchRLRun):
        return _estimator("k3", "loss", run.samples, run.teachers, run, SOURCES["torchrl"], direction=run.kl_direction)
    if isinstance(run, VerlRun):
        source = SOURCES["verl"]
        if run.loss_mode == "forward_kl_topk":
            if run.vocab_size is not None and run.topk >= run.vocab_size:
                weights, note = _weights_note(run, "student")
                return Prediction("A", weights=weights, reason=f"the top-k forward KL with k = V is the forward KL; "
                                  f"{note}; {T1}.", source=source)
            return Prediction("none", reason="the forward KL over the teacher's top k only, clamped at 0: its minimiser "
                              "over q would be the teacher renormalised on its top k, where the partial sum is "
                              "m ln m < 0 (m the top-k mass), so the clamp zeroes the gradient first: training stops "
                              "wherever the partial KL reaches 0, no unique target", source=source)
        if run.loss_mode == "abs":
            return Prediction("none", reason="|ln q - ln p| has a sign-valued gradient: for one teacher it stops at p; "
                              "with several, anywhere the weighted signs balance (no divergence's gradient)",
                              source=source)
        estimator = {"kl": "k1", "k1": "k1", "k1+": "k2", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3",
                     "k3+": "k3+"}[run.loss_mode]
        prediction = _estimator(estimator, "reward" if run.use_policy_gradient else "loss", "student", "routed", run,
                                source)
        if estimator == "k3" and not run.use_policy_gradient:
            prediction = Prediction(prediction.target, prediction.weights, reason=prediction.reason + " verl's "
                                    "low_var_kl / k3 clamps the value at 10 (zero gradient where ln(p/q) > 2.53); it "
                                    "does not bind near the fixed point.", source=source)
        return prediction
    if isinstance(run, NeMoRLRun):
        return _nemo_rl(run)
    if isinstance(run, TinkerRun):
        source = SOURCES["tinker-cookbook"]
        if run.kl_discount_factor in (0.0, 1.0):
            return _estimator("k1", "reward", "student", "routed", run, source, gamma=run.kl_discount_factor)
        return Prediction("none", reason="a discount strictly between 0 and 1 solves a discounted soft-control "
                          "problem: its policy lies between l (discount 0) and g (discount 1) and is no pool of theory section 2",
                          source=source)
    if isinstance(run, OwnRun):
        source = SOURCES["this project"]
        source = (source[0], source[1] + ("token_level.py" if run.loss in ("forward_kl", "reverse_kl", "generalized_jsd")
                                          else "sampled.py"), source[2])
        if run.loss in ("forward_kl", "reverse_kl", "generalized_jsd"):
            beta = {"forward_kl": 0.0, "reverse_kl": 1.0}.get(run.loss, run.beta)
            return _full_logit(beta, run, run.samples, source, 1.0)
        if run.loss == "rkl_policy_gradient":
            return _estimator("k1", "reward", "student", run.teachers, run, source, gamma=float(run.gamma))
        teachers = "routed" if run.teachers == "routed" else "pooled" if run.pool == "before" else "per-teacher"
        return _estimator(run.estimator, run.mode, run.samples, teachers, run, source, direction=run.direction)
    raise ValueError(f"run = {run!r} is not a run description ({', '.join(c.__name__ for c in RUN_TYPES)})")


RUN_TYPES = (TRLRun, VerlRun, TorchRLRun, LigerRun, NeMoRLRun, TinkerRun, OwnRun)


def _nemo_rl(run):
    source = SOURCES["NeMo-RL"]
    if run.loss_fn == "DistillationLossFn":
        if run.topk is not None:
            return Prediction("none", reason="the KL over the teacher's top k logits only: the forward partial sum is "
                              "minimised by the teacher renormalised on its top k (mass outside pushed to 0), the "
                              "reverse one without zero_outside_topk by q = p / e on the top k with the rest outside; "
                              "no pool of the full distributions", source=source)
        return Prediction("A", reason=f"one teacher p over the whole vocabulary: forward, reverse and mixed "
                          f"(weight {run.mixed_kl_weight:g}) KL all vanish only at q = p (T1, T2)", source=source)
    weights, note = _weights_note(run, "dataset")
    if run.kd_loss_mode == "select_teacher":
        return Prediction("select", reason="select_teacher keeps only the teacher of lowest next-token cross-entropy "
                          "on the batch's tokens (argmin_k CE); the student then learns that teacher alone",
                          source=source)
    if run.kd_loss_mode == "averaged_logits":
        return Prediction("l", weights=weights, reason="averaged_logits averages the teachers' logits with weights "
                          "w / sum(w): softmax(sum_k w_k z_k) is the geometric pool l, and one KL to it, in either "
                          "direction, vanishes only at l (T2's pool without T2's loss)", source=source)
    if run.reverse_kl:
        return Prediction("l", weights=weights, reason=f"sum: sum_i w_i KL(q || p_i) per position; {note}; {T2}.",
                          source=source)
    return Prediction("A", weights=weights, reason=f"sum: sum_i w_i KL(p_i || q) per position; {note}; {T1}.",
                      source=source)


# ------------------------------------------------------------------------------------------------
# a prediction's conditionals on a prefix-tree machine
# ------------------------------------------------------------------------------------------------
def prefix_depths(machine):
    """Depth of each state of a prefix-tree machine (start at 0), and its parent (-1 for the start)."""
    S = machine.next_state.shape[0]
    depth, parent = np.full(S, -1), np.full(S, -1)
    depth[machine.start] = 0
    order = [machine.start]
    for s in order:
        for a, child in enumerate(machine.next_state[s]):
            if child >= 0:
                if depth[child] >= 0:
                    raise ValueError("machine must be a prefix tree (a state with two parents)")
                depth[child], parent[child] = depth[s] + 1, s
                order.append(int(child))
    return depth, parent


def context_weights(machine, weights, kind):
    """(S, K) teacher weights per state: the prior w, or the posterior ∝ w_k p_k(prefix) (theory section 2)."""
    w = np.asarray(weights, dtype=float)
    S = machine.next_state.shape[0]
    if kind == "prior":
        return np.broadcast_to(w, (S, len(w))).copy()
    with np.errstate(divide="ignore"):
        log_post = np.log(w)[:, None] + _log_prefix(machine)
    log_post -= np.logaddexp.reduce(log_post, axis=0)
    return np.exp(log_post).T


def _log_prefix(machine):
    """(K, S) ln p_k(prefix of each state) on a prefix tree."""
    depth, parent = prefix_depths(machine)
    log_prefix = np.zeros((machine.log_probs.shape[0], len(depth)))
    for s in np.argsort(depth, kind="stable"):
        p = parent[s]
        if p >= 0:
            a = int(np.nonzero(machine.next_state[p] == s)[0][0])
            log_prefix[:, s] = log_prefix[:, p] + machine.log_probs[:, p, a]
    return log_prefix


def jsd_barycentre(log_probs, weights, beta):
    """argmin_q sum_k c_k JSD_beta(p_k, q) per row (the loss of :func:`llm_bridge.losses.generalized_jsd`,
    strictly convex in q): log_probs (K, S, n), weights (S, K); returns log q (S, n)."""
    lp = torch.as_tensor(np.array(log_probs, dtype=float))
    c = torch.as_tensor(np.array(weights, dtype=float)).T[:, :, None]            # (K, S, 1)
    log_b, log_1b = math.log(beta), math.log1p(-beta)

    def loss(theta):
        lq = torch.log_softmax(theta, -1)
        lm = torch.logaddexp(lp + log_b, lq + log_1b)
        jsd = beta * lp.exp() * (lp - lm) + (1 - beta) * lq.exp() * (lq - lm)
        return (c * jsd).sum()
    theta = torch.log(torch.einsum("ksn,ksn->sn", c.expand_as(lp), lp.exp())).clone().requires_grad_()
    opt = torch.optim.LBFGS([theta], lr=1, max_iter=1000, tolerance_grad=1e-14, tolerance_change=1e-18,
                            history_size=20, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        value = loss(theta)
        value.backward()
        return value
    for _ in range(3):
        opt.step(closure)
    return torch.log_softmax(theta.detach(), -1).numpy()


def target_log_probs(prediction, machine, weights, horizon=None):
    """The predicted conditionals ``(S, n)`` at every state of a prefix-tree machine (for 'g' the
    sequence-level conditionals over the tree's depth); a ValueError for 'none' / 'diverges'."""
    if prediction.target not in ("A", "l", "J", "g"):          # 'select' needs the data: see its reason
        raise ValueError(f"prediction.target = {prediction.target!r} names no conditionals")
    if prediction.temperature != 1.0:
        raise ValueError("target_log_probs takes temperature-1 predictions (pass tempered teachers instead)")
    depth, _ = prefix_depths(machine)
    if prediction.target == "g":
        H = int(depth.max()) + 1 if horizon is None else horizon
        g = ag.sequence_geometric_conditionals(machine, np.asarray(weights, float), H)
        return g[depth, np.arange(len(depth))]
    lp = machine.log_probs
    if prediction.weights == "visitation":        # top-down: the weights at depth d need the target above
        w = np.asarray(weights, dtype=float)
        teacher_prefix = w[:, None] * np.exp(_log_prefix(machine))      # (K, S) w_k p_k(u)
        _, parent = prefix_depths(machine)
        out, q_prefix = np.zeros(lp.shape[1:]), np.ones(len(depth))
        for d in range(int(depth.max()) + 1):
            at = np.nonzero(depth == d)[0]
            for s in at:
                if parent[s] >= 0:
                    a = int(np.nonzero(machine.next_state[parent[s]] == s)[0][0])
                    q_prefix[s] = q_prefix[parent[s]] * np.exp(out[parent[s], a])
            c = prediction.lmbda * q_prefix[at, None] * w + (1 - prediction.lmbda) * teacher_prefix[:, at].T
            out[at] = _pool(prediction, lp[:, at], c / c.sum(1, keepdims=True))
        return out
    return _pool(prediction, lp, context_weights(machine, weights, prediction.weights))


def _pool(prediction, lp, c):
    """Prediction A / l / J of the teachers' log-probs lp (K, S, n) with weights c (S, K)."""
    if prediction.target == "A":
        with np.errstate(divide="ignore"):
            return np.logaddexp.reduce(np.log(c.T)[:, :, None] + lp, axis=0)
    if prediction.target == "l":
        r = np.einsum("sk,ksn->sn", c, lp)
        return r - np.logaddexp.reduce(r, axis=-1, keepdims=True)
    return jsd_barycentre(lp, c, prediction.beta)


KEY_FLAGS = {"TRLRun": ("beta", "lmbda", "seq_kd", "teachers"), "VerlRun": ("loss_mode", "use_policy_gradient", "topk"),
             "NeMoRLRun": ("kl_type",), "TinkerRun": ("kl_discount_factor",),
             "TorchRLRun": ("kl_direction",), "LigerRun": ("beta", "teachers", "samples"),
             "OwnRun": ("teachers", "samples")}
OWN_FLAGS = {"generalized_jsd": ("beta",), "rkl_policy_gradient": ("gamma",),
             "kl_estimator_loss": ("estimator", "mode", "pool", "direction")}


def describe(run):
    """The run in its library's words: 'TRL GKDTrainer beta=0.5 lmbda=1.0 seq_kd=False teachers=routed'."""
    library = {TRLRun: f"TRL {getattr(run, 'trainer', '')}", VerlRun: "verl", TorchRLRun: "torchrl DistillationLoss",
               NeMoRLRun: f"NeMo-RL {getattr(run, 'loss_fn', '')}", TinkerRun: "tinker-cookbook on-policy distillation",
               LigerRun: "Liger LigerFusedLinearJSDLoss", OwnRun: f"{getattr(run, 'loss', '')}"}
    if type(run) not in library:
        raise ValueError(f"run = {run!r} is not a run description")
    names = KEY_FLAGS[type(run).__name__] + (OWN_FLAGS.get(run.loss, ()) if isinstance(run, OwnRun) else ())
    if isinstance(run, TRLRun) and run.trainer == "DistillationTrainer":
        names = ("beta", "teachers")
    if isinstance(run, (TRLRun, LigerRun)) and run.temperature != 1.0:
        names += ("temperature",)
    if isinstance(run, NeMoRLRun):
        names = ("kl_type", "topk") if run.loss_fn == "DistillationLossFn" else ("kd_loss_mode", "reverse_kl")
    if isinstance(run, VerlRun):
        names = ("loss_mode", "topk") if run.loss_mode == "forward_kl_topk" else ("loss_mode", "use_policy_gradient")
    return " ".join([library[type(run)], *(f"{n}={getattr(run, n)}" for n in names)])
