"""How a block computes beyond its shapes: the static choices that the pure functions of
jaxscale.model.block take (ModelConfig.family builds one; a plan adds its own: the FP8
recipe, the mesh axes a mixture of experts' tokens live on)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """The static choices of a block's computation: hashable, so part of the compiled
    program as remat and the attention kernel are. `kv_heads`: the model's k and v heads,
    all devices together (0: as many as the query heads); tensor parallelism needs it to
    know whether it splits them (jaxscale.model.block.attention). `matmul`: how the block's
    projections multiply, set by the precision policy, not the model (with `fp8_block`, the
    tile of fp8-block, and `fp8_head`, whether the output head takes the recipe too)."""

    norm: str = "layernorm"
    mlp: str = "gelu"
    position: str = "learned"
    rope_theta: float = 10_000.0
    rope_scaling: tuple = ()
    norm_eps: float = 1e-5
    kv_heads: int = 0
    matmul: str = "native"  # or "fp8", "fp8-delayed", "fp8-block": the policy's (model.fp8)
    fp8_block: int = 128  # fp8-block's tile length (model.fp8.BLOCK, DeepSeek-V3's 128)
    fp8_head: bool = False  # the output head multiplies under the recipe too
    # mixture of experts (jaxscale.model.moe): the router's choices and loss weights (aux,
    # z), and where the tokens live: `token_axes` the mesh axes that split them,
    # `copy_axes` and `shared_axes` those that hold the same ones (tp; shared: under
    # sequence parallelism, where the loss is a sum over tp), `ep_axis` the experts' axis
    top_k: int = 2
    capacity_factor: float | None = None
    router_weights: tuple = (0.01, 0.001)
    token_axes: tuple = ()
    copy_axes: tuple = ()
    shared_axes: tuple = ()
    ep_axis: str | None = None


GPT2 = Family()  # the garden presets': LayerNorm, GELU, learned positions, multi-head
