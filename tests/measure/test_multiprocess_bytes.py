"""Bytes that leave a process: the HLO count (measure.ring_bytes_by_op with a device-to-process
map), the prediction from the placement, and compare's cross-proc column, without starting
any process (the map is given by hand)."""
import pytest

from jaxscale.measure import hlo as measure
from jaxscale.compare import report
from jaxscale.model import config as model_config

F32_256 = "f32[256]{0}"  # 1024 bytes on one device
TWO_BY_TWO = [0, 0, 1, 1]  # 4 devices, 2 processes of 2


def _hlo(*lines: str) -> str:
    return "\n".join(f"  %c{i} = {line}" for i, line in enumerate(lines))


def test_an_all_reduce_over_two_processes_sends_half_its_hops_across():
    # ring 0->1->2->3->0: the hops 1->2 and 3->0 join the processes, 2 of 4
    hlo = _hlo(f"{F32_256} all-reduce(f32[256]{{0}} %x), replica_groups={{{{0,1,2,3}}}}, "
               "to_apply=%add")
    assert measure.ring_bytes_by_op(hlo) == {"all-reduce": 2 * 3 / 4 * 1024}
    assert measure.ring_bytes_by_op(hlo, device_process=TWO_BY_TWO) == {
        "all-reduce": 2 * 3 / 4 * 1024 * 2 / 4}
    # interleaved processes: every hop crosses
    assert measure.ring_bytes_by_op(hlo, device_process=[0, 1, 0, 1]) == {
        "all-reduce": 2 * 3 / 4 * 1024}


def test_permutes_count_the_pairs_that_cross():
    across = _hlo(f"{F32_256} collective-permute(f32[256]{{0}} %x), "
                  "source_target_pairs={{0,2},{2,0}}")
    assert measure.ring_bytes_by_op(across, device_process=TWO_BY_TWO) == {
        "collective-permute": 1024}
    inside = _hlo(f"{F32_256} collective-permute(f32[256]{{0}} %x), "
                  "source_target_pairs={{0,1},{1,0}}")
    assert measure.ring_bytes_by_op(inside) == {"collective-permute": 1024}
    assert measure.ring_bytes_by_op(inside, device_process=TWO_BY_TWO) == {}
    half = _hlo(f"{F32_256} collective-permute(f32[256]{{0}} %x), "
                "source_target_pairs={{0,1},{1,2},{2,3},{3,0}}")
    assert measure.ring_bytes_by_op(half, device_process=TWO_BY_TWO) == {
        "collective-permute": 512}


def test_groups_inside_a_process_send_nothing_across():
    hlo = _hlo(
        f"{F32_256} all-gather(f32[128]{{0}} %x), replica_groups={{{{0,1}},{{2,3}}}}, "
        "dimensions={0}",
        f"f32[128]{{0}} reduce-scatter({F32_256} %y), replica_groups=[2,4]<=[8], "
        "dimensions={0}, to_apply=%add")
    by_process = [0] * 4 + [1] * 4
    assert measure.ring_bytes_by_op(hlo, device_process=by_process) == {}
    assert measure.ring_bytes_by_op(hlo) == {"all-gather": 512, "reduce-scatter": 3 * 512}
    # the same groups across interleaved processes: all of it crosses
    assert measure.ring_bytes_by_op(hlo, device_process=[0, 1] * 4) == {
        "all-gather": 512, "reduce-scatter": 3 * 512}


def test_an_op_over_every_device_uses_the_whole_map():
    hlo = _hlo(f"{F32_256} all-reduce(f32[256]{{0}} %x), replica_groups={{}}, to_apply=%add")
    assert measure.ring_bytes_by_op(hlo, n_devices=4, device_process=TWO_BY_TWO) == {
        "all-reduce": 2 * 3 / 4 * 1024 / 2}


# --- the prediction: each axis's share of crossing hops under the placement --------------------

BY_PROCESS = [0] * 4 + [1] * 4  # 2 processes x 4 devices, as compare's workers place them


def _plan(**axes):
    from jaxscale.parallel.plan import Plan
    return Plan(**axes).as_dict()


@pytest.mark.parametrize("axes, share", [
    # ring 0..7: 3->4 and 7->0 cross
    (dict(dp=8), {"dp": 2 / 8, "pp": 0.0, "cp": 0.0, "tp": 0.0}),
    (dict(dp=4, pp=2, micro_batches=4), {"dp": 0.5, "pp": 0.0, "cp": 0.0, "tp": 0.0}),  # 0,2,4,6
    (dict(dp=2, tp=4), {"dp": 1.0, "pp": 0.0, "cp": 0.0, "tp": 0.0}),
    (dict(dp=2, pp=2, tp=2, micro_batches=4), {"dp": 1.0, "pp": 0.0, "cp": 0.0, "tp": 0.0}),
    (dict(tp=4), {"dp": 0.0, "pp": 0.0, "cp": 0.0, "tp": 0.0}),  # process 0's devices only
    (dict(tp=8), {"dp": 0.0, "pp": 0.0, "cp": 0.0, "tp": 0.25}),  # tp too big for a process
])
def test_axis_crossing_share_follows_the_placement(axes, share):
    assert report.axis_crossing_share(_plan(**axes), BY_PROCESS) == share


def test_the_prediction_splits_predict_by_axis_and_adds_up():
    from jaxscale.compare.predict import predict, predictable
    from jaxscale.compare.strategies import STRATEGIES, strategy_plan
    cfg = model_config.preset("tiny")
    shape = (32, cfg.seq_len)
    for name in STRATEGIES:
        plan = strategy_plan(name, 8, cfg)
        if not predictable(plan):
            continue
        sent = predict(cfg, plan, shape)["sent"]
        by_axis = report.predicted_by_axis(cfg, plan.as_dict(), shape, sent)
        assert by_axis is not None, name
        totals = {}
        for ops in by_axis.values():
            for op, v in ops.items():
                totals[op] = totals.get(op, 0.0) + v
        assert totals == pytest.approx(sent), name
    dp = predict(cfg, strategy_plan("dp", 8, cfg), shape)["sent"]
    assert report.predict_cross_process(cfg, _plan(dp=8), shape, BY_PROCESS, dp) == {
        "all-reduce": pytest.approx(dp["all-reduce"] / 4)}
    # a prediction that does not add up (predict changed) is withheld, not shown wrong
    assert report.predict_cross_process(cfg, _plan(dp=8), shape, BY_PROCESS,
                                        {"all-reduce": 1.0}) is None


@pytest.mark.parametrize("model, name", [("tiny", "dp+pp"), ("tiny", "3d"),
                                         ("tiny-moe", "dp=2,ep=2,cp=2")])
@pytest.mark.slow
def test_measured_crossing_bytes_match_the_prediction(devices, model, name):
    """The HLO of a real step, read with the 2 x 4 map, against the placement's prediction:
    the replica groups JAX writes follow the mesh as the prediction assumes, those over
    two axes at once (tiny-moe's gradients over ep x cp) too."""
    from jaxscale.model import optim
    from jaxscale.compare.predict import predict
    from jaxscale.compare.strategies import strategy_plan
    from jaxscale.parallel.build import build_train_step
    from jaxscale.parallel.plan import Plan
    from jaxscale.parallel.tick_table import tick_table
    from conftest import setup
    cfg, params, batch = setup(model)
    plan = Plan.parse(name) if "=" in name else strategy_plan(name, 8, cfg)
    init, step = build_train_step(cfg, plan, optim.adamw(3e-3), devices)
    hlo = step.jitted.lower(init(params), step.place_batch(batch)).as_text(dialect="hlo")
    share = tick_table(plan.schedule, plan.pp, plan.micro_batches, plan.virtual).branch_share()
    measured = measure.ring_bytes_by_op(hlo, share, device_process=BY_PROCESS)
    shape = (batch["tokens"].shape[0], cfg.seq_len)
    predicted = report.predict_cross_process(model_config.preset(model), plan.as_dict(), shape,
                                             BY_PROCESS, predict(cfg, plan, shape)["sent"])
    assert measured == pytest.approx(predicted) and measured


# --- compare's cross-proc column ------------------------------------------------------------------

def _row(name, plan, predicted, sent, cross=None):
    row = {"name": name, "status": "ok", "mesh": name, "plan": plan, "max_rel_dloss": 1e-7,
           "pass": True, "memory": {"params": 1, "master": 0, "optimizer": 2,
                                    "temporaries": 5},
           "compile_s": 1.0, "compile_source": "compiled", "step_s": 0.02, "step_s_q1": 0.019,
           "step_s_q3": 0.021, "sent": sent, "predicted": predicted}
    if cross is not None:
        row["sent_cross_process"] = cross
    return row


def _result(processes):
    from jaxscale.compare.predict import predict
    from jaxscale.compare.strategies import strategy_plan
    cfg = model_config.preset("tiny")
    dp = strategy_plan("dp", 8, cfg)
    pred = predict(cfg, dp, (32, cfg.seq_len))
    single = _row("single", _plan(), {"states": {"params": 1, "optimizer": 2}, "sent": {}}, {})
    row = _row("dp", dp.as_dict(), pred, dict(pred["sent"]),
               {"all-reduce": pred["sent"]["all-reduce"] / 4} if processes > 1 else None)
    failed = {"name": "3d", "status": "failed", "mesh": "dp=2 tp=2 pp=2", "error": "died"}
    result = {"model": "tiny", "devices": 8, "steps": 2, "batch_size": 32, "cores": 2,
              "rows": [single, row, failed], "noise": {"tolerance": 1e-6, "why": "the floor"}}
    if processes > 1:
        result["processes"] = processes
    report.finish(result)
    return result, pred["sent"]["all-reduce"]


def test_the_cross_process_column_shows_measured_and_predicted(capsys):
    result, all_reduce = _result(2)
    cols, rows = report.table_rows(result)
    i = cols.index("cross-proc/step")
    assert cols[i + 1] == "pred" and cols[i - 2:i] == ["sent/step", "pred"]
    quarter = report._bytes(all_reduce / 4)
    assert rows[1][i:i + 2] == [quarter, quarter] and rows[0][i:i + 2] == ["0 B", "0 B"]
    assert rows[2][:4] == ["3d", "dp=2 tp=2 pp=2", "-", "FAILED"] and len(rows[2]) == len(cols)
    md = report.markdown(result)
    assert "| cross-proc/step | pred |" in md and "8 devices in 2 processes" in md
    n = f"{all_reduce / 4:,.0f}"
    assert f"Of which cross a process boundary (measured / predicted):\n\n- single: none\n" \
           f"- dp: all-reduce {n} / {n}\n" in md
    assert "cross-proc/step: bytes per device per step that leave the process (2 processes)" in md
    report.print_table(result)
    out = capsys.readouterr()
    assert "cross-proc/step" in out.out and "x 1 dev" in out.out
    assert "leave the process" in out.err


def test_one_process_runs_show_no_cross_process_column():
    result, _ = _result(1)
    cols, rows = report.table_rows(result)
    assert "cross-proc/step" not in cols and all(len(r) == len(cols) for r in rows)
    assert "process boundary" not in report.markdown(result)
    assert "sent_cross_process_predicted" not in result["rows"][1]
