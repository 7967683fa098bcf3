"""`jaxscale data clean`: filter, decontaminate and deduplicate a corpus, stage by stage.

    jaxscale data clean --docs 20000                      # the labelled garden web corpus
    jaxscale data clean --docs 20000 --bands 16 --rows 8 --json
    jaxscale data clean --input pages.jsonl --validation val.txt --out cleaned/

The garden web corpus (jaxscale.data.web) comes with ground truth, so every stage's
removals are scored (precision, recall); a user's own JSONL or text file is cleaned the
same way and its kept records written back unchanged. Everything is read and checked
before anything is computed or written: a bad value is one line and exit code 2.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from jaxscale.cli.main import UsageError


def register(subparsers) -> None:
    from jaxscale.cli.main import _number
    from jaxscale.runtime.devices import PLATFORMS
    from jaxscale.data.filters import FILTERS
    from jaxscale.data.decontaminate import MIN_FRACTION, N_GRAM
    from jaxscale.data.records import FORMATS
    from jaxscale.data.shingles import SHINGLE_HASHES

    p = subparsers.add_parser("data", help="clean a corpus: quality filters, decontamination, "
                              "MinHash + LSH near-duplicate removal",
                              description="Pretraining-data tools.")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    c = actions.add_parser("clean", help="run the cleaning pipeline and report each stage",
                           description=(
        "Run the cleaning pipeline: (1) Gopher-style quality filters, (2) decontamination: "
        "a page holding most of one validation document's word 13-grams goes, (3) MinHash "
        "signatures of each page's 5-word shingles, computed in JAX on --devices devices, (4) LSH: pages whose "
        "signatures agree on all rows of some band become candidates, (5) candidates "
        "verified by the exact Jaccard of their shingle sets, (6) union-find clusters, the "
        "first page of each kept. A pair of Jaccard s becomes a candidate with probability "
        "1-(1-s^r)^b (b bands of r rows). Reads the garden web corpus (--docs, labelled, so "
        "each stage is scored) or your own file (--input)."))
    src = c.add_argument_group("input (one of)")
    src.add_argument("--docs", type=_number(), default=None, metavar="N",
                     help="generate N labelled garden web pages (default 10000 when no "
                          "--input is given)")
    src.add_argument("--seed", type=_number(minimum=0), default=None, metavar="S",
                     help="seed of the garden web corpus (default 0)")
    src.add_argument("--input", metavar="FILE", default=None,
                     help="your documents: JSONL (one object a line with a string \"text\", "
                          "optional \"id\") or plain text (one document a line)")
    src.add_argument("--format", choices=FORMATS, default=None,
                     help="format of --input (default auto: JSONL for a .jsonl name or a "
                          "first line starting with '{', else text)")
    src.add_argument("--validation", metavar="FILE", default=None,
                     help="validation documents for decontamination of --input (either "
                          "format, detected alike); the garden corpus brings its own")
    lsh = c.add_argument_group("near-duplicates")
    lsh.add_argument("--threshold", type=_number(float, 0, exclusive=True), default=None,
                     metavar="T", help="Jaccard at which pages count as near-duplicates, in "
                                       "(0, 1) (default 0.7); bands and rows are chosen for "
                                       "it as datasketch chooses them")
    lsh.add_argument("--bands", type=_number(), default=None, metavar="B",
                     help="LSH bands, with --rows; B x R must equal --num-perm")
    lsh.add_argument("--rows", type=_number(), default=None, metavar="R",
                     help="rows (hashes) per band, with --bands")
    lsh.add_argument("--num-perm", type=_number(), default=128, metavar="K",
                     help="MinHash permutations per page (default 128)")
    lsh.add_argument("--shingle-hash", choices=SHINGLE_HASHES, default="fast",
                     help="how shingles are hashed: fast (in JAX, default) or sha1 "
                          "(datasketch's default, computed in Python)")
    lsh.add_argument("--minhash-seed", type=_number(minimum=0), default=1, metavar="S",
                     help="seed of the MinHash permutations, as datasketch's (default 1)")
    stages = c.add_argument_group("stages")
    stages.add_argument("--filters", default=",".join(FILTERS), metavar="LIST",
                        help=f"comma-separated quality filters, or none (default all: "
                             f"{', '.join(FILTERS)})")
    stages.add_argument("--no-decontaminate", action="store_true",
                        help="skip the n-gram decontamination stage")
    stages.add_argument("--ngram", type=_number(), default=N_GRAM, metavar="N",
                        help=f"decontamination: words per n-gram (default {N_GRAM}, GPT-3's)")
    stages.add_argument("--min-fraction", type=_number(float, 0), default=MIN_FRACTION,
                        metavar="F", help=f"decontamination: the share of ONE validation "
                        f"document's n-grams a page must hold, in [0, 1] (default "
                        f"{MIN_FRACTION}, measured on the garden language, whose short "
                        "phrases recur by chance; 0 is GPT-3's any-one rule; on a long "
                        "test document, lower it, or a page quoting a paragraph is kept)")
    run = c.add_argument_group("where and what out")
    run.add_argument("--devices", type=_number(), default=1, metavar="D",
                     help="devices the signatures are computed on (CPU: forced host "
                          "devices; default 1)")
    run.add_argument("--platform", default="auto", choices=PLATFORMS, metavar="NAME",
                     help=f"{', '.join(PLATFORMS)} (default auto: an accelerator if present)")
    run.add_argument("--out", metavar="DIR", default=None,
                     help="write kept.jsonl, removed.jsonl (id, stage, and for a duplicate "
                          "the id of the kept page it duplicates) and report.json here")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object with every figure instead of tables")
    c.set_defaults(run=_cmd_clean)


def config(args):
    """The CleanConfig of the options, checked (CleanError names a bad value)."""
    from jaxscale.data.clean import CleanConfig, CleanError
    from jaxscale.data.filters import FILTERS

    if args.threshold is not None and (args.bands is not None or args.rows is not None):
        raise UsageError("give either --threshold or --bands with --rows, not both")
    if (args.bands is None) != (args.rows is None):
        raise UsageError(f"--{'rows' if args.rows is None else 'bands'} is missing: give "
                         "--bands and --rows together (or --threshold)")
    if args.threshold is not None and not args.threshold < 1:
        raise UsageError(f"--threshold must lie in (0, 1), got {args.threshold:g}")
    if args.bands is not None and args.bands * args.rows != args.num_perm:
        raise UsageError(f"--bands {args.bands} x --rows {args.rows} = "
                         f"{args.bands * args.rows} must equal --num-perm {args.num_perm}; "
                         f"e.g. {_factorings(args.num_perm)}")
    names = () if args.filters.strip().lower() == "none" else tuple(
        f.strip() for f in args.filters.split(",") if f.strip())
    for f in names:
        if f not in FILTERS:
            raise UsageError(f"--filters: unknown filter {f!r}; choose from "
                             f"{', '.join(FILTERS)}, or none")
    if args.min_fraction > 1:
        raise UsageError(f"--min-fraction must lie in [0, 1], got {args.min_fraction:g}")
    if args.input is not None and args.docs is not None:
        raise UsageError("give either --docs (the garden web corpus) or --input FILE, not both")
    if args.input is None:
        for flag, value in (("--validation", args.validation), ("--format", args.format)):
            if value is not None:
                raise UsageError(f"{flag} goes with --input FILE; the garden web corpus "
                                 "(--docs) brings its own validation documents")
    elif args.seed is not None:
        raise UsageError("--seed is the garden web corpus's (--docs); it does nothing for "
                         "--input (the MinHash permutations' seed is --minhash-seed)")
    try:
        return CleanConfig(num_perm=args.num_perm, seed=args.minhash_seed,
                           threshold=args.threshold, bands=args.bands, rows=args.rows,
                           shingle_hash=args.shingle_hash, filters=names,
                           decontaminate=not args.no_decontaminate, ngram=args.ngram,
                           min_fraction=args.min_fraction).check()
    except CleanError as e:
        raise UsageError(str(e)) from None


def _factorings(k: int) -> str:
    pairs = [f"{b}x{k // b}" for b in range(2, k) if k % b == 0][:6]
    return ", ".join(pairs) if pairs else f"1x{k}"


def load(args):
    """(texts, ids, records to write back or None, validation, web corpus or None)."""
    from jaxscale.data.records import RecordsError, read_records

    try:
        if args.input is None:
            from jaxscale.data.web import make_web
            n = args.docs or 10000
            if not args.json:
                print(f"generating {n:,} garden web pages...", file=sys.stderr, flush=True)
            web = make_web(n, seed=args.seed or 0)
            return list(web.texts), list(web.ids), None, list(web.validation), web
        recs = read_records(args.input, args.format or "auto")
        validation = None if args.validation is None else list(
            read_records(args.validation, "auto").texts)
        return list(recs.texts), list(recs.ids), recs.lines, validation, None
    except RecordsError as e:
        raise UsageError(str(e)) from None


def check_out(out: Path) -> None:
    """--out must be a folder, or creatable as one, and writable: checked before any work
    (nothing is created until the results are ready)."""
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe == out and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory (it is created if needed)")
    if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"--out {out}: {probe} is {'not writable' if probe.is_dir() else 'a file'}"
                         "; give a folder that can be created and written")


def _cmd_clean(args) -> int:
    from jaxscale.cli.main import enable_compilation_cache
    from jaxscale.runtime import devices as devlib
    from jaxscale.data.clean import clean

    cfg = config(args)
    out = Path(args.out) if args.out else None
    if out is not None:
        check_out(out)
    devices = devlib.pick_devices(args.platform, args.devices)
    enable_compilation_cache()
    texts, ids, lines, validation, web = load(args)
    bar = _StageProgress(enabled=not args.json)
    try:
        report = clean(texts, cfg, validation=validation, devices=devices, progress=bar)
    finally:
        bar.close()
    result = report.as_json()
    result["input"] = args.input or (f"garden web corpus ({len(texts)} pages, seed "
                                     f"{args.seed or 0})")
    result["devices"] = [str(d) for d in devices]
    if web is not None:
        from jaxscale.data.truth import score_report
        result["scores"] = score_report(report, web)
    if out is not None:
        _write(out, report, ids, lines, texts, result)
        result["out"] = str(out)
    if args.json:
        print(json.dumps(result))
    else:
        _render(result)
    return 0


class _StageProgress:
    """A progress bar for each stage that goes through the pages; a line for the others."""

    PER_PAGE = ("filters", "decontamination", "signatures")

    def __init__(self, enabled: bool):
        self.enabled, self.stage, self.bar = enabled, None, None

    def __call__(self, stage: str, done: int, total: int) -> None:
        from jaxscale.report import Progress

        if not self.enabled:
            return
        if stage != self.stage:
            self.close()
            self.stage = stage
            if stage in self.PER_PAGE and total:
                self.bar = Progress(total, label=stage)
            else:
                print(f"{stage}: {total:,} pages", file=sys.stderr, flush=True)
        if self.bar is not None and done:
            self.bar.update(done, f"{done:,} pages")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


OUTPUTS = ("kept.jsonl", "removed.jsonl", "report.json")


def _write(out: Path, report, ids, lines, texts, result) -> None:
    """kept.jsonl, removed.jsonl and report.json, written together: into a temporary
    folder inside `out`, then renamed into place, report.json last (so a folder whose
    report.json is there and newer than the others holds one complete run)."""
    import shutil

    from jaxscale.data.records import write_atomically

    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    try:
        kept = report.kept.tolist()
        if lines is None:  # the garden corpus: write id and text
            lines = [json.dumps({"id": i, "text": t}, ensure_ascii=False)
                     for i, t in zip(ids, texts)]
        write_atomically(tmp / "kept.jsonl", (lines[i] for i in kept))
        names = [s.name for s in report.stages]

        def removed(i: int) -> str:
            line = {"id": ids[i], "stage": names[report.removed_by[i]]}
            if report.duplicate_of[i] >= 0:
                line["duplicate_of"] = ids[report.duplicate_of[i]]
            return json.dumps(line, ensure_ascii=False)
        write_atomically(tmp / "removed.jsonl",
                         map(removed, (report.removed_by >= 0).nonzero()[0].tolist()))
        write_atomically(tmp / "report.json", [json.dumps(result, indent=1)])
        (out / "report.json").unlink(missing_ok=True)  # no report.json while the set changes
        for name in OUTPUTS:
            os.replace(tmp / name, out / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _render(r: dict) -> None:
    from jaxscale.data.clean import stage_note
    from jaxscale.report import print_table

    scores = r.get("scores", {}).get("stages", {})
    rows = []
    for s in r["stages"]:
        sc = scores.get(s["name"])
        rows.append([s["name"], f"{s['docs_in']:,}", f"{s['removed']:,}", f"{s['kept']:,}",
                     f"{s['seconds']:.2f}",
                     "-" if sc is None else f"{sc['precision']:.3f}",
                     "-" if sc is None else f"{sc['recall']:.3f}", stage_note(s["name"], s)])
    print_table(f"{r['input']}: kept {r['kept']:,} of {r['docs']:,} "
                f"({r['docs_per_s']:,.0f} docs/s end to end; b={r['bands']} bands x "
                f"r={r['rows']} rows, verify at Jaccard >= {r['verify_threshold']:.3f})",
                ["stage", "in", "removed", "kept", "seconds", "precision", "recall", "notes"],
                rows)
    if "out" in r:
        print(f"wrote {r['out']}/kept.jsonl, removed.jsonl, report.json")
