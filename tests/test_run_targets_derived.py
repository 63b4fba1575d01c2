"""Run targets of libraries that cannot be installed here, from their source (derived, not run):
NeMo-RL's DistillationLossFn and CrossTokenizerDistillationLossFn (same-vocabulary teachers, whole
vocabulary) and tinker-cookbook's on-policy distillation, re-implemented below line by line from

  NVIDIA-NeMo/RL @ 7ea279abfbeb698b092856d0dab61e7cf39bc909, nemo_rl/algorithms/loss/loss_functions.py
    (DistillationLossFn.__call__; CrossTokenizerDistillationLossFn._sum_kd, _averaged_logits_kd,
    _select_teacher_kd, _direct_full_vocab_kl)
  thinking-machines-lab/tinker-cookbook @ 9dfcc3a2cf44432d621a01005073dc6d76a1e87a,
    tinker_cookbook/distillation/train_on_policy.py (incorporate_kl_penalty) and
    tinker_cookbook/rl/metrics.py (discounted_future_sum_vectorized)

and minimised on the tabular student as the library rows are (tests/run_targets_harness.py).
"""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import run_targets_harness as harness
from llm_bridge import runs
from llm_bridge.runs import NeMoRLRun, TinkerRun, predict_target
from test_run_targets import WEIGHTS, check

XTOKEN = "CrossTokenizerDistillationLossFn"


# --- NeMo-RL, from source -----------------------------------------------------------------------
def nemo_distillation_rows(student_logits, teacher_logits, kl_type, mixed_kl_weight):
    """DistillationLossFn.__call__'s per_token_kl with the whole vocabulary as the top k."""
    student_topk_logprobs = torch.log_softmax(student_logits, -1)
    teacher_topk_logprobs = torch.log_softmax(teacher_logits, -1)
    student_probs, teacher_probs = student_topk_logprobs.exp(), teacher_topk_logprobs.exp()
    if kl_type == "forward":
        per_token_kl = teacher_probs * (teacher_topk_logprobs - student_topk_logprobs)
    elif kl_type == "reverse":
        per_token_kl = student_probs * (student_topk_logprobs - teacher_topk_logprobs)
    else:
        kl_forward = teacher_probs * (teacher_topk_logprobs - student_topk_logprobs)
        kl_reverse = student_probs * (student_topk_logprobs - teacher_topk_logprobs)
        per_token_kl = mixed_kl_weight * kl_forward + (1.0 - mixed_kl_weight) * kl_reverse
    return per_token_kl.sum(dim=-1)


def nemo_direct_kl_rows(student_logits, teacher_logits, reverse_kl, T=1.0):
    """_direct_full_vocab_kl's per-position KL."""
    student_log_probs = torch.log_softmax(student_logits / T, -1)
    teacher_log_probs = torch.log_softmax(teacher_logits.float().double() / T, dim=-1)
    if reverse_kl:
        return F.kl_div(teacher_log_probs, student_log_probs, reduction="none", log_target=True).sum(dim=-1)
    return F.kl_div(student_log_probs, teacher_log_probs, reduction="none", log_target=True).sum(dim=-1)


def nemo_loss(run, tab):
    K = tab.lp.shape[0]
    w = list(run.weights)
    if run.loss_fn == "DistillationLossFn":
        return lambda theta: nemo_distillation_rows(theta, tab.lp[0], run.kl_type, run.mixed_kl_weight).sum()
    if run.kd_loss_mode == "sum":                                       # total_kd = sum_i weight_i KD_i
        return lambda theta: sum(w[i] * nemo_direct_kl_rows(theta, tab.lp[i], run.reverse_kl).sum() for i in range(K))
    if run.kd_loss_mode == "averaged_logits":                           # convex average of logits, one KL
        avg = sum(tab.lp[i] * (w[i] / sum(w)) for i in range(K))
        return lambda theta: nemo_direct_kl_rows(theta, avg, run.reverse_kl).sum()
    best = select_teacher(tab)                                          # _select_teacher_kd: lowest CE
    return lambda theta: nemo_direct_kl_rows(theta, tab.lp[best], run.reverse_kl).sum()


def data_paths(tab):
    """The data set of the select_teacher rows: every response of the tree, equally likely."""
    n = tab.lp.shape[2]
    paths = torch.cartesian_prod(*[torch.arange(n)] * harness.DEPTH)
    states = torch.zeros_like(paths)
    for h in range(1, harness.DEPTH):
        states[:, h] = torch.tensor(tab.m.next_state)[states[:, h - 1], paths[:, h - 1]]
    return paths, states


def select_teacher(tab):
    """_select_teacher_kd's choice: the teacher with the lowest mean next-token cross-entropy on the data."""
    paths, states = data_paths(tab)
    ces = [float(F.cross_entropy(tab.lp[i][states].reshape(-1, tab.lp.shape[2]), paths.reshape(-1)))
           for i in range(tab.lp.shape[0])]
    return int(min(range(len(ces)), key=lambda j: ces[j]))


# --- tinker-cookbook, from source ---------------------------------------------------------------
def discounted_future_sum_vectorized(x, gamma):
    """tinker_cookbook/rl/metrics.py, over the last axis."""
    result = torch.empty_like(x)
    running = torch.zeros(x.shape[:-1], dtype=x.dtype)
    for t in range(x.shape[-1] - 1, -1, -1):
        running = x[..., t] + gamma * running
        result[..., t] = running
    return result


def tinker_loss(run, tab):
    """incorporate_kl_penalty's advantages, -coef (ln q - ln p_k) on the sampled tokens, discounted-summed
    when kl_discount_factor > 0, in the importance-sampling policy loss at ratio 1 (on-policy):
    -A ln q; every response of the tree weighted by the student's probability, teachers routed k ~ w."""
    paths, states = data_paths(tab)

    def loss(theta):
        lq = torch.log_softmax(theta, -1)
        sampled = lq[states, paths]                                      # (N, H) ln q of the sampled tokens
        prob = sampled.detach().sum(1).exp()
        total = 0.0
        for k in range(tab.lp.shape[0]):
            reverse_kl = sampled.detach() - tab.lp[k][states, paths]
            advantages = -run.kl_penalty_coef * reverse_kl
            if run.kl_discount_factor > 0:
                advantages = discounted_future_sum_vectorized(advantages, run.kl_discount_factor)
            total = total + tab.w[k] * (prob[:, None] * -(advantages * sampled)).sum()
        return total
    return loss


harness.DERIVED_LOSSES.update({NeMoRLRun: nemo_loss, TinkerRun: tinker_loss})

DERIVED_CASES = [
    NeMoRLRun(kl_type="forward"), NeMoRLRun(kl_type="reverse"), NeMoRLRun(kl_type="mixed"),
    NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="sum", weights=(0.5, 0.5)),
    NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="sum", reverse_kl=True, weights=(0.5, 0.5)),
    NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="averaged_logits", weights=(0.5, 0.5)),
    NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="averaged_logits", reverse_kl=True, weights=(0.5, 0.5)),
    NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="select_teacher", weights=(0.5, 0.5)),
    TinkerRun(kl_discount_factor=0.0), TinkerRun(kl_discount_factor=1.0),
]


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("run", DERIVED_CASES, ids=lambda r: runs.describe(r))
def test_derived_loss_reaches_the_predicted_target(run, K):
    if run.loss_fn == "DistillationLossFn" if isinstance(run, NeMoRLRun) else False:
        check_one_teacher(run, K)
        return
    if predict_target(run).target == "select":
        check_select(run, K)
        return
    check(run, K)


def check_one_teacher(run, K):
    """DistillationLossFn takes one teacher: the machine's teacher K - 1 alone, reached exactly."""
    m = harness.machine(K)
    tab = harness.Tabular(m, (1.0,))
    tab.lp = tab.lp[K - 1:]
    log_q, residual = harness.solve(nemo_loss(run, tab), m.S)
    assert residual < 1e-10
    assert harness.tv(log_q, m.log_probs[K - 1]).max() <= harness.TV_TOLERANCE
    # the other teachers are far (the comparison can fail)
    assert min(harness.tv(log_q, m.log_probs[k]).max() for k in range(K - 1)) > 1e-3


def check_select(run, K):
    run = dataclasses.replace(run, weights=WEIGHTS[K])
    m = harness.machine(K)
    tab = harness.Tabular(m, run.weights)
    log_q, residual = harness.solve(nemo_loss(run, tab), m.S)
    assert residual < 1e-10
    errs = [harness.tv(log_q, m.log_probs[k]).max() for k in range(K)]
    best = select_teacher(tab)
    assert errs[best] <= harness.TV_TOLERANCE and sorted(errs)[1] > 1e-3, errs
    for name, lp in harness.candidates(K, run.weights).items():
        assert harness.tv(log_q, lp).max() > 1e-3, name
