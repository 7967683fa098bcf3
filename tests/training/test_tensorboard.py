"""`train --tensorboard DIR`: the scalars written are the metrics.jsonl figures, by step."""
import json
import struct

import pytest

tensorboardX = pytest.importorskip(
    "tensorboardX", reason="the tensorboard extra is not installed: pip install -e "
                           "'.[tensorboard]' (scripts/dev.sh test installs it)")


def _scalars(folder) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} from the event files in `folder`: each record is a length
    (8 bytes), its checksum (4), an Event message and its checksum (4)."""
    from tensorboardX.proto.event_pb2 import Event
    out: dict = {}
    for path in sorted(folder.iterdir()):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


@pytest.mark.slow
def test_scalars_equal_the_metrics_by_step(cli, tmp_path):
    board = tmp_path / "tb"
    cli("train", "--model", "tiny", "--steps", "8", "--eval-every", "4", "--spike-policy",
        "skip", "--inject", "nan@5", "--out", str(tmp_path / "run"), "--tensorboard",
        str(board), "--json")
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
             if x.strip()]
    steps = {r["step"]: r for r in lines if "loss" in r}
    got = _scalars(board)
    assert {"train/loss", "train/grad_norm", "train/learning_rate", "train/loss_scale",
            "train/tokens_per_s", "eval/val_loss", "eval/gap_to_floor", "guard/rejected",
            "guard/lr_factor"} <= set(got)
    for step, r in steps.items():  # float32 in the event file
        assert got["train/learning_rate"][step] == pytest.approx(r["lr"], rel=1e-6)
        if r["loss"] is None:  # the poisoned step: its NaN is not written
            assert step == 5 and step not in got["train/loss"]
        else:
            assert got["train/loss"][step] == pytest.approx(r["loss"], rel=1e-6)
    assert set(got["eval/val_loss"]) == {4, 8}
    assert got["guard/rejected"] == {5: 1.0}  # the NaN batch, skipped
    assert all(v > 0 for v in got["train/tokens_per_s"].values())
    written = (tmp_path / "run" / "config.toml").read_text()  # the run's options, at its end
    assert "steps = 8" in written and 'inject = ["nan@5"]' in written
