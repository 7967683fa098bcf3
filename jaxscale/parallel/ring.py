"""Collectives built by hand from `lax.ppermute`, with a ledger of the bytes each device sends.

Call these inside `jax.shard_map`, on each device's local block, over one mesh axis of K
devices. A ring connects device i to device i+1 (mod K); every step, every device sends one
chunk of n/K elements to its right neighbour, so all links are busy at once:

  reduce-scatter  K-1 steps: pass a partial sum along the ring, each device adding its
                  own copy of that chunk; device i ends with chunk i summed over all devices
  all-gather      K-1 steps: pass the finished chunks along the ring
  all-reduce      reduce-scatter then all-gather: 2(K-1) sends of n/K elements per device,
                  2(K-1)/K x the vector, almost independent of K

The ring adds chunk i in the order x_{i+1} + x_{i+2} + ... + x_i, while XLA's psum on CPU
adds x_0 + x_1 + ...: integers agree exactly, floats to a few ulps (addition is not
associative).

For contrast, `parameter_server_all_reduce` sends everything to device 0 and back: device 0
moves 2(K-1) x the vector, growing linearly with K (exercise 4).

The `Ledger` is filled while JAX traces the function (the shapes are known then), so it
records each compiled program once; the HLO of the same program (`jaxscale.measure.hlo`) shows
the same sends as collective-permute ops.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
from jax import lax


@dataclass
class Send:
    op: str  # which collective
    step: int
    pairs: tuple[tuple[int, int], ...]  # (source, destination) device indices on the axis
    nbytes: int  # bytes each source sends in this step


@dataclass
class Ledger:
    """Every ppermute the hand-built collectives issue, with its bytes (recorded at trace time)."""

    axis_size: int = 0
    sends: list[Send] = field(default_factory=list)

    def record(self, op: str, step: int, pairs, x: jax.Array) -> None:
        self.sends.append(Send(op, step, tuple(pairs), x.size * x.dtype.itemsize))

    def _per_device(self, end: int) -> list[int]:
        out = [0] * self.axis_size
        for s in self.sends:
            for pair in s.pairs:
                out[pair[end]] += s.nbytes
        return out

    def sent_per_device(self) -> list[int]:
        """Total bytes sent by each device on the axis."""
        return self._per_device(0)

    def received_per_device(self) -> list[int]:
        """Total bytes received by each device on the axis."""
        return self._per_device(1)


def _ring(k: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % k) for i in range(k)]


def _chunks(x: jax.Array, k: int) -> jax.Array:
    if x.shape[0] % k:
        raise ValueError(f"leading dimension {x.shape[0]} is not divisible by the axis size {k}; "
                         "pad it to a multiple first")
    return x.reshape(k, x.shape[0] // k, *x.shape[1:])


def ring_reduce_scatter(x: jax.Array, axis_name: str, ledger: Ledger | None = None,
                        trace: list | None = None) -> jax.Array:
    """Sum x over the axis; device i keeps chunk i (= lax.psum_scatter(x, axis, tiled=True))."""
    k = lax.axis_size(axis_name)
    i = lax.axis_index(axis_name)
    chunks = _chunks(x, k)
    own = lambda c: lax.dynamic_index_in_dim(chunks, c % k, keepdims=False)  # noqa: E731
    buf = own(i - 1)  # step s sends the partial sum of chunk (i - s - 1)
    if ledger is not None:
        ledger.axis_size = k
    for s in range(k - 1):
        if ledger is not None:
            ledger.record("reduce_scatter", s, _ring(k), buf)
        received = lax.ppermute(buf, axis_name, _ring(k))  # from device i-1: chunk i-s-2
        buf = received + own(i - s - 2)
        if trace is not None:
            trace.append(buf)
    return buf  # after K-1 steps: chunk i, complete


def ring_all_gather(chunk: jax.Array, axis_name: str, ledger: Ledger | None = None,
                    trace: list | None = None) -> jax.Array:
    """Concatenate every device's chunk in device order (= lax.all_gather(..., tiled=True))."""
    k = lax.axis_size(axis_name)
    i = lax.axis_index(axis_name)
    out = jnp.zeros((k, *chunk.shape), chunk.dtype)
    out = lax.dynamic_update_index_in_dim(out, chunk, i, 0)
    buf = chunk
    if ledger is not None:
        ledger.axis_size = k
    for s in range(k - 1):
        if ledger is not None:
            ledger.record("all_gather", s, _ring(k), buf)
        buf = lax.ppermute(buf, axis_name, _ring(k))  # chunk (i - s - 1), finished
        out = lax.dynamic_update_index_in_dim(out, buf, (i - s - 1) % k, 0)
        if trace is not None:
            trace.append(buf)
    return out.reshape(k * chunk.shape[0], *chunk.shape[1:])


def ring_all_reduce(x: jax.Array, axis_name: str, ledger: Ledger | None = None,
                    trace: list | None = None) -> jax.Array:
    """Sum x over the axis on every device (= lax.psum): reduce-scatter, then all-gather."""
    return ring_all_gather(ring_reduce_scatter(x, axis_name, ledger, trace), axis_name, ledger,
                           trace)


def parameter_server_all_reduce(x: jax.Array, axis_name: str,
                                ledger: Ledger | None = None) -> jax.Array:
    """Every device sends x to device 0, which adds them and sends the sum back to each."""
    k = lax.axis_size(axis_name)
    i = lax.axis_index(axis_name)
    if ledger is not None:
        ledger.axis_size = k
    total = x
    for src in range(1, k):  # one transfer at a time: device 0's link is the bottleneck
        if ledger is not None:
            ledger.record("ps_gather", src - 1, [(src, 0)], x)
        total = total + lax.ppermute(x, axis_name, [(src, 0)])  # zero on devices other than 0
    total = jnp.where(i == 0, total, jnp.zeros_like(total))
    result = total
    for dst in range(1, k):
        if ledger is not None:
            ledger.record("ps_broadcast", dst - 1, [(0, dst)], x)
        result = result + lax.ppermute(total, axis_name, [(0, dst)])
    return result
