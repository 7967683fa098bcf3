"""`jaxscale compare`'s predicted step time, calibrated on the machine that runs it.

The time model (jaxscale.costmodel.steptime) needs a FLOP rate and a link bandwidth. Here
both are measured by the worker before its first strategy, on the devices compare uses:

  flops_per_s  hardware.measure_matmul_peak on the first device (on CPU: float32, all cores)
  bytes_per_s  a psum of a 4 MiB float32 array over all the devices, timed (median): the
               ring all-reduce's 2(n-1)/n x bytes per device over the seconds
  latency_s    20 chained psums of one float over all the devices, timed, / 20: what one
               collective costs before its bytes (rendezvous of the device threads on CPU)

Each measured row then gets, from its own exact counts:

  compute  tokens x (model FLOPs + recompute FLOPs per token, jaxscale.model.flops) / flops_per_s
           (on CPU the whole step's work over the rate: forced CPU devices share the same
           cores, so an idle pipeline stage frees cores for another and the bubble costs no
           time; on an accelerator each device's share, the bubble not added)
  comm     collectives x latency_s + the predicted bytes sent per device per step
           (compare.predict, equal to the HLO's) / bytes_per_s; the number of collectives
           the step runs is counted in its HLO (loops x trip counts), as the bytes are
  step     compute + comm (no overlap: XLA:CPU runs collectives between computations)

`rank_agreement` is Spearman's rho between the predicted and the measured step times: how far
the model orders the strategies as the machine does, whatever the absolute error.
"""
from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxscale.measure.hardware import measure_matmul_peak
from jaxscale.model.flops import model_flops_per_token, recompute_flops_per_token

LINK_BYTES = 4 * 2**20
LATENCY_CHAIN = 20


def calibrate(devices) -> dict:
    """Measure the FLOP rate of one device and the all-reduce bandwidth over `devices`."""
    peak = measure_matmul_peak(devices[0], repeats=3)  # n = 1024 on CPU: on the plateau
    out = {"flops_per_s": peak.flops_per_s, "matmul_n": peak.n, "devices": len(devices),
           "platform": devices[0].platform, "bytes_per_s": None}
    n = len(devices)
    if n > 1:
        mesh = Mesh(np.asarray(devices), ("x",))
        size = LINK_BYTES // 4
        x = jax.device_put(jnp.ones((n, size), jnp.float32), NamedSharding(mesh, P("x")))
        allreduce = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "x"), mesh=mesh,
                                          in_specs=P("x"), out_specs=P("x")))
        out["link_seconds"] = _median_seconds(allreduce, x)
        out["bytes_per_s"] = 2 * (n - 1) / n * LINK_BYTES / out["link_seconds"]

        def chain(a):
            for _ in range(LATENCY_CHAIN):  # each psum needs the last one's result
                a = jax.lax.psum(a, "x") * 0.5
            return a
        tiny = jax.device_put(jnp.ones((n, 1), jnp.float32), NamedSharding(mesh, P("x")))
        chained = jax.jit(jax.shard_map(chain, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        out["latency_s"] = _median_seconds(chained, tiny) / LATENCY_CHAIN
    return out


def _median_seconds(fn, x, repeats: int = 5) -> float:
    """Median wall time of fn(x) after one warm-up call (which compiles it)."""
    fn(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def predicted_step(cfg, plan: dict, batch_size: int, sent_bytes: float | None,
                   calibration: dict, collectives: float = 0) -> dict:
    """compute, comm and step seconds of one row under the calibration (module docstring)."""
    tokens = batch_size * cfg.seq_len
    per_token = (model_flops_per_token(cfg).total
                 + recompute_flops_per_token(cfg, plan.get("remat", "none")))
    compute = tokens * per_token / calibration["flops_per_s"]
    if calibration.get("platform") != "cpu":  # each accelerator computes its own share
        compute /= plan_devices(plan)
    bw = calibration.get("bytes_per_s")
    comm = 0.0 if not sent_bytes else (sent_bytes / bw if bw else None)
    if comm is not None:
        comm += collectives * calibration.get("latency_s", 0.0)
    return {"compute_s": compute, "comm_s": comm,
            "step_s": None if comm is None else compute + comm}


def plan_devices(plan: dict) -> int:
    """Devices of a plan dict: dp x ep x pp x cp x tp (Plan.n_devices; ep splits the rows
    too, so each device computes its share of the tokens)."""
    return (plan.get("dp", 1) * plan.get("ep", 1) * plan.get("pp", 1) * plan.get("cp", 1)
            * plan.get("tp", 1))


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 3 pairs."""
    if len(a) < 3:
        return None

    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else None


def add_predictions(result: dict, cfg) -> None:
    """step_s_predicted and its parts on every measured row with a calibration and a byte
    prediction; result["time_model"] with the calibration and the rank agreement."""
    rows = [r for r in result["rows"] if r.get("status") == "ok" and r.get("calibration")]
    for r in rows:
        sent = r.get("sent_predicted_total") if r.get("predicted") else None
        if r.get("n_devices", 1) > 1 and sent is None:
            continue  # bytes not modelled (fp8-delayed, a pipeline under remat, ...): no time
        p = predicted_step(cfg, r["plan"], result["batch_size"], sent or 0.0, r["calibration"],
                           r.get("collectives_per_step", 0))
        if p["step_s"] is not None:
            r["step_predicted"] = p
            r["step_s_predicted"] = p["step_s"]
            r["step_measured_over_predicted"] = (r["step_s"] / p["step_s"]
                                                 if r.get("step_s") else None)
    both = [r for r in rows if r.get("step_s_predicted") and r.get("step_s")]
    result["time_model"] = {
        "calibration": rows[0]["calibration"] if rows else None,
        "rows": len(both),
        "rank_agreement": spearman([r["step_s_predicted"] for r in both],
                                   [r["step_s"] for r in both]),
        "median_measured_over_predicted": (statistics.median(
            r["step_measured_over_predicted"] for r in both) if both else None)}
