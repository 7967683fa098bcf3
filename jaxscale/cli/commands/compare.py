"""`jaxscale compare`: every parallel strategy side by side, measured next to predicted.

    jaxscale compare                                  # 8 CPU devices, tiny, 20 steps
    jaxscale compare --devices 4 --strategies single,dp,zero3,tp --json
    jaxscale compare --abstract --model 7b --devices 64   # compile only, XLA's memory

Each strategy trains on the same batches (same tokens per step) and is checked against the
single device, within a multiple of the drift that rounding alone produces (the control
run); the table shows its memory, communication, compile and step time, each measured
figure beside the cost model's. Writes compare.json (a row as each strategy finishes),
compare.md and PNG charts.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jaxscale.cli.main import COMMANDS, EXIT_FAILED, _error, _number
from jaxscale.files import write_text_atomically
from jaxscale.report import plural
from jaxscale.runtime.devices import PLATFORMS
from jaxscale.runtime import devices as devlib
from jaxscale.cli import cluster_options, config_file
from jaxscale.cli.commands import (compare_baseline, compare_checks, compare_judging,
                                    compare_target)
from jaxscale.model import config as model_config


def register(subparsers) -> None:
    from jaxscale.cli import runtime_options as runtime
    from jaxscale.compare.strategies import CONTROL, NAMES, NOISE_FLOOR, NOISE_MULTIPLE
    from jaxscale.cli.model_arg import FILE_HELP, model_arg
    from jaxscale.model.config import PRESETS
    from jaxscale.parallel.plan import LAYOUT_KEYS
    from jaxscale.cli.paths import output_dir
    p = subparsers.add_parser(
        "compare", help=COMMANDS["compare"],
        description=(
            "Train the same model with each parallel strategy on the same batches and show, "
            "per strategy: the largest relative loss difference from the single device, "
            f"judged against a measured noise floor (the '{CONTROL}' run is the single device "
            "with its batch summed in two halves: rounding alone; a strategy passes within "
            f"{NOISE_MULTIPLE:g} x its drift, never below {NOISE_FLOOR:g}); per-device memory "
            "of the compiled step (state shards and XLA's analysis) next to the closed forms; "
            "bytes each device sends per step by collective (read from the HLO) next to the "
            "cost model; compile time (compiled, or loaded from the cache); step time (median "
            "and quartiles) as a ratio to one device; the pipeline's idle share. Strategies: "
            "single; dp; zero1/zero2 (over dp, 4 micro-batches); zero3; tp (largest the heads "
            "allow); pp (largest the layers allow, 1F1B); dp+tp; dp+pp; 3d (dp x tp=2 x pp=2, "
            "ZeRO-1); fsdp+tp (ZeRO-3 over dp on tp=2 shards); tp+sp (sequence parallel); cp "
            "(ring attention over the largest cp the sequence allows); dp+cp+tp (cp=2, tp=2, "
            "sequence parallel). Each runs in a worker process: a strategy that crashes is marked failed "
            "and the others are kept. On CPU devices as many workers as cores compile the "
            "strategies at once, then each is timed alone; the notes split the wall time. "
            "Exit code 1 if a strategy fails or misses the bound."))
    p.add_argument("--devices", type=_number(), default=None, metavar="N",
                   help="devices to use (CPU: forced host devices; several processes: in "
                        "all, split evenly over them; default 8, or the target's chips)")
    p.add_argument("--platform", default="auto", choices=PLATFORMS, metavar="NAME",
                   help="cpu, gpu, tpu or auto (the default backend; default auto)")
    p.add_argument("--model", default="tiny", type=model_arg, metavar="PRESET",
                   help=f"model preset: {', '.join(PRESETS)}; {FILE_HELP} (default tiny)")
    p.add_argument("--steps", type=_number(), default=20, help="training steps (default 20)")
    p.add_argument("--batch-size", type=_number(), default=32,
                   help="documents per step, the same for every strategy (default 32)")
    p.add_argument("--strategies", default=None, metavar="LIST",
                   help=f"comma-separated, from {', '.join(NAMES)} (default: all that "
                        "fit the devices, unless --strategy is given)")
    p.add_argument("--strategy", action="append", default=[], metavar="LAYOUT",
                   help="a layout written out, e.g. dp=2,tp=4,zero=1,remat=full,precision=bf16 "
                        f"(keys: {', '.join(LAYOUT_KEYS)}); repeatable, beside --strategies")
    p.add_argument("--repeats", type=_number(minimum=3), default=15, metavar="R",
                   help="timed steps per strategy for the median and quartiles (default 15)")
    p.add_argument("--abstract", action="store_true",
                   help="lower and compile only (no execution, no allocation): XLA's "
                        "per-device memory next to the formulas, for models too big to run")
    p.add_argument("--target", default=None, metavar="NAME",
                   help="with --abstract: compile for a Cloud TPU slice from this machine "
                        "(libtpu's compile-only devices; pip install -e \".[tpu]\"): v5e-16, "
                        "v6e-64, v5p-512 (v5p counts TensorCores, 2 per chip; v5e and v6e "
                        "count chips) or a topology such as v5p:4x8x8. Each row gets XLA:TPU's "
                        "memory per chip against the chip's HBM")
    p.add_argument("--seq", type=_number(), default=None, metavar="S",
                   help="with --abstract: tokens per sequence of the job (default: the "
                        "model's seq_len)")
    p.add_argument("--out", type=output_dir, default="runs/compare", metavar="DIR",
                   help="folder for compare.json, compare.md and, unless --abstract, the "
                        "PNG charts (default runs/compare)")
    p.add_argument("--json", action="store_true", help="print one JSON object with every figure")
    p.add_argument("--save-params", type=output_dir, default=None, metavar="DIR",
                   help="write each strategy's final whole parameters to DIR/NAME.npz (to "
                        "compare runs, e.g. one process against several)")
    compare_judging.add_arguments(p)
    compare_baseline.add_arguments(p)
    config_file.add_argument(p)
    runtime.add_profile_argument(p)  # one trace folder per strategy: DIR/NAME
    cluster_options.add_arguments(p)
    p.set_defaults(run=run, parser=p)


def _strategy_names(args, n, cfg) -> tuple[list[str], tuple[str, ...]]:
    """(strategy names, written-out layouts) to run; the single device and the control
    first (the reference and the noise floor), unless compiling only."""
    from jaxscale.compare.strategies import CONTROL, NAMES, CompareError, strategy_plan
    layouts = tuple(args.strategy)
    if args.strategies is None and not layouts:
        names = []
        for name in NAMES:  # (the ep strategies only fit models with experts)
            try:
                strategy_plan(name, n, cfg)
                names.append(name)
            except CompareError:
                pass  # does not fit these devices: left out of the default set
    else:
        names = [s.strip() for s in (args.strategies or "").split(",") if s.strip()]
        bad = [s for s in names if s not in NAMES]
        if bad or (args.strategies is not None and not names):
            raise CompareError(f"unknown strategy {bad[0] if bad else args.strategies!r}; "
                               f"choose from {', '.join(NAMES)}")
    if not args.abstract:
        names = ["single", CONTROL] + [s for s in names if s not in ("single", CONTROL)]
    return names, layouts


def _checked_plans(args, cfg, on_cpu: bool) -> dict:
    """The strategies' plans, each checked against the model, the devices and the batch."""
    from jaxscale.compare.strategies import CompareError, check_strategies
    if not args.abstract and on_cpu:
        try:
            model_config.check_platform(args.model, "cpu")
        except model_config.ModelConfigError:
            raise CompareError(f"model {args.model!r} is too big to train here; use "
                               "--abstract to compile it without running, or one of "
                               f"{', '.join(model_config.CPU_PRESETS)}") from None
    if on_cpu and not args.abstract:  # the host's limit first, as train states it
        devlib.check_cpu_count(args.devices)
    names, layouts = _strategy_names(args, args.devices, cfg)
    plans = check_strategies(names, args.devices, cfg, layouts, args.precision,
                             compare_judging.fp8_options(args))
    for name, plan in plans.items():
        if args.batch_size % (plan.rows * plan.micro_batches):
            need = max(p.rows * p.micro_batches for p in plans.values())
            split = "(dp x ep)" if plan.ep > 1 else "dp"
            raise CompareError(f"strategy {name!r}: batch of {args.batch_size} documents is not "
                               f"divisible by {split} x micro_batches = {plan.rows} x "
                               f"{plan.micro_batches}; try --batch-size {need}")
    from jaxscale.parallel.fits import kv_heads_note
    for name, plan in plans.items():
        note = kv_heads_note(cfg, plan)
        if note:
            print(f"note: {name}: {note}", file=sys.stderr)
    return plans


def run(args) -> int:
    from jaxscale.runtime import processes as distributed
    from jaxscale.compare.strategies import CompareError
    target, cfg = compare_target.target_and_job(args, model_config.preset(args.model))
    on_cpu = args.platform == "cpu" or (args.platform == "auto"
                                        and not devlib.accelerator_installed())
    plans = _checked_plans(args, cfg, on_cpu)  # all valid before JAX starts
    compare_target.check_kernels(plans, target, on_cpu, cfg)  # and where each compiles
    if target is not None:
        compare_target.check_target_sizes(plans, target, args.strategy, cfg)
    out = Path(args.out)
    cluster = distributed.from_args(args)
    base = compare_baseline.load(args, on_cpu)  # another job's is refused before JAX
    compare_checks.check_trace(args, cluster)
    if args.abstract:
        compare_checks.check_abstract(args, cluster)
        return _run_abstract(args, cfg, plans, out, target)
    from jaxscale.compare import report
    from jaxscale.compare.run import WorkerCrashed, WorkerError, run_all
    from jaxscale.compare.strategies import judge
    result = {"model": args.model, "devices": args.devices, "steps": args.steps,
              "batch_size": args.batch_size, "cores": os.cpu_count(),
              "platform": args.platform, "complete": False,
              "rows": []}

    def save(rows):  # every finished strategy is on disk at once
        result["rows"] = rows
        result["noise"] = judge(rows, args.tolerance)
        result["all_pass"] = all(r["pass"] for r in rows)
        _write_json(out / "compare.json", result)

    spec = _spec(args, plans, cluster, on_cpu)
    if cluster is not None:
        result["processes"] = cluster.num_processes
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    voice = {"main": cluster is None or cluster.process_id in (None, 0)}
    if voice["main"]:
        _start_outputs(out)
        config_file.write(args.parser, args, out)  # the options this run ran with
    wall: dict = {}  # where the run's wall time went: compile phase, timing phase, ...
    try:
        rows = run_all(spec, save, log, voice=voice, wall=wall)
    except WorkerCrashed as e:  # the run went wrong (exit 1), not the options (exit 2)
        done = plural(len(result["rows"]), "strategy", "strategies")
        _error(f"{e}" + (f"; {done} finished before it, in {out / 'compare.json'}"
                         if result["rows"] else ""))
        return EXIT_FAILED
    except WorkerError as e:
        raise CompareError(str(e)) from None
    except KeyboardInterrupt:
        if not voice["main"]:
            return 130
        report.print_partial(result, args.json, save)  # saved, then as the table or JSON
        log(f"jaxscale: interrupted; the {len(result['rows'])} strategies finished so far "
            f"are in {out / 'compare.json'}")
        return 130
    if not voice["main"]:  # process 0 reports for the job
        return 1 if any(r["status"] == "failed" for r in rows) else 0
    from jaxscale.compare.divergence import trace_failures
    if trace_failures(spec, rows, result["noise"], log):  # a strategy missed: where?
        save(rows)
    result["complete"] = True
    result["wall"] = wall
    report.finish(result)
    compare_baseline.check(base, result)
    save(result["rows"])
    compare_baseline.save(args, out)
    write_text_atomically(out / "compare.md", report.markdown(result))
    from jaxscale.compare.charts import charts
    charts(result, out)
    if args.json:
        print(json.dumps(result))
    else:
        report.print_table(result)
        from jaxscale.compare.divergence import notes
        for line in notes(result):
            print(line, file=sys.stderr)
        print(f"report, JSON and charts in {out}/", file=sys.stderr)
    unchanged = result.get("baseline", {}).get("unchanged", True)
    return 0 if result["all_pass"] and unchanged else 1


def _spec(args, plans: dict, cluster, on_cpu: bool) -> dict:
    """What the workers run (compare.run): the job, the strategies, the options."""
    from dataclasses import asdict

    from jaxscale.compare.run import worker_count
    return {"model": args.model, "devices": args.devices, "platform": args.platform,
            "steps": args.steps, "batch_size": args.batch_size, "repeats": args.repeats,
            "strategies": [{"name": k, "plan": p.as_dict()} for k, p in plans.items()],
            "cluster": None if cluster is None else asdict(cluster),
            "save_params": None if args.save_params is None else str(args.save_params),
            "profile": None if args.profile is None else os.path.abspath(args.profile),
            "trace_divergence": args.trace_divergence, "tolerance": args.tolerance,
            "precision": args.precision,
            # compile on every core, then time each strategy alone (compare/pool.py)
            "workers": worker_count(len(plans), on_cpu, cluster is not None)}


def _run_abstract(args, cfg, plans, out: Path, target=None) -> int:
    """Compile only, in this process (nothing runs, so nothing can crash a collective)."""
    from jaxscale.compare import abstract, report
    from jaxscale.runtime import devices as devlib, targets
    from jaxscale.runtime.compile_cache import enable_compilation_cache
    devices = (targets.target_devices(target) if target is not None
               else devlib.pick_devices(args.platform, args.devices))
    enable_compilation_cache()
    _start_outputs(out)
    rows = abstract.run_abstract(cfg, plans, devices, args.batch_size, target)
    result = {"model": args.model, "devices": args.devices, "abstract": True, "rows": rows}
    if target is not None:
        result.update(target=target.name, topology=target.topology, seq=cfg.seq_len,
                      hbm_bytes=target.hbm_bytes)
    _write_json(out / "compare.json", result)
    write_text_atomically(out / "compare.md", report.markdown(result))
    config_file.write(args.parser, args, out)  # the options this run ran with
    if args.json:
        print(json.dumps(result))
    else:
        report.print_table(result)
        print(f"report and JSON in {out}/", file=sys.stderr)
    return 0


def _start_outputs(out: Path) -> None:
    """Just before the work: no earlier run's report or charts beside this run's
    compare.json, whole or partial (a refused run leaves an earlier result untouched)."""
    from jaxscale.compare.charts import FILES as CHARTS
    from jaxscale.files import start_output_set
    start_output_set(out, ("compare.json", "compare.md", "config.toml", *CHARTS))


def _write_json(path: Path, obj) -> None:
    """Write whole or not at all: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(obj, indent=1))
