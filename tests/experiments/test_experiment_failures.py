"""experiments.failures part e: a real run crashed by SIGKILL and restarted by the supervisor,
at its smallest (three training processes in all)."""
import pytest


@pytest.mark.slow
def test_part_e_crashed_runs_end_bit_identical_and_their_waste_adds_up(tmp_path, capsys):
    from experiments.failures import crash_steps, part_e

    steps, tau = 30, 10
    (crash,) = crash_steps(steps, 1, 0)
    e = part_e({"seed": 0}, tmp_path, steps=steps, failures=1, taus=(tau,))
    (row,) = e["rows"]
    # nothing lost: the crashed run ends where the failure-free one does, bit for bit
    assert e["all_identical"] and row["state"]["identical"] and row["state"]["max_abs_diff"] == 0
    assert row["state"]["tensors"] > 0 and row["loss_curve_equal"]
    # it resumed from the checkpoint before the crash, and computed the steps since again
    resumed = (crash - 1) // tau * tau
    assert row["resume_steps"] == [0, resumed]
    assert row["recomputed_steps"] == crash - 1 - resumed
    assert row["saves"] == steps // tau and e["save_delta_steps"] > 0
    (restart,) = row["restart_s"]
    assert restart > 0 and e["fresh_start_s"] > 0
    # the wall clock agrees with what was counted: saves, steps computed twice, the restart
    assert row["waste_s"] > restart
    assert abs(row["other_s"]) < 0.5 * row["waste_s"]
    # saves dominate at this interval: the counted waste is Young's to within 2x
    assert 0.5 < row["counted_waste_without_restarts"] / row["young"] < 2
    assert (tmp_path / "e_waste_vs_interval.png").stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e_waste_vs_interval.png"]
    out = capsys.readouterr().out
    assert "bit for bit" in out and "Young" in out and "Daly" in out
