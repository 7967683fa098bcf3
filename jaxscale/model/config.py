"""The model's shape (`ModelConfig`), the named presets, and its closed-form parameter count.

Plain data: building the model from a config is `model.transformer`'s job. One model, two
families: GPT-2's blocks (LayerNorm with biases, GELU MLP, learned positions, the output
head tied to the embedding), the garden presets' default, and Llama's (RMSNorm, SwiGLU MLP,
rotary positions, grouped-query attention, an untied head, no biases). Each difference is
its own field, so any mix is a model too. A mixture of experts (`n_experts` > 0) puts
routed experts in the MLP's place of every block, or every `moe_every`-th (model.moe).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxscale import garden
from jaxscale.model import hf_config
from jaxscale.model.family import GPT2, Family  # noqa: F401 (the model's own names)


class ModelConfigError(ValueError):
    """A model configuration is inconsistent."""


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
        self._check_experts()

    def _check_experts(self) -> None:
        e, k, cf = self.n_experts, self.top_k, self.capacity_factor
        for name in ("n_experts", "moe_d_ff", "n_shared_experts", "router_aux_weight",
                     "router_z_weight"):
            if getattr(self, name) < 0:
                raise ModelConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not e:
            moe = [f"{n}={getattr(self, n)}" for n in MOE_OPTIONS
                   if getattr(self, n) != MOE_DEFAULTS[n]]
            if moe:
                raise ModelConfigError(f"{', '.join(moe)} configure experts, but the model "
                                       "has none; set n_experts > 0 (e.g. the tiny-moe preset)")
            return
        if not 1 <= k <= e:
            raise ModelConfigError(f"top_k={k} experts per token out of n_experts={e}; "
                                   f"choose top_k from 1 to {e}")
        n, L = self.moe_every, self.n_layers
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or L % n:
            raise ModelConfigError(f"moe_every={n} must divide n_layers={L} (every n-th block "
                                   f"holds the experts); choose from "
                                   f"{[m for m in range(1, L + 1) if L % m == 0]}")
        if cf is not None and (not isinstance(cf, (int, float)) or isinstance(cf, bool)
                               or not cf > 0):
            raise ModelConfigError(f"capacity_factor must be > 0 (1.0: each expert takes its "
                                   f"fair share of tokens), or None for dropless; got {cf}")

    @property
    def expert_d_ff(self) -> int:
        """Each expert's hidden width (the dense MLP's when moe_d_ff is 0)."""
        return self.moe_d_ff or self.d_ff

    @property
    def moe_layers(self) -> int:  # blocks that hold the experts (0: a dense model)
        return self.n_layers // self.moe_every if self.n_experts else 0

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


MOE_OPTIONS = ("top_k", "moe_d_ff", "n_shared_experts", "capacity_factor", "moe_every")
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
}


# the ones small enough to train on a laptop's CPU
CPU_PRESETS = ("tiny", "tiny8", "small", "long", "tiny-llama", "small-llama", "tiny-moe",
               "tiny-switch")


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


def param_count(cfg: ModelConfig, active: bool = False) -> int:
    """Closed-form number of parameters, every tensor counted (biases and norms too).
    `active`: those one token uses (a mixture of experts: top_k of its routed experts)."""
    d, v, t = cfg.d_model, cfg.vocab_size, cfg.seq_len
    kv = cfg.kv_heads * cfg.head_dim  # the width of k and of v
    b = int(cfg.bias)
    attention = 2 * d * d + 2 * d * kv + b * (2 * d + 2 * kv)  # Wq, Wo, Wk, Wv (+ biases)

    def mlp(f, bias=b):  # one MLP of hidden width f
        n = 3 if cfg.mlp == "swiglu" else 2  # (SwiGLU: b1 and b3, f each)
        return n * d * f + bias * ((n - 1) * f + d)
    used = cfg.top_k if active else cfg.n_experts
    # the router, the routed experts, the shared ones (no biases); 0 layers if dense
    experts = d * cfg.n_experts + mlp(cfg.expert_d_ff * (used + cfg.n_shared_experts), 0)
    ffn = cfg.moe_layers * experts + cfg.dense_layers * mlp(cfg.d_ff)
    norm = d * (1 + (cfg.norm == "layernorm" and cfg.bias))  # a scale (+ a bias)
    embeddings = v * d * (1 if cfg.tied_head else 2) + (t * d if cfg.position == "learned" else 0)
    return embeddings + cfg.n_layers * (attention + 2 * norm) + ffn + norm
