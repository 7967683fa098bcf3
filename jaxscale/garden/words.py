"""The garden world's words and the probabilities that tie them together.

Each table is one choice the generator makes, conditioned on what came before: the
season picks the weather, an animal its verbs, a verb its prepositions, and so on.
`jaxscale.garden.language` turns these tables into an automaton.
"""
from __future__ import annotations

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


def normalize(d: dict[str, float]) -> dict[str, float]:
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
