"""A torch module serving one teacher of a FiniteStateTeachers table as a causal LM (theory section 6).

With K of these as the bridge's teachers, every exact quantity of the bridge can be checked against
aggregation's dynamic programme. Token ids 0..n-1 are the machine's tokens; id n is a BOS token
that starts every sequence (the start state), and ``pad`` extra logit rows imitate a padded
vocabulary. After the response ends (``next_state = -1``) the model serves uniform logits.

The "KV cache" is the current state of each sequence, a LongTensor ``(B,)``; like a transformers
cache it is returned (as ``cache`` and ``past_key_values``) when ``use_cache=True`` and is continued
by passing it back with the new tokens only.
"""

import math
from types import SimpleNamespace

import numpy as np
import torch

import aggregation as ag
from aggregation.sequence import TARGETS, target_log_probs  # noqa: F401  the targets are math; kept importable here

_NEG = -1e30   # finite stand-in for -inf, so that logits stay finite as real models' do


class TabularLM(torch.nn.Module):
    """Causal LM over a finite-state table: ``logits[b, t] = log p_k(. | state after ids[b, :t+1])``.

    Parameters
    ----------
    teachers : aggregation.FiniteStateTeachers; k : which teacher; pad : padded logit rows.
    """

    def __init__(self, teachers, k, pad=0):
        super().__init__()
        self.n = teachers.n
        self.bos_token_id = teachers.n
        self.pad = int(pad)
        self.start = teachers.start
        # one extra row (index S) is the "ended / no state" row with uniform logits
        ns = np.vstack([np.array(teachers.next_state), np.full((1, self.n), -1)])
        ns[ns < 0] = teachers.S
        self.register_buffer("next_state", torch.from_numpy(ns))
        lp = np.where(np.isneginf(teachers.log_probs[k]), _NEG, teachers.log_probs[k])
        table = np.full((teachers.S + 1, self.vocab_size), _NEG)
        table[:-1, :self.n] = lp
        table[-1, :self.n] = 0.0
        self.register_buffer("table", torch.from_numpy(table))
        self.ended = teachers.S

    @property
    def vocab_size(self):
        """Logit rows: the n tokens, BOS, then padding."""
        return self.n + 1 + self.pad

    def forward(self, input_ids, cache=None, past_key_values=None, use_cache=False, **_):
        """Logits (B, T, vocab_size) of ``input_ids`` (B, T): ids in [0, n] (the tokens and BOS); an id
        outside is a ValueError naming its position (a real model's embedding lookup would fail)."""
        B, T = input_ids.shape
        bad = (input_ids < 0) | (input_ids > self.bos_token_id)
        if bool(bad.any()):
            b, t = (int(i) for i in torch.nonzero(bad)[0])
            raise ValueError(f"input_ids[{b}, {t}] = {int(input_ids[b, t])} is not a token of this machine "
                             f"(ids 0..{self.n - 1}, BOS = {self.bos_token_id})")
        past_key_values = cache if cache is not None else past_key_values
        if past_key_values is None:
            state = torch.full((B,), self.ended, dtype=torch.long, device=input_ids.device)
        else:
            state = past_key_values.to(input_ids.device)
        states = torch.empty((B, T), dtype=torch.long, device=input_ids.device)
        for t in range(T):
            a = input_ids[:, t]
            inside = (a < self.n) & (state != self.ended)
            step = self.next_state[state, a.clamp(0, self.n - 1)]
            state = torch.where(a == self.bos_token_id, torch.full_like(state, self.start),
                                torch.where(inside, step, torch.full_like(state, self.ended)))
            states[:, t] = state
        state = state if use_cache else None
        return SimpleNamespace(logits=self.table[states], cache=state, past_key_values=state)


# ------------------------------------------------------------------------------------------------
# a student trained on TabularLM teachers, measured exactly on the machine
# ------------------------------------------------------------------------------------------------


def tree_responses(teachers, horizon):
    """Every response of ``horizon`` tokens of a prefix-tree machine (no end tokens before the last), as
    model inputs ``(N, horizon)`` = BOS followed by the first horizon - 1 tokens, the tokens ``(N, horizon)``
    and the state before each token ``(N, horizon)``."""
    n, paths = teachers.n, [[]]
    for _ in range(horizon):
        paths = [p + [a] for p in paths for a in range(n)]
    tokens = np.array(paths, dtype=np.int64)
    states = np.zeros_like(tokens)
    for i, p in enumerate(paths):
        s = teachers.start
        for h, a in enumerate(p):
            if s < 0:
                raise ValueError(f"the machine ends a response before {horizon} tokens: use a prefix tree")
            states[i, h] = s
            s = teachers.next_state[s, a]
    inputs = np.concatenate([np.full((len(paths), 1), n), tokens[:, :-1]], axis=1)
    return torch.from_numpy(inputs), torch.from_numpy(tokens), torch.from_numpy(states)


@torch.no_grad()
def student_kl(model, teachers, weights, horizon, target, direction="forward", vocab_size=None):
    """Exact KL between a causal-LM student (reading BOS + prefix) and a target, on a prefix-tree machine.

    ``direction="forward"``: the mean over the machine's prefixes (each once) of KL(target || q), what a
    forward loss trained on every prefix minimises; ``"reverse"``: the same mean of KL(q || target);
    ``"sequence"``: sum over prefixes of q(prefix) KL(q(.|prefix) || target(.|prefix)), the sequence-
    level KL_seq(q || P) over whole responses (for the geometric target, KL_seq(q || G_seq): what the
    on-policy gamma = 1 policy gradient minimises; it weighs the prefixes the student visits).
    Nats per position (forward, reverse) or per response (sequence).
    """
    if direction not in ("forward", "reverse", "sequence"):
        raise ValueError(f"direction = {direction!r} must be 'forward', 'reverse' or 'sequence'")
    inputs, tokens, states = tree_responses(teachers, horizon)
    n = teachers.n
    log_q = torch.log_softmax(model(input_ids=inputs).logits[..., :vocab_size or n].double(), -1).numpy()[..., :n]
    log_t = target_log_probs(teachers, weights, horizon, target)
    seen, total = set(), 0.0
    for i in range(inputs.shape[0]):
        prefix_log_q = 0.0
        for h in range(horizon):
            key = tuple(tokens[i, :h].tolist())
            if key not in seen:
                seen.add(key)
                lt, lq = log_t[h, states[i, h]], log_q[i, h]
                a, b = (lt, lq) if direction == "forward" else (lq, lt)
                kl = float(np.sum(np.exp(a) * (a - b)))
                total += kl * math.exp(prefix_log_q) if direction == "sequence" else kl
            prefix_log_q += log_q[i, h, tokens[i, h]]
    return total if direction == "sequence" else total / len(seen)


def toy_problem(seed=0, horizon=3, n=3, arch="qwen2"):
    """The distillation problem of the examples and tests: two random teachers on a prefix tree of
    depth ``horizon`` over ``n`` tokens (their pools A, l and g all differ), served as TabularLM, and
    a tiny randomly initialised student over the n tokens plus BOS. Returns (machine, teachers, student)."""
    from aggregation import examples
    from .models import tiny_model
    machine = examples.prefix_tree(2, horizon, n, seed=26, concentration=0.3)
    teachers = [TabularLM(machine, k) for k in range(machine.K)]
    return machine, teachers, tiny_model(arch, vocab_size=n + 1, seed=seed)


@torch.no_grad()
def sample_student(student, n, horizon, batch, generator):
    """``batch`` responses of ``horizon`` tokens from the student over the first n tokens (BOS = n):
    (inputs (batch, horizon) = BOS + all but the last token, tokens (batch, horizon))."""
    ids = torch.full((batch, 1), n, dtype=torch.long)
    for _ in range(horizon):
        probs = torch.softmax(student(input_ids=ids).logits[:, -1, :n].float(), -1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return ids[:, :-1], ids[:, 1:]
