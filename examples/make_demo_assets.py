"""Build the small demo assets shipped in ``examples/``.

Running this script (deterministic, seeded) writes:

* ``examples/data/corpus.txt``  - an original toy English corpus, one document per line
* ``examples/data/eval.txt``    - held-out lines in the same style
* ``examples/tiny-llama/``      - a byte-level BPE tokenizer (vocab 512) and a tiny
  Llama ``config.json`` / ``generation_config.json`` (no weights: the model is
  random-initialized from a seed by the library)

The text is written for this demo: short, repetitive prose about a small coastal
town (its lighthouse keeper, fishing boats, weather, bakery, school, trains and
gardens) with a deliberately small vocabulary, so a tiny model can visibly learn
it in a couple hundred steps.

Usage::

    python examples/make_demo_assets.py            # corpus + eval + tokenizer + config
    python examples/make_demo_assets.py --text-only  # only the two text files
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

SEED = 1234
N_CORPUS = 360
N_EVAL = 40
VOCAB_SIZE = 512
MIN_WORDS, MAX_WORDS = 20, 60

HERE = Path(__file__).resolve().parent
DATA_DIR = HERE / "data"
MODEL_DIR = HERE / "tiny-llama"

# --------------------------------------------------------------------------- #
# Slot values
# --------------------------------------------------------------------------- #
GOOD_WEATHER = [
    "the sun was bright",
    "the air was warm and still",
    "the sky was clear and blue",
    "a light wind came from the south",
]
BAD_WEATHER = [
    "the sky was grey",
    "a cold wind came from the north",
    "a soft rain fell on the roofs",
    "a thick fog rolled in from the sea",
    "dark clouds moved over the hills",
    "a strong wind blew from the sea",
]
CALM_SEA = ["the sea was calm", "the water was flat and blue", "the waves were small"]
ROUGH_SEA = ["the sea was rough", "the waves were high", "the water was grey and wild"]
VEG = ["beans", "carrots", "potatoes", "peas", "onions", "tomatoes"]
FLOWERS = ["roses", "sunflowers"]

SLOTS = {
    "time": ["In the morning", "At dawn", "In the evening", "Late at night", "At noon", "After lunch", "At sunset"],
    "mtime": ["In the morning", "At dawn", "Before breakfast", "Early in the morning", "At six o'clock"],
    "dtime": ["In the morning", "At noon", "After lunch", "In the afternoon"],
    "day": ["On Monday", "On Tuesday", "On Wednesday", "On Thursday", "On Friday", "On Saturday", "On Sunday"],
    "weekday": ["On Monday", "On Tuesday", "On Wednesday", "On Thursday", "On Friday"],
    "season": ["spring", "summer", "autumn", "winter"],
    "weather": GOOD_WEATHER + BAD_WEATHER,
    "good_weather": GOOD_WEATHER,
    "bad_weather": BAD_WEATHER,
    "sea": CALM_SEA + ROUGH_SEA,
    "calm_sea": CALM_SEA,
    "rough_sea": ROUGH_SEA,
    "boat": [
        "the blue boat",
        "the small red boat",
        "the old green boat",
        "the white boat",
        "the long black boat",
        "the little yellow boat",
    ],
    "fish": ["cod", "herring", "mackerel", "crabs", "small silver fish", "lobsters"],
    "bread": ["brown bread", "sweet buns", "seed rolls", "apple cakes", "warm loaves", "honey cakes", "white bread"],
    "veg": VEG,
    "plant": VEG + FLOWERS,
    "lesson": ["numbers", "reading", "the stars", "the tides", "birds", "maps", "the moon", "the weather"],
    "story": [
        "the stars",
        "an old ship",
        "a great storm",
        "a whale",
        "the first lighthouse",
        "a lost boat",
        "the moon and the sea",
    ],
    "bird": ["gulls", "small brown birds", "geese", "crows", "white herons"],
    "child": ["Sam", "Lily", "Tom", "Rosa"],
    "fisher": ["Old Jon", "Ada", "Peter"],
    "number": ["two", "three", "four", "five", "six"],
    "color": ["red", "blue", "green", "yellow", "white"],
}

# Slots that keep one value for a whole line (so the characters, the weather and
# the season of one document stay consistent). ``{child2}`` is a second child,
# different from ``{child}``.
STICKY = {"fisher", "child", "weather", "good_weather", "bad_weather", "sea", "calm_sea", "rough_sea", "season"}

# Fixed characters (pronouns stay consistent):
#   Mara  - the lighthouse keeper (she)
#   Ben   - the baker (he)
#   Mrs Hale - the teacher (she)
#   Nora  - the gardener (she)
#   Mr Reed - the station master (he)

# Each topic: openers set a scene (and name who "she"/"he" is), middles add an
# event, closers end the line.
TOPICS = {
    "lighthouse": {
        "openers": [
            "{time}, Mara climbed the stairs of the lighthouse.",
            "Mara is the keeper of the lighthouse at the end of the rocks.",
            "{day}, {weather}, and Mara cleaned the big glass of the lamp.",
            "The lighthouse stands on the rocks above the harbor, and Mara lives at the bottom of it.",
            "{time}, Mara looked out from the top of the lighthouse.",
            "In winter, Mara lights the lamp early because the days are short.",
            "In summer, Mara lights the lamp late because the days are long.",
            "The old lighthouse has one hundred steps, and Mara knows every one.",
        ],
        "middles": [
            "She saw {boat} far out on the water, and she waved to the people on board.",
            "She lit the lamp, and the light turned slowly over the dark sea.",
            "She wrote in her book that {sea} and {weather}.",
            "She watched the {bird} fly over the rocks and down to the beach.",
            "She made a cup of tea and sat by the window to watch the boats.",
            "She counted {number} boats coming home before the sun went down.",
            "She checked the lamp, the oil, and the clock, as she does every day.",
            "When the fog came, she rang the big bell so the boats could find the way.",
        ],
        "closers": [
            "The boats came home safe, and the town went to sleep.",
            "The light kept turning until the morning came.",
            "Then she went down the stairs and made her supper.",
            "The fishermen say that Mara has the best eyes in the town.",
            "All night the lamp turned, and no boat was lost.",
            "Later she wrote a short letter to her sister in the city.",
        ],
    },
    "fishing": {
        "openers": [
            "{mtime}, {fisher} and the crew took {boat} out of the harbor.",
            "{day}, the fishing boats left the harbor before the sun came up.",
            "{fisher} and the crew of {boat} have worked on the sea for many years.",
            "In {season}, the fishing boats go far out to catch {fish}.",
            "{mtime}, {sea}, and the boats moved slowly past the lighthouse.",
            "The fishermen of the town meet at the harbor every morning.",
            "{fisher} painted {boat} in {season}, and then the crew took it out to sea.",
        ],
        "middles": [
            "They put the nets into the water and waited for the {fish}.",
            "By noon the nets were full of {fish}, and everyone on board was happy.",
            "The wind was strong, so they stayed close to the shore.",
            "They caught {number} boxes of {fish} and some {fish} too.",
            "{fisher} sang an old song while the nets came up.",
            "The {bird} followed the boat and cried for fish.",
            "When {bad_weather}, they turned the boat back toward the light.",
            "They ate bread and cheese on the boat and drank hot tea.",
        ],
        "closers": [
            "In the evening they sold the fish at the market by the harbor.",
            "They came home tired, wet, and happy.",
            "The next day they went out again, as they always do.",
            "At home, {fisher} cooked fish with potatoes for supper.",
            "The children ran down to the harbor to see the catch.",
            "That night the boats rocked softly in the harbor.",
        ],
    },
    "bakery": {
        "openers": [
            "Ben the baker gets up before the sun every day.",
            "{mtime}, Ben opened the door of the bakery on the main street.",
            "Ben has a small bakery near the harbor with a blue door.",
            "{day}, Ben made {bread} and {bread} for the whole town.",
            "In {season}, the bakery smells of {bread} and warm butter, and Ben is busy all day.",
            "{mtime}, the windows of the bakery were bright, and Ben was already at work.",
        ],
        "middles": [
            "He mixed the flour, the water, and the salt in a big bowl.",
            "He put the {bread} in the hot oven and waited.",
            "{child} came in with a coin and asked for {bread}.",
            "The fishermen bought {bread} to eat on their boats.",
            "Mara came down from the lighthouse to buy {bread}.",
            "The shop was full of people, and the bread was gone by noon.",
            "He gave the last of the {bread} to the children from the school.",
            "He sang while he worked, and the people in the street could hear him.",
        ],
        "closers": [
            "After work, Ben walked by the sea and looked at the boats.",
            "In the evening he cleaned the oven and closed the blue door.",
            "Everyone in the town says that Ben makes the best {bread}.",
            "Then he went home, ate his supper, and went to bed early.",
            "The next morning he started again before the sun came up.",
            "He saved some {bread} for his mother on the hill.",
        ],
    },
    "school": {
        "openers": [
            "The school is on the hill above the town, and Mrs Hale is the teacher.",
            "{weekday}, Mrs Hale taught the children about {lesson}.",
            "{mtime}, the children walked up the hill to the school.",
            "Mrs Hale has taught at the small school for twenty years.",
            "In {season}, the school has a window full of drawings of the sea.",
            "{child} and {child2} sit together at the front of the class.",
        ],
        "middles": [
            "The children read from their books and wrote in their notes.",
            "{child} drew a picture of the lighthouse with a bright yellow light.",
            "Mrs Hale told a story about {story}, and the class was very quiet.",
            "They counted the boats in the harbor from the school window.",
            "At lunch the children ate {bread} from the bakery.",
            "{child} asked why the sea goes out and comes back every day.",
            "Mrs Hale said that the moon pulls the water, and that is why we have tides.",
            "The class went down to the beach to look for shells and small crabs.",
        ],
        "closers": [
            "After school, the children ran down the hill to the harbor.",
            "At the end of the day, Mrs Hale closed the windows and went home.",
            "{child} wants to be a lighthouse keeper one day.",
            "That night {child} told the whole story at supper.",
            "The next day they learned about {lesson}.",
            "The children sang a song about the sea before they went home.",
        ],
    },
    "train": {
        "openers": [
            "The train comes to the town twice a day, once in the morning and once in the evening.",
            "{time}, the train came along the coast and stopped at the small station.",
            "Mr Reed is the station master, and he keeps a big clock on the wall.",
            "{day}, {bad_weather}, and the train was late.",
            "The railway runs along the coast between the hills and the sea.",
            "In {season}, many people come to the town on the train.",
        ],
        "middles": [
            "Mr Reed rang the bell, and the people got on the train.",
            "The train brought letters, flour for the bakery, and news from the city.",
            "{child} waited on the platform to see the big engine.",
            "The fishermen sent boxes of {fish} to the city on the train.",
            "From the train window you can see the lighthouse and the boats.",
            "Mr Reed looked at his clock and wrote the time in his book.",
            "Ben came to the station to carry sacks of flour back to the bakery.",
        ],
        "closers": [
            "Then the train moved on, and the station was quiet again.",
            "Mr Reed swept the platform and went home for tea.",
            "The train went away along the coast until it was very small.",
            "In the evening the last train came home with its lights on.",
            "{child} waved to the train until it was gone.",
        ],
    },
    "garden": {
        "openers": [
            "Nora has a garden behind her house on the hill.",
            "{dtime}, Nora went out to work in her garden.",
            "In {season}, Nora plants {plant} and {plant} in long rows.",
            "{day}, {weather}, and Nora was in the garden.",
            "Nora has a small garden, but it is full of {plant}, {plant}, and {plant}.",
            "Nora keeps {number} hens and a cat in her garden.",
        ],
        "middles": [
            "She put the seeds in the ground and gave them water.",
            "She pulled the weeds and talked to her plants.",
            "The {plant} grew tall in the sun near the stone wall.",
            "The rain was good for the {plant}, and she was happy.",
            "{child} helped her carry water from the well.",
            "The wind from the sea was salty, so she built a low wall.",
            "She picked a basket of {veg} for her friends in the town.",
            "The {bird} sat on the wall and watched her work.",
        ],
        "closers": [
            "In the evening she sat in the garden and looked at the sea.",
            "She gave some {veg} to Ben, and he gave her a loaf of bread.",
            "Then she went inside and made soup with {veg} and {veg}.",
            "Next {season} she wants to grow {plant} by the gate.",
            "When it was dark, she could see the light of the lighthouse from her garden.",
        ],
    },
    "storm": {
        "openers": [
            "{day}, {bad_weather}.",
            "In {season}, the weather in the town changes every day, and {day_lower} {bad_weather}.",
            "A big storm came from the sea in autumn.",
            "{time}, {bad_weather}, and {rough_sea}.",
            "The people of the town always talk about the weather, and today {bad_weather}.",
        ],
        "middles": [
            "The boats stayed in the harbor, and the fishermen mended their nets.",
            "The children put on their coats and boots to walk to school.",
            "Later the rain came, and the streets were full of water.",
            "The wind blew hard, and the waves hit the rocks below the lighthouse.",
            "Mara watched the clouds from the lighthouse and wrote in her book.",
            "Nora covered her {plant} so the cold would not hurt them.",
            "People stayed inside, and the bakery was warm and full.",
        ],
        "closers": [
            "By evening the sky was clear, and the stars were out.",
            "The next day was calm, and the boats went out again.",
            "Old Jon says he can smell the weather before it comes.",
            "The next morning, the beach was covered with wood and shells.",
        ],
    },
    "fair_weather": {
        "openers": [
            "{day}, {good_weather}.",
            "{time}, {good_weather}, and {calm_sea}.",
            "In summer the days are long, and the sea is often calm.",
            "The people of the town always talk about the weather, and today {good_weather}.",
        ],
        "middles": [
            "The boats went out early, and the nets came back full.",
            "The children played on the beach after school.",
            "Nora opened her windows and worked in the garden all day.",
            "The sun dried the nets that hung along the harbor wall.",
            "Mara painted the door of the lighthouse white again.",
            "People sat outside the bakery and ate {bread} in the sun.",
        ],
        "closers": [
            "That night everyone in the town slept well.",
            "In the evening the sky was red over the sea.",
            "Old Jon says he can smell the weather before it comes.",
            "Everyone hoped that the next day would be the same.",
        ],
    },
    "spring": {
        "openers": [
            "In spring, the hills turn green and the birds come back to the town.",
            "Spring is the favorite season of {child}.",
            "In spring, the days get longer and the air gets warm again.",
            "Every spring, the town has a small fair by the harbor.",
        ],
        "middles": [
            "Nora plants {plant} in her garden and gives them water every day.",
            "The fishermen paint their boats and mend their nets.",
            "The {bird} build their nests on the rocks below the lighthouse.",
            "The children pick flowers on the hill on the way to school.",
            "Ben makes {bread} with the first eggs from the hens that Nora keeps.",
        ],
        "closers": [
            "Everyone in the town is glad when spring comes again.",
            "It is a busy time, and the town is happy.",
            "At night, the light of the lighthouse turns over the water as always.",
        ],
    },
    "summer": {
        "openers": [
            "In summer, children swim in the sea and play on the beach.",
            "Summer is the favorite season of {child}.",
            "In summer the days are long and warm, and the sea is often calm.",
            "Every summer, many people come to the town on the train.",
        ],
        "middles": [
            "The visitors walk on the beach and buy {bread} from the bakery.",
            "The fishing boats go out early and come home late.",
            "{child} and {child2} build a castle of sand near the water.",
            "Nora works in her garden from morning until evening.",
            "Mara opens the door of the lighthouse so the children can climb to the top.",
            "The school is closed, and Mrs Hale walks on the hills with a book.",
        ],
        "closers": [
            "Everyone in the town is glad when summer comes again.",
            "Then the summer ends, and the children go back to school.",
            "At night, the light of the lighthouse turns over the water as always.",
        ],
    },
    "autumn": {
        "openers": [
            "In autumn, the leaves fall and the wind gets cold.",
            "Autumn is the favorite season of {child}.",
            "In autumn, the nights get longer and the sea gets rough.",
            "Every autumn, the town has a harvest supper in the school.",
        ],
        "middles": [
            "Nora digs up her potatoes and picks the last of her {veg}.",
            "The children go back to school and tell stories about the summer.",
            "The {bird} fly over the harbor in long lines.",
            "Ben makes apple cakes from the apples on the hill.",
            "The fishermen bring their boats up onto the beach before the storms.",
        ],
        "closers": [
            "Then the autumn ends, and the first snow comes.",
            "It is a quiet time, and the town is happy.",
            "At night, the light of the lighthouse turns over the water as always.",
        ],
    },
    "winter": {
        "openers": [
            "In winter, the nights are long and the lighthouse works hard.",
            "Winter is the favorite season of {child}.",
            "In winter, snow falls on the hills and the harbor is cold and quiet.",
            "Every winter, the people of the town meet in the school to sing songs.",
        ],
        "middles": [
            "Mara cleans the lamp every day, because the nights are dark.",
            "The people of the town sit by the fire and eat fish and bread.",
            "The boats stay in the harbor when the sea is too rough.",
            "The train brings coal and letters from the city.",
            "The children make a snowman on the hill behind the school.",
            "Ben keeps his oven hot all day, and the bakery is the warmest place in the town.",
        ],
        "closers": [
            "Then the winter ends, and the birds come back in spring.",
            "It is a quiet time, but the town is happy.",
            "At night, the light of the lighthouse turns over the water as always.",
        ],
    },
    "market": {
        "openers": [
            "{day}, there is a market by the harbor.",
            "The market is in the square near the station.",
            "{dtime}, the market was busy with people and noise.",
        ],
        "middles": [
            "The fishermen sold {fish}, and Nora sold {veg} from her garden.",
            "Ben had a table with {bread} and {bread}.",
            "{child} bought a small {color} ball with a coin from home.",
            "People talked about the weather, the boats, and the train.",
            "An old man played music, and the children danced.",
            "Mara bought oil for the lamp and a new book.",
        ],
        "closers": [
            "By the evening the tables were empty, and everyone went home.",
            "The {bird} came to look for bits of fish and bread.",
            "It was a good day for the whole town.",
            "The next market will be in one week.",
        ],
    },
}

# Hand-written explanatory lines (added to the corpus as they are).
HANDWRITTEN = [
    "A lighthouse is a tall tower with a bright lamp at the top. The lamp turns all night, so the boats at sea can see the rocks and stay safe.",
    "A harbor is a place where boats can rest. The water in a harbor is calm, because a long wall of stone keeps out the big waves.",
    "The tide is the slow rise and fall of the sea. Twice a day the water comes up the beach, and twice a day it goes back out.",
    "Fishermen use nets to catch fish. A net is made of many small knots, and the fish cannot swim through it.",
    "Bread is made from flour, water, salt, and a little yeast. The baker mixes them, waits for the bread to rise, and then puts it in the oven.",
    "A train runs on two long rails of iron. It stops at stations, where people get on and get off.",
    "A garden needs sun, water, and good soil. If you pull the weeds and wait, the seeds will grow into plants.",
    "Fog is a cloud that sits low on the ground or on the sea. In thick fog you cannot see your own hand, and the boats must move slowly.",
    "A storm is a time of strong wind and heavy rain. In a storm the boats stay in the harbor, and the people stay inside.",
    "Gulls are large white and grey birds that live by the sea. They follow the fishing boats and cry for fish.",
    "The year has four seasons: spring, summer, autumn, and winter. In the town, each season has its own weather and its own work.",
    "A school is a place where children learn to read, to write, and to count. In the town, the school has one room and one teacher.",
    "A station master looks after the station. He rings the bell, keeps the clock right, and helps people with their bags.",
    "Shells are the old homes of small sea animals. After a storm, the beach is full of shells of many colors.",
    "The moon pulls on the sea, and that is why we have tides. When the moon is full, the tides are very high and very low.",
    "A keeper must watch the light all night. If the lamp goes out, a boat in the dark may hit the rocks.",
    "Salt comes from the sea. When sea water dries in the sun, a thin white salt is left on the rocks.",
    "Hens give eggs, and eggs are good for cakes and bread. Nora gives her eggs to Ben, and Ben makes honey cakes with them.",
    "Rain is water that falls from the clouds. The gardens need rain, but the fishermen do not like it very much.",
    "Wind moves the clouds and the waves. A north wind is cold and hard, and a south wind is soft and warm.",
    "The town is small, and everyone knows everyone. If you walk down the main street, people will say good morning to you.",
    "From the top of the hill you can see the whole town: the harbor, the boats, the station, the school, and the lighthouse on the rocks.",
    "Old Jon is the oldest fisherman in the town. He has a long white beard and a small green boat, and he knows every rock in the bay.",
    "Mara has kept the lighthouse for ten years. She lives in a small house at the bottom of the tower with her dog.",
    "Ben learned to bake from his father, and his father learned from his grandfather. The bakery has been on the main street for a long time.",
    "Mrs Hale likes birds, maps, and old stories. She tells the children that the sea is like a big book that you can read every day.",
    "Mr Reed has a big clock, a small bell, and a red flag. When the train is ready to go, he waves the flag and rings the bell.",
    "Nora grows beans, peas, carrots, and roses. Her garden is the most colorful place in the whole town in summer.",
    "Sam and Lily are brother and sister. They live near the harbor, and they love to watch the boats come home.",
    "Tom and Rosa are friends from school. After class they walk on the beach and look for crabs under the stones.",
    "When the fishing boats come home, the gulls fly over the harbor and the children run down to meet them.",
    "In the evening the town is quiet. The bakery is closed, the train has gone, and only the lighthouse is still awake.",
    "A map shows where things are. On the map of the town, the lighthouse is at the end of the rocks and the station is by the square.",
    "An oven must be hot to bake bread. Ben puts wood in the oven early in the morning, so it is ready when the dough has risen.",
    "The stars come out when the sky is clear. Mara knows their names, and she tells them to the children when they visit the lighthouse.",
    "Potatoes grow under the ground. In autumn, Nora digs them up with a small fork and puts them in a basket.",
    "Dogs, cats, hens, and goats live in the town. Mara has a dog, Nora has a cat, and Old Jon has a goat that eats everything.",
    "A bell can be heard far away. When the fog is thick, the bell of the lighthouse tells the boats where the rocks are.",
    "The sea can be kind, and the sea can be cruel. The people of the town love it, but they never forget how strong it is.",
    "Every morning is a little different in the town, but the boats, the bread, the train, and the light are always there.",
]

HANDWRITTEN_EVAL = [
    "A bay is a part of the sea that goes into the land. The town sits at the edge of a small bay with rocks on both sides.",
    "Flour is made from wheat. The train brings big sacks of flour to the station, and Ben carries them to the bakery.",
    "Waves are made by the wind. When the wind is strong, the waves are high, and the boats stay in the harbor.",
    "Mara keeps a book by the lamp. Every night she writes down the weather, the sea, and the boats she sees.",
    "Seeds are small, but they hold a whole plant inside. Nora keeps her seeds in paper bags in a dry box.",
]


# --------------------------------------------------------------------------- #
# Text generation
# --------------------------------------------------------------------------- #
def _fill(template: str, rng: random.Random, state: dict[str, str]) -> str:
    """Fill ``{slot}`` placeholders.

    Slots in ``STICKY`` keep their value for the whole line (``state``); other
    slots repeated in one sentence get distinct values.
    """
    used: dict[str, set[str]] = {}

    def repl(m: re.Match) -> str:
        key = m.group(1)
        if key == "child2":
            child = state.setdefault("child", rng.choice(SLOTS["child"]))
            return rng.choice([c for c in SLOTS["child"] if c != child])
        if key == "day_lower":
            day = state.setdefault("day", rng.choice(SLOTS["day"]))
            return day[0].lower() + day[1:]
        if key in STICKY:
            return state.setdefault(key, rng.choice(SLOTS[key]))
        choices = [c for c in SLOTS[key] if c not in used.setdefault(key, set())]
        value = rng.choice(choices)
        used[key].add(value)
        return value

    return re.sub(r"\{(\w+)\}", repl, template)


def _tidy(line: str) -> str:
    line = re.sub(r"\s+", " ", line).strip()
    # Capitalize the first letter of every sentence.
    return re.sub(r"(^|[.!?] )([a-z])", lambda m: m.group(1) + m.group(2).upper(), line)


def make_line(rng: random.Random) -> str:
    topic = TOPICS[rng.choice(sorted(TOPICS))]
    state: dict[str, str] = {}
    parts = [_fill(rng.choice(topic["openers"]), rng, state)]
    n_mid = rng.choice([1, 1, 2])
    for mid in rng.sample(topic["middles"], n_mid):
        parts.append(_fill(mid, rng, state))
    if n_mid == 1 and rng.random() < 0.6:
        parts.append(_fill(rng.choice(topic["closers"]), rng, state))
    return _tidy(" ".join(parts))


def n_words(line: str) -> int:
    return len(line.split())


def make_lines(rng: random.Random, n: int, seen: set[str], first: list[str]) -> list[str]:
    out: list[str] = []
    for line in first:
        line = _tidy(line)
        if line not in seen:
            seen.add(line)
            out.append(line)
    while len(out) < n:
        line = make_line(rng)
        if line in seen or not (MIN_WORDS <= n_words(line) <= MAX_WORDS):
            continue
        seen.add(line)
        out.append(line)
    return out


def build_text() -> tuple[list[str], list[str]]:
    rng = random.Random(SEED)
    seen: set[str] = set()
    corpus = make_lines(rng, N_CORPUS, seen, HANDWRITTEN)
    rng.shuffle(corpus)
    eval_lines = make_lines(random.Random(SEED + 1), N_EVAL, seen, HANDWRITTEN_EVAL)
    for line in corpus + eval_lines:
        assert line.isascii(), line
        assert MIN_WORDS <= n_words(line) <= MAX_WORDS, (n_words(line), line)
    return corpus, eval_lines


def write_lines(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n", encoding="ascii")


# --------------------------------------------------------------------------- #
# Tokenizer and config
# --------------------------------------------------------------------------- #
def build_tokenizer(corpus_path: Path, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<pad>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = None  # the library appends EOS itself
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus_path)], trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
        model_max_length=256,
    )
    hf_tok.save_pretrained(str(out_dir))
    # Recent transformers write ``"tokenizer_class": "TokenizersBackend"``; the
    # generic name loads the same class there and also works on older releases.
    cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, sort_keys=True) + "\n")
    return hf_tok


def build_config(tok, out_dir: Path) -> None:
    from transformers import GenerationConfig, LlamaConfig

    ids = {
        "bos_token_id": tok.convert_tokens_to_ids("<s>"),
        "eos_token_id": tok.convert_tokens_to_ids("</s>"),
        "pad_token_id": tok.convert_tokens_to_ids("<pad>"),
    }
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **ids,
    )
    config.save_pretrained(str(out_dir))
    GenerationConfig(**ids).save_pretrained(str(out_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text-only", action="store_true", help="only write the text files")
    args = ap.parse_args()

    corpus, eval_lines = build_text()
    corpus_path = DATA_DIR / "corpus.txt"
    write_lines(corpus_path, corpus)
    write_lines(DATA_DIR / "eval.txt", eval_lines)
    vocab = {w.strip(".,:;!?").lower() for line in corpus for w in line.split()}
    print(
        f"corpus: {len(corpus)} lines, {sum(map(n_words, corpus))} words, "
        f"{len(vocab)} distinct words; eval: {len(eval_lines)} lines"
    )
    if args.text_only:
        return

    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(corpus_path, MODEL_DIR)
    build_config(tok, MODEL_DIR)
    print(f"tokenizer: {len(tok)} tokens; wrote {MODEL_DIR}")
    verify(MODEL_DIR)


def verify(model_dir: Path) -> None:
    """Reload what was written, check the tokenizer round-trips, run one forward pass."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    config = AutoConfig.from_pretrained(str(model_dir))
    assert len(tok) == config.vocab_size == VOCAB_SIZE, (len(tok), config.vocab_size)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        config.bos_token_id,
        config.eos_token_id,
        config.pad_token_id,
    )
    for name in ("corpus", "eval"):
        lines = (DATA_DIR / f"{name}.txt").read_text(encoding="ascii").splitlines()
        n_tokens = 0
        for line in lines:
            ids = tok.encode(line, add_special_tokens=False)
            assert tok(line)["input_ids"] == ids, "tokenizer must not add BOS/EOS itself"
            assert tok.unk_token_id not in ids, line
            assert tok.decode(ids) == line, line
            n_tokens += len(ids) + 1  # + one EOS per line
        print(f"{name}: {len(lines)} lines, {n_tokens} tokens (one EOS per line), round-trip ok")
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    batch = tok([lines[0] + tok.eos_token], return_tensors="pt")
    out = model(**batch, labels=batch["input_ids"])
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {type(model).__name__}, {n_params} parameters, initial loss {out.loss.item():.3f}")


if __name__ == "__main__":
    main()
