"""The learners' and targets' names as they appear in the CSVs (one place, so a name is written once).

Colours and line styles for them live in ``figures.labels``.
"""

# the mechanism sims' learners (theory section 2-3), each named with the feedback it gets per round
KT = "KT, one token from a sampled teacher (FKL)"
FTL = "FTL, a sampled teacher's full row (RKL)"
ROLLOUT = "own rollout, one token scored by a sampled teacher (RKL)"
SEQ_RKL = "plug-in soft-Bellman, sequence-level RKL"   # not a policy gradient: it re-solves the soft
TOKEN_RKL = "plug-in per-token RKL (discount 0)"         # Bellman equation on its estimated rewards
STATE_KT = "per-state KT, responses of a sampled teacher (FKL)"

# exact targets drawn beside learned curves
A, G = "A", "G"
G_SEQ = "g (sequence-level geometric)"
L_LOCAL = "l (local geometric)"
MIXTURE = "mixture marginal"

# the function-approximation learners of the regret sims
LOGLINEAR = {                                                      # learners.online.loglinear method -> name
    "OGD": "OGD, step 1/(lambda t)",
    "ONS": "ONS, HAK constants",
    "Newton-style": "Newton-style, gamma = 1 (no guarantee)",
    "constant step": "OGD, constant step 0.1 (badly tuned)",
    "frozen": "frozen at theta = 0",
    "OGD-RKL": "OGD on RKL, step 1/(lambda t)",
    "frozen-RKL": "frozen at theta = 0 (RKL)",
}
