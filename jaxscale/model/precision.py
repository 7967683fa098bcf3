"""Mixed-precision policies: in which dtype the working parameters live (and so the forward
and backward pass compute), whether an FP32 master copy receives the updates, and how the
loss is scaled. The step that applies a policy is `parallel.step.make_step`; the formats
themselves are `model.formats`.
"""
from __future__ import annotations

from dataclasses import dataclass

from jaxscale.model import fp8_history
from jaxscale.model.formats import PrecisionError, dtype_of


@dataclass(frozen=True)
class Policy:
    """Where each training quantity lives, and how the loss is scaled."""

    name: str
    param_dtype: str  # working parameters; the forward and backward pass compute in it
    master_weights: bool  # an fp32 copy receives the updates (and the optimizer state is fp32)
    loss_scale: str = "none"  # none | static | dynamic
    initial_scale: float = 2.0**15
    growth_interval: int = 2000  # dynamic: finite steps in a row before doubling the scale
    matmul: str = "native"  # how a block's matrix multiplies compute (jaxscale.model.fp8)
    fp8_history: int = 0  # fp8-delayed: steps of amax history (jaxscale.model.fp8_history)
    fp8_head: bool = False  # fp8-delayed: the output head keeps a history too

    def __post_init__(self):
        dtype_of(self.param_dtype)
        if self.loss_scale not in ("none", "static", "dynamic"):
            raise PrecisionError(f"unknown loss scaling {self.loss_scale!r}; choose from none, "
                                 "static, dynamic")
        if self.matmul == "fp8-delayed" and self.fp8_history < 1:
            raise PrecisionError(f"fp8-delayed needs an amax history of at least one step, "
                                 f"got {self.fp8_history}")
        if not self.initial_scale > 0 or self.growth_interval < 1:
            raise PrecisionError("initial_scale must be > 0 and growth_interval >= 1")

    @property
    def compute_dtype(self):
        return dtype_of(self.param_dtype)

    def bytes_per_param(self, optimizer_moments: int = 2,
                        moment_bytes: int | None = None) -> dict[str, int]:
        """Closed form: working params + gradients + master + optimizer moments (Adam: 2),
        each moment `moment_bytes` (default: as the updated copy, fp32 with a master;
        2 for moments kept in bf16, jaxscale.model.optim_states)."""
        w = self.compute_dtype.itemsize
        state = 4 if self.master_weights else w  # the moments live with the updated copy
        return {"params": w, "grads": w, "master": 4 if self.master_weights else 0,
                "optimizer": optimizer_moments * (moment_bytes or state)}


POLICIES = {
    "fp32": Policy("fp32", "float32", master_weights=False),
    "bf16": Policy("bf16", "bfloat16", master_weights=True),
    "fp16": Policy("fp16", "float16", master_weights=True, loss_scale="dynamic"),
    "bf16-pure": Policy("bf16-pure", "bfloat16", master_weights=False),
    "fp8": Policy("fp8", "bfloat16", master_weights=True, matmul="fp8"),
    "fp8-delayed": Policy("fp8-delayed", "bfloat16", master_weights=True, matmul="fp8-delayed",
                          fp8_history=fp8_history.HISTORY),
    "fp8-block": Policy("fp8-block", "bfloat16", master_weights=True, matmul="fp8-block"),
}
POLICY_HELP = {
    "fp32": "everything in float32 (the reference)",
    "bf16": "bfloat16 weights, activations and gradients; fp32 master weights and optimizer state",
    "fp16": "float16 likewise, with fp32 master weights and dynamic loss scaling",
    "bf16-pure": "bfloat16 everywhere, optimizer state included; no master weights",
    "fp8": "bf16, with the blocks' matrix multiplies in FP8 (E4M3 forward, E5M2 gradients, "
           "per-tensor current scaling)",
    "fp8-delayed": "fp8 with each tensor's scale from the largest amax of its last steps "
                   "(Transformer Engine's delayed scaling; --fp8-history steps)",
    "fp8-block": "fp8 with a scale per tile (DeepSeek-V3: 1x128 activations and gradients, "
                 "128x128 weights)",
}


def policy(name: str) -> Policy:
    if name not in POLICIES:
        raise PrecisionError(f"unknown precision policy {name!r}; choose from {', '.join(POLICIES)}")
    return POLICIES[name]
