"""Benchmark: the user's time, on a fresh clone, in one run.

Clones the repository's HEAD into a temporary folder (no virtual environment, no
compilation cache) and measures, one after the other on the otherwise idle machine:

1. `.ci/run` (the README's test command: virtual environment, install, the whole suite):
   its wall time, pytest's own time, the tests passed, and the programs compiled:
   the distinct programs in the suite's persistent compilation cache at the end (one
   entry per program, the subprocesses' included) and the compiles the pytest workers
   did themselves (tests/conftest.py counts XLA backend compiles against cache loads);
   then the same suite again, warm (every program in the cache): what the suite costs
   besides compiling, i.e. how close to its budget it could come if it compiled nothing;
2. the quick tier (`-m "not slow"`), cold (its cache emptied first) and then warm;
3. the main job, `jaxscale compare` with its defaults, cold (a new, empty cache) and warm.

Writes benchmarks/results/test_suite.json; the README's figures come from it. Budgets (2
cores): suite 900 s, quick tier 180 s cold, main job 60 s cold and 25 s warm.

    python benchmarks/suite_time.py [--skip-suite]
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS_S = {"suite": 900, "quick_cold": 180, "compare_cold": 60, "compare_warm": 25}
PYTEST_TAIL = re.compile(r"(\d+) passed.* in ([\d.]+)s")


def timed(cmd, cwd, env=None) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True,
                       text=True)
    return time.perf_counter() - t0, r


def pytest_figures(r: subprocess.CompletedProcess, what: str) -> dict:
    tail = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    m = PYTEST_TAIL.search(tail)
    if r.returncode != 0 or not m:
        sys.exit(f"{what} failed (exit {r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return {"pytest_s": float(m.group(2)), "tests_passed": int(m.group(1)),
            "reruns": int(r2.group(1)) if (r2 := re.search(r"(\d+) rerun", tail)) else 0}


def compile_seconds(entry: Path) -> int | None:
    """The compile time JAX stored in a persistent-cache entry, in whole seconds (JAX
    truncates: 4.9 s is stored as 4): the entry is compressed (zstd where JAX found it,
    else zlib), its first 4 bytes the seconds, big-endian. None if it cannot be read."""
    data = entry.read_bytes()
    try:
        if data[:4] == b"\x28\xb5\x2f\xfd":  # a zstd frame
            import zstandard
            data = zstandard.ZstdDecompressor().decompress(data)
        else:
            data = zlib.decompress(data)
    except (ImportError, zlib.error, ValueError):
        return None
    return int.from_bytes(data[:4], "big")


def programs(clone: Path) -> dict:
    """Distinct programs in the suite's cache, what compiling each once would take (the
    floor of the suite's compile time, from the seconds JAX stored, truncated), and what the
    pytest workers compiled."""
    cache = clone / ".cache" / "jax-tests"
    entries = [p for p in cache.glob("*-cache")] if cache.exists() else []
    stored = {p: compile_seconds(p) for p in entries}  # each entry read once
    seconds = [s for s in stored.values() if s is not None]
    return {"distinct_programs": len(entries),
            # every distinct program compiled once: at least this many CPU-seconds
            "distinct_compile_s_at_least": sum(seconds),
            "distinct_programs_over_1s": sum(s >= 1 for s in seconds),
            "distinct_train_steps": sum(p.name.startswith("jit_step-") for p in entries),
            # the training steps alone, each compiled once: the suite's floor on this machine
            # is this over its cores, before any other program compiles or any step runs
            "distinct_train_steps_compile_s_at_least": sum(
                s for p, s in stored.items() if p.name.startswith("jit_step-") and s is not None),
            **worker_figures(clone)}


def worker_figures(clone: Path) -> dict:
    """What the pytest workers compiled and loaded themselves (tests/conftest.py's record)."""
    workers = [json.loads(p.read_text())
               for p in (clone / ".cache" / "suite-compiles").glob("*.json")]
    return {"worker_compiles": sum(w["compiles"] for w in workers),
            "worker_cache_loads": sum(w["cache_hits"] for w in workers),
            "worker_compile_or_load_s": round(sum(w["compile_or_load_s"] for w in workers), 1),
            # times a worker dropped its loaded programs to stay under vm.max_map_count
            "worker_program_drops": sum(w.get("program_drops", 0) for w in workers)}


def by_test(clone: Path, junit: Path, top: int = 15) -> dict:
    """Where the test-seconds went: what the pytest workers compiled (or loaded) in each
    test (tests/conftest.py records it by test), the tests that compiled nothing in their
    own process (their work is in the processes they start: the CLI, several processes,
    the experiments), and the rest (running steps, Python, the tests' own checks); and the
    slowest tests with the share of each that was compiling."""
    import xml.etree.ElementTree as ET
    per = {}
    for p in (clone / ".cache" / "suite-compiles" / "by-test").glob("*.json"):
        per.update(json.loads(p.read_text()))
    seconds = {case.get("classname").replace(".", "/") + ".py::" + case.get("name"):
               float(case.get("time")) for case in ET.parse(junit).iter("testcase")}
    compiled = {k: per.get(k, {}).get("compile_or_load_s", 0.0) for k in seconds}
    elsewhere = sum(s for k, s in seconds.items() if compiled[k] == 0.0)
    slowest = sorted(seconds, key=seconds.get, reverse=True)[:top]
    return {"test_s": round(sum(seconds.values()), 1),
            "in_process_compile_or_load_s": round(sum(compiled.values()), 1),
            "tests_compiling_nothing_in_process_s": round(elsewhere, 1),
            "slowest": [{"test": k, "s": seconds[k], "compile_or_load_s": compiled[k],
                         "compiles": per.get(k, {}).get("compiles", 0)} for k in slowest]}


def suite(clone: Path) -> dict:
    junit = clone / ".cache" / "suite-junit.xml"
    wall, r = timed(["bash", ".ci/run"], clone, env={"PYTEST_ADDOPTS": f"--junitxml={junit}"})
    return {"ci_wall_s": wall, **pytest_figures(r, ".ci/run"), **programs(clone),
            "by_test": by_test(clone, junit)}


def suite_warm(clone: Path) -> dict:
    """`.ci/run` again in the same clone: installed, every program in the cache. Its time is
    the suite's floor without compiling (the steps run, processes start, the TPU targets
    compile again: JAX stores their compile-only programs but cannot load them)."""
    junit = clone / ".cache" / "suite-junit-warm.xml"
    wall, r = timed(["bash", ".ci/run"], clone, env={"PYTEST_ADDOPTS": f"--junitxml={junit}"})
    figures = pytest_figures(r, ".ci/run (warm)")
    workers = worker_figures(clone)  # (the cache's entries are the cold run's, read already)
    return {"suite_warm_wall_s": wall, "suite_warm_pytest_s": figures["pytest_s"],
            "suite_warm_worker_compiles": workers["worker_compiles"],
            "suite_warm_worker_cache_loads": workers["worker_cache_loads"],
            "suite_warm_by_test": by_test(clone, junit)}


def quick(clone: Path) -> dict:
    shutil.rmtree(clone / ".cache" / "jax-tests", ignore_errors=True)
    cmd = [str(clone / ".venv" / "bin" / "python"), "-m", "pytest", "-n", "2", "--dist",
           "worksteal", "-q", "-p", "no:cacheprovider", "-m", "not slow"]
    out = {}
    for kind in ("cold", "warm"):
        wall, r = timed(cmd, clone)
        out[f"quick_{kind}_s"] = wall
        out[f"quick_{kind}_pytest_s"] = pytest_figures(r, f"quick tier ({kind})")["pytest_s"]
    return out


def main_job(clone: Path) -> dict:
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        for kind in ("cold", "warm"):
            wall, r = timed([str(clone / ".venv" / "bin" / "jaxscale"), "compare", "--json",
                             "--out", str(clone / "runs" / f"compare-{kind}")], clone,
                            env={"JAXSCALE_CACHE_DIR": cache})
            if r.returncode != 0:
                sys.exit(f"jaxscale compare ({kind}) failed:\n{r.stderr[-3000:]}")
            got = json.loads(r.stdout)
            out[f"compare_{kind}_s"] = wall
            out[f"compare_{kind}_split_s"] = got.get("wall")  # compare.run.wall_split
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-suite", action="store_true",
                    help="only the quick tier and the main job (the clone still installs)")
    args = ap.parse_args()
    out = ROOT / "benchmarks" / "results" / "test_suite.json"
    with tempfile.TemporaryDirectory() as tmp:
        clone = Path(tmp) / "jaxscale"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone,
                                capture_output=True, text=True).stdout.strip()  # what ran
        result = {"benchmark": "test_suite_cold", "commit": commit, "cpus": os.cpu_count(),
                  "target_s": TARGETS_S["suite"], "targets_s": TARGETS_S}
        if args.skip_suite:
            subprocess.run(["bash", "scripts/dev.sh", "test", "--co", "-q"], cwd=clone,
                           check=True, capture_output=True)
        else:
            result.update(suite(clone))
            print(f"fresh clone: .ci/run {result['ci_wall_s']:.1f} s, pytest "
                  f"{result['pytest_s']:.1f} s, {result['tests_passed']} passed, "
                  f"{result['distinct_programs']} distinct programs", file=sys.stderr)
            result.update(suite_warm(clone))
            print(f"again, warm: .ci/run {result['suite_warm_wall_s']:.1f} s, pytest "
                  f"{result['suite_warm_pytest_s']:.1f} s, "
                  f"{result['suite_warm_worker_compiles']} compiles", file=sys.stderr)
        result.update(quick(clone))
        result.update(main_job(clone))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
