"""The checks every figure of the project passes (issue 34): its text inside the canvas and apart, a
suptitle that states its claim, and only colour-blind-safe colours (no matplotlib tab10). Shared by
tests/test_figures.py (the six simulation studies) and tests/test_figures_bridge.py (the LLM-bridge figures)."""

import itertools

import matplotlib
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.markers import MarkerStyle
from matplotlib.text import Text

TOLERANCE = 1.0            # pixels at 100 dpi: glyph boxes may touch, not overlap


def drawn_texts(fig):
    """(text, window extent) of every visible, non-empty text artist the renderer draws, tick labels
    included (only those of ticks inside the view: an Axis keeps spare Tick objects it does not draw)."""
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    spare, drawn = set(), []
    for ax in fig.axes:
        for axis in ax._axis_map.values():
            in_view = axis._update_ticks()          # may create Tick objects: before listing them all
            spare.update(t for tick in axis.get_major_ticks() + axis.get_minor_ticks() for t in (tick.label1, tick.label2))
            if ax.get_visible() and ax.axison and axis.get_visible():
                drawn += [t for tick in in_view for t in (tick.label1, tick.label2)]
    texts = [t for t in fig.findobj(Text) if t not in spare] + drawn
    return [(t.get_text(), t.get_window_extent(renderer)) for t in texts
            if t.get_visible() and t.get_text().strip() and (t.axes is None or t.axes.get_visible())]


def text_problems(fig, tolerance=TOLERANCE):
    """Text outside the canvas, and pairs of texts whose boxes overlap by more than ``tolerance`` pixels."""
    fig.set_dpi(100)
    canvas = fig.bbox
    found = drawn_texts(fig)
    problems = [f"outside the canvas: {text!r}" for text, box in found
                if box.x0 < canvas.x0 - tolerance or box.y0 < canvas.y0 - tolerance
                or box.x1 > canvas.x1 + tolerance or box.y1 > canvas.y1 + tolerance]
    for (t1, b1), (t2, b2) in itertools.combinations(found, 2):
        if min(b1.x1, b2.x1) - max(b1.x0, b2.x0) > tolerance and min(b1.y1, b2.y1) - max(b1.y0, b2.y0) > tolerance:
            problems.append(f"overlap: {t1!r} and {t2!r}")
    return problems


def states_its_claim(fig):
    """A suptitle of more than 20 characters: the figure says what it shows."""
    return fig._suptitle is not None and len(fig._suptitle.get_text()) > 20


TAB10 = {matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab10"].colors} - {"#7f7f7f"}   # grey is fine


def ink(line):
    """The colours a line puts on the canvas: its stroke when it has a line style, its marker's edge and
    face when it has a marker (errorbar keeps an invisible data line, and caps whose stroke colour is unused)."""
    out = []
    if line.get_visible() and line.get_linestyle() not in ("None", "", " "):
        out.append(line.get_color())
    if line.get_visible() and line.get_marker() not in ("None", "", " ", None):
        out.append(line.get_markeredgecolor())
        if MarkerStyle(line.get_marker()).is_filled():       # '|', 'x': no face
            out.append(line.get_markerfacecolor())
    return {matplotlib.colors.to_hex(c) for c in out if not (isinstance(c, str) and c.lower() == "none")}


def colours_used(fig):
    """The hex colours of the panels' lines and markers (:func:`ink`), patches and collections' faces."""
    used = set().union(*(ink(ln) for ax in fig.axes for ln in ax.lines))
    used |= {matplotlib.colors.to_hex(p.get_facecolor()) for ax in fig.axes for p in ax.patches}
    used |= {matplotlib.colors.to_hex(c) for ax in fig.axes for coll in ax.collections for c in coll.get_facecolor()}
    return used
