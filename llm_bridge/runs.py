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

import dataclasses
import difflib
import math
from dataclasses import dataclass, fields

import numpy as np
import torch

import aggregation as ag

SAMPLES = ("student", "teacher", "dataset")
TEACHERS = ("pooled", "routed")
TARGETS = ("A", "l", "J", "g", "mix", "select", "data", "computed", "none", "diverges")

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
    sampling_temperature: float = 1.0   # posterior / visitation weights: the temperature the traces are drawn at
    data_share: float = None    # 'mix': the data's share (1 - data_share: A's)
    condition: str = ""         # the condition the target holds under ('' : always)

    @property
    def label(self):
        """A short name: 'A', 'l (posterior weights)', 'J_0.5', 'g', '0.5 data + 0.5 A', 'computed', 'none'."""
        name = f"J_{self.beta:g}" if self.target == "J" else self.target
        if self.target == "mix":
            name = f"{self.data_share:.3g} data + {1 - self.data_share:.3g} A"
        if self.target in ("A", "l", "J") and self.weights != "prior":
            name += f" ({self.weights} weights" + (f", traces at temperature {self.sampling_temperature:g}"
                                                   if self.sampling_temperature != 1.0 else "") + ")"
        if self.temperature != 1.0:
            name += f" at temperature {self.temperature:g}"
        if self.condition:
            name += f" if {self.condition}"
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


def _flag(value, name):
    if not isinstance(value, bool):
        raise ValueError(f"{name} = {value!r} must be a bool")


def _count(value, name, allow_none=False, low=1):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} = {value!r} must be {'None or ' if allow_none else ''}an integer >= {low}")


class _LibraryDefault:
    """The value of a flag left unset: the library's own default fills it (None can be a flag's value)."""

    def __repr__(self):
        return "<library default>"


LIBRARY_DEFAULT = _LibraryDefault()


def _run_description(cls):
    """A frozen dataclass whose constructor names an unknown flag in a ValueError (with the nearest known
    name) instead of Python's TypeError."""
    cls = dataclass(frozen=True)(cls)
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        known = [f.name for f in fields(cls)]
        for name in kwargs:
            if name not in known:
                near = difflib.get_close_matches(name, known, n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise ValueError(f"{cls.__name__} has no flag {name!r}{hint}; its flags: {', '.join(known)}")
        if len(args) > len(known):
            raise ValueError(f"{cls.__name__} takes its flags by name ({', '.join(known)})")
        init(self, *args, **kwargs)
    __init__.__doc__ = init.__doc__
    cls.__init__ = __init__
    return cls


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

    def _defaults(self, defaults):
        """Fill the flags left unset from ``defaults`` (the library's own launched defaults)."""
        for name, value in defaults.items():
            if getattr(self, name) is LIBRARY_DEFAULT:
                object.__setattr__(self, name, value)

    @property
    def K(self):
        return sum(1 for wk in self.weights if wk > 0)


# The libraries' own defaults, as their released code sets them (tests/test_run_targets.py reads each
# from the library's config class in its wheel and compares).
TRL_DEFAULTS = {"GKDTrainer": dict(beta=0.5, lmbda=0.5, seq_kd=False, temperature=0.9),       # GKDConfig
                "DistillationTrainer": dict(beta=1.0, temperature=1.0)}                         # DistillationConfig


@_run_description
class TRLRun(_Run):
    """TRL's ``GKDTrainer`` (GKDConfig: beta, lmbda, seq_kd, temperature) or ``DistillationTrainer``
    (DistillationConfig: beta, temperature; always on the student's rollouts). A flag left unset takes the
    trainer's own default (:data:`TRL_DEFAULTS`: GKD beta 0.5, lmbda 0.5, temperature 0.9; Distillation beta
    1.0, temperature 1.0). ``temperature`` is read differently by the two trainers: GKDTrainer samples
    (the student's rollouts and, with seq_kd, the teacher's traces) at it but computes its loss at
    temperature 1 (``compute_loss`` does not pass it on); DistillationTrainer samples at it and divides
    both sides' logits by it in the loss. With several teachers TRL has no pooling: ``teachers="routed"``
    is routing by a teacher id per sample (k ~ w), ``"pooled"`` a wrapper summing w_k times the loss against
    each teacher. Off the student's rollouts GKD trains on the teachers' traces (``seq_kd``) or the data set."""
    trainer: str = "GKDTrainer"
    beta: float = LIBRARY_DEFAULT
    lmbda: float = LIBRARY_DEFAULT
    seq_kd: bool = LIBRARY_DEFAULT
    temperature: float = LIBRARY_DEFAULT
    weights: tuple = (1.0,)
    teachers: str = "routed"

    def __post_init__(self):
        _choice(self.trainer, "trainer", ("GKDTrainer", "DistillationTrainer"))
        if self.trainer == "DistillationTrainer":
            for name in ("lmbda", "seq_kd"):
                if getattr(self, name) not in (LIBRARY_DEFAULT, None):
                    raise ValueError(f"{name} = {getattr(self, name)!r}: DistillationTrainer has no {name} (it always "
                                     "trains on the student's rollouts); leave it unset")
                object.__setattr__(self, name, None)
        self._defaults(TRL_DEFAULTS[self.trainer])
        _number(self.beta, "beta", 0.0, 1.0)
        _number(self.temperature, "temperature", 0.0, low_open=True)
        if self.trainer == "GKDTrainer":
            _number(self.lmbda, "lmbda", 0.0, 1.0)
            _flag(self.seq_kd, "seq_kd")
        self._check_common()

    @classmethod
    def from_config(cls, config, weights=(1.0,), teachers="routed"):
        """The run of a TRL ``GKDConfig`` or ``DistillationConfig`` object (its beta, lmbda, seq_kd, temperature)."""
        trainer = {"GKDConfig": "GKDTrainer", "DistillationConfig": "DistillationTrainer"}.get(type(config).__name__)
        if trainer is None:
            raise ValueError(f"config = {type(config).__name__}: expected TRL's GKDConfig or DistillationConfig")
        names = ("beta", "lmbda", "seq_kd", "temperature") if trainer == "GKDTrainer" else ("beta", "temperature")
        return cls(trainer=trainer, weights=weights, teachers=teachers, **{n: getattr(config, n) for n in names})

    @property
    def loss_temperature(self):
        """The temperature the loss divides the logits by (GKDTrainer: 1; DistillationTrainer: ``temperature``)."""
        return 1.0 if self.trainer == "GKDTrainer" else self.temperature

    @property
    def samples(self):
        """'student', 'teacher' (seq_kd), 'dataset', or 'mixed:teacher' / 'mixed:dataset' (0 < lmbda < 1)."""
        if self.trainer == "DistillationTrainer":
            return "student"
        off = "teacher" if self.seq_kd else "dataset"
        return "student" if self.lmbda == 1.0 else off if self.lmbda == 0.0 else f"mixed:{off}"


# verl 0.9.1's registered distillation loss modes (get_distillation_loss_settings refuses any other)
VERL_LOSS_MODES = ("forward_kl_topk", "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# verl's two sets of defaults: the shipped Hydra config verl/trainer/config/distillation/distillation.yaml
# (what a run launched from verl's trainer gets) and the DistillationLossConfig dataclass (what a config
# built in Python gets)
VERL_DEFAULTS = {
    "yaml": dict(loss_mode="k3", topk=32, use_task_rewards=True, distillation_loss_coef=1.0, loss_max_clamp=None,
                 log_prob_min_clamp=None, use_policy_gradient=False),
    "dataclass": dict(loss_mode="k3", topk=128, use_task_rewards=True, distillation_loss_coef=1.0, loss_max_clamp=10.0,
                      log_prob_min_clamp=-10.0, use_policy_gradient=True),
}


@_run_description
class VerlRun(_Run):
    """verl's distillation (DistillationLossConfig): ``loss_mode`` (one of :data:`VERL_LOSS_MODES`: an estimator
    of kl_penalty on the student's sampled token, or ``forward_kl_topk``, the forward KL over the teacher's top
    ``topk`` tokens clamped at 0), ``use_policy_gradient`` (the negative loss as a per-token advantage instead of
    a loss), ``loss_max_clamp`` (the per-token loss clamped to [-c, c]), ``log_prob_min_clamp`` (forward_kl_topk's
    log-probabilities clamped from below), ``use_task_rewards`` (the task's PPO loss is added to the
    distillation loss, which is scaled by ``distillation_loss_coef``). A flag left unset takes the defaults of
    ``defaults``: "yaml" (the shipped Hydra config a launched run gets, the default here) or "dataclass"
    (:data:`VERL_DEFAULTS`). Samples are the student's rollouts; several teachers are routed by
    ``teacher_models.*.key`` (k ~ w per sample). ``vocab_size``: the vocabulary, to tell a full top-k."""
    loss_mode: str = LIBRARY_DEFAULT
    use_policy_gradient: bool = LIBRARY_DEFAULT
    topk: int = LIBRARY_DEFAULT
    use_task_rewards: bool = LIBRARY_DEFAULT
    distillation_loss_coef: float = LIBRARY_DEFAULT
    loss_max_clamp: float = LIBRARY_DEFAULT
    log_prob_min_clamp: float = LIBRARY_DEFAULT
    vocab_size: int = None
    defaults: str = "yaml"
    weights: tuple = (1.0,)
    teachers: str = "routed"
    samples: str = "student"

    def __post_init__(self):
        _choice(self.defaults, "defaults", tuple(VERL_DEFAULTS))
        self._defaults(VERL_DEFAULTS[self.defaults])
        if self.loss_mode not in VERL_LOSS_MODES:                                       # verl's own refusal
            raise ValueError(f"loss_mode = {self.loss_mode!r}: verl 0.9.1 refuses it (\"Unsupported loss mode: "
                             f"{self.loss_mode}. Supported modes are: {list(VERL_LOSS_MODES)}\")")
        _flag(self.use_policy_gradient, "use_policy_gradient")
        _flag(self.use_task_rewards, "use_task_rewards")
        _count(self.topk, "topk")
        _count(self.vocab_size, "vocab_size", allow_none=True, low=2)
        _number(self.distillation_loss_coef, "distillation_loss_coef", 0.0, low_open=True)
        if self.loss_max_clamp is not None:
            _number(self.loss_max_clamp, "loss_max_clamp", 0.0, low_open=True)
        if self.log_prob_min_clamp is not None:
            _number(self.log_prob_min_clamp, "log_prob_min_clamp")
        if self.loss_mode in ("k1", "kl") and not self.use_policy_gradient:           # verl's own refusal
            raise ValueError(f"loss_mode = {self.loss_mode!r} with use_policy_gradient = False: verl 0.9.1 refuses it "
                             "(\"Directly backpropagating k1 loss is incorrect since gradient of k1 loss wrt model "
                             "weights does not depend on teacher log probabilities.\")")
        _choice(self.teachers, "teachers", ("routed",))
        _choice(self.samples, "samples", ("student",))
        self._check_common()

    @classmethod
    def from_config(cls, config, defaults="yaml", weights=(1.0,), vocab_size=None):
        """The run of a verl ``DistillationLossConfig`` (or a mapping with its keys, as in the YAML's
        ``distillation.distillation_loss``); keys it does not have take ``defaults``' values."""
        get = config.get if isinstance(config, dict) else lambda name, default: getattr(config, name, default)
        flags = {name: get(name, LIBRARY_DEFAULT) for name in VERL_DEFAULTS["yaml"]}
        return cls(defaults=defaults, weights=weights, vocab_size=vocab_size, **flags)


@_run_description
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


# LigerFusedLinearJSDLoss.__init__'s defaults (liger-kernel 0.8.5)
LIGER_DEFAULTS = dict(weight_hard_loss=0.5, weight_soft_loss=0.5, beta=0.5, temperature=1.0)


@_run_description
class LigerRun(_Run):
    """Liger's ``LigerFusedLinearJSDLoss(weight_hard_loss, weight_soft_loss, beta, temperature)``: the loss
    is ``weight_hard_loss`` times the cross-entropy of the student (at temperature 1) on the batch's own
    tokens (``true_labels``) plus ``weight_soft_loss`` times the generalised JSD at ``temperature`` (both
    sides' logits divided by it). Unset flags take Liger's defaults (:data:`LIGER_DEFAULTS`: 0.5, 0.5, 0.5,
    1.0). ``samples``: where the batch's tokens come from (a data set's responses by default)."""
    beta: float = LIBRARY_DEFAULT
    temperature: float = LIBRARY_DEFAULT
    weight_hard_loss: float = LIBRARY_DEFAULT
    weight_soft_loss: float = LIBRARY_DEFAULT
    weights: tuple = (1.0,)
    teachers: str = "pooled"
    samples: str = "dataset"

    def __post_init__(self):
        self._defaults(LIGER_DEFAULTS)
        _number(self.beta, "beta", 0.0, 1.0)
        _number(self.temperature, "temperature", 0.0, low_open=True)
        _number(self.weight_hard_loss, "weight_hard_loss", 0.0)
        _number(self.weight_soft_loss, "weight_soft_loss", 0.0)
        if self.weight_hard_loss == 0 and self.weight_soft_loss == 0:
            raise ValueError("weight_hard_loss = weight_soft_loss = 0: the loss is 0 and nothing is trained")
        self._check_common()

    @classmethod
    def from_loss(cls, loss, weights=(1.0,), teachers="pooled", samples="dataset"):
        """The run of a ``LigerFusedLinearJSDLoss`` module (its weight_hard_loss, weight_soft_loss, beta, temperature)."""
        if type(loss).__name__ != "LigerFusedLinearJSDLoss":
            raise ValueError(f"loss = {type(loss).__name__}: expected Liger's LigerFusedLinearJSDLoss")
        return cls(weights=weights, teachers=teachers, samples=samples, **{n: getattr(loss, n) for n in LIGER_DEFAULTS})


# NeMo-RL's shipped X-Token multi-teacher config (examples/configs/xtoken_multiteacher_off_policy_distillation.yaml):
# loss_fn's kl_loss_weight, ce_loss_scale, dynamic_loss_scaling, kd_loss_mode; policy.train_micro_batch_size 1
NEMO_XTOKEN_DEFAULTS = dict(kl_loss_weight=1.0, ce_loss_scale=0.1, dynamic_loss_scaling=True, kd_loss_mode="sum")


@_run_description
class NeMoRLRun(_Run):
    """NeMo-RL (derived from source, see SOURCES): ``loss_fn="DistillationLossFn"`` (on-policy distillation,
    one teacher: ``kl_type`` forward / reverse / mixed with ``mixed_kl_weight``, ``zero_outside_topk``,
    the teacher's ``topk`` logits; ``topk=None``: the whole vocabulary) or
    ``"CrossTokenizerDistillationLossFn"`` (X-Token off-policy distillation on a data set, same-vocabulary
    teachers: ``kd_loss_mode`` sum / averaged_logits / select_teacher x ``reverse_kl``, teacher weights),
    which always adds the student's cross-entropy on the data: ``kl_loss_weight * kd + ce_loss_scale * ce``,
    or with ``dynamic_loss_scaling`` ``sg(ce / kd) * kd + ce`` per micro-batch. ``micro_batches``: how many
    micro-batches the data set is split into (each rescales, and select_teacher picks its teacher, on its
    own); None: one response each (the shipped ``train_micro_batch_size: 1``). Unset flags take the shipped
    multi-teacher config's values (:data:`NEMO_XTOKEN_DEFAULTS`)."""
    loss_fn: str = "DistillationLossFn"
    kl_type: str = "mixed"
    mixed_kl_weight: float = 0.5
    zero_outside_topk: bool = False
    topk: int = None
    kd_loss_mode: str = LIBRARY_DEFAULT
    reverse_kl: bool = False
    kl_loss_weight: float = LIBRARY_DEFAULT
    ce_loss_scale: float = LIBRARY_DEFAULT
    dynamic_loss_scaling: bool = LIBRARY_DEFAULT
    micro_batches: int = None
    weights: tuple = (1.0,)
    teachers: str = "pooled"

    def __post_init__(self):
        self._defaults(NEMO_XTOKEN_DEFAULTS)
        _choice(self.loss_fn, "loss_fn", ("DistillationLossFn", "CrossTokenizerDistillationLossFn"))
        _choice(self.kl_type, "kl_type", ("forward", "reverse", "mixed"))
        _number(self.mixed_kl_weight, "mixed_kl_weight", 0.0, 1.0)
        _choice(self.kd_loss_mode, "kd_loss_mode", ("sum", "averaged_logits", "select_teacher"))
        for name in ("zero_outside_topk", "reverse_kl", "dynamic_loss_scaling"):
            _flag(getattr(self, name), name)
        _count(self.topk, "topk", allow_none=True)
        _count(self.micro_batches, "micro_batches", allow_none=True)
        _number(self.kl_loss_weight, "kl_loss_weight", 0.0)
        _number(self.ce_loss_scale, "ce_loss_scale", 0.0)
        if self.loss_fn == "DistillationLossFn" and len(self.weights) != 1:
            raise ValueError(f"weights = {self.weights!r}: DistillationLossFn takes one teacher")
        _choice(self.teachers, "teachers", ("pooled",))
        self._check_common()

    @property
    def samples(self):
        return "student" if self.loss_fn == "DistillationLossFn" else "dataset"


@_run_description
class TinkerRun(_Run):
    """tinker-cookbook's on-policy distillation (``incorporate_kl_penalty``): the per-token advantage
    -kl_penalty_coef (ln q - ln p) on the student's rollouts, summed over the future with
    ``kl_discount_factor``; several teachers are routed by data set (one teacher per data set). Defaults are
    the cookbook's Config (discount 0, coefficient 1)."""
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


@_run_description
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


def _full_logit(beta, run, samples, source, temperature, sampling_temperature=1.0):
    weights, note = _weights_note(run, samples)
    target = "A" if beta == 0 else "l" if beta == 1 else ("J" if run.K > 1 else "A")
    theory = T1 if target == "A" and beta == 0 else T2 if target == "l" else JSD
    if run.K == 1 and 0 < beta < 1:
        theory = "JSD_beta(p, q) = 0 iff q = p: one teacher is reached at every beta"
    if weights == "prior":
        sampling_temperature = 1.0            # the samples' temperature sets no weight
    return Prediction(target, weights=weights, beta=beta if target == "J" else None,
                      reason=f"A per-context loss on the full distributions; {note}; {theory}.",
                      source=source, temperature=temperature, sampling_temperature=sampling_temperature,
                      lmbda=getattr(run, "lmbda", None) if weights == "visitation" else None)


COMPUTED = ("no closed form: llm_bridge.run_dynamics.fixed_point computes where it goes on finite-state teachers, "
            "and how far that is from A, l, J, g and each teacher")


def _computed(reason, source):
    return Prediction("computed", reason=f"{reason}; {COMPUTED}.", source=source)


def _trl(run):
    source = SOURCES[f"TRL {run.trainer}"]
    if run.trainer == "DistillationTrainer":
        prediction = _full_logit(run.beta, run, "student", source, run.temperature)
        return dataclasses.replace(prediction, reason=prediction.reason + f" DistillationTrainer samples at "
                                   f"temperature {run.temperature:g} and divides both sides' logits by it in the loss.")
    prediction = _full_logit(run.beta, run, run.samples, source, 1.0, run.temperature)
    return dataclasses.replace(prediction, reason=prediction.reason + " GKDTrainer's compute_loss calls "
                               "generalized_jsd_loss without a temperature (the loss is at temperature 1); its "
                               f"temperature ({run.temperature:g}) only draws the samples, which sets the weights only "
                               "where the teachers' own traces are mixed in (seq_kd, routed).")


def _liger(run):
    source = SOURCES["Liger"]
    soft = _full_logit(run.beta, run, run.samples, source, run.temperature)
    if run.weight_hard_loss == 0 or run.samples == "student":
        why = ("weight_hard_loss = 0" if run.weight_hard_loss == 0 else
               "the hard loss is the cross-entropy on the student's own samples, whose expected gradient is 0")
        return dataclasses.replace(soft, reason=soft.reason + f" {why}: only the soft loss moves the student.")
    if run.weight_soft_loss == 0:
        return Prediction("data", reason="weight_soft_loss = 0: only the cross-entropy on the batch's tokens, "
                          "minimised by the data's own conditionals", source=source)
    share = run.weight_hard_loss / (run.weight_hard_loss + run.weight_soft_loss)
    if run.beta == 0 and run.temperature == 1.0 and run.samples == "dataset" and soft.weights == "prior":
        return Prediction("mix", data_share=share, source=source, reason=(
            f"weight_hard_loss CE(d, q) + weight_soft_loss KL(A || q) = -(h d + s A) . ln q + const: minimised by "
            f"the mixture (h d + s A) / (h + s), the data's conditionals d with share {share:.3g} (T1's argument with "
            "the data as one more teacher)"))
    return _computed(f"the hard loss (weight {run.weight_hard_loss:g}: the cross-entropy on the batch's own tokens "
                     f"at temperature 1) beside the soft JSD_{run.beta:g} at temperature {run.temperature:g}", source)


def _verl(run):
    source = SOURCES["verl"]
    task = ("the task reward is constant" if run.use_task_rewards else "")
    clamp = (f" loss_max_clamp = {run.loss_max_clamp:g} clamps the per-token loss (zero gradient where it binds)."
             if run.loss_max_clamp is not None else "")
    if run.loss_max_clamp is not None and run.loss_mode not in ("k3", "low_var_kl"):   # k3: verl clamps it at 10 anyway
        task = " and ".join(filter(None, [task, f"the clamp at {run.loss_max_clamp:g} does not bind"]))
    if run.loss_mode == "forward_kl_topk":
        if run.use_policy_gradient:
            return Prediction("none", source=source, reason=(
                "forward_kl_topk's value is one number per context (a KL over the teacher's top k), so as an advantage "
                "it is the same for every token sampled there, and its expected policy gradient, A E_q grad ln q, is 0: "
                "the student does not move (verl itself warns that the top-k signal is unused)"))
        if run.vocab_size is not None and run.topk >= run.vocab_size:
            weights, note = _weights_note(run, "student")
            floor = (f" log_prob_min_clamp = {run.log_prob_min_clamp:g} floors the log-probabilities (no gradient "
                     "below it)." if run.log_prob_min_clamp is not None else "")
            return Prediction("A", weights=weights, condition=task, source=source, reason=(
                f"the top-k forward KL with k = V is the forward KL; {note}; {T1}.{floor}{clamp}"))
        return _computed("the forward KL over the teacher's top k only, clamped at 0: the partial sum's minimiser "
                         "is the teacher renormalised on its top k, where it is m ln m < 0 (m the top-k mass), so the "
                         "clamp at 0 stops the gradient first", source)
    if run.loss_mode == "abs":
        if run.use_policy_gradient:
            return _computed("|ln q - ln p| as a per-token advantage", source)
        return _computed("|ln q - ln p| has a sign-valued gradient: for one teacher it stops at p; with several, "
                         "wherever the weighted signs balance (a set of fixed points: where the run enters it)", source)
    estimator = {"kl": "k1", "k1": "k1", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}[run.loss_mode]
    prediction = _estimator(estimator, "reward" if run.use_policy_gradient else "loss", "student", "routed", run, source)
    if prediction.target == "none":
        return _computed(f"{run.loss_mode} as a per-token advantage (the negative loss) is no divergence's gradient "
                         "(theory section 4's table: only k1 is)", source)
    extra = ""
    if estimator == "k3" and not run.use_policy_gradient:
        extra = (" verl's k3 clamps ln(p/q) to [-20, 20] and the value to [-10, 10]: no gradient where "
                 "p_k/q > 12.5, which at A needs a teacher of weight below 0.08.")
    reason = prediction.reason + extra + clamp
    if run.use_task_rewards:
        reason += (f" use_task_rewards: the task's PPO loss is added (the distillation loss scaled by "
                   f"{run.distillation_loss_coef:g}); a task reward that varies between responses moves the fixed point "
                   "(llm_bridge.run_dynamics.fixed_point with reward=...).")
    return dataclasses.replace(prediction, reason=reason, condition=task)


def _tinker(run):
    source = SOURCES["tinker-cookbook"]
    if run.kl_discount_factor in (0.0, 1.0):
        return _estimator("k1", "reward", "student", "routed", run, source, gamma=run.kl_discount_factor)
    return _computed(f"a discount of {run.kl_discount_factor:g}, strictly between 0 and 1, solves a discounted "
                     "soft-control problem: its policy lies between l (discount 0) and g (discount 1) and is no pool "
                     "of theory section 2", source)


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
        return _trl(run)
    if isinstance(run, LigerRun):
        return _liger(run)
    if isinstance(run, TorchRLRun):
        return _estimator("k3", "loss", run.samples, run.teachers, run, SOURCES["torchrl"], direction=run.kl_direction)
    if isinstance(run, VerlRun):
        return _verl(run)
    if isinstance(run, NeMoRLRun):
        return _nemo_rl(run)
    if isinstance(run, TinkerRun):
        return _tinker(run)
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
    ce = not run.dynamic_loss_scaling and run.ce_loss_scale == 0
    if ce and run.kd_loss_mode == "select_teacher" and run.micro_batches == 1:
        return Prediction("select", source=source, reason="select_teacher keeps only the teacher of lowest next-token "
                          "cross-entropy on the data (argmin_k CE, one micro-batch: the whole data set); the student "
                          "then learns that teacher alone (ce_loss_scale = 0: no data term)")
    if ce and run.kd_loss_mode != "select_teacher":
        if run.kd_loss_mode == "averaged_logits":
            return Prediction("l", weights=weights, source=source, reason="averaged_logits averages the teachers' "
                              "logits with weights w / sum(w): softmax(sum_k w_k z_k) is the geometric pool l, and one "
                              "KL to it, in either direction, vanishes only at l (T2's pool without T2's loss)")
        if run.reverse_kl:
            return Prediction("l", weights=weights, reason=f"sum: sum_i w_i KL(q || p_i) per position; {note}; {T2}.",
                              source=source)
        return Prediction("A", weights=weights, reason=f"sum: sum_i w_i KL(p_i || q) per position; {note}; {T1}.",
                          source=source)
    term = ("sg(ce / kd) * kd + ce per micro-batch (dynamic_loss_scaling)" if run.dynamic_loss_scaling else
            f"{run.kl_loss_weight:g} kd + {run.ce_loss_scale:g} ce")
    if (not run.dynamic_loss_scaling and run.kd_loss_mode == "sum" and not run.reverse_kl
            and run.kl_loss_weight > 0):
        share = run.ce_loss_scale / (run.kl_loss_weight + run.ce_loss_scale)
        return Prediction("mix", data_share=share, source=source, reason=(
            f"sum with forward KL and the student's cross-entropy on the data, {term}: -(c d + k A) . ln q + const, "
            f"minimised by the mixture (c d + k A) / (c + k), the data's share {share:.3g} (T1 with the data as one "
            "more teacher)"))
    if run.kl_loss_weight == 0 and not run.dynamic_loss_scaling:
        return Prediction("data", reason="kl_loss_weight = 0: only the cross-entropy on the data", source=source)
    select = (" select_teacher picks, per micro-batch, the teacher of lowest next-token cross-entropy on that "
              "micro-batch's tokens, so the teacher changes between micro-batches;" if run.kd_loss_mode == "select_teacher"
              else "")
    return _computed(f"CrossTokenizerDistillationLossFn always adds the student's cross-entropy on the data: {term};"
                     f"{select} with dynamic scaling the KD term's weight grows without bound as kd -> 0, and where the "
                     "data's cross-entropy is large against kd there may be no fixed point at all (the student circles A)"
                     if run.dynamic_loss_scaling else f"CrossTokenizerDistillationLossFn adds the student's cross-entropy "
                     f"on the data: {term};{select}", source)


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


def context_weights(machine, weights, kind, sampling_temperature=1.0):
    """(S, K) teacher weights per state: the prior w, or the posterior ∝ w_k p_k(prefix) (theory section 2),
    the prefix drawn at ``sampling_temperature``."""
    w = np.asarray(weights, dtype=float)
    S = machine.next_state.shape[0]
    if kind == "prior":
        return np.broadcast_to(w, (S, len(w))).copy()
    with np.errstate(divide="ignore"):
        log_post = np.log(w)[:, None] + _log_prefix(tempered(machine, sampling_temperature))
    log_post -= np.logaddexp.reduce(log_post, axis=0)
    return np.exp(log_post).T


def tempered(machine, temperature):
    """The machine with every conditional at ``temperature``: softmax(ln p / temperature)."""
    if temperature == 1.0:
        return machine
    lp = np.asarray(machine.log_probs, dtype=float) / temperature
    return ag.FiniteStateTeachers(machine.next_state, lp - np.logaddexp.reduce(lp, axis=-1, keepdims=True),
                                  machine.start)


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


def target_log_probs(prediction, machine, weights, horizon=None, data_log_probs=None):
    """The student's predicted conditionals ``(S, n)`` at every state of a prefix-tree machine (for 'g'
    the sequence-level conditionals over the tree's depth; for 'mix' and 'data' the data's conditionals
    ``data_log_probs``, default uniform). At a temperature tau the student's softmax(z / tau) is the pool
    of the tempered teachers, so its own conditionals are that pool's tau-th power, renormalised. A
    ValueError for a prediction without closed form ('computed', 'select', 'none', 'diverges'): see
    llm_bridge.run_dynamics.fixed_point."""
    if prediction.target not in ("A", "l", "J", "g", "mix", "data"):
        raise ValueError(f"prediction.target = {prediction.target!r} names no conditionals "
                         "(llm_bridge.run_dynamics.fixed_point computes where such a run goes)")
    tau = prediction.temperature
    if tau != 1.0:
        pooled = target_log_probs(dataclasses.replace(prediction, temperature=1.0), tempered(machine, tau), weights,
                                  horizon, data_log_probs)
        return pooled * tau - np.logaddexp.reduce(pooled * tau, axis=-1, keepdims=True)
    depth, _ = prefix_depths(machine)
    if prediction.target in ("mix", "data"):
        S, n = machine.next_state.shape
        data = np.full((S, n), -np.log(n)) if data_log_probs is None else np.asarray(data_log_probs, dtype=float)
        if prediction.target == "data":
            return data
        A = target_log_probs(Prediction("A"), machine, weights)
        h = prediction.data_share
        return np.logaddexp(np.log(h) + data, np.log1p(-h) + A)
    if prediction.target == "g":
        H = int(depth.max()) + 1 if horizon is None else horizon
        g = ag.sequence_geometric_conditionals(machine, np.asarray(weights, float), H)
        return g[depth, np.arange(len(depth))]
    lp = machine.log_probs
    if prediction.weights == "visitation":        # top-down: the weights at depth d need the target above
        w = np.asarray(weights, dtype=float)
        sampled = tempered(machine, prediction.sampling_temperature)
        teacher_prefix = w[:, None] * np.exp(_log_prefix(sampled))      # (K, S) w_k p_k(u), traces at temperature
        _, parent = prefix_depths(machine)
        out, q_prefix = np.zeros(lp.shape[1:]), np.ones(len(depth))
        for d in range(int(depth.max()) + 1):
            at = np.nonzero(depth == d)[0]
            for s in at:
                if parent[s] >= 0:
                    a = int(np.nonzero(machine.next_state[parent[s]] == s)[0][0])
                    row = out[parent[s]] / prediction.sampling_temperature
                    q_prefix[s] = q_prefix[parent[s]] * np.exp(row[a] - np.logaddexp.reduce(row))
            c = prediction.lmbda * q_prefix[at, None] * w + (1 - prediction.lmbda) * teacher_prefix[:, at].T
            out[at] = _pool(prediction, lp[:, at], c / c.sum(1, keepdims=True))
        return out
    return _pool(prediction, lp, context_weights(machine, weights, prediction.weights, prediction.sampling_temperature))


def _pool(prediction, lp, c):
    """Prediction A / l / J of the teachers' log-probs lp (K, S, n) with weights c (S, K)."""
    if prediction.target == "A":
        with np.errstate(divide="ignore"):
            return np.logaddexp.reduce(np.log(c.T)[:, :, None] + lp, axis=0)
    if prediction.target == "l":
        r = np.einsum("sk,ksn->sn", c, lp)
        return r - np.logaddexp.reduce(r, axis=-1, keepdims=True)
    return jsd_barycentre(lp, c, prediction.beta)


KEY_FLAGS = {"TRLRun": ("beta", "lmbda", "seq_kd", "teachers", "temperature"),
             "VerlRun": ("loss_mode", "use_policy_gradient", "topk", "use_task_rewards", "loss_max_clamp",
                         "log_prob_min_clamp"),
             "NeMoRLRun": ("kl_type",), "TinkerRun": ("kl_discount_factor",),
             "TorchRLRun": ("kl_direction",),
             "LigerRun": ("beta", "temperature", "weight_hard_loss", "weight_soft_loss", "teachers", "samples"),
             "OwnRun": ("teachers", "samples")}
OWN_FLAGS = {"generalized_jsd": ("beta",), "rkl_policy_gradient": ("gamma",),
             "kl_estimator_loss": ("estimator", "mode", "pool", "direction")}


def describe(run):
    """The run in its library's words: 'TRL GKDTrainer beta=0.5 lmbda=1.0 seq_kd=False teachers=routed temperature=0.9'."""
    library = {TRLRun: f"TRL {getattr(run, 'trainer', '')}", VerlRun: "verl", TorchRLRun: "torchrl DistillationLoss",
               NeMoRLRun: f"NeMo-RL {getattr(run, 'loss_fn', '')}", TinkerRun: "tinker-cookbook on-policy distillation",
               LigerRun: "Liger LigerFusedLinearJSDLoss", OwnRun: f"{getattr(run, 'loss', '')}"}
    if type(run) not in library:
        raise ValueError(f"run = {run!r} is not a run description")
    names = KEY_FLAGS[type(run).__name__] + (OWN_FLAGS.get(run.loss, ()) if isinstance(run, OwnRun) else ())
    if isinstance(run, TRLRun) and run.trainer == "DistillationTrainer":
        names = ("beta", "teachers", "temperature")
    if isinstance(run, NeMoRLRun):
        names = ("kl_type", "topk") if run.loss_fn == "DistillationLossFn" else (
            "kd_loss_mode", "reverse_kl", "kl_loss_weight", "ce_loss_scale", "dynamic_loss_scaling", "micro_batches")
    if isinstance(run, VerlRun):
        names = ("loss_mode", "topk", "log_prob_min_clamp") if run.loss_mode == "forward_kl_topk" else ("loss_mode",)
        names += ("use_policy_gradient", "use_task_rewards", "loss_max_clamp")
    return " ".join([library[type(run)], *(f"{n}={getattr(run, n)}" for n in names)])
