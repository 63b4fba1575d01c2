"""How the analyses reach their models: one small interface, and its first implementation in process.

An analysis (the diagnosis, for now) asks a backend for three things, each batched over many requests:

    generate(rows, max_tokens, rngs)      responses sampled from one model per row (inverse CDF, at the
                                          model's temperature), stopping after an end token
    score(rows)                           ln p_j(c_t | u c_<t) of given token ids under every model
    distributions(rows, block)            the full next-token log-probabilities along given token ids,
                                          every model at once, a block of positions at a time (so that
                                          memory is O(block x n), never O(length x n))

A row names a prompt (token ids, after which each model's template goes first) and, for scoring, a
continuation. :class:`InProcess` runs transformers causal LMs (or :class:`llm_bridge.TabularLM`) in this
process: generation is one left-padded, KV-cached batch per model; scoring is one parallel pass per model
over every row, the model's template (its persona / system prompt) run once and its KV cache shared by
every row. The served backend (:class:`llm_bridge.served.Served`: an inference server's completions with
log-probabilities) generates and scores the same way and gives each position's top k instead of
``distributions``; the diagnosis then works from the top k with bounds (:mod:`llm_bridge.topk_bounds`).
"""

import inspect

import numpy as np
import torch

from aggregation.validate import check_int

from .teachers import Teacher


class Streams:
    """Uniforms for a batch whose rows draw from their own generators: ``random(n)`` concatenates
    ``g.random(count)`` over ``segments`` [(Generator, count), ...] (counts summing to n). Rows of one
    prompt sharing a generator draw exactly what one ``g.random(total)`` would (NumPy's streams are
    sequential), so batching prompts together does not change any prompt's draws."""

    def __init__(self, segments):
        self.segments = [(g, int(c)) for g, c in segments if int(c) > 0]

    def random(self, n):
        """``n`` uniforms on [0, 1): each segment's generator draws its count, in segment order."""
        total = sum(c for _, c in self.segments)
        if n != total:
            raise ValueError(f"asked for {n} uniforms, the segments hold {total}")
        return np.concatenate([g.random(c) for g, c in self.segments]) if self.segments else np.empty(0)


class InProcess:
    """The in-process backend: ``teachers`` (:class:`llm_bridge.Teachers`) and optional ``extra`` models
    (e.g. a student, a :class:`llm_bridge.Teacher` over the same vocabulary) addressed by index
    j = 0 .. K - 1 (the teachers), K, ... (the extra ones)."""

    def __init__(self, teachers, extra=()):
        self.teachers = teachers
        for e in extra:
            if not isinstance(e, Teacher):
                raise ValueError(f"student must be an llm_bridge.Teacher, got {type(e).__name__}")
            e.model.to(teachers.device).eval()
        self.models = list(teachers.teachers) + list(extra)
        self.device = teachers.device
        self.vocab_size = teachers.vocab_size
        self.end_token_ids = teachers.end_token_ids

    # -- generation ------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, rows, max_tokens, rngs):
        """Sample one response per row ``(j, prompt_ids)`` from model j at its temperature, at most
        ``max_tokens`` tokens, stopping after an end token. ``rngs``: one numpy Generator per row (rows of
        one prompt may share one: each step the live rows draw in row order). Returns token-id lists.

        Rows of models sharing one module (personas of one model) run as one left-padded, KV-cached batch:
        where their templates differ each row is ``template_j + prompt``; where all are the same the template
        runs once and its KV cache is shared."""
        from .partition import _sample            # partition imports this module
        max_tokens = check_int(max_tokens, "max_tokens", 1)
        out = [[] for _ in rows]
        groups = {}
        for i, (j, _) in enumerate(rows):
            groups.setdefault(id(self.models[j].model), []).append(i)
        ends = set(self.end_token_ids)
        state = {}
        for g, members in groups.items():
            js = [rows[i][0] for i in members]
            first = self.models[js[0]]
            if all(list(self.models[j].template_ids) == list(first.template_ids) for j in js):
                teacher, contexts = first, [rows[i][1] for i in members]
            else:
                teacher = Teacher(first.model)
                contexts = [list(self.models[j].template_ids) + list(rows[i][1]) for i, j in zip(members, js)]
            logits, cache, mask, pos = prefill(teacher, contexts, 1, self.device)
            state[g] = [logits[:, -1], cache, mask, pos, np.ones(len(members), dtype=bool),
                        np.zeros(len(members), dtype=np.int64), js, first.model]
        for t in range(max_tokens):
            # every live row draws, in row order (one prompt's rows draw from its generator in turn)
            order = sorted((i, g, b) for g, members in groups.items() for b, i in enumerate(members) if state[g][4][b])
            lp = torch.stack([self.teachers.log_softmax(state[g][0][b], self.models[state[g][6][b]].temperature)
                              for _, g, b in order]).double().cpu().numpy()
            drawn = _sample(lp, Streams([(rngs[i], 1) for i, _, _ in order]))
            for (i, g, b), a in zip(order, drawn):
                out[i].append(int(a))
                state[g][5][b] = a
                if int(a) in ends:
                    state[g][4][b] = False
            if t == max_tokens - 1:
                break
            for st in state.values():
                if st[4].any():
                    _, cache, mask, pos, _, feed, _, model = st
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                    logits, cache = step(model, torch.from_numpy(feed).to(self.device), cache, mask, pos)
                    st[:4] = [logits, cache, mask, pos + 1]
            if not any(st[4].any() for st in state.values()):
                break
        return out

    # -- scoring ---------------------------------------------------------------------------------
    @torch.no_grad()
    def distributions(self, rows, models=None, block=128):
        """Every model's next-token log-probabilities along given token ids, a block at a time.

        rows : list of (prompt_ids, continuation_ids); models : indices j (default every model).
        Yields ``(row, position, log_probs)``: ``row`` and ``position`` (b,) int arrays (the b <= block
        positions of this block: position t predicts continuation_ids[t]) and ``log_probs`` (J, b, n) float32
        tensor. Each model runs once over every row (its template once, shared); its logits are made a block
        at a time."""
        models = list(range(len(self.models))) if models is None else list(models)
        block = check_int(block, "block", 1)
        feats = [_features(self.models[j], [list(p) + list(c) for p, c in rows], self.device) for j in models]
        pairs = [(i, t) for i, (_, c) in enumerate(rows) for t in range(len(c))]
        for lo in range(0, len(pairs), block):
            chunk = pairs[lo:lo + block]
            r = np.array([i for i, _ in chunk])
            t = np.array([t for _, t in chunk])
            at = [len(rows[i][0]) - 1 + s for i, s in chunk]          # the position predicting c_t
            lp = torch.stack([self.teachers.log_softmax(f(r, at), self.models[j].temperature)
                              for j, f in zip(models, feats)])
            yield r, t, lp
            del lp                      # one block alive at a time (the caller drops its reference too)

    @torch.no_grad()
    def score(self, rows, models=None):
        """ln p_j(c_t | template_j u c_<t) for every row (prompt_ids, continuation_ids): a list of
        (J, T_i) float64 arrays."""
        models = list(range(len(self.models))) if models is None else list(models)
        out = [np.zeros((len(models), len(c))) for _, c in rows]
        for r, t, lp in self.distributions(rows, models):
            target = torch.tensor([rows[i][1][s] for i, s in zip(r, t)], device=lp.device)
            got = lp.gather(2, target[None, :, None].expand(lp.shape[0], -1, 1))[..., 0].double().cpu().numpy()
            for b, (i, s) in enumerate(zip(r, t)):
                out[i][:, s] = got[:, b]
        return out


@torch.no_grad()
def step(model, tokens, cache, mask=None, positions=None):
    """Feed one token per sequence, ``tokens`` (B,), to a model with its cache (and, for left-padded batches,
    the attention mask including the new token and the new tokens' positions (B,)); returns (next-token
    logits (B, V), the cache)."""
    extra = {} if mask is None else {"attention_mask": mask, "position_ids": positions[:, None]}
    out = model(input_ids=tokens[:, None], use_cache=True, **{_cache_name(model): cache}, **extra)
    return out.logits[:, -1], _cache_of(out)


@torch.no_grad()
def prefill(teacher, contexts, n_last, device):
    """Run a teacher's template once (its KV cache repeated over the batch), then the contexts left-padded
    after it (the padding repeats each context's first token and is masked out; TabularLM's first token is
    BOS, which resets it; positions continue from the template). Returns (logits of the last ``n_last``
    positions (B, n_last, V), cache, attention mask (B, L), next positions (B,))."""
    model = teacher.model
    B, Lt = len(contexts), len(teacher.template_ids)
    L = max(len(c) for c in contexts)
    ids = torch.tensor([[c[0]] * (L - len(c)) + list(c) for c in contexts], device=device)
    mask = torch.tensor([[1] * Lt + [0] * (L - len(c)) + [1] * len(c) for c in contexts], device=device)
    positions = Lt + (mask[:, Lt:].cumsum(1) - 1).clamp(min=0)
    extra = {"logits_to_keep": n_last} if _accepts(model, "logits_to_keep") else {}
    if Lt:
        head = model(input_ids=torch.tensor([list(teacher.template_ids)], device=device), use_cache=True,
                     **_keep_last(model))
        extra[_cache_name(model)] = expand_cache(_cache_of(head), B)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **extra)
    return out.logits[:, -n_last:], _cache_of(out), mask, positions[:, -1] + 1


@torch.no_grad()
def _features(teacher, seqs, device):
    """A function (rows (b,), positions (b,)) -> logits (b, V) of ``template + seqs[row]`` at those positions
    (indices into seqs[row]), from one pass over every sequence.

    A transformers causal LM (``logits = lm_head(decoder(ids))``) runs its decoder once: the template alone
    (its KV cache repeated over the rows), then the sequences left-padded after it; the head is applied per
    block, so memory for logits is O(block x V). Other modules (TabularLM) serve full logits of
    ``template + seq``."""
    model, template = teacher.model, list(teacher.template_ids)
    get_decoder = getattr(model, "get_decoder", None)
    get_head = getattr(model, "get_output_embeddings", None)
    decoder = get_decoder() if callable(get_decoder) else None
    head = get_head() if callable(get_head) else None
    B, L, Lt = len(seqs), max(len(s) for s in seqs), len(template)
    pad = [L - len(s) for s in seqs]
    if decoder is None or head is None or decoder is model:
        full = [template + s for s in seqs]
        Lf = max(len(s) for s in full)
        ids = torch.tensor([[s[0]] * (Lf - len(s)) + s for s in full], device=device)
        logits = model(input_ids=ids, use_cache=False).logits
        shift = [Lf - len(s) + Lt for s in full]
        return lambda r, at: logits[torch.as_tensor(r), torch.as_tensor([shift[i] + a for i, a in zip(r, at)])]
    ids = torch.tensor([[s[0]] * p + list(s) for s, p in zip(seqs, pad)], device=device)
    mask = torch.tensor([[1] * Lt + [0] * p + [1] * len(s) for s, p in zip(seqs, pad)], device=device)
    positions = Lt + (mask[:, Lt:].cumsum(1) - 1).clamp(min=0)
    extra = {}
    if Lt:
        head_out = decoder(input_ids=torch.tensor([template], device=device), use_cache=True)
        extra[_cache_name(decoder)] = expand_cache(_cache_of(head_out), B)
    hidden = decoder(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=bool(Lt),
                     **extra).last_hidden_state
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)

    def rows(r, at):
        h = hidden[torch.as_tensor(r), torch.as_tensor([pad[i] + a for i, a in zip(r, at)])]
        logits = head(h)
        return cap * torch.tanh(logits / cap) if cap else logits
    return rows


# ------------------------------------------------------------------------------------------------
# transformers' calling conventions (and TabularLM's)
# ------------------------------------------------------------------------------------------------
def expand_cache(cache, batch):
    """Repeat a batch-1 cache ``batch`` times along the batch axis (transformers Cache or a tensor)."""
    if isinstance(cache, torch.Tensor):
        return cache.repeat_interleave(batch, dim=0)
    if hasattr(cache, "batch_repeat_interleave"):
        cache.batch_repeat_interleave(batch)
        return cache
    if isinstance(cache, tuple):        # legacy tuple-of-tuples cache
        return tuple(tuple(x.repeat_interleave(batch, dim=0) for x in layer) for layer in cache)
    raise ValueError(f"cannot expand a cache of type {type(cache).__name__} along the batch axis")


def _accepts(model, name):
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _cache_name(model):
    """The cache keyword: ``cache`` in transformers >= 5.2x, ``past_key_values`` before."""
    return "cache" if _accepts(model, "cache") else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def _keep_last(model):
    """Ask transformers models for the last position's logits only (prefill memory O(n), not O(T n))."""
    return {"logits_to_keep": 1} if _accepts(model, "logits_to_keep") else {}
