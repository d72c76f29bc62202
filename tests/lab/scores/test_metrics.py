"""Metrics (lab/scores/metrics.py) against hand-checked values and the rules of the official evaluation code: VQA
accuracy, CIDEr-D, multiple choice, MME's acc / acc+ / score, SEED's dimensions."""
import math
import os
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import data as D
from lab.scores import metrics, results


def mme_item(i, subtask, image_name, answer):
    return D.Item(i, f"/mme/{subtask}/{image_name}", "q?", (answer,), answer, subtask)


def official_mme(folder, subtask):
    """acc and acc+ (percent) of one eval_tool results file, computed the way calculation.py does: lines in
    consecutive pairs (one image each), the prediction lowercased, exact yes/no else "yes" then "no" in its first
    4 characters, else other."""
    with open(os.path.join(folder, subtask + ".txt")) as f:
        lines = f.readlines()
    right = []
    for line in lines:
        _, _, gt, pred = line.split("\t")
        pred = pred.lower()
        label = pred if pred in ("yes", "no") else "yes" if "yes" in pred[:4] else "no" if "no" in pred[:4] else "x"
        right.append(label == gt.lower())
    pairs = [right[i:i + 2] for i in range(0, len(right), 2)]
    return 100 * sum(right) / len(right), 100 * sum(all(p) for p in pairs) / len(pairs)


def test_mme_scores_hand_computed(tmp_path):
    items = [mme_item(0, "existence", "1.jpg", "Yes"), mme_item(1, "existence", "1.jpg", "No"),
             mme_item(2, "existence", "2.jpg", "Yes"), mme_item(3, "existence", "2.jpg", "No"),
             mme_item(4, "code_reasoning", "3.png", "Yes"), mme_item(5, "code_reasoning", "3.png", "No")]
    predictions = ["Yes", "no, there is none", "yes", "Yes it is", "Not sure", "maybe"]
    # existence: image 1 both right, image 2 one right -> acc 3/4, acc+ 1/2, score 125.
    # code_reasoning: "Not sure" has "no" in its first 4 characters -> "no" (wrong), "maybe" -> other (wrong).
    m = metrics.mme_scores(items, predictions)
    assert m["subtasks"] == {"existence": {"acc": 75.0, "acc_plus": 50.0, "score": 125.0},
                             "code_reasoning": {"acc": 0.0, "acc_plus": 0.0, "score": 0.0}}
    assert (m["perception"], m["cognition"], m["accuracy"], m["mean_subtask_accuracy"]) == (125.0, 0.0, 50.0, 37.5)
    results.write_mme_results(str(tmp_path), items, predictions)  # the official way on the official results format
    for subtask, v in m["subtasks"].items():
        assert official_mme(str(tmp_path), subtask) == (v["acc"], v["acc_plus"])


@pytest.mark.parametrize("generation, letter", [
    ("(B)", "b"), ("B.", "b"), ("The answer is B", "b"), ("the answer is b.", "b"), ("b", "b"),
    (" C) three", "c"), ("Answer: (d)", "d"), ("answer is: A", "a"), ("D. Four", "d"),
    ("Bus", None), ("", None), ("The bus", None), ("1", None),
])
def test_option_letter(generation, letter):
    assert metrics.option_letter(generation) == letter


def test_seed_scores_per_dimension():
    items = [D.Item(i, "x.jpg", "q", ("1", "2", "3", "4"), t, c)
             for i, (t, c) in enumerate([("A", "d1"), ("B", "d1"), ("C", "d2"), ("D", "d2"), ("A", "d2")])]
    m = metrics.seed_scores(items, ["(A)", "The answer is c", "C.", "d", "B"])
    assert m == {"dimensions": {"d1": 50.0, "d2": 200 / 3}, "accuracy": 60.0}


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


# The metrics refuse inputs they cannot score with a ValueError, under `python -O` too (no assert).
@pytest.mark.parametrize("candidates, references, named", [
    ({1: "a cat"}, {2: ["a cat"]}, "ids in only one: 1, 2"),
    ({1: "a cat", 2: "a dog"}, {1: ["a cat"]}, "ids in only one: 2"),
    ({}, {}, "at least one"),
    ({1: "a cat"}, {1: []}, "each with a reference"),
])
def test_cider_d_refuses_unpaired_or_missing_references(candidates, references, named):
    with pytest.raises(ValueError, match=named):
        metrics.cider_d(candidates, references)
    assert metrics.cider_d({1: "a cat"}, {1: ["a cat"]})[1].keys() == {1}  # a paired input is scored


@pytest.mark.parametrize("predictions, answers", [(["yes"], ["yes", "no"]), (["yes", "no"], ["yes"]), ([], [])])
def test_multiple_choice_accuracy_refuses_predictions_not_one_per_answer(predictions, answers):
    with pytest.raises(ValueError, match=f"{len(predictions)} predictions for {len(answers)} answers"):
        metrics.multiple_choice_accuracy(predictions, answers)
    assert metrics.multiple_choice_accuracy(["Yes", "B."], ["yes", "b"]) == 1.0
