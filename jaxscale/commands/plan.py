"""`jaxscale plan`: pick a dp x tp x pp x ZeRO layout that fits, from closed forms.

    jaxscale plan --params 70e9 --devices 64 --device-memory 80GB --node-size 8
    jaxscale plan --model 7b --devices 16 --device-memory 40GB --batch 64 --json

The rules (which layouts are allowed, how memory and communication are counted, how the
recommendation is ranked) are jaxscale.planner's, listed in its docstring and in RULES.
"""
from __future__ import annotations

from jaxscale import costmodel as cm
from jaxscale import planner as P
from jaxscale.commands.memory import (
    add_shape_options,
    bytes_arg,
    count_arg,
    describe_shape,
    emit,
    link_arg,
    model_shape,
    short_bytes,
    size_arg,
    table,
)


def register(subparsers) -> None:
    from jaxscale.cli import _number

    p = subparsers.add_parser("plan", help="choose a dp x tp x pp x ZeRO layout that fits "
                              "in memory with the least communication", description=(
        "Enumerate every layout devices = dp x tp x pp with ZeRO stage 0-3 and optional "
        "recomputation, and recommend one. Rules: " + "; ".join(
            f"({i}) {r}" for i, r in enumerate(P.RULES, 1)) + ". Memory per device: the "
        "tp x pp model shard's mixed-precision Adam states sharded by ZeRO over dp, plus "
        "activations (Korthikanti et al. with tp, 1F1B keeps min(m, pp) micro-batches per "
        "stage). Communication per step: TP all-reduces on the intra-node link, PP "
        "activations/gradients and the DP gradient all-reduce (x1.5 for ZeRO-3) on the "
        "inter-node link once they leave a node. Without a shape, the shape of the published "
        "model nearest in parameter count is assumed (and printed). Exit code 1 if nothing "
        "fits."))
    p.add_argument("--params", type=count_arg, default=None, metavar="N",
                   help="parameter count, e.g. 70e9 or 70B (default: from --model or the shape)")
    p.add_argument("--devices", type=size_arg(), required=True, metavar="K", help="devices in all")
    p.add_argument("--device-memory", type=bytes_arg, default=80e9, metavar="SIZE",
                   help="memory per device, e.g. 80GB or 80GiB (default 80GB)")
    p.add_argument("--node-size", type=size_arg(), default=8, metavar="N",
                   help="devices per node, joined by the intra-node link (default 8)")
    add_shape_options(p, "global batch in sequences per step", 4096, 256)
    p.add_argument("--micro-batch", type=size_arg(), default=1, metavar="B",
                   help="sequences per micro-batch (default 1)")
    p.add_argument("--flash-attention", action="store_true",
                   help="activations without the attention maps")
    p.add_argument("--usable", type=_number(float, 0, exclusive=True), default=0.9, metavar="F",
                   help="fraction of device memory a layout may fill; the rest is for "
                        "embeddings, buffers and fragmentation (default 0.9)")
    p.add_argument("--max-bubble", type=_number(float, 0), default=0.1, metavar="F",
                   help="largest pipeline bubble allowed (default 0.1)")
    p.add_argument("--intra-link", type=link_arg, default=cm.link_bandwidth("nvlink"),
                   metavar="LINK", help="link inside a node (default nvlink)")
    p.add_argument("--inter-link", type=link_arg, default=cm.link_bandwidth("infiniband"),
                   metavar="LINK", help="link between nodes (default infiniband)")
    p.add_argument("--grad-bytes", type=size_arg(), default=2, metavar="B",
                   help="bytes per gradient value in the all-reduce (default 2)")
    p.add_argument("--top", type=size_arg(minimum=0), default=5, metavar="N",
                   help="how many alternatives to list (default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.set_defaults(run=run)


def compute(args) -> dict:
    """The plan as one JSON-ready dict, with the shape it assumed."""
    if args.usable > 1:
        raise cm.CostModelError(f"--usable {args.usable:g} is a fraction of device memory: "
                                "choose a number in (0, 1]")
    if args.max_bubble >= 1:
        raise cm.CostModelError(f"--max-bubble {args.max_bubble:g} is a fraction: choose a "
                                "number in [0, 1)")
    if args.devices > args.node_size and args.devices % args.node_size:
        raise cm.CostModelError(f"--devices {args.devices} does not fill whole nodes of "
                                f"--node-size {args.node_size}: use a multiple of {args.node_size}")
    shape = model_shape(args, 4096, without_shape=("seq",))
    if shape is None:
        if args.params is None:
            raise cm.CostModelError("give --params (e.g. 70e9), or --model PRESET, or the "
                                    "shape (--layers --hidden --heads)")
        name, (ref_params, layers, hidden, heads) = P.nearest_reference(args.params)
        shape = {"layers": layers, "hidden": hidden, "heads": heads, "seq": args.seq or 4096,
                 "source": f"assumed: {P.describe_reference(name)}, the published shape "
                           f"nearest to {args.params:.3g} parameters (memory and "
                           "communication use the given count)"}
    params = args.params if args.params is not None else shape["params"]
    w = P.Workload(params=params, layers=shape["layers"], hidden=shape["hidden"],
                   heads=shape["heads"], seq=shape["seq"], batch=args.batch,
                   micro_batch=args.micro_batch, flash_attention=args.flash_attention,
                   grad_bytes=args.grad_bytes)
    c = P.Cluster(devices=args.devices, node_size=args.node_size, memory=args.device_memory,
                  usable=args.usable, intra=args.intra_link[1], inter=args.inter_link[1],
                  max_bubble=args.max_bubble)
    out = P.plan(w, c, args.top)
    out["shape_source"] = (shape["source"] if shape["source"].startswith("assumed")
                           else describe_shape(shape, params, shape["source"]))
    out["links"] = {"intra": args.intra_link[0], "inter": args.inter_link[0]}
    return out


def _row(r: dict, c: dict) -> list:
    m, k = r["memory"], r["comm"]
    return [f"{r['dp']} x {r['tp']} x {r['pp']}", r["zero_stage"],
            "yes" if r["recompute"] else "no",
            r["micro_batches"], f"{100 * r['bubble']:.1f}%",
            short_bytes(m["params"] + m["grads"] + m["optimizer"] + m["zero3_gathered_layer"]),
            short_bytes(m["activations"]), short_bytes(m["total"]),
            f"{100 * r['of_device']:.0f}%",
            f"{k['tp_seconds']:.3g}", f"{k['pp_seconds']:.3g}"
            + (" (x-node)" if k["pp_across_nodes"] and r["pp"] > 1 else ""),
            f"{k['dp_seconds']:.3g}", f"{k['seconds']:.3g}"]


COLUMNS = ["dp x tp x pp", "ZeRO", "recompute", "micro-batches", "bubble", "model states",
           "activations", "memory", "of device", "TP s", "PP s", "DP s", "comm s/step"]


def render(r: dict) -> None:
    from jaxscale.report import plural

    w, c = r["workload"], r["cluster"]
    print(f"plan: {w['params']:.4g} parameters, {plural(w['layers'], 'layer')}, h = "
          f"{w['hidden']}, {plural(w['heads'], 'head')} (shape {r['shape_source']}); batch "
          f"{plural(w['batch'], 'sequence')} x {plural(w['seq'], 'token')}, micro-batch "
          f"{plural(w['micro_batch'], 'sequence')}; {plural(c['devices'], 'device')} in nodes "
          f"of {c['node_size']}, {cm.human_bytes(c['memory'])} each ({100 * c['usable']:.0f}% "
          f"usable); links {r['links']['intra']} inside a node, {r['links']['inter']} between")
    for i, rule in enumerate(r["rules"], 1):
        print(f"  rule {i}: {rule}")
    best = r["recommended"]
    if best:
        table("recommended (memory per device, GB = 1e9; communication seconds per step)",
              COLUMNS, [_row(best, c)])
    else:
        print("no layout fits: see the reasons below")
    if r["alternatives"]:
        n = len(r["alternatives"])
        table(f"the next {plural(n, 'layout')} of the {r['fitting']:,} that fit", COLUMNS,
              [_row(x, c) for x in r["alternatives"]])
    table(f"{plural(r['considered'], 'layout')} considered, "
          f"{sum(r['rejected'].values()):,} rejected",
          ["reason", "layouts"], sorted(([k, v] for k, v in r["rejected"].items()),
                                        key=lambda kv: -kv[1]))
    miss = r["closest_memory_miss"]
    if miss:
        table("closest to fitting among those rejected for memory (ZeRO-3 + recomputation)",
              COLUMNS, [_row(miss, c)])


def run(args) -> int:
    out = compute(args)
    emit(args, out, render)
    return 0 if out["recommended"] else 1
