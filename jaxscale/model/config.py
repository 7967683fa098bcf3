"""The model's shape (`ModelConfig`) and the named presets (its checks: model.config_checks;
its closed-form parameter count: model.counts).

Plain data: building the model from a config is `model.transformer`'s job. One model, two
families: GPT-2's blocks (LayerNorm with biases, GELU MLP, learned positions, the output
head tied to the embedding), the garden presets' default, and Llama's (RMSNorm, SwiGLU MLP,
rotary positions, grouped-query attention, an untied head, no biases). Each difference is
its own field, so any mix is a model too. A mixture of experts (`n_experts` > 0) puts
routed experts in the MLP's place of every block, or every `moe_every`-th, or all but the
`first_dense` first (model.moe); DeepSeek's latent attention (`kv_lora_rank` > 0) takes
the place of q, k and v's projections (model.mla).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxscale import garden
from jaxscale.model import config_checks, hf_config
from jaxscale.model.counts import attention_params, param_count  # noqa: F401
from jaxscale.model.config_checks import LATENT_OPTIONS, MOE_OPTIONS, ModelConfigError  # noqa: F401
from jaxscale.model.family import GPT2, Family  # noqa: F401 (the model's own names)




@dataclass(frozen=True)
class ModelConfig:
    """Shape of the transformer."""

    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    init_std: float = 0.02
    # packed rows: attention never crosses a document boundary (`document_ids`)
    document_mask: bool = False
    # the family's choices (defaults: GPT-2's)
    norm: str = "layernorm"  # or "rmsnorm": x / rms(x) * scale, no mean, no bias
    mlp: str = "gelu"  # or "swiglu": (silu(x W1) * (x W3)) W2, three matrices
    position: str = "learned"  # or "rope": q and k rotated by position (no position table)
    rope_theta: float = 10_000.0  # RoPE's base: pair i turns by position / theta^(2i / head_dim)
    n_kv_heads: int = 0  # grouped-query attention: heads of k and v (0: n_heads, plain MHA)
    tied_head: bool = True  # the output head is the token embedding (False: its own V x d)
    bias: bool = True  # biases in the projections and the norms
    norm_eps: float = 1e-5
    # Llama 3.1's long-context RoPE: (factor, low_freq_factor, high_freq_factor,
    # original context) as its config.json's rope_scaling gives them; () for none
    rope_scaling: tuple = ()
    # mixture of experts (0 experts: the dense MLP): each token's top_k of n_experts MLPs
    # of width moe_d_ff (0: d_ff), plus n_shared_experts that every token uses; each expert
    # takes at most capacity_factor x its fair share of a device's tokens (None: dropless),
    # and the router learns under Switch's load-balancing loss and ST-MoE's z-loss.
    # moe_every n > 1 interleaves: blocks n, 2n, ... (1-based) hold the experts, the
    # others the dense MLP of width d_ff (Switch and GShard: every other layer; Llama 4's
    # interleave_moe_layer_step)
    n_experts: int = 0
    top_k: int = 2
    moe_d_ff: int = 0
    n_shared_experts: int = 0
    capacity_factor: float | None = None
    router_aux_weight: float = 0.01
    router_z_weight: float = 0.001
    moe_every: int = 1
    # DeepSeek's first_k_dense_replace: the first `first_dense` blocks keep the dense MLP of
    # width d_ff, the experts fill the rest (with moe_every 1)
    first_dense: int = 0
    # multi-head latent attention (DeepSeek-V2; kv_lora_rank > 0, model.mla): each head's k
    # and v rebuilt from one kv_lora_rank-wide latent per token, plus a qk_rope_dim-wide
    # key all heads share (the only rotated part); q from a q_lora_rank-wide latent (0:
    # from x). A head's q.k spans qk_nope_dim + qk_rope_dim, its value v_head_dim
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self):
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff",
                     "init_std", "rope_theta", "norm_eps"):
            if not getattr(self, name) > 0:
                raise ModelConfigError(f"{name} must be positive, got {getattr(self, name)}")
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ModelConfigError(f"unknown {name} {getattr(self, name)!r}; choose from "
                                       f"{', '.join(choices)}")
        if self.d_model % self.n_heads:
            raise ModelConfigError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_kv_heads < 0 or self.n_heads % self.kv_heads:
            raise ModelConfigError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}; choose from "
                f"{[k for k in range(1, self.n_heads + 1) if self.n_heads % k == 0]}")
        if self.rope_scaling and len(self.rope_scaling) != 4:
            raise ModelConfigError("rope_scaling takes (factor, low_freq_factor, "
                                   f"high_freq_factor, original context), got {self.rope_scaling}")
        if self.position == "rope" and self.head_dim % 2:
            raise ModelConfigError(f"rotary positions turn pairs of a head's dimensions: "
                                   f"head_dim={self.head_dim} must be even")
        config_checks.experts(self)
        config_checks.latent(self)

    def first_blocks(self, n: int) -> "ModelConfig":
        """The model of the first n blocks (stack.first cuts its parameters): inside the
        dense first blocks, a dense model with no experts."""
        if n > self.first_dense:
            return dataclasses.replace(self, n_layers=n)
        return dataclasses.replace(self, n_layers=n, n_experts=0,
                                   **{k: MOE_DEFAULTS[k] for k in MOE_OPTIONS})

    @property
    def expert_d_ff(self) -> int:
        """Each expert's hidden width (the dense MLP's when moe_d_ff is 0)."""
        return self.moe_d_ff or self.d_ff

    @property
    def moe_layers(self) -> int:  # blocks that hold the experts (0: a dense model)
        return (self.n_layers - self.first_dense) // self.moe_every if self.n_experts else 0

    @property
    def dense_layers(self) -> int:  # blocks with the dense MLP
        return self.n_layers - self.moe_layers

    @property
    def mlp_widths(self) -> list[int]:
        """The MLP widths tp must divide: the dense MLP's, each expert's, or both."""
        return sorted({w for w, n in ((self.d_ff, self.dense_layers),
                                      (self.expert_d_ff, self.moe_layers)) if n})

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def qk_dim(self) -> int:
        """The width of a head's q.k: head_dim, or latent attention's nope + rope parts."""
        return self.qk_nope_dim + self.qk_rope_dim if self.kv_lora_rank else self.head_dim

    @property
    def v_dim(self) -> int:
        """The width of a head's value (and of Wo's rows per head)."""
        return self.v_head_dim if self.kv_lora_rank else self.head_dim

    @property
    def kv_heads(self) -> int:
        """Heads of k and v: n_kv_heads, or n_heads for plain multi-head attention."""
        return self.n_kv_heads or self.n_heads

    @property
    def family(self) -> Family:
        """How a block computes beyond its shapes (what the pure functions of
        jaxscale.model.block take)."""
        return Family(self.norm, self.mlp, self.position, self.rope_theta, self.rope_scaling,
                      self.norm_eps, self.kv_heads, top_k=self.top_k,
                      capacity_factor=self.capacity_factor,
                      router_weights=(self.router_aux_weight, self.router_z_weight))


MOE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                if f.name in MOE_OPTIONS}
CHOICES = {"norm": ("layernorm", "rmsnorm"), "mlp": ("gelu", "swiglu"),
           "position": ("learned", "rope")}


def _garden(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=len(garden.VOCAB), seq_len=64, **kw)


LLAMA = dict(norm="rmsnorm", mlp="swiglu", position="rope", tied_head=False, bias=False)


def _llama(vocab: int, seq: int, d: int, layers: int, heads: int, kv: int, ff: int,
           theta: float) -> ModelConfig:
    """A published Llama shape (its config.json's hidden_size, num_hidden_layers, ...)."""
    return ModelConfig(vocab_size=vocab, seq_len=seq, d_model=d, n_layers=layers,
                       n_heads=heads, n_kv_heads=kv, d_ff=ff, rope_theta=theta, **LLAMA)


def _latent(q_lora: int, kv_lora: int, nope: int, rope: int, v: int) -> dict:
    return dict(q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_nope_dim=nope,
                qk_rope_dim=rope, v_head_dim=v)


def _deepseek(vocab: int, d: int, layers: int, heads: int, ff: int, experts: int,
              top_k: int, expert_ff: int, dense: int, latent: dict, shared: int = 1):
    """A published DeepSeek shape (config.json's hidden_size, ..., first_k_dense_replace)."""
    return ModelConfig(vocab_size=vocab, seq_len=4096, d_model=d, n_layers=layers,
                       n_heads=heads, d_ff=ff, n_experts=experts, top_k=top_k,
                       moe_d_ff=expert_ff, n_shared_experts=shared, first_dense=dense,
                       norm_eps=1e-6, **latent, **LLAMA)


# Presets. tiny and small train here on CPU; the 1B-class ones are for GPU/TPU and are only
# ever built abstractly on CPU (jax.eval_shape), e.g. to size memory.
PRESETS: dict[str, ModelConfig] = {
    "tiny": _garden(d_model=32, n_layers=2, n_heads=4, d_ff=128),
    # still tiny, but with 8 layers and 8 heads: tp, pp up to 8 and interleaving (pp=4, v=2)
    "tiny8": _garden(d_model=32, n_layers=8, n_heads=8, d_ff=128),
    "small": _garden(d_model=256, n_layers=4, n_heads=8, d_ff=1024),
    # one GPU, minutes: GPT-2-medium's shape (302M matmul parameters) on packed garden rows
    # of 1,024 tokens (garden.pack), the vocabulary padded to 128 for the tensor cores
    "mid": ModelConfig(vocab_size=128, seq_len=1024, d_model=1024, n_layers=24,
                       n_heads=16, d_ff=4096),
    # tiny's shape on packed rows of 1,024 tokens (about 45 documents each), attention
    # masked to documents: long enough for context parallelism to split on CPU
    "long": ModelConfig(vocab_size=len(garden.VOCAB), seq_len=1024, d_model=32, n_layers=2,
                        n_heads=4, d_ff=128, document_mask=True),
    "1b": ModelConfig(vocab_size=32000, seq_len=2048, d_model=2048, n_layers=18,
                      n_heads=16, d_ff=8192),
    "7b": ModelConfig(vocab_size=32000, seq_len=4096, d_model=4096, n_layers=32,
                      n_heads=32, d_ff=16384),
    # the Llama family on the garden corpus: tiny's and small's sizes, two kv heads each
    # (tiny-llama: 2 query heads per kv head; small-llama: 4), d_ff as SwiGLU's 8/3 d
    # rounded to a multiple of 32
    "tiny-llama": _garden(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96,
                          **LLAMA),
    "small-llama": _garden(d_model=256, n_layers=4, n_heads=8, n_kv_heads=2, d_ff=704,
                           **LLAMA),
    # published shapes (Meta's config.json files), built abstractly on CPU. Llama 3's
    # 405B is Llama 3.1's (its seq_len here: the 8,192 of pre-training)
    "llama2-7b": _llama(32000, 4096, 4096, 32, 32, 32, 11008, 1e4),
    "llama2-70b": _llama(32000, 4096, 8192, 80, 64, 8, 28672, 1e4),
    "llama3-8b": _llama(128256, 8192, 4096, 32, 32, 8, 14336, 5e5),
    "llama3-70b": _llama(128256, 8192, 8192, 80, 64, 8, 28672, 5e5),
    "llama3-405b": _llama(128256, 8192, 16384, 126, 128, 8, 53248, 5e5),
    # mixtures of experts: tiny-llama's attention, 8 SwiGLU experts of width 64, top-2;
    # tiny-switch: 4 blocks, experts (top-1, Switch's) in every second (both train here);
    # Mixtral 8x7B's shape and router loss (config.json's router_aux_loss_coef 0.02 is
    # jaxscale's 0.02 x 2 / 32 per layer, hf_config; no z-loss)
    "tiny-moe": _garden(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64,
                        n_experts=8, top_k=2, **LLAMA),
    "tiny-switch": _garden(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=64,
                           n_experts=8, top_k=1, moe_every=2, **LLAMA),
    "mixtral-8x7b": dataclasses.replace(_llama(32000, 4096, 4096, 32, 32, 8, 14336, 1e6),
                                        n_experts=8, top_k=2, router_aux_weight=0.02 * 2 / 32,
                                        router_z_weight=0.0),
    # DeepSeek's design at garden size: latent attention (kv latent 16, q latent 16, heads
    # of 8 + 4 rotated q.k dimensions and 8 value ones), the first block dense, then 8
    # routed experts (top-2) beside one shared expert
    "tiny-deepseek": _garden(d_model=32, n_layers=3, n_heads=4, d_ff=96, n_experts=8,
                             top_k=2, moe_d_ff=32, n_shared_experts=1, first_dense=1,
                             **_latent(16, 16, 8, 4, 8), **LLAMA),
    # published shapes (config.json): DeepSeek-V3 (671B, 37B active; its pre-training
    # context of 4,096 tokens, the multi-token-prediction module left out) and V2-Lite
    # (15.7B, 2.4B active; no q latent). Their routers are jaxscale's softmax top-k with
    # Switch's loss, not DeepSeek's (sigmoid scores, group-limited top-k, bias balancing)
    "deepseek-v3": _deepseek(129280, 7168, 61, 128, 18432, 256, 8, 2048, 3,
                             _latent(1536, 512, 128, 64, 128)),
    "deepseek-v2-lite": _deepseek(102400, 2048, 27, 16, 10944, 64, 6, 1408, 1,
                                  _latent(0, 512, 128, 64, 128), shared=2),
}


# the ones small enough to train on a laptop's CPU
CPU_PRESETS = ("tiny", "tiny8", "small", "long", "tiny-llama", "small-llama", "tiny-moe",
               "tiny-switch", "tiny-deepseek")


def is_file(name: str) -> bool:
    """Whether a model name is a Hugging Face config.json (a path) rather than a preset."""
    return name.endswith(".json")


def preset(name: str) -> ModelConfig:
    """The ModelConfig called `name`, or read from a Hugging Face config.json when `name` is
    a path ending in .json (jaxscale.model.hf_config); a clear error lists the valid names."""
    if is_file(name):
        try:
            return ModelConfig(**hf_config.read(name))
        except (hf_config.HFConfigError, ModelConfigError) as e:
            raise ModelConfigError(str(e)) from None
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model {name!r}; choose from {', '.join(PRESETS)}, "
                               "or give a Hugging Face config.json")
    return PRESETS[name]


def check_platform(name: str, platform: str) -> None:
    """Refuse to run a GPU/TPU-sized model on CPU devices, before anything is built: a
    preset not in CPU_PRESETS, or a config.json bigger than the biggest of them."""
    if is_file(name):
        biggest = max(param_count(PRESETS[n]) for n in CPU_PRESETS)
        too_big = param_count(preset(name)) > biggest
    else:
        too_big = name not in CPU_PRESETS
    if platform == "cpu" and too_big:
        raise ModelConfigError(
            f"model {name!r} is sized for GPU/TPU; on cpu devices use one of "
            f"{', '.join(CPU_PRESETS)} (or --platform gpu on a GPU machine)")
