"""Near-duplicate pages: an original with one run of body words replaced, aimed at a Jaccard level.

Each near-duplicate is given a target Jaccard, spread evenly over `NEAR_DUPLICATE_LEVELS`, and
its source page one contiguous run of body words replaced by fresh garden words, the run's
length steered towards the target (`edit_towards`): from the count of shingles a run changes
at first, then corrected against the exact Jaccard of each candidate, which `_Run` computes
from the shingles around the run alone. The top level is a whitespace-only edit: the same
words, other bytes. What is recorded is the exact Jaccard of the result to its source.
"""
from __future__ import annotations

import numpy as np

from jaxscale.data.shingles import SHINGLE_WORDS, jaccard
from jaxscale.data.web_pages import Page, PageBuilder

NEAR_DUPLICATE_LEVELS = (0.1, 1.0)  # target Jaccard of near-duplicates, spread evenly


def near_duplicates(builder: PageBuilder,
                    sources: list[int]) -> tuple[list[str], list[float]]:
    """The near-duplicates of the given originals, with their exact Jaccard to them."""
    low, high = NEAR_DUPLICATE_LEVELS
    n = len(sources)
    targets = low + (high - low) * (np.arange(n) + builder.rng.random(n)) / max(n, 1)
    texts, levels = [], []
    for original, target in zip(sources, builder.rng.permutation(targets).tolist()):
        text, level = edit_towards(builder, original, target)
        texts.append(text)
        levels.append(level)
    return texts, levels


def edit_towards(builder: PageBuilder, original: int, target: float) -> tuple[str, float]:
    """The original with one run of body words replaced, its Jaccard near `target`.

    Replacing a run of L words that has >= 4 page words on either side changes the
    L + 4 shingles that overlap it (L at the page's ends): with S distinct source
    shingles, D of them changed gives J ~ (S - D) / (S + D), so D = S (1 - J) / (1 + J).
    Repeated shingles move the real value, so L is corrected a few times against the
    Jaccard of the candidate, computed from the shingles around the run alone (the
    same set that `shingle_set` of the candidate's text gives: the tests check that).
    Returns the text and its exact Jaccard to the original.
    """
    page = builder.originals[original]
    source_set = builder.source_set(original)
    n_changed = len(source_set) * (1 - target) / (1 + target)
    if n_changed < 0.5:  # the top level: the same words, other whitespace
        return whitespace_edit(builder.rng, page), 1.0
    run = _Run(page, builder.source_shingles(original), builder.fresh_words,
               builder.rng.random())
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
        return whitespace_edit(builder.rng, page), 1.0
    return text, best_level


def whitespace_edit(rng: np.random.Generator, page: Page) -> str:
    """The same words with one extra space: byte-different, shingle-identical."""
    body = list(page.body)
    line = int(rng.integers(len(body)))
    body[line] = body[line].replace(" ", "  ", 1) if " " in body[line] else body[line] + " "
    return Page(page.header, body, page.footer).text()


class _Run:
    """Candidate near-duplicates of one page: body words [start, start + L) made fresh.

    Runs touching a page end (no header before, or no footer after, the body) change
    fewer shingles, which is what makes levels near 1.0 reachable: so a run sits at the
    body's end or start when that is the page's end or start, else anywhere inside.
    """

    def __init__(self, page: Page, source_shingles: list[bytes], fresh_words,
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
        return Page(self.page.header, body, self.page.footer).text()
