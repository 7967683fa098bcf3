"""Layouts: where each piece of the training state lives, and how it returns to the
canonical form (whole tensors in the model's own layer order) that checkpoints hold.

`Replicated` is the base: everything whole on every device. Sharded layouts (ZeRO's flat
slices in `parallel.zero`, the mesh layouts in `parallel.hybrid`) override its methods.
"""
from __future__ import annotations

import optax


class Replicated:
    """Where the optimizer's copy of the parameters lives: here, whole on every device.

    A sharded layout (ZeRO, `jaxscale.parallel.zero`) overrides these: `target` picks the
    slice of the working parameters a device updates, `params` rebuilds the working
    parameters from the updated slices, and the reductions make per-slice flags and sums
    global.
    """

    def target(self, params):
        return params

    def params(self, updated):
        return updated

    def all_finite(self, flag):
        return flag

    def global_sum(self, x):
        return x

    def norm(self, tree):
        return optax.tree.norm(tree)

    # The canonical form (jaxscale.parallel.canonical): whole tensors in the model's own
    # layer order, whatever the plan. A layout that stores a tensor otherwise converts it
    # here, one tensor at a time, on global arrays under jit: the working parameters
    # (`params_*`) and the optimizer's copy (`copy_*`: master weights and every
    # parameter-shaped leaf of the optimizer state). `info` is the tensor's ParamInfo.
    def canonical_spec(self, info):
        """The PartitionSpec of a whole tensor this layout converts from and to on its own
        devices; None: spread it over all devices (parallel.canonical.canonical_sharding)."""
        return None

    def params_to_canonical(self, x, info):
        return x

    def params_from_canonical(self, x, info):
        return x

    def copy_to_canonical(self, x, info):
        return x

    def copy_from_canonical(self, x, info):
        return x
