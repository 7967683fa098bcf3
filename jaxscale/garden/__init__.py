"""Garden world: a small synthetic language whose true next-token distribution is known.

A document is generated word by word by a finite, deterministic probabilistic automaton:
every prefix leads to exactly one `State`, and `next_words(state)` lists each possible next
word with its probability and the state it leads to. Because the true distribution is known
for every prefix, the cross-entropy floor of any corpus drawn from it (the mean entropy of
the true next-token distributions, nats/token) is computed exactly: no model can beat it.

    <bos> in spring , a frog jumps in the pond . it is quiet . rain falls . <eos>

What the language carries on purpose:
  * long-range memory: the season (said once, up front) shapes the weather, plant and animal
    words in every later sentence; the document's first animal tends to come back;
  * agreement: an animal picks its verbs, a verb its prepositions, "it is ..." its adjective
    from the previous sentence's animal;
  * rare words (hedgehog, heron, badger, orchid) in well under 1% of documents;
  * variable length (1-6 sentences): batches and shards hold different numbers of tokens.
"""
from jaxscale.garden.corpus import (PACK_FROM, Batch, Corpus, corpus_for, make_batch,
                                    make_corpus, make_packed_corpus, pack, row_entropies)
from jaxscale.garden.language import (END, State, entropy, max_document_tokens, next_words,
                                      population_entropy_floor, reachable_states,
                                      score_document)
from jaxscale.garden.sampling import sample_document, sample_documents
from jaxscale.garden.words import BOS_ID, EOS_ID, PAD_ID, RARE_WORDS, VOCAB, WORD_ID

__all__ = ["Batch", "Corpus", "make_batch", "make_corpus", "PACK_FROM", "corpus_for",
           "make_packed_corpus", "pack", "row_entropies", "END", "State", "entropy",
           "max_document_tokens", "next_words", "population_entropy_floor",
           "reachable_states", "sample_document", "sample_documents", "score_document",
           "BOS_ID", "EOS_ID", "PAD_ID", "RARE_WORDS", "VOCAB", "WORD_ID"]
