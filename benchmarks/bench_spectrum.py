"""Speed of the students (distillation/students.py, trained by distillation/training.py), side by side.

    python benchmarks/bench_spectrum.py            # or: make bench
    python benchmarks/bench_spectrum.py --quick

Tabular: one tensor for every run of a sweep (``TabularStudents`` with all the configurations of a
spectrum cell and its seeds) against the same runs one at a time (the same code with one run: a plain
per-run loop), in student updates per second; issue 13 asks for >= 10x. Neural: R tiny Qwen2 students
(``TokenStudents``) trained together under ``torch.func.vmap`` against the same R students trained one
after another (a loop over runs, each a one-run ``TokenStudents``), the same steps, batch and loss; this
ratio is what chose vmap for every neural student (issue 18). The library's FKL is first checked
against the formula written out.
"""

import argparse
import os
import platform
import sys
from datetime import date

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from timing import best_time  # noqa: E402  (benchmarks/timing.py, beside this script)


def tabular(steps, repeats):
    from distillation import tasks, training
    from distillation.students import TabularStudents
    from sims.rollout_spectrum import ALPHAS, spectrum_configs
    task = tasks.make_task("tree", K=2, seed=0)
    configs = spectrum_configs(ALPHAS)
    seeds = [0, 1]
    kw = dict(steps=steps, batch=64, eval_every=steps, fixed_points=False)

    def run(configs, seeds, seed):
        gen = torch.Generator().manual_seed(seed)
        return training.train(task, configs, seeds, TabularStudents(task, len(configs) * len(seeds), gen), gen=gen, **kw)

    def vectorised():
        return run(configs, seeds, 0)

    def per_run():
        return [run([c], [s], 1000 * i + s) for i, c in enumerate(configs) for s in seeds]
    runs = len(configs) * len(seeds)
    # the warm-up: the two do the same work (every run's final loss finite, on the same scale)
    a = vectorised()
    a = a[a.step == steps].loss.to_numpy()
    b = np.concatenate([df[df.step == steps].loss.to_numpy() for df in per_run()])
    assert np.isfinite(a).sum() == np.isfinite(b).sum() == runs
    assert abs(np.median(a) - np.median(b)) < 0.5 * np.median(np.abs(a)) + 1e-3
    t = best_time({"vectorised": vectorised, "per-run loop": per_run}, repeats, warmup=False)
    ups = {k: runs * steps / v for k, v in t.items()}
    return runs, ups


def check_fkl(task, batch=64):
    """The library's FKL (through position_losses) equals the formula written out, on one batch."""
    from distillation import training
    t, H, n = task.teachers, task.horizon, task.teachers.n
    teacher_lp = torch.as_tensor(np.array(t.log_probs), dtype=torch.float32)
    w = torch.as_tensor(task.weights, dtype=torch.float32)
    b = training.rollouts(task, lambda h, s: teacher_lp[0, s], 1.0, False, batch, torch.Generator().manual_seed(1))
    logits = torch.randn(batch, H, n, generator=torch.Generator().manual_seed(2))
    lq, lp = torch.log_softmax(logits, -1), teacher_lp[:, b.states]
    hand = (w[:, None, None] * (lp.exp() * (lp - lq[None])).sum(-1)).sum(0).sum(1).mean()
    assert abs(float(training.position_losses("fkl", logits, b, task).sum(1).mean()) - float(hand)) < 1e-5


def neural(steps, repeats, runs=8, batch=64):
    from distillation import tasks, training
    from distillation.configs import SpectrumConfig
    from distillation.students import TokenStudents
    task = tasks.make_task("tree", K=2, seed=0)
    check_fkl(task)
    n = task.teachers.n
    config = SpectrumConfig(objective="fkl", alpha=1.0, switch=False, importance=False, clip=True)
    seeds = list(range(runs))
    kw = dict(steps=steps, batch=batch, eval_every=steps)

    def run(seeds):
        students = TokenStudents(task, seeds, vocab=n + 1, bos=n, lr=3e-3)
        return training.train(task, [config], seeds, students, gen=torch.Generator().manual_seed(seeds[0]), **kw)

    def vmapped():
        return run(seeds)

    def loop():
        return [run([s]) for s in seeds]
    a = vmapped()
    b = pd.concat(loop())
    for df in (a, b):                               # the warm-up: both learn (final KL to A below its start)
        assert (df[df.step == steps].kl_named.to_numpy() < df[df.step == 0].kl_named.to_numpy()).all()
    return best_time({"vmap": vmapped, "loop": loop}, repeats, warmup=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    steps, repeats = (20, 1) if args.quick else (60, 3)
    print(f"# bench_spectrum  {date.today()}  {platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    runs, ups = tabular(steps, repeats)
    print(f"tabular students: {runs} runs (a spectrum cell: every objective x alpha x weighting, 2 seeds), "
          f"{steps} updates each, batch 64")
    for k, v in ups.items():
        print(f"  {k:14s} {v:10.0f} student updates / s")
    print(f"  speed-up {ups['vectorised'] / ups['per-run loop']:.1f}x  (issue 13: >= 10x)")
    t = neural(steps // 2, repeats)
    print(f"neural students (8 tiny Qwen2, batch 64 each, FKL on their own rollouts): {steps // 2} steps")
    print(f"  vmap {t['vmap']:8.2f} s   loop over runs {t['loop']:8.2f} s   speed-up {t['loop'] / t['vmap']:.1f}x")


if __name__ == "__main__":
    main()
