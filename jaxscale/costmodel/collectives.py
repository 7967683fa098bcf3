"""Time of one collective on a ring of K devices: latency per hop + bytes / bandwidth.

n is the size of the whole array: the gathered output of an all-gather, the input of a
reduce-scatter or all-reduce; for an all-to-all, the array each device holds (it keeps 1/K
and sends 1/K to each of the others). B is one direction of one device's link, alpha one hop.

                  one-directional ring                     bidirectional ring (torus axis)
  all-gather      (K-1) (alpha + n/K / B)                  floor(K/2) (alpha + n/K / B)
                  = (K-1)/K n / B + ...                    ~ n / 2B for large K
  reduce-scatter  the same as all-gather
  all-reduce      reduce-scatter + all-gather (twice the above)
  all-to-all      (K-1) alpha + (K-1)/2 . n / B            each chunk the short way round:
                  (a chunk to the device d hops on         sum_d min(d, K-d) . n/K / 2B
                  crosses d links; K links share them)     (1/4 of an all-gather of K n)

`axes` > 1 spreads one collective over several torus axes at once (the scaling book's
V / (W n_axes)). The bidirectional all-gather reproduces the scaling book's T = V / W_ici
with W_ici both directions (its quiz: 34 MB over 4 v5e chips, 377 us: two hops of 8.5 MB
each way at 4.5e10 B/s); GPUs use the
one-directional form with B = NVLink or InfiniBand per GPU (NCCL's bus bandwidth).
"""
from __future__ import annotations

from jaxscale.costmodel.shape import ShapeError

KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


def collective_seconds(kind: str, n_bytes: float, k: int, bandwidth: float,
                       latency: float = 0.0, bidirectional: bool = False, axes: int = 1) -> float:
    """Seconds for one `kind` collective of an n-byte array over k devices (table above)."""
    if kind not in KINDS:
        raise ShapeError(f"unknown collective {kind!r}; choose from {', '.join(KINDS)}")
    if k < 1 or n_bytes < 0 or not bandwidth > 0 or latency < 0 or axes < 1:
        raise ShapeError(f"need k >= 1, n >= 0, bandwidth > 0, latency >= 0, axes >= 1; got "
                         f"{k}, {n_bytes}, {bandwidth}, {latency}, {axes}")
    if k == 1 or n_bytes == 0:
        return 0.0
    if kind == "all_reduce":
        return 2 * collective_seconds("all_gather", n_bytes, k, bandwidth, latency,
                                      bidirectional, axes)
    hops = k // 2 if bidirectional else k - 1
    if kind == "all_to_all":
        chunk = n_bytes / k  # per destination
        if bidirectional:  # 2k directed links share sum_d min(d, k-d) chunk-hops per source
            load = chunk * sum(min(d, k - d) for d in range(1, k)) / 2
        else:  # k links share k sources x chunk x (1 + 2 + ... + k-1) chunk-hops
            load = chunk * (k - 1) * k / 2
        return hops * latency + load / (bandwidth * axes)
    # each hop moves one shard (n/k) per direction: k-1 hops one way, floor(k/2) both ways
    return hops * (latency + n_bytes / k / (bandwidth * axes))


def collective_bytes(kind: str, n_bytes: float, k: int) -> float:
    """Bytes one device sends in a ring `kind` over k devices (the same both ways round):
    all-gather and reduce-scatter (k-1)/k n, all-reduce twice that, all-to-all (k-1)/k n."""
    if kind not in KINDS:
        raise ShapeError(f"unknown collective {kind!r}; choose from {', '.join(KINDS)}")
    return (2 if kind == "all_reduce" else 1) * (k - 1) / k * n_bytes
