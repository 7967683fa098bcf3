"""experiments.instability: its offline watch of the curves and its reading of the guard's
events, on made-up curves (the training runs take a minute: run the module for those)."""
import numpy as np

from experiments.instability import (detections, detections_text, fault_spans,
                                     final_lr_factor, first_over, lead, watch)


def noisy(n, seed=0):
    rng = np.random.default_rng(seed)
    return 2.0 + 0.05 * rng.standard_normal(n), 1.0 + 0.1 * rng.standard_normal(n)


def test_watch_fires_where_a_signal_jumps_and_leaves_it_out_of_the_window():
    loss, norm = noisy(120)
    norm[79] = 5.0  # step 80: the norm jumps; the loss follows at step 83
    loss[82] = 4.0
    seen = watch(loss, norm, z=6.0, window=50)
    assert not seen["norm_over"][:79].any() and np.isinf(seen["norm_max"][:50]).all()
    assert first_over(seen, 80, 121) == {"norm": 80, "loss": 83}
    assert lead(first_over(seen, 80, 121)) == (3, "3")
    # the spikes stayed out of the window: before the last step it holds the 50 calm ones
    calm = np.delete(loss[:-1], [79, 82])[-50:]
    assert np.isclose(seen["mean"][-1][0], calm.mean())
    assert lead({"norm": 80, "loss": None}) == (None, "the loss never crossed")


def test_fault_spans_run_to_the_next_fault():
    assert fault_spans(("spike@100:repeat", "lr@130:10"), 200) == [
        (100, "spike@100:repeat", 130), (130, "lr@130:10", 201)]


def test_events_read_back():
    events = [{"step": 110, "event": "inject", "fault": "lr@110:10"},
              {"step": 111, "event": "spike", "action": "skip", "loss": 1.0, "grad_norm": 3.0,
               "loss_max": 2.0, "norm_max": 2.0},
              {"step": 112, "event": "spike", "action": "skip", "loss": 3.0, "grad_norm": 3.0,
               "loss_max": 2.0, "norm_max": 2.0},
              {"step": 140, "event": "nonfinite", "action": "skip", "loss": float("nan"),
               "grad_norm": float("nan"), "loss_max": 2.0, "norm_max": 2.0}]
    found = detections(events)
    assert [d["over"] for d in found] == ["norm", "loss+norm", "non-finite"]
    assert detections_text(found) == "111-112 (2, first norm), 140 non-finite"
    assert final_lr_factor(events) == 10.0
    assert final_lr_factor(events + [{"step": 150, "event": "rollback", "to": 100,
                                      "skipped_batches": [100, 149], "lr_factor": 0.5}]) == 0.5
