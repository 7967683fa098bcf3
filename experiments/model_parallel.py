"""Lecture 13 §4 (4.2-4.4), exercises 3 and 6; day-4 §5.3-5.5: tensor and pipeline parallelism.

    python -m experiments.model_parallel [--out runs/model_parallel] [--parts abcdef] [--json]

Runs on 8 host-CPU devices (forced here, before JAX starts), on the tiny8 preset (8 layers,
8 heads, d = 32) so that tp and pp reach 8.

a. the Megatron MLP at k = 2, 4, 8 devices vs one: max difference, bytes per device; the
   wrong (row-first) split, and by how much GELU(a) + GELU(b) misses GELU(a + b)
b. attention split by heads at k = 2, 4, 8
c. pipeline gradients vs the unpipelined model: 2 and 4 stages, 1-8 micro-batches, each schedule
d. the schedules' timelines (text and PNG), idle simulated vs (p-1)/(m+p-1), exercise 3
e. lecture §4.4's communication table: 32 layers, h = 4096, 8 x 2048 tokens (cost model)
f. 3-D: dp=2, tp=2, pp=2, 1F1B, 20 steps vs one device; bytes per axis from the HLO next to
   the schedule's count; activation memory of GPipe vs 1F1B; step times as ratios, with
   their quartiles over 5 timed runs

Each plan's training step is compiled once (XLA:CPU compiling dominates the run) and kept on
the lab, its optimizer state holding the step's gradient, which part c reads. Part f runs
the same programs: it trains the single device and 3-D (their steps update with AdamW, the
others' with 0), reads the 3-D program's bytes and the pipelines' memory, and times them.
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
import optax  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from experiments._runner import log, run_experiment  # noqa: E402
from jaxscale import costmodel as cm, garden  # noqa: E402
from jaxscale.measure import hlo as measure  # noqa: E402
from jaxscale.measure import compare_trees, memory, timing  # noqa: E402
from jaxscale.model import transformer as M, optim  # noqa: E402
from jaxscale.runtime.mesh import make_mesh  # noqa: E402
from jaxscale.parallel import schedules as sched  # noqa: E402
from jaxscale.parallel.gantt import gantt_png  # noqa: E402
from jaxscale.parallel.hybrid import param_specs  # noqa: E402
from jaxscale.parallel.tick_table import tick_table  # noqa: E402
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.parallel.build import build_train_step  # noqa: E402
from jaxscale.report import print_table  # noqa: E402
from jaxscale.training.config import TrainConfig  # noqa: E402
from jaxscale.training.reference import as_arrays, init_run  # noqa: E402
from jaxscale.model import config as model_config

MODEL, BATCH, STEPS = "tiny8", 32, 20
TIMED = 5  # timed runs of each step in part f (their quartiles are printed)
# the state is the gradient (a trace that forgets: g + 0 x old = g, exactly), the update 0
KEEP_GRADIENT = optax.chain(optax.trace(decay=0.0), optax.scale(0.0))
# the plans part f trains: AdamW on the gradient, which their state keeps all the same
TRAINED = (Plan(), Plan(dp=2, tp=2, pp=2, micro_batches=4))
ADAMW_KEEPING_GRADIENT = optax.chain(optax.trace(decay=0.0), optim.adamw(3e-3))


class Lab:
    def __init__(self, seed: int = 0):
        if len(jax.devices()) != N_DEVICES:
            raise SystemExit(f"needs {N_DEVICES} devices, JAX has {len(jax.devices())}: run it "
                             "as python -m experiments.model_parallel")
        self.cfg = model_config.preset(MODEL)
        _, self.params, _ = init_run(TrainConfig(model=MODEL, seed=seed))
        it = garden.make_corpus(seed).train_batches(BATCH, seed=seed)
        self.batches = [as_arrays(next(it)) for _ in range(STEPS)]
        self.layer0 = jax.tree.map(lambda x: x[0], self.params["blocks"])
        x = M.embed(self.params, jnp.asarray(self.batches[0]["tokens"][:8]))
        self.x = M.layer_norm(x, self.layer0["ln1"]["scale"], self.layer0["ln1"]["bias"])
        self.axes = jax.tree.map(lambda a: a[1:], M.logical_axes(M.abstract(self.cfg))["blocks"],
                                 is_leaf=lambda a: isinstance(a, tuple))
        self._grads = {}

    def sharded(self, fn, k: int):
        """fn(layer params, x) run over k devices with the block's tensor-parallel specs."""
        mesh = make_mesh(f"tp={k}", jax.devices()[:k])
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(param_specs(self.axes, Plan(tp=k)),
                                                               P()), out_specs=P()))

    def gradient(self, plan: Plan) -> dict:
        """One step of `plan` on batch 0, compiled once and kept for every part: the whole
        gradient (on the host: comparing it compiles nothing per plan), the loss, the
        compiled program (memory, timing; TRAINED plans: training), the lowered one (HLO),
        the inputs."""
        if plan not in self._grads:
            optimizer = ADAMW_KEEPING_GRADIENT if plan in TRAINED else KEEP_GRADIENT
            init, step = build_train_step(self.cfg, plan, optimizer,
                                          jax.devices()[:plan.n_devices])
            state0 = init(self.params)
            batch = step.place_batch(self.batches[0])
            lowered = step.jitted.lower(state0, batch)
            compiled = lowered.compile()
            state, metrics = compiled(state0, batch)
            whole = step.full_params(
                state._replace(params=state.opt_state[0].trace))
            self._grads[plan] = {"grad": jax.device_get(whole), "loss": float(metrics["loss"]),
                                 "compiled": compiled, "lowered": lowered, "step": step,
                                 "state": state0, "batch": batch}
        return self._grads[plan]

    def losses(self, plan: Plan) -> list[float]:
        """The loss at each of STEPS AdamW steps of `plan` (one of TRAINED)."""
        run = self.gradient(plan)
        state, curve = run["state"], []
        for b in self.batches:
            state, m = run["compiled"](state, run["step"].place_batch(b))
            curve.append(float(m["loss"]))
        return curve


def part_a(lab: Lab, out: Path) -> dict:
    p, x = lab.layer0, lab.x
    right = M.mlp(p, x)
    rows, res = [], {}
    for k in (2, 4, 8):
        enter, reduce = M.tp_operators("tp")
        f = lab.sharded(lambda q, h: M.mlp(q, enter(h), reduce), k)
        specs = param_specs(lab.axes, Plan(tp=k))
        placed = jax.device_put(p, jax.tree.map(lambda s: jax.sharding.NamedSharding(
            make_mesh(f"tp={k}", jax.devices()[:k]), s), specs, is_leaf=lambda s: isinstance(s, P)))
        diff = float(jnp.max(jnp.abs(f(placed, x) - right)))
        mlp_bytes = sum(memory.bytes_on_device(placed[n], jax.devices()[0])
                        for n in ("w1", "b1", "w2"))
        whole = sum(p[n].nbytes for n in ("w1", "b1", "w2"))
        res[k] = {"max_abs_diff": diff, "bytes_per_device": mlp_bytes, "whole_bytes": whole}
        rows.append([k, f"{diff:.1e}", f"{mlp_bytes:,}", f"{whole // k:,}"])
    print_table("a. Megatron MLP: W1 by columns, W2 by rows, one all-reduce",
                ["k", "max |diff| vs 1 device", "W1, b1, W2 bytes/device", "whole / k"], rows)
    halves = np.split(np.arange(lab.cfg.d_model), 2)
    wrong = sum(jax.nn.gelu(x[..., i] @ p["w1"][i] + p["b1"] / 2) for i in halves) @ p["w2"] \
        + p["b2"]
    res["wrong_split_max_abs_diff"] = float(jnp.max(jnp.abs(wrong - right)))
    res["output_scale"] = float(jnp.max(jnp.abs(right)))
    print(f"  wrong split (W1 by rows, GELU of the partial sums, k=2): max |diff| "
          f"{res['wrong_split_max_abs_diff']:.2e} against outputs up to {res['output_scale']:.2e}"
          ": GELU(a) + GELU(b) != GELU(a + b)")
    return res


def part_b(lab: Lab, out: Path) -> dict:
    p, x = lab.layer0, lab.x
    right = M.attention(p, x)
    rows, res = [], {}
    for k in (2, 4, 8):
        enter, reduce = M.tp_operators("tp")
        f = lab.sharded(lambda q, h: M.attention(q, enter(h), reduce), k)
        diff = float(jnp.max(jnp.abs(f(p, x) - right)))
        res[k] = {"max_abs_diff": diff, "heads_per_device": lab.cfg.n_heads // k}
        rows.append([k, lab.cfg.n_heads // k, f"{diff:.1e}"])
    print_table("b. attention split by heads (Q, K, V by output, O by input)",
                ["k", "heads per device", "max |diff| vs 1 device"], rows)
    return res


def part_c(lab: Lab, out: Path) -> dict:
    ref = lab.gradient(Plan())
    # 2 and 4 stages, 1 to 8 micro-batches (tests/parallel/test_pipeline.py runs more combinations)
    cases = [("gpipe", 2, 8), ("gpipe", 4, 1), ("1f1b", 2, 8), ("1f1b", 4, 4),
             ("interleaved", 2, 8), ("interleaved", 4, 4)]
    rows, res = [], []
    for i, (schedule, p, m) in enumerate(cases):
        log(f"  pipeline {i + 1}/{len(cases)}: {schedule}, {p} stages, {m} micro-batches")
        v = 2 if schedule == "interleaved" else 1
        run = lab.gradient(Plan(pp=p, micro_batches=m, schedule=schedule, virtual=v))
        r = {"schedule": schedule, "stages": p, "micro_batches": m, "virtual": v,
             "max_rel_grad_diff": compare_trees.max_rel_diff(run["grad"], ref["grad"]),
             "loss_rel_diff": abs(run["loss"] - ref["loss"]) / ref["loss"],
             "activation_slots": tick_table(schedule, p, m, v).slots}
        res.append(r)
        rows.append([schedule, p, m, v, f"{r['max_rel_grad_diff']:.1e}",
                     f"{r['loss_rel_diff']:.1e}", r["activation_slots"]])
    print_table("c. pipeline gradients vs the unpipelined model (whole batch, tiny8)",
                ["schedule", "stages", "micro-batches", "v", "max rel grad diff", "loss diff",
                 "inputs kept"], rows)
    return {"cases": res}


def part_d(lab: Lab, out: Path) -> dict:
    res = {}
    for schedule, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        tl = sched.run(schedule, 4, 4, v)
        print(f"d. {schedule}, p = 4, m = 4{f', v = {v}' if v > 1 else ''} "
              "(forward 1, backward 2):")
        print(sched.text_chart(tl))
        gantt_png(tl, out / f"schedule_{schedule}.png", title=(
            f"{schedule}, p=4, m=4{f', v={v}' if v > 1 else ''}: idle "
            f"{float(tl.idle_fraction):.1%} (simulated)"))
        res[schedule] = {"idle_simulated": float(tl.idle_fraction),
                         "idle_formula": float(sched.bubble_over_total(schedule, 4, 4, v)),
                         "peak_in_flight": tl.peak_in_flight}
    need = {p: sched.smallest_micro_batches("1f1b", p) for p in (4, 8)}
    print_table("   idle fraction: simulator vs formula; exercise 3 (idle <= 10%)",
                ["schedule", "simulated", "formula", "peak in flight per device"],
                [[k, f"{r['idle_simulated']:.4f}", f"{r['idle_formula']:.4f}", r["peak_in_flight"]]
                 for k, r in res.items()])
    print(f"  smallest m with idle <= 10% (simulated): p=4 -> {need[4]}, p=8 -> {need[8]}")
    return {"schedules": res, "exercise_3": need}


def part_e(lab: Lab, out: Path) -> dict:
    L, h, b, s = 32, 4096, 8, 2048
    tp = cm.tp_step_volume(L, s, b, h, tp=8)
    pp = cm.pp_step_volume(s, b, h, pp=8)
    dp = cm.dp_gradient_allreduce(12 * L * h * h, 8, grad_bytes=2)
    rows = [["TP (8 devices)", f"{tp['allreduces_per_step']} all-reduces of "
             f"{tp['allreduce_bytes'] / 1e6:.0f} MB", f"{tp['payload_bytes_per_step'] / 1e9:.1f} GB"],
            ["PP (8 stages)", "activations + gradients per boundary",
             f"{pp['boundary_bytes_per_step'] / 1e6:.0f} MB"],
            ["DP (8 replicas)", f"gradient all-reduce of 12 L h^2 = {12 * L * h * h / 1e9:.2f}B "
             "bf16 parameters", f"{dp['payload_bytes'] / 1e9:.1f} GB"]]
    print_table(f"e. communication per step, {L} layers, h = {h}, {b} x {s} tokens, 16-bit",
                ["strategy", "what moves", "bytes"], rows)
    return {"tp": tp, "pp": pp, "dp": dp}


def part_f(lab: Lab, out: Path) -> dict:
    cfg, res = lab.cfg, {}
    single, three_d = TRAINED
    m = three_d.micro_batches
    curves = {"single": lab.losses(single), "3d": lab.losses(three_d)}
    res["loss_rel_diff_20_steps"] = max(abs(a - b) / b for a, b in zip(curves["3d"],
                                                                        curves["single"]))
    run = lab.gradient(three_d)
    batch, state = lab.batches[0], run["state"]
    table = tick_table("1f1b", 2, m)
    hlo = run["lowered"].as_text(dialect="hlo")
    axes = measure.bytes_by_axis(hlo, {"dp": 2, "pp": 2, "tp": 2}, table.branch_share())
    act = BATCH // 2 // m * batch["tokens"].shape[1] * cfg.d_model * 4
    per_stage = cfg.n_layers // 2
    predicted = {"tp": m * per_stage * 6 * act, "pp_permute": 2 * table.ticks * act,
                 "pp_useful": 2 * m * act,
                 "dp": sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state.params))}
    res["bytes"] = {"measured": axes, "predicted": predicted}
    print_table(f"f. dp=2, tp=2, pp=2, 1F1B, m={m}: bytes per device per step (HLO vs count)", [
        "axis", "op", "measured", "predicted", "why"], [
        ["tp", "all-reduce", f"{axes['tp']['all-reduce']['bytes']:,.0f}", f"{predicted['tp']:,}",
         "2 per layer in F, 4 in B (recomputes F) x micro-batches"],
        ["pp", "collective-permute", f"{axes['pp']['collective-permute']['bytes']:,}",
         f"{predicted['pp_permute']:,}", f"2 per tick x {table.ticks} ticks (useful: "
         f"{predicted['pp_useful']:,}, the rest idle ticks' zeros)"],
        ["dp", "all-reduce", f"{axes['dp']['all-reduce']['bytes']:,}", f"{predicted['dp']:,}",
         "this device's gradient shard"]])
    temps = {schedule: memory.memory(lab.gradient(Plan(pp=2, micro_batches=8, schedule=schedule))
                                      ["compiled"])["temporaries"] for schedule in ("gpipe", "1f1b")}
    res["temporaries_pp2_m8"] = temps
    res.update(_step_times(lab))
    print(f"  20 steps, loss vs one device: max rel diff {res['loss_rel_diff_20_steps']:.1e}")
    print(f"  temporaries, pp=2, m=8: GPipe {temps['gpipe']:,} B, 1F1B {temps['1f1b']:,} B")
    q = res["step_quartiles_to_single"]
    print(f"  step time / single device (8 CPU devices on 2 cores; median of {TIMED} runs "
          "[quartiles]): " + ", ".join(f"{k} {v:.2f} [{q[k][0]:.2f}-{q[k][1]:.2f}]"
                                       for k, v in res["step_ratio_to_single"].items()))
    return res


def _step_times(lab: Lab) -> dict:
    """Each plan's step time (its compiled program has run already: one warm-up call), as a
    ratio to the single device's median, with its quartiles: the spread says how far the
    ratios can be trusted on a shared machine. (The single device and 3-D steps carry
    AdamW's update, the others not: it is elementwise, within 1% of a step as measured.)"""
    stats = {}
    for name, plan in (("single", Plan()), ("tp2", Plan(tp=2)),
                       ("pp2_gpipe", Plan(pp=2, micro_batches=8, schedule="gpipe")),
                       ("pp2_1f1b", Plan(pp=2, micro_batches=8)),
                       ("pp2_interleaved", Plan(pp=2, micro_batches=8, schedule="interleaved",
                                                virtual=2)),
                       ("3d", TRAINED[1])):
        run = lab.gradient(plan)
        stats[name] = timing.step_seconds(
            lambda r=run: r["compiled"](r["state"], r["batch"]), repeats=TIMED, warmup=1)
    single = stats["single"]["median_s"]
    return {"step_ratio_to_single": {k: s["median_s"] / single for k, s in stats.items()},
            "step_quartiles_to_single": {k: [s["q1_s"] / single, s["q3_s"] / single]
                                         for k, s in stats.items()}}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e, "f": part_f}
TITLES = {"a": "tensor-parallel MLP", "b": "attention by heads", "c": "pipeline gradients",
          "d": "schedules", "e": "communication table", "f": "3-D"}


def main(argv=None) -> int:
    log(f"{len(jax.devices())} {jax.devices()[0].platform} devices")
    return run_experiment("model_parallel", __doc__, PARTS, TITLES, Lab, argv)


if __name__ == "__main__":
    sys.exit(main())
