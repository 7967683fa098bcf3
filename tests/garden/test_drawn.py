"""garden.drawn: documents drawn in one process are read back in the next, the same to the
last token, and drawn again whenever what they depend on changed."""
from pathlib import Path

import numpy as np
import pytest

from jaxscale.garden import corpus, drawn

make = corpus.make_corpus.__wrapped__  # past the process's own lru_cache


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A folder of this test's own (the process's setting is restored after it)."""
    monkeypatch.setattr(drawn, "_folder", None)
    drawn.keep_in(tmp_path / "corpora")
    return tmp_path / "corpora"


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y)
                                    for x, y in zip(a, b))


def _refuse(rng, n):
    raise AssertionError("drew again where the kept documents should have been read")


def test_kept_documents_are_the_drawn_ones(kept, monkeypatch):
    fresh = make(7, 300, 40)  # nothing kept yet: drawn, then written
    assert sorted(p.name.split("-")[1] for p in kept.glob("*.npz")) == ["train", "val"]
    with monkeypatch.context() as m:
        m.setattr(corpus, "sample_documents", _refuse)
        again = make(7, 300, 40)
    assert _same(again.train, fresh.train) and _same(again.val, fresh.val)
    assert all(d.flags.owndata and d.flags.writeable for d in again.train + fresh.train)
    assert again.entropy_floor == fresh.entropy_floor
    drawn.keep_in(None)
    assert _same(make(7, 300, 40).train, again.train)  # a draw with nothing kept


def test_another_seed_count_or_source_is_drawn_again(kept, monkeypatch):
    base = make(7, 300, 40)
    assert not _same(make(8, 300, 40).train, base.train)
    assert _same(make(7, 200, 40).train, base.train[:200])  # a stream's first 200
    monkeypatch.setattr(drawn, "source_digest", lambda: "another-garden")
    calls = []
    monkeypatch.setattr(corpus, "sample_documents",
                        lambda rng, n: calls.append(n) or (np.zeros(3, np.int32),) * n)
    make(7, 300, 40)
    assert calls == [300, 40]


def test_a_file_cut_short_is_drawn_again_and_replaced(kept):
    base = make(7, 300, 40)
    (train,) = kept.glob("7-train-300-*.npz")
    train.write_bytes(train.read_bytes()[:200])
    assert _same(make(7, 300, 40).train, base.train)
    assert train.stat().st_size > 200 and all(p.suffix == ".npz" for p in kept.iterdir())


def test_nothing_is_kept_without_a_folder(monkeypatch):
    monkeypatch.setattr(drawn, "_folder", None)
    calls = []
    for _ in range(2):
        drawn.documents(7, "train", 1, lambda: calls.append(1) or (np.arange(3, dtype=np.int32),))
    assert len(calls) == 2


def test_the_digest_covers_every_source_of_the_garden():
    names = {p.name for p in Path(drawn.__file__).parent.glob("*.py")}
    assert {"language.py", "words.py", "sampling.py", "corpus.py"} <= names
    assert len(drawn.source_digest()) == 20
