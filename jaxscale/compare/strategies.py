"""Every parallel strategy side by side: trained, measured, and next to its prediction.

A strategy is a name for a Plan on n devices (`strategy_plan`), or any Plan written out
(`Plan.parse`). `run_strategy` trains it for a few steps on the same batches as every other
strategy (same tokens per step) and measures: the loss curve, per-device memory (the
state's shards; XLA's memory analysis of the compiled step), the collectives in its HLO
(bytes each device sends per step, loops counted per iteration), compile time (and whether
the persistent cache supplied it) and step time (median and quartiles). `compare.predict`
gives the same figures from closed forms of what the strategy does, so that every measured
number has a predicted one beside it.

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

import math
from dataclasses import replace

from jaxscale.compare import phases
from jaxscale.parallel.fits import check_divisible, check_experts
from jaxscale.parallel.plan import Plan, PlanError
from jaxscale.model import config as model_config

STRATEGIES = ("single", "dp", "zero1", "zero2", "zero3", "tp", "pp", "dp+tp", "dp+pp", "3d",
              "fsdp+tp", "tp+sp", "cp", "dp+cp+tp")
EXPERT_STRATEGIES = ("ep", "dp+ep")  # for models with experts (a default set adds them)
NAMES = STRATEGIES + EXPERT_STRATEGIES
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
    """The Plan a strategy name stands for on n devices (see STRATEGIES), if the model
    runs under it: the ep strategies need experts, and a mixture of experts runs without
    FP8, and in a pipeline without dense first blocks (a default set leaves out what it
    refuses: jaxscale.parallel.fits.check_experts)."""
    plan = _plan(name, n, cfg)
    try:
        check_experts(cfg, plan)
    except PlanError as e:
        raise CompareError(f"strategy {name!r}: {e}") from None
    return plan


def _plan(name: str, n: int, cfg: model_config.ModelConfig) -> Plan:
    tp_ok = lambda k: cfg.n_heads % k == 0 and all(w % k == 0 for w in cfg.mlp_widths)  # noqa: E731
    pp_ok = lambda k: cfg.n_layers // cfg.moe_every % k == 0  # noqa: E731 (whole groups)
    if name == CONTROL:
        return Plan(micro_batches=2)
    if name not in NAMES:
        raise CompareError(f"unknown strategy {name!r}; choose from {', '.join(NAMES)}, "
                           "or write a layout with --strategy (e.g. dp=2,tp=4,zero=1)")
    need = {"single": 1, "dp+tp": 2, "dp+pp": 2, "3d": 8, "fsdp+tp": 4, "dp+ep": 4,
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
    if name in ("ep", "dp+ep"):  # the largest ep dividing the experts (and n or n / 2)
        rows = n if name == "ep" else n // 2
        ep = _largest(rows, lambda k: cfg.n_experts % k == 0) if cfg.n_experts else 2
        return Plan(dp=n // ep, ep=ep) if ep > 1 else Plan(ep=n)  # (ep=n: refused by name)
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


def run_strategy(name: str, plan: Plan, cfg, params, batches, optimizer, devices,
                 time_steps: bool = True, repeats: int = 15, keep_params: bool = False,
                 profile=None) -> dict:
    """Train `plan` on `batches` (a data.sampler.StepBatches, or FixedBatches of host
    dicts) and measure it (see the module docstring); without `time_steps` the step time is
    left out (step_s is None). Under several processes every process whose devices the
    plan uses runs this; memory is read on this process's first device of the plan.
    `keep_params`: the final whole parameters, as host arrays by name, in "_final_params".
    `profile`: a folder for a jax.profiler trace of the training steps (compiled before).

    The three phases one after another (compare.phases); compare's worker pool runs them
    apart, so that no step is timed while another process compiles."""
    p = phases.prepare(name, plan, cfg, params, batches, optimizer, devices)
    phases.train(p, len(batches), keep_params, profile)
    if time_steps:
        phases.time_step(p, repeats)
    return p.row


def judge(rows: list[dict], tolerance: float | None = None) -> dict:
    """Mark every measured row pass/fail against the single device (see the module
    docstring); returns the noise figures the bound came from. Rows that failed to run
    stay failed."""
    ok = {r["name"]: r for r in rows if r.get("status") == "ok"}
    ref, control = ok.get("single"), ok.get(CONTROL)
    for r in ok.values():
        if ref is not None:
            r["rel_dloss"] = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"])]
            r["max_rel_dloss"] = worst(r["rel_dloss"])
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
    for r in rows:  # no reference, nothing to pass with
        r["pass"] = bool(r.get("status") == "ok" and bound is not None
                         and r.get("max_rel_dloss", math.nan) <= bound)
    return {"control": CONTROL, "drift": drift, "multiple": NOISE_MULTIPLE,
            "floor": NOISE_FLOOR, "tolerance": bound, "why": why}


def worst(diffs: list[float]) -> float:
    """The largest difference, NaN if any is NaN: `max` keeps its first item against a NaN
    after it (NaN compares false), so a loss that stopped being a number would pass."""
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs)


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


def check_strategies(names: list[str], n: int, cfg, layouts: tuple[str, ...] = (),
                     precision: str | None = None,
                     fp8_options: dict | None = None) -> dict[str, Plan]:
    """Plans for strategy `names` and written-out `layouts` (named by their text), all
    validated before anything compiles (CompareError if not). `precision`: the policy of
    every strategy, the single device and the control included, except a layout that
    names its own (so each is judged against its own single-device run); `fp8_options`
    (Plan's fp8_block, fp8_head, fp8_history) go with it."""
    plans = {}
    for name in [*names, *layouts]:
        plan = layout_plan(name, n) if name in layouts else strategy_plan(name, n, cfg)
        if precision is not None and not (name in layouts and "precision=" in name):
            plan = replace(plan, precision=precision, **(fp8_options or {}))
        try:
            plan.validate()
            check_divisible(cfg, plan)  # (a one-device plan: fp8-block's tiles)
        except PlanError as e:
            raise CompareError(f"strategy {name!r}: {e}") from None
        plans[name] = plan
    return plans
