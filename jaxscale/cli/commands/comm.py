"""`jaxscale comm`: bytes each device sends per training step, and how long that takes.

    jaxscale comm --params 7e9 --devices 8 --link ethernet
    jaxscale comm --params 1e9 --devices 8 --link 50          # a link of 50 GB/s
    jaxscale comm --layers 32 --hidden 4096 --seq 2048 --batch 8 --devices 8

The data-parallel gradient all-reduce as a ring, 2(K-1)/K x n per device, next to a
parameter server (device 0 receives and sends (K-1) x n); with a model shape, what tensor,
pipeline and data parallelism each move per step (jaxscale.costmodel has the formulas).
"""
from __future__ import annotations

from jaxscale import costmodel as cm
from jaxscale.cli.calculator_args import (add_shape_options, count_arg, describe_shape, emit,
    link_arg, model_shape, size_arg, table)
from jaxscale.costmodel.units import human_bytes, short_bytes
from jaxscale.cli.main import COMMANDS


def register(subparsers) -> None:
    p = subparsers.add_parser("comm", help=COMMANDS["comm"],
                              description=(
        "Communication of one training step, from closed forms. Data parallelism: the "
        "gradient all-reduce, 2(K-1)/K x n bytes sent per device in a ring, against a "
        "parameter server whose device 0 receives (K-1) x n and sends (K-1) x n. Time = bytes "
        "/ bandwidth (latency and overlap with compute ignored). With --layers --hidden "
        "(--seq --batch): tensor parallelism's 4 all-reduces of b*s*h activations per layer "
        "per step (Megatron), pipeline parallelism's b*s*h activations and gradients at each "
        "stage boundary, and data parallelism's one gradient all-reduce, each using --tp / "
        "--pp / all K devices. GB = 1e9 bytes."))
    p.add_argument("--params", type=count_arg, default=None, metavar="N",
                   help="parameter count, e.g. 7e9 or 7B (default: estimated from the shape)")
    p.add_argument("--devices", type=size_arg(), default=8, metavar="K",
                   help="devices in the all-reduce (default 8)")
    presets = ", ".join(f"{k} ({v / 1e9:g} GB/s)" for k, v in cm.LINKS.items())
    p.add_argument("--link", type=link_arg, default=cm.link_bandwidth("infiniband"),
                   metavar="LINK", help=f"{presets}, or a bandwidth in GB/s per device and "
                                        "direction (default infiniband)")
    p.add_argument("--grad-bytes", type=size_arg(), default=2, metavar="B",
                   help="bytes per gradient value: 2 for bf16/fp16, 4 for fp32 (default 2)")
    p.add_argument("--act-bytes", type=size_arg(), default=None, metavar="B",
                   help="bytes per activation value, for the TP and PP rows (default 2, "
                        "16-bit)")
    add_shape_options(p, "sequences per step", 2048, 8)
    p.add_argument("--tp", type=size_arg(), default=None, metavar="T",
                   help="tensor-parallel degree (default K; must divide the heads)")
    p.add_argument("--pp", type=size_arg(), default=None, metavar="P",
                   help="pipeline stages (default K; must divide the layers)")
    p.add_argument("--recompute", action="store_true",
                   help="full recomputation: forward runs twice, 6 TP all-reduces per layer")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.set_defaults(run=run)


def _divisors(n: int, shown: int = 16) -> str:
    from jaxscale.costmodel.planner import divisors

    ds = divisors(n)
    more = f", ... ({len(ds)} divisors in all)" if len(ds) > shown else ""
    return ", ".join(map(str, ds[:shown])) + more


def compute(args) -> dict:
    """Every figure of the comm command, as one JSON-ready dict."""
    shape = model_shape(args, 2048, require=("layers", "hidden"))
    if args.params is not None:
        params, source = args.params, "given"
    elif shape is not None:
        params, source = shape["params"], shape["params_source"]
    else:
        raise cm.CostModelError("give --params (e.g. 7e9), or the model shape (--layers "
                                "--hidden, or --model PRESET)")
    k, (link, bw) = args.devices, args.link
    links = {**cm.LINKS, link: bw}
    payload = params * args.grad_bytes
    ring = cm.ring_all_reduce_bytes(payload, k)
    ps = cm.parameter_server_bytes(payload, k)
    server = ps["server_sent"] + ps["server_received"]
    out = {"params": params, "params_source": source, "devices": k,
           "model": describe_shape(shape, params, source),
           "grad_bytes": args.grad_bytes, "link": link, "link_bytes_per_s": bw,
           "dp": {"payload_bytes": payload, "ring_bytes_per_device": ring,
                  "ring_seconds": ring / bw, **ps, "server_total": server,
                  "server_seconds": server / bw},
           "per_link": [{"link": n, "bytes_per_s": b, "ring_seconds": ring / b,
                         "server_seconds": server / b} for n, b in links.items()],
           "strategies": None}
    if shape is None:
        given = [o for o, v in (("--tp", args.tp), ("--pp", args.pp),
                                ("--act-bytes", args.act_bytes),
                                ("--recompute", args.recompute)) if v]
        if given:  # they shape the TP and PP rows, which need the model's shape
            raise cm.CostModelError(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} the model's shape (--layers "
                                    "--hidden, or --model PRESET): with --params alone comm "
                                    "counts data parallelism's gradient all-reduce only")
        return out
    tp, pp = args.tp or k, args.pp or k
    args.act_bytes = args.act_bytes or 2
    L, h, s, b = shape["layers"], shape["hidden"], shape["seq"], args.batch
    split = shape["heads"] or h
    default = f" (the default: --devices {k})"
    if split % tp:
        what = "heads" if shape["heads"] else "hidden size"
        raise cm.CostModelError(f"--tp {tp}{'' if args.tp else default} does not divide the "
                                f"{what} {split}: choose --tp from {_divisors(split)}")
    if L % pp:
        raise cm.CostModelError(f"--pp {pp}{'' if args.pp else default} does not divide the "
                                f"{L} layers: choose --pp from {_divisors(L)}")
    t = cm.tp_step_volume(L, s, b, h, tp, args.act_bytes, args.recompute)
    p_ = cm.pp_step_volume(s, b, h, pp, args.act_bytes)
    rows = [
        {"strategy": "TP", "degree": tp, "what": "all-reduce of b*s*h activations",
         "one_bytes": t["allreduce_bytes"], "count_per_step": t["allreduces_per_step"],
         "payload_per_step": t["payload_bytes_per_step"],
         "sent_per_device": t["ring_bytes_per_device"]},
        {"strategy": "PP", "degree": pp,
         "what": "activations + gradients at a stage boundary",
         "one_bytes": p_["boundary_bytes_per_step"], "count_per_step": p_["boundaries"],
         "payload_per_step": p_["total_bytes_per_step"],
         "sent_per_device": p_["max_bytes_per_device"]},
        {"strategy": "DP", "degree": k, "what": "all-reduce of the gradients",
         "one_bytes": payload, "count_per_step": 1, "payload_per_step": payload,
         "sent_per_device": ring}]
    for r in rows:
        r["seconds"] = {n: r["sent_per_device"] / b for n, b in links.items()}
    out["strategies"] = {"layers": L, "hidden": h, "seq": s, "batch": b, "heads": shape["heads"],
                         "act_bytes": args.act_bytes, "recompute": args.recompute, "rows": rows}
    return out


def _t(seconds: float) -> str:
    return f"{seconds * 1e3:,.3g} ms" if seconds < 1 else f"{seconds:,.3g} s"


def render(r: dict) -> None:
    from jaxscale.report import plural

    hb, d = human_bytes, r["dp"]
    table(f"data-parallel gradient all-reduce: {r['model']}; x {r['grad_bytes']} bytes per "
          f"gradient, K = {plural(r['devices'], 'device')}, on {r['link']}",
          ["", "bytes", f"time on {r['link']}"],
          [["gradients (payload n)", hb(d["payload_bytes"]), ""],
           ["ring: sent per device, 2(K-1)/K n", hb(d["ring_bytes_per_device"]),
            _t(d["ring_seconds"])],
           ["parameter server: device 0 receives", hb(d["server_received"]), ""],
           ["parameter server: device 0 sends", hb(d["server_sent"]), ""],
           ["parameter server: device 0 in total", hb(d["server_total"]), _t(d["server_seconds"])]])
    table("the same all-reduce on each link", ["link", "GB/s", "ring", "parameter server"],
          [[x["link"], f"{x['bytes_per_s'] / 1e9:g}", _t(x["ring_seconds"]),
            _t(x["server_seconds"])] for x in r["per_link"]])
    st = r["strategies"]
    if st:
        names = list(st["rows"][0]["seconds"])
        table(f"one step of {plural(st['batch'], 'sequence')} x {plural(st['seq'], 'token')}, "
              f"{plural(st['layers'], 'layer')}, h = {st['hidden']}, "
              f"{st['act_bytes']}-byte activations"
              f"{', recomputation' if st['recompute'] else ''} (GB = 1e9 bytes)",
              ["strategy", "degree", "each", "per step", "payload per step", "sent per device",
               *[f"time, {n}" for n in names]],
              [[x["strategy"], x["degree"], short_bytes(x["one_bytes"]), f"{x['count_per_step']:,}",
                short_bytes(x["payload_per_step"]), short_bytes(x["sent_per_device"]),
                *[_t(x["seconds"][n]) for n in names]] for x in st["rows"]])


def run(args) -> int:
    return emit(args, compute(args), render)
