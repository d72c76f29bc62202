"""The VQA and caption readers (lab/datasets/readers.py) on files in the official formats, written by hand: targets,
and every missing file, malformed JSON, bad id, annotation or path out of the dataset refused naming it."""
import json
import os
import re

import pytest
from PIL import Image

import benchmarks
import data
from helpers import ANNOTATION, QUESTION, vqa_files
from lab.datasets import readers, tasks
from lab.disk import files


def write_image(path, size=(40, 30)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, (10, 200, 30)).save(path)


def write_vqa(root, dataset, split="val", answers=None, drop_annotation=False):
    """Two questions about COCO image 42 in the official VQAv2 / OK-VQA layout."""
    folder, qfile, afile = readers.VQA_FILES[dataset]
    answers = answers or ["two", "2", "2", "two", "2", "2", "2", "3", "2", "2"]
    questions = [{"image_id": 42, "question": "How many cats?", "question_id": 42000},
                 {"image_id": 42, "question": "Is it sunny?", "question_id": 42001}]
    annotations = [{"question_id": 42000, "image_id": 42, "question_type": "how many", "answer_type": "number",
                    "multiple_choice_answer": "2",
                    "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1}
                                for i, a in enumerate(answers)]},
                   {"question_id": 42001, "image_id": 42, "question_type": "is it", "answer_type": "yes/no",
                    "multiple_choice_answer": "yes",
                    "answers": [{"answer": "yes", "answer_confidence": "yes", "answer_id": i + 1} for i in range(10)]}]
    files.write_json(os.path.join(root, folder, qfile.format(split)), {"questions": questions})
    files.write_json(os.path.join(root, folder, afile.format(split)),
                     {"annotations": annotations[:1] if drop_annotation else annotations})
    write_image(readers.coco_image(root, split, 42))


def karpathy_image(imgid, split, filename, captions, **extra):
    return {"imgid": imgid, "split": split, "filename": filename, **extra,
            "sentences": [{"raw": c, "tokens": c.lower().split(), "imgid": imgid, "sentid": 10 * imgid + k}
                          for k, c in enumerate(captions)]}


def write_karpathy(root):
    """A COCO and a Flickr30k Karpathy file with one image in each of train, restval, val and test."""
    coco = [karpathy_image(i, s, f"COCO_val2014_{i:012d}.jpg", [f"A dog {i}. ", f"Some dog {i}."],
                           filepath="val2014", cocoid=1000 + i)
            for i, s in enumerate(["train", "restval", "val", "test"])]
    flickr = [karpathy_image(i, s, f"{100 + i}.jpg", [f"A man {i}.", f"Men {i}."])
              for i, s in enumerate(["train", "restval", "val", "test"])]
    files.write_json(os.path.join(root, "coco", "dataset_coco.json"), {"images": coco, "dataset": "coco"})
    files.write_json(os.path.join(root, "flickr30k", "dataset_flickr30k.json"),
                     {"images": flickr, "dataset": "flickr30k"})


def test_vqav2_reader(tmp_path):
    write_vqa(tmp_path, "vqav2")
    items = tasks.load_task("vqav2", "val", tmp_path)
    assert [i.id for i in items] == [42000, 42001]
    assert items[0].question == "How many cats?" and items[0].target == "2" and len(items[0].answers) == 10
    assert items[0].image_path == str(tmp_path / "coco" / "val2014" / "COCO_val2014_000000000042.jpg")
    assert data.load_image(items[0]).mode == "RGB"


def test_okvqa_target_is_most_frequent_answer_ties_to_first(tmp_path):
    write_vqa(tmp_path, "ok-vqa", split="train", answers=["cat"] * 4 + ["dog"] * 4 + ["cow"] * 2)
    items = tasks.load_task("ok-vqa", "train", tmp_path)
    assert items[0].target == "cat" and items[1].target == "yes"
    assert readers.most_frequent(["b", "a", "a", "b", "c"]) == "b"


def test_karpathy_readers(tmp_path):
    write_karpathy(tmp_path)
    train, val = tasks.load_task("coco", "train", tmp_path), tasks.load_task("coco", "val", tmp_path)
    assert [i.id for i in train] == [1000, 1001] and [i.id for i in val] == [1002]  # Karpathy's val (MimIC's code)
    assert val[0].question is None and val[0].answers == ("A dog 2.", "Some dog 2.") and val[0].target == "A dog 2."
    assert val[0].image_path == str(tmp_path / "coco" / "val2014" / "COCO_val2014_000000000002.jpg")
    assert [i.id for i in tasks.load_task("coco", "test", tmp_path)] == [1003]  # --split test: Karpathy's test
    flickr = tasks.load_task("flickr30k", "val", tmp_path)
    assert [i.id for i in flickr] == [2] and flickr[0].target == "A man 2."
    assert flickr[0].image_path == str(tmp_path / "flickr30k" / "flickr30k-images" / "102.jpg")
    assert [i.id for i in tasks.load_task("flickr30k", "test", tmp_path)] == [3]


@pytest.mark.parametrize("task, missing", [
    ("vqav2", "vqav2/v2_OpenEnded_mscoco_val2014_questions.json"),
    ("ok-vqa", "ok-vqa/OpenEnded_mscoco_val2014_questions.json"),
    ("coco", "coco/dataset_coco.json"), ("flickr30k", "flickr30k/dataset_flickr30k.json")])
def test_missing_file_names_path_and_dataset(tmp_path, task, missing):
    with pytest.raises(FileNotFoundError) as e:
        tasks.load_task(task, "val", tmp_path)
    assert str(tmp_path / missing) in str(e.value) and task in str(e.value)


def test_missing_annotations_file(tmp_path):
    write_vqa(tmp_path, "vqav2")
    os.remove(tmp_path / "vqav2" / "v2_mscoco_val2014_annotations.json")
    with pytest.raises(FileNotFoundError, match="v2_mscoco_val2014_annotations.json"):
        tasks.load_task("vqav2", "val", tmp_path)


def test_malformed_json(tmp_path):
    write_karpathy(tmp_path)
    (tmp_path / "coco" / "dataset_coco.json").write_text('{"images": [')
    with pytest.raises(ValueError, match="coco: .*dataset_coco.json is not valid JSON"):
        tasks.load_task("coco", "val", tmp_path)


def test_question_without_annotation(tmp_path):
    write_vqa(tmp_path, "vqav2", drop_annotation=True)
    with pytest.raises(ValueError, match="question 42001 .* has no annotation"):
        tasks.load_task("vqav2", "val", tmp_path)


def vqa_root(tmp_path, dataset, questions, annotations):
    folder, qfile, afile = readers.VQA_FILES[dataset]
    (tmp_path / folder).mkdir(exist_ok=True)
    (tmp_path / folder / qfile.format("val")).write_text(json.dumps({"questions": questions}))
    (tmp_path / folder / afile.format("val")).write_text(json.dumps({"annotations": annotations}))
    return str(tmp_path)


@pytest.mark.parametrize("image_id", ["abc", True, None])
def test_a_vqa_image_id_that_is_not_an_integer_is_refused(tmp_path, image_id):
    root = vqa_root(tmp_path, "vqav2", [{**QUESTION, "image_id": image_id}], [ANNOTATION])
    with pytest.raises(ValueError, match=rf"entry 0 of .*questions.json .*: its image_id is {image_id!r}; it must be "
                                         "an integer"):
        tasks.load_task("vqav2", "val", root)


@pytest.mark.parametrize("dataset, annotation, message", [
    ("vqav2", None, r"entry 1 of .*v2_mscoco_val2014_annotations.json .*duplicate question_id 7"),
    ("ok-vqa", None, r"entry 1 of .*mscoco_val2014_annotations.json .*duplicate question_id 7"),
    ("vqav2", {**ANNOTATION, "multiple_choice_answer": None}, r"entry 0 of .*: its multiple_choice_answer is None"),
    ("vqav2", {**ANNOTATION, "answers": []}, r"entry 0 of .*: its answers are \[\]; they must be a non-empty list"),
    ("vqav2", {**ANNOTATION, "answers": [{"answer": 2}] * 10}, r"entry 0 of .*: an answer is \{'answer': 2\}; every "
                                                               r"answer must be"),
    ("ok-vqa", {**ANNOTATION, "answers": []}, r"entry 0 of .*: its answers are \[\]"),
    ("vqav2", {**ANNOTATION, "answers": ["red"] * 10}, r"entry 0 of .*: an answer is 'red'; every answer must be"),
])
def test_vqa_annotations_that_cannot_be_scored_are_refused_naming_file_and_entry(tmp_path, dataset, annotation,
                                                                                message):
    annotations = [ANNOTATION, {**ANNOTATION, "answers": [{"answer": "blue"}] * 10}] if annotation is None else \
        [annotation]
    with pytest.raises(ValueError, match=message):
        tasks.load_task(dataset, "val", vqa_root(tmp_path, dataset, [QUESTION], annotations))


IMAGE = {"filepath": "val2014", "filename": "a.jpg", "imgid": 0, "cocoid": 5, "split": "val",
         "sentences": [{"raw": "A red square."}]}


@pytest.mark.parametrize("dataset, images, message", [
    ("coco", [IMAGE, {**IMAGE, "imgid": 1}], r"coco: entry 1 of .*dataset_coco.json .*duplicate cocoid 5"),
    ("flickr30k", [IMAGE, {**IMAGE, "cocoid": 6}], r"flickr30k: entry 1 of .*dataset_flickr30k.json .*duplicate "
                                                   r"imgid 0"),
    ("flickr30k", [{**IMAGE, "imgid": None}], r"entry 0 of .*: its imgid is None; it must be an integer"),
    ("coco", [{**IMAGE, "split": "train"}, {**IMAGE, "imgid": 1}], r"entry 1 of .*duplicate cocoid 5"),
    ("coco", [{**IMAGE, "cocoid": True}], r"entry 0 of .*: its cocoid is True; it must be an integer"),
    ("coco", [{**IMAGE, "sentences": [{"raw": None}]}], r"entry 0 of .*: its raw is None; it must be non-empty text"),
    ("coco", [{**IMAGE, "sentences": []}], r"entry 0 of .*: it has no captions"),
    ("coco", [{**IMAGE, "filename": None}], r"entry 0 of .*: its filename is None"),
    ("coco", [{k: v for k, v in IMAGE.items() if k != "filename"}],
     r"coco: entry 0 of .*dataset_coco.json .* missing or malformed field \(KeyError: 'filename'"),
])
def test_caption_images_without_one_id_or_a_filename_are_refused(tmp_path, dataset, images, message):
    (tmp_path / dataset).mkdir()
    (tmp_path / dataset / f"dataset_{dataset}.json").write_text(json.dumps({"images": images}))
    with pytest.raises(ValueError, match=message):
        tasks.load_task(dataset, "val", str(tmp_path))


@pytest.mark.parametrize("field, value", [("filepath", "/etc"), ("filepath", ".."), ("filename", "../../x.jpg"),
                                          ("filename", "/etc/passwd")])
def test_a_karpathy_filepath_or_filename_out_of_the_dataset_is_refused_naming_it(tmp_path, field, value):
    os.makedirs(tmp_path / "coco")
    entry = {"cocoid": 1, "split": "val", "filepath": "val2014", "filename": "a.jpg", "sentences": [{"raw": "a"}]}
    path = tmp_path / "coco" / "dataset_coco.json"
    path.write_text(json.dumps({"images": [{**entry, field: value}]}))
    with pytest.raises(ValueError, match=rf"coco: entry 0 of {path} .* is malformed: its {field} '{value}' leads out"):
        readers.read_karpathy(str(tmp_path), "val", "coco")


def vqa_copy(tmp_path, change):
    """A copy of the benchmarks' VQAv2 val questions and annotations, `change`(questions, annotations) applied."""
    root = benchmarks.copy(tmp_path / "root", "vqav2", "coco")
    folder, qfile, afile = readers.VQA_FILES["vqav2"]
    qpath, apath = (os.path.join(root, folder, f.format("val")) for f in (qfile, afile))
    q, a = (json.load(open(p)) for p in (qpath, apath))
    change(q["questions"], a["annotations"])
    for path, obj in ((qpath, q), (apath, a)):
        with open(path, "w") as f:
            json.dump(obj, f)
    return root


@pytest.mark.parametrize("value", [float("nan"), True, 1.5, "100000000", float(10**8)])
def test_a_vqa_question_id_that_is_not_an_integer_is_refused(tmp_path, value):
    def change(questions, annotations):
        questions[0]["question_id"] = annotations[0]["question_id"] = value
    root = vqa_copy(tmp_path, change)
    with pytest.raises(ValueError, match=r"vqav2: entry 0 of .*annotations.json.* its question_id is .*; it must be an "
                                         r"integer"):
        readers.read_vqa(root, "val", "vqav2")


def test_a_string_question_id_and_its_integer_are_not_two_questions(tmp_path):
    def change(questions, annotations):
        annotations.append({**annotations[0], "question_id": str(annotations[0]["question_id"])})
    with pytest.raises(ValueError, match=r"its question_id is '\d+'; it must be an integer"):
        readers.read_vqa(vqa_copy(tmp_path, change), "val", "vqav2")


def test_a_deeply_nested_json_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match=rf"vqav2: {path} is nested too deeply"):
        readers.read_json(str(path), "vqav2")


@pytest.mark.parametrize("questions, annotations, message", [
    ([QUESTION], {"annotations": [ANNOTATION]},
     r"questions.json should be a JSON object with a list under 'questions'"),
    ({"questions": [QUESTION]}, {"annotations": {}}, r"annotations.json should be a JSON object with a list under"),
    ({"questions": [{"question_id": 7, "image_id": 1}]}, {"annotations": [ANNOTATION]},
     r"entry 0 of .*questions.json .* missing or malformed field \(KeyError: 'question'\)"),
    ({"questions": [QUESTION]}, {"annotations": [{"question_id": 7, "multiple_choice_answer": "red"}]},
     r"entry 0 of .*annotations.json .* missing or malformed field \(KeyError: 'answers'\)"),
    ({"questions": [QUESTION, 5]}, {"annotations": [ANNOTATION]}, r"entry 1 of .*questions.json \(5\)"),
])
def test_malformed_dataset_json_names_the_file_and_entry(tmp_path, questions, annotations, message):
    root = vqa_files(tmp_path, questions, annotations)
    with pytest.raises(ValueError, match=message):
        tasks.load_task("vqav2", "val", str(root))


def test_karpathy_file_of_the_wrong_shape_names_the_file(tmp_path):
    (tmp_path / "coco").mkdir(parents=True)
    (tmp_path / "coco" / "dataset_coco.json").write_text(json.dumps([{"split": "test"}]))
    with pytest.raises(ValueError, match="dataset_coco.json should be a JSON object with a list under 'images'"):
        tasks.load_task("coco", "val", str(tmp_path))


@pytest.mark.parametrize("question, message", [(None, "its question is None"), ("  ", "its question is '  '")])
def test_a_null_or_empty_question_names_the_file_and_entry(tmp_path, question, message):
    root = vqa_files(tmp_path, {"questions": [{**QUESTION, "question": question}]}, {"annotations": [ANNOTATION]})
    with pytest.raises(ValueError, match=rf"vqav2: entry 0 of .*questions.json .*: {message}"):
        tasks.load_task("vqav2", "val", str(root))


def test_duplicate_vqa_question_ids_are_an_error(tmp_path):
    root = vqa_files(tmp_path, {"questions": [QUESTION, QUESTION]}, {"annotations": [ANNOTATION]})
    with pytest.raises(ValueError, match=r"entry 1 of .*questions.json .*duplicate question_id 7"):
        tasks.load_task("vqav2", "val", str(root))


@pytest.mark.parametrize("change, message", [
    (lambda coco: coco.pop("categories"), r"instances_val2014.json should be a JSON object with a list under "
                                          r"'categories'"),
    (lambda coco: coco["annotations"][0].update(category_id=99), r"entry 0 of .*instances_val2014.json .*: "
                                                                 r"category_id 99 is not among the file's categories"),
])
def test_coco_instances_without_categories_or_with_unknown_ones_are_named(tmp_path, change, message):
    items = tasks.load_task("coco", "val", benchmarks.copy(tmp_path, "coco"))[:2]
    path = readers.instances_path(str(tmp_path), "val2014")
    coco = json.load(open(path))
    change(coco)
    open(path, "w").write(json.dumps(coco))
    with pytest.raises(ValueError, match=message):
        readers.read_instances(items)


@pytest.mark.parametrize("answer, message", [  # issue 63, item 14: OK-VQA's target, its most frequent answer, was
    ("<image> <|image_pad|>", "holds '<image>', an image placeholder"),  # never checked (VQAv2's was)
    ("two</s>", "holds '</s>', a control token"),
    ("\ud800", "holds a lone surrogate (U+D800)"),
])
def test_an_ok_vqa_target_that_is_no_plain_text_is_refused_naming_the_entry(tmp_path, answer, message):
    write_vqa(tmp_path, "ok-vqa", answers=[answer] * 6 + ["2"] * 4)
    with pytest.raises(ValueError, match=rf"ok-vqa: entry 0 of .* is malformed: its most frequent answer "
                                         rf"\(its target\) {re.escape(message)}"):
        tasks.load_task("ok-vqa", "val", tmp_path)
    write_vqa(tmp_path, "ok-vqa", answers=[answer] * 4 + ["2"] * 6)  # a reference only: scored, never in a row
    assert tasks.load_task("ok-vqa", "val", tmp_path)[0].target == "2"


def test_a_question_of_zero_width_spaces_is_refused_as_empty(tmp_path):
    """Issue 63, item 7: U+200B and U+FEFF are not whitespace to str.strip."""
    write_vqa(tmp_path, "vqav2")
    path = os.path.join(tmp_path, "vqav2", readers.VQA_FILES["vqav2"][1].format("val"))
    questions = json.load(open(path))
    questions["questions"][1]["question"] = "\u200b\ufeff\u2060"
    files.write_json(path, questions)
    with pytest.raises(ValueError, match=r"entry 1 of .* its question is .*; it must be non-empty text"):
        tasks.load_task("vqav2", "val", tmp_path)
