"""What a checkpoint records about its run: the JSON item beside the tensors (`run_meta`)
and the versions of the packages that wrote it (`versions`).

The JSON is read back as plain files by jaxscale.training.checkpoint.store (`read_meta`,
`listing`, `check_compatible`); writing it needs the model's presets and JAX, so it lives
here and store never starts JAX.
"""
from __future__ import annotations

from dataclasses import asdict

import jax

from jaxscale import __version__
from jaxscale.model.config import preset


def run_meta(cfg, plan, samples_seen: int, losses, norms, val_curve, tokens,
             model=None, guard: dict | None = None) -> dict:
    """The JSON item beside a checkpoint's tensors: the run (a TrainConfig), its plan, the
    model, the data position (the global sample index: mesh-independent), the metrics so
    far, the spike guard's state (jaxscale.training.spikes.GuardState). (There is no random state
    to add: see jaxscale.training.checkpoint.manager.)"""
    return {
        "config": asdict(cfg), "plan": plan.as_dict(), "plan_layout": plan.layout(),
        "model": asdict(model or preset(cfg.model)),  # `model`: a ModelConfig, not a preset
        "data": {"samples_seen": samples_seen, "batch_size": cfg.batch_size,
                 "order": "a shuffle of (seed, epoch) per epoch (jaxscale.data.sampler)"},
        "random": "the seed alone: batch order is a function of (seed, sample index), and "
                  "the model has no dropout",
        "metrics": {"loss_curve": list(losses), "grad_norms": list(norms),
                    "val_curve": [list(v) for v in val_curve], "tokens_seen": tokens},
        "guard": guard or {}, "processes": jax.process_count(), "devices": plan.n_devices}


def versions() -> dict[str, str]:
    """The versions of jaxscale and of the packages a checkpoint's numbers depend on."""
    import flax  # here, not at the top: Flax and Orbax take a while to import
    import optax
    import orbax.checkpoint as ocp

    return {"jaxscale": __version__, "jax": jax.__version__, "jaxlib": jax.lib.__version__,
            "flax": flax.__version__, "optax": optax.__version__, "orbax": ocp.__version__}
