"""Distil a tiny Qwen2 student from two finite-state teachers in a plain PyTorch loop, then measure
exactly which target it reached (KL to each pool, computed on the machine).

    python llm_bridge/examples/distill_loop.py --loss forward --steps 300   # -> the arithmetic pool
    python llm_bridge/examples/distill_loop.py --loss reverse               # -> l, the local geometric
    python llm_bridge/examples/distill_loop.py --loss pg                    # -> g, conditionals of G_seq

Prints one JSON line: the loss, and the exact KL between the student and each target before and after,
in the form the loss minimises (llm_bridge.tabular.student_kl): KL(target || q) per prefix for the
forward loss, KL(q || target) per prefix for the per-token reverse loss, and the sequence-level
KL_seq(q || P) over the student's own responses for the policy gradient.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from llm_bridge.losses import forward_kl, reverse_kl, rkl_policy_gradient, token_log_probs  # noqa: E402
from llm_bridge.tabular import TARGETS, sample_student, student_kl, toy_problem, tree_responses  # noqa: E402

WEIGHTS = [0.6, 0.4]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loss", choices=("forward", "reverse", "pg"), default="forward")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=None, help="Adam step (default 3e-3; 2e-3 for the noisier pg)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    machine, teachers, student = toy_problem(args.seed)
    n, H = machine.n, 3
    direction = {"forward": "forward", "reverse": "reverse", "pg": "sequence"}[args.loss]
    before = {t: student_kl(student, machine, WEIGHTS, H, t, direction) for t in TARGETS}
    opt = torch.optim.Adam(student.parameters(), lr=args.lr or (2e-3 if args.loss == "pg" else 3e-3))
    gen = torch.Generator().manual_seed(args.seed)
    inputs, _, _ = tree_responses(machine, H)
    for _ in range(args.steps):
        if args.loss == "pg":                     # on-policy: the student's own responses, scored by the teachers
            inputs, tokens = sample_student(student, n, H, 256, gen)
        with torch.no_grad():
            teacher_logits = torch.stack([t(inputs).logits for t in teachers])
        logits = student(input_ids=inputs).logits
        if args.loss == "pg":
            scores = token_log_probs(teacher_logits, tokens, vocab_size=n)
            loss, _ = rkl_policy_gradient(logits, tokens, scores, WEIGHTS, gamma=1.0, teacher_logits=teacher_logits,
                                          vocab_size=n)
        else:
            loss, _ = (forward_kl if args.loss == "forward" else reverse_kl)(logits, teacher_logits, WEIGHTS,
                                                                             vocab_size=n)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = {t: student_kl(student, machine, WEIGHTS, H, t, direction) for t in TARGETS}
    print(json.dumps({"loss": args.loss, "steps": args.steps, "before": before, "after": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
