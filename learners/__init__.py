"""Online learners of multi-teacher distillation and the theory's closed forms (theory section 1-3).

    online         the learners (numba kernels in ``_kernels``, NumPy twins in ``_reference``): add-beta,
                   FTL / exponentiated gradient, plug-in soft-Bellman, log-linear OGD / ONS; regret arrays
    closed_forms   regret bounds and constants, the mechanisms' exact pools, asymptotic s.d. of learned q_T
    names          the learners' and targets' names as they appear in the CSVs
"""
