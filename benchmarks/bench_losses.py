"""Speed and memory of llm_bridge.losses against the straightforward implementation, side by side in one
run: the straightforward forward KL materialises the float32 log-softmax of every teacher and of the
student at once and lets autograd keep what it needs.

    python benchmarks/bench_losses.py                 # B = 4, T = 1024, V = 49152, K = 3 (the issue's size)
    python benchmarks/bench_losses.py --T 256 --quick # smaller, for a look

Reports, for float32 and bf16 inputs, the peak memory above the inputs during forward + backward
(CPU: resident memory sampled every 0.5 ms by psutil in a thread, llm_bridge._memory; CUDA: the
allocator's peak) and the best wall time of
forward + backward, for ours and the straightforward one, their ratios, and tokens per second. The
fused path (hidden states + lm_head) is measured at two vocabulary sizes: its peak should not grow
with V beyond the chunk and the weight's own gradient. Each measurement runs in a fresh process, so
one run's freed memory cannot hide the next one's peak.
"""

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from timing import best_time  # noqa: E402  (benchmarks/timing.py, beside this script)


def measure(args):
    import torch

    from llm_bridge._memory import peak_rss_mib
    from llm_bridge.losses import forward_kl, fused_linear_loss
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    dev = torch.device(args.device)
    B, T, V, K = args.B, args.T, args.V, args.K
    w = torch.full((K,), 1.0 / K)
    if args.which in ("ours", "straightforward"):
        student = torch.randn(B, T, V, device=dev).to(dtype).requires_grad_()
        teachers = torch.randn(K, B, T, V, device=dev).to(dtype)

        def ours():
            loss, _ = forward_kl(student, teachers, w, chunk_size=args.chunk or None, metrics=args.metrics == 1)
            loss.backward()
            student.grad = None

        def straightforward():
            lq = torch.log_softmax(student.float(), -1)
            lp = torch.log_softmax(teachers.float(), -1)
            loss = (w[:, None, None] * (lp.exp() * (lp - lq[None])).sum(-1)).sum(0).mean()
            loss.backward()
            student.grad = None
        fn = ours if args.which == "ours" else straightforward
    else:                                                        # the fused path, or its straightforward twin
        H = args.H
        hidden = torch.randn(B, T, H, device=dev).to(dtype).requires_grad_()
        weight = (torch.randn(V, H, device=dev) / H ** 0.5).to(dtype).requires_grad_()
        teachers = torch.randn(K, B, T, V, device=dev).to(dtype)

        def fn():
            if args.which == "fused":
                loss, _ = fused_linear_loss(hidden, weight, teachers, w, chunk_size=args.chunk or None, metrics=args.metrics == 1)
            else:
                loss, _ = forward_kl(hidden @ weight.T, teachers, w, chunk_size=args.chunk or None, metrics=args.metrics == 1)
            loss.backward()
            hidden.grad = weight.grad = None
    fn()                                                         # warm-up: allocator, threads
    if dev.type == "cuda":
        def timed():
            fn()
            torch.cuda.synchronize()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        timed()
        peak = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        seconds = best_time(timed, args.repeats, warmup=False)
    else:
        peak = peak_rss_mib(fn)
        seconds = best_time(fn, args.repeats, warmup=False)
    print(json.dumps(dict(which=args.which, dtype=args.dtype, V=V, peak_mib=peak, seconds=seconds,
                          tokens_per_s=B * T / seconds)))


def run(args, **over):
    cmd = [sys.executable, __file__, "--measure"]
    for key, value in {**vars(args), **over}.items():
        if key in ("measure", "quick"):
            continue
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--V", type=int, default=49152)
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--H", type=int, default=576)
    ap.add_argument("--chunk", type=int, default=0, help="positions per chunk (0: the library's default)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (peak memory from torch.cuda's allocator)")
    ap.add_argument("--which", default="ours")
    ap.add_argument("--metrics", type=int, default=1)
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.measure:
        return measure(args)
    print(f"B = {args.B}, T = {args.T}, V = {args.V}, K = {args.K}, chunk = {args.chunk or 'default'}, "
          f"device = {args.device}, threads = {args.threads}")
    print(f"{'inputs':>8} {'implementation':>16} {'peak MiB':>9} {'s (f+b)':>8} {'tokens/s':>9}")
    for dtype in ("float32", "bf16"):
        res = {which: run(args, dtype=dtype, which=which) for which in ("ours", "straightforward")}
        res["ours, no metrics"] = run(args, dtype=dtype, which="ours", metrics=0)
        for which, r in res.items():
            print(f"{dtype:>8} {which:>16} {r['peak_mib']:9.0f} {r['seconds']:8.3f} {r['tokens_per_s']:9.0f}")
        res = {k: v for k, v in res.items()}
        for which in ("ours", "ours, no metrics"):
            print(f"{dtype:>8} {'ratio ' + which[4:] if which != 'ours' else 'ratio':>16} "
                  f"{res[which]['peak_mib'] / res['straightforward']['peak_mib']:9.3f} "
                  f"{res[which]['seconds'] / res['straightforward']['seconds']:8.3f}   (targets: <= 0.25, <= 1.1)")
    for V in (args.V // 4, args.V):
        fused = run(args, V=V, dtype="float32", which="fused")
        plain = run(args, V=V, dtype="float32", which="logits")
        print(f"fused hidden-state path, V = {V}: peak {fused['peak_mib']:.0f} MiB (materialised logits: "
              f"{plain['peak_mib']:.0f} MiB), {fused['seconds']:.3f} s, {fused['tokens_per_s']:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
