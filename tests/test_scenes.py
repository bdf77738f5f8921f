"""Synthetic multimodal scenes: rendering, splits, task answers, conversation format, benchmark prompt sets."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from specdec.bench.prompts import load_prompts, resolve_prompt_source
from specdec.errors import SpecDecError
from specdec.multimodal import scenes as sc
from specdec.multimodal.scenes import (
    CELL_NAMES,
    COLOURS,
    IMAGE_SIZE,
    SCENARIOS,
    SHAPES,
    Example,
    Scene,
    SceneObject,
    cell_center,
    export_scenario,
    format_conversation,
    generate_examples,
    make_example,
    random_scene,
    render,
    scenario_items,
    scene_split,
)

NUM = {w: i for i, w in enumerate(sc.NUMBER_WORDS)}
IMAGE_TASKS = ("describe", "count", "colour", "shape", "where", "read", "change", "followup")


def _pixels(image: Image.Image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


def _cell_of(name: str) -> int:
    return CELL_NAMES.index(name)


def _loc_cell(phrase: str) -> int:
    """Map "at the top left" / "on the left" / "in the center" to a cell index."""
    m = re.fullmatch(r"(?:at|on|in) the (.+)", phrase)
    assert m, phrase
    return _cell_of(m.group(1))


def _by_name(scene: Scene) -> dict[str, SceneObject]:
    return {o.name: o for o in scene.objects}


# ----- scenes and rendering -------------------------------------------------------------


def test_render_size_colours_and_sign():
    scene = Scene(
        (SceneObject("circle", "red", 0), SceneObject("triangle", "orange", 4), SceneObject("diamond", "yellow", 8)),
        sign="DOG",
        sign_cell=6,
    )
    image = render(scene)
    assert image.mode == "RGB" and image.size == (IMAGE_SIZE, IMAGE_SIZE)
    px = _pixels(image)
    for obj in scene.objects:
        x, y = cell_center(obj.cell)
        assert tuple(px[y, x]) == COLOURS[obj.colour]
    for cell in (1, 2, 3, 5, 7):  # empty cells are background only
        x0, y0 = (cell % 3) * 32, (cell // 3) * 32
        assert (px[y0 : y0 + 32, x0 : x0 + 32] == sc.BACKGROUND).all()
    board = px[64 + 9 : 64 + 23, 2:30]  # the sign's inside: white board, black letters
    black = (board == 0).all(-1)
    assert 20 < black.sum() < board.shape[0] * board.shape[1] // 2
    assert ((board == 255).all(-1) | black).all()
    assert render(scene, 192).size == (192, 192) and render(scene, 224).size == (224, 224)
    with pytest.raises(SpecDecError, match="image size"):
        render(scene, 0)


def test_every_sign_word_renders_distinctly_inside_the_board():
    seen = set()
    for word in sc.SIGN_WORDS:
        px = _pixels(render(Scene((), sign=word, sign_cell=4)))
        ys, xs = np.nonzero((px == 0).all(-1))
        assert xs.min() >= 32 + 2 and xs.max() <= 32 + 29 and ys.min() >= 32 + 9 and ys.max() <= 32 + 22, word
        seen.add(px.tobytes())
    assert len(seen) == len(sc.SIGN_WORDS) and len(set(sc.SIGN_WORDS)) >= 25


def test_object_pixels_match_random_scenes():
    rng = random.Random(7)
    for _ in range(150):
        scene = random_scene(rng)
        assert 1 <= len(scene.objects) <= 4
        assert len({(o.shape, o.colour) for o in scene.objects}) == len(scene.objects)
        px = _pixels(render(scene))
        for obj in scene.objects:
            x, y = cell_center(obj.cell)
            assert tuple(px[y, x]) == COLOURS[obj.colour], (scene.key(), obj)


def test_scene_validation_and_key():
    a = Scene((SceneObject("square", "blue", 4), SceneObject("circle", "red", 0)), "CAT", 5)
    b = Scene((SceneObject("circle", "red", 0), SceneObject("square", "blue", 4)), "CAT", 5)
    assert a.key() == b.key() == "0:red-circle;4:blue-square|sign@5:CAT"
    assert Scene((SceneObject("circle", "red", 0),)).key() != a.key()
    with pytest.raises(SpecDecError, match="distinct cells"):
        Scene((SceneObject("circle", "red", 0), SceneObject("square", "blue", 0)))
    with pytest.raises(SpecDecError, match="sign_cell"):
        Scene((SceneObject("circle", "red", 0),), "CAT", 0)
    with pytest.raises(SpecDecError, match="hexagon"):
        SceneObject("hexagon", "red", 0)
    with pytest.raises(SpecDecError, match="pink"):
        SceneObject("circle", "pink", 0)
    with pytest.raises(SpecDecError, match="cell 9"):
        SceneObject("circle", "red", 9)


def test_splits_are_disjoint_and_about_one_in_eight():
    rng = random.Random(0)
    splits = Counter(scene_split(random_scene(rng)) for _ in range(4000))
    assert 0.09 < splits["eval"] / 4000 < 0.16
    keys = {}
    for split in ("train", "eval"):
        found = set()
        for ex in generate_examples(1500 if split == "train" else 600, seed=5, split=split):
            for scene in ex.scenes:
                assert scene_split(scene) == split
                found.add(scene.key())
        keys[split] = found
    assert len(keys["train"]) > 1000 and len(keys["eval"]) > 300
    assert not keys["train"] & keys["eval"]


# ----- examples -------------------------------------------------------------------------


def test_determinism():
    a = generate_examples(60, seed=11, split="train")
    b = generate_examples(60, seed=11, split="train")
    assert a == b
    assert a != generate_examples(60, seed=12, split="train")
    assert generate_examples(20, seed=11, split="train") == a[:20]
    assert [s.key() for e in a for s in e.scenes] == [s.key() for e in b for s in e.scenes]
    for ea, eb in zip(a[:15], b[:15], strict=True):
        assert [im.tobytes() for im in ea.images()] == [im.tobytes() for im in eb.images()]
    e1 = make_example(random.Random(3), "eval", "change")
    e2 = make_example(random.Random(3), "eval", "change")
    assert e1 == e2
    assert [i.tobytes() for i in e1.images()] == [i.tobytes() for i in e2.images()]


def test_training_mixture_covers_tasks_but_never_story():
    tasks = Counter(e.task for e in generate_examples(600, seed=1, split="train"))
    assert set(tasks) == set(sc.TRAIN_MIXTURE) and "story" not in tasks
    with pytest.raises(SpecDecError, match="evaluation only"):
        make_example(random.Random(0), "train", "story")
    with pytest.raises(SpecDecError, match="'nope' is not known"):
        generate_examples(1, seed=0, split="train", tasks=["nope"])
    with pytest.raises(SpecDecError, match="'dev'"):
        generate_examples(1, seed=0, split="dev")


@pytest.mark.parametrize("task", sc.TASKS)
def test_every_task_is_well_formed(task):
    split = "eval" if task == "story" else "train"
    for ex in generate_examples(40, seed=2, split=split, tasks=[task]):
        assert isinstance(ex, Example) and ex.task == task and ex.turns
        n_images = {"text": 0, "change": 2, "story": 5}.get(task, 1)
        assert len(ex.scenes) == n_images
        assert len(ex.turns) == (2 if task == "followup" else 1)
        first_user = ex.turns[0][0]
        assert first_user.startswith("<image>\n" * n_images) and first_user.count("<image>") == n_images
        assert first_user.count("\n") == n_images  # exactly one newline after each placeholder, none elsewhere
        for k, (user, answer) in enumerate(ex.turns):
            assert user.strip() == user or user.startswith("<image>")
            assert user.endswith(("?", ".")) and "</s>" not in user + answer
            if k > 0:
                assert "<image>" not in user
            if task == "story":
                assert answer == ""
            else:
                assert answer[0].isupper() and answer.endswith(".") and "\n" not in answer and len(answer) < 200


def test_answers_agree_with_scenes():
    examples = generate_examples(400, seed=4, split="train", tasks=["describe", "count", "colour", "shape", "where", "read"])
    checked = Counter()
    for ex in examples:
        (scene,) = ex.scenes
        question, answer = ex.turns[0]
        question = question.removeprefix("<image>\n")
        objs = scene.objects
        px = _pixels(render(scene))
        if ex.task == "count":
            assert re.fullmatch(r"How many (\w+ )?\w+s are there\?", question), question
            words = question.removeprefix("How many ").removesuffix("s are there?").split()
            if words == ["object"]:
                n = len(objs)
            elif words[0] in COLOURS:
                n = sum(o.colour == words[0] for o in objs)
            else:
                assert words[0] in SHAPES
                n = sum(o.shape == words[0] for o in objs)
            a = re.fullmatch(r"There (?:is|are) (\w+) (.+)\.", answer)
            assert a, answer
            assert (0 if a.group(1) == "no" else NUM[a.group(1)]) == n
        elif ex.task == "colour":
            shape = re.fullmatch(r"What colour is the (\w+)\?", question).group(1)
            (obj,) = [o for o in objs if o.shape == shape]
            assert answer == f"The {shape} is {obj.colour}."
            x, y = cell_center(obj.cell)
            assert tuple(px[y, x]) == COLOURS[obj.colour]
        elif ex.task == "shape":
            colour = re.fullmatch(r"What shape is the (\w+) object\?", question).group(1)
            (obj,) = [o for o in objs if o.colour == colour]
            assert re.fullmatch(rf"The {colour} object is an? {obj.shape}\.", answer)
        elif ex.task == "where":
            m = re.fullmatch(r"The (.+) is ((?:at|on|in) the .+)\.", answer)
            assert m, answer
            cell = _loc_cell(m.group(2))
            if m.group(1) == "sign":
                assert question == "Where is the sign?" and scene.sign_cell == cell
            else:
                obj = _by_name(scene)[m.group(1)]
                assert question == f"Where is the {obj.name}?" and obj.cell == cell
                x, y = cell_center(cell)
                assert tuple(px[y, x]) == COLOURS[obj.colour]
        elif ex.task == "read":
            assert scene.sign is not None and answer == f"The sign says {scene.sign}."
        elif ex.task == "describe":
            body = answer.removeprefix("There is ").removesuffix(".")
            parts = re.split(r", | and ", body)
            sign = [p for p in parts if p.startswith("a sign")]
            mentioned = []
            for part in parts:
                if part.startswith("a sign"):
                    continue
                m = re.fullmatch(r"an? (\w+) (\w+) ((?:at|on|in) the .+)", part)
                assert m, part
                mentioned.append(SceneObject(m.group(2), m.group(1), _loc_cell(m.group(3))))
            assert mentioned == sorted(objs, key=lambda o: o.cell)  # every object, in reading order
            assert sign == ([f"a sign that says {scene.sign} {sc.location(scene.sign_cell)}"] if scene.sign else [])
        checked[ex.task] += 1
    assert set(checked) == {"describe", "count", "colour", "shape", "where", "read"}


def _apply_change(first: Scene, answer: str) -> tuple[str, Scene]:
    """The kind of edit `answer` describes, and the second scene it implies, built from `first`."""
    objs = list(first.objects)
    if m := re.fullmatch(r"The (\w+ \w+) moved from the (.+) to the (.+)\.", answer):
        kind, obj = "move", _by_name(first)[m.group(1)]
        assert obj.cell == _cell_of(m.group(2))
        objs = [SceneObject(o.shape, o.colour, _cell_of(m.group(3))) if o == obj else o for o in objs]
    elif m := re.fullmatch(r"The (\w+) changed from (\w+) to (\w+)\.", answer):
        kind, (obj,) = "recolour", [o for o in objs if o.shape == m.group(1)]
        assert obj.colour == m.group(2) and m.group(3) != m.group(2)
        objs = [SceneObject(o.shape, m.group(3), o.cell) if o == obj else o for o in objs]
    elif m := re.fullmatch(r"An? (\w+) (\w+) was added ((?:at|on|in) the .+)\.", answer):
        kind = "add"
        objs.append(SceneObject(m.group(2), m.group(1), _loc_cell(m.group(3))))
    elif m := re.fullmatch(r"The (\w+ \w+) was removed\.", answer):
        kind = "remove"
        objs.remove(_by_name(first)[m.group(1)])
    else:
        raise AssertionError(f"unexpected change answer {answer!r}")
    return kind, Scene(tuple(objs), first.sign, first.sign_cell)


def test_change_examples_differ_exactly_as_described():
    kinds = Counter()
    for split in ("train", "eval"):
        for ex in generate_examples(120, seed=9, split=split, tasks=["change"]):
            first, second = ex.scenes
            question, answer = ex.turns[0]
            assert question == "<image>\n<image>\nWhat changed between the two images?"
            assert scene_split(first) == scene_split(second) == split
            kind, implied = _apply_change(first, answer)
            assert implied.key() == second.key() != first.key()
            kinds[kind] += 1
            # the renders differ in exactly the cells the edit touches (2 for a move, else 1)
            a, b = _pixels(render(first)), _pixels(render(second))
            cells = [(slice((c // 3) * 32, (c // 3) * 32 + 32), slice((c % 3) * 32, (c % 3) * 32 + 32)) for c in range(9)]
            changed = [c for c, (ys, xs) in enumerate(cells) if (a[ys, xs] != b[ys, xs]).any()]
            assert len(changed) == (2 if kind == "move" else 1)
    assert set(kinds) == {"move", "recolour", "add", "remove"}


def test_text_and_followup_answers():
    for ex in generate_examples(200, seed=3, split="train", tasks=["text"]):
        ((q, a),) = ex.turns
        if m := re.fullmatch(r"What is (\w+) plus (\w+)\?", q):
            x, y = NUM[m.group(1)], NUM[m.group(2)]
            assert x + y <= 10 and a == f"{m.group(1).capitalize()} plus {m.group(2)} is {sc.NUMBER_WORDS[x + y]}."
        elif m := re.fullmatch(r"What comes after (\w+)\?", q):
            assert a == f"{sc.DAYS[(sc.DAYS.index(m.group(1)) + 1) % 7]} comes after {m.group(1)}."
        elif m := re.fullmatch(r"Spell the word (\w+)\.", q):
            assert a == " ".join(m.group(1).upper()) + "."
        else:
            word = re.fullmatch(r"What is the opposite of (\w+)\?", q).group(1)
            other = re.fullmatch(rf"The opposite of {word} is (\w+)\.", a).group(1)
            assert (word, other) in sc.OPPOSITES or (other, word) in sc.OPPOSITES
    seen = Counter()
    for ex in generate_examples(300, seed=3, split="train", tasks=["followup"]):
        (q0, a0), (q1, a1) = ex.turns
        seen[q1 if q1 in ("Repeat your answer.", "Answer in one word.", "Is that a warm colour?") else "text"] += 1
        if q1 == "Repeat your answer.":
            assert a1 == a0
        elif q1 == "Answer in one word.":
            assert re.fullmatch(r"[A-Z][a-z]+\.", a1) and a1[:-1].lower() in a0.lower().replace("no ", "zero ")
        elif q1 == "Is that a warm colour?":
            colour = re.fullmatch(r"The \w+ is (\w+)\.", a0).group(1)
            warm = colour in ("red", "orange", "yellow")
            assert a1 == (f"Yes, {colour} is a warm colour." if warm else f"No, {colour} is not a warm colour.")
    assert set(seen) == {"Repeat your answer.", "Answer in one word.", "Is that a warm colour?", "text"}


# ----- conversation format --------------------------------------------------------------


def test_format_conversation_exact():
    turns = [("<image>\nWhat colour is the circle?", "The circle is red."), ("Answer in one word.", "Red.")]
    assert format_conversation(turns) == (
        "USER: <image>\nWhat colour is the circle? ASSISTANT: The circle is red.</s>USER: Answer in one word. ASSISTANT: Red.</s>"
    )
    assert format_conversation(turns, upto=0) == "USER: <image>\nWhat colour is the circle? ASSISTANT:"
    assert format_conversation(turns, upto=1) == (
        "USER: <image>\nWhat colour is the circle? ASSISTANT: The circle is red.</s>USER: Answer in one word. ASSISTANT:"
    )
    assert format_conversation(turns, eos="<|end|>") == (
        "USER: <image>\nWhat colour is the circle? ASSISTANT: The circle is red.<|end|>USER: Answer in one word. ASSISTANT: Red.<|end|>"
    )
    # the prompt for answer k, continued with " " + answer + eos, is the full conversation up to k
    assert format_conversation(turns, upto=1) + " Red.</s>" == format_conversation(turns)
    for bad in (2, -1):
        with pytest.raises(SpecDecError, match="upto"):
            format_conversation(turns, upto=bad)


# ----- benchmark prompt sets ------------------------------------------------------------


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_items(name):
    items = scenario_items(name, n=12, seed=7)
    assert len(items) == 12 and len({i.id for i in items}) == 12
    assert [i.prompt for i in items] == [i.prompt for i in scenario_items(name, n=12, seed=7)]
    assert [i.prompt for i in items[:5]] == [i.prompt for i in scenario_items(name, n=5, seed=7)]
    other = scenario_items(name, n=12, seed=8)
    assert [(i.prompt, [im.tobytes() for im in i.images]) for i in items] != [(i.prompt, [im.tobytes() for im in i.images]) for i in other]
    for item in items:
        n = item.prompt.count("<image>")
        assert n == len(item.images) and all(im.size == (IMAGE_SIZE, IMAGE_SIZE) for im in item.images)
        assert item.prompt.startswith("USER: " + "<image>\n" * n) and item.prompt.endswith(" ASSISTANT:")
        if name == "scenes-first-turn":
            assert n in (1, 2) and item.task in sc.FIRST_TURN_MIXTURE and item.answer and item.prompt.count("USER:") == 1
        elif name == "scenes-second-turn":
            assert n >= 1 and item.task == "followup" and item.answer and item.prompt.count("USER:") == 2
            assert item.prompt.count("</s>") == 1 and "<image>" not in item.prompt.split("</s>")[1]
        else:
            assert n == 5 and item.task == "story" and item.answer is None
    if name == "scenes-first-turn":
        assert {i.task for i in scenario_items(name, n=40)} >= {"change", "read", "count", "where"}


def test_scenario_scenes_come_from_eval_split(monkeypatch):
    drawn = []
    real = sc.scene_split

    def spy(scene):
        split = real(scene)
        drawn.append((scene.key(), split))
        return split

    monkeypatch.setattr(sc, "scene_split", spy)
    items = scenario_items("scenes-first-turn", n=6)
    assert items and drawn and any(s == "eval" for _, s in drawn)
    # every rendered image equals the render of some eval scene
    eval_renders = {render(_scene_from_key(k)).tobytes() for k, s in drawn if s == "eval"}
    assert all(im.tobytes() in eval_renders for item in items for im in item.images)


def _scene_from_key(key: str) -> Scene:
    body, _, sign = key.partition("|sign@")
    objs = []
    for part in filter(None, body.split(";")):
        cell, _, rest = part.partition(":")
        colour, shape = rest.split("-")
        objs.append(SceneObject(shape, colour, int(cell)))
    if sign:
        cell, word = sign.split(":")
        return Scene(tuple(objs), word, int(cell))
    return Scene(tuple(objs))


def test_bad_scenario_name(tmp_path):
    for call in (lambda: scenario_items("scenes-third-turn"), lambda: export_scenario("scenes-third-turn", tmp_path)):
        with pytest.raises(SpecDecError) as info:
            call()
        assert "'scenes-third-turn'" in str(info.value) and all(name in str(info.value) for name in SCENARIOS)
    assert not list(tmp_path.iterdir())
    with pytest.raises(SpecDecError, match="scenes-first-turn"):
        resolve_prompt_source("scenes-third-turn")


@pytest.mark.parametrize("name", SCENARIOS)
def test_export_then_load_round_trip(tmp_path, name, monkeypatch):
    path = export_scenario(name, tmp_path / "out", n=6)
    assert path == tmp_path / "out" / f"{name}.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 6 and all(set(r) == {"id", "prompt", "images", "reference", "task"} for r in rows)
    assert all(p.startswith("images/") for r in rows for p in r["images"])
    monkeypatch.chdir(tmp_path)  # image paths resolve against the JSONL file, not the working directory
    from_file = load_prompts(resolve_prompt_source(str(path)))
    generated = load_prompts(resolve_prompt_source(name))
    assert resolve_prompt_source(name) == name and len(generated) == 24
    assert len(load_prompts(name, limit=30)) == 30 and [p.id for p in load_prompts(name, limit=3)] == [
        f"{name}-{i:03d}" for i in (0, 8, 16)
    ]
    items = scenario_items(name, n=6)
    for got, gen, item in zip(from_file, generated, items, strict=False):
        assert got.id == gen.id == item.id
        assert got.turns == gen.turns == [item.prompt]
        assert got.reference == gen.reference == item.answer
        assert len(got.images) == len(gen.images) == len(item.images) == item.prompt.count("<image>")
        for file, image in zip(got.images, gen.images, strict=True):
            assert file.is_absolute() or file.parent.parent == path.parent
            with Image.open(file) as opened:
                assert opened.mode == "RGB" and opened.size == image.size
                assert np.array_equal(_pixels(opened), _pixels(image))


def test_jsonl_image_paths_resolve_and_missing_image_names_file_and_line(tmp_path, monkeypatch):
    (tmp_path / "imgs").mkdir()
    render(Scene((SceneObject("circle", "red", 4),))).save(tmp_path / "imgs" / "a.png")
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"id": "x", "prompt": "USER: <image>\nHi ASSISTANT:", "images": ["imgs/a.png"]}) + "\n", encoding="utf-8")
    monkeypatch.chdir("/")
    (item,) = load_prompts(path)
    assert item.images == [tmp_path / "imgs" / "a.png"]
    path.write_text(
        json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": "USER: <image>\nHi ASSISTANT:", "images": ["imgs/missing.png"]}) + "\n",
        encoding="utf-8",
    )
    with pytest.raises(SpecDecError) as info:
        load_prompts(path)
    assert f"{path}:2" in str(info.value) and "missing.png" in str(info.value)


def test_cli_scenes_export(tmp_path, capsys):
    from specdec.cli import main

    assert main(["scenes", "--scenario", "scenes-ood", "--num", "2", "--out", str(tmp_path)]) == 0
    items = load_prompts(tmp_path / "scenes-ood.jsonl")
    assert len(items) == 2 and all(len(p.images) == 5 for p in items)
    assert main(["scenes", "--scenario", "scenes-nope", "--out", str(tmp_path)]) == 2
    assert "scenes-nope" in capsys.readouterr().err


@pytest.mark.parametrize("in_the_way", ["images", "scenes-ood.jsonl"])
def test_cli_scenes_out_holding_the_wrong_kind_of_entry(tmp_path, capsys, in_the_way):
    from specdec.cli import main

    if in_the_way == "images":
        (tmp_path / "images").write_text("a file where the images folder goes\n")
    else:
        (tmp_path / in_the_way).mkdir()
    assert main(["scenes", "--scenario", "scenes-ood", "--num", "1", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("specdec: error: --out") and f"named {in_the_way}" in err and "Traceback" not in err
