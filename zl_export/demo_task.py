"""The built-in demo task: short generated sentences about four topics, each mapped to a color word.

The mapping (food -> blue, weather -> red, sports -> yellow, music -> green)
is arbitrary, so a pretrained model can only guess among the four colors
(about 25 % accuracy), while a short LoRA fine-tune learns it from a few
hundred samples: the topic is plain in every sentence. The sentences come from
the word lists and templates below (no third-party text) and are fixed by a
seed; train and dev never share a sentence. They are short (at most 44 bytes,
about 10 SmolLM2 tokens), so that with the prompt `{text}\\nColor:` a sample
fits 64 tokens even for the byte tokenizer of the random test models.
"""

import hashlib
import itertools
import json
import random

from zl_base.errors import ZLError

DEMO_TEMPLATE = "{text}\nColor:"
DEMO_SEQ_LEN = 64
DEMO_TRAIN_ROWS = 256
DEMO_DEV_ROWS = 128
MAX_SENTENCE_BYTES = 44
# Distinct first letters, so the words also differ at their first byte.
TOPIC_COLORS = {"food": "blue", "weather": "red", "sports": "yellow", "music": "green"}

_NAMES = ["Anna", "Ben", "Cara", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jill", "Kai", "Lea"]
_WHEN = ["today", "on Monday", "at noon", "last night", "this week", "on Friday"]
_TOPICS: dict[str, list[tuple[str, dict[str, list[str]]]]] = {
    "food": [
        ("{name} {verb} {dish} for {meal}.", {
            "verb": ["cooked", "ate", "ordered", "baked", "shared", "made"],
            "dish": ["soup", "rice", "pasta", "bread", "salad", "noodles", "pie", "curry", "beans", "tacos"],
            "meal": ["lunch", "dinner", "breakfast"],
        }),
        ("The {dish} tasted {taste} {when}.", {
            "dish": ["soup", "rice", "pasta", "bread", "salad", "curry", "cake", "stew"],
            "taste": ["salty", "sweet", "spicy", "bland", "fresh", "rich"],
        }),
        ("{name} added {spice} to the {dish}.", {
            "spice": ["salt", "pepper", "garlic", "honey", "butter", "basil"],
            "dish": ["soup", "rice", "pasta", "salad", "stew", "eggs"],
        }),
    ],
    "weather": [
        ("It was {adj} and {adj2} in {town} {when}.", {
            "adj": ["windy", "rainy", "sunny", "foggy", "cloudy", "stormy"],
            "adj2": ["cold", "warm", "humid", "chilly", "mild"],
            "town": ["Oslo", "Lima", "Rome", "Kyiv", "Pune", "Perth"],
        }),
        ("{name} saw {sky} over the {place}.", {
            "sky": ["dark clouds", "heavy rain", "thick fog", "falling snow", "lightning", "hail"],
            "place": ["hills", "city", "lake", "coast", "farm", "bay"],
        }),
        ("The forecast said {fc} {when}.", {
            "fc": ["snow", "rain", "sun", "strong wind", "frost", "thunder", "showers", "a heat wave"],
        }),
    ],
    "sports": [
        ("{name} {verb} {sport} {when}.", {
            "verb": ["played", "watched", "practiced", "coached", "won at", "lost at"],
            "sport": ["tennis", "soccer", "hockey", "rugby", "golf", "chess", "volleyball"],
        }),
        ("The {team} team scored {n} goals.", {
            "team": ["home", "away", "school", "city", "junior", "local"],
            "n": ["two", "three", "four", "five", "six", "nine"],
        }),
        ("{name} ran {dist} in the {race}.", {
            "dist": ["five miles", "ten miles", "two laps", "a mile", "fast"],
            "race": ["marathon", "relay", "sprint", "final", "heat", "trial"],
        }),
    ],
    "music": [
        ("{name} played the {inst} {when}.", {
            "inst": ["violin", "piano", "guitar", "flute", "drums", "cello", "trumpet", "harp"],
        }),
        ("{name} sang a {song} in the {venue}.", {
            "song": ["ballad", "hymn", "folk song", "lullaby", "duet", "love song"],
            "venue": ["choir", "church", "hall", "club", "band", "park"],
        }),
        ("The {group} rehearsed the {piece}.", {
            "group": ["band", "choir", "orchestra", "quartet", "trio", "duo"],
            "piece": ["symphony", "anthem", "chorus", "sonata", "opening tune", "encore", "waltz"],
        }),
    ],
}


def _sentences(topic: str) -> list[str]:
    """Every sentence of `topic` that fits MAX_SENTENCE_BYTES, in a fixed order."""
    out = []
    for template, slots in _TOPICS[topic]:
        fields = dict(slots)
        if "{name}" in template:
            fields["name"] = _NAMES
        if "{when}" in template:
            fields["when"] = _WHEN
        keys = sorted(fields)
        for values in itertools.product(*(fields[k] for k in keys)):
            sentence = template.format(**dict(zip(keys, values)))
            if len(sentence.encode()) <= MAX_SENTENCE_BYTES:
                out.append(sentence)
    return sorted(set(out))


def demo_rows(seed: int = 0, train_rows: int = DEMO_TRAIN_ROWS, dev_rows: int = DEMO_DEV_ROWS) -> dict[str, list[dict[str, str]]]:
    """Train and dev rows `{"text": sentence, "label": color}`, balanced over the topics and shuffled.

    The same seed gives the same rows; train and dev share no sentence.

    Raises:
        ZLError: row counts that are not positive multiples of 4 or exceed what the templates can make.
    """
    topics = list(TOPIC_COLORS)
    for name, n in (("train", train_rows), ("dev", dev_rows)):
        if n < len(topics) or n % len(topics):
            raise ZLError(f"demo {name} rows {n}: expected a positive multiple of {len(topics)} (one share per topic).")
    rng = random.Random(seed)
    per_train, per_dev = train_rows // len(topics), dev_rows // len(topics)
    splits: dict[str, list[dict[str, str]]] = {"train": [], "dev": []}
    for topic in topics:
        pool = _sentences(topic)
        if per_train + per_dev > len(pool):
            raise ZLError(
                f"demo task: {per_train + per_dev} sentences per topic requested, topic {topic!r} has {len(pool)}; "
                "ask for fewer rows."
            )
        picked = rng.sample(pool, per_train + per_dev)
        splits["train"] += [{"text": s, "label": TOPIC_COLORS[topic]} for s in picked[:per_train]]
        splits["dev"] += [{"text": s, "label": TOPIC_COLORS[topic]} for s in picked[per_train:]]
    for rows in splits.values():
        rng.shuffle(rows)
    return splits


def rows_sha256(rows: list[dict[str, str]]) -> str:
    """A fingerprint of generated rows, recorded in the shard sidecar in place of a file hash."""
    return hashlib.sha256(json.dumps(rows, sort_keys=True).encode()).hexdigest()
