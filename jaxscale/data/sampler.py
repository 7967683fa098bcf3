"""Which documents a step trains on, and each process building only its own rows of them.

The sampler is a pure function: the g-th training sample (g counts from 0 over the whole
run, step after step) is document `order(epoch)[position]`, with epoch = g // n_docs and
position = g % n_docs, and `order(epoch)` a permutation drawn from (seed, epoch) alone. So
  - every epoch is a new shuffle, and every process computes the same one, with no state
    to keep in step (PyTorch's DistributedSampler needs `set_epoch` for both: forget it
    and every epoch repeats the first order);
  - the data position of a run is one number, the global sample index, whatever the mesh:
    a checkpoint taken on dp=8 resumes on dp=2 at the same sample.

Step s trains on samples s*B ... s*B + B-1 (B the global batch). Its batch is one global
array per field, sharded over the dp axis; `StepBatches.place` asks the step's batch
sharding which rows this process's devices hold and builds only those rows (padding,
shifting, masking), so no process materialises another's share of the batch.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from jaxscale.garden.corpus import make_batch


class Sampler:
    """The document index of every global sample index: see the module docstring."""

    def __init__(self, n_docs: int, seed: int):
        if n_docs < 1:
            raise ValueError(f"a sampler needs at least one document, got {n_docs}")
        self.n_docs, self.seed = int(n_docs), int(seed)

    @functools.lru_cache(maxsize=4)
    def order(self, epoch: int) -> np.ndarray:
        """The epoch's permutation of the documents, from (seed, epoch) alone."""
        return np.random.default_rng([self.seed, 2, epoch]).permutation(self.n_docs)

    def docs(self, start: int, stop: int) -> np.ndarray:
        """Document indices of global samples start .. stop-1 (epochs may change inside)."""
        g = np.arange(start, stop)
        epochs, positions = np.divmod(g, self.n_docs)
        out = np.empty(len(g), dtype=np.int64)
        for e in np.unique(epochs):
            here = epochs == e
            out[here] = self.order(int(e))[positions[here]]
        return out


def rows_held(sharding, batch_size: int) -> tuple[int, int]:
    """(lo, hi): the rows of a [batch_size, ...] array that this process's devices hold
    under `sharding` (rows of one process are contiguous: dp groups follow processes)."""
    spans = [idx[0].indices(batch_size)[:2]
             for idx in sharding.addressable_devices_indices_map((batch_size, 1)).values()]
    lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
    return lo, hi


class StepBatches:
    """The batches of a run: `place(step, sharding)` gives step's batch as global arrays
    (rows on the dp axis), this process building only the rows it holds. With
    `record=True`, `touched` lists the global sample indices it built (tests read it; a
    training run does not keep a list that grows every step)."""

    def __init__(self, docs, batch_size: int, seq_len: int, seed: int, steps: int | None = None,
                 record: bool = False):
        self.docs, self.batch_size, self.seq_len = docs, int(batch_size), int(seq_len)
        self.sampler = Sampler(len(docs), seed)
        self.steps = steps  # len(): how many steps there are (None: endless)
        self.touched: list[int] | None = [] if record else None

    def __len__(self) -> int:
        if self.steps is None:
            raise TypeError("an endless StepBatches has no length; give steps=")
        return self.steps

    def position(self, step: int) -> int:
        """The global sample index step (counting from 0) starts at: the data position."""
        return step * self.batch_size

    def n_tokens(self, step: int) -> int:
        """Target tokens in step's whole batch, from the documents' lengths (no rows)."""
        start = self.position(step)
        lengths = [min(len(self.docs[i]), self.seq_len + 1) - 1
                   for i in self.sampler.docs(start, start + self.batch_size)]
        return int(sum(lengths))

    def rows(self, step: int, lo: int, hi: int) -> dict[str, np.ndarray]:
        """Rows lo .. hi-1 of step's batch, padded and masked (garden.make_batch)."""
        start = self.position(step)
        if self.touched is not None:
            self.touched.extend(range(start + lo, start + hi))
        b = make_batch([self.docs[i] for i in self.sampler.docs(start + lo, start + hi)],
                       self.seq_len)
        return {"tokens": b.tokens, "targets": b.targets, "mask": b.mask}

    def place(self, step: int, sharding=None) -> dict:
        """Step's batch on `sharding` (None: the whole batch as host arrays, for one
        device), every process supplying only its own rows."""
        if sharding is None:
            return self.rows(step, 0, self.batch_size)
        lo, hi = rows_held(sharding, self.batch_size)
        local = self.rows(step, lo, hi)

        def field(x):
            shape = (self.batch_size, *x.shape[1:])
            return jax.make_array_from_callback(
                shape, sharding, lambda idx: x[_shift(idx[0], lo, self.batch_size)])
        return {k: field(v) for k, v in local.items()}


def _shift(rows: slice, lo: int, n: int) -> slice:
    start, stop, _ = rows.indices(n)
    return slice(start - lo, stop - lo)


class FixedBatches:
    """Given host batches (whole dicts of numpy arrays) behind StepBatches' interface:
    every process holds every row. For tests and one-process tools."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.batch_size = len(self.batches[0]["tokens"])

    def __len__(self) -> int:
        return len(self.batches)

    def place(self, step: int, sharding=None) -> dict:
        b = {k: self.batches[step][k] for k in ("tokens", "targets", "mask")}
        return b if sharding is None else jax.device_put(b, sharding)
