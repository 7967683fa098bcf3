"""Every parallel strategy side by side: trained, measured, and next to its prediction.

A strategy is a name for a Plan on n devices (`strategy_plan`). `run_strategy` trains it
for a few steps on the same batches as every other strategy (same tokens per step) and
measures: the loss curve, per-device memory (the state's shards; XLA's memory analysis
of the compiled step), the collectives in its HLO (bytes each device sends per step,
loops counted per iteration), compile time and median step time. `predict` gives the
same figures from closed forms of what the strategy does (jaxscale.costmodel and the
structure of our model), so that every measured number has a predicted one beside it.
"""
from __future__ import annotations

import time


from jaxscale import costmodel as cm, measure, model as modellib
from jaxscale.parallel.pipeline import tick_table
from jaxscale.parallel.plan import Plan, PlanError, build_train_step

STRATEGIES = ("single", "dp", "zero1", "zero2", "zero3", "tp", "pp", "dp+tp", "dp+pp", "3d")
TOLERANCE = 1e-5  # max |loss - single| / single over all steps: reduction order only
MICRO_BATCHES = 4  # for the pipelined strategies


class CompareError(ValueError):
    """A strategy that does not exist or does not fit the devices or the model."""


def _largest(limit: int, ok) -> int:
    return max(k for k in range(1, limit + 1) if limit % k == 0 and ok(k))


def _need_split(k: int, axis: str, n: int, cfg) -> int:
    if k == 1:
        what = (f"the heads ({cfg.n_heads}) and the MLP width ({cfg.d_ff})" if axis == "tp"
                else f"the layers ({cfg.n_layers})")
        raise CompareError(f"no {axis} > 1 divides both {n} devices and {what}")
    return k


def strategy_plan(name: str, n: int, cfg: modellib.ModelConfig) -> Plan:
    """The Plan a strategy name stands for on n devices (see STRATEGIES)."""
    tp_ok = lambda k: cfg.n_heads % k == 0 and cfg.d_ff % k == 0  # noqa: E731
    pp_ok = lambda k: cfg.n_layers % k == 0  # noqa: E731
    if name not in STRATEGIES:
        raise CompareError(f"unknown strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    need = {"single": 1, "dp+tp": 2, "dp+pp": 2, "3d": 8}.get(name, 2)
    if n < need:
        raise CompareError(f"strategy {name!r} needs at least {need} devices, got {n}")
    m = MICRO_BATCHES
    if name == "single":
        return Plan()
    if name == "dp":
        return Plan(dp=n)
    if name.startswith("zero"):
        return Plan(dp=n, zero_stage=int(name[-1]))
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
    if n % 8:
        raise CompareError(f"strategy '3d' (dp x tp=2 x pp=2, dp >= 2) needs a multiple of 8 "
                           f"devices, got {n}")
    if not tp_ok(2) or not pp_ok(2):
        raise CompareError(f"strategy '3d' needs tp=2 and pp=2 to divide the model: heads "
                           f"{cfg.n_heads}, MLP width {cfg.d_ff}, layers {cfg.n_layers}")
    return Plan(dp=n // 4, tp=2, pp=2, micro_batches=m, zero_stage=1)


def params_per_device(cfg: modellib.ModelConfig, plan: Plan) -> dict[str, float]:
    """Closed form: parameters one device holds before ZeRO (tp splits the heads and the
    MLP width, pp the layers; embeddings, LayerNorms and output biases are replicated)."""
    d, f, L = cfg.d_model, cfg.d_ff, cfg.n_layers
    split = 4 * d * d + 3 * d + 2 * d * f + f  # Q, K, V, O, their biases, W1, b1, W2
    replicated = 6 * d  # bo, b2, two LayerNorms
    top = cfg.vocab_size * d + cfg.seq_len * d + 2 * d
    return {"top": top, "blocks": L / plan.pp * (split / plan.tp + replicated),
            "total": top + L / plan.pp * (split / plan.tp + replicated)}


def predict(cfg: modellib.ModelConfig, plan: Plan, batch_shape: tuple[int, int]) -> dict:
    """Predicted per-device model-state bytes and ring bytes sent per step (fp32, Adam).

    Modelled: dp, tp, pp, schedule, virtual, micro_batches, zero_stage. Not modelled, and
    refused: remat (full remat repeats tp's forward all-reduces), precision other than fp32,
    ZeRO-3 with micro-batches (its gathers repeat per micro-batch)."""
    if plan.remat != "none" or plan.precision != "fp32" or (plan.zero_stage == 3
                                                            and plan.micro_batches > 1):
        raise CompareError(f"the prediction covers fp32 plans without remat (and ZeRO-3 "
                           f"with one micro-batch); got {plan}")
    psi = params_per_device(cfg, plan)
    k, z = plan.dp, plan.zero_stage
    states = cm.model_state_bytes(psi["total"], k, z, "fp32")
    b, s = batch_shape
    act = b // plan.dp // plan.micro_batches * s * cfg.d_model * 4  # one micro-batch's x
    ring = lambda n, g: 2 * (g - 1) / g * n  # noqa: E731
    sent: dict[str, float] = {}

    def add(op, v):
        if v:
            sent[op] = sent.get(op, 0.0) + v
    grads = 4 * psi["total"]
    if z == 0:
        add("all-reduce", ring(grads, k))
    elif z in (1, 2):
        add("reduce-scatter", (k - 1) / k * grads)
        add("all-gather", (k - 1) / k * grads)
    else:
        from flax import nnx

        from jaxscale.parallel.zero import stage3_ring_bytes
        shapes = nnx.to_pure_dict(nnx.state(modellib.abstract(cfg), nnx.Param))
        census = stage3_ring_bytes(shapes, k, 4)
        add("all-gather", census["all_gather"])
        add("reduce-scatter", census["reduce_scatter"])
    layers_here = cfg.n_layers // plan.pp
    if plan.tp > 1:  # 2 all-reduces per layer forward, 2 backward (+2: a pipeline recomputes)
        per_micro = (6 if plan.pp > 1 else 4) * layers_here
        add("all-reduce", ring(per_micro * plan.micro_batches * act, plan.tp))
    if plan.pp > 1:
        ticks = tick_table(plan.schedule, plan.pp, plan.micro_batches, plan.virtual).ticks
        add("collective-permute", 2 * ticks * act)
        # the shared embeddings' and final LayerNorm's gradients (ZeRO: their dp slices)
        add("all-reduce", ring(4 * psi["top"] / (k if z else 1), plan.pp))
    return {"params_per_device": psi["total"], "states": states, "sent": sent}


def run_strategy(name: str, plan: Plan, cfg, params, batches, optimizer, devices,
                 time_steps: bool = True) -> dict:
    """Train `plan` on `batches` and measure it (see the module docstring); without
    `time_steps` the median step time is left out (step_s is None)."""
    init, step = build_train_step(cfg, plan, optimizer, devices[:plan.n_devices])
    state = init(params)
    fn = getattr(step, "jitted", step)
    place = getattr(step, "place_batch", lambda b: b)
    placed = place(batches[0])
    t0 = time.perf_counter()
    lowered = fn.lower(state, placed)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - t0
    table = (tick_table(plan.schedule, plan.pp, plan.micro_batches, plan.virtual)
             if plan.pp > 1 else None)
    sent = measure.ring_bytes_by_op(lowered.as_text(dialect="hlo"),
                                    table.branch_share() if table else None)
    mem = measure.memory(compiled)
    losses = []
    for b in batches:
        state, metrics = compiled(state, place(b))
        losses.append(float(metrics["loss"]))
    timing = (measure.step_seconds(lambda: compiled(state, placed), repeats=9)  # whole output
              if time_steps else {"median_s": None})
    on0 = lambda tree: measure.bytes_on_device(tree, devices[0])  # noqa: E731
    out = {"name": name, "plan": plan.as_dict(), "n_devices": plan.n_devices,
           "losses": losses, "compile_s": compile_s, "step_s": timing["median_s"],
           "memory": {"params": on0(state.params), "master": on0(state.master),
                      "optimizer": on0(state.opt_state), **mem},
           "sent": sent}
    if table is not None:  # the idle share of the schedule the executor runs (unit ticks)
        out["idle_schedule"] = table.branch_share()[0]
        from jaxscale.parallel.schedule import bubble_fraction
        out["idle_formula"] = float(bubble_fraction(plan.schedule, plan.pp, plan.micro_batches,
                                                    plan.virtual))
    return out


def check_strategies(names: list[str], n: int, cfg) -> dict[str, Plan]:
    """Plans for `names`, all validated before anything compiles (CompareError if not)."""
    from jaxscale.parallel.hybrid import check_divisible
    plans = {}
    for name in names:
        plan = strategy_plan(name, n, cfg)
        try:
            plan.validate()
            if plan.tp > 1 or plan.pp > 1:
                check_divisible(cfg, plan)
        except PlanError as e:
            raise CompareError(f"strategy {name!r}: {e}") from None
        plans[name] = plan
    return plans
