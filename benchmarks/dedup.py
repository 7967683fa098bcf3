"""Benchmark: near-duplicate removal from text to kept ids, against datasketch and rensa.

    python benchmarks/dedup.py [--docs 20000] [--repeats 3] [--devices 2] [--big 1000000]

The corpus: --docs documents of exactly 100 words of garden text (each a run of garden
documents' words), a tenth of them near-copies of an earlier one with 2 words replaced (Jaccard ~0.8);
shingles are 5 words (jaxscale.data.shingles), 128 permutations, Jaccard threshold 0.7.
Every contender goes from the list of texts to the ids it keeps:

- jaxscale fast   `clean.clean` without filters or decontamination: MinHash in JAX with
                  the fast shingle hash, LSH bands and candidate pairs, exact-Jaccard
                  verification, union-find; on one device here, in the same rounds as
                  the peers, and on --devices forced CPU devices in a process of its own;
                  timed warm (a first, cold run compiles, and is reported apart)
- jaxscale sha1   the same with datasketch's sha1 shingle hash, on one device
- datasketch      `MinHash.bulk` of each text's shingles, `MinHashLSH` (its own (b, r) for
                  the threshold) filled in an insertion session, each document queried,
                  union-find over the answers, the first of each cluster kept
- rensa           `RMinHash.from_token_sets` of the same shingle strings, `RMinHashLSH`
                  (b = 16 bands of 8 rows), `query_all`, the same union-find
- rensa words     rensa fed each document's words instead of its shingles (the way
                  rensa's own benchmarks feed it): a different, cheaper set, shown only
                  because it is the figure people quote

Every contender runs once per round, the order rotated from round to round; medians
over --repeats rounds. datasketch and rensa have no verification step, so
their kept sets differ a little from ours: the agreement with datasketch's kept set is
reported. With --big N, one more process runs jaxscale fast on N documents (and one on N/10) and
reports its resident memory before the pipeline (the texts and the runtime) and at its
peak (VmHWM), beside the size of the texts' characters and of the [N, 128] signatures.
Writes benchmarks/results/dedup.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORDS, NUM_PERM, THRESHOLD, CHANGED = 100, 128, 0.7, 2


def make_docs(n: int, seed: int = 0) -> list[str]:
    """n documents of WORDS garden words: a stream of random garden documents cut into
    consecutive pieces; every tenth a near-copy of an earlier one, CHANGED words replaced
    (Jaccard about 0.8 to it)."""
    from jaxscale.garden.sampling import sample_document
    from jaxscale.garden.words import VOCAB

    rng = np.random.default_rng(seed)
    pool = [sample_document(rng)[1:-1] for _ in range(4000)]  # token ids, no <bos>/<eos>
    vocab = np.array(VOCAB, dtype=object)
    docs: list[str] = []
    for start in range(0, n, 10000):  # in pieces, so that making them needs little memory
        m = min(10000, n - start)
        picks = rng.integers(0, len(pool), m * WORDS // 8 + 100)  # documents average > 8 words
        stream = np.concatenate([pool[i] for i in picks])[:m * WORDS].reshape(m, WORDS)
        docs += [" ".join(row) for row in vocab[stream]]
    for i in range(10, n, 10):
        copy = docs[int(rng.integers(0, i))].split()
        for j in rng.choice(WORDS, CHANGED, replace=False):
            copy[j] = f"w{rng.integers(10**6)}"
        docs[i] = " ".join(copy)
    return docs


def _kept_from_candidates(n: int, neighbours) -> np.ndarray:
    """Union-find over (i, j) candidate answers; the first document of each cluster."""
    from jaxscale.data import dedup

    edges = np.array([(i, j) for i, js in enumerate(neighbours) for j in js if j != i],
                     np.int64).reshape(-1, 2)
    return np.flatnonzero(dedup.keep_mask(dedup.clusters(n, edges)))


def run_datasketch(texts: list[str]) -> np.ndarray:
    from datasketch import MinHash, MinHashLSH

    from jaxscale.data.shingles import shingles

    sketches = MinHash.bulk([shingles(t) for t in texts], num_perm=NUM_PERM)
    index = MinHashLSH(threshold=THRESHOLD, num_perm=NUM_PERM)
    with index.insertion_session() as session:
        for i, m in enumerate(sketches):
            session.insert(i, m)
    return _kept_from_candidates(len(texts), (index.query(m) for m in sketches))


def run_rensa(texts: list[str], tokens: str) -> np.ndarray:
    from rensa import RMinHash, RMinHashLSH

    from jaxscale.data.shingles import SHINGLE_WORDS

    def shingle_strings(t):
        w = t.split()
        return [" ".join(w[i:i + SHINGLE_WORDS]) for i in range(len(w) - SHINGLE_WORDS + 1)]
    sets = [shingle_strings(t) if tokens == "shingles" else t.split() for t in texts]
    sketches = RMinHash.from_token_sets(sets, NUM_PERM, 1)
    index = RMinHashLSH(THRESHOLD, NUM_PERM, 16)
    for i, m in enumerate(sketches):
        index.insert(i, m)
    return _kept_from_candidates(len(texts), index.query_all(sketches))


def run_jaxscale(texts: list[str], shingle_hash: str, devices):
    """The pipeline's Report (its .kept are the kept ids; its stages are timed)."""
    from jaxscale.data.clean import clean
    from jaxscale.data.clean_config import CleanConfig

    cfg = CleanConfig(num_perm=NUM_PERM, threshold=THRESHOLD, shingle_hash=shingle_hash,
                      filters=(), decontaminate=False)
    return clean(texts, cfg, devices=devices)


def peak_rss() -> int:
    """The process's peak resident memory (VmHWM: unlike ru_maxrss, which a child started
    by fork and exec may inherit from its parent, it belongs to this program alone)."""
    with open("/proc/self/status") as f:
        line = next(ln for ln in f if ln.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def start_jax(n_devices: int):
    from jaxscale.runtime.devices import force_cpu_devices
    devices = force_cpu_devices(n_devices)
    os.environ.setdefault("JAXSCALE_CACHE_DIR", "off")  # compile time is measured apart
    from jaxscale.runtime.compile_cache import enable_compilation_cache
    enable_compilation_cache()
    return devices


def rounds(contenders: dict, repeats: int) -> dict:
    """Each contender once per round, the order rotated from round to round, so that the
    noise of a shared machine falls on all alike; -> name: (times, last output)."""
    names, out = list(contenders), {k: ([], None) for k in contenders}
    for r in range(repeats):
        for name in names[r % len(names):] + names[:r % len(names)]:
            t = time.perf_counter()
            kept = contenders[name]()
            out[name][0].append(time.perf_counter() - t)
            out[name] = (out[name][0], kept)
    return out


# ---- a worker process: jaxscale on more devices, or on --big documents ----------------

def worker(args) -> None:
    devices = start_jax(args.worker_devices)
    texts = make_docs(args.docs, args.seed)
    import gc
    gc.collect()
    before = current_rss()  # the texts and the runtime, before the pipeline runs
    t = time.perf_counter()
    run_jaxscale(texts, args.worker_hash, devices)  # compiles
    cold = time.perf_counter() - t
    times, report = rounds({"j": lambda: run_jaxscale(texts, args.worker_hash, devices)},
                           args.repeats)["j"]
    print(json.dumps({"cold_s": cold, "times_s": times, "kept": len(report.kept),
                      "stages_s": {st.name: st.seconds for st in report.stages},
                      "rss_before_bytes": before, "peak_rss_bytes": peak_rss(),
                      "text_bytes": sum(map(len, texts)),
                      "signature_bytes": args.docs * NUM_PERM * 4}))


def run_worker(docs: int, devices: int, shingle_hash: str, repeats: int, seed: int) -> dict:
    cmd = [sys.executable, __file__, "--worker-devices", str(devices), "--worker-hash",
           shingle_hash, "--docs", str(docs), "--repeats", str(repeats), "--seed", str(seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"worker failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--devices", default="2", help="more device counts for jaxscale fast, "
                                                   "each in its own process (1 runs here)")
    ap.add_argument("--big", type=int, default=1_000_000,
                    help="documents for the memory run (0: skip)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "dedup.json"))
    ap.add_argument("--worker-devices", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--worker-hash", default="fast", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_devices:
        return worker(args)

    devices = start_jax(1)
    texts = make_docs(args.docs, args.seed)
    cold = {}
    for shingle_hash in ("fast", "sha1"):  # the first run compiles: timed apart
        t = time.perf_counter()
        run_jaxscale(texts, shingle_hash, devices)
        cold[shingle_hash] = time.perf_counter() - t
    timed = rounds({
        "datasketch": lambda: run_datasketch(texts),
        "rensa": lambda: run_rensa(texts, "shingles"),
        "rensa words": lambda: run_rensa(texts, "words"),
        "jaxscale fast 1 device": lambda: run_jaxscale(texts, "fast", devices),
        "jaxscale sha1 1 device": lambda: run_jaxscale(texts, "sha1", devices),
    }, args.repeats)
    reference = set(timed["datasketch"][1].tolist())
    rows = {}
    for name, (times, out) in timed.items():
        med = statistics.median(times)
        kept = set(np.asarray(getattr(out, "kept", out)).tolist())
        rows[name] = {"docs_per_s": args.docs / med, "median_s": med, "times_s": times,
                      "kept": len(kept),
                      "kept_jaccard_with_datasketch": len(kept & reference) / len(kept | reference)}
        if hasattr(out, "stages"):  # jaxscale: where its time went, in the last round
            rows[name]["stages_s"] = {st.name: st.seconds for st in out.stages}
    for name, hash_ in (("jaxscale fast 1 device", "fast"), ("jaxscale sha1 1 device", "sha1")):
        rows[name]["cold_s"] = cold[hash_]
    for d in [int(x) for x in args.devices.split(",") if x.strip()]:
        r = run_worker(args.docs, d, "fast", args.repeats, args.seed)
        med = statistics.median(r["times_s"])
        rows[f"jaxscale fast {d} devices"] = {
            "docs_per_s": args.docs / med, "median_s": med, "times_s": r["times_s"],
            "kept": r["kept"], "cold_s": r["cold_s"], "stages_s": r["stages_s"],
            "own_process": True}
    for name, row in rows.items():
        print(f"{name:26s} {row['docs_per_s']:>10,.0f} docs/s  kept {row['kept']:,}",
              file=sys.stderr, flush=True)
    ours = rows["jaxscale fast 1 device"]["docs_per_s"]
    result = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version()},
        "docs": args.docs, "words_per_doc": WORDS, "num_perm": NUM_PERM,
        "threshold": THRESHOLD, "repeats": args.repeats, "runs": rows,
        "ratios_1_device": {
            "jaxscale_fast_over_datasketch": ours / rows["datasketch"]["docs_per_s"],
            "jaxscale_fast_over_rensa": ours / rows["rensa"]["docs_per_s"],
            "jaxscale_fast_over_rensa_words": ours / rows["rensa words"]["docs_per_s"],
            "jaxscale_sha1_over_datasketch":
                rows["jaxscale sha1 1 device"]["docs_per_s"] / rows["datasketch"]["docs_per_s"]},
        "targets": {"at_least_10x_datasketch": ours >= 10 * rows["datasketch"]["docs_per_s"],
                    "at_least_rensa": ours >= rows["rensa"]["docs_per_s"]},
    }
    if args.big:
        mem = {}
        for n in (args.big // 10, args.big):
            r = run_worker(n, 1, "fast", 1, args.seed)
            mem[str(n)] = {k: r[k] for k in ("rss_before_bytes", "peak_rss_bytes", "text_bytes",
                                             "signature_bytes", "cold_s", "stages_s")}
            mem[str(n)]["pipeline_bytes"] = r["peak_rss_bytes"] - r["rss_before_bytes"]
            mem[str(n)]["docs_per_s"] = n / r["times_s"][0]
            print(f"memory, {n:,} docs: {r['rss_before_bytes'] / 2**20:,.0f} MiB before the "
                  f"pipeline (texts {r['text_bytes'] / 2**20:,.0f} MiB of characters), peak "
                  f"{r['peak_rss_bytes'] / 2**20:,.0f} MiB (signatures alone "
                  f"{r['signature_bytes'] / 2**20:,.0f} MiB), "
                  f"{mem[str(n)]['docs_per_s']:,.0f} docs/s", file=sys.stderr, flush=True)
        result["memory"] = mem
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["ratios_1_device"]))


if __name__ == "__main__":
    main()
