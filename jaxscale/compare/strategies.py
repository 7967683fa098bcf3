"""Every parallel strategy side by side: trained, measured, and next to its prediction.

A strategy is a name for a Plan on n devices (`strategy_plan`), or any Plan written out
(`Plan.parse`). `run_strategy` trains it for a few steps on the same batches as every other
strategy (same tokens per step) and measures: the loss curve, per-device memory (the
state's shards; XLA's memory analysis of the compiled step), the collectives in its HLO
(bytes each device sends per step, loops counted per iteration), compile time (and whether
the persistent cache supplied it) and step time (median and quartiles). `predict` gives the
same figures from closed forms of what the strategy does (jaxscale.costmodel and the
structure of our model), so that every measured number has a predicted one beside it.

`judge` decides which strategies compute what the single device computes. Rounding alone
makes any two reduction orders drift apart, by an amount that depends on the model and the
number of steps; a fixed bound cannot tell that drift from a bug. So the noise floor is
measured: the CONTROL run is the single device again with its batch summed in two halves
(gradient accumulation: the same arithmetic in another order, nothing else changed). A
strategy passes when its largest relative loss difference from the single device stays
within NOISE_MULTIPLE times the control's (and never below NOISE_FLOOR); `--tolerance`
replaces the bound.
"""
from __future__ import annotations

from jaxscale import costmodel as cm
from jaxscale.measure import hlo as measure
from jaxscale.model import transformer as modellib
from jaxscale.parallel.pipeline import tick_table
from jaxscale.parallel.plan import Plan, PlanError
from jaxscale.parallel.build import build_train_step
from jaxscale.runtime import mesh as meshlib
from jaxscale.model import config as model_config

STRATEGIES = ("single", "dp", "zero1", "zero2", "zero3", "tp", "pp", "dp+tp", "dp+pp", "3d",
              "fsdp+tp", "tp+sp", "cp", "dp+cp+tp")
CONTROL = "control"  # the single device, batch summed in two halves: rounding alone
MICRO_BATCHES = 4  # for the pipelined strategies, and ZeRO-1/2 (stage 2's sharded accumulator)
NOISE_MULTIPLE = 20.0
NOISE_FLOOR = 1e-6


class CompareError(ValueError):
    """A strategy that does not exist or does not fit the devices or the model."""


def _largest(limit: int, ok) -> int:
    return max(k for k in range(1, limit + 1) if limit % k == 0 and ok(k))


def _need_split(k: int, axis: str, n: int, cfg) -> int:
    if k == 1:
        what = {"tp": f"the heads ({cfg.n_heads}) and the MLP width ({cfg.d_ff})",
                "pp": f"the layers ({cfg.n_layers})",
                "cp": f"half the sequence ({cfg.seq_len // 2})"}[axis]
        raise CompareError(f"no {axis} > 1 divides both {n} devices and {what}")
    return k


def strategy_plan(name: str, n: int, cfg: model_config.ModelConfig) -> Plan:
    """The Plan a strategy name stands for on n devices (see STRATEGIES)."""
    tp_ok = lambda k: cfg.n_heads % k == 0 and cfg.d_ff % k == 0  # noqa: E731
    pp_ok = lambda k: cfg.n_layers % k == 0  # noqa: E731
    if name == CONTROL:
        return Plan(micro_batches=2)
    if name not in STRATEGIES:
        raise CompareError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}, "
                           "or write a layout with --strategy (e.g. dp=2,tp=4,zero=1)")
    need = {"single": 1, "dp+tp": 2, "dp+pp": 2, "3d": 8, "fsdp+tp": 4,
            "dp+cp+tp": 8}.get(name, 2)
    if n < need:
        raise CompareError(f"strategy {name!r} needs at least {need} devices, got {n}")
    m = MICRO_BATCHES
    if name == "single":
        return Plan()
    if name == "dp":
        return Plan(dp=n)
    if name in ("zero1", "zero2"):  # micro-batches: stage 2 keeps only its slice of them
        return Plan(dp=n, zero_stage=int(name[-1]), micro_batches=m)
    if name == "zero3":
        return Plan(dp=n, zero_stage=3)
    if name == "tp":
        return Plan(tp=_need_split(_largest(n, tp_ok), "tp", n, cfg))
    if name == "pp":
        return Plan(pp=_need_split(_largest(n, pp_ok), "pp", n, cfg), micro_batches=m)
    if name == "dp+tp":
        tp = _need_split(_largest(n // 2, tp_ok), "tp", n // 2, cfg)
        return Plan(dp=n // tp, tp=tp)
    if name == "dp+pp":
        pp = _need_split(_largest(n // 2, pp_ok), "pp", n // 2, cfg)
        return Plan(dp=n // pp, pp=pp, micro_batches=m)
    if name == "fsdp+tp":  # ZeRO-3 over dp on each device's tp shards (2-D FSDP x TP)
        tp = _need_split(_largest(n // 2, lambda k: tp_ok(k) and k <= 2), "tp", n // 2, cfg)
        return Plan(dp=n // tp, tp=tp, zero_stage=3)
    if name == "tp+sp":
        tp = _need_split(_largest(n, lambda k: tp_ok(k) and cfg.seq_len % k == 0), "tp", n,
                         cfg)
        return Plan(tp=tp, sequence_parallel=True)
    if name == "cp":
        return Plan(cp=_need_split(_largest(n, lambda k: cfg.seq_len % (2 * k) == 0), "cp",
                                   n, cfg))
    if name == "dp+cp+tp":
        if n % 8 or not tp_ok(2) or cfg.seq_len % 8:
            raise CompareError(f"strategy 'dp+cp+tp' (dp x cp=2 x tp=2 with sequence "
                               f"parallelism) needs a multiple of 8 devices and tp=2 to divide "
                               f"the model; got {n} devices, heads {cfg.n_heads}, MLP width "
                               f"{cfg.d_ff}, seq_len {cfg.seq_len}")
        return Plan(dp=n // 4, cp=2, tp=2, sequence_parallel=True)
    if n % 8:
        raise CompareError(f"strategy '3d' (dp x tp=2 x pp=2, dp >= 2) needs a multiple of 8 "
                           f"devices, got {n}")
    if not tp_ok(2) or not pp_ok(2):
        raise CompareError(f"strategy '3d' needs tp=2 and pp=2 to divide the model: heads "
                           f"{cfg.n_heads}, MLP width {cfg.d_ff}, layers {cfg.n_layers}")
    return Plan(dp=n // 4, tp=2, pp=2, micro_batches=m, zero_stage=1)


def params_per_device(cfg: model_config.ModelConfig, plan: Plan) -> dict[str, float]:
    """Closed form: parameters one device holds before ZeRO (tp splits the heads and the
    MLP width, pp the layers; embeddings, LayerNorms and output biases are replicated)."""
    d, f, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    split = 4 * d * d + 3 * d + 2 * d * f + f  # Q, K, V, O, their biases, W1, b1, W2
    replicated = 6 * d  # bo, b2, two LayerNorms
    top = cfg.vocab_size * d + cfg.seq_len * d + 2 * d
    return {"top": top, "blocks": L / plan.pp * (split / plan.tp + replicated),
            "split": L / plan.pp * split / plan.tp,  # what tp splits
            "total": top + L / plan.pp * (split / plan.tp + replicated)}


def predictable(plan: Plan) -> bool:
    """Whether `predict` models the plan: fp32, no remat (full remat repeats tp's forward
    all-reduces), ZeRO-3 outside a pipeline only with one micro-batch (its gathers repeat
    per micro-batch; in a pipeline they are counted per tick)."""
    return (plan.remat == "none" and plan.precision == "fp32"
            and not (plan.zero_stage == 3 and plan.micro_batches > 1 and plan.pp == 1))


def predict(cfg: model_config.ModelConfig, plan: Plan, batch_shape: tuple[int, int]) -> dict:
    """Predicted per-device model-state bytes and ring bytes sent per step (fp32, Adam);
    "sent_by_axis" splits the bytes by the mesh axis each collective runs over.

    Modelled: dp, tp, pp, cp, sequence_parallel, schedule, virtual, micro_batches,
    zero_stage; other plans are refused (see `predictable`)."""
    if not predictable(plan):
        raise CompareError(f"the prediction covers fp32 plans without remat (and ZeRO-3 "
                           f"with one micro-batch); got {plan}")
    psi = params_per_device(cfg, plan)
    k, z, m, tp, cp = plan.dp, plan.zero_stage, plan.micro_batches, plan.tp, plan.cp
    states = cm.model_state_bytes(psi["total"], k, z, "fp32")
    b, s = batch_shape
    rows = b // k // m  # rows of one micro-batch on one device
    act = rows * (s // cp) * cfg.d_model * 4  # one micro-batch's x on a cp share (whole)
    ring = lambda n, g: 2 * (g - 1) / g * n  # noqa: E731
    sent: dict[str, float] = {}
    by_axis: dict[str, dict[str, float]] = {}

    def add(op, v, axis):
        if v:
            sent[op] = sent.get(op, 0.0) + v
            ops = by_axis.setdefault(axis, {})
            ops[op] = ops.get(op, 0.0) + v
    grads = 4 * psi["total"]
    if z == 0:
        add("all-reduce", ring(grads, k), "dp")
    elif z in (1, 2):  # stage 2 reduce-scatters every micro-batch (pipeline: backward tick)
        times = m * (plan.virtual if plan.pp > 1 else 1) if z == 2 else 1
        add("reduce-scatter", times * (k - 1) / k * grads, "dp")
        add("all-gather", (k - 1) / k * grads, "dp")
    elif plan.pp == 1:
        census = stage3_census(cfg, plan)
        add("all-gather", census["all_gather"], "dp")
        add("reduce-scatter", census["reduce_scatter"], "dp")
    else:  # every tick gathers its chunk's units: forward, then again in backward (the
        # stage's recomputed forward and what its backward needs), scattering there
        census, ticks = stage3_census(cfg, plan), m * plan.virtual
        add("all-gather", ticks * (census["all_gather"] + census["reduce_scatter"]), "dp")
        add("reduce-scatter", ticks * census["reduce_scatter"], "dp")
    # the sequence's shares of every gradient (ZeRO: of its slices) summed, after dp's
    # reduction: over cp, and over tp for what tp does not split when sequence parallel
    shrink, sp = (k if z else 1), plan.sequence_parallel
    if cp > 1 or sp:
        split, whole = 4 * psi["split"] / shrink, 4 * (psi["total"] - psi["split"]) / shrink
        add("all-reduce", ring(whole, cp * (tp if sp else 1)), "cp" if cp > 1 else "tp")
        add("all-reduce", ring(split, cp), "cp")
    if cp > 1:
        # ring attention: per layer, cp - 1 hops of k and v forward, of their gradients back
        kv = 2 * rows * (s // cp) * cfg.d_model // tp * 4
        add("collective-permute", 2 * (cp - 1) * kv * cfg.n_layers * m, "cp")
    layers_here = cfg.n_layers // plan.pp
    if tp > 1 and plan.sequence_parallel:
        # each all-reduce split in two: per layer 2 all-gathers and 2 reduce-scatters
        # forward, the same backward, on the whole cp share
        add("all-gather", 4 * layers_here * m * (tp - 1) / tp * act, "tp")
        add("reduce-scatter", 4 * layers_here * m * (tp - 1) / tp * act, "tp")
    elif tp > 1:  # 2 all-reduces per layer forward, 2 backward (+2: a pipeline recomputes)
        per_micro = (6 if plan.pp > 1 else 4) * layers_here
        add("all-reduce", ring(per_micro * m * act, tp), "tp")
    if cfg.document_mask and (cp > 1 or plan.sequence_parallel):
        g = cp * (tp if plan.sequence_parallel else 1)  # every token's document id, int32
        add("all-gather", m * (g - 1) / g * rows * s * 4, "cp" if cp > 1 else "tp")
    if plan.pp > 1:
        ticks = tick_table(plan.schedule, plan.pp, m, plan.virtual).ticks
        add("collective-permute", 2 * ticks * act, "pp")
        # the shared embeddings' and final LayerNorm's gradients (ZeRO: their dp slices)
        add("all-reduce", ring(4 * psi["top"] / (k if z else 1), plan.pp), "pp")
    return {"params_per_device": psi["total"], "states": states, "sent": sent,
            "sent_by_axis": by_axis}


def stage3_census(cfg: model_config.ModelConfig, plan: Plan) -> dict[str, float]:
    """ZeRO-3's gathers and reduce-scatters (zero.stage3_ring_bytes) on each device's own
    tp shards (in a pipeline: for one chunk of its layers)."""
    import jax
    from flax import nnx

    from jaxscale.parallel.hybrid import _local_shapes, param_specs
    from jaxscale.parallel.zero import stage3_ring_bytes
    abstract = modellib.abstract(cfg)
    shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    if plan.tp > 1 or plan.pp > 1:  # each device's shards; a pipeline: one chunk's layers
        shapes = _local_shapes(shapes, param_specs(modellib.logical_axes(abstract), plan), plan)
        chunk = cfg.n_layers // (plan.pp * plan.virtual)
        shapes = {**shapes, "blocks": jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((chunk, *x.shape[1:]), x.dtype), shapes["blocks"])}
    return stage3_ring_bytes(shapes, plan.dp, 4, plan.sequence_parallel)


def run_strategy(name: str, plan: Plan, cfg, params, batches, optimizer, devices,
                 time_steps: bool = True, repeats: int = 15, keep_params: bool = False,
                 profile=None) -> dict:
    """Train `plan` on `batches` (a data.sampler.StepBatches, or FixedBatches of host
    dicts) and measure it (see the module docstring); without `time_steps` the step time is
    left out (step_s is None). Under several processes every process whose devices the
    plan uses runs this; memory is read on this process's first device of the plan.
    `keep_params`: the final whole parameters, as host arrays by name, in "_final_params".
    `profile`: a folder for a jax.profiler trace of the training steps (compiled before)."""
    import jax

    from jaxscale.runtime import processes as distributed, profiling
    init, step = build_train_step(cfg, plan, optimizer, devices[:plan.n_devices])
    state = init(params)
    place = lambda i: batches.place(i, step.batch_sharding)  # noqa: E731 - this process's rows
    placed = place(0)
    lowered = step.jitted.lower(state, placed)
    compiled, compile_s, source = measure.compile_timed(lowered)
    table = (tick_table(plan.schedule, plan.pp, plan.micro_batches, plan.virtual)
             if plan.pp > 1 else None)
    hlo, share = lowered.as_text(dialect="hlo"), table.branch_share() if table else None
    sent = measure.ring_bytes_by_op(hlo, share)
    mem = measure.memory(compiled)
    losses = []
    prof = profiling.Profiler(profile)
    with prof.trace():
        for i in range(len(batches)):  # float() waits for each step: never runs ahead
            with prof.step(i):
                state, metrics = compiled(state, place(i))
                losses.append(float(metrics["loss"]))
    timing = (measure.step_seconds(lambda: compiled(state, placed), repeats=repeats)
              if time_steps else {})  # the whole output, not only the loss
    here = next(d for d in devices[:plan.n_devices] if d.process_index == jax.process_index())
    on0 = lambda tree: measure.bytes_on_device(tree, here)  # noqa: E731
    out = {"name": name, "status": "ok", "plan": plan.as_dict(), "n_devices": plan.n_devices,
           "platform": here.platform, "device_kind": here.device_kind,
           "losses": losses, "compile_s": compile_s, "compile_source": source,
           "step_s": timing.get("median_s"), "step_s_q1": timing.get("q1_s"),
           "step_s_q3": timing.get("q3_s"), "step_repeats": timing.get("repeats"),
           "memory": {"params": on0(state.params), "master": on0(state.master),
                      "optimizer": on0(state.opt_state), **mem},
           "sent": sent,
           "collectives_per_step": sum(c.times for c in measure.collectives(hlo, share)
                                       if measure.group_size(c, plan.n_devices) > 1)}
    if jax.process_count() > 1 and step.mesh is not None:  # which bytes leave the process
        out["sent_cross_process"] = measure.ring_bytes_by_op(
            hlo, share, device_process=meshlib.device_process(step.mesh))
    if keep_params:
        out["_final_params"] = distributed.named_host_arrays(step.full_params(state))
    if table is not None:  # the idle share of the schedule the executor runs (unit ticks)
        out["idle_schedule"] = table.branch_share()[0]
        from jaxscale.parallel.schedules import bubble_over_total
        out["idle_formula"] = float(bubble_over_total(plan.schedule, plan.pp, plan.micro_batches,
                                                    plan.virtual))
    return out


def judge(rows: list[dict], tolerance: float | None = None) -> dict:
    """Mark every measured row pass/fail against the single device (see the module
    docstring); returns the noise figures the bound came from. Rows that failed to run
    stay failed."""
    ok = {r["name"]: r for r in rows if r.get("status") == "ok"}
    ref, control = ok.get("single"), ok.get(CONTROL)
    for r in ok.values():
        if ref is not None:
            r["rel_dloss"] = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])]
            r["max_rel_dloss"] = max(r["rel_dloss"])
    drift = control["max_rel_dloss"] if control is not None and ref is not None else None
    if tolerance is not None:
        bound, why = tolerance, "given with --tolerance"
    elif drift is not None:
        bound = max(NOISE_MULTIPLE * drift, NOISE_FLOOR)
        why = (f"{NOISE_MULTIPLE:g} x the control's drift {drift:.2g}"
               if bound > NOISE_FLOOR else f"the floor {NOISE_FLOOR:g} (the control drifted "
                                               f"{drift:.2g})")
    else:
        bound, why = None, "no single-device reference or control run: nothing to judge"
    for r in rows:
        r["pass"] = bool(r.get("status") == "ok" and bound is not None
                         and r["max_rel_dloss"] <= bound)
    return {"control": CONTROL, "drift": drift, "multiple": NOISE_MULTIPLE,
            "floor": NOISE_FLOOR, "tolerance": bound, "why": why}


def layout_plan(layout: str, n: int) -> Plan:
    """The Plan of a written-out layout (`--strategy dp=2,tp=4,zero=1`) on n devices."""
    try:
        plan = Plan.parse(layout)
    except PlanError as e:
        raise CompareError(f"strategy {layout!r}: {e}") from None
    if plan.n_devices > n:
        raise CompareError(f"strategy {layout!r} needs {plan.n_devices} devices, got {n}; "
                           f"pass --devices {plan.n_devices}")
    return plan


def check_strategies(names: list[str], n: int, cfg, layouts: tuple[str, ...] = ()
                     ) -> dict[str, Plan]:
    """Plans for strategy `names` and written-out `layouts` (named by their text), all
    validated before anything compiles (CompareError if not)."""
    from jaxscale.parallel.hybrid import check_divisible
    plans = {}
    for name in [*names, *layouts]:
        plan = layout_plan(name, n) if name in layouts else strategy_plan(name, n, cfg)
        try:
            plan.validate()
            if plan.tp > 1 or plan.pp > 1:
                check_divisible(cfg, plan)
        except PlanError as e:
            raise CompareError(f"strategy {name!r}: {e}") from None
        plans[name] = plan
    return plans
