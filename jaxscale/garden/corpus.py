"""Corpora drawn from the garden language, and padded batches with loss masks.

A row of a batch holds one document (up to 53 tokens: rows of 64 fit any), or, for long
rows, several whole documents one after another (`pack`): a row of 1,024 tokens holds
about 45. A packed row's targets are its documents' targets plus one per boundary, where
<eos> is always followed by <bos>: a target of entropy 0. So the exact floor still holds,
computed over the same targets the loss counts (`row_entropies`). Attention may look
across a boundary; documents are drawn independently, so that neither helps nor hurts
the floor.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jaxscale.garden import drawn
from jaxscale.garden.language import max_document_tokens, score_document
from jaxscale.garden.sampling import sample_documents
from jaxscale.garden.words import BOS_ID, PAD_ID


class Batch(NamedTuple):
    """A padded batch: predict targets[b, t] from tokens[b, :t+1] where mask[b, t] is 1."""

    tokens: np.ndarray  # int32 [B, T]
    targets: np.ndarray  # int32 [B, T]
    mask: np.ndarray  # float32 [B, T], 0 on padding
    n_tokens: int  # number of target tokens (sum of mask)


@dataclass(frozen=True)
class Corpus:
    """Training and validation documents drawn from the garden language."""

    train: tuple[np.ndarray, ...]  # rows: one document each, or several whole ones (pack)
    val: tuple[np.ndarray, ...]
    seq_len: int
    seed: int

    @functools.cached_property
    def entropy_floor(self) -> float:
        """Exact cross-entropy floor of the validation set, nats per target token."""
        return float(np.concatenate([row_entropies(r) for r in self.val]).mean())

    def val_batches(self, batch_size: int) -> list[Batch]:
        return [make_batch(self.val[i:i + batch_size], self.seq_len)
                for i in range(0, len(self.val), batch_size)]

    def train_batches(self, batch_size: int, seed: int | None = None):
        """Endless batches of `batch_size` documents, reshuffled every pass (seeded)."""
        if not 1 <= batch_size <= len(self.train):  # else no batch, and the loop would spin
            raise ValueError(f"a batch of {batch_size} needs 1 to {len(self.train)} training "
                             f"rows (this corpus has {len(self.train)})")
        rng = np.random.default_rng([self.seed if seed is None else seed, 1])
        n = len(self.train) // batch_size * batch_size
        while True:
            order = rng.permutation(len(self.train))[:n]
            for i in range(0, n, batch_size):
                yield make_batch([self.train[j] for j in order[i:i + batch_size]], self.seq_len)


def make_batch(docs, seq_len: int) -> Batch:
    """Pad documents to seq_len + 1 tokens and shift: inputs, next-token targets, loss mask."""
    b = len(docs)
    full = np.full((b, seq_len + 1), PAD_ID, dtype=np.int32)
    for i, d in enumerate(docs):
        if len(d) > seq_len + 1:
            raise ValueError(f"document of {len(d)} tokens does not fit seq_len={seq_len}")
        full[i, :len(d)] = d
    targets = full[:, 1:]
    mask = (targets != PAD_ID).astype(np.float32)
    return Batch(full[:, :-1], targets, mask, int(mask.sum()))


def row_entropies(row: np.ndarray) -> np.ndarray:
    """The true entropy of every target of a row (one document or several packed whole):
    each document's, and 0 for each <eos> -> <bos> boundary."""
    starts = np.flatnonzero(row == BOS_ID)
    if len(starts) == 0 or starts[0] != 0:
        raise ValueError("a row must start with <bos>")
    parts = []
    for i, doc in enumerate(np.split(row, starts[1:])):
        if i:
            parts.append(np.zeros(1))  # the boundary: <bos> always follows <eos>
        parts.append(score_document(doc)[1])
    return np.concatenate(parts)


def pack(docs, seq_len: int) -> tuple[np.ndarray, ...]:
    """Whole documents laid end to end in rows of at most seq_len + 1 tokens (inputs and
    shifted targets), in order: a row is closed when the next document would not fit."""
    rows, row, used = [], [], 0
    for d in docs:
        if len(d) > seq_len + 1:
            raise ValueError(f"document of {len(d)} tokens does not fit seq_len={seq_len}")
        if used + len(d) > seq_len + 1:
            rows.append(np.concatenate(row))
            row, used = [], 0
        row.append(d)
        used += len(d)
    if row:
        rows.append(np.concatenate(row))
    return tuple(rows)


# Rows this long or longer are packed (corpus_for): one 53-token document in a row of 256
# would leave four fifths of every row padding.
PACK_FROM = 256


def corpus_for(seq_len: int, seed: int = 0, n_train: int = 8192, n_val: int = 512) -> Corpus:
    """The corpus a model of seq_len trains on: make_corpus's documents, packed into rows
    when seq_len >= PACK_FROM (then n_train and n_val count documents, not rows)."""
    if seq_len < PACK_FROM:
        return make_corpus(seed, n_train, n_val, seq_len)
    return make_packed_corpus(seed, n_train, n_val, seq_len)


@functools.lru_cache(maxsize=4)
def make_packed_corpus(seed: int = 0, n_train: int = 8192, n_val: int = 512,
                       seq_len: int = 1024) -> Corpus:
    """make_corpus's documents (the same seed, the same streams), packed into rows."""
    docs = make_corpus(seed, n_train, n_val, seq_len)  # seq_len only sets the padding
    return Corpus(pack(docs.train, seq_len), pack(docs.val, seq_len), seq_len, seed)


@functools.lru_cache(maxsize=8)
def make_corpus(seed: int = 0, n_train: int = 8192, n_val: int = 512,
                seq_len: int = 64) -> Corpus:
    """Draw a corpus; the same seed always gives the same documents.

    Train and validation come from independent streams of the seed, so changing n_train
    leaves the validation set (and its floor) unchanged. Documents drawn before in another
    process are read back where a folder keeps them (garden.drawn).
    """
    train_rng, val_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    train = drawn.documents(seed, "train", n_train, lambda: sample_documents(train_rng, n_train))
    val = drawn.documents(seed, "val", n_val, lambda: sample_documents(val_rng, n_val))
    longest = max(len(d) for d in train + val)
    if longest > seq_len + 1:
        raise ValueError(f"seq_len={seq_len} is too short for a drawn document of {longest} "
                         f"tokens; use seq_len >= {max_document_tokens() - 1}")
    return Corpus(train, val, seq_len, seed)
