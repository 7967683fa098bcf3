"""`jaxscale compare`: strategies measured next to their predictions, and bad input."""
import json

import pytest

from jaxscale import compare as C, model as M, optim
from jaxscale.cli import main

from conftest import run_python, setup


def test_compare_on_four_devices_end_to_end(tmp_path):
    """The command in a fresh process (it forces its own 4 devices): every strategy passes
    its loss tolerance and every measured figure equals its prediction."""
    r = run_python("from jaxscale.cli import main; import sys; sys.exit(main(sys.argv[1:]))",
                   "compare", "--devices", "4", "--strategies", "dp,zero2,zero3,tp,pp,dp+pp",
                   "--steps", "3", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    res = json.loads(r.stdout)
    assert [row["name"] for row in res["rows"]] == ["single", "dp", "zero2", "zero3", "tp", "pp",
                                                     "dp+pp"]
    assert res["all_pass"]
    for row in res["rows"]:
        assert row["states_measured"] == row["states_predicted"], row["name"]
        for op in set(row["sent"]) | set(row["predicted"]["sent"]):
            assert row["sent"].get(op, 0) == pytest.approx(row["predicted"]["sent"].get(op, 0),
                                                           rel=1e-12), (row["name"], op)
    pp = next(row for row in res["rows"] if row["name"] == "pp")
    assert pp["idle_schedule"] == pytest.approx(pp["idle_formula"], abs=1e-12)  # 1/(4+1)
    for name in ("compare.json", "compare.md", "memory.png", "bytes.png", "losses.png"):
        assert (tmp_path / name).stat().st_size > 100
    assert "| zero3 | dp=4 ZeRO-3 |" in (tmp_path / "compare.md").read_text()


@pytest.mark.parametrize("name", ["zero1", "dp+tp", "3d"])
def test_eight_device_strategies_match_their_predictions(devices, name):
    cfg, params, batch = setup("tiny")
    plan = C.check_strategies([name], 8, cfg)[name]
    row = C.run_strategy(name, plan, cfg, params, [batch], optim.adamw(3e-3), devices,
                         time_steps=False)
    pred = C.predict(cfg, plan, batch["tokens"].shape)
    m = row["memory"]
    assert m["params"] + m["master"] + m["optimizer"] == \
        pred["states"]["params"] + pred["states"]["optimizer"]
    assert row["sent"] == pytest.approx(pred["sent"], rel=1e-12)


def test_strategy_plans_on_eight_devices():
    cfg = M.preset("tiny")  # 4 heads, 2 layers
    plans = C.check_strategies(list(C.STRATEGIES), 8, cfg)
    got = {k: (p.dp, p.tp, p.pp, p.zero_stage) for k, p in plans.items()}
    assert got == {"single": (1, 1, 1, 0), "dp": (8, 1, 1, 0), "zero1": (8, 1, 1, 1),
                   "zero2": (8, 1, 1, 2), "zero3": (8, 1, 1, 3), "tp": (1, 4, 1, 0),
                   "pp": (1, 1, 2, 0), "dp+tp": (2, 4, 1, 0), "dp+pp": (4, 1, 2, 0),
                   "3d": (2, 2, 2, 1)}


@pytest.mark.parametrize("argv, words", [
    (["compare", "--devices", "4", "--strategies", "3d"], ["'3d'", "at least 8 devices, got 4"]),
    (["compare", "--devices", "3", "--strategies", "tp"], ["no tp > 1", "heads (4)"]),
    (["compare", "--strategies", "dp,fsdp"], ["'fsdp'", "single, dp, zero1"]),
    (["compare", "--devices", "-1"], ["--devices", "-1"]),
    (["compare", "--steps", "0"], ["--steps", "got 0"]),
    (["compare", "--batch-size", "12"], ["12 documents", "dp x micro_batches = 8 x 1"]),
    (["compare", "--platform", "tpu", "--strategies", "dp"], ["no tpu devices"]),
    (["compare", "--model", "7b"], ["too big to train here", "--abstract"]),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, words):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    for w in words:
        assert w in err, err


def test_abstract_compiles_a_big_model_without_running_it(tmp_path):
    """1b on 8 devices, compiled only: XLA's argument bytes equal the closed form."""
    r = run_python("from jaxscale.cli import main; import sys; sys.exit(main(sys.argv[1:]))",
                   "compare", "--abstract", "--model", "1b", "--devices", "8", "--strategies",
                   "dp,zero3,tp", "--batch-size", "8", "--out", str(tmp_path), "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    for row in rows:
        assert abs(row["rel_diff"]) < 1e-6, row  # only the optimizer's step count differs
