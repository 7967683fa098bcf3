"""What every experiment module shares: its command line, the parts loop, results.json."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path


def log(msg: str) -> None:
    """Progress on stderr, so that --json output on stdout stays one clean object."""
    print(msg, file=sys.stderr, flush=True)


def run_experiment(name: str, doc: str, parts: dict, titles: dict, make_lab, argv=None) -> int:
    """Parse the command line, run the chosen parts on one shared lab, write results.json.

    Each part is part(lab, out_dir) -> dict of its figures; it prints its own tables.
    """
    ap = argparse.ArgumentParser(prog=f"python -m experiments.{name}",
                                 description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=f"runs/{name}", help="folder for PNGs and results.json")
    ap.add_argument("--parts", default="".join(parts),
                    help=f"which parts to run, any of {''.join(parts)} (default all)")
    ap.add_argument("--json", action="store_true", help="print all results as one JSON object")
    ap.add_argument("--seed", type=int, default=0, help="corpus and initialisation seed")
    args = ap.parse_args(argv)
    bad = sorted(set(args.parts) - set(parts))
    if bad or not args.parts:
        ap.error(f"unknown part(s) {''.join(bad) or repr(args.parts)}; choose from {''.join(parts)}")
    from jaxscale.runtime.compile_cache import enable_compilation_cache
    enable_compilation_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lab = make_lab(args.seed)
    results, timings = {}, {}
    # with --json, stdout carries only the JSON object: the tables go to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        for key in [k for k in parts if k in args.parts]:
            t = time.perf_counter()
            log(f"[{key}] {titles[key]}...")
            results[key] = parts[key](lab, out)
            timings[key] = time.perf_counter() - t
    results["timings_s"] = {**timings, "total": time.perf_counter() - t0}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    log(f"done in {results['timings_s']['total']:.1f} s; figures and results.json in {out}/")
    if args.json:
        print(json.dumps(results, default=str))
    return 0
