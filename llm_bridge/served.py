"""Teachers behind an inference server: vLLM's OpenAI-compatible ``/v1/completions`` (issue 43).

A practitioner's teachers run on a server (vLLM, tensor- and pipeline-parallel, any number of GPUs or
nodes); this backend asks it what :class:`llm_bridge.backend.InProcess` computes in process, in token ids
(the prompt is sent as ids, answers come back as ids: ``return_tokens_as_token_ids``, ``return_token_ids``):

    score(rows)                       ln p_j(c_t | template_j u prompt c_<t): exact (vLLM's prompt
                                      log-probabilities, float32 logits, the same weights as in process)
    top_k(rows, k)                    each position's k most likely tokens and their log-probabilities
    generate(rows, max_tokens, rngs)  a response per row, sampled by the server at the teacher's
                                      temperature with a seed drawn from the row's generator; it stops
                                      after an end token (``stop_token_ids``; the model's own EOS ignored)
    distributions(rows)               the full next-token log-probabilities (a server started with
                                      ``--max-logprobs -1``; one request per position and teacher, ~40x
                                      slower than in process on a CPU server: short texts only)

Requests run concurrently, at most ``max_in_flight`` at a time, each with a timeout and ``retries``
retries with exponential backoff for a refused connection, a timeout, a 5xx or a 429; anything else, or
the last failure, is a :class:`ServerError` whose message is one line naming the server.

What a server cannot give cheaply: the full next-token distribution (all n log-probabilities per position come
back only with ``--max-logprobs -1``, one generation step per position, ~40x slower than in process on a CPU
server: benchmarks/README.md), so the analyses that follow many responses work from the top k with bounds
(:mod:`llm_bridge.topk_bounds`); and prompt log-probabilities at a temperature other than 1 (vLLM's prompt
log-probabilities are always at temperature 1). A tempered teacher (temperature T != 1) is therefore scored one
generation step per position: the request carries T and ``logprob_token_ids`` (the tokens asked), and a server
started with ``--logprobs-mode processed_logprobs`` answers ``log_softmax(logits / T)`` of those tokens,
exactly; a server in vLLM's default mode (``raw_logprobs``) would answer at temperature 1, so
:meth:`Served.check_temperatures` asks once and refuses it. Ranks do not change with T, so a tempered teacher's
top k are its temperature-1 top k, re-scored at T.
"""

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from aggregation.validate import check_int


class ServerError(RuntimeError):
    """A server that is down, times out or answers with an error: one line, naming the server."""


@dataclass
class ServedTeacher:
    """One teacher on a server: its base ``url`` (``http://host:port``), the ``model`` name it is served
    under, token ids put before every prompt (a persona / system turn), a temperature and a name."""
    url: str
    model: str
    template_ids: list = field(default_factory=list)
    temperature: float = 1.0
    name: str = ""


class Served:
    """The served backend: ``teachers`` (:class:`ServedTeacher`), addressed by index j as in process.

    vocab_size : the scored vocabulary n (ids in [0, n)); end_token_ids : ids a response stops after.
    max_in_flight (default 32: a server batches the requests in flight), timeout (seconds per request),
    retries, backoff (seconds before the first retry, doubled each time): the transport."""

    def __init__(self, teachers, vocab_size, end_token_ids=(), max_in_flight=32, timeout=120.0, retries=3,
                 backoff=0.5):
        self.models = list(teachers)
        if not self.models:
            raise ValueError("teachers is empty")
        for i, t in enumerate(self.models):
            if not isinstance(t, ServedTeacher):
                raise ValueError(f"teachers[{i}] must be a ServedTeacher, got {type(t).__name__}")
            if not str(t.url).startswith(("http://", "https://")):
                raise ValueError(f"teachers[{i}].url = {t.url!r} must start with http:// or https://")
            if not t.temperature > 0:
                raise ValueError(f"teachers[{i}].temperature = {t.temperature} must be > 0")
            if not t.name:
                t.name = f"teacher{i}"
        self.vocab_size = check_int(vocab_size, "vocab_size", 1)
        self.end_token_ids = tuple(int(e) for e in end_token_ids)
        self.max_in_flight = check_int(max_in_flight, "max_in_flight", 1)
        self.retries = check_int(retries, "retries", 0)
        if not timeout > 0 or not backoff >= 0:
            raise ValueError(f"timeout = {timeout} must be > 0 and backoff = {backoff} >= 0")
        self.timeout, self.backoff = float(timeout), float(backoff)

    # -- transport -------------------------------------------------------------------------------
    def _post(self, j, path, body):
        t = self.models[j]
        where = f"server {t.url} (model {t.model!r}, teacher {t.name!r})"
        data = json.dumps({"model": t.model, **body}).encode()
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(t.url.rstrip("/") + path, data=data,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                    return json.loads(resp.read())
            except urllib.error.HTTPError as exc:
                message = _error_message(exc)
                if exc.code not in (429,) and exc.code < 500:
                    raise ServerError(f"{where} answered {exc.code}: {message}") from None
                failure = f"answered {exc.code}: {message}"
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                failure = f"is unreachable ({reason})"
            if attempt < self.retries:
                time.sleep(self.backoff * 2 ** attempt)
        raise ServerError(f"{where} {failure} after {self.retries + 1} tries")

    def _map(self, calls):
        """Run (j, path, body) requests concurrently, at most max_in_flight at a time; answers in order."""
        if len(calls) <= 1:
            return [self._post(*c) for c in calls]
        with ThreadPoolExecutor(max_workers=min(self.max_in_flight, len(calls))) as pool:
            return list(pool.map(lambda c: self._post(*c), calls))

    def _ids(self, rows, what):
        out = []
        for i, row in enumerate(rows):
            ids = [int(a) for a in row]
            bad = [a for a in ids if not 0 <= a < self.vocab_size]
            if bad:
                raise ValueError(f"{what}[{i}] holds id {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
            out.append(ids)
        return out

    def _rows(self, rows):
        """Validated (prompt ids, continuation ids) lists; an empty prompt is an error."""
        rows = list(zip(self._ids([p for p, _ in rows], "prompts"), self._ids([c for _, c in rows], "continuations")))
        for i, (p, _) in enumerate(rows):
            if not p:
                raise ValueError(f"prompts[{i}] is empty")
        return rows

    def _models(self, models):
        models = list(range(len(self.models))) if models is None else [int(j) for j in models]
        bad = [j for j in models if not 0 <= j < len(self.models)]
        if bad:
            raise ValueError(f"models holds {bad[0]}, not a teacher index in [0, {len(self.models)})")
        return models

    # -- the tokenizer check ---------------------------------------------------------------------
    def check_tokenizer(self, text, token_ids):
        """Raise ValueError unless every server tokenizes ``text`` to ``token_ids`` (the ids this process's
        tokenizer gives): teachers with different tokenizers cannot be pooled."""
        want = [int(a) for a in token_ids]
        answers = self._map([(j, "/tokenize", {"prompt": text, "add_special_tokens": False})
                             for j in range(len(self.models))])
        for t, a in zip(self.models, answers):
            got = [int(x) for x in a.get("tokens", [])]
            if got != want:
                first = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
                raise ValueError(f"server {t.url} (model {t.model!r}) tokenizes {text!r} differently from the "
                                 f"local tokenizer: first difference at token {first} ({got[first:first + 3]} vs "
                                 f"{want[first:first + 3]})")

    # -- tempered teachers -----------------------------------------------------------------------
    def check_temperatures(self, prompt_ids):
        """Raise ValueError unless each tempered teacher's server answers generated log-probabilities at the
        request's temperature (``--logprobs-mode processed_logprobs``). One context (template + ``prompt_ids``),
        two requests per tempered teacher, at T and at 1: the gap between its most and fifth most likely tokens
        is the temperature-1 gap over T on such a server and the temperature-1 gap on a raw one."""
        hot = [j for j, t in enumerate(self.models) if t.temperature != 1.0]
        if not hot:
            return
        prompt = self._ids([prompt_ids], "prompt_ids")[0]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        calls = [(j, "/v1/completions", dict(self._step(j, prompt, temperature), logprobs=5))
                 for j in hot for temperature in (self.models[j].temperature, 1.0)]
        answers = iter(self._map(calls))
        for j in hot:
            gaps = []
            for _ in range(2):
                got = sorted(next(answers)["choices"][0]["logprobs"]["top_logprobs"][0].values(), reverse=True)
                gaps.append(got[0] - got[4])                 # [4]: a sampled token outside the 5 is appended
            t = self.models[j]
            if not abs(gaps[0] * t.temperature - gaps[1]) <= 1e-3 * gaps[1] + 1e-4 or gaps[1] < 1e-2:
                raise ValueError(f"server {t.url} (model {t.model!r}) answers log-probabilities at temperature 1 "
                                 f"for teacher {t.name!r} at temperature {t.temperature:g}: start it with "
                                 "--logprobs-mode processed_logprobs")

    def _step(self, j, context, temperature):
        """One generation step's request body after template_j + context, at ``temperature``, full support."""
        return {"prompt": list(self.models[j].template_ids) + [int(a) for a in context], "max_tokens": 1,
                "temperature": temperature, "top_p": 1.0, "top_k": -1, "seed": 0, "return_tokens_as_token_ids": True}

    def _tempered(self, j, asks):
        """ln p_j(a | template_j u context) at teacher j's temperature for each (context, tokens) in ``asks``:
        one generation step per context (the tokens as ``logprob_token_ids``); a list of float64 arrays."""
        calls = [(j, "/v1/completions", dict(self._step(j, ctx, self.models[j].temperature), logprobs=0,
                                              logprob_token_ids=[int(a) for a in tokens])) for ctx, tokens in asks]
        out = []
        for answer, (_, tokens) in zip(self._map(calls), asks):
            got = answer["choices"][0]["logprobs"]["top_logprobs"][0]
            out.append(np.array([got[f"token_id:{int(a)}"] for a in tokens], dtype=float))
        return out

    # -- scoring ---------------------------------------------------------------------------------
    def _prompt_log_probs(self, rows, models, k):
        """One request per (model, row), models outer: each row's continuation positions of vLLM's prompt
        log-probabilities of template + prompt + continuation, with the top k (k = 0: the scored token only)."""
        rows = self._rows(rows)
        calls = [(j, "/v1/completions", {"prompt": list(self.models[j].template_ids) + p + c, "max_tokens": 1,
                                         "temperature": 0.0, "prompt_logprobs": k, "echo": False})
                 for j in models for p, c in rows]
        starts = [len(self.models[j].template_ids) + len(p) for j in models for p, _ in rows]
        lengths = [len(c) for _ in models for _, c in rows]
        return [a["choices"][0]["prompt_logprobs"][start:start + n]
                for a, start, n in zip(self._map(calls), starts, lengths)]

    def score(self, rows, models=None):
        """ln p_j(c_t | template_j u prompt c_<t) for every row (prompt_ids, continuation_ids), at teacher j's
        temperature: a list of (J, T_i) float64 arrays, as :meth:`llm_bridge.backend.InProcess.score` returns.
        One request per row and temperature-1 teacher; one per position of a tempered teacher."""
        models = self._models(models)
        rows = self._rows(rows)
        out = [np.zeros((len(models), len(c))) for _, c in rows]
        cold = [m for m, j in enumerate(models) if self.models[j].temperature == 1.0]
        got = iter(self._prompt_log_probs(rows, [models[m] for m in cold], 0))
        for m in cold:
            for (_, c), o in zip(rows, out):
                o[m] = [entry[str(tok)]["logprob"] for tok, entry in zip(c, next(got))]
        for m, j in enumerate(models):
            if m not in cold:
                got = iter(self._tempered(j, [(p + c[:t], [c[t]]) for p, c in rows for t in range(len(c))]))
                for (_, c), o in zip(rows, out):
                    o[m] = [next(got)[0] for _ in c]
        return out

    def top_k(self, rows, k, models=None):
        """Each continuation position's ``k`` most likely next tokens under each model (at its temperature), and
        the continuation's own tokens' log-probabilities, from one request per row and model (and one per
        position of a tempered teacher): per row (ids (J, T, k) int64, log_probs (J, T, k) float64, most likely
        first; token_log_probs (J, T) float64). ``k`` is at most the server's ``--max-logprobs``."""
        k = check_int(k, "k", 1)
        models = self._models(models)
        rows = self._rows(rows)
        got = iter(self._prompt_log_probs(rows, models, k))
        out = [(np.zeros((len(models), len(c), k), dtype=np.int64), np.zeros((len(models), len(c), k)),
                np.zeros((len(models), len(c)))) for _, c in rows]
        for m in range(len(models)):
            for (_, c), (ids, lps, own) in zip(rows, out):
                for t, (tok, entry) in enumerate(zip(c, next(got))):
                    best = sorted((v["rank"], int(b), v["logprob"]) for b, v in entry.items() if v["rank"] <= k)[:k]
                    if len(best) < k:
                        raise ServerError(f"server {self.models[models[m]].url} returned {len(best)} of the top {k} "
                                          "log-probabilities (start it with --max-logprobs >= k)")
                    ids[m, t] = [b[1] for b in best]
                    lps[m, t] = [b[2] for b in best]
                    own[m, t] = entry[str(int(tok))]["logprob"]
        for m, j in enumerate(models):                  # tempered: the same ranks, re-scored at T
            if self.models[j].temperature != 1.0:
                asks = [(p + c[:t], [*ids[m, t], c[t]])
                        for (p, c), (ids, _, _) in zip(rows, out) for t in range(len(c))]
                got = iter(self._tempered(j, asks))
                for (_, c), (_, lps, own) in zip(rows, out):
                    for t in range(len(c)):
                        g = next(got)
                        lps[m, t], own[m, t] = g[:-1], g[-1]
        return out

    def distributions(self, rows, models=None, block=128):
        """Every model's full next-token log-probabilities along given token ids, as
        :meth:`llm_bridge.backend.InProcess.distributions` yields them (``(row, position, log_probs (J, b, n)
        float32 tensor)``, blocks of at most ``block`` positions of one row), at each teacher's temperature.
        One generation step per position and model at temperature 1 with all n log-probabilities
        (``logprobs = n``: a server started with ``--max-logprobs -1``), the temperature applied here, exactly
        (``log_softmax(ln p / T)``). Not prompt log-probabilities: those come for every position of the template
        and prompt as well, each entry with its decoded text (15x slower for a 4-token continuation of the
        shipped teachers: benchmarks/README.md). Answers are read ``max_in_flight`` requests at a time, so memory
        is O(J x T_i x n) floats for a row."""
        import torch
        models = self._models(models)
        block = check_int(block, "block", 1)
        n = self.vocab_size
        for i, (p, c) in enumerate(self._rows(rows)):
            lp = np.full((len(models), len(c), n), -np.inf, dtype=np.float32)
            asks = [(m, t) for m in range(len(models)) for t in range(len(c))]
            for lo in range(0, len(asks), self.max_in_flight):
                chunk = asks[lo:lo + self.max_in_flight]
                calls = [(models[m], "/v1/completions", dict(self._step(models[m], p + c[:t], 1.0), logprobs=n))
                         for m, t in chunk]
                for (m, t), answer in zip(chunk, self._map(calls)):
                    got = answer["choices"][0]["logprobs"]["top_logprobs"][0]
                    if len(got) < n:
                        raise ServerError(f"server {self.models[models[m]].url} returned {len(got)} of the {n} "
                                          "log-probabilities of a position (start it with --max-logprobs -1)")
                    ids = np.fromiter((int(k.rpartition(":")[2]) for k in got), dtype=np.int64, count=len(got))
                    lp[m, t, ids] = np.fromiter(got.values(), dtype=np.float64, count=len(got))
            for m, j in enumerate(models):
                temperature = self.models[j].temperature
                if temperature != 1.0:
                    lp[m] = torch.log_softmax(torch.from_numpy(lp[m]).double() / temperature, dim=-1).float().numpy()
            for lo in range(0, len(c), block):
                t = np.arange(lo, min(lo + block, len(c)))
                yield np.full(len(t), i), t, torch.from_numpy(lp[:, t])

    # -- generation ------------------------------------------------------------------------------
    def generate(self, rows, max_tokens, rngs):
        """Sample one response per row ``(j, prompt_ids)`` from teacher j at its temperature, at most
        ``max_tokens`` tokens, stopping after an end token. ``rngs``: one numpy Generator per row; each row's
        server seed is drawn from it, so the same generators give the same responses from the same server
        (not the in-process backend's: the server draws its own uniforms). Returns token-id lists."""
        max_tokens = check_int(max_tokens, "max_tokens", 1)
        if len(rngs) != len(rows):
            raise ValueError(f"rngs has {len(rngs)} entries for {len(rows)} rows")
        models = self._models([j for j, _ in rows])
        prompts = self._ids([p for _, p in rows], "prompts")
        calls = [(j, "/v1/completions", {"prompt": list(self.models[j].template_ids) + p, "max_tokens": max_tokens,
                                         "temperature": self.models[j].temperature, "top_p": 1.0, "top_k": -1,
                                         "seed": int(g.integers(2 ** 31)), "ignore_eos": True,
                                         "stop_token_ids": list(self.end_token_ids), "return_token_ids": True,
                                         "skip_special_tokens": False})
                 for j, p, g in zip(models, prompts, rngs)]
        return [[int(a) for a in answer["choices"][0]["token_ids"]] for answer in self._map(calls)]


def served_model_name(url, timeout=30.0):
    """The name of the one model a server serves (its ``/v1/models``); a :class:`ServerError` when it cannot be
    reached, a ValueError when it serves several (name one)."""
    try:
        with urllib.request.urlopen(str(url).rstrip("/") + "/v1/models", timeout=timeout) as resp:
            names = [m["id"] for m in json.loads(resp.read()).get("data", [])]
    except urllib.error.HTTPError as exc:
        raise ServerError(f"server {url} answered {exc.code}: {_error_message(exc)}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as exc:
        raise ServerError(f"server {url} is unreachable ({getattr(exc, 'reason', exc)})") from None
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ServerError(f"server {url} did not answer /v1/models with a list of models") from None
    if len(names) != 1:
        raise ValueError(f"server {url} serves {len(names)} models ({', '.join(names)}): name one with its 'model'")
    return names[0]


def _error_message(exc):
    """The server's own message of an HTTP error (vLLM: {"error": {"message": ...}}), on one line."""
    try:
        body = json.loads(exc.read())
        message = body.get("error", body)
        message = message.get("message", message) if isinstance(message, dict) else message
    except (ValueError, OSError, AttributeError):
        message = exc.reason
    return " ".join(str(message).split())[:300]


class LocalServer:
    """A vLLM OpenAI-compatible server on 127.0.0.1 for tests and benchmarks: ``python -m
    vllm.entrypoints.openai.api_server`` of a Hugging Face ``folder`` under ``name`` (float32, eager, a 1 GiB KV
    cache: vLLM's CPU build), started by ``start`` (waits for ``/health``, at most ``wait`` seconds; ``url``) and
    stopped by ``stop`` through its process group id (SIGTERM, SIGKILL after 60 s). ``python``: the vLLM
    environment's interpreter; ``threads``: OMP threads; ``log``: its output file. A context manager."""

    def __init__(self, python, folder, name, log, max_logprobs=50, threads=1, max_model_len=2048, wait=900.0,
                 logprobs_mode="processed_logprobs"):
        self.python, self.folder, self.name, self.log = str(python), str(folder), name, log
        self.max_logprobs, self.threads, self.max_model_len, self.wait = max_logprobs, threads, max_model_len, wait
        self.logprobs_mode = logprobs_mode
        self.proc, self.url = None, None

    def start(self):
        """Start the server on a free port and wait for ``/health``; its URL. A server that exits or does not
        answer in time is a :class:`ServerError` naming the log."""
        import os
        import socket
        import subprocess
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1"}
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.folder, "--served-model-name",
                 self.name, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
                 "--max-logprobs", str(self.max_logprobs), "--max-model-len", str(self.max_model_len),
                 "--logprobs-mode", self.logprobs_mode],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.wait
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"the vLLM server exited with {self.proc.returncode} (log: {self.log})")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self.url
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"the vLLM server did not answer within {self.wait:g} s (log: {self.log})")
            time.sleep(2)

    def stop(self):
        """Stop the server's process group; True when no process of it is left 30 s later."""
        import os
        import signal
        import subprocess
        if self.proc is None:
            return True
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)
        for _ in range(60):                       # its engine process leaves with it
            try:
                os.killpg(self.proc.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.5)
        os.killpg(self.proc.pid, signal.SIGKILL)
        return False

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()
