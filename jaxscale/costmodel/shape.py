"""The shape of a dense decoder-only transformer, as the cost model reads it.

One record for every formula in jaxscale.costmodel (activations, states, FLOPs, time) so
that the same model is never described twice. The options beyond GPT's shape are the two
that change the counts of today's open models:

  ffn       the MLP's inner width f (GPT: 4h; Llama-2-7B: 11008). It changes parameters,
            FLOPs and activations alike.
  swiglu    a gated MLP (Llama): three f x h matrices instead of two, and one more f-wide
            activation kept for backward.
  kv_heads  grouped-query attention: k and v have kv_heads x head_dim columns instead of h.
  experts   a mixture of experts (top_k of them per token, each an MLP of width f, and a
            router h x experts): the parameters count every expert, the FLOPs and the
            activations only the top_k a token uses (`active`). moe_every n > 1: every
            n-th block holds the experts, the others a dense MLP of width dense_ffn.
            shared: experts every token uses besides its top_k (DeepSeek's), not split
            by ep. capacity_factor: the places each expert's all-to-all carries, over
            its fair share (1: a dropless exchange that sends each token's top_k copies).
            first_dense: DeepSeek's first blocks with the dense MLP (width dense_ffn).
  latent    multi-head latent attention (DeepSeek; jaxscale.model.mla), (q_lora, kv_lora,
            nope, rope, v): q and k are heads x (nope + rope) wide, v heads x v; the
            weights are the latents' down-projections and the heads' up-projections.

Parameters: L (2h^2 + 2 h h_kv + n_mlp h f) + V h (2 V h untied), n_mlp = 2 (3 with
SwiGLU), h_kv = kv_heads x h / heads; with E experts (and S shared) the MLP term of a block
that holds them is (E + S) n_mlp h f + h E, and of the others (moe_every > 1 or
first_dense) n_mlp h dense_ffn; latent attention's weights replace 2h^2 + 2 h h_kv
(`attention_params`); biases, norms and learned positions left out (< 0.1% of any model
here). Latent attention's down-projections are whole on every tp device but counted here
as split with the rest (DeepSeek-V3: 0.92B of 671B, 0.14%), and their gradients'
all-reduce over tp is not charged to the step time (compare.predict counts it).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace


class ShapeError(ValueError):
    """A transformer shape that no model could have."""


@dataclass(frozen=True)
class Transformer:
    layers: int
    hidden: int
    heads: int
    seq: int = 2048
    ffn: int | None = None  # None: 4 x hidden
    kv_heads: int | None = None  # None: heads (multi-head attention)
    vocab: int = 0
    swiglu: bool = False
    tied: bool = True  # the output head shares the embedding (False: Llama, another V x h)
    experts: int = 0  # a mixture of experts' routed experts (0: a dense MLP)
    top_k: int = 1  # experts per token
    moe_every: int = 1  # every n-th block holds the experts (1: all of them)
    dense_ffn: int | None = None  # the dense blocks' MLP width when interleaved (None: ffn)
    shared: int = 0  # shared experts (each of width ffn) in every block that holds experts
    capacity_factor: float = 1.0  # places per expert over its fair share, in the all-to-all
    first_dense: int = 0  # the first blocks keep the dense MLP (DeepSeek's)
    latent: tuple = ()  # latent attention's (q_lora, kv_lora, nope, rope, v); () for none

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq"):
            if not getattr(self, name) >= 1:
                raise ShapeError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (self.ffn is not None and self.ffn < 1) or self.vocab < 0:
            raise ShapeError(f"ffn must be >= 1 and vocab >= 0, got {self.ffn}, {self.vocab}")
        if self.hidden % self.heads:
            raise ShapeError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        kv = self.kv
        if not 1 <= kv <= self.heads or self.heads % kv:
            raise ShapeError(f"kv_heads {kv} must divide heads {self.heads}")
        if self.experts < 0 or (self.experts and not 1 <= self.top_k <= self.experts):
            raise ShapeError(f"top_k {self.top_k} must be 1 to experts {self.experts}")
        if self.shared < 0 or not self.capacity_factor > 0:
            raise ShapeError(f"shared experts must be >= 0 and the capacity factor > 0, got "
                             f"{self.shared}, {self.capacity_factor}")
        if self.moe_every < 1 or self.layers % self.moe_every:
            raise ShapeError(f"moe_every {self.moe_every} must divide layers {self.layers}")
        if not 0 <= self.first_dense < self.layers or (self.latent and len(self.latent) != 5):
            raise ShapeError(f"first_dense {self.first_dense} must leave experts in some of "
                             f"the {self.layers} layers; latent takes 5 widths, got "
                             f"{self.latent}")

    @property
    def f(self) -> int:
        return 4 * self.hidden if self.ffn is None else self.ffn

    @property
    def kv(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def kv_hidden(self) -> int:
        """Columns of k (and of v): kv_heads x head_dim."""
        return self.kv * (self.hidden // self.heads)

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.swiglu else 2

    @property
    def moe_layers(self) -> int:
        return (self.layers - self.first_dense) // self.moe_every if self.experts else 0

    @property
    def columns(self) -> tuple[int, int]:
        """(q's and k's columns, v's and the attention output's), all heads: (h, h), or
        latent attention's heads x (nope + rope) and heads x v."""
        if not self.latent:
            return self.hidden, self.hidden
        _, _, nope, rope, v = self.latent
        return self.heads * (nope + rope), self.heads * v

    def attention_params(self) -> int:
        """One block's attention weights: Wq, Wo (h x h), Wk, Wv (h x h_kv), or latent
        attention's down-projections (h x q_lora, h x (kv_lora + rope)), up-projections
        (q_lora x q columns, or h x them without a q latent; kv_lora x heads (nope + v))
        and Wo (v columns x h)."""
        h = self.hidden
        if not self.latent:
            return 2 * h * h + 2 * h * self.kv_hidden
        q_lora, kv_lora, nope, rope, v = self.latent
        qk, out = self.columns
        q = q_lora * (h + qk) if q_lora else h * qk
        return q + h * (kv_lora + rope) + kv_lora * self.heads * (nope + v) + out * h

    def core_flops(self) -> int:
        """Forward FLOPs per token of the attention cores, all layers, non-causal: q k^T
        over q's columns and weights @ v over v's, against s keys (4 L s h when plain)."""
        return 2 * self.layers * self.seq * sum(self.columns)

    def layer_params(self, active: bool = False) -> int:
        """Matmul weights of one block (with experts, a block that holds them): Wq, Wo (h x
        h), Wk, Wv (h x h_kv) or latent attention's, the MLP's (with experts: every expert's, or the top_k a
        token uses when `active`, and the router)."""
        h = self.hidden
        mlps = (self.top_k if active else self.experts) + self.shared if self.experts else 1
        router = h * self.experts
        return self.attention_params() + mlps * self.mlp_matrices * h * self.f + router

    def dense_layer_params(self) -> int:
        """Matmul weights of a block with the dense MLP (beside the experts' blocks)."""
        h, f = self.hidden, self.dense_ffn or self.f
        return self.attention_params() + self.mlp_matrices * h * f

    def blocks_params(self, active: bool = False) -> int:
        """Matmul weights of all the blocks."""
        if not self.experts:
            return self.layers * self.layer_params()
        return (self.moe_layers * self.layer_params(active)
                + (self.layers - self.moe_layers) * self.dense_layer_params())

    def expert_params(self) -> int:
        """The routed experts' weights, all layers (what expert parallelism splits)."""
        return self.moe_layers * self.experts * self.mlp_matrices * self.hidden * self.f

    def params(self, active: bool = False) -> int:
        embeddings = (1 if self.tied else 2) * self.vocab * self.hidden
        return self.blocks_params(active) + embeddings

    def active(self) -> "Transformer":
        """The dense model a token sees: top_k experts as one MLP of width top_k x f (the
        activations and FLOPs of a mixture of experts, its router's left out); interleaved,
        the blocks' mean MLP width (activations are linear in it: the sum over the blocks
        is exact, one block's figure an average)."""
        if not self.experts:
            return self
        n = self.moe_layers
        used = (self.top_k + self.shared) * self.f  # a token's experts, the shared ones too
        ffn = (n * used + (self.layers - n) * (self.dense_ffn or self.f)) / self.layers
        return replace(self, ffn=int(ffn) if ffn == int(ffn) else ffn, experts=0, top_k=1,
                       moe_every=1, dense_ffn=None, shared=0, capacity_factor=1.0,
                       first_dense=0)

    def with_seq(self, seq: int) -> Transformer:
        return replace(self, seq=seq)

    def as_dict(self) -> dict:
        return {**asdict(self), "ffn": self.f, "kv_heads": self.kv, "params": self.params(),
                **({"active_params": self.params(active=True)} if self.experts else {})}
