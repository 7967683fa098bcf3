"""Communication formulas against the lectures' worked numbers."""
import pytest

from jaxscale import costmodel as cm
from jaxscale.costmodel import units


def test_ring_volume_is_almost_independent_of_k():
    assert cm.ring_all_reduce_bytes(8.0, 8) == 14.0
    assert cm.ring_all_reduce_bytes(1.0, 1) == 0.0
    assert cm.ring_all_reduce_bytes(1.0, 1024) < 2.0


def test_exercise_4_ring_vs_parameter_server():
    """8 GPUs, 1B parameters, bf16 gradients (2 GB), 50 GB/s."""
    grads = 1e9 * 2
    ring = cm.ring_all_reduce_bytes(grads, 8)
    assert ring == pytest.approx(3.5e9)
    assert cm.transfer_seconds(ring, "infiniband") == pytest.approx(0.07)
    ps = cm.parameter_server_bytes(grads, 8)
    assert ps["server_sent"] + ps["server_received"] == pytest.approx(28e9)
    assert cm.transfer_seconds(ps["server_sent"] + ps["server_received"], "infiniband") == \
        pytest.approx(0.56)


def test_lecture_7b_on_ethernet_waits_about_twenty_seconds():
    ring = cm.ring_all_reduce_bytes(7e9 * 2, 8)  # 14 GB of bf16 gradients
    assert 19 < cm.transfer_seconds(ring, "ethernet") < 21


def test_bad_arguments():
    with pytest.raises(cm.CostModelError, match="unknown link 'wifi'; choose from nvlink"):
        cm.transfer_seconds(1.0, "wifi")
    with pytest.raises(cm.CostModelError, match="K=0"):
        cm.ring_all_reduce_bytes(1.0, 0)


def test_zero_paper_table_psi_7_5b_k_64():
    """Rajbhandari et al.: 120 / 31.4 / 16.6 / 1.88 GB per device."""
    got = [cm.model_state_bytes(7.5e9, 64, s)["total"] / 1e9 for s in range(4)]
    assert [round(x, 1) for x in got[:3]] == [120.0, 31.4, 16.6]
    assert round(got[3], 2) == 1.88
    assert cm.model_state_bytes(7.5e9, 64, 0, "fp32")["total"] == 16 * 7.5e9


def test_exercise_2_seventy_b():
    full = cm.model_state_bytes(70e9, 1)["total"]
    assert full / 1e9 == pytest.approx(1120)
    assert cm.model_state_bytes(70e9, 64, 3)["total"] / 1e9 == pytest.approx(17.5)
    assert -(-full // 80e9) == 14  # 80 GB cards needed for model states alone


def test_lecture_activation_figures():
    """32 layers, h = 4096, 32 heads, 8 x 2048 tokens: 7.7 GB per layer, 245 GB, ~12 GB."""
    per = cm.activation_bytes_per_layer(2048, 8, 4096, 32)
    assert round(per / 1e9, 1) == 7.7
    assert round(cm.activation_bytes(32, 2048, 8, 4096, 32) / 1e9) == 245
    assert round(cm.activation_bytes(32, 2048, 8, 4096, 32, recompute=True) / 1e9) == 12
    assert cm.activation_bytes_per_layer(2048, 8, 4096, 32, flash_attention=True) == 34 * 2048 * 8 * 4096


def test_bad_memory_arguments():
    with pytest.raises(cm.CostModelError, match="ZeRO stage must be 0, 1, 2 or 3, got 4"):
        cm.model_state_bytes(1e9, 8, 4)
    with pytest.raises(cm.CostModelError, match="unknown precision 'fp8'"):
        cm.model_state_bytes(1e9, 8, 0, "fp8")


# --------------------------------------------------------------------------------------
# Day 4 (week 2) notes, groups 3, 5 and 7; lecture 13 §4.4; LoRA/QLoRA; sizes and links
# --------------------------------------------------------------------------------------

GIB = 2**30


def test_day4_group5_zero_stages_7b_on_8_devices_in_gib():
    """104.3 / 35.9 / 24.4 / 13.0 GiB for Psi = 7e9, N = 8; 100.4 GiB for Llama-2's 6.74e9."""
    got = [cm.model_state_bytes(7e9, 8, s)["total"] / GIB for s in range(4)]
    hand = [16 * 7e9 / GIB, (2 + 2 + 12 / 8) * 7e9 / GIB, (2 + (2 + 12) / 8) * 7e9 / GIB,
            16 / 8 * 7e9 / GIB]
    assert got == pytest.approx(hand)
    assert [round(x, 1) for x in got] == [104.3, 35.9, 24.4, 13.0]
    assert round(cm.model_state_bytes(6.74e9, 8)["total"] / GIB, 1) == 100.4


def test_fp32_states_shard_differently_from_mixed():
    """fp32 Adam is 4 + 4 + 8 = 16 bytes too, but ZeRO-1 keeps 8 + 8/K of them."""
    z1 = cm.model_state_bytes(7.5e9, 64, 1, "fp32")
    assert z1["total"] == pytest.approx((4 + 4 + 8 / 64) * 7.5e9)
    assert z1["optimizer"] == pytest.approx(8 * 7.5e9 / 64)


def test_day4_group3_llama_7b_activations():
    """s = 4096, b = 1, 32 layers, h = 4096, 32 heads: 97 GiB stored, 17 GiB with flash
    attention, 1.5 GiB with checkpointing (each layer's input + one flash layer)."""
    s, h, a, L = 4096, 4096, 32, 32
    stored = cm.activation_bytes(L, s, 1, h, a)
    assert stored == pytest.approx(L * s * h * (34 + 5 * a * s / h))
    assert round(stored / GIB) == 97
    flash = cm.activation_bytes(L, s, 1, h, a, flash_attention=True)
    assert round(flash / GIB) == 17 and flash == L * 34 * s * h
    ckpt = cm.activation_bytes(L, s, 1, h, a, flash_attention=True, recompute=True)
    assert ckpt == L * 2 * s * h + 34 * s * h
    assert round(ckpt / GIB, 1) == 1.5


def test_tensor_parallel_activations_korthikanti_eq2():
    """s*b*h*(10 + 24/t + 5as/(ht)) per device; t = 1 gives the 34 + 5as/h of the lecture."""
    s, b, h, a = 2048, 8, 4096, 32
    assert cm.activation_bytes_per_layer(s, b, h, a, tp=1) == cm.activation_bytes_per_layer(s, b, h, a)
    assert cm.activation_bytes_per_layer(s, b, h, a, tp=8) == pytest.approx(
        s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    assert cm.activation_bytes_per_layer(s, b, h, a, True, tp=4) == pytest.approx(
        s * b * h * (10 + 24 / 4))
    with pytest.raises(cm.CostModelError, match="tp must be >= 1, got 0"):
        cm.activation_bytes_per_layer(s, b, h, a, tp=0)


def test_lecture_13_tensor_and_pipeline_volumes():
    """32 layers, h = 4096, 8 x 2048 tokens, bf16: 134 MB per TP all-reduce, 17.2 GB per
    step; 268 MB at a pipeline boundary."""
    t = cm.tp_step_volume(32, 2048, 8, 4096, tp=8)
    assert t["allreduce_bytes"] == 8 * 2048 * 4096 * 2
    assert round(t["allreduce_bytes"] / 1e6) == 134
    assert t["allreduces_per_step"] == 4 * 32
    assert round(t["payload_bytes_per_step"] / 1e9, 1) == 17.2
    assert t["ring_bytes_per_device"] == pytest.approx(128 * 2 * 7 / 8 * 8 * 2048 * 4096 * 2)
    assert cm.tp_step_volume(32, 2048, 8, 4096, 8, recompute=True)["allreduces_per_step"] == 6 * 32
    assert cm.tp_step_volume(32, 2048, 8, 4096, tp=1)["ring_bytes_per_device"] == 0
    p = cm.pp_step_volume(2048, 8, 4096, pp=4)
    assert round(p["boundary_bytes_per_step"] / 1e6) == 268
    assert p["boundaries"] == 3 and p["total_bytes_per_step"] == 3 * 2 * 8 * 2048 * 4096 * 2
    assert p["max_bytes_per_device"] == 2 * 8 * 2048 * 4096 * 2
    assert cm.pp_step_volume(2048, 8, 4096, pp=2)["max_bytes_per_device"] == 8 * 2048 * 4096 * 2
    assert cm.pp_step_volume(2048, 8, 4096, pp=1)["max_bytes_per_device"] == 0


def test_day4_group7_dp_and_tp_volumes_and_times():
    """7B on 8 devices: 22.8 GiB per device; TP 32 MiB per all-reduce, 4 GiB per step;
    1 GiB takes 1.8 ms on NVLink (600 GB/s) and 43 ms on InfiniBand (25 GB/s)."""
    dp = cm.dp_gradient_allreduce(7e9, 8, grad_bytes=2)
    assert round(dp["ring_bytes_per_device"] / GIB, 1) == round(2 * 7 / 8 * 14e9 / GIB, 1) == 22.8
    t = cm.tp_step_volume(32, 4096, 1, 4096, tp=8)
    assert t["allreduce_bytes"] == 32 * 2**20
    assert t["payload_bytes_per_step"] == 4 * GIB
    assert round(GIB / 600e9 * 1e3, 1) == 1.8
    assert round(GIB / cm.link_bandwidth("600")[1] * 1e3, 1) == 1.8
    assert round(GIB / cm.link_bandwidth("25")[1] * 1e3) == 43


def test_bubble_two_definitions_and_exercise_3():
    assert cm.bubble_over_total(8, 16) == 7 / 23  # day 4 self-test: 30.4%
    assert round(100 * cm.bubble_over_total(8, 16), 1) == 30.4
    assert cm.bubble_over_total(1, 5) == 0.0
    need = {p: next(m for m in range(1, 1000) if cm.bubble_over_total(p, m) <= 0.1) for p in (4, 8)}
    assert need == {4: 9 * 3, 8: 9 * 7}  # m >= 9(p - 1): 27 and 63
    with pytest.raises(cm.CostModelError, match="micro_batches=0"):
        cm.bubble_over_total(4, 0)
    # Narayanan et al.: (p-1)/m for 1F1B, (p-1)/(v m) interleaved, over the ideal time
    assert cm.bubble_over_ideal(8, 16) == 7 / 16 and cm.bubble_over_ideal(8, 16, 2) == 7 / 32
    b = cm.bubble_over_total(8, 16, 2)  # the same pipeline, over the whole time
    assert b == 7 / 39 and cm.bubble_over_ideal(8, 16, 2) == pytest.approx(b / (1 - b))


def test_lora_adapters_and_finetune_bytes():
    """rank r on Wq, Wk, Wv, Wo (h x h) and W1, W2 (h x ffn): r(d_in + d_out) each."""
    n = cm.lora_adapter_params(32, 4096, 16, ffn=16384)
    assert n == 32 * (4 * 16 * (4096 + 4096) + 2 * 16 * (4096 + 16384)) == 37_748_736
    assert cm.lora_adapter_params(2, 64, 4) == 2 * (4 * 4 * 128 + 2 * 4 * (64 + 256))
    lora = cm.finetune_state_bytes(7e9, n)
    assert lora["base_weights"] == 2 * 7e9
    assert lora["total"] == 2 * 7e9 + 16 * n
    qlora = cm.finetune_state_bytes(7e9, n, quantized=True)
    nf4 = (4 + 8 / 64 + 32 / (64 * 256)) / 8
    assert cm.NF4_BYTES_PER_PARAM == pytest.approx(nf4) and round(nf4, 4) == 0.5159
    assert qlora["total"] == pytest.approx(nf4 * 7e9 + 16 * n)
    assert qlora["adapter_optimizer"] == 12 * n
    with pytest.raises(cm.CostModelError, match="rank 5000 is larger than hidden 4096"):
        cm.lora_adapter_params(32, 4096, 5000)
    with pytest.raises(cm.CostModelError, match="rank must be >= 1, got 0"):
        cm.lora_adapter_params(32, 4096, 0)


@pytest.mark.parametrize("text, value", [
    ("7e9", 7e9), ("7B", 7e9), ("70b", 70e9), ("350M", 350e6), ("1.5T", 1.5e12),
    ("7_000_000_000", 7e9), ("12k", 12e3)])
def test_parse_count(text, value):
    assert units.parse_count(text) == pytest.approx(value)


@pytest.mark.parametrize("text, value", [
    ("80GB", 80e9), ("80 GB", 80e9), ("80GiB", 80 * GIB), ("512MB", 512e6), ("8e10", 8e10),
    ("1.5tb", 1.5e12), ("16MiB", 16 * 2**20)])
def test_parse_bytes(text, value):
    assert units.parse_bytes(text) == pytest.approx(value)


@pytest.mark.parametrize("text, words", [
    ("-5", "must be > 0"), ("0", "must be > 0"), ("abc", "'abc' is not understood"),
    ("80XB", "'80XB' is not understood"), ("inf", "not understood"), ("nan", "not understood"),
    ("", "not understood")])
def test_parse_errors(text, words):
    with pytest.raises(cm.CostModelError, match=words):
        units.parse_bytes(text)
    with pytest.raises(cm.CostModelError):
        units.parse_count(text)


def test_links_by_name_or_bandwidth():
    assert cm.link_bandwidth("NVLink") == ("nvlink", 300e9)
    assert cm.link_bandwidth("25") == ("25 GB/s", 25e9)
    assert cm.link_bandwidth(12.5)[1] == 12.5e9
    with pytest.raises(cm.CostModelError, match="unknown link 'wifi'; choose from nvlink, "
                                                "infiniband, ethernet or a bandwidth"):
        cm.link_bandwidth("wifi")
    with pytest.raises(cm.CostModelError, match="must be > 0 GB/s, got -3"):
        cm.link_bandwidth("-3")


def test_human_bytes_says_both_units():
    assert units.human_bytes(120e9) == "120.00 GB (111.76 GiB)"
    assert units.human_bytes(32 * 2**20) == "33.6 MB (32.0 MiB)"
