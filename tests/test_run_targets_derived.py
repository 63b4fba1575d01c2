"""Run targets of NeMo-RL, which cannot be installed here, from its source (derived, not run):
DistillationLossFn and CrossTokenizerDistillationLossFn (same-vocabulary teachers, whole vocabulary),
re-implemented below line by line from

  NVIDIA-NeMo/RL @ 7ea279abfbeb698b092856d0dab61e7cf39bc909, nemo_rl/algorithms/loss/loss_functions.py
    (DistillationLossFn.__call__; CrossTokenizerDistillationLossFn.__call__, _compute_ce, _sum_kd,
    _averaged_logits_kd, _select_teacher_kd, _direct_full_vocab_kl)

as one loss call per micro-batch (policy.train_micro_batch_size: 1 in the shipped multi-teacher config:
each response is its own micro-batch), and driven on the tabular student as the library rows are
(tests/run_targets_harness.py); the model of llm_bridge.run_dynamics must stop where it does.
"""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import run_targets_harness as harness
from llm_bridge import run_dynamics as rd
from llm_bridge import runs
from llm_bridge.runs import NeMoRLRun, predict_target
from test_run_targets import WEIGHTS

XTOKEN = "CrossTokenizerDistillationLossFn"


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


def xtoken_call(run, logits, teacher_logits, tokens, mask, global_valid_toks):
    """CrossTokenizerDistillationLossFn.__call__ on one micro-batch: masked means normalised by the global
    batch's valid tokens (masked_mean's global_normalization_factor)."""
    def masked_mean(values):
        return (mask * values).sum() / global_valid_toks
    ce_loss = masked_mean(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1),
                                          reduction="none").reshape(tokens.shape))          # _compute_ce
    w = list(run.weights)
    if run.kd_loss_mode == "sum":                                                         # sum_i weight_i KD_i
        total_kd = sum(w[i] * masked_mean(nemo_direct_kl_rows(logits, teacher_logits[i], run.reverse_kl))
                       for i in range(len(w)))
    elif run.kd_loss_mode == "averaged_logits":                                           # one KL to the average
        average = sum(teacher_logits[i] * (w[i] / sum(w)) for i in range(len(w)))
        total_kd = masked_mean(nemo_direct_kl_rows(logits, average, run.reverse_kl))
    else:                                                                                 # _select_teacher_kd
        with torch.no_grad():
            ces = [float(masked_mean(F.cross_entropy(teacher_logits[i].reshape(-1, logits.shape[-1]).float(),
                                                     tokens.reshape(-1), reduction="none").reshape(tokens.shape)))
                   for i in range(len(w))]
            best = int(min(range(len(w)), key=lambda j: ces[j]))
        total_kd = masked_mean(nemo_direct_kl_rows(logits, teacher_logits[best], run.reverse_kl))
    if run.dynamic_loss_scaling:
        kd_detached, ce_detached = total_kd.detach().abs(), ce_loss.detach().abs()
        kl_scale = torch.where(kd_detached > 0, ce_detached / kd_detached, torch.ones_like(kd_detached))
        return kl_scale * total_kd + ce_loss
    return run.kl_loss_weight * total_kd + run.ce_loss_scale * ce_loss


def nemo_step(run):
    """(routes, loss): the data set's responses, cut into micro-batches in order (run.micro_batches; None:
    one response each), each a separate loss call; DistillationLossFn on the student's own rollouts."""
    if run.loss_fn == "DistillationLossFn":
        routes = [rd.Route(1.0, ("student", 1.0), ((0, 1.0),))]

        def one(route, X, W, batch):
            return (W * nemo_distillation_rows(X, batch.teacher_lp[0][batch.states], run.kl_type,
                                               run.mixed_kl_weight)).sum()
        return routes, one
    routes = [rd.Route(1.0, ("data",), tuple((k, w) for k, w in enumerate(run.weights)))]

    def per_batch(route, leaf, batch):           # the data set: every response once (uniform data)
        P = leaf.shape[0]
        parts = np.array_split(np.arange(P), P if run.micro_batches is None else min(run.micro_batches, P))
        total = 0.0
        for idx in map(torch.as_tensor, parts):      # one loss call and one backward per micro-batch
            teachers = [batch.teacher_lp[k][batch.states[idx]] for k in range(len(run.weights))]
            total = total + xtoken_call(run, leaf[idx], teachers, batch.tokens[idx], batch.mask[idx], batch.mask.sum())
        return total
    return routes, harness.leafwise(per_batch)


DERIVED_CASES = [
    NeMoRLRun(kl_type="forward"), NeMoRLRun(kl_type="reverse"), NeMoRLRun(kl_type="mixed"),
    NeMoRLRun(loss_fn=XTOKEN, micro_batches=3),                                # the shipped loss_fn (dynamic scaling)
    NeMoRLRun(loss_fn=XTOKEN, dynamic_loss_scaling=False),                     # fixed weights 1 kd + 0.1 ce
    NeMoRLRun(loss_fn=XTOKEN, dynamic_loss_scaling=False, reverse_kl=True),
    NeMoRLRun(loss_fn=XTOKEN, dynamic_loss_scaling=False, ce_loss_scale=0.0),
    NeMoRLRun(loss_fn=XTOKEN, dynamic_loss_scaling=False, ce_loss_scale=0.0, reverse_kl=True),
    NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="averaged_logits", dynamic_loss_scaling=False, ce_loss_scale=0.0),
    NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="averaged_logits", dynamic_loss_scaling=False),
    NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="select_teacher", dynamic_loss_scaling=False, ce_loss_scale=0.0,
              micro_batches=1),
    NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="select_teacher", dynamic_loss_scaling=False, ce_loss_scale=0.0,
              micro_batches=8),
    NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="select_teacher", dynamic_loss_scaling=False, micro_batches=8),
]


def derived_fixed_point(run, m):
    batch = rd.batch_of(m)
    routes, loss = nemo_step(run)
    theta, residual, status = rd.solve(rd.expected_loss(routes, loss, batch), np.zeros((batch.S, batch.n)))
    return rd.log_softmax(theta), residual, status


@pytest.mark.parametrize("K", [2, 3])
@pytest.mark.parametrize("run", DERIVED_CASES, ids=lambda r: runs.describe(r))
def test_nemo_rls_step_stops_where_the_model_says(run, K):
    one = run.loss_fn == "DistillationLossFn"
    run = dataclasses.replace(run, weights=WEIGHTS[1 if one else K])
    m = harness.machine(K)
    if one:                                          # DistillationLossFn takes one teacher: the machine's last
        m = type(m)(m.next_state, m.log_probs[K - 1:], m.start)
    torch.set_num_threads(1)
    log_q, residual, status = derived_fixed_point(run, m)
    fp = rd.fixed_point(run, m)
    assert status == fp.status == "fixed point", (status, residual, fp.status)
    assert rd.tv(log_q, fp.log_probs).max() <= harness.TV_TOLERANCE
    prediction = predict_target(run)
    if prediction.target in ("A", "l", "mix"):
        assert rd.tv(log_q, runs.target_log_probs(prediction, m, run.weights)).max() <= harness.TV_TOLERANCE
    if prediction.target == "select":               # one teacher, the data's lowest cross-entropy
        errs = [rd.tv(log_q, m.log_probs[k]).max() for k in range(K)]
        assert min(errs) <= harness.TV_TOLERANCE and sorted(errs)[1] > 1e-3


def test_nemo_rls_cross_entropy_moves_the_sum_row_off_a():
    """Finding 4: the shipped X-Token loss adds the student's CE on the data, so the forward-KL sum does not
    reach A; select_teacher over 8 micro-batches picks different teachers and reaches none of them."""
    m = harness.machine(2)
    A = runs.target_log_probs(runs.Prediction("A"), m, WEIGHTS[2])
    log_q, _, _ = derived_fixed_point(NeMoRLRun(loss_fn=XTOKEN, micro_batches=3, weights=WEIGHTS[2]), m)
    assert rd.tv(log_q, A).max() > 0.02
    log_q, _, _ = derived_fixed_point(NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="select_teacher", ce_loss_scale=0.0,
                                                dynamic_loss_scaling=False, micro_batches=8, weights=WEIGHTS[2]), m)
    assert min(rd.tv(log_q, m.log_probs[k]).max() for k in range(2)) > 0.05


def test_with_dynamic_scaling_select_teacher_has_no_fixed_point():
    """The shipped dynamic scaling with select_teacher over 8 micro-batches: neither the loss calls from source
    nor the model settle (the KD term's weight ce / kd grows as the student nears a micro-batch's teacher);
    both say so instead of naming a point."""
    run = NeMoRLRun(loss_fn=XTOKEN, kd_loss_mode="select_teacher", micro_batches=8, weights=WEIGHTS[2])
    m = harness.machine(2)
    torch.set_num_threads(1)
    _, residual, status = derived_fixed_point(run, m)
    fp = rd.fixed_point(run, m)
    assert status != "fixed point" and fp.status != "fixed point" and residual > 1e-3 and fp.residual > 1e-3
