"""The model's shape (`ModelConfig`), the named presets, and its closed-form parameter count.

Plain data: building the model from a config is `model.transformer`'s job.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from jaxscale import garden


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

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "document_mask" and v <= 0:
                raise ModelConfigError(f"{f.name} must be positive, got {v}")
        if self.d_model % self.n_heads:
            raise ModelConfigError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def _garden(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=len(garden.VOCAB), seq_len=64, **kw)


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
}


CPU_PRESETS = ("tiny", "tiny8", "small", "long")  # the ones small enough to train on a laptop's CPU


def preset(name: str) -> ModelConfig:
    """The ModelConfig called `name`; a clear error lists the valid names."""
    if name not in PRESETS:
        raise ModelConfigError(f"unknown model {name!r}; choose from {', '.join(PRESETS)}")
    return PRESETS[name]


def check_platform(name: str, platform: str) -> None:
    """Refuse to run a GPU/TPU-sized preset on CPU devices, before anything is built."""
    if platform == "cpu" and name not in CPU_PRESETS:
        raise ModelConfigError(
            f"model {name!r} is sized for GPU/TPU; on cpu devices use one of "
            f"{', '.join(CPU_PRESETS)} (or --platform gpu on a GPU machine)")


def param_count(cfg: ModelConfig) -> int:
    """Closed-form number of parameters (tied output head)."""
    d, f, v, t = cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.seq_len
    attention = 4 * d * d + 4 * d  # Wq, Wk, Wv, Wo and their biases
    mlp = 2 * d * f + f + d
    norms = 2 * 2 * d  # two LayerNorms, scale and bias
    return v * d + t * d + cfg.n_layers * (attention + mlp + norms) + 2 * d
