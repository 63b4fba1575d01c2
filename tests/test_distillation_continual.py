"""Continual distillation (distillation/continual.py): update sparsity, learning-rate schedules, forgetting
against closed forms."""

import itertools
import math

import numpy as np
import pytest
import torch

from distillation import continual, evaluation, fixed_points, students, tasks
from distillation.configs import SCHEDULES, STORAGES, ContinualConfig


# ------------------------------------------------------------------------------------------------
# update sparsity
# ------------------------------------------------------------------------------------------------
def test_update_sparsity_float32_threshold_on_hand_made_changes():
    theta0 = np.array([0.0, 1.0, 100.0, -3.0, 5.0, 2.0])
    delta = np.array([2e-6, 3e-6, 5e-5, 0.0, -1e-5, 2e-6])
    # thresholds 1e-6 (1 + |theta0|): 1e-6, 2e-6, 1.01e-4, 4e-6, 6e-6, 3e-6 -> changed: yes yes no no yes no
    frac, _ = continual.update_sparsity(theta0, theta0 + delta)
    assert frac == pytest.approx(0.5, abs=0)
    frac, frac_bf16 = continual.update_sparsity(theta0, theta0)
    assert frac == 0.0 and frac_bf16 == 0.0


def test_update_sparsity_reads_both_vectors_as_float32_and_a_change_at_the_threshold_as_none():
    """Per run (rows): float64 inputs are the float32 parameters they round to. 1 + 1.99e-6 is 17 float32 ulps
    (2.03e-6) from 1, above the threshold 2e-6 either way round, though 1.99e-6 is below it in float64; a
    change of exactly the threshold (1e-6 from 0, both in float32) is not above it."""
    theta0 = np.array([[0.0], [1.0 + 1.99e-6], [1.0]])
    theta1 = np.array([[1e-6], [1.0], [1.0 + 1.99e-6]])
    frac, frac_bf16 = continual.update_sparsity(theta0, theta1)
    assert frac.tolist() == [0.0, 1.0, 1.0] and frac_bf16.tolist() == [1.0, 0.0, 0.0]


def test_update_sparsity_bf16_rounding_swallows_updates_below_half_an_ulp():
    # bfloat16 keeps 8 significant bits: the ulp is 2^-7 at 1, 2^-8 at 0.5, 2 at 256
    theta0 = np.array([1.0, 1.0, 256.0, 0.5])
    theta1 = np.array([1.0 + 0.003, 1.0 + 0.0079, 256.0 + 1.5, 0.5 + 0.001])
    frac, frac_bf16 = continual.update_sparsity(theta0, theta1)
    assert frac == 1.0                                  # every float32 change is above the threshold
    assert frac_bf16 == pytest.approx(0.5, abs=0)       # only 1 + 0.0079 and 256 + 1.5 move a bf16 value


def _bf16_reference(x):
    """Round float32 to bfloat16 (nearest, ties to even) on the bits: add 0x7FFF plus the lowest kept bit,
    drop the low 16 bits."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return rounded.view(np.float32)


def test_round_bf16_equals_a_bit_level_reference():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(size=5000) * 10.0 ** rng.integers(-6, 6, size=5000),
                        [1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 256.0 + 1.0, 256.0 + 3.0]]).astype(np.float32)
    ours = students.round_bf16(torch.as_tensor(x)).numpy()
    np.testing.assert_array_equal(ours, _bf16_reference(x))
    assert ours[-4:].tolist() == [1.0, 1.0 + 2 * 2.0 ** -7, 256.0, 260.0]          # ties go to the even neighbour


def test_update_sparsity_per_run_and_bad_shapes():
    theta0 = torch.zeros(3, 2, 5)
    theta1 = theta0.clone()
    theta1[1, 0, :2] = 1.0
    theta1[2] = 1.0
    frac, frac_bf16 = continual.update_sparsity(theta0, theta1)
    np.testing.assert_array_equal(frac, [0.0, 0.2, 1.0])
    np.testing.assert_array_equal(frac_bf16, [0.0, 0.2, 1.0])
    with pytest.raises(ValueError, match="same shape"):
        continual.update_sparsity(np.zeros(3), np.zeros(4))


# ------------------------------------------------------------------------------------------------
# learning-rate schedules
# ------------------------------------------------------------------------------------------------
def test_learning_rate_schedules_against_their_closed_forms():
    steps, lr = 100, 0.3
    k = np.arange(steps)
    np.testing.assert_allclose(continual.learning_rates(lr, "constant", False, steps), lr)
    np.testing.assert_allclose(continual.learning_rates(lr, "linear", False, steps), lr * (1 - k / steps), rtol=1e-15)
    np.testing.assert_allclose(continual.learning_rates(lr, "cosine", False, steps), lr * 0.5 * (1 + np.cos(np.pi * k / steps)),
                               rtol=1e-12)
    w = 10                                                  # the warm-up: 10% of the steps, a ramp (k + 1) / w
    for schedule in SCHEDULES:
        rates = continual.learning_rates(lr, schedule, True, steps)
        np.testing.assert_allclose(rates[:w], lr * (k[:w] + 1) / w, rtol=1e-15)
        assert rates[w] == pytest.approx(lr)                # the peak, then the decay over the other 90 steps
    np.testing.assert_allclose(continual.learning_rates(lr, "linear", True, steps)[w:], lr * (1 - (k[w:] - w) / (steps - w)))
    assert np.all(continual.learning_rates(0.0, "cosine", True, steps) == 0.0)
    with pytest.raises(ValueError, match="schedule"):
        continual.learning_rates(lr, "step", False, steps)
    with pytest.raises(ValueError, match="lr"):
        continual.learning_rates(-1.0, "constant", False, steps)


# ------------------------------------------------------------------------------------------------
# forgetting
# ------------------------------------------------------------------------------------------------
def _enumerated_loss(task, log_q):
    """KL_seq(P || q) by enumerating every response of the tree (P the task's one teacher)."""
    t = task.teachers
    total = 0.0
    for response in itertools.product(range(t.n), repeat=task.horizon):
        s, lp, lq = t.start, 0.0, 0.0
        for h, a in enumerate(response):
            lp += t.log_probs[0, s, a]
            lq += log_q[h, s, a] if log_q.ndim == 3 else log_q[s, a]
            s = t.next_state[s, a]
        total += math.exp(lp) * (lp - lq)
    return total


def test_loss_on_a_equals_the_enumerated_sequence_kl():
    pair = tasks.make_pair(0)
    rng = np.random.default_rng(3)
    t = pair.A.teachers
    log_q = np.log(rng.dirichlet(np.ones(t.n), size=t.S))
    assert evaluation.loss_on(pair.A, log_q) == pytest.approx(_enumerated_loss(pair.A, log_q), rel=1e-10)
    assert evaluation.loss_on(pair.A, np.asarray(t.log_probs[0])) == pytest.approx(0.0, abs=1e-12)


def _config(**kw):
    return ContinualConfig.from_dict(dict(dict(lr=0.1, schedule="constant", warmup=False, alpha=0.0, objective="fkl",
                                               clip=True, storage="float32"), **kw))


def test_forgetting_is_exactly_zero_at_learning_rate_zero_beside_runs_that_forget():
    pair = tasks.make_pair(1)
    start = continual.learn_a(pair, continual.students_for("loglinear", pair, [0]), steps=60)
    runs = [(_config(lr=0.0, storage=st, objective=obj), 0) for st in STORAGES for obj in ("fkl", "pg1")]
    runs += [(_config(lr=0.1, storage=st), 0) for st in STORAGES]
    out = continual.distil(pair, runs, start, steps=30, batch=16)
    frozen, moving = out[out.lr == 0.0], out[out.lr > 0]
    assert (frozen.forgetting == 0.0).all() and (frozen.sparsity == 0.0).all() and (frozen.sparsity_bf16 == 0.0).all()
    assert (moving.forgetting > 1e-3).all() and (moving.sparsity > 0.3).all()


def test_forgetting_on_a_student_that_cannot_tell_the_tasks_apart_equals_its_closed_form():
    """With features one-hot in the state only (the same for A and B), FKL on B drives the student to B's
    arithmetic pool at every state, so forgetting -> KL_seq(P_A || A_B) - KL_seq(P_A || q_before)."""
    pair = tasks.make_pair(2)
    S = pair.A.teachers.S
    blind = tasks.Pair(pair.A, pair.B, np.broadcast_to(np.eye(S), (2, S, S)).copy())
    start = continual.learn_a(blind, continual.students_for("loglinear", blind, [0]), steps=300)
    out = continual.distil(blind, [(_config(lr=0.05), 0)], start, steps=400, batch=64).iloc[0]
    A_B = fixed_points.target_table(pair.B, "arithmetic")
    expected = _enumerated_loss(pair.A, A_B) - out.loss_a_before
    assert expected > 0.1
    assert out.forgetting == pytest.approx(expected, rel=0.02)
    assert out.quality < 1e-3


def test_outcome_row_with_its_own_evaluator_reads_each_objectives_target_on_b():
    """outcome_row without an evaluator builds one on B: quality is the KL per position to the objective's own
    target (SFT's fixed point at its alpha for 'sft', the pool for 'fkl'), from an independent Evaluator call."""
    pair = tasks.make_pair(0)
    B, rng = pair.B, np.random.default_rng(5)
    q_b = np.log(rng.dirichlet(np.ones(B.teachers.n), size=(B.horizon, B.teachers.S)))
    q_a0, q_a1 = (np.log(rng.dirichlet(np.ones(B.teachers.n), size=B.teachers.S)) for _ in range(2))
    for objective, target in (("sft", "kl_sft"), ("fkl", "kl_arithmetic")):
        config = _config(objective=objective, alpha=0.3)
        row = continual.outcome_row(pair, config, 7, q_a0, q_a1, q_b, 0.25, 0.5)
        ref = evaluation.Evaluator(B)(q_b, config.spectrum())
        before, after = evaluation.loss_on(pair.A, q_a0), evaluation.loss_on(pair.A, q_a1)
        assert row["quality"] == pytest.approx(ref[target] / B.horizon, rel=1e-12) and row["quality"] > 0
        assert row["kl_arithmetic_b"] == pytest.approx(ref["kl_arithmetic"] / B.horizon, rel=1e-12)
        assert (row["seed"], row["loss_a_before"], row["loss_a_after"]) == (7, before, after)
        assert row["forgetting"] == after - before and before != after
        assert (row["accuracy_b"], row["sparsity"], row["sparsity_bf16"]) == (ref["accuracy"], 0.25, 0.5)


@pytest.mark.parametrize("bad", [dict(storage="fp8"), dict(objective="mse"), dict(alpha=1.5), dict(schedule="step"),
                                 dict(lr=-0.1), dict(learning_rate=0.1)])
def test_phase_two_configs_refuse_bad_fields_naming_them(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        _config(**bad)


def test_neural_forgetting_is_exactly_zero_at_learning_rate_zero():
    pair = tasks.make_pair(0)
    start = continual.learn_a(pair, continual.students_for("neural", pair, [0, 1]), steps=5)
    runs = [(_config(lr=0.0, storage="float32"), 1), (_config(lr=3e-3), 0), (_config(lr=3e-3), 1)]
    out = continual.distil(pair, runs, start, steps=20, batch=16)
    frozen, moving = out.iloc[0], out.iloc[1:]
    assert frozen["forgetting"] == 0.0 and frozen["sparsity"] == 0.0
    assert (moving.forgetting > 1e-3).all() and (moving.sparsity > 0.5).all()


def test_alpha_reaches_the_sampler_of_every_student(monkeypatch):
    """Each phase-2 run's rollouts are drawn with its own config's alpha (one value per sequence), for
    both students."""
    pair = tasks.make_pair(0)
    seen = []
    original = continual.rollouts

    def spy(task, student_logp, alpha, switch, n, gen, labels=True):
        seen.append(torch.as_tensor(alpha).clone())
        return original(task, student_logp, alpha, switch, n, gen, labels)
    monkeypatch.setattr(continual, "rollouts", spy)
    for kind in ("loglinear", "neural"):
        start = continual.learn_a(pair, continual.students_for(kind, pair, [0]), steps=2)
        runs = [(_config(alpha=a, lr=1e-3), 0) for a in (0.0, 0.5, 1.0)]
        seen.clear()
        continual.distil(pair, runs, start, steps=2, batch=4)
        assert len(seen) == 2
        for alpha in seen:
            assert alpha.tolist() == [0.0] * 4 + [0.5] * 4 + [1.0] * 4, kind


def test_bf16_storage_rounds_after_every_step_not_only_at_the_end():
    """Updates below half a bfloat16 ulp vanish when the parameters are rounded after every step: at lr
    1e-4 for 100 steps (each step far below half an ulp of most entries, their sum far above it) the bf16
    run moves a small fraction of the entries that the float32 run moves; rounding once at the end would
    let the sum through."""
    pair = tasks.make_pair(1)
    start = continual.learn_a(pair, continual.students_for("loglinear", pair, [0]), steps=60)
    runs = [(_config(lr=1e-4, storage=st), 0) for st in ("float32", "bf16")]
    out = continual.distil(pair, runs, start, steps=100, batch=16).set_index("storage")
    assert out.loc["float32", "sparsity_bf16"] > 0.3
    assert out.loc["bf16", "sparsity_bf16"] < 0.5 * out.loc["float32", "sparsity_bf16"]
