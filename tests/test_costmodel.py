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
