"""A compare run kept as a baseline, and a later run checked against it.

`compare --save-baseline FILE` writes the finished run (its compare.json); `compare
--baseline FILE` first checks that FILE is a run of the same job (model, devices, steps,
batch, and the platform its single device ran on: else the field that differs, before
anything compiles), then, after the run, compares every strategy both have (one that ran
then and fails now is listed as moved):

  losses   the largest relative difference, step by step, from the baseline's losses must
           stay within this run's bound (compare's measured tolerance): the same numerics
  bytes    the bytes each collective sends per device per step must be equal, exactly
  memory   the model-state bytes per device and XLA's temporaries must be equal, exactly

What moved is listed (strategy, what, baseline, now); a run that moved anything exits 1,
like a strategy that misses the bound. This is how to check that a change to a model, to
a layout or to jaxscale left a layout's numerics and costs alone.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

SAME_JOB = ("model", "devices", "steps", "batch_size")  # and the platform it ran on


class BaselineError(ValueError):
    """A baseline that cannot be read, or is a run of another job; the message says which."""


def load(path, job: dict) -> dict:
    """The baseline at `path`, checked to be a complete run of the same job as `job`
    (its platform: "cpu", "gpu" or "tpu" where known before the run, else None)."""
    try:
        base = json.loads(Path(path).read_text())
    except OSError as e:
        raise BaselineError(f"cannot read the baseline {str(path)!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise BaselineError(f"the baseline {str(path)!r} is not JSON (line {e.lineno}): "
                            "give a compare.json") from None
    if not isinstance(base, dict) or not isinstance(base.get("rows"), list):
        raise BaselineError(f"the baseline {str(path)!r} has no rows: give a compare.json "
                            "written by jaxscale compare (or --save-baseline)")
    if base.get("abstract"):
        raise BaselineError(f"the baseline {str(path)!r} is a compile-only run (--abstract): "
                            "it has no losses to compare")
    ran_on = next((r.get("platform") for r in base["rows"] if r.get("name") == "single"), None)
    if job["platform"] is not None and ran_on is not None and ran_on != job["platform"]:
        raise BaselineError(f"the baseline {str(path)!r} ran on {ran_on}, this run runs on "
                            f"{job['platform']}: compare like with like")
    single = next((r.get("plan") or {} for r in base["rows"] if r.get("name") == "single"), {})
    if job.get("precision") and single.get("precision", "fp32") != job["precision"]:
        raise BaselineError(f"the baseline {str(path)!r} ran in precision "
                            f"{single.get('precision', 'fp32')!r}, this run in "
                            f"{job['precision']!r}: "
                            "compare like with like")
    for field in SAME_JOB:
        if base.get(field) != job.get(field):
            raise BaselineError(f"the baseline {str(path)!r} is a run with {field} = "
                                f"{base.get(field)!r}, this run has {job.get(field)!r}: "
                                "compare like with like")
    return base


def moved(base: dict, result: dict) -> dict:
    """What moved between the baseline's rows and this run's (module docstring)."""
    tolerance = (result.get("noise") or {}).get("tolerance")
    then = {r["name"]: r for r in base["rows"] if r.get("status") == "ok"}
    now = {r["name"]: r for r in result["rows"]}
    shared = [r for r in result["rows"] if r.get("status") == "ok" and r["name"] in then]
    changes = [_change(now[n], "status", "ok", now[n].get("status")) for n in then
               if n in now and now[n].get("status") != "ok"]  # ran then, fails now
    for row in shared:
        old = then[row["name"]]
        drift = _max_rel_diff(row["losses"], old["losses"])
        if tolerance is None or not drift <= tolerance:  # a NaN is a change
            changes.append(_change(row, "losses (largest relative difference)", 0.0, drift))
        for op in sorted(set(row["sent"]) | set(old["sent"])):
            if row["sent"].get(op, 0) != old["sent"].get(op, 0):
                changes.append(_change(row, f"bytes sent: {op}", old["sent"].get(op, 0),
                                       row["sent"].get(op, 0)))
        for what, get in (("model-state bytes", lambda r: r.get("states_measured")),
                          ("XLA temporaries", lambda r: r["memory"].get("temporaries"))):
            if get(row) != get(old):
                changes.append(_change(row, what, get(old), get(row)))
    return {"compared": [r["name"] for r in shared], "tolerance": tolerance,
            "only_in_baseline": sorted(set(then) - {r["name"] for r in result["rows"]}),
            "moved": changes, "unchanged": not changes}


def _max_rel_diff(now: list[float], then: list[float]) -> float:
    if len(now) != len(then):
        return float("inf")
    diffs = [abs(a - b) / abs(b) for a, b in zip(now, then)]  # a NaN anywhere is a NaN
    return math.nan if any(math.isnan(d) for d in diffs) else max(diffs, default=0.0)


def _change(row: dict, what: str, then, now) -> dict:
    return {"strategy": row["name"], "what": what, "baseline": then, "now": now}
