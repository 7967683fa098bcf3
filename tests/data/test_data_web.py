"""The synthetic web: ground truth that holds, page by page."""
from __future__ import annotations

import numpy as np
import pytest

from jaxscale.data import web
from jaxscale.data.web_junk import JUNK_KINDS
from jaxscale.data.shingles import jaccard, shingle_set
from jaxscale.garden.words import SEASONS

N_PAGES = 2000


@pytest.fixture(scope="module")
def corpus() -> web.WebCorpus:
    return web.make_web(N_PAGES, seed=3)


def _is_body(line: str) -> bool:
    """A garden document starts "in <season> ,"; boilerplate never does."""
    return any(line.startswith(f"in {season} ,") for season in SEASONS)


def _of_kind(corpus, name):
    return np.flatnonzero(corpus.is_kind(name))


def test_same_seed_same_corpus_other_seed_other():
    a, b = web.make_web(300, seed=5), web.make_web(300, seed=5)
    assert a.texts == b.texts and a.validation == b.validation
    for field in ("kind", "source", "junk"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    np.testing.assert_array_equal(a.jaccard, b.jaccard)  # nan == nan here
    c = web.make_web(300, seed=6)
    assert len(set(a.texts) & set(c.texts)) < 10


def test_kind_counts_follow_the_mix(corpus):
    counts = np.bincount(corpus.kind, minlength=len(web.KINDS))
    for name, fraction in web.DEFAULT_MIX.items():
        assert counts[web.KINDS.index(name)] == int(fraction * N_PAGES), name
    assert counts.sum() == N_PAGES == len(corpus.ids) == len(set(corpus.ids))
    custom = web.make_web(1000, seed=0, junk=0.3, contaminated=0.0, near_duplicate=0.05)
    assert np.sum(custom.is_kind("junk")) == 300 and not custom.is_kind("contaminated").any()
    # junk kinds cycle evenly; only junk pages have one
    junk = custom.junk[custom.is_kind("junk")]
    np.testing.assert_array_equal(np.bincount(junk), [75, 75, 75, 75])
    assert (custom.junk[~custom.is_kind("junk")] == -1).all()


def test_pages_are_shuffled_and_sources_are_originals(corpus):
    derived = np.flatnonzero(corpus.source >= 0)
    expected = np.isin(corpus.kind, [web.KINDS.index(k) for k in web.DERIVED_KINDS])
    np.testing.assert_array_equal(corpus.source >= 0, expected)
    assert (corpus.kind[corpus.source[derived]] == web.KINDS.index("original")).all()
    assert np.median(np.abs(corpus.source[derived] - derived)) > N_PAGES / 10
    assert len(np.unique(corpus.kind[:100])) > 2  # not sorted by kind


def test_typical_page_length():
    corpus = web.make_web(500, seed=1, junk=0.0, contaminated=0.0)
    words = np.array([len(t.split()) for t in corpus.texts])
    assert 60 <= np.median(words) <= 150
    assert np.mean((words >= 40) & (words <= 200)) > 0.85


def test_recorded_jaccard_is_exact(corpus):
    derived = np.flatnonzero(corpus.source >= 0)
    for page in derived:
        exact = jaccard(shingle_set(corpus.texts[page]),
                        shingle_set(corpus.texts[corpus.source[page]]))
        assert corpus.jaccard[page] == exact, (page, web.KINDS[corpus.kind[page]])
    assert np.isnan(corpus.jaccard[corpus.source < 0]).all()


def test_near_duplicates_span_the_levels(corpus):
    levels = corpus.jaccard[_of_kind(corpus, "near_duplicate")]
    per_bin, _ = np.histogram(levels, bins=np.linspace(0.1, 1.0, 10))
    assert (per_bin >= 0.5 * len(levels) / 9).all(), per_bin  # roughly even over 9 bins
    assert levels.min() < 0.15 and levels.max() == 1.0
    near = _of_kind(corpus, "near_duplicate")
    assert all(corpus.texts[p] != corpus.texts[corpus.source[p]] for p in near)


def test_exact_copies_are_byte_identical(corpus):
    copies = _of_kind(corpus, "exact_copy")
    assert len(copies) == 80
    assert all(corpus.texts[p] == corpus.texts[corpus.source[p]] for p in copies)
    assert (corpus.jaccard[copies] == 1.0).all()


def test_reposts_change_only_header_and_footer(corpus):
    for page in _of_kind(corpus, "repost"):
        mine = corpus.texts[page].split("\n")
        theirs = corpus.texts[corpus.source[page]].split("\n")
        assert [line for line in mine if _is_body(line)] == \
            [line for line in theirs if _is_body(line)]
        mine_boiler = [line for line in mine if not _is_body(line)]
        assert mine_boiler and mine_boiler != [line for line in theirs if not _is_body(line)]
    levels = corpus.jaccard[_of_kind(corpus, "repost")]
    assert 0.6 < levels.mean() < 1.0


def test_contaminated_pages_hold_a_validation_document(corpus):
    validation = set(corpus.validation)
    assert len(validation) == len(corpus.validation) == web.N_VALIDATION
    contaminated = corpus.is_kind("contaminated")
    for page, text in enumerate(corpus.texts):
        held = any(line in validation for line in text.split("\n"))
        assert held == contaminated[page], (page, web.KINDS[corpus.kind[page]])


def test_junk_kinds_look_like_their_names(corpus):
    def pages(junk_kind):
        return [corpus.texts[p] for p in np.flatnonzero(corpus.junk
                                                         == JUNK_KINDS.index(junk_kind))]

    for text in pages("repeated_lines"):
        lines = text.split("\n")
        assert len(set(lines)) <= len(lines) - 5
    for text in pages("no_stop_words"):
        assert not set(text.split()) & {"the", "a", "in", "is", ",", "."}
    for text in pages("symbols"):
        words = text.split()
        assert np.mean([w.isalpha() for w in words]) < 0.4
    for text in pages("word_length"):
        lengths = [len(w) for w in text.split()]
        assert not 3 <= np.mean(lengths) <= 10


def test_duplicate_pairs_semantics(corpus):
    everything = corpus.duplicate_pairs(0.0)
    assert everything.dtype == np.int64 and everything.shape[1] == 2
    assert (everything[:, 0] < everything[:, 1]).all()
    assert len(np.unique(everything, axis=0)) == len(everything)
    pairs = {tuple(p) for p in everything.tolist()}
    derived = np.flatnonzero(corpus.source >= 0)
    for page in derived:  # every copy is paired with its source
        assert tuple(sorted((page, int(corpus.source[page])))) in pairs
    siblings = len(everything) - len(derived)
    by_source = np.bincount(corpus.source[derived])
    assert siblings == int((by_source * (by_source - 1) // 2).sum()) > 0
    for a, b in everything.tolist():  # only pages that are copies, or have copies
        assert corpus.source[a] >= 0 or corpus.source[b] >= 0
    # the threshold keeps exactly the pairs at or above it, by exact Jaccard
    high = corpus.duplicate_pairs(0.8)
    for a, b in high.tolist():
        assert jaccard(shingle_set(corpus.texts[a]), shingle_set(corpus.texts[b])) >= 0.8
    kept = {tuple(p) for p in high.tolist()}
    for a, b in everything.tolist():
        if (a, b) not in kept:
            assert jaccard(shingle_set(corpus.texts[a]), shingle_set(corpus.texts[b])) < 0.8
    assert 0 < len(high) < len(everything)


@pytest.mark.parametrize("bad, match", [
    (dict(n_docs=0), "n_docs must be an integer >= 1, got 0"),
    (dict(n_docs=2.5), "n_docs must be an integer"),
    (dict(n_docs=10, junk=-0.1), r"fraction of junk pages must be in \[0, 1\], got -0.1"),
    (dict(n_docs=10, junk=0.6, near_duplicate=0.6), "sum to 1.3"),
    (dict(n_docs=10, spam=0.1), "unknown page kinds"),
    (dict(n_docs=10, n_validation=0), "n_validation must be >= 1"),
])
def test_bad_input_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        web.make_web(**bad)
    corpus = web.make_web(50, seed=0)
    with pytest.raises(ValueError, match=r"threshold must be a Jaccard level in \[0, 1\]"):
        corpus.duplicate_pairs(1.5)
    with pytest.raises(ValueError, match="unknown page kind"):
        corpus.is_kind("spam")


def test_one_page_and_all_originals():
    one = web.make_web(1, seed=0)
    assert len(one) == 1 and one.kind[0] == 0 and len(one.duplicate_pairs(0.0)) == 0
    with pytest.raises(ValueError, match="leaves no original"):
        web.make_web(10, repost=0.5, junk=0.5, near_duplicate=0.0, exact_copy=0.0,
                     contaminated=0.0)
