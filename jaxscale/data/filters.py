"""Quality filters: cheap rules that spot machine-made text (Gopher, Rae et al. 2021, App. A).

A crawl holds pages no one would want a model to learn from: symbol soup, one line
repeated, word salad, text with no grammar. Gopher's answer is a handful of heuristics on
simple counts, each removing a page when one number is out of the range that ordinary
prose has. They are not learned and need no model: a page is removed when ANY rule fires.

Each rule below is a small pure function of one text that returns True when the page
should be REMOVED; its thresholds are keyword defaults. Words are `text.split()`, lines
are `text.split("\\n")` with blank lines dropped.

    mean_word_length       mean word length outside [3, 10] characters (Gopher's range)
    symbol_ratio           "#" or ellipses ("...", "…") per word above 0.1, either one
    ellipsis_lines         more than 30% of lines end in an ellipsis
    few_stop_words         fewer than 2 stop words (see STOP_WORDS)
    duplicate_lines        more than 30% of lines repeat an earlier line
    few_alphabetic_words   fewer than 60% of words contain a letter (Gopher: 80%)

Adapted to the garden language, and why:
  - Stop words. Of Gopher's list (the, be, to, of, and, that, have, with) the garden uses
    only "the", so a page of weather sentences ("in winter , snow falls .") would have
    none. STOP_WORDS adds the garden's own function words (a, in, it, is, by, on, over,
    near, under, along): the rule still asks "does this read like grammar?", which word
    salad of content words fails.
  - Alphabetic words. The garden writes "," and "." as words of their own: about 21% of
    its words have no letter (0.79 on average), so Gopher's 80% would remove most ordinary
    pages. 60% keeps the rule's point (symbol soup has about 25% words with a letter).
  - Mean word length. Garden words are short (3.3 characters on average, punctuation
    included), close to Gopher's lower bound of 3; measured on 10^4 web pages the bound
    removes few originals, so it is kept (the false-positive rate is in the tests).

`apply_filters` runs the rules on many texts: one Python pass counts everything once per
text (`text_counts`), and every rule is then a comparison of numpy arrays, the same
comparison the one-text functions make (tested to agree). `score` measures any stage's
removals against ground truth.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

GOPHER_STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})
GARDEN_STOP_WORDS = frozenset({"a", "in", "it", "is", "by", "on", "over", "near", "under",
                               "along"})
STOP_WORDS = GOPHER_STOP_WORDS | GARDEN_STOP_WORDS
ELLIPSES = ("...", "\u2026")
_HAS_LETTER = re.compile(r"[^\W\d_]")  # a Unicode letter: a word character, not digit or _


@dataclass(frozen=True)
class TextCounts:
    """The counts every rule needs, one entry per text (int64 arrays)."""

    words: np.ndarray
    word_chars: np.ndarray  # characters in words (whitespace excluded)
    hashes: np.ndarray  # "#" characters
    ellipses: np.ndarray  # "..." and "…" occurrences
    stop_words: np.ndarray
    alphabetic_words: np.ndarray  # words with at least one letter
    lines: np.ndarray  # non-blank lines
    ellipsis_lines: np.ndarray  # non-blank lines ending in an ellipsis
    duplicate_lines: np.ndarray  # non-blank lines equal to an earlier one


def text_counts(texts: Sequence[str]) -> TextCounts:
    """Count words, symbols, stop words and lines of every text in one pass."""
    rows = [_count(text) for text in _checked_texts(texts)]
    columns = np.asarray(rows, dtype=np.int64).reshape(len(rows), 9).T
    return TextCounts(*columns)


def _count(text: str) -> tuple[int, ...]:
    words = text.split()
    lines = [line.strip() for line in text.split("\n")]
    lines = [line for line in lines if line]
    return (len(words), sum(map(len, words)), text.count("#"),
            sum(text.count(e) for e in ELLIPSES),
            sum(1 for w in words if w in STOP_WORDS),
            sum(1 for w in words if _HAS_LETTER.search(w)),
            len(lines), sum(1 for line in lines if line.endswith(ELLIPSES)),
            len(lines) - len(set(lines)))


def _checked_texts(texts: Sequence[str]) -> Sequence[str]:
    if isinstance(texts, str):
        raise TypeError("give a sequence of texts, not one str (wrap it in a list)")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"text {i} is a {type(text).__name__}, not a str")
    return texts


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """numerator / denominator, 0 where the denominator is 0."""
    return np.divide(numerator, denominator, out=np.zeros(len(numerator)),
                     where=denominator > 0)


# ---- the rules, on counts (arrays) ----------------------------------------------------
def _mean_word_length_rule(c: TextCounts, low: float = 3.0, high: float = 10.0) -> np.ndarray:
    mean = _ratio(c.word_chars, c.words)
    return (c.words == 0) | (mean < low) | (mean > high)


def _symbol_ratio_rule(c: TextCounts, max_ratio: float = 0.1) -> np.ndarray:
    return (_ratio(c.hashes, c.words) > max_ratio) | (_ratio(c.ellipses, c.words) > max_ratio)


def _ellipsis_lines_rule(c: TextCounts, max_fraction: float = 0.3) -> np.ndarray:
    return _ratio(c.ellipsis_lines, c.lines) > max_fraction


def _few_stop_words_rule(c: TextCounts, min_stop_words: int = 2) -> np.ndarray:
    return c.stop_words < min_stop_words


def _duplicate_lines_rule(c: TextCounts, max_fraction: float = 0.3) -> np.ndarray:
    return _ratio(c.duplicate_lines, c.lines) > max_fraction


def _few_alphabetic_words_rule(c: TextCounts, min_fraction: float = 0.6) -> np.ndarray:
    return (c.words == 0) | (_ratio(c.alphabetic_words, c.words) < min_fraction)


# ---- the rules, on one text ------------------------------------------------------------
def _one(rule, text: str, **thresholds) -> bool:
    return bool(rule(text_counts([text]), **thresholds)[0])


def mean_word_length(text: str, *, low: float = 3.0, high: float = 10.0) -> bool:
    """Remove when the mean word length (characters) is below `low` or above `high`, or there
    are no words: word salad of fragments, or run-together tokens, URLs, hashes."""
    return _one(_mean_word_length_rule, text, low=low, high=high)


def symbol_ratio(text: str, *, max_ratio: float = 0.1) -> bool:
    """Remove when "#" characters per word, or ellipses per word, exceed `max_ratio`."""
    return _one(_symbol_ratio_rule, text, max_ratio=max_ratio)


def ellipsis_lines(text: str, *, max_fraction: float = 0.3) -> bool:
    """Remove when more than `max_fraction` of the lines end in an ellipsis (truncated
    snippets, "read more ..." lists)."""
    return _one(_ellipsis_lines_rule, text, max_fraction=max_fraction)


def few_stop_words(text: str, *, min_stop_words: int = 2) -> bool:
    """Remove when fewer than `min_stop_words` words are in STOP_WORDS: no grammar."""
    return _one(_few_stop_words_rule, text, min_stop_words=min_stop_words)


def duplicate_lines(text: str, *, max_fraction: float = 0.3) -> bool:
    """Remove when more than `max_fraction` of the lines repeat an earlier line."""
    return _one(_duplicate_lines_rule, text, max_fraction=max_fraction)


def few_alphabetic_words(text: str, *, min_fraction: float = 0.6) -> bool:
    """Remove when fewer than `min_fraction` of the words contain a letter, or there are no
    words (Gopher uses 0.8; see the module docstring for the garden's 0.6)."""
    return _one(_few_alphabetic_words_rule, text, min_fraction=min_fraction)


FILTERS: dict[str, Callable[[str], bool]] = {
    "mean_word_length": mean_word_length,
    "symbol_ratio": symbol_ratio,
    "ellipsis_lines": ellipsis_lines,
    "few_stop_words": few_stop_words,
    "duplicate_lines": duplicate_lines,
    "few_alphabetic_words": few_alphabetic_words,
}
_RULES = {
    "mean_word_length": _mean_word_length_rule,
    "symbol_ratio": _symbol_ratio_rule,
    "ellipsis_lines": _ellipsis_lines_rule,
    "few_stop_words": _few_stop_words_rule,
    "duplicate_lines": _duplicate_lines_rule,
    "few_alphabetic_words": _few_alphabetic_words_rule,
}


def apply_filters(texts: Sequence[str], names: Sequence[str] | None = None
                  ) -> dict[str, np.ndarray]:
    """{rule name: bool array, True where that rule removes the text}, in FILTERS order.

    `names` picks some rules (default: all). A page is removed by the filter stage when any
    rule fires: `np.logical_or.reduce(list(result.values()))`.
    """
    names = list(FILTERS) if names is None else list(names)
    unknown = [n for n in names if n not in FILTERS]
    if unknown:
        raise ValueError(f"unknown filters {unknown}; the filters are {list(FILTERS)}")
    counts = text_counts(texts)
    return {name: _RULES[name](counts) for name in FILTERS if name in names}


def score(removed: np.ndarray, truth: np.ndarray) -> dict[str, float | int]:
    """How well a stage's removals match the pages that should go.

    precision = true positives / removed (nan when nothing is removed), recall = true
    positives / truth (nan when there is nothing to find); `removed` and `true_positives`
    are counts.
    """
    removed, truth = np.asarray(removed), np.asarray(truth)
    if removed.dtype != bool or truth.dtype != bool:
        raise TypeError(f"removed and truth must be bool arrays, got {removed.dtype} and "
                        f"{truth.dtype}")
    if removed.shape != truth.shape or removed.ndim != 1:
        raise ValueError(f"removed and truth must be 1-d and of one shape, got {removed.shape} "
                         f"and {truth.shape}")
    n_removed, n_truth = int(removed.sum()), int(truth.sum())
    true_positives = int((removed & truth).sum())
    return {"precision": true_positives / n_removed if n_removed else float("nan"),
            "recall": true_positives / n_truth if n_truth else float("nan"),
            "removed": n_removed, "true_positives": true_positives}
