"""Output shared by every command: progress on long runs, figures.

Progress is a rich bar on a terminal and a plain line every 10% otherwise (logs, CI), on
stderr so that `--json` output on stdout stays one clean object.
"""
from __future__ import annotations

import sys
from pathlib import Path


class Progress:
    """A rich progress bar on a terminal; a plain line every 10% of the steps otherwise."""

    def __init__(self, total: int, enabled: bool = True, label: str = "progress"):
        self.total, self.enabled, self.label = total, enabled, label
        self.bar, self.next_line = None, 0
        if enabled:
            from rich import progress as rp
            from rich.console import Console

            console = Console(stderr=True)
            if console.is_terminal:
                self.bar = rp.Progress(rp.TextColumn(label), rp.BarColumn(),
                                       rp.MofNCompleteColumn(), rp.TextColumn("{task.fields[info]}"),
                                       rp.TimeRemainingColumn(), console=console)
                self.task = self.bar.add_task(label, total=total, info="starting...")
                self.bar.start()

    def update(self, step: int, info: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.enabled and (step >= self.next_line or step == self.total):
            print(f"{self.label} {step}/{self.total} {info}", file=sys.stderr, flush=True)
            self.next_line = step + max(1, self.total // 10)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def plot_loss_curve(result, path: Path) -> None:
    """Training loss per step, validation loss, and the exact entropy floor."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(result.loss_curve) + 1), result.loss_curve, lw=0.8, label="train loss")
    vs, vl = zip(*result.val_curve)
    ax.plot(vs, vl, "o-", ms=3, label="validation loss")
    ax.axhline(result.entropy_floor, color="k", ls="--",
               label=f"entropy floor {result.entropy_floor:.4f}")
    ax.set(xlabel="step", ylabel="nats / token", yscale="log",
           title=f"{result.config['model']} ({result.param_count:,} params), "
                 f"{result.config['optimizer']} lr={result.config['lr']:g}")
    ax.legend()
    save_figure(fig, path, dpi=120)


def print_table(title: str, columns: list[str], rows: list[list], file=None) -> None:
    """A table on the terminal (rich); off a terminal (pipes, logs) wide enough that no
    cell wraps."""
    from rich.console import Console
    from rich.table import Table

    console = Console(file=file)
    console = Console(file=file, width=max(100, min(160, console.width))
                      if console.is_terminal else 200)
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c, justify="left" if c == columns[0] else "right")
    for row in rows:
        table.add_row(*[_fmt(v) for v in row])
    console.print(table)


def _fmt(v) -> str:
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return str(v)
        if v == 0.0:
            return "0.0"
        return f"{v:.4g}" if 1e-3 <= abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


def pyplot():
    """matplotlib.pyplot with the file-only Agg backend."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path: Path, dpi: int = 110) -> None:
    """Lay out, write as PNG and close (figures hold memory until closed)."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
