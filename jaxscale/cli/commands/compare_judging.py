"""`compare`'s options for what each strategy is judged by: the number formats every
strategy runs in (so each is judged against its own single-device run), the bound, and
the trace of where a strategy parts ways with the single device."""
from __future__ import annotations

from jaxscale.cli.main import _number
from jaxscale.model.precision import POLICIES


def fp8_options(args) -> dict:
    """The Plan fields --fp8-block, --fp8-head and --fp8-history set, for every strategy
    alike; refused (CompareError) without the --precision they belong to."""
    from jaxscale.compare.strategies import CompareError
    options = {k: v for k, v in (("fp8_block", args.fp8_block),
                                 ("fp8_head", args.fp8_head or None),
                                 ("fp8_history", args.fp8_history)) if v is not None}
    if options and args.precision is None:
        raise CompareError(f"--{next(iter(options)).replace('_', '-')} applies to an fp8 "
                           "--precision (fp8, fp8-delayed or fp8-block); give one")
    return options


def add_arguments(p) -> None:
    p.add_argument("--precision", default=None, choices=list(POLICIES), metavar="POLICY",
                   help="the number formats of every strategy, the single device and the "
                        f"control included ({', '.join(POLICIES)}; default fp32); a layout's "
                        "own precision= key stays")
    p.add_argument("--fp8-block", type=_number(), default=None, metavar="N",
                   help="with --precision fp8-block: its tile length, for every strategy "
                        "alike (default 128)")
    p.add_argument("--fp8-head", action="store_true",
                   help="with an fp8 --precision: the output head in FP8 too, for every "
                        "strategy alike")
    p.add_argument("--fp8-history", type=_number(), default=None, metavar="N",
                   help="with --precision fp8-delayed: the amax history's steps, for every "
                        "strategy alike (default 16)")
    p.add_argument("--tolerance", type=_number(float, 0, exclusive=True), default=None,
                   metavar="REL", help="pass bound on the largest relative loss difference "
                                       "from the single device, instead of the measured one")
    p.add_argument("--trace-divergence", action="store_true",
                   help="for each strategy, also find where it parts ways with the single "
                        "device (a strategy that misses the bound is traced anyway, after "
                        "the run): the first step whose loss leaves the bound (--tolerance, "
                        "else fp32 rounding of the batch's sum), the parameters that differ "
                        "most entering it, and the block whose computation differs (a "
                        "bisection over models cut to their first blocks); one process")
