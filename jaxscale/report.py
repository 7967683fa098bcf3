"""Output shared by every command: progress on long runs, counted words, figures.

Progress is a rich bar on a terminal and a plain line every 10% otherwise (logs, CI), on
stderr so that `--json` output on stdout stays one clean object. Both show the time elapsed
and an estimate of the time left.
"""
from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

from jaxscale.files import replacing


def plural(n: float, word: str, many: str | None = None) -> str:
    """A count with its noun in the right number: '1 device', '8 devices', '1,024 devices'.

    `many` is the plural when adding -s (or -es after s, x, z, ch, sh) is wrong.
    """
    if many is None:
        many = word + ("es" if word.endswith(("s", "x", "z", "ch", "sh")) else "s")
    count = f"{n:,}" if isinstance(n, int) else f"{n:,.6g}"
    return f"{count} {word if n == 1 else many}"


def hms(seconds: float) -> str:
    """Seconds as m:ss, or h:mm:ss from an hour on."""
    s = int(round(seconds))
    h, m = divmod(s // 60, 60)
    return f"{h}:{m:02d}:{s % 60:02d}" if h else f"{m}:{s % 60:02d}"


class Progress:
    """A rich progress bar on a terminal; a plain line every 10% of the steps otherwise.

    The time left is estimated from the steps after the first update, so that the first
    step's compilation does not count as the pace of the others.
    """

    def __init__(self, total: int, enabled: bool = True, label: str = "progress",
                 clock=time.monotonic, console=None):
        self.total, self.enabled, self.label, self.clock = total, enabled, label, clock
        self.bar, self.next_line, self.first, self.file = None, 0, None, sys.stderr
        self.start = clock()
        if enabled:
            from rich import progress as rp
            from rich.console import Console

            console = Console(stderr=True) if console is None else console
            self.file = console.file
            if console.is_terminal:
                self.bar = rp.Progress(rp.TextColumn(label), rp.BarColumn(),
                                       rp.MofNCompleteColumn(), rp.TextColumn("{task.fields[info]}"),
                                       rp.TextColumn("{task.fields[timing]}"), console=console)
                self.task = self.bar.add_task(label, total=total, info="starting...",
                                              timing="")
                self.bar.start()

    def timing(self, step: int) -> str:
        """'0:12 elapsed, ~0:30 left' (no estimate until a step after the first is done)."""
        now = self.clock()
        if self.first is None:
            self.first = (step, now)
        text = f"{hms(now - self.start)} elapsed"
        done, since = step - self.first[0], now - self.first[1]
        if step >= self.total:
            return text
        if done > 0:
            return f"{text}, ~{hms(since / done * (self.total - step))} left"
        return f"{text}, time left: estimating"

    def update(self, step: int, info: str) -> None:
        if not self.enabled:
            return
        timing = self.timing(step)
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info, timing=timing)
        elif step >= self.next_line or step == self.total:
            print(f"{self.label} {step}/{self.total} {info} | {timing}", file=self.file,
                  flush=True)
            self.next_line = step + max(1, self.total // 10)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def plot_loss_curve(result, path: Path) -> None:
    """Training loss per step, validation loss, and the exact entropy floor (finite points).

    The y-axis is linear from 0, so that the gap to the floor reads at its true size, unless
    the losses span more than a decade (a run that blew up): then it is logarithmic, and says
    so. The floor is named on its line: it is the loss no model can beat.
    """
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    floor = result.entropy_floor
    steps = [(i, x) for i, x in enumerate(result.loss_curve, 1) if math.isfinite(x)]
    vals = [(s, v) for s, v in result.val_curve if math.isfinite(v)]
    if steps:
        batch = result.config.get("batch_size")
        ax.plot(*zip(*steps), lw=0.8, color="tab:blue", label="training loss (each step's "
                f"batch{f' of {batch} documents' if batch else ''})")
    if vals:  # few points, drawn over the training curve so that none hides in it
        ax.plot(*zip(*vals), "--D", color="tab:red", lw=0.8, ms=6, mec="white", zorder=3,
                label="validation loss (held-out documents)")
        last_step, last = vals[-1]
        ax.annotate(f"{last:.3f}", (last_step, last), xytext=(0, 8), textcoords="offset points",
                    ha="center", color="tab:red", fontsize=8)
    ax.axhline(floor, color="k", ls="--", lw=1)
    ax.text(0.01, floor, f"entropy floor {floor:.4f}: no model can go lower",
            transform=ax.get_yaxis_transform(), va="bottom", fontsize=8)
    shown = [x for _, x in steps + vals] + [floor]
    log = min(shown) > 0 and max(shown) / min(shown) > 10
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda y, _: f"{y:g}"))
    else:
        ax.set_ylim(bottom=0)
    ax.set(xlabel="training step", ylabel="loss (nats per token" + (", log scale)" if log
                                                                    else ")"),
           title=f"{result.config['model']} ({result.param_count:,} parameters), "
                 f"{result.config['optimizer']}, lr {result.config['lr']:g}")
    if steps or vals:
        ax.legend(loc="best", fontsize=8)
    save_figure(fig, path, dpi=120)


# Off a terminal (a pipe, a log) with no COLUMNS: wide enough that most tables stay whole.
OFF_TERMINAL_WIDTH = 200


def console(file=None):
    """A rich Console as wide as COLUMNS if set, else the terminal, else OFF_TERMINAL_WIDTH
    off a terminal (rich itself reads COLUMNS, then the terminal's size, else 80)."""
    from rich.console import Console

    out = Console(file=file)
    columns = os.environ.get("COLUMNS", "")
    if out.is_terminal or (columns.isdigit() and int(columns) > 0):
        return out
    return Console(file=file, width=OFF_TERMINAL_WIDTH)


def say(text: str, indent: str = "", file=None) -> None:
    """Print a paragraph wrapped to the console's width (`indent` before the first line,
    two more spaces before the others)."""
    import textwrap

    print(textwrap.fill(text, console(file).width, initial_indent=indent,
                        subsequent_indent=indent + "  ", break_on_hyphens=False,
                        break_long_words=False), file=file)


def column_groups(needs: list[int], width: int) -> list[list[int]]:
    """Split columns into groups that each fit `width`, the first (label) column in every
    group: `needs` are the columns' widths in characters, padding and a border included.
    A column too wide to share a group with the first one gets a group to itself."""
    groups, current, used = [], [0], 1 + needs[0]  # the table's left border
    for i in range(1, len(needs)):
        if used + needs[i] > width and len(current) > 1:
            groups.append(current)
            current, used = [0], 1 + needs[0]
        current.append(i)
        used += needs[i]
    return groups + [current]


def print_table(title: str, columns: list[str], rows: list[list], file=None) -> None:
    """A rich table as wide as `console` says; a wider one is split into column groups (the
    first column repeated in each), so that no number is ever cut short."""
    from rich.cells import cell_len
    from rich.table import Table

    out = console(file)
    cells = [[_fmt(v) for v in row] for row in rows]
    widest = [max([cell_len(r[i]) for r in cells], default=1) for i in range(len(columns))]
    # narrowest: the widest cell, or the header's longest word (a header may wrap); natural:
    # the header on one line
    narrow = [max([w, *map(cell_len, c.split())]) for w, c in zip(widest, columns)]
    natural = [max(w, cell_len(c)) for w, c in zip(widest, columns)]
    groups = column_groups([w + 3 for w in narrow], out.width)  # padding 2, border 1
    for k, group in enumerate(groups, 1):
        spare = out.width - 1 - sum(narrow[i] + 3 for i in group)
        part = f" (part {k} of {len(groups)})" if len(groups) > 1 else ""
        table = Table(title=title + part, title_justify="left")
        for i in group:
            grow = max(0, min(natural[i] - narrow[i], spare))
            spare -= grow
            table.add_column(columns[i], justify="left" if i == 0 else "right",
                             width=narrow[i] + grow, overflow="fold")
        for row in cells:
            table.add_row(*[row[i] for i in group])
        out.print(table)


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        if v == 0.0:
            return "0.0"
        if abs(v) >= 1e4:  # 136,512 and 54,322 (tokens/s and the like), never 5.432e+04
            return f"{v:,.0f}"
        return f"{v:.4g}" if abs(v) >= 1e-3 else f"{v:.3e}"  # 0.000123 would hide digits
    return str(v)


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def figure_formats() -> tuple[str, ...]:
    """The file extensions save_figure can write ('png', 'svg', 'pdf', ...: matplotlib's own
    list, which its version decides); any other extension makes savefig raise."""
    pyplot()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    return tuple(sorted(FigureCanvasAgg.get_supported_filetypes()))


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out, write whole or not at all, in the format the name's extension says (no
    extension: matplotlib's default, PNG), and close (figures hold memory until closed)."""
    path = Path(path)
    try:
        fig.tight_layout()
        with replacing(path, "wb") as f:
            fig.savefig(f, dpi=dpi, format=path.suffix[1:].lower() or None)
    finally:
        pyplot().close(fig)
