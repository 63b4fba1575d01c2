"""The learners' and targets' labels as they appear in the CSVs, with their colours in every figure.

One table, used by the sims (to label rows) and by ``figures/`` (to draw them), so that a label is
written once. Colours are matplotlib colour names; nothing here imports matplotlib.
"""

# the mechanism sims' learners (SPEC 2-3), each named with the feedback it gets per round
KT = "KT, one token from a sampled teacher (FKL)"
FTL = "FTL, a sampled teacher's full row (RKL)"
ROLLOUT = "own rollout, one token scored by a sampled teacher (RKL)"
SEQ_RKL = "plug-in soft-Bellman, sequence-level RKL"   # not a policy gradient: it re-solves the soft
TOKEN_RKL = "plug-in per-token RKL (discount 0)"         # Bellman equation on its estimated rewards
STATE_KT = "per-state KT, responses of a sampled teacher (FKL)"

LEARNER_COLOURS = {
    KT: "tab:blue",
    FTL: "tab:orange",
    ROLLOUT: "tab:green",
    SEQ_RKL: "tab:red",
    TOKEN_RKL: "tab:purple",
    STATE_KT: "tab:blue",
}

# exact targets drawn beside learned curves: label -> (line style, legend text)
A, G = "A", "G"
G_SEQ = "g (sequence-level geometric)"
L_LOCAL = "l (local geometric)"
MIXTURE = "mixture marginal"
TARGET_STYLES = {A: ("--", "A (FKL target)"), G: (":", "G (RKL target)"),
                 G_SEQ: (":", "g, sequence-level geometric"), L_LOCAL: ("-.", "l, local geometric"),
                 MIXTURE: ("--", "mixture marginal")}
POOL_COLOURS = {A: "tab:blue", G: "tab:orange", G_SEQ: "tab:red", L_LOCAL: "tab:purple", MIXTURE: "tab:blue"}

# the function-approximation learners of the regret sims
LOGLINEAR = {                                                      # sims.learners.loglinear method -> label
    "OGD": "OGD, step 1/(lambda t)",
    "ONS": "ONS, HAK constants",
    "Newton-style": "Newton-style, gamma = 1 (no guarantee)",
    "constant step": "OGD, constant step 0.1 (badly tuned)",
    "frozen": "frozen at theta = 0",
    "OGD-RKL": "OGD on RKL, step 1/(lambda t)",
    "frozen-RKL": "frozen at theta = 0 (RKL)",
}
