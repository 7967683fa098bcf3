"""`jaxscale explain`'s tables: the tensors, what fills memory inside the step, the totals."""
from __future__ import annotations

import re

from jaxscale.compare.explain import HISTORY, KINDS, PERSISTENT, TRANSIENT
from jaxscale.report import print_table


def _piece(r) -> str:
    return "x".join(map(str, r["per_device_shape"])) or "scalar"


def _axes(r) -> str:
    a = r["logical_axes"]
    return "-" if a is None else a if isinstance(a, str) else ",".join(a)


def _kind(r) -> str:
    return r["kind"] + (f" {r['slot']}" if r["slot"] else "")


def tensors(run: dict) -> None:
    rows = sorted(run["rows"], key=lambda r: (KINDS.index(r["kind"]), r["slot"] or "",
                                              r["name"]))
    print_table(f"{run['strategy']}: every tensor of the training state, and the gradients "
                "inside the step, on each device",
                ["tensor", "kind", "logical axes", "spec", "piece", "dtype", "bytes",
                 "copies"],
                [[r["name"], _kind(r), _axes(r), r["spec"], _piece(r), r["dtype"],
                  f"{r['bytes_per_device']:,}", f"{r['replicas']} of {r['devices']}"]
                 for r in rows])


def differences(runs, diff) -> None:
    a, b = (r["strategy"] for r in runs)

    def cell(r):
        return "absent" if r is None else (f"{r['spec']} {_piece(r)} {r['dtype']} "
                                           f"{r['bytes_per_device']:,} B x{r['replicas']}")
    print_table(f"the {len(diff)} tensors placed differently (spec, piece, dtype, bytes per "
                "device, copies)", ["tensor", "kind", a, b],
                [[d["name"], d["kind"] + (f" {d['slot']}" if d["slot"] else ""), cell(d["a"]),
                  cell(d["b"])] for d in diff])


def _where(source: str) -> str:
    """'/…/jaxscale/model/attention.py:70 (causal_attention)' -> 'model/attention.py:70'."""
    return re.sub(r"^.*?/jaxscale/", "", source).split(" (")[0]


def _op(name: str) -> str:
    """jax's op_name, its last three scopes (the JSON keeps it whole): transpose(jvp(...))
    says backward, a named scope the layer."""
    parts = re.sub(r"^jit\(\w+\)/(shard_map/)?", "", name).split("/")
    return ("…/" if len(parts) > 3 else "") + "/".join(parts[-3:]) if name else "-"


def inside(run: dict) -> None:
    ins = run["inside"]
    act = ins["activations"]
    print_table(f"{run['strategy']}: what backward keeps of one layer, per device (remat "
                f"{act['remat']}; {act['rows_per_micro_batch']} rows x {act['tokens']} "
                "tokens)", ["made by", "shape", "dtype", "bytes"],
                [[r["made_by"], "x".join(map(str, r["shape"])), r["dtype"], f"{r['bytes']:,}"]
                 for r in act["rows"]])
    print(f"saved activations of the blocks per device: {act['how']} = {act['total']:,} B "
          f"(not traced: {'; '.join(act['left_out'])})")
    if "refused" in ins:
        print(f"the compiler refuses the step: {ins['refused']}")
        return
    if "peak_buffers" in ins:
        print_table(f"{run['strategy']}: the compiled step's largest buffers live at its "
                    "peak (XLA's buffer assignment)",
                    ["bytes", "shape", "instruction", "jax op", "source"],
                    [[f"{r['bytes']:,}", r["shape"], r["instruction"], _op(r["op_name"]),
                      _where(r["source"]) or "-"] for r in ins["peak_buffers"]])
    m = ins["memory"]
    peak = ins.get("at_peak", {}).get("temporary")
    print(f"XLA: arguments {m['arguments']:,} B, outputs {m['outputs']:,} B, temporaries "
          f"{m['temporaries']:,} B" + (f"; temporaries live together at the peak "
                                       f"{peak:,} B" if peak is not None else ""))


def inside_side_by_side(runs) -> None:
    def cells(run):
        ins = run["inside"]
        m = ins.get("memory")
        return [ins["activations"]["total"], m["temporaries"] if m else ins.get("refused"),
                ins.get("at_peak", {}).get("temporary", "-")]
    rows = zip(["saved activations", "temporaries (XLA)", "live at the peak"],
               *(cells(r) for r in runs))
    print_table("inside the step, bytes per device",
                ["", *(r["strategy"] for r in runs)],
                [[name, *(f"{v:,}" if isinstance(v, int) else v for v in vs)]
                 for name, *vs in rows])


def totals(runs) -> None:
    for r in runs:
        for row in r["rows"]:
            if row["flag"]:
                print(f"warning: {r['strategy']}: {row['name']} ({row['kind']}): {row['flag']}")
        t = r["totals"]
        history = f"; {HISTORY} {t[HISTORY]:,} B" if t.get(HISTORY) else ""
        print(f"{r['strategy']}: per device " + ", ".join(
            f"{k}s {t[k]:,} B" for k in (*PERSISTENT, "counter")) + history +
            f"; model state {t['model_state']:,} B (parameters + master weights + optimizer "
            "slots); inside the step " + ", ".join(f"{k}s {t[k]:,} B" for k in TRANSIENT))
