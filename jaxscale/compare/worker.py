"""`jaxscale compare`'s worker (`python -m jaxscale.compare.worker`): the child process that
`compare.run` drives. It forces the devices, builds the shared parameters and batches, and
runs the strategies in order (strategies.run_strategy), printing one JSON event per line
(a row as each strategy finishes). A Python exception in one strategy becomes a failed row;
the worker goes on with the next.

Nothing here touches a device at import: the devices are forced (`devices.pick_devices`,
or `processes.start` in a cluster) when `worker()` runs, before anything asks JAX for one.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import jax
import numpy as np

from jaxscale import garden
from jaxscale.compare.predict import predict, predictable
from jaxscale.compare.run import mesh_label
from jaxscale.compare.strategies import CompareError, run_strategy
from jaxscale.compare.time_model import calibrate
from jaxscale.data.sampler import StepBatches
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
    me = jax.process_index()
    if jax.process_count() > 1:
        emit(event="joined", process=me, processes=jax.process_count())
    enable_compilation_cache()
    cfg = model_config.preset(spec["model"])
    _, params, _ = init_run(TrainConfig(model=spec["model"]))
    corpus = garden.make_corpus(0, seq_len=cfg.seq_len)
    batches = StepBatches(corpus.train, spec["batch_size"], cfg.seq_len, seed=1,
                          steps=spec["steps"])  # each process builds only its rows
    calibration = None
    if spec.get("time_model", True) and jax.process_count() == 1:
        calibration = calibrate(devices[:spec["devices"]])  # the rate and the links it runs on
    for s in spec["strategies"]:
        plan = Plan(**s["plan"])
        emit(event="start", name=s["name"], mesh=mesh_label(s["plan"]))
        if not any(d.process_index == me for d in devices[:plan.n_devices]):
            emit(event="row", row={"name": s["name"], "status": "elsewhere", "plan": s["plan"],
                                   "mesh": mesh_label(s["plan"]), "process": me})
            continue  # a plan on other processes' devices only (the single device: process 0)
        try:
            where = spec.get("profile")
            row = run_strategy(s["name"], plan, cfg, params, batches, optim.adamw(LEARNING_RATE),
                               devices, repeats=spec["repeats"],
                               keep_params=bool(spec.get("save_params")),
                               profile=None if where is None or me else
                               os.path.join(where, s["name"].replace("/", "_")))
            row["predicted"] = (predict(cfg, plan, (spec["batch_size"], cfg.seq_len))
                                if predictable(plan) else None)
            row["calibration"] = calibration
            if spec.get("save_params"):
                row["params_file"] = _save_params(row, spec["save_params"], me)
        except Exception as e:  # noqa: BLE001 - one strategy's error must not end the others
            row = {"name": s["name"], "status": "failed", "plan": s["plan"],
                   "error": f"{type(e).__name__}: {e}"[:2000]}
        row["mesh"] = mesh_label(s["plan"])
        row["process"] = me
        emit(event="row", row=row)
    return 0


def _save_params(row, folder, me):
    """Process 0 writes the strategy's final whole parameters to FOLDER/NAME.npz."""
    params = row.pop("_final_params")
    path = Path(folder) / f"{row['name'].replace('/', '_')}.npz"
    if me == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **params)
    return str(path)


if __name__ == "__main__":
    try:
        sys.exit(worker())
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; the parent reports
        os._exit(130)
