"""The zero-bubble schedules in the cost model and the planner: bubble and in-flight
micro-batches from the closed forms equal the simulator's, the planner's search includes
them when asked (and only then), bad input."""
import pytest

from jaxscale import costmodel as cm
from jaxscale.costmodel import planner as P
from jaxscale.costmodel.devices import device
from jaxscale.costmodel.layout import Layout, memory
from jaxscale.costmodel.schedule import in_flight
from jaxscale.costmodel.shape import ShapeError, Transformer
from jaxscale.costmodel.steptime import step_time
from jaxscale.parallel.schedules import run

SMALL = Transformer(8, 1024, 8, 512, vocab=1000)


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 16), (8, 64)])
def test_closed_forms_equal_the_simulator(p, m):
    """F = B = W (the simulator's default split of a backward of 2): Qi et al.'s ZB-H1
    bubble (p-1)(F+B-W) is a third of 1F1B's (p-1)(F+B+W); zb-h2 idles the same inside one
    step; zbv, with chunks of half a stage, idles half as long; the first stage holds p
    (zb-h1, zbv) and 2p (zb-h2) micro-batches' stage activations from F until W."""
    for schedule, v in (("zb-h1", 1), ("zb-h2", 1), ("zbv", 2)):
        tl = run(schedule, p, m, v)
        assert cm.bubble_over_total(p, m, schedule=schedule) == pytest.approx(
            float(tl.idle_fraction), rel=1e-12)
        assert cm.bubble_over_ideal(p, m, schedule=schedule) == pytest.approx(
            cm.bubble_over_ideal(p, m) / (3 * v), rel=1e-12)  # zbv: chunks of half a stage
        assert in_flight(p, m, schedule) == tl.peak_in_flight[0] / v  # stages' worth


def test_a_zero_bubble_layout_costs_a_third_of_the_bubble_and_its_in_flight_memory():
    one, zb1, zb2 = (Layout(dp=2, pp=4, micro_batch=1, zero_bubble=z) for z in ("", "zb-h1",
                                                                             "zb-h2"))
    a100 = device("a100")
    times = [step_time(SMALL, lay, 64, a100) for lay in (one, zb1, zb2)]
    assert times[1]["bubble"] == pytest.approx(times[0]["bubble"] / 3, rel=1e-12)
    assert times[1]["compute"] == times[0]["compute"] and times[2]["bubble"] == times[1]["bubble"]
    mems = [memory(SMALL, lay, 64) for lay in (one, zb1, zb2)]
    assert mems[1]["activations"] == mems[0]["activations"]  # p = 4 in flight either way
    assert mems[2]["activations"] == pytest.approx(2 * mems[0]["activations"])
    assert zb1.name() == "dp2 pp4 zb-h1 mb1" and zb1.as_dict()["schedule"] == "zb-h1"


def test_the_planner_searches_them_only_when_asked():
    a100 = device("a100")
    base = dict(shape=SMALL, batch=64, devices=8, device=a100,
                fixed=(("pp", 4), ("tp", 1), ("cp", 1), ("virtual", 1)))
    default = P.plan(P.Job(**base))
    asked = P.plan(P.Job(**base, schedules=("1f1b", "zb-h1", "zb-h2")))
    assert default["recommended"]["layout"]["zero_bubble"] == ""
    best = asked["recommended"]
    assert best["layout"]["zero_bubble"] in ("zb-h1", "zb-h2")
    assert best["time"]["step"] < default["recommended"]["time"]["step"]
    assert asked["fitting"] > default["fitting"]
    vee = P.ranked(P.Job(**{**base, "fixed": (("pp", 4), ("tp", 1), ("cp", 1))},
                         schedules=("zbv",)))
    assert {r["layout"]["zero_bubble"] for r in vee} == {"zbv", ""}  # "": interleaved, v > 1
    assert all(r["layout"]["virtual"] == 2 for r in vee if r["layout"]["zero_bubble"])
    # dp = 2 with micro-batches of 8 sequences: m = 64 / 16 = 4, and zb-h2 at p = 4 needs 8
    only = P.plan(P.Job(**base, schedules=("zb-h2",), micro_batches=(8,)))
    assert only["fitting"] == 0 and only["rejected"] == {P.REASONS["zero_bubble"]: 1}
    assert P.plan(P.Job(**base, schedules=("zb-h2",), micro_batches=(4,)))["fitting"] > 0


def test_bad_input_names_the_value():
    with pytest.raises(cm.CostModelError, match="schedules zb-h3: choose from 1f1b, zb-h1"):
        P.plan(P.Job(SMALL, 64, 8, device("a100"), schedules=("zb-h3",)))
    with pytest.raises(ShapeError, match="zero_bubble .zb-h1. is one of .* with pp >= 2; got pp=1"):
        memory(SMALL, Layout(dp=8, zero_bubble="zb-h1"), 64)
    with pytest.raises(cm.CostModelError, match="zb-h2 needs at least 8 micro-batches"):
        cm.bubble_over_total(4, 6, schedule="zb-h2")


def test_plan_cli_takes_schedules_and_refuses_a_bad_one(cli, capsys):
    out = cli("plan", "--layers", "8", "--hidden", "1024", "--heads", "8", "--seq", "512",
              "--batch", "64", "--devices", "8", "--fix", "pp=4,tp=1,cp=1,virtual=1",
              "--schedules", "1f1b,zb-h1", "--json")
    assert out["recommended"]["layout"]["schedule"] == "zb-h1"
    assert out["job"]["schedules"] == ["1f1b", "zb-h1"]
    with pytest.raises(SystemExit) as e:
        cli("plan", "--params", "7e9", "--devices", "8", "--schedules", "zb-h9")
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "'zb-h9'" in err, err
