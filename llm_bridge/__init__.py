"""The token-level conditional analysis of aggregation/ on real causal language models (SPEC section 6).

    Teachers(teachers, weights, vocab_size, device)   K causal LMs (or personas of one) with weights
    Teachers.teacher_log_probs(prompt_ids, continuation_ids, full=False, chunk=256)
    Teachers.path_analysis(prompt_ids, continuation_ids)   l, local and sequence-level mixture, posteriors
    TabularLM(finite_state_teachers, k)               a FiniteStateTeachers teacher served as a causal LM
"""

from .tabular import TabularLM
from .teachers import Teacher, Teachers, check_tokenizers, resolve_device

__all__ = ["Teacher", "Teachers", "TabularLM", "check_tokenizers", "resolve_device"]
