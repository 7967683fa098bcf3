"""Bytes that leave a process, predicted: each predicted collective's bytes x the share of
its ring's hops that join two processes, for the mesh axis (or group of axes: "ep+cp") it
runs over, given the placement (`distributed.place_devices`: process by process, tp
innermost, then pp, then dp). compare.report shows them beside the measured ones."""
from __future__ import annotations

import numpy as np

from jaxscale.compare.predict import predict
from jaxscale.parallel.plan import Plan
from jaxscale.runtime.mesh import MESH_AXES


def _device_process(result: dict) -> list[int] | None:
    """The process of each device position, as compare's workers place them: the job's
    devices sorted process by process, the same number on each (None: count unknown)."""
    p, n = result.get("processes"), result.get("devices")
    if not p or not n or n % p:
        return None
    return [i // (n // p) for i in range(n)]


def axis_crossing_share(plan: dict, device_process: list[int]) -> dict[str, float]:
    """For each mesh axis, the share of ring hops along it (each device to the next in its
    group, the last back to the first) that join two processes; the plan's devices are the
    first of `device_process`, laid out (dp, ep, pp, cp, tp) as `devices.make_mesh` does."""
    out = {axis: group_crossing_share(plan, device_process, axis) for axis in MESH_AXES}
    return out if plan.get("ep", 1) > 1 else {k: v for k, v in out.items() if k != "ep"}


def group_crossing_share(plan: dict, device_process: list[int], group: str) -> float:
    """axis_crossing_share for one group of mesh axes ("ep+cp": a ring over the devices
    that differ in ep and cp, in mesh order, as a collective over both axes runs)."""
    sizes = [plan.get(a, 1) for a in MESH_AXES]
    grid = np.asarray(device_process[:int(np.prod(sizes))]).reshape(sizes)
    idx = [MESH_AXES.index(a) for a in group.split("+")]
    size = int(np.prod([sizes[i] for i in idx]))
    if size == 1:
        return 0.0
    groups = np.moveaxis(grid, idx, list(range(-len(idx), 0))).reshape(-1, size)
    return float(np.mean(groups != np.roll(groups, -1, axis=1)))


def predicted_by_axis(cfg, plan: dict, batch_shape: tuple[int, int],
                      sent: dict[str, float]) -> dict[str, dict[str, float]] | None:
    """compare.predict's bytes per collective, split by the mesh axis each runs over
    (its "sent_by_axis"). None if predict's total is not `sent`, the prediction the row
    recorded (predict changed since: better no prediction than a wrong one)."""
    pred = predict(cfg, Plan(**plan), batch_shape)
    if set(pred["sent"]) != set(sent) or any(
            abs(pred["sent"][op] - v) > 1e-6 * max(v, 1.0) for op, v in sent.items()):
        return None
    return pred["sent_by_axis"]


def predict_cross_process(cfg, plan: dict, batch_shape, device_process: list[int],
                          sent: dict[str, float]) -> dict[str, float] | None:
    """{op: predicted bytes per device per step that cross a process boundary}: each axis's
    predicted bytes x the share of that axis's ring hops that join two processes."""
    by_axis = predicted_by_axis(cfg, plan, batch_shape, sent)
    if by_axis is None:
        return None
    out: dict[str, float] = {}
    for axis, ops in by_axis.items():
        share = group_crossing_share(plan, device_process, axis)
        for op, v in ops.items():
            if v * share:
                out[op] = out.get(op, 0.0) + v * share
    return out
