"""A synthetic "web crawl" with ground truth, to measure a pretraining-data cleaning pipeline.

Real crawls are full of copies: the same article reposted under another site's menu, pages
edited a little, mirrored byte for byte, machine-made junk, and pages quoting a benchmark's
test set. A cleaning pipeline (near-duplicate removal, quality filters, decontamination) is
only as good as its measured precision and recall, and those need pages whose truth is
known. This module makes such pages from the garden language (`jaxscale.garden`).

A page is lines joined by "\\n":
    [header lines]   boilerplate, e.g. "home | about | contact", "posted by user123 on 2026-03-04"
    body lines       one garden document per line (its words joined by single spaces,
                     without <bos>/<eos>/<pad>); 3 to 7 of them, typically 60 to 150 words
    [footer lines]   boilerplate, e.g. "share this page", "copyright 2026 site42 ..."

Every page has one kind (`KINDS`), and copies record which page they come from:
    original        a fresh page.
    repost          an original's body, verbatim and in order, under a different header and
                    footer (so two pages can share most text but not their boilerplate).
    near_duplicate  an original with one contiguous run of body words replaced by fresh
                    garden words, sized to aim at a Jaccard level drawn evenly from 0.1 to
                    1.0 (the top level is a whitespace-only edit: same words, other bytes).
    exact_copy      an original, byte for byte.
    junk            machine-made text, one of `web_junk.JUNK_KINDS`: symbol soup, one line
                    repeated, content words without any stop word, words of the wrong
                    length; no boilerplate (its "posted by ... on" would add stop words).
    contaminated    a fresh page with one validation document inserted verbatim as a body
                    line. The validation documents (`WebCorpus.validation`) are garden
                    documents held out from the pages: the "test set" to decontaminate against.

Similarity is measured exactly as `shingles.py` defines it: the Jaccard index of two pages'
sets of 5-word shingles. The target level only steers how much text a near-duplicate
replaces; what is recorded (`WebCorpus.jaccard`) is the exact Jaccard to the source page,
computed with `shingles.shingle_set` and `shingles.jaccard`.

How it scales. Sampling a garden document walks the automaton in Python (~0.25 ms), too slow
to draw five fresh documents for each of 10^6 pages. So a pool of at most `POOL_MAX`
documents is sampled once and pages pick their body lines from it by index (numpy). The
cost: independent pages share pool documents by chance (at 10^5 pages each is used about 60
times), as they share the garden language's common short documents anyway ("in winter ,
snow falls ."). Such chance overlap is real similarity but not ground truth: see
`WebCorpus.duplicate_pairs`. Pages are shuffled, so copies are not next to their sources.

Here: the corpus, its labels and `make_web`. The pages themselves are made by `web_pages.py`
(originals, reposts, exact copies, contaminated pages), `web_edits.py` (near-duplicates)
and `web_junk.py` (junk).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from jaxscale.data.shingles import jaccard, shingle_set
from jaxscale.data.web_edits import near_duplicates
from jaxscale.data.web_junk import JUNK_KINDS, junk_pages
from jaxscale.data.web_pages import BODY_LINES, PageBuilder
from jaxscale.garden.sampling import sample_document
from jaxscale.garden.words import VOCAB, BOS_ID, EOS_ID, PAD_ID

KINDS = ("original", "repost", "near_duplicate", "exact_copy", "junk", "contaminated")
DEFAULT_MIX = {"repost": 0.04, "near_duplicate": 0.10, "exact_copy": 0.04, "junk": 0.08,
               "contaminated": 0.02}  # the rest (72%) are originals
DERIVED_KINDS = ("repost", "near_duplicate", "exact_copy")  # the kinds that have a source

POOL_MIN, POOL_MAX = 512, 8192  # garden documents sampled once, that body lines come from
N_VALIDATION = 256  # held-out documents


@dataclass(frozen=True)
class WebCorpus:
    """Pages and their ground truth; row i of every array describes page i."""

    texts: tuple[str, ...]
    ids: tuple[str, ...]  # "web-000123"
    kind: np.ndarray  # int8 index into KINDS
    source: np.ndarray  # int64 index of the page this one copies or derives from, -1 if none
    jaccard: np.ndarray  # float64 exact shingle-set Jaccard with `source`, nan if none
    junk: np.ndarray  # int8 index into JUNK_KINDS, -1 if not junk
    validation: tuple[str, ...]  # held-out documents (decontamination checks pages against these)
    seed: int

    def __len__(self) -> int:
        return len(self.texts)

    def is_kind(self, name: str) -> np.ndarray:
        """Boolean mask of the pages of one kind, e.g. `is_kind("junk")`."""
        if name not in KINDS:
            raise ValueError(f"unknown page kind {name!r}; kinds are {KINDS}")
        return self.kind == KINDS.index(name)

    def duplicate_pairs(self, threshold: float) -> np.ndarray:
        """Ground-truth similar pairs [P, 2] (int64, i < j, sorted) with Jaccard >= threshold.

        Ground truth means "made similar by construction": a copy and its source (repost,
        near-duplicate, exact copy), and two copies of the same source, whose exact Jaccard
        is computed here too. Pages that are similar by chance (sharing pool documents, the
        language's common short documents, or boilerplate lines) are never listed, however
        similar; junk and contaminated pages have no source and are never listed either.
        """
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be a Jaccard level in [0, 1], got {threshold}")
        pairs, levels = self._constructed_pairs
        return pairs[levels >= threshold]

    @functools.cached_property
    def _constructed_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        copies = np.flatnonzero(self.source >= 0)
        pairs = [np.sort(np.stack([copies, self.source[copies]], axis=1), axis=1)]
        levels = [self.jaccard[copies]]
        siblings, sibling_levels = self._sibling_pairs(copies)
        pairs.append(siblings)
        levels.append(sibling_levels)
        pairs, levels = np.concatenate(pairs), np.concatenate(levels)
        order = np.lexsort((pairs[:, 1], pairs[:, 0]))
        return pairs[order], levels[order]

    def _sibling_pairs(self, copies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Every pair of copies of one source, with their exact Jaccard."""
        by_source: dict[int, list[int]] = {}
        for page in copies.tolist():
            by_source.setdefault(int(self.source[page]), []).append(page)
        pairs, levels, sets = [], [], {}
        for group in by_source.values():
            for a_pos, a in enumerate(group):
                for b in group[a_pos + 1:]:
                    for page in (a, b):
                        if page not in sets:
                            sets[page] = shingle_set(self.texts[page])
                    pairs.append((min(a, b), max(a, b)))
                    levels.append(jaccard(sets[a], sets[b]))
        return (np.asarray(pairs, dtype=np.int64).reshape(-1, 2),
                np.asarray(levels, dtype=np.float64))


def make_web(n_docs: int, seed: int = 0, *, n_validation: int = N_VALIDATION,
             **mix: float) -> WebCorpus:
    """A shuffled synthetic web of `n_docs` pages with ground truth (see the module docstring).

    `mix` gives the fraction of pages of each kind but "original" (defaults `DEFAULT_MIX`),
    e.g. `make_web(10_000, junk=0.2)`; page counts are floor(fraction * n_docs) and the
    rest are originals. Junk pages cycle through `JUNK_KINDS`. The same arguments always
    give the same corpus.
    """
    counts = _kind_counts(n_docs, mix)
    if n_validation < 1:
        raise ValueError(f"n_validation must be >= 1 (decontamination needs a validation "
                         f"set), got {n_validation}")
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4)]
    pool_rng, validation_rng, page_rng, order_rng = streams
    n_lines = (BODY_LINES[0] + BODY_LINES[1]) / 2 * n_docs
    pool = _sample_pool(pool_rng, int(np.clip(n_lines // 16, POOL_MIN, POOL_MAX)))
    validation = _sample_validation(validation_rng, n_validation, _sentence_prefixes(pool))
    builder = PageBuilder(page_rng, pool, validation, counts["original"])
    pages, kind, source, levels, junk = _assemble(builder, counts)
    return _shuffled(pages, kind, source, levels, junk, validation, seed, order_rng)


def _kind_counts(n_docs: int, mix: dict[str, float]) -> dict[str, int]:
    if isinstance(n_docs, bool) or not isinstance(n_docs, (int, np.integer)) or n_docs < 1:
        raise ValueError(f"n_docs must be an integer >= 1, got {n_docs!r}")
    unknown = set(mix) - set(DEFAULT_MIX)
    if unknown:
        raise ValueError(f"unknown page kinds {sorted(unknown)} in the mix; give fractions for "
                         f"{tuple(DEFAULT_MIX)} (originals are the rest)")
    fractions = {**DEFAULT_MIX, **mix}
    for name, fraction in fractions.items():
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"fraction of {name} pages must be in [0, 1], got {fraction}")
    total = sum(fractions.values())
    if total > 1.0 + 1e-12:
        raise ValueError(f"the mix fractions sum to {total:.4g} > 1 ({fractions}); they must "
                         f"sum to at most 1, the rest being originals")
    counts = {name: int(np.floor(fractions[name] * n_docs + 1e-9)) for name in KINDS[1:]}
    counts["original"] = int(n_docs) - sum(counts.values())
    if counts["original"] == 0 and any(counts[k] for k in DERIVED_KINDS):
        raise ValueError(f"the mix {fractions} leaves no original page for the "
                         f"{DERIVED_KINDS} pages to copy; keep their sum below 1")
    return counts


def _document_text(ids: np.ndarray) -> str:
    return " ".join(VOCAB[t] for t in ids.tolist() if t not in (BOS_ID, EOS_ID, PAD_ID))


def _sample_pool(rng: np.random.Generator, size: int) -> tuple[str, ...]:
    return tuple(_document_text(sample_document(rng)) for _ in range(size))


def _sentence_prefixes(pool: tuple[str, ...]) -> set[str]:
    """Every run of whole first sentences of a pool document ("in winter , snow falls .")."""
    prefixes = set()
    for doc in pool:
        words = doc.split()
        prefixes.update(" ".join(words[:i + 1]) for i, w in enumerate(words) if w == ".")
    return prefixes


def _sample_validation(rng: np.random.Generator, size: int,
                       pool_prefixes: set[str]) -> tuple[str, ...]:
    """Distinct held-out documents, none of which occurs on a page that is not contaminated.

    A garden document says "in <season> ," only at its start and ends with ".", so it occurs
    in a page built from pool documents only as a pool document's first sentences. Without
    this check, common short documents ("in winter , snow falls .") would be in the
    validation set and, verbatim, on hundreds of ordinary pages. (A near-duplicate's
    replaced run could in principle complete one by chance; measured on 10^4 pages: never,
    and tests/data/test_data_filters.py would see it as a decontamination false positive.)
    """
    chosen: dict[str, None] = {}
    for _ in range(200 * size):
        if len(chosen) == size:
            break
        text = _document_text(sample_document(rng))
        if text not in pool_prefixes:
            chosen.setdefault(text)
    if len(chosen) < size:
        raise ValueError(f"could not draw {size} distinct validation documents outside the pool")
    return tuple(chosen)


def _assemble(builder: PageBuilder, counts: dict[str, int]):
    """Every page with its labels, kind after kind in construction order (originals first)."""
    pages: list[str] = []
    kind, source, levels, junk = [], [], [], []

    def add(texts, name, sources=None, jaccards=None, junk_kinds=None):
        n = len(texts)
        pages.extend(texts)
        kind.append(np.full(n, KINDS.index(name), np.int8))
        source.append(np.full(n, -1, np.int64) if sources is None else sources)
        levels.append(np.full(n, np.nan) if jaccards is None else jaccards)
        junk.append(np.full(n, -1, np.int8) if junk_kinds is None else junk_kinds)

    add([page.text() for page in builder.originals], "original")
    makers = {"repost": builder.repost, "exact_copy": builder.exact_copy,
              "near_duplicate": functools.partial(near_duplicates, builder)}
    for name in DERIVED_KINDS:
        sources = builder.rng.integers(0, len(builder.originals), counts[name]).astype(np.int64)
        texts, jaccards = makers[name](sources.tolist())
        add(texts, name, sources, np.asarray(jaccards, np.float64))
    junk_kinds = np.arange(counts["junk"], dtype=np.int8) % len(JUNK_KINDS)
    add(junk_pages(builder.rng, builder.pool, junk_kinds), "junk", junk_kinds=junk_kinds)
    add(builder.contaminated(counts["contaminated"]), "contaminated")
    return pages, np.concatenate(kind), np.concatenate(source), \
        np.concatenate(levels), np.concatenate(junk)


def _shuffled(pages, kind, source, levels, junk, validation, seed,
              rng: np.random.Generator) -> WebCorpus:
    """Put the pages in a random order, renumbering sources to the new positions."""
    order = rng.permutation(len(pages))
    new_position = np.empty_like(order)
    new_position[order] = np.arange(len(order))
    source = source[order]
    source = np.where(source >= 0, new_position[np.maximum(source, 0)], -1).astype(np.int64)
    width = max(6, len(str(len(pages) - 1)))
    return WebCorpus(texts=tuple(pages[i] for i in order.tolist()),
                     ids=tuple(f"web-{i:0{width}d}" for i in range(len(pages))),
                     kind=kind[order], source=source, jaccard=levels[order],
                     junk=junk[order], validation=validation, seed=int(seed))
