"""evaluate.predict's argument checks (lab/datasets/api_checks.py): one ValueError naming the argument or the item
before any batch is built."""
import dataclasses

import numpy as np
import pytest

import data as D
import evaluate
from lab.datasets import api_checks


ITEMS = [D.Item(1, "a.png", "what?", ("x",), "x"), D.Item(2, "a.png", "what?", ("y",), "y")]


@pytest.mark.parametrize("items, icds, message", [
    ((it for it in ITEMS), None, r"items and icds must be lists \(got generator"),
    (ITEMS, [[], None], r"icds\[1\] is NoneType; each item's demonstrations are a list"),
])
def test_predict_refuses_a_generator_or_an_icd_entry_that_is_no_list(items, icds, message):
    with pytest.raises(ValueError, match=message):  # before: a TypeError inside predict
        api_checks.check_predict("vqav2", items, icds, 1, False)


def test_predict_takes_a_numpy_integer_batch_size():
    api_checks.check_predict("vqav2", ITEMS, None, np.int64(2), False)  # before: refused as "not an integer"
    with pytest.raises(ValueError, match=r"batch_size must be an integer of at least 1"):
        api_checks.check_predict("vqav2", ITEMS, None, np.float64(2), False)


@pytest.mark.parametrize("call, message", [
    (lambda b, its: evaluate.predict(b, "vqav2", its, icds=[[]] * (len(its) - 1)),
     r"icds holds 2 demonstration lists for 3 items"),
    (lambda b, its: evaluate.predict(b, "vqav2", its[:2], likelihood=True),
     r"likelihood ranks a multiple-choice item's options; vqav2 is a vqa task"),
    (lambda b, its: evaluate.predict(b, "vqav2", its, batch_size=0), r"batch_size must be an integer of at least 1 "
     r"\(got 0\)"),
    (lambda b, its: evaluate.predict(b, "vqa-v2", its), r"unknown task 'vqa-v2'; choose from .*vqav2"),
    (lambda b, its: evaluate.predict(b, "vqav2", [dataclasses.replace(its[0], question=None)]),
     rf"item \d+: its question is None; a vqa task asks one"),
    (lambda b, its: evaluate.predict(b, "vqav2", [dataclasses.replace(its[0], image_path=None)]),
     rf"item \d+: its image_path is None; every item needs an image file"),
])
def test_the_python_api_refuses_what_would_misalign_naming_the_argument_or_item(backbone, items, call, message):
    with pytest.raises(ValueError, match=message):
        call(backbone, items)
