"""`jaxscale compare`'s worker (`python -m jaxscale.compare.worker`): the child process that
`compare.run` drives. It forces the devices, builds the shared parameters and batches, and
then works in one of two ways, printing one JSON event per line:

  on its own (the spec's strategies in order): calibrates the time model, then builds
      and times each strategy in turn (compare.phases: prepare, train, time), a row as each
      one finishes. One worker alone on the machine, or one process of a cluster job.
  on command (spec["commands"], one of compare.pool's workers): says "ready", then reads
      one command a line -- build a row (compile it, read its HLO, train it: "built"),
      time a row it built ("row"), calibrate ("calibration") -- and answers each. The
      pool builds on every worker at once and times one row at a time while the others
      wait, so no step is timed while another process compiles.

A Python exception in one strategy becomes a failed row; the worker goes on with the next.
Nothing here touches a device at import: the devices are forced (`devices.pick_devices`,
or `processes.start` in a cluster) when `worker()` runs, before anything asks JAX for one.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxscale import garden
from jaxscale.compare import divergence, phases
from jaxscale.compare.predict import predict, predictable
from jaxscale.compare.run import mesh_label
from jaxscale.compare.strategies import CONTROL, CompareError
from jaxscale.compare.time_model import calibrate
from jaxscale.data.sampler import StepBatches
from jaxscale.files import replacing
from jaxscale.model import config as model_config, optim
from jaxscale.parallel.plan import Plan
from jaxscale.runtime import devices as devlib, processes as distributed
from jaxscale.runtime.compile_cache import enable_compilation_cache
from jaxscale.training.config import TrainConfig
from jaxscale.training.reference import init_run

LEARNING_RATE = 3e-3  # AdamW, the same for every strategy


def join_cluster(spec: dict):
    """One process of a jax.distributed job: forced CPU devices (--platform cpu, or auto
    with no accelerator plugin installed), else the accelerators; the first n devices of
    the global list, process by process."""
    platform, n = spec["platform"], spec["devices"]
    cpu = platform == "cpu" or (platform == "auto" and not devlib.accelerator_installed())
    distributed.start(distributed.Cluster(**spec["cluster"]), n if cpu else None)
    found = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(found) < n:
        raise CompareError(f"--devices {n}: the job has only {len(found)} devices")
    return found[:n]


def worker() -> int:
    """The child process: the spec on stdin, one JSON event per line on stdout."""
    distributed.die_with_parent()  # under `jaxscale launch`: never outlive the supervisor
    spec = json.loads(sys.stdin.readline())

    def emit(**event):
        print(json.dumps(event), flush=True)

    try:
        if spec.get("cluster"):
            devices = join_cluster(spec)
        else:
            devices = devlib.pick_devices(spec["platform"], spec["devices"])
        # `compare` refused a GPU-sized model on CPU before JAX started, by whether an
        # accelerator plugin is installed; a plugin with no device behind it leaves auto on
        # the CPU, which only the devices found here can tell
        model_config.check_platform(spec["model"], devices[0].platform)
    except (CompareError, ValueError) as e:
        emit(event="error", message=str(e))
        return 2
    if jax.process_count() > 1:
        emit(event="joined", process=jax.process_index(), processes=jax.process_count())
    enable_compilation_cache()
    rows = Rows(spec, devices)
    if spec.get("commands"):  # one of the pool's workers: it says what to do, and when
        emit(event="ready")
        for line in sys.stdin:
            command = json.loads(line)
            emit(**rows.do(command["do"], command.get("name")))
        return 0
    calibration = rows.do("calibrate")  # alone: the rows come after it
    emit(**calibration)
    for s in spec["strategies"]:  # build and time each row in turn
        emit(event="start", name=s["name"], mesh=mesh_label(s["plan"]))
        event = rows.do("build", s["name"])
        if event["event"] == "built":
            event = rows.do("time", s["name"])
        if event["row"]["status"] == "ok":
            event["row"]["calibration"] = calibration["calibration"]
        emit(**event)
    return 0


class Rows:
    """This worker's rows, each built (compiled, read, trained: compare.phases) and then
    timed; `do` answers one command with the event that reports it."""

    def __init__(self, spec: dict, devices):
        self.spec, self.devices, self.me = spec, devices, jax.process_index()
        self.plans = {s["name"]: s["plan"] for s in spec["strategies"]}
        self.cfg = model_config.preset(spec["model"])
        _, self.params, _ = init_run(TrainConfig(model=spec["model"]))
        corpus = garden.make_corpus(0, seq_len=self.cfg.seq_len)
        self.batches = StepBatches(corpus.train, spec["batch_size"], self.cfg.seq_len, seed=1,
                                   steps=spec["steps"])  # each process builds only its rows
        # a profile pictures the steps' time: the pool trains them in the timing phase
        self.train_late = bool(spec.get("commands") and spec.get("profile"))
        self.held: dict[str, phases.Prepared] = {}

    def do(self, what: str, name: str | None = None) -> dict:
        """"calibrate", or "build" / "time" the row `name`: the event to emit ("built"
        while the row waits for its timing; "row" once it is finished, or failed)."""
        if what == "calibrate":
            start = time.time()
            n = self.spec["devices"]
            cal = (calibrate(self.devices[:n]) if self.spec.get("time_model", True)
                   and jax.process_count() == 1 else None)  # the rate and the links it runs on
            return {"event": "calibration", "calibration": cal, "window": [start, time.time()]}
        plan = Plan(**self.plans[name])
        if what == "build" and not any(d.process_index == self.me
                                       for d in self.devices[:plan.n_devices]):
            return self._row({"name": name, "status": "elsewhere", "plan": self.plans[name]})
        try:
            if what == "build":
                return self._build(name, plan)
            p = self.held.pop(name)
            if self.train_late:
                self._train(name, p)
            phases.time_step(p, self.spec["repeats"])
            return self._row(p.row)
        except Exception as e:  # noqa: BLE001 - one strategy's error must not end the others
            self.held.pop(name, None)
            return self._row({"name": name, "status": "failed", "plan": self.plans[name],
                              "error": f"{type(e).__name__}: {e}"[:2000]})

    def _build(self, name: str, plan: Plan) -> dict:
        p = phases.prepare(name, plan, self.cfg, self.params, self.batches,
                           optim.adamw(LEARNING_RATE), self.devices)
        p.row["predicted"] = (predict(self.cfg, plan, (self.spec["batch_size"],
                                                       self.cfg.seq_len))
                              if predictable(plan, self.cfg) else None)
        if not self.train_late:
            self._train(name, p)
        self.held[name] = p
        return {"event": "built", "name": name, "wall": p.row["wall"]}

    def _train(self, name: str, p: phases.Prepared) -> None:
        where, save = self.spec.get("profile"), self.spec.get("save_params")
        phases.train(p, len(self.batches), keep_params=bool(save),
                     profile=None if where is None or self.me else
                     os.path.join(where, name.replace("/", "_")))
        if save:
            p.row["params_file"] = _save_params(p.row, save, self.me)
        if self.spec.get("trace_divergence") and name not in ("single", CONTROL):
            self._trace(p)

    def _trace(self, p: phases.Prepared) -> None:
        """row["divergence"]: where the strategy parts ways (compare.divergence)."""
        n = self.spec["batch_size"]
        batches = [self.batches.rows(i, 0, n) for i in range(len(self.batches))]
        bound = self.spec.get("tolerance") or divergence.rounding_bound(
            int(batches[0]["mask"].sum()))
        single = next((Plan(**s["plan"]) for s in self.spec["strategies"]  # compare's single
                       if s["name"] == "single"),
                      Plan(precision=self.spec.get("precision") or "fp32"))
        p.row["divergence"] = divergence.trace(p.plan, self.cfg, self.params, batches,
                                               self.devices, bound, optim.adamw(LEARNING_RATE),
                                               single)

    def _row(self, row: dict) -> dict:
        row["mesh"] = mesh_label(row["plan"])
        row["process"] = self.me
        return {"event": "row", "row": row}


def _save_params(row, folder, me):
    """Process 0 writes the strategy's final whole parameters to FOLDER/NAME.npz."""
    params = row.pop("_final_params")
    path = Path(folder) / f"{row['name'].replace('/', '_')}.npz"
    if me == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path, "wb") as f:  # whole or not at all
            np.savez(f, **params)
    return str(path)


if __name__ == "__main__":
    try:
        sys.exit(worker())
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the parent reports
        os._exit(130)
