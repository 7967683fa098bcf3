"""Reading XLA's HLO text: its computations, how often each runs per run of the module
(while loops' trip counts, conditional branches), and the instructions that are
collectives, with their result types and replica groups. jaxscale.measure.hlo turns
these into collectives and the bytes they move.

The text is the lowered module (`lowered.as_text(dialect="hlo")`) or an optimized one
(`compiled.as_text()`), whose types carry the target's layouts (XLA:TPU's tiles,
`bf16[8,128]{1,0:T(8,128)(2,1)}`) and whose collectives may be async -start/-done pairs.
"""
from __future__ import annotations

import re

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute",
                  "all-to-all")

# an instruction that is a collective: its name, then "=", the result type, the op
_ASSIGN = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*")
_OP = re.compile(r"\s*(?P<op>" + "|".join(COLLECTIVE_OPS) + r")(?P<start>-start)?\(")

_CALLS = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)"
                    r"=%?(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r"constant\((?P<n>\d+)\)")
_GROUPS = re.compile(r"replica_groups=\{(?P<groups>(?:\{[\d,]*\},?)*)\}")
_IOTA = re.compile(r"replica_groups=\[(?P<groups>\d+),(?P<size>\d+)\]<=\[(?P<total>\d+)\]"
                   r"(?P<transpose>T\([\d,]*\))?")


def computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """{computation name: its instruction lines}, and the entry computation's name."""
    comps, entry, current = {}, None, None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split()
            is_entry = head[0] == "ENTRY"
            current = (head[1] if is_entry else head[0]).lstrip("%")
            comps[current] = []
            entry = current if is_entry else entry
        elif current is not None and line.strip() == "}":
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps, entry


def times_run(comps: dict[str, list[str]], entry: str) -> dict[tuple[str, int | None], int]:
    """How many times each computation runs per run of `entry`, keyed by (computation,
    the index of the conditional branch it runs under, or None): while bodies run trip
    count times; each branch of a conditional as often as the conditional."""
    times: dict[tuple[str, int | None], int] = {}

    def visit(name: str, n: int, branch: int | None = None) -> None:
        times[name, branch] = times.get((name, branch), 0) + n
        for line in comps.get(name, ()):
            calls = {m["name"]: m[1] for m in _CALLS.finditer(line)}
            for b in _BRANCHES.finditer(line):
                for i, c in enumerate(b["names"].split(",")):
                    calls[c.strip().lstrip("%")] = i
            trip = 1
            if "condition" in calls.values():
                cond = next(c for c, kind in calls.items() if kind == "condition")
                trips = [int(m["n"]) for line_ in comps.get(cond, ()) for m in _TRIP.finditer(line_)]
                trip = max(trips) if trips else 1
            for callee, kind in calls.items():
                visit(callee, n * trip if kind == "body" else n,
                      kind if isinstance(kind, int) else branch)
    visit(entry, 1)
    return times


def replica_groups(line: str) -> tuple[tuple[int, ...], ...] | None:
    """Replica groups of an HLO collective: explicit ({{0,1},{2,3}}), iota ([2,4]<=[8]:
    2 groups of 4 consecutive devices), () when absent, None for "all devices" ({})."""
    if (g := _GROUPS.search(line)) is not None:
        groups = tuple(tuple(int(v) for v in grp.split(",") if v)
                       for grp in re.findall(r"\{([\d,]*)\}", g["groups"]))
        return groups or None
    if (g := _IOTA.search(line)) is not None:
        n_groups, size = int(g["groups"]), int(g["size"])
        if g["transpose"] or n_groups * size != int(g["total"]):
            raise ValueError(f"replica groups written as {g[0]!r} are not read here; "
                             "only explicit lists and plain iota [groups,size]<=[n]")
        return tuple(tuple(range(i * size, (i + 1) * size)) for i in range(n_groups))
    return ()


def collective_result(line: str) -> tuple[str, str] | None:
    """(op, the text of its result type) when `line` is a collective, else None. An async
    pair is read at its -start, whose type holds more than the result: all-gather-start
    and collective-permute-start are (operands, results[, contexts]), so their result is
    the tuple's second element; all-reduce-start's type is its result."""
    head = _ASSIGN.match(line)
    if head is None:
        return None
    rest = line[head.end():]
    if rest.startswith("("):  # a tuple, its layouts holding parentheses of their own
        end = _closing(rest)
        result, rest = rest[:end + 1], rest[end + 1:]
    else:
        result, _, rest = rest.partition(" ")
        rest = " " + rest
    m = _OP.match(rest)
    if m is None:
        return None
    if m["start"] and m["op"] != "all-reduce" and result.startswith("("):
        result = _elements(result)[1]
    return m["op"], result


def _closing(text: str) -> int:
    """The index of the parenthesis that closes the one `text` opens with."""
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced HLO type: {text[:80]!r}")


def _elements(tuple_text: str) -> list[str]:
    """A tuple type's top-level elements: "(a, (b, c), d)" -> ["a", "(b, c)", "d"]."""
    out, depth, start = [], 0, 1
    for i, ch in enumerate(tuple_text[1:-1], start=1):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(tuple_text[start:i].strip())
            start = i + 1
    out.append(tuple_text[start:-1].strip())
    return out
