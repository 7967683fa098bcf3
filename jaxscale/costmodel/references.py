"""Published model shapes, and the one nearest a parameter count (`jaxscale plan --params`)."""
from __future__ import annotations

import math

from jaxscale import costmodel as cm
from jaxscale.costmodel.shape import Transformer

# Published shapes and counts. GPT-style models: 4h MLP, tied embeddings, vocab 51,200 as in
# Narayanan et al. and Korthikanti et al.; Llama-2: SwiGLU, untied, GQA for 70B.
REFERENCES: dict[str, tuple[float, Transformer]] = {
    "Llama-2-7B": (6.74e9, Transformer(32, 4096, 32, 4096, ffn=11008, vocab=32000,
                                        swiglu=True, tied=False)),
    "Llama-2-13B": (13.0e9, Transformer(40, 5120, 40, 4096, ffn=13824, vocab=32000,
                                         swiglu=True, tied=False)),
    "Llama-2-70B": (69e9, Transformer(80, 8192, 64, 4096, ffn=28672, kv_heads=8, vocab=32000,
                                       swiglu=True, tied=False)),
    "Korthikanti 22B": (22e9, Transformer(48, 6144, 64, 2048, vocab=51200)),
    "GPT-3 175B": (175e9, Transformer(96, 12288, 96, 2048, vocab=51200)),
    "MT-NLG 530B": (530e9, Transformer(105, 20480, 128, 2048, vocab=51200)),
    "Megatron 1T": (1e12, Transformer(128, 25600, 160, 2048, vocab=51200)),
}

def describe_reference(name: str) -> str:
    """'Llama-2-7B (32 layers, h = 4096, 32 heads, 6.74e+09 parameters)'."""
    params, s = REFERENCES[name]
    return f"{name} ({s.layers} layers, h = {s.hidden}, {s.heads} heads, {params:.3g} parameters)"


NEAREST_WITHIN = 2.0  # a reference more than this factor from the request is refused


def nearest_reference(params: float) -> tuple[str, Transformer]:
    """The reference model whose parameter count is nearest on a log scale; CostModelError
    if even that one is more than NEAREST_WITHIN times away (a 1e6-parameter request would
    otherwise be planned as a 7e9 one)."""
    name = min(REFERENCES, key=lambda k: abs(math.log(REFERENCES[k][0] / params)))
    count = REFERENCES[name][0]
    if max(count / params, params / count) > NEAREST_WITHIN:
        known = ", ".join(f"{k} ({n:.3g})" for k, (n, _) in REFERENCES.items())
        raise cm.CostModelError(
            f"--params {params:.3g}: the nearest published shape, {name} ({count:.3g}), is "
            f"{max(count / params, params / count):,.3g}x away; give --params within "
            f"{NEAREST_WITHIN:g}x of one of {known}, or the shape itself (--layers "
            "--hidden --heads) or --model PRESET")
    return name, REFERENCES[name][1]
