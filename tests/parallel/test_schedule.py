"""Pipeline schedules: the simulated bubble equals the formula exactly, every per-device order
respects its dependencies, activation counts, exercise 3, the charts, `jaxscale schedule`."""
import json
from fractions import Fraction

import pytest

from jaxscale.cli.main import main as cli_main
from jaxscale.cli.commands.schedule import MAX_FORWARDS, MAX_MICRO_BATCHES, MAX_STAGES, MAX_VIRTUAL
from jaxscale.parallel.gantt import gantt_figure, gantt_png
from jaxscale.parallel.schedules import (Action, ScheduleError, bubble_over_total, run, simulate,
    smallest_micro_batches, stage_orders, text_chart)

COSTS = [(1, 2), (1, 1), (2, 1), (0.5, 1.5)]


def _grid():
    for name in ("gpipe", "1f1b"):
        for p in (1, 2, 3, 4, 8):
            for m in (1, 2, 3, 5, 8, 13):
                yield name, p, m, 1
    for p in (1, 2, 3, 4, 8):
        for k in (1, 2, 3):
            for v in (2, 3, 4):
                yield "interleaved", p, k * p, v


GRID = list(_grid())


@pytest.mark.parametrize("costs", COSTS)
def test_measured_idle_equals_the_formula_exactly(costs):
    """GPipe, 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1), as exact fractions."""
    for name, p, m, v in GRID:
        tl = run(name, p, m, v, *costs)
        assert tl.idle_fraction == Fraction(p - 1, v * m + p - 1), (name, p, m, v, costs)
        assert tl.idle_fraction == bubble_over_total(name, p, m, v)
        f, b = (Fraction(str(c)) for c in costs)
        assert tl.busy == [m * (f + b)] * p  # every device does its whole share, no more


def _needs(a: Action, p: int, v: int) -> list[tuple]:
    """Written out again here rather than imported: F flows down the virtual stages, B up."""
    k, V = a.chunk * p + a.stage, v * p
    if a.kind == "F":
        return [] if k == 0 else [("F", a.micro_batch, k - 1)]
    return [("F", a.micro_batch, k)] if k == V - 1 else [("B", a.micro_batch, k + 1)]


@pytest.mark.parametrize("costs", COSTS[:2])
def test_every_order_respects_its_dependencies_and_starts_as_soon_as_it_can(costs):
    for name, p, m, v in GRID:
        tl = run(name, p, m, v, *costs)
        f, b = (Fraction(str(c)) / v for c in costs)
        done = {(a.kind, a.micro_batch, a.chunk * p + a.stage): (s, e)
                for row in tl.rows for s, e, a in row}
        assert len(done) == 2 * m * v * p
        for dev, row in enumerate(tl.rows):
            assert sorted((a.kind, a.micro_batch, a.chunk) for _, _, a in row) == sorted(
                (k, j, c) for k in "FB" for j in range(m) for c in range(v))
            prev_end = Fraction(0)
            for start, end, a in row:
                assert a.stage == dev and end - start == (f if a.kind == "F" else b)
                ready = [done[d][1] for d in _needs(a, p, v)]
                assert all(r <= start for r in ready), (name, p, m, v, a)
                assert start == max([prev_end] + ready)  # no waiting without a reason
                prev_end = end
        assert [[a for _, _, a in row] for row in tl.rows] == stage_orders(name, p, m, v)


def test_the_lecture_gpipe_chart_is_reproduced():
    """4 stages, 4 micro-batches, forward 1 and backward 2 time units (lecture 13, §4.3)."""
    def idle(n):
        return ". " * n
    fwd, bwd = "F0F1F2F3", "B0B0B1B1B2B2B3B3"  # a backward fills two columns
    want = [f"device {s} |{idle(s)}{fwd}{idle(9 - 3 * s)}{bwd}{idle(2 * s)}|" for s in range(4)]
    assert text_chart(run("gpipe", 4, 4)).splitlines() == want


def test_1f1b_orders_warm_up_then_alternate_then_drain():
    for p, m in [(4, 8), (4, 2), (8, 3), (5, 5)]:
        for s, order in enumerate(stage_orders("1f1b", p, m)):
            kinds = "".join(a.kind for a in order)
            warm = min(p - s - 1, m)
            steady = m - warm
            assert kinds == "F" * warm + "FB" * steady + "B" * warm, (p, m, s)
            assert [a.micro_batch for a in order if a.kind == "F"] == list(range(m))
            assert [a.micro_batch for a in order if a.kind == "B"] == list(range(m))
    chart = text_chart(run("1f1b", 4, 4)).splitlines()
    assert chart[3] == "device 3 |. . . F0B0B0F1B1B1F2B2B2F3B3B3. . . . . . |"


def test_peak_in_flight_micro_batches():
    """GPipe holds all m micro-batches' activations; 1F1B at most p (p-s on device s)."""
    for p in (2, 4, 8):
        for m in (1, 3, 4, 8, 17):
            assert run("gpipe", p, m).peak_in_flight == [m] * p
            peaks = run("1f1b", p, m).peak_in_flight
            assert max(peaks) <= p and peaks[0] == min(m, p)
            assert peaks == [min(m, p - s) for s in range(p)]
    # Interleaved: Megatron's warm-up plus one, in chunk activations (1/v of a stage each).
    for p, m, v in [(4, 8, 2), (4, 4, 2), (8, 16, 4), (2, 6, 3)]:
        peaks = run("interleaved", p, m, v).peak_in_flight
        assert peaks == [min(m * v, (v - 1) * p + 2 * (p - s - 1) + 1) for s in range(p)]


def test_orders_that_cannot_run_are_refused():
    good = stage_orders("1f1b", 2, 2)
    assert run("1f1b", 2, 2).rows  # fine as built
    deadlock = [[Action("F", 0, 0, 0), Action("B", 1, 0, 0), Action("F", 1, 0, 0),
                 Action("B", 0, 0, 0)], good[1]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(deadlock, 2, 2)
    backward_first = [good[0], [Action("B", 0, 0, 1), Action("F", 0, 0, 1),
                                Action("F", 1, 0, 1), Action("B", 1, 0, 1)]]
    with pytest.raises(ScheduleError, match="deadlock"):  # the last stage's B needs its F
        simulate(backward_first, 2, 2)
    with pytest.raises(ScheduleError, match="exactly once"):
        simulate([good[0][:-1], good[1]], 2, 2)
    with pytest.raises(ScheduleError, match="exactly once"):
        simulate([good[1], good[0]], 2, 2)  # device 1's actions on device 0
    with pytest.raises(ScheduleError, match="costs must be positive"):
        simulate(good, 2, 2, f_cost=0)


@pytest.mark.parametrize("args, words", [
    (("zigzag", 4, 4), ["'zigzag'", "gpipe, 1f1b, interleaved"]),
    (("interleaved", 4, 6, 2), ["multiple", "m=6", "p=4", "m=8"]),
    (("interleaved", 4, 8, 1), ["v >= 2"]),
    (("1f1b", 4, 8, 2), ["v=2", "interleaved"]),
    (("gpipe", 0, 4), ["stages p", "got 0"]),
    (("gpipe", 4, -1), ["micro-batches m", "got -1"]),
    (("gpipe", 4, True), ["micro-batches m"]),
])
def test_bad_sizes_raise_schedule_error(args, words):
    with pytest.raises(ScheduleError) as e:
        stage_orders(*args)
    assert isinstance(e.value, ValueError)
    for w in words:
        assert w in str(e.value)


def test_exercise_3_smallest_micro_batches_for_ten_percent_idle():
    """Lecture 13 exercise 3: idle <= 10% needs m >= 9(p-1): 27 for p=4, 63 for p=8."""
    for name in ("gpipe", "1f1b"):
        assert smallest_micro_batches(name, 4) == 27
        assert smallest_micro_batches(name, 8) == 63
    for p, want in [(4, 27), (8, 63)]:  # the answer is tight in the simulator itself
        assert run("1f1b", p, want).idle_fraction <= Fraction(1, 10)
        assert run("1f1b", p, want - 1).idle_fraction > Fraction(1, 10)
    # Interleaving with v=2 halves it, rounded up to a multiple of p: 16 for p=4, 32 for p=8.
    assert smallest_micro_batches("interleaved", 4, v=2) == 16
    assert smallest_micro_batches("interleaved", 8, v=2) == 32
    # The bisection agrees with a plain scan.
    for p, bound in [(2, 0.3), (3, 0.15), (5, 0.25)]:
        scan = next(m for m in range(1, 100) if run("gpipe", p, m).idle_fraction
                    <= Fraction(str(bound)))
        assert smallest_micro_batches("gpipe", p, bound) == scan
    with pytest.raises(ScheduleError, match="no m <="):
        smallest_micro_batches("gpipe", 4, 0.0, limit=64)


def test_text_chart_shape():
    for name, p, m, v in [("gpipe", 4, 4, 1), ("1f1b", 8, 12, 1), ("interleaved", 4, 8, 2)]:
        tl = run(name, p, m, v)
        lines = text_chart(tl).splitlines()
        assert len(lines) == p
        width = 2 + (m > 10) + (v > 1)  # "F3", "F12", "F3a"
        unit = Fraction(1, v)  # costs 1 and 2 split into v chunks
        for s, line in enumerate(lines):
            head, body, tail = line.split("|")
            assert head == f"device {s} " and tail == ""
            cells = [body[i:i + width] for i in range(0, len(body), width)]
            assert len(body) == width * tl.makespan / unit
            assert sum(c[0] in "FB" for c in cells) * unit == tl.busy[s]
            assert sum(c.strip() == "." for c in cells) * unit == tl.makespan - tl.busy[s]


def test_text_chart_refuses_to_be_too_wide():
    """Forward 1, backward 2,000: 3 forwards and 3 backwards on the critical path, 6,003
    columns at one per time unit: refused, saying why."""
    with pytest.raises(ScheduleError) as e:
        text_chart(run("gpipe", 2, 2, 1, 1, 2000))
    assert "6,003 columns wide, more than 5,000" in str(e.value)
    assert "fewer micro-batches" in str(e.value) and "coarser grid" in str(e.value)


def _labels_inside_their_boxes(fig) -> int:
    """Lay the figure out as save_figure does; assert every box label lies inside its box
    (so no two overlap: boxes are disjoint); return how many labels there are."""
    fig.tight_layout()
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    labels = [t for t in ax.texts if (t.get_gid() or "").startswith("label:")]
    for t in labels:
        _, lane, start, end = t.get_gid().split(":")
        (x0, y0), (x1, y1) = ax.transData.transform([(float(start), int(lane) - 0.4),
                                                     (float(end), int(lane) + 0.4)])
        box = t.get_window_extent(renderer)
        assert min(x0, x1) <= box.x0 and box.x1 <= max(x0, x1), t.get_text()
        assert min(y0, y1) <= box.y0 and box.y1 <= max(y0, y1), t.get_text()
    return len(labels)


@pytest.mark.parametrize("case", [("interleaved", 4, 8, 2), ("gpipe", 4, 4, 1),
                                  ("1f1b", 8, 32, 1), ("interleaved", 8, 64, 4)])
def test_gantt_labels_fit_inside_their_boxes(case):
    tl = run(*case)
    fig, counts = gantt_figure(tl)
    n_boxes = 2 * tl.p * tl.m * tl.v
    assert sum(counts.values()) == n_boxes
    assert _labels_inside_their_boxes(fig) == counts["full"] + counts["short"]
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    if case[:3] in (("interleaved", 4, 8), ("gpipe", 4, 4)):  # small enough: every box named
        assert counts == {"full": n_boxes, "short": 0, "none": 0}
    if tl.v > 1:  # the chunks' shades are explained
        assert {"forward, chunk a", "backward, chunk b"} <= set(legend)
    if counts["short"]:
        assert "numbers: micro-batch" in legend
    if case == ("interleaved", 8, 64, 4):  # 4,096 boxes: too narrow, and the legend says so
        assert counts["none"] > 0 and any("too narrow" in t for t in legend)
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_gantt_label_counts_match_measuring_every_label():
    """Measured again here, box by box and without gantt's shortcut for tiny boxes: the
    first of F3a at 7 pt, at 5.5 pt, 3 at 7 pt, at 5.5 pt that fits, else none."""
    tl = run("interleaved", 4, 16, 3)  # boxes of every kind: full, short and none
    fig, counts = gantt_figure(tl)
    fig.tight_layout()
    ax, renderer = fig.axes[0], fig.canvas.get_renderer()
    want = {"full": 0, "short": 0, "none": 0}
    for s, row in enumerate(tl.rows):
        for start, end, a in row:
            (x0, y0), (x1, y1) = ax.transData.transform([(float(start), s - 0.4),
                                                         (float(end), s + 0.4)])
            kind = "none"
            for text, name, size in [(a.label(3), "full", 7), (a.label(3), "full", 5.5),
                                     (str(a.micro_batch), "short", 7),
                                     (str(a.micro_batch), "short", 5.5)]:
                probe = ax.text(0, 0, text, fontsize=size)
                box = probe.get_window_extent(renderer)
                probe.remove()
                if box.width <= abs(x1 - x0) - 2 and box.height <= abs(y1 - y0) - 2:
                    kind = name
                    break
            want[kind] += 1
    assert counts == want and min(want.values()) > 0
    import matplotlib.pyplot as plt
    plt.close(fig)


def test_gantt_png(tmp_path):
    path = tmp_path / "gantt.png"
    counts = gantt_png(run("interleaved", 4, 4, 2), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert counts == {"full": 64, "short": 0, "none": 0}


# --- the command ---------------------------------------------------------------------------

@pytest.fixture
def schedule_cli(capsys):

    def call(*argv):
        code = cli_main(["schedule", *argv])
        out = capsys.readouterr()
        return code, out.out, out.err
    return call


def test_cli_prints_chart_measured_and_formula(schedule_cli):
    code, out, _ = schedule_cli("--stages", "4", "--micro-batches", "4", "--schedule", "1f1b")
    assert code == 0
    assert "device 3 |. . . F0B0B0F1B1B1F2B2B2F3B3B3. . . . . . |" in out
    assert "simulated 3/7 = 0.4286; formula (p-1)/(m+p-1) = 3/7" in out
    assert "per device: 4 3 2 1" in out


def test_cli_json_has_every_figure(schedule_cli, tmp_path):
    png = tmp_path / "i.png"
    code, out, _ = schedule_cli("--stages", "4", "--micro-batches", "8", "--schedule",
                                "interleaved", "--virtual", "2", "--forward-cost", "1",
                                "--backward-cost", "2", "--png", str(png), "--json")
    r = json.loads(out)
    assert code == 0 and png.exists() and r["png"] == str(png)
    assert r["idle_fraction_exact"] == r["formula_idle_fraction_exact"] == "3/19"
    assert r["matches_formula"] is True and r["formula"] == "(p-1)/(v*m+p-1)"
    assert r["makespan"] == 28.5 and r["busy"] == [24.0] * 4
    assert r["peak_in_flight"] == [11, 9, 7, 5]
    assert [len(o) for o in r["orders"]] == [32] * 4 and r["orders"][3][:3] == ["F0a", "F1a", "F2a"]
    assert len(r["timeline"][0]) == 32 and r["chart"].count("\n") == 3
    _, out, _ = schedule_cli("--schedule", "gpipe", "--json")
    r = json.loads(out)
    assert (r["stages"], r["micro_batches"], r["virtual"]) == (4, 4, 1)
    assert r["idle_fraction_exact"] == "3/7" and r["peak_in_flight"] == [4] * 4


def test_cli_zero_bubble_splits_the_backward(schedule_cli):
    code, out, _ = schedule_cli("--schedule", "zb-h1", "--micro-batches", "8", "--weight-cost",
                                "0.8", "--json")
    r = json.loads(out)
    assert code == 0 and r["weight_cost"] == 0.8 and r["matches_formula"] is True
    assert r["idle_fraction_exact"] == "7/47"  # idle 3 x (1 + 1.2 - 0.8) = 4.2 over 28.2
    assert r["peak_in_flight"] == [4] * 4 and r["orders"][3][:3] == ["F0", "B0", "F1"]
    assert {e["kind"] for e in r["timeline"][0]} == {"F", "B", "W"}
    code, out, _ = schedule_cli("--schedule", "zb-h2", "--micro-batches", "8")
    assert "backward 2 = input gradient B 1 + weight gradient W 1 per stage" in out
    assert "simulated 1/9 = 0.1111" in out and "(equal)" in out and "(held from F until W)" in out
    code, out, _ = schedule_cli("--schedule", "zbv", "--micro-batches", "8", "--json")
    r = json.loads(out)  # two chunks by default, half the idle of zb-h1's 1/9
    assert r["virtual"] == 2 and r["idle_fraction_exact"] == "1/17" and r["matches_formula"]
    code, out, _ = schedule_cli("--schedule", "zbv", "--micro-batches", "8", "--weight-cost", "0.5")
    assert "(none for these costs)" in out


@pytest.mark.parametrize("argv, words", [
    (["--schedule", "zigzag"], ["'zigzag'", "gpipe, 1f1b, interleaved"]),
    (["--schedule", "1f1b", "--virtual", "2"], ["--virtual 2", "interleaved"]),
    (["--schedule", "gpipe", "--virtual", "3"], ["--virtual 3", "interleaved"]),
    (["--schedule", "interleaved", "--micro-batches", "6"], ["multiple", "m=6", "p=4"]),
    (["--schedule", "interleaved", "--virtual", "1"], ["v >= 2"]),
    (["--schedule", "1f1b", "--weight-cost", "1"], ["--weight-cost", "zb-h1, zb-h2", "1f1b"]),
    (["--schedule", "zb-h1", "--weight-cost", "2"], ["weight part 2.0", "less than the backward"]),
    (["--schedule", "zb-h2", "--micro-batches", "6"], ["zb-h2", "p=4", "got m=6; try m=8"]),
    (["--schedule", "zbv", "--virtual", "3"], ["zbv runs two chunks per device", "use v=2"]),
    (["--stages", "0"], ["--stages", "0"]),
    (["--micro-batches", "-3"], ["--micro-batches", "-3"]),
    (["--virtual", "0"], ["--virtual", "0"]),
    (["--forward-cost", "0"], ["--forward-cost", "0"]),
    (["--backward-cost", "-2"], ["--backward-cost", "-2"]),
    (["--stages", "two"], ["--stages", "'two'"]),
    (["--stages", "1e6", "--micro-batches", "1e6"], ["--stages", "1e6", f"at most {MAX_STAGES}"]),
    (["--micro-batches", str(MAX_MICRO_BATCHES + 1)],
     ["--micro-batches", str(MAX_MICRO_BATCHES + 1), f"at most {MAX_MICRO_BATCHES}"]),
    (["--schedule", "interleaved", "--virtual", "1e9"],
     ["--virtual", "1e9", f"at most {MAX_VIRTUAL}"]),
    (["--stages", "64", "--micro-batches", "256"],
     ["--stages 64 x --micro-batches 256 x --virtual 1 = 16,384", f"more than {MAX_FORWARDS:,}"]),
])
def test_cli_bad_input_is_one_line_and_exit_2(schedule_cli, capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        schedule_cli(*argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("jaxscale: error: "), err
    for w in words:
        assert w in err, err


@pytest.mark.slow
def test_cli_runs_at_its_limits(schedule_cli):
    """The largest runs the limits allow finish (the simulator is plain Python)."""
    assert MAX_STAGES * (MAX_FORWARDS // MAX_STAGES) == MAX_FORWARDS
    for argv in (["--stages", MAX_STAGES, "--micro-batches", MAX_FORWARDS // MAX_STAGES],
                 ["--stages", MAX_FORWARDS // MAX_MICRO_BATCHES,
                  "--micro-batches", MAX_MICRO_BATCHES, "--schedule", "gpipe"],
                 ["--stages", 8, "--micro-batches", 64, "--schedule", "interleaved",
                  "--virtual", MAX_VIRTUAL]):
        code, out, _ = schedule_cli(*map(str, argv), "--json")
        r = json.loads(out)
        assert code == 0 and r["matches_formula"] is True
        assert r["stages"] * r["micro_batches"] * r["virtual"] == MAX_FORWARDS


def test_cli_counts_are_plural_only_when_many(schedule_cli):
    _, out, _ = schedule_cli("--stages", "1", "--micro-batches", "1")
    assert "p = 1 stage, m = 1 micro-batch, v = 1 chunk per device" in out
    assert "(GPipe would hold 1 micro-batch on every device)" in out
    _, out, _ = schedule_cli("--stages", "2", "--micro-batches", "2", "--schedule", "interleaved")
    assert "p = 2 stages, m = 2 micro-batches, v = 2 chunks per device" in out
    assert "F1b = micro-batch 1 on chunk b" in out  # an action this run has
    _, out, _ = schedule_cli()
    assert "(GPipe would hold all 4 micro-batches on every device)" in out


def test_cli_png_writes_only_where_told(schedule_cli, capsys, tmp_path):
    """--png names a file in an existing folder: no folder is created, no path reported
    that was not written."""
    for bad, words in ((tmp_path / "missing" / "s.png", ["does not exist", "missing"]),
                       (tmp_path, ["is a folder"])):
        with pytest.raises(SystemExit) as e:
            schedule_cli("--png", str(bad))
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2 and len(err.splitlines()) == 1 and "--png" in err, err
        assert all(w in err for w in words), err
    assert list(tmp_path.iterdir()) == []  # nothing created
    code, out, _ = schedule_cli("--png", str(tmp_path / "s.png"))
    assert code == 0 and f"Gantt chart in {tmp_path / 's.png'}" in out
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
