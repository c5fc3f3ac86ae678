"""RULER-style long-context task suite: token-exact prompts over procedural prose, scoring, and
perplexity by position.

Everything is offline and deterministic. The haystack is English prose generated here from our own
sentence templates and word lists by a seeded :class:`random.Random`; it contains no digits (digits
belong to the answers) and none of the words the needles and questions use (:data:`RESERVED_WORDS`,
the key words, the coded words). The only outside object is the Hugging Face tokenizer passed in:
pieces are encoded with ``tokenizer(texts, add_special_tokens=False)["input_ids"]``.

Prompts are token-exact: every :class:`Sample` holds exactly ``n_tokens`` ids. The intro, each
inserted piece, every haystack sentence and the question are tokenised separately and the id lists
concatenated; the haystack is filled with whole sentences to the exact remaining length (the last one
is cut only when no combination of spare sentences fits, which needs a haystack of a few tokens).
Haystack sentences are units ``" Sentence."`` inside a paragraph and ``"\\n\\nSentence."`` at a
paragraph start (3 to 7 sentences a paragraph). Plain completion text, no chat template.

Layouts (``H`` = haystack tokens, ``n_tokens`` minus everything else; ``depth`` 0 = start, 1 = end)::

    single_needle      INTRO  hay[:d]  "\\n\\nThe special magic number for KEY is: NNNNNNN."  hay[d:]
                       "\\n\\nWhat is the special magic number for KEY? The special magic number for KEY is:"
    multi_key          INTRO  hay with 4 needles (4 keys, 4 numbers, uniform random depths)
                       same question for one of the 4 keys
    multi_value        INTRO  hay with 4 needles for one KEY, needle j at depth (j + u) / 4,
                       u ~ U[0.1, 0.9] (one per quarter)
                       "\\n\\nWhat are all the four special magic numbers for KEY? The four special magic
                       numbers for KEY are:"
    variable_tracking  INTRO  hay with VT_CHAINS * 5 statements "\\n\\nVAR ABCDE = 12345." /
                       "\\n\\nVAR FGHIJ = VAR ABCDE.": VT_CHAINS (1, as RULER's default) chains of 4 hops
                       (5 names each, values differ; the first chain is asked), randomly interleaved with
                       each chain's order kept, statement k of m at depth (k + u) / m
                       "\\n\\nFind all variables that are assigned the value 12345 in the text above. Answer:
                       According to the chain(s) of variable assignment in the text above, 5 variables are
                       assigned the value 12345, they are: VAR"  (ends with "VAR": the answer starts at a name)
    frequent_words     INTRO  hay with sentences " Coded words: w1 w2." of 1 to 3 coded words at random
                       sentence boundaries
                       "\\n\\nWhat are the three most frequently appearing coded words in the text above?
                       Answer: The three most frequently appearing coded words are:"

Needles and statements are paragraphs of their own, placed at the paragraph boundary of the haystack
(unit start, or its very end) nearest to ``depth * H`` tokens; pieces that land on one boundary keep
their order. ``single_needle`` sample ``index`` of ``samples`` has ``depth = index / (samples - 1)``
(``0.5`` when ``samples == 1``), recorded in :attr:`Sample.depth`. KEY is a hyphenated pair of words
from our key lists (``"jubilant-walrus"``), NNNNNNN a 7-digit number, VAR names 5 random uppercase
letters, coded words 3 random consonant-vowel syllables (``"kemavu"``) absent from the haystack.

``frequent_words`` counts: ``total = max(10, round(n_tokens / TOKENS_PER_CODED_WORD))`` occurrences
over :data:`CODED_WORDS` words with Zipf weights ``1 / r`` for ranks ``r = 1, 2, 3`` and
``TAIL_FACTOR / r`` for ranks 4 to 10, rounded (each at least once); every top-three count is at
least :data:`TOP_GAP` times every other count. The density of coded words is constant in ``n_tokens``.

Scoring (:func:`score`): correct when every string of :attr:`Sample.answers` occurs in the generated
text as a whole word: not preceded or followed by a letter or digit, case-insensitive (so
``1234567`` does not match inside ``12345678`` and ``ABCDE`` not inside ``ABCDEF``). ``single_needle``
and ``multi_key``: the asked number; ``multi_value``: all 4 numbers; ``variable_tracking``: all 5
names of the asked chain; ``frequent_words``: the 3 most frequent coded words. Partial credit
(:func:`score_fraction`): the fraction of those strings found, as RULER reports its multi-answer tasks.

Perplexity (:data:`PERPLEXITY_TASK`): :func:`perplexity_ids` gives ``n_tokens`` haystack ids only
(first paragraph without the leading blank line); :func:`position_buckets` averages the per-token
loss into equal position buckets.
"""

from __future__ import annotations

import bisect
import hashlib
import random
import re
from dataclasses import dataclass
from functools import cache

import torch

from minference._checks import check_int

__all__ = [
    "TASKS",
    "PERPLEXITY_TASK",
    "NEEDLE_DIGITS",
    "MULTI_NEEDLES",
    "VT_HOPS",
    "VT_CHAINS",
    "VT_NAME_LETTERS",
    "VT_VALUE_DIGITS",
    "CODED_WORDS",
    "TOP_CODED_WORDS",
    "TOKENS_PER_CODED_WORD",
    "TAIL_FACTOR",
    "TOP_GAP",
    "MIN_HAYSTACK_TOKENS",
    "ANSWER_SLACK_TOKENS",
    "RESERVED_WORDS",
    "Sample",
    "make_sample",
    "score",
    "score_fraction",
    "perplexity_ids",
    "position_buckets",
]

TASKS: tuple[str, ...] = ("single_needle", "multi_key", "multi_value", "variable_tracking", "frequent_words")
PERPLEXITY_TASK = "perplexity"

#: Digits of a needle's magic number.
NEEDLE_DIGITS = 7
#: Needles of ``multi_key`` (keys) and of ``multi_value`` (numbers of the one key).
MULTI_NEEDLES = 4
#: Hops of a ``variable_tracking`` chain (``VT_HOPS + 1`` names).
VT_HOPS = 4
#: Chains of ``variable_tracking``; the first is asked, the others are distractors with their own value.
VT_CHAINS = 1
#: Letters of a ``variable_tracking`` name.
VT_NAME_LETTERS = 5
#: Digits of a ``variable_tracking`` value.
VT_VALUE_DIGITS = 5
#: Distinct coded words of ``frequent_words``.
CODED_WORDS = 10
#: Coded words asked for; the question text spells it ("three").
TOP_CODED_WORDS = 3
#: Prompt tokens per coded-word occurrence (the density; each occurrence is 2 to 4 tokens).
TOKENS_PER_CODED_WORD = 40
#: Zipf weight multiplier of the coded words below the top three.
TAIL_FACTOR = 0.5
#: Every top-three count is at least this many times every other count.
TOP_GAP = 2
#: Smallest haystack a prompt may have.
MIN_HAYSTACK_TOKENS = 32
#: Greedy tokens allowed beyond the tokenised answer text.
ANSWER_SLACK_TOKENS = 8
#: Words of the needles and questions that the haystack never uses.
RESERVED_WORDS = frozenset(
    {"special", "magic", "number", "numbers", "var", "variable", "variables", "value", "assigned", "coded",
     "word", "words"}
)

_PARAGRAPH_SENTENCES = (3, 7)
#: Spread of a stratified depth inside its stratum (multi_value, variable_tracking).
_STRATUM_JITTER = (0.1, 0.9)
_MAX_CODED_GROUP = 3
#: One group of coded words, a sentence of its own.
_CODED_GROUP = " Coded words: {words}."
#: Counts the questions spell out.
_COUNT_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
_TOKENS_PER_SENTENCE_GUESS = 18
_FILL_POOL = 48
_FILL_POPS = 3

_INTRO_ONE = (
    "A special magic number is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the number afterwards."
)
_INTRO_MANY = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize them. "
    "I will quiz you about the numbers afterwards."
)
_INTRO_VT = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_INTRO_FW = (
    "Read the following text and keep count of the coded words scattered through it. "
    "I will ask which coded words appear most often."
)
_NEEDLE = "\n\nThe special magic number for {key} is: {number}."
_QUESTION_ONE = "\n\nWhat is the special magic number for {key}? The special magic number for {key} is:"
_QUESTION_ALL = (
    "\n\nWhat are all the {count} special magic numbers for {key}? The {count} special magic numbers for {key} are:"
)
_VT_FIRST = "\n\nVAR {name} = {value}."
_VT_HOP = "\n\nVAR {name} = VAR {prev}."
_QUESTION_VT = (
    "\n\nFind all variables that are assigned the value {value} in the text above. Answer: According to the "
    "chain(s) of variable assignment in the text above, {count} variables are assigned the value {value}, "
    "they are: VAR"
)
_QUESTION_FW = (
    "\n\nWhat are the three most frequently appearing coded words in the text above? Answer: The three most "
    "frequently appearing coded words are:"
)

# ---------------------------------------------------------------------------------------------
# Haystack vocabulary: our own words and templates. No digits, nothing from RESERVED_WORDS.
# ---------------------------------------------------------------------------------------------

_SLOTS: dict[str, tuple[str, ...]] = {
    "name": (
        "Ada", "Bram", "Celia", "Dario", "Elin", "Farah", "Gideon", "Hana", "Ivo", "Jorun", "Kasimir", "Lena",
        "Matteo", "Nadia", "Oskar", "Petra", "Quentin", "Rosalind", "Sami", "Talia", "Ulric", "Vera", "Wendell",
        "Xenia", "Yusuf", "Zora", "Amara", "Benedikt", "Clio", "Desmond", "Esme", "Florian", "Greta", "Hamid",
        "Ilse", "Jonas", "Keiko", "Leopold", "Mira", "Niall", "Odile", "Pavel", "Rhea", "Silas", "Tamsin", "Ugo",
        "Vivian", "Yara", "Zeno", "Anouk", "Basil", "Corin", "Delphine", "Emrys", "Freya", "Gustav", "Hester",
        "Imre", "Juno", "Kofi", "Linnea", "Magnus", "Noor", "Orla", "Piet", "Rafael", "Saskia", "Tobias",
        "Ursula", "Viggo", "Willa", "Aurelio", "Beatrix", "Cosmo", "Dagny", "Edmund", "Fenna", "Gwen", "Halvard",
        "Ingrid", "Lucian", "Marisol", "Nikolai", "Philippa", "Soren", "Theodora",
    ),
    "adj": (
        "quiet", "narrow", "crooked", "golden", "weathered", "patient", "steep", "hollow", "bright", "dusty",
        "gentle", "sturdy", "faded", "polished", "ancient", "humble", "restless", "tidy", "rough", "silver",
        "tall", "careful", "slender", "wide", "heavy", "soft", "distant", "cheerful", "solemn", "brittle",
        "warm", "chilly", "damp", "fragrant", "shallow", "crowded", "empty", "modest", "curious", "stubborn",
        "clever", "weary", "lively", "stern", "generous", "shy", "proud", "tiny", "enormous", "wooden",
        "painted", "mossy", "sunlit", "shadowy", "windy", "muddy", "frosty", "glossy", "rusty", "simple",
        "elegant", "plain", "busy", "sleepy", "lonely", "friendly", "graceful", "clumsy", "sharp", "blunt",
        "smooth", "grand", "little", "old", "young", "fresh", "ripe", "pale", "dark", "tangled", "ornate",
        "sagging", "lopsided", "spotless", "drafty", "cozy",
    ),
    "noun": (
        "lantern", "basket", "bridge", "kettle", "ladder", "window", "garden", "wagon", "barrel", "blanket",
        "candle", "chimney", "compass", "cottage", "cupboard", "doorway", "fence", "fountain", "hammer",
        "harness", "jar", "kite", "lamp", "loom", "map", "oar", "parcel", "pathway", "pebble", "pillow",
        "pitcher", "quilt", "rope", "saddle", "sail", "scarf", "shovel", "spoon", "staircase", "statue", "stool",
        "stove", "tablecloth", "teapot", "tent", "thimble", "tower", "trunk", "umbrella", "violin",
        "wheelbarrow", "whistle", "workbench", "anchor", "apron", "bell", "bench", "boat", "bottle", "bucket",
        "cart", "chair", "clock", "coat", "drum", "envelope", "feather", "flag", "gate", "glove", "hat",
        "helmet", "jacket", "ledger", "mast", "notebook", "oven", "paddle", "pail", "pan", "piano", "plank",
        "pot", "rake", "ribbon", "roof", "rug", "sack", "scythe", "shelf", "shutter", "sieve", "sled", "spindle",
        "spade", "table", "tile", "tray", "trowel", "vase", "wardrobe", "wheel", "windmill", "wreath", "easel",
        "awning", "banner", "satchel", "bowl", "brush", "chisel", "canoe", "carriage", "cradle", "crate",
        "lute", "mallet", "mantel", "net", "barn", "birdhouse", "weathervane", "hourglass", "footbridge",
    ),
    "place": (
        "the harbor", "the old mill", "the market square", "the northern ridge", "the river bend",
        "the village green", "the lighthouse", "the lower field", "the stone bridge", "the bakery on the corner",
        "the ferry landing", "the chapel yard", "the salt marsh", "the upper pasture", "the library steps",
        "the boathouse", "the quarry", "the apple orchard", "the weaver's cottage", "the train platform",
        "the fish market", "the hillside vineyard", "the cedar grove", "the town hall",
        "the inn by the crossroads", "the dry creek", "the pottery shed", "the old observatory",
        "the canal lock", "the birch woods", "the mountain pass", "the schoolhouse", "the glassworks",
        "the east gate", "the tannery", "the sheep fold", "the sawmill", "the walled garden", "the duck pond",
        "the reed beds", "the customs house", "the copper mine", "the hay loft", "the tide pools",
        "the pine forest", "the ruined abbey", "the narrow lane", "the blacksmith's forge", "the bell tower",
        "the covered bridge", "the sand dunes", "the olive terraces", "the courthouse", "the spice stall",
        "the rope walk", "the orchard wall", "the shipyard", "the waterfall", "the marble quarry",
        "the west meadow",
    ),
    "time": (
        "at dawn", "before noon", "late in the evening", "after the harvest", "on a quiet morning",
        "just before sunset", "in the middle of the night", "during the festival", "after supper",
        "early on market day", "while the bells rang", "on the first warm day", "long after dark",
        "at the turn of the tide", "before the frost came", "in the grey hour before sunrise",
        "on a slow afternoon", "after the long rains", "at the end of the week", "before the guests arrived",
        "in the heat of midday", "when the lamps were lit", "as the fog lifted", "on the eve of the fair",
        "soon after breakfast", "in the last light of day", "when the geese flew south", "during the first snow",
        "while the bread was baking", "once the shops had closed",
    ),
    "weather": (
        "a thin fog", "a steady rain", "a dry wind", "a soft drizzle", "a warm breeze", "a heavy mist",
        "a bitter frost", "a sudden squall", "a pale sunshine", "a low haze", "a sharp cold", "a gentle snowfall",
        "a humid stillness", "a blustery gale", "a fine sleet", "a hot calm", "a cool shower",
        "a rolling thunder", "a bright glare", "a clear chill", "a salty sea wind", "a sullen overcast",
        "a drifting cloud bank", "a brief hailstorm", "a mild thaw",
    ),
    "craft": (
        "weaving", "pottery", "glassblowing", "bookbinding", "carpentry", "basketry", "embroidery", "leatherwork",
        "woodcarving", "candle making", "clockmaking", "lacemaking", "quilting", "stonemasonry", "blacksmithing",
        "knitting", "printmaking", "calligraphy", "beekeeping", "boatbuilding", "cabinetmaking", "barrel making",
        "dyeing", "enameling", "felting", "gilding", "jewelry making", "joinery", "engraving", "mosaic work",
        "papermaking", "rope making", "saddlery", "tailoring", "thatching", "tile painting", "upholstery",
        "violin making", "wood turning", "spinning",
    ),
    "verb": (
        "carried", "repaired", "painted", "polished", "mended", "carved", "folded", "wrapped", "lifted",
        "cleaned", "measured", "sketched", "sold", "bought", "borrowed", "lent", "found", "dropped", "traded",
        "sharpened", "tightened", "loosened", "stitched", "sanded", "varnished", "oiled", "dusted", "fetched",
        "delivered", "inspected", "admired", "studied", "praised", "rebuilt", "restored", "moved", "stacked",
        "balanced", "weighed", "hung", "returned", "packed", "unpacked", "cooled", "warmed", "brushed",
        "scrubbed", "dried", "gathered", "tied", "untied", "opened", "closed", "locked", "pushed", "pulled",
        "dragged", "raised", "lowered", "decorated",
    ),
    "animal": (
        "heron", "fox", "goat", "sparrow", "badger", "otter", "donkey", "crow", "hare", "owl", "mule", "swan",
        "lamb", "pony", "weasel", "magpie", "hedgehog", "beetle", "moth", "trout", "rooster", "goose", "duck",
        "cat", "dog", "mare", "stag", "robin", "finch", "gull", "cormorant", "toad", "frog", "lizard",
        "squirrel", "ferret", "falcon", "starling", "pigeon", "eel",
    ),
    "color": (
        "red", "blue", "green", "ochre", "crimson", "indigo", "grey", "white", "black", "saffron", "teal",
        "violet", "rust", "olive", "ivory", "scarlet", "cobalt", "umber", "plum", "slate", "sand", "sage",
        "cream", "lavender", "russet",
    ),
    "material": (
        "oak", "copper", "linen", "clay", "wool", "brass", "pine", "walnut", "leather", "cotton", "iron", "tin",
        "silk", "marble", "willow", "birch", "cedar", "bronze", "glass", "felt", "canvas", "cork", "horn", "bone",
        "bamboo", "hemp", "pewter", "ash", "maple", "elm",
    ),
    "food": (
        "bread", "plum jam", "barley soup", "roasted chestnuts", "pear tart", "onion stew", "honey cake",
        "goat cheese", "smoked fish", "apple cider", "lentil broth", "rye crackers", "mint tea", "rice pudding",
        "herb dumplings", "salted butter", "fig bread", "cabbage pie", "mushroom soup", "oat porridge",
        "walnut bread", "spiced wine", "cherry preserves", "potato pancakes", "grilled sardines",
        "lemon biscuits", "pumpkin soup", "bean stew", "blackberry pie", "buttered leeks",
    ),
    "feeling": (
        "patience", "relief", "curiosity", "pride", "wonder", "gratitude", "caution", "delight", "longing",
        "calm", "resolve", "amusement", "doubt", "hope", "affection", "surprise", "contentment", "fatigue",
        "nostalgia", "impatience", "determination", "embarrassment", "joy", "sorrow", "confidence",
    ),
    "season": (
        "early spring", "late spring", "high summer", "late summer", "early autumn", "late autumn",
        "deep winter", "the first days of spring", "the dry season", "the wet season", "the harvest season",
        "midwinter",
    ),
    "sound": (
        "the creak of a door", "a distant bell", "the clatter of hooves", "the hiss of a kettle",
        "laughter from the street", "the slap of waves", "a dog barking far away", "the rustle of leaves",
        "the hum of bees", "the knock of a hammer", "the cry of gulls", "the rattle of a cart",
        "the patter of rain on the roof", "a fiddle tune from an open window", "the murmur of the river",
        "the crackle of a fire", "the chime of a clock", "footsteps on the gravel", "the groan of old timber",
        "a song from the fields",
    ),
    "adverb": (
        "slowly", "carefully", "quietly", "cheerfully", "patiently", "briskly", "gently", "firmly", "eagerly",
        "absently", "thoughtfully", "proudly", "hastily", "steadily", "neatly", "warily", "happily", "sadly",
        "boldly", "softly", "lazily", "nervously", "calmly", "politely", "stubbornly", "gracefully",
        "clumsily", "silently", "tenderly", "wearily",
    ),
    "motion": (
        "wandered", "hurried", "strolled", "climbed", "rowed", "walked", "drifted", "marched", "limped",
        "crept", "paced", "rambled", "trudged", "sailed", "cycled", "skated", "hiked", "waded", "roamed",
        "dashed", "ambled", "travelled", "meandered", "scrambled", "tramped",
    ),
    "role": (
        "the baker", "the ferryman", "an old fisherman", "the schoolteacher", "a traveling tinker",
        "the miller's daughter", "the innkeeper", "a young shepherd", "the harbor master", "the village doctor",
        "a retired sailor", "the librarian", "the gardener", "a wandering musician", "the mayor",
        "a potter from the hills", "the blacksmith", "the carpenter's apprentice", "a widow from the next valley",
        "the postmaster", "the clockmaker", "a cheesemaker", "the night watchman", "the beekeeper", "a mapmaker",
    ),
}

# Slots: {kind}, {kind_b} (a second, different draw of the kind), {a_kind} (with "a"/"an").
_TEMPLATES = (
    "{name} {verb} the {adj} {noun} near {place} {time}.",
    "{time}, {weather} settled over {place}, and {name} went back to {craft}.",
    "{role} said that the {noun} by {place} had always been {adj}.",
    "Nobody at {place} could recall a year as {adj} as the one when {name} took up {craft}.",
    "In {season}, {name} and {name_b} {motion} to {place} in search of {a_adj} {noun}.",
    "The {color} {noun} that {name} kept in the kitchen was made of {material}.",
    "{sound} drifted across {place} while {name} {adverb} {verb} {a_material} {noun}.",
    "According to {role}, {food} tastes best {time}.",
    "{name} watched {a_animal} with {feeling} until it vanished behind the {noun}.",
    "There was {a_adj} {animal} asleep under the {noun} at {place}.",
    "{name} once traded {a_adj} {noun} for a jar of {food}.",
    "The road from {place} to {place_b} was {adj} and lined with {material} posts.",
    "{role} taught {name} the basics of {craft} {time}.",
    "When {weather} rolled in, {name} {verb} the {noun} and hurried home.",
    "It was {feeling}, more than anything else, that kept {name} at {craft} for so many seasons.",
    "{name} liked to sit near {place} and listen to {sound}.",
    "Some said the {adj} {noun} at {place} had once belonged to {role}.",
    "By the time {name} reached {place}, {weather} had turned the sky {color}.",
    "{name_b} thought the {noun} looked {adj}, but {name} found it {adj_b} in the {color} light of evening.",
    "{name} {motion} {adverb} past {place}, carrying {a_adj} {noun} under one arm.",
    "{a_animal} had made its home in the {noun} behind {place}.",
    "Over {food} and {food_b}, {name} and {name_b} argued about {craft}.",
    "{role} {verb} the {noun} with {feeling} and set it down beside the {noun_b}.",
    "{time}, {place} smelled of {food} and wood smoke.",
    "{name} kept a small notebook of everything {role} had explained about {craft}.",
    "Even in {season}, the {noun} at {place} stayed {adj}.",
    "{name} {adverb} asked {role} whether the {noun} could be {verb} {time}.",
    "From {place}, {name} saw {a_animal} chase {a_animal_b} across {place_b}.",
    "The {craft} fair at {place} drew {role}, {role_b} and half the valley.",
    "Long ago, {place} was known for its {craft} and for {a_adj} {animal} that nested by the {noun}.",
    "{name} {verb} the {noun}, then {verb_b} the {noun_b}, and finally rested by {place}.",
    "{sound} woke {name} {time}, and the {adj} {noun} was still where it had been left.",
    "An old saying at {place} holds that {feeling} is worth more than {food}.",
    "{name} and {role} shared {food} on the steps of {place} while {weather} passed overhead.",
    "The {material} {noun} in the corner of {place} was the pride of {name}'s family.",
    "If {name} had not {verb} the {noun} {time}, the whole day at {place} would have gone differently.",
)

_SLOT = re.compile(r"\{(a_)?([a-z]+?)(_b)?\}")


def _parse(template: str) -> tuple[str | tuple[str, bool], ...]:
    """Template -> literal strings and ``(kind, article)`` slots."""
    parts: list[str | tuple[str, bool]] = []
    last = 0
    for m in _SLOT.finditer(template):
        parts.append(template[last : m.start()])
        parts.append((m.group(2), m.group(1) is not None))
        last = m.end()
    parts.append(template[last:])
    return tuple(p for p in parts if p != "")


_PARSED = tuple(_parse(t) for t in _TEMPLATES)

# Needle keys: "adjective-noun" from lists disjoint from the haystack vocabulary.
_KEY_ADJECTIVES = (
    "fearless", "jubilant", "vivid", "zealous", "bashful", "frantic", "nimble", "gleeful", "jovial", "witty",
    "mellow", "feisty", "drowsy", "giddy", "grumpy", "icy", "jolly", "lucky", "mighty", "noisy", "plucky",
    "quirky", "rowdy", "snug", "spiky", "thrifty", "upbeat", "zany", "dapper", "fluffy",
)
_KEY_NOUNS = (
    "walrus", "trombone", "pelican", "cactus", "comet", "dragonfly", "giraffe", "harmonica", "iguana",
    "jellyfish", "kangaroo", "lemur", "mango", "narwhal", "octopus", "panda", "quokka", "raccoon", "saxophone",
    "tortoise", "ukulele", "volcano", "waffle", "yak", "zebra", "avocado", "buffalo", "crocodile", "dolphin",
    "flamingo", "gecko", "koala", "llama", "meerkat", "ostrich", "penguin", "rhubarb", "sloth",
)

# Coded words are consonant-vowel syllables; these common English words of that shape are refused.
_CODED_CONSONANTS = "bdfgklmnprstvz"
_CODED_VOWELS = "aeiou"
_CODED_SYLLABLES = 3
_ENGLISH_CVCVCV = frozenset(
    "banana potato tomato salami domino kimono safari savage ravine devote demote revise revive divine denote "
    "relate remote refuse refute repute repose refine define reside resume retire debate delete demise derive "
    "desire devise manure mature minute nature pirate polite sedate senate sonata tenure gazebo bikini kabuki "
    "karate medusa pagoda parade garage latino marina panama lazuli bolero legato rotate gelato bonito misuse "
    "dilute pomade sesame madame regime resale genome morale tirade nebula salute silage gemini tobago".split()
)


@cache
def _vocabulary() -> frozenset[str]:
    """Every lowercase word the haystack can contain."""
    text = " ".join(_TEMPLATES) + " " + " ".join(w for words in _SLOTS.values() for w in words)
    return frozenset(re.findall(r"[a-z]+", _SLOT.sub(" ", text).lower()))


@cache
def _fixed_words() -> frozenset[str]:
    """Every lowercase word of the intros, needles and questions."""
    text = " ".join((_INTRO_ONE, _INTRO_MANY, _INTRO_VT, _INTRO_FW, _NEEDLE, _QUESTION_ONE, _QUESTION_ALL,
                     _VT_FIRST, _VT_HOP, _QUESTION_VT, _QUESTION_FW, _CODED_GROUP))
    return frozenset(re.findall(r"[a-z]+", re.sub(r"\{[a-z]+\}", " ", text).lower()))


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class _Prose:
    """Seeded sentence stream grouped into paragraphs of 3 to 7 sentences."""

    def __init__(self, rng: random.Random, first_prefix: str) -> None:
        self.rng = rng
        self.left = 0  # sentences left in the current paragraph
        self.first_prefix: str | None = first_prefix

    def sentence(self) -> str:
        rng = self.rng
        used: set[str] = set()
        out = []
        for part in rng.choice(_PARSED):
            if isinstance(part, str):
                out.append(part)
                continue
            kind, article = part
            words = _SLOTS[kind]
            word = rng.choice(words)
            while word in used:
                word = rng.choice(words)
            used.add(word)
            out.append(f"{_article(word)} {word}" if article else word)
        s = "".join(out)
        return s[0].upper() + s[1:]

    def units(self, k: int) -> tuple[list[str], list[bool]]:
        """``k`` unit texts and whether each starts a paragraph."""
        texts, starts = [], []
        for _ in range(k):
            start = self.left == 0
            if start:
                self.left = self.rng.randint(*_PARAGRAPH_SENTENCES)
            self.left -= 1
            prefix = "\n\n" if start else " "
            if self.first_prefix is not None:
                prefix, self.first_prefix = self.first_prefix, None
            texts.append(prefix + self.sentence())
            starts.append(start)
        return texts, starts


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _exact_fill(lengths: list[int], r: int) -> list[int] | None:
    """Indices of one or two pool sentences whose lengths sum to ``r``, or None."""
    if r == 0:
        return []
    where: dict[int, int] = {}
    for i, n in enumerate(lengths):
        where.setdefault(n, i)
    if r in where:
        return [where[r]]
    for i, n in enumerate(lengths):
        j = where.get(r - n)
        if j is not None and j != i:
            return [i, j]
    return None


@dataclass
class _Haystack:
    units: list[list[int]]  # token ids of each sentence unit; together exactly the haystack length
    starts: list[bool]  # unit starts a paragraph


def _haystack(tokenizer, rng: random.Random, n_tokens: int, first_prefix: str) -> _Haystack:
    """Whole sentences totalling exactly ``n_tokens`` ids (the last is cut only as a last resort)."""
    prose = _Prose(rng, first_prefix)
    units: list[list[int]] = []
    starts: list[bool] = []
    total = 0
    while total < n_tokens:
        k = (n_tokens - total) // _TOKENS_PER_SENTENCE_GUESS + 4
        texts, flags = prose.units(k)
        for ids, flag in zip(_encode(tokenizer, texts), flags):
            units.append(ids)
            starts.append(flag)
            total += len(ids)
    while total > n_tokens:
        total -= len(units.pop())
        starts.pop()
    r = n_tokens - total
    pool = _encode(tokenizer, [" " + prose.sentence() for _ in range(_FILL_POOL)])
    lengths = [len(p) for p in pool]
    pick = _exact_fill(lengths, r)
    for _ in range(_FILL_POPS):
        if pick is not None or not units:
            break
        r += len(units.pop())
        starts.pop()
        pick = _exact_fill(lengths, r)
    if pick is None:  # greedy whole sentences, then one cut sentence
        pick = []
        for i, n in enumerate(lengths):
            if n <= r - sum(lengths[j] for j in pick):
                pick.append(i)
        rest = r - sum(lengths[j] for j in pick)
        fill = [pool[i] for i in pick]
        while rest > 0:
            cut = _encode(tokenizer, [" " + prose.sentence()])[0][:rest]
            fill.append(cut)
            rest -= len(cut)
    else:
        fill = [pool[i] for i in pick]
    units.extend(fill)
    starts.extend([False] * len(fill))
    return _Haystack(units, starts)


def _rng(seed: int, task: str, n_tokens: int, index: int) -> random.Random:
    """Stable across runs and machines (sha256, not the salted ``hash`` of a str)."""
    digest = hashlib.sha256(f"minference.evals|{seed}|{task}|{n_tokens}|{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


# ---------------------------------------------------------------------------------------------
# Tasks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One prompt of the suite.

    ``ids [n_tokens]`` int64 prompt ids (exactly ``n_tokens``, no special tokens); ``answers``: every
    string must occur in the generated text (:func:`score`); ``max_new_tokens``: the tokenised answer
    text (``" A, B, C."``; ``variable_tracking``: ``" A, VAR B, ..."``, the prompt ending in ``"VAR"``) plus
    :data:`ANSWER_SLACK_TOKENS`; ``depth``: the ``single_needle`` depth, else None.
    """

    task: str
    n_tokens: int
    index: int
    seed: int
    ids: torch.Tensor
    answers: tuple[str, ...]
    max_new_tokens: int
    depth: float | None


@dataclass
class _Spec:
    intro: str
    needles: list[tuple[float, str]]  # (depth, text) paragraph pieces, in text order
    scattered: list[str]  # sentence pieces at random sentence boundaries
    question: str
    answers: tuple[str, ...]
    answer_text: str
    depth: float | None = None


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(10 ** (n - 1), 10**n - 1))


def _distinct(draw, k: int) -> list[str]:
    out: list[str] = []
    while len(out) < k:
        x = draw()
        if x not in out:
            out.append(x)
    return out


def _key(rng: random.Random) -> str:
    return f"{rng.choice(_KEY_ADJECTIVES)}-{rng.choice(_KEY_NOUNS)}"


def _coded_word(rng: random.Random) -> str:
    while True:
        w = "".join(rng.choice(_CODED_CONSONANTS) + rng.choice(_CODED_VOWELS) for _ in range(_CODED_SYLLABLES))
        if w not in _ENGLISH_CVCVCV and w not in _vocabulary() and w not in _fixed_words():
            return w


def _coded_counts(n_tokens: int) -> list[int]:
    """Occurrences of the coded words by rank (first three: the answers)."""
    total = max(CODED_WORDS, round(n_tokens / TOKENS_PER_CODED_WORD))
    weights = [(1.0 if r <= TOP_CODED_WORDS else TAIL_FACTOR) / r for r in range(1, CODED_WORDS + 1)]
    scale = total / sum(weights)
    tail = [max(1, round(scale * w)) for w in weights[TOP_CODED_WORDS:]]
    top = [max(round(scale * w), TOP_GAP * max(tail)) for w in weights[:TOP_CODED_WORDS]]
    return top + tail


def _stratified(rng: random.Random, k: int) -> list[float]:
    return [(j + rng.uniform(*_STRATUM_JITTER)) / k for j in range(k)]


def _spec(task: str, rng: random.Random, n_tokens: int, index: int, samples: int) -> _Spec:
    if task == "single_needle":
        depth = 0.5 if samples == 1 else index / (samples - 1)
        key, number = _key(rng), _digits(rng, NEEDLE_DIGITS)
        return _Spec(_INTRO_ONE, [(depth, _NEEDLE.format(key=key, number=number))], [],
                     _QUESTION_ONE.format(key=key), (number,), f" {number}.", depth)
    if task == "multi_key":
        keys = _distinct(lambda: _key(rng), MULTI_NEEDLES)
        numbers = _distinct(lambda: _digits(rng, NEEDLE_DIGITS), MULTI_NEEDLES)
        needles = sorted(((rng.random(), _NEEDLE.format(key=k, number=v)) for k, v in zip(keys, numbers)),
                         key=lambda x: x[0])
        asked = rng.randrange(MULTI_NEEDLES)
        return _Spec(_INTRO_MANY, needles, [], _QUESTION_ONE.format(key=keys[asked]), (numbers[asked],),
                     f" {numbers[asked]}.")
    if task == "multi_value":
        key = _key(rng)
        numbers = _distinct(lambda: _digits(rng, NEEDLE_DIGITS), MULTI_NEEDLES)
        needles = [(d, _NEEDLE.format(key=key, number=v)) for d, v in zip(_stratified(rng, MULTI_NEEDLES), numbers)]
        question = _QUESTION_ALL.format(key=key, count=_COUNT_WORDS[MULTI_NEEDLES])
        return _Spec(_INTRO_MANY, needles, [], question, tuple(numbers), " " + ", ".join(numbers) + ".")
    if task == "variable_tracking":
        size = VT_HOPS + 1
        letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        names = _distinct(lambda: "".join(rng.choice(letters) for _ in range(VT_NAME_LETTERS)), VT_CHAINS * size)
        values = _distinct(lambda: _digits(rng, VT_VALUE_DIGITS), VT_CHAINS)
        chains = []
        for c in range(VT_CHAINS):
            chain = names[c * size : (c + 1) * size]
            lines = [_VT_FIRST.format(name=chain[0], value=values[c])]
            lines += [_VT_HOP.format(name=chain[h], prev=chain[h - 1]) for h in range(1, size)]
            chains.append(lines)
        order = [c for c in range(VT_CHAINS) for _ in range(size)]
        rng.shuffle(order)
        lines = [chains[c].pop(0) for c in order]  # each chain keeps its order
        needles = list(zip(_stratified(rng, len(lines)), lines))
        asked_names = tuple(names[:size])
        # The question ends with "VAR", so the answer text starts at the first name.
        return _Spec(_INTRO_VT, needles, [], _QUESTION_VT.format(value=values[0], count=size), asked_names,
                     " " + ", VAR ".join(asked_names) + ".")
    # frequent_words
    words = _distinct(lambda: _coded_word(rng), CODED_WORDS)  # by rank
    occurrences = [w for w, c in zip(words, _coded_counts(n_tokens)) for _ in range(c)]
    rng.shuffle(occurrences)
    groups = []
    i = 0
    while i < len(occurrences):
        g = rng.randint(1, _MAX_CODED_GROUP)
        groups.append(_CODED_GROUP.format(words=" ".join(occurrences[i : i + g])))
        i += g
    top = tuple(words[:TOP_CODED_WORDS])
    return _Spec(_INTRO_FW, [], groups, _QUESTION_FW, top, " " + ", ".join(top) + ".")


def _check_task(task: object) -> str:
    if not isinstance(task, str):
        raise TypeError(f"task must be a str, got {type(task).__name__}")
    if task == PERPLEXITY_TASK:
        raise ValueError(f"task {task!r} has no prompts: use perplexity_ids and position_buckets")
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    return task


def _nearest(offsets: list[int], target: float) -> int:
    """Index into sorted ``offsets`` of the one nearest ``target`` (the earlier one on a tie)."""
    i = bisect.bisect_left(offsets, target)
    if i == len(offsets):
        return i - 1
    if i > 0 and target - offsets[i - 1] <= offsets[i] - target:
        return i - 1
    return i


def make_sample(task: str, tokenizer, n_tokens: int, index: int, *, samples: int = 10, seed: int = 0) -> Sample:
    """Sample ``index`` of ``samples`` of ``task`` at ``n_tokens`` tokens (layouts: module docstring).

    Args:
        task: one of :data:`TASKS`.
        tokenizer: a Hugging Face tokenizer; called as ``tokenizer(texts, add_special_tokens=False)``.
        n_tokens: exact prompt length; at least the intro, needles and question plus
            :data:`MIN_HAYSTACK_TOKENS` (the error says how many).
        index: ``0 .. samples - 1``; spreads the ``single_needle`` depth over ``0 .. 1``.
        samples: samples per (task, length).
        seed: with ``task``, ``n_tokens`` and ``index``, fixes every random draw (sha256-derived).

    Returns:
        :class:`Sample` with ``ids [n_tokens]`` int64.
    """
    task = _check_task(task)
    check_int("n_tokens", n_tokens, 1)
    check_int("samples", samples, 1)
    check_int("index", index, 0)
    check_int("seed", seed, 0)
    if index >= samples:
        raise ValueError(f"index must lie in 0..{samples - 1} (samples={samples}), got {index}")
    rng = _rng(seed, task, n_tokens, index)
    spec = _spec(task, rng, n_tokens, index, samples)
    pieces = _encode(tokenizer, [spec.intro, spec.question, spec.answer_text]
                     + [t for _, t in spec.needles] + spec.scattered)
    intro, question, answer = pieces[0], pieces[1], pieces[2]
    needles = pieces[3 : 3 + len(spec.needles)]
    scattered = pieces[3 + len(spec.needles) :]
    fixed = len(intro) + len(question) + sum(map(len, needles)) + sum(map(len, scattered))
    hay_len = n_tokens - fixed
    if hay_len < MIN_HAYSTACK_TOKENS:
        raise ValueError(
            f"n_tokens={n_tokens} is too small for task {task!r}: its intro, inserted pieces and question take "
            f"{fixed} tokens and the haystack needs at least {MIN_HAYSTACK_TOKENS}; "
            f"use n_tokens >= {fixed + MIN_HAYSTACK_TOKENS}"
        )
    hay = _haystack(tokenizer, rng, hay_len, "\n\n")
    offsets = [0]
    for u in hay.units:
        offsets.append(offsets[-1] + len(u))  # offsets[i]: start of unit i; offsets[-1] == hay_len
    inserts: dict[int, list[list[int]]] = {}
    paragraph = [i for i, s in enumerate(hay.starts) if s or i == 0] + [len(hay.units)]
    para_offsets = [offsets[i] for i in paragraph]
    for (depth, _), ids in zip(spec.needles, needles):
        inserts.setdefault(paragraph[_nearest(para_offsets, depth * hay_len)], []).append(ids)
    for ids in scattered:  # after some sentence, never glued to the intro
        inserts.setdefault(rng.randint(min(1, len(hay.units)), len(hay.units)), []).append(ids)
    out = list(intro)
    for i, unit in enumerate(hay.units):
        for ids in inserts.get(i, ()):
            out.extend(ids)
        out.extend(unit)
    for ids in inserts.get(len(hay.units), ()):
        out.extend(ids)
    out.extend(question)
    assert len(out) == n_tokens, (len(out), n_tokens)
    return Sample(task=task, n_tokens=n_tokens, index=index, seed=seed, ids=torch.tensor(out, dtype=torch.int64),
                  answers=spec.answers, max_new_tokens=len(answer) + ANSWER_SLACK_TOKENS, depth=spec.depth)


@cache
def _whole_word(answer: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![0-9A-Za-z]){re.escape(answer)}(?![0-9A-Za-z])", re.IGNORECASE)


def score(sample: Sample, text: str) -> bool:
    """True when every answer of ``sample`` occurs in ``text`` as a whole word: no letter or digit
    directly before or after it, case-insensitive (``"1234567"`` is not found in ``"12345678"``)."""
    if not isinstance(sample, Sample):
        raise TypeError(f"sample must be a Sample, got {type(sample).__name__}")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    return all(_whole_word(a).search(text) is not None for a in sample.answers)


def score_fraction(sample: Sample, text: str) -> float:
    """Partial credit: the fraction of the answers of ``sample`` that occur in ``text`` as whole
    words (same matching as :func:`score`; ``1.0`` exactly when :func:`score` is True). RULER
    reports this for its multi-answer tasks."""
    if not isinstance(sample, Sample):
        raise TypeError(f"sample must be a Sample, got {type(sample).__name__}")
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    found = sum(_whole_word(a).search(text) is not None for a in sample.answers)
    return found / len(sample.answers)


def perplexity_ids(tokenizer, n_tokens: int, index: int, *, seed: int = 0) -> torch.Tensor:
    """``[n_tokens]`` int64 haystack ids only (same prose as the prompts, no needles, first
    paragraph without a leading blank line); ``index`` and ``seed`` pick the text."""
    check_int("n_tokens", n_tokens, 1)
    check_int("index", index, 0)
    check_int("seed", seed, 0)
    hay = _haystack(tokenizer, _rng(seed, PERPLEXITY_TASK, n_tokens, index), n_tokens, "")
    ids = [t for u in hay.units for t in u]
    return torch.tensor(ids, dtype=torch.int64)


def position_buckets(nll: torch.Tensor, buckets: int = 8) -> list[float]:
    """Mean per-token loss in ``buckets`` equal runs of positions.

    Args:
        nll: ``[L]`` float, ``nll[j]`` the loss of token ``j + 1`` given tokens ``0 .. j`` (``L = n - 1``
            for ``n`` ids).
        buckets: number of buckets, ``1 <= buckets <= L``.

    Returns:
        ``buckets`` floats; bucket ``b`` averages ``nll[j]`` for ``b * L // buckets <= j <
        (b + 1) * L // buckets`` (sizes differ by at most one; the mean is taken in float64, and a
        NaN stays inside its bucket).
    """
    if not isinstance(nll, torch.Tensor):
        raise TypeError(f"nll must be a torch.Tensor, got {type(nll).__name__}")
    if nll.dim() != 1:
        raise ValueError(f"nll must have rank 1 ([n - 1] losses), got shape {tuple(nll.shape)}")
    if not nll.is_floating_point():
        raise TypeError(f"nll must be a floating tensor, got {str(nll.dtype).replace('torch.', '')}")
    check_int("buckets", buckets, 1)
    L = nll.shape[0]
    if buckets > L:
        raise ValueError(f"buckets must be <= the {L} positions of nll, got {buckets}")
    x = nll.detach().to("cpu", torch.float64)
    edges = [b * L // buckets for b in range(buckets + 1)]
    return [float(x[edges[b] : edges[b + 1]].mean()) for b in range(buckets)]
