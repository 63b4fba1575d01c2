"""The learners' and targets' labels as they appear in the CSVs, with their colours in every figure.

One table, used by the sims (to label rows) and by ``figures/`` (to draw them), so that a label is
written once. Colours are matplotlib colour names; nothing here imports matplotlib.
"""

# the mechanism sims' learners (SPEC 2-3): what each is fed and which target it reaches
KT = "KT on teacher samples (FKL)"
FTL = "FTL, sampled teacher scores q (RKL)"
ROLLOUT = "FTL on own rollouts (RKL)"
SEQ_RKL = "sequence-level RKL, reward-to-go"
TOKEN_RKL = "per-token RKL, discount 0"
STATE_KT = "per-state KT on teacher samples (FKL)"

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
