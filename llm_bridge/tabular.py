"""A torch module serving one teacher of a FiniteStateTeachers table as a causal LM (SPEC 6).

With K of these as the bridge's teachers, every exact quantity of the bridge can be checked against
aggregation's dynamic programme. Token ids 0..n-1 are the machine's tokens; id n is a BOS token
that starts every sequence (the start state), and ``pad`` extra logit rows imitate a padded
vocabulary. After the response ends (``next_state = -1``) the model serves uniform logits.
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
        self.register_buffer("next_state", torch.from_numpy(np.array(teachers.next_state)))
        lp = np.where(np.isneginf(teachers.log_probs[k]), _NEG, teachers.log_probs[k])
        self.register_buffer("table", torch.from_numpy(lp))

    @property
    def vocab_size(self):
        """Logit rows: the n tokens, BOS, then padding."""
        return self.n + 1 + self.pad

    def forward(self, input_ids, use_cache=False, **_):
        B, T = input_ids.shape
        logits = torch.full((B, T, self.vocab_size), _NEG, dtype=self.table.dtype, device=input_ids.device)
        for b in range(B):
            s = -1
            for t in range(T):
                a = int(input_ids[b, t])
                if a == self.bos_token_id:
                    s = self.start
                elif s >= 0 and a < self.n:
                    s = int(self.next_state[s, a])
                else:
                    s = -1
                logits[b, t, :self.n] = self.table[s] if s >= 0 else 0.0
        return SimpleNamespace(logits=logits)
