"""The forward-KL multi-teacher loss inside a transformers.Trainer: override compute_loss, nothing else.

    python llm_bridge/examples/distill_trainer.py --steps 300

Two finite-state teachers (TabularLM) and a tiny Qwen2 student; prints one JSON line with the exact
KL(arithmetic pool || student) per position before and after training (the target forward_kl names).

The batch follows transformers' causal-LM layout: ``input_ids`` (B, T + 1), ``labels`` (the same ids,
-100 where no loss is wanted), ``attention_mask``. The logits at position t are scored against the
teachers' at t for the token at t + 1, so the mask is ``mask_from_labels(labels)[:, 1:]``: exactly the
positions Trainer counts in ``num_items_in_batch`` (``labels[..., 1:] != -100`` over the micro-batches
of one optimizer step, and of every process under DDP). Dividing by that count, not by this
micro-batch's, makes gradient accumulation give the full batch's update; under DDP with
``average_tokens_across_devices`` (transformers' default) the count is summed over the processes while
DDP averages their gradients, so the loss is multiplied by the number of processes, as Trainer's own
``compute_loss`` does.
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402

from llm_bridge.losses import forward_kl, mask_from_labels  # noqa: E402
from llm_bridge.tabular import TARGETS, student_kl, toy_problem, tree_responses  # noqa: E402

WEIGHTS = [0.6, 0.4]


class DistillTrainer(Trainer):
    """A Trainer whose loss is sum_k w_k KL(p_k || q) against the teachers' full conditionals."""

    def __init__(self, *args, teachers, weights, vocab_size, **kwargs):
        super().__init__(*args, **kwargs)
        self.teachers, self.weights, self.vocab_size = teachers, weights, vocab_size

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        ids, attention = inputs["input_ids"], inputs.get("attention_mask")
        with torch.no_grad():
            teacher_logits = torch.stack([t(ids, attention_mask=attention).logits for t in self.teachers])
        outputs = model(input_ids=ids, attention_mask=attention)
        mask = mask_from_labels(inputs["labels"])[:, 1:]
        if attention is not None:
            mask = mask & attention[:, 1:].bool()
        loss, _ = forward_kl(outputs.logits[:, :-1], teacher_logits[:, :, :-1], self.weights, mask,
                             vocab_size=self.vocab_size, num_items_in_batch=num_items_in_batch)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * self.accelerator.num_processes       # DDP averages; the count is the global one
        return (loss, outputs) if return_outputs else loss


def training_data(machine, horizon=3):
    """Every response of the tree as a causal-LM batch: input_ids = BOS + the horizon tokens, labels the
    same (position 0 is never a target), attention_mask all ones."""
    inputs, tokens, _ = tree_responses(machine, horizon)
    ids = torch.cat([inputs[:, :1], tokens], dim=1)
    return [{"input_ids": row, "labels": row.clone(), "attention_mask": torch.ones_like(row)} for row in ids]


def train(student, teachers, machine, data, *, steps, lr, batch_size=None, accumulation=1, optim="adamw_torch",
          max_grad_norm=1.0, seed=0):
    with tempfile.TemporaryDirectory() as out:
        training = TrainingArguments(output_dir=out, max_steps=steps,
                                     per_device_train_batch_size=batch_size or len(data),
                                     gradient_accumulation_steps=accumulation, optim=optim,
                                     max_grad_norm=max_grad_norm,
                                     learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0,
                                     weight_decay=0.0, report_to=[], save_strategy="no", logging_strategy="no",
                                     disable_tqdm=True, use_cpu=True, remove_unused_columns=False, seed=seed)
        DistillTrainer(model=student, args=training, train_dataset=data, teachers=teachers, weights=WEIGHTS,
                       vocab_size=machine.n).train()
    return student


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args(argv)
    machine, teachers, student = toy_problem(0)
    data = training_data(machine, 3)
    before = {t: student_kl(student, machine, WEIGHTS, 3, t) for t in TARGETS}
    train(student, teachers, machine, data, steps=args.steps, lr=args.lr)
    after = {t: student_kl(student, machine, WEIGHTS, 3, t) for t in TARGETS}
    print(json.dumps({"loss": "forward (Trainer)", "steps": args.steps, "before": before, "after": after}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
