"""The multi-teacher forward KL, forward + backward, each contender in a FRESH PROCESS with the default
allocator (nothing sets glibc's malloc options), in INTERLEAVED ROUNDS (every round runs each case's
contenders once, in a rotated order, so that they share the machine's load; the summary gives min, median
and max over rounds, and each ratio is taken round by round, pair by pair):

    plain            the teachers under no_grad pooled into one target A = sum_k w_k p_k, then
                     sum_k w_k sum p_k ln p_k - sum A ln q by autograd (four (B, T, V) float32 tensors)
    chunked pooling  the same, the teachers' pooling done a chunk of positions at a time (the fair
                     autograd baseline: one (B, T, V) target, one student log-softmax, autograd's backward)
    chunked Function the Liger pattern in ~30 lines: an autograd.Function that walks chunks of positions,
                     writes each chunk's gradient q - A in closed form into a zeros_like(student) buffer
                     during the forward pass, and hands it over in backward (unscaled when the upstream
                     gradient is 1)
    ours             llm_bridge.losses.forward_kl, metrics=False
    ours, metrics    forward_kl with its default metrics=True (teacher_disagreement, neg_log_z)

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
``slack_mib`` of the resident size). Time = the best of ``--repeats`` further calls. Each row records the
round, the 1-minute load average when its process started and the process's ``nice`` value. Ratios
between contenders of one case, not absolute numbers, are what carries over.
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

SIZES = {"V32000": dict(B=2, T=512, V=32000, K=3, H=512), "V151936": dict(B=2, T=128, V=151936, K=3, H=896),
         "smoke": dict(B=2, T=48, V=32000, K=3, H=64)}         # smoke: a check that the script runs, not a size
LOGIT_CONTENDERS = ("plain", "chunked pooling", "chunked Function", "ours", "ours, metrics")
FUSED_CONTENDERS = ("liger, K calls", "ours, fused", "liger, K = 1", "ours, fused, K = 1")
RATIOS = [("ours", "chunked pooling"), ("ours, metrics", "chunked pooling"), ("ours", "chunked Function"),
          ("ours, metrics", "chunked Function"), ("ours", "plain"), ("chunked pooling", "plain"),
          ("ours, fused", "liger, K calls"), ("ours, fused, K = 1", "liger, K = 1")]


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

        chunk = max(1, (1 << 19) // V)            # positions per chunk: ours' CPU default (about 512K logits)

        def plain():
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
            return loss

        def pooled(teachers, sl):
            """(A, sum_k w_k sum p_k ln p_k) on the positions ``sl``, float32."""
            A, const = None, 0
            for k in range(K):
                lp = torch.log_softmax(teachers[k][sl].float(), -1)
                p = lp.exp()
                const = const + w[k] * (p * lp).sum(-1)
                A = p.mul_(w[k]) if A is None else A.add_(p, alpha=float(w[k]))
            return A, const

        def chunked_pooling():
            student, teachers = inputs()
            with torch.no_grad():
                target = torch.empty(B, T, V)
                const = torch.empty(B, T)
                for b in range(B):
                    for lo in range(0, T, chunk):
                        sl = (b, slice(lo, lo + chunk))
                        target[sl], const[sl] = pooled(teachers, sl)
            loss = (const - (target * torch.log_softmax(student.float(), -1)).sum(-1)).mean()
            loss.backward()
            return loss

        class ChunkedFKL(torch.autograd.Function):
            """The Liger pattern: per chunk, the loss and its gradient (q - A) / N in closed form, forward."""

            @staticmethod
            def forward(ctx, student, teachers):
                grad = torch.zeros_like(student)
                total, n = torch.zeros(()), B * T
                for b in range(B):
                    for lo in range(0, T, chunk):
                        sl = (b, slice(lo, lo + chunk))
                        with torch.no_grad():
                            A, const = pooled(teachers, sl)
                            lq = torch.log_softmax(student[sl].float(), -1)
                            total += const.sum() - (A * lq).sum()
                            grad[sl] = lq.exp_().sub_(A).div_(n)
                ctx.save_for_backward(grad)
                return total / n

            @staticmethod
            def backward(ctx, g):
                (grad,) = ctx.saved_tensors
                return (grad if bool(g == 1) else grad * g), None

        def chunked_function():
            student, teachers = inputs()
            loss = ChunkedFKL.apply(student, teachers)
            loss.backward()
            return loss

        def ours(metrics):
            def run():
                student, teachers = inputs()
                loss = forward_kl(student, teachers, w, metrics=metrics)[0]
                loss.backward()
                return loss
            return run
        fn = {"plain": plain, "chunked pooling": chunked_pooling, "chunked Function": chunked_function,
              "ours": ours(False), "ours, metrics": ours(True)}[contender]
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
    load = os.getloadavg()[0]
    before, mark = rss_mib(), maxrss_mib()
    t0 = time.perf_counter()
    loss = fn()
    cold = time.perf_counter() - t0
    peak = maxrss_mib() - before
    # what every contender of a case must agree on (checked by the parent): the loss and the gradient's norm
    check = [float(loss), float(sum(p.grad.double().square().sum() for p in params) ** 0.5)] if loss is not None else None
    for p in params:
        p.grad = None
    times = [cold] if repeats == 0 else []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
    print(json.dumps({"peak_mib": peak, "slack_mib": mark - before, "inputs_mib": before, "time_s": min(times),
                      "nice": os.nice(0), "load1": load, "check": check}))


def cases(sizes, dtypes, layouts, liger):
    for size in sizes:
        for dtype in dtypes:
            for layout in layouts:
                if layout != "fused":
                    yield size, dtype, layout, LOGIT_CONTENDERS
                elif liger:
                    yield size, dtype, "fused", FUSED_CONTENDERS


def spread(values):
    """(min, median, max)."""
    v = sorted(values)
    n = len(v)
    return v[0], (v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2), v[-1]


def summary(rows):
    """Per case: each contender's peak and time (median [min-max] over rounds), and each ratio of RATIOS taken
    round by round (pairs from one round), as rows of a table."""
    out = []
    keys = sorted({(r["size"], r["dtype"], r["layout"]) for r in rows}, key=lambda k: [r["size"] for r in rows].index(k[0]))
    for size, dtype, layout in keys:
        case = [r for r in rows if (r["size"], r["dtype"], r["layout"]) == (size, dtype, layout)]
        by = {}
        for r in case:
            by.setdefault(r["contender"], {})[r["round"]] = r
        for contender, runs in by.items():
            for what in ("peak_mib", "time_s"):
                lo, med, hi = spread([x[what] for x in runs.values()])
                out.append(dict(size=size, dtype=dtype, layout=layout, quantity=what, of=contender, against="",
                                rounds=len(runs), min=lo, median=med, max=hi))
        for a, b in RATIOS:
            if a in by and b in by:
                common = sorted(set(by[a]) & set(by[b]))
                for what in ("peak_mib", "time_s"):
                    lo, med, hi = spread([by[a][i][what] / by[b][i][what] for i in common])
                    out.append(dict(size=size, dtype=dtype, layout=layout, quantity=what + " ratio", of=a, against=b,
                                    rounds=len(common), min=lo, median=med, max=hi))
    return out


def markdown(table):
    """benchmarks/README.md's tables from a summary CSV: per case each contender's peak and time, median
    [min-max] over rounds, then each ratio (taken round by round) with the baseline it is against."""
    def cell(r, digits):
        return f"{float(r['median']):.{digits}f} [{float(r['min']):.{digits}f}-{float(r['max']):.{digits}f}]"
    lines = []
    cases = list(dict.fromkeys((r["size"], r["dtype"], r["layout"]) for r in table))
    lines += ["| case | contender | peak MiB | s (f+b) | rounds |", "|---|---|---|---|---|"]
    for case in cases:
        rows = [r for r in table if (r["size"], r["dtype"], r["layout"]) == case and not r["against"]]
        for who in dict.fromkeys(r["of"] for r in rows):
            peak, secs = (next(r for r in rows if r["of"] == who and r["quantity"] == q) for q in ("peak_mib", "time_s"))
            lines.append(f"| {' '.join(case)} | {who} | {cell(peak, 0)} | {cell(secs, 2)} | {peak['rounds']} |")
    lines += ["", "| case | ratio | against | peak | time |", "|---|---|---|---|---|"]
    for case in cases:
        rows = [r for r in table if (r["size"], r["dtype"], r["layout"]) == case and r["against"]]
        for pair in dict.fromkeys((r["of"], r["against"]) for r in rows):
            peak, secs = (next(r for r in rows if (r["of"], r["against"]) == pair and r["quantity"] == q + " ratio")
                          for q in ("peak_mib", "time_s"))
            lines.append(f"| {' '.join(case)} | {pair[0]} | {pair[1]} | {cell(peak, 2)}x | {cell(secs, 2)}x |")
    return "\n".join(lines)


def write_csv(path, rows):
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the V = 32000 logits cases only")
    ap.add_argument("--sizes", default="V32000,V151936", help=f"comma-separated, of {list(SIZES)}")
    ap.add_argument("--dtypes", default="float32,bf16", help="comma-separated, of float32 and bf16")
    ap.add_argument("--layouts", default="contiguous,shifted,fused", help="comma-separated, of contiguous, "
                    "shifted (the student's logits) and fused (hidden states, against Liger)")
    ap.add_argument("--contenders", default=None, help="a ';'-separated subset of the contenders (default all)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--repeats", type=int, default=2, help="timed calls after the cold (peak) call (0: the time "
                    "of the cold call itself)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1: on a shared, "
                    "oversubscribed machine every parallel op waits for its threads to be scheduled)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "bench_losses.csv"),
                    help="the rows, one per process; the summary goes beside it (NAME_summary.csv)")
    ap.add_argument("--table", metavar="SUMMARY_CSV", help="print the markdown tables of benchmarks/README.md from "
                    "a summary CSV, and exit")
    ap.add_argument("--child", nargs=4, metavar=("SIZE", "DTYPE", "LAYOUT", "CONTENDER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child, args.repeats, args.threads)
        return 0
    if args.table:
        print(markdown(list(csv.DictReader(open(args.table)))))
        return 0
    from llm_bridge.losses import oracle
    try:
        oracle.source("liger")
        liger = True
    except oracle.OracleMissing:
        liger = False
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}     # the default allocator
    print(f"threads = {args.threads}; fresh process per contender, default allocator, {args.rounds} interleaved "
          f"rounds; {os.cpu_count()} cores; Liger: "
          f"{'LigerFusedLinearJSDLoss 0.8.5 (torch path)' if liger else 'absent (make oracle)'}")
    sizes, layouts = args.sizes.split(","), args.layouts.split(",")
    if args.quick:
        sizes, layouts = ["V32000"], [x for x in layouts if x != "fused"]
    chosen = args.contenders.split(";") if args.contenders else None
    todo = [(size, dtype, layout, [c for c in contenders if chosen is None or c in chosen])
            for size, dtype, layout, contenders in cases(sizes, args.dtypes.split(","), layouts, liger)]
    rows = []
    out = Path(args.out)
    for rnd in range(args.rounds):
        for size, dtype, layout, contenders in todo:
            order = contenders[rnd % len(contenders):] + contenders[:rnd % len(contenders)]     # rotated
            checks = {}
            for contender in order:
                proc = subprocess.run([sys.executable, __file__, "--child", size, dtype, layout, contender,
                                       "--repeats", str(args.repeats), "--threads", str(args.threads)],
                                      env=env, capture_output=True, text=True, check=True)
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                checks[contender] = r.pop("check")
                rows.append({"round": rnd, "size": size, **SIZES[size], "dtype": dtype, "layout": layout,
                             "contender": contender, **{k: round(v, 4) for k, v in r.items()}})
                print(f"round {rnd} {size} {dtype} {layout:>10} {contender:>18}: peak {r['peak_mib']:7.0f} MiB, "
                      f"{r['time_s']:7.3f} s, load {r['load1']:.1f}", flush=True)
            logits = [c for c in checks if c in LOGIT_CONTENDERS]
            for c in logits[1:]:                 # the contenders compute the same loss and gradient
                for x, y in zip(checks[c], checks[logits[0]]):
                    if abs(x - y) > 2e-3 * abs(y):
                        raise SystemExit(f"{c} disagrees with {logits[0]}: {checks[c]} against {checks[logits[0]]}")
            write_csv(out, rows)
            table = summary(rows)                # rewritten after every case: an interrupted run keeps its rounds
            write_csv(out.with_name(out.stem + "_summary.csv"), table)
    for r in table:
        if r["against"]:
            print(f"{r['size']} {r['dtype']} {r['layout']:>10} {r['quantity']:>16} {r['of']} / {r['against']}: "
                  f"{r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
