"""Benchmark: Ctrl-C at 20 random instants of a run that saves a checkpoint every step.

Each round starts `jaxscale train` (resuming from the last round's checkpoints), waits
until it has saved a step newer than the round before, sleeps a random 0-0.3 s (a sync
save of the tiny model takes about that long, so many land inside one) and sends SIGINT,
as a terminal's Ctrl-C does. What must hold every time: exit code 130 (or 0 if the run had
already finished), no traceback and no "Event loop is closed" on stderr, the latest
complete checkpoint never older than before, and a line that names the command which
resumes. At the end a last run resumes to the final step: its loss curve must equal an
uninterrupted run's bit for bit.

The suite keeps the deterministic half (tests/training/test_interrupt.py: SIGINT at each
phase of a save, sync and async); this is the random half, in real processes, whose
interpreter shutdown is where the tracebacks used to come from.

    python benchmarks/ctrl_c.py [--rounds 20] [--seed 0]

Writes benchmarks/results/ctrl_c.json.
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from jaxscale.training.checkpoint.store import TMP_MARK, complete_steps  # noqa: E402

TRAIN = ["--model", "tiny", "--steps", "60", "--eval-every", "1000", "--batch-size", "8",
         "--warmup", "5", "--json"]


def jaxscale(*args):
    return [sys.executable, "-m", "jaxscale.cli.main", *args]


def latest(d: Path) -> int:
    return (complete_steps(d) or [0])[-1] if d.is_dir() else 0


def one_round(d: Path, delay: float, timeout: float = 300.0) -> dict:
    before = latest(d)
    cmd = jaxscale("train", *TRAIN, "--checkpoint-dir", str(d), "--checkpoint-every", "1",
                   *(["--resume"] if before else []))
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    t0 = time.monotonic()
    while proc.poll() is None and latest(d) <= before and time.monotonic() - t0 < timeout:
        time.sleep(0.002)
    time.sleep(delay)
    sent = proc.poll() is None
    if sent:
        proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=timeout)
    return {"delay_s": round(delay, 3), "sent": sent, "rc": proc.returncode,
            "latest_before": before, "latest_after": latest(d),
            "traceback": "Traceback" in err or "Event loop is closed" in err,
            "held_for_save": "finishing the checkpoint" in err,
            "resume_hint": "--resume" in err,
            "leftovers": sorted(p.name for p in d.iterdir() if TMP_MARK in p.name)
            if d.is_dir() else [], "stderr_tail": err[-600:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp) / "ck"
        straight = subprocess.run(jaxscale("train", *TRAIN), cwd=ROOT, capture_output=True,
                                  text=True, check=True)
        want = json.loads(straight.stdout.splitlines()[-1])["loss_curve"]
        rounds = []
        for k in range(args.rounds):
            rounds.append(one_round(d, rng.uniform(0.0, 0.3)))
            r = rounds[-1]
            print(f"round {k + 1}: rc {r['rc']}, step {r['latest_before']} -> "
                  f"{r['latest_after']}, held {r['held_for_save']}, traceback {r['traceback']}",
                  file=sys.stderr)
        final = subprocess.run(jaxscale("train", *TRAIN, "--checkpoint-dir", str(d),
                                        "--checkpoint-every", "1", "--resume"),
                               cwd=ROOT, capture_output=True, text=True)
        got = json.loads(final.stdout.splitlines()[-1])["loss_curve"] if final.stdout else []
    ok = all(r["rc"] in (130, 0) and not r["traceback"] and not r["leftovers"]
             and r["latest_after"] >= r["latest_before"]
             and (r["rc"] == 0 or r["resume_hint"]) for r in rounds)
    result = {"benchmark": "ctrl_c", "rounds": rounds, "seed": args.seed,
              "interrupted_inside_a_save": sum(r["held_for_save"] for r in rounds),
              "final_rc": final.returncode, "final_equals_uninterrupted": got == want,
              "all_clean": ok, "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count()}
    path = ROOT / "benchmarks" / "results" / "ctrl_c.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{len(rounds)} Ctrl-Cs, {result['interrupted_inside_a_save']} inside a save; "
          f"all clean: {ok}; resumed run equals the uninterrupted one: {got == want}; "
          f"written to {path}")
    return 0 if ok and got == want else 1


if __name__ == "__main__":
    sys.exit(main())
