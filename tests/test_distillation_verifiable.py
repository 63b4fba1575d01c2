"""Distillation and RL from a verifiable reward (distillation/verifiable.py) and the students it trains
(distillation/students.py)."""

import numpy as np
import pandas as pd
import pytest
import torch

from distillation import tasks, verifiable
from distillation.configs import Method
from distillation.students import FeatureStudents, LogLinearStudents, loglinear_tables


@pytest.fixture(scope="module")
def task():
    return tasks.make_goal_task(0)


# ------------------------------------------------------------------------------------------------
# distillation and RL
# ------------------------------------------------------------------------------------------------
METHODS = [Method("offline FKL", "fkl", "offline", 128), Method("on-policy FKL", "fkl", "on-policy"),
           Method("on-policy RKL", "rkl", "on-policy"), Method("none")]


@pytest.fixture(scope="module")
def distilled(task):
    runs = [(m, 0) for m in METHODS]
    students = LogLinearStudents(task.features, task.n, [0] * len(runs), lr=0.05)
    W0 = students.params["W"].clone()
    rows, costs = verifiable.distil(task, runs, students, steps=250, batch=32)
    return runs, W0, students.params["W"], pd.DataFrame(rows), costs


def test_distillation_counts_every_token(task, distilled):
    runs, W0, W, rows, (teacher, student) = distilled
    pool = verifiable.teacher_traces(task, 128, verifiable.pool_generator(0, 0))
    assert teacher[0] == task.K * int(pool.mask.sum()) and student[0] == 0         # paid once, up front
    for r in (1, 2):
        assert student[r] > 250 * 32 and teacher[r] == task.K * student[r]        # every student token scored
    assert teacher[3] == student[3] == 0
    assert torch.equal(W[3], W0[3])                                                 # no distillation: untouched
    last = rows[rows.step == 250].set_index("method")
    assert last.loc["offline FKL", "teacher_tokens"] == teacher[0]
    assert (rows.seed == 0).all() and (rows.stage == "distil").all()
    assert sorted(rows.step.unique()) == sorted(verifiable.checkpoints(250))
    assert last.loc["on-policy RKL", "student_tokens"] == student[2]


def test_offline_pools_are_drawn_per_task_and_seed(task):
    """The pool of seed s on one task shares nothing with seed s's pool on another task (the t-interval
    over tasks treats tasks as independent), and the same (task, seed) draws the same pool."""
    draw = lambda task_seed, seed: verifiable.teacher_traces(task, 64, verifiable.pool_generator(task_seed, seed))  # noqa: E731
    same, other_task, other_seed = draw(3, 1), draw(4, 1), draw(3, 2)
    assert torch.equal(draw(3, 1).states, same.states)
    assert not torch.equal(same.states[:, 0], other_task.states[:, 0])
    assert not torch.equal(same.states[:, 0], other_seed.states[:, 0])


@pytest.mark.parametrize("change", [dict(objective="sft"), dict(rollouts="online"), dict(pool=0), dict(size=3)])
def test_methods_refuse_bad_fields_naming_them(change):
    (name,) = change
    with pytest.raises(ValueError, match=name):
        Method.from_dict(dict(METHODS[0].as_dict(), **change))


def test_distillation_reaches_each_objectives_target(distilled):
    _, _, _, rows, _ = distilled
    first, last = rows[rows.step == 0].set_index("method"), rows[rows.step == 250].set_index("method")
    for method, near, far in (("offline FKL", "kl_arithmetic", "kl_local"), ("on-policy FKL", "kl_arithmetic", "kl_local"),
                              ("on-policy RKL", "kl_local", "kl_arithmetic")):
        assert last.loc[method, near] < 0.005 < 0.02 < last.loc[method, far], method
        assert last.loc[method, near] < 0.02 * first.loc[method, near]


def test_rl_with_equal_rewards_in_every_group_leaves_the_student_unchanged(task):
    d = task.features.shape[1]
    W = torch.zeros(1, task.n, d)
    W[0, :, d - task.S:] = torch.as_tensor(60.0 * np.eye(task.n)[task.progress].T)   # one-hot(s) -> progress
    runs = [(METHODS[-1], 0)]
    assert tasks.success(task, loglinear_tables(W.double(), task.features).numpy(), task.id_starts).min() == 1.0
    students = LogLinearStudents(task.features, task.n, [0])
    students.params["W"] = W.clone()
    rows = verifiable.reinforce(task, runs, students, (np.zeros(1), np.zeros(1)), steps=5, contexts=4, group=4)
    assert torch.equal(students.params["W"], W)                          # every response correct: zero advantage
    last = rows[-1]                        # 5 steps of 16 responses, each as long as its start's level (1..4)
    assert last["teacher_tokens"] == 0 and 5 * 16 <= last["student_tokens"] <= 5 * 16 * 4


def test_rl_from_scratch_learns_the_task(task):
    runs = [(METHODS[-1], s) for s in range(3)]
    students = LogLinearStudents(task.features, task.n, [0, 1, 2], lr=0.05)
    rows = pd.DataFrame(verifiable.reinforce(task, runs, students, (np.zeros(3), np.zeros(3)), steps=150))
    before, after = rows[rows.step == 0].id_accuracy.to_numpy(), rows[rows.step == 150].id_accuracy.to_numpy()
    assert (after > before + 0.3).all()
    assert (rows[rows.step == 150].teacher_tokens == 0).all()
    assert (rows.stage == "rl").all() and sorted(rows[rows.step == 150].seed) == [0, 1, 2]


def test_checkpoints_are_step_0_and_the_log_grid_up_to_the_last_step():
    assert verifiable.checkpoints(0) == {0} and verifiable.checkpoints(1) == {0, 1}
    assert verifiable.checkpoints(2) == {0, 1, 2}
    assert verifiable.checkpoints(20) == {0, 1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 20}


def test_neural_students_learn_and_runs_stay_independent(task):
    students = FeatureStudents(task.features, task.n, [0, 1, 2], lr=3e-3)
    before = students.log_probs()
    runs = [(METHODS[1], 0), (METHODS[-1], 1), (METHODS[2], 2)]          # on-policy FKL, none, on-policy RKL
    rows = pd.DataFrame(verifiable.distil(task, runs, students, steps=80, batch=16)[0])
    after = students.log_probs()
    np.testing.assert_array_equal(after[1], before[1])                     # its loss is 0: Adam leaves it
    first, last = rows[rows.step == 0].set_index("method"), rows[rows.step == 80].set_index("method")
    assert last.loc["on-policy FKL", "kl_arithmetic"] < 0.3 * first.loc["on-policy FKL", "kl_arithmetic"]
    assert last.loc["on-policy RKL", "kl_local"] < 0.3 * first.loc["on-policy RKL", "kl_local"]


def test_on_policy_arms_sample_from_the_student(task, monkeypatch):
    """The first on-policy batch is drawn from each on-policy run's own student table (its starting
    policy), row by row; the offline run draws only from the teachers' pool."""
    calls = []
    original = verifiable.rollouts

    def spy(task_, tables, starts, gen, horizon=None):
        calls.append(tables.detach().clone())
        return original(task_, tables, starts, gen, horizon)
    monkeypatch.setattr(verifiable, "rollouts", spy)
    runs = [(METHODS[0], 0), (METHODS[1], 1), (METHODS[2], 2)]            # offline FKL, on-policy FKL, RKL
    students = LogLinearStudents(task.features, task.n, [0, 1, 2], lr=0.05)
    start = torch.as_tensor(students.log_probs(), dtype=torch.float32)
    verifiable.distil(task, runs, students, steps=1, batch=4)
    pool, first = calls[0], calls[1]
    teachers = torch.as_tensor(task.teacher_logp, dtype=torch.float32)
    assert all(any(torch.equal(row, t) for t in teachers) for row in pool)  # the pool: the teachers' tables
    assert first.shape[0] == 2 * 4
    torch.testing.assert_close(first, start[[1, 1, 1, 1, 2, 2, 2, 2]], rtol=0, atol=1e-6)


def test_the_fresh_teacher_control_samples_new_teacher_traces_every_step_and_pays_for_each(task, monkeypatch):
    """Each step the fresh-teacher run draws ``batch`` new teacher traces (tables: the teachers', starts
    fresh each step), and its teacher_tokens are K times their tokens, summed over the steps; it generates
    nothing itself, and adding it leaves the other runs' distillation unchanged."""
    calls = []
    original = verifiable.rollouts

    def spy(task_, tables, starts, gen, horizon=None):
        out = original(task_, tables, starts, gen, horizon)
        calls.append((tables.detach().clone(), starts.clone(), out))
        return out
    monkeypatch.setattr(verifiable, "rollouts", spy)
    fresh = Method("fresh FKL", "fkl", "fresh")
    runs = [(METHODS[0], 0), (METHODS[1], 1), (fresh, 2)]
    students = LogLinearStudents(task.features, task.n, [0, 1, 2], lr=0.05)
    rows, (teacher, student) = verifiable.distil(task, runs, students, steps=3, batch=4)
    teachers = torch.as_tensor(task.teacher_logp, dtype=torch.float32)
    drawn = [c for c in calls[1:] if all(any(torch.equal(row, t) for t in teachers) for row in c[0])]
    assert len(drawn) == 3 and all(c[0].shape[0] == 4 for c in drawn)        # one teacher batch per step
    assert len({tuple(c[1].tolist()) + tuple(c[2].tokens.flatten().tolist()) for c in drawn}) == 3   # all new
    assert teacher[2] == task.K * sum(int(c[2].mask.sum()) for c in drawn) and student[2] == 0
    students_alone = LogLinearStudents(task.features, task.n, [0, 1], lr=0.05)
    monkeypatch.setattr(verifiable, "rollouts", original)
    alone, _ = verifiable.distil(task, runs[:2], students_alone, steps=3, batch=4)
    both = pd.DataFrame(rows)
    pd.testing.assert_frame_equal(both[both.method != "fresh FKL"].reset_index(drop=True), pd.DataFrame(alone))
