"""The metrics refuse inputs they cannot score with a ValueError, under `python -O` too (no assert): CIDEr-D's
candidates and references of other ids, no ids or an id without a reference; multiple-choice accuracy's predictions
and answers of other lengths, or none."""
import pytest

from lab.scores import metrics


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
