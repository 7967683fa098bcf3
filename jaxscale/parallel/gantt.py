"""Gantt charts of a simulated pipeline schedule (jaxscale.parallel.schedules), as PNGs.

One lane per device and one box per action: forwards in blues, backwards in oranges (in a
split backward: input gradients in oranges, weight gradients in greens), one shade per
model chunk. Each box carries the largest label that fits inside it (F3a, else
the micro-batch number alone, else nothing), and the legend says when labels were
shortened or left out, so that a crowded chart never shows overlapping or clipped text.
"""
from __future__ import annotations

import numpy as np

from jaxscale.parallel.schedules import Timeline, time_unit
from jaxscale.report import pyplot, save_figure

KIND_WORDS = {"F": "forward", "B": "backward", "W": "weight gradient"}
SPLIT_WORDS = {**KIND_WORDS, "B": "input gradient"}  # when the backward is split
LABEL_SIZES = (7, 5.5)  # points: the larger first


def gantt_png(timeline: Timeline, path, title: str | None = None) -> dict:
    """A Gantt chart PNG: one lane per device, forwards in blues and backwards in oranges
    (one shade per model chunk); returns how many boxes got which label (see _label_boxes)."""
    fig, counts = gantt_figure(timeline, title)
    save_figure(fig, path)
    return counts


def gantt_figure(timeline: Timeline, title: str | None = None):
    """(matplotlib figure, label counts) of gantt_png's chart, laid out, not yet saved."""
    plt = pyplot()
    tl = timeline
    width = min(20.0, max(6.0, 2.5 + 0.25 * float(tl.makespan / time_unit(tl))))  # ~1/4 in
    fig, ax = plt.subplots(figsize=(width, min(12.0, 1.2 + tl.p / 2)))
    colour = _shades(plt, tl.v)
    _draw_boxes(ax, tl, colour, width)
    cost = {a.kind: (end - start) * tl.v for row in tl.rows for start, end, a in row}
    words = SPLIT_WORDS if tl.split else KIND_WORDS
    ax.set_yticks(range(tl.p), [f"device {s}" for s in range(tl.p)])
    ax.invert_yaxis()
    ax.set(xlim=(0, float(tl.makespan)), ylim=(tl.p - 0.5, -0.5), xlabel=(
        "time (one stage's " + ", ".join(f"{words[k]} = {float(c):g}" for k, c in cost.items())
        + ")"),
        title=title or f"p={tl.p}, m={tl.m}, v={tl.v}: idle {float(tl.idle_fraction):.1%}")
    counts = _legend_and_labels(fig, ax, tl, colour)
    return fig, counts


def _shades(plt, v: int):
    """colour(kind, chunk): Blues for forwards, Oranges for backwards (input gradients),
    Greens for weight gradients, darker per chunk."""
    cmaps = {"F": plt.get_cmap("Blues"), "B": plt.get_cmap("Oranges"),
             "W": plt.get_cmap("Greens")}
    table = {(kind, c): cmaps[kind](0.45 + 0.4 * c / max(1, v - 1)) for kind in cmaps
             for c in range(v)}  # looked up once per box: a colormap call costs ~25 us

    def colour(kind: str, chunk: int):
        return table[kind, chunk]
    return colour


def _draw_boxes(ax, tl: Timeline, colour, fig_width: float) -> None:
    """One box per action; a white edge between boxes, unless it would hide the boxes."""
    shortest = min(end - start for row in tl.rows for start, end, _ in row)
    edge = 0.5 if (fig_width - 3) * 72 * float(shortest / tl.makespan) > 4 else 0  # points
    for s, row in enumerate(tl.rows):  # one call per lane: a call per box costs matplotlib
        # a collection each, which made a chart of thousands of boxes take minutes
        ax.broken_barh([(float(start), float(end - start)) for start, end, _ in row],
                       (s - 0.4, 0.8), facecolors=[colour(a.kind, a.chunk) for _, _, a in row],
                       edgecolor="white", linewidth=edge)


def _legend_and_labels(fig, ax, tl: Timeline, colour) -> dict:
    """Place the legend beside the axes and label the boxes; returns the label counts.

    The legend takes room from the axes, so the layout comes first and the labels are fitted
    after it; a note added to the legend ("numbers: micro-batch", "n boxes too narrow")
    changes the layout again, so fit again until the notes settle.
    """
    plt = pyplot()
    words = SPLIT_WORDS if tl.split else KIND_WORDS
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour(k, c), label=words[k] + (
        f", chunk {chr(ord('a') + c)}" if tl.v > 1 else "")) for k in ("FBW" if tl.split else "FB")
        for c in range(tl.v)]
    blank = plt.Rectangle((0, 0), 1, 1, fill=False, edgecolor="none")
    notes, texts = [], []
    for _ in range(3):
        ax.legend(handles=handles + [blank] * len(notes), labels=[
            h.get_label() for h in handles] + notes, loc="upper left",
            bbox_to_anchor=(1.005, 1), fontsize=8)  # replaces the axes' previous legend
        fig.tight_layout()
        for t in texts:
            t.remove()
        texts, counts = _label_boxes(fig, ax, tl, colour)
        now = (["numbers: micro-batch"] if counts["short"] else []) + (
            [f"{counts['none']} of {sum(counts.values())} boxes\ntoo narrow to label"]
            if counts["none"] else [])
        if now == notes:
            break
        notes = now
    return counts


def _label_boxes(fig, ax, tl: Timeline, colour) -> tuple[list, dict]:
    """Write in each box the largest label that fits inside it: F3a at 7 pt, else at 5.5 pt,
    else the micro-batch number alone (colour says F or B, shade the chunk), else nothing.
    Returns the texts drawn and {"full": n, "short": n, "none": n} boxes."""
    renderer = fig.canvas.get_renderer()
    to_px = ax.transData.transform
    sizes: dict = {}

    def extent(text: str, size: float):  # rendered (width, height) in pixels, memoised
        if (text, size) not in sizes:
            probe = ax.text(0, 0, text, fontsize=size)
            box = probe.get_window_extent(renderer)
            sizes[text, size] = (box.width, box.height)
            probe.remove()
        return sizes[text, size]

    # every label holds a digit, so a box smaller than any digit at the smallest size holds
    # none: such boxes are counted without measuring their labels
    digits = [extent(d, LABEL_SIZES[-1]) for d in "0123456789"]
    least_w, least_h = min(w for w, _ in digits), min(h for _, h in digits)
    boxes = [(s, start, end, a) for s, row in enumerate(tl.rows) for start, end, a in row]
    corners = to_px([(float(x), s + dy) for s, start, end, _ in boxes
                     for x, dy in ((start, -0.4), (end, 0.4))])  # all at once: fast
    rooms = np.abs(corners[1::2] - corners[0::2]) - 2  # a pixel of margin each side
    counts, texts = {"full": 0, "short": 0, "none": 0}, []
    for (s, start, end, a), (room_w, room_h) in zip(boxes, rooms.tolist()):
        fit = None
        if room_w >= least_w and room_h >= least_h:
            candidates = [(text, size, kind) for text, kind in ((a.label(tl.v), "full"),
                                                                (str(a.micro_batch), "short"))
                          for size in LABEL_SIZES]
            fit = next((c for c in candidates if extent(c[0], c[1])[0] <= room_w
                        and extent(c[0], c[1])[1] <= room_h), None)
        if fit is None:
            counts["none"] += 1
            continue
        text, size, kind = fit
        counts[kind] += 1
        r, g, b, _ = colour(a.kind, a.chunk)
        texts.append(ax.text(
            float(start + end) / 2, s, text, ha="center", va="center", fontsize=size,
            color="white" if 0.3 * r + 0.59 * g + 0.11 * b < 0.5 else "black",
            gid=f"label:{s}:{float(start)}:{float(end)}"))
    return texts, counts
