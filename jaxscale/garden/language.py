"""The garden language as a finite, deterministic probabilistic automaton.

Every prefix leads to exactly one `State`; `next_words(state)` lists each possible next
word with its probability and the state it leads to. That makes the true next-token
distribution, and so the entropy floor, exact. Sampling and scoring documents walk the
same automaton.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import numpy as np

from jaxscale.garden.words import (ACTION_PLANTS, ACTIONS, ANIMAL_ADJECTIVES, ANIMAL_VERBS,
                                   ANIMALS, EOS, FLOWERS, KINDS, MAX_SENTENCES,
                                   P_COLOR, P_END, P_IT, P_PLANT_PLACE, P_SAME_ANIMAL,
                                   PLANT_COLORS, PLANT_PLACES, PLANT_VERBS, PLANTS,
                                   PREP_PLACES, SEASONS, VERB_PREPS, VOCAB, WATER_ANIMALS,
                                   WEATHER, WEATHER_VERBS, WINTER_SLEEPERS, normalize)


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
    base = normalize(base)
    if not s.first_animal:
        return base
    mix = {a: (1 - P_SAME_ANIMAL) * p for a, p in base.items()}
    mix[s.first_animal] += P_SAME_ANIMAL
    return mix


def _verb_dist(s: State) -> dict[str, float]:
    verbs = ANIMAL_VERBS[s.animal]
    if s.season == "winter":  # everyone sleeps and hides more in winter
        verbs = {v: p * (3.0 if v in ("sleeps", "hides") else 1.0) for v, p in verbs.items()}
    return normalize(verbs)


def _place_dist(s: State) -> dict[str, float]:
    places = PREP_PLACES[s.prep]
    if s.animal in WATER_ANIMALS and "pond" in places:
        places = {w: p * (4.0 if w == "pond" else 1.0) for w, p in places.items()}
    return normalize(places)


def _plant_dist(s: State, allowed) -> dict[str, float]:
    flower_weight = 0.3 if s.season == "winter" else 1.0  # few flowers in winter
    d = {p: w * (flower_weight if p in FLOWERS else 1.0) for p, w in PLANTS.items() if p in allowed}
    return normalize(d)


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
               for p, w in normalize(weights).items()]
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


def max_document_tokens() -> int:
    """Longest possible document, <bos> and <eos> included (longest path in the state graph)."""
    @functools.lru_cache(maxsize=None)
    def longest(s: State) -> int:
        if s == END:
            return 0
        return 1 + max(longest(n) for _, _, n in next_words(s))

    return 1 + longest(State())
