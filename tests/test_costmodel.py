"""Communication formulas against the lectures' worked numbers."""
import pytest

from jaxscale import costmodel as cm


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
