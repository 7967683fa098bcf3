"""Output paths are checked before any work, by the file system itself; tables fit the
terminal without cutting a number.

    - every output option (`--out`, `--profile`, `--checkpoint-dir`, `--png`) refuses a
      folder no file can be created in (/proc: root's permission bits would say yes), an
      existing file where a folder is wanted, and `--png` a format matplotlib cannot write:
      exit 2, one line, before anything is computed and with nothing left behind
    - `checkpoint ls` of an unreadable folder is one line, exit 2
    - tables take COLUMNS (off a terminal too) and split into column groups: at 60 and 100
      columns no line of `plan` is wider than the screen and no cell ends in an ellipsis
"""
import os
from pathlib import Path

import pytest

from jaxscale import report
from jaxscale.cli import paths
from jaxscale.cli.main import main

UNWRITABLE = "/proc/jaxscale-probe/out"  # /proc takes no new files, even from root


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("argv", [
    ["train", "--out", UNWRITABLE],
    ["train", "--checkpoint-dir", UNWRITABLE],
    ["bench", "--profile", UNWRITABLE],
    ["compare", "--out", UNWRITABLE],
    ["data", "clean", "--docs", "10", "--out", UNWRITABLE],
    ["schedule", "--png", "/proc/gantt.png"],
])
def test_an_unwritable_output_is_refused_before_any_work(fail, argv):
    err = fail(*argv)
    assert "cannot write" in err and "'/proc'" in err, err


@pytest.mark.parametrize("option", [["train", "--profile"], ["bench", "--profile"],
                                    ["train", "--checkpoint-dir"], ["compare", "--out"]])
def test_a_file_where_a_folder_is_wanted_is_refused(fail, tmp_path, option):
    (tmp_path / "f").write_text("x")
    err = fail(*option, str(tmp_path / "f"))
    assert "is an existing file, not a folder" in err, err
    assert (tmp_path / "f").read_text() == "x" and os.listdir(tmp_path) == ["f"]


def test_png_takes_only_formats_matplotlib_writes(fail, tmp_path):
    err = fail("schedule", "--png", str(tmp_path / "s.txt"))
    assert "'.txt'" in err and ".png" in err and ".svg" in err, err
    err = fail("schedule", "--png", str(tmp_path / "s"))
    assert "no extension" in err, err
    assert not any(tmp_path.iterdir())
    assert {"png", "svg", "pdf"} <= set(report.figure_formats())


def test_the_probe_leaves_nothing_behind(tmp_path):
    assert paths.writable(tmp_path) is None and not any(tmp_path.iterdir())
    assert paths.writable(tmp_path / "missing")  # a reason, not None


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_checkpoint_ls_of_an_unreadable_folder_is_one_line(fail):
    err = fail("checkpoint", "ls", "/proc")
    assert "/proc" in err, err


def test_column_groups_repeat_the_label_and_fit():
    needs = [10, 20, 20, 20, 50, 5]
    groups = report.column_groups(needs, 60)
    assert all(g[0] == 0 for g in groups)
    assert sorted({i for g in groups for i in g}) == list(range(len(needs)))
    for g in groups:  # each fits, unless one column alone beside the label is wider
        assert 1 + sum(needs[i] for i in g) <= 60 or len(g) == 2
    assert report.column_groups(needs, 1000) == [list(range(len(needs)))]


@pytest.mark.parametrize("width", [60, 100])
def test_plan_fits_the_terminal_and_cuts_no_number(capsys, monkeypatch, width):
    monkeypatch.setenv("COLUMNS", str(width))
    assert main(["plan", "--params", "7e9", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(map(len, lines)) <= width, max(lines, key=len)
    assert "…" not in out
    assert "(part 1 of" in out  # 9 columns do not fit in 100: split, not squeezed
