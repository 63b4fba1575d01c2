"""The fixed points of each objective (distillation/fixed_points.py) against brute-force enumeration, and the
exact evaluator."""

import itertools
import math

import numpy as np
import pytest

import aggregation as ag
from distillation import evaluation, fixed_points, tasks
from distillation.configs import SpectrumConfig

TOL = 0.01


# ------------------------------------------------------------------------------------------------
# the SFT fixed point against a brute-force enumeration of responses
# ------------------------------------------------------------------------------------------------
def brute_sft(task, alpha):
    """The labels' distribution at every (step, state) by enumerating every response prefix (not by the
    occupancy recursion): teacher k ~ w writes with prob 1 - alpha and labels its own tokens; the student
    (the fixed point itself, solved step by step) writes with prob alpha and a teacher k ~ w labels."""
    t, w, H = task.teachers, task.weights, task.horizon
    p = np.exp(t.log_probs)
    A = np.tensordot(w, p, axes=1)
    q = np.full((H, t.S, t.n), np.nan)
    for h in range(H):
        mass = np.zeros((t.S, t.n))
        for prefix in itertools.product(range(t.n), repeat=h):
            s, pk, pq = t.start, w.copy(), 1.0
            for j, a in enumerate(prefix):
                pk, pq, s = pk * p[:, s, a], pq * math.exp(q[j, s, a]), t.next_state[s, a]
                if s < 0:
                    break
            if s < 0:
                continue
            mass[s] += (1 - alpha) * pk @ p[:, s] + alpha * pq * A[s]
        seen = mass.sum(1) > 0
        q[h, seen] = np.log(mass[seen] / mass[seen].sum(1, keepdims=True))
        q[h, ~seen] = np.log(A[~seen])
    return q


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0])
def test_sft_fixed_point_equals_the_enumerated_label_distribution(alpha):
    task = tasks.make_task("tree", K=2, seed=3)
    np.testing.assert_allclose(fixed_points.sft_fixed_point(task, alpha), brute_sft(task, alpha), atol=1e-12)


def test_sft_fixed_point_is_the_mixture_at_alpha_0_and_A_at_alpha_1_and_moves_between():
    task = tasks.make_task("tree", K=2, seed=0)
    t, w = task.teachers, task.weights
    at0 = fixed_points.sft_fixed_point(task, 0.0)
    for path in itertools.product(range(t.n), repeat=task.horizon):     # every state of the tree, once
        mix = ag.mixture_conditionals(t, w, list(path))
        s = t.start
        for h, a in enumerate(path):
            np.testing.assert_allclose(at0[h, s], mix[h], atol=1e-12)
            s = t.next_state[s, a]
    np.testing.assert_allclose(fixed_points.sft_fixed_point(task, 1.0), fixed_points.target_table(task, "arithmetic"), atol=1e-12)
    theory = [ag.sequence_kl(t, w, task.horizon, fixed_points.sft_fixed_point(task, a), target=fixed_points.target_table(task, "arithmetic"))
              for a in np.linspace(0, 1, 11)]
    assert theory[0] > 0.05 and theory[-1] == pytest.approx(0.0, abs=1e-12)
    assert np.all(np.diff(theory) < 0)                        # it moves monotonically from the mixture to A
    one = tasks.make_task("tree", K=1, seed=0)                     # one teacher: nothing to move
    np.testing.assert_allclose(fixed_points.sft_fixed_point(one, 0.0), fixed_points.sft_fixed_point(one, 1.0), atol=1e-12)


def test_evaluator_kl_matches_a_monte_carlo_of_the_log_ratio_on_the_students_rollouts():
    task = tasks.make_task("tree", K=2, seed=1)
    t, H = task.teachers, task.horizon
    rng = np.random.default_rng(0)
    log_q = np.log(rng.dirichlet(np.ones(t.n), size=(H, t.S)))
    cfg = SpectrumConfig(objective="sft", alpha=0.5, switch=False, importance=False)
    out = evaluation.Evaluator(task)(log_q, cfg)
    tables = {name: fixed_points.target_table(task, name, 0.5) for name in fixed_points.TARGETS + ("sft",)}
    tables["fixed_point"] = fixed_points.fixed_point(task, cfg)
    N = 20000
    logs = {name: np.zeros(N) for name in tables}
    for i in range(N):
        s = t.start
        for h in range(H):
            a = rng.choice(t.n, p=np.exp(log_q[h, s]))
            for name, table in tables.items():
                logs[name][i] += log_q[h, s, a] - table[h, s, a]
            s = t.next_state[s, a]
    for name, v in logs.items():
        assert abs(v.mean() - out[f"kl_{name}"]) < 4 * v.std() / math.sqrt(N), name
    assert out["accuracy"] == pytest.approx(np.exp(log_q[0, t.start, 0]))
