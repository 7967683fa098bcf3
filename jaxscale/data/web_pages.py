"""The pages of the synthetic web: boilerplate around garden body lines, and their copies.

A page is header lines, body lines (each one garden document) and footer lines (`Page`).
`PageBuilder` holds what every page is made from (the pool of garden documents, the
validation documents, one random stream, and the original pages, made first) and makes the
kinds that need no editing: fresh pages (the originals, and the base of contaminated pages),
reposts (an original's body under other boilerplate), exact copies, and contaminated pages
(a validation document inserted as a body line). Near-duplicates are `web_edits.py`, junk
`web_junk.py`; `web.make_web` puts the kinds together and labels them.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from jaxscale.data.shingles import jaccard, shingle_set, shingles
from jaxscale.garden.words import ANIMAL_ADJECTIVES, ANIMALS, PLANTS, SEASONS

BODY_LINES = (3, 7)  # garden documents per page, inclusive

# Words that carry meaning in the garden language (no function words, no punctuation):
# used for junk pages without stop words and for boilerplate topics.
CONTENT_WORDS = tuple(sorted({*SEASONS, *ANIMALS, *PLANTS,
                              *(a for d in ANIMAL_ADJECTIVES.values() for a in d)}))
HEADER_TEMPLATES = ("home | about | contact", "menu | garden | shop | blog",
                    "posted by user{user} on 2026-{month:02d}-{day:02d}",
                    "you are here : home > garden > {topic}")
FOOTER_TEMPLATES = ("share this page", "copyright 2026 site{site} . all rights reserved .",
                    "read more ...", "comments ( {count} )", "tags : {topic} , {topic2}")


@dataclass
class Page:
    """A page under construction: boilerplate around garden body lines."""

    header: list[str]
    body: list[str]
    footer: list[str]

    def text(self) -> str:
        return "\n".join(self.header + self.body + self.footer)


class PageBuilder:
    """Makes pages from the pool, in the order asked; the originals are made first, on creation."""

    def __init__(self, rng: np.random.Generator, pool: tuple[str, ...],
                 validation: tuple[str, ...], n_originals: int):
        self.rng, self.pool, self.validation = rng, pool, validation
        self.pool_words = [doc.split() for doc in pool]
        self._shingles: dict[int, list[bytes]] = {}
        self._shingle_sets: dict[int, frozenset[bytes]] = {}
        self.originals: list[Page] = self.fresh_pages(n_originals)

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

    def fresh_pages(self, n: int) -> list[Page]:
        n_lines = self.rng.integers(BODY_LINES[0], BODY_LINES[1] + 1, n)
        line_ids = self.rng.integers(0, len(self.pool), int(n_lines.sum())).tolist()
        ends = np.cumsum(n_lines).tolist()
        return [Page(header, [self.pool[i] for i in line_ids[end - k:end]], footer)
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
            text = Page(header, page.body, footer).text()
            texts.append(text)
            levels.append(jaccard(self.source_set(original), shingle_set(text)))
        return texts, levels

    # ---- pages without a source -----------------------------------------------------------
    def contaminated(self, n: int) -> list[str]:
        pages = self.fresh_pages(n)
        chosen = self.rng.integers(0, len(self.validation), n)
        for page, doc in zip(pages, chosen.tolist()):
            page.body.insert(int(self.rng.integers(len(page.body) + 1)), self.validation[doc])
        return [page.text() for page in pages]


def _fill(template: str, fields: list[int]) -> str:
    user, month, day, site, count, topic, topic2 = fields
    return template.format(user=user, month=month, day=day, site=site, count=count,
                           topic=CONTENT_WORDS[topic], topic2=CONTENT_WORDS[topic2])
