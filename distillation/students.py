"""The students: many runs trained at once, each an independent policy (theory section 5).

Every student class holds R runs' parameters stacked along a first run axis and shares one interface:

    tables()        the runs' log-probs with gradient: (R, H, S, n) per step, or (R, S, n) for a
                    stationary student (one policy at every step)
    step(loss, lr)  one update from the sum of the runs' losses: each run's gradient clipped to its own
                    norm (:func:`clip_per_run`), then :func:`adam_step` with a learning rate per run
    reset()         a fresh optimiser state (each training stage starts its own Adam)
    log_probs()     the tables as float64 NumPy, for the exact outcomes
    take(rows)      a copy of some runs (a phase-2 sweep starting from phase-1 students)
    seeds           the seed of each run (the seeded students)

The students:

    TabularStudents     a free logit table theta (R, H, S, n): every (step, state) its own softmax
    LogLinearStudents   W (R, n, d) on a task's features, logits(s) = W phi(s) (stationary)
    FeatureStudents     a tiny Qwen2 per run reading phi(s) through a linear input layer (stationary)
    TokenStudents       a tiny Qwen2 per run reading the token prefix after a first token ``bos``; on a
                        prefix tree every state is reached by one prefix, so its table is one forward
                        pass over the tree's responses

The neural students run together under ``torch.func.vmap`` over their stacked parameters
(``benchmarks/bench_spectrum.py`` measures this against a loop over the runs). The optimiser is a
functional Adam rather than ``torch.optim.Adam`` because a sweep gives each run of one stacked tensor
its own learning rate and schedule, which torch's Adam (one rate per parameter group) cannot.
"""

import copy
import math

import numpy as np
import torch

from llm_bridge.tabular import tree_responses


BETAS, EPS = (0.9, 0.999), 1e-8


def round_bf16(x):
    """x rounded to bfloat16 and back (round to nearest even)."""
    return x.to(torch.bfloat16).to(x.dtype)


def _per_run(x, like):
    """x (R,) viewed to broadcast against ``like`` (R, ...)."""
    return x.view(-1, *[1] * (like.ndim - 1))


def adam_step(W, grad, m, v, step, lr):
    """One elementwise Adam step (betas BETAS, eps EPS) with a per-run learning rate lr (R,), in place on
    the moments m, v; returns the new W. Elementwise, so the runs stay independent."""
    m.mul_(BETAS[0]).add_(grad, alpha=1 - BETAS[0])
    v.mul_(BETAS[1]).addcmul_(grad, grad, value=1 - BETAS[1])
    mhat = m / (1 - BETAS[0] ** step)
    vhat = v / (1 - BETAS[1] ** step)
    return W - _per_run(lr, W) * mhat / (vhat.sqrt() + EPS)


def clip_scale(norms, clip_norm):
    """The factor min(1, clip_norm / |g|) that clips each run's gradient (norms (R,)) to ``clip_norm``."""
    return (clip_norm / norms.clamp(min=1e-12)).clamp(max=1.0)


def clip_per_run(grads, clip_norm, active=None):
    """Each run's gradient clipped to global norm ``clip_norm``: grads a list of (R, ...) tensors (one per
    parameter, run axis first), NaN entries set to 0, each run's entries scaled by min(1, clip_norm / |g_r|)
    where ``active`` (R,) bool (default: every run). Returns the scaled list."""
    grads = [g.nan_to_num(0.0, 0.0, 0.0) for g in grads]
    norms = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in grads))
    scale = clip_scale(norms, clip_norm)
    if active is not None:
        scale = torch.where(active, scale, torch.ones_like(scale))
    return [g * _per_run(scale, g) for g in grads]


def loglinear_tables(W, features):
    """log-probs (R, S, n) of runs W (R, n, d) at the states of one task (features (S, d))."""
    return torch.log_softmax(torch.einsum("rnd,sd->rsn", W, torch.as_tensor(features, dtype=W.dtype)), -1)


class Students:
    """R runs with parameters ``params`` {name: (R, ...) tensor}, the names in ``trained`` updated;
    ``lr`` a float or (R,); ``clip`` (R,) bool: the runs whose gradient is clipped to ``clip_norm``
    (default all); ``bf16`` (R,) bool: the runs whose parameters are stored in bfloat16 (rounded after
    every step; set by :meth:`store_bf16`); ``cast`` (R,) bool: the runs trained in mixed precision, float32
    master weights read through their bfloat16 copy (set by :meth:`cast_bf16`). A subclass defines
    ``forward(params)``."""

    def __init__(self, params, trained=None, lr=1e-3, clip_norm=1.0):
        self.params = {k: v.detach().clone() for k, v in params.items()}
        self.trained = list(self.params) if trained is None else [k for k in self.params if k in trained]
        self.lr, self.clip_norm, self.clip, self.bf16, self.cast = lr, clip_norm, None, None, None
        self.reset()

    @property
    def runs(self):
        return next(iter(self.params.values())).shape[0]

    def reset(self):
        """A fresh optimiser state."""
        self.m = {k: torch.zeros_like(self.params[k]) for k in self.trained}
        self.v = {k: torch.zeros_like(self.params[k]) for k in self.trained}
        self.t = 0

    def store_bf16(self, runs):
        """Keep the parameters of ``runs`` (R,) bool in bfloat16 from now on (rounded now and after
        every step; the update itself is computed in float32)."""
        self.bf16 = torch.as_tensor(runs, dtype=torch.bool)
        self.params = {k: self._round(p) for k, p in self.params.items()}

    def cast_bf16(self, runs):
        """Train ``runs`` (R,) bool in mixed precision from now on: float32 master weights, updated in
        float32, whose bfloat16 copy is what the forward pass reads, in training and in evaluation (the
        gradient passes straight through the rounding to the master)."""
        self.cast = torch.as_tensor(runs, dtype=torch.bool)

    def _round(self, p):
        return p if self.bf16 is None else torch.where(_per_run(self.bf16, p), round_bf16(p), p)

    def _read(self, params):
        """What the forward pass reads: the bfloat16 copy of the runs in mixed precision (straight-through)."""
        if self.cast is None:
            return params
        return {k: torch.where(_per_run(self.cast, p), p + (round_bf16(p) - p).detach(), p) for k, p in params.items()}

    def forward(self, params):
        """The runs' log-probability tables from ``params`` {name: (R, ...) tensor}: (R, H, S, n), or
        (R, S, n) for a stationary student. Each subclass defines it."""
        raise NotImplementedError

    def tables(self):
        """The runs' log-probability tables, with gradients enabled for the trained parameters: build a
        loss from them, then call :meth:`step`."""
        self._leaves = {k: v.detach().requires_grad_(k in self.trained) for k, v in self.params.items()}
        return self.forward(self._read(self._leaves))

    def step(self, loss, lr=None):
        """One update from ``loss`` (the sum of the runs' losses, built from the last :meth:`tables`);
        ``lr`` (R,) or a float overrides the students' learning rate for this step."""
        grads = torch.autograd.grad(loss, [self._leaves[k] for k in self.trained], allow_unused=True)
        grads = [torch.zeros_like(self.params[k]) if g is None else g for k, g in zip(self.trained, grads)]
        grads = clip_per_run(grads, self.clip_norm, active=self.clip)
        self.t += 1
        rate = torch.as_tensor(self.lr if lr is None else lr, dtype=torch.float32).expand(self.runs)
        for k, g in zip(self.trained, grads):
            self.params[k] = self._round(adam_step(self.params[k], g, self.m[k], self.v[k], self.t, rate))

    def log_probs(self):
        """The tables as float64 NumPy, without gradients."""
        with torch.no_grad():
            return self.forward(self._read({k: v.double() for k, v in self.params.items()})).numpy()

    def flat(self):
        """Every parameter of each run as one row (R, P) (for update sparsity)."""
        return torch.cat([p.detach().flatten(1) for p in self.params.values()], dim=1)

    def take(self, rows):
        """A copy of the runs ``rows`` (a list of run indices), with a fresh optimiser state."""
        other = copy.copy(self)
        idx = torch.as_tensor(rows, dtype=torch.long)
        other.params = {k: v[idx].clone() for k, v in self.params.items()}
        if getattr(self, "seeds", None) is not None:
            other.seeds = [self.seeds[i] for i in rows]
        if hasattr(self, "buffers"):
            other.buffers = {k: v[idx] for k, v in self.buffers.items()}
        for name in ("clip", "bf16", "cast"):
            if getattr(self, name) is not None:
                setattr(other, name, getattr(self, name)[idx])
        if not isinstance(self.lr, (int, float)):
            other.lr = torch.as_tensor(self.lr)[idx]
        other.reset()
        return other


class TabularStudents(Students):
    """R free tables theta (R, H, S, n) ~ N(0, 0.1^2) drawn from ``gen``, one softmax per (step, state)."""

    def __init__(self, task, runs, gen, lr=0.05, clip_norm=1.0):
        t = task.teachers
        theta = torch.zeros(runs, task.horizon, t.S, t.n)
        theta.normal_(0.0, 0.1, generator=gen)
        super().__init__({"theta": theta}, lr=lr, clip_norm=clip_norm)

    def forward(self, params):
        return torch.log_softmax(params["theta"], -1)

    def max_logit(self):
        """(R,) each run's largest |logit - its row's mean| (a run driven to a vertex has a large one)."""
        theta = self.params["theta"]
        return (theta - theta.mean(-1, keepdim=True)).abs().amax(dim=(1, 2, 3)).numpy()


class LogLinearStudents(Students):
    """R log-linear students W (R, n, d) on ``features`` (S, d) over n actions, one small random W per
    seed (generator ``init + seed``); stationary. ``features`` may be changed (a task pair's other task)."""

    def __init__(self, features, n, seeds, lr=0.03, clip_norm=1.0, scale=0.1, init=9000):
        self.features, self.seeds = torch.as_tensor(features, dtype=torch.float32), list(seeds)
        d = self.features.shape[1]
        W = torch.stack([scale * torch.randn(n, d, generator=torch.Generator().manual_seed(init + s)) for s in seeds])
        super().__init__({"W": W}, lr=lr, clip_norm=clip_norm)

    def forward(self, params):
        return loglinear_tables(params["W"], self.features)


class _Stacked(Students):
    """Students that are R copies of one torch module with stacked parameters, evaluated by vmap."""

    def __init__(self, models, lr, clip_norm, frozen=()):
        from torch.func import stack_module_state
        params, self.buffers = stack_module_state(models)
        self.base = copy.deepcopy(models[0]).to("meta")
        super().__init__(params, trained=[k for k in params if not (frozen and k.startswith(frozen))], lr=lr,
                         clip_norm=clip_norm)

    def _vmap(self, params, *args, **kwargs):
        from torch.func import functional_call, vmap

        def one(p, b):
            out = functional_call(self.base, (p, b), args, kwargs)
            return out if torch.is_tensor(out) else out.logits
        return vmap(one)(params, self.buffers)

    def log_probs(self):
        """The tables as float64 NumPy: the network in float32, the final log-softmax in float64."""
        with torch.no_grad():
            return self.forward(self._read(self.params), out=torch.float64).numpy()


class FeaturePolicy(torch.nn.Module):
    """A tiny Qwen2 (from a config) as a stationary policy: it reads a state's features through a linear
    input layer as a one-position sequence and returns the logits of the n actions."""

    def __init__(self, d, n, seed, hidden=32):
        super().__init__()
        from llm_bridge.models import tiny_model
        torch.manual_seed(9000 + seed)
        self.embed = torch.nn.Linear(d, hidden)
        self.lm = tiny_model("qwen2", vocab_size=n, hidden_size=hidden, seed=9000 + seed, attention="eager")

    def forward(self, features):
        return self.lm(inputs_embeds=self.embed(features)[:, None, :]).logits[:, 0, :]


class FeatureStudents(_Stacked):
    """R :class:`FeaturePolicy` students on ``features`` (S, d), one per seed; stationary. The token
    embeddings are never read (the inputs are embedded features) and are not trained."""

    def __init__(self, features, n, seeds, lr=3e-3, clip_norm=1.0):
        self.features, self.seeds = torch.as_tensor(features, dtype=torch.float32), list(seeds)
        super().__init__([FeaturePolicy(self.features.shape[1], n, s) for s in seeds], lr, clip_norm,
                         frozen=("lm.model.embed_tokens",))

    def forward(self, params, out=torch.float32):
        return torch.log_softmax(self._vmap(params, self.features).to(out), -1)


class TokenStudents(_Stacked):
    """R tiny Qwen2 causal LMs (``llm_bridge.models.tiny_model``, seeded) over ``vocab`` tokens reading
    the token prefix after a first token ``bos``, as tables (R, H, S, n) on the prefix tree ``task``:
    each state is reached by one prefix, so one forward pass over the tree's responses gives the
    conditionals at every state ((step, state) pairs no prefix reaches: uniform). ``task`` and ``bos``
    may be changed (a task pair's other task)."""

    def __init__(self, task, seeds, vocab, bos, lr=3e-3, clip_norm=1.0):
        from llm_bridge.models import tiny_model
        self.task, self.bos, self.seeds = task, bos, list(seeds)
        super().__init__([tiny_model("qwen2", vocab_size=vocab, seed=s, attention="eager") for s in seeds], lr,
                         clip_norm)
        self._tree = None

    def _tree_index(self):
        """(inputs (N, H), the reached (step, state) pairs hs, ss and the first response reaching each),
        for the current task and first token; computed once per (task, bos), not at every step."""
        if self._tree is None or self._tree[0] is not self.task or self._tree[1] != self.bos:
            inputs, _, states = tree_responses(self.task.teachers, self.task.horizon)
            inputs[:, 0] = self.bos
            first = {}                                  # (step, state) -> the first response reaching it
            for i in range(inputs.shape[0]):
                for h in range(self.task.horizon):
                    first.setdefault((h, int(states[i, h])), i)
            (hs, ss), rows = zip(*first.keys()), list(first.values())
            self._tree = (self.task, self.bos, inputs, torch.tensor(hs), torch.tensor(ss), rows)
        return self._tree[2:]

    def forward(self, params, out=torch.float32):
        t, H = self.task.teachers, self.task.horizon
        inputs, hs, ss, rows = self._tree_index()
        logits = self._vmap(params, inputs, use_cache=False)                                     # (R, N, H, vocab)
        logp = torch.log_softmax(logits[:, rows, hs, :t.n].to(out), -1)                        # (R, reached, n)
        table = torch.full((logits.shape[0], H, t.S, t.n), -math.log(t.n), dtype=logp.dtype)
        return _scatter(table, hs, ss, logp)


def _scatter(table, hs, ss, values):
    """table (R, H, S, n) with the entries (:, hs[j], ss[j]) replaced by values[:, j] (keeps the graph)."""
    flat = table.flatten(1, 2)
    idx = hs * table.shape[2] + ss
    return flat.index_copy(1, idx, values).view(table.shape)


def at_step(table, h):
    """A student's table (R, S, n) at step h: a stationary table itself, a per-step one's slice h."""
    return table if table.ndim == 3 else table[:, h]


def at_positions(table, row_run, states):
    """The rows of a student's table at a batch's positions: table (R, H, S, n) or stationary (R, S, n),
    row_run (N,) the run of each sequence, states (N, H). Returns (N, H, n)."""
    if table.ndim == 3:
        return table[row_run[:, None], states]
    return table[row_run[:, None], torch.arange(states.shape[1]), states]


def goal_students(kind, task, seeds, lr):
    """The students of a goal task (``tasks.GoalTask``): 'loglinear' or 'neural' (:class:`FeatureStudents`)."""
    if kind not in GOAL_STUDENTS:
        raise ValueError(f"student = {kind!r} must be one of {sorted(GOAL_STUDENTS)}")
    return GOAL_STUDENTS[kind](task.features, task.n, seeds, lr=lr)


GOAL_STUDENTS = {"loglinear": LogLinearStudents, "neural": FeatureStudents}
