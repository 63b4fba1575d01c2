"""llm_bridge/examples/distill_trainer.py under transformers.Trainer: the mask from labels and
num_items_in_batch make gradient accumulation give the full batch's update (issue 21)."""

import importlib.util

import pytest
import torch

from llm_bridge.losses import forward_kl, mask_from_labels
from llm_bridge.tabular import toy_problem

pytest.importorskip("transformers")


def load_example():
    from conftest import ROOT
    spec = importlib.util.spec_from_file_location("example_distill_trainer",
                                                  ROOT / "llm_bridge" / "examples" / "distill_trainer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def flat_parameters(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.integration
def test_gradient_accumulation_1_and_2_give_the_same_sgd_update_as_the_full_batch_by_hand():
    """One SGD step on 26 responses whose labels drop about 40% of the positions at random (so the two
    micro-batches keep different numbers of positions): accumulation 1 (batch 26) and 2 (batches of 13)
    move the parameters (no gradient clipping) by the same vector, equal to -lr x the gradient of the full batch's mean loss
    over its kept positions, computed by hand with forward_kl."""
    example = load_example()
    machine, teachers, _ = toy_problem(0)
    data = example.training_data(machine, 3)[:26]
    g = torch.Generator().manual_seed(0)
    for row in data:
        row["labels"][torch.rand(row["labels"].shape, generator=g) < 0.4] = -100
    lr = 0.5
    _, _, student = toy_problem(0)
    start = flat_parameters(student)
    ids = torch.stack([row["input_ids"] for row in data])
    labels = torch.stack([row["labels"] for row in data])
    with torch.no_grad():
        teacher_logits = torch.stack([t(ids).logits for t in teachers])
    loss, _ = forward_kl(student(input_ids=ids).logits[:, :-1], teacher_logits[:, :, :-1], example.WEIGHTS,
                         mask_from_labels(labels)[:, 1:], vocab_size=machine.n)
    by_hand = -lr * torch.cat([p.flatten() for p in torch.autograd.grad(loss, list(student.parameters()))])
    assert float(by_hand.norm()) > 1e-3
    for accumulation in (1, 2):
        _, _, student = toy_problem(0)
        example.train(student, teachers, machine, data, steps=1, lr=lr, batch_size=len(data) // accumulation,
                      accumulation=accumulation, optim="sgd", max_grad_norm=0.0)
        moved = flat_parameters(student) - start
        torch.testing.assert_close(moved, by_hand, rtol=1e-4, atol=2e-7)
