"""figures.verdicts: the verdict tables of the study pages and the gallery, generated from the committed
docs/verdicts/*.csv (fast tier: these tests are what `make mutate` runs against figures/verdicts.py)."""

import numpy as np
import pandas as pd
import pytest

import figures
from conftest import ROOT


# ------------------------------------------------------------------------------------------------
# the verdict tables of the study pages and the gallery (docs/)
# ------------------------------------------------------------------------------------------------
def test_study_pages_verdict_blocks_are_the_tables_of_the_committed_verdicts():
    """Each study page's block between the markers is exactly what ``python -m figures --gallery``
    generates from its docs/verdicts/<study>.csv, and every verdict there comes from a committed CSV."""
    from figures.verdicts import BEGIN, END, markdown_table, replace_block
    frames = figures.verdict_frames(ROOT / figures.VERDICTS_DIR)
    assert set(frames) == set(figures.VERDICT_STUDIES) == set(figures.VERDICT_PAGES)
    for study, page in figures.VERDICT_PAGES.items():
        text = (ROOT / page).read_text()
        assert replace_block(text, markdown_table({study: frames[study]})) == text, page
        block = text[text.index(BEGIN):text.index(END)]
        assert block.count("\n| `") == len(frames[study]) > 0


def test_gallery_page_is_generated_from_the_committed_verdicts():
    """The gallery page's block is what ``python -m figures --gallery`` generates: every caption that
    states a verdict reads it from docs/verdicts/*.csv, and every figure it shows is committed."""
    from figures.verdicts import GALLERY_BEGIN, GALLERY_END, gallery_table, replace_block
    frames = figures.verdict_frames(ROOT / figures.VERDICTS_DIR)
    text = (ROOT / figures.GALLERY_PAGE).read_text()
    assert replace_block(text, gallery_table(figures.GALLERY_CAPTIONS, frames, figures.GALLERY_LINKS),
                         GALLERY_BEGIN, GALLERY_END) == text
    page_dir = (ROOT / figures.GALLERY_PAGE).parent
    for stem, _, picks in figures.GALLERY_CAPTIONS:
        assert (page_dir / figures.GALLERY_LINKS / f"{stem}.png").exists()
        assert (ROOT / figures.GALLERY_DIR / f"{stem}.png").exists()
        assert all(study in frames for study, _, _ in picks)


def test_write_verdict_pages_regenerates_every_block(tmp_path):
    """What --gallery writes: stale blocks on the study pages and the gallery page are replaced by the
    tables generated from the verdict copies."""
    from figures.verdicts import BEGIN, END, GALLERY_BEGIN, GALLERY_END
    pages = {study: tmp_path / f"{study}.md" for study in figures.VERDICT_STUDIES}
    for page in pages.values():
        page.write_text(f"head\n{BEGIN}\nstale\n{END}\ntail\n")
    gallery = tmp_path / "gallery.md"
    gallery.write_text(f"{GALLERY_BEGIN}\nstale\n{GALLERY_END}\n")
    figures.write_verdict_pages(ROOT / figures.VERDICTS_DIR, pages, gallery)
    for study, page in pages.items():
        assert "stale" not in page.read_text()
        assert page.read_text().count("\n| `" + study + "` |") == len(pd.read_csv(ROOT / figures.VERDICTS_DIR / f"{study}.csv"))
    assert "stale" not in gallery.read_text() and "](figures/spectrum.png)" in gallery.read_text()


def test_gallery_captions_follow_the_verdict_rows():
    from figures.verdicts import gallery_table, row_caption
    frame = pd.DataFrame([dict(claim="E9 x holds", condition="tabular, K = 2", verdict="reproduces", estimate=0.1,
                               lo=0.05, hi=0.2, rule="r", statistic="KL; 7 of 8 task draws <= 0.01; median"),
                          dict(claim="E9 y holds", condition="neural", verdict="inconclusive", estimate=0.1, lo=-0.05,
                               hi=0.2, rule="r", statistic="a difference")])
    assert row_caption(frame, "E9 x", "tabular") == \
        "E9 x holds (tabular, K = 2): **reproduces**, 7 of 8 task draws <= 0.01"
    assert row_caption(frame, "E9 y") == "E9 y holds (neural): **inconclusive**, 0.1 [-0.05, 0.2]"
    decided = frame.assign(statistic=["KL; 3 of 5 decidable task draws <= 0.01 (8 task draws); median", "x"])
    assert row_caption(decided, "E9 x") == \
        "E9 x holds (tabular, K = 2): **reproduces**, 3 of 5 decidable task draws <= 0.01 (8 task draws)"
    flipped = frame.assign(verdict=["does not reproduce", "inconclusive"])
    table = gallery_table([("a", "shows x", (("s", "E9 x", ""),)), ("b", "plain", ())], {"s": flipped}, "figs")
    assert table.splitlines()[2] == ("| ![a](figs/a.png) shows x. E9 x holds (tabular, K = 2): **does not reproduce**, "
                                     "7 of 8 task draws <= 0.01 | ![b](figs/b.png) plain |")
    with pytest.raises(ValueError, match="no verdict row"):
        row_caption(frame, "E9 z")


def test_markdown_table_and_replace_block():
    from figures.verdicts import BEGIN, END, markdown_table, replace_block
    frame = pd.DataFrame([dict(claim="c", condition="k", statistic="a | E[w](H)", estimate=0.00123, lo=1e-5,
                               hi=float("nan"), rule="r", verdict="inconclusive")])
    table = markdown_table({"study": frame})
    assert table.splitlines()[2] == "| `study` | c | k | a \\| E\\[w](H) | 0.0012 [1e-05, ] | **inconclusive** |"
    text = f"head\n{BEGIN}\nold\n{END}\ntail"
    assert replace_block(text, "new") == f"head\n{BEGIN}\nnew\n{END}\ntail"
    with pytest.raises(ValueError, match="markers"):
        replace_block("no markers", "new")


def test_verdict_text_states_the_condition_and_where_the_tolerance_matters():
    from figures.verdicts import verdict_text
    row = pd.DataFrame([dict(verdict="reproduces under stated conditions", stated_condition="sep > 0.03",
                             verdict_half_tolerance="reproduces under stated conditions",
                             verdict_twice_tolerance="reproduces under stated conditions"),
                        dict(verdict="mixed", stated_condition=np.nan, verdict_half_tolerance="mixed",
                             verdict_twice_tolerance="reproduces"),
                        dict(verdict="inconclusive", stated_condition=np.nan, verdict_half_tolerance=np.nan,
                             verdict_twice_tolerance=np.nan)])
    texts = [verdict_text(r) for r in row.itertuples(index=False)]
    assert texts == ["**reproduces under stated conditions** (sep > 0.03)",
                     "**mixed**; at half the tolerance: mixed, at twice: reproduces", "**inconclusive**"]


def test_numbers_keep_three_figures_from_1e4_on():
    """Below 1e4 two significant figures, from 1e4 on three (a ratio of 12345 prints 1.23e+04)."""
    from figures.verdicts import markdown_table
    frame = pd.DataFrame([dict(claim="c", condition="k", statistic="s", estimate=12345.0, lo=-23456.0, hi=1234.0,
                               rule="r", verdict="reproduces")])
    assert markdown_table({"s": frame}).splitlines()[2] == \
        "| `s` | c | k | s | 1.23e+04 [-2.35e+04, 1.2e+03] | **reproduces** |"


def test_gallery_table_pairs_captions_and_links_docs_figures_by_default():
    """Three figures: two rows, the third caption beside an empty cell; the images under docs/figures."""
    from figures.verdicts import gallery_table
    table = gallery_table([("a", "one", ()), ("b", "two", ()), ("c", "three", ())], {})
    assert table.splitlines() == ["| | |", "|---|---|",
                                  "| ![a](docs/figures/a.png) one | ![b](docs/figures/b.png) two |",
                                  "| ![c](docs/figures/c.png) three |  |"]


def test_replace_block_replaces_the_first_block_only_and_says_why_it_cannot():
    """Two blocks with the same markers: the first is replaced, the second and the text between are kept;
    no markers: the error names them."""
    from figures.verdicts import BEGIN, END, replace_block
    text = f"head\n{BEGIN}\nold\n{END}\nmiddle\n{BEGIN}\nold 2\n{END}\ntail"
    assert replace_block(text, "new") == f"head\n{BEGIN}\nnew\n{END}\nmiddle\n{BEGIN}\nold 2\n{END}\ntail"
    with pytest.raises(ValueError, match=r"^the generated block's markers are missing or out of order$"):
        replace_block(f"{END}\n{BEGIN}", "new")


def test_verdict_text_reads_a_missing_half_tolerance_verdict_as_the_verdict():
    """A row with a verdict at twice the tolerance but none at half: at half it is the verdict itself."""
    import collections
    from figures.verdicts import verdict_text
    row = collections.namedtuple("Row", "verdict verdict_twice_tolerance")("mixed", "reproduces")
    assert verdict_text(row) == "**mixed**; at half the tolerance: mixed, at twice: reproduces"


def test_verdict_text_gives_the_conditions_permutation_p():
    """A stated condition carries its permutation p-value when the row has one (two significant figures);
    a row without one (NaN or no column) shows the condition alone."""
    from figures.verdicts import verdict_text
    rows = pd.DataFrame([dict(verdict="reproduces under stated conditions", stated_condition="sep > 0.03",
                              condition_p=2 / 56),
                         dict(verdict="mixed", stated_condition="sep > 0.85", condition_p=np.nan)])
    assert [verdict_text(r) for r in rows.itertuples(index=False)] == \
        ["**reproduces under stated conditions** (sep > 0.03; permutation p = 0.036)", "**mixed** (sep > 0.85)"]
