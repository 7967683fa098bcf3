"""The garden-world language: a true distribution in every state, an exact entropy floor."""
import math

import numpy as np
import pytest

from jaxscale import garden as g


@pytest.fixture(scope="module")
def corpus():
    return g.make_corpus(seed=0)


def test_vocabulary_size_and_specials():
    assert 50 <= len(g.VOCAB) <= 150
    assert len(set(g.VOCAB)) == len(g.VOCAB)
    assert (g.PAD_ID, g.BOS_ID, g.EOS_ID) == (0, 1, 2)


@pytest.mark.slow
def test_every_reachable_state_is_a_distribution():
    states = g.reachable_states()
    assert len(states) > 1000
    for s in states:
        options = g.next_words(s)
        words = [w for w, _, _ in options]
        assert len(set(words)) == len(words), s  # distinct words: the prefix fixes the state
        assert all(p > 0 for _, p, _ in options), s
        assert math.isclose(sum(p for _, p, _ in options), 1.0, abs_tol=1e-12), s


def test_documents_are_deterministic_per_seed(corpus):
    again = g.make_corpus.__wrapped__(seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(corpus.train, again.train))
    assert all(np.array_equal(a, b) for a, b in zip(corpus.val, again.val))
    other = g.make_corpus.__wrapped__(seed=1, n_train=64, n_val=64)
    assert not all(np.array_equal(a, b) for a, b in zip(corpus.val, other.val))
    # the validation set does not depend on how many training documents are drawn
    smaller = g.make_corpus.__wrapped__(seed=0, n_train=32, n_val=16)
    assert all(np.array_equal(a, b) for a, b in zip(corpus.val[:16], smaller.val))


@pytest.mark.slow
def test_documents_have_bos_eos_and_variable_length(corpus):
    lengths = np.array([len(d) for d in corpus.train])
    assert all(d[0] == g.BOS_ID and d[-1] == g.EOS_ID for d in corpus.train)
    assert all(g.BOS_ID not in d[1:] and g.EOS_ID not in d[:-1] for d in corpus.train[:500])
    assert lengths.min() < 12 and lengths.max() > 40
    assert lengths.max() <= g.max_document_tokens() <= corpus.seq_len + 1


def test_rare_words_are_rare_but_present(corpus):
    for word in g.RARE_WORDS:
        i = g.WORD_ID[word]
        doc_freq = np.mean([i in d for d in corpus.train])
        assert 0 < doc_freq < 0.01, (word, doc_freq)


def test_a_batch_larger_than_the_corpus_is_refused_not_awaited(corpus):
    """Fewer training rows than one batch (a packed corpus has ~45 documents a row): the
    first batch is refused with the sizes, where it used to spin for ever."""
    for size in (len(corpus.train) + 1, 0):
        with pytest.raises(ValueError, match=f"a batch of {size} needs 1 to"):
            next(corpus.train_batches(size))


def test_batches_mask_padding_and_count_tokens(corpus):
    batches = corpus.train_batches(32)
    sizes = []
    for _ in range(4):
        b = next(batches)
        assert b.tokens.shape == b.targets.shape == b.mask.shape == (32, corpus.seq_len)
        assert np.array_equal(b.tokens[:, 1:], b.targets[:, :-1])
        assert np.array_equal(b.mask, (b.targets != g.PAD_ID).astype(np.float32))
        assert b.n_tokens == int(b.mask.sum())
        assert (b.tokens[:, 0] == g.BOS_ID).all()
        sizes.append(b.n_tokens)
        halves = b.mask[:16].sum(), b.mask[16:].sum()
    assert len(set(sizes)) > 1  # batches differ in token count
    assert halves[0] != halves[1]  # and so do the shards of one batch


def test_batch_order_is_seeded(corpus):
    a = [next(corpus.train_batches(8, seed=3)).tokens for _ in range(1)]
    b = [next(corpus.train_batches(8, seed=3)).tokens for _ in range(1)]
    c = [next(corpus.train_batches(8, seed=4)).tokens for _ in range(1)]
    assert np.array_equal(a[0], b[0]) and not np.array_equal(a[0], c[0])


@pytest.mark.slow
def test_floor_agrees_with_monte_carlo(corpus):
    """Three routes to the floor agree within sampling error (3 standard errors).

    1. population: the exact entropy rate of the language (recursion over the state graph);
    2. validation set: exact mean entropy of the true distributions at its positions;
    3. Monte Carlo: mean true NLL of the tokens actually drawn.
    """
    population = g.population_entropy_floor()
    nll, ent, per_doc = [], [], []
    for d in corpus.val:
        n, e = g.score_document(d)
        nll.append(n)
        ent.append(e)
        per_doc.append((n.sum(), e.sum(), len(n)))
    nll, ent = np.concatenate(nll), np.concatenate(ent)
    assert corpus.entropy_floor == pytest.approx(ent.mean(), rel=1e-12)

    # (3) vs (2) on the same tokens: nll - entropy has conditional mean 0 at each position
    se_same = (nll - ent).std() / math.sqrt(len(nll))
    assert abs(nll.mean() - ent.mean()) < 3 * se_same

    # (2) and (3) vs (1): ratio estimators over i.i.d. documents (delta-method s.e.)
    a_nll, a_ent, counts = (np.array(x, dtype=float) for x in zip(*per_doc))
    for sums in (a_ent, a_nll):
        r = sums.sum() / counts.sum()
        se = math.sqrt(((sums - r * counts) ** 2).sum()) / counts.sum()
        assert abs(r - population) < 3 * se, (r, population, se)

    # a fresh, larger Monte-Carlo sample pins the population floor more tightly
    rng = np.random.default_rng(123)
    sums, counts = [], []
    for _ in range(4000):
        n, _ = g.score_document(g.sample_document(rng))
        sums.append(n.sum())
        counts.append(len(n))
    sums, counts = np.array(sums), np.array(counts, dtype=float)
    r = sums.sum() / counts.sum()
    se = math.sqrt(((sums - r * counts) ** 2).sum()) / counts.sum()
    assert se < 0.01 and abs(r - population) < 3 * se, (r, population, se)


@pytest.mark.parametrize("block", [7, 8192])  # many block ends inside documents; the default
def test_sample_documents_draws_what_sample_document_draws(monkeypatch, block):
    """The numbered walk with block draws gives the very documents of one draw per token,
    across block boundaries (600 documents take about 12,000 draws)."""
    from jaxscale.garden import sampling
    monkeypatch.setattr(sampling, "DRAW_BLOCK", block)
    one = np.random.default_rng(5)
    expected = [g.sample_document(one) for _ in range(600)]
    got = g.sample_documents(np.random.default_rng(5), 600)
    assert sum(map(len, got)) > 8192 and len(got) == len(expected)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got, expected))
