"""The prefix-bias probe on real causal LMs (theory section 2 "prefix bias", theory section 6): the library behind
``python sims/probe_prefix_bias.py`` (one question) and ``python sims/probe_batch.py``.

For a question with a known correct answer, each answer option (a prefix of the response) is scored
under every teacher, the local geometric pool l, the sequence-level mixture and the sequence-level
geometric pool g with H continuation tokens after the option, for several H. The margin of a scorer
is ``ln s(correct) - max_{o != correct} ln s(o)``; a *flip* at a horizon means every teacher's margin
is > 0 and g's is < 0, *significant* when g's 95% upper bound is < 0 as well.

    settings = ProbeSettings.from_args(args)      # validates every argument and the teachers file
    teachers = settings.load()                    # only then loads the model
    scores, summary = run_probe(teachers, question, options, correct, settings)
    write_probe(folder, scores, summary)          # scores.csv, margins.csv, summary.json
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from aggregation.validate import check_int, check_weights
from harness import atomic_write, write_csv

from .models import (DTYPES, PersonaTeachers, load_model, load_tokenizer, read_jsonl, read_teachers_file,
                     resolve_model_path)
from .partition import Z_95, sequence_geometric_scores, sequence_geometric_scores_backend
from .teachers import resolve_device


def parse_horizons(text):
    """Comma-separated horizons >= 0 -> sorted unique list; ValueError on anything else."""
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


def check_question(question, options, correct):
    """Validate one probe question; returns the index of the correct option (its text or an index)."""
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question is empty")
    options = list(options)
    if len(options) < 2:
        raise ValueError(f"options needs at least 2 entries, got {len(options)}")
    for i, o in enumerate(options):
        if not isinstance(o, str) or not o.strip():
            raise ValueError(f"options[{i}] = {o!r} is empty")
    if len(set(options)) < len(options):
        raise ValueError(f"options must differ, got {options}")
    if correct in options:
        return options.index(correct)
    try:
        i = int(correct)
    except (TypeError, ValueError):
        i = None
    if i is None or not 0 <= i < len(options):
        raise ValueError(f"correct = {correct!r} is neither one of the options {options} nor an index")
    return i


@dataclass
class ProbeSettings:
    """Everything a probe needs besides the question, validated before any model is loaded."""
    model: str
    teachers_file: str
    horizons: list
    n_samples: int = 64
    seed: int = 0
    batch_size: object = None
    device: str = "cpu"
    dtype: str = "auto"

    def __post_init__(self):
        self.horizons = parse_horizons(",".join(map(str, self.horizons)) if not isinstance(self.horizons, str)
                                       else self.horizons)
        self.n_samples = check_int(self.n_samples, "n_samples", 1)
        self.seed = check_int(self.seed, "seed", 0)
        if self.batch_size is not None:
            self.batch_size = check_int(self.batch_size, "batch_size", 1)
        resolve_device(self.device)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype = {self.dtype!r} must be one of {sorted(DTYPES)} or 'auto'")
        self.format, self.personas, weights = read_teachers_file(self.teachers_file)
        self.weights = check_weights(weights, len(self.personas), name=f"teachers file {self.teachers_file}: weights",
                                     other="teachers")
        resolve_model_path(self.model)

    def as_dict(self):
        """What a probe's result depends on besides the question (JSON-able): a resumed batch reuses a
        saved question only when all of it is unchanged."""
        return dict(model=self.model, horizons=self.horizons, n_samples=self.n_samples, seed=self.seed,
                    batch_size=self.batch_size, device=self.device, dtype=self.dtype, format=self.format,
                    personas=self.personas, weights=self.weights.tolist())

    @classmethod
    def from_args(cls, args):
        """The settings of a parsed command line (llm_bridge.arguments); a study that samples no
        continuations has no --horizons, --n-samples, --batch-size or --seed and gets the defaults."""
        return cls(str(args.model), args.teachers, getattr(args, "horizons", "0"), getattr(args, "n_samples", 64),
                   getattr(args, "seed", 0), getattr(args, "batch_size", None), args.device, args.dtype)

    def load(self):
        """PersonaTeachers of the model under the file's personas (loads the model); for teachers behind a
        server (the file's ``server``) only the text side: the tokenizer loads, the server answers."""
        if any("server" in p for p in self.personas):
            return PersonaTeachers(None, load_tokenizer(self.model), self.personas, self.weights, self.format)
        model, tok = load_model(self.model, self.device, self.dtype)
        return PersonaTeachers(model, tok, self.personas, self.weights, self.format, device=self.device)


def run_probe(persona_teachers, question, options, correct, settings, progress=False):
    """Run one probe; returns (tidy scores DataFrame, summary dict). ``correct``: option text or index."""
    c = check_question(question, options, correct)
    bridge = persona_teachers.teachers
    prompt = persona_teachers.prompt_ids(question)
    option_ids = persona_teachers.option_ids(options)
    names, weights = persona_teachers.names, np.asarray(settings.weights, dtype=float)
    if bridge is None:                  # teachers behind a server: no l, ln Z from the teachers' own samples
        df = sequence_geometric_scores_backend(persona_teachers.served(), weights, prompt, option_ids,
                                               settings.horizons, settings.n_samples, settings.seed, names)
    else:
        df = sequence_geometric_scores(bridge, prompt, option_ids, settings.horizons, settings.n_samples,
                                       settings.seed, settings.batch_size, progress)
    df.insert(3, "option_text", [options[i] for i in df["option"]])
    df["correct"] = df["option"] == c
    summary = summarise(df, names, c)
    summary.update(question=question, options=list(options), correct=options[c], horizons=settings.horizons,
                   n_samples=settings.n_samples, seed=settings.seed, weights=weights.tolist(),
                   teachers=names, option_tokens=[len(o) for o in option_ids],
                   reward=df.attrs["reward"].tolist(), model=settings.model, device=settings.device,
                   served=bridge is None)
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


def write_probe(folder, scores, summary):
    """scores.csv, margins.csv (what the figure reads) and summary.json under ``folder``; their paths."""
    folder = Path(folder)
    correct = summary["options"].index(summary["correct"])
    paths = [folder / "scores.csv", folder / "margins.csv", folder / "summary.json"]
    write_csv(paths[0], scores)
    write_csv(paths[1], margins(scores, correct))
    atomic_write(paths[2], lambda p: Path(p).write_text(json.dumps(summary, indent=1)))
    return paths


def describe(summary):
    """One line per horizon: g's margin with its interval, l's, the mixture's, and the flip flag."""
    return "\n".join(
        f"H={r['horizon']:>4}  margin g={r['margin']['geometric']:+.3f} "
        f"[{r['geometric_margin_ci'][0]:+.3f}, {r['geometric_margin_ci'][1]:+.3f}]  "
        + (f"l={r['margin']['local_geometric']:+.3f}  " if "local_geometric" in r["margin"] else "l=n/a (served)  ")
        + f"mixture={r['margin']['mixture']:+.3f}  "
        f"teachers={'correct' if r['teachers_prefer_correct'] else 'not all correct'}"
        f"{'  FLIP' if r['flip'] else ''}" for r in summary["per_horizon"])


# ------------------------------------------------------------------------------------------------
# a batch of questions (probe_batch)
# ------------------------------------------------------------------------------------------------
QUESTION_KEYS = ("id", "question", "options", "correct", "kind")     # kind: an optional label of the question


def read_questions(path):
    """Validated questions: a list of dicts with id, question, options, correct (and optionally kind).

    An unknown key (a typo such as ``"optins"``) is a ValueError naming it and the nearest valid key."""
    out, seen = [], set()
    for i, q in read_jsonl(path, "questions", QUESTION_KEYS, "a question"):
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
