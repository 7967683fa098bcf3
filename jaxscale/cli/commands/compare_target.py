"""`compare --abstract --target`: the target and the job checked before JAX starts (the
compile itself is jaxscale.compare.abstract's, on jaxscale.runtime.targets' devices)."""
from __future__ import annotations


def target_and_job(args, cfg):
    """(the --target, or None; the model with the job's --seq), checked before JAX starts;
    --devices defaults to the target's chips (else 8) and must match them."""
    import dataclasses

    from jaxscale.compare.strategies import CompareError
    if (args.target or args.seq) and not args.abstract:
        raise CompareError("--target and --seq only compile: add --abstract")
    target = checked_target(args.target, args.devices) if args.target else None
    args.devices = target.n_devices if target else args.devices or 8
    return target, dataclasses.replace(cfg, seq_len=args.seq) if args.seq else cfg


def checked_target(name: str, devices: int | None):
    """The target NAME, its compiler installed and its chips --devices (if given)."""
    from jaxscale.compare.strategies import CompareError
    from jaxscale.runtime import targets
    try:
        target = targets.available_target(name)
    except targets.TargetError as e:
        raise CompareError(str(e)) from None
    if devices not in (None, target.n_devices):
        raise CompareError(f"--devices {devices}, but {target.name} has {target.n_devices} "
                           "chips: drop --devices, or pick a target of that many chips")
    return target


def check_target_sizes(plans, target, layouts, cfg) -> None:
    """A written-out layout must use every chip of the target, and some plan's model states
    (the closed form) must fit one chip: otherwise nothing is worth compiling."""
    from jaxscale.compare.abstract import predicted_states
    from jaxscale.compare.strategies import CompareError
    from jaxscale.costmodel.units import human_bytes
    for name, plan in plans.items():
        if name in layouts and plan.n_devices != target.n_devices:
            raise CompareError(f"layout {name} uses {plan.n_devices} devices, but "
                               f"{target.name} has {target.n_devices} chips")
    states = {name: predicted_states(cfg, p)["total"] for name, p in plans.items()}
    least = min(states, key=states.get)
    if states[least] > target.hbm_bytes:
        raise CompareError(f"no plan fits even before activations: the least, {least}, needs "
                           f"{human_bytes(states[least])} of model states per chip and a "
                           f"{target.generation} chip has {human_bytes(target.hbm_bytes)} "
                           f"({states[least] / target.hbm_bytes:.1f}x); shard them over more "
                           "chips (zero=3, tp, pp) or pick a bigger slice")


def check_kernels(plans, target, on_cpu: bool, cfg) -> None:
    """Each plan's attention kernel runs where it will be compiled: a target's chips (TPU,
    GPU), else this machine's CPU when it has no accelerator; tpu-flash on sequences of a
    multiple of its block."""
    from jaxscale.compare.strategies import CompareError
    from jaxscale.model.attention import FLASH_BLOCK, KernelError, check_kernel
    platform = (("tpu" if target.platform == "tpu" else "gpu") if target is not None
                else "cpu" if on_cpu else None)
    for name, plan in plans.items():
        try:
            check_kernel(plan.attention, platform)
        except KernelError as e:
            raise CompareError(f"strategy {name!r}: {e}") from None
        if plan.attention == "tpu-flash" and plan.cp > 1:
            raise CompareError(f"strategy {name!r}: with cp > 1 ring attention is the kernel "
                               "(its blocks are einsums), so tpu-flash would not run: drop "
                               "attention=tpu-flash or cp")
        if plan.attention == "tpu-flash" and cfg.seq_len % FLASH_BLOCK:
            raise CompareError(f"strategy {name!r}: tpu-flash takes sequences of a multiple "
                               f"of {FLASH_BLOCK} tokens, and the job's are {cfg.seq_len}: "
                               "set --seq, or use attention einsum")
