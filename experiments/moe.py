"""A mixture of experts, for real: the router's balance, capacity, expert parallelism.

    python -m experiments.moe [--out runs/moe] [--parts abcd] [--json]

a. load balance over training: tiny-moe (8 SwiGLU experts, top-2) with Switch's
   load-balancing loss (weight 0.01) and without it: at each step the busiest expert's
   assignments over the mean (1 is perfect balance, 4 is every token on the same 2)
b. capacity: the share of (token, expert) assignments dropped and the loss, at capacity
   factors 0.5 and 1 and dropless
c. expert parallelism against data parallelism on 4 devices (dp=4 against ep=4):
   bytes per device per step by collective, measured in the compiled program next to
   jaxscale.compare.predict's closed form, and the step time (median of 5, alone)
d. the garden MoE against a dense model of its active size (one SwiGLU MLP 2 x 64 = 128
   wide: the same parameters per token but for the router's 256 per layer) on the same
   tokens

The training runs of a, b and d start together, two at a time (this machine's two
cores compile two programs at once); c's programs compile the same way, then each is
timed with nothing else running. Runs on 4 host-CPU devices, forced here before JAX
starts. Tables go to stdout (stderr with --json) and results.json; the balance curve to
a PNG in --out.
"""
from __future__ import annotations

import dataclasses
import sys
from concurrent.futures import ThreadPoolExecutor

from jaxscale.runtime.devices import force_cpu_devices

N_DEVICES = 4
if __name__ == "__main__":
    force_cpu_devices(N_DEVICES)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from experiments._runner import log, run_experiment  # noqa: E402
from jaxscale import garden  # noqa: E402
from jaxscale.compare.predict import predict  # noqa: E402
from jaxscale.measure import hlo, timing  # noqa: E402
from jaxscale.model import config as model_config, transformer as M  # noqa: E402
from jaxscale.parallel.build import build_train_step  # noqa: E402
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.report import print_table, pyplot, save_figure  # noqa: E402
from jaxscale.training import sweep  # noqa: E402
from jaxscale.training.config import TrainConfig  # noqa: E402
from jaxscale.training.reference import init_run  # noqa: E402

MODEL, STEPS, BATCH, LR = "tiny-moe", 30, 16, 3e-3  # sized to keep the experiment near 60 s
LAST = 5  # the loss of a run: the mean of its last LAST steps (each on fresh batches)
FACTORS = (0.5, 1.0)  # capacity factors of part b, beside dropless
LAYOUTS = ("dp=4", "ep=4")  # (dp=2 x ep=2 works as well: tests/parallel; 20 s more here)


class Lab:
    def __init__(self, seed: int = 0):
        self.cfg = TrainConfig(model=MODEL, seed=seed, lr=LR, warmup=3, steps=STEPS,
                               batch_size=BATCH)
        self.moe = model_config.preset(MODEL)
        _, self.params, self.optimizer = init_run(self.cfg)
        self.batches = sweep.stack_batches(garden.make_corpus(seed), STEPS, BATCH, seed=seed)
        self.dense = dataclasses.replace(self.moe, n_experts=0, top_k=2,
                                         d_ff=self.moe.top_k * self.moe.expert_d_ff)
        variants = {"aux": self.moe, "no aux": dataclasses.replace(self.moe, router_aux_weight=0.0),
                    **{f"capacity {f}": dataclasses.replace(self.moe, capacity_factor=f)
                       for f in FACTORS}, "dense": self.dense}
        pool = ThreadPoolExecutor(2)
        self.runs = {k: pool.submit(self.train, cfg, seed) for k, cfg in variants.items()}

    def train(self, cfg, seed: int) -> dict:
        """STEPS steps on one device: each step's figures, and the run's loss."""
        params = (self.params if cfg.n_experts else
                  nnx.to_pure_dict(nnx.state(M.build(cfg, seed=seed), nnx.Param)))
        init, step = build_train_step(cfg, Plan(), self.optimizer)
        state, curve = init(params), []
        for i in range(STEPS):
            state, m = step(state, {k: v[i] for k, v in self.batches.items()})
            curve.append({k: float(v) for k, v in m.items()
                          if k == "loss" or k.startswith("moe_")})
        return {"curve": curve, "loss": float(np.mean([c["loss"] for c in curve[-LAST:]])),
                "params": model_config.param_count(cfg),
                "active": model_config.param_count(cfg, active=True)}

    def result(self, key: str) -> dict:
        return self.runs[key].result()


def part_a(lab: Lab, out) -> dict:
    rows, curves = [], {}
    for key in ("aux", "no aux"):
        run = lab.result(key)
        load = [c["moe_load_max"] for c in run["curve"]]
        curves[key] = load
        rows.append({"router": key, "load max/mean first": load[0],
                     f"mean of last {LAST}": float(np.mean(load[-LAST:])),
                     "worst": max(load), "aux loss last": run["curve"][-1]["moe_aux"],
                     "loss": run["loss"]})
    print_table("a. load balance: the busiest expert's assignments over the mean, per "
                "step (1: balanced; 4: every token on the same two of 8)",
                list(rows[0]), [list(r.values()) for r in rows])
    fig, ax = pyplot().subplots(figsize=(6, 3.5))
    for key, load in curves.items():
        ax.plot(range(1, STEPS + 1), load, label=f"{key} (Switch load-balancing loss)"
                if key == "aux" else key)
    ax.set(xlabel="step", ylabel="max / mean assignments", title="tiny-moe's router")
    ax.legend()
    save_figure(fig, out / "a_balance.png")
    return {"rows": rows, "curves": curves}


def part_b(lab: Lab, out) -> dict:
    rows = []
    for key, factor in [*((f"capacity {f}", f) for f in FACTORS), ("aux", None)]:
        run = lab.result(key)
        dropped = [c["moe_dropped"] for c in run["curve"]]
        rows.append({"capacity factor": "dropless" if factor is None else factor,
                     "dropped first": dropped[0], f"dropped, mean of last {LAST}":
                     float(np.mean(dropped[-LAST:])), "loss": run["loss"]})
    print_table("b. capacity: assignments dropped (the token passes the layer on its "
                "residual alone) and the loss", list(rows[0]), [list(r.values()) for r in rows])
    return {"rows": rows}


def _layout(lab: Lab, layout: str):
    plan = Plan.parse(layout)
    init, step = build_train_step(lab.moe, plan, lab.optimizer, jax.devices()[:plan.n_devices])
    state, batch = init(lab.params), {k: v[0] for k, v in lab.batches.items()}
    text = step.jitted.lower(state, step.place_batch(batch)).as_text(dialect="hlo")
    jax.block_until_ready(step(state, batch))  # compiled (and run once)
    return plan, step, state, batch, text


def part_c(lab: Lab, out) -> dict:
    with ThreadPoolExecutor(2) as pool:
        built = list(pool.map(lambda lay: _layout(lab, lay), LAYOUTS))
    rows = []
    for layout, (plan, step, state, batch, text) in zip(LAYOUTS, built):
        sent = hlo.ring_bytes_by_op(text, n_devices=plan.n_devices)
        pred = predict(lab.moe, plan, batch["tokens"].shape)["sent"]
        t = timing.step_seconds(step, state, batch, repeats=5, warmup=1)
        rows.append({"layout": layout, "all-to-all B": sent.get("all-to-all", 0.0),
                     "predicted": pred.get("all-to-all", 0.0),
                     "all-reduce B": sent.get("all-reduce", 0.0),
                     "predicted ": pred.get("all-reduce", 0.0),
                     "agree": sent == pred, "step ms": 1e3 * t["median_s"],
                     "q1-q3 ms": f"{1e3 * t['q1_s']:.0f}-{1e3 * t['q3_s']:.0f}"})
    print_table(f"c. expert parallelism against data parallelism on {N_DEVICES} devices: "
                "bytes per device per step (ring), measured in the program and predicted; "
                "step time (4 devices share 2 cores: overheads, not speed-ups)",
                list(rows[0]), [list(r.values()) for r in rows])
    return {"rows": rows}


def part_d(lab: Lab, out) -> dict:
    rows = [{"model": name, "parameters": run["params"], "active per token": run["active"],
             "loss": run["loss"]} for name, run in (("tiny-moe", lab.result("aux")),
                                                    ("dense, same active", lab.result("dense")))]
    print_table(f"d. the MoE against a dense model of its active size, {STEPS} steps of "
                f"{BATCH} documents each (loss: mean of the last {LAST})",
                list(rows[0]), [list(r.values()) for r in rows])
    return {"rows": rows, "moe_minus_dense": rows[0]["loss"] - rows[1]["loss"]}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d}
TITLES = {"a": "load balance with and without the auxiliary loss", "b": "capacity",
          "c": "ep against dp", "d": "MoE against dense"}


def main(argv=None) -> int:
    log(f"training {MODEL} five ways, two at a time, while the parts wait for theirs")
    return run_experiment("moe", __doc__, PARTS, TITLES, Lab, argv)


if __name__ == "__main__":
    sys.exit(main())
