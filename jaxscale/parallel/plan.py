"""The Plan: a parallel training strategy as data, and the one function that builds its step.

    Plan()                                the single-device reference
    Plan(dp=8)                            data parallel over 8 devices
    Plan(dp=8, micro_batches=4)           ... accumulating 4 micro-batches per step

    Plan(dp=8, zero_stage=3)              ZeRO-3 over the 8 data-parallel devices
    Plan(dp=2, tp=2, pp=2, micro_batches=4, schedule="1f1b", zero_stage=1)   3-D
    Plan(dp=2, cp=2, tp=2)                ... the sequence split over cp (ring attention)
    Plan(dp=2, ep=2)                      a mixture of experts' experts split over ep

Every field is validated before anything compiles. `parallel.build.build_train_step(
model_cfg, plan, optimizer)` returns (init, step); the training loop never branches on the
strategy. Tensor and pipeline parallelism, ZeRO and recomputation are fields of the same
Plan.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace


from jaxscale.model import attention, fp8, fp8_history, precision, transformer as modellib
from jaxscale.parallel import schedules as sched
from jaxscale.parallel.axes import CP, DP, EP, TP
from jaxscale.runtime import mesh as meshlib

SCHEDULES = sched.SCHEDULES
REMAT_POLICIES = tuple(modellib.REMAT_POLICIES)


class PlanError(ValueError):
    """A Plan field is out of range or does not fit the batch or the devices."""


@dataclass(frozen=True)
class Plan:
    """How one training step is spread over devices."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: the sequence split over cp devices (ring attention)
    ep: int = 1  # expert parallel: the experts split over ep devices, the rows too (all-to-all)
    sequence_parallel: bool = False  # Megatron SP: LayerNorm/residual regions split over tp
    zero_stage: int = 0
    micro_batches: int = 1
    schedule: str = "1f1b"
    virtual: int = 1  # model chunks per pipeline device (interleaved schedule: >= 2)
    remat: str = "none"
    precision: str = "fp32"
    attention: str = "einsum"  # jaxscale.model.attention.KERNELS: einsum (the reference), xla,
    # cudnn, tpu-flash
    unroll: bool = False  # the layers written out instead of one scanned loop body
    fp8_block: int = fp8.BLOCK  # precision fp8-block: the tile length (model.fp8.blocks)
    fp8_head: bool = False  # an fp8 precision: the output head multiplies in FP8 too
    fp8_history: int = fp8_history.HISTORY  # precision fp8-delayed: the amax history's steps

    @property
    def n_devices(self) -> int:
        return self.dp * self.tp * self.pp * self.cp * self.ep

    @property
    def rows(self) -> int:
        """The devices the batch's rows are split over: dp x ep."""
        return self.dp * self.ep

    @property
    def mesh_shape(self) -> meshlib.MeshShape:
        return meshlib.MeshShape(dp=self.dp, pp=self.pp, tp=self.tp, cp=self.cp, ep=self.ep)

    @classmethod
    def from_mesh(cls, spec: str, **fields) -> "Plan":
        """A Plan whose axis sizes come from a mesh spec such as "dp=8"."""
        shape = meshlib.parse_mesh_spec(spec)
        return cls(dp=shape.dp, tp=shape.tp, pp=shape.pp, cp=shape.cp, ep=shape.ep, **fields)

    def validate(self, global_batch: int | None = None, n_devices: int | None = None) -> "Plan":
        """Raise PlanError naming the bad value and what would fit; return self if fine."""
        for name in ("dp", "tp", "pp", "cp", "ep", "micro_batches", "virtual"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PlanError(f"{name} must be a positive integer, got {v!r}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"unknown pipeline schedule {self.schedule!r}; choose from "
                            f"{', '.join(SCHEDULES)}")
        if self.remat not in REMAT_POLICIES:
            raise PlanError(f"unknown remat policy {self.remat!r}; choose from "
                            f"{', '.join(REMAT_POLICIES)}")
        if self.precision not in precision.POLICIES:
            raise PlanError(f"unknown precision policy {self.precision!r}; choose from "
                            f"{', '.join(precision.POLICIES)}")
        try:
            attention.check_kernel(self.attention,
                                   compute_dtype=precision.policy(self.precision).compute_dtype)
        except attention.KernelError as e:
            raise PlanError(f"{e} (precision {self.precision})") from None
        self._validate_fp8()
        for name in ("unroll", "sequence_parallel", "fp8_head"):
            if not isinstance(getattr(self, name), bool):
                raise PlanError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.sequence_parallel and self.tp < 2:
            raise PlanError(f"sequence parallelism splits the sequence over the tensor-parallel "
                            f"group, but tp={self.tp}; use tp >= 2 (e.g. --mesh dp=2,tp=2)")
        if self.sequence_parallel and self.pp > 1:
            raise PlanError(f"sequence parallelism runs with dp, tp and cp, not yet inside a "
                            f"pipeline (pp={self.pp}); use pp=1")
        if self.zero_stage and self.dp < 2:
            raise PlanError(f"ZeRO needs dp > 1 to shard over, got dp={self.dp} with "
                            f"zero_stage={self.zero_stage}; use e.g. --mesh dp=8")
        if n_devices is not None and self.n_devices != n_devices:
            raise PlanError(f"the plan's mesh {self.mesh_shape} needs {self.n_devices} devices "
                            f"but {n_devices} {'is' if n_devices == 1 else 'are'} available")
        if global_batch is not None and global_batch % (self.rows * self.micro_batches):
            split = "(dp x ep)" if self.ep > 1 else "dp"
            raise PlanError(
                f"global batch of {global_batch} documents is not divisible by {split} x "
                f"micro_batches = {self.rows} x {self.micro_batches}; use a batch that is a "
                f"multiple of {self.rows * self.micro_batches}")
        if self.pp > 1 or self.virtual > 1:
            try:
                sched.check_sizes(self.schedule, self.pp, self.micro_batches, self.virtual)
            except sched.ScheduleError as e:
                raise PlanError(str(e)) from None
        if self.pp > 1 and self.schedule in sched.SPLIT and self.zero_stage == 3:
            raise PlanError(f"{self.schedule} splits each backward into input and weight "
                            "gradients on whole weights; ZeRO-3 gathers them per unit: use "
                            "zero_stage 1 or 2 with it, or schedule=1f1b with ZeRO-3")
        if self.cp > 1 and self.pp > 1:
            raise PlanError(f"context parallelism (cp={self.cp}) runs with dp and tp, not yet "
                            f"inside a pipeline (pp={self.pp}); use pp=1")
        return self

    def _validate_fp8(self) -> None:
        recipe = precision.policy(self.precision).matmul
        block = self.fp8_block
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise PlanError(f"fp8_block must be a positive integer, got {block!r}")
        if block != Plan.fp8_block and recipe != "fp8-block":
            raise PlanError(f"fp8_block={block} sets the tile of precision fp8-block, but "
                            f"the precision is {self.precision}; use precision=fp8-block "
                            "(--precision fp8-block)")
        if self.fp8_head is True and recipe == "native":
            raise PlanError(f"fp8_head puts the output head under an FP8 recipe, but the "
                            f"precision {self.precision} has none; use precision=fp8, "
                            "fp8-delayed or fp8-block (--precision)")
        length = self.fp8_history
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise PlanError(f"fp8_history is the number of steps whose amaxes set the "
                            f"scales and must be a positive integer, got {length!r}")
        if length != Plan.fp8_history and recipe != "fp8-delayed":
            raise PlanError(f"fp8_history={length} sets the amax history of precision "
                            f"fp8-delayed, but the precision is {self.precision}; use "
                            "precision=fp8-delayed (--precision fp8-delayed)")

    def policy(self) -> precision.Policy:
        """The precision policy, with fp8-delayed's history options from this plan (the
        shape of the history a state holds: jaxscale.model.fp8_history)."""
        pol = precision.policy(self.precision)
        if pol.matmul != "fp8-delayed":
            return pol
        return replace(pol, fp8_history=self.fp8_history, fp8_head=self.fp8_head)

    def family(self, model_cfg):
        """How a block computes under this plan: the model's family, multiplying as the
        precision policy says (jaxscale.model.fp8), with its tile and head options; a
        mixture of experts learns where its tokens and experts live (jaxscale.model.moe):
        the axes that split the tokens (dp, and ep and cp), those that copy them (tp), ep."""
        family = replace(model_cfg.family, matmul=precision.policy(self.precision).matmul,
                         fp8_block=self.fp8_block, fp8_head=self.fp8_head)
        if not model_cfg.n_experts:
            return family
        tp = (TP,) if self.tp > 1 else ()
        return replace(family, token_axes=(DP,) + tuple(a for a in (EP, CP) if getattr(self, a) > 1),
                       copy_axes=() if self.sequence_parallel else tp,
                       shared_axes=tp if self.sequence_parallel else (),
                       ep_axis=EP if self.ep > 1 else None)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def parse(cls, layout: str) -> "Plan":
        """A Plan written out as KEY=VALUE pairs, e.g. "dp=2,tp=4,zero=1,remat=full,
        precision=bf16" (keys: see LAYOUT_KEYS; absent fields keep their defaults)."""
        fields: dict = {}
        for item in layout.split(","):
            key, sep, value = (part.strip() for part in item.partition("="))
            if not sep or not key or not value:
                raise PlanError(f"cannot read {item.strip()!r} in layout {layout!r}; expected "
                                f"KEY=VALUE with KEY in {', '.join(LAYOUT_KEYS)}")
            if key not in LAYOUT_KEYS:
                raise PlanError(f"unknown layout key {key!r} in {layout!r}; valid keys: "
                                f"{', '.join(LAYOUT_KEYS)}")
            field = LAYOUT_KEYS[key]
            if field in fields:
                raise PlanError(f"{key!r} given twice in layout {layout!r}")
            if field in ("schedule", "remat", "precision", "attention"):
                fields[field] = value
            elif field in ("unroll", "sequence_parallel", "fp8_head"):
                if value not in ("0", "1"):
                    raise PlanError(f"{key} must be 0 or 1, got {value!r} in {layout!r}")
                fields[field] = value == "1"
            elif value.isdigit():
                fields[field] = int(value)
            else:
                raise PlanError(f"{key} must be a non-negative integer, got {value!r} in "
                                f"{layout!r}")
        if fields.get("schedule") in sched.VEE:  # two chunks in a V unless written out
            fields.setdefault("virtual", 2)
        return cls(**fields).validate()

    def layout(self) -> str:
        """The inverse of `parse`: the fields that differ from the defaults."""
        default, keys = Plan(), {v: k for k, v in LAYOUT_KEYS.items()}
        def text(v):
            return str(int(v)) if isinstance(v, bool) else str(v)
        return ",".join(f"{keys[f]}={text(getattr(self, f))}" for f in LAYOUT_KEYS.values()
                        if getattr(self, f) != getattr(default, f)) or "dp=1"


def elastic_micro_batches(saved: Plan, plan: Plan, global_batch: int) -> int:
    """Micro-batches for `plan` that keep the global batch (tokens per step) of a run saved
    under `saved`, with no more rows per micro-batch than it had (so activation memory per
    device does not grow): the fewest that fit. A dp that cannot split the global batch is
    refused with the dp sizes (and device counts) that can: an elastic restart onto fewer
    devices picks one of those."""
    rows = global_batch // (saved.rows * saved.micro_batches)  # (rows split over dp x ep)
    if global_batch % plan.rows == 0:
        for m in range(1, global_batch // plan.rows + 1):
            if global_batch % (plan.rows * m) == 0 and global_batch // (plan.rows * m) <= rows:
                try:
                    Plan(**{**plan.as_dict(), "micro_batches": m}).validate(global_batch)
                except PlanError:
                    continue  # a pipeline needs more micro-batches than that
                return m
    can = [d for d in range(1, global_batch + 1) if global_batch % d == 0]
    per = plan.n_devices // plan.dp  # devices per data-parallel replica: tp x pp x cp
    raise PlanError(
        f"dp={plan.dp} cannot keep the global batch of {global_batch} documents of the run "
        f"saved under {saved.layout()} ({rows} rows per micro-batch); dp sizes that can: "
        f"{', '.join(map(str, can))}" + (f" (devices: dp x {per} = "
                                         f"{', '.join(str(d * per) for d in can)})"
                                         if per > 1 else ""))


# The keys of a written-out layout (Plan.parse) and the Plan field each sets.
LAYOUT_KEYS = {"dp": "dp", "tp": "tp", "pp": "pp", "cp": "cp", "ep": "ep", "zero": "zero_stage",
               "micro_batches": "micro_batches", "schedule": "schedule", "virtual": "virtual",
               "remat": "remat", "precision": "precision", "attention": "attention",
               "unroll": "unroll", "sp": "sequence_parallel", "fp8_block": "fp8_block",
               "fp8_head": "fp8_head", "fp8_history": "fp8_history"}
