"""Other libraries' loss functions, run from their unpacked wheels without importing their packages
(the oracle tier, ``make oracle``; tests/test_losses_oracle.py and benchmarks/bench_losses.py).

``make oracle`` unpacks the files below under ``.cache/oracle/<package>/`` (or ``$LOSSES_ORACLE_DIR``).
A function is executed alone from its source (``ast``) in a namespace holding torch and F; Liger's
chunked JSD is loaded from its two files under stub parent packages, so Triton is never imported.
"""

import ast
import importlib.util
import math
import os
import sys
import textwrap
import types
from pathlib import Path

import torch
import torch.nn.functional as F

ORACLE = Path(os.environ.get("LOSSES_ORACLE_DIR", Path(__file__).resolve().parents[2] / ".cache" / "oracle"))
SOURCES = {  # unpacked wheel -> the one file read
    "trl": "trl/experimental/gkd/gkd_trainer.py",
    "verl": "verl/trainer/ppo/core_algos.py",
    "torchrl": "torchrl/objectives/llm/distillation.py",
    "liger": "liger_kernel/chunked_loss/jsd_loss.py",
}


class OracleMissing(LookupError):
    """The package's files are not unpacked (run ``make oracle``)."""


def source(package):
    path = ORACLE / package / SOURCES[package]
    if not path.exists():
        raise OracleMissing(f"{package}'s wheel is not unpacked under {ORACLE} (run `make oracle`)")
    return path


def functions(package, *names, cls=None):
    """The named top-level functions (or methods of class ``cls``) of the package's file, executed alone
    in a namespace holding torch and F: no import of the package (nor of its dependencies)."""
    path = source(package)
    text = path.read_text()
    tree = ast.parse(text)
    scope = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body if cls else tree.body
    namespace = {"torch": torch, "F": F, "math": math}
    for node in scope:
        if isinstance(node, ast.FunctionDef) and node.name in names:
            exec(textwrap.dedent(ast.get_source_segment(text, node)), namespace)
    return [namespace[n] for n in names]


def liger_jsd_class():
    """Liger's LigerFusedLinearJSDLoss from its two files, under stub parent packages (no Triton import)."""
    path = source("liger")
    saved = {name: sys.modules.get(name) for name in ("liger_kernel", "liger_kernel.chunked_loss",
                                                      "liger_kernel.chunked_loss.fused_linear_distillation")}
    try:
        for name in ("liger_kernel", "liger_kernel.chunked_loss"):
            stub = types.ModuleType(name)
            stub.__path__ = []
            sys.modules[name] = stub
        modules = {}
        for name in ("fused_linear_distillation", "jsd_loss"):
            full = f"liger_kernel.chunked_loss.{name}"
            spec = importlib.util.spec_from_file_location(full, path.parent / f"{name}.py")
            modules[name] = importlib.util.module_from_spec(spec)
            sys.modules[full] = modules[name]
            spec.loader.exec_module(modules[name])
        return modules["jsd_loss"].LigerFusedLinearJSDLoss
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
