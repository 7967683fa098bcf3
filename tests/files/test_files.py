"""jaxscale.files: every file written whole, or the old one left as it was."""
import os

import pytest

from jaxscale.files import (replacing, start_output_set, write_lines_atomically,
                            write_text_atomically)


def test_a_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("old")
    write_text_atomically(path, "new ✓")  # utf-8 whatever the locale
    assert path.read_bytes() == "new ✓".encode()
    assert os.listdir(tmp_path) == ["result.json"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "kept.jsonl"
    path.write_text("old\n")

    def lines():
        yield "first"
        raise KeyboardInterrupt  # Ctrl-C half way through a generator of lines

    with pytest.raises(KeyboardInterrupt):
        write_lines_atomically(path, lines(), durable=True)
    assert path.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["kept.jsonl"]


def test_nothing_is_created_when_the_first_write_fails(tmp_path):
    path = tmp_path / "corpus.npz"
    with pytest.raises(RuntimeError), replacing(path, "wb") as f:
        f.write(b"half")
        raise RuntimeError("disk gone")
    assert os.listdir(tmp_path) == []


def test_a_durable_write_syncs_the_file_then_its_folder(tmp_path, monkeypatch):
    """durable=True: the file's bytes reach the disk before the rename, and the folder's
    entry after it (else a power loss can bring the old file back)."""
    synced, real = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(
        f"/proc/self/fd/{fd}")), real(fd)))
    target = tmp_path / "faults.json"
    write_text_atomically(target, "{}", durable=True)
    assert [os.path.basename(p).startswith(".faults.json.tmp-") for p in synced] == [True, False]
    assert synced[1] == str(tmp_path)
    write_text_atomically(target, "{}")  # a cache: no wait for the disk
    assert len(synced) == 2


def test_a_symbolic_link_is_followed_and_kept(tmp_path):
    (tmp_path / "runs").mkdir()
    target = tmp_path / "runs" / "compare.md"
    target.write_text("old")
    (tmp_path / "latest.md").symlink_to(target)
    write_text_atomically(tmp_path / "latest.md", "new")
    assert (tmp_path / "latest.md").is_symlink() and target.read_text() == "new"


def test_lines_end_with_newlines_and_bytes_are_written_as_they_are(tmp_path):
    write_lines_atomically(tmp_path / "a.txt", iter(["x", "y"]))
    assert (tmp_path / "a.txt").read_text() == "x\ny\n"
    with replacing(tmp_path / "b.bin", "wb", durable=True) as f:
        f.write(b"\x00\xff")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\xff"


def test_an_output_set_removes_only_its_own_names(tmp_path):
    out = tmp_path / "run" / "deep"
    start_output_set(out, ["result.json"])
    (out / "result.json").write_text("earlier run")
    (out / "notes.txt").write_text("the user's")
    start_output_set(out, ["result.json", "loss.png"])
    assert sorted(os.listdir(out)) == ["notes.txt"]


def test_a_figure_is_written_whole_in_its_extensions_format(tmp_path):
    from jaxscale import report
    plt = report.pyplot()
    before = set(plt.get_fignums())  # other tests in this worker may have left some open
    for name, magic in (("chart.png", b"\x89PNG"), ("chart.PDF", b"%PDF"),
                        ("chart.svg", b"<?xml")):
        report.save_figure(plt.subplots()[0], tmp_path / name)
        assert (tmp_path / name).read_bytes().startswith(magic), name
    (tmp_path / "chart.xyz").write_text("old")
    with pytest.raises(ValueError, match="xyz"):  # a format matplotlib cannot write
        report.save_figure(plt.subplots()[0], tmp_path / "chart.xyz")
    assert (tmp_path / "chart.xyz").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["chart.PDF", "chart.png", "chart.svg", "chart.xyz"]
    assert set(plt.get_fignums()) == before  # each figure closed, the failed one too
