"""The students: many runs trained at once, each an independent policy (SPEC 5).

    LogLinearStudents   W (R, n, d) on a task's features, logits(s) = W phi(s): every run one slice
    NeuralStudents      a tiny Qwen2 per run reading phi(s) through a linear input layer (FeaturePolicy),
                        the runs stacked and evaluated by torch.func.vmap
    student_table       a causal-LM student's conditionals at every state of a prefix tree, as a table

Both student classes share one interface: ``tables()`` (log-probs (R, S, n) with gradient), ``step(loss)``
(one update from the sum of the runs' losses, each run's gradient clipped to its own norm), ``reset()`` (a
fresh optimiser state) and ``log_probs()`` (float64 NumPy for the exact outcomes).
"""

import math

import numpy as np
import torch

from llm_bridge.tabular import tree_responses


BETAS, EPS = (0.9, 0.999), 1e-8


def round_bf16(x):
    """x rounded to bfloat16 and back (round to nearest even)."""
    return x.to(torch.bfloat16).to(x.dtype)


def loglinear_tables(W, features):
    """log-probs (R, S, n) of runs W (R, n, d) at the states of one task (features (S, d))."""
    return torch.log_softmax(torch.einsum("rnd,sd->rsn", W, torch.as_tensor(features, dtype=W.dtype)), -1)


def adam_step(W, grad, m, v, step, lr):
    """One elementwise Adam step with a per-run learning rate lr (R,), in place on m, v; returns the
    new W (float32)."""
    m.mul_(BETAS[0]).add_(grad, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
    mhat = m / (1 - BETAS[0] ** step)
    vhat = v / (1 - BETAS[1] ** step)
    return W - lr.view(-1, *[1] * (W.ndim - 1)) * mhat / (vhat.sqrt() + EPS)


def clip_scale(norms, clip_norm):
    """The factor min(1, clip_norm / |g|) that clips each run's gradient (norms (R,)) to ``clip_norm``."""
    return (clip_norm / norms.clamp(min=1e-12)).clamp(max=1.0)


def clip_per_run(grads, clip_norm, active=None):
    """Each run's gradient clipped to global norm ``clip_norm``: grads a list of (R, ...) tensors (one per
    parameter, run axis first), NaN entries set to 0, each run's entries scaled by min(1, clip_norm / |g_r|)
    where ``active`` (R,) bool (default: every run). Returns the scaled list."""
    grads = [g.nan_to_num(0.0, 0.0, 0.0) for g in grads]
    if len(grads) == 1:
        norms = grads[0].flatten(1).norm(dim=1)
    else:
        norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads))
    scale = clip_scale(norms, clip_norm)
    if active is not None:
        scale = torch.where(active, scale, torch.ones_like(scale))
    return [g * scale.view(-1, *[1] * (g.ndim - 1)) for g in grads]


def student_table(model, task, bos=None):
    """The neural student's conditionals at every state of a prefix-tree task, as a tabular policy
    (H, S, n) log-probs (each state is reached by one prefix); ``bos`` the first input token (default n,
    a token after the task's vocabulary)."""
    t, H = task.teachers, task.horizon
    inputs, tokens, states = tree_responses(t, H)
    if bos is not None:
        inputs[:, 0] = bos
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=inputs).logits[..., :t.n].double(), -1).numpy()
    table = np.full((H, t.S, t.n), -math.log(t.n))          # (step, state) pairs no prefix reaches: uniform
    for i in range(inputs.shape[0]):
        for h in range(H):
            table[h, states[i, h]] = logp[i, h]
    return table


class LogLinearStudents:
    """R log-linear students W (R, n, d) on the task's features, one small random W per seed, trained by
    an elementwise Adam (:func:`adam_step`), the gradient norm clipped per run. ``lr`` may be
    changed between stages: :meth:`reset` (called by distil and reinforce) starts a fresh Adam."""

    def __init__(self, task, seeds, lr=0.03, clip_norm=1.0, scale=0.1):
        d = task.features.shape[1]
        self.features, self.lr, self.clip_norm = task.features, lr, clip_norm
        self.W = torch.stack([scale * torch.randn(task.n, d, generator=torch.Generator().manual_seed(9000 + s))
                              for s in seeds])
        self.reset()

    def reset(self):
        """A fresh optimiser state (each training stage starts its own Adam)."""
        self.m, self.v, self.t = torch.zeros_like(self.W), torch.zeros_like(self.W), 0

    def tables(self):
        """log-probs (R, S, n) with gradient."""
        self._W = self.W.clone().requires_grad_()
        return loglinear_tables(self._W, self.features)

    def step(self, loss):
        """One update from ``loss`` (the sum of the runs' losses, built from the last :meth:`tables`)."""
        (grad,) = clip_per_run(torch.autograd.grad(loss, self._W), self.clip_norm)
        self.t += 1
        self.W = adam_step(self.W, grad, self.m, self.v, self.t, torch.full((self.W.shape[0],), self.lr))

    def log_probs(self):
        """log-probs (R, S, n) as float64 NumPy, for the exact outcomes."""
        with torch.no_grad():
            return loglinear_tables(self.W.double(), self.features).numpy()


class FeaturePolicy(torch.nn.Module):
    """A tiny Qwen2 (from a config) as a stationary policy: it reads a state's features through a linear
    input layer as a one-position sequence and returns log-probs over the n actions."""

    def __init__(self, task, seed, hidden=32):
        super().__init__()
        from llm_bridge.models import tiny_model
        torch.manual_seed(9000 + seed)
        self.embed = torch.nn.Linear(task.features.shape[1], hidden)
        self.lm = tiny_model("qwen2", vocab_size=task.n, hidden_size=hidden, seed=9000 + seed, attention="eager")

    def forward(self, features):
        logits = self.lm(inputs_embeds=self.embed(features)[:, None, :]).logits[:, 0, :]
        return torch.log_softmax(logits.float(), -1)


class NeuralStudents:
    """R :class:`FeaturePolicy` students, one per seed, evaluated together by ``torch.func.vmap`` over
    their stacked parameters; Adam (elementwise, so the runs stay independent) with each run's gradient
    clipped to global norm ``clip_norm``. The same interface as :class:`LogLinearStudents`."""

    def __init__(self, task, seeds, lr=3e-3, clip_norm=1.0):
        import copy
        from torch.func import stack_module_state
        self.features = torch.as_tensor(task.features, dtype=torch.float32)
        self.lr, self.clip_norm = lr, clip_norm
        models = [FeaturePolicy(task, s) for s in seeds]
        params, self.buffers = stack_module_state(models)
        # the token embeddings are never read (the inputs are embedded features): not trained
        self.params = {k: v.detach().requires_grad_(not k.startswith("lm.model.embed_tokens"))
                       for k, v in params.items()}
        self.base = copy.deepcopy(models[0]).to("meta")
        self.reset()

    def reset(self):
        self.opt = torch.optim.Adam([p for p in self.params.values() if p.requires_grad], lr=self.lr)

    def tables(self):
        from torch.func import functional_call, vmap

        def one(params, buffers):
            return functional_call(self.base, (params, buffers), (self.features,))
        return vmap(one)(self.params, self.buffers)

    def step(self, loss):
        trained = [p for p in self.params.values() if p.requires_grad]
        for p, g in zip(trained, clip_per_run(torch.autograd.grad(loss, trained), self.clip_norm)):
            p.grad = g
        self.opt.step()

    def log_probs(self):
        with torch.no_grad():
            return self.tables().double().numpy()


STUDENTS = {"loglinear": LogLinearStudents, "neural": NeuralStudents}
