"""`jaxscale memory`: bytes per device of training a model, from closed forms.

    jaxscale memory --params 7e9 --devices 8
    jaxscale memory --model 7b --devices 8 --batch 1 --flash-attention --recompute
    jaxscale memory --params 6.74e9 --layers 32 --hidden 4096 --heads 32 --seq 4096 --qlora

The layout section (--tp, --pp, --cp, budgets, --max-model) is in memory_layout.py; the
options shared with the other calculators are in calculator_args.py.
"""
from __future__ import annotations

from jaxscale import costmodel as cm
from jaxscale.cli.commands import memory_layout
from jaxscale.cli.calculator_args import (add_shape_options, count_arg, describe_shape, emit, gb,
    model_shape, STAGE_NAMES, resolve_params, size_arg, table, transformer)
from jaxscale.costmodel import units
from jaxscale.cli.main import COMMANDS


def register(subparsers) -> None:
    p = subparsers.add_parser("memory", help=COMMANDS["memory"], description=(
        "Memory per device of training a transformer, from closed forms (jaxscale.costmodel). "
        "Model states: "
        "parameters, gradients and Adam state per device for DDP and ZeRO stages 1-3, "
        "mixed precision (2 + 2 + 12 bytes per parameter: bf16 weights and gradients, fp32 "
        "master weights, m and v) and all-fp32 (4 + 4 + 8). With a model shape: activations "
        "per layer and in total by Korthikanti et al. 2022, s*b*h*(34 + 5*a*s/h) bytes per "
        "layer (34*s*b*h with flash attention), and with per-layer recomputation (each "
        "layer's input, 2*s*b*h, plus one layer). With --lora-rank / --qlora: fine-tuning "
        "with a frozen bf16 (LoRA) or NF4 (QLoRA) base and Adam-trained adapters. Then one "
        "device of a layout (--tp, --sequence-parallel, --pp, --virtual, --cp): Korthikanti et "
        "al.'s equations 1-6 at that tp, the first pipeline stage's activations, the states "
        "under a byte budget (--bytes-per-param) with ZeRO-3's gathered layer and optimizer "
        "offload, the largest model that fits (--max-model) and DeepSpeed's estimator "
        "(--deepspeed). The real d_ff, SwiGLU and GQA change activations as well as "
        "parameters. GB = 1e9 bytes, GiB = 2^30."))
    p.add_argument("--params", type=count_arg, default=None, metavar="N",
                   help="parameter count, e.g. 7e9 or 7B (default: from --model or the shape)")
    p.add_argument("--devices", type=size_arg(), default=1, metavar="K",
                   help="data-parallel devices that ZeRO shards over (default 1)")
    add_shape_options(p, "sequences per device (micro-batch)", 2048, 1)
    p.add_argument("--flash-attention", action="store_true",
                   help="count activations without the a*s*s attention maps (34*s*b*h)")
    p.add_argument("--recompute", nargs="?", const="full", default="none",
                   choices=("none", "selective", "full"),
                   help="activation recomputation: none; selective (the attention maps, "
                        "Korthikanti et al.); full (each layer's input kept). A bare "
                        "--recompute means full")
    p.add_argument("--lora-rank", type=size_arg(), default=None, metavar="R",
                   help="add a LoRA fine-tune with rank-R adapters on every linear layer")
    p.add_argument("--qlora", action="store_true",
                   help="add a QLoRA fine-tune (NF4 base; rank from --lora-rank, default 64)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    memory_layout.add_options(p)
    p.set_defaults(run=run)


def compute(args) -> dict:
    """Every figure of the memory command, as one JSON-ready dict."""
    shape = model_shape(args, 2048)
    params, source = resolve_params(args, shape)
    k = args.devices
    states = {prec: [{"stage": z, "name": STAGE_NAMES[z],
                      **cm.model_state_bytes(params, k, z, prec)} for z in range(4)]
              for prec in cm.STATE_BYTES}
    for rows in states.values():
        for r in rows:
            r["bytes_per_param"] = r["total"] / params
    out = {"params": params, "params_source": source, "devices": k, "shape": shape,
           "batch": args.batch, "model_states": states, "activations": None, "finetune": None}
    acts_used = 0.0
    if shape is not None:
        from jaxscale.costmodel import activations as A
        t = transformer(shape)
        s, b, h = shape["seq"], args.batch, shape["hidden"]
        logits = 4 * s * b * shape["vocab"] if shape["vocab"] else 0.0  # fp32 logits for the loss
        names = {"none": "stored", "selective": "selective", "full": "recompute"}

        def key(recompute: str, flash: bool) -> str:
            return names[recompute] + ("_flash" if flash else "")
        total = {key(rc, fa): A.activation_memory(t.active(), b, recompute=rc,  # (MoE: top_k)
                                                  flash_attention=fa)["total"]
                 for rc in names for fa in (False, True)}
        variant = key(args.recompute, args.flash_attention)
        acts_used = total[variant] + logits
        out["activations"] = {
            "per_layer": A.per_layer(t, b)["total"],
            "per_layer_flash": A.per_layer(t, b, flash_attention=True)["total"],
            "layer_input": 2 * s * b * h, "total": total, "logits_fp32": logits,
            "used": variant, "used_bytes": acts_used}
    out["per_device"] = [{"stage": r["stage"], "name": r["name"], "states": r["total"],
                          "activations": acts_used, "total": r["total"] + acts_used}
                         for r in states["mixed"]]
    if args.lora_rank is not None or args.qlora:
        if shape is None:
            raise cm.CostModelError("LoRA needs the model shape: give --model PRESET or "
                                    "--layers --hidden --heads")
        rank = args.lora_rank or 64
        if rank > shape["hidden"]:
            raise cm.CostModelError(f"--lora-rank {rank} is larger than the hidden size "
                                    f"{shape['hidden']}: choose 1..{shape['hidden']}")
        t = transformer(shape)
        n = cm.lora_adapter_params(t.layers, t.hidden, rank, t.f, t.kv_hidden, t.mlp_matrices)
        full = cm.model_state_bytes(params, 1)
        rows = {"full fine-tune": {"weights": full["params"],
                                   "trained_states": full["grads"] + full["optimizer"],
                                   "total": full["total"]}}
        for name, quantized in (("LoRA", False), ("QLoRA", True))[:2 if args.qlora else 1]:
            x = cm.finetune_state_bytes(params, n, quantized)
            rows[name] = {"weights": x["base_weights"], "total": x["total"], "breakdown": x,
                          "trained_states": x["total"] - x["base_weights"]}
        for r in rows.values():
            r["with_activations"] = r["total"] + acts_used
        out["finetune"] = {"rank": rank, "adapter_params": n, "adapter_fraction": n / params,
                           "nf4_bytes_per_param": cm.NF4_BYTES_PER_PARAM, "rows": rows}
    out["layout"] = memory_layout.compute(args, transformer(shape) if shape else None, params)
    return out


def render(r: dict) -> None:
    from jaxscale.report import plural

    hb = units.human_bytes
    shape = r["shape"]
    desc = describe_shape(shape, r["params"], r["params_source"])
    if shape:
        desc += (f"; {plural(r['batch'], 'sequence')} x {plural(shape['seq'], 'token')} "
                 "per device")
    for prec, (p, g, o) in cm.STATE_BYTES.items():
        table(f"model states per device, {prec} ({p} + {g} + {o} bytes per parameter), "
              f"K = {plural(r['devices'], 'device')}; {desc}",
              ["", "parameters", "gradients", "optimizer", "total", "bytes / parameter"],
              [[x["name"], gb(x["params"]), gb(x["grads"]), gb(x["optimizer"]), hb(x["total"]),
                f"{x['bytes_per_param']:.4g}"] for x in r["model_states"][prec]])
    a = r["activations"]
    if a:
        names = {"stored": "stored (Korthikanti)", "stored_flash": "flash attention",
                 "selective": "selective recomputation",
                 "selective_flash": "selective recomputation + flash attention",
                 "recompute": "full recomputation (+ one working layer)",
                 "recompute_flash": "full recomputation + flash attention"}
        table(f"activations on one device holding the whole model, no tp/pp/cp (16-bit, with "
              f"dropout; one layer {hb(a['per_layer'])}, with flash "
              f"attention {hb(a['per_layer_flash'])}, one layer's input {hb(a['layer_input'])})",
              ["", "all layers", "used below"],
              [[names[k], hb(v), "<-" if k == a["used"] else ""] for k, v in a["total"].items()]
              + ([["fp32 logits for the loss", hb(a["logits_fp32"]), "+"]]
                 if a["logits_fp32"] else []))
    if a:
        table("one device holding the whole model: mixed-precision model states + "
              "activations (the layout's figures follow)",
              ["", "model states", "activations", "total"],
              [[x["name"], hb(x["states"]), hb(x["activations"]), hb(x["total"])]
               for x in r["per_device"]])
    else:
        print("(activations: give the model shape, --layers --hidden --heads, or --model PRESET)")
    f = r["finetune"]
    if f:
        table(f"fine-tuning on one device: rank {f['rank']} adapters on every linear layer, "
              f"{plural(f['adapter_params'], 'trainable parameter')} "
              f"({100 * f['adapter_fraction']:.3g}% "
              f"of the model); NF4 = {f['nf4_bytes_per_param']:.4f} bytes per weight",
              ["", "weights (frozen for LoRA)", "trained: grads + Adam (+ adapters)", "total",
               "with activations"],
              [[name, hb(x["weights"]), hb(x["trained_states"]), hb(x["total"]),
                hb(x["with_activations"])] for name, x in f["rows"].items()])


def render_all(r: dict) -> None:
    render(r)
    memory_layout.render(r["layout"])


def run(args) -> int:
    return emit(args, compute(args), render_all)
