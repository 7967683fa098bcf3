"""The options and printing that the calculator commands (memory, plan, comm, failures) share.

argparse types for counts ("7e9", "7B"), sizes ("80GB", "80GiB") and links; the model shape
from --model or --layers/--hidden/--heads (with --ffn, --kv-heads, --vocab, --swiglu, --seq);
the parameter count and where it came from; printing a result as rich tables or as one JSON
object (--json).
"""
from __future__ import annotations

import argparse
import json

from jaxscale import costmodel as cm
from jaxscale.costmodel import units

STAGE_NAMES = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]  # ZeRO stage 0-3, as tables print them


def arg_type(parse):
    """An argparse type from a costmodel parser: its CostModelError becomes argparse's error."""
    def convert(text: str):
        try:
            return parse(text)
        except cm.CostModelError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return convert


# The most devices, layers, heads, tokens... a calculator takes: more than any cluster or
# model has, and small enough that divisors are found at once and products stay finite.
MAX_SIZE = 10**9

count_arg = arg_type(units.parse_count)  # "7e9", "7B", "350M"
bytes_arg = arg_type(units.parse_bytes)  # "80GB", "80GiB", "8e10"
link_arg = arg_type(cm.link_bandwidth)  # "nvlink", "infiniband", "ethernet" or GB/s


def size_arg(minimum: int = 1):
    """argparse type: a whole number from minimum to MAX_SIZE (devices, layers, tokens...)."""
    from jaxscale.cli.main import _number
    return _number(minimum=minimum, maximum=MAX_SIZE)


def preset_summary(name: str) -> str:
    """Which model a preset is: '7b (32 layers, d_model 4096, 32 heads, d_ff 16384, vocab
    32000, seq 4096; 6.59B parameters)', so that its count is not mistaken for another 7B."""
    from jaxscale.model.config import PRESETS, param_count

    c, n = PRESETS[name], param_count(PRESETS[name])
    count = f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M" if n >= 1e6 else f"{n:,}"
    family = (f", {c.kv_heads} kv heads" if c.kv_heads != c.n_heads else "") + (
        ", Llama blocks" if c.family.position == "rope" else "") + (
        f", {c.n_experts} experts top-{c.top_k}" if c.n_experts else "") + (
        f" in 1 of every {c.moe_every} blocks" if c.moe_every > 1 else "") + (
        f" after {c.first_dense} dense blocks" if c.first_dense else "") + (
        f", latent attention (kv latent {c.kv_lora_rank})" if c.kv_lora_rank else "")
    return (f"{name} ({c.n_layers} layers, d_model {c.d_model}, {c.n_heads} heads{family}, "
            f"d_ff {c.d_ff}, vocab {c.vocab_size}, seq {c.seq_len}; {count} parameters)")


def add_shape_options(p, batch_help: str, seq_default: int, batch_default: int) -> None:
    """--model, --layers, --hidden, --heads, --ffn, --vocab, --seq, --batch."""
    from jaxscale.cli.model_arg import FILE_HELP, model_arg
    from jaxscale.model.config import PRESETS  # the presets' table alone: no JAX

    p.add_argument("--model", type=model_arg, metavar="PRESET",
                   help=f"take the shape (and parameter count) from a jaxscale.model.transformer preset: "
                        f"{'; '.join(preset_summary(k) for k in PRESETS)}; {FILE_HELP}. "
                        "Explicit options below override it")
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
        from jaxscale.model.config import LATENT_OPTIONS, is_file, param_count, preset
        cfg = preset(args.model)
        shape = {"layers": cfg.n_layers, "hidden": cfg.d_model, "heads": cfg.n_heads,
                 "ffn": cfg.d_ff, "vocab": cfg.vocab_size, "seq": cfg.seq_len,
                 "params": float(param_count(cfg)),
                 "source": f"{'config' if is_file(args.model) else 'preset'} {args.model}"}
        # the Llama family's differences (absent for GPT-2's shapes, as before it existed)
        if cfg.n_kv_heads:
            shape["kv_heads"] = cfg.n_kv_heads
        if cfg.mlp == "swiglu":
            shape["swiglu"] = True
        if not cfg.tied_head:
            shape["tied"] = False
        if cfg.n_experts:  # each expert's width as the MLP's
            shape.update(experts=cfg.n_experts, top_k=cfg.top_k, ffn=cfg.expert_d_ff,
                         shared=cfg.n_shared_experts, capacity_factor=cfg.capacity_factor or 1.0)
            if cfg.moe_every > 1 or cfg.first_dense:  # the dense blocks' own width
                shape.update(moe_every=cfg.moe_every, dense_ffn=cfg.d_ff,
                             first_dense=cfg.first_dense)
        if cfg.kv_lora_rank:  # latent attention (DeepSeek's)
            shape["latent"] = tuple(getattr(cfg, n) for n in LATENT_OPTIONS)
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
                       vocab=shape["vocab"] or 0, swiglu=shape.get("swiglu", False),
                       tied=shape.get("tied", True), experts=shape.get("experts", 0),
                       top_k=shape.get("top_k", 1), moe_every=shape.get("moe_every", 1),
                       dense_ffn=shape.get("dense_ffn"), shared=shape.get("shared", 0),
                       capacity_factor=shape.get("capacity_factor", 1.0),
                       first_dense=shape.get("first_dense", 0), latent=shape.get("latent", ()))


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
    return f"{n / 1e9:,.2f} GB" if abs(n) < 1e15 else units.short_bytes(n)


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
    if shape.get("kv_heads") and shape["kv_heads"] != shape.get("heads"):
        parts.append(f"{shape['kv_heads']} kv heads")
    parts.append(f"{'SwiGLU ' if shape.get('swiglu') else ''}ffn {shape['ffn']}")
    if shape.get("tied") is False:
        parts.append("untied head")
    if shape.get("vocab"):
        parts.append(f"vocab {shape['vocab']}")
    origin = shape["source"] if shape["source"] != "options" else "shape"
    return f"{text}; {origin}: {', '.join(parts)}"


def table(title: str, columns: list[str], rows: list[list]) -> None:
    """A rich table of already formatted cells (jaxscale.report.print_table)."""
    from jaxscale.report import print_table
    print_table(title, columns, [[str(v) for v in row] for row in rows])
