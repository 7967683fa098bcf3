"""The settings of a cleaning run (`CleanConfig`), checked before anything is computed.

One frozen dataclass holds every choice `clean.clean` needs: MinHash (permutations, their seed,
the shingle hash), LSH (a Jaccard threshold, or bands and rows), the quality filters to apply,
and decontamination (on or off, n-gram length, share of one validation document). `check`
refuses a bad value with a `CleanError` that names it. With the bands and rows given instead of
a threshold, the verification threshold is the S-curve's own, (1/b)^(1/r): where a pair's
chance of becoming a candidate is 1 - (1 - 1/b)^b, about 1 - 1/e = 0.63.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from jaxscale.data import minhash
from jaxscale.data.decontaminate import MIN_FRACTION, N_GRAM, Decontaminator
from jaxscale.data.filters import FILTERS
from jaxscale.data.lsh_params import check_params, threshold_estimate


class CleanError(ValueError):
    """A bad pipeline setting: the message names the value and the valid choices."""


DEFAULT_THRESHOLD = 0.7


@dataclass(frozen=True)
class CleanConfig:
    num_perm: int = 128
    seed: int = 1  # of the MinHash permutations (datasketch's meaning)
    threshold: float | None = None  # Jaccard of near-duplicates (DEFAULT_THRESHOLD if
    bands: int | None = None  #        neither it nor bands and rows are given)
    rows: int | None = None
    shingle_hash: str = "fast"
    filters: tuple[str, ...] = tuple(FILTERS)
    decontaminate: bool = True
    ngram: int = N_GRAM  # decontamination: words per n-gram
    min_fraction: float = MIN_FRACTION  # and the share of one document's n-grams

    @functools.cached_property
    def _params(self) -> tuple[int, int]:
        given = self.bands is not None or self.rows is not None
        threshold = DEFAULT_THRESHOLD if self.threshold is None and not given else self.threshold
        return check_params(self.num_perm, self.bands, self.rows, threshold)

    def lsh_params(self) -> tuple[int, int]:
        """(bands, rows): as given, or chosen for the threshold as datasketch chooses."""
        return self._params

    def verify_threshold(self) -> float:
        """The threshold, or with bands and rows given the curve's own, (1/b)^(1/r)."""
        if self.threshold is not None or (self.bands is None and self.rows is None):
            return DEFAULT_THRESHOLD if self.threshold is None else self.threshold
        return threshold_estimate(*self.lsh_params())

    def check(self) -> "CleanConfig":
        minhash.check_options(self.num_perm, self.shingle_hash)
        unknown = [f for f in self.filters if f not in FILTERS]
        if unknown:
            raise CleanError(f"unknown filter {unknown[0]!r}; choose from {', '.join(FILTERS)}")
        try:
            self.lsh_params()
            Decontaminator(["a"], self.ngram, self.min_fraction)  # checks n and the fraction
        except ValueError as e:
            raise CleanError(str(e)) from None
        return self
