"""Junk pages: machine-made text of four kinds (`JUNK_KINDS`), for the quality filters to remove.

    symbols          symbol tokens ("#$", "@@&", ...) 3 in 4, some "...", the rest garden words
    repeated_lines   one pool document 6 to 15 times, with up to two others
    no_stop_words    garden content words only: no "the", "a", "in", ... and no punctuation
    word_length      run-together triples of content words, or 1-2 letter fragments

Junk has no boilerplate (its "posted by ... on" would add stop words): a page is its lines.
"""
from __future__ import annotations

import numpy as np

from jaxscale.data.web_pages import CONTENT_WORDS, Page
from jaxscale.garden.words import VOCAB

JUNK_KINDS = ("symbols", "repeated_lines", "no_stop_words", "word_length")
SYMBOL_TOKENS = np.array(sorted({a + b + c for a in "#$%&@*!" for b in ("", "#", "@", "&", "%")
                                  for c in ("", "!", "#", "*")}))  # 1 to 3 symbols each
GARDEN_WORDS = np.array(VOCAB[3:])  # every word but <pad>, <bos>, <eos>
CONTENT_ARRAY = np.array(CONTENT_WORDS)
FRAGMENTS = np.array([a + b for a in "abcdefghijklmnopqrstuvwxyz"
                      for b in ("", *"aeiouxyz")])  # "a", "ax", "qz"...: 1 or 2 letters


def junk_pages(rng: np.random.Generator, pool: tuple[str, ...],
               junk_kinds: np.ndarray) -> list[str]:
    """One page per entry of `junk_kinds` (indices into JUNK_KINDS), drawn from `rng`."""
    makers = {"symbols": lambda: symbol_lines(rng),
              "repeated_lines": lambda: repeated_lines(rng, pool),
              "no_stop_words": lambda: content_word_lines(rng),
              "word_length": lambda: wrong_length_lines(rng)}
    return [Page([], makers[JUNK_KINDS[j]](), []).text() for j in junk_kinds.tolist()]


def _line_lengths(rng: np.random.Generator) -> list[int]:
    """4 to 8 lines of 8 to 20 tokens."""
    return rng.integers(8, 21, rng.integers(4, 9)).tolist()


def symbol_lines(rng: np.random.Generator) -> list[str]:
    """Symbol tokens ("#$", "@@&", ...) 3 in 4, "..." some of the rest, else garden words."""
    lengths = _line_lengths(rng)
    n = sum(lengths)
    draw = rng.random(n)
    symbols = SYMBOL_TOKENS[rng.integers(len(SYMBOL_TOKENS), size=n)]
    garden = GARDEN_WORDS[rng.integers(len(GARDEN_WORDS), size=n)]
    tokens = np.where(draw < 0.75, symbols, np.where(draw < 0.8, "...", garden))
    return _lines(tokens.tolist(), lengths)


def repeated_lines(rng: np.random.Generator, pool: tuple[str, ...]) -> list[str]:
    """One pool document 6 to 15 times, with up to two other documents."""
    line = pool[rng.integers(len(pool))]
    lines = [line] * int(rng.integers(6, 16))
    lines += [pool[i] for i in rng.integers(0, len(pool), rng.integers(0, 3))]
    return [lines[i] for i in rng.permutation(len(lines))]


def content_word_lines(rng: np.random.Generator) -> list[str]:
    """Garden content words only: no "the", "a", "in", ... and no punctuation."""
    lengths = _line_lengths(rng)
    words = CONTENT_ARRAY[rng.integers(len(CONTENT_ARRAY), size=sum(lengths))]
    return _lines(words.tolist(), lengths)


def wrong_length_lines(rng: np.random.Generator) -> list[str]:
    """Either run-together triples of content words (~14 letters) or 1-2 letter fragments."""
    lengths = _line_lengths(rng)
    n = sum(lengths)
    if rng.random() < 0.5:
        triples = CONTENT_ARRAY[rng.integers(len(CONTENT_ARRAY), size=(n, 3))]
        words = ["".join(t) for t in triples.tolist()]
    else:
        words = FRAGMENTS[rng.integers(len(FRAGMENTS), size=n)].tolist()
    return _lines(words, lengths)


def _lines(tokens: list[str], lengths: list[int]) -> list[str]:
    """Cut a token list into lines of the given lengths, words joined by single spaces."""
    lines, at = [], 0
    for length in lengths:
        lines.append(" ".join(tokens[at:at + length]))
        at += length
    return lines
