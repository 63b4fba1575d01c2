"""K causal-LM teachers sharing one tokenizer, and the exact token-level analysis along a path (theory section 6).

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
from aggregation.validate import check_int, check_token_ids, check_weights


SPECIAL_ATTRIBUTES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")


def _special_tokens(tok):
    """Every special token of a tokenizer, as comparable data: the named ids, the special-token map
    (additional special tokens included) and the added tokens with their flags."""
    out = {name: getattr(tok, name, None) for name in SPECIAL_ATTRIBUTES}
    out["special tokens"] = sorted(getattr(tok, "all_special_tokens", None) or [])
    added = getattr(tok, "added_tokens_decoder", None) or {}
    out["added tokens"] = sorted((int(i), str(t), bool(getattr(t, "special", False))) for i, t in added.items())
    return out


def check_tokenizers(tokenizers):
    """Raise ValueError naming the first difference in vocabulary ids or special tokens (theory section 6)."""
    first = tokenizers[0]
    vocab0 = first.get_vocab()
    special0 = _special_tokens(first)
    for i, tok in enumerate(tokenizers[1:], start=1):
        vocab = tok.get_vocab()
        if len(vocab) != len(vocab0):
            raise ValueError(f"tokenizer {i} has {len(vocab)} tokens, tokenizer 0 has {len(vocab0)}")
        for token, idx in sorted(vocab0.items(), key=lambda kv: kv[1]):
            if vocab.get(token) != idx:
                raise ValueError(f"tokenizer {i} maps {token!r} to id {vocab.get(token)}, tokenizer 0 to {idx}")
        for name, value in _special_tokens(tok).items():
            if value != special0[name]:
                if isinstance(value, list):
                    diff = sorted(set(map(str, value)) ^ set(map(str, special0[name])))
                    raise ValueError(f"tokenizer {i} and tokenizer 0 differ in their {name}: first difference "
                                     f"{diff[0] if diff else 'in order'}")
                raise ValueError(f"tokenizer {i} has {name} = {value}, tokenizer 0 has {special0[name]}")


@dataclass
class Teacher:
    """One teacher: a causal LM, token ids put before every prompt, a temperature and a name."""
    model: torch.nn.Module
    template_ids: list = field(default_factory=list)   # e.g. a system prompt, before the prompt
    temperature: float = 1.0                           # logits / temperature before log_softmax
    name: str = ""                                     # "" -> "teacher{k}"


class Teachers:
    """K teachers over one vocabulary of ``vocab_size`` tokens, with weights on the simplex.

    Parameters
    ----------
    teachers : list of :class:`Teacher` (the same model may appear under several templates).
    weights : (K,) on the simplex.
    vocab_size : tokens that count (``len(tokenizer)``); logit rows past it are padding and dropped.
        Taken from ``tokenizers`` when not given.
    device : ``"cpu"`` (default), ``"cuda"`` or ``"auto"`` (CUDA when present).
    end_token_ids : token ids that end a response (EOS, ``<|im_end|>``); sampling stops there.
    tokenizers : optional, one per teacher (or one for all): checked to share every vocabulary id
        and special token (:func:`check_tokenizers` names the first difference).
    """

    def __init__(self, teachers, weights, vocab_size=None, device="cpu", end_token_ids=(), tokenizers=None):
        if not teachers:
            raise ValueError("teachers is empty")
        self.teachers = list(teachers)
        self.weights = check_weights(weights, len(self.teachers), other="teachers")
        for i, t in enumerate(self.teachers):
            if not t.temperature > 0:
                raise ValueError(f"teachers[{i}].temperature = {t.temperature} must be > 0")
        if tokenizers is not None:
            tokenizers = list(tokenizers)
            if len(tokenizers) not in (1, len(self.teachers)):
                raise ValueError(f"tokenizers has {len(tokenizers)} entries: give one, or one per teacher "
                                 f"({len(self.teachers)})")
            check_tokenizers(tokenizers)
            if vocab_size is None:
                vocab_size = len(tokenizers[0])
        if vocab_size is None:
            raise ValueError("vocab_size is missing: give vocab_size = len(tokenizer), or the tokenizers")
        if vocab_size < 1:
            raise ValueError(f"vocab_size = {vocab_size} must be >= 1")
        self.vocab_size = int(vocab_size)
        rows = [_rows(t.model) for t in self.teachers]
        for i, r in enumerate(rows):
            if r is not None and r < self.vocab_size:
                raise ValueError(f"teachers[{i}] has {r} logit rows, fewer than vocab_size = {self.vocab_size}")
        # a prompt may hold ids the scored vocabulary leaves out (TabularLM's BOS), never past a model's rows
        self.input_vocab_size = min([r for r in rows if r is not None], default=self.vocab_size)
        for i, t in enumerate(self.teachers):
            self.check_ids(t.template_ids, f"teachers[{i}].template_ids", input_ids=True)
        self.device = resolve_device(device)
        self.end_token_ids = tuple(int(e) for e in end_token_ids)
        bad = [e for e in self.end_token_ids if not 0 <= e < self.vocab_size]
        if bad:
            raise ValueError(f"end_token_ids contains {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        for k, t in enumerate(self.teachers):
            t.model.to(self.device).eval()
            if not t.name:
                t.name = f"teacher{k}"
        names = [t.name for t in self.teachers]
        if len(set(names)) < len(names):
            raise ValueError(f"teacher names must differ, got {names}")

    @property
    def K(self):
        return len(self.teachers)

    @property
    def names(self):
        return [t.name for t in self.teachers]

    @torch.no_grad()
    def teacher_log_probs(self, prompt_ids, continuation_ids, full=False, chunk=256):
        """Per-teacher log-probs of the continuation tokens, and optionally full conditionals.

        Returns
        -------
        path : (K, T) float64, ``ln p_k(c_t | prompt, c_<t)``;
        full (if asked) : (K, T, n) float64, the whole conditional at each position.
        """
        prompt_ids = self.check_ids(prompt_ids, "prompt", allow_empty=False, input_ids=True)
        continuation_ids = self.check_ids(continuation_ids, "continuation")
        chunk = check_int(chunk, "chunk", 1)
        from .backend import InProcess
        T, n = len(continuation_ids), self.vocab_size
        path = np.empty((self.K, T))
        out_full = np.empty((self.K, T, n)) if full else None
        target = torch.tensor(continuation_ids, dtype=torch.long, device=self.device)
        for _, t, lp in InProcess(self).distributions([(prompt_ids, continuation_ids)], block=chunk):
            tt = torch.as_tensor(t, device=self.device)
            path[:, t] = lp.gather(2, target[tt][None, :, None].expand(self.K, -1, 1))[..., 0].double().cpu().numpy()
            if full:
                out_full[:, t] = lp.double().cpu().numpy()
            del lp                      # before the next block is made: memory O(block x n)
        return (path, out_full) if full else path

    def path_analysis(self, prompt_ids, continuation_ids, chunk=256):
        """Exact token-level quantities along a path (theory section 2, 6), with aggregation's pools.

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


    def check_ids(self, ids, name, allow_empty=True, input_ids=False):
        """Token ids as a list of ints, each in [0, vocab_size) (scored tokens) or, with ``input_ids``,
        in [0, input_vocab_size) (prompt tokens: every id the models embed); ValueError naming the first
        bad position. ``allow_empty=False``: an empty list is an error (a prompt needs a token)."""
        if not allow_empty and len(ids) == 0:
            raise ValueError(f"{name} is empty: a causal LM needs at least one token to condition on")
        return check_token_ids(ids, name, self.input_vocab_size if input_ids else self.vocab_size)

    def log_softmax(self, logits, temperature):
        """float32 ``log_softmax(logits[..., :n] / temperature)``: padded logit rows are dropped."""
        return torch.log_softmax(logits[..., :self.vocab_size].float() / temperature, dim=-1)

    @torch.no_grad()
    def prefill(self, k, ids):
        """Run teacher k on ``template + ids`` (one sequence); returns (next-token log-probs (n,)
        float32 tensor, the model's cache)."""
        from .backend import prefill
        t = self.teachers[k]
        logits, cache, _, _ = prefill(t, [list(ids)], 1, self.device)
        return self.log_softmax(logits[0, -1], t.temperature), cache

    @torch.no_grad()
    def step(self, k, tokens, cache):
        """Feed one token per sequence, ``tokens: (B,)`` LongTensor, to teacher k with its cache;
        returns ((B, n) float32 log-probs, the cache)."""
        from .backend import step
        t = self.teachers[k]
        logits, cache = step(t.model, tokens, cache)
        return self.log_softmax(logits, t.temperature), cache


def _rows(model):
    """The number of logit rows (token ids) of a model, when it says: ``config.vocab_size`` for
    transformers models, ``vocab_size`` for TabularLM; None otherwise."""
    rows = getattr(getattr(model, "config", None), "vocab_size", None)
    rows = getattr(model, "vocab_size", None) if rows is None else rows
    return rows if isinstance(rows, int) else None


def resolve_device(device):
    """'cpu', 'cuda' or 'auto' (CUDA when available) -> torch.device; anything else is a ValueError."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device = {device!r} must be 'cpu', 'cuda' or 'auto'")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device = 'cuda' but CUDA is not available here")
    return torch.device(device)
