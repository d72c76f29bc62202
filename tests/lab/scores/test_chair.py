"""CHAIR (Table 5; lab/scores/chair.py): by hand and as chair.py counts, the synonyms list, the corrected count."""
import pytest

import benchmarks
import data as D
from lab.datasets import readers, tasks
from lab.scores import chair, results
from helpers import lab_evaluate_args


VOCAB = chair.chair_vocabulary(chair.COCO_SYNONYMS)


def test_a_changed_synonyms_file_is_refused(tmp_path):
    changed = tmp_path / "synonyms.txt"
    changed.write_text(chair.published_synonyms() + "robot, android\n")
    with pytest.raises(ValueError, match="not the published CHAIR synonyms.txt"):
        chair.published_synonyms(str(changed))


def test_chair_synonyms_are_the_published_list():
    assert len(chair.COCO_SYNONYMS) == 80 and len(chair.published_synonyms().splitlines()) == 80
    names = list(chair.COCO_SYNONYMS)
    assert names[:3] == ["person", "bicycle", "car"] and names[-1] == "toothbrush"
    for word, category in [("bagel", "donut"), ("briefcase", "handbag"), ("wallet", "handbag"), ("pickup", "truck"),
                           ("bison", "cow"), ("panda", "bear"), ("sub", "sandwich"), ("notebook", "laptop"),
                           ("container", "bowl"), ("villager", "person"), ("husky", "dog"), ("steamship", "boat")]:
        assert VOCAB[word] == category
    for word in ("surfer", "batter", "umpire", "baseball", "football", "bat", "glove", "glass", "plant", "bag",
                 "cub", "grizzly", "hair dryer", "double decker"):  # the project's old list had them; chair.py not
        assert word not in VOCAB
    assert len(VOCAB) == 403  # chair.py's 403 distinct words, " motor bike", " cheesecake", "iPhone" as stripped


def test_read_synonyms_strips_and_lowercases_and_rejects_empty_words():
    assert chair.read_synonyms("motorcycle, scooter,  motor bike\ncell phone, iPhone") == \
        {"motorcycle": "motorcycle, scooter, motor bike", "cell phone": "cell phone, iphone"}
    with pytest.raises(ValueError, match="synonyms line 2"):
        chair.read_synonyms("cat, kitten\ndog, , puppy")


@pytest.mark.parametrize("caption, mentions", [
    ("A train on the train tracks.", [("train", "train")]),           # "train track" is no train (chair.py's pair)
    ("Two double decker buses.", [("bus", "bus")]),                   # one bus, "double decker" is no synonym
    ("A baseball player at home plate.", [("player", "person")]),    # "baseball" is no ball
    ("Two taxis near a cab.", [("taxi", "car"), ("cab", "car")]),     # taxis -> taxi, as chair.py singularises
    ("A stove top oven.", [("stove", "oven"), ("oven", "oven")]),     # only pairs are joined: two ovens
    ("A man in a bow tie.", [("man", "person"), ("tie", "tie")]),     # bow tie is read as tie
    ("A passenger jet and baby birds.", [("jet", "airplane"), ("bird", "bird")]),  # no passenger, no baby
    ("A seat in the toilet.", [("toilet", "toilet")]),                # a toilet's seat is no chair
    ("A hot dog and teddy bears.", [("hot dog", "hot dog"), ("teddy bear", "teddy bear")]),
    ("Wine glasses and a cell phone.", [("wine glass", "wine glass"), ("cell phone", "cell phone")]),
    ("People, women and children.", [("person", "person"), ("woman", "person"), ("child", "person")]),
])
def test_caption_objects_follow_chair_py(caption, mentions):
    assert chair.caption_objects(caption, VOCAB) == mentions


# chair.py's quirks (README, "CHAIR"): the caption, chair.py's mentions (worked out by hand from its code:
# pattern.en's singularize and synonyms.txt split on ", "), which the default count reproduces, and the corrected
# count's (--chair corrected).
CHAIR_PY_DIFFERENCES = [
    ("A bus.", [], [("bus", "bus")]),                                 # pattern: bus -> "bu"; "buses" -> bus both
    ("A minibus and an airbus.", [], [("minibus", "bus"), ("airbus", "airplane")]),  # -> "minibu", "airbu"
    ("Two ties.", [], [("tie", "tie")]),                              # pattern: ties -> "ty"
    ("Two canoes.", [], [("canoe", "boat")]),                         # pattern: canoes -> "cano"
    ("A motor bike.", [], [("motor bike", "motorcycle")]),            # synonyms.txt: " motor bike" (leading space)
    ("A cheesecake.", [], [("cheesecake", "cake")]),                  # " cheesecake"
    ("An iPhone.", [], [("iphone", "cell phone")]),                   # "iPhone" against a lowercased caption
    ("Two doggies.", [], [("doggy", "dog")]),                         # pattern keeps "doggies" (its -ie list)
    ("A hot, dog.", [("dog", "dog")], [("hot dog", "hot dog")]),      # nltk keeps the comma: no pair
    ("A teddy. Bear.", [("bear", "bear")], [("teddy bear", "teddy bear")]),  # nor the period
    ("A wine - glass.", [], [("wine glass", "wine glass")]),          # nor the dash; "glass" -> "glas", no word
]


# pattern.en's other readings, which change the word chair.py reports but not its category, and the -i / -u
# plurals it singularises (the project's rule kept words ending in -is / -us): caption, chair.py's mentions.
@pytest.mark.parametrize("caption, mentions", [
    ("People with skis.", [("person", "person"), ("ski", "skis")]),   # pattern: people -> person, skis -> ski
    ("Two oxen.", [("ox", "cow")]),                                   # oxen -> ox
    ("A tennis racket.", [("racket", "tennis racket")]),              # tennis -> "tenni", so no pair
    ("A dining table.", [("table", "dining table")]),                 # no double word in chair.py: table
    ("Corgis, zebus and broccolis.", [("corgi", "dog"), ("zebu", "cow"), ("broccoli", "broccoli")]),
    ("Two computer mouses.", [("computer", "laptop"), ("mouse", "mouse")]),
])
def test_caption_objects_report_chair_pys_words(caption, mentions):
    assert chair.caption_objects(caption, VOCAB) == mentions


def test_chair_py_pairs_and_plurals_change_the_count():
    # by hand: ground truth {dog}; "hot, dog" is a dog (no hot dog), "corgis" a dog; "doggies" nothing;
    # a tie hallucinated
    captions = {1: "A hot, dog and two corgis.", 2: "Doggies and a tie."}
    result, wrong = chair.chair(captions, {1: {"dog"}, 2: {"dog"}}, {1: [], 2: []}, VOCAB)
    assert wrong == {1: [], 2: ["tie"]} and result["chair_s"] == 0.5 and result["chair_i"] == pytest.approx(1 / 3)
    result, wrong = chair.chair(captions, {1: {"dog"}, 2: {"dog"}}, {1: [], 2: []}, VOCAB, "corrected")
    assert wrong == {1: ["hot dog"], 2: ["tie"]} and result["chair_i"] == pytest.approx(2 / 4)


@pytest.mark.parametrize("caption, chair_py, corrected", CHAIR_PY_DIFFERENCES)
def test_chair_counts_as_chair_py_by_default_and_corrected_on_request(caption, chair_py, corrected):
    assert chair.caption_objects(caption, VOCAB) == chair_py != corrected
    assert chair.caption_objects(caption, VOCAB, "corrected") == corrected


def test_chair_counts_a_singular_bus_only_when_corrected():
    captions = {1: "A bus on the street.", 2: "A dog and two buses."}
    result, wrong = chair.chair(captions, {1: set(), 2: {"dog"}}, {1: [], 2: []}, VOCAB, "corrected")
    assert wrong == {1: ["bus"], 2: ["bus"]}
    assert result["chair_s"] == 1.0 and result["chair_i"] == pytest.approx(2 / 3)
    result, wrong = chair.chair(captions, {1: set(), 2: {"dog"}}, {1: [], 2: []}, VOCAB)    # as chair.py
    assert wrong == {1: [], 2: ["bus"]} and result["chair_s"] == 0.5 and result["chair_i"] == 0.5


# Captions as a model writes them, each mention worked out by hand as chair.py's caption_to_words reads it (nltk's
# tokens, pattern.en's singularize, its double words, synonyms.txt split on ", "): (caption, ground truth, chair.py's
# hallucinated words, its mention count).
CHAIR_PY_BY_HAND = [
    ("A red bus parked next to two buses.", {"bus"}, [], 1),                 # "bu" is no word; buses -> bus
    ("A man with two ties and a canoe.", {"person"}, ["canoe"], 2),          # ties -> "ty"; canoe is a boat
    ("Canoes on a lake near a motor bike.", set(), [], 0),                   # "cano"; " motor bike" never matches
    ("A woman eats cheesecake and holds an iPhone.", {"person"}, [], 1),     # " cheesecake", "iPhone" never match
    ("A dog sits on a bus seat next to a toilet.", {"dog"}, ["toilet"], 2),  # "bu"; seat dropped beside a toilet
    ("Two giraffes and a baby elephant.", {"giraffe"}, ["elephant"], 2),     # baby elephant -> elephant
]


def test_default_chair_equals_chair_pys_count_on_hand_worked_captions():
    captions = {k: c for k, (c, _, _, _) in enumerate(CHAIR_PY_BY_HAND)}
    truth = {k: t for k, (_, t, _, _) in enumerate(CHAIR_PY_BY_HAND)}
    result, wrong = chair.chair(captions, truth, {k: [] for k in captions}, VOCAB)
    assert [wrong[k] for k in captions] == [w for _, _, w, _ in CHAIR_PY_BY_HAND]
    mentions = sum(n for *_, n in CHAIR_PY_BY_HAND)
    assert result["chair_i"] == pytest.approx(3 / mentions) and result["chair_s"] == pytest.approx(3 / 6)
    corrected, _ = chair.chair(captions, truth, {k: [] for k in captions}, VOCAB, "corrected")
    assert corrected["chair_i"] != result["chair_i"]


def test_the_corrected_count_is_named_in_the_output():
    items = tasks.load_task("coco", "val", benchmarks.ROOT)[:2]
    assert set(chair.chair_metrics(items, [it.target for it in items], "corrected")) == \
        {"chair_s_corrected", "chair_i_corrected", "recall_corrected"}
    args = lab_evaluate_args(["--model", "tiny-idefics2", "--task", "coco", "--chair", "corrected"])
    assert args.chair == "corrected" and "chair-corrected" in results.result_name(args, "0-shot", 2, {})
    assert lab_evaluate_args(["--model", "tiny-idefics2", "--task", "coco", "--chair"]).chair == "chair.py"


def test_chair_by_hand():
    vocab = chair.chair_vocabulary(chair.COCO_SYNONYMS)
    annotated = {1: {"dog"}, 2: {"person", "bicycle", "backpack"}, 3: {"cat"}, 4: set()}
    references = {1: ["A dog lying on a couch."], 2: ["A man riding a bike."], 3: ["A kitten."], 4: ["An empty road."]}
    captions = {
        1: "Two dogs sitting on a sofa next to a hot dog.",   # dog (plural), couch (synonym, from the reference),
                                                             # hot dog (multi-word: hallucinated, not a dog)
        2: "Women riding bicycles near teddy bears.",         # person (irregular plural), bicycle, teddy bear (wrong)
        3: "A cat on the grass.",                             # cat
        4: "A view of the blue sky.",                         # no object at all
    }
    result, wrong = chair.chair(captions, annotated, references, vocab)
    assert wrong == {1: ["hot dog"], 2: ["teddy bear"], 3: [], 4: []}
    assert result["chair_i"] == pytest.approx(2 / 7)        # 7 mentions: dog couch hot-dog / woman bicycle teddy / cat
    assert result["chair_s"] == pytest.approx(2 / 4)
    assert result["recall"] == pytest.approx(5 / 6)         # truth: {dog, couch} {person, bicycle, backpack} {cat} {}


@pytest.mark.parametrize("caption, mentions", [
    ("A baby elephant next to adult giraffes.", [("elephant", "elephant"), ("giraffe", "giraffe")]),  # not people
    ("The toilet seat is up.", [("toilet", "toilet")]),     # a toilet seat is no chair
    ("Glasses, wine glasses, buses, skis, knives and scissors.", [("wine glass", "wine glass"), ("bus", "bus"),
                                                                  ("ski", "skis"), ("knife", "knife"),
                                                                  ("scissors", "scissors")]),  # "glass": none
    ("Children and mice.", [("child", "person"), ("mouse", "mouse")]),
    ("Two ties.", []),                                       # as chair.py: "ty" (--chair corrected: a tie)
    ("", []),
])
def test_caption_objects(caption, mentions):
    assert chair.caption_objects(caption, chair.chair_vocabulary(chair.COCO_SYNONYMS)) == mentions


def test_chair_on_toy_instances():
    items = tasks.load_task("coco", "val", benchmarks.ROOT)[:2]
    annotated, categories = readers.read_instances(items)
    assert categories == set(benchmarks.SHAPES)
    shapes = [next(s for s in benchmarks.SHAPES if s in it.target) for it in items]
    assert [annotated[it.id] for it in items] == [{s} for s in shapes]
    other = next(s for s in benchmarks.SHAPES if s != shapes[1])
    result = chair.chair_metrics(items, [items[0].target, f"A red {other}."])  # each shape read by its own name
    assert result == {"chair_s": 50.0, "chair_i": 50.0, "recall": 50.0}


def test_chair_missing_instances(tmp_path):
    item = D.Item(1, str(tmp_path / "coco" / "val2014" / "x.jpg"), None, ("a dog",), "a dog")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "coco" / "annotations" / "instances_val2014.json")):
        readers.read_instances([item])
