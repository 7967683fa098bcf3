"""Activation memory per device, term by term, after Korthikanti et al. (2022).

"Reducing Activation Recomputation in Large Transformer Models" counts what one layer keeps
for backward in 16-bit (2 bytes; dropout masks 1 byte), for s tokens, micro-batch b, hidden
h, a heads. Its equations, which `per_layer` reproduces term by term (TERMS below):

  eq. 1  no parallelism                     s b h (34 + 5 a s / h)
  eq. 2  tensor parallel over t             s b h (10 + 24/t + 5 a s / (h t))
  eq. 4  + sequence parallel                s b h (34/t + 5 a s / (h t))
  Table 2, tp + selective recompute         s b h (10 + 24/t)   (the 5as/h maps recomputed)
  Table 2, tp + sp + selective              s b h 34/t
  Table 2, full recompute                   s b h 2             (only the layer's input)
  eq. 5  first pipeline stage               L x eq. 4: p stages of L/p layers, p micro-
                                            batches in flight under 1F1B; interleaved with
                                            v chunks per device, x (1 + (p-1)/(p v))
  eq. 6  the whole model, tp + sp + selective  34 s b h L / t

The 34 is 10 terms whole on every tp device (the two LayerNorm inputs, the two matmul inputs
that follow them, two dropout masks: 2+2+2+2+1+1) and 24 split by tp (q, k, v, the
projection input, the MLP's 4h-wide GELU input and output). Sequence parallelism splits the
10 as well. 5as/h are the a x s x s attention maps (softmax output 2, its dropout mask 1,
dropout output 2); flash attention never stores them, and selective recompute drops them.

Generalised here, each an option the paper does not need:
  ffn, SwiGLU, GQA  the f-wide terms become 2f/h (3f/h with SwiGLU) per 2 bytes, k and v
                    2 h_kv/h (`shape.Transformer`);
  latent attention  q and k heads x (nope + rope) wide, v and the projection input heads x
                    v (`shape.columns`), and the two latents (before and after their
                    norms) with the shared rotated key, whole on every tp device;
  dropout=False     no masks (today's LLMs): 34 -> 32 and the maps 5 -> 2;
  cp                context parallelism: each device keeps s/cp tokens; its queries' maps
                    span all s keys (a s^2/cp);
  full recompute    the paper's 2sbh per layer (the input; /t under sequence parallelism,
                    which the paper notes is possible but does not use) plus, shown apart
                    as `working_layer`, one layer's activations while it is recomputed (the
                    paper leaves it out; it is what the device holds at the peak).
Not counted (as in the paper): embeddings, the output layer and the loss (report them apart
if they matter: 4 s b V / t bytes of fp32 logits), and the framework's temporaries.
"""
from __future__ import annotations

from jaxscale.costmodel.schedule import in_flight
from jaxscale.costmodel.shape import ShapeError, Transformer

RECOMPUTE = ("none", "selective", "full")


def _check(**values) -> None:
    for name, v in values.items():
        if not v >= 1:
            raise ShapeError(f"{name} must be >= 1, got {v}")


def terms(shape: Transformer, dropout: bool = True) -> list[tuple[str, float, str]]:
    """One layer's kept tensors in bytes per token (whole micro-batch: x s b), with how they
    split: 'replicated' (whole on every tp device, split by sequence parallelism), 'whole'
    (whole on every tp device either way: latent attention's latents, computed from the
    sequence sp gathers; counted with 'replicated'), 'split' (by tp), 'maps' (the attention
    maps, a x s_keys per token, split by tp)."""
    h, f, kv, a = shape.hidden, shape.f, shape.kv_hidden, shape.heads
    qk, out = shape.columns  # (h, h) but for latent attention
    mask = 1 if dropout else 0
    latents = 0
    if shape.latent:  # its latents before and after their norms, and the shared key
        q_lora, kv_lora, _, rope, _ = shape.latent
        latents = 2 * 2 * (q_lora + kv_lora) + 2 * rope
    rows = [
        ("layernorm 1 input", 2 * h, "replicated"),
        ("q k v input", 2 * h, "replicated"),
        ("latent attention's latents", latents, "whole"),
        ("q", 2 * qk, "split"),
        ("k and v", 2 * (qk + out) if shape.latent else 2 * 2 * kv, "split"),
        ("softmax output", 2 * a, "maps"),
        ("softmax dropout mask", mask * a, "maps"),
        ("softmax dropout output", 2 * mask * a, "maps"),
        ("projection input", 2 * out, "split"),
        ("attention dropout mask", mask * h, "replicated"),
        ("layernorm 2 input", 2 * h, "replicated"),
        ("mlp input", 2 * h, "replicated"),
        ("activation input" + (" (gate, up)" if shape.swiglu else ""),
         2 * f * (2 if shape.swiglu else 1), "split"),
        ("activation output", 2 * f, "split"),
        ("mlp dropout mask", mask * h, "replicated"),
    ]
    return [r for r in rows if r[1]]


def per_layer(shape: Transformer, micro_batch: int = 1, tp: int = 1,
              sequence_parallel: bool = False, cp: int = 1, recompute: str = "none",
              flash_attention: bool = False, dropout: bool = True) -> dict[str, float]:
    """Bytes one layer keeps on one device for one micro-batch, by kind, and their total.

    recompute='full' keeps only the layer's 16-bit input: 2 s b h (/ t with sequence
    parallelism, / cp); 'selective' drops the attention maps; flash attention never has them.
    """
    _check(micro_batch=micro_batch, tp=tp, cp=cp)
    if recompute not in RECOMPUTE:
        raise ShapeError(f"unknown recompute {recompute!r}; choose from {', '.join(RECOMPUTE)}")
    if shape.heads % tp or shape.kv % tp:
        raise ShapeError(f"tp {tp} does not divide the {shape.heads} heads"
                         + (f" and {shape.kv} kv heads" if shape.kv != shape.heads else ""))
    if shape.seq % cp:
        raise ShapeError(f"cp {cp} does not divide the sequence length {shape.seq}")
    tokens = shape.seq // cp * micro_batch  # kept on this device
    rep_div = tp if sequence_parallel else 1
    if recompute == "full":
        layer_input = 2 * shape.hidden * tokens / rep_div
        return {"replicated": layer_input, "split": 0.0, "maps": 0.0, "total": layer_input}
    sums = {"replicated": 0.0, "whole": 0.0, "split": 0.0, "maps": 0.0}
    for _, per_token, kind in terms(shape, dropout):
        sums[kind] += per_token
    out = {"replicated": sums["replicated"] * tokens / rep_div + sums["whole"] * tokens,
           "split": sums["split"] * tokens / tp,
           "maps": sums["maps"] * tokens * shape.seq / tp}  # each query meets all s keys
    if flash_attention or recompute == "selective":
        out["maps"] = 0.0
    out["total"] = out["replicated"] + out["split"] + out["maps"]
    return out


def activation_memory(shape: Transformer, micro_batch: int = 1, tp: int = 1,
                      sequence_parallel: bool = False, cp: int = 1, pp: int = 1,
                      micro_batches: int = 1, schedule: str = "1f1b", virtual: int = 1,
                      recompute: str = "none", flash_attention: bool = False,
                      dropout: bool = True) -> dict:
    """Activations on the busiest device (the first pipeline stage) for one training step.

    stored = layers on the stage x micro-batches in flight x per-layer bytes; with full
    recompute, `working_layer` is one layer's whole activations rebuilt in backward (on top,
    once). total = stored + working_layer.
    """
    _check(pp=pp)
    if shape.layers % pp:
        raise ShapeError(f"pp {pp} does not divide the {shape.layers} layers")
    one = per_layer(shape, micro_batch, tp, sequence_parallel, cp, recompute,
                    flash_attention, dropout)
    layers_here = shape.layers // pp
    held = in_flight(pp, micro_batches, schedule, virtual)
    stored = one["total"] * layers_here * held
    working = 0.0
    if recompute == "full":
        working = per_layer(shape, micro_batch, tp, sequence_parallel, cp, "none",
                            flash_attention, dropout)["total"]
    return {"per_layer": one, "layers_on_stage": layers_here, "in_flight": held,
            "stored": stored, "working_layer": working, "total": stored + working}
