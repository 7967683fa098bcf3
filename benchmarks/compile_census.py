"""Benchmark: which programs the suite compiles, and how many of them differ only in their
constants (what making those constants runtime inputs could save).

Run as a pytest plugin, it records every XLA compile-or-load the pytest workers do that
takes over 0.3 s or is a training step (`jit_step*`): the test, the program's name, a hash
of its StableHLO text, a hash of the same text with every constant's value blanked
(`dense<...>`), and the seconds. Two programs with the same blanked hash differ only in
constants (a learning rate, a warm-up length, a schedule's step count): one program would
do for both if those constants were inputs of the step.

    # on a fresh clone (an empty compilation cache), the files that compile the most:
    PYTHONPATH=benchmarks python -m pytest -p compile_census -n 2 tests/training ...
    python benchmarks/compile_census.py        # adds up .cache/compile-census/*.json

Writes benchmarks/results/compile_census.json.
"""
from __future__ import annotations

import atexit
import collections
import hashlib
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / ".cache" / "compile-census"
_CONSTANT = re.compile(r"dense<[^>]*>")
_records: list = []
_test = ["<collect>"]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _install() -> None:
    from jax._src import compiler
    from jax._src.lib.mlir import ir

    original = compiler.compile_or_get_cached

    def recorded(backend, computation, *args, **kwargs):
        name = ir.StringAttr(computation.operation.attributes["sym_name"]).value
        start = time.perf_counter()
        try:
            return original(backend, computation, *args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            if seconds > 0.3 or name.startswith("jit_step"):
                text = str(computation)
                _records.append((_test[0], name, _digest(text),
                                 _digest(_CONSTANT.sub("dense<C>", text)), seconds))
    compiler.compile_or_get_cached = recorded


def _dump() -> None:
    RECORDS.mkdir(parents=True, exist_ok=True)
    (RECORDS / f"{os.getpid()}.json").write_text(json.dumps(_records))


def pytest_configure(config):  # noqa: D103 (pytest hook)
    _install()
    atexit.register(_dump)


def pytest_runtest_setup(item):  # noqa: D103
    _test[0] = item.nodeid


def summarize(records: list, only_steps: bool) -> dict:
    """Distinct programs, distinct once constants are blanked, and the compile seconds the
    blanking would save (every program of a blanked group but its costliest)."""
    rows = [r for r in records if r[1].startswith("jit_step")] if only_steps else records
    cost: dict[str, float] = {}
    groups = collections.defaultdict(set)
    for _, _, full, blanked, seconds in rows:
        cost[full] = max(cost.get(full, 0.0), seconds)  # its compile; the rest were loads
        groups[blanked].add(full)
    saved = sum(sum(sorted(cost[f] for f in fulls)[:-1]) for fulls in groups.values())
    return {"programs": len(cost), "programs_with_constants_blanked": len(groups),
            "compile_s": round(sum(cost.values()), 1),
            "compile_or_load_s": round(sum(r[4] for r in rows), 1),
            "saved_if_constants_were_inputs_s": round(saved, 1)}


def main() -> int:
    records = [r for f in sorted(RECORDS.glob("*.json")) for r in json.loads(f.read_text())]
    if not records:
        print(f"no records in {RECORDS}: run pytest with -p compile_census first",
              file=sys.stderr)
        return 2
    by_file = collections.Counter()
    for test, _, _, _, seconds in records:
        by_file[test.split("::")[0]] += seconds
    result = {"steps": summarize(records, True), "all_over_0.3s": summarize(records, False),
              "compile_or_load_s_by_file": {k: round(v, 1) for k, v in by_file.most_common()}}
    out = ROOT / "benchmarks" / "results" / "compile_census.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
