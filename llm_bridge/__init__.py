"""The token-level conditional analysis of aggregation/ on real causal language models (docs/theory.md section 6).

    Teachers(teachers, weights, vocab_size, device, end_token_ids)   K causal LMs (or personas of one)
    Teachers.teacher_log_probs(prompt_ids, continuation_ids, full=False, chunk=256)
    Teachers.path_analysis(prompt_ids, continuation_ids)   l, local and sequence-level mixture, posteriors
    estimate_log_partition(teachers, prompt_ids, prefix_ids, horizon, n_samples, seed)   MC ln Z(u)
    sequence_geometric_scores(teachers, prompt_ids, options, horizons, n_samples, seed)  ln g of options
    TabularLM(finite_state_teachers, k)               a FiniteStateTeachers teacher served as a causal LM
    load_model(spec), PersonaTeachers(model, tokenizer, personas, weights)   real models and personas

Distillation losses for torch training loops (``llm_bridge.losses``; targets in theory section 1, 2, 4):

    forward_kl, reverse_kl, generalized_jsd(beta)   token level against K teachers' logits or TopK
    fused_linear_loss(hidden_states, lm_head_weight, ...)   the same without the student's logits
    rkl_policy_gradient, kl_estimator_loss, token_log_probs   sampled tokens (policy gradient, k1/k2/k3)
    audit_estimators                                 the exact expected gradient of each estimator

Scripts: ``python sims/probe_prefix_bias.py`` (one probe), ``python sims/probe_batch.py`` and
``python sims/diagnose.py`` (a diagnosis of teachers before training; library ``llm_bridge.diagnosis``).
"""

import importlib
from typing import TYPE_CHECKING

# Loaded on first use (PEP 562), so that a command line's `--help` and a bad argument (sims/*.py) answer
# before torch and transformers load; `from llm_bridge import Teachers` works as before.
_HOME = {"PersonaTeachers": "models", "load_model": "models", "read_teachers_file": "models",
         "PartitionEstimate": "partition", "estimate_log_partition": "partition",
         "sample_log_factors": "partition", "sequence_geometric_scores": "partition",
         "TabularLM": "tabular", "Teacher": "teachers", "Teachers": "teachers", "check_tokenizers": "teachers",
         "resolve_device": "teachers"}

if TYPE_CHECKING:      # what static readers (type checkers, the API reference) see
    from .models import PersonaTeachers, load_model, read_teachers_file
    from .partition import PartitionEstimate, estimate_log_partition, sample_log_factors, sequence_geometric_scores
    from .tabular import TabularLM
    from .teachers import Teacher, Teachers, check_tokenizers, resolve_device

__all__ = ["Teacher", "Teachers", "TabularLM", "check_tokenizers", "resolve_device",
           "PartitionEstimate", "estimate_log_partition", "sample_log_factors", "sequence_geometric_scores",
           "PersonaTeachers", "load_model", "read_teachers_file"]


def __getattr__(name):
    if name not in _HOME:
        raise AttributeError(f"module 'llm_bridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
