"""The forward-KL multi-teacher loss inside a transformers.Trainer: override compute_loss, nothing else.

    python llm_bridge/examples/distill_trainer.py --steps 300

Two finite-state teachers (TabularLM) and a tiny Qwen2 student; prints one JSON line with the exact
KL(arithmetic pool || student) per position before and after training (the target forward_kl names).
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from llm_bridge.losses import forward_kl  # noqa: E402
from llm_bridge.tabular import TARGETS, student_kl, toy_problem, tree_responses  # noqa: E402

WEIGHTS = [0.6, 0.4]


class DistillTrainer(Trainer):
    """A Trainer whose loss is sum_k w_k KL(p_k || q) against the teachers' full conditionals."""

    def __init__(self, *args, teachers, weights, vocab_size, **kwargs):
        super().__init__(*args, **kwargs)
        self.teachers, self.weights, self.vocab_size = teachers, weights, vocab_size

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids = inputs["input_ids"]
        with torch.no_grad():
            teacher_logits = torch.stack([t(ids).logits for t in self.teachers])
        outputs = model(input_ids=ids)
        loss, _ = forward_kl(outputs.logits, teacher_logits, self.weights, vocab_size=self.vocab_size)
        return (loss, outputs) if return_outputs else loss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    machine, teachers, student = toy_problem(0)
    inputs, _, _ = tree_responses(machine, 3)
    data = [{"input_ids": row} for row in inputs]
    before = {t: student_kl(student, machine, WEIGHTS, 3, t) for t in TARGETS}
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, max_steps=args.steps, per_device_train_batch_size=len(data),
                                     learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
                                     weight_decay=0.0, report_to=[], save_strategy="no", logging_strategy="no",
                                     disable_tqdm=True, use_cpu=True, remove_unused_columns=False, seed=0)
        DistillTrainer(model=student, args=training, train_dataset=data, teachers=teachers, weights=WEIGHTS,
                       vocab_size=machine.n).train()
    after = {t: student_kl(student, machine, WEIGHTS, 3, t) for t in TARGETS}
    print(json.dumps({"loss": "forward (Trainer)", "steps": args.steps, "before": before, "after": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
