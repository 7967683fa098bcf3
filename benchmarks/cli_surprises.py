"""Benchmark: the command line as a new user meets it, on the inputs issue 33 listed.

Each case is run as a real process (`python -m jaxscale.cli.main ARGS`, COLUMNS=100, off a
terminal, in an empty temporary folder) and judged by what the user sees:

    refuse    exit 2, one line on stderr, no traceback, nothing written
    note      exit 0, no traceback, and the given words on stderr (a visible note)
    either    refuse, or note
    fits      exit 0, no traceback, no line wider than 100 columns, no cut cell (…)
    help      exit 0 and each given option's help line says its default
    clean     no traceback and the given words in the output
    (a word that starts with ! must not appear)
    pipe      `... | head -1`: no traceback (a closed pipe is not an error to report)

    python benchmarks/cli_surprises.py [--label NAME]

Prints one line per case and the count that behave; writes
benchmarks/results/cli_surprises[-LABEL].json. Run it on two commits to compare them.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = ["plan", "--params", "7e9", "--devices", "8"]
TRAIN = ["train", "--model", "tiny", "--eval-every", "1000"]
CASES = [  # (issue item, kind, argv, words)
    ("2", "fits", PLAN, ()),
    ("2", "fits", ["memory", "--params", "7e9"], ()),
    ("3", "refuse", ["plan", "--params", "1e6", "--devices", "8"], ("1e+06",)),
    ("3", "refuse", ["plan", "--params", "1e15", "--devices", "8"], ()),
    ("4", "refuse", [*TRAIN, "--steps", "2", "--profile", "FILE"], ("FILE",)),
    ("4", "refuse", ["bench", "--profile", "FILE"], ("FILE",)),
    ("4", "refuse", ["compare", "--profile", "FILE"], ("FILE",)),
    ("4", "refuse", ["data", "clean", "--docs", "200", "--out", "/proc/x"], ("/proc",)),
    ("4", "refuse", [*TRAIN, "--steps", "2", "--out", "/proc/x"], ("/proc",)),
    ("4", "refuse", ["compare", "--out", "/proc/x"], ("/proc",)),
    ("4", "refuse", ["bench", "--profile", "/proc/x"], ("/proc",)),
    ("4", "refuse", ["schedule", "--png", "/proc/x.png"], ("/proc",)),
    ("4", "refuse", ["checkpoint", "ls", "/proc"], ("/proc",)),
    ("4", "refuse", ["schedule", "--png", "s.txt"], (".png",)),
    ("6", "either", [*TRAIN, "--warmup", "5000", "--steps", "10"], ("warm",)),
    ("6", "refuse", [*TRAIN, "--inject", "nan@50", "--steps", "10"], ("nan@50",)),
    ("6", "note", [*TRAIN, "--devices", "2", "--steps", "2"], ("dp=2",)),
    ("6", "either", ["comm", "--params", "7e9", "--tp", "4"], ("--tp",)),
    ("6", "refuse", ["memory", "--params", "7e9", "--pp", "4", "--virtual", "2",
                     "--micro-batches", "1"], ("m=1",)),
    ("6", "refuse", ["memory", "--params", "7e9", "--pp", "2", "--virtual", "2",
                     "--micro-batches", "3"], ("m=3",)),
    ("6", "either", ["failures", "--async-blocking-minutes", "20", "--save-minutes", "10"],
     ("cannot win",)),
    ("7", "refuse", [*PLAN, "--fix", "dp=3"], ("dp=3",)),
    ("7", "refuse", [*PLAN, "--fix", "dp=1,dp=2"], ("dp",)),
    ("7", "refuse", [*PLAN, "--fix", "tp=128"], ("tp=128",)),
    ("7", "refuse", ["compare", "--devices", "100000"], ("devices",)),
    ("7", "refuse", [*TRAIN, "--mesh", "dp=2,tp=2,pp=2", "--schedule", "interleaved",
                     "--virtual", "3", "--micro-batches", "4"], ("virtual", "!from []")),
    ("7", "refuse", ["launch", "--processes", "2", "--devices-per-process", "4", "--",
                     "compare", "--abstract"], ("--abstract",)),
    ("7", "pipe", PLAN, ()),
    ("8", "clean", [], ("usage",)),
    ("8", "clean", ["train", "--stpes", "5"], ("--steps",)),
    ("8", "help", ["train", "--help"], ("--devices", "--mesh", "--zero", "--remat",
                                        "--precision")),
    ("8", "help", ["memory", "--help"], ("--tp", "--pp", "--cp", "--schedule",
                                         "--bytes-per-param", "--offload")),
    ("8", "clean", ["checkpoint", "prune", "--help"], ("--keep",)),
]


def run(argv, cwd, pipe=False, timeout=600):
    env = {**os.environ, "COLUMNS": "100", "PYTHONPATH": str(ROOT)}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jaxscale.cli.main", *argv]
    if pipe:
        cmd = ["bash", "-c", " ".join(cmd) + " | head -1"]
    try:
        r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True,
                           timeout=timeout)
        return r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired:
        return None, "", "timed out"


def option_help(text: str) -> dict[str, str]:
    """argparse's help, cut into {--option: its lines} (an option's block runs until the
    next line that starts a new option or a section)."""
    blocks, current = {}, None
    for line in text.splitlines():
        head = re.match(r"\s{2}(-\w, )?(--[\w-]+)", line)
        if head:
            current = head.group(2)
            blocks[current] = line
        elif current and line.startswith(" " * 6):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def judge(kind, words, rc, out, err, left) -> bool:
    if "Traceback" in out + err or "BrokenPipe" in err or rc is None:
        return False
    if any(w.startswith("!") and w[1:] in out + err for w in words):
        return False  # words that must not appear
    words = [w for w in words if not w.startswith("!")]
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    refused = rc == 2 and len(lines) == 1 and not left and all(w in err for w in words)
    noted = rc == 0 and all(w in out + err for w in words)
    if kind == "refuse":
        return refused
    if kind == "note":
        return noted
    if kind == "either":
        return refused or noted
    if kind == "fits":
        return rc == 0 and "…" not in out and max(map(len, out.splitlines() or [""])) <= 100
    if kind == "help":
        blocks = option_help(out)
        return rc == 0 and all("default" in blocks.get(w, "") for w in words)
    return all(w in out + err for w in words)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    results, t0 = [], time.perf_counter()
    for item, kind, argv, words in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "FILE").write_text("a file where a folder is wanted\n")
            rc, out, err = run(argv, tmp, pipe=kind == "pipe")
            left = sorted(p.name for p in Path(tmp).iterdir() if p.name != "FILE")
        ok = judge(kind, words, rc, out, err, left)
        results.append({"item": item, "kind": kind, "argv": argv, "ok": ok, "rc": rc,
                        "stderr_tail": err[-400:], "left_behind": left})
        print(f"{'ok  ' if ok else 'BAD '} item {item} {kind:6} jaxscale {' '.join(argv)}")
    n_ok = sum(r["ok"] for r in results)
    name = "cli_surprises" + (f"-{args.label}" if args.label else "")
    summary = {"benchmark": "cli_surprises", "label": args.label, "cases": len(results),
               "behave": n_ok, "wall_s": round(time.perf_counter() - t0, 1),
               "date": time.strftime("%Y-%m-%d"), "results": results}
    (ROOT / "benchmarks" / "results" / f"{name}.json").write_text(
        json.dumps(summary, indent=1) + "\n")
    print(f"{n_ok} of {len(results)} cases behave")
    return 0


if __name__ == "__main__":
    sys.exit(main())
