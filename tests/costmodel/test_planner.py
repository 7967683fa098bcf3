"""The layout planner: its rules, memory and time by hand, the published layouts, the CLI."""

import pytest

from jaxscale import costmodel as cm
from jaxscale.costmodel import planner as P
from jaxscale.costmodel import references as R
from jaxscale.costmodel import activations as A
from jaxscale.costmodel import states as S
from jaxscale.costmodel.devices import device
from jaxscale.costmodel.layout import Layout, memory
from jaxscale.costmodel.shape import ShapeError, Transformer
from jaxscale.costmodel.steptime import step_time

SMALL = Transformer(8, 1024, 8, 512, vocab=1000)
A100 = device("a100")


def test_reference_shapes():
    assert R.nearest_reference(70e9)[0] == "Llama-2-70B"
    assert R.nearest_reference(7e9)[0] == "Llama-2-7B"
    assert R.nearest_reference(150e9)[0] == "GPT-3 175B"
    assert Transformer(32, 4096, 32).params() == 12 * 32 * 4096**2
    assert Transformer(2, 64, 4, ffn=100, vocab=10).params() == 2 * (4 * 64 * 64 + 2 * 64 * 100) + 640


def test_layout_memory_by_hand():
    lay = Layout(dp=4, tp=2, pp=2, zero=1, micro_batch=2)
    m = memory(SMALL, lay, 32)
    shard = SMALL.params() / 4
    assert (m["params"], m["grads"], m["optimizer"]) == pytest.approx((2 * shard, 2 * shard, 3 * shard))
    per_layer = 512 * 2 * 1024 * (10 + 24 / 2 + 5 * 8 * 512 / (1024 * 2))  # Korthikanti eq. 2
    assert m["activations"] == pytest.approx(4 * 2 * per_layer)  # 4 layers x min(m = 4, pp = 2)
    assert m["gathered_layer"] == 0 and m["total"] == pytest.approx(7 * shard + m["activations"])
    z3 = memory(SMALL, Layout(4, 2, 2, zero=3, recompute="full", micro_batch=2), 32)
    assert z3["gathered_layer"] == 2 * SMALL.layer_params() / 2  # one block, 16-bit, / tp
    assert z3["activations_stored"] == 4 * 2 * 2 * 512 * 2 * 1024  # inputs only
    assert z3["working_layer"] == pytest.approx(per_layer)
    off = S.state_memory(SMALL.params(), 4, 1, offload="optimizer")
    assert off["optimizer"] == 0 and off["cpu"] == pytest.approx(3 * SMALL.params())


def test_activation_options_change_the_count():
    """The real d_ff, SwiGLU and GQA move the activations (the issue: 18% off at 11008)."""
    gpt = Transformer(32, 4096, 32, 4096)
    llama = Transformer(32, 4096, 32, 4096, ffn=11008)
    assert A.per_layer(llama)["split"] / A.per_layer(gpt)["split"] == pytest.approx(
        (8 + 4 * 11008 / 4096) / 24)
    swiglu = Transformer(32, 4096, 32, 4096, ffn=11008, swiglu=True)
    assert A.per_layer(swiglu)["split"] - A.per_layer(llama)["split"] == 2 * 11008 * 4096
    gqa = Transformer(32, 4096, 32, 4096, kv_heads=8)
    assert A.per_layer(gpt)["split"] - A.per_layer(gqa)["split"] == 4 * (4096 - 1024) * 4096
    nodrop = A.per_layer(gpt, dropout=False)
    assert nodrop["replicated"] == 8 * 4096 * 4096 and nodrop["maps"] == 2 * 32 * 4096**2
    cp = A.per_layer(gpt, cp=4)
    assert cp["replicated"] == A.per_layer(gpt)["replicated"] / 4
    assert cp["maps"] == A.per_layer(gpt)["maps"] / 4


def test_step_time_by_hand():
    """Compute at the efficiency, the bubble over ideal time, tp's all-reduces on NVLink."""
    lay = Layout(dp=1, tp=2, pp=2, micro_batch=2)
    t = step_time(SMALL, lay, 32, A100, efficiency=0.5)
    tokens = 32 * 512
    flops = 6 * SMALL.params() + 12 * 8 * 512 * 1024
    assert t["compute"] == pytest.approx(tokens * flops / 4 / (312e12 * 0.5))
    assert t["bubble"] == pytest.approx(t["compute"] * 1 / 16)  # m = 16, p = 2
    act = 2 * 512 * 1024 * 2  # b s h, 16-bit
    ar = 2 * (act / 2 / 300e9 + 5e-6)  # one hop each way on a ring of 2
    assert t["tp"] == pytest.approx(4 * 16 * 4 * ar)  # 4 layers x 16 micro-batches x 4
    assert t["dp"] == 0 and t["cp"] == 0
    assert t["step"] == pytest.approx(sum(t[k] for k in ("compute", "bubble", "tp", "pp")))
    assert t["mfu"] == pytest.approx(flops * t["tokens_per_s"] / (4 * 312e12))
    # ZeRO-3 sends 1.5x ZeRO-0's bytes per micro-batch, but hides them behind all compute
    z0 = step_time(SMALL, Layout(dp=4, micro_batch=2), 32, A100, overlap=False)
    z3 = step_time(SMALL, Layout(dp=4, zero=3, micro_batch=2), 32, A100, overlap=False)
    assert z3["dp_total"] == pytest.approx(4 * 1.5 * z0["dp_total"], rel=0.01)


def test_structural_rules_and_fixed_degrees():
    job = P.Job(SMALL, 8, 16, A100)
    assert P.structural_reason(job, Layout(tp=16)) == "tp"
    assert P.structural_reason(job, Layout(pp=16)) == "pp"
    assert P.structural_reason(job, Layout(pp=2, virtual=8)) == "pp"
    assert P.structural_reason(job, Layout(cp=3)) == "cp"
    assert P.structural_reason(job, Layout(dp=16)) == "batch"
    assert P.structural_reason(job, Layout(dp=2, pp=4, virtual=2, micro_batch=2)) == "interleave"  # m = 2
    assert P.structural_reason(job, Layout(dp=8, tp=2)) is None
    fixed = P.Job(SMALL, 8, 16, A100, fixed=(("dp", 1), ("cp", 1)))
    assert all(dp == 1 and cp == 1 for dp, tp, pp, cp in P.meshes(fixed))
    assert {m[1:] for m in P.meshes(fixed)} == {(16, 1, 1), (8, 2, 1), (4, 4, 1), (2, 8, 1),
                                                 (1, 16, 1)}
    with pytest.raises(cm.CostModelError, match="cannot fix pipeline=2"):
        P.plan(P.Job(SMALL, 8, 16, A100, fixed=(("pipeline", 2),)))
    with pytest.raises(cm.CostModelError, match="cannot fix zero=7"):
        P.plan(P.Job(SMALL, 8, 16, A100, fixed=(("zero", 7),)))
    # a fixed degree no mesh can take leaves nothing, and rejects nothing
    none = P.plan(P.Job(SMALL, 8, 16, A100, fixed=(("micro_batch", 16),)))
    assert none["fitting"] == 0 and none["recommended"] is None
    assert sum(none["rejected"].values()) < none["considered"]  # only structural rejections
    assert set(none["rejected"]) <= {P.REASONS["tp"], P.REASONS["pp"], P.REASONS["cp"]}


def test_plan_ranks_fitting_layouts_by_step_time():
    r = P.plan(P.Job(SMALL, 32, 16, A100), top=100)
    meshes = list(P.meshes(P.Job(SMALL, 32, 16, A100)))
    assert r["considered"] == len(meshes) and sum(r["rejected"].values()) < len(meshes)
    assert r["rejected"][P.REASONS["tp"]] == sum(1 for m in meshes if m[1] == 16)
    rows = [r["recommended"], *r["alternatives"]]
    steps = [x["time"]["step"] for x in rows]
    assert steps == sorted(steps) and all(x["fits"] for x in rows)
    assert len(rows) == min(r["fitting"], 101)
    every = P.ranked(P.Job(SMALL, 32, 16, A100))
    assert every[0]["name"] == r["recommended"]["name"] and len(every) == r["fitting"]


def test_nothing_fits_names_the_reason_and_the_closest_miss():
    big = R.REFERENCES["Llama-2-70B"][1]
    r = P.plan(P.Job(big, 8, 8, device("tpu-v5e")))
    assert r["recommended"] is None and r["fitting"] == 0
    assert r["rejected"][P.REASONS["memory"]] >= 1
    assert r["closest_memory_miss"]["memory"]["total"] > 0.9 * 16e9


def test_bad_inputs_name_the_value():
    with pytest.raises(ShapeError, match="hidden 1000 is not divisible by heads 3"):
        Transformer(8, 1000, 3)
    with pytest.raises(ShapeError, match="kv_heads 3 must divide heads 8"):
        Transformer(8, 1024, 8, kv_heads=3)
    with pytest.raises(ShapeError, match="layers must be >= 1, got -2"):
        Transformer(-2, 1024, 8)
    with pytest.raises(cm.CostModelError, match="12 devices do not fill whole nodes of 8"):
        P.plan(P.Job(SMALL, 8, 12, A100))
    with pytest.raises(ShapeError, match="tp 3 does not divide the 8 heads"):
        memory(SMALL, Layout(tp=3), 8)
    with pytest.raises(ValueError, match="unknown device 'h900'; choose from a100, h100"):
        device("h900")
    with pytest.raises(ShapeError, match="unknown bytes-per-param budget 'fp4'"):
        S.per_param(1, 0, "fp4")


# The published layouts (tp, pp) and where our planner ranks them. Each case searches the
# toolbox the authors had: Korthikanti et al. ran without data parallelism, with sequence
# parallelism and selective recompute; Narayanan et al. (2021) had full recompute, no
# sequence parallelism, no sharded optimizer, no context parallelism. A100 80 GB.
KORTHIKANTI = [("Korthikanti 22B", 8, 4, 8, 1, 8), ("GPT-3 175B", 64, 64, 8, 8, 3),
               ("MT-NLG 530B", 280, 280, 8, 35, 1), ("Megatron 1T", 512, 512, 8, 64, 1)]


@pytest.mark.parametrize("name,gpus,batch,tp,pp,worst", KORTHIKANTI,
                         ids=[k[0] for k in KORTHIKANTI])
def test_planner_ranks_korthikanti_layouts(name, gpus, batch, tp, pp, worst):
    """Rank of the published (tp, pp): 530B and 1T first, 175B third (tp 4 x pp 16 wins by
    2%: half the tp all-reduces, one more stage), 22B eighth (tp 4 x pp 2: our model charges
    tp's all-reduces in full and the matmuls' loss of efficiency at tp 8 not at all)."""
    job = P.Job(R.REFERENCES[name][1], batch, gpus, A100, fixed=(("dp", 1), ("cp", 1)),
                recompute=("selective",), zero_stages=(0,))
    rank = P.rank_of(P.ranked(job), tp=tp, pp=pp)
    assert rank is not None and rank <= worst


NARAYANAN = [(40, 6144, 48, 8, 1, 256, 1024, 41), (60, 10240, 80, 8, 4, 1024, 1792, 1),
             (80, 12288, 96, 8, 8, 1536, 2304, 3), (105, 20480, 128, 8, 35, 2520, 2520, 2),
             (128, 25600, 160, 8, 64, 3072, 3072, 1)]


@pytest.mark.parametrize("L,h,a,tp,pp,gpus,batch,worst", NARAYANAN,
                         ids=[f"{n[0]}x{n[1]}" for n in NARAYANAN])
def test_planner_ranks_narayanan_layouts(L, h, a, tp, pp, gpus, batch, worst):
    """Table 1 rows: 76B, 146B, 530B, 1T in our top 3; 18.4B (tp 8, pp 1) ranks 41st: we
    prefer tp 2 x pp 4 with interleaving, whose pipeline sends we count as almost free."""
    job = P.Job(Transformer(L, h, a, 2048, vocab=51200), batch, gpus, A100,
                fixed=(("cp", 1),), recompute=("full",), zero_stages=(0,),
                sequence_parallel=False)
    rank = P.rank_of(P.ranked(job), tp=tp, pp=pp)
    assert rank is not None and rank <= worst


def test_plan_cli_70b(cli):
    r = cli("plan", "--params", "70e9", "--devices", "64", "--device", "h100", "--json")
    assert "Llama-2-70B" in r["shape_source"]
    assert r["job"]["shape"]["layers"] == 80 and r["job"]["device"]["memory"] == 80e9
    best = r["recommended"]
    assert best["layout"]["devices"] == 64 and best["fits"]
    assert r["rules"] == P.RULES and len(r["alternatives"]) == 5
    assert best["time"]["step"] <= min(x["time"]["step"] for x in r["alternatives"])
    assert r["roofline"]["matmul_critical_tokens"] == pytest.approx(989e12 / 3.35e12)
    assert r["roofline"]["dp_critical_tokens_inter"] == pytest.approx(989e12 / 50e9)
    assert r["roofline"]["tokens_per_device"] == 256 * 4096 / 64
    out = cli("plan", "--params", "70e9", "--devices", "64", "--device", "h100", "--top", "1")
    assert "recommended" in out and "rule 5" in out and "MFU" in out and "roofline" in out


def test_plan_cli_fix_and_toolbox(cli):
    r = cli("plan", "--model", "small", "--devices", "8", "--batch", "16", "--fix", "dp=1",
            "--recompute-choices", "none", "--zero-choices", "0", "--json")
    rows = [r["recommended"], *r["alternatives"]]
    assert all(x["layout"]["dp"] == 1 and x["layout"]["recompute"] == "none" for x in rows)


def test_plan_cli_nothing_fits_exit_1(cli):
    r = cli("plan", "--model", "7b", "--devices", "2", "--device-memory", "8GiB", "--json",
            expect=1)
    assert r["recommended"] is None and r["job"]["device"]["memory"] == 8 * 2**30
    out = cli("plan", "--model", "7b", "--devices", "2", "--device-memory", "8GiB", expect=1)
    assert "no layout fits" in out and "closest to fitting" in out


def test_bytes_sent_follow_the_ring_volumes():
    """tp: 4 all-reduces of b s h per layer and micro-batch, 2(k-1)/k each; ZeRO-3's dp:
    two all-gathers of the 16-bit weights and a reduce-scatter of the gradients per
    micro-batch, (k-1)/k each."""
    t = step_time(SMALL, Layout(tp=2, pp=2, micro_batch=2), 32, A100)
    act = 2 * 512 * 1024 * 2
    assert t["bytes_sent"]["tp"] == pytest.approx(4 * 16 * 4 * 2 * (1 / 2) * act)
    assert t["bytes_sent"]["pp"] == pytest.approx(2 * 16 * act / 2)
    z3 = step_time(SMALL, Layout(dp=4, zero=3, micro_batch=2), 32, A100)
    psi = SMALL.params()
    assert z3["bytes_sent"]["dp"] == pytest.approx(4 * (2 * 2 + 2) * psi * 3 / 4)
    assert z3["bytes_sent_total"] == z3["bytes_sent"]["dp"]


def test_llama_7b_and_70b_on_one_node_of_eight_80gb_gpus():
    """7B: 16 bytes x 6.74e9 = 108 GB of states do not fit one 80 GB device, so every layout
    shards them over all eight (ZeRO-3 over dp x cp); plain FSDP (dp 8, ZeRO-3) is within
    5% of the best. 70B: 1.1 TB of mixed-precision Adam states cannot fit 640 GB, whatever
    the layout; with a bf16 budget (8 bytes) it does, on tp x pp with full recompute."""
    h100 = device("h100")
    seven = P.ranked(P.Job(R.REFERENCES["Llama-2-7B"][1], 64, 8, h100))
    best = seven[0]["layout"]
    assert best["zero"] == 3 and best["dp"] * best["cp"] == 8
    fsdp = next(r for r in seven if r["layout"]["dp"] == 8 and r["layout"]["zero"] == 3)
    assert fsdp["time"]["step"] <= 1.05 * seven[0]["time"]["step"]
    seventy = P.plan(P.Job(R.REFERENCES["Llama-2-70B"][1], 64, 8, h100))
    assert seventy["recommended"] is None and seventy["closest_memory_miss"] is not None
    bf16 = P.plan(P.Job(R.REFERENCES["Llama-2-70B"][1], 64, 8, h100, budget="bf16"))
    lay = bf16["recommended"]["layout"]
    assert lay["tp"] * lay["pp"] == 8 and lay["recompute"] == "full"
