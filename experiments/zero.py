"""Lecture 13 §5 and exercise 2; day-4 §4.1-4.2 and §5.2: ZeRO and recomputation, for real.

    python -m experiments.zero [--out runs/zero] [--parts abcde] [--json]

Runs on 8 host-CPU devices (forced here, before JAX starts); ZeRO runs use 4 of them.

a. the ZeRO paper's per-device table (Psi = 7.5B, K = 64), mixed-precision and fp32 Adam
b. 40 AdamW steps on 4 devices: DP and ZeRO 1, 2, 3 against the single device; optimizer
   state per device; bytes each device sends per step, read from the HLO; step time
c. per-device memory of the compiled steps next to the closed forms 16, 4 + 12/K, 2 + 14/K,
   16/K bytes per parameter (bf16 policy) and 16, 4 + 12/K ... (fp32)
d. activations: Korthikanti et al.'s table for 32 layers, h = 4096, 32 heads, 8 x 2048 tokens,
   then our model's saved residuals, measured, next to the same formula; remat's cost
e. exercise 2: a 70B model's model states, on 64 devices, and the fewest 80 GB devices
"""
from __future__ import annotations

import sys
from pathlib import Path

from jaxscale.runtime.devices import force_cpu_devices

N_DEVICES, K, STEPS, BATCH = 8, 4, 40, 32
if __name__ == "__main__":
    force_cpu_devices(N_DEVICES)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax._src.ad_checkpoint import saved_residuals  # noqa: E402  (what print_saved_residuals prints)

from experiments._runner import log, run_experiment  # noqa: E402
from jaxscale import costmodel as cm, garden  # noqa: E402
from jaxscale.measure import hlo as measure  # noqa: E402
from jaxscale.measure import memory, timing  # noqa: E402
from jaxscale.model import transformer as M, optim, precision  # noqa: E402
from jaxscale.model.loss import loss_fn  # noqa: E402
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.parallel.build import build_train_step  # noqa: E402
from jaxscale.parallel.zero import stage3_ring_bytes  # noqa: E402
from jaxscale.report import print_table, pyplot, save_figure  # noqa: E402
from jaxscale.training.config import TrainConfig  # noqa: E402
from jaxscale.training.reference import as_arrays, init_run  # noqa: E402
from jaxscale.model import config as model_config

GB = 1e9
BK = "['blocks']['bk']"


class Lab:
    def __init__(self, seed: int = 0):
        if len(jax.devices()) != N_DEVICES:
            raise SystemExit(f"needs {N_DEVICES} devices, JAX has {len(jax.devices())}: run it "
                             "as python -m experiments.zero")
        self.cfg = model_config.preset("tiny")
        self.graphdef, self.params0, _ = init_run(TrainConfig(seed=seed))
        it = garden.make_corpus(seed).train_batches(BATCH, seed=seed)
        self.batches = [as_arrays(next(it)) for _ in range(STEPS)]
        self.n = model_config.param_count(self.cfg)
        self.shapes = nnx.to_pure_dict(nnx.state(M.abstract(self.cfg), nnx.Param))
        self._compiled = {}

    def compiled(self, plan: Plan):
        """(compiled step, its HLO text, initial state, step) for `plan`, compiled once and
        shared by the parts (training, HLO bytes, memory analysis)."""
        if plan not in self._compiled:
            init, step = build_train_step(self.cfg, plan, optim.adamw(3e-3),
                                          jax.devices()[:plan.n_devices])
            state = init(self.params0)
            lowered = step.jitted.lower(state, step.place_batch(self.batches[0]))
            self._compiled[plan] = (lowered.compile(), lowered.as_text(dialect="hlo"), state,
                                    step)
        return self._compiled[plan]


def part_a(lab: Lab, out: Path) -> dict:
    psi, k = 7.5e9, 64
    rows, res = [], {}
    for stage, name in enumerate(["DP (baseline)", "ZeRO-1 (P_os)", "ZeRO-2 (P_os+g)",
                                  "ZeRO-3 (P_os+g+p)"]):
        mixed = cm.model_state_bytes(psi, k, stage, "mixed")
        fp32 = cm.model_state_bytes(psi, k, stage, "fp32")
        res[stage] = {"mixed_gb": mixed["total"] / GB, "fp32_gb": fp32["total"] / GB}
        rows.append([name, mixed["params"] / GB, mixed["grads"] / GB, mixed["optimizer"] / GB,
                     mixed["total"] / GB, fp32["total"] / GB])
    print_table(f"a. model states per device, Psi = {psi:.3g}, K = {k} (GB = 1e9 bytes)",
                ["stage", "params", "grads", "optimizer", "total (2/2/12 B)", "total fp32 (4/4/8)"],
                rows)
    return res


def _run(lab: Lab, plan: Plan):
    """Train `plan` for STEPS steps with its one compiled program: (state, losses, step)."""
    compiled, _, state, step = lab.compiled(plan)
    place = step.place_batch
    losses = []
    for b in lab.batches:
        state, m = compiled(state, place(b))
        losses.append(float(m["loss"]))
    return state, losses, step


def _rel(a, b, skip=()) -> float:
    """max |a - b| over the tensors (but `skip`), over the largest |b|."""
    scale = max(float(jnp.max(jnp.abs(y))) for y in jax.tree.leaves(b))
    return max(float(jnp.max(jnp.abs(x - y))) for (p, x), y in
               zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b))
               if jax.tree_util.keystr(p) not in skip) / scale


def part_b(lab: Lab, out: Path) -> dict:
    _, single, _ = _run(lab, Plan())
    runs = {stage: _run(lab, Plan(dp=K, zero_stage=stage)) for stage in range(4)}
    dp_params = runs[0][2].full_params(runs[0][0])
    batch = runs[0][2].place_batch(lab.batches[0])
    rows, res = [], {}
    dp_sent = None
    for stage, (state, losses, step) in runs.items():
        compiled, hlo, _, _ = lab.compiled(Plan(dp=K, zero_stage=stage))
        sent = measure.ring_bytes_sent(hlo, K)
        dp_sent = dp_sent or sent
        t = timing.step_seconds(lambda c=compiled, st=state: c(st, batch), repeats=9)
        whole = step.full_params(state)
        on0 = lambda tree: memory.bytes_on_device(tree, jax.devices()[0])  # noqa: E731
        bk = lambda t: {"bk": t["blocks"]["bk"]}  # noqa: E731
        r = {"loss_rel_vs_single": max(abs(a - b) / b for a, b in zip(losses, single)),
             "params_rel_vs_dp": _rel(whole, dp_params, skip=(BK,)),
             "bk_rel_vs_dp": _rel(bk(whole), bk(dp_params)) * float(jnp.max(jnp.abs(
                 dp_params["blocks"]["bk"]))) / max(float(jnp.max(jnp.abs(y)))
                                                   for y in jax.tree.leaves(dp_params)),
             "opt_state_bytes": on0(state.opt_state),
             "param_bytes": on0(state.params), "ring_bytes_sent": sent,
             "ratio_to_dp_bytes": sent / dp_sent, "step_ms": t["median_s"] * 1e3}
        res[stage] = r
    for stage, r in res.items():
        r["step_ratio_to_dp"] = r["step_ms"] / res[0]["step_ms"]
        rows.append([f"{'DP' if stage == 0 else f'ZeRO-{stage}'}", f"{r['loss_rel_vs_single']:.1e}",
                     f"{r['params_rel_vs_dp']:.1e}", f"{r['bk_rel_vs_dp']:.1e}",
                     f"{r['opt_state_bytes']:,}", f"{r['param_bytes']:,}",
                     f"{r['ring_bytes_sent']:,}", f"{r['ratio_to_dp_bytes']:.3f}",
                     f"{r['step_ratio_to_dp']:.2f}"])
    print_table(f"b. {STEPS} AdamW steps on {K} devices, {lab.n:,} parameters (per device)",
                ["strategy", "max rel loss vs 1 device", "params vs DP (but bk)", "bk vs DP",
                 "optimizer state B", "param B", "bytes sent/step", "x DP", "step time x DP"],
                rows)
    predicted3 = stage3_ring_bytes(lab.shapes, K, 4)
    formulas = {"opt_state_dp": 8 * lab.n, "opt_state_zero": 8 * lab.n // K,
                "lecture_28672_params": [8 * 28672, 8 * 28672 // K],
                "dp_ring_bytes": cm.ring_all_reduce_bytes(4 * lab.n, K),
                "stage3_census": predicted3, "stage3_textbook_ratio": 1.5}
    print(f"  optimizer state, Adam 8 B/param: DP {formulas['opt_state_dp']:,} -> ZeRO "
          f"{formulas['opt_state_zero']:,} (the lecture's 28,672-parameter model: "
          f"{formulas['lecture_28672_params'][0]:,} -> {formulas['lecture_28672_params'][1]:,})")
    print(f"  bytes/step: DP ring all-reduce 2(K-1)/K x 4 x Psi = {formulas['dp_ring_bytes']:,.0f};"
          f" ZeRO-3 census {predicted3['total']:,.0f} = {predicted3['total'] / predicted3['dp']:.3f}"
          f" x DP (textbook 3(K-1)/K x 4 x Psi = {predicted3['textbook']:,.0f} = 1.5 x): the tied "
          "embedding is gathered by two units, pos_embed and b2 are not needed in backward")
    return {"runs": res, "formulas": formulas}


def _outer_scans(jaxpr) -> list:
    """The scan equations of a jaxpr that no other scan encloses (searched through jit,
    shard_map, cond and other sub-programs)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append(eqn)
            continue
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(sub, "eqns"):
                    found += _outer_scans(sub)
    return found


def _accumulator_bytes(step, state, batch) -> int:
    """Per-device bytes of the gradient accumulator, read from the step's own program: the
    carry of its micro-batch scan (data.accumulated_value_and_grad), shapes as one device
    sees them inside shard_map, the scalar loss left out."""
    scans = _outer_scans(jax.make_jaxpr(step.jitted)(state, batch).jaxpr)
    if len(scans) != 1:
        raise RuntimeError(f"expected one micro-batch scan in the step, found {len(scans)}")
    eqn = scans[0]
    first = eqn.params["num_consts"]
    carry = eqn.invars[first:first + eqn.params["num_carry"]]
    return sum(v.aval.size * v.aval.dtype.itemsize for v in carry if v.aval.ndim)


def _grads_formula(lab: Lab, plan: Plan) -> int:
    """The closed form the accumulator should have: every gradient tensor in the compute
    dtype, whole before stage 2, its padded 1/K slice from stage 2 on."""
    itemsize = np.dtype(precision.policy(plan.precision).compute_dtype).itemsize
    k = plan.dp if plan.zero_stage >= 2 else 1
    return sum(-(-int(np.prod(s.shape[1:] if p[0].key == "blocks" else s.shape)) // k)
               * (s.shape[0] if p[0].key == "blocks" else 1) * itemsize
               for p, s in jax.tree_util.tree_leaves_with_path(lab.shapes))


def _model_states(lab: Lab, plan: Plan) -> dict:
    """Per-device model-state bytes of the compiled step, measured: its arguments less the
    batch (XLA's memory analysis), plus the gradient accumulator the program carries (XLA
    counts that among the temporaries, so its size is read from the program's scan)."""
    compiled, _, state, step = lab.compiled(plan)
    batch = step.place_batch(lab.batches[0])
    mem = memory.memory(compiled)
    batch_bytes = sum(x.nbytes for x in jax.tree.leaves(batch)) // plan.dp
    grads = _accumulator_bytes(step, state, batch)
    states = mem["arguments"] - batch_bytes
    return {"states_in_arguments": states, "grads": grads, "total": states + grads,
            "grads_formula": _grads_formula(lab, plan), "temporaries": mem["temporaries"]}


def part_c(lab: Lab, out: Path) -> dict:
    rows, res = [], {}
    for prec, formula_kind in (("bf16", "mixed"), ("fp32", "fp32")):
        for stage in range(4):
            m = _model_states(lab, Plan(dp=K, zero_stage=stage, precision=prec))
            f = cm.model_state_bytes(lab.n, K, stage, formula_kind)["total"]
            r = {**m, "formula": f, "rel_diff": (m["total"] - f) / f}
            res[f"{prec}_stage{stage}"] = r
            rows.append([prec, stage, f"{m['states_in_arguments']:,}", f"{m['grads']:,}",
                         f"{m['grads_formula']:,}", f"{m['total']:,}", f"{f:,.0f}",
                         f"{f / lab.n:.1f}", f"{r['rel_diff']:+.4%}", f"{m['temporaries']:,}"])
    print_table(f"c. model states per device, K = {K}, {lab.n:,} parameters: measured = state "
                "arguments (XLA's memory analysis, less the batch) + the gradient accumulator "
                "(read from the step's micro-batch scan)", [
                    "policy", "ZeRO", "state args B", "grad acc. B", "grads formula B",
                    "measured B", "formula B", "formula B/param", "diff", "XLA temporaries B"], rows)
    padded = [jax.tree_util.keystr(p) for p, s in jax.tree_util.tree_leaves_with_path(lab.shapes)
              if (np.prod(s.shape[1:]) if p[0].key == "blocks" else np.prod(s.shape)) % K]
    print("  the remainder: Adam's step count, the loss scale and the skip counters "
          "(4-byte scalars) ride in the arguments; tensors padded at K="
          f"{K}: {', '.join(padded) or 'none'}")
    t1, t2 = (res[f"fp32_stage{s}"]["temporaries"] for s in (1, 2))
    print(f"  XLA's temporaries, fp32: stage 1 {t1:,} B, stage 2 {t2:,} B" + (
        ": equal, since with one micro-batch each device still computes its whole gradient "
        "before the reduce-scatter (stage 2's smaller accumulator pays off with several "
        "micro-batches)" if t1 == t2 else f", {t1 - t2:+,} B"))
    return res


def _residuals(lab: Lab, remat: str, batch) -> dict:
    graphdef = nnx.graphdef(M.abstract(lab.cfg, remat=remat))
    res = saved_residuals(lambda p: loss_fn(graphdef, p, batch), lab.params0)
    b, s = batch["tokens"].shape
    h, a, L = lab.cfg.d_model, lab.cfg.n_heads, lab.cfg.n_layers
    sbh, as2b = s * b * h, a * s * s * b
    layers = [av for av, why in res if av.ndim >= 1 and av.shape[0] == L]
    maps = [av for av in layers if av.shape[-2:] == (s, s)]  # [L, b, a, s, s]: attention maps
    return {"total_bytes": sum(av.size * av.dtype.itemsize for av, _ in res),
            "per_layer_bytes": sum(av.size * av.dtype.itemsize for av in layers) / L,
            "sbh_tensors_per_layer": sum(av.size for av in layers if av.shape[1:3] == (b, s))
            / (L * sbh),  # [L, b, s, ...]: per-token activations
            "as2b_tensors_per_layer": sum(av.size for av in maps) / (L * as2b), "s": s, "b": b}


def part_d(lab: Lab, out: Path) -> dict:
    L, h, a, b, s = 32, 4096, 32, 8, 2048
    lecture = [  # (results.json key, what the row is, bytes)
        ("per_layer_gb", "one layer: s*b*h*(34 + 5*a*s/h)", cm.activation_bytes_per_layer(
            s, b, h, a)),
        ("total_gb", f"all {L} layers", cm.activation_bytes(L, s, b, h, a)),
        ("flash_per_layer_gb", "one layer, flash attention (no a*s*s maps): 34*s*b*h",
         cm.activation_bytes_per_layer(s, b, h, a, True)),
        ("recompute_gb", f"all {L} layers, each recomputed: {L} inputs of 2*s*b*h + one layer",
         cm.activation_bytes(L, s, b, h, a, recompute=True)),
        ("flash_recompute_gb", f"all {L} layers, flash attention and recomputation",
         cm.activation_bytes(L, s, b, h, a, True, True))]
    table = {key: n / GB for key, _, n in lecture}
    print_table(f"d. activations kept for backward (Korthikanti et al.), {L} layers, h = {h}, "
                f"{a} heads, {b} x {s} tokens, 16-bit; GB = 1e9 bytes",
                ["activations", "bytes", "GB"], [[what, f"{n:,.0f}", n / GB]
                                                 for _, what, n in lecture])
    batch = as_arrays(next(garden.make_corpus(0).train_batches(128)))
    ours, rows = {}, []
    for remat in M.REMAT_POLICIES:
        r = _residuals(lab, remat, batch)
        graphdef = nnx.graphdef(M.abstract(lab.cfg, remat=remat))
        grad = jax.jit(jax.grad(lambda p, bt, g=graphdef: loss_fn(g, p, bt)))
        compiled = grad.lower(lab.params0, batch).compile()
        r["temporaries"] = memory.memory(compiled)["temporaries"]
        r["flops"] = compiled.cost_analysis()["flops"]
        r["grad_ms"] = timing.step_seconds(compiled, lab.params0, batch, repeats=9)["median_s"] * 1e3
        ours[remat] = r
    s_, b_, h_, a_ = ours["none"]["s"], ours["none"]["b"], lab.cfg.d_model, lab.cfg.n_heads
    # Korthikanti et al. count 16-bit tensors and 1-byte dropout masks; we train in fp32 with
    # no dropout: 2 x (34 - 2 masks) s*b*h + 2 x (5 - 3: mask and dropout output) a*s*s*b
    formula = 2 * (32 * s_ * b_ * h_ + 2 * a_ * s_ * s_ * b_)  # = 4 B x (16 sbh + 1 as^2b)
    for remat, r in ours.items():
        r["overhead_vs_none"] = r["grad_ms"] / ours["none"]["grad_ms"]
        r["flops_vs_none"] = r["flops"] / ours["none"]["flops"]
        rows.append([remat, f"{r['per_layer_bytes']:,.0f}", f"{r['sbh_tensors_per_layer']:.1f}",
                     f"{r['as2b_tensors_per_layer']:.1f}", f"{r['total_bytes']:,}",
                     f"{r['temporaries']:,}", f"{r['flops_vs_none']:.2f}",
                     f"{r['overhead_vs_none']:.2f}"])
    print_table(f"   our model, {b_} documents x {s_} positions, fp32: residuals kept for backward "
                "(measured by jax's saved_residuals)",
                ["remat", "per layer B", "s*b*h tensors", "a*s*s*b tensors", "all residuals B",
                 "XLA temporaries B", "FLOPs x none", "time x none"], rows)
    print(f"  formula per layer, fp32 and no dropout: 4 B x (16 s*b*h + 1 a*s*s*b) = {formula:,.0f} B;"
          f" measured {ours['none']['per_layer_bytes']:,.0f} B. JAX keeps the tanh-GELU's "
          "intermediates (several 4h-wide tensors where the formula counts 2) and the scores both "
          "before and after softmax; 'matmuls' keeps only matmul outputs, 'full' only each "
          "block's input. FLOPs (XLA's cost analysis) show the recomputation: +1 forward "
          "of each block is +1/3 of its work, less here because the head and loss are not "
          "recomputed; time on this 2-core CPU is noisy and memory-bound, so it need not follow")
    return {"lecture_table": table, "ours": ours, "formula_per_layer_fp32_no_dropout": formula}


def part_e(lab: Lab, out: Path) -> dict:
    psi = 70e9
    total = cm.model_state_bytes(psi, 1, 0, "mixed")["total"]
    on64 = cm.model_state_bytes(psi, 64, 3, "mixed")["total"]
    fewest = int(np.ceil(total / 80e9))
    print_table("e. exercise 2: 70B parameters, mixed-precision Adam", ["quantity", "value"], [
        ["model states in all (16 B/param)", f"{total / GB:,.0f} GB"],
        ["per device, ZeRO-3 on 64", f"{on64 / GB:.1f} GB"],
        ["fewest 80 GB devices for model states alone", fewest],
        ["...but activations, gathered layers, buffers and compute", "need far more"]])
    fig, ax = pyplot().subplots(figsize=(6, 3.2))
    ks = [8, 16, 32, 64, 128, 256]
    for stage in range(4):
        ax.plot(ks, [cm.model_state_bytes(psi, k, stage)["total"] / GB for k in ks], "o-",
                label="DP" if stage == 0 else f"ZeRO-{stage}")
    ax.axhline(80, color="k", ls="--", lw=0.8, label="80 GB device")
    ax.set(xscale="log", yscale="log", xlabel="data-parallel devices K (log)",
           ylabel="model states per device (GB = 1e9 B, log)",
           title="70B parameters, mixed-precision Adam (2 + 2 + 12 B/param)")
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    save_figure(fig, out / "zero_70b.png")
    return {"total_gb": total / GB, "zero3_on_64_gb": on64 / GB, "fewest_80gb_devices": fewest}


PARTS = {"a": part_a, "b": part_b, "c": part_c, "d": part_d, "e": part_e}
TITLES = {"a": "the ZeRO paper's table", "b": f"{STEPS} steps on {K} devices, stages 0-3",
          "c": "compiled memory vs formulas", "d": "activations and recomputation",
          "e": "exercise 2 (70B)"}


def main(argv=None) -> int:
    log(f"{len(jax.devices())} {jax.devices()[0].platform} devices")
    return run_experiment("zero", __doc__, PARTS, TITLES, Lab, argv)


if __name__ == "__main__":
    sys.exit(main())
