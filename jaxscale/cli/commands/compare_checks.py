"""`compare`'s options that only some runs take, checked before any work: what
--abstract (compile only, in one process) and --trace-divergence (retrain next to the
single device) cannot be combined with."""
from __future__ import annotations


def check_trace(args, cluster) -> None:
    """--trace-divergence's conditions, checked before anything runs."""
    from jaxscale.compare.strategies import CompareError
    if not args.trace_divergence:
        return
    if args.precision not in (None, "fp32") and not args.tolerance:
        raise CompareError(f"--trace-divergence bounds each step by fp32's rounding, which "
                           f"--precision {args.precision} exceeds by design; give --tolerance")
    if args.abstract or cluster is not None:
        raise CompareError("--trace-divergence retrains each strategy in one process next to "
                           "the single device; drop --abstract and the multi-process options")


def check_abstract(args, cluster) -> None:
    """--abstract's conditions: one process, and nothing asked of steps that never run."""
    from jaxscale.compare.strategies import CompareError
    if cluster is not None:
        raise CompareError("--abstract compiles in one process; drop the multi-process "
                           "options (or run it without `jaxscale launch`)")
    trained = [o for o, v in (("--profile", args.profile), ("--save-params", args.save_params))
               if v is not None]
    if trained:
        raise CompareError(f"{' and '.join(trained)} keep{'s' if len(trained) == 1 else ''} "
                           "what training steps leave, and --abstract runs none; drop "
                           f"{'it' if len(trained) == 1 else 'them'} or --abstract")
