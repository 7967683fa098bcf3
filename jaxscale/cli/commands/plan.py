"""`jaxscale plan`: search dp x tp x pp(v) x cp x ZeRO x recompute x micro-batch, rank by
predicted step time.

    jaxscale plan --params 70e9 --devices 64 --device h100
    jaxscale plan --model 7b --devices 8 --device a100 --batch 64 --json
    jaxscale plan --params 175e9 --devices 64 --batch 64 --seq 2048 --fix dp=1

The rules are jaxscale.costmodel.planner's (its docstring and RULES); memory and time are
jaxscale.costmodel's (layout.memory, steptime.step_time); the device table is
costmodel.devices.
"""
from __future__ import annotations

from dataclasses import replace

from jaxscale import costmodel as cm
from jaxscale.costmodel import planner as P
from jaxscale.costmodel import references as R
from jaxscale.costmodel.schedule import ZERO_BUBBLE
from jaxscale.cli.calculator_args import (add_shape_options, arg_type, bytes_arg, count_arg,
    describe_shape, emit, link_arg, model_shape, size_arg, table, transformer)
from jaxscale.costmodel import devices as D
from jaxscale.costmodel import states as S
from jaxscale.costmodel.units import human_bytes, short_bytes
from jaxscale.cli.main import COMMANDS
from jaxscale.cli.commands import plan_verify


def _fixed(text: str) -> tuple[tuple[str, int], ...]:
    """'dp=1,cp=1' -> (('dp', 1), ('cp', 1)); a bad item names itself and the choices."""
    out = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, _, value = item.partition("=")
        if name not in P.FIXABLE or not value.strip().isdigit():
            raise cm.CostModelError(f"--fix {item!r} is not understood: write NAME=N with NAME "
                                    f"one of {', '.join(P.FIXABLE)}, e.g. dp=1,cp=1")
        out.append((name, int(value)))
    return tuple(out)


def _choices(allowed: tuple):
    """'none,full' -> ('none', 'full'), each checked against `allowed` (compared as text)."""
    by_name = {str(a): a for a in allowed}

    def parse(text: str) -> tuple:
        names = [x.strip() for x in text.split(",") if x.strip()]
        if not names or any(x not in by_name for x in names):
            raise cm.CostModelError(f"{text!r}: choose a comma list from {', '.join(by_name)}")
        return tuple(by_name[x] for x in names)
    return parse


def register(subparsers) -> None:
    from jaxscale.cli.main import _number

    p = subparsers.add_parser("plan", help=COMMANDS["plan"], description=(
        "Search every layout devices = dp x tp x pp x cp with v chunks per pipeline device, "
        "ZeRO 0-3, recompute none/selective/full and micro-batches 1/2/4/8; keep those that "
        "fit; rank by predicted step time. Rules: " + "; ".join(
            f"({i}) {r}" for i, r in enumerate(P.RULES, 1)) + ". Memory: states under the byte "
        "budget and ZeRO, ZeRO-3's gathered layer, first-stage activations (Korthikanti et "
        "al.). Time: FLOPs at --efficiency x the device's peak, the bubble (p-1)/(v m) over "
        "ideal time, tp on the critical path, the dp reduction hidden behind backward where "
        "it can be, links from the device table (tp, cp, pp, dp placed from the inside). "
        "Without a shape, the published model nearest in parameter count is assumed (and "
        "printed). Exit code 1 if nothing fits."))
    p.add_argument("--params", type=count_arg, default=None, metavar="N",
                   help="parameter count, e.g. 70e9 or 70B (default: from --model or the shape)")
    p.add_argument("--devices", type=size_arg(), default=None, metavar="K",
                   help="devices in all (required, unless --target gives them)")
    p.add_argument("--device", type=str.lower, choices=list(D.DEVICES), default=None,
                   help="the accelerator: peak FLOP/s, memory, links (default a100, or "
                        "--target's chip)")
    p.add_argument("--device-memory", type=bytes_arg, default=None, metavar="SIZE",
                   help="memory per device, e.g. 80GB or 80GiB (default: the device's)")
    p.add_argument("--node-size", type=size_arg(), default=None, metavar="N",
                   help="devices per node, joined by the intra link (default: the device's)")
    p.add_argument("--intra-link", type=link_arg, default=None, metavar="LINK",
                   help="link inside a node, a name or GB/s one way (default: the device's)")
    p.add_argument("--inter-link", type=link_arg, default=None, metavar="LINK",
                   help="link between nodes (default: the device's)")
    add_shape_options(p, "global batch in sequences per step", 4096, 256)
    p.add_argument("--flash-attention", action="store_true",
                   help="activations without the attention maps")
    p.add_argument("--no-dropout", action="store_true", help="activations without dropout masks")
    p.add_argument("--bytes-per-param", choices=list(S.BUDGETS), default="mixed-adam",
                   help="model-state byte budget (default mixed-adam, 16 bytes)")
    p.add_argument("--usable", type=_number(float, 0, exclusive=True), default=0.9, metavar="F",
                   help="fraction of device memory a layout may fill; the rest is for "
                        "embeddings, buffers and fragmentation (default 0.9)")
    p.add_argument("--efficiency", type=_number(float, 0, exclusive=True), default=0.7,
                   metavar="F", help="fraction of the peak the matmuls reach (default 0.7)")
    p.add_argument("--max-bubble", type=_number(float, 0), default=None, metavar="F",
                   help="cap on the bubble (p-1)/(v m) (default: none; the time ranks it)")
    p.add_argument("--fix", type=_fixed_arg, default=(), metavar="NAME=N,...",
                   help=f"hold degrees fixed, e.g. dp=1,cp=1 ({', '.join(P.FIXABLE)})")
    p.add_argument("--recompute-choices", type=arg_type(_choices(P.RECOMPUTE)), default=P.RECOMPUTE,
                   metavar="LIST", help="recompute policies to try (default none,selective,full)")
    p.add_argument("--zero-choices", type=arg_type(_choices((0, 1, 2, 3))), default=(0, 1, 2, 3),
                   metavar="LIST", help="ZeRO stages to try (default 0,1,2,3)")
    p.add_argument("--schedules", type=arg_type(_choices(("1f1b", *ZERO_BUBBLE))),
                   default=("1f1b",), metavar="LIST",
                   help="pipeline schedules to try (default 1f1b; add zb-h1,zb-h2,zbv, the "
                        "zero-bubble schedules: a third of 1F1B's bubble, zbv a sixth with "
                        "two chunks per device); interleaved 1F1B is tried for v > 1 either way")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="never use sequence parallelism (a 2021 Megatron had none)")
    p.add_argument("--top", type=size_arg(minimum=0), default=5, metavar="N",
                   help="how many alternatives to list (default 5)")
    p.add_argument("--verify", type=size_arg(), default=None, metavar="N",
                   help="compile the top N layouts for --target with XLA:TPU (from this "
                        "machine: pip install -e \".[tpu]\") and rank them again by what "
                        "the compiler says fits; needs --model")
    p.add_argument("--target", default=None, metavar="NAME",
                   help="the Cloud TPU slice for --verify (v5e-256, v5p-512, v6e-64, or a "
                        "topology v5p:4x8x8): --devices and --device default to it")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.set_defaults(run=run)


_fixed_arg = arg_type(_fixed)


def compute(args) -> dict:
    """The plan as one JSON-ready dict, with the shape it assumed."""
    if args.usable > 1 or args.efficiency > 1:
        bad = "--usable" if args.usable > 1 else "--efficiency"
        raise cm.CostModelError(f"{bad} {max(args.usable, args.efficiency):g} is a fraction: "
                                "choose a number in (0, 1]")
    if args.max_bubble is not None and args.max_bubble >= 1:
        raise cm.CostModelError(f"--max-bubble {args.max_bubble:g} is a fraction: choose a "
                                "number in [0, 1)")
    dev = D.device(args.device)
    dev = replace(dev, **{k: v for k, v in (
        ("memory", args.device_memory), ("node_size", args.node_size),
        ("intra", args.intra_link and args.intra_link[1]),
        ("inter", args.inter_link and args.inter_link[1])) if v is not None})
    if args.devices > dev.node_size and args.devices % dev.node_size:
        raise cm.CostModelError(f"--devices {args.devices} does not fill whole nodes of "
                                f"{dev.node_size} (--node-size): use a multiple of {dev.node_size}")
    shape = model_shape(args, 4096, without_shape=("seq",))
    if shape is None:
        if args.params is None:
            raise cm.CostModelError("give --params (e.g. 70e9), or --model PRESET, or the "
                                    "shape (--layers --hidden --heads)")
        name, ref = R.nearest_reference(args.params)
        t = replace(ref, seq=args.seq or ref.seq)
        source = (f"assumed: {R.describe_reference(name)}, the published shape nearest to "
                  f"{args.params:.3g} parameters")
    else:
        t = transformer(shape)
        source = describe_shape(shape, shape["params"], shape["source"])
    job = P.Job(t, args.batch, args.devices, dev, usable=args.usable,
                efficiency=args.efficiency, budget=args.bytes_per_param,
                flash_attention=args.flash_attention, dropout=not args.no_dropout,
                max_bubble=args.max_bubble, fixed=args.fix,
                recompute=args.recompute_choices, zero_stages=args.zero_choices,
                sequence_parallel=not args.no_sequence_parallel, schedules=args.schedules)
    out = P.plan(job, args.top)
    out["shape_source"] = source
    out["roofline"] = {  # the scaling book's critical batch sizes for this device
        "tokens_per_device": args.batch * t.seq / args.devices,
        "matmul_critical_tokens": D.matmul_critical_batch(dev),
        "dp_critical_tokens_intra": D.comm_critical_batch(
            dev, dev.intra * (2 if dev.bidirectional else 1)),
        "dp_critical_tokens_inter": D.comm_critical_batch(dev, dev.inter)}
    if args.params is not None and abs(args.params / t.params() - 1) > 0.02:
        out["params_note"] = (f"--params {args.params:.4g} differs from the shape's "
                              f"{t.params():.4g}: memory and time use the shape's count")
    elif args.params is not None:
        out["params_note"] = "memory and time use the shape's count"
    return out


COLUMNS = ["layout", "m", "bubble", "states", "activations", "memory", "of device", "sent",
           "compute s", "bubble s", "tp s", "pp s", "cp s", "dp s", "step s", "tokens/s", "MFU"]


def columns(experts: bool) -> list[str]:
    """The table's columns; a mixture of experts' adds ep's all-to-all seconds."""
    return COLUMNS[:14] + ["ep s"] * experts + COLUMNS[14:]


def _row(r: dict, experts: bool = False) -> list:
    m, t = r["memory"], r["time"]
    parts = ("compute", "bubble", "tp", "pp", "cp", "dp") + ("ep",) * experts + ("step",)
    return [r["name"], r["micro_batches"], f"{100 * t['bubble_over_ideal']:.1f}%",
            short_bytes(m["states"]), short_bytes(m["activations"]), short_bytes(m["total"]),
            f"{100 * r['of_device']:.0f}%", short_bytes(t["bytes_sent_total"])] + [
                f"{t[k]:.3g}" for k in parts] + [
            f"{t['tokens_per_s']:,.0f}", f"{100 * t['mfu']:.1f}%"]


def render(r: dict) -> None:
    from jaxscale.report import plural, say

    j, dev = r["job"], r["job"]["device"]
    s = j["shape"]
    experts = bool(s.get("experts"))
    active = (f", {s['active_params']:.4g} of them used per token (top {s['top_k']} of "
              f"{s['experts']} experts)" if experts else "")
    say(f"plan: {s['params']:.4g} parameters counted by the cost model (matmul weights and "
        f"embeddings{active}; {r['shape_source']}); batch "
        f"{plural(j['batch'], 'sequence')} x {plural(s['seq'], 'token')}; "
        f"{plural(j['devices'], 'device')} {dev['name']} ({dev['peak'] / 1e12:g} TFLOP/s "
        f"bf16 x efficiency {j['efficiency']:g}, {human_bytes(dev['memory'])}, "
        f"{100 * j['usable']:.0f}% usable) in nodes of {dev['node_size']}; links "
        f"{dev['intra'] / 1e9:g} GB/s inside a node, {dev['inter'] / 1e9:g} GB/s between, "
        f"one way; budget {j['budget']}")
    if r.get("params_note"):
        say(f"note: {r['params_note']}", "  ")
    rl = r["roofline"]
    say(f"roofline: {rl['tokens_per_device']:,.0f} tokens per device per step; a bf16 "
        f"matmul is compute-bound above {rl['matmul_critical_tokens']:,.0f} tokens (peak / "
        f"HBM bandwidth); data parallelism hides its reduction behind compute above "
        f"{rl['dp_critical_tokens_intra']:,.0f} tokens per device inside a node, "
        f"{rl['dp_critical_tokens_inter']:,.0f} across nodes (peak / link bandwidth)", "  ")
    for i, rule in enumerate(r["rules"], 1):
        say(f"rule {i}: {rule}", "  ")
    best = r["recommended"]
    if best:
        table("recommended (memory and bytes sent per device per step, GB = 1e9; seconds "
              "per step)", columns(experts),
              [_row(best, experts)])
    else:
        print("no layout fits: see the reasons below")
    if r["alternatives"]:
        n = len(r["alternatives"])
        table(f"the next {plural(n, 'layout')} of the {r['fitting']:,} that fit",
              columns(experts), [_row(x, experts) for x in r["alternatives"]])
    say(f"{plural(r['considered'], 'mesh', 'meshes')} (dp x tp x pp x cp) considered, "
        f"{sum(r['rejected'].values()):,} rejected (no option on them survives)")
    if r["rejected"]:
        table("rejected meshes by the last rule their options broke", ["reason", "meshes"],
              sorted(([k, v] for k, v in r["rejected"].items()), key=lambda kv: -kv[1]))
    miss = r["closest_memory_miss"]
    if miss:
        table("closest to fitting among those rejected for memory", columns(experts),
              [_row(miss, experts)])


def run(args) -> int:
    target = plan_verify.checked_target(args)  # --devices and --device from the target
    if args.devices is None:
        raise cm.CostModelError("give --devices K (the devices in all), or --target NAME "
                                "with --verify N")
    args.device = args.device or "a100"
    out = compute(args)
    if target is not None:
        out["verified"] = plan_verify.verify(args, out, target)
    emit(args, out, lambda r: (render(r), r.get("verified") and plan_verify.render(r["verified"])))
    return 0 if out["recommended"] else 1
