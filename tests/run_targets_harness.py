"""The tabular harness of the run-target verification (tests/test_run_targets.py, docs/run_targets.md).

A tabular student (one free softmax per state of a prefix-tree machine) is trained by the expected
gradient of a library's own loss: exact expectations over the contexts the run's sampling visits and
over the tokens it samples there (student tokens: the student's current conditional, detached, as a
sampler is), with K teachers served from aggregation's FiniteStateTeachers tables. The fixed point is
solved to machine precision (scipy's hybrid root finder on the expected gradient, one logit per state
pinned at 0) and compared with the predicted target's conditionals.
"""

import ast
import dataclasses
import functools
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import scipy.optimize
import torch
import torch.nn.functional as F

from aggregation import FiniteStateTeachers, examples
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


class Tabular:
    """The machine's tables as torch tensors and the run's visitation weights per state."""

    def __init__(self, m, weights):
        self.m = m
        self.lp = torch.tensor(m.log_probs)                         # (K, S, n)
        self.w = torch.tensor(weights, dtype=torch.float64)
        self.depth, self.parent = runs.prefix_depths(m)
        self.log_prefix = torch.from_numpy(runs._log_prefix(m))     # (K, S) ln p_k(u)
        self.token_in = [int(np.nonzero(m.next_state[p] == s)[0][0]) if p >= 0 else -1
                         for s, p in enumerate(self.parent)]

    def student_prefix(self, log_q):
        """(S,) q(u) of the student's current conditionals, detached."""
        out = torch.ones(len(self.depth), dtype=torch.float64)
        for s in np.argsort(self.depth, kind="stable"):
            p = self.parent[s]
            if p >= 0:
                out[s] = out[p] * log_q[p, self.token_in[s]].detach().exp()
        return out

    def context_weights(self, log_q, samples, teachers, lmbda=0.0):
        """(S, K) the probability that a visit of state u scores teacher k, up to a per-state factor:
        pooled or routed on samples independent of k: w_k; routed on the routed teacher's traces:
        w_k p_k(u); a share lmbda of the student's rollouts mixed in (TRL): w_k (lmbda q(u) + (1 - lmbda) p_k(u))."""
        S = len(self.depth)
        if teachers == "pooled" or samples in ("student", "dataset"):
            c = self.w.expand(S, -1)
        else:
            teacher = self.w[:, None] * self.log_prefix.exp()              # (K, S)
            c = (lmbda * self.student_prefix(log_q)[None] * self.w[:, None] + (1 - lmbda) * teacher).T
        return c / c.sum(1, keepdim=True)


def solve(expected_loss, S, n=N):
    """The student's conditionals (S, n) where the expected gradient of ``expected_loss(theta)`` (theta
    (S, n) logits; samplers inside detached) vanishes."""
    def theta_of(x):
        theta = torch.zeros(S, n, dtype=torch.float64)
        theta[:, :-1] = torch.from_numpy(x.reshape(S, n - 1))
        return theta.requires_grad_()

    def gradient(x):
        theta = theta_of(x)
        g, = torch.autograd.grad(expected_loss(theta), theta)
        return g[:, :-1].reshape(-1).numpy()
    x = np.zeros(S * (n - 1))
    for _ in range(50):                             # a few plain steps first, then the root finder
        x = x - 2.0 * gradient(x)
    sol = scipy.optimize.root(gradient, x, method="hybr", tol=1e-15)
    return torch.log_softmax(theta_of(sol.x).detach(), -1).numpy(), float(np.abs(gradient(sol.x)).max())


def tv(log_a, log_b):
    """Per-state total variation (S,)."""
    return 0.5 * np.abs(np.exp(log_a) - np.exp(log_b)).sum(-1)


@functools.lru_cache(maxsize=None)
def candidates(K, weights, seed=1, temperature=1.0):
    """Every named target's conditionals on the machine: A, l, J_0.5 with prior / posterior weights, g."""
    m, out = machine(K, seed, temperature), {}
    for target in ("A", "l", "J"):
        for kind in ("prior", "posterior"):
            p = runs.Prediction(target, weights=kind, beta=0.5)
            out[p.label] = runs.target_log_probs(p, m, weights)
    out["g"] = runs.target_log_probs(runs.Prediction("g", level="sequence"), m, weights)
    return out


# ------------------------------------------------------------------------------------------------
# each library's own loss, in expectation over the run's sampling, on the tabular student
# ------------------------------------------------------------------------------------------------
def _full_logit_loss(rows_of, tab, samples, teachers, lmbda=0.0):
    """E[loss] for a per-context loss on the full distributions: rows_of(theta, teacher_lp (S, n)) -> (S,)."""
    def loss(theta):
        c = tab.context_weights(torch.log_softmax(theta, -1), samples, teachers, lmbda)
        return sum((c[:, k] * rows_of(theta, tab.lp[k])).sum() for k in range(tab.lp.shape[0]))
    return loss


def _token_loss(per_token, tab, samples, teachers):
    """E[loss] for a sampled-token loss: per_token(log_q (S, n), teacher_lp (S, n)) -> (S, n), the loss of
    every token at every state, averaged over the sampler (the student's detached conditional, or the
    routed teacher's) and the teachers."""
    def loss(theta):
        lq = torch.log_softmax(theta, -1)
        c = tab.context_weights(lq, samples, teachers)
        total = 0.0
        for k in range(tab.lp.shape[0]):
            sampler = lq.detach().exp() if samples == "student" else tab.lp[k].exp()
            total = total + (c[:, k, None] * sampler * per_token(lq, tab.lp[k])).sum()
        return total
    return loss


DERIVED_LOSSES = {}      # run type -> loss builder, filled by tests/test_run_targets_derived.py


def expected_loss(run, tab):
    """The run's expected loss on the tabular student, from the library's own function."""
    if isinstance(run, runs.TRLRun):
        jsd = library_function("trl", "generalized_jsd_loss", cls="GKDTrainer")
        lmbda = run.lmbda if run.samples.startswith("mixed") else 0.0
        samples = "teacher" if run.samples.endswith("teacher") else run.samples.replace("mixed:", "")
        return _full_logit_loss(lambda theta, t: jsd(theta[None], t[None], beta=run.beta, temperature=run.temperature,
                                                     reduction="none").sum(-1)[0], tab, samples, run.teachers, lmbda)
    if isinstance(run, runs.LigerRun):
        fn = library_function("liger", "distillation_loss_fn", cls="LigerFusedLinearJSDFunction")
        return _full_logit_loss(lambda theta, t: torch.stack([fn(theta[i:i + 1], t[i:i + 1], beta=run.beta)
                                                              for i in range(theta.shape[0])]),
                                tab, run.samples, run.teachers)
    if isinstance(run, runs.TorchRLRun):
        k3 = library_function("torchrl", "k3_kl_token_estimate")
        if run.kl_direction == "reverse":
            return _token_loss(lambda lq, lp: k3(lp, lq), tab, "student", "routed")
        return _token_loss(lambda lq, lp: k3(lq, lp), tab, "teacher", "routed")
    if isinstance(run, runs.VerlRun):
        if run.loss_mode == "forward_kl_topk":
            kl_divergence = library_function("verl-topk", "kl_divergence")

            def rows(theta, t):                     # compute_forward_kl_topk: gather, partial KL, clamp_min(0)
                ids = torch.topk(t, run.topk, dim=-1).indices
                return kl_divergence(log_q=torch.log_softmax(theta, -1).gather(-1, ids),
                                     log_p=t.gather(-1, ids)).clamp_min(0.0)
            return _full_logit_loss(rows, tab, "student", "routed")
        kl_penalty = library_function("verl", "kl_penalty")
        kl_penalty.__globals__["kl_penalty_forward"] = library_function("verl", "kl_penalty_forward")
        if run.use_policy_gradient:               # advantages = -loss (detached); PPO's surrogate at ratio 1
            return _token_loss(lambda lq, lp: kl_penalty(lq, lp, run.loss_mode).detach() * lq, tab, "student", "routed")
        return _token_loss(lambda lq, lp: kl_penalty(lq, lp, run.loss_mode), tab, "student", "routed")
    if isinstance(run, runs.OwnRun):
        return _own_loss(run, tab)
    if type(run) in DERIVED_LOSSES:
        return DERIVED_LOSSES[type(run)](run, tab)
    raise ValueError(f"no verification for {run!r}")


def _own_loss(run, tab):
    from llm_bridge import losses
    K, S, n = tab.lp.shape
    if run.loss in ("forward_kl", "reverse_kl", "generalized_jsd"):
        fn = getattr(losses, run.loss)
        kw = {"beta": run.beta} if run.loss == "generalized_jsd" else {}

        def loss(theta):
            c = tab.context_weights(torch.log_softmax(theta, -1), run.samples, run.teachers)
            value, _ = fn(theta[:, None], tab.lp[:, :, None], c, reduction="sum", metrics=False, **kw)
            return value
        return loss
    if run.loss == "kl_estimator_loss":
        states = torch.arange(S).repeat_interleave(n)
        tokens = torch.arange(n).repeat(S)[:, None]

        def loss(theta):
            lq = torch.log_softmax(theta, -1)
            c = tab.context_weights(lq, run.samples, run.teachers)
            teacher_lp = tab.lp[:, states, tokens[:, 0]][:, :, None]
            if run.teachers == "routed":
                routes = [(torch.eye(K, dtype=torch.float64)[k].expand(S * n, K), c[states, k], k) for k in range(K)]
            else:
                routes = [(c[states], torch.ones(S * n, dtype=torch.float64), None)]
            total = 0.0
            for w, share, k in routes:
                value, _ = losses.kl_estimator_loss(theta[states][:, None], tokens, teacher_lp, w, estimator=run.estimator,
                                                    mode=run.mode, pool=run.pool, direction=run.direction,
                                                    reduction="none")
                if run.samples == "student":
                    sampler = lq.detach().exp()[states, tokens[:, 0]]
                elif k is not None:
                    sampler = tab.lp[k, states, tokens[:, 0]].exp()
                else:                             # pooled teachers' traces: the mixture at each state
                    sampler = (c[states].T * tab.lp[:, states, tokens[:, 0]].exp()).sum(0)
                total = total + (share * sampler * value[:, 0]).sum()
            return total
        return loss
    # rkl_policy_gradient: every response of the tree, weighted by the student's (detached) probability
    paths = torch.cartesian_prod(*[torch.arange(n)] * DEPTH)
    path_states = torch.zeros_like(paths)
    for h in range(1, DEPTH):
        path_states[:, h] = torch.tensor(tab.m.next_state)[path_states[:, h - 1], paths[:, h - 1]]

    def loss(theta):
        lq = torch.log_softmax(theta, -1)
        prob = lq.detach()[path_states, paths].sum(1).exp()
        teacher_lp = tab.lp[:, path_states, paths]
        value, _ = losses.rkl_policy_gradient(theta[path_states], paths, teacher_lp, tab.w, gamma=float(run.gamma),
                                              baseline=None, reduction="none")
        return (prob[:, None] * value).sum()
    return loss


def verify(run, K, seed=1):
    """(the student's fixed point (S, n), the largest expected-gradient entry there, the candidates)."""
    weights = tuple(run.weights)
    m = machine(K, seed)
    tab = Tabular(m, weights)
    log_q, residual = solve(expected_loss(run, tab), m.S)
    return log_q, residual, m, tab


# ------------------------------------------------------------------------------------------------
# the generated table (docs/run_targets.md): python tests/run_targets_harness.py rewrites it
# ------------------------------------------------------------------------------------------------
TABLE = Path(__file__).resolve().parents[1] / "docs" / "run_targets.md"
THEORY = {"A": "T1", "l": "T2", "J": "JSD_beta convex in q (T1 at beta = 0, T2 at 1)", "g": "theory section 2, T8",
          "select": "one teacher (Gibbs: the data's lowest cross-entropy)", "none": "theory section 4", "diverges": "theory section 4"}
LIBRARY_OF = {"TRLRun": "trl", "LigerRun": "liger", "VerlRun": "verl", "TorchRLRun": "torchrl"}


def verified_cell(run):
    """How a row is verified: by minimising the library's own loss (tests/test_run_targets.py), and for
    the runs of tests/test_checkpoint_audit_targets.py by the checkpoint audit of tiny Qwen2 students."""
    cell = _verified_cell(run)
    from test_checkpoint_audit_targets import LIBRARY_CASES, OWN_CASES, SEEDS
    if runs.describe(run) in {runs.describe(case) for case, _ in OWN_CASES + LIBRARY_CASES}:
        cell += f"; a tiny Qwen2 student ends closest to it ({len(SEEDS)} seeds, checkpoint audit)"
    return cell


def _verified_cell(run):
    kind = type(run).__name__
    if kind in ("NeMoRLRun", "TinkerRun"):
        repository, _, commit = runs.predict_target(run).source
        return f"derived from source ({repository}@{commit[:12]}; K = 2, 3)"
    if kind == "OwnRun":
        return "verified against this project's losses (K = 2, 3)"
    package = "verl-topk" if getattr(run, "loss_mode", "") == "forward_kl_topk" else LIBRARY_OF[kind]
    if getattr(run, "trainer", "") == "DistillationTrainer":
        return f"verified against {VERSIONS[package]}'s GKD generalized_jsd_loss (K = 2, 3); its chunked kernel read"
    return f"verified against {VERSIONS[package]} (K = 2, 3)"


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
        rows.append([runs.describe(run), samples.replace("mixed:", "student + "), label, p.level, theory,
                     verified_cell(run)])
    return rows


def render_table(cases):
    head = ("| run (library, flags) | samples | target | level | theory | verified how |\n"
            "|---|---|---|---|---|---|\n")
    body = "".join("| " + " | ".join(row) + " |\n" for row in table_rows(cases))
    return TABLE_INTRO + head + body + TABLE_OUTRO


TABLE_INTRO = """# What a distillation run converges to

Generated by `python tests/run_targets_harness.py` from `llm_bridge.runs.predict_target` and the
verification cases of `tests/test_run_targets.py` (a test fails if this file and the code disagree).
Each row was verified by minimising the library's *own* loss function (from its released wheel, `make
oracle`) on a tabular student — one free softmax per state of a depth-3 prefix tree over 3 tokens —
with exact expectations over K = 2 and K = 3 random `TabularLM`-style teachers (weights (0.3, 0.7) and
(0.2, 0.3, 0.5)) and over the sampling the run implies; the fixed point agrees with the prediction to
<= 1e-6 total variation at every state and is > 1e-3 from every other named target. For "none" the
expected gradient either vanishes everywhere or has none of the named targets as a fixed point; for
"diverges" it is minus the forward-KL gradient to A.

Targets: **A** the arithmetic pool sum_k c_k p_k (forward KL, T1); **l** the local geometric pool
∝ prod_k p_k^{c_k} (per-token reverse KL, T2); **J_beta** the generalised-JSD barycentre (between A
and l, no closed form; one teacher: the teacher); **g** the conditionals of the sequence-level
geometric pool G_seq, which carry T8's prefix bias. Weights c_k = w_k, or *posterior* c_k(u) ∝ w_k
p_k(u) when each sample is routed to one teacher and trained on that teacher's own traces (for A: the
sequence-level mixture's conditionals), or *visitation* weights ∝ w_k (lmbda q(u) + (1 - lmbda)
p_k(u)) when the student's rollouts are mixed in (TRL's lmbda with seq_kd). Samples: the student's
rollouts, the (routed) teacher's traces, or a fixed data set's responses. Several teachers with TRL,
verl and torchrl are routed (one teacher per sample: a teacher id, verl's `teacher_models.*.key`);
"teachers=pooled" is a wrapper summing w_k times the loss against each teacher.

"""

TABLE_OUTRO = """
`predict_target(run).reason` gives the paragraph behind each row and `.source` the file it was read
from (TRL 1.16.0 `trl/experimental/gkd/gkd_trainer.py`, `trl/trainer/distillation_trainer.py`; verl
0.9.1 `verl/trainer/distillation/losses.py`, `verl/trainer/ppo/core_algos.py`; torchrl 0.14.1
`torchrl/objectives/llm/distillation.py`; Liger-Kernel 0.8.5 `liger_kernel/chunked_loss/jsd_loss.py`).
NeMo-RL and tinker-cookbook cannot be installed here: their losses are re-implemented from the source
at the cited commit in `tests/test_run_targets_derived.py` (NeMo-RL
`nemo_rl/algorithms/loss/loss_functions.py`; tinker-cookbook
`tinker_cookbook/distillation/train_on_policy.py`) and verified the same way. The select_teacher row's
data set is every response of the tree, equally likely.
"at temperature tau" (TRL's `temperature`, applied to both sides): the student's softmax(logits / tau)
reaches the pool of the teachers' softmax(logits / tau); its own conditionals are that pool's tau-th
power, renormalised. Notes: verl's policy-gradient rows use PPO's surrogate at ratio 1 (the first on-policy step) with the
negative loss as the per-token advantage, as `distillation_loss` passes it; TRL's DistillationTrainer
row runs GKD's `generalized_jsd_loss`, the same divergence its chunked kernel computes (read, not run:
the kernel module imports the trainer's utilities).
"a tiny Qwen2 student ends closest to it": `tests/test_checkpoint_audit_targets.py` distils a tiny Qwen2
(built from a config) from two `TabularLM` teachers with that run's loss — this project's, or the
library's own function from its wheel — from each seed, and `target_distances`, exact on the machine,
names the row's target the closest of A, l, the routed mixture, g and each teacher, the 95% t interval
of its margin over the audited responses above 0.
"""


def table_cases():
    import dataclasses
    from test_run_targets import LIBRARY_CASES, OWN_CASES, WEIGHTS
    from test_run_targets_derived import DERIVED_CASES
    one = lambda run: getattr(run, "loss_fn", "") == "DistillationLossFn"      # noqa: E731 (one teacher)
    return [dataclasses.replace(run, weights=WEIGHTS[1 if one(run) else 2]) for run in LIBRARY_CASES + DERIVED_CASES
            + OWN_CASES]


if __name__ == "__main__":
    TABLE.write_text(render_table(table_cases()))
    print(f"wrote {TABLE}")
