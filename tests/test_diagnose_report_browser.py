"""The diagnosis report as a reader sees it: each shipped example's report.html (docs/diagnose/<pair>/, written by
``make gallery``) rendered by a headless Chromium at a laptop's width, where no table may overflow the page or
clip a cell, and every figure must load. Chromium is Debian's ``chromium`` package (``.ci/run`` installs it);
outside CI the test skips when it is absent."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ("end_veto", "control")

# Run in the page after it loads: every table must fit the body (no horizontal overflow, no cell whose content
# is wider than the cell), every image must have decoded; the verdict goes into the DOM that --dump-dom prints.
CHECK = """
<script>
window.addEventListener('load', function () {
  var body = document.body.getBoundingClientRect(), out = {tables: 0, overflow: [], clipped: [], images: 0, broken: []};
  document.querySelectorAll('table').forEach(function (t, i) {
    out.tables += 1;
    var r = t.getBoundingClientRect();
    if (r.right > body.right + 1 || t.scrollWidth > t.clientWidth + 1)
      out.overflow.push(i + ': ' + Math.round(r.width) + ' px wide, body ' + Math.round(body.width));
    t.querySelectorAll('td, th').forEach(function (c) {
      if (c.scrollWidth > c.clientWidth + 1) out.clipped.push(i + ': ' + c.textContent.slice(0, 40));
    });
  });
  document.querySelectorAll('img').forEach(function (img) {
    out.images += 1;
    if (!img.complete || img.naturalWidth === 0) out.broken.push(img.alt);
  });
  var pre = document.createElement('pre');
  pre.id = 'layout-check';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def chromium():
    """The Chromium binary, or a skip (a failure in CI, where .ci/run installs it)."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("no Chromium in CI: .ci/run installs Debian's chromium package")
    pytest.skip("no headless Chromium here (apt-get install chromium): the report's layout test needs one")


def layout(page_html, tmp_path, width=1280):
    """Render a page in headless Chromium at ``width`` px and return the CHECK script's verdict."""
    page = tmp_path / "page.html"
    page.write_text(page_html.replace("</body>", CHECK + "</body>"))
    cmd = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}",
           f"--window-size={width},900", "--virtual-time-budget=10000", "--dump-dom", page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    found = re.search(r'<pre id="layout-check">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"Chromium printed no verdict (exit {proc.returncode}): {proc.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<")
                      .replace("&gt;", ">"))


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS)
def test_shipped_reports_fit_the_page_and_load_every_figure(tmp_path, pair):
    page = (ROOT / "docs" / "diagnose" / pair / "report.html").read_text()
    said = layout(page, tmp_path)
    assert said["tables"] >= 4 and said["images"] >= 1, said
    assert said["overflow"] == [] and said["clipped"] == [] and said["broken"] == [], said


@pytest.mark.slow
def test_the_layout_check_sees_an_overflowing_table_and_a_broken_figure(tmp_path):
    """The check can fail: a table of one unbreakable 3000 px cell overflows, and an image whose data is not
    a PNG does not load."""
    page = ("<!doctype html><html><head><style>body{max-width:600px}</style></head><body>"
            f"<table><tr><td style='white-space:nowrap'>{'x' * 600}</td></tr></table>"
            "<img alt='bad' src='data:image/png;base64,AAAA'></body></html>")
    said = layout(page, tmp_path)
    assert said["tables"] == 1 and said["overflow"] and said["broken"] == ["bad"], said
