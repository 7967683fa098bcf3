"""`jaxscale explain`: where every tensor of a layout's training state lives.

    jaxscale explain --strategy dp=2,tp=2,pp=2,zero=3,micro_batches=2 --model tiny8
    jaxscale explain --strategy dp=8,zero=1 --strategy dp=2,tp=4 --json

Builds the plan's state for real on forced host-CPU devices (jaxscale.compare.explain) and
prints, per tensor, its logical axes, its PartitionSpec, one device's piece, its dtype and
bytes, and how many devices hold the same piece; then the per-device totals (their sum over
parameters, master weights and optimizer slots is the model state `compare` measures). With
two plans it prints only the tensors whose placement or bytes differ.
"""
from __future__ import annotations

import json

from jaxscale.cli.main import _number
from jaxscale.report import print_table

KINDS = ("parameter", "master weight", "optimizer slot", "counter")


def register(subparsers) -> None:
    from jaxscale.cli.model_arg import FILE_HELP, model_arg
    from jaxscale.parallel.plan import LAYOUT_KEYS
    p = subparsers.add_parser(
        "explain", help="where every tensor of a layout's state lives: spec, piece, copies",
        description=(
            "Build a layout's training state (on forced host-CPU devices) and show, for "
            "every parameter, master weight, optimizer slot and counter: its logical axes, "
            "its PartitionSpec on the mesh, one device's piece (shape, dtype, bytes) and how "
            "many devices hold the same piece; then the bytes per device by kind, whose "
            "sum is the model state `jaxscale compare` measures. Give --strategy twice to "
            "see only what differs between two layouts."))
    p.add_argument("--strategy", action="append", required=True, metavar="LAYOUT",
                   help="a layout written out, e.g. dp=2,tp=2,pp=2,zero=3,micro_batches=2 "
                        f"(keys: {', '.join(LAYOUT_KEYS)}); once, or twice to compare two")
    p.add_argument("--model", default="tiny", type=model_arg, metavar="PRESET",
                   help=f"model preset (one that trains on CPU); {FILE_HELP} (default tiny)")
    p.add_argument("--devices", type=_number(), default=8, metavar="N",
                   help="forced host-CPU devices (default 8)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every row")
    p.set_defaults(run=run)


def run(args) -> int:
    from jaxscale.compare.strategies import CompareError, check_strategies
    from jaxscale.model import config as model_config
    from jaxscale.runtime import devices as devlib
    if len(args.strategy) > 2:
        raise CompareError(f"--strategy given {len(args.strategy)} times; give one layout to "
                           "explain, or two to compare")
    model_config.check_platform(args.model, "cpu")
    cfg = model_config.preset(args.model)
    devlib.check_cpu_count(args.devices)
    checked = check_strategies([], args.devices, cfg, tuple(args.strategy))  # before JAX
    plans = [checked[s] for s in args.strategy]
    devices = devlib.force_cpu_devices(args.devices)
    from jaxscale.compare import explain
    params = explain.whole_params(cfg)
    runs = [{"strategy": s, "plan": p.as_dict(), "rows": (rows := explain.tensors(
        cfg, p, params, devices)), "totals": explain.totals(rows)}
        for s, p in zip(args.strategy, plans)]
    diff = explain.differences(runs[0]["rows"], runs[1]["rows"]) if len(runs) == 2 else None
    if args.json:
        print(json.dumps({"model": args.model, "devices": args.devices, "plans": runs,
                          "differences": diff}))
        return 0
    if diff is None:
        _show(runs[0])
    else:
        _show_differences(runs, diff)
    for r in runs:
        for row in r["rows"]:
            if row["flag"]:
                print(f"warning: {r['strategy']}: {row['name']} ({row['kind']}): {row['flag']}")
        t = r["totals"]
        print(f"{r['strategy']}: per device " + ", ".join(
            f"{k}s {t[k]:,} B" for k in KINDS) + f"; model state {t['model_state']:,} B "
            "(parameters + master weights + optimizer slots)")
    return 0


def _piece(r) -> str:
    return "x".join(map(str, r["per_device_shape"])) or "scalar"


def _axes(r) -> str:
    a = r["logical_axes"]
    return "-" if a is None else a if isinstance(a, str) else ",".join(a)


def _show(run: dict) -> None:
    rows = sorted(run["rows"], key=lambda r: (KINDS.index(r["kind"]), r["slot"] or "",
                                              r["name"]))
    print_table(f"{run['strategy']}: every tensor of the training state, on each device",
                ["tensor", "kind", "logical axes", "spec", "piece", "dtype", "bytes",
                 "copies"],
                [[r["name"], r["kind"] + (f" {r['slot']}" if r["slot"] else ""), _axes(r),
                  r["spec"], _piece(r), r["dtype"], f"{r['bytes_per_device']:,}",
                  f"{r['replicas']} of {r['devices']}"] for r in rows])


def _show_differences(runs, diff) -> None:
    a, b = (r["strategy"] for r in runs)

    def cell(r):
        return "absent" if r is None else (f"{r['spec']} {_piece(r)} {r['dtype']} "
                                           f"{r['bytes_per_device']:,} B x{r['replicas']}")
    print_table(f"the {len(diff)} tensors placed differently (spec, piece, dtype, bytes per "
                "device, copies)", ["tensor", "kind", a, b],
                [[d["name"], d["kind"] + (f" {d['slot']}" if d["slot"] else ""), cell(d["a"]),
                  cell(d["b"])] for d in diff])
