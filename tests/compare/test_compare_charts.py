"""compare's charts on a synthetic result (the contract compare fills): what is drawn, not
only that a PNG exists."""
import numpy as np
import pytest

from jaxscale.compare.charts import charts

N, STEPS = 30_752, 12  # the tiny model's parameters; steps per run


def _row(name, mesh, k=1, zero=0, rel=0.0, sent=0.0, sent_pred=0.0, seed=0):
    rng = np.random.default_rng(seed)
    single = 4.6 * np.exp(-0.08 * np.arange(STEPS))
    rel_d = np.zeros(STEPS) if rel == 0 else rel * rng.uniform(0.2, 1.0, STEPS)
    params = 4 * N // (k if zero == 3 else 1)
    opt = 8 * N // (k if zero else 1)
    return {"name": name, "status": "ok", "mesh": mesh, "plan": {},
            "losses": (single * (1 + rel_d)).tolist(), "rel_dloss": rel_d.tolist(),
            "max_rel_dloss": float(rel_d.max()), "pass": bool(rel_d.max() <= 1e-5),
            "memory": {"params": params, "master": 0, "optimizer": opt + 4,
                       "arguments": params + opt + 5000, "temporaries": 9_000_000},
            "predicted": {"states": {"params": params, "optimizer": opt,
                                     "grads": 4 * N // (k if zero >= 2 else 1)},
                          "sent": {"all-reduce": sent_pred} if sent_pred else {}},
            "sent": {"all-reduce": sent} if sent else {}, "sent_total": sent,
            "sent_predicted_total": sent_pred, "step_s": 0.01, "step_s_q1": 0.009,
            "step_s_q3": 0.011, "compile_s": 2.0, "compile_source": "compiled"}


@pytest.fixture
def result():
    ring = 2 * 7 / 8 * 4 * N
    rows = [_row("single", "1 device"),
            _row("single-rerun", "1 device", rel=3e-7, seed=1),  # the control run
            _row("dp", "dp=8", k=8, rel=4e-7, sent=ring, sent_pred=ring, seed=2),
            _row("dp-m4", "dp=8", k=8, rel=0.0, sent=ring, sent_pred=ring),  # bit-identical
            _row("zero3", "dp=8 ZeRO-3", k=8, zero=3, rel=6e-7, sent=1.57 * ring,
                 sent_pred=1.57 * ring, seed=3),
            {"name": "tp2", "status": "failed", "error": "XLA aborted", "plan": {},
             "mesh": "tp=2"}]
    return {"model": "tiny", "devices": 8, "steps": STEPS, "batch_size": 32, "rows": rows,
            "noise": {"control": "single-rerun", "drift": 3e-7, "multiple": 10.0,
                      "floor": 1e-6, "tolerance": 3e-6}}


@pytest.fixture
def drawn(result, tmp_path):
    figs = charts(result, tmp_path)
    for name in ("memory", "bytes", "losses"):
        assert (tmp_path / f"{name}.png").read_bytes()[:4] == b"\x89PNG"
    return figs, result


def _bars(ax) -> dict:
    """{container label: {bar centre x: (bottom, height)}}."""
    return {c.get_label(): {round(p.get_x() + p.get_width() / 2, 3): (p.get_y(), p.get_height())
                            for p in c.patches} for c in ax.containers}


def test_memory_bars_compare_the_same_components(drawn):
    figs, result = drawn
    ax = figs["memory"].axes[0]
    bars = _bars(ax)
    assert not any("grad" in label for label in bars)  # gradients in neither side
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    scale = 1e3  # the figure's unit: the largest total is ~370 kB
    assert "kB" in ax.get_ylabel()
    for i, r in enumerate(ok):
        m = sum(h for label, b in bars.items() if "(measured)" in label for _, h in [b[round(i - 0.2, 3)]])
        p = sum(h for label, b in bars.items() if "(predicted)" in label
                for _, h in [b[round(i + 0.2, 3)]])
        mem, pred = r["memory"], r["predicted"]["states"]
        assert m * scale == pytest.approx(mem["params"] + mem["master"] + mem["optimizer"])
        assert p * scale == pytest.approx(pred["params"] + pred["optimizer"])
        assert abs(m / p - 1) < 1e-3  # like with like: the synthetic pairs agree
    assert "tp2" in ax.get_title() and "tp2" not in [t.get_text() for t in ax.get_xticklabels()]


def test_bytes_chart_writes_zero_instead_of_a_fake_bar(drawn):
    figs, result = drawn
    ax = figs["bytes"].axes[0]
    assert ax.get_yscale() == "log" and ax.get_title()
    bars = _bars(ax)
    assert set(bars) == {"measured (HLO)", "predicted"}
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    silent = [i for i, r in enumerate(ok) if r["sent_total"] == 0]
    assert silent == [0, 1]  # the single device and its control run send nothing
    for label, dx in (("measured (HLO)", -0.2), ("predicted", 0.2)):
        xs = set(bars[label])
        assert not any(round(i + dx, 3) in xs for i in silent)  # no bar for 0 bytes
        assert len(xs) == len(ok) - len(silent)
        assert all(h >= 1000 for _, h in bars[label].values())
    zeros = [t for t in ax.texts if (t.get_gid() or "").startswith("zero:")]
    assert sorted(t.get_gid() for t in zeros) == sorted(
        f"zero:{key}:{i}" for key in ("sent_total", "sent_predicted_total") for i in silent)
    assert {t.get_text() for t in zeros} == {"0"}


def test_losses_chart_shows_differences_noise_and_bound(drawn):
    figs, result = drawn
    ax, ax_loss = figs["losses"].axes
    assert ax.get_yscale() == "log"
    lines = {line.get_label(): line for line in ax.get_lines()}
    # one curve per strategy but the reference (and the failed one)
    curves = {k.split(" ")[0].rstrip(":"): v for k, v in lines.items()
              if not k.startswith(("noise", "pass", "_"))}
    assert set(curves) == {"single-rerun", "dp", "dp-m4", "zero3"}
    control = curves["single-rerun"]
    assert control.get_linestyle() == "--" and control.get_color() == "k"  # drawn apart
    assert all(c.get_color() != "k" for n, c in curves.items() if n != "single-rerun")
    floor = ax.get_ylim()[0] * 2
    identical = next(k for k in lines if k.startswith("dp-m4"))
    assert "identical" in identical
    np.testing.assert_allclose(curves["dp-m4"].get_ydata(), floor)  # visible, at the floor
    assert floor > 0 and floor < 3e-7 / 10
    row = next(r for r in result["rows"] if r["name"] == "zero3")
    np.testing.assert_allclose(curves["zero3"].get_ydata(), row["rel_dloss"])
    bound = next(v for k, v in lines.items() if k.startswith("pass bound"))
    noise = next(v for k, v in lines.items() if k.startswith("noise"))
    assert set(bound.get_ydata()) == {3e-6} and set(noise.get_ydata()) == {3e-7}
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("exactly 0, drawn at" in t for t in legend)
    single = next(r for r in result["rows"] if r["name"] == "single")
    np.testing.assert_allclose(ax_loss.get_lines()[0].get_ydata(), single["losses"])
    assert "failed" in ax.get_title() and "tp2" in ax.get_title()


def test_charts_without_failures_or_traffic(result, tmp_path):
    """Only single-device rows: no bars at all on the log scale, only zeros; no failure note."""
    result["rows"] = [r for r in result["rows"] if r["name"] in ("single", "single-rerun")]
    figs = charts(result, tmp_path)
    ax = figs["bytes"].axes[0]
    assert all(len(c.patches) == 0 for c in ax.containers)
    assert len([t for t in ax.texts if t.get_text() == "0"]) == 4
    assert "failed" not in figs["losses"].axes[0].get_title()


def test_a_failed_control_or_no_bound_draws_no_line_instead_of_crashing(result, tmp_path):
    """The control run failed (no drift) and no --tolerance (no bound): the losses chart is
    drawn without those two lines (before: max(None, floor) raised, and no table printed)."""
    result["noise"].update(drift=None, tolerance=None)
    ax = charts(result, tmp_path)["losses"].axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert not any(t.startswith(("noise:", "pass bound")) for t in labels), labels


def test_a_plan_the_cost_model_does_not_cover_says_so(result, tmp_path):
    """A written-out layout with remat or bf16 has no prediction: its measured bars stand
    alone, labelled, instead of a crash or a 0 that would read as a prediction."""
    row = result["rows"][2]
    row.update(predicted=None, sent_predicted_total=None)
    figs = charts(result, tmp_path)
    mem = [t.get_text() for t in figs["memory"].axes[0].texts]
    sent = [t.get_text() for t in figs["bytes"].axes[0].texts]
    assert mem.count("not modelled") == 1 and sent.count("not\nmodelled") == 1
