"""The students (distillation/students.py): one interface, runs that stay independent, the functional
Adam against torch's, per-run clipping, the neural students' vmap against each model alone."""

import math

import numpy as np
import pytest
import torch

from distillation import tasks
from distillation.students import (FeaturePolicy, FeatureStudents, LogLinearStudents, TabularStudents, TokenStudents,
                                   adam_step, at_positions, clip_per_run, loglinear_tables, round_bf16)
from llm_bridge.models import tiny_model
from llm_bridge.tabular import tree_responses


@pytest.fixture(scope="module")
def tree():
    return tasks.make_task("tree", K=2, seed=0)


def test_adam_step_equals_torch_adam_for_each_runs_learning_rate():
    """Each run r of a stacked tensor stepped by adam_step with lr_r equals torch.optim.Adam with lr_r on
    that run alone, over 25 steps of varying gradients."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(3, 4, 5, generator=g)
    lrs = torch.tensor([0.1, 1e-3, 0.0])
    grads = [torch.randn(3, 4, 5, generator=g) for _ in range(25)]
    ours, m, v = W.clone(), torch.zeros_like(W), torch.zeros_like(W)
    for t, grad in enumerate(grads, 1):
        ours = adam_step(ours, grad, m, v, t, lrs)
    for r in range(3):
        p = W[r].clone().requires_grad_()
        opt = torch.optim.Adam([p], lr=float(lrs[r]), betas=(0.9, 0.999), eps=1e-8)
        for grad in grads:
            p.grad = grad[r].clone()
            opt.step()
        torch.testing.assert_close(ours[r], p.detach(), rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[2], W[2])                                    # learning rate 0: untouched


def test_clip_per_run_scales_each_runs_global_norm_alone():
    a = torch.tensor([[3.0, 0.0], [0.3, 0.0], [float("nan"), 4.0]])
    b = torch.tensor([[4.0], [0.4], [3.0]])
    ca, cb = clip_per_run([a, b], 1.0)
    norms = torch.sqrt(ca.pow(2).sum(1) + cb.pow(2).sum(1))
    torch.testing.assert_close(norms, torch.tensor([1.0, 0.5, 1.0]))     # norm 5 -> 1; 0.5 kept; NaN -> 0, 5 -> 1
    torch.testing.assert_close(ca[0], torch.tensor([0.6, 0.0]))
    (kept,) = clip_per_run([a], 1.0, active=torch.tensor([False, True, True]))
    assert torch.equal(kept[0], a[0])                                    # clipping off for run 0


def test_token_students_tables_are_each_models_conditionals_on_the_tree(tree):
    """vmap over the stacked runs equals each tiny Qwen2 alone, at every (step, state) of the tree."""
    n, seeds = tree.teachers.n, [0, 3]
    lp = TokenStudents(tree, seeds, vocab=n + 1, bos=n).log_probs()
    inputs, _, states = tree_responses(tree.teachers, tree.horizon)
    for r, s in enumerate(seeds):
        model = tiny_model("qwen2", vocab_size=n + 1, seed=s, attention="eager")
        with torch.no_grad():
            alone = torch.log_softmax(model(input_ids=inputs).logits[..., :n].double(), -1).numpy()
        for i in range(len(inputs)):
            for h in range(tree.horizon):
                np.testing.assert_allclose(lp[r, h, states[i, h]], alone[i, h], rtol=0, atol=1e-6)


def test_feature_students_vmap_equals_each_model():
    task = tasks.make_goal_task(0)
    seeds = [0, 1, 2]
    students = FeatureStudents(task.features, task.n, seeds)
    features = torch.as_tensor(task.features, dtype=torch.float32)
    with torch.no_grad():
        alone = torch.stack([torch.log_softmax(FeaturePolicy(features.shape[1], task.n, s)(features), -1)
                             for s in seeds])
    torch.testing.assert_close(students.tables(), alone, rtol=1e-5, atol=1e-6)


def _fkl_to_uniform(table):
    """The runs' summed cross-entropy from the uniform policy (a loss every student can lower)."""
    return -table.mean(dim=tuple(range(1, table.ndim))).sum()


@pytest.mark.parametrize("kind", ["tabular", "loglinear", "feature", "token"])
def test_every_student_steps_each_run_at_its_own_rate_and_take_copies_runs(tree, kind):
    """One interface: a run with learning rate 0 is untouched while the others move; take() returns
    copies of the chosen runs with a fresh optimiser state; log_probs are normalised float64."""
    n = tree.teachers.n
    feats = np.eye(tree.teachers.S)
    make = {"tabular": lambda: TabularStudents(tree, 3, torch.Generator().manual_seed(0)),
            "loglinear": lambda: LogLinearStudents(feats, n, [0, 1, 2]),
            "feature": lambda: FeatureStudents(feats, n, [0, 1, 2]),
            "token": lambda: TokenStudents(tree, [0, 1, 2], vocab=n + 1, bos=n)}[kind]
    students = make()
    before = students.log_probs()
    assert before.dtype == np.float64
    np.testing.assert_allclose(np.exp(before).sum(-1), 1.0, atol=1e-12)
    for _ in range(3):
        students.step(_fkl_to_uniform(students.tables()), lr=torch.tensor([0.05, 0.0, 0.01]))
    after = students.log_probs()
    np.testing.assert_array_equal(after[1], before[1])
    assert np.abs(after[0] - before[0]).max() > np.abs(after[2] - before[2]).max() > 0
    copy = students.take([2, 0])
    np.testing.assert_array_equal(copy.log_probs(), after[[2, 0]])
    assert copy.t == 0 and students.t == 3
    copy.step(_fkl_to_uniform(copy.tables()), lr=0.05)
    np.testing.assert_array_equal(students.log_probs(), after)         # the copy does not share parameters


def test_bf16_storage_rounds_the_chosen_runs_after_every_step():
    students = LogLinearStudents(np.eye(5), 3, [0, 1])
    students.store_bf16([True, False])
    for _ in range(4):
        students.step(_fkl_to_uniform(students.tables()), lr=1e-4)
        W = students.params["W"]
        assert torch.equal(W[0], round_bf16(W[0]))                       # stored in bfloat16
        assert not torch.equal(W[1], round_bf16(W[1]))                   # float32 keeps its low bits


def test_mixed_precision_keeps_float32_masters_and_reads_their_bf16_copy():
    """A run in mixed precision ('bf16-master') accumulates updates below half a bfloat16 ulp in its float32
    master, which bf16 storage loses; its forward pass, in training and evaluation, reads the bf16 copy,
    and its gradient is the one at that copy (straight through the rounding)."""
    students = LogLinearStudents(np.eye(5), 3, [0, 0, 0])          # the same start for float32, bf16, master
    students.params["W"] = 1 + torch.rand(students.params["W"].shape[1:], generator=torch.Generator().manual_seed(0)
                                          ).expand_as(students.params["W"]).clone()   # |W| >= 1: half an ulp >= 2^-9
    students.store_bf16([False, True, False])
    students.cast_bf16([False, False, True])
    start = students.params["W"].clone()
    leaf = round_bf16(start[2:3]).clone().requires_grad_()
    expected = torch.autograd.grad(_fkl_to_uniform(loglinear_tables(leaf, students.features)), [leaf])[0][0]
    tables = students.tables()
    torch.testing.assert_close(tables[2], loglinear_tables(round_bf16(start[2:3]), students.features)[0])
    got = torch.autograd.grad(_fkl_to_uniform(tables), [students._leaves["W"]], retain_graph=True)[0][2]
    torch.testing.assert_close(got, expected)
    for _ in range(3):
        students.step(_fkl_to_uniform(students.tables()), lr=1e-5)          # far below half a bf16 ulp
    W = students.params["W"]
    moved = (W - round_bf16(start)).abs() > 0
    assert not moved[1].any()                                             # bf16 storage: every update lost
    assert moved[2].sum() == moved[0].sum() > 0 and not torch.equal(W[2], round_bf16(W[2]))   # the master kept them
    np.testing.assert_allclose(students.log_probs()[2],
                               loglinear_tables(round_bf16(W[2:3]).double(), students.features.double())[0].numpy())
    assert torch.equal(students.take([2]).cast, torch.tensor([True]))


def test_at_positions_reads_per_step_and_stationary_tables():
    per_step = torch.arange(2 * 3 * 4 * 2, dtype=torch.float32).view(2, 3, 4, 2)     # (R, H, S, n)
    row_run, states = torch.tensor([1, 0]), torch.tensor([[0, 3, 2], [1, 1, 1]])
    got = at_positions(per_step, row_run, states)
    assert torch.equal(got[0, 1], per_step[1, 1, 3]) and torch.equal(got[1, 2], per_step[0, 2, 1])
    stationary = per_step[:, 0]
    assert torch.equal(at_positions(stationary, row_run, states)[0, 1], stationary[1, 3])
    assert math.isfinite(float(got.sum()))
