"""Speed of the rollout-spectrum students (distillation/training.py), side by side with plain PyTorch loops.

    python benchmarks/bench_spectrum.py            # or: make bench
    python benchmarks/bench_spectrum.py --quick

Tabular: one tensor for every run of a sweep (``train_tabular`` with all the configurations of a
spectrum cell and its seeds) against the same runs one at a time (the same code with one run: a plain
per-run PyTorch loop), in student updates per second; issue 13 asks for >= 10x. Neural: one
``neural_step`` (rollouts by the student, the loss by llm_bridge.losses, clipping, Adam) against a
hand-written step with the same tiny Qwen2, the same loss function (llm_bridge.losses.forward_kl) and
the same batch size, so the ratio is the overhead of the spectrum's machinery; issue 13 asks for a
ratio <= 1.2. The library's FKL is first checked against the formula written out.
"""

import argparse
import os
import platform
import sys
from datetime import date

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from timing import best_time  # noqa: E402  (benchmarks/timing.py, beside this script)


def tabular(steps, repeats):
    from distillation import tasks, training
    from sims.rollout_spectrum import ALPHAS, spectrum_configs
    task = tasks.make_task("tree", K=2, seed=0)
    configs = spectrum_configs(ALPHAS)
    seeds = [0, 1]
    kw = dict(steps=steps, batch=64, lr=0.05, eval_every=steps, fixed_points=False)

    def vectorised():
        return training.train_tabular(task, configs, seeds, **kw)

    def per_run():
        return [training.train_tabular(task, [c], [s], seed=1000 * i + s, **kw) for i, c in enumerate(configs) for s in seeds]
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


def neural(steps, repeats, batch=64):
    from llm_bridge.losses import forward_kl
    from distillation import tasks, training
    from distillation.configs import SpectrumConfig
    from llm_bridge.models import tiny_model
    task = tasks.make_task("tree", K=2, seed=0)
    t, H, n = task.teachers, task.horizon, task.teachers.n
    next_state = torch.as_tensor(np.array(t.next_state))
    teacher_lp = torch.as_tensor(np.array(t.log_probs), dtype=torch.float32)
    w = torch.as_tensor(task.weights, dtype=torch.float32)
    config = SpectrumConfig(objective="fkl", alpha=1.0, switch=False, importance=False, clip=True)

    def make():
        model = tiny_model("qwen2", vocab_size=n + 1, seed=0)
        return model, torch.optim.Adam(model.parameters(), lr=3e-3), torch.Generator().manual_seed(0)

    m1, o1, g1 = make()
    m2, o2, g2 = make()

    def ours():
        return training.neural_step(m1, o1, task, config, batch, g1)

    def plain():                                   # the hand-written step: generate, score, KL, clip, Adam
        ids = torch.full((batch, 1), n, dtype=torch.long)
        states = torch.full((batch,), t.start, dtype=torch.long)
        rows = []
        with torch.no_grad():
            for _ in range(H):
                probs = torch.softmax(m2(input_ids=ids).logits[:, -1, :n].float(), -1)
                tok = torch.multinomial(probs, 1, generator=g2)
                rows.append(states)
                states = next_state[states, tok[:, 0]].clamp(min=0)
                ids = torch.cat([ids, tok], dim=1)
        logits = m2(input_ids=ids[:, :-1]).logits[..., :n]                                   # (B, H, n)
        lp = teacher_lp[:, torch.stack(rows, 1)]                                             # (K, B, H, n)
        loss = forward_kl(logits, lp, w.double(), reduction="none", metrics=False)[0].sum(1).mean()
        o2.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m2.parameters(), 1.0)
        o2.step()
        return float(loss.detach())
    # the loss: on one batch, the library's FKL (through position_losses) equals the formula written out
    b = training.rollouts(task, lambda h, s, tok: teacher_lp[0, s], 1.0, False, batch, torch.Generator().manual_seed(1))
    logits = torch.randn(batch, H, n, generator=torch.Generator().manual_seed(2))
    lq, lp = torch.log_softmax(logits, -1), teacher_lp[:, b.states]
    hand = (w[:, None, None] * (lp.exp() * (lp - lq[None])).sum(-1)).sum(0).sum(1).mean()
    assert abs(float(training.position_losses("fkl", logits, b, task).sum(1).mean()) - float(hand)) < 1e-5
    t = best_time({"ours": lambda: [ours() for _ in range(steps)], "plain": lambda: [plain() for _ in range(steps)]},
                  repeats)
    return t


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
    t = neural(steps // 4, 2 * repeats - 1)
    print(f"neural student (tiny Qwen2, batch 64, FKL on its own rollouts): {steps // 4} steps")
    print(f"  neural_step {t['ours'] * 1e3:8.1f} ms   plain loop {t['plain'] * 1e3:8.1f} ms   "
          f"ratio {t['ours'] / t['plain']:.2f}  (issue 13: <= 1.2)")


if __name__ == "__main__":
    main()
