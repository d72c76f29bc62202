"""VQAv2's test server (lab/scores/submission.py): evaluate.py --split test-dev / test on a generated test2015 layout
(the official questions files, no annotations, images in coco/test2015/) writes EvalAI's file over every test2015
question; --n-eval below the split writes none; a file missing ids is never written. Under torchrun the file is
written by the first process from predict's gathered answers, as the predictions (tests/lab/run/test_torchrun.py)."""
import json
import os

import pytest
from PIL import Image

import evaluate as E
from lab.datasets import readers
from lab.scores import submission
from lab.scores.metrics import normalize_vqa_answer
from helpers import lab_args, lab_evaluate


TEST_IDS = [5000, 5001, 5002, 5010, 5011, 5020, 5021]  # test2015; test-dev is a part of it


DEV_IDS = [5001, 5010, 5020, 5021]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A test2015 layout: 7 questions on 3 tiny images, test-dev 4 of them (as the official files, question ids
    grouped by image: image_id * 1000 + k)."""
    root = tmp_path_factory.mktemp("vqa-test")
    (root / "coco" / "test2015").mkdir(parents=True)
    (root / "vqav2").mkdir()
    for image_id, colour in ((5, "red"), (10, "blue"), (20, "green")):
        Image.new("RGB", (16, 16), colour).save(root / "coco" / "test2015" / f"COCO_test2015_{image_id:012d}.jpg")
    question = lambda q: {"image_id": q // 1000, "question": f"What colour is thing {q}?", "question_id": q}
    for subtype, ids in (("test2015", TEST_IDS), ("test-dev2015", DEV_IDS)):
        with open(readers.questions_path(str(root), subtype), "w") as f:
            json.dump({"info": {}, "task_type": "Open-Ended", "data_type": "mscoco", "license": {},
                       "data_subtype": subtype, "questions": [question(q) for q in ids]}, f)
    return str(root)


def run(root, out, split, *extra):
    return lab_evaluate(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", root, "--split", split,
                         "--shots", "0", "--batch-size", "4", "--out", str(out), *extra])


def server_file(out, name):
    with open(os.path.join(out, name)) as f:
        return json.load(f)


def predictions(out, metrics):
    with open(os.path.join(out, metrics["predictions"])) as f:
        return {r["id"]: r["prediction"] for r in map(json.loads, f)}


@pytest.mark.parametrize("split, subtype, answered", [("test-dev", "test-dev2015", DEV_IDS),
                                                      ("test", "test2015", TEST_IDS)])
def test_the_server_file_holds_every_test2015_question_once(root, tmp_path, capsys, split, subtype, answered):
    metrics = run(root, tmp_path, split)
    name = f"vqav2_{subtype}_0-shot_results.json"
    printed = capsys.readouterr().out
    assert metrics["server_file"] == name and os.path.join(str(tmp_path), name) in printed
    assert "vqa_accuracy" not in metrics and "vqa_accuracy" not in printed  # no answers, no score
    rows = server_file(tmp_path, name)
    assert [r["question_id"] for r in rows] == TEST_IDS and all(set(r) == {"question_id", "answer"} for r in rows)
    assert all(type(r["question_id"]) is int and isinstance(r["answer"], str) for r in rows)
    said = predictions(tmp_path, metrics)
    assert sorted(said) == sorted(answered) and metrics["n"] == len(answered)
    assert {r["question_id"]: r["answer"] for r in rows} == \
        {q: normalize_vqa_answer(said[q]) if q in said else "" for q in TEST_IDS}


def test_answers_are_normalised_as_the_official_evaluation(root, tmp_path, monkeypatch):
    said = iter(["The Two.", "Yes!", "a dont", "three dogs"])
    monkeypatch.setattr(E, "postprocess", lambda text: next(said))
    run(root, tmp_path, "test-dev")
    rows = server_file(tmp_path, "vqav2_test-dev2015_0-shot_results.json")
    assert {r["question_id"]: r["answer"] for r in rows if r["answer"]} == \
        {5001: "2", 5010: "yes", 5020: "don't", 5021: "3 dogs"}


def test_n_eval_below_the_split_writes_no_server_file(root, tmp_path, capsys):
    metrics = run(root, tmp_path, "test-dev", "--n-eval", "3")
    assert metrics["server_file"] is None and not any(f.startswith("vqav2_") for f in os.listdir(tmp_path))
    assert "no server file: --n-eval 3 answers 3 of the 4 test-dev questions" in capsys.readouterr().out
    assert sorted(predictions(tmp_path, metrics)) == DEV_IDS[:3]


def test_a_file_missing_ids_is_never_written(root, tmp_path):
    rows = [{"question_id": q, "answer": "a"} for q in TEST_IDS]
    submission.check_complete(rows, TEST_IDS)
    for broken, why in ((rows[1:], "once"), (rows + rows[:1], "once"), ([{**rows[0], "question_id": "5000"}], "int"),
                        ([{**rows[0], "answer": None}], "str")):
        with pytest.raises(ValueError, match=why):
            submission.check_complete(broken, TEST_IDS)
    stray = tmp_path / "root"  # a test-dev question that test2015 lacks: the full file cannot be made
    (stray / "vqav2").mkdir(parents=True)
    os.symlink(os.path.join(root, "coco"), stray / "coco")
    with open(os.path.join(root, "vqav2", readers.QUESTIONS.format("test2015"))) as f:
        official = json.load(f)
    for subtype, questions in (("test2015", official["questions"][:-1]), ("test-dev2015", official["questions"][-2:])):
        with open(readers.questions_path(str(stray), subtype), "w") as f:
            json.dump({**official, "questions": questions}, f)
    with pytest.raises(ValueError, match="1 question ids .first 5021. are not in the test2015"):
        run(str(stray), tmp_path / "out", "test-dev")
    assert not any(f.startswith("vqav2_") for f in os.listdir(tmp_path / "out"))


def test_another_evaluations_server_file_is_kept(root, tmp_path):
    run(root, tmp_path, "test-dev")
    path = tmp_path / "vqav2_test-dev2015_0-shot_results.json"
    first = path.read_text()
    assert run(root, tmp_path, "test-dev")["server_file"] == path.name  # the same settings again: replaced
    path.write_text("[]")  # as another checkpoint's would be: its metrics have another name
    (tmp_path / "vqav2-test-dev-0-shot-seed0-n4.metrics.json").unlink()
    with pytest.raises(ValueError, match="holds another evaluation's answers"):
        run(root, tmp_path, "test-dev")
    assert path.read_text() == "[]" and first != "[]"
    run(root, tmp_path, "test-dev", "--n-eval", "2")  # writes no server file, so replaces none


@pytest.mark.parametrize("flags, message", [
    (["evaluate", "--task", "ok-vqa", "--split", "test-dev"],
     "--split test-dev is VQAv2's test server split (--task vqav2), Karpathy's test split (coco, flickr30k) or a "
     "folder task's test.jsonl, not ok-vqa's"),
    (["evaluate", "--task", "mme", "--split", "test"], "Karpathy's test split (coco, flickr30k)"),
    (["hyperbolicity", "--task", "vqav2", "--split", "test"], "--split test has no answers"),
])
def test_the_test_splits_are_vqav2_evaluations(flags, message, capsys):
    with pytest.raises(SystemExit):
        lab_args(flags)
    assert message in capsys.readouterr().err
