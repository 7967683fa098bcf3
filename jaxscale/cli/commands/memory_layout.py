"""`jaxscale memory`'s layout section: one device of a tp x pp x cp x dp layout.

    jaxscale memory --model 7b --tp 8 --sequence-parallel --pp 4 --recompute selective
    jaxscale memory --params 7.5e9 --devices 64 --max-model --device-memory 32GB

What `memory.py` prints first are the lectures' tables (ZeRO stages, Korthikanti on one
device, LoRA); this section adds the parallel layout: Korthikanti et al.'s equations 1-6 for
the shape at the given tp, the first stage's activations under the schedule, model states
under a byte budget with ZeRO-3's gathered layer and optimizer offload, the largest model
that fits (--max-model), and DeepSpeed's own estimator (--deepspeed). The formulas are in
jaxscale.costmodel (activations, states, layout); nothing here computes a figure itself.
"""
from __future__ import annotations

from jaxscale import costmodel as cm
from jaxscale.cli.calculator_args import STAGE_NAMES, bytes_arg, size_arg, table
from jaxscale.costmodel import activations as A
from jaxscale.costmodel import states as S
from jaxscale.costmodel import units
from jaxscale.report import plural


def add_options(p) -> None:
    g = p.add_argument_group("layout (tensor, sequence, pipeline, context parallelism)")
    g.add_argument("--tp", type=size_arg(), default=1, metavar="T", help="tensor-parallel degree")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split the LayerNorm/dropout regions over the tp group too "
                        "(needs --tp >= 2)")
    g.add_argument("--pp", type=size_arg(), default=1, metavar="P", help="pipeline stages")
    g.add_argument("--virtual", type=size_arg(), default=1, metavar="V",
                   help="model chunks per pipeline device: interleaved 1F1B when > 1")
    g.add_argument("--micro-batches", type=size_arg(), default=None, metavar="M",
                   help="micro-batches per step in the pipeline (default: pp, the most 1F1B "
                        "keeps in flight)")
    g.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b",
                   help="pipeline schedule (GPipe keeps all m micro-batches in flight)")
    g.add_argument("--cp", type=size_arg(), default=1, metavar="C",
                   help="context-parallel degree: each device keeps s / cp tokens")
    g.add_argument("--no-dropout", action="store_true",
                   help="no dropout masks (34 -> 32 bytes, attention maps 5 -> 2; today's LLMs)")
    g = p.add_argument_group("model states")
    g.add_argument("--bytes-per-param", choices=list(S.BUDGETS), default="mixed-adam",
                   help="byte budget: " + "; ".join(f"{k} {sum(v)} ({' + '.join(map(str, v))})"
                                                   for k, v in S.BUDGETS.items()))
    g.add_argument("--offload", choices=S.OFFLOAD, default="none",
                   help="'optimizer': the optimizer state lives in CPU memory (ZeRO-Offload)")
    g.add_argument("--max-model", action="store_true",
                   help="the largest parameter count whose states fit --device-memory")
    g.add_argument("--device-memory", type=bytes_arg, default=None, metavar="SIZE",
                   help="memory per device, e.g. 80GB or 80GiB (for --max-model and 'fits')")
    g.add_argument("--deepspeed", action="store_true",
                   help="also DeepSpeed's estimator (ZeRO-2/3, with and without offload), "
                        "over --devices GPUs in nodes of --node-size")
    g.add_argument("--node-size", type=size_arg(), default=8, metavar="N",
                   help="GPUs per node for --deepspeed (default 8)")


def check(args) -> None:
    if args.sequence_parallel and args.tp < 2:
        raise cm.CostModelError("--sequence-parallel splits the tp group: give --tp 2 or more")
    if args.virtual > 1 and args.schedule == "gpipe":
        raise cm.CostModelError("--virtual > 1 is interleaved 1F1B: drop --schedule gpipe")
    if args.virtual > 1 and args.pp < 2:
        raise cm.CostModelError(f"--virtual {args.virtual} needs a pipeline: give --pp 2 or more")
    if args.max_model and args.device_memory is None:
        raise cm.CostModelError("--max-model needs --device-memory, e.g. 80GB")


def compute(args, shape, params: float) -> dict:
    """The layout section as a JSON-ready dict (shape: a costmodel Transformer or None)."""
    check(args)
    tp, pp, cp, dp = args.tp, args.pp, args.cp, args.devices
    m = args.micro_batches or pp
    schedule = "interleaved" if args.virtual > 1 else args.schedule
    if pp > 1:  # the sizes `schedule` and `plan` accept, by the same rule
        from jaxscale.parallel.schedules import check_sizes
        check_sizes(schedule, pp, m, args.virtual)
    recompute = args.recompute
    out = {"degrees": {"dp": dp, "tp": tp, "pp": pp, "virtual": args.virtual, "cp": cp,
                       "sequence_parallel": args.sequence_parallel, "micro_batches": m,
                       "micro_batch": args.batch, "schedule": schedule},
           "budget": args.bytes_per_param, "offload": args.offload, "recompute": recompute}
    largest = shape.layer_params() / tp if shape is not None else 0.0
    states = [{"stage": z, "name": STAGE_NAMES[z],
               **S.state_memory(params, dp, z, args.bytes_per_param, args.offload, tp * pp,
                                largest)} for z in range(4)]
    out["states"] = states
    acts = None
    if shape is not None:
        if shape.layers % (pp * args.virtual):
            raise cm.CostModelError(f"--pp {pp} x --virtual {args.virtual} does not divide the "
                                    f"{shape.layers} layers")
        if shape.heads % tp or shape.kv % tp:
            kv = f" ({shape.kv} kv heads)" if shape.kv != shape.heads else ""
            raise cm.CostModelError(f"--tp {tp} does not divide the {shape.heads} heads{kv}")
        if shape.seq % cp:
            raise cm.CostModelError(f"--cp {cp} does not divide the sequence length {shape.seq}")
        kw = dict(micro_batch=args.batch, flash_attention=args.flash_attention,
                  dropout=not args.no_dropout)  # the paper's per-layer figures: no cp
        active = shape.active()  # a mixture of experts' activations: its top_k experts'
        one = lambda **o: A.per_layer(active, tp=o.pop("tp", tp), **kw, **o)["total"]  # noqa: E731
        out["korthikanti"] = {  # the paper's Table 2 rows, per layer, at this tp
            "eq1_no_parallelism": one(tp=1),
            "eq2_tensor_parallel": one(),
            "eq4_tensor_sequence_parallel": one(sequence_parallel=True) if tp > 1 else None,
            "tp_selective_recompute": one(recompute="selective"),
            "tp_sp_selective_recompute": (one(sequence_parallel=True, recompute="selective")
                                          if tp > 1 else None),
            "full_recompute": one(recompute="full"),
        }
        acts = A.activation_memory(active, args.batch, tp, args.sequence_parallel, cp, pp, m,
                                   schedule, args.virtual, recompute, args.flash_attention,
                                   not args.no_dropout)
        out["activations"] = acts
    act_bytes = acts["total"] if acts else 0.0
    out["per_device"] = [{"stage": x["stage"], "name": x["name"], "states": x["total"],
                          "activations": act_bytes, "total": x["total"] + act_bytes,
                          "cpu": x["cpu"]} for x in states]
    if args.device_memory is not None:
        for row in out["per_device"]:
            row["fits"] = row["total"] <= args.device_memory
    if args.max_model:
        out["max_model"] = [{"stage": z, "name": STAGE_NAMES[z], "params": S.max_params(
            args.device_memory, dp, z, args.bytes_per_param, args.offload, tp * pp)}
            for z in range(4)]
    if args.deepspeed:
        if dp > args.node_size and dp % args.node_size:
            raise cm.CostModelError(f"--devices {dp} does not fill whole nodes of --node-size "
                                    f"{args.node_size}")
        per_node, nodes = min(dp, args.node_size), max(1, dp // args.node_size)
        layer = shape.layer_params() if shape is not None else 0.0
        out["deepspeed"] = {"largest_layer_params": layer, "gpus_per_node": per_node,
                            "nodes": nodes, "rows": [
            {"stage": z, "offload": o,
             **S.deepspeed_estimate(params, layer, per_node, nodes, z, o)}
            for z, offloads in ((2, ("none", "optimizer")), (3, ("none", "optimizer", "params")))
            for o in offloads]}
    return out


def render(r: dict) -> None:
    hb = units.human_bytes
    d = r["degrees"]
    chunks = f" (v {d['virtual']})" if d["virtual"] > 1 else ""
    where = (f"dp {d['dp']} x tp {d['tp']}{' + sp' if d['sequence_parallel'] else ''} x pp "
             f"{d['pp']}{chunks} x cp "
             f"{d['cp']}; {plural(d['micro_batches'], 'micro-batch', 'micro-batches')} of "
             f"{d['micro_batch']}, "
             f"{d['schedule']}; recompute {r['recompute']}")
    k = r.get("korthikanti")
    if k:
        table(f"Korthikanti et al. per layer per device at tp = {d['tp']} (16-bit, one "
              "micro-batch)", ["equation", "bytes"],
              [[name.replace("_", " "), hb(v)] for name, v in k.items() if v is not None])
        a = r["activations"]
        table(f"activations on the first stage: {where}", ["", "bytes"],
              [["one layer", hb(a["per_layer"]["total"])],
               [f"x {plural(a['layers_on_stage'], 'layer')} x "
                f"{plural(a['in_flight'], 'micro-batch', 'micro-batches')} "
                "in flight", hb(a["stored"])],
               ["+ the layer being recomputed", hb(a["working_layer"])],
               ["total", hb(a["total"])]])
    cols = ["", "parameters", "gradients", "optimizer", "gathered layer", "device total",
            "with activations"] + (["CPU (offload)"] if r["offload"] != "none" else [])
    rows = []
    for s, p in zip(r["states"], r["per_device"]):
        rows.append([s["name"], hb(s["params"]), hb(s["grads"]), hb(s["optimizer"]),
                     hb(s["gathered_layer"]), hb(s["total"]),
                     hb(p["total"]) + ("" if "fits" not in p else
                                       " fits" if p["fits"] else " DOES NOT FIT")]
                    + ([hb(s["cpu"])] if r["offload"] != "none" else []))
    table(f"model states per device, budget {r['budget']}, offload {r['offload']}; {where}",
          cols, rows)
    if "max_model" in r:
        table("the largest model whose states fit the device (activations left out, as in "
              "the ZeRO paper's Table 2)", ["", "parameters"],
              [[x["name"], f"{x['params'] / 1e9:,.4g}B"] for x in r["max_model"]])
    if "deepspeed" in r:
        ds = r["deepspeed"]
        table(f"DeepSpeed's estimator (its formulas; {ds['nodes']} node(s) of "
              f"{ds['gpus_per_node']} GPUs)", ["ZeRO", "offload", "GPU per device", "CPU per node"],
              [[x["stage"], x["offload"], hb(x["gpu_per_device"]), hb(x["cpu_per_node"])]
               for x in ds["rows"]])
