"""Non-learnable baselines and the hallucination metric: CHAIR (Table 5), RICES demonstration retrieval, task vectors
and function vectors (Table 1), on hand-made data, the toy caption task and the tiny Idefics2 twin (CPU, offline)."""
import dataclasses
import json

import pytest

import data as D
import evaluate as E

# -----------------------------------------------------------------------------
# CHAIR


def test_chair_by_hand():
    vocab = E.chair_vocabulary(E.COCO_SYNONYMS)
    annotated = {1: {"dog"}, 2: {"person", "bicycle", "backpack"}, 3: {"cat"}, 4: set()}
    references = {1: ["A dog lying on a couch."], 2: ["A man riding a bike."], 3: ["A kitten."], 4: ["An empty road."]}
    captions = {
        1: "Two dogs sitting on a sofa next to a hot dog.",   # dog (plural), couch (synonym, from the reference),
                                                             # hot dog (multi-word: hallucinated, not a dog)
        2: "Women riding bicycles near teddy bears.",         # person (irregular plural), bicycle, teddy bear (wrong)
        3: "A cat on the grass.",                             # cat
        4: "A view of the blue sky.",                         # no object at all
    }
    result, wrong = E.chair(captions, annotated, references, vocab)
    assert wrong == {1: ["hot dog"], 2: ["teddy bear"], 3: [], 4: []}
    assert result["chair_i"] == pytest.approx(2 / 7)        # 7 mentions: dog couch hot-dog / woman bicycle teddy / cat
    assert result["chair_s"] == pytest.approx(2 / 4)
    assert result["recall"] == pytest.approx(5 / 6)         # truth: {dog, couch} {person, bicycle, backpack} {cat} {}


@pytest.mark.parametrize("caption, mentions", [
    ("A baby elephant next to adult giraffes.", [("elephant", "elephant"), ("giraffe", "giraffe")]),  # not people
    ("The toilet seat is up.", [("toilet", "toilet")]),     # a toilet seat is no chair
    ("Glasses, buses, skis, knives and scissors.", [("glass", "wine glass"), ("bus", "bus"), ("skis", "skis"),
                                                     ("knife", "knife"), ("scissor", "scissors")]),
    ("Children and mice.", [("child", "person"), ("mouse", "mouse")]),
    ("Two ties.", [("tie", "tie")]),
    ("", []),
])
def test_caption_objects(caption, mentions):
    assert E.caption_objects(caption, E.chair_vocabulary(E.COCO_SYNONYMS)) == mentions


def test_chair_on_toy_instances():
    items = D.load_task("toy-caption", "val")[:2]
    annotated, categories = D.read_instances(items)
    assert categories == set(D.SHAPES)
    shapes = [next(s for s in D.SHAPES if s in it.target) for it in items]
    assert [annotated[it.id] for it in items] == [{s} for s in shapes]
    other = next(s for s in D.SHAPES if s != shapes[1])
    result = E.chair_metrics(items, [items[0].target, f"A red {other}."])
    assert result == {"chair_s": 50.0, "chair_i": 50.0, "recall": 50.0}


def test_chair_missing_instances(tmp_path):
    item = D.Item(1, str(tmp_path / "coco" / "val2014" / "x.jpg"), None, ("a dog",), "a dog")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "coco" / "annotations" / "instances_val2014.json")):
        D.read_instances([item])
