"""Benchmark: how well the calibrated time model orders `jaxscale compare`'s strategies.

    python benchmarks/compare_time_model.py [--repeats 3]

Runs `jaxscale compare` (defaults: 8 forced CPU devices, the tiny model, every default
strategy) `repeats` times in fresh processes. Each run measures its own calibration (the
matmul rate, the all-reduce bandwidth, the latency of one collective) and predicts every
strategy's step time from its FLOPs, its predicted bytes and its HLO's collectives
(jaxscale/compare/time_model.py). Records, per run and as medians over the runs: the
rank agreement (Spearman's rho between predicted and measured step times) and each row's
measured / predicted ratio, in benchmarks/results/compare_time_model.json.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    runs = []
    for i in range(args.repeats):
        r = subprocess.run([str(ROOT / ".venv" / "bin" / "jaxscale"), "compare", "--json",
                            "--out", str(ROOT / "runs" / "bench_compare_time")], cwd=ROOT,
                           capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"jaxscale compare failed:\n{r.stderr[-4000:]}")
        res = json.loads(r.stdout)
        rows = {x["name"]: {"measured_s": x["step_s"], "predicted_s": x.get("step_s_predicted"),
                            "predicted": x.get("step_predicted"),
                            "collectives_per_step": x.get("collectives_per_step"),
                            "measured_over_predicted": x.get("step_measured_over_predicted")}
                for x in res["rows"] if x["status"] == "ok"}
        runs.append({"time_model": res["time_model"], "rows": rows})
        print(f"run {i + 1}/{args.repeats}: rank agreement "
              f"{res['time_model']['rank_agreement']:.3f}, measured / predicted median "
              f"{res['time_model']['median_measured_over_predicted']:.3g}", file=sys.stderr)
    names = list(runs[0]["rows"])
    out = {"command": "jaxscale compare", "cores": os.cpu_count(), "repeats": args.repeats,
           "rank_agreement": [r["time_model"]["rank_agreement"] for r in runs],
           "rank_agreement_median": statistics.median(
               r["time_model"]["rank_agreement"] for r in runs),
           "measured_over_predicted_median": {
               n: statistics.median(r["rows"][n]["measured_over_predicted"] for r in runs)
               for n in names if all(r["rows"][n]["measured_over_predicted"] for r in runs)},
           "runs": runs}
    path = ROOT / "benchmarks" / "results" / "compare_time_model.json"
    path.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: out[k] for k in ("rank_agreement", "rank_agreement_median",
                                          "measured_over_predicted_median")}, indent=1))


if __name__ == "__main__":
    main()
