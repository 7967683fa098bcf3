"""Decontamination: drop training pages that contain text of the evaluation set (GPT-3 style).

If a benchmark's test documents are in the training data, the model's score on them
measures memory, not skill. GPT-3 (Brown et al. 2020, App. C) removed every training
document that shares a word 13-gram with a test document: 13 words in a row are long
enough that ordinary English rarely repeats them by chance, and short enough to catch a
quoted passage.

The rule here, exactly:
  - words are `text.split()`; an n-gram is n consecutive words (n = 13 by default);
  - every validation document contributes all its n-grams; a document shorter than n words
    is looked for as a whole line of the page (its words, and nothing else, on one line):
    as a run of words anywhere it would flag every page holding a short common phrase
    (a one-word document "the" would flag nearly all of them);
  - a page is contaminated when it contains at least `min_fraction` of the n-grams of some
    ONE validation document (GPT-3: any one n-gram, i.e. `min_fraction=0`).

The n-grams are kept as strings in a set, not hashed: a validation set has thousands of
documents, not billions, so the set is small, exact (no collisions to reason about) and a
Python set lookup hashes the string in C anyway. A 64-bit hash (e.g. blake2b's first 8
bytes) pays off when the index must be stored compactly or shipped between machines.

Why `min_fraction` is 0.75 and not GPT-3's "any one": the garden language is low-entropy
(a vocabulary of ~90 words and a few sentence shapes), so a 13-gram such as
"tom waters the mint . a bird sings on the wall . it is" turns up on independent pages by
chance. Measured on `make_web(10_000, seed=0)` (200 contaminated pages among 10,000, 256
validation documents, 20 of them shorter than 13 words):
    n = 13, any one n-gram (GPT-3)   precision 0.10  recall 1.0  (1,750 clean pages flagged)
    n = 8,  min_fraction = 0.5       precision 0.21  recall 1.0
    n = 13, min_fraction = 0.1       precision 0.18  recall 1.0
    n = 13, min_fraction = 0.2       precision 0.40  recall 1.0
    n = 13, min_fraction = 0.5       precision 1.0   recall 1.0
    n = 20, any one n-gram           precision 1.0   recall 1.0
but 0.5 is not enough on other seeds: on make_web(5000) seeds 0 and 1 it gives precision
0.87 and 0.885 (a 17-word validation document has 5 13-grams, and a page saying "... a
mouse hides under the bench ." where the document says "... under the shed ." shares 3
of them), while 0.75 gives precision 1.0 and recall 1.0 on seeds 0, 1 and 2 (as do 0.9
and 1.0). So we keep GPT-3's n = 13 and ask for three quarters of ONE document's n-grams,
because that also says what is being looked for (a long stretch of one test document,
which chance does not give; a verbatim copy has all of them) and still catches a page
quoting most of a document. A longer n only moves the problem: the garden repeats whole
sentences, and real repetitive text (code, templates) has longer chance matches still.
Real English is far less repetitive, which is why GPT-3 could use a single 13-gram.
(The web generator keeps its ground truth honest by never choosing a validation document
that an ordinary page contains verbatim; see `web._sample_validation`.) The measurement
is repeated in tests/data/test_data_filters.py.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np

from jaxscale.data.shingles import word_ngrams as ngrams  # one definition

N_GRAM = 13
MIN_FRACTION = 0.75


class Decontaminator:
    """Finds pages that contain a validation document's n-grams: see the module docstring."""

    def __init__(self, validation: Sequence[str], n: int = N_GRAM,
                 min_fraction: float = MIN_FRACTION):
        if isinstance(validation, str) or len(validation) == 0:
            raise ValueError("validation must be a non-empty sequence of documents (str)")
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"n (words per n-gram) must be an integer >= 1, got {n!r}")
        if not 0.0 <= min_fraction <= 1.0:
            raise ValueError(f"min_fraction must be in [0, 1], got {min_fraction}")
        self.n, self.min_fraction = int(n), float(min_fraction)
        self.owners: dict[str, list[int]] = {}  # n-gram -> the documents it occurs in
        self.needed: list[int] = []  # how many of its n-grams a page must share, per document
        self.short: set[str] = set()  # documents shorter than n words, words " "-joined
        for doc_id, doc in enumerate(validation):
            if not isinstance(doc, str):
                raise TypeError(f"validation document {doc_id} is a {type(doc).__name__}")
            words = doc.split()
            grams = set(ngrams(words, self.n))
            if len(words) < self.n:
                self.short.update(grams)
            else:
                for gram in grams:
                    self.owners.setdefault(gram, []).append(doc_id)
            # the fraction as written (0.14 is 7/50): float products round up past whole
            # counts (0.14 * 50 = 7.000000000000001), and ceil would ask for 8 of 50
            share = Fraction(repr(self.min_fraction)) * len(grams)
            self.needed.append(max(1, math.ceil(share)))

    def contaminated(self, texts: Sequence[str]) -> np.ndarray:
        """bool array: True where the page shares enough of one validation document."""
        if isinstance(texts, str):
            raise TypeError("give a sequence of texts, not one str (wrap it in a list)")
        return np.fromiter((self._is_contaminated(t) for t in texts), dtype=bool,
                           count=len(texts))

    def _is_contaminated(self, text: str) -> bool:
        words = text.split()
        if self.short and any(" ".join(line.split()) in self.short
                              for line in text.split("\n")):  # a short document as a line
            return True
        if len(words) < self.n:
            return False
        shared: dict[int, int] = {}
        for gram in set(ngrams(words, self.n)):
            for doc_id in self.owners.get(gram, ()):
                shared[doc_id] = shared.get(doc_id, 0) + 1
                if shared[doc_id] >= self.needed[doc_id]:
                    return True
        return False
