"""Day-4 §B.5: two processes, one gradient. DDP and FSDP over gloo against one device.

    python -m experiments.multiprocess [--out runs/multiprocess] [--devices-per-process K]
                                       [--json]

This command is only a supervisor: it starts itself twice on 127.0.0.1 (`--worker 0` and
`--worker 1`, a free coordinator port, K forced CPU devices each), waits a bounded time,
and kills both if either fails or the time runs out. The two workers form one
jax.distributed job whose collectives cross processes over gloo, and compute the gradient
of ONE step's token-weighted loss, each building only its own rows of the global batch:

a. DDP: every device differentiates its own copy of the parameters on its rows, then one
   psum over dp (parallel/data.py's dp_value_and_grad, unchanged)
b. FSDP (ZeRO-3): every device holds 1/(2K) of every flat, padded tensor; the forward pass
   all-gathers each unit's parameters and the gathers' transposes reduce-scatter the
   gradients (parallel/zero.py's zero_value_and_grad, stage 3): each device ends up with
   the gradient of its own slice only

Process 0 then computes the same gradient with plain jax.grad of loss_fn on the whole batch
on one device, and compares (max abs difference, and compare_trees.max_rel_diff: per tensor,
relative to that tensor's largest entry). Tolerance TOLERANCE = 1e-5 relative: gloo adds
the devices' partial sums in another order than one device adds the tokens, so fp32
rounding differs by a few ulps of each tensor's largest entries (measured: ~1e-6 relative,
in the tied embedding, whose gradient sums the most terms; in-process dp=4 gives the same);
the all-gathers only copy, so they add nothing. A real mistake (a missing or doubled psum,
a mean of shard means) is >= 1e-2.
Only process 0 prints and writes DIR/multiprocess.json. With --json the supervisor prints
that file's object on stdout once the job has succeeded, and process 0's tables go to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from jaxscale.model import config as model_config

ROOT = Path(__file__).resolve().parents[1]
N_PROCESSES = 2
ROWS_PER_DEVICE = 4  # the global batch is 4 documents per device
SEED, N_DOCS = 0, 512
TOLERANCE = 1e-5  # max relative gradient difference (see the docstring)
HEARTBEAT_S, SHUTDOWN_S = 10, 30  # a dead peer is noticed in seconds, not JAX's 100 / 300
WAIT_S = 180  # the supervisor's bound on the whole job


# --- the supervisor: start two workers, wait a bounded time, leave no process behind ------

def supervise(out: Path, per: int, wait_s: float, as_json: bool = False) -> int:
    """Run the job; 0 once both workers exit 0. With `as_json`, process 0's tables go to
    stderr and its multiprocess.json is printed on stdout (a stale one is removed first, so
    that a failed job never prints an old result)."""
    code = _supervise(out, per, wait_s, sys.stderr if as_json else None)
    if as_json and code == 0:
        print((out / "multiprocess.json").read_text().strip())
    return code


def _supervise(out: Path, per: int, wait_s: float, main_stdout) -> int:
    from jaxscale.runtime.launcher import child_env, coordinator_port
    out.mkdir(parents=True, exist_ok=True)
    (out / "multiprocess.json").unlink(missing_ok=True)
    port = coordinator_port()
    print(f"multiprocess: {N_PROCESSES} processes x {per} CPU devices, coordinator "
          f"127.0.0.1:{port}; process 1's output in {out}/process-1.log", file=sys.stderr)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # run finally
    children, logs = [], []
    try:
        for i in range(N_PROCESSES):  # process 0 speaks on our terminal, the others to a log
            logs.append(main_stdout if i == 0 else open(out / f"process-{i}.log", "wb"))
            argv = [sys.executable, "-m", "experiments.multiprocess", "--worker", str(i),
                    "--port", str(port), "--out", str(out), "--devices-per-process", str(per)]
            children.append(subprocess.Popen(
                argv, cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL, stdout=logs[i],
                stderr=subprocess.STDOUT if logs[i] else None, start_new_session=True))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            codes = [c.poll() for c in children]
            failed = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
            if failed:
                i, rc = failed[0]
                print(f"multiprocess: process {i} exited with code {rc}; stopping the rest",
                      file=sys.stderr)
                return 1
            if all(rc == 0 for rc in codes):
                return 0
            time.sleep(0.1)
        print(f"multiprocess: not done after {wait_s:g} s; killing both processes",
              file=sys.stderr)
        return 1
    finally:
        for c in children:  # the child's whole group: it and anything it started
            try:
                os.killpg(c.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            c.wait()
        for f in logs:
            if f not in (None, main_stdout):
                f.close()


# --- a worker: one process of the job ------------------------------------------------------

def worker(i: int, port: int, out: Path, per: int) -> None:
    from jaxscale.runtime import processes as distributed
    distributed.start(distributed.Cluster(f"127.0.0.1:{port}", N_PROCESSES, i, HEARTBEAT_S,
                                          SHUTDOWN_S), n_devices=N_PROCESSES * per)
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jaxscale import garden
    from jaxscale.measure import compare_trees
    from jaxscale.runtime.compile_cache import enable_compilation_cache
    from jaxscale.data.sampler import StepBatches
    from jaxscale.runtime.mesh import make_mesh
    from jaxscale.model.loss import loss_fn
    from jaxscale.parallel.axes import DP
    from jaxscale.parallel.data_parallel import dp_value_and_grad
    from jaxscale.parallel.zero import zero_value_and_grad
    from jaxscale.parallel.zero_layout import zero_layout
    from jaxscale.report import print_table
    from jaxscale.training.config import TrainConfig
    from jaxscale.training.reference import init_run

    enable_compilation_cache()
    assert jax.process_count() == N_PROCESSES and len(jax.local_devices()) == per
    t0 = time.perf_counter()
    k = len(jax.devices())  # dp over every device of both processes
    batch_size = ROWS_PER_DEVICE * k
    cfg = model_config.preset("tiny")
    graphdef, params, _ = init_run(TrainConfig(seed=SEED))  # the same on every process
    corpus = garden.make_corpus(SEED, N_DOCS, 8, cfg.seq_len)
    mesh = make_mesh(f"dp={k}")  # process by process: process 0's devices first
    batches = StepBatches(corpus.train, batch_size, cfg.seq_len, SEED, record=True)
    batch = batches.place(0, NamedSharding(mesh, P(DP)))  # builds only this process's rows

    # a. DDP: replicated parameters, local gradients, one psum over dp (across processes)
    ddp = jax.jit(jax.shard_map(lambda p, b: dp_value_and_grad(graphdef)(p, b, None),
                                mesh=mesh, in_specs=(P(), P(DP)), out_specs=(P(), P())))
    ddp_loss, ddp_grads = ddp(jax.device_put(params, NamedSharding(mesh, P())), batch)

    # b. FSDP: every flat tensor cut into k slices; the gradient comes back reduce-scattered
    layout = zero_layout(jax.eval_shape(lambda: params), k, stage=3)
    specs = jax.tree.map(layout.spec, jax.eval_shape(layout.flatten, params))
    slices = jax.device_put(layout.flatten(params),
                            jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    fsdp = jax.jit(jax.shard_map(lambda s, b: zero_value_and_grad(graphdef, layout, 1)(s, b, None),
                                 mesh=mesh, in_specs=(specs, P(DP)), out_specs=(P(), specs)))
    fsdp_loss, fsdp_slices = fsdp(slices, batch)

    # what this process holds, per local device: rows of the batch, its FSDP slice
    rows = {s.device.id: s.index[0].indices(batch_size)[:2]
            for s in batch["tokens"].addressable_shards}
    tok = {s.device.id: s.index[0].indices(fsdp_slices["tok_embed"].shape[0])[:2]
           for s in fsdp_slices["tok_embed"].addressable_shards}
    held = {d.id: 0 for d in jax.local_devices()}
    for leaf in jax.tree.leaves(fsdp_slices):
        for s in leaf.addressable_shards:
            held[s.device.id] += s.data.size
    mine = {"pid": np.int64(os.getpid()), "samples": np.asarray(batches.touched),
            "devices": np.asarray([[d.id, d.process_index, *rows[d.id], *tok[d.id], held[d.id]]
                                   for d in jax.local_devices()])}
    views = multihost_utils.process_allgather(mine)  # collectives: every process calls them
    ddp_host = distributed.named_host_arrays(ddp_grads)
    fsdp_host = distributed.named_host_arrays(fsdp_slices)  # the gather of the slices: exact
    if not distributed.is_main():
        return

    whole = StepBatches(corpus.train, batch_size, cfg.seq_len, SEED).place(0)  # one device
    ref_loss, ref = jax.jit(jax.value_and_grad(lambda p, b: loss_fn(graphdef, p, b)))(params, whole)
    ref_host = distributed.named_host_arrays(ref)
    ref_flat = distributed.named_host_arrays(layout.flatten(ref))  # padding: exactly zero

    def compare(loss, got, want):
        diff = {"loss": float(loss), "max_abs_diff": max(float(np.max(np.abs(got[n] - want[n])))
                                                         for n in want),
                "max_rel_diff": compare_trees.max_rel_diff(got, want)}
        return {**diff, "within_tolerance": diff["max_rel_diff"] <= TOLERANCE}
    result = {"processes": N_PROCESSES, "devices_per_process": per, "batch_size": batch_size,
              "tolerance_rel": TOLERANCE, "reference_loss": float(ref_loss),
              "a_ddp": compare(ddp_loss, ddp_host, ref_host),
              "b_fsdp": compare(fsdp_loss, fsdp_host, ref_flat)}
    view = []
    for p in range(N_PROCESSES):
        samples = views["samples"][p].tolist()
        view.append({"process": p, "pid": int(views["pid"][p]), "samples": samples,
                     "documents": batches.sampler.docs(samples[0], samples[-1] + 1).tolist(),
                     "devices": [dict(zip(("id", "process", "row_lo", "row_hi", "tok_embed_lo",
                                           "tok_embed_hi", "grad_elements"), map(int, d)))
                                 for d in views["devices"][p]]})
    result["view"] = view
    result["wall_s"] = time.perf_counter() - t0

    print_table(f"the job: {N_PROCESSES} processes x {per} devices, one batch of {batch_size} "
                f"documents, dp={k} (FSDP: every flat tensor in {k} slices)",
                ["process", "pid", "samples built", "device id (process)", "batch rows",
                 "tok_embed gradient slice", "gradient elements held"],
                [[v["process"], v["pid"], f"{v['samples'][0]}..{v['samples'][-1]}",
                  f"{d['id']} ({d['process']})", f"{d['row_lo']}..{d['row_hi'] - 1}",
                  f"{d['tok_embed_lo']}..{d['tok_embed_hi'] - 1} of {fsdp_host['tok_embed'].size}",
                  d["grad_elements"]] for v in view for d in v["devices"]])
    print_table(f"gradient of one step vs one device with the whole batch (tolerance "
                f"{TOLERANCE:g} relative: gloo sums in another order, fp32 rounding)",
                ["part", "loss", "max abs difference", "max relative difference", "within"],
                [["one device (jax.grad of loss_fn)", f"{ref_loss:.7f}", "", "", ""]]
                + [[name, f"{r['loss']:.7f}", f"{r['max_abs_diff']:.2e}",
                    f"{r['max_rel_diff']:.2e}", r["within_tolerance"]]
                   for name, r in (("a. DDP (psum over dp)", result["a_ddp"]),
                                   ("b. FSDP (reduce-scattered slices)", result["b_fsdp"]))])
    (out / "multiprocess.json").write_text(json.dumps(result, indent=1))
    print(f"written {out}/multiprocess.json", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.multiprocess",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/multiprocess", help="folder for multiprocess.json")
    ap.add_argument("--devices-per-process", type=int, default=2, metavar="K",
                    help="forced CPU devices in each of the two processes (default 2)")
    ap.add_argument("--timeout", type=float, default=WAIT_S, metavar="S",
                    help=f"kill both processes if not done after S seconds (default {WAIT_S})")
    ap.add_argument("--json", action="store_true",
                    help="print the result (multiprocess.json) as one JSON object on stdout; "
                         "the tables go to stderr")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not 1 <= args.devices_per_process <= 8:
        ap.error(f"--devices-per-process {args.devices_per_process}: choose 1 to 8")
    out = Path(args.out)
    if args.worker is None:
        return supervise(out, args.devices_per_process, args.timeout, args.json)
    try:
        worker(args.worker, args.port, out, args.devices_per_process)
    except BaseException:  # noqa: BLE001 - exit at once, not after JAX's shutdown barrier
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
