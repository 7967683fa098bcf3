"""`jaxscale data clean`: filter, decontaminate and deduplicate a corpus, stage by stage.

    jaxscale data clean --docs 20000                      # the labelled garden web corpus
    jaxscale data clean --docs 20000 --bands 16 --rows 8 --json
    jaxscale data clean --input pages.jsonl --validation val.txt --out cleaned/

The garden web corpus (jaxscale.data.web) comes with ground truth, so every stage's
removals are scored (precision, recall); a user's own JSONL or text file is cleaned the
same way and its kept records written back unchanged. Everything is read and checked
before anything is computed or written: a bad value is one line and exit code 2.

Here: the options (`register`), their checking into a CleanConfig (`config`), the input
(`load`) and the run; what is shown and written (progress, the table, the files of --out)
is `data_output.py`.
"""
from __future__ import annotations

import json
import sys

from jaxscale.cli.commands.data_output import StageProgress, print_report, write_out
from jaxscale.cli.main import COMMANDS, UsageError, _number
from jaxscale.cli.paths import output_dir
from jaxscale.data.clean import clean
from jaxscale.data.clean_config import CleanConfig, CleanError
from jaxscale.data.decontaminate import MIN_FRACTION, N_GRAM
from jaxscale.data.filters import FILTERS
from jaxscale.data.records import FORMATS, RecordsError, read_records
from jaxscale.data.shingles import SHINGLE_HASHES
from jaxscale.data.truth import score_report
from jaxscale.data.web import make_web
from jaxscale.runtime import devices as devlib
from jaxscale.runtime.compile_cache import enable_compilation_cache
from jaxscale.runtime.devices import PLATFORMS


def register(subparsers) -> None:
    p = subparsers.add_parser("data", help=COMMANDS["data"],
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
    _input_options(c.add_argument_group("input (one of)"))
    _near_duplicate_options(c.add_argument_group("near-duplicates"))
    _stage_options(c.add_argument_group("stages"))
    _output_options(c.add_argument_group("where and what out"))
    c.set_defaults(run=_cmd_clean)


def _input_options(src) -> None:
    """--docs or --input, and what goes with each."""
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


def _near_duplicate_options(lsh) -> None:
    """MinHash and LSH: the threshold, or bands and rows."""
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


def _stage_options(stages) -> None:
    """Which quality filters run, and decontamination's settings."""
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


def _output_options(run) -> None:
    """Devices, and what is printed and written."""
    run.add_argument("--devices", type=_number(), default=1, metavar="D",
                     help="devices the signatures are computed on (CPU: forced host "
                          "devices; default 1)")
    run.add_argument("--platform", default="auto", choices=PLATFORMS, metavar="NAME",
                     help=f"{', '.join(PLATFORMS)} (default auto: an accelerator if present)")
    run.add_argument("--out", type=output_dir, metavar="DIR", default=None,
                     help="write kept.jsonl, removed.jsonl (id, stage, and for a duplicate "
                          "the id of the kept page it duplicates) and report.json here")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object with every figure instead of tables")


def config(args):
    """The CleanConfig of the options, checked (CleanError names a bad value)."""
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
    try:
        if args.input is None:
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


def _cmd_clean(args) -> int:
    cfg = config(args)
    out = args.out  # checked by output_dir when parsed
    devices = devlib.pick_devices(args.platform, args.devices)
    enable_compilation_cache()
    texts, ids, lines, validation, web = load(args)
    bar = StageProgress(enabled=not args.json)
    try:
        report = clean(texts, cfg, validation=validation, devices=devices, progress=bar)
    finally:
        bar.close()
    result = report.as_json()
    result["input"] = args.input or (f"garden web corpus ({len(texts)} pages, seed "
                                     f"{args.seed or 0})")
    result["devices"] = [str(d) for d in devices]
    if web is not None:
        result["scores"] = score_report(report, web)
    if out is not None:
        write_out(out, report, ids, lines, texts, result)
        result["out"] = str(out)
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0
