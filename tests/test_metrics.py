"""Metrics in evaluate.py against hand-checked values and the rules of the official evaluation code."""
import math
import random

import pytest
from hypothesis import given, settings, strategies as st

import benchmarks
import evaluate as E
from lab.datasets import tasks
from lab.scores import chair, metrics, results

# -----------------------------------------------------------------------------
# VQA normalisation (vqaEval.py processPunctuation / processDigitArticle)


@pytest.mark.parametrize("raw, expected", [
    ("Yes.", "yes"),                    # period not followed by a digit is deleted, then lowercased
    ("5.", "5"),
    ("2.5", "2.5"),                     # period followed by a digit is kept
    ("e.g.", "eg"),
    ("1,000", "1000"),                  # digit,digit comma: every punctuation mark is deleted
    ("1,2 and x,y", "12 and xy"),       # ... including commas elsewhere in the string
    ("x,y", "x y"),                     # no digit,digit and no adjacent space: mark becomes a space
    ("hot-dog", "hot dog"),
    ("hot - dog", "hot dog"),           # mark touching a space is deleted (double space then collapses)
    ("yes!", "yes"),                    # '!' at the end touches no space -> space, stripped by split
    ("what?!", "what"),
    ("(left)", "left"),
    ("it's", "it's"),                   # the apostrophe is not in the official punctuation list
    ("two", "2"),                       # number words -> digits
    ("None", "0"),
    ("Ten dogs", "10 dogs"),
    ("eleven", "eleven"),               # manualMap stops at ten
    ("the cat", "cat"),                 # articles a/an/the removed
    ("A an The dog", "dog"),
    ("dont", "don't"),                  # contractions restored
    ("Isnt it", "isn't it"),
    ("somebody'd", "somebodyd"),        # an official table entry that goes the "wrong" way, kept
    ("\n Two\tdogs \n", "2 dogs"),      # newline/tab -> space and strip come first
])
def test_normalize_vqa_answer(raw, expected):
    assert metrics.normalize_vqa_answer(raw) == expected


def test_period_strip_count_quirk():
    # vqaEval passes re.UNICODE (= 32) as re.sub's count: only the first 32 periods are removed
    assert metrics.normalize_vqa_answer("." * 40) == "." * 8


# -----------------------------------------------------------------------------
# VQA accuracy


@pytest.mark.parametrize("k, expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_vqa_accuracy_leave_one_out(k, expected):
    # k of the ten answers equal the prediction. Leaving out a matching answer leaves k-1 matches,
    # leaving out a non-matching one leaves k, so acc = [k*min(1,(k-1)/3) + (10-k)*min(1,k/3)] / 10:
    # k=1: (1*0 + 9*1/3)/10 = 0.3;  k=2: (2*1/3 + 8*2/3)/10 = 0.6;  k=3: (3*2/3 + 7*1)/10 = 0.9;
    # k=4: (4*1 + 6*1)/10 = 1.0
    answers = ["cat"] * k + [f"dog{i}" for i in range(10 - k)]
    assert metrics.vqa_accuracy("cat", answers) == pytest.approx(expected, abs=1e-12)


def test_vqa_accuracy_all_identical_quirk():
    # ten identical answers: only whitespace cleanup, no punctuation/digit/article/case normalisation
    assert metrics.vqa_accuracy("two", ["2"] * 10) == 0.0
    assert metrics.vqa_accuracy("Two", ["two"] * 10) == 0.0
    assert metrics.vqa_accuracy("the cat", ["cat"] * 10) == 0.0
    assert metrics.vqa_accuracy(" 2\n", ["2"] * 10) == 1.0
    assert metrics.vqa_accuracy("2", ["2 "] * 9 + ["2"]) == 1.0   # answers are whitespace-cleaned before the check
    # one differing answer: normalisation applies to both sides; 9 answers match "2" -> 1.0
    assert metrics.vqa_accuracy("two", ["2"] * 9 + ["3"]) == 1.0
    assert metrics.vqa_accuracy("Two.", ["2"] * 2 + ["3"] * 8) == pytest.approx(0.6)


def test_vqa_accuracy_normalises_answers_too():
    answers = ["Two", "2", "two.", "3", "3", "3", "3", "3", "3", "3"]  # three answers normalise to "2"
    assert metrics.vqa_accuracy("2", answers) == pytest.approx(0.9)


@settings(max_examples=200)
@given(st.lists(st.sampled_from(["yes", "no", "2", "two", "Yes."]), min_size=10, max_size=10),
       st.sampled_from(["yes", "no", "2", "two", "maybe"]))
def test_vqa_accuracy_takes_leave_one_out_values(answers, prediction):
    # whatever the answers, the score is one of the five leave-one-out values
    acc = metrics.vqa_accuracy(prediction, answers)
    assert any(math.isclose(acc, v, abs_tol=1e-12) for v in (0.0, 0.3, 0.6, 0.9, 1.0))


# -----------------------------------------------------------------------------
# captions: tokenisation and CIDEr-D


@pytest.mark.parametrize("raw, expected", [
    ("A man, riding a horse.", ["a", "man", "riding", "a", "horse"]),
    ("The dog's ball", ["the", "dog", "'s", "ball"]),
    ("Don't", ["do", "n't"]),
    ("black-and-white cat", ["black-and-white", "cat"]),
    ('"Hi" (there) -- ok...', ["hi", "-lrb-", "there", "-rrb-", "ok"]),  # brackets kept as -lrb- -rrb-
    ("1,000 people at 2.5 pm!", ["1,000", "people", "at", "2.5", "pm"]),
    ("A sign reading 'STOP' in red.", ["a", "sign", "reading", "stop", "in", "red"]),  # a quote, not the clitic 's
    ("a 'Stop' sign", ["a", "stop", "sign"]),
    ("He'S here, it's 's'", ["he", "'s", "here", "it", "'s", "'s"]),  # before a non-letter 's is still the clitic
    ("An <angle> view", ["an", "<angle>", "view"]),                   # an SGML tag is one token
    ("a < b > c", ["a", "<", "b", ">", "c"]),                          # not a tag: a space after "<"
])
def test_tokenize_caption(raw, expected):
    assert metrics.tokenize_caption(raw) == expected


def test_cider_d_hand_computed():
    refs = {"a": ["dog runs", "dog sits"], "b": ["cat sits"], "c": ["bird flies"]}
    cands = {"a": "dog dog runs", "b": "cat sits", "c": "bird"}
    # 3 images. df: sits -> 2 (images a, b), every other reference n-gram -> 1; unseen n-grams -> df 0,
    # and log(max(1, 0)) = 0. So idf = ln3 for all n-grams except "sits": ln3 - ln2 = ln1.5.
    w, w_sits = math.log(3), math.log(1.5)
    pen1 = math.exp(-1 / (2 * 6.0 ** 2))  # length differs by one word
    # image a, candidate "dog dog runs": unigrams dog 2w, runs w (norm w*sqrt5); bigrams "dog dog" w,
    # "dog runs" w (norm w*sqrt2); trigram "dog dog runs" w; no 4-grams.
    #  ref "dog runs" (norms: uni w*sqrt2, bi w; no trigrams -> 0):
    #    uni: clipped min(2w, w)*w + w*w = 2w^2 -> 2w^2 / (w*sqrt5 * w*sqrt2) = 2/sqrt10
    #    bi: w*w / (w*sqrt2 * w) = 1/sqrt2
    #  ref "dog sits" (uni norm sqrt(w^2 + w_sits^2)): uni min(2w, w)*w = w^2; bigram "dog sits" unmatched
    #    uni: w^2 / (w*sqrt5 * sqrt(w^2 + w_sits^2))
    ref1 = (2 / math.sqrt(10) + 1 / math.sqrt(2)) * pen1
    ref2 = w / (math.sqrt(5) * math.sqrt(w * w + w_sits * w_sits)) * pen1
    score_a = 10 * (ref1 + ref2) / 4 / 2          # mean over n = 1..4, then over the two references
    score_b = 10 * (1 + 1 + 0 + 0) / 4            # identical caption: cosine 1 for uni and bi = 5.0
    score_c = 10 * (w * w / (w * w * math.sqrt(2))) * pen1 / 4  # "bird" vs "bird flies": 1/sqrt2, one word shorter
    corpus, per_id = metrics.cider_d(cands, refs)
    assert per_id["a"] == pytest.approx(score_a, rel=1e-12)
    assert per_id["b"] == pytest.approx(5.0, rel=1e-12)
    assert per_id["c"] == pytest.approx(score_c, rel=1e-12)
    assert corpus == pytest.approx((score_a + score_b + score_c) / 3, rel=1e-12)
    # numerically: a = 2.16856..., c = 1.74338...
    assert per_id["a"] == pytest.approx(2.16856, abs=1e-5)
    assert per_id["c"] == pytest.approx(1.74338, abs=1e-5)


def test_cider_d_clipping():
    # without the min() clipping, "dog dog runs" would get uni numerator 2w*w + w*w = 3w^2 against "dog runs"
    # (cosine 3/sqrt10); with clipping it is 2/sqrt10. Every idf is ln2 here, so it cancels.
    refs = {"a": ["dog runs"], "b": ["cat"]}
    pen1 = math.exp(-1 / 72)
    clipped = (2 / math.sqrt(10) + 1 / math.sqrt(2)) * pen1
    assert metrics.cider_d({"a": "dog dog runs", "b": "cat"}, refs)[1]["a"] == pytest.approx(10 * clipped / 4)


def test_cider_d_length_penalty():
    # one reference: changing sigma only rescales by exp(-delta^2 / (2 sigma^2)); here delta = 8 - 2 = 6 words
    refs = {"a": ["red dog"], "b": ["blue sky"]}
    cands = {"a": "red dog runs on the green grass today", "b": "blue sky"}
    with_penalty = metrics.cider_d(cands, refs)[1]["a"]
    without = metrics.cider_d(cands, refs, sigma=1e9)[1]["a"]
    assert without > 0
    assert with_penalty == pytest.approx(without * math.exp(-36 / 72), rel=1e-9)


def test_cider_d_edge_cases():
    assert metrics.cider_d({"a": "dog"}, {"a": ["dog"]}) == (0.0, {"a": 0.0})  # one image: every idf is log(1) = 0
    assert metrics.cider_d({"a": "", "b": "cat"}, {"a": ["dog"], "b": ["cat"]})[1]["a"] == 0.0
    with pytest.raises(ValueError):
        metrics.cider_d({"a": "dog"}, {"b": ["dog"]})


_WORDS = ["red", "dog", "cat", "runs", "big"]
_caption = st.lists(st.sampled_from(_WORDS), min_size=1, max_size=5)


@settings(max_examples=60)
@given(st.lists(_caption, min_size=1, max_size=4), st.integers(0, 2**31))
def test_cider_d_reference_order_invariant(ref_words, seed):
    refs = {"a": [" ".join(r) for r in ref_words], "b": ["tree sky"], "c": ["dog sky"]}
    cands = {"a": " ".join(ref_words[0][::-1]), "b": "sky", "c": "red dog"}
    corpus, per_id = metrics.cider_d(cands, refs)
    rng = random.Random(seed)
    shuffled = {k: rng.sample(v, len(v)) for k, v in reversed(list(refs.items()))}
    corpus2, per_id2 = metrics.cider_d(cands, shuffled)
    assert corpus2 == pytest.approx(corpus, rel=1e-12, abs=1e-12)
    assert all(per_id2[k] == pytest.approx(per_id[k], rel=1e-12, abs=1e-12) for k in per_id)


@settings(max_examples=100)
@given(_caption, _caption, st.integers(1, 4))
def test_cider_d_consensus_caption_wins(best, other, num_refs):
    # the candidate equal to every reference scores at least as high as any other candidate, strictly
    # higher unless the other has the same words (other images use a disjoint vocabulary, so idf > 0)
    refs = {"a": [" ".join(best)] * num_refs, "b": ["tree sky"], "c": ["sun"]}
    score = lambda cand: metrics.cider_d({"a": cand, "b": "tree", "c": "sun"}, refs)[1]["a"]
    top, rival = score(" ".join(best)), score(" ".join(other))
    assert top == pytest.approx(10 * min(len(best), 4) / 4)
    if sorted(best) == sorted(other):
        assert rival <= top + 1e-9
    else:
        assert rival < top


# -----------------------------------------------------------------------------
# multiple choice (MME yes/no, SEED-Bench option letters)


@pytest.mark.parametrize("pred, answer, correct", [
    ("Yes", "yes", True),
    ("yes, there is a dog", "Yes", True),
    ("No.", "no", True),
    ("Not really", "no", True),     # MME's rule: "no" within the first 4 characters
    ("There is no dog", "no", False),  # ... and only there
    ("maybe", "no", False),
    ("B", "B", True),
    ("b. a cat", "B", True),
    ("(C) two", "c", True),
    ("D) red", "D", True),
    (" A", "a", True),
    ("Bus", "B", False),            # a letter followed by a letter is a word, not an option
    ("C", "B", False),
    ("", "A", False),
])
def test_multiple_choice_single(pred, answer, correct):
    assert metrics.multiple_choice_accuracy([pred], [answer]) == float(correct)


def test_multiple_choice_accuracy_mean():
    assert metrics.multiple_choice_accuracy(["A", "yes", "C", "no"], ["A", "no", "b", "no"]) == 0.5


# -----------------------------------------------------------------------------
# CHAIR as chair.py counts it (Rohrbach et al.'s utils/chair.py and data/synonyms.txt)

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
    args = E.parse_args(["--model", "tiny-idefics2", "--task", "coco", "--chair", "corrected"])
    assert args.chair == "corrected" and "chair-corrected" in results.result_name(args, "0-shot", 2, {})
    assert E.parse_args(["--model", "tiny-idefics2", "--task", "coco", "--chair"]).chair == "chair.py"
