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
    junk            machine-made text, one of `JUNK_KINDS`: symbol soup, one line repeated,
                    content words without any stop word, words of the wrong length; no
                    boilerplate (its "posted by ... on" would add stop words).
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
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from jaxscale.data.shingles import SHINGLE_WORDS, jaccard, shingle_set, shingles
from jaxscale.garden.language import sample_document
from jaxscale.garden.words import (ANIMAL_ADJECTIVES, ANIMALS, PLANTS, SEASONS, VOCAB,
                                   BOS_ID, EOS_ID, PAD_ID)

KINDS = ("original", "repost", "near_duplicate", "exact_copy", "junk", "contaminated")
JUNK_KINDS = ("symbols", "repeated_lines", "no_stop_words", "word_length")
DEFAULT_MIX = {"repost": 0.04, "near_duplicate": 0.10, "exact_copy": 0.04, "junk": 0.08,
               "contaminated": 0.02}  # the rest (72%) are originals
DERIVED_KINDS = ("repost", "near_duplicate", "exact_copy")  # the kinds that have a source

POOL_MIN, POOL_MAX = 512, 8192  # garden documents sampled once, that body lines come from
BODY_LINES = (3, 7)  # garden documents per page, inclusive
N_VALIDATION = 256  # held-out documents
NEAR_DUPLICATE_LEVELS = (0.1, 1.0)  # target Jaccard of near-duplicates, spread evenly

# Words that carry meaning in the garden language (no function words, no punctuation):
# used for junk pages without stop words and for boilerplate topics.
CONTENT_WORDS = tuple(sorted({*SEASONS, *ANIMALS, *PLANTS,
                              *(a for d in ANIMAL_ADJECTIVES.values() for a in d)}))
HEADER_TEMPLATES = ("home | about | contact", "menu | garden | shop | blog",
                    "posted by user{user} on 2026-{month:02d}-{day:02d}",
                    "you are here : home > garden > {topic}")
FOOTER_TEMPLATES = ("share this page", "copyright 2026 site{site} . all rights reserved .",
                    "read more ...", "comments ( {count} )", "tags : {topic} , {topic2}")
SYMBOL_TOKENS = np.array(sorted({a + b + c for a in "#$%&@*!" for b in ("", "#", "@", "&", "%")
                                  for c in ("", "!", "#", "*")}))  # 1 to 3 symbols each
GARDEN_WORDS = np.array(VOCAB[3:])  # every word but <pad>, <bos>, <eos>
CONTENT_ARRAY = np.array(CONTENT_WORDS)
FRAGMENTS = np.array([a + b for a in "abcdefghijklmnopqrstuvwxyz"
                      for b in ("", *"aeiouxyz")])  # "a", "ax", "qz"...: 1 or 2 letters


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


@dataclass
class _Page:
    """A page under construction: boilerplate around garden body lines."""

    header: list[str]
    body: list[str]
    footer: list[str]

    def text(self) -> str:
        return "\n".join(self.header + self.body + self.footer)


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
    builder = _Builder(page_rng, pool, validation)
    pages, kind, source, levels, junk = builder.build(counts)
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
    and tests/test_data_filters.py would see it as a decontamination false positive.)
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


class _Builder:
    """Makes the pages of each kind, in construction order (originals first)."""

    def __init__(self, rng: np.random.Generator, pool: tuple[str, ...],
                 validation: tuple[str, ...]):
        self.rng, self.pool, self.validation = rng, pool, validation
        self.pool_words = [doc.split() for doc in pool]
        self.originals: list[_Page] = []
        self._shingles: dict[int, list[bytes]] = {}
        self._shingle_sets: dict[int, frozenset[bytes]] = {}

    def build(self, counts: dict[str, int]):
        self.originals = self.fresh_pages(counts["original"])
        pages: list[str] = []
        kind, source, levels, junk = [], [], [], []

        def add(texts, name, sources=None, jaccards=None, junk_kinds=None):
            n = len(texts)
            pages.extend(texts)
            kind.append(np.full(n, KINDS.index(name), np.int8))
            source.append(np.full(n, -1, np.int64) if sources is None else sources)
            levels.append(np.full(n, np.nan) if jaccards is None else jaccards)
            junk.append(np.full(n, -1, np.int8) if junk_kinds is None else junk_kinds)

        add([page.text() for page in self.originals], "original")
        for name in DERIVED_KINDS:
            sources = self.rng.integers(0, len(self.originals), counts[name]).astype(np.int64)
            texts, jaccards = getattr(self, name)(sources.tolist())
            add(texts, name, sources, np.asarray(jaccards, np.float64))
        junk_kinds = np.arange(counts["junk"], dtype=np.int8) % len(JUNK_KINDS)
        add(self.junk_pages(junk_kinds), "junk", junk_kinds=junk_kinds)
        add(self.contaminated(counts["contaminated"]), "contaminated")
        return pages, np.concatenate(kind), np.concatenate(source), \
            np.concatenate(levels), np.concatenate(junk)

    def source_shingles(self, original: int) -> list[bytes]:
        """An original's shingles in order (`shingles.shingles`), computed once."""
        if original not in self._shingles:
            self._shingles[original] = shingles(self.originals[original].text())
        return self._shingles[original]

    def source_set(self, original: int) -> frozenset[bytes]:
        """An original's shingle set, as `shingles.shingle_set` makes it, computed once."""
        if original not in self._shingle_sets:
            self._shingle_sets[original] = frozenset(self.source_shingles(original))
        return self._shingle_sets[original]

    # ---- boilerplate and bodies ---------------------------------------------------------
    def headers_and_footers(self, n: int, at_least_one: bool = False):
        """n (header, footer) pairs of 0-2 boilerplate lines each (1-2 if at_least_one)."""
        rng = self.rng
        n_lines = rng.choice(3, size=(n, 2), p=(0.3, 0.5, 0.2))
        if at_least_one:
            n_lines = np.maximum(n_lines, 1)
        header_order = np.argsort(rng.random((n, len(HEADER_TEMPLATES))), axis=1)
        footer_order = np.argsort(rng.random((n, len(FOOTER_TEMPLATES))), axis=1)
        # fields of up to 2 + 2 lines: user, month, day, site, count, topic, topic
        low = [1, 1, 1, 1, 0, 0, 0]
        high = [10_000, 13, 29, 1000, 200, len(CONTENT_WORDS), len(CONTENT_WORDS)]
        fields = rng.integers(low, high, size=(n, 4, 7)).tolist()
        out = []
        for page, (n_header, n_footer) in enumerate(n_lines.tolist()):
            header = [_fill(HEADER_TEMPLATES[t], fields[page][slot])
                      for slot, t in enumerate(header_order[page, :n_header].tolist())]
            footer = [_fill(FOOTER_TEMPLATES[t], fields[page][2 + slot])
                      for slot, t in enumerate(footer_order[page, :n_footer].tolist())]
            out.append((header, footer))
        return out

    def fresh_pages(self, n: int) -> list[_Page]:
        n_lines = self.rng.integers(BODY_LINES[0], BODY_LINES[1] + 1, n)
        line_ids = self.rng.integers(0, len(self.pool), int(n_lines.sum())).tolist()
        ends = np.cumsum(n_lines).tolist()
        return [_Page(header, [self.pool[i] for i in line_ids[end - k:end]], footer)
                for (header, footer), end, k in zip(self.headers_and_footers(n), ends,
                                                     n_lines.tolist())]

    def fresh_words(self, n: int) -> list[str]:
        """n garden words: consecutive random pool documents, cut to length."""
        words: list[str] = []
        while len(words) < n:
            words += self.pool_words[self.rng.integers(len(self.pool))]
        return words[:n]

    # ---- the derived kinds ----------------------------------------------------------------
    def exact_copy(self, sources: list[int]) -> tuple[list[str], list[float]]:
        return [self.originals[i].text() for i in sources], [1.0] * len(sources)

    def repost(self, sources: list[int]) -> tuple[list[str], list[float]]:
        texts, levels = [], []
        for original, (header, footer) in zip(sources, self.headers_and_footers(
                len(sources), at_least_one=True)):
            page = self.originals[original]
            while (header, footer) == (page.header, page.footer):
                header, footer = self.headers_and_footers(1, at_least_one=True)[0]
            text = _Page(header, page.body, footer).text()
            texts.append(text)
            levels.append(jaccard(self.source_set(original), shingle_set(text)))
        return texts, levels

    def near_duplicate(self, sources: list[int]) -> tuple[list[str], list[float]]:
        low, high = NEAR_DUPLICATE_LEVELS
        n = len(sources)
        targets = low + (high - low) * (np.arange(n) + self.rng.random(n)) / max(n, 1)
        texts, levels = [], []
        for original, target in zip(sources, self.rng.permutation(targets).tolist()):
            text, level = self.edit_towards(original, target)
            texts.append(text)
            levels.append(level)
        return texts, levels

    def edit_towards(self, original: int, target: float) -> tuple[str, float]:
        """The original with one run of body words replaced, its Jaccard near `target`.

        Replacing a run of L words that has >= 4 page words on either side changes the
        L + 4 shingles that overlap it (L at the page's ends): with S distinct source
        shingles, D of them changed gives J ~ (S - D) / (S + D), so D = S (1 - J) / (1 + J).
        Repeated shingles move the real value, so L is corrected a few times against the
        Jaccard of the candidate, computed from the shingles around the run alone (the
        same set that `shingle_set` of the candidate's text gives: the tests check that).
        Returns the text and its exact Jaccard to the original.
        """
        page = self.originals[original]
        source_set = self.source_set(original)
        n_changed = len(source_set) * (1 - target) / (1 + target)
        if n_changed < 0.5:  # the top level: the same words, other whitespace
            return self.whitespace_edit(page), 1.0
        run = _Run(page, self.source_shingles(original), self.fresh_words, self.rng.random())
        length = int(np.clip(round(n_changed) - run.context, 1, run.n_body))
        best_length, best_level, best_error = length, np.nan, np.inf
        for _ in range(6):
            level = jaccard(source_set, run.shingle_set(length))
            if abs(level - target) < best_error:
                best_length, best_level, best_error = length, level, abs(level - target)
            measured = len(source_set) * (1 - level) / (1 + level)
            length = int(np.clip(round(length + n_changed - measured), 1, run.n_body))
            if best_error < 0.01 or length == best_length:
                break
        text = run.text(best_length)
        if text == page.text():  # the fresh words happened to equal the ones they replace
            return self.whitespace_edit(page), 1.0
        return text, best_level

    def whitespace_edit(self, page: _Page) -> str:
        """The same words with one extra space: byte-different, shingle-identical."""
        body = list(page.body)
        line = int(self.rng.integers(len(body)))
        body[line] = body[line].replace(" ", "  ", 1) if " " in body[line] else body[line] + " "
        return _Page(page.header, body, page.footer).text()

    # ---- pages without a source -----------------------------------------------------------
    def contaminated(self, n: int) -> list[str]:
        pages = self.fresh_pages(n)
        chosen = self.rng.integers(0, len(self.validation), n)
        for page, doc in zip(pages, chosen.tolist()):
            page.body.insert(int(self.rng.integers(len(page.body) + 1)), self.validation[doc])
        return [page.text() for page in pages]

    def junk_pages(self, junk_kinds: np.ndarray) -> list[str]:
        makers = {"symbols": self.symbol_lines, "repeated_lines": self.repeated_lines,
                  "no_stop_words": self.content_word_lines,
                  "word_length": self.wrong_length_lines}
        return [_Page([], makers[JUNK_KINDS[j]](), []).text() for j in junk_kinds.tolist()]

    def _line_lengths(self) -> list[int]:
        """4 to 8 lines of 8 to 20 tokens."""
        return self.rng.integers(8, 21, self.rng.integers(4, 9)).tolist()

    def symbol_lines(self) -> list[str]:
        """Symbol tokens ("#$", "@@&", ...) 3 in 4, "..." some of the rest, else garden words."""
        lengths = self._line_lengths()
        n = sum(lengths)
        draw = self.rng.random(n)
        symbols = SYMBOL_TOKENS[self.rng.integers(len(SYMBOL_TOKENS), size=n)]
        garden = GARDEN_WORDS[self.rng.integers(len(GARDEN_WORDS), size=n)]
        tokens = np.where(draw < 0.75, symbols, np.where(draw < 0.8, "...", garden))
        return _lines(tokens.tolist(), lengths)

    def repeated_lines(self) -> list[str]:
        """One pool document 6 to 15 times, with up to two other documents."""
        rng = self.rng
        line = self.pool[rng.integers(len(self.pool))]
        lines = [line] * int(rng.integers(6, 16))
        lines += [self.pool[i] for i in rng.integers(0, len(self.pool), rng.integers(0, 3))]
        return [lines[i] for i in rng.permutation(len(lines))]

    def content_word_lines(self) -> list[str]:
        """Garden content words only: no "the", "a", "in", ... and no punctuation."""
        lengths = self._line_lengths()
        words = CONTENT_ARRAY[self.rng.integers(len(CONTENT_ARRAY), size=sum(lengths))]
        return _lines(words.tolist(), lengths)

    def wrong_length_lines(self) -> list[str]:
        """Either run-together triples of content words (~14 letters) or 1-2 letter fragments."""
        lengths = self._line_lengths()
        n = sum(lengths)
        if self.rng.random() < 0.5:
            triples = CONTENT_ARRAY[self.rng.integers(len(CONTENT_ARRAY), size=(n, 3))]
            words = ["".join(t) for t in triples.tolist()]
        else:
            words = FRAGMENTS[self.rng.integers(len(FRAGMENTS), size=n)].tolist()
        return _lines(words, lengths)


class _Run:
    """Candidate near-duplicates of one page: body words [start, start + L) made fresh.

    Runs touching a page end (no header before, or no footer after, the body) change
    fewer shingles, which is what makes levels near 1.0 reachable: so a run sits at the
    body's end or start when that is the page's end or start, else anywhere inside.
    """

    def __init__(self, page: _Page, source_shingles: list[bytes], fresh_words,
                 start_draw: float):
        self.page = page
        self.body_lines = [line.split() for line in page.body]
        self.header_words = [w for line in page.header for w in line.split()]
        self.words = (self.header_words + [w for line in self.body_lines for w in line]
                      + [w for line in page.footer for w in line.split()])
        self.n_body = sum(len(line) for line in self.body_lines)
        self.source_shingles = source_shingles
        self.fresh = fresh_words(self.n_body)
        self.at_start, self.at_end = not page.header, not page.footer
        self.context = 0 if (self.at_start or self.at_end) else SHINGLE_WORDS - 1
        self.start_draw = start_draw

    def start(self, length: int) -> int:
        if self.at_end:
            return self.n_body - length
        if self.at_start:
            return 0
        return int(self.start_draw * (self.n_body - length + 1))

    def page_words(self, length: int) -> tuple[list[str], int]:
        at = len(self.header_words) + self.start(length)
        return self.words[:at] + self.fresh[:length] + self.words[at + length:], at

    def shingle_set(self, length: int) -> set[bytes]:
        """The candidate's shingle set: the source's away from the run, recomputed near it."""
        words, at = self.page_words(length)
        first = max(0, at - SHINGLE_WORDS + 1)
        last = min(len(words) - SHINGLE_WORDS, at + length - 1)
        near = {" ".join(words[i:i + SHINGLE_WORDS]).encode("utf-8")
                for i in range(first, last + 1)}
        return set(self.source_shingles[:first]) | set(self.source_shingles[last + 1:]) | near

    def text(self, length: int) -> str:
        words, at = self.page_words(length)
        body_words = words[len(self.header_words):len(self.header_words) + self.n_body]
        body, position = [], 0
        for line in self.body_lines:
            body.append(" ".join(body_words[position:position + len(line)]))
            position += len(line)
        return _Page(self.page.header, body, self.page.footer).text()


def _fill(template: str, fields: list[int]) -> str:
    user, month, day, site, count, topic, topic2 = fields
    return template.format(user=user, month=month, day=day, site=site, count=count,
                           topic=CONTENT_WORDS[topic], topic2=CONTENT_WORDS[topic2])


def _lines(tokens: list[str], lengths: list[int]) -> list[str]:
    """Cut a token list into lines of the given lengths, words joined by single spaces."""
    lines, at = [], 0
    for length in lengths:
        lines.append(" ".join(tokens[at:at + length]))
        at += length
    return lines


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
