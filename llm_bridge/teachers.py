"""K causal-LM teachers sharing one tokenizer, and the exact token-level analysis along a path (SPEC 6).

A teacher is a causal LM (transformers calling convention: ``model(input_ids=...).logits``) with an
optional prompt template (a system prompt / persona, as token ids put before the prompt) and a
temperature. Log-probs are float32 ``log_softmax`` of the logits restricted to the tokenizer's
vocabulary (Qwen-style checkpoints pad the logit rows past ``len(tokenizer)``), chunked over
positions so that memory is O(chunk x n) per teacher. The pools themselves are aggregation's.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.special import logsumexp

import aggregation as ag
from aggregation._validate import check_weights


def check_tokenizers(tokenizers):
    """Raise ValueError naming the first difference in vocabulary ids or special tokens."""
    first = tokenizers[0]
    vocab0 = first.get_vocab()
    for i, tok in enumerate(tokenizers[1:], start=1):
        vocab = tok.get_vocab()
        if len(vocab) != len(vocab0):
            raise ValueError(f"tokenizer {i} has {len(vocab)} tokens, tokenizer 0 has {len(vocab0)}")
        for token, idx in sorted(vocab0.items(), key=lambda kv: kv[1]):
            if vocab.get(token) != idx:
                raise ValueError(f"tokenizer {i} maps {token!r} to id {vocab.get(token)}, tokenizer 0 to {idx}")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            if getattr(tok, name, None) != getattr(first, name, None):
                raise ValueError(f"tokenizer {i} has {name} = {getattr(tok, name, None)}, "
                                 f"tokenizer 0 has {getattr(first, name, None)}")


@dataclass
class Teacher:
    """One teacher: a causal LM, token ids put before every prompt, and a temperature."""
    model: torch.nn.Module
    template_ids: list = field(default_factory=list)
    temperature: float = 1.0


class Teachers:
    """K teachers over one vocabulary of ``vocab_size`` tokens, with weights on the simplex.

    Parameters
    ----------
    teachers : list of :class:`Teacher` (the same model may appear under several templates).
    weights : (K,) on the simplex.
    vocab_size : tokens that count (``len(tokenizer)``); logit rows past it are padding and dropped.
    device : ``"cpu"`` (default), ``"cuda"`` or ``"auto"`` (CUDA when present).
    """

    def __init__(self, teachers, weights, vocab_size, device="cpu"):
        if not teachers:
            raise ValueError("teachers is empty")
        self.teachers = list(teachers)
        self.weights = check_weights(weights, len(self.teachers), other="teachers")
        for i, t in enumerate(self.teachers):
            if not t.temperature > 0:
                raise ValueError(f"teachers[{i}].temperature = {t.temperature} must be > 0")
        if vocab_size < 1:
            raise ValueError(f"vocab_size = {vocab_size} must be >= 1")
        self.vocab_size = int(vocab_size)
        self.device = resolve_device(device)
        for t in self.teachers:
            t.model.to(self.device).eval()

    @property
    def K(self):
        return len(self.teachers)

    @torch.no_grad()
    def teacher_log_probs(self, prompt_ids, continuation_ids, full=False, chunk=256):
        """Per-teacher log-probs of the continuation tokens, and optionally full conditionals.

        Returns
        -------
        path : (K, T) float64, ``ln p_k(c_t | prompt, c_<t)``;
        full (if asked) : (K, T, n) float64, the whole conditional at each position.
        """
        prompt_ids, continuation_ids = list(prompt_ids), list(continuation_ids)
        if not prompt_ids:
            raise ValueError("prompt is empty: a causal LM needs at least one token to condition on")
        bad = [i for i, c in enumerate(continuation_ids) if not 0 <= c < self.vocab_size]
        if bad:
            raise ValueError(f"continuation[{bad[0]}] = {continuation_ids[bad[0]]} is outside the vocabulary")
        if chunk < 1:
            raise ValueError(f"chunk = {chunk} must be >= 1")
        T, n = len(continuation_ids), self.vocab_size
        path = np.empty((self.K, T))
        out_full = np.empty((self.K, T, n)) if full else None
        target = torch.tensor(continuation_ids, dtype=torch.long, device=self.device)
        for k, t in enumerate(self.teachers):
            ids = torch.tensor([t.template_ids + prompt_ids + continuation_ids], device=self.device)
            out = t.model(input_ids=ids, use_cache=False)
            hidden_logits = out.logits[0]
            start = len(t.template_ids) + len(prompt_ids) - 1      # position predicting c_0
            for lo in range(0, T, chunk):
                hi = min(T, lo + chunk)
                logits = hidden_logits[start + lo:start + hi, :n].float() / t.temperature
                lp = torch.log_softmax(logits, dim=-1)
                path[k, lo:hi] = lp.gather(1, target[lo:hi, None])[:, 0].double().cpu().numpy()
                if full:
                    out_full[k, lo:hi] = lp.double().cpu().numpy()
        return (path, out_full) if full else path

    def path_analysis(self, prompt_ids, continuation_ids, chunk=256):
        """Exact token-level quantities along a path (SPEC 2, 6), with aggregation's pools.

        Returns a dict of arrays over positions t = 0 .. T-1:
        ``teacher`` (K, T, n) conditionals, ``local_geometric`` (T, n) l, ``local_mixture`` (T, n)
        the token-level mixture, ``mixture`` (T, n) the sequence-level mixture conditional with
        posterior weights ``posterior`` (T, K) ∝ w_k p_k(c_<t), and ``prefix_log_prob`` (K, T + 1)
        = ln p_k(c_<t).
        """
        path, full = self.teacher_log_probs(prompt_ids, continuation_ids, full=True, chunk=chunk)
        K, T = path.shape
        prefix = np.concatenate([np.zeros((K, 1)), np.cumsum(path, axis=1)], axis=1)
        with np.errstate(divide="ignore"):
            log_post = np.log(self.weights)[:, None] + prefix[:, :T]
        log_post -= logsumexp(log_post, axis=0)
        post = np.exp(log_post).T                                   # (T, K)
        mixture = np.stack([ag.log_arithmetic_pool(full[:, t], post[t] / post[t].sum()) for t in range(T)]) \
            if T else np.empty((0, self.vocab_size))
        return {
            "teacher": full,
            "local_geometric": ag.log_geometric_pool(full, self.weights),
            "local_mixture": ag.log_arithmetic_pool(full, self.weights),
            "mixture": mixture,
            "posterior": post,
            "prefix_log_prob": prefix,
        }


def resolve_device(device):
    """'cpu', 'cuda' or 'auto' (CUDA when available) -> torch.device; anything else is a ValueError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device = {device!r} must be 'cpu', 'cuda' or 'auto'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device = 'cuda' but CUDA is not available here")
    return torch.device(device)
