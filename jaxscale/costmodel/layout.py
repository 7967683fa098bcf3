"""A parallel layout and its memory per device: the one place the planner's memory comes from.

A `Layout` names every degree jaxscale's Plan has (dp x pp x cp x tp, ZeRO, sequence
parallelism, the pipeline schedule with v chunks per device, micro-batches, recomputation).
`memory` adds, for the busiest device (the first pipeline stage):

  model states     Psi / (tp x pp) parameters under ZeRO over dp x cp (the devices that
                   hold the same weights) with the byte budget (costmodel.states), +
                   ZeRO-3's gathered layer (one block's weights of this tp shard, in the
                   budget's weight bytes) when dp x cp > 1
  activations      costmodel.activations: per layer x layers on the stage x micro-batches
                   in flight under the schedule, + the layer being recomputed (full)
  cpu              what optimizer offload moves to host memory (not in the device total)

Embeddings and the output head are counted in Psi (their states) but not as activations,
as in Korthikanti et al.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from jaxscale.costmodel import activations as A
from jaxscale.costmodel import schedule as schedule_model
from jaxscale.costmodel import states as S
from jaxscale.costmodel.shape import ShapeError, Transformer


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    virtual: int = 1  # chunks per device (interleaved 1F1B when > 1)
    sequence_parallel: bool = False
    zero: int = 0
    recompute: str = "none"
    micro_batch: int = 1  # sequences per micro-batch
    zero_bubble: str = ""  # a zero-bubble schedule: zb-h1 or zb-h2 (v = 1), zbv (v = 2)

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def schedule(self) -> str:
        return self.zero_bubble or ("interleaved" if self.virtual > 1 else "1f1b")

    def micro_batches(self, batch: int) -> int:
        """Micro-batches per replica and step for a global batch of `batch` sequences."""
        return batch // (self.dp * self.micro_batch)

    def name(self) -> str:
        """'dp2 tp8 pp4 v2 sp ZeRO-1 selective mb1': the degrees above 1, then the options."""
        parts = [f"{k}{v}" for k, v in (("dp", self.dp), ("tp", self.tp), ("pp", self.pp),
                                         ("cp", self.cp)) if v > 1] or ["1 device"]
        parts += [f"v{self.virtual}"] * (self.virtual > 1) + [self.zero_bubble] * bool(
            self.zero_bubble) + ["sp"] * self.sequence_parallel
        parts += [f"ZeRO-{self.zero}"] * (self.zero > 0)
        parts += [self.recompute] * (self.recompute != "none") + [f"mb{self.micro_batch}"]
        return " ".join(parts)

    def as_dict(self) -> dict:
        return {**asdict(self), "schedule": self.schedule, "devices": self.devices}


def check(shape: Transformer, lay: Layout, batch: int) -> None:
    """Refuse a layout the model cannot be cut into, naming the degree and the dimension."""
    for name in ("dp", "tp", "pp", "cp", "virtual", "micro_batch"):
        if getattr(lay, name) < 1:
            raise ShapeError(f"{name} must be >= 1, got {getattr(lay, name)}")
    if shape.heads % lay.tp or shape.kv % lay.tp:
        raise ShapeError(f"tp {lay.tp} does not divide the {shape.heads} heads"
                         + (f" and {shape.kv} kv heads" if shape.kv != shape.heads else ""))
    if shape.layers % (lay.pp * lay.virtual):
        raise ShapeError(f"pp x virtual = {lay.pp * lay.virtual} does not divide the "
                         f"{shape.layers} layers")
    if shape.seq % lay.cp:
        raise ShapeError(f"cp {lay.cp} does not divide the sequence length {shape.seq}")
    if batch % (lay.dp * lay.micro_batch):
        raise ShapeError(f"dp x micro-batch = {lay.dp * lay.micro_batch} does not divide the "
                         f"batch {batch}")
    if lay.sequence_parallel and lay.tp == 1:
        raise ShapeError("sequence parallelism splits the tp group: it needs tp >= 2")
    chunks = schedule_model.ZERO_BUBBLE.get(lay.zero_bubble)
    if lay.zero_bubble and (lay.pp == 1 or lay.virtual != chunks):
        raise ShapeError(f"zero_bubble {lay.zero_bubble!r} is one of zb-h1, zb-h2 (v = 1) or "
                         f"zbv (v = 2), with pp >= 2; got pp={lay.pp}, v={lay.virtual}")


def memory(shape: Transformer, lay: Layout, batch: int, budget: str = "mixed-adam",
           offload: str = "none", flash_attention: bool = False,
           dropout: bool = True) -> dict[str, float]:
    """Bytes on the busiest device: states, gathered layer, activations; and the cpu's."""
    check(shape, lay, batch)
    st = S.state_memory(shape.params(), lay.dp * lay.cp, lay.zero, budget, offload,
                        model_parallel=lay.tp * lay.pp,
                        largest_layer=shape.layer_params() / lay.tp)
    act = A.activation_memory(shape, lay.micro_batch, lay.tp, lay.sequence_parallel, lay.cp,
                              lay.pp, lay.micro_batches(batch), lay.schedule, lay.virtual,
                              lay.recompute, flash_attention, dropout)
    out = {"params": st["params"], "grads": st["grads"], "optimizer": st["optimizer"],
           "gathered_layer": st["gathered_layer"], "activations": act["total"],
           "activations_stored": act["stored"], "working_layer": act["working_layer"],
           "in_flight": act["in_flight"], "cpu": st["cpu"]}
    out["states"] = st["total"]
    out["total"] = st["total"] + act["total"]
    return out
