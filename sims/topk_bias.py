"""The bias of top-k teachers: each tail treatment against the full-vocabulary divergence, as a function of
k, on real logits (issue 12; theory section 4's E_q[k3] = KL(q || p) - p(V \\ S) is the same effect for samplers).

    python sims/topk_bias.py        # SmolLM2 and llm_bridge/examples/teachers.json, to results/topk_bias
    python sims/topk_bias.py --model MODEL --teachers TEACHERS.json --out DIR

A teachers file with a ``server`` reaches the personas through vLLM (started with ``--max-logprobs -1``: this
study needs every token's log-probability; ``--model`` then only gives the tokenizer).

The teacher is the first persona of the teachers file, the student the second, both the same model,
scored along a fixed text (their full conditionals at every position). For each k, tail treatment
and direction (forward, reverse), the top-k loss of llm_bridge.losses is compared with the full-
vocabulary one at every position. Writes ``topk_bias.csv`` (k, tail, kind, full, topk, bias, bias_lo,
bias_hi: the mean over positions with a 95% interval) and ``figures/topk_bias.png``.
"""

import os
import sys
from pathlib import Path

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import Parser

from llm_bridge.arguments import EXAMPLE_TEACHERS, add_figures_argument, add_model_arguments

TEXT = ("The river that runs through the old town was once the main road for traders, who carried salt, "
        "wool and timber down to the sea. Today it is quiet, and the bridges are mostly for walkers.")


def parse_args(argv):
    p = Parser(prog="topk_bias", description=__doc__.split("\n\n")[0])
    add_model_arguments(p, sampling=False, teachers=EXAMPLE_TEACHERS)
    p.add_argument("--text", default=TEXT, help="the text both personas score")
    p.add_argument("--out", default="results/topk_bias", help="output folder (default results/topk_bias)")
    add_figures_argument(p, "figures/topk_bias.png")
    return p, p.parse_args(argv)


if __name__ == "__main__":      # --help and a bad argument answer here, before torch and pandas load
    parse_args(sys.argv[1:])

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from harness import write_csv  # noqa: E402

from llm_bridge.backend import InProcess  # noqa: E402
from llm_bridge.losses import TAILS, TopK, forward_kl, reverse_kl  # noqa: E402
from llm_bridge.served import ServerError  # noqa: E402
from llm_bridge.probes import ProbeSettings  # noqa: E402

KS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)


def bias_table(student_logits, teacher_logits, ks=KS, tails=TAILS):
    """Per (k, tail, kind): the full-vocabulary loss, the top-k loss and their difference per position
    (mean and a 95% interval over positions). student_logits, teacher_logits: (1, T, V)."""
    rows = []
    lp = torch.log_softmax(teacher_logits.double(), -1)
    s = student_logits.double()
    for kind, fn in (("forward", forward_kl), ("reverse", reverse_kl)):
        full = fn(s, lp[None], [1.0], reduction="none", metrics=False)[0][0]
        for k in ks:
            if k > lp.shape[-1]:
                continue
            top = lp.topk(k, dim=-1)
            for tail in tails:
                topk = fn(s, [TopK(top.indices, top.values)], [1.0], reduction="none", tail=tail, metrics=False)[0][0]
                diff = (topk - full).numpy()
                half = 1.96 * diff.std(ddof=1) / np.sqrt(diff.size)
                rows.append(dict(k=k, tail=tail, kind=kind, full=float(full.mean()), topk=float(topk.mean()),
                                 bias=float(diff.mean()), bias_lo=float(diff.mean() - half),
                                 bias_hi=float(diff.mean() + half), positions=int(diff.size)))
    return pd.DataFrame(rows)


def full_log_probs(personas, prompt, text):
    """(2, T, V) float32 tensor: the first two personas' full conditionals along ``text``, in process or through
    their server (:meth:`llm_bridge.served.Served.distributions`: a server started with --max-logprobs -1)."""
    backend = personas.served() if personas.teachers is None else InProcess(personas.teachers)
    out = torch.empty(2, len(text), len(personas.tokenizer))
    for _, t, lp in backend.distributions([(prompt, text)], models=[0, 1]):
        out[:, t] = lp[..., :out.shape[-1]].float().cpu()
    return out


def main(argv=None):
    p, args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if not args.text.strip():
            raise ValueError("text is empty")
        settings = ProbeSettings.from_args(args)
        if len(settings.personas) < 2:
            raise ValueError("the teachers file needs two personas: the teacher, then the student")
        personas = settings.load()
        tok = personas.tokenizer
        prompt = personas.prompt_ids("Describe the old town.")
        text = list(tok(" " + args.text.strip(), add_special_tokens=False)["input_ids"])
        full = full_log_probs(personas, prompt, text)                              # (2, T, V)
        table = bias_table(full[1][None], full[0][None])
        out = Path(args.out)
        write_csv(out / "topk_bias.csv", table)
        paths = []
        if not args.no_figures:
            import figures
            paths = figures.rebuild(str(out))
    except (ValueError, OSError, ServerError) as exc:
        p.error(str(exc))
    print(table[table.k.isin((1, 16, 256, 4096))].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print("wrote " + ", ".join([os.path.abspath(out / "topk_bias.csv")] + [os.path.abspath(x) for x in paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
