"""A torch module serving one teacher of a FiniteStateTeachers table as a causal LM (SPEC 6).

With K of these as the bridge's teachers, every exact quantity of the bridge can be checked against
aggregation's dynamic programme. Token ids 0..n-1 are the machine's tokens; id n is a BOS token
that starts every sequence (the start state), and ``pad`` extra logit rows imitate a padded
vocabulary. After the response ends (``next_state = -1``) the model serves uniform logits.

The "KV cache" is the current state of each sequence, a LongTensor ``(B,)``; like a transformers
cache it is returned (as ``cache`` and ``past_key_values``) when ``use_cache=True`` and is continued
by passing it back with the new tokens only.
"""

from types import SimpleNamespace

import numpy as np
import torch

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
