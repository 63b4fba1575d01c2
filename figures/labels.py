"""Colours and line styles of the learners and targets named in ``learners.names``, used by every figure.

Colours are matplotlib colour names; nothing here imports matplotlib.
"""

from learners.names import FTL, G_SEQ, KT, L_LOCAL, MIXTURE, ROLLOUT, SEQ_RKL, STATE_KT, TOKEN_RKL, A, G

LEARNER_COLOURS = {
    KT: "tab:blue",
    FTL: "tab:orange",
    ROLLOUT: "tab:green",
    SEQ_RKL: "tab:red",
    TOKEN_RKL: "tab:purple",
    STATE_KT: "tab:blue",
}

# exact targets drawn beside learned curves: name -> (line style, legend text)
TARGET_STYLES = {A: ("--", "A (FKL target)"), G: (":", "G (RKL target)"),
                 G_SEQ: (":", "g, sequence-level geometric"), L_LOCAL: ("-.", "l, local geometric"),
                 MIXTURE: ("--", "mixture marginal")}
POOL_COLOURS = {A: "tab:blue", G: "tab:orange", G_SEQ: "tab:red", L_LOCAL: "tab:purple", MIXTURE: "tab:blue"}
