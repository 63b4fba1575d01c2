"""paper_repro.md's shape and its numbers: one H1, a table of contents whose links resolve, a glance table of
one short line per claim, and the E3 numbers it quotes matched to the committed CSV they come from."""

import re

import pandas as pd
import pytest

from conftest import ROOT

CLAIMS = [f"T{i}" for i in range(1, 9)] + [f"E{i}" for i in range(1, 7)]


def _text():
    return (ROOT / "paper_repro.md").read_text()


def _slug(heading):
    """Python-Markdown's default toc slug (what mkdocs links to)."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())


def _glance():
    text = _text()
    block = text[text.index("## Verdicts at a glance"):text.index("## The theory (T1-T8)")]
    return [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| claim")]


def test_one_h1_and_contents_links_that_resolve():
    text = _text()
    outside_code = re.sub(r"```.*?```", "", text, flags=re.S)
    assert [line for line in outside_code.splitlines() if line.startswith("# ")] == ["# Reproducing the papers' claims"]
    slugs = {_slug(line.lstrip("#").strip()) for line in outside_code.splitlines() if line.startswith("##")}
    contents = text[text.index("**Contents.**"):text.index("## Verdicts at a glance")]
    links = re.findall(r"\]\(#([^)]+)\)", contents)
    assert len(links) >= 5 and set(links) <= slugs, set(links) - slugs


def test_the_glance_table_has_one_line_per_claim_of_at_most_40_words():
    rows = _glance()
    assert [r.split("|")[1].split()[0] for r in rows] == CLAIMS
    for r in rows:
        verdict = r.split("|")[2]
        assert len(verdict.split()) <= 40, r
        assert re.search(r"\*\*(reproduces|under stated conditions|does not|inconclusive|mixed|not parity|"
                         r"not observed)", verdict), r


def _printed(value, text):
    """Whether ``value`` prints as ``text`` at the decimals ``text`` shows (0 for an integer)."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return f"{value:.{decimals}f}" == text


@pytest.mark.parametrize("claim", ["E3"])
def test_quoted_estimates_and_intervals_are_rows_of_the_committed_csv(claim):
    """Every 'x [lo, hi]' (or 'x x [lo, hi]' for a ratio) that the claim's glance and detail rows quote is
    the estimate and interval of a row of docs/verdicts/forgetting.csv at the printed precision: prose
    cannot say 0.019 where the CSV has 0.0185."""
    frame = pd.read_csv(ROOT / "docs" / "verdicts" / "forgetting.csv")
    text = _text()
    section = text[text.index("## The empirical study in simulation: E3, E4, E6"):]
    lines = [line for line in section.splitlines() if line.startswith(f"| {claim} ")] + \
        [r for r in _glance() if r.startswith(f"| {claim} ")]
    quoted = [m for line in lines for m in re.findall(r"(-?\d+\.?\d*)x? \[(-?\d+\.?\d*), (-?\d+\.?\d*)\]", line)]
    assert quoted, "no number quoted"
    for est, lo, hi in quoted:
        assert any(_printed(r.estimate, est) and _printed(r.lo, lo) and _printed(r.hi, hi)
                   for r in frame.itertuples()), (est, lo, hi)
