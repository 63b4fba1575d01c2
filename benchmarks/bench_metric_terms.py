"""The losses' metric terms on one CPU chunk (the default chunk: about 512K float32 logits), torch, interleaved:

    xlogy + sum    torch.xlogy(A, A).sum(-1): sum A ln A with 0 log 0 = 0 in one op (the metrics' old way)
    log + dot      torch.linalg.vecdot(A, torch.log(A)): the same sum (NaN where A = 0, redone with xlogy)
    exp + sum      torch.exp(r).sum(-1): -ln z's sum
    log_softmax    one teacher's log-probabilities: a pass every loss makes, for scale

    python benchmarks/bench_metric_terms.py [--rounds 7] [--repeats 50] [--threads 1] [--out PATH]

A is a row-normalised positive (n, V) float32 array, r = sum of three weighted log-softmaxes; every round
runs each contender ``--repeats`` times in a rotated order and records its mean time a call; the CSV
(``benchmarks/bench_metric_terms.csv``) has one row per round and contender and the summary min / median / max.
"""

import argparse
import csv
import os
import platform
import time

import torch

SHAPES = {"V32000": (16, 32000), "V151936": (3, 151936)}           # the CPU default chunk's rows at each V


def contenders(A, r, buf):
    return {"xlogy + sum": lambda: torch.xlogy(A, A, out=buf).sum(-1),
            "log + dot": lambda: torch.linalg.vecdot(A, torch.log(A, out=buf)),
            "exp + sum": lambda: torch.exp(r, out=buf).sum(-1),
            "log_softmax": lambda: torch.log_softmax(r, -1)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_metric_terms.csv"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for size, (n, V) in SHAPES.items():
        lp = torch.log_softmax(torch.randn(3, n, V, generator=gen), -1)
        A, r, buf = lp.exp().mean(0), lp.mean(0), torch.empty(n, V)
        fns = contenders(A, r, buf)
        a, b = fns["xlogy + sum"](), fns["log + dot"]()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)          # the two ways give one sum
        names = list(fns)
        for rnd in range(args.rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                fns[name]()
                t0 = time.perf_counter()
                for _ in range(args.repeats):
                    fns[name]()
                rows.append(dict(round=rnd, size=size, n=n, V=V, contender=name, threads=args.threads,
                                 us_per_call=round((time.perf_counter() - t0) / args.repeats * 1e6, 2),
                                 load1=round(os.getloadavg()[0], 2), machine=platform.processor() or platform.machine()))
    with open(args.out + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    os.replace(args.out + ".tmp", args.out)
    for size in SHAPES:
        for name in names:
            t = sorted(r["us_per_call"] for r in rows if r["size"] == size and r["contender"] == name)
            print(f"{size:8} {name:12} median {t[len(t) // 2]:9.1f} us [{t[0]:.1f}-{t[-1]:.1f}] over {len(t)} rounds")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
