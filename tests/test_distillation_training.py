"""The spectrum's students and training loops (distillation/training.py): each objective reaches its derived
fixed point."""

import itertools
import math

import numpy as np
import pandas as pd
import pytest
import torch

import aggregation as ag
from distillation import evaluation, fixed_points, tasks, training
from distillation.configs import SpectrumConfig
from distillation.students import TabularStudents, TokenStudents

TOL = 0.01


def train_tabular(task, configs, seeds, steps, batch=32, lr=0.05, eval_every=50, seed=0):
    """The tabular student trained as the sims train it: one generator for the start and the rollouts."""
    gen = torch.Generator().manual_seed(seed)
    students = TabularStudents(task, len(configs) * len(seeds), gen, lr=lr)
    return training.train(task, configs, seeds, students, steps=steps, batch=batch, eval_every=eval_every, gen=gen)


# ------------------------------------------------------------------------------------------------
# the tabular student's fixed points
# ------------------------------------------------------------------------------------------------
CONFIGS = [  # (objective, alpha, importance): where it must land, and the competing target it must avoid
    ("fkl", 0.0, False, "arithmetic", "local"), ("fkl", 1.0, False, "arithmetic", "local"),
    ("rkl", 0.0, False, "local", "arithmetic"), ("rkl", 1.0, False, "local", "arithmetic"),
    ("sft", 0.0, False, "mixture", "arithmetic"), ("sft", 1.0, False, "arithmetic", "mixture"),
    ("k2", 1.0, False, "local", "arithmetic"), ("k3", 1.0, False, "local", "arithmetic"),
    ("k3-teacher", 1.0, False, "arithmetic", "local"), ("pg0", 1.0, False, "local", "geometric"),
    ("pg1", 1.0, False, "geometric", "local"), ("pg1", 0.0, True, "geometric", "local"),
    ("k2", 0.0, True, "local", "arithmetic"),
    ("k3-teacher", 0.0, True, "mixture", "arithmetic"),   # routed to the teacher that wrote it: posterior weights
]
NO_CLOSED_FORM = [("k2", 0.0), ("k3", 0.0), ("k3-teacher", 0.0), ("k2", 0.5)]   # unweighted teacher samples


@pytest.fixture(scope="module")
def trained():
    task = tasks.make_task("tree", K=2, seed=0)
    configs = [SpectrumConfig(objective=o, alpha=a, switch=False, importance=i, clip=False) for o, a, i, _, _ in CONFIGS]
    configs += [SpectrumConfig(objective=o, alpha=a, switch=False, importance=False, clip=False)
                for o, a in NO_CLOSED_FORM + [("k1", 0.0), ("k1", 1.0), ("sft", 0.5)]]
    df = train_tabular(task, configs, seeds=[0, 1], steps=300, batch=64, lr=0.05, eval_every=300, seed=0)
    last = df[df.step == 300].copy()
    for name in fixed_points.TARGETS + ("sft", "fixed_point"):
        last[f"kl_{name}"] = last[f"kl_{name}"] / task.horizon
    return task, last.groupby(["objective", "alpha", "importance"]).mean(numeric_only=True)


def test_the_candidate_targets_are_far_apart_compared_with_the_tolerance():
    task = tasks.make_task("tree", K=2, seed=0)
    ev = evaluation.Evaluator(task)
    for a, b in itertools.permutations(fixed_points.TARGETS, 2):
        assert ev(fixed_points.target_table(task, a))[f"kl_{b}"] / task.horizon > 2.9 * TOL, (a, b)


@pytest.mark.parametrize("objective, alpha, importance, target, other", CONFIGS)
def test_each_objective_reaches_its_derived_fixed_point_and_not_the_competing_one(trained, objective, alpha,
                                                                                   importance, target, other):
    _, final = trained
    row = final.loc[(objective, alpha, importance)]
    assert row[f"kl_{target}"] < TOL, row
    assert row[f"kl_{other}"] > 2 * TOL, row


def test_sft_at_an_interior_alpha_reaches_its_own_fixed_point(trained):
    _, final = trained
    row = final.loc[("sft", 0.5, False)]
    assert row.kl_sft < TOL / 2 and row.kl_sft < row.kl_arithmetic and row.kl_sft < row.kl_mixture


@pytest.mark.parametrize("objective, alpha", NO_CLOSED_FORM)
def test_unweighted_teacher_samples_reach_the_solved_fixed_point_and_not_the_nominal_target(trained, objective,
                                                                                           alpha):
    _, final = trained
    row = final.loc[(objective, alpha, False)]
    assert row.kl_fixed_point < TOL, row
    assert row.kl_named > TOL, row                        # the departure the solved point explains


def test_estimator_fixed_point_closed_forms():
    """The solver against the closed forms it must reproduce: l for pooled losses on the student's samples
    or with importance weights, A for k3-teacher on the student's samples, and, routed with weights on the
    teachers' samples, SFT's fixed point (the same label distribution) at every alpha."""
    task = tasks.make_task("tree", K=2, seed=0)
    t = task.teachers
    l, A = fixed_points.target_table(task, "local"), fixed_points.target_table(task, "arithmetic")
    reached = ag.policy_occupancy(t, task.horizon, l)[:-1] > 0        # (step, state) pairs a response visits
    for obj, alpha, imp in (("k2", 1.0, False), ("k3", 1.0, False), ("k2", 0.0, True), ("k3", 0.3, True)):
        np.testing.assert_allclose(fixed_points.estimator_fixed_point(task, obj, alpha, imp)[reached], l[reached], atol=1e-8)
    np.testing.assert_allclose(fixed_points.estimator_fixed_point(task, "k3-teacher", 1.0)[reached], A[reached], atol=1e-8)
    for alpha in (0.0, 0.3, 0.7):
        fp, sft = fixed_points.estimator_fixed_point(task, "k3-teacher", alpha, True), fixed_points.sft_fixed_point(task, alpha)
        np.testing.assert_allclose(fp[reached], sft[reached], atol=1e-8)
    unweighted = fixed_points.estimator_fixed_point(task, "k3", 0.0)
    assert ag.sequence_kl(t, task.weights, task.horizon, unweighted, target=l) / task.horizon > 2 * TOL
    with pytest.raises(ValueError, match="estimator fixed point"):
        fixed_points.estimator_fixed_point(task, "k1", 0.0)


def test_sampled_token_losses_on_unweighted_teacher_samples_miss_l(trained):
    _, final = trained
    for obj in ("k2", "k3"):
        off, on, weighted = (final.loc[(obj, 0.0, False)].kl_local, final.loc[(obj, 1.0, False)].kl_local,
                             final.loc[("k2", 0.0, True)].kl_local)
        assert off > 2 * TOL and on < TOL and weighted < TOL


def test_k1_as_a_loss_diverges_on_teacher_samples_and_does_not_move_on_the_students(trained):
    _, final = trained
    off, on = final.loc[("k1", 0.0, False)], final.loc[("k1", 1.0, False)]
    assert off.max_logit > 0.75 * evaluation.DIVERGED_LOGIT and off.accuracy < 1e-6       # the teacher's tokens pushed down
    assert on.max_logit < 0.2 * evaluation.DIVERGED_LOGIT


def test_divergence_is_flagged():
    task = tasks.make_task("tree", K=2, seed=0)
    cfg = SpectrumConfig(objective="k1", alpha=0.0, switch=False, importance=False, clip=False)
    df = train_tabular(task, [cfg], seeds=[0], steps=600, batch=64, lr=0.2, eval_every=600)
    last = df[df.step == 600].iloc[0]
    assert last.diverged and last.max_logit > evaluation.DIVERGED_LOGIT


def test_training_is_deterministic_and_runs_are_independent_of_their_neighbours():
    task = tasks.make_task("tree", K=2, seed=0)
    a = SpectrumConfig(objective="fkl", alpha=0.5, switch=False, importance=False, clip=True)
    b = SpectrumConfig(objective="rkl", alpha=0.2, switch=True, importance=False, clip=False)
    one = train_tabular(task, [a, b], seeds=[0], steps=20, eval_every=10)
    two = train_tabular(task, [a, b], seeds=[0], steps=20, eval_every=10)
    pd.testing.assert_frame_equal(one, two)
    assert one.kl_named.iloc[-1] < one.kl_named.iloc[3]                     # it learns


def test_the_neural_student_reads_the_prefix_and_learns_fkl():
    task = tasks.make_task("tree", K=2, seed=0)
    cfg = SpectrumConfig(objective="fkl", alpha=0.5, switch=False, importance=False, clip=True)
    students = TokenStudents(task, [0, 1], vocab=task.teachers.n + 1, bos=task.teachers.n, lr=3e-3)
    df = training.train(task, [cfg], [0, 1], students, steps=40, batch=32, eval_every=40)
    for _, run in df.groupby("seed"):
        first, last = run.kl_named.iloc[0], run.kl_named.iloc[-1]
        assert last < 0.2 * first


def test_bad_input():
    task = tasks.make_task("tree", K=2, seed=0)
    with pytest.raises(ValueError, match="alpha"):
        fixed_points.sft_fixed_point(task, 1.5)
    with pytest.raises(ValueError, match="target"):
        fixed_points.target_table(task, "median")
    with pytest.raises(ValueError, match="kind"):
        tasks.make_task("ring")


# ------------------------------------------------------------------------------------------------
# the one sampler, the batch type and the per-run loss
# ------------------------------------------------------------------------------------------------
def test_sample_follows_the_machine_masks_finished_sequences_and_records_after_the_token():
    # 0 -a-> 1 -a-> 2 -a-> end; token b ends at once from 0; the policy at state s puts all mass on token s % 2
    next_state = torch.tensor([[1, -1], [2, 2], [-1, -1]])
    seen = []

    def policy(h, states):
        rows = torch.full((len(states), 2), -math.inf)
        rows[torch.arange(len(states)), states % 2] = 0.0
        return rows

    def record(h, states, token, rows):
        seen.append(h)
        return {"double": 2 * token}
    fields, last = training.sample(next_state, torch.tensor([0, 1]), 5, policy, torch.Generator().manual_seed(0),
                                   lambda h, s: s < 0, record)
    # row 0: 0 -(0)-> 1 -(1)-> 2 -(0)-> end; row 1: 1 -(1)-> 2 -(0)-> end
    assert fields["states"].tolist() == [[0, 1, 2, 0, 0], [1, 2, 0, 0, 0]]
    assert fields["tokens"][:, :3].tolist() == [[0, 1, 0], [1, 0, 0]]
    assert fields["mask"].tolist() == [[True, True, True, False, False], [True, True, False, False, False]]
    assert torch.equal(fields["double"], 2 * fields["tokens"]) and seen == list(range(5))
    assert last.tolist() == [-1, -1]
    # a horizon per row and an absorbing goal (state 0), as the goal tasks use it
    goal = torch.tensor([[0, 0], [0, 0], [1, 1]])                  # 2 -> 1 -> 0, the goal
    fields, last = training.sample(goal, torch.tensor([2, 2]), 4, policy, torch.Generator().manual_seed(0),
                                   lambda h, s: (s == 0) | (h >= torch.tensor([1, 4])))
    assert fields["mask"].tolist() == [[True, False, False, False], [True, True, False, False]]
    assert last.tolist() == [1, 0]                                   # the horizon stops row 0 one step short


def test_batch_take_and_cat_keep_every_field_and_leave_missing_ones_none():
    b = training.Batch(states=torch.arange(6).view(3, 2), tokens=torch.zeros(3, 2, dtype=torch.long),
                       mask=torch.ones(3, 2, dtype=torch.bool), teacher=torch.tensor([0, 1, 0]))
    both = training.Batch.cat([b.take(torch.tensor([2])), b.take(torch.tensor([0, 1]))])
    assert both.states.tolist() == [[4, 5], [0, 1], [2, 3]] and both.teacher.tolist() == [0, 0, 1]
    assert both.labels is None and both.correct is None


def test_per_run_losses_sum_each_runs_rows_over_every_part():
    row_run = torch.tensor([0, 0, 1, 1, 2, 2])
    parts = training.partition_rows(np.array(["rkl", "fkl", "fkl", "rkl", "fkl", "fkl"]))
    assert list(parts) == ["fkl", "rkl"] and parts["rkl"].tolist() == [0, 3]
    losses = torch.arange(12, dtype=torch.float64).view(6, 2)
    scale = {"fkl": 1.0, "rkl": 10.0}
    got = training.per_run_losses(3, row_run, parts, lambda key, rows: scale[key] * losses[rows], batch=2)
    want = [(10 * (0 + 1) + (2 + 3)) / 2, ((4 + 5) + 10 * (6 + 7)) / 2, (8 + 9 + 10 + 11) / 2]
    assert got.dtype == torch.float32 and got.tolist() == want


def test_the_switch_point_variant_hands_over_once_at_a_uniform_position():
    """switch=True: a teacher writes up to a position m ~ U{0..H}, the student from m on. With a student
    that always emits token 2, the student's positions are exactly those from m on, each handover
    position is drawn about N / (H + 1) times, and the generating log-prob is the student's after m and
    the sequence's teacher's before it."""
    task = tasks.make_task("tree", K=2, seed=0)
    H, N = task.horizon, 8000
    always_2 = torch.tensor([-math.inf, -math.inf, 0.0])
    b = training.rollouts(task, lambda h, s: always_2.expand(len(s), 3), 0.0, True, N,
                          torch.Generator().manual_seed(3))
    first = torch.where(b.by_student.any(1), b.by_student.int().argmax(1), torch.full((N,), H))
    steps = torch.arange(H)
    assert torch.equal(b.by_student, steps[None, :] >= first[:, None])          # one handover, then the student
    counts = torch.bincount(first, minlength=H + 1).double()
    assert (counts - N / (H + 1)).abs().max() < 5 * math.sqrt(N / (H + 1))      # uniform on {0..H}
    assert (b.tokens[b.by_student] == 2).all() and (b.gen_logp[b.by_student] == 0).all()
    _, teacher_logp, _ = task.tensors
    before = ~b.by_student
    rows = teacher_logp[b.teacher[:, None].expand(-1, H), b.states]
    assert torch.equal(b.gen_logp[before], rows.gather(-1, b.tokens[..., None])[..., 0][before])


# ------------------------------------------------------------------------------------------------
# truncated importance weights (a clip that binds)
# ------------------------------------------------------------------------------------------------
def _train_once(task, configs, steps=1, batch=4000, seed=3):
    gen = torch.Generator().manual_seed(seed)
    students = TabularStudents(task, len(configs), gen)
    start = students.log_probs()
    return start, training.train(task, configs, [0], students, steps=steps, batch=batch, eval_every=steps, gen=gen,
                                 fixed_points=False)


def test_truncation_binds_on_the_share_of_teacher_tokens_the_exact_weights_predict():
    """At the first step the k2 weight of teacher k's token a in state s is q0(a|s) / p_k(a|s): the share of
    weighted tokens it cuts is sum_k w_k sum_h,s occ_k(h, s) sum_a p_k(a|s) [q0 / p_k > c] over the
    teachers' occupancies, which a 4000-sequence batch measures to about 0.003."""
    task = tasks.make_task("loop", K=2, seed=0, horizon=6)
    t, H, cut = task.teachers, task.horizon, 1.5
    configs = [SpectrumConfig("k2", 0.0, importance=True, truncate=c) for c in (cut, 1e30)]
    start, df = _train_once(task, configs)
    lp = np.asarray(t.log_probs)
    over = total = 0.0
    for k in range(t.K):
        occ = ag.policy_occupancy(t, H, np.broadcast_to(lp[k], (H,) + lp[k].shape))[:H]          # (H, S)
        binds = (start[0] - lp[k][None]) > np.log(cut)                                           # (H, S, n)
        over += task.weights[k] * np.sum(occ[..., None] * np.exp(lp[k])[None] * binds)
        total += task.weights[k] * occ.sum()
    last = df[df.step == 1].set_index("truncate")
    assert 0.05 < over / total < 0.95                                      # the check is not vacuous
    assert last.truncated_tokens[cut] == pytest.approx(over / total, abs=0.01)    # s.e. about 0.003
    assert last.truncated_steps[cut] == 1.0
    assert last.truncated_tokens[1e30] == 0.0 and last.truncated_steps[1e30] == 0.0


def test_a_truncation_that_never_binds_changes_nothing_and_one_that_binds_changes_the_student():
    task = tasks.make_task("loop", K=2, seed=0, horizon=6)
    kl = {c: _train_once(task, [SpectrumConfig("pg0", 0.0, importance=True, truncate=c)], steps=20, batch=64)[1]
          .query("step == 20").kl_local.iloc[0] for c in (math.inf, 1e30, 0.5)}
    assert kl[1e30] == kl[math.inf]
    assert abs(kl[0.5] - kl[math.inf]) > 1e-3
    plain = _train_once(task, [SpectrumConfig("pg0", 0.0, importance=True)], steps=20, batch=64)[1]
    assert "truncated_tokens" not in plain                                  # no truncation: no share columns


def test_truncation_needs_weights_and_a_positive_level():
    with pytest.raises(ValueError, match="importance"):
        SpectrumConfig("k2", 0.0, truncate=1.0)
    with pytest.raises(ValueError, match="truncate"):
        SpectrumConfig("k2", 0.0, importance=True, truncate=0.0)
