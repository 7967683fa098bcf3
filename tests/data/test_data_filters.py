"""Quality filters and decontamination: each rule on hand-made pages, then measured on a web.

The bounds below come from measurements on `make_web(10_000, seed=0)` (stated beside each)
with a margin, checked here on a smaller corpus of another seed.
"""
from __future__ import annotations

import numpy as np
import pytest

from jaxscale.data import filters, web
from jaxscale.data.decontaminate import Decontaminator, ngrams
from jaxscale.data.web_junk import JUNK_KINDS

GARDEN = ("in spring , a frog jumps in the pond . it is green . rain falls .\n"
          "in summer , the red rose blooms by the wall . tom waters the mint .")


@pytest.fixture(scope="module")
def corpus() -> web.WebCorpus:
    return web.make_web(3000, seed=11)


@pytest.fixture(scope="module")
def removed(corpus) -> dict[str, np.ndarray]:
    return filters.apply_filters(corpus.texts)


# ---- each rule on hand-written pages -----------------------------------------------------
@pytest.mark.parametrize("name, bad, good", [
    ("mean_word_length", "a b c de f gh i j", GARDEN),
    ("mean_word_length", "sunflowerhedgehogbutterfly tomatoorchidheron", GARDEN),
    ("mean_word_length", "", GARDEN),
    ("symbol_ratio", "# # the cat sat on the mat ### #",
     "the cat # sat on the mat and it was nice ."),
    ("symbol_ratio", "wait ... what ... no ... yes",
     "wait ... what happened to the cat on that day ?"),
    ("ellipsis_lines", "one line ...\ntwo line ...\nthree line\nfour line \u2026",
     "one line ...\ntwo line\nthree line\nfour line"),
    ("few_stop_words", "rose tulip daisy frog heron badger", "rose tulip the daisy frog heron"
                                                            " in the pond"),
    ("duplicate_lines", "same line\nsame line\nother line", "same line\nother line\nthird line\n"
                                                           "\n\nsame line\nfourth\nfifth"),
    ("few_alphabetic_words", "@@ ## $$ %% cat && ,", GARDEN),
])
def test_each_rule_on_examples(name, bad, good):
    rule = filters.FILTERS[name]
    assert rule(bad) is True
    assert rule(good) is False
    np.testing.assert_array_equal(filters.apply_filters([bad, good], [name])[name],
                                  [True, False])


def test_thresholds_are_keywords():
    assert filters.mean_word_length("a b c", low=1.0) is False
    assert filters.symbol_ratio("# a b c d e f g h i", max_ratio=0.05) is True
    assert filters.symbol_ratio("# a b c d e f g h i") is False  # exactly 0.1 is kept
    assert filters.few_stop_words("the cat", min_stop_words=1) is False
    assert filters.duplicate_lines("x\nx\ny", max_fraction=0.5) is False
    assert filters.few_alphabetic_words(", . , cat", min_fraction=0.2) is False


def test_stop_words_are_adapted_to_the_garden():
    weather = "in winter , snow falls . frost bites .\nin autumn , wind blows ."
    assert not filters.GOPHER_STOP_WORDS & set(weather.split())
    assert filters.few_stop_words(weather) is False  # "in", "in": garden function words


def test_apply_filters_agrees_with_the_one_text_rules(corpus, removed):
    assert list(removed) == list(filters.FILTERS)
    sample = range(0, len(corpus), 7)
    for name, rule in filters.FILTERS.items():
        assert removed[name].dtype == bool and removed[name].shape == (len(corpus),)
        assert [rule(corpus.texts[i]) for i in sample] == removed[name][sample].tolist(), name


# ---- measured on the synthetic web -------------------------------------------------------
# measured recall of the rule meant for each junk kind, 10^4 pages: 1.0 for all four
RULE_FOR_JUNK = {"symbols": "symbol_ratio", "repeated_lines": "duplicate_lines",
                 "no_stop_words": "few_stop_words", "word_length": "mean_word_length"}


@pytest.mark.parametrize("junk_kind", JUNK_KINDS)
def test_each_junk_kind_is_caught_by_its_rule(corpus, removed, junk_kind):
    truth = corpus.junk == JUNK_KINDS.index(junk_kind)
    result = filters.score(removed[RULE_FOR_JUNK[junk_kind]], truth)
    assert result["recall"] >= 0.97, result


def test_originals_are_rarely_removed(corpus, removed):
    # measured on 10^4 pages: 0.11% of originals removed (mean word length just under 3)
    any_rule = np.logical_or.reduce(list(removed.values()))
    originals = corpus.is_kind("original")
    assert any_rule[originals].mean() <= 0.005
    for name in ("symbol_ratio", "ellipsis_lines", "few_stop_words", "duplicate_lines",
                 "few_alphabetic_words"):
        assert removed[name][originals].mean() <= 0.002, name
    result = filters.score(any_rule, corpus.is_kind("junk"))
    assert result["recall"] == 1.0 and result["precision"] >= 0.95, result


def test_gopher_alphabetic_threshold_would_remove_ordinary_garden_pages(corpus):
    originals = [t for t, k in zip(corpus.texts, corpus.kind) if k == 0][:300]
    gopher = np.mean([filters.few_alphabetic_words(t, min_fraction=0.8) for t in originals])
    assert gopher > 0.9  # why the default is 0.6 (see the module docstring)


def test_score_counts_and_checks_its_input():
    removed = np.array([True, True, False, False, True])
    truth = np.array([True, False, False, True, True])
    assert filters.score(removed, truth) == {"precision": 2 / 3, "recall": 2 / 3,
                                             "removed": 3, "true_positives": 2}
    nothing = filters.score(np.zeros(3, bool), np.zeros(3, bool))
    assert np.isnan(nothing["precision"]) and np.isnan(nothing["recall"])
    with pytest.raises(TypeError, match="bool arrays"):
        filters.score(np.array([1, 0]), np.array([True, False]))
    with pytest.raises(ValueError, match="of one shape"):
        filters.score(np.array([True]), np.array([True, False]))


def test_filters_refuse_bad_input():
    with pytest.raises(ValueError, match="unknown filters"):
        filters.apply_filters(["a b"], ["no_such_rule"])
    with pytest.raises(TypeError, match="not one str"):
        filters.apply_filters("a page")
    with pytest.raises(TypeError, match="text 1 is a int"):
        filters.apply_filters(["a", 3])


# ---- decontamination ----------------------------------------------------------------------
def test_ngrams_and_the_short_document_rule():
    words = "a b c d e".split()
    assert ngrams(words, 3) == ["a b c", "b c d", "c d e"]
    assert ngrams(words, 9) == ["a b c d e"]
    assert ngrams([], 3) == []
    finder = Decontaminator(["x y z", "p q r s t u v w", "the"], n=5, min_fraction=0.0)
    found = finder.contaminated(["a\n x  y z \nb", "a x y z b", "q r s t u",
                                 "r s t u", "xx y z", "the cat", "a\nthe\n"])
    # a short document counts as a whole line of the page, not as words anywhere in it
    np.testing.assert_array_equal(found, [True, False, True, False, False, False, True])


def test_min_fraction_counts_ngrams_of_one_document():
    doc_a = " ".join(f"a{i}" for i in range(20))  # 8 distinct 13-grams
    doc_b = " ".join(f"b{i}" for i in range(20))
    finder = Decontaminator([doc_a, doc_b])  # n = 13, 3/4 of one document's n-grams
    most_a = " ".join(f"a{i}" for i in range(18))  # 6 of a's 8 13-grams
    less_a = " ".join(f"a{i}" for i in range(17))  # 5 of 8
    two_parts = less_a + " " + " ".join(f"b{i}" for i in range(17))  # 5 + 5, of two docs
    found = finder.contaminated([most_a, less_a, two_parts, doc_b, "unrelated words"])
    np.testing.assert_array_equal(found, [True, False, False, True, False])


def test_decontamination_finds_every_contaminated_page(corpus):
    truth = corpus.is_kind("contaminated")
    result = filters.score(Decontaminator(corpus.validation).contaminated(corpus.texts), truth)
    # measured on 10^4 pages: recall 1.0, precision 1.0 (200 of 200, no clean page flagged)
    assert result["recall"] == 1.0 and result["precision"] >= 0.95, result
    # GPT-3's "any one 13-gram" on this low-entropy language: precision 0.10 at 10^4 pages
    gpt3 = filters.score(Decontaminator(corpus.validation, min_fraction=0.0)
                         .contaminated(corpus.texts), truth)
    assert gpt3["recall"] == 1.0 and gpt3["precision"] < 0.5, gpt3


def test_the_share_of_n_grams_needed_is_the_fraction_as_written():
    """min_fraction 0.14 of a document's 50 distinct 13-grams is 7 (0.14 * 50 is
    7.000000000000001 in floats, and its ceiling asked for 8)."""
    words = [f"w{i}" for i in range(62)]  # 50 distinct 13-grams
    finder = Decontaminator([" ".join(words)], min_fraction=0.14)
    assert finder.needed == [7]
    found = finder.contaminated([" ".join(words[:19]), " ".join(words[:18])])  # 7 and 6
    np.testing.assert_array_equal(found, [True, False])


def test_decontaminator_refuses_bad_input():
    with pytest.raises(ValueError, match="non-empty sequence"):
        Decontaminator([])
    with pytest.raises(ValueError, match="non-empty sequence"):
        Decontaminator("one document")
    with pytest.raises(ValueError, match=r"n \(words per n-gram\) must be an integer >= 1, got 0"):
        Decontaminator(["a b"], n=0)
    with pytest.raises(ValueError, match=r"min_fraction must be in \[0, 1\], got 2"):
        Decontaminator(["a b"], min_fraction=2)
    with pytest.raises(TypeError, match="not one str"):
        Decontaminator(["a b"]).contaminated("a b")
