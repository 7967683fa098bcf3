"""`compare`'s options for what each strategy is judged by: the number formats every
strategy runs in (so each is judged against its own single-device run), the bound, and
the trace of where a strategy parts ways with the single device."""
from __future__ import annotations

from jaxscale.cli.main import _number
from jaxscale.model.precision import POLICIES


def add_arguments(p) -> None:
    p.add_argument("--precision", default=None, choices=list(POLICIES), metavar="POLICY",
                   help="the number formats of every strategy, the single device and the "
                        f"control included ({', '.join(POLICIES)}; default fp32); a layout's "
                        "own precision= key stays")
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
