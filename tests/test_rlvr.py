"""RL from a verifiable reward after distillation, and the cost of distillation (SPEC 5; claims E4, E6): the
goal task's structure, the exact success probabilities against an enumeration of responses and against Monte
Carlo through the sampler, the exact KL on the student's occupancy, distillation reaching each objective's
target with every token counted, the RL stage's group baseline, the E4 / E6 tables on synthetic curves with
known answers, and sims/rlvr.py end to end.
"""

import itertools
from collections import deque

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import assert_usage_error, run_script

from distillation import evaluation, tasks, verifiable
from distillation.students import FeaturePolicy, LogLinearStudents, NeuralStudents, loglinear_tables


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
    assert abs(ratio - evaluation.evaluate(task, log_q[None])["kl_arithmetic"][0]) < 4.5 * se


def test_each_target_is_at_zero_kl_from_itself(task):
    out = evaluation.evaluate(task, np.stack([task.target("arithmetic"), task.target("local")]))
    assert out["kl_arithmetic"][0] == pytest.approx(0.0, abs=1e-15)
    assert out["kl_local"][1] == pytest.approx(0.0, abs=1e-15)
    assert out["kl_local"][0] > 0.02 and out["kl_arithmetic"][1] > 0.02        # A and l are apart on this task


# ------------------------------------------------------------------------------------------------
# distillation and RL
# ------------------------------------------------------------------------------------------------
METHODS = [dict(method="offline FKL", objective="fkl", rollouts="offline", pool=128),
           dict(method="on-policy FKL", objective="fkl", rollouts="on-policy", pool=0),
           dict(method="on-policy RKL", objective="rkl", rollouts="on-policy", pool=0),
           dict(method="none", objective="", rollouts="", pool=0)]


@pytest.fixture(scope="module")
def distilled(task):
    runs = [(m, 0) for m in METHODS]
    students = LogLinearStudents(task, [0] * len(runs), lr=0.05)
    W0 = students.W.clone()
    rows, costs = verifiable.distil(task, runs, students, steps=250, batch=32)
    return runs, W0, students.W, pd.DataFrame(rows), costs


def test_distillation_counts_every_token(task, distilled):
    runs, W0, W, rows, (teacher, student) = distilled
    pool = verifiable.teacher_traces(task, 128, torch.Generator().manual_seed(10_000))
    assert teacher[0] == task.K * int(pool.mask.sum()) and student[0] == 0         # paid once, up front
    for r in (1, 2):
        assert student[r] > 250 * 32 and teacher[r] == task.K * student[r]        # every student token scored
    assert teacher[3] == student[3] == 0
    assert torch.equal(W[3], W0[3])                                                 # no distillation: untouched
    last = rows[rows.step == 250].set_index("method")
    assert last.loc["offline FKL", "teacher_tokens"] == teacher[0]
    assert last.loc["on-policy RKL", "student_tokens"] == student[2]


@pytest.mark.parametrize("method", [dict(METHODS[0], objective="sft"), dict(METHODS[1], rollouts="online"),
                                    dict(METHODS[0], pool=0)])
def test_distillation_rejects_unknown_methods(task, method):
    with pytest.raises(ValueError, match="method"):
        verifiable.distil(task, [(method, 0)], LogLinearStudents(task, [0]), steps=1)


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
    students = LogLinearStudents(task, [0])
    students.W = W.clone()
    rows = verifiable.reinforce(task, runs, students, (np.zeros(1), np.zeros(1)), steps=5, contexts=4, group=4)
    assert torch.equal(students.W, W)                          # every response correct: zero advantage
    last = rows[-1]                        # 5 steps of 16 responses, each as long as its start's level (1..4)
    assert last["teacher_tokens"] == 0 and 5 * 16 <= last["student_tokens"] <= 5 * 16 * 4


def test_rl_from_scratch_learns_the_task(task):
    runs = [(METHODS[-1], s) for s in range(3)]
    students = LogLinearStudents(task, [0, 1, 2], lr=0.05)
    rows = pd.DataFrame(verifiable.reinforce(task, runs, students, (np.zeros(3), np.zeros(3)), steps=150))
    before, after = rows[rows.step == 0].id_accuracy.to_numpy(), rows[rows.step == 150].id_accuracy.to_numpy()
    assert (after > before + 0.3).all()
    assert (rows[rows.step == 150].teacher_tokens == 0).all()


def test_neural_students_vmap_equals_each_model_and_runs_stay_independent(task):
    seeds = [0, 1, 2]
    students = NeuralStudents(task, seeds, lr=3e-3)
    features = torch.as_tensor(task.features, dtype=torch.float32)
    with torch.no_grad():
        one_by_one = torch.stack([FeaturePolicy(task, s)(features) for s in seeds])
    torch.testing.assert_close(students.tables(), one_by_one, rtol=1e-5, atol=1e-6)
    before = students.log_probs()
    runs = [(METHODS[1], 0), (METHODS[-1], 1), (METHODS[2], 2)]          # on-policy FKL, none, on-policy RKL
    rows = pd.DataFrame(verifiable.distil(task, runs, students, steps=80, batch=16)[0])
    after = students.log_probs()
    np.testing.assert_array_equal(after[1], before[1])                     # its loss is 0: Adam leaves it
    first, last = rows[rows.step == 0].set_index("method"), rows[rows.step == 80].set_index("method")
    assert last.loc["on-policy FKL", "kl_arithmetic"] < 0.3 * first.loc["on-policy FKL", "kl_arithmetic"]
    assert last.loc["on-policy RKL", "kl_local"] < 0.3 * first.loc["on-policy RKL", "kl_local"]


# ------------------------------------------------------------------------------------------------
# the E4 and E6 tables on synthetic curves with known answers
# ------------------------------------------------------------------------------------------------
def _synthetic_curves(edge_distil, edge_rl, n=12):
    rng = np.random.default_rng(0)
    rows = []
    for condition in ("shared", "unshared"):
        for task_id, seed in itertools.product(range(2), range(n // 2)):
            base = 0.3 + 0.1 * rng.normal(size=2)
            for method in ("offline FKL", "on-policy FKL", "offline RKL", "on-policy RKL"):
                on = method.startswith("on")
                noise = 0.005 * rng.normal(size=2)
                for stage, b, edge, e in (("distil", base[0], edge_distil, noise[0]), ("rl", base[1], edge_rl, noise[1])):
                    rows.append(dict(student="loglinear", condition=condition, task=task_id, method=method, seed=seed,
                                     stage=stage, step=10, ood_accuracy=b + (edge if on else 0.0) + e, id_accuracy=0.5))
    return pd.DataFrame(rows)


@pytest.mark.parametrize("edge_distil, edge_rl, verdict", [
    (0.1, 0.0, "edge does not survive RL (after RL: includes 0)"),
    (0.1, 0.05, "edge survives RL"),
    (0.0, 0.1, "no edge after distillation (includes 0)"),
    (0.1, -0.05, "edge does not survive RL (after RL: below 0)"),
])
def test_e4_table_verdicts(edge_distil, edge_rl, verdict):
    from sims import rlvr
    e4 = rlvr.e4_table(_synthetic_curves(edge_distil, edge_rl))
    diffs = e4[e4.comparison.str.contains(" - ")]
    assert len(diffs) == 8 and (diffs.verdict == verdict).all()
    d = diffs[diffs.stage == "distil"].ood_accuracy.to_numpy()
    np.testing.assert_allclose(d, edge_distil, atol=0.01)


def test_e6_table_on_curves_with_known_crossings():
    from sims import rlvr
    rows = []
    for seed in range(3):
        for step in range(0, 11):                  # offline: cost 1000 from the start, KL 1 / (1 + step)
            rows.append(dict(student="loglinear", condition="shared", task=0, seed=seed, method="offline FKL",
                             objective="fkl", stage="distil",
                             step=step, teacher_tokens=1000, student_tokens=0, kl_arithmetic=1 / (1 + step),
                             kl_local=1.0, id_accuracy=0.5))
            # on-policy: 300 tokens a step, KL 2 / (1 + step): KL at cost 1000 (step 3) = 0.5, reaches 1/11 at step 21
            rows.append(dict(student="loglinear", condition="shared", task=0, seed=seed, method="on-policy FKL",
                             objective="fkl",
                             stage="distil", step=step, teacher_tokens=200 * step, student_tokens=100 * step,
                             kl_arithmetic=2 / (1 + step), kl_local=1.0, id_accuracy=0.5))
        rows.append(dict(rows[-2], method="offline RKL", objective="rkl", kl_local=0.1))
    e6 = rlvr.e6_table(pd.DataFrame(rows)).set_index("method")
    on = e6.loc["on-policy FKL"]
    assert on.cost == 3000 and on.kl_at_offline_cost == pytest.approx(0.5) and np.isnan(on.cost_to_offline_kl)
    assert on.reached_offline_kl == "0/3"
    off = e6.loc["offline FKL"]
    assert off.cost == 1000 and off.kl_target == pytest.approx(1 / 11) and off.cost_to_offline_kl == 1000


# ------------------------------------------------------------------------------------------------
# sims/rlvr.py end to end
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def quick_rlvr(quick_run):
    return quick_run("rlvr")


@pytest.mark.integration
def test_rlvr_quick_end_to_end(quick_rlvr):
    from sims import rlvr
    out = quick_rlvr
    for name in ("curves.csv", "teachers.csv", "e4.csv", "e6.csv", "figures/rlvr.png", "figures/rlvr_cost.png"):
        assert (out / name).exists(), name
    curves = pd.read_csv(out / "curves.csv", keep_default_na=False, na_values=[""])
    assert set(curves.method) == {m["method"] for m in rlvr.METHODS} and set(curves.stage) == {"distil", "rl"}
    assert set(curves.student) == {"loglinear", "neural"}
    rl = curves[curves.stage == "rl"]
    assert (rl.groupby(["student", "condition", "task", "method", "seed"]).teacher_tokens.nunique() == 1).all()
    e4 = pd.read_csv(out / "e4.csv")
    assert e4.verdict.dropna().str.contains("edge").all() and len(e4.verdict.dropna()) == 16
    e6 = pd.read_csv(out / "e6.csv")
    assert set(e6.method) == {m["method"] for m in rlvr.METHODS if m["objective"]}
    teachers = pd.read_csv(out / "teachers.csv")
    assert (teachers[teachers.policy.str.startswith("A")].kl_arithmetic.abs() < 1e-12).all()


@pytest.mark.integration
def test_rlvr_is_deterministic_and_resumes(quick_rlvr, tmp_path):
    run_script("sims/rlvr.py", "--quick", "--only", "shared", "--out", tmp_path, "--quiet", "--no-figures")
    a = pd.read_csv(tmp_path / "curves.csv", keep_default_na=False, na_values=[""])
    b = pd.read_csv(quick_rlvr / "curves.csv", keep_default_na=False, na_values=[""])
    pd.testing.assert_frame_equal(a, b[b.condition == "shared"].reset_index(drop=True))
    proc = run_script("sims/rlvr.py", "--quick", "--out", quick_rlvr, "--resume", "--no-figures")
    assert "(6 resumed)" in proc.stderr


@pytest.mark.integration
def test_rlvr_figures_read_the_csvs(quick_rlvr):
    from figures import rlvr as fr
    figs = fr.figures_from(str(quick_rlvr))
    assert set(figs) == {"rlvr", "rlvr_cost"}
    e4 = pd.read_csv(quick_rlvr / "e4.csv")
    for ax, student in ((figs["rlvr"].axes[2], "loglinear"), (figs["rlvr"].axes[5], "neural")):
        diffs = e4[e4.comparison.str.contains(" - ") & (e4.student == student)]
        assert len(ax.get_yticklabels()) == len(diffs) == 8
    fkl = figs["rlvr_cost"].axes[0]
    assert fkl.get_xscale() == "log" and len(fkl.get_lines()) >= 2 * 4        # a line and an end marker per method


@pytest.mark.parametrize("bad", [["--seeds", "0"], ["--only", "nope"], ["--full"], ["--executor", "mpi"]])
def test_rlvr_bad_arguments_exit_2_with_one_line(bad, tmp_path):
    proc = run_script("sims/rlvr.py", *bad, "--quick", "--out", tmp_path, check=False, timeout=60)
    assert_usage_error(proc)
