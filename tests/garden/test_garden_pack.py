"""Packed rows: whole garden documents end to end, and the floor over the same targets."""
import numpy as np
import pytest

from jaxscale import garden
from jaxscale.garden import BOS_ID, EOS_ID, PAD_ID


@pytest.fixture(scope="module")
def packed():
    return garden.make_packed_corpus(0, 600, 100, 256)


def test_rows_hold_every_document_whole_and_in_order(packed):
    docs = garden.make_corpus(0, 600, 100, 256)
    for rows, originals in ((packed.train, docs.train), (packed.val, docs.val)):
        assert all(len(r) <= 257 and r[0] == BOS_ID for r in rows)
        assert np.array_equal(np.concatenate(rows), np.concatenate(originals))
        # a row is closed only when the next document would not fit
        lengths = [len(d) for d in originals]
        starts = np.cumsum([0] + [len(r) for r in rows])[:-1]
        first_docs = np.searchsorted(np.cumsum([0] + lengths), starts)
        for row, nxt in zip(rows[:-1], first_docs[1:]):
            assert len(row) + lengths[nxt] > 257


def test_the_floor_counts_each_boundary_as_a_target_of_entropy_zero(packed):
    """The loss counts every non-pad target of a row: its documents' and one per
    <eos> -> <bos> boundary (always <bos>, entropy 0). The floor is their mean."""
    docs = garden.make_corpus(0, 600, 100, 256).val
    ent = np.concatenate([garden.score_document(d)[1] for d in docs])
    boundaries = len(docs) - len(packed.val)
    assert packed.entropy_floor == pytest.approx(ent.sum() / (len(ent) + boundaries),
                                                 rel=1e-12)
    batch = garden.make_batch(packed.val, 256)
    assert batch.n_tokens == len(ent) + boundaries
    eos = batch.tokens == EOS_ID
    assert np.all(batch.targets[eos & (batch.mask > 0)] == BOS_ID)


def test_row_entropies_of_one_document_are_its_own():
    doc = garden.make_corpus(0, 10, 4, 64).val[0]
    assert np.array_equal(garden.row_entropies(doc), garden.score_document(doc)[1])
    with pytest.raises(ValueError, match="must start with <bos>"):
        garden.row_entropies(doc[1:])


def test_long_rows_are_packed_and_short_ones_hold_one_document():
    assert garden.corpus_for(64, 0, 50, 10).train == garden.make_corpus(0, 50, 10, 64).train
    long = garden.corpus_for(garden.PACK_FROM, 0, 50, 10)
    assert len(long.train) < 50 and long.seq_len == garden.PACK_FROM


def test_a_document_longer_than_a_row_is_refused():
    with pytest.raises(ValueError, match="does not fit seq_len=8"):
        garden.pack([np.full(12, PAD_ID)], 8)
