"""Goal tasks and their checker (distillation/tasks.py) and their exact outcomes (distillation/evaluation.py)."""

import itertools
from collections import deque

import numpy as np
import pytest
import torch

from distillation import evaluation, tasks, verifiable


@pytest.fixture(scope="module")
def task():
    return tasks.make_goal_task(0)


def _policy(task, seed=0, concentration=1.0):
    rng = np.random.default_rng(seed)
    return np.log(rng.dirichlet(np.full(task.n, concentration), size=task.S))


# ------------------------------------------------------------------------------------------------
# the task and its exact outcomes
# ------------------------------------------------------------------------------------------------
def test_goal_task_levels_are_the_distances_to_the_goal(task):
    dist = np.full(task.S, -1)                                  # breadth-first search on the reversed graph
    dist[tasks.GOAL] = 0
    queue = deque([tasks.GOAL])
    while queue:
        t = queue.popleft()
        for s, a in zip(*np.nonzero(task.next_state == t)):
            if dist[s] < 0:
                dist[s] = dist[t] + 1
                queue.append(s)
    np.testing.assert_array_equal(dist, task.level)
    s = np.arange(1, task.S)
    np.testing.assert_array_equal(task.level[task.next_state[s, task.progress[s]]], task.level[s] - 1)
    assert (task.next_state[tasks.GOAL] == tasks.GOAL).all()
    assert set(task.level[task.id_starts]) == {1, 2, 3, 4} and set(task.level[task.ood_starts]) == {6, 7, 8}
    with pytest.raises(ValueError, match="ood_levels"):
        tasks.make_goal_task(0, ood_levels=(6, 9))


def test_success_is_one_for_the_progress_policy_and_zero_for_a_policy_that_never_progresses(task):
    onehot = np.eye(task.n)[task.progress]
    with np.errstate(divide="ignore"):
        good, never = np.log(onehot), np.log(np.roll(onehot, 1, axis=1))
    out = tasks.success(task, np.stack([good, never]), np.concatenate([task.id_starts, task.ood_starts]))
    assert (out[0] == 1.0).all() and (out[1] == 0.0).all()


def test_success_equals_an_enumeration_of_responses(task):
    log_q = _policy(task, 1)
    q = np.exp(log_q)
    starts = task.id_starts
    exact = tasks.success(task, log_q[None], starts)[0]
    for c, H, value in zip(starts, task.horizons(starts), exact):
        total = 0.0
        for response in itertools.product(range(task.n), repeat=int(H)):
            s, prob = c, 1.0
            for a in response:                 # after the goal the response goes on there (its row sums to 1)
                prob, s = prob * q[s, a], task.next_state[s, a]
            total += prob * (s == tasks.GOAL)
        assert value == pytest.approx(total, rel=1e-12, abs=1e-15)


def test_success_and_the_kl_on_the_occupancy_match_monte_carlo_through_the_sampler(task):
    log_q = _policy(task, 2, concentration=2.0)
    N = 40_000
    gen = torch.Generator().manual_seed(0)
    tables = torch.as_tensor(log_q, dtype=torch.float32).expand(N, -1, -1)
    for starts in (task.id_starts, task.ood_starts):
        draw = torch.as_tensor(starts)[torch.randint(len(starts), (N,), generator=gen)]
        tr = verifiable.rollouts(task, tables, draw, gen)
        assert (tr.mask.sum(1).numpy() <= task.horizons(draw.numpy())).all()
        exact = tasks.success(task, log_q[None], starts)[0].mean()
        mc = tr.correct.double().mean().item()
        assert abs(mc - exact) < 4.5 * np.sqrt(exact * (1 - exact) / N)
    # the per-position KL to A on ID responses: a ratio of means (KL summed over a response / its length)
    kl_state = np.sum(np.exp(log_q) * (log_q - task.target("arithmetic")), axis=1)
    draw = torch.as_tensor(task.id_starts)[torch.randint(len(task.id_starts), (N,), generator=gen)]
    tr = verifiable.rollouts(task, tables, draw, gen)
    X = (torch.as_tensor(kl_state)[tr.states] * tr.mask).sum(1).numpy()
    Y = tr.mask.sum(1).double().numpy()
    ratio = X.mean() / Y.mean()
    se = np.std(X - ratio * Y) / Y.mean() / np.sqrt(N)
    assert abs(ratio - evaluation.Evaluator(task)(log_q[None])["kl_arithmetic"][0]) < 4.5 * se


def test_each_target_is_at_zero_kl_from_itself(task):
    out = evaluation.Evaluator(task)(np.stack([task.target("arithmetic"), task.target("local")]))
    assert out["kl_arithmetic"][0] == pytest.approx(0.0, abs=1e-15)
    assert out["kl_local"][1] == pytest.approx(0.0, abs=1e-15)
    assert out["kl_local"][0] > 0.02 and out["kl_arithmetic"][1] > 0.02        # A and l are apart on this task
