"""Lecture 13 §3, exercises 4 and 7; day-4 §4.3 and §5.1: data parallelism, for real.

    python -m experiments.data_parallel [--out runs/data_parallel] [--parts abcdef] [--json]

Runs on 8 host-CPU devices (forced here, before JAX starts).

a. one batch on dp=8 vs one device: gradients, and the wrong mean of per-shard means
b. 60 steps: loss curves and the replicas' parameters, bit for bit, every step
c. the ring all-reduce step by step on 4 devices, its bytes for K = 2..8, a parameter server
d. communication time of a 7B model's bf16 gradients over NVLink / InfiniBand / Ethernet
e. gradient accumulation (exercise 7) and the mean-of-means trap (day-4: 500/100/400/50)
f. the compiled step: all-reduce bytes in the HLO vs the cost model, memory, step time
"""
from __future__ import annotations

import sys
from pathlib import Path

from jaxscale.runtime.devices import force_cpu_devices

N_DEVICES = 8
if __name__ == "__main__":
    force_cpu_devices(N_DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from experiments._runner import log, run_experiment  # noqa: E402
from jaxscale.parallel import ring as C  # noqa: E402
from jaxscale import costmodel as cm, garden  # noqa: E402
from jaxscale.measure import hlo as measure  # noqa: E402
from jaxscale.measure import compare_trees, memory, timing  # noqa: E402
from jaxscale.model import optim  # noqa: E402
from jaxscale.runtime.mesh import make_mesh  # noqa: E402
from jaxscale.model.loss import loss_fn, nll_and_count  # noqa: E402
from jaxscale.parallel.axes import DP
from jaxscale.parallel.data_parallel import (dp_value_and_grad, replicas_identical,
    shard_mean_of_means)
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.parallel.build import build_train_step  # noqa: E402
from jaxscale.report import print_table, pyplot, save_figure  # noqa: E402
from jaxscale.training.config import TrainConfig  # noqa: E402
from jaxscale.training.reference import as_arrays, init_run  # noqa: E402
from jaxscale.model import config as model_config

BATCH, STEPS = 32, 60


class Lab:
    def __init__(self, seed: int = 0):
        if len(jax.devices()) != N_DEVICES:
            raise SystemExit(f"needs {N_DEVICES} devices, JAX has {len(jax.devices())}: run it "
                             "as python -m experiments.data_parallel")
        self.cfg = model_config.preset("tiny")
        self.graphdef, self.params0, _ = init_run(TrainConfig(seed=seed))
        self.corpus = garden.make_corpus(seed)
        it = self.corpus.train_batches(BATCH, seed=seed)
        self.batches = [as_arrays(next(it)) for _ in range(STEPS)]
        self.n_params = model_config.param_count(self.cfg)
        self._trained = None

    @property
    def trained(self):
        """Parameters after 30 single-device AdamW steps: per-token losses differ by then
        (at initialisation every token costs about log(vocab), hiding reduction mistakes)."""
        if self._trained is None:
            init, step = build_train_step(self.cfg, Plan(), optim.adamw(1e-2))
            state = init(self.params0)
            for b in self.batches[:30]:
                state, _ = step(state, b)
            self._trained = state.params
        return self._trained


def dp_grad_fn(lab: Lab, dp: int, micro: int = 1):
    mesh = make_mesh(f"dp={dp}", jax.devices()[:dp])
    return jax.jit(jax.shard_map(lambda p, b: dp_value_and_grad(lab.graphdef, micro)(p, b, None),
                                 mesh=mesh, in_specs=(P(), P(DP)), out_specs=(P(), P())))


def part_a(lab: Lab, out: Path) -> dict:
    batch = lab.batches[0]
    ref_loss, ref = jax.value_and_grad(lambda p: loss_fn(lab.graphdef, p, batch))(lab.params0)
    loss, grads = dp_grad_fn(lab, N_DEVICES)(lab.params0, batch)
    mom = shard_mean_of_means(lab.graphdef, lab.trained, batch, N_DEVICES)
    rows = {"single_device_loss": float(ref_loss), "dp8_loss": float(loss),
            "max_rel_grad_diff": compare_trees.max_rel_diff(grads, ref), **mom}
    print_table(f"a. one batch of {BATCH} documents ({int(batch['mask'].sum())} target tokens) "
                f"on 1 device vs dp={N_DEVICES}", ["quantity", "value"],
                [["loss, 1 device", rows["single_device_loss"]], ["loss, dp=8", rows["dp8_loss"]],
                 ["max relative gradient difference", rows["max_rel_grad_diff"]],
                 ["target tokens per shard", str(mom["tokens_per_shard"])],
                 ["after 30 steps: token-weighted loss", mom["token_weighted"]],
                 ["after 30 steps: mean of shard means (wrong)", mom["mean_of_shard_means"]],
                 ["difference", mom["difference"]]])
    return rows


def part_b(lab: Lab, out: Path) -> dict:
    opt = optim.adamw(3e-3)
    init1, step1 = build_train_step(lab.cfg, Plan(), opt)
    init8, step8 = build_train_step(lab.cfg, Plan(dp=N_DEVICES), opt)
    a, b = init1(lab.params0), init8(lab.params0)
    single, dp, identical = [], [], True
    for batch in lab.batches:
        a, ma = step1(a, batch)
        b, mb = step8(b, batch)
        single.append(float(ma["loss"]))
        dp.append(float(mb["loss"]))
        identical &= replicas_identical((b.params, b.opt_state))
    rel = np.abs(np.array(dp) - np.array(single)) / np.array(single)
    print_table(f"b. {STEPS} AdamW steps, 1 device vs dp={N_DEVICES}", ["quantity", "value"],
                [["max relative loss difference (any step)", float(rel.max())],
                 ["at step", int(rel.argmax()) + 1],
                 ["replicas bit-identical at every step", identical],
                 ["final loss, 1 device / dp=8", f"{single[-1]:.6f} / {dp[-1]:.6f}"]])
    plt = pyplot()
    # the two curves coincide: below them, their relative difference per step (log scale;
    # a step where they agree exactly is drawn at a floor, and says so)
    fig, (ax, low) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True,
                                  gridspec_kw={"height_ratios": [3, 2]})
    steps = np.arange(1, STEPS + 1)
    ax.plot(steps, single, label="1 device")
    ax.plot(steps, dp, "--", label=f"dp={N_DEVICES}")
    ax.set(ylabel="training loss (nats/token)",
           title=f"{STEPS} AdamW steps: 1 device vs dp={N_DEVICES}, max relative difference "
                 f"{rel.max():.1e}")
    ax.legend()
    floor = 10 ** np.floor(np.log10(rel[rel > 0].min() / 3)) if rel.any() else 1e-9
    low.plot(steps, np.maximum(rel, floor), "o-", ms=2.5, lw=0.8, color="C2")
    low.axhline(floor, color="0.6", lw=0.8, ls=":", label=f"exactly equal, drawn at {floor:.0e}")
    low.set(xlabel="step", yscale="log", ylabel="|dp - 1 device| / 1 device")
    low.legend(fontsize=8)
    save_figure(fig, out / "b_loss_curves.png")
    return {"max_rel_loss_diff": float(rel.max()), "replicas_identical": bool(identical),
            "single": single, "dp": dp}


def _run_on(k: int, fn, x):
    mesh = make_mesh(f"dp={k}", jax.devices()[:k])
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(DP), out_specs=P(DP)))(x)


def part_c(lab: Lab, out: Path) -> dict:
    k, n = 4, 8
    x = jnp.arange(k * n, dtype=jnp.int32).reshape(k, n)  # device i holds 8i .. 8i+7

    def fn(v):
        trace = []
        total = C.ring_all_reduce(v[0], DP, trace=trace)
        return total[None], jnp.stack(trace)[None]
    total, trace = (np.asarray(a) for a in _run_on(k, fn, x))
    walk = []
    for s in range(2 * (k - 1)):
        phase = "reduce-scatter" if s < k - 1 else "all-gather"
        walk.append([f"{phase} {s % (k - 1) + 1}", *[str(trace[i, s].tolist()) for i in range(k)]])
    print_table(f"c. ring all-reduce on {k} devices, vector of {n} int32 (device i holds "
                f"{n}i .. {n}i+{n - 1}): the chunk each device holds after each step",
                ["step", *[f"device {i}" for i in range(k)]], walk)
    rows = []
    for kk in (2, 4, 8):
        vec = 1024  # elements per device, float32
        ring, ps = C.Ledger(), C.Ledger()
        xs = jnp.ones((kk, vec), jnp.float32)
        jax.jit(jax.shard_map(lambda v: C.ring_all_reduce(v[0], DP, ring)[None],
                              mesh=make_mesh(f"dp={kk}", jax.devices()[:kk]), in_specs=P(DP),
                              out_specs=P(DP))).lower(xs)
        jax.jit(jax.shard_map(lambda v: C.parameter_server_all_reduce(v[0], DP, ps)[None],
                              mesh=make_mesh(f"dp={kk}", jax.devices()[:kk]), in_specs=P(DP),
                              out_specs=P(DP))).lower(xs)
        nbytes = vec * 4
        rows.append({"K": kk, "vector_bytes": nbytes, "ring_sent_per_device": ring.sent_per_device()[0],
                     "ring_formula": cm.ring_all_reduce_bytes(nbytes, kk),
                     "server_sent_plus_received": ps.sent_per_device()[0] + ps.received_per_device()[0],
                     "server_formula": 2 * (kk - 1) * nbytes})
    print_table("c. bytes per device: ring (every device) vs parameter server (device 0), "
                "measured by the ledger next to the formulas",
                ["K", "vector", "ring sent", "2(K-1)/K x n", "server sent+received",
                 "2(K-1) x n"], [list(r.values()) for r in rows])
    return {"walkthrough": walk, "result": total[0].tolist(), "bytes": rows}


def part_d(lab: Lab, out: Path) -> dict:
    grads = 7e9 * 2  # 7B parameters, bf16 gradients: 14 GB
    rows = []
    for k in (8, 64):
        ring = cm.ring_all_reduce_bytes(grads, k)
        ps = cm.parameter_server_bytes(grads, k)
        for link in cm.LINKS:
            rows.append({"K": k, "link": link, "GB/s": cm.LINKS[link] / 1e9,
                         "ring_GB_per_device": ring / 1e9,
                         "ring_seconds": cm.transfer_seconds(ring, link),
                         "server_seconds": cm.transfer_seconds(ps["server_sent"] + ps["server_received"], link)})
    print_table("d. one all-reduce of a 7B model's bf16 gradients (14 GB = 1e9 B units), "
                "bandwidth-bound", ["K", "link", "GB/s", "ring GB / device", "ring s",
                                    "parameter server s"], [list(r.values()) for r in rows])
    return {"rows": rows}


def part_e(lab: Lab, out: Path) -> dict:
    batch = lab.batches[0]
    ref_loss, ref = jax.value_and_grad(lambda p: loss_fn(lab.graphdef, p, batch))(lab.params0)
    one_device_m8 = dp_grad_fn(lab, 1, 8)(lab.params0, batch)
    dp8 = dp_grad_fn(lab, N_DEVICES, 1)(lab.params0, batch)
    dp2_m4 = dp_grad_fn(lab, 2, 4)(lab.params0, batch)
    rows = [{"setup": "1 device, 8 micro-batches of 4", "max_rel_grad_diff": compare_trees.max_rel_diff(one_device_m8[1], ref)},
            {"setup": "dp=8, 1 micro-batch", "max_rel_grad_diff": compare_trees.max_rel_diff(dp8[1], ref)},
            {"setup": "dp=2 x 4 micro-batches", "max_rel_grad_diff": compare_trees.max_rel_diff(dp2_m4[1], ref)}]
    print_table(f"e. exercise 7: gradient of one {BATCH}-document batch, accumulated vs at once",
                ["setup", "max relative difference"], [list(r.values()) for r in rows])
    # day-4 §4.3: micro-batches of ~500 / 100 / 400 / 50 target tokens
    pool, sums, counts = iter(lab.corpus.train), [], []
    for want in (500, 100, 400, 50):
        group, total = [], 0
        for d in pool:
            if total + len(d) - 1 <= want:
                group.append(d)
                total += len(d) - 1
            if want - total < 8:
                break
        s, c = nll_and_count(lab.graphdef, lab.trained, as_arrays(garden.make_batch(group, 64)))
        sums.append(float(s))
        counts.append(float(c))
    right = sum(sums) / sum(counts)
    wrong = float(np.mean([s / c for s, c in zip(sums, counts)]))
    print_table("e. day-4 trap: loss of 4 micro-batches of different sizes (model after 30 steps)",
                ["target tokens", "micro-batch mean NLL"],
                [[int(c), s / c] for s, c in zip(sums, counts)]
                + [["sum / total tokens (right)", right], ["mean of means (wrong)", wrong]])
    return {"accumulation": rows, "trap": {"tokens": counts, "right": right, "wrong": wrong,
                                           "difference": wrong - right}}


def part_f(lab: Lab, out: Path) -> dict:
    opt = optim.adamw(3e-3)
    init1, step1 = build_train_step(lab.cfg, Plan(), opt)
    init8, step8 = build_train_step(lab.cfg, Plan(dp=N_DEVICES), opt)
    s1, s8 = init1(lab.params0), init8(lab.params0)
    batch = lab.batches[0]
    placed = step8.place_batch(batch)
    hlo = step8.jitted.lower(s8, placed).as_text(dialect="hlo")
    reductions = [c for c in measure.collectives(hlo) if c.op == "all-reduce"]
    grad_bytes = sum(c.nbytes for c in reductions if any(len(d) for _, d in c.shapes))
    predicted = cm.dp_gradient_allreduce(lab.n_params, N_DEVICES)
    compiled1, c1 = timing.compile_seconds(step1.jitted, s1, step1.place_batch(batch))
    compiled8, c8 = timing.compile_seconds(step8.jitted, s8, placed)
    mem1, mem8 = memory.memory(compiled1), memory.memory(compiled8)
    t1 = timing.step_seconds(lambda: step1(s1, batch))
    t8 = timing.step_seconds(lambda: step8.jitted(s8, placed))
    rows = [["gradient all-reduce payload (HLO, non-scalar all-reduces)", grad_bytes],
            ["gradient all-reduce payload (cost model: params x 4 B)", predicted["payload_bytes"]],
            ["ring bytes sent per device (cost model, 2(K-1)/K)", predicted["ring_bytes_per_device"]],
            ["scalar all-reduces (loss, token count)", sum(1 for c in reductions if not any(len(d) for _, d in c.shapes))],
            ["arguments per device, 1 device / dp=8", f"{mem1['arguments']:,} / {mem8['arguments']:,}"],
            ["temporaries per device, 1 device / dp=8", f"{mem1['temporaries']:,} / {mem8['temporaries']:,}"],
            ["compile (lower + compile), 1 device / dp=8", f"{c1:.2f} s / {c8:.2f} s"],
            ["median step, 1 device", f"{t1['median_s'] * 1e3:.2f} ms"],
            [f"median step, dp={N_DEVICES} (8 CPU devices share 2 cores)", f"{t8['median_s'] * 1e3:.2f} ms"],
            ["ratio dp / single", t8["median_s"] / t1["median_s"]]]
    print_table("f. the compiled data-parallel step", ["quantity", "value"], rows)
    return {"hlo_grad_allreduce_bytes": grad_bytes, "predicted": predicted,
            "agree": grad_bytes == predicted["payload_bytes"], "memory_single": mem1,
            "memory_dp": mem8, "compile_s_single": c1, "compile_s_dp": c8,
            "step_single": t1, "step_dp": t8,
            "step_ratio": t8["median_s"] / t1["median_s"]}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "f": part_f}
TITLES = {"a": "gradients on one batch", "b": "60 steps, replicas", "c": "ring walkthrough",
          "d": "communication time", "e": "gradient accumulation", "f": "compiled step"}


def main(argv=None) -> int:
    log(f"{len(jax.devices())} {jax.devices()[0].platform} devices")
    return run_experiment("data_parallel", __doc__, PARTS, TITLES, Lab, argv)


if __name__ == "__main__":
    sys.exit(main())
