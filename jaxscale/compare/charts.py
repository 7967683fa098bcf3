"""`jaxscale compare`'s charts: memory.png, bytes.png and losses.png in the run's folder.

Each chart compares like with like:
  memory.png  model states per device: measured on device 0 (parameters, then fp32 master
              weights + optimizer state) beside the formula's (parameters, then optimizer
              state, which includes the master copy). Gradients are left out of both: they
              are not part of the state the step carries (XLA counts them among temporaries)
  bytes.png   bytes one device sends per step: counted in the lowered HLO beside the
              prediction, on a log scale; a strategy that sends nothing gets a "0", not a bar
  losses.png  each strategy's relative loss difference from the single device per step,
              |loss - single| / single, on a log scale, with the control run's drift (the
              noise) and the pass bound; beside it, the single device's loss curve

Failed strategies are not drawn; each chart's title names them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.ticker import MaxNLocator

from jaxscale.report import pyplot, save_figure

FILES = ("memory.png", "bytes.png", "losses.png")  # what `charts` may write
REFERENCE = "single"  # the row every loss is compared with
ZERO_FLOOR = 1e-9  # where an exact 0 is drawn on the log scale when nothing differs


def charts(result: dict, out: Path) -> dict:
    """Write memory.png, bytes.png and losses.png (when the single device ran) into `out`;
    returns the figures by name (saved and closed, their artists still readable)."""
    ok = [r for r in result["rows"] if r.get("status", "ok") == "ok"]
    failed = [r["name"] for r in result["rows"] if r.get("status", "ok") != "ok"]
    note = f"\nfailed, not drawn: {', '.join(failed)}" if failed else ""
    figures = {"memory": memory_figure(ok, note), "bytes": bytes_figure(ok, note)}
    if any(r["name"] == REFERENCE for r in ok):  # no reference, no differences to draw
        figures["losses"] = losses_figure(result, ok, note)
    for name, fig in figures.items():
        assert f"{name}.png" in FILES
        save_figure(fig, Path(out) / f"{name}.png")
    return figures


def _unit(largest: float) -> tuple[str, float]:
    """Bytes in powers of 1000, the unit that keeps the largest value below 1000."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if largest >= scale:
            return unit, scale
    return "B", 1.0


def _width(rows) -> float:
    return max(7.0, 1.1 * len(rows) + 2)


def _short(x: float) -> str:
    """369k, 3.15M: bytes in powers of 1000, for a label on a bar."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.0f}"


def memory_figure(rows: list[dict], note: str = ""):
    """Stacked bars per strategy: measured (left) and predicted (right), same components."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(_width(rows), 4.2))
    x = np.arange(len(rows))
    measured = {"params": [r["memory"]["params"] for r in rows],
                "master + optimizer state": [r["memory"]["master"] + r["memory"]["optimizer"]
                                             for r in rows]}
    states = [(r.get("predicted") or {}).get("states") for r in rows]  # None: not modelled
    predicted = {"params": [p["params"] if p else 0 for p in states],
                 "optimizer state (incl. master)": [p["optimizer"] if p else 0 for p in states]}
    totals_m = np.sum(list(measured.values()), axis=0) if rows else np.zeros(0)
    totals_p = np.sum(list(predicted.values()), axis=0) if rows else np.zeros(0)
    unit, scale = _unit(max([*totals_m, *totals_p, 1]))
    for side, parts, dx, alpha in (("measured", measured, -0.2, 1.0),
                                   ("predicted", predicted, 0.2, 0.45)):
        bottom = np.zeros(len(rows))
        for colour, (key, values) in zip(("C0", "C1"), parts.items()):
            heights = np.asarray(values, float) / scale
            ax.bar(x + dx, heights, 0.38, bottom=bottom, color=colour, alpha=alpha,
                   label=f"{key} ({side})")
            bottom += heights
    for i, (m, p) in enumerate(zip(totals_m, totals_p)):
        label = "not modelled" if states[i] is None else f"{m / p - 1:+.2%}" if p else "-"
        ax.annotate(label, (x[i], max(m, p) / scale),
                    xytext=(0, 2), textcoords="offset points", ha="center", fontsize=7)
    ax.set(xticks=x, ylabel=f"bytes per device ({unit} = {scale:,.0f} B)" if scale > 1
           else "bytes per device", title="model states per device (gradients in neither: "
           "they are not carried state)\nmeasured on device 0 (solid) vs formula (light); "
           f"on top: measured / formula - 1{note}")
    ax.set_xticklabels([r["name"] for r in rows], rotation=30, ha="right")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.margins(y=0.1)
    return fig


def bytes_figure(rows: list[dict], note: str = ""):
    """Bytes sent per device per step, HLO vs prediction, log scale; a 0 is written, not drawn."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(_width(rows), 4.0))
    x = np.arange(len(rows))
    series = (("measured (HLO)", "sent_total", -0.2, "C0"),
              ("predicted", "sent_predicted_total", 0.2, "C1"))
    positive = [r[key] for _, key, _, _ in series for r in rows if (r[key] or 0) > 0]
    for label, key, dx, colour in series:
        keep = [i for i, r in enumerate(rows) if (r[key] or 0) > 0]
        ax.bar(x[keep] + dx, [rows[i][key] for i in keep], 0.38, color=colour, label=label)
        for i in keep:
            ax.annotate(_short(rows[i][key]), (x[i] + dx, rows[i][key]), xytext=(0, 2),
                        textcoords="offset points", ha="center", fontsize=7)
        for i, r in enumerate(rows):
            if r[key] == 0:  # log scale: no bar can show 0, so say it
                ax.text(x[i] + dx, 0.02, "0", transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=9, color=colour, gid=f"zero:{key}:{i}")
            elif r[key] is None:  # a plan the cost model does not cover
                ax.text(x[i] + dx, 0.02, "not\nmodelled", transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=6, color=colour)
    ax.set_yscale("log")
    if positive:
        ax.set_ylim(min(positive) / 5, max(positive) * 3)
    ax.set(xticks=x, ylabel="bytes sent per device per step (log scale)",
           title="communication: bytes one device sends per step, counted in the lowered HLO "
                 f"vs predicted\n(every collective as a ring; 0 = no collective){note}")
    ax.set_xticklabels([r["name"] for r in rows], rotation=30, ha="right")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    return fig


def losses_figure(result: dict, rows: list[dict], note: str = ""):
    """Relative loss difference from the single device per step (log), noise and bound;
    the single device's own loss curve beside it."""
    plt = pyplot()
    noise = result["noise"]
    fig, (ax, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.6),
                                      gridspec_kw={"width_ratios": [3, 1]})
    others = [r for r in rows if r["name"] != REFERENCE]
    positive = [d for r in others for d in r["rel_dloss"] if d > 0]
    positive += [v for v in (noise["drift"], noise["tolerance"]) if v is not None and v > 0]
    # an exact 0 is drawn a decade or so below the smallest real difference
    floor = 10 ** np.floor(np.log10(min(positive) / 3)) if positive else ZERO_FLOOR
    markers = "os^vD<>pPX*h"
    colours = [f"C{i}" for i in (0, 1, 2, 4, 5, 6, 8, 9)]  # red and grey are the lines
    for i, r in enumerate(others):
        d = np.asarray(r["rel_dloss"], float)
        steps = np.arange(1, len(d) + 1)
        control = r["name"] == noise["control"]
        identical = not d.any()
        label = r["name"] + (" (control run)" if control else "") + (
            f": identical to {REFERENCE} at every step" if identical else "")
        style = dict(color="k", ls="--", lw=1.6, marker="", zorder=3) if control else dict(
            color=colours[i % len(colours)], lw=1, marker=markers[i % len(markers)], ms=3.5)
        ax.plot(steps, np.maximum(d, floor), label=label, **style)
    if noise["drift"] is not None:  # None: the control run failed
        ax.axhline(max(noise["drift"], floor), color="0.4", ls=":", lw=1.2,
                   label=f"noise: {noise['control']}'s largest drift {noise['drift']:.1e}")
    if noise["tolerance"] is not None:  # None: no bound to pass (and none given)
        ax.axhline(max(noise["tolerance"], floor), color="red", lw=1.2,
                   label=f"pass bound {noise['tolerance']:.1e}")
    ax.axhspan(floor / 2, floor * 1.5, color="0.9", zorder=0,
               label=f"exactly 0, drawn at {floor:.0e}")
    ax.set(yscale="log", ylim=(floor / 2, None), xlabel="step",
           ylabel=f"|loss - {REFERENCE}| / {REFERENCE}",
           title=f"{result['model']} on {result['devices']} devices, {result['steps']} steps of "
                 f"{result['batch_size']} documents: loss difference from {REFERENCE}{note}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.title.set_fontsize(9)
    ax.legend(fontsize=6.5, loc="upper left", bbox_to_anchor=(0, -0.14), ncol=3)
    ref = next((r for r in rows if r["name"] == REFERENCE), None)
    if ref is not None:
        ax_loss.plot(np.arange(1, len(ref["losses"]) + 1), ref["losses"], "o-", ms=3, lw=1)
        ax_loss.set(xlabel="step", ylabel="training loss (nats/token)",
                    title=f"{REFERENCE}: the loss itself")
        ax_loss.title.set_fontsize(9)
        ax_loss.xaxis.set_major_locator(MaxNLocator(integer=True))
    else:
        ax_loss.set_axis_off()
    return fig
