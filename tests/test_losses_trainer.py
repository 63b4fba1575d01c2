"""llm_bridge/examples/distill_trainer.py under transformers.Trainer: the mask from labels and
num_items_in_batch make gradient accumulation (issue 21) and two-process DDP (issue 31) give the full
batch's update."""

import importlib.util
import os
import socket
import subprocess
import sys

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


LR = 0.5


def masked_data(example, machine):
    """26 responses whose labels drop about 40% of the positions at random (so two halves keep different
    numbers of positions)."""
    data = example.training_data(machine, 3)[:26]
    g = torch.Generator().manual_seed(0)
    for row in data:
        row["labels"][torch.rand(row["labels"].shape, generator=g) < 0.4] = -100
    return data


def full_batch_update(example, machine, teachers, data, lr=LR):
    """-lr x the gradient of the full batch's mean loss over its kept positions, by hand with forward_kl."""
    _, _, student = toy_problem(0)
    ids = torch.stack([row["input_ids"] for row in data])
    labels = torch.stack([row["labels"] for row in data])
    with torch.no_grad():
        teacher_logits = torch.stack([t(ids).logits for t in teachers])
    loss, _ = forward_kl(student(input_ids=ids).logits[:, :-1], teacher_logits[:, :, :-1], example.WEIGHTS,
                         mask_from_labels(labels)[:, 1:], vocab_size=machine.n)
    return -lr * torch.cat([p.flatten() for p in torch.autograd.grad(loss, list(student.parameters()))])


def ddp_worker(out):
    """One process of a two-process DDP run (gloo, CPU; RANK / WORLD_SIZE / MASTER_* from the
    environment, as torchrun sets them): one SGD step of the example's Trainer on 13 of the 26
    responses; rank 0 saves how far the parameters moved."""
    torch.set_num_threads(1)
    example = load_example()
    machine, teachers, student = toy_problem(0)
    data = masked_data(example, machine)
    start = flat_parameters(student)
    example.train(student, teachers, machine, data, steps=1, lr=LR, batch_size=len(data) // 2, optim="sgd",
                  max_grad_norm=0.0)
    if os.environ["RANK"] == "0":
        torch.save(flat_parameters(student) - start, out)
    import torch.distributed as dist
    if dist.is_initialized():               # the Trainer's process group, closed before exit: left to the
        dist.barrier()                      # interpreter's teardown, gloo's threads can abort the process
        dist.destroy_process_group()        # ("terminate called without an active exception") after the step


@pytest.mark.integration
def test_two_process_ddp_gives_the_single_process_full_batch_update(tmp_path):
    """Trainer under DDP (two CPU processes, gloo; average_tokens_across_devices, transformers' default):
    num_items_in_batch counts the kept positions of both processes, DDP averages the two gradients, and
    the example's compute_loss multiplies by the number of processes, so one SGD step moves the
    parameters by -lr x the full batch's gradient (without that factor: half of it)."""
    example = load_example()
    machine, teachers, _ = toy_problem(0)
    by_hand = full_batch_update(example, machine, teachers, masked_data(example, machine))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    from conftest import ROOT
    code = (f"import sys; sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]; "
            f"import test_losses_trainer as t; t.ddp_worker({str(tmp_path / 'moved.pt')!r})")
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    moved = torch.load(tmp_path / "moved.pt")
    torch.testing.assert_close(moved, by_hand, rtol=1e-4, atol=2e-7)


@pytest.mark.integration
def test_gradient_accumulation_1_and_2_give_the_same_sgd_update_as_the_full_batch_by_hand():
    """One SGD step on 26 responses whose labels drop about 40% of the positions at random (so the two
    micro-batches keep different numbers of positions): accumulation 1 (batch 26) and 2 (batches of 13)
    move the parameters (no gradient clipping) by the same vector, equal to -lr x the gradient of the full batch's mean loss
    over its kept positions, computed by hand with forward_kl."""
    example = load_example()
    machine, teachers, _ = toy_problem(0)
    data = masked_data(example, machine)
    lr = LR
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
