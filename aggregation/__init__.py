"""Multi-teacher aggregation: the FKL mixture and the RKL geometric pool, token and sequence level.

Token level (theory section 1), arrays ``(K, ..., n)``, weights ``(K,)``::

    arithmetic_pool, geometric_pool            probabilities in, probabilities out
    log_arithmetic_pool, log_geometric_pool    log-probabilities in and out
    log_partition                              ln Z of the geometric pool

Sequence level (theory section 2), on a :class:`FiniteStateTeachers` machine::

    sequence_log_partition          ln Z[h, s] by the backward recursion
    sequence_geometric_conditionals ln g[h, s, a], the token conditionals of G_seq
    local_geometric_conditionals    ln l[s, a], the per-token geometric pool
    target_log_probs                the target a loss names (arithmetic, local or geometric) per position
    mixture_conditionals            ln A(a | u) along a path (posterior weights)
    sequence_log_prob               ln p_k(y) of a path
    sample_paths, state_occupancy   sampling and forward occupancies under g, l, A or a teacher
    sequence_kl, policy_occupancy   KL_seq(q || G_seq, l, a teacher or any policy) and the occupancy of
                                    a state-conditional policy q
    growth_rate                     lim_H Z_H(s)^{1/H}, which decides the prefix bias as H -> inf

Submodules: ``examples`` (worked examples of docs/theory.md, random teachers), ``validate`` (the argument checks
every package uses), ``jit`` (numba building blocks for kernels elsewhere). Importing this package
pulls in neither torch nor matplotlib.
"""

from .pools import arithmetic_pool, geometric_pool, log_arithmetic_pool, log_geometric_pool, log_partition
from .sequence import (
    FiniteStateTeachers,
    NumericalFallbackWarning,
    growth_rate,
    policy_occupancy,
    local_geometric_conditionals,
    mixture_conditionals,
    sample_paths,
    sequence_geometric_conditionals,
    sequence_log_partition,
    sequence_kl,
    sequence_log_prob,
    state_occupancy,
    target_log_probs,
)

__all__ = [
    "arithmetic_pool",
    "geometric_pool",
    "log_arithmetic_pool",
    "log_geometric_pool",
    "log_partition",
    "FiniteStateTeachers",
    "NumericalFallbackWarning",
    "sequence_log_partition",
    "sequence_geometric_conditionals",
    "local_geometric_conditionals",
    "mixture_conditionals",
    "sequence_log_prob",
    "sample_paths",
    "state_occupancy",
    "sequence_kl",
    "growth_rate",
    "policy_occupancy",
    "target_log_probs",
]
