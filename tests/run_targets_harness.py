"""The oracle harness of the run-target verification (tests/test_run_targets.py, docs/run_targets.md).

Each library's own training-step code — TRL's GKDTrainer.compute_loss and DistillationTrainer's
_chunked_divergence_loss, Liger's LigerFusedLinearJSDLoss module, verl's distillation_ppo_loss with its own
ActorConfig and DistillationLossConfig, tinker-cookbook's incorporate_kl_penalty — is run on the batch of
every response of a prefix-tree machine, the tabular student's logits at each position a separate leaf;
the library's gradient at each position, weighted by that response's probability under the run's sampler
(llm_bridge.run_dynamics.expected_loss), is the run's expected update, followed to its fixed point with
run_dynamics.solve. The samplers are written here from each trainer's own sampling code (GKD's
training_step, DistillationTrainer's on-policy generation), not taken from the model under test.
"""

import ast
import asyncio
import dataclasses
import math
import os
import tempfile
import textwrap
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from aggregation import FiniteStateTeachers, examples
from llm_bridge import run_dynamics as rd
from llm_bridge import runs
from llm_bridge.losses import oracle

torch.set_num_threads(1)      # tiny tensors: more threads only contend on a shared CPU
TV_TOLERANCE = 1e-6
DEPTH, N = 3, 3

# the files each library's loss is read from inside its unpacked wheel (make oracle)
FILES = {"trl": "trl/experimental/gkd/gkd_trainer.py", "verl": "verl/trainer/ppo/core_algos.py",
         "verl-topk": "verl/trainer/distillation/fsdp/losses.py", "torchrl": "torchrl/objectives/llm/distillation.py",
         "liger": "liger_kernel/chunked_loss/jsd_loss.py"}
VERSIONS = {"trl": "TRL 1.16.0", "verl": "verl 0.9.1", "verl-topk": "verl 0.9.1", "torchrl": "torchrl 0.14.1",
            "liger": "Liger-Kernel 0.8.5"}


def library_function(package, name, cls=None):
    """A function (or a class's method) executed alone from its source in the unpacked wheel, in a
    namespace holding torch, F and math; pytest.skip when the wheel is not unpacked."""
    folder = "verl" if package.startswith("verl") else package
    path = oracle.ORACLE / folder / FILES[package]
    if not path.exists():
        pytest.skip(f"{package}'s wheel is not unpacked under {oracle.ORACLE} (run `make oracle`)")
    text = path.read_text()
    tree = ast.parse(text)
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body if cls else tree.body
    namespace = {"torch": torch, "F": F, "math": math}
    node = next(n for n in scope if isinstance(n, ast.FunctionDef) and n.name == name)
    exec(textwrap.dedent(ast.get_source_segment(text, node)), namespace)
    return namespace[name]


def machine(K, seed=1, temperature=1.0):
    """K random teachers on the full prefix tree of depth 3 over 3 tokens (13 states); with a temperature,
    the teachers' conditionals softmax(log p / temperature) (what a loss at that temperature sees)."""
    m = examples.prefix_tree(K, DEPTH, N, seed=seed, concentration=1.0)
    if temperature == 1.0:
        return m
    lp = m.log_probs / temperature
    return FiniteStateTeachers(m.next_state, lp - np.logaddexp.reduce(lp, axis=-1, keepdims=True), m.start)


# ------------------------------------------------------------------------------------------------
# each library's own training-step code on the batch of every response (the oracle tier)
# ------------------------------------------------------------------------------------------------
def oracle_module(package, module):
    """A module of a library, imported from its wheel unpacked under .cache/oracle/<package>/ (make oracle);
    pytest.skip when absent. verl's package __init__ (its Ray workers) is not run: its namespace is made
    directly so that only the loss modules and their imports load."""
    import importlib
    import sys
    import types
    root = oracle.ORACLE / package
    top = module.split(".")[0]
    if not (root / top).is_dir():
        pytest.skip(f"{package}'s wheel is not unpacked under {oracle.ORACLE} (run `make oracle`)")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    if top == "verl" and "verl" not in sys.modules:
        namespace = types.ModuleType("verl")
        namespace.__path__ = [str(root / "verl")]
        sys.modules["verl"] = namespace
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    return importlib.import_module(module)


def leafwise(per_batch):
    """A library's loss on the batch (its own reduction) as run_dynamics' loss(route, X, W, batch): the
    library's gradient at each position, weighted by W. The positions are separate leaves, so the
    library's token mean is undone by multiplying by the number of positions."""
    def loss(route, X, W, batch):
        leaf = X.detach().clone().requires_grad_()
        value = per_batch(route, leaf, batch)
        g, = torch.autograd.grad(value, leaf)
        return (W[..., None] * g * batch.mask.sum() * X).sum()
    return loss


class TableModel(torch.nn.Module):
    """A causal LM whose logits at input id i are row i of ``table``: the tabular student (or teacher) as
    a model a trainer calls."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, input_ids, attention_mask=None, **_):
        return types.SimpleNamespace(logits=self.table[input_ids])


def sequence_inputs(batch):
    """input_ids (P, H + 1) numbering the positions (the last one a padding row), attention_mask, and
    labels (P, H + 1): the response tokens shifted by one, -100 past a response's end."""
    P, H = batch.tokens.shape
    ids = torch.arange(P * H).reshape(P, H)
    input_ids = torch.cat([ids, torch.full((P, 1), P * H)], 1)
    labels = torch.full((P, H + 1), -100)
    labels[:, 1:] = torch.where(batch.mask > 0, batch.tokens, torch.full_like(batch.tokens, -100))
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def position_rows(lp, batch):
    """(P H + 1, n): the rows of every position, then a padding row."""
    rows = lp.reshape(-1, lp.shape[-1])
    return torch.cat([rows, torch.zeros(1, rows.shape[-1], dtype=rows.dtype)])


def gkd_step(config):
    """TRL GKDTrainer: ``compute_loss`` on the batch (the routes: ``training_step``'s sampling)."""
    gkd = oracle_module("trl", "trl.experimental.gkd.gkd_trainer")

    def per_batch(route, leaf, batch):
        total = 0.0
        for k, c in route.scored:
            trainer = types.SimpleNamespace(teacher_model=TableModel(position_rows(batch.teacher_lp[k][batch.states],
                                                                                    batch)),
                                            beta=config.beta, generalized_jsd_loss=gkd.GKDTrainer.generalized_jsd_loss)
            total = total + c * gkd.GKDTrainer.compute_loss(trainer, TableModel(position_rows(leaf, batch)),
                                                           sequence_inputs(batch))
        return total
    return leafwise(per_batch)


def gkd_routes(config, weights, teachers):
    """GKDTrainer.training_step's samples: with probability lmbda the student generates (generation_config's
    temperature is config.temperature), else with seq_kd the teacher generates (the same config), else the
    batch is the data set's; teachers routed (one per sample, k ~ w) or pooled (a wrapper: all, weights w)."""
    ks = [k for k, w in enumerate(weights) if w > 0]
    tau = config.temperature

    def scored(k):
        return tuple((j, weights[j]) for j in ks) if teachers == "pooled" else ((k, 1.0),)

    def route(share, sampler):
        if sampler == "teacher":
            return [rd.Route(share * weights[k], ("teacher", k, tau), scored(k)) for k in ks]
        s = ("student", tau) if sampler == "student" else ("data",)
        return ([rd.Route(share, s, scored(None))] if teachers == "pooled"
                else [rd.Route(share * weights[k], s, ((k, 1.0),)) for k in ks])
    out = route(config.lmbda, "student") if config.lmbda > 0 else []
    if config.lmbda < 1:
        out += route(1 - config.lmbda, "teacher" if config.seq_kd else "data")
    return out


def trl_config(run):
    """The TRL config object of a run (GKDConfig or DistillationConfig, from TRL's wheel)."""
    if run.trainer == "GKDTrainer":
        cls = oracle_module("trl", "trl.experimental.gkd.gkd_config").GKDConfig
        flags = dict(beta=run.beta, lmbda=run.lmbda, seq_kd=run.seq_kd, temperature=run.temperature)
    else:
        cls = oracle_module("trl", "trl.trainer.distillation_config").DistillationConfig
        flags = dict(beta=run.beta, temperature=run.temperature)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(output_dir=str(Path(tempfile.gettempdir()) / "trl-oracle"), report_to="none", use_cpu=True,
                   bf16=False, **flags)


def distillation_trainer_step(config):
    """TRL DistillationTrainer: ``_chunked_divergence_loss``, the loss ``_compute_loss`` returns, on one-hot
    hidden states whose lm_head rows are the positions' logits (the student's and each teacher's)."""
    dt = oracle_module("trl", "trl.trainer.distillation_trainer")

    def per_batch(route, leaf, batch):
        P, H, n = leaf.shape
        hidden = torch.eye(P * H, dtype=leaf.dtype).reshape(P, H, P * H)
        total = 0.0
        for k, c in route.scored:
            loss, _, _ = dt._chunked_divergence_loss(hidden, hidden, leaf.reshape(P * H, n).T,
                                                     batch.teacher_lp[k][batch.states].reshape(P * H, n).T,
                                                     batch.mask, config.beta, temperature=config.temperature)
            total = total + c * loss
        return total
    return leafwise(per_batch)


def distillation_trainer_routes(config, weights, teachers):
    """DistillationTrainer always trains on the student's rollouts, sampled at config.temperature."""
    ks = [k for k, w in enumerate(weights) if w > 0]
    if teachers == "pooled":
        return [rd.Route(1.0, ("student", config.temperature), tuple((k, weights[k]) for k in ks))]
    return [rd.Route(weights[k], ("student", config.temperature), ((k, 1.0),)) for k in ks]


def liger_step(run):
    """Liger: ``LigerFusedLinearJSDLoss(...).forward`` on one-hot inputs whose weight columns are the
    positions' logits; true_labels are the batch's own tokens (compiled=False: the same math without
    torch.compile, which on a CPU would compile a C++ kernel per shape)."""
    jsd = oracle_module("liger", "liger_kernel.chunked_loss.jsd_loss")
    module = jsd.LigerFusedLinearJSDLoss(weight_hard_loss=run.weight_hard_loss, weight_soft_loss=run.weight_soft_loss,
                                         beta=run.beta, temperature=run.temperature, compiled=False)

    def per_batch(route, leaf, batch):
        P, H, n = leaf.shape
        eye = torch.eye(P * H, dtype=leaf.dtype)
        labels = torch.where(batch.mask > 0, batch.tokens, torch.full_like(batch.tokens, -100)).reshape(-1)
        return sum(c * module(eye, leaf.reshape(P * H, n).T, eye, batch.teacher_lp[k][batch.states].reshape(P * H, n).T,
                              labels) for k, c in route.scored)
    return module, leafwise(per_batch)


def verl_loss_config(run):
    """verl's own DistillationLossConfig for the run (its __post_init__ refuses what verl refuses)."""
    config = oracle_module("verl", "verl.workers.config")
    return config.DistillationLossConfig(loss_mode=run.loss_mode, topk=run.topk, use_task_rewards=run.use_task_rewards,
                                         distillation_loss_coef=run.distillation_loss_coef,
                                         loss_max_clamp=run.loss_max_clamp, log_prob_min_clamp=run.log_prob_min_clamp,
                                         use_policy_gradient=run.use_policy_gradient)


def verl_step(run):
    """verl: ``distillation_ppo_loss`` (the actor's policy loss with distillation: the distillation loss of
    the configured mode, clamps, the negative loss as advantage, the task's PPO loss) with verl's own
    ActorConfig and DistillationLossConfig; forward_kl_topk's per-token loss first through the same
    function as the logits processor. One prompt token per response, PPO at ratio 1 (old log-probs =
    current: the first update on fresh rollouts); the task advantage is r - E_q r per token (a group
    baseline), 0 without a reward."""
    from tensordict import TensorDict
    losses = oracle_module("verl", "verl.trainer.distillation.losses")
    config = oracle_module("verl", "verl.workers.config")
    tensordict_utils = oracle_module("verl", "verl.utils.tensordict_utils")
    actor = config.ActorConfig(strategy="fsdp", rollout_n=1, ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1,
                               use_dynamic_bsz=False)
    distillation = types.SimpleNamespace(enabled=True, distillation_loss=verl_loss_config(run))

    def flat(values):                          # (P, H, ...) -> the unpadded layout: each response then one slot
        pad = torch.zeros(values.shape[0], 1, *values.shape[2:], dtype=values.dtype)
        return torch.cat([values, pad], 1).reshape(-1, *values.shape[2:])

    def nested(values):                        # (P, H, ...) -> a jagged (P, H + 1, ...) tensor (per response)
        pad = torch.zeros(values.shape[0], 1, *values.shape[2:], dtype=values.dtype)
        return torch.nested.as_nested_tensor(list(torch.cat([values, pad], 1)), layout=torch.jagged)

    def per_batch(route, leaf, batch):
        (k, _), = route.scored
        P, H, n = leaf.shape
        lq = torch.log_softmax(leaf, -1)
        sampled = lq.gather(-1, batch.tokens[..., None])[..., 0]
        teacher = batch.teacher_lp[k][batch.states]
        q_paths = batch.path_log_probs(batch.student_lp).exp()
        advantage = (batch.reward - (q_paths * batch.reward).sum())[:, None].expand(P, H) * batch.mask
        data = TensorDict({"prompts": torch.zeros(P, 1, dtype=torch.long), "responses": batch.tokens,
                           "attention_mask": torch.ones(P, H + 1, dtype=torch.long), "response_mask": batch.mask > 0,
                           "old_log_probs": sampled.detach(), "advantages": advantage,
                           "teacher_logprobs": nested(teacher.gather(-1, batch.tokens[..., None]))}, batch_size=[P])
        tensordict_utils.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(batch.mask.sum()), global_batch_size=P)
        output = {"log_probs": flat(sampled)}
        if run.loss_mode == "forward_kl_topk":
            top = torch.topk(teacher, min(run.topk, n), dim=-1)
            data["teacher_logprobs"], data["teacher_ids"] = nested(top.values), nested(top.indices)
            processed = losses.distillation_ppo_loss(actor, distillation, data=data, student_logits=flat(leaf)[None])
            output.update({key: value[0] for key, value in processed.items()})
        value, _ = losses.distillation_ppo_loss(actor, distillation, model_output=output, data=data)
        return value
    return leafwise(per_batch)


def tinker_step(run):
    """tinker-cookbook: ``incorporate_kl_penalty`` (run from its source in the wheel: the cookbook imports its
    service client, which is not installed) writes each response's advantages; the update is the
    importance-sampling policy loss at ratio 1, -A ln q per token."""
    metrics = library_source_function("tinker_cookbook", "tinker_cookbook/rl/metrics.py",
                                       "discounted_future_sum_vectorized")
    incorporate = library_source_function("tinker_cookbook", "tinker_cookbook/distillation/train_on_policy.py",
                                          "incorporate_kl_penalty", tinker=TINKER_STUB,
                                          discounted_future_sum_vectorized=metrics, safezip=_safezip, cast=lambda t, x: x,
                                          asyncio=asyncio)

    def loss(route, X, W, batch):
        (k, _), = route.scored
        lq = torch.log_softmax(X, -1).gather(-1, batch.tokens[..., None])[..., 0]
        teacher = batch.teacher_lp[k][batch.states].gather(-1, batch.tokens[..., None])[..., 0]
        data = [TinkerDatum(lq[p].detach(), batch.mask[p], batch.tokens[p]) for p in range(len(lq))]
        clients = [TinkerTeacher(teacher[p]) for p in range(len(lq))]
        asyncio.run(incorporate(data, clients, [0] * len(data), run.kl_penalty_coef, run.kl_discount_factor))
        advantages = torch.stack([d.loss_fn_inputs["advantages"].to_torch() for d in data])
        return -(W * advantages * lq).sum()
    return loss


def torchrl_step(run):
    """torchrl: ``k3_kl_token_estimate`` from the wheel, the per-token estimate DistillationLoss.forward applies
    (reverse: target = the teacher's log-prob, on the student's tokens; forward: the other way round, on the
    teacher's); the module itself needs a chat tokenizer and a TransformersWrapper, and torchrl's tensordict
    (>= 0.14) cannot share a venv with verl's (<= 0.10): it is not run."""
    k3 = library_function("torchrl", "k3_kl_token_estimate")

    def per_batch(route, leaf, batch):
        (k, _), = route.scored
        lq = torch.log_softmax(leaf, -1).gather(-1, batch.tokens[..., None])[..., 0]
        lp = batch.teacher_lp[k][batch.states].gather(-1, batch.tokens[..., None])[..., 0]
        value = k3(lp, lq) if run.kl_direction == "reverse" else k3(lq, lp)
        return (value * batch.mask).sum() / batch.mask.sum()
    return leafwise(per_batch)


def library_source_function(package, path, name, **namespace):
    """A top-level function executed from its source file in an unpacked wheel, in a namespace holding
    torch, F, math and ``namespace`` (for a library whose package cannot be imported here)."""
    file = oracle.ORACLE / package / path
    if not file.exists():
        pytest.skip(f"{package}'s wheel is not unpacked under {oracle.ORACLE} (run `make oracle`)")
    text = file.read_text()
    node = next(n for n in ast.parse(text).body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name == name)
    scope = {"torch": torch, "F": F, "math": math, **namespace}
    exec(textwrap.dedent(ast.get_source_segment(text, node)), scope)
    return scope[name]


class _TensorData:
    """tinker.TensorData's two methods the cookbook calls."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.data = tensor.tolist()

    @classmethod
    def from_torch(cls, tensor):
        return cls(tensor)

    def to_torch(self):
        return self.tensor


TINKER_STUB = types.SimpleNamespace(TensorData=_TensorData, Datum=object, SamplingClient=object)


class _ModelInput:
    def __init__(self, tokens):
        self.tokens = tokens

    def append_int(self, token):
        return _ModelInput(self.tokens + [token])


class TinkerDatum:
    """A tinker Datum of one response: model_input (a prompt token, then all but the last response token),
    loss_fn_inputs target_tokens, the sampler's logprobs, mask and advantages (zero before the penalty)."""

    def __init__(self, logprobs, mask, tokens):
        self.model_input = _ModelInput([0] + tokens[:-1].tolist())
        self.loss_fn_inputs = {"target_tokens": _TensorData(tokens), "logprobs": _TensorData(logprobs),
                               "mask": _TensorData(mask), "advantages": _TensorData(torch.zeros_like(logprobs))}


class TinkerTeacher:
    """A tinker SamplingClient's compute_logprobs: the log-prob of every token of the sequence (None for the first)."""

    def __init__(self, logprobs):
        self.logprobs = logprobs

    def compute_logprobs(self, sequence):
        result = [None] + self.logprobs.tolist()

        async def done():
            return result
        return types.SimpleNamespace(coroutine=done)


def _safezip(*args):
    return zip(*args, strict=True)


def library_step(run):
    """(routes, loss) of the run as its library's own training-step code computes it (the oracle)."""
    w = tuple(run.weights)
    if isinstance(run, runs.TRLRun):
        config = trl_config(run)
        if run.trainer == "GKDTrainer":
            return gkd_routes(config, w, run.teachers), gkd_step(config)
        return distillation_trainer_routes(config, w, run.teachers), distillation_trainer_step(config)
    if isinstance(run, runs.LigerRun):
        return rd.routes_for(run.samples, run.teachers, w), liger_step(run)[1]
    if isinstance(run, runs.VerlRun):
        return [rd.Route(w[k], ("student", 1.0), ((k, 1.0),)) for k in range(len(w)) if w[k] > 0], verl_step(run)
    if isinstance(run, runs.TinkerRun):
        return [rd.Route(w[k], ("student", 1.0), ((k, 1.0),)) for k in range(len(w)) if w[k] > 0], tinker_step(run)
    if isinstance(run, runs.TorchRLRun):             # its docstring: the scored tokens are the student's or the teacher's
        sampler = (lambda k: ("student", 1.0)) if run.kl_direction == "reverse" else (lambda k: ("teacher", k, 1.0))
        return [rd.Route(w[k], sampler(k), ((k, 1.0),)) for k in range(len(w)) if w[k] > 0], torchrl_step(run)
    raise ValueError(f"no library step for {run!r}")


def library_update(run, m, **kw):
    """theta (S, n) -> the library's expected update there (run_dynamics.gradient_of its surrogate)."""
    batch = rd.batch_of(m, **kw)
    routes, loss = library_step(run)
    return rd.gradient_of(rd.expected_loss(routes, loss, batch), batch.S, batch.n), rd.expected_loss(routes, loss, batch)


def library_fixed_point(run, m, **kw):
    """(log_q, residual, status) where the library's own step goes on machine m (run_dynamics.solve)."""
    batch = rd.batch_of(m, **kw)
    routes, loss = library_step(run)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        theta, residual, status = rd.solve(rd.expected_loss(routes, loss, batch), np.zeros((batch.S, batch.n)))
    finally:
        torch.set_num_threads(threads)
    return rd.log_softmax(theta), residual, status


# ------------------------------------------------------------------------------------------------
# the generated table (docs/run_targets.md): python tests/run_targets_harness.py rewrites it
# ------------------------------------------------------------------------------------------------
TABLE = Path(__file__).resolve().parents[1] / "docs" / "run_targets.md"
THEORY = {"A": "T1", "l": "T2", "J": "JSD_beta convex in q (T1 at beta = 0, T2 at 1)", "g": "theory section 2, T8",
          "mix": "T1 with the data as one more teacher", "data": "cross-entropy alone",
          "select": "one teacher (the data's lowest cross-entropy)", "computed": "no closed form",
          "none": "theory section 4", "diverges": "theory section 4"}
# the function each library row runs (tests/run_targets_harness.py), with the library's version
STEPS = {"GKDTrainer": "TRL 1.16.0 GKDTrainer.compute_loss", "DistillationTrainer":
         "TRL 1.16.0 distillation_trainer._chunked_divergence_loss", "LigerRun":
         "Liger-Kernel 0.8.5 LigerFusedLinearJSDLoss.forward", "VerlRun":
         "verl 0.9.1 distillation_ppo_loss (ActorConfig, DistillationLossConfig)", "TinkerRun":
         "tinker-cookbook 0.6.1 incorporate_kl_penalty", "TorchRLRun":
         "torchrl 0.14.1 k3_kl_token_estimate (the estimate DistillationLoss applies; the module is not run)"}


def verified_cell(run):
    """How a row is verified (tests/test_run_targets.py, tests/test_run_targets_derived.py), and for the runs
    of tests/test_checkpoint_audit_targets.py the checkpoint audit of tiny Qwen2 students."""
    cell = _verified_cell(run)
    from test_checkpoint_audit_targets import LIBRARY_CASES, OWN_CASES, SEEDS
    if runs.describe(run) in {runs.describe(case) for case, _ in OWN_CASES + LIBRARY_CASES}:
        cell += f"; a tiny Qwen2 student ends closest to it ({len(SEEDS)} seeds, checkpoint audit)"
    return cell


def _verified_cell(run):
    kind = type(run).__name__
    from test_run_targets import LIBRARY_CASES
    if kind == "NeMoRLRun":
        repository, _, commit = runs.predict_target(run).source
        return f"derived from source ({repository}@{commit[:12]}, re-implemented loss call per micro-batch; K = 2, 3)"
    if kind == "OwnRun":
        return "this project's losses (K = 2, 3)"
    step = STEPS[getattr(run, "trainer", kind)]
    library = {runs.describe(dataclasses.replace(case, weights=run.weights)) for case in LIBRARY_CASES}
    if runs.describe(run) in library:
        return f"the library's own step: {step} (K = 2, 3)"
    return f"model only (the library's step is checked on the rows above); {step}"


def where_it_goes(run):
    """The fixed point of the model of the run on the K = 2 verification machine: 'reaches it' or its
    distance to the nearest named targets."""
    m = machine(2)
    run = dataclasses.replace(run, weights=(0.3, 0.7)) if len(run.weights) == 2 else run
    if len(run.weights) == 1:
        return "the teacher"
    fp = rd.fixed_point(run, m)
    if fp.status == "static":
        return "does not move"
    # equal printed distances in name order: their float order is the CPU's rounding
    nearest = sorted(fp.distances.items(), key=lambda x: (float(f"{x[1]:.2g}"), x[0]))[:2]
    text = ", ".join(f"{d:.2g} from {name}" if d >= 1e-6 else f"reaches {name}" for name, d in nearest)
    return text if fp.status == "fixed point" else f"{fp.status}: {text}"


def table_rows(cases):
    rows = []
    for run in cases:
        p = runs.predict_target(run)
        if len(run.weights) == 1 and p.target in ("A", "l"):
            p = dataclasses.replace(p, target="the teacher")
        theory = "T1, T2 (one teacher)" if p.target == "the teacher" else \
            THEORY[p.target] + (" via theory section 4" if p.target in ("A", "l") and "theory section 4" in p.reason else "")
        samples = getattr(run, "samples", "student")
        label = {"J": p.label.replace("J_", "J_beta="), "the teacher": "the teacher p",
                 "select": "the lowest-CE teacher"}.get(p.target, p.label)
        where = "reaches it" if p.target in ("A", "l", "J", "g", "mix", "data", "the teacher") else where_it_goes(run)
        rows.append([runs.describe(run), samples.replace("mixed:", "student + "), label, theory, where,
                     verified_cell(run)])
    return rows


def render_table(cases):
    head = ("| run (library, flags) | samples | target | theory | where it goes (K = 2) | verified how |\n"
            "|---|---|---|---|---|---|\n")
    body = "".join("| " + " | ".join(row) + " |\n" for row in table_rows(cases))
    return TABLE_INTRO + head + body + TABLE_OUTRO


TABLE_INTRO = """# What a distillation run converges to

Generated by `python tests/run_targets_harness.py` from `llm_bridge.runs.predict_target`,
`llm_bridge.run_dynamics.fixed_point` and the verification cases of `tests/test_run_targets.py` (a test
fails if this file and the code disagree).

**Which temperature is which.** TRL's `GKDTrainer` reads `temperature` (GKDConfig default 0.9) only to
*sample* — the student's rollouts and, with `seq_kd`, the teacher's traces; its `compute_loss` calls
`generalized_jsd_loss` without a temperature, so the loss is at temperature 1 and the target is the pool of
the untempered teachers (the temperature moves it only through the posterior weights of tempered traces).
TRL's `DistillationTrainer` samples at its `temperature` *and* divides both sides' logits by it in the
loss: its student's softmax(z / tau) reaches the pool of the tempered teachers. Liger's
`LigerFusedLinearJSDLoss` applies its temperature to the soft loss only; its hard loss (the cross-entropy
on the batch's own tokens) is at temperature 1.

**How each row is verified.** A tabular student — one free softmax per state of a depth-3 prefix tree over
3 tokens, K = 2 and K = 3 random teachers (weights (0.3, 0.7) and (0.2, 0.3, 0.5)) — is trained by the
run's *expected* update: every response of the tree is a batch element weighted by its probability under
the run's sampler (the student's rollouts at the sampling temperature, the routed teacher's traces, the
data set — uniform here), the sampler held fixed during a step, each state's step divided by how often the
run visits it. For the library rows the update is the gradient of the **library's own training-step
code** on that batch (the function named in the last column, with the library's own config classes: TRL's
GKDConfig / DistillationConfig, verl's ActorConfig and DistillationLossConfig, Liger's module); for every
row it is also this project's model of the run (`llm_bridge.run_dynamics`). Both are followed from a
uniform student to where the update vanishes and must agree to <= 1e-6 total variation at every state; a
closed-form target must be reached to 1e-6 and lie > 1e-3 from every other named target. "where it goes"
is that fixed point on the K = 2 machine: "reaches it" for a closed form, else its distance (largest
per-state total variation) to the two nearest of A, l, J_0.5, g and each teacher. "not converged": the
update never vanished, and the distances are where the run stood when the iteration stopped, which depends
on the CPU's rounding (the same row reads 0.0065 on one machine and 0.011 on another).

Targets: **A** the arithmetic pool sum_k c_k p_k (forward KL, T1); **l** the local geometric pool
∝ prod_k p_k^{c_k} (per-token reverse KL, T2); **J_beta** the generalised-JSD barycentre (between A
and l, no closed form; one teacher: the teacher); **g** the conditionals of the sequence-level
geometric pool G_seq, which carry T8's prefix bias; **h data + (1 - h) A** a data term beside the forward
KL (the data's conditionals as one more teacher); **computed**: no closed form, where it goes is computed
(`llm_bridge.run_dynamics.fixed_point(run, machine)`). Weights c_k = w_k, or *posterior* c_k(u) ∝ w_k
p_k(u) when each sample is routed to one teacher and trained on that teacher's own traces (drawn at the
sampling temperature), or *visitation* weights ∝ w_k (lmbda q(u) + (1 - lmbda) p_k(u)) when the
student's rollouts are mixed in (TRL's lmbda with seq_kd). Several teachers with TRL, verl and torchrl are
routed (one teacher per sample: a teacher id, verl's `teacher_models.*.key`); "teachers=pooled" is a
wrapper summing w_k times the loss against each teacher. Flags left unset take the library's own
defaults (verl: the shipped YAML unless `defaults="dataclass"`). A label "if the task reward is
constant": verl adds the task's PPO loss (`use_task_rewards`, true in both sets of defaults); a reward
that varies moves the fixed point (`fixed_point(run, machine, reward=...)` computes it).

"""

TABLE_OUTRO = """
`predict_target(run).reason` gives the paragraph behind each row and `.source` the file it was read
from. NeMo-RL cannot be installed here: its loss calls are re-implemented from the source at the cited
commit in `tests/test_run_targets_derived.py`, one call per micro-batch (each response its own
micro-batch, the shipped `train_micro_batch_size: 1`, unless `micro_batches` says otherwise), and
verified the same way. With `dynamic_loss_scaling` (`sg(ce / kd) kd + ce`) the KD term's weight grows
without bound as kd falls; on data far from the pool (uniform here) there is then no fixed point when
each response or the whole data set is one micro-batch — the student circles A — so its row uses 3
micro-batches. Notes: verl's rows run `distillation_ppo_loss` on one-prompt-token responses with PPO at
ratio 1 (the old log-probs are the current ones: the first update on fresh rollouts) and the task
advantage r - E_q r per token; Liger runs with `compiled=False` (the same math without torch.compile).
"a tiny Qwen2 student ends closest to it": `tests/test_checkpoint_audit_targets.py` distils a tiny Qwen2
(built from a config) from two `TabularLM` teachers with that run's loss — this project's, or the
library's own function from its wheel — from each seed, and `target_distances`, exact on the machine,
names the row's target the closest of A, l, the routed mixture, g and each teacher, the 95% t interval
of its margin over the audited responses above 0.
"""


def table_cases():
    import dataclasses
    from test_run_targets import LIBRARY_CASES, MODEL_CASES, WEIGHTS
    from test_run_targets_derived import DERIVED_CASES
    one = lambda run: getattr(run, "loss_fn", "") == "DistillationLossFn"      # noqa: E731 (one teacher)
    seen, cases = set(), []
    for run in LIBRARY_CASES + MODEL_CASES + DERIVED_CASES:
        run = dataclasses.replace(run, weights=WEIGHTS[1 if one(run) else 2])
        if runs.describe(run) not in seen:
            seen.add(runs.describe(run))
            cases.append(run)
    return cases


if __name__ == "__main__":
    TABLE.write_text(render_table(table_cases()))
    print(f"wrote {TABLE}")
