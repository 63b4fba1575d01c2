"""Figures: pure functions from the tidy CSVs of a results folder to matplotlib Figures.

    python -m figures [--results DIR]     # rebuild every figure of every results folder under DIR
    python -m figures --gallery           # ... then copy the headline figures to docs/figures/, the
                                          # studies' verdicts.csv to docs/verdicts/ and regenerate the
                                          # verdict block of each study's page (VERDICT_PAGES) and the
                                          # gallery page (GALLERY_PAGE, GALLERY_CAPTIONS) from them
    figures.rebuild(folder)               # what the experiment scripts call at the end of a run

A results folder is recognised by the CSVs it holds (``KINDS``): ``regret.csv`` (``sims/regret.py``),
``<mechanism>.csv`` (``sims/mechanisms.py``), ``margins.csv`` (the LLM-bridge probes), ``topk_bias.csv``
(``python sims/topk_bias.py``), ``spectrum.csv`` (``sims/rollout_spectrum.py``), ``gradients.csv``
(``sims/estimators.py``), ``loglinear.csv`` (``sims/forgetting.py``), ``curves.csv`` (``sims/rlvr.py``),
``flip_questions.csv`` / ``flip_validation.csv`` (``python sims/flip_horizon.py``), ``vetoes.csv``
(``python sims/diagnose.py``). Its figures go to
``<folder>/figures/``. Each figure module builds Figures with matplotlib's object API (no pyplot,
no backend switch): building a figure changes no global state.
"""

import importlib
import os
import shutil
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    """One kind of results folder: ``matches(folder)`` says whether a folder is one, ``build(folder)``
    returns {file stem: Figure} from its CSVs."""
    name: str
    matches: object
    build: object


def _exists(*names):
    return lambda folder: any(os.path.exists(os.path.join(folder, n)) for n in names)


def _module(name):
    """build(folder) of the figure module ``figures.<name>`` (imported when first used)."""
    return lambda folder: importlib.import_module(f"{__name__}.{name}").figures_from(folder)


KINDS = (
    Kind("regret", _exists("regret.csv"), _module("regret")),
    Kind("mechanisms", _exists("confident-expert.csv", "low-prob.csv", "prefix-bias.csv"), _module("mechanisms")),
    Kind("probe", _exists("margins.csv"), _module("probe")),
    Kind("topk", _exists("topk_bias.csv"), _module("topk")),
    Kind("spectrum", _exists("spectrum.csv"), _module("spectrum")),
    Kind("estimators", _exists("gradients.csv"), _module("estimators")),
    Kind("forgetting", _exists("loglinear.csv"), _module("forgetting")),
    Kind("rlvr", _exists("curves.csv"), _module("rlvr")),
    Kind("flip_horizon", _exists("flip_questions.csv", "flip_validation.csv"), _module("flip_horizon")),
    Kind("diagnosis", lambda folder: _exists("positions.csv")(folder) and _exists("vetoes.csv")(folder),
         _module("diagnosis")),             # docs/diagnose/* keeps vetoes.csv without the per-position table
)

# The headline figures kept under version control (docs/figures/), refreshed only by --gallery.
GALLERY_DIR = os.path.join("docs", "figures")
GALLERY = {
    "regret": ("regret_offpolicy-tabular", "regret_offpolicy-sequence", "regret_onpolicy-tabular",
               "regret_onpolicy-sequence", "regret_function-approx"),
    "mechanisms": ("mechanism_confident-expert", "mechanism_confident-expert_learned", "mechanism_low-prob",
                   "mechanism_low-prob_learned", "mechanism_prefix-bias", "mechanism_prefix-bias_learned"),
    "topk_bias": ("topk_bias",),
    "rollout_spectrum": ("spectrum", "spectrum_neural", "spectrum_verdicts"),
    "estimators": ("estimators",),
    "forgetting": ("forgetting_shares", "forgetting"),
    "rlvr": ("rlvr", "rlvr_cost"),
    "flip_horizon": ("flip_horizon",),
}
DPI = 200


def save(fig, path, dpi=DPI):
    """Write one Figure as PNG (atomically: a reader never sees half a file)."""
    from harness import atomic_write
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=dpi, format="png"))
    return path


def rebuild(folder, fig_dir=None, quiet=True):
    """Rebuild every figure of one results folder into ``fig_dir`` (default ``folder/figures``);
    returns the paths written (none when the folder holds no known CSVs)."""
    fig_dir = fig_dir or os.path.join(folder, "figures")
    paths = []
    for kind in KINDS:
        if kind.matches(folder):
            for stem, fig in kind.build(folder).items():
                paths.append(save(fig, os.path.join(fig_dir, f"{stem}.png")))
                if not quiet:
                    print(f"wrote {paths[-1]}", file=sys.stderr)
    return paths


def results_folders(root):
    """``root`` and every folder below it (cells/ and figures/ aside) that holds a known kind of CSV."""
    found = []
    for dirpath, dirnames, _ in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("cells", "figures") and not d.startswith("."))
        if any(kind.matches(dirpath) for kind in KINDS):
            found.append(dirpath)
    return found


def rebuild_all(root="results", quiet=True):
    """Rebuild the figures of every results folder under ``root``; returns the paths written."""
    return [p for folder in results_folders(root) for p in rebuild(folder, quiet=quiet)]


VERDICT_STUDIES = ("rollout_spectrum", "estimators", "forgetting", "rlvr")   # the studies that write a verdicts.csv
VERDICTS_DIR = os.path.join("docs", "verdicts")
# Where the generated blocks live: each study's verdict table on its page of the documentation site, the
# gallery on its own page; the pages sit under docs/, so they show the figures as figures/<stem>.png.
VERDICT_PAGES = {study: os.path.join("docs", "studies", f"{study}.md") for study in VERDICT_STUDIES}
GALLERY_PAGE = os.path.join("docs", "gallery.md")
GALLERY_LINKS = "figures"    # docs/figures/ as the gallery page links it
# The gallery: (figure, what it shows, the verdict rows (study, claim, condition) it states).
GALLERY_CAPTIONS = (
    ("regret_offpolicy-tabular", "off-policy learners: logarithmic regret at the theory's constants (T3)", ()),
    ("mechanism_low-prob", "one teacher's tiny probability vetoes the geometric pool (T7)", ()),
    ("mechanism_prefix-bias", "the sequence-level geometric target flips to the incorrect prefix beyond H* (T8)", ()),
    ("spectrum", "distance to each objective's target across the rollout spectrum, bars the range over task draws",
     (("rollout_spectrum", "E1 FKL is flat", "tabular"), ("rollout_spectrum", "E1 FKL is flat", "capacity"),
      ("rollout_spectrum", "E2 k3 needs student rollouts", ""),
      ("rollout_spectrum", "E2 k3 on teacher samples is a biased fixed point", ""))),
    ("forgetting_shares", "shares of the variance of forgetting by factor",
     (("forgetting", "E3 the learning rate governs", "loglinear, full design"),
      ("forgetting", "E3 the learning rate governs", "loglinear, learning rates that learn B"),
      ("forgetting", "E3 alpha leaves forgetting unchanged at equal quality", "loglinear, FKL"),
      ("forgetting", "E3 alpha leaves forgetting unchanged at equal quality", "loglinear, PG1"))),
    ("rlvr", "OOD accuracy after distillation and after RL, on-policy minus offline",
     (("rlvr", "E4 an on-policy edge", "loglinear, shared, FKL"),
      ("rlvr", "E4 the edge does not survive RL", "loglinear, shared, FKL"),
      ("rlvr", "E4 control: on-policy sampling carries an OOD edge beyond fresh", "loglinear, shared, FKL"))),
    ("rlvr_cost", "quality against tokens spent, offline traces and on-policy rollouts",
     (("rlvr", "E6 on-policy distillation needs more tokens than the offline arm to reach the offline arm's final KL",
       "loglinear, shared, f = 1, on-policy FKL against its offline arm (1,024"),
      ("rlvr", "E6 offline traces reach parity with on-policy distillation at a lower cost (final ID",
       "neural, shared, f = 1, on-policy FKL against its offline arm (1,024"),
      ("rlvr", "E6 offline traces reach parity with on-policy distillation at a lower cost (final ID",
       "loglinear, shared, f = 1, on-policy FKL against its offline arm (4,096"))),
    ("estimators", "k1/k2/k3: bias, variance and gradient targets (theory section 4)",
     (("estimators", "the k2 loss gives the RKL gradient", ""), ("estimators", "the k3 loss gives the FKL gradient", ""),
      ("estimators", "the k2 loss on teacher samples is biased", ""),
      ("estimators", "k3 has a smaller variance than k1", "x ~ q, one sample, exact, spread 0.5"),
      ("estimators", "k3 has a smaller variance than k1", "x ~ q, one sample, exact, spread 2"))),
)


def verdict_frames(verdicts_dir=VERDICTS_DIR):
    """{study: its verdicts DataFrame} from the copies in ``verdicts_dir``, in VERDICT_STUDIES order."""
    import pandas as pd
    return {s: pd.read_csv(os.path.join(verdicts_dir, f"{s}.csv")) for s in VERDICT_STUDIES
            if os.path.exists(os.path.join(verdicts_dir, f"{s}.csv"))}


def _rewrite(path, edit):
    """Apply ``edit`` (text -> text) to the file at ``path``, atomically."""
    from harness import atomic_write
    with open(path) as f:
        text = edit(f.read())

    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    atomic_write(path, write)


def refresh_verdicts(root="results", verdicts_dir=VERDICTS_DIR, pages=VERDICT_PAGES, gallery=GALLERY_PAGE):
    """Copy each study's ``root/<study>/verdicts.csv`` to ``verdicts_dir/<study>.csv`` and regenerate the
    verdict block of each study's page (``pages`` {study: path}) and the gallery block of ``gallery`` from
    the copies; returns the copies. ValueError naming a missing file."""
    copies = []
    for study in VERDICT_STUDIES:
        src = os.path.join(root, study, "verdicts.csv")
        if not os.path.exists(src):
            raise ValueError(f"{src} is missing: run the {study} script (default settings) first")
        os.makedirs(verdicts_dir, exist_ok=True)
        copies.append(shutil.copyfile(src, os.path.join(verdicts_dir, f"{study}.csv")))
    write_verdict_pages(verdicts_dir, pages, gallery)
    return copies


def write_verdict_pages(verdicts_dir=VERDICTS_DIR, pages=VERDICT_PAGES, gallery=GALLERY_PAGE):
    """Regenerate the verdict block of each study's page and the gallery block from the copies in
    ``verdicts_dir`` (what ``refresh_verdicts`` does after copying)."""
    from .verdicts import GALLERY_BEGIN, GALLERY_END, gallery_table, markdown_table, replace_block
    frames = verdict_frames(verdicts_dir)
    for study, page in pages.items():
        _rewrite(page, lambda text, study=study: replace_block(text, markdown_table({study: frames[study]})))
    _rewrite(gallery, lambda text: replace_block(text, gallery_table(GALLERY_CAPTIONS, frames, GALLERY_LINKS),
                                                 GALLERY_BEGIN, GALLERY_END))


def refresh_gallery(root="results", gallery_dir=GALLERY_DIR):
    """Copy the headline figures from ``root/<experiment>/figures`` to ``gallery_dir``; returns the copies.
    Raises ValueError naming the first headline figure that is missing (run its script first)."""
    copies = []
    for experiment, stems in GALLERY.items():
        for stem in stems:
            src = os.path.join(root, experiment, "figures", f"{stem}.png")
            if not os.path.exists(src):
                raise ValueError(f"{src} is missing: run the {experiment} script (default settings) first")
            os.makedirs(gallery_dir, exist_ok=True)
            copies.append(shutil.copyfile(src, os.path.join(gallery_dir, f"{stem}.png")))
    return copies
