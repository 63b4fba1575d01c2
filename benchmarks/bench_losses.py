"""The multi-teacher forward KL, forward + backward, side by side in ONE process with the same allocator
settings for every contender (glibc's mmap threshold fixed at 64 KiB before the first measurement, by
llm_bridge._memory, for all of them):

    naive     every teacher's and the student's float32 log-softmax at once, autograd keeps what it needs
    careful   the teachers under no_grad pooled into one target A = sum_k w_k p_k, then
              sum_k w_k sum p_k ln p_k - sum A ln q (one (B, T, V) target, one student log-softmax)
    ours      llm_bridge.losses.forward_kl (chunked, gradient computed in the forward pass)
    liger     Liger's chunked LigerFusedLinearJSDLoss at beta = 0 (forward KL), torch path
              (compiled=False), one call per teacher (K = 1: one call), from hidden states and lm_head
              weights; beside it ours from the same hidden states: fused_linear_loss
              (needs `make oracle`, which unpacks Liger's files; skipped otherwise)

    python benchmarks/bench_losses.py            # two sizes, float32 and bf16 inputs
    python benchmarks/bench_losses.py --quick    # the small size only

Reports the peak resident memory above the inputs during forward + backward (psutil, sampled every
0.5 ms in a thread) and the best of `--repeats` wall times, and the ratios of ours against the careful
implementation and against Liger's. Ratios, not absolute numbers, are what carries over.
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from llm_bridge._memory import peak_rss_mib  # noqa: E402
from llm_bridge.losses import forward_kl, fused_linear_loss  # noqa: E402
from timing import best_time  # noqa: E402

SIZES = {"small": dict(B=2, T=256, V=8192, K=3, H=256), "large": dict(B=2, T=512, V=32000, K=3, H=512)}


def liger_loss_class():
    """LigerFusedLinearJSDLoss from the files `make oracle` unpacks (llm_bridge.losses.oracle)."""
    from llm_bridge.losses import oracle
    try:
        return oracle.liger_jsd_class()
    except oracle.OracleMissing:
        return None


def contenders(size, dtype, liger_class):
    B, T, V, K, H = (size[k] for k in "BTVKH")
    g = torch.Generator().manual_seed(0)
    w = torch.full((K,), 1.0 / K)
    student = torch.randn(B, T, V, generator=g).to(dtype).requires_grad_()
    teachers = torch.randn(K, B, T, V, generator=g).to(dtype)
    hidden = torch.randn(B * T, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype).requires_grad_()
    t_hidden = torch.randn(K, B * T, H, generator=g).to(dtype)
    t_weight = (torch.randn(K, V, H, generator=g) / H ** 0.5).to(dtype)
    with torch.no_grad():
        t_logits = torch.einsum("knh,kvh->knv", t_hidden.float(), t_weight.float()).to(dtype).reshape(K, B, T, V)

    def naive():
        lq = torch.log_softmax(student.float(), -1)
        lp = torch.log_softmax(teachers.float(), -1)
        loss = (w[:, None, None] * (lp.exp() * (lp - lq[None])).sum(-1)).sum(0).mean()
        loss.backward()
        student.grad = None

    def careful():
        with torch.no_grad():
            target = torch.zeros(B, T, V)
            const = torch.zeros(B, T)
            for k in range(K):
                lp = torch.log_softmax(teachers[k].float(), -1)
                p = lp.exp()
                target.add_(w[k] * p)
                const.add_(w[k] * (p * lp).sum(-1))
                del lp, p
        loss = (const - (target * torch.log_softmax(student.float(), -1)).sum(-1)).mean()
        loss.backward()
        student.grad = None

    def ours():
        forward_kl(student, teachers, w, metrics=False)[0].backward()
        student.grad = None

    runs = {"naive": naive, "careful": careful, "ours": ours}

    def ours_fused():
        fused_linear_loss(hidden.reshape(B, T, H), weight, t_logits, w, metrics=False)[0].backward()
        hidden.grad = weight.grad = None
    runs["ours, fused (hidden states)"] = ours_fused
    if liger_class is not None:
        liger = liger_class(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0, compiled=False)
        labels = torch.zeros(B * T, dtype=torch.long)

        def liger_k_calls():
            loss = sum(w[k] * liger(hidden, weight, t_hidden[k], t_weight[k], labels) for k in range(K))
            loss.backward()
            hidden.grad = weight.grad = None

        def liger_one_teacher():
            liger(hidden, weight, t_hidden[0], t_weight[0], labels).backward()
            hidden.grad = weight.grad = None

        def ours_fused_one_teacher():
            fused_linear_loss(hidden.reshape(B, T, H), weight, t_logits[:1], [1.0], metrics=False)[0].backward()
            hidden.grad = weight.grad = None
        runs.update({"liger, K calls": liger_k_calls, "liger, K = 1": liger_one_teacher,
                     "ours, fused, K = 1": ours_fused_one_teacher})
    return runs


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the small size only")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {sorted(SIZES)}")
    ap.add_argument("--dtypes", default="float32,bf16", help="comma-separated, of float32 and bf16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    liger_class = liger_loss_class()
    print(f"threads = {args.threads}; Liger: {'LigerFusedLinearJSDLoss (torch path)' if liger_class else 'absent (make oracle)'}")
    dtypes = {"float32": torch.float32, "bf16": torch.bfloat16}
    for name, size in SIZES.items():
        if name not in args.sizes.split(",") or (args.quick and name != "small"):
            continue
        for dtype in (dtypes[d] for d in args.dtypes.split(",")):
            runs = contenders(size, dtype, liger_class)
            for fn in runs.values():
                fn()                                                     # warm-up, allocator settled
            peaks = {label: peak_rss_mib(fn) for label, fn in runs.items()}
            times = best_time(runs, args.repeats, warmup=False)
            print(f"\n{name} {size}, {str(dtype)[6:]} inputs")
            print(f"{'':>30} {'peak MiB':>9} {'s (f+b)':>8}")
            for label in runs:
                print(f"{label:>30} {peaks[label]:9.0f} {times[label]:8.3f}")
            pairs = [("ours", "careful"), ("ours", "naive"), ("ours, fused (hidden states)", "careful")]
            if liger_class is not None:
                pairs += [("ours, fused (hidden states)", "liger, K calls"), ("ours, fused, K = 1", "liger, K = 1")]
            for a, b in pairs:
                print(f"{'ratio ' + a + ' / ' + b:>60}: peak {peaks[a] / max(peaks[b], 1e-9):6.2f}x, "
                      f"time {times[a] / times[b]:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
