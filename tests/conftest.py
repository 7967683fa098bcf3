"""Test set-up: 8 forced host-CPU devices for the whole session, and a persistent XLA cache.

The device count is fixed here, before any test imports or runs JAX code, and asserted.
Single-device tests do not see the other devices: a plain jax.jit places everything on
device 0 (test_train checks that). Tests that need a *different* device count, or a fresh
backend, run in a subprocess (see `run_python`).

The CPU suite never starts an accelerator (JAX is told to use the CPU only), so a GPU
machine runs it as a laptop does. Tests marked `gpu` need an NVIDIA GPU: they run only with
JAXSCALE_GPU_TESTS=1 (benchmarks/gpu_check.sh sets it and selects them with -m gpu), and
are skipped otherwise, with the reason shown by -ra.

The suite writes nothing outside the repository (and pytest's tmp_path): compiled programs
go to .cache/jax-tests/, also for the CLI run in-process or in a subprocess (its
enable_compilation_cache reads JAXSCALE_CACHE_DIR), and matplotlib's font cache to
.cache/matplotlib/. Both are set here, before anything imports JAX or matplotlib.
"""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / ".cache" / "jax-tests"
N_DEVICES = 8
os.environ["JAXSCALE_CACHE_DIR"] = str(CACHE)
# and for JAX itself, in every process a test starts (a script that calls train() or
# jax.jit directly, without the CLI's enable_compilation_cache): the programs compiled here
# are loaded there, not compiled again (the new process that resumes every default
# strategy took 92 s of its test's 145 s; with the cache the test takes 68 s, warm)
os.environ["JAX_COMPILATION_CACHE_DIR"] = str(CACHE)
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
os.environ["MPLCONFIGDIR"] = str(ROOT / ".cache" / "matplotlib")
os.environ["JAXSCALE_DISTRIBUTED"] = "off"  # run under SLURM or on a TPU VM: never join it
# Tables as wide as off a terminal (report.OFF_TERMINAL_WIDTH), whatever terminal or COLUMNS
# the suite is started from: tests that read a table's cells must not see them folded (the
# tests of narrow terminals set COLUMNS themselves). Child processes inherit it.
os.environ["COLUMNS"] = "200"

import functools  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
import pytest  # noqa: E402

from jaxscale import garden  # noqa: E402
from jaxscale.runtime.devices import force_cpu_devices  # noqa: E402
from jaxscale.parallel.plan import Plan  # noqa: E402
from jaxscale.parallel.build import build_train_step  # noqa: E402
from jaxscale.training.config import TrainConfig  # noqa: E402
from jaxscale.training.reference import as_arrays, init_run  # noqa: E402
from jaxscale.model import config as model_config

jax.config.update("jax_compilation_cache_dir", str(CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
GPU_TESTS = os.environ.get("JAXSCALE_GPU_TESTS") == "1"
if not GPU_TESTS:
    jax.config.update("jax_platforms", "cpu")
    # and in every process a test starts: no accelerator backend looked for (libtpu, the
    # [tpu] extra the target tests use, would look for TPU chips and print warnings)
    os.environ["JAX_PLATFORMS"] = "cpu"
DEVICES = force_cpu_devices(N_DEVICES)
assert len(jax.devices("cpu")) == N_DEVICES, jax.devices("cpu")


# --- how many programs this process compiled (XLA backend compiles, not persistent-cache
# loads) and how long they took: each worker writes .cache/suite-compiles/<worker>.json at
# the end, and benchmarks/suite_time.py adds them up with the cache's entries (one per
# distinct program, subprocesses included)
COMPILES = {"compile_requests": 0, "cache_hits": 0, "compile_or_load_s": 0.0, "trace_s": 0.0,
            "program_drops": 0, "most_mappings": 0}
PER_TEST: dict[str, dict] = {}  # nodeid: that test's share of COMPILES


def _on_duration(event: str, seconds: float, **_):
    if event == "/jax/core/compile/backend_compile_duration":
        COMPILES["compile_requests"] += 1
        COMPILES["compile_or_load_s"] += seconds
    elif event == "/jax/core/compile/jaxpr_trace_duration":
        COMPILES["trace_s"] += seconds


def _on_event(event: str, **_):
    if event == "/jax/compilation_cache/cache_hits":
        COMPILES["cache_hits"] += 1


jax.monitoring.register_event_duration_secs_listener(_on_duration)
jax.monitoring.register_event_listener(_on_event)


# --- a worker's memory mappings: XLA:CPU maps each loaded program's code into its own
# mappings (a training step of the tiny models takes 600 to 900 of them), and the kernel
# caps a process at vm.max_map_count (65,530 by default). Past it LLVM cannot allocate and
# the worker dies of a segmentation fault in the next compile: a CI worker did, at 88% of
# the suite, once the lru_caches here and in the test modules (which keep one compiled step
# per plan for the whole run) held about 90 steps. Before a test, a worker past half the
# cap drops XLA's loaded programs (jax.clear_caches: the functions stay, and their next call
# loads the program from the persistent cache). benchmarks/suite_time.py reports the count.
MAPS = Path("/proc/self/maps")
MAX_MAPS = Path("/proc/sys/vm/max_map_count")
# read once: the cap is the kernel's and does not change during a run; None where not Linux
MAPPING_CAP = int(MAX_MAPS.read_text()) if MAX_MAPS.exists() and MAPS.exists() else None


def _mappings() -> int:
    with MAPS.open("rb") as f:
        return sum(1 for _ in f)


def drop_programs_past(cap: int) -> bool:
    """jax.clear_caches() if this process holds more than `cap` mappings; True if it did."""
    if _mappings() <= cap:
        return False
    jax.clear_caches()
    return True


@pytest.fixture(autouse=True)
def _bounded_mappings():
    if MAPPING_CAP is None:
        yield
        return
    COMPILES["program_drops"] += drop_programs_past(MAPPING_CAP // 2)
    yield
    COMPILES["most_mappings"] = max(COMPILES["most_mappings"], _mappings())


@pytest.fixture(autouse=True)
def _compiles_by_test(request):
    """What this test itself compiled (its subprocesses' compiles are not seen here): the
    figures by test that benchmarks/suite_time.py ranks."""
    before = dict(COMPILES)
    yield
    PER_TEST[request.node.nodeid] = {
        "compiles": (COMPILES["compile_requests"] - before["compile_requests"])
        - (COMPILES["cache_hits"] - before["cache_hits"]),
        "compile_or_load_s": round(COMPILES["compile_or_load_s"] - before["compile_or_load_s"], 3),
        "trace_s": round(COMPILES["trace_s"] - before["trace_s"], 3)}


def pytest_sessionfinish(session):
    import json
    # the worker's id from xdist itself: a pytest run nested in a test (gpu_check.sh's)
    # inherits PYTEST_XDIST_WORKER and would overwrite its parent worker's record
    worker = getattr(session.config, "workerinput", {}).get("workerid", "main")
    out = ROOT / ".cache" / "suite-compiles" / f"{worker}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**COMPILES, "compiles": COMPILES["compile_requests"]
                               - COMPILES["cache_hits"]}) + "\n")
    (out.parent / "by-test").mkdir(exist_ok=True)
    (out.parent / "by-test" / f"{worker}.json").write_text(json.dumps(PER_TEST, indent=0))


def pytest_collection_modifyitems(config, items):
    has_gpu = GPU_TESTS and any(d.platform == "gpu" for d in jax.devices())
    reason = ("needs an NVIDIA GPU: run with JAXSCALE_GPU_TESTS=1 on a GPU machine "
              "(benchmarks/gpu_check.sh does)" if not has_gpu else None)
    for item in items:
        if reason and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
    # The files that hold slow tests run first, each file's tests together (their
    # module-scoped fixtures built once): with xdist's work stealing (scripts/dev.sh) the
    # long tests start at once, and the quick ones fill both workers' last minutes
    # instead of one long test running alone at the end.
    slow_files = {item.path for item in items if "slow" in item.keywords}
    items.sort(key=lambda item: item.path not in slow_files)  # stable: order kept within


def run_python(code: str, *args: str, env: dict | None = None, timeout: int = 300):
    """Run `python -c code` in a fresh process (fresh JAX backend) from the repo root."""
    full_env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    full_env.update({"JAXSCALE_CACHE_DIR": str(CACHE)}, **(env or {}))
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def devices():
    return DEVICES


# --- shared by the model-parallel tests: one compiled step per plan, for the whole session

@functools.lru_cache(maxsize=None)
def setup(model: str):
    _, params, _ = init_run(TrainConfig(model=model))
    batch = as_arrays(next(garden.make_corpus(0).train_batches(32, seed=3)))
    return model_config.preset(model), params, batch


# An "optimizer" that keeps the gradient in its state and leaves the parameters alone:
# one step of it hands back the step's whole gradient, however the plan shards it.
KEEP_GRADIENT = optax.chain(optax.trace(decay=0.0), optax.scale(0.0))


@functools.lru_cache(maxsize=None)
def one_step(model: str, **plan):
    """(gradient as whole tensors, loss, step, initial state) of one step of `plan`.
    Not for ZeRO 1/2, whose optimizer state (hence the kept gradient) is flat slices."""
    cfg, params, batch = setup(model)
    p = Plan(**plan)
    assert p.zero_stage in (0, 3), "the gradient trace of ZeRO 1/2 is in flat slices"
    init, step = build_train_step(cfg, p, KEEP_GRADIENT, jax.devices()[:p.n_devices])
    state, metrics = step(init(params), batch)
    trace = state.opt_state[0].trace
    whole = step.full_params(state._replace(params=trace))
    return whole, float(metrics["loss"]), step, init(params)


def canonical_after_two_steps(model: str, **plan):
    """Two steps of momentum SGD on `model` under the plan and under Plan(): (the plan's
    canonical state, the single device's, the plan's state, and that state rebuilt by
    from_canonical(to_canonical(.)))."""
    cfg, params, batch = setup(model)
    states = []
    for p in (Plan(), Plan(**plan)):
        init, step = build_train_step(cfg, p, optax.sgd(0.1, momentum=0.9),
                                      jax.devices()[:p.n_devices])
        state = init(params)
        for _ in range(2):
            state, _ = step(state, batch)
        states.append((state, step))
    (ref_state, ref_step), (state, step) = states
    canonical = step.canonical.to_canonical(state)
    return (canonical, ref_step.canonical.to_canonical(ref_state), state,
            step.canonical.from_canonical(canonical))


def fp32_sum_bound(n_terms, c: float = 1.0) -> float:
    """c sqrt(n) eps_fp32: how far apart, relative to the total, two fp32 sums of the same n
    terms may land when taken in different orders (a loss: n target tokens' NLLs; a gradient
    entry: n tokens' contributions, relative to the largest entry).

    Each addition rounds by up to eps/2 of its partial sum: as a random walk, a sequential
    sum of n same-sign terms errs by about sqrt(n) eps / 6 (one standard deviation) and two
    orders differ by about sqrt(n) eps / 4, so c = 1 is four to six of those; blocked or
    tree sums do better. Measured at most 0.33 sqrt(n) eps (tiny, n = 682 tokens: 1.03e-6
    relative, where a fixed 1e-6 failed). Loss curves take c = 3: each step's sum, plus the
    parameters' rounding drift over the steps (measured at most 0.5 sqrt(n) eps)."""
    return c * float(n_terms) ** 0.5 * 2.0 ** -23  # 2**-23 = np.finfo(np.float32).eps




@pytest.fixture
def fail(capsys):
    """Run `jaxscale ARGS` expecting bad input: one line on stderr, exit code 2; the line."""
    from jaxscale.cli.main import main

    def run(*argv):
        with pytest.raises(SystemExit) as e:
            main(list(argv))
        err = capsys.readouterr().err.strip()
        assert e.value.code == 2, err
        assert len(err.splitlines()) == 1 and err.startswith("jaxscale: error: "), err
        return err
    return run


@pytest.fixture
def cli(capsys):
    """Run `jaxscale ARGS` in-process; returns the parsed JSON with --json, else stdout."""
    import json

    from jaxscale.cli.main import main

    def run(*argv, expect=0):
        code = main(list(argv))
        out = capsys.readouterr()
        assert code == expect, out.err
        return json.loads(out.out) if "--json" in argv else out.out
    return run
