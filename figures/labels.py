"""Colours and line styles of the learners and targets named in ``learners.names``, used by every figure.

Colours are hex strings from the Okabe-Ito palette (``figures.style.PALETTE``); nothing here imports matplotlib.
"""

from learners.names import FTL, G_SEQ, KT, L_LOCAL, MIXTURE, ROLLOUT, SEQ_RKL, STATE_KT, TOKEN_RKL, A, G

BLUE, ORANGE, GREEN, VERMILLION, PURPLE = "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7"

LEARNER_COLOURS = {
    KT: BLUE,
    FTL: ORANGE,
    ROLLOUT: GREEN,
    SEQ_RKL: VERMILLION,
    TOKEN_RKL: PURPLE,
    STATE_KT: BLUE,
}

# exact targets drawn beside learned curves: name -> (line style, legend text)
TARGET_STYLES = {A: ("--", "A (FKL target)"), G: (":", "G (RKL target)"),
                 G_SEQ: (":", "g, sequence-level geometric"), L_LOCAL: ("-.", "l, local geometric"),
                 MIXTURE: ("--", "mixture marginal")}
POOL_COLOURS = {A: BLUE, G: ORANGE, G_SEQ: VERMILLION, L_LOCAL: PURPLE, MIXTURE: BLUE}
