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
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
MAX_SENTENCES = 6
P_END = 0.25  # chance that a document ends after any sentence but the first

SEASONS = ("spring", "summer", "autumn", "winter")

# ---- weather: "<noun> <verb> ." -------------------------------------------------------
WEATHER = {  # season -> P(weather noun)
    "spring": {"sun": 0.3, "rain": 0.4, "wind": 0.2, "fog": 0.1},
    "summer": {"sun": 0.7, "rain": 0.15, "wind": 0.15},
    "autumn": {"rain": 0.35, "wind": 0.35, "fog": 0.2, "sun": 0.1},
    "winter": {"snow": 0.4, "frost": 0.3, "wind": 0.2, "fog": 0.1},
}
WEATHER_VERBS = {
    "sun": {"shines": 0.7, "warms": 0.3},
    "rain": {"falls": 0.6, "stops": 0.4},
    "wind": {"blows": 0.6, "howls": 0.4},
    "fog": {"lifts": 0.5, "lingers": 0.5},
    "snow": {"falls": 0.5, "melts": 0.5},
    "frost": {"bites": 0.6, "melts": 0.4},
}

# ---- animals: "a <animal> <verb> <prep> the <place> ." --------------------------------
ANIMALS = {  # base frequency; rare ones appear in well under 1% of documents
    "bird": 0.2, "cat": 0.15, "rabbit": 0.15, "frog": 0.12, "mouse": 0.12, "snail": 0.1,
    "bee": 0.08, "butterfly": 0.073, "hedgehog": 0.003, "heron": 0.002, "badger": 0.002,
}
WINTER_SLEEPERS = {"bee", "butterfly", "frog", "snail", "hedgehog"}
ANIMAL_VERBS = {
    "bird": {"sings": 0.4, "flies": 0.4, "hops": 0.2},
    "cat": {"sleeps": 0.4, "hunts": 0.3, "sits": 0.3},
    "rabbit": {"hops": 0.5, "hides": 0.3, "sleeps": 0.2},
    "frog": {"jumps": 0.4, "swims": 0.4, "sits": 0.2},
    "mouse": {"runs": 0.5, "hides": 0.5},
    "snail": {"crawls": 0.7, "hides": 0.3},
    "bee": {"buzzes": 0.6, "flies": 0.4},
    "butterfly": {"flies": 0.7, "sits": 0.3},
    "hedgehog": {"sleeps": 0.5, "hides": 0.3, "runs": 0.2},
    "heron": {"hunts": 0.6, "flies": 0.4},
    "badger": {"hunts": 0.5, "sleeps": 0.5},
}
VERB_PREPS = {
    "sings": {"on": 0.6, "near": 0.4}, "flies": {"over": 0.8, "near": 0.2},
    "hops": {"on": 0.5, "near": 0.5}, "sleeps": {"under": 0.6, "on": 0.4},
    "hunts": {"near": 0.6, "by": 0.4}, "sits": {"on": 0.7, "by": 0.3},
    "hides": {"under": 0.8, "in": 0.2}, "jumps": {"in": 0.6, "over": 0.4},
    "swims": {"in": 1.0}, "runs": {"along": 0.6, "under": 0.4},
    "crawls": {"on": 0.6, "along": 0.4}, "buzzes": {"near": 0.7, "over": 0.3},
}
PREP_PLACES = {
    "on": {"wall": 0.35, "fence": 0.35, "bench": 0.15, "lawn": 0.15},
    "near": {"pond": 0.3, "shed": 0.25, "hedge": 0.25, "bench": 0.2},
    "under": {"hedge": 0.5, "shed": 0.3, "bench": 0.2},
    "over": {"pond": 0.4, "wall": 0.3, "lawn": 0.3},
    "by": {"pond": 0.6, "fence": 0.4},
    "in": {"pond": 0.7, "hedge": 0.3},
    "along": {"path": 0.6, "fence": 0.4},
}
WATER_ANIMALS = {"frog", "heron"}  # prefer the pond wherever it is possible
ANIMAL_ADJECTIVES = {  # "it is <adj> ." refers back to the previous sentence's animal
    "bird": {"loud": 0.5, "small": 0.5}, "cat": {"lazy": 0.6, "quiet": 0.4},
    "rabbit": {"shy": 0.5, "quick": 0.5}, "frog": {"green": 0.6, "loud": 0.4},
    "mouse": {"small": 0.5, "shy": 0.5}, "snail": {"slow": 0.8, "small": 0.2},
    "bee": {"busy": 0.7, "small": 0.3}, "butterfly": {"pretty": 0.7, "quiet": 0.3},
    "hedgehog": {"shy": 0.6, "slow": 0.4}, "heron": {"tall": 0.7, "quiet": 0.3},
    "badger": {"shy": 0.5, "lazy": 0.5},
}

# ---- plants: "the [<color>] <plant> <verb> [by the <place>] ." ------------------------
PLANTS = {"rose": 0.18, "tulip": 0.14, "daisy": 0.14, "apple": 0.14, "tomato": 0.12,
          "sunflower": 0.1, "bean": 0.1, "mint": 0.077, "orchid": 0.003}
FLOWERS = {"rose", "tulip", "daisy", "sunflower", "orchid"}
PLANT_COLORS = {
    "rose": ("red", "white", "pink"), "tulip": ("red", "yellow", "pink"),
    "daisy": ("white", "yellow"), "apple": ("red", "green"), "tomato": ("red", "green"),
    "sunflower": ("yellow",), "bean": ("green",), "mint": ("green",), "orchid": ("pink", "white"),
}
P_COLOR = 0.4
PLANT_VERBS = {  # season -> (verbs of flowers, verbs of fruit and herbs)
    "spring": ({"grows": 0.5, "blooms": 0.5}, {"grows": 1.0}),
    "summer": ({"blooms": 0.7, "sways": 0.3}, {"grows": 0.5, "ripens": 0.5}),
    "autumn": ({"wilts": 0.6, "sways": 0.4}, {"ripens": 0.7, "wilts": 0.3}),
    "winter": ({"sleeps": 1.0}, {"sleeps": 0.6, "wilts": 0.4}),
}
P_PLANT_PLACE = 0.4
PLANT_PLACES = {"wall": 0.3, "shed": 0.3, "path": 0.2, "pond": 0.2}

# ---- the gardener: "tom <action> the <plant> ." ---------------------------------------
ACTIONS = {
    "spring": {"plants": 0.5, "waters": 0.3, "prunes": 0.2},
    "summer": {"waters": 0.6, "picks": 0.3, "plants": 0.1},
    "autumn": {"picks": 0.6, "prunes": 0.2, "waters": 0.2},
    "winter": {"prunes": 0.8, "waters": 0.2},
}
ACTION_PLANTS = {"picks": {"apple", "tomato", "bean", "mint"}, "prunes": {"rose", "apple"},
                 "plants": set(PLANTS), "waters": set(PLANTS)}

# ---- which sentence comes next ---------------------------------------------------------
KINDS = {  # season -> P(sentence kind); "it" is only possible right after an animal
    "spring": {"animal": 0.35, "plant": 0.3, "weather": 0.15, "gardener": 0.2},
    "summer": {"animal": 0.4, "plant": 0.3, "weather": 0.1, "gardener": 0.2},
    "autumn": {"animal": 0.3, "plant": 0.25, "weather": 0.25, "gardener": 0.2},
    "winter": {"animal": 0.25, "plant": 0.15, "weather": 0.4, "gardener": 0.2},
}
P_IT = 0.35  # after an animal sentence
P_SAME_ANIMAL = 0.5  # a later animal sentence returns to the document's first animal

RARE_WORDS = ("hedgehog", "heron", "badger", "orchid")


def _normalize(d: dict[str, float]) -> dict[str, float]:
    total = sum(d.values())
    return {k: v / total for k, v in d.items() if v > 0}


def _collect_vocab() -> tuple[str, ...]:
    words = [PAD, BOS, EOS, "in", ",", ".", "a", "the", "it", "is", "tom", "by"]
    tables = [SEASONS, *WEATHER.values(), *WEATHER_VERBS.values(), ANIMALS,
              *ANIMAL_VERBS.values(), VERB_PREPS, *VERB_PREPS.values(), *PREP_PLACES.values(),
              *ANIMAL_ADJECTIVES.values(), PLANTS, *PLANT_COLORS.values(),
              *(v for pair in PLANT_VERBS.values() for v in pair), PLANT_PLACES,
              *ACTIONS.values()]
    for table in tables:
        for w in table:
            if w not in words:
                words.append(w)
    return tuple(words)


VOCAB: tuple[str, ...] = _collect_vocab()
WORD_ID: dict[str, int] = {w: i for i, w in enumerate(VOCAB)}
PAD_ID, BOS_ID, EOS_ID = WORD_ID[PAD], WORD_ID[BOS], WORD_ID[EOS]


@dataclass(frozen=True)
class State:
    """Everything the generator remembers about a prefix; the prefix determines it uniquely."""

    at: str = "start"  # position in the document / sentence grammar
    season: str = ""
    n_sent: int = 0  # sentences finished
    first_animal: str = ""  # the document's first animal, which tends to come back
    prev_animal: str = ""  # animal of the previous sentence ("" if it had none)
    # words of the current sentence that a later choice depends on ("" once not needed,
    # which keeps the state space small)
    weather: str = ""
    animal: str = ""
    verb: str = ""
    prep: str = ""
    color: str = ""
    plant: str = ""
    action: str = ""


END = State(at="end")


def _sentence_start(s: State) -> list[tuple[str, float, State]]:
    """First word of the next sentence, or <eos>: the sentence kind and its first word."""
    out: list[tuple[str, float, State]] = []
    p_end = 0.0 if s.n_sent == 0 else 1.0 if s.n_sent >= MAX_SENTENCES else P_END
    if p_end:
        out.append((EOS, p_end, END))
    p_it = P_IT if s.prev_animal else 0.0
    rest = (1.0 - p_end) * (1.0 - p_it)
    if p_it and p_end < 1.0:
        out.append(("it", (1.0 - p_end) * p_it, replace(s, at="it")))
    if rest == 0.0:
        return out
    kinds = KINDS[s.season]
    for w, p in WEATHER[s.season].items():  # a weather sentence starts with its noun
        out.append((w, rest * kinds["weather"] * p, replace(s, at="weather_verb", weather=w)))
    out.append(("a", rest * kinds["animal"], replace(s, at="animal")))
    out.append(("the", rest * kinds["plant"], replace(s, at="plant_color")))
    out.append(("tom", rest * kinds["gardener"], replace(s, at="action")))
    return out


def _end_sentence(s: State, animal: str = "") -> State:
    return State(at="sentence", season=s.season, n_sent=s.n_sent + 1,
                 first_animal=s.first_animal, prev_animal=animal)


def _animal_dist(s: State) -> dict[str, float]:
    base = dict(ANIMALS)
    if s.season == "winter":
        base = {a: p * (0.1 if a in WINTER_SLEEPERS else 1.0) for a, p in base.items()}
    base = _normalize(base)
    if not s.first_animal:
        return base
    mix = {a: (1 - P_SAME_ANIMAL) * p for a, p in base.items()}
    mix[s.first_animal] += P_SAME_ANIMAL
    return mix


def _verb_dist(s: State) -> dict[str, float]:
    verbs = ANIMAL_VERBS[s.animal]
    if s.season == "winter":  # everyone sleeps and hides more in winter
        verbs = {v: p * (3.0 if v in ("sleeps", "hides") else 1.0) for v, p in verbs.items()}
    return _normalize(verbs)


def _place_dist(s: State) -> dict[str, float]:
    places = PREP_PLACES[s.prep]
    if s.animal in WATER_ANIMALS and "pond" in places:
        places = {w: p * (4.0 if w == "pond" else 1.0) for w, p in places.items()}
    return _normalize(places)


def _plant_dist(s: State, allowed) -> dict[str, float]:
    flower_weight = 0.3 if s.season == "winter" else 1.0  # few flowers in winter
    d = {p: w * (flower_weight if p in FLOWERS else 1.0) for p, w in PLANTS.items() if p in allowed}
    return _normalize(d)


def _plant_verbs(s: State, plant: str) -> dict[str, float]:
    flower_verbs, crop_verbs = PLANT_VERBS[s.season]
    return flower_verbs if plant in FLOWERS else crop_verbs


def _plant_color_start(s: State) -> list[tuple[str, float, State]]:
    """After "the": a color (then a plant of that color) or the plant itself."""
    plants = _plant_dist(s, PLANTS)
    colors: dict[str, float] = {}
    for plant, p in plants.items():
        for c in PLANT_COLORS[plant]:
            colors[c] = colors.get(c, 0.0) + P_COLOR * p / len(PLANT_COLORS[plant])
    out = [(c, p, replace(s, at="plant_after_color", color=c)) for c, p in colors.items()]
    out += [(pl, (1 - P_COLOR) * p, replace(s, at="plant_verb", plant=pl))
            for pl, p in plants.items()]
    return out


@functools.lru_cache(maxsize=None)
def next_words(s: State) -> tuple[tuple[str, float, State], ...]:
    """The true next-word distribution after any prefix that leads to `s`.

    Returns (word, probability, next state) triples; the words are distinct, so the next
    state is a function of the prefix. Probabilities sum to 1 (tested for every state).
    """
    at = s.at
    if at == "start":
        out = [("in", 1.0, replace(s, at="season"))]
    elif at == "season":
        out = [(w, 1 / len(SEASONS), replace(s, at="comma", season=w)) for w in SEASONS]
    elif at == "comma":
        out = [(",", 1.0, replace(s, at="sentence"))]
    elif at == "sentence":
        out = _sentence_start(s)
    elif at == "weather_verb":
        out = [(v, p, replace(s, at="dot", weather="")) for v, p in WEATHER_VERBS[s.weather].items()]
    elif at == "dot":
        out = [(".", 1.0, _end_sentence(s, s.animal))]
    elif at == "animal":
        out = [(a, p, replace(s, at="animal_verb", animal=a,
                              first_animal=s.first_animal or a))
               for a, p in _animal_dist(s).items()]
    elif at == "animal_verb":
        out = [(v, p, replace(s, at="prep", verb=v)) for v, p in _verb_dist(s).items()]
    elif at == "prep":
        out = [(w, p, replace(s, at="prep_the", prep=w)) for w, p in VERB_PREPS[s.verb].items()]
    elif at == "prep_the":
        out = [("the", 1.0, replace(s, at="place"))]
    elif at == "place":
        out = [(w, p, replace(s, at="dot", verb="", prep=""))
               for w, p in _place_dist(s).items()]
    elif at == "it":
        out = [("is", 1.0, replace(s, at="adjective"))]
    elif at == "adjective":
        out = [(w, p, replace(s, at="dot", animal=""))
               for w, p in ANIMAL_ADJECTIVES[s.prev_animal].items()]
    elif at == "plant_color":
        out = _plant_color_start(s)
    elif at == "plant_after_color":
        plants = _plant_dist(s, [p for p in PLANTS if s.color in PLANT_COLORS[p]])
        weights = {p: w / len(PLANT_COLORS[p]) for p, w in plants.items()}
        out = [(p, w, replace(s, at="plant_verb", plant=p, color=""))
               for p, w in _normalize(weights).items()]
    elif at == "plant_verb":
        out = [(v, p, replace(s, at="plant_end", plant=""))
               for v, p in _plant_verbs(s, s.plant).items()]
    elif at == "plant_end":
        out = [(".", 1 - P_PLANT_PLACE, _end_sentence(s)),
               ("by", P_PLANT_PLACE, replace(s, at="plant_the"))]
    elif at == "plant_the":
        out = [("the", 1.0, replace(s, at="plant_place"))]
    elif at == "plant_place":
        out = [(w, p, replace(s, at="dot")) for w, p in PLANT_PLACES.items()]
    elif at == "action":
        out = [(w, p, replace(s, at="action_the", action=w)) for w, p in ACTIONS[s.season].items()]
    elif at == "action_the":
        out = [("the", 1.0, replace(s, at="action_plant"))]
    elif at == "action_plant":
        out = [(w, p, replace(s, at="dot", action=""))
               for w, p in _plant_dist(s, ACTION_PLANTS[s.action]).items()]
    else:
        raise ValueError(f"unknown generator state {s.at!r}")
    return tuple(out)


def entropy(s: State) -> float:
    """Entropy in nats of the true next-word distribution in state `s`."""
    return -sum(p * math.log(p) for _, p, _ in next_words(s))


# ---------------------------------------------------------------------------------------
# Sampling and scoring documents
# ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _sampler(s: State) -> tuple[np.ndarray, tuple[int, ...], tuple[State, ...]]:
    options = next_words(s)
    cum = np.cumsum([p for _, p, _ in options])
    cum[-1] = 1.0
    return cum, tuple(WORD_ID[w] for w, _, _ in options), tuple(n for _, _, n in options)


def sample_document(rng: np.random.Generator) -> np.ndarray:
    """One document as token ids: <bos> ... <eos>."""
    ids, s = [BOS_ID], State()
    while s is not END:
        cum, words, nexts = _sampler(s)
        k = int(np.searchsorted(cum, rng.random(), side="right"))
        k = min(k, len(words) - 1)
        ids.append(words[k])
        s = nexts[k]
    return np.asarray(ids, dtype=np.int32)


def score_document(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-target-token (true NLL, true entropy) in nats for a document <bos> ... <eos>."""
    nll, ent, s = [], [], State()
    for tok in ids[1:]:
        word = VOCAB[int(tok)]
        for w, p, nxt in next_words(s):
            if w == word:
                break
        else:
            raise ValueError(f"word {word!r} is impossible after this prefix")
        nll.append(-math.log(p))
        ent.append(entropy(s))
        s = nxt
    return np.asarray(nll), np.asarray(ent)


def reachable_states() -> list[State]:
    """Every state the generator can reach from the start (a finite set)."""
    seen, stack = {State()}, [State()]
    while stack:
        for _, _, nxt in next_words(stack.pop()):
            if nxt is not END and nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return list(seen)


def population_entropy_floor() -> float:
    """The language's exact entropy rate, E[sum of per-token entropies] / E[tokens per doc].

    The state graph is acyclic (every word moves forward in the document), so both
    expectations follow from one recursion over it.
    """
    @functools.lru_cache(maxsize=None)
    def expect(s: State) -> tuple[float, float]:
        if s is END or s == END:
            return 0.0, 0.0
        h, n = entropy(s), 1.0
        for _, p, nxt in next_words(s):
            dh, dn = expect(nxt)
            h, n = h + p * dh, n + p * dn
        return h, n

    h, n = expect(State())
    return h / n


# ---------------------------------------------------------------------------------------
# Corpus and batches
# ---------------------------------------------------------------------------------------

class Batch(NamedTuple):
    """A padded batch: predict targets[b, t] from tokens[b, :t+1] where mask[b, t] is 1."""

    tokens: np.ndarray  # int32 [B, T]
    targets: np.ndarray  # int32 [B, T]
    mask: np.ndarray  # float32 [B, T], 0 on padding
    n_tokens: int  # number of target tokens (sum of mask)


@dataclass(frozen=True)
class Corpus:
    """Training and validation documents drawn from the garden language."""

    train: tuple[np.ndarray, ...]
    val: tuple[np.ndarray, ...]
    seq_len: int
    seed: int

    @functools.cached_property
    def entropy_floor(self) -> float:
        """Exact cross-entropy floor of the validation set, nats per target token."""
        ent = np.concatenate([score_document(d)[1] for d in self.val])
        return float(ent.mean())

    def val_batches(self, batch_size: int) -> list[Batch]:
        return [make_batch(self.val[i:i + batch_size], self.seq_len)
                for i in range(0, len(self.val), batch_size)]

    def train_batches(self, batch_size: int, seed: int | None = None):
        """Endless batches of `batch_size` documents, reshuffled every pass (seeded)."""
        rng = np.random.default_rng([self.seed if seed is None else seed, 1])
        n = len(self.train) // batch_size * batch_size
        while True:
            order = rng.permutation(len(self.train))[:n]
            for i in range(0, n, batch_size):
                yield make_batch([self.train[j] for j in order[i:i + batch_size]], self.seq_len)


def make_batch(docs, seq_len: int) -> Batch:
    """Pad documents to seq_len + 1 tokens and shift: inputs, next-token targets, loss mask."""
    b = len(docs)
    full = np.full((b, seq_len + 1), PAD_ID, dtype=np.int32)
    for i, d in enumerate(docs):
        if len(d) > seq_len + 1:
            raise ValueError(f"document of {len(d)} tokens does not fit seq_len={seq_len}")
        full[i, :len(d)] = d
    targets = full[:, 1:]
    mask = (targets != PAD_ID).astype(np.float32)
    return Batch(full[:, :-1], targets, mask, int(mask.sum()))


def max_document_tokens() -> int:
    """Longest possible document, <bos> and <eos> included (longest path in the state graph)."""
    @functools.lru_cache(maxsize=None)
    def longest(s: State) -> int:
        if s == END:
            return 0
        return 1 + max(longest(n) for _, _, n in next_words(s))

    return 1 + longest(State())


@functools.lru_cache(maxsize=8)
def make_corpus(seed: int = 0, n_train: int = 8192, n_val: int = 512,
                seq_len: int = 64) -> Corpus:
    """Draw a corpus; the same seed always gives the same documents.

    Train and validation come from independent streams of the seed, so changing n_train
    leaves the validation set (and its floor) unchanged.
    """
    train_rng, val_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    train = tuple(sample_document(train_rng) for _ in range(n_train))
    val = tuple(sample_document(val_rng) for _ in range(n_val))
    longest = max(len(d) for d in train + val)
    if longest > seq_len + 1:
        raise ValueError(f"seq_len={seq_len} is too short for a drawn document of {longest} "
                         f"tokens; use seq_len >= {max_document_tokens() - 1}")
    return Corpus(train, val, seq_len, seed)
