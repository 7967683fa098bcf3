"""A user's documents in, the kept ones out: JSONL or plain text, checked whole before use.

Input formats:
  - JSONL: one JSON object a line with a string field `text` and, optionally, `id` (any
    JSON value, unique in the file; a document without one is named by its line number).
    Lines end at "\n" only (a "\r" before it is dropped); blank lines are skipped. Every
    other field is kept: the kept records are written back byte for byte as they were read.
  - plain text: one document a line (blank lines skipped); written back as
    {"id": line number, "text": line} records.
`auto` picks JSONL for a .jsonl/.ndjson file name or a first non-blank line that starts
with '{', plain text otherwise. A malformed line is reported with its number before
anything is computed, and an output is written to a temporary name and renamed into place
only when complete, so a failure never leaves a half-written file.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

FORMATS = ("auto", "jsonl", "text")


class RecordsError(ValueError):
    """Unreadable input: the message names the file, the line and what is wrong."""


@dataclass(frozen=True)
class Records:
    texts: tuple[str, ...]
    ids: tuple[object, ...]
    lines: tuple[str, ...]  # each record as read (JSONL) or as it will be written (text)
    format: str
    path: str


def _detect(path: Path, lines: list[str]) -> str:
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        return "jsonl"
    first = next((ln for ln in lines if ln.strip()), "")
    return "jsonl" if first.lstrip().startswith("{") else "text"


def read_records(path: str | Path, fmt: str = "auto") -> Records:
    """Every document of a JSONL or text file, or RecordsError naming the bad line."""
    if fmt not in FORMATS:
        raise RecordsError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    path = Path(path)
    if not path.is_file():
        raise RecordsError(f"{path}: {'is a directory' if path.is_dir() else 'no such file'}"
                           "; give a JSONL file (one {\"text\": ...} object a line) or a "
                           "text file (one document a line)")
    try:
        raw = path.read_text(encoding="utf-8-sig")  # a byte-order mark is not text
    except UnicodeDecodeError as e:
        raise RecordsError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason})") from None
    # "\n" ends a line, nothing else: str.splitlines would also split at U+2028, form
    # feeds and other characters a JSON string or a document may hold
    lines = [ln[:-1] if ln.endswith("\r") else ln for ln in raw.split("\n")]
    guessed = fmt == "auto"
    fmt = _detect(path, lines) if guessed else fmt
    texts, ids, kept, first_line = [], [], [], {}
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if fmt == "text":
            texts.append(line)
            ids.append(number)
            kept.append(json.dumps({"id": number, "text": line}, ensure_ascii=False))
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            hint = (" (read as JSONL because its first line starts with '{'; --format text "
                    "reads one document a line)" if guessed and path.suffix.lower()
                    not in (".jsonl", ".ndjson") else "")
            raise RecordsError(f"{path}:{number}: not JSON ({e.msg} at column {e.colno}); "
                               f"each line must be one JSON object{hint}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            what = ("has no \"text\" field" if isinstance(record, dict) and "text" not in record
                    else "its \"text\" is not a string" if isinstance(record, dict)
                    else f"is a JSON {type(record).__name__}, not an object")
            raise RecordsError(f"{path}:{number}: the record {what}; each line must be an "
                               "object with a string \"text\" (and optionally an \"id\")")
        rid = record.get("id", number)
        earlier = first_line.setdefault(json.dumps(rid, sort_keys=True), number)
        if earlier != number:
            raise RecordsError(f"{path}:{number}: id {json.dumps(rid)} is also the id of line "
                               f"{earlier}; ids must be unique (a record without one is "
                               "named by its line number)")
        texts.append(record["text"])
        ids.append(rid)
        kept.append(line)
    if not texts:
        raise RecordsError(f"{path}: no documents (the file is empty or blank)")
    return Records(tuple(texts), tuple(ids), tuple(kept), fmt, str(path))
