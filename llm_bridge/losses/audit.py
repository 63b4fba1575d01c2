"""The estimator audit: the exact expected gradient of every sampled-token estimator configuration, no
sampling, and which divergence's gradient it equals (theory section 4)."""

from dataclasses import dataclass
from itertools import product

import torch

from ._engine import check_weights
from .sampled import DIRECTIONS, ESTIMATORS, VERL_LOG_RATIO_CLAMP

TEACHER_SETUPS = ("one", "pooled", "per-teacher", "routed")
MODES = ("loss", "reward")
SAMPLES = ("student", "teacher", "teacher + IS")


@dataclass(frozen=True)
class _Setup:
    """The student and one teacher set-up at the audited positions (rows n, vocabulary V)."""
    lq: torch.Tensor            # (n, V) ln q
    q: torch.Tensor             # (n, V)
    tau: float                  # the student's temperature
    weights: torch.Tensor       # (K',) the teachers' weights ('one': [1])
    lp: torch.Tensor            # (K', n, V) the teachers' log-probs
    r_pool: torch.Tensor        # (n, V) sum_k w_k ln p_k over the teachers with w_k > 0
    log_a: torch.Tensor         # (n, V) ln A, A = sum_k w_k p_k


def _expected(setup, sample_lp, phi):
    """E_{x ~ s}[phi(x) (e_x - q)] / tau, s = exp(sample_lp) (n, V), phi (n, V)."""
    sp = sample_lp.exp() * phi
    return (sp - setup.q * sp.sum(-1, keepdim=True)) / setup.tau


def _rkl_gradient(setup, r):
    d = setup.lq - r
    return setup.q * (d - (setup.q * d).sum(-1, keepdim=True)) / setup.tau


def _setup(lq, lp, weights, teachers, tau):
    wk, lp_k = (torch.ones(1, dtype=torch.float64), lp[:1]) if teachers == "one" else (weights, lp)
    keep = wk > 0
    r_pool = (wk[keep][:, None, None] * lp_k[keep]).sum(0)
    log_a = torch.logsumexp(torch.log(wk[keep])[:, None, None] + lp_k[keep], 0)
    return _Setup(lq=lq, q=lq.exp(), tau=tau, weights=wk, lp=lp_k, r_pool=r_pool, log_a=log_a)


def _references(setup):
    """The reference gradients an estimator may equal."""
    log_l = setup.r_pool - torch.logsumexp(setup.r_pool, -1, keepdim=True)
    refs = {"FKL to A": (setup.q - setup.log_a.exp()) / setup.tau, "RKL to l": _rkl_gradient(setup, setup.r_pool),
            "FKL to l": (setup.q - log_l.exp()) / setup.tau}
    refs["minus FKL to A"] = -refs["FKL to A"]
    return refs


def _clamped_k3(clamp):
    """verl's low_var_kl: k3 of r clamped to [-20, 20], the value clamped at ``clamp``; its gradient is 0
    wherever either clamp binds."""
    def value(r):
        return (torch.expm1(r.clamp(-VERL_LOG_RATIO_CLAMP, VERL_LOG_RATIO_CLAMP))
                - r.clamp(-VERL_LOG_RATIO_CLAMP, VERL_LOG_RATIO_CLAMP)).clamp(-clamp, clamp)

    def derivative(r):
        free = (r.abs() <= VERL_LOG_RATIO_CLAMP) & ((torch.expm1(r) - r) < clamp)
        return torch.where(free, torch.expm1(r), torch.zeros_like(r))
    return value, derivative


def _phi(functions, mode, samples, r, sample_lp, lq, direction):
    """The per-sample coefficient of (e_x - q): -c k'(r) as a loss, c k(r) as a reward (c: the IS weight);
    direction 'forward' uses r' = ln q - ln p = -r, whose derivative in ln q is +k'(r')."""
    value, derivative = functions
    c = torch.ones_like(r) if samples != "teacher + IS" else (lq - sample_lp).exp()
    if direction == "forward":
        return c * derivative(-r) if mode == "loss" else c * value(-r)
    return -c * derivative(r) if mode == "loss" else c * value(r)


def _gradient(setup, teachers, functions, mode, samples, direction="reverse"):
    """The exact expected gradient of one configuration."""
    lq, wk, lp_k = setup.lq, setup.weights, setup.lp
    live = [k for k in range(len(wk)) if wk[k] > 0]
    if teachers == "routed":                                  # k ~ w, then teacher k alone
        return sum(wk[k] * _expected(setup, lq if samples == "student" else lp_k[k],
                                     _phi(functions, mode, samples, lp_k[k] - lq,
                                          lq if samples == "student" else lp_k[k], lq, direction))
                   for k in live)
    sample_lp = lq if samples == "student" else setup.log_a
    if teachers in ("one", "pooled"):
        return _expected(setup, sample_lp, _phi(functions, mode, samples, setup.r_pool - lq, sample_lp, lq, direction))
    if mode == "loss" or direction == "forward":              # per-teacher: sum_k w_k k(r_k)
        phi = sum(wk[k] * _phi(functions, mode, samples, lp_k[k] - lq, sample_lp, lq, direction) for k in live)
    else:
        c = torch.ones_like(lq) if samples != "teacher + IS" else (lq - sample_lp).exp()
        phi = c * sum(wk[k] * functions[0](lp_k[k] - lq) for k in live)
    return _expected(setup, sample_lp, phi)


def _label(g, refs, tolerance):
    """The relative error against each reference and the reference g equals: within ``tolerance``, or
    the same direction scaled per position ('FKL to l x 0.83'), or 'none'."""
    scale = refs["FKL to A"].norm()
    errs = {name: float((g - ref).norm() / ref.norm().clamp(min=1e-300)) for name, ref in refs.items()}
    errs["zero"] = float(g.norm() / scale.clamp(min=1e-300))
    equals = next((name for name, e in errs.items() if e < tolerance), None)
    if equals is not None:
        return errs, equals
    for name, ref in refs.items():
        c = (g * ref).sum(-1, keepdim=True) / (ref * ref).sum(-1, keepdim=True).clamp(min=1e-300)
        if bool((c > 0).all()) and float((g - c * ref).norm() / g.norm().clamp(min=1e-300)) < tolerance:
            return errs, f"{name} x {float(c.min()):.2g}..{float(c.max()):.2g}"
    return errs, "none"


def audit_estimators(student_logits, teacher_logits, weights, *, student_temperature=1.0,
                     teacher_temperature=1.0, tolerance=1e-6, clamp=None):
    """Exact expected gradient, with respect to the student's logits, of every sampled-token estimator
    configuration, and which divergence's gradient it equals (theory section 4).

    student_logits (..., V) and teacher_logits (K, ..., V) at some positions; weights (K,). For a
    sample x from s with weight c(x) and per-sample loss L(x), E_s[grad L] = sum_x s(x) phi(x) (e_x - q)
    / tau_s, with phi = -c k'(r) for an estimator used as a loss and phi = c k(r) as a reward. The
    configurations: estimator k1 / k2 / k3 / k3+ (verl's: k3's value, k2's gradient) x mode loss /
    reward x samples from the student, from the teachers, from the teachers with importance weights
    q / s x teachers: 'one' (teacher 0 alone), 'pooled' (one estimator on sum_k w_k ln p_k - ln q;
    teacher samples from the mixture A), 'per-teacher' (sum_k w_k k(r_k); samples from A), 'routed'
    (k ~ w per sample, teacher k's estimator and samples) x direction 'reverse' (r = ln p - ln q) or
    'forward' (r = ln q - ln p, torchrl's kl_direction='forward'). k3 here is unclamped; ``clamp``
    (verl's low_var_kl: 10) adds the rows of estimator 'k3 clamp 10', whose gradient is 0 where the
    clamp binds.

    Returns a pandas DataFrame, one row per configuration: the relative error of the expected gradient
    against each reference gradient (FKL to A: q - A; RKL to l: grad sum_k w_k KL(q || p_k); FKL to l:
    q - l; minus FKL to A; zero: |g| / |q - A|) and ``equals``: the reference within ``tolerance`` (for
    'one', A = l = p_0), or the best direction with its scale ('FKL to l x 0.83'), or 'none'.
    """
    import pandas as pd
    s = torch.as_tensor(student_logits, dtype=torch.float64)
    t = torch.as_tensor(teacher_logits, dtype=torch.float64)
    if t.ndim != s.ndim + 1 or t.shape[1:] != s.shape:
        raise ValueError(f"teacher_logits must have shape (K,) + {tuple(s.shape)}, got {tuple(t.shape)}")
    if clamp is not None and not (isinstance(clamp, (int, float)) and clamp > 0):
        raise ValueError(f"clamp = {clamp!r} must be None or a positive number")
    K, V = t.shape[0], s.shape[-1]
    w = check_weights(weights, K, 1)[0]
    lq = torch.log_softmax(s.reshape(-1, V) / student_temperature, -1)
    lp = torch.log_softmax(t.reshape(K, -1, V) / teacher_temperature, -1)
    estimators = dict(ESTIMATORS)
    if clamp is not None:
        estimators[f"k3 clamp {clamp:g}"] = _clamped_k3(float(clamp))
    rows = []
    for direction, teachers in product(DIRECTIONS, TEACHER_SETUPS):
        setup = _setup(lq, lp, w, teachers, student_temperature)
        refs = _references(setup)
        for estimator, mode, samples in product(estimators, MODES, SAMPLES):
            g = _gradient(setup, teachers, estimators[estimator], mode, samples, direction)
            errs, equals = _label(g, refs, tolerance)
            rows.append(dict(estimator=estimator, mode=mode, samples=samples, teachers=teachers, direction=direction,
                             equals=equals, **{f"err {name}": e for name, e in errs.items()}))
    return pd.DataFrame(rows)
