"""Day 4 (week 2) §4-§5: the memory and communication checks, computed from closed forms.

    python -m experiments.day4_checks [--out runs/day4_checks] [--parts 3567] [--json]

3. 7B full training: model states, activations (Korthikanti), flash attention, checkpointing
5. ZeRO stages per device: 7B on 8 devices (GiB), the ZeRO paper's 7.5B on 64 (GB), and
   lecture 13 exercise 2 (70B)
6. the pipeline bubble (p-1)/(m+p-1), the micro-batches needed for a bubble <= 10%, and
   the activations GPipe and 1F1B keep in flight
7. communication per step: data parallel (7B, 8 devices), tensor parallel (one all-reduce,
   a step, its time on NVLink and InfiniBand), and lecture 13 §4.4's three strategies

Parts are named after the notes' check groups. Everything printed is computed here from
jaxscale.costmodel; only the inputs (model sizes, link speeds) come from the notes.
"""
from __future__ import annotations

import sys
from pathlib import Path

from experiments._runner import run_experiment
from jaxscale import costmodel as cm
from jaxscale.report import print_table

GIB, GB = 2**30, 1e9

# Llama-2-7B, as in the notes' group 3: 6.74e9 parameters, 32 layers, h = 4096, 32 heads,
# sequence 4096, one sequence per device, bf16 mixed precision.
LLAMA7B = {"params": 6.74e9, "layers": 32, "hidden": 4096, "heads": 32, "seq": 4096, "batch": 1}


def part_3(lab, out: Path) -> dict:
    m = LLAMA7B
    states = cm.model_state_bytes(m["params"], 1)["total"]
    shape = (m["layers"], m["seq"], m["batch"], m["hidden"], m["heads"])
    acts = {
        "stored (Korthikanti)": cm.activation_bytes(*shape),
        "flash attention": cm.activation_bytes(*shape, flash_attention=True),
        "checkpointing (each layer's input + one layer)": cm.activation_bytes(*shape, recompute=True),
        "checkpointing + flash attention": cm.activation_bytes(*shape, flash_attention=True,
                                                               recompute=True),
    }
    rows = [{"what": "model states (16 bytes/parameter)", "bytes": states, "with_states": states}]
    rows += [{"what": f"activations, {k}", "bytes": v, "with_states": states + v}
             for k, v in acts.items()]
    # forward = 1 unit, backward = 2; recomputation adds one forward: (1 + 2 + 1) / (1 + 2)
    recompute_cost = (1 + 2 + 1) / (1 + 2) - 1
    print_table(f"3. 7B full training ({m['params']:.3g} parameters, {m['layers']} layers, "
                f"h = {m['hidden']}, {m['heads']} heads, {m['batch']} x {m['seq']} tokens per "
                "device, bf16 mixed precision)",
                ["", "GiB", "GB", "with model states, GiB", "fits one 80 GB device"],
                [[r["what"], r["bytes"] / GIB, r["bytes"] / GB, r["with_states"] / GIB,
                  "yes" if r["with_states"] <= 80 * GB else "no"] for r in rows])
    print(f"checkpointing costs one more forward: +{100 * recompute_cost:.0f}% compute")
    return {"inputs": m, "rows": rows, "recompute_extra_compute": recompute_cost,
            "per_layer": cm.activation_bytes_per_layer(m["seq"], m["batch"], m["hidden"], m["heads"]),
            "per_layer_flash": cm.activation_bytes_per_layer(m["seq"], m["batch"], m["hidden"],
                                                             m["heads"], True)}


def _zero_rows(params: float, k: int, unit: float) -> list[dict]:
    names = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    return [{"stage": names[z], **{key: v / unit for key, v in cm.model_state_bytes(params, k, z).items()},
             "comm_vs_ddp": 1.5 if z == 3 else 1.0} for z in range(4)]


def part_5(lab, out: Path) -> dict:
    tables = {"7B on 8 devices (GiB)": (7e9, 8, GIB), "Llama-2-7B on 8 devices (GiB)": (6.74e9, 8, GIB),
              "ZeRO paper: 7.5B on 64 devices (GB)": (7.5e9, 64, GB)}
    res = {}
    for title, (params, k, unit) in tables.items():
        rows = _zero_rows(params, k, unit)
        print_table(f"5. {title}: per-device model states, mixed-precision Adam 2 + 2 + 12 "
                    "bytes per parameter", ["", "parameters", "gradients", "optimizer", "total",
                                            "communication vs DDP"],
                    [[r["stage"], r["params"], r["grads"], r["optimizer"], r["total"],
                      r["comm_vs_ddp"]] for r in rows])
        res[title] = {"params": params, "devices": k, "unit_bytes": unit, "rows": rows}
    # lecture 13 exercise 2: 70B
    full = cm.model_state_bytes(70e9, 1)["total"]
    z3 = cm.model_state_bytes(70e9, 64, 3)["total"]
    cards = next(n for n in range(1, 10**6) if cm.model_state_bytes(70e9, n, 3)["total"] <= 80 * GB)
    ex2 = {"total_GB": full / GB, "zero3_on_64_GB": z3 / GB, "min_80GB_cards_zero3": cards}
    print_table("5. lecture 13 exercise 2: 70B, mixed-precision Adam", ["", "value"],
                [["model states in all (GB)", ex2["total_GB"]],
                 ["ZeRO-3 on 64 devices, per device (GB)", ex2["zero3_on_64_GB"]],
                 ["fewest 80 GB devices for the model states alone (ZeRO-3)", cards]])
    res["exercise_2"] = ex2
    return res


def part_6(lab, out: Path) -> dict:
    stages, mbs = (2, 4, 8), (1, 2, 4, 8, 16, 32, 64)
    grid = {p: {m: cm.bubble_over_total(p, m) for m in mbs} for p in stages}
    print_table("6. pipeline bubble (p-1)/(m+p-1), p stages, m micro-batches",
                ["p", *[f"m = {m}" for m in mbs]],
                [[p, *[f"{100 * f:.1f}%" for f in row.values()]] for p, row in grid.items()])
    need = {p: next(m for m in range(1, 10**6) if cm.bubble_over_total(p, m) <= 0.1)
            for p in (2, 4, 8, 16)}
    print_table("6. fewest micro-batches for a bubble <= 10% (lecture 13 exercise 3), and the "
                "micro-batches' activations a stage keeps: GPipe all m, 1F1B at most p",
                ["p", "m needed", "bubble then", "GPipe keeps", "1F1B keeps"],
                [[p, m, f"{100 * cm.bubble_over_total(p, m):.2f}%", m, min(m, p)]
                 for p, m in need.items()])
    return {"bubble": {str(p): {str(m): f for m, f in row.items()} for p, row in grid.items()},
            "min_micro_batches_for_10pct": {str(p): m for p, m in need.items()},
            "in_flight": {str(p): {"gpipe": m, "1f1b": min(m, p)} for p, m in need.items()}}


def part_7(lab, out: Path) -> dict:
    dp = cm.dp_gradient_allreduce(7e9, 8, grad_bytes=2)
    tp = cm.tp_step_volume(layers=32, seq=4096, batch=1, hidden=4096, tp=8)
    links = {"NVLink ~600 GB/s": 600e9, "InfiniBand ~25 GB/s per device": 25e9}
    rows = [{"what": "DP: ring all-reduce of 7B bf16 gradients, sent per device (8 devices)",
             "bytes": dp["ring_bytes_per_device"]},
            {"what": "TP: one all-reduce of b*s*d (1 x 4096 x 4096, bf16)",
             "bytes": tp["allreduce_bytes"]},
            {"what": f"TP: a step, 32 layers x 4 = {tp['allreduces_per_step']} all-reduces",
             "bytes": tp["payload_bytes_per_step"]},
            {"what": "1 GiB", "bytes": GIB}]
    for r in rows:
        r["seconds"] = {name: r["bytes"] / bw for name, bw in links.items()}
    print_table("7. communication per step, payload bytes and time = bytes / bandwidth",
                ["", "MiB", "GiB", *[f"ms on {n}" for n in links]],
                [[r["what"], r["bytes"] / 2**20, r["bytes"] / GIB,
                  *[1e3 * s for s in r["seconds"].values()]] for r in rows])
    # lecture 13 §4.4: 32 layers, h = 4096, 8 x 2048 tokens per step, bf16
    lec_tp = cm.tp_step_volume(32, 2048, 8, 4096, tp=8)
    lec_pp = cm.pp_step_volume(2048, 8, 4096, pp=4)
    lec_dp = cm.dp_gradient_allreduce(12 * 32 * 4096**2, 8, grad_bytes=2)
    lecture = {"tp_allreduce_MB": lec_tp["allreduce_bytes"] / 1e6,
               "tp_per_step_GB": lec_tp["payload_bytes_per_step"] / GB,
               "pp_boundary_per_step_MB": lec_pp["boundary_bytes_per_step"] / 1e6,
               "dp_gradients_GB": lec_dp["payload_bytes"] / GB}
    print_table("7. lecture 13 §4.4: 32 layers, h = 4096, 8 x 2048 tokens, bf16 (DP: 12 L h^2 "
                "parameters)", ["strategy", "each", "per step", "waits in every layer"],
                [["tensor parallel", f"{lecture['tp_allreduce_MB']:.0f} MB all-reduce",
                  f"{lecture['tp_per_step_GB']:.1f} GB", "yes"],
                 ["pipeline parallel", "activations + gradients at a boundary",
                  f"{lecture['pp_boundary_per_step_MB']:.0f} MB", "no"],
                 ["data parallel", "one all-reduce of every gradient",
                  f"{lecture['dp_gradients_GB']:.1f} GB", "no (overlaps backward)"]])
    return {"rows": rows, "links_bytes_per_s": links, "lecture13": lecture}


PARTS = {"3": part_3, "5": part_5, "6": part_6, "7": part_7}
TITLES = {"3": "7B training memory", "5": "ZeRO stages", "6": "pipeline bubble",
          "7": "communication per step"}


def main(argv=None) -> int:
    return run_experiment("day4_checks", __doc__, PARTS, TITLES, lambda seed: None, argv)


if __name__ == "__main__":
    sys.exit(main())
