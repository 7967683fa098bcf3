"""Drawing documents: a walk through the garden automaton from its start to END, each
next word chosen with its true probability by one uniform draw.

`sample_document` is the walk as the automaton states it; `sample_documents` is the same
walk over numbered states, for corpora of thousands of documents.
"""
from __future__ import annotations

import bisect
import functools

import numpy as np

from jaxscale.garden.language import END, State, next_words
from jaxscale.garden.words import BOS_ID, WORD_ID


@functools.lru_cache(maxsize=None)
def _sampler(s: State) -> tuple[np.ndarray, tuple[int, ...], tuple[State, ...]]:
    options = next_words(s)
    cum = np.cumsum([p for _, p, _ in options])
    cum[-1] = 1.0
    return cum, tuple(WORD_ID[w] for w, _, _ in options), tuple(n for _, _, n in options)


def sample_document(rng: np.random.Generator) -> np.ndarray:
    """One document as token ids: <bos> ... <eos>."""
    ids, s = [BOS_ID], State()
    while s is not END:
        cum, words, nexts = _sampler(s)
        k = int(np.searchsorted(cum, rng.random(), side="right"))
        k = min(k, len(words) - 1)
        ids.append(words[k])
        s = nexts[k]
    return np.asarray(ids, dtype=np.int32)


class _Numbered:
    """The automaton's states numbered as sampling first meets them (the start is 0, END
    is 1), each with its row: cumulative probabilities as a list (bisect on Python floats
    finds the index np.searchsorted finds), word ids, and the next states' numbers. A walk
    then follows integers, where sample_document hashes a State at every token."""

    def __init__(self):
        self.number, self.states, self.rows = {State(): 0, END: 1}, [State(), END], [None, None]

    def row(self, i: int) -> tuple[list[float], tuple[int, ...], tuple[int, ...]]:
        if self.rows[i] is None:
            cum, words, nexts = _sampler(self.states[i])
            self.rows[i] = (cum.tolist(), words, tuple(map(self._number_of, nexts)))
        return self.rows[i]

    def _number_of(self, s: State) -> int:
        if s not in self.number:
            self.number[s] = len(self.states)
            self.states.append(s)
            self.rows.append(None)
        return self.number[s]


_NUMBERED = _Numbered()
DRAW_BLOCK = 8192  # uniforms drawn at a time by sample_documents


def sample_documents(rng: np.random.Generator, n: int) -> tuple[np.ndarray, ...]:
    """n documents, the same as n calls of sample_document(rng): the same uniforms in the
    same order (a Generator's block of k draws is its next k single draws), the same
    choices, about twice as fast. It draws DRAW_BLOCK uniforms at a time, so it leaves
    `rng` further along than n calls of sample_document would."""
    draws, j, docs = rng.random(DRAW_BLOCK).tolist(), 0, []
    for _ in range(n):
        ids, i = [BOS_ID], 0
        while i != 1:  # END's number
            cum, words, nexts = _NUMBERED.row(i)
            if j == len(draws):
                draws, j = rng.random(DRAW_BLOCK).tolist(), 0
            k = min(bisect.bisect_right(cum, draws[j]), len(words) - 1)
            j += 1
            ids.append(words[k])
            i = nexts[k]
        docs.append(np.asarray(ids, dtype=np.int32))
    return tuple(docs)
