"""A parallel layout and its memory per device: the one place the planner's memory comes from.

A `Layout` names every degree jaxscale's Plan has (dp x pp x cp x tp, ZeRO, sequence
parallelism, the pipeline schedule with v chunks per device, micro-batches, recomputation).
`memory` adds, for the busiest device (the first pipeline stage):

  model states     Psi / (tp x pp) parameters under ZeRO over dp x cp (the devices that
                   hold the same weights) with the byte budget (costmodel.states), +
                   ZeRO-3's gathered layer (one block's weights of this tp shard, in the
                   budget's weight bytes) when dp x cp > 1. A mixture of experts' experts
                   are split over ep too, and ZeRO-sharded over dp x cp; the rest is held
                   by dp x cp x ep devices alike (ep splits the batch outside the experts)
                   and ZeRO-sharded over all of them (DeepSpeed-MoE; jaxscale's ZeRO
                   shards over dp only)
  activations      costmodel.activations: per layer x layers on the stage x micro-batches
                   in flight under the schedule, + the layer being recomputed (full); a
                   mixture of experts' as the dense MLP of its top_k and shared experts
                   (capacity factor 1, the router's probabilities left out; interleaved,
                   the blocks' mean width; jaxscale's dropless default pads every expert
                   to a device's tokens, E / top_k times more)
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
    ep: int = 1  # expert parallel: a mixture of experts' experts split over ep devices

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def schedule(self) -> str:
        return self.zero_bubble or ("interleaved" if self.virtual > 1 else "1f1b")

    def micro_batches(self, batch: int) -> int:
        """Micro-batches per replica and step for a global batch of `batch` sequences."""
        return batch // (self.dp * self.ep * self.micro_batch)

    def name(self) -> str:
        """'dp2 tp8 pp4 v2 sp ZeRO-1 selective mb1': the degrees above 1, then the options."""
        parts = [f"{k}{v}" for k, v in (("dp", self.dp), ("ep", self.ep), ("tp", self.tp),
                                         ("pp", self.pp), ("cp", self.cp)) if v > 1] or ["1 device"]
        parts += [f"v{self.virtual}"] * (self.virtual > 1) + [self.zero_bubble] * bool(
            self.zero_bubble) + ["sp"] * self.sequence_parallel
        parts += [f"ZeRO-{self.zero}"] * (self.zero > 0)
        parts += [self.recompute] * (self.recompute != "none") + [f"mb{self.micro_batch}"]
        return " ".join(parts)

    def as_dict(self) -> dict:
        return {**asdict(self), "schedule": self.schedule, "devices": self.devices}


def check(shape: Transformer, lay: Layout, batch: int) -> None:
    """Refuse a layout the model cannot be cut into, naming the degree and the dimension."""
    for name in ("dp", "tp", "pp", "cp", "ep", "virtual", "micro_batch"):
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
    if lay.ep > 1 and (not shape.experts or shape.experts % lay.ep):
        raise ShapeError(f"ep {lay.ep} must divide the model's experts ({shape.experts})")
    if batch % (lay.dp * lay.ep * lay.micro_batch):
        raise ShapeError(f"dp x{' ep x' if lay.ep > 1 else ''} micro-batch = "
                         f"{lay.dp * lay.ep * lay.micro_batch} does not divide the batch {batch}")
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
    st = _states(shape, lay, budget, offload)
    act = A.activation_memory(shape.active(), lay.micro_batch, lay.tp, lay.sequence_parallel,
                              lay.cp,
                              lay.pp, lay.micro_batches(batch), lay.schedule, lay.virtual,
                              lay.recompute, flash_attention, dropout)
    out = {"params": st["params"], "grads": st["grads"], "optimizer": st["optimizer"],
           "gathered_layer": st["gathered_layer"], "activations": act["total"],
           "activations_stored": act["stored"], "working_layer": act["working_layer"],
           "in_flight": act["in_flight"], "cpu": st["cpu"]}
    out["states"] = st["total"]
    out["total"] = st["total"] + act["total"]
    return out


def _states(shape: Transformer, lay: Layout, budget: str, offload: str) -> dict:
    """The states of the parameters a device holds: one budget for a dense model; for a
    mixture of experts, its experts' (split over ep x tp x pp, ZeRO over dp x cp) plus the
    rest's (split over tp x pp, ZeRO over dp x cp x ep)."""
    experts = shape.expert_params()
    per_layer = experts / max(shape.moe_layers, 1)  # one layer's experts
    dense = shape.dense_layer_params() if shape.moe_layers < shape.layers else 0
    largest = max(shape.layer_params() - per_layer, dense)  # an expert block's rest, a dense
    rest = S.state_memory(shape.params() - experts, lay.dp * lay.cp * lay.ep, lay.zero, budget,
                          offload, model_parallel=lay.tp * lay.pp,
                          largest_layer=largest / lay.tp)
    if not experts:
        return rest
    mine = S.state_memory(experts, lay.dp * lay.cp, lay.zero, budget, offload,
                          model_parallel=lay.ep * lay.tp * lay.pp,
                          largest_layer=per_layer / (lay.ep * lay.tp))
    return {k: rest[k] + mine[k] for k in rest}
