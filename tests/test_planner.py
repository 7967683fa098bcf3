"""The layout planner: its rules, its memory and communication counts by hand, the CLI."""

import pytest

from jaxscale import costmodel as cm
from jaxscale import planner as P

W = P.Workload(params=8e9, layers=8, hidden=1024, heads=8, seq=512, batch=32, micro_batch=2)
C = P.Cluster(devices=16, node_size=8, memory=80e9)


def test_reference_shapes_and_parameter_estimate():
    assert P.nearest_reference(70e9)[0] == "Llama-2-70B"
    assert P.nearest_reference(7e9)[0] == "Llama-2-7B"
    assert P.nearest_reference(150e9)[0] == "GPT-3 175B"
    assert P.estimate_params(32, 4096) == 12 * 32 * 4096**2
    assert P.estimate_params(2, 64, ffn=100, vocab=10) == 2 * (4 * 64 * 64 + 2 * 64 * 100) + 640


def test_layout_memory_by_hand():
    lay = P.Layout(dp=4, tp=2, pp=2, zero_stage=1)
    m = P.layout_memory(W, C, lay)
    shard = 8e9 / (2 * 2)
    assert (m["params"], m["grads"], m["optimizer"]) == pytest.approx((2 * shard, 2 * shard, 12 * shard / 4))
    per_layer = 512 * 2 * 1024 * (10 + 24 / 2 + 5 * 8 * 512 / (1024 * 2))  # Korthikanti, tp = 2
    micro = 32 // (4 * 2)  # 4 micro-batches per replica; 1F1B keeps min(4, pp = 2) in flight
    assert m["activations"] == pytest.approx((8 // 2) * min(micro, 2) * per_layer)
    assert m["zero3_gathered_layer"] == 0
    assert m["total"] == pytest.approx(2 * shard + 2 * shard + 3 * shard + m["activations"])
    rc = P.layout_memory(W, C, P.Layout(4, 2, 2, 3, recompute=True))
    assert rc["activations"] == pytest.approx(4 * 2 * 2 * 512 * 2 * 1024 + per_layer)
    assert rc["zero3_gathered_layer"] == 2 * 8e9 / (8 * 2)  # one layer of 16-bit params, /tp
    assert rc["params"] == pytest.approx(2 * shard / 4)


def test_layout_comm_by_hand():
    k = P.layout_comm(W, C, P.Layout(dp=4, tp=2, pp=2, zero_stage=1))
    one = 512 * (32 // 4) * 1024 * 2  # b*s*h of a replica's batch, 16-bit
    assert k["tp_bytes"] == pytest.approx(4 * (8 // 2) * 2 * (2 - 1) / 2 * one)
    assert k["pp_bytes"] == one  # two stages: each sends one direction
    assert k["dp_bytes"] == pytest.approx(2 * 3 / 4 * (8e9 / 4 * 2))
    assert not k["pp_across_nodes"] and k["dp_across_nodes"]  # tp*pp = 4 <= 8; 16 devices
    assert k["seconds"] == pytest.approx(k["tp_bytes"] / 300e9 + one / 300e9 + k["dp_bytes"] / 50e9)
    z3 = P.layout_comm(W, C, P.Layout(4, 2, 2, 3))
    assert z3["dp_bytes"] == pytest.approx(1.5 * k["dp_bytes"])  # ZeRO-3: +50%
    rc = P.layout_comm(W, C, P.Layout(4, 2, 2, 1, recompute=True))
    assert rc["tp_bytes"] == pytest.approx(6 / 4 * k["tp_bytes"])  # forward again: 6 all-reduces
    assert P.layout_comm(W, C, P.Layout(1, 2, 8))["pp_across_nodes"]  # tp*pp = 16 > 8


def test_structural_rules_in_order():
    w = P.Workload(params=1e9, layers=8, hidden=1024, heads=8, seq=512, batch=8)
    c = P.Cluster(devices=16)
    assert P.structural_reason(w, c, 1, 16, 1) == "tp_node"
    assert P.structural_reason(w, P.Cluster(devices=48, node_size=48), 1, 3, 16) == "tp_heads"
    assert P.structural_reason(w, c, 1, 1, 16) == "pp_layers"
    assert P.structural_reason(w, c, 16, 1, 1) == "batch"  # 8 sequences over 16 replicas
    assert P.structural_reason(w, c, 2, 1, 8) == "bubble"  # m = 4, p = 8: 7/11 > 10%
    assert P.structural_reason(w, c, 8, 2, 1) is None


def test_70b_on_64_devices():
    w = P.Workload(params=70e9, layers=80, hidden=8192, heads=64)
    c = P.Cluster(devices=64, node_size=8, memory=80e9)
    r = P.plan(w, c, top=100)
    assert r["considered"] == 28  # ordered factorisations of 2^6 into three: C(8, 2)
    assert r["fitting"] + sum(r["rejected"].values()) == r["considered"]
    # tp in {16, 32, 64}: 3 + 2 + 1 layouts; pp in {32, 64} with tp <= 8: (1, 32), (1, 64), (2, 32)
    assert r["rejected"][P.REASONS["tp_node"]] == 6
    assert r["rejected"][P.REASONS["pp_layers"]] == 3
    best = r["recommended"]
    assert best["dp"] * best["tp"] * best["pp"] == 64
    assert 8 % best["tp"] == 0 and 64 % best["tp"] == 0 and 80 % best["pp"] == 0
    assert best["memory"]["total"] <= 0.9 * 80e9 and best["bubble"] <= 0.1
    assert len(r["alternatives"]) == r["fitting"] - 1
    assert all(best["comm"]["seconds"] <= x["comm"]["seconds"] for x in r["alternatives"])
    # rule 4: every kept option is the first in MEMORY_OPTIONS that fits
    for row in [best, *r["alternatives"]]:
        i = P.MEMORY_OPTIONS.index((row["zero_stage"], row["recompute"]))
        for z, rc in P.MEMORY_OPTIONS[:i]:
            assert not P.evaluate(w, c, P.Layout(row["dp"], row["tp"], row["pp"], z, rc))["fits"]


def test_nothing_fits_names_the_reason_and_the_closest_miss():
    w = P.Workload(params=70e9, layers=80, hidden=8192, heads=64)
    r = P.plan(w, P.Cluster(devices=8, memory=16e9))
    assert r["recommended"] is None and r["fitting"] == 0
    assert r["rejected"][P.REASONS["memory"]] >= 1
    miss = r["closest_memory_miss"]
    assert miss["zero_stage"] == 3 and miss["recompute"] and miss["memory"]["total"] > 0.9 * 16e9


def test_check_refuses_inconsistent_inputs():
    with pytest.raises(cm.CostModelError, match="hidden 1000 is not divisible by heads 3"):
        P.plan(P.Workload(1e9, 8, 1000, 3), P.Cluster(devices=8))
    with pytest.raises(cm.CostModelError, match="12 devices do not fill whole nodes of 8"):
        P.plan(P.Workload(1e9, 8, 1024, 8), P.Cluster(devices=12))




def test_plan_cli_70b(cli):
    r = cli("plan", "--params", "70e9", "--devices", "64", "--device-memory", "80GB",
            "--node-size", "8", "--json")
    assert "Llama-2-70B" in r["shape_source"]
    assert r["workload"]["layers"] == 80 and r["cluster"]["memory"] == 80e9
    best = r["recommended"]
    assert best["dp"] * best["tp"] * best["pp"] == 64 and best["fits"]
    assert r["rules"] == P.RULES and len(r["alternatives"]) == 5
    out = cli("plan", "--params", "70e9", "--devices", "64")
    assert "recommended" in out and "rule 6" in out and "tp does not divide the node size" in out


def test_plan_cli_nothing_fits_exit_1(cli):
    r = cli("plan", "--model", "7b", "--devices", "2", "--device-memory", "8GiB", "--json", expect=1)
    assert r["recommended"] is None and r["cluster"]["memory"] == 8 * 2**30
    out = cli("plan", "--model", "7b", "--devices", "2", "--device-memory", "8GiB", expect=1)
    assert "no layout fits" in out and "closest to fitting" in out
