"""`jaxscale plan --verify N --target T`: the planner's best layouts, compiled for the target.

The planner ranks layouts by closed forms (jaxscale.costmodel.planner). Here its top N
become executable Plans, each is compiled by XLA:TPU for the target slice from this machine
(jaxscale.compare.abstract, on libtpu's compile-only devices), and the list is ranked
again: the layouts the compiler says fit the chip first, in the planner's order, then
those it refused. Beside each: the planner's memory per device, the compiler's, and the
planner's error on it.
"""
from __future__ import annotations

from jaxscale.compare import abstract
from jaxscale.parallel.fits import check_divisible
from jaxscale.parallel.plan import Plan, PlanError

PRECISION_OF_BUDGET = {"mixed-adam": "bf16", "fp32-adam": "fp32"}


def to_plan(layout: dict, micro_batches: int, budget: str) -> Plan:
    """The executable Plan of a planner layout (its degrees, ZeRO stage, recomputation,
    micro-batches and schedule; the precision from the byte budget)."""
    if budget not in PRECISION_OF_BUDGET:
        raise PlanError(f"the byte budget {budget!r} has no precision policy to compile; "
                        f"use one of {', '.join(PRECISION_OF_BUDGET)}")
    return Plan(dp=layout["dp"], tp=layout["tp"], pp=layout["pp"], cp=layout["cp"],
                sequence_parallel=layout["sequence_parallel"], zero_stage=layout["zero"],
                micro_batches=micro_batches, virtual=layout["virtual"],
                schedule=layout["schedule"], remat=layout["recompute"],
                precision=PRECISION_OF_BUDGET[budget])


def verify(cfg, candidates: list[dict], target, devices, batch: int, budget: str) -> dict:
    """Compile each planner row in `candidates` (best first) for the target; the rows with
    the compiler's figures, and their order once ranked by what fits."""
    rows = []
    for rank, cand in enumerate(candidates, 1):
        row = {"rank": rank, "name": cand["name"], "predicted_bytes": cand["memory"]["total"]}
        try:
            plan = to_plan(cand["layout"], cand["micro_batches"], budget)
            plan.validate()
            check_divisible(cfg, plan)
        except PlanError as e:
            rows.append({**row, "buildable": False, "why": str(e), "fits": False})
            continue
        compiled = abstract.run_abstract(cfg, {cand["name"]: plan}, devices, batch, target)[0]
        needed = compiled["needed_bytes"]
        rows.append({**row, "buildable": True, "plan": plan.layout(), "fits": compiled["fits"],
                     "compiled_bytes": needed, "refused": compiled.get("refused"),
                     "error": None if needed is None else row["predicted_bytes"] / needed - 1,
                     "memory": compiled["memory"]})
    order = [r["rank"] for r in rows if r["fits"]] + [r["rank"] for r in rows if not r["fits"]]
    return {"target": target.name, "hbm_bytes": target.hbm_bytes, "rows": rows,
            "reranked": order}
