"""The multi-teacher forward KL, forward + backward, each contender in a FRESH PROCESS with the default
allocator (nothing sets glibc's malloc options), side by side (the contenders of one case run one
after the other, so they see the same machine load):

    careful        the teachers under no_grad pooled into one target A = sum_k w_k p_k, then
                   sum_k w_k sum p_k ln p_k - sum A ln q (one (B, T, V) target, one student log-softmax)
    ours           llm_bridge.losses.forward_kl, metrics=False
    ours, metrics  forward_kl with its default metrics=True (teacher_disagreement, neg_log_z)

on the student's logits, contiguous or shifted (``student[:, :-1]`` and ``teachers[:, :, :-1]`` of
(B, T + 1, V) tensors, the HF / TRL call), float32 and bf16 inputs; and from hidden states:

    liger, K calls       Liger's chunked LigerFusedLinearJSDLoss at beta = 0 (forward KL), torch path
                         (compiled=False), one call per teacher from its hidden states and lm_head
    ours, fused          the teachers' logits projected from the same hidden states (under no_grad, in
                         the timed region: the projections are charged to both), then fused_linear_loss
    (and both at K = 1)  (Liger needs `make oracle`, which unpacks its files; skipped otherwise)

    python benchmarks/bench_losses.py                 # every case below, writes benchmarks/bench_losses.csv
    python benchmarks/bench_losses.py --quick         # V = 32000 logits cases only
    python benchmarks/bench_losses.py --sizes V151936 --layouts contiguous,shifted --out qwen.csv

Peak = the growth of the process's high-water mark (getrusage ru_maxrss) over one cold forward +
backward, above the inputs (which are built without transients: the mark before the call is within
``slack_mib`` of the resident size). Time = the best of ``--repeats`` further calls. Ratios between
contenders of one case, not absolute numbers, are what carries over (the machine may be shared; each
row records the process's ``nice`` value, since a shared machine may lower a long job's priority).
"""

import argparse
import csv
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES = {"V32000": dict(B=2, T=512, V=32000, K=3, H=512), "V151936": dict(B=2, T=128, V=151936, K=3, H=896)}
LOGIT_CONTENDERS = ("careful", "ours", "ours, metrics")
FUSED_CONTENDERS = ("liger, K calls", "ours, fused", "liger, K = 1", "ours, fused, K = 1")
RATIOS = [("ours", "careful"), ("ours, metrics", "careful"), ("ours, fused", "liger, K calls"),
          ("ours, fused, K = 1", "liger, K = 1")]


def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def maxrss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def randn(shape, dtype, gen):
    """A standard normal tensor filled row block by row block (no full-size float32 transient)."""
    import torch
    out = torch.empty(shape, dtype=dtype)
    flat = out.view(-1, shape[-1])
    for lo in range(0, flat.shape[0], 64):
        flat[lo:lo + 64] = torch.randn(flat[lo:lo + 64].shape, generator=gen)
    return out


def child(size_name, dtype_name, layout, contender, repeats, threads):
    """One contender in this (fresh) process; prints one JSON line."""
    import torch
    from llm_bridge.losses import forward_kl, fused_linear_loss
    torch.set_num_threads(threads)
    size = SIZES[size_name]
    B, T, V, K, H = (size[k] for k in "BTVKH")
    dtype = {"float32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    g = torch.Generator().manual_seed(0)
    w = torch.full((K,), 1.0 / K)
    if contender in LOGIT_CONTENDERS:
        extra = 1 if layout == "shifted" else 0
        leaf = randn((B, T + extra, V), dtype, g).requires_grad_()
        teachers_full = randn((K, B, T + extra, V), dtype, g)

        def inputs():
            return (leaf[:, :-1], teachers_full[:, :, :-1]) if extra else (leaf, teachers_full)

        def careful():
            student, teachers = inputs()
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

        def ours(metrics):
            def run():
                student, teachers = inputs()
                forward_kl(student, teachers, w, metrics=metrics)[0].backward()
            return run
        fn = {"careful": careful, "ours": ours(False), "ours, metrics": ours(True)}[contender]
        params = [leaf]
    else:
        hidden = randn((B * T, H), dtype, g).requires_grad_()
        weight = randn((V, H), dtype, g)
        with torch.no_grad():
            weight.mul_(H ** -0.5)
        weight.requires_grad_()
        t_hidden = randn((K, B * T, H), dtype, g)
        t_weight = randn((K, V, H), dtype, g)
        with torch.no_grad():
            t_weight.mul_(H ** -0.5)
        n_teachers = 1 if contender.endswith("K = 1") else K
        params = [hidden, weight]
        if contender.startswith("liger"):
            from llm_bridge.losses import oracle
            liger = oracle.liger_jsd_class()(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0, compiled=False)
            labels = torch.zeros(B * T, dtype=torch.long)
            wk = [1.0] if n_teachers == 1 else w.tolist()

            def fn():
                sum(wk[k] * liger(hidden, weight, t_hidden[k], t_weight[k], labels) for k in range(n_teachers)).backward()
        else:
            wk = [1.0] if n_teachers == 1 else w

            def fn():
                with torch.no_grad():                      # the teachers' projections, charged as Liger's are
                    t_logits = torch.stack([t_hidden[k] @ t_weight[k].T for k in range(n_teachers)])
                fused_linear_loss(hidden.reshape(B, T, H), weight, t_logits.reshape(n_teachers, B, T, V), wk,
                                  metrics=False)[0].backward()
    before, mark = rss_mib(), maxrss_mib()
    fn()
    peak = maxrss_mib() - before
    for p in params:
        p.grad = None
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
    print(json.dumps({"peak_mib": peak, "slack_mib": mark - before, "inputs_mib": before, "time_s": min(times),
                      "nice": os.nice(0)}))


def cases(sizes, dtypes, layouts, liger):
    for size in sizes:
        for dtype in dtypes:
            for layout in layouts:
                if layout != "fused":
                    yield size, dtype, layout, LOGIT_CONTENDERS
                elif liger:
                    yield size, dtype, "fused", FUSED_CONTENDERS


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the V = 32000 logits cases only")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated, of {list(SIZES)}")
    ap.add_argument("--dtypes", default="float32,bf16", help="comma-separated, of float32 and bf16")
    ap.add_argument("--layouts", default="contiguous,shifted,fused", help="comma-separated, of contiguous, "
                    "shifted (the student's logits) and fused (hidden states, against Liger)")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls after the cold (peak) call")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1: on a shared, "
                    "oversubscribed machine every parallel op waits for its threads to be scheduled)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "bench_losses.csv"))
    ap.add_argument("--child", nargs=4, metavar=("SIZE", "DTYPE", "LAYOUT", "CONTENDER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.repeats, args.threads)
        return 0
    from llm_bridge.losses import oracle
    try:
        oracle.source("liger")
        liger = True
    except oracle.OracleMissing:
        liger = False
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}     # the default allocator
    print(f"threads = {args.threads}; fresh process per contender, default allocator; Liger: "
          f"{'LigerFusedLinearJSDLoss 0.8.5 (torch path)' if liger else 'absent (make oracle)'}")
    rows = []
    sizes, layouts = args.sizes.split(","), args.layouts.split(",")
    if args.quick:
        sizes, layouts = ["V32000"], [x for x in layouts if x != "fused"]
    for size, dtype, layout, contenders in cases(sizes, args.dtypes.split(","), layouts, liger):
        result = {}
        for contender in contenders:
            out = subprocess.run([sys.executable, __file__, "--child", size, dtype, layout, contender,
                                  "--repeats", str(args.repeats), "--threads", str(args.threads)],
                                 env=env, capture_output=True, text=True, check=True)
            result[contender] = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"size": size, **SIZES[size], "dtype": dtype, "layout": layout, "contender": contender,
                         **{k: round(v, 4) for k, v in result[contender].items()}})
            result[contender]["nice"] = int(result[contender]["nice"])
        print(f"\n{size} {SIZES[size]}, {dtype}, {layout}")
        print(f"{'':>22} {'peak MiB':>9} {'slack':>6} {'s (f+b)':>8} {'nice':>5}")
        for contender, r in result.items():
            print(f"{contender:>22} {r['peak_mib']:9.0f} {r['slack_mib']:6.0f} {r['time_s']:8.3f} {r['nice']:5d}")
        for a, b in RATIOS:
            if a in result and b in result:
                print(f"{'ratio ' + a + ' / ' + b:>48}: peak {result[a]['peak_mib'] / result[b]['peak_mib']:5.2f}x, "
                      f"time {result[a]['time_s'] / result[b]['time_s']:5.2f}x")
        with open(args.out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
