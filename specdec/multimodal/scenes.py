"""Deterministic synthetic multimodal data: 3x3-grid scenes, question/answer tasks, benchmark prompt sets.

A `Scene` is up to four coloured shapes in a 3x3 grid of 32-px cells on a 96x96 light-grey
canvas, plus optionally a white sign with a three-letter word. `render` draws it (PIL only).
Examples pair scenes with LLaVA-style conversations whose answers are deterministic
functions of the scenes (so a tiny vision-language model can learn them):

    describe  "What is in the picture?"          -> "There is a red circle at the top left and a blue square in the center."
    count     "How many red objects are there?"  -> "There is one red object."
    colour    "What colour is the circle?"       -> "The circle is red."          (shape unique in the scene)
    shape     "What shape is the green object?"  -> "The green object is a triangle."  (colour unique)
    where     "Where is the blue square?"        -> "The blue square is at the top right."
    read      "What does the sign say?"          -> "The sign says CAT."
    change    two images, one edit               -> "The red circle moved from the top left to the center."
    text      no image                           -> "Two plus three is five."
    followup  an image task, then a text turn    -> "Answer in one word." -> "Red."
    story     five images, evaluation only (OOD) -> "" (no reference)

Locations: "at the top left", "at the top", "at the top right", "on the left", "in the
center", "on the right", "at the bottom left", "at the bottom", "at the bottom right"
("from the top left to the center" in `change` answers). The sign is not an object: counts
ignore it; `describe` mentions it last ("... and a sign that says CAT on the right").

Splits: a scene's split is a sha256 hash of `Scene.key()` (1 in 8 scenes is "eval"), and
generators draw scenes until they land in the requested split, so train and eval never
share a scene (a multi-image example needs all its scenes in the split).

Everything is deterministic from a seed (`random.Random`, hashlib; never `hash()`).
`scenario_items` / `export_scenario` build the benchmark prompt sets (TABED Table 1):
"scenes-first-turn", "scenes-second-turn" and "scenes-ood", all from the eval split.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from PIL import Image, ImageDraw, ImageFont, features

from specdec.errors import SpecDecError

IMAGE_SIZE = 96
"""side of a rendered scene in pixels"""
GRID = 3
CELL_SIZE = IMAGE_SIZE // GRID
"""side of one grid cell (32 px)"""
CELL_NAMES = ("top left", "top", "top right", "left", "center", "right", "bottom left", "bottom", "bottom right")
"""cell names in reading order (cell index 0..8 = row * 3 + column)"""
_AT = ("at the", "at the", "at the", "on the", "in the", "on the", "at the", "at the", "at the")

SHAPES = ("circle", "square", "triangle", "diamond")
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 210, 0),
    "purple": (140, 50, 180),
    "orange": (250, 130, 0),
}
WARM_COLOURS = frozenset({"red", "orange", "yellow"})
BACKGROUND = (214, 214, 214)
"""the canvas colour (light grey, so the white sign stands out)"""
SIGN_FILL = (255, 255, 255)
SIGN_BORDER = (120, 120, 120)
SIGN_TEXT = (0, 0, 0)
SIGN_WORDS = (
    "CAT", "DOG", "SUN", "BOX", "CAR", "BUS", "HAT", "CUP", "PEN", "MAP",
    "KEY", "BED", "FOX", "EGG", "ICE", "JAR", "LOG", "NET", "PIG", "RAT",
    "TOY", "VAN", "ZOO", "ANT", "BAT", "HEN", "SKY", "FIG", "NUT", "TEA",
)  # fmt: skip
"""words a sign can show (no W or M: every word fits the 30-px sign at the default font)"""
_SIGN_FONT_SIZE = 12
EVAL_ONE_IN = 8
"""1 in EVAL_ONE_IN scenes (by hash) belongs to the eval split"""
IMAGE_TOKEN = "<image>"
"""the LLaVA image placeholder; each is followed by a newline in user text"""

Split = Literal["train", "eval"]
SPLITS: tuple[Split, ...] = ("train", "eval")
TASKS = ("describe", "count", "colour", "shape", "where", "read", "change", "text", "followup", "story")
TRAIN_MIXTURE: dict[str, int] = {
    "describe": 2,
    "count": 2,
    "colour": 2,
    "shape": 1,
    "where": 2,
    "read": 1,
    "change": 2,
    "text": 1,
    "followup": 2,
}
"""task weights when `make_example` is given no task (`story` is evaluation only)"""
FIRST_TURN_MIXTURE: dict[str, int] = {t: w for t, w in TRAIN_MIXTURE.items() if t not in ("text", "followup")}
"""the single-turn image tasks of the "scenes-first-turn" prompt set"""
FOLLOWUP_FIRST_TASKS = ("colour", "shape", "where", "count", "describe")

SCENARIOS = ("scenes-first-turn", "scenes-second-turn", "scenes-ood")
"""the benchmark prompt sets (TABED Table 1 scenarios), all built from the eval split"""

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
OPPOSITES = (
    ("big", "small"), ("hot", "cold"), ("up", "down"), ("fast", "slow"), ("happy", "sad"),
    ("open", "closed"), ("light", "dark"), ("wet", "dry"), ("full", "empty"), ("hard", "soft"),
    ("long", "short"), ("early", "late"), ("left", "right"), ("day", "night"), ("loud", "quiet"),
    ("rich", "poor"),
)  # fmt: skip
"""word pairs for "What is the opposite of X?" (asked in both directions; every word occurs once)"""
_OPPOSITE = {a: b for a, b in OPPOSITES} | {b: a for a, b in OPPOSITES}

_MAX_TRIES = 10_000


# ----- scenes --------------------------------------------------------------------------


@dataclass(frozen=True)
class SceneObject:
    """One filled shape, centred in grid cell `cell` (0..8, reading order)."""

    shape: str
    colour: str
    cell: int

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise SpecDecError(f"shape {self.shape!r} is not known; use one of {', '.join(SHAPES)}")
        if self.colour not in COLOURS:
            raise SpecDecError(f"colour {self.colour!r} is not known; use one of {', '.join(COLOURS)}")
        if not isinstance(self.cell, int) or not 0 <= self.cell < GRID * GRID:
            raise SpecDecError(f"cell {self.cell!r} must be an integer in 0..{GRID * GRID - 1}")

    @property
    def name(self) -> str:
        """e.g. "red circle" """
        return f"{self.colour} {self.shape}"


@dataclass(frozen=True)
class Scene:
    """Objects in distinct cells, and optionally a sign (a 1-3 letter uppercase word) in a free cell."""

    objects: tuple[SceneObject, ...]
    sign: str | None = None
    sign_cell: int | None = None

    def __post_init__(self) -> None:
        cells = [o.cell for o in self.objects]
        if len(set(cells)) != len(cells):
            raise SpecDecError(f"scene objects must be in distinct cells, got cells {cells}")
        if (self.sign is None) != (self.sign_cell is None):
            raise SpecDecError(f"a sign needs both a word and a cell, got sign={self.sign!r}, sign_cell={self.sign_cell!r}")
        if self.sign is not None:
            if not (1 <= len(self.sign) <= 3 and self.sign.isascii() and self.sign.isalpha() and self.sign.isupper()):
                raise SpecDecError(f"sign {self.sign!r} must be 1-3 uppercase ASCII letters, e.g. 'CAT'")
            if not isinstance(self.sign_cell, int) or not 0 <= self.sign_cell < GRID * GRID or self.sign_cell in cells:
                raise SpecDecError(f"sign_cell {self.sign_cell!r} must be a cell in 0..8 that no object occupies (objects: {cells})")

    def key(self) -> str:
        """Canonical string (objects in reading order), e.g. "0:red-circle;4:blue-square|sign@5:CAT"."""
        body = ";".join(f"{o.cell}:{o.colour}-{o.shape}" for o in self.ordered())
        return body + (f"|sign@{self.sign_cell}:{self.sign}" if self.sign is not None else "")

    def ordered(self) -> list[SceneObject]:
        """The objects in reading order (by cell)."""
        return sorted(self.objects, key=lambda o: o.cell)

    def unique_by(self, key: Callable[[SceneObject], str]) -> list[SceneObject]:
        """The objects, in reading order, whose `key` (shape, colour, name) no other object
        shares: a question or an edit can name each of them by it alone."""
        counts = Counter(key(o) for o in self.objects)
        return [o for o in self.ordered() if counts[key(o)] == 1]

    def free_cells(self) -> list[int]:
        """Cells holding neither an object nor the sign."""
        taken = {o.cell for o in self.objects} | ({self.sign_cell} if self.sign_cell is not None else set())
        return [c for c in range(GRID * GRID) if c not in taken]


def _cell_origin(cell: int) -> tuple[int, int]:
    return (cell % GRID) * CELL_SIZE, (cell // GRID) * CELL_SIZE


def cell_center(cell: int) -> tuple[int, int]:
    """A pixel (x, y) at the centre of `cell` in a 96-px render (inside any object drawn there)."""
    x0, y0 = _cell_origin(cell)
    return x0 + CELL_SIZE // 2, y0 + CELL_SIZE // 2


@functools.lru_cache(maxsize=1)
def _sign_font() -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    """PIL's default font: the bundled FreeType font at 12 px, or the bitmap font without FreeType."""
    if features.check("freetype2"):
        return ImageFont.load_default(size=_SIGN_FONT_SIZE)
    return ImageFont.load_default_imagefont()


def _draw_object(draw: ImageDraw.ImageDraw, obj: SceneObject) -> None:
    x0, y0 = _cell_origin(obj.cell)
    fill = COLOURS[obj.colour]
    if obj.shape == "circle":  # 22 px across
        draw.ellipse((x0 + 5, y0 + 5, x0 + 26, y0 + 26), fill=fill)
    elif obj.shape == "square":  # 20 px
        draw.rectangle((x0 + 6, y0 + 6, x0 + 25, y0 + 25), fill=fill)
    elif obj.shape == "triangle":  # 23 px wide, 23 px tall, pointing up
        draw.polygon([(x0 + 4, y0 + 26), (x0 + 27, y0 + 26), (x0 + 15.5, y0 + 4)], fill=fill)
    else:  # diamond: 25 px tip to tip
        draw.polygon([(x0 + 15.5, y0 + 3), (x0 + 28, y0 + 15.5), (x0 + 15.5, y0 + 28), (x0 + 3, y0 + 15.5)], fill=fill)


def _draw_sign(draw: ImageDraw.ImageDraw, word: str, cell: int) -> None:
    """A white 30x16 board with a grey border; the word in black, un-antialiased and double-struck (bold)."""
    x0, y0 = _cell_origin(cell)
    draw.rectangle((x0 + 1, y0 + 8, x0 + 30, y0 + 23), fill=SIGN_FILL, outline=SIGN_BORDER)
    font = _sign_font()
    left, top, right, bottom = draw.textbbox((0, 0), word, font=font)
    x = x0 + (CELL_SIZE - (right - left + 1)) // 2 - left
    y = y0 + (CELL_SIZE - (bottom - top)) // 2 - top
    draw.text((x, y), word, font=font, fill=SIGN_TEXT)
    draw.text((x + 1, y), word, font=font, fill=SIGN_TEXT)


def render(scene: Scene, size: int = IMAGE_SIZE) -> Image.Image:
    """The scene as an RGB image `size` px square (drawn at 96 px, then resized if `size` differs)."""
    if not isinstance(size, int) or size < 1:
        raise SpecDecError(f"image size {size!r} must be a positive integer")
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    draw.fontmode = "1"
    for obj in scene.ordered():
        _draw_object(draw, obj)
    if scene.sign is not None and scene.sign_cell is not None:
        _draw_sign(draw, scene.sign, scene.sign_cell)
    if size != IMAGE_SIZE:
        resample = Image.Resampling.NEAREST if size % IMAGE_SIZE == 0 else Image.Resampling.BICUBIC
        image = image.resize((size, size), resample)
    return image


def random_scene(rng: random.Random, min_objects: int = 1, max_objects: int = 4, sign_prob: float = 0.25) -> Scene:
    """Uniform 1-4 objects (distinct cells, no two with the same colour and shape); a sign with probability `sign_prob`."""
    most = GRID * GRID - (1 if sign_prob > 0 else 0)  # a sign needs a free cell
    if not 0 <= min_objects <= max_objects <= most:
        raise SpecDecError(f"need 0 <= min_objects <= max_objects <= {most}, got min_objects={min_objects}, max_objects={max_objects}")
    n = rng.randint(min_objects, max_objects)
    cells = rng.sample(range(GRID * GRID), n)
    kinds = rng.sample([(s, c) for s in SHAPES for c in COLOURS], n)
    objects = tuple(sorted((SceneObject(s, c, cell) for (s, c), cell in zip(kinds, cells, strict=True)), key=lambda o: o.cell))
    if rng.random() < sign_prob:
        free = [c for c in range(GRID * GRID) if c not in cells]
        return Scene(objects, rng.choice(SIGN_WORDS), rng.choice(free))
    return Scene(objects)


def scene_split(scene: Scene) -> Split:
    """The scene's split: "eval" for 1 in 8 scenes (sha256 of `scene.key()`), else "train"."""
    digest = hashlib.sha256(scene.key().encode("utf-8")).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_ONE_IN == 0 else "train"


# ----- phrasing ------------------------------------------------------------------------


def location(cell: int) -> str:
    """The cell as a location phrase: "at the top left", "on the left", "in the center", ..."""
    return f"{_AT[cell]} {CELL_NAMES[cell]}"


def _a(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _count_sentence(n: int, noun: str) -> str:
    if n == 0:
        return f"There are no {noun}s."
    if n == 1:
        return f"There is one {noun}."
    return f"There are {NUMBER_WORDS[n]} {noun}s."


def describe_scene(scene: Scene) -> str:
    """ "There is a red circle at the top left, a blue square in the center and a sign that says CAT on the right." """
    parts = [f"{_a(o.name)} {location(o.cell)}" for o in scene.ordered()]
    if scene.sign is not None and scene.sign_cell is not None:
        parts.append(f"a sign that says {scene.sign} {location(scene.sign_cell)}")
    if not parts:
        return "There is nothing in the picture."
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"There is {listed}."


# ----- examples ------------------------------------------------------------------------


@dataclass
class Example:
    """One training/evaluation conversation: `turns` are (user text, assistant answer) pairs.

    The first turn's user text starts with one "<image>\\n" per scene; later turns are text only.
    """

    task: str
    scenes: list[Scene]
    turns: list[tuple[str, str]]

    def images(self, size: int = IMAGE_SIZE) -> list[Image.Image]:
        """The scenes rendered, in placeholder order."""
        return [render(s, size) for s in self.scenes]


@dataclass
class _Turn:
    """An image task's single turn, with what a follow-up question can build on."""

    scenes: list[Scene]
    question: str
    answer: str
    word: str | None = None
    """the answer's key word ("red", "triangle", "three"), when it has one"""
    colour: str | None = None
    """the colour a `colour` answer names"""


def _image_prefix(n: int) -> str:
    return f"{IMAGE_TOKEN}\n" * n


class _Draw:
    """Scenes from one split."""

    def __init__(self, rng: random.Random, split: Split) -> None:
        self.rng = rng
        self.split = split

    def scene(self, min_objects: int = 1, max_objects: int = 4, sign_prob: float = 0.25) -> Scene:
        for _ in range(_MAX_TRIES):
            scene = random_scene(self.rng, min_objects, max_objects, sign_prob)
            if scene_split(scene) == self.split:
                return scene
        raise RuntimeError(f"no {self.split} scene in {_MAX_TRIES} draws")  # pragma: no cover

    def unique_object(self, scene: Scene, key: Callable[[SceneObject], str]) -> SceneObject | None:
        """A random object of `scene` that a question can name by `key` alone (`Scene.unique_by`),
        or None when there is none."""
        unique = scene.unique_by(key)
        return self.rng.choice(unique) if unique else None


def _describe(d: _Draw) -> _Turn | None:
    scene = d.scene()
    return _Turn([scene], d.rng.choice(("What is in the picture?", "Describe the image.")), describe_scene(scene))


def _count(d: _Draw) -> _Turn | None:
    scene = d.scene()
    rng = d.rng
    kind = rng.choice(("objects", "colour", "shape"))
    if kind == "objects":
        n, noun = len(scene.objects), "object"
    elif kind == "colour":
        present = sorted({o.colour for o in scene.objects}, key=list(COLOURS).index)
        colour = rng.choice(present) if rng.random() < 0.5 else rng.choice(list(COLOURS))
        n, noun = sum(o.colour == colour for o in scene.objects), f"{colour} object"
    else:
        present = sorted({o.shape for o in scene.objects}, key=SHAPES.index)
        shape = rng.choice(present) if rng.random() < 0.5 else rng.choice(SHAPES)
        n, noun = sum(o.shape == shape for o in scene.objects), shape
    return _Turn([scene], f"How many {noun}s are there?", _count_sentence(n, noun), word=NUMBER_WORDS[n])


def _colour(d: _Draw) -> _Turn | None:
    scene = d.scene()
    obj = d.unique_object(scene, lambda o: o.shape)
    if obj is None:
        return None
    return _Turn([scene], f"What colour is the {obj.shape}?", f"The {obj.shape} is {obj.colour}.", word=obj.colour, colour=obj.colour)


def _shape(d: _Draw) -> _Turn | None:
    scene = d.scene()
    obj = d.unique_object(scene, lambda o: o.colour)
    if obj is None:
        return None
    return _Turn([scene], f"What shape is the {obj.colour} object?", f"The {obj.colour} object is {_a(obj.shape)}.", word=obj.shape)


def _where(d: _Draw) -> _Turn | None:
    scene = d.scene()
    if scene.sign_cell is not None and d.rng.random() < 0.25:
        return _Turn([scene], "Where is the sign?", f"The sign is {location(scene.sign_cell)}.")
    obj = d.unique_object(scene, lambda o: o.name)
    if obj is None:
        return None
    return _Turn([scene], f"Where is the {obj.name}?", f"The {obj.name} is {location(obj.cell)}.")


def _read(d: _Draw) -> _Turn | None:
    scene = d.scene(sign_prob=1.0)
    return _Turn([scene], d.rng.choice(("What does the sign say?", "What word is on the sign?")), f"The sign says {scene.sign}.")


def _edit(rng: random.Random, scene: Scene) -> tuple[Scene, str] | None:
    """One random edit of `scene` (move, recolour, add or remove an object) and the sentence describing it."""
    objs = scene.ordered()
    free = scene.free_cells()
    movable = scene.unique_by(lambda o: o.name)
    recolourable = scene.unique_by(lambda o: o.shape)
    options = []
    if movable and free:
        options.append("move")
    if recolourable:
        options.append("recolour")
    if len(objs) < 4 and free:
        options.append("add")
    if len(objs) >= 2 and movable:
        options.append("remove")
    if not options:
        return None
    kind = rng.choice(options)
    if kind == "move":
        obj = rng.choice(movable)
        cell = rng.choice(free)
        new = [SceneObject(obj.shape, obj.colour, cell) if o is obj else o for o in objs]
        answer = f"The {obj.name} moved from the {CELL_NAMES[obj.cell]} to the {CELL_NAMES[cell]}."
    elif kind == "recolour":
        obj = rng.choice(recolourable)
        colour = rng.choice([c for c in COLOURS if c != obj.colour])
        new = [SceneObject(obj.shape, colour, obj.cell) if o is obj else o for o in objs]
        answer = f"The {obj.shape} changed from {obj.colour} to {colour}."
    elif kind == "add":
        names = {o.name for o in objs}
        shape, colour = rng.choice([(s, c) for s in SHAPES for c in COLOURS if f"{c} {s}" not in names])
        cell = rng.choice(free)
        new = [*objs, SceneObject(shape, colour, cell)]
        answer = f"{_cap(_a(f'{colour} {shape}'))} was added {location(cell)}."
    else:
        obj = rng.choice(movable)
        new = [o for o in objs if o is not obj]
        answer = f"The {obj.name} was removed."
    return Scene(tuple(sorted(new, key=lambda o: o.cell)), scene.sign, scene.sign_cell), answer


def _change(d: _Draw) -> _Turn | None:
    first = d.scene()
    for _ in range(200):
        edited = _edit(d.rng, first)
        if edited is None:
            return None
        if scene_split(edited[0]) == d.split:
            return _Turn([first, edited[0]], "What changed between the two images?", edited[1])
    return None


def text_turn(rng: random.Random) -> tuple[str, str]:
    """An image-free question and its answer: a small sum, the next weekday, spelling, or an opposite."""
    kind = rng.choice(("add", "after", "spell", "opposite"))
    if kind == "add":
        a, b = rng.choice([(a, b) for a in range(11) for b in range(11 - a)])
        x, y, s = NUMBER_WORDS[a], NUMBER_WORDS[b], NUMBER_WORDS[a + b]
        return f"What is {x} plus {y}?", f"{_cap(x)} plus {y} is {s}."
    if kind == "after":
        i = rng.randrange(len(DAYS))
        return f"What comes after {DAYS[i]}?", f"{DAYS[(i + 1) % len(DAYS)]} comes after {DAYS[i]}."
    if kind == "spell":
        word = rng.choice(SIGN_WORDS)
        return f"Spell the word {word.lower()}.", " ".join(word) + "."
    word = rng.choice(sorted(_OPPOSITE))
    return f"What is the opposite of {word}?", f"The opposite of {word} is {_OPPOSITE[word]}."


_IMAGE_TASKS = {
    "describe": _describe,
    "count": _count,
    "colour": _colour,
    "shape": _shape,
    "where": _where,
    "read": _read,
    "change": _change,
}


def _followup(d: _Draw) -> Example | None:
    first_task = d.rng.choice(FOLLOWUP_FIRST_TASKS)
    first = _IMAGE_TASKS[first_task](d)
    if first is None:
        return None
    options = ["repeat", "text"]
    if first.word is not None:
        options.append("one word")
    if first.colour is not None:
        options.append("warm")
    kind = d.rng.choice(options)
    if kind == "repeat":
        second = ("Repeat your answer.", first.answer)
    elif kind == "one word":
        second = ("Answer in one word.", f"{_cap(first.word or '')}.")
    elif kind == "warm":
        colour = first.colour or ""
        warm = colour in WARM_COLOURS
        second = ("Is that a warm colour?", f"Yes, {colour} is a warm colour." if warm else f"No, {colour} is not a warm colour.")
    else:
        second = text_turn(d.rng)
    return Example("followup", first.scenes, [(_image_prefix(len(first.scenes)) + first.question, first.answer), second])


def _story(d: _Draw) -> Example:
    scenes = [d.scene() for _ in range(5)]
    return Example("story", scenes, [(_image_prefix(5) + "Tell a story about these five pictures.", "")])


def _check_split(split: str) -> Split:
    if split not in SPLITS:
        raise SpecDecError(f"split {split!r} is not known; use 'train' or 'eval'")
    return "eval" if split == "eval" else "train"


def _check_task(task: str) -> str:
    if task not in TASKS:
        raise SpecDecError(f"task {task!r} is not known; use one of {', '.join(TASKS)}")
    return task


def make_example(rng: random.Random, split: str, task: str | None = None) -> Example:
    """One example whose scenes all belong to `split`; `task=None` draws one from `TRAIN_MIXTURE`.

    `story` (five images, no reference answer) is out of distribution: eval split only.
    """
    which = _check_split(split)
    if task is None:
        task = rng.choices(list(TRAIN_MIXTURE), weights=list(TRAIN_MIXTURE.values()))[0]
    _check_task(task)
    if task == "story" and which != "eval":
        raise SpecDecError("task 'story' is evaluation only (out of distribution); ask for it with split='eval'")
    d = _Draw(rng, which)
    for _ in range(_MAX_TRIES):
        if task == "text":
            return Example("text", [], [text_turn(rng)])
        if task == "story":
            return _story(d)
        if task == "followup":
            example = _followup(d)
            if example is not None:
                return example
            continue
        turn = _IMAGE_TASKS[task](d)
        if turn is not None:
            return Example(task, turn.scenes, [(_image_prefix(len(turn.scenes)) + turn.question, turn.answer)])
    raise RuntimeError(f"could not build a {task!r} example in {_MAX_TRIES} tries")  # pragma: no cover


def _derive_seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode("utf-8")).digest()[:8], "big")


def generate_examples(n: int, seed: int, split: str, tasks: Sequence[str] | None = None) -> list[Example]:
    """`n` examples from `split`, deterministic in (`seed`, `split`); a prefix of the list for any larger `n`.

    `tasks=None`: the training mixture; otherwise each example's task is drawn uniformly from
    `tasks` (repeat a name to weight it).
    """
    which = _check_split(split)
    if tasks is not None:
        if not tasks:
            raise SpecDecError("tasks must name at least one task (or be None for the training mixture)")
        for t in tasks:
            _check_task(t)
    rng = random.Random(_derive_seed("examples", seed, which))
    return [make_example(rng, which, rng.choice(list(tasks)) if tasks is not None else None) for _ in range(n)]


# ----- conversation format -------------------------------------------------------------


def format_conversation(turns: Sequence[tuple[str, str]], upto: int | None = None, eos: str = "</s>") -> str:
    """LLaVA-1.5 style text of a conversation.

    Each turn is `"USER: " + user + " ASSISTANT: " + answer + eos`, concatenated with nothing
    in between (no space or newline after eos), e.g.

        "USER: <image>\\nWhat is in the picture? ASSISTANT: There is a red circle at the top.</s>"
        "USER: Answer in one word. ASSISTANT: Red.</s>"

    `upto=k` renders turns 0..k-1 in full, then turn k's user text followed by " ASSISTANT:"
    (no trailing space): the prompt whose continuation is answer k (" " + answer + eos).
    """
    if upto is None:
        end = len(turns)
    elif isinstance(upto, int) and 0 <= upto < len(turns):
        end = upto
    else:
        raise SpecDecError(f"upto={upto!r} must be a turn index in 0..{len(turns) - 1} (or None for the whole conversation)")
    text = "".join(f"USER: {user} ASSISTANT: {answer}{eos}" for user, answer in turns[:end])
    if upto is not None:
        text += f"USER: {turns[upto][0]} ASSISTANT:"
    return text


# ----- benchmark prompt sets -----------------------------------------------------------


@dataclass
class ScenarioItem:
    """One benchmark prompt: text with one `<image>` per entry of `images`; `answer` None when there is no reference."""

    id: str
    prompt: str
    images: list[Image.Image]
    answer: str | None
    task: str


def check_scenario(name: str) -> str:
    """`name` if it is one of `SCENARIOS`, else a SpecDecError listing them."""
    if name not in SCENARIOS:
        raise SpecDecError(f"scenario {name!r} is not known; use one of {', '.join(SCENARIOS)}")
    return name


def scenario_items(name: str, n: int = 24, seed: int = 1234) -> list[ScenarioItem]:
    """`n` prompts of a TABED-style scenario, all from the eval split (a prefix of the list for any larger `n`).

    - "scenes-first-turn": single-turn image tasks (`FIRST_TURN_MIXTURE`, incl. change and read);
      prompt = turn 0 up to " ASSISTANT:".
    - "scenes-second-turn": `followup` conversations; prompt = turn 0 in full + turn 1's user
      text + " ASSISTANT:"; answer = turn 1's answer.
    - "scenes-ood": `story` over five images; no reference answer.
    """
    check_scenario(name)
    if not isinstance(n, int) or n < 0:
        raise SpecDecError(f"n={n!r} must be a non-negative integer")
    rng = random.Random(_derive_seed("scenario", name, seed))
    items = []
    for i in range(n):
        if name == "scenes-first-turn":
            task = rng.choices(list(FIRST_TURN_MIXTURE), weights=list(FIRST_TURN_MIXTURE.values()))[0]
            upto = 0
        elif name == "scenes-second-turn":
            task, upto = "followup", 1
        else:
            task, upto = "story", 0
        example = make_example(rng, "eval", task)
        answer = example.turns[upto][1] or None
        items.append(ScenarioItem(f"{name}-{i:03d}", format_conversation(example.turns, upto=upto), example.images(), answer, task))
    return items


def export_scenario(name: str, out_dir: Path, n: int = 24, seed: int = 1234) -> Path:
    """Write `out_dir/<name>.jsonl` and `out_dir/images/<id>-<k>.png`; returns the JSONL path.

    Each line: {"id", "prompt", "images" (paths relative to the JSONL file), "reference", "task"}.
    """
    items = scenario_items(name, n, seed)
    out_dir = Path(out_dir)
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    lines = []
    for item in items:
        paths = []
        for k, image in enumerate(item.images):
            rel = f"images/{item.id}-{k}.png"
            image.save(out_dir / rel, format="PNG")
            paths.append(rel)
        row: dict[str, Any] = {"id": item.id, "prompt": item.prompt, "images": paths, "reference": item.answer, "task": item.task}
        lines.append(json.dumps(row))
    path = out_dir / f"{name}.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""), encoding="utf-8")
    return path
