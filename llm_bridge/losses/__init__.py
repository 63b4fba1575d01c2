"""Multi-teacher distillation losses for torch training loops, each paired with the target it reaches
(theory section 1, 2, 4, 6).

Token level, from the student's logits ``(B, T, V)`` and K teachers (full logits ``(K, B, T, V)`` or a
list of K ``(B, T, V)`` tensors, or a list of K :class:`TopK`), weights ``(K,)`` or per sample ``(B, K)``
(one-hot rows route each sample to one teacher: routing and pooling are one API):

    forward_kl       sum_k w_k KL(p_k || q)                     target: the arithmetic pool A = sum_k w_k p_k
    reverse_kl       sum_k w_k KL(q || p_k) = KL(q || l) - ln z target: the local geometric pool l
    generalized_jsd  sum_k w_k JSD_beta(p_k, q)                 beta = 0: forward_kl, beta = 1: reverse_kl

Sequence level, from sampled tokens (theory section 2 "which target a learner reaches", theory section 4):

    rkl_policy_gradient   on-policy RKL by reward-to-go; gamma = 1 reaches G_seq (conditionals g),
                          gamma = 0 reaches l
    kl_estimator_loss     k1 / k2 / k3 of theory section 4 on the sampled token, as a loss or as a reward
    audit_estimators      exact expected gradient of every estimator configuration, and which
                          divergence's gradient it equals

Every token-level loss returns ``(loss, metrics)``: the loss reduced over the unmasked positions
(``reduction="mean"``: their mean, or the sum over ``num_items_in_batch`` under gradient accumulation;
``"sum"``; ``"batchmean"``: the sum over B, TRL's without labels; ``"none"``: ``(B, T)`` with 0 at
masked positions; a mask (0 / 1 only, :func:`mask_from_labels` from labels) with no kept position gives
a zero loss that keeps the graph), and
per-position metrics (``(B, T)``, NaN where masked): ``teacher_disagreement`` = sum_k w_k KL(p_k || A),
``neg_log_z`` = -ln z (both zero iff the teachers agree), ``tail_mass`` ``(K, B, T)`` for top-k teachers,
and the temperatures used. Memory: positions are processed in chunks of ``chunk_size``; the gradient
with respect to the student's logits is computed chunk by chunk during the forward pass, in closed form
(as Liger's fused losses do, without autograd), scaled by the reduction and written into the one
buffer that ``backward`` hands over as the student's gradient, so no ``K x B x T x V`` float32 tensor,
nor the student's full log-softmax, is ever materialised; bf16 / fp16 logits are upcast to float32 per
chunk (float64 inputs stay float64). NaN / inf inputs are found from each chunk's per-row results (no
separate scan); under ``no_grad`` / ``inference_mode`` no gradient is computed.
:func:`fused_linear_loss` goes further and never materialises the student's logits at all.
"""

from ._engine import REDUCTIONS, TAILS, TopK, mask_from_labels
from .audit import audit_estimators
from .sampled import kl_estimator_loss, rkl_policy_gradient, token_log_probs
from .token_level import JSD_CONVENTIONS, forward_kl, fused_linear_loss, generalized_jsd, reverse_kl

__all__ = ["TopK", "TAILS", "REDUCTIONS", "mask_from_labels", "forward_kl", "reverse_kl", "generalized_jsd", "fused_linear_loss",
           "rkl_policy_gradient", "kl_estimator_loss", "token_log_probs", "audit_estimators", "JSD_CONVENTIONS"]
