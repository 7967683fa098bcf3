"""Corpora drawn from the garden language, and padded batches with loss masks."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from jaxscale.garden.language import max_document_tokens, sample_document, score_document
from jaxscale.garden.words import PAD_ID


class Batch(NamedTuple):
    """A padded batch: predict targets[b, t] from tokens[b, :t+1] where mask[b, t] is 1."""

    tokens: np.ndarray  # int32 [B, T]
    targets: np.ndarray  # int32 [B, T]
    mask: np.ndarray  # float32 [B, T], 0 on padding
    n_tokens: int  # number of target tokens (sum of mask)


@dataclass(frozen=True)
class Corpus:
    """Training and validation documents drawn from the garden language."""

    train: tuple[np.ndarray, ...]
    val: tuple[np.ndarray, ...]
    seq_len: int
    seed: int

    @functools.cached_property
    def entropy_floor(self) -> float:
        """Exact cross-entropy floor of the validation set, nats per target token."""
        ent = np.concatenate([score_document(d)[1] for d in self.val])
        return float(ent.mean())

    def val_batches(self, batch_size: int) -> list[Batch]:
        return [make_batch(self.val[i:i + batch_size], self.seq_len)
                for i in range(0, len(self.val), batch_size)]

    def train_batches(self, batch_size: int, seed: int | None = None):
        """Endless batches of `batch_size` documents, reshuffled every pass (seeded)."""
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


@functools.lru_cache(maxsize=8)
def make_corpus(seed: int = 0, n_train: int = 8192, n_val: int = 512,
                seq_len: int = 64) -> Corpus:
    """Draw a corpus; the same seed always gives the same documents.

    Train and validation come from independent streams of the seed, so changing n_train
    leaves the validation set (and its floor) unchanged.
    """
    train_rng, val_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    train = tuple(sample_document(train_rng) for _ in range(n_train))
    val = tuple(sample_document(val_rng) for _ in range(n_val))
    longest = max(len(d) for d in train + val)
    if longest > seq_len + 1:
        raise ValueError(f"seq_len={seq_len} is too short for a drawn document of {longest} "
                         f"tokens; use seq_len >= {max_document_tokens() - 1}")
    return Corpus(train, val, seq_len, seed)
