"""`jaxscale memory`: bytes per device of training a model, from closed forms.

    jaxscale memory --params 7e9 --devices 8
    jaxscale memory --model 7b --devices 8 --batch 1 --flash-attention --recompute
    jaxscale memory --params 6.74e9 --layers 32 --hidden 4096 --heads 32 --seq 4096 --qlora

Also the helpers the other calculator commands share: argparse types for counts ("7e9",
"7B") and sizes ("80GB", "80GiB"), the model shape from --model or --layers/--hidden/--heads,
and printing a result as rich tables or as one JSON object.
"""
from __future__ import annotations

import argparse
import json

from jaxscale import costmodel as cm

STAGE_NAMES = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]


# ------------------------------------------------------------------------------------
# shared by the calculator commands
# ------------------------------------------------------------------------------------

def _arg_type(parse):
    def convert(text: str):
        try:
            return parse(text)
        except cm.CostModelError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


# The most devices, layers, heads, tokens... a calculator takes: more than any cluster or
# model has, and small enough that divisors are found at once and products stay finite.
MAX_SIZE = 10**9

count_arg = _arg_type(cm.parse_count)  # "7e9", "7B", "350M"
bytes_arg = _arg_type(cm.parse_bytes)  # "80GB", "80GiB", "8e10"
link_arg = _arg_type(cm.link_bandwidth)  # "nvlink", "infiniband", "ethernet" or GB/s


def size_arg(minimum: int = 1):
    """argparse type: a whole number from minimum to MAX_SIZE (devices, layers, tokens...)."""
    from jaxscale.cli import _number
    return _number(minimum=minimum, maximum=MAX_SIZE)


def preset_summary(name: str) -> str:
    """Which model a preset is: '7b (32 layers, d_model 4096, 32 heads, d_ff 16384, vocab
    32000, seq 4096; 6.59B parameters)', so that its count is not mistaken for another 7B."""
    from jaxscale.model import PRESETS, param_count

    c, n = PRESETS[name], param_count(PRESETS[name])
    count = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"
    return (f"{name} ({c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads, d_ff "
            f"{c.d_ff}, vocab {c.vocab_size}, seq {c.seq_len}; {count} parameters)")


def add_shape_options(p, batch_help: str, seq_default: int, batch_default: int) -> None:
    """--model, --layers, --hidden, --heads, --ffn, --vocab, --seq, --batch."""
    from jaxscale.model import PRESETS  # already imported by jaxscale.cli.build_parser

    p.add_argument("--model", choices=list(PRESETS), metavar="PRESET",
                   help=f"take the shape (and parameter count) from a jaxscale.model preset: "
                        f"{'; '.join(preset_summary(k) for k in PRESETS)}. Explicit options "
                        "below override it")
    for flags, what in ((("--layers",), "transformer layers L"), (("--hidden",), "hidden size h"),
                        (("--heads",), "attention heads a (must divide h)"),
                        (("--ffn", "--d-ff"), "MLP inner size f (default 4h)"),
                        (("--kv-heads",), "key/value heads for grouped-query attention "
                                          "(default: the heads)"),
                        (("--vocab",), "vocabulary size")):
        p.add_argument(*flags, type=size_arg(), default=None, metavar="N", help=what)
    p.add_argument("--swiglu", action="store_true",
                   help="a gated MLP (Llama): three h x f matrices and one more f-wide activation")
    p.add_argument("--seq", type=size_arg(), default=None, metavar="S",
                   help=f"sequence length s (default the preset's, else {seq_default})")
    p.add_argument("--batch", type=size_arg(), default=batch_default, metavar="B",
                   help=f"{batch_help} (default {batch_default})")


def model_shape(args, seq_default: int, require: tuple[str, ...] = ("layers", "hidden", "heads"),
                without_shape: tuple[str, ...] = ()) -> dict | None:
    """The shape from --model and the explicit options; None if neither was given.

    Keys: layers, hidden, heads, ffn, vocab, seq, params (from the preset or estimated),
    source. Raises CostModelError if the shape is incomplete or inconsistent, or if options
    that only mean something with a shape (other than those in without_shape) come alone.
    """
    shape: dict = {}
    if args.model:
        from jaxscale.model import PRESETS, param_count
        cfg = PRESETS[args.model]
        shape = {"layers": cfg.n_layers, "hidden": cfg.d_model, "heads": cfg.n_heads,
                 "ffn": cfg.d_ff, "vocab": cfg.vocab_size, "seq": cfg.seq_len,
                 "params": float(param_count(cfg)), "source": f"preset {args.model}"}
    given = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "ffn", "kv_heads",
                                           "vocab", "seq") if getattr(args, k) is not None}
    if args.swiglu:
        given["swiglu"] = True
    if not shape and not {"layers", "hidden", "heads"} & set(given):
        orphans = [f"--{k}" for k in given if k not in without_shape]
        if orphans:
            raise cm.CostModelError(f"{', '.join(orphans)} describe the model shape: give "
                                    "--layers --hidden --heads too, or --model PRESET")
        return None
    shape = {"source": "options", **shape, **given}
    missing = [k for k in require if k not in shape]
    if missing:
        raise cm.CostModelError(f"the model shape needs --{', --'.join(missing)} as well "
                                "(or --model PRESET)")
    shape.setdefault("heads", None)
    if shape["heads"] and shape["hidden"] % shape["heads"]:
        raise cm.CostModelError(f"--hidden {shape['hidden']} is not divisible by --heads "
                                f"{shape['heads']}: pick heads dividing the hidden size")
    if shape.get("kv_heads") and shape["heads"] and shape["heads"] % shape["kv_heads"]:
        raise cm.CostModelError(f"--kv-heads {shape['kv_heads']} does not divide --heads "
                                f"{shape['heads']}: pick a divisor of the heads")
    shape.setdefault("ffn", 4 * shape["hidden"])
    shape.setdefault("kv_heads", None)
    shape.setdefault("swiglu", False)
    shape.setdefault("vocab", None)
    shape.setdefault("seq", seq_default)
    if "params" not in shape or {"layers", "hidden", "ffn", "vocab", "kv_heads",
                                 "swiglu"} & set(given):
        shape["params"] = float(transformer(shape).params())
        shape["params_source"] = ("estimated from the shape: L(2h^2 + 2h h_kv + n h ffn) + "
                                  "vocab h (n = 2, 3 with SwiGLU)")
    else:
        shape["params_source"] = f"{shape['source']}'s count"
    return shape


def transformer(shape: dict):
    """The cost model's record of a shape dict (heads default to 1 when a caller has none)."""
    from jaxscale.costmodel.shape import Transformer
    return Transformer(shape["layers"], shape["hidden"], shape["heads"] or 1, shape["seq"],
                       ffn=shape["ffn"], kv_heads=shape.get("kv_heads"),
                       vocab=shape["vocab"] or 0, swiglu=shape.get("swiglu", False))


def resolve_params(args, shape: dict | None) -> tuple[float, str]:
    """--params if given, else the shape's count; an error says what to give."""
    if args.params is not None:
        return args.params, "given"
    if shape is not None:
        return shape["params"], shape["params_source"]
    raise cm.CostModelError("give --params (e.g. 7e9), or --model PRESET, or the shape "
                            "(--layers --hidden --heads)")


def emit(args, result: dict, render) -> int:
    """One JSON object with every figure (--json), else render(result) prints the tables."""
    if args.json:
        print(json.dumps(result))
    else:
        render(result)
    return 0


def gb(n: float) -> str:
    """GB (1e9) with two decimals; PB (1e15) from there on."""
    return f"{n / 1e9:,.2f} GB" if abs(n) < 1e15 else cm.short_bytes(n)


short_bytes = cm.short_bytes  # GB or MB, for tables too narrow for both units


def describe_shape(shape: dict | None, params: float, source: str) -> str:
    """'6.592e+09 parameters (preset 7b's count); preset 7b: 32 layers, h = 4096, ...': the
    parameter count with the model it belongs to, so that two "7B" models are told apart."""
    from jaxscale.report import plural

    text = f"{params:.4g} parameters ({source})"
    if shape is None:
        return text
    parts = [plural(shape["layers"], "layer"), f"h = {shape['hidden']}"]
    if shape.get("heads"):
        parts.append(plural(shape["heads"], "head"))
    parts.append(f"ffn {shape['ffn']}")
    if shape.get("vocab"):
        parts.append(f"vocab {shape['vocab']}")
    origin = shape["source"] if shape["source"] != "options" else "shape"
    return f"{text}; {origin}: {', '.join(parts)}"


def table(title: str, columns: list[str], rows: list[list]) -> None:
    """A rich table of already formatted cells (jaxscale.report.print_table)."""
    from jaxscale.report import print_table
    print_table(title, columns, [[str(v) for v in row] for row in rows])


# ------------------------------------------------------------------------------------
# the memory command
# ------------------------------------------------------------------------------------

def register(subparsers) -> None:
    p = subparsers.add_parser("memory", help="bytes per device: model states under ZeRO, "
                              "activations, recomputation, LoRA/QLoRA", description=(
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
    from jaxscale.commands import memory_layout
    memory_layout.add_options(p, size_arg, bytes_arg)
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
        total = {key(rc, fa): A.activation_memory(t, b, recompute=rc, flash_attention=fa)["total"]
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
    from jaxscale.commands import memory_layout
    out["layout"] = memory_layout.compute(args, transformer(shape) if shape else None, params)
    return out


def render(r: dict) -> None:
    from jaxscale.report import plural

    hb = cm.human_bytes
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
    from jaxscale.commands import memory_layout
    render(r)
    memory_layout.render(r["layout"], table, cm.human_bytes)


def run(args) -> int:
    return emit(args, compute(args), render_all)
