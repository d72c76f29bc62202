"""MME, SEED-Bench and SEED-Bench-2 (lab/datasets/mme_seed.py): the readers on hand-written files in the official
formats and on copies of tools/benchmarks.py's, and every malformed line, question, id or image refused naming it."""
import json
import os
import shutil

import pytest
from PIL import Image

import benchmarks
import data
from lab.datasets import mme_seed, tasks
from lab.disk import files


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def image(path, fmt="JPEG"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(path, fmt)


@pytest.fixture
def mme_root(tmp_path):
    """Two subtasks as the release lays them out: existence (image beside its questions, .jpg and .png) and
    artwork (images/ and questions_answers_YN/)."""
    flat, nested = tmp_path / "mme" / "existence", tmp_path / "mme" / "artwork"
    image(flat / "0001.jpg")
    write(flat / "0001.txt", "Is there a dog? Please answer yes or no.\tYes\n"
                             "Is there a cat? Please answer yes or no.\tNo\n\n")  # a trailing blank line
    image(flat / "0002.png", "PNG")
    write(flat / "0002.txt", "Is there a car?\tno\r\nIs there a bus?\tYes\r\n")  # lowercase, CRLF
    image(nested / "images" / "10002.jpg")
    write(nested / "questions_answers_YN" / "10002.txt", "Is it a painting?\tYes\nIs it glassware?\tNo")
    return str(tmp_path)


def test_mme_reader_both_layouts(mme_root):
    items = mme_seed.read_mme(mme_root, ("existence", "artwork"))
    assert [it.id for it in items] == list(range(6))
    assert [(it.question, it.target, it.category) for it in items] == [
        ("Is there a dog? Please answer yes or no.", "Yes", "existence"),
        ("Is there a cat? Please answer yes or no.", "No", "existence"),
        ("Is there a car?", "No", "existence"), ("Is there a bus?", "Yes", "existence"),
        ("Is it a painting?", "Yes", "artwork"), ("Is it glassware?", "No", "artwork")]
    assert [os.path.relpath(it.image_path, mme_root) for it in items[::2]] == [
        "mme/existence/0001.jpg", "mme/existence/0002.png", "mme/artwork/images/10002.jpg"]
    assert all(it.answers == (it.target,) for it in items)
    assert data.load_image(items[4]).size == (8, 8)


@pytest.mark.parametrize("text, line", [
    ("Is there a dog?\tYes\nIs there a cat? No\n", 2),          # no tab
    ("Is there a dog?\tMaybe\nIs there a cat?\tNo\n", 1),       # not Yes / No
    ("\nIs there a dog?\tYes\tNo\n", 2),                        # three fields (line numbers count blank lines)
])
def test_mme_malformed_line_names_file_and_line(mme_root, text, line):
    path = os.path.join(mme_root, "mme", "existence", "0001.txt")
    write(path, text)
    with pytest.raises(ValueError, match=f"{path} line {line}:"):
        mme_seed.read_mme(mme_root, ("existence",))


def test_mme_needs_two_questions_per_image(mme_root):
    path = os.path.join(mme_root, "mme", "existence", "0001.txt")
    write(path, "Is there a dog?\tYes\n")
    with pytest.raises(ValueError, match=f"{path} has 1 questions"):
        mme_seed.read_mme(mme_root, ("existence",))


def test_mme_missing_image_and_subtask(mme_root):
    os.remove(os.path.join(mme_root, "mme", "artwork", "images", "10002.jpg"))
    path = os.path.join(mme_root, "mme", "artwork", "questions_answers_YN", "10002.txt")
    with pytest.raises(FileNotFoundError, match=f"no image for {path}"):
        mme_seed.read_mme(mme_root, ("artwork",))
    with pytest.raises(FileNotFoundError, match="mme/OCR"):
        mme_seed.read_mme(mme_root, ("OCR",))


def seed_question(qid, dim, data_id, answer="B", **extra):
    return {"answer": answer, "choice_a": "One", "choice_b": "Two ", "choice_c": "Three", "choice_d": "Four",
            "data_id": data_id, "data_type": "image" if dim <= 9 else "video", "question": "How many towels?",
            "question_id": str(qid), "question_type_id": dim, **extra}


@pytest.fixture
def seed_root(tmp_path):
    folder = tmp_path / "seed-bench"
    image(folder / "SEED-Bench-image" / "1454426_2591111986.jpg")
    image(folder / "SEED-Bench-image" / "77_1.png", "PNG")
    questions = [seed_question(101669, 5, "1454426_2591111986"),            # data_id without its extension
                 seed_question(101670, 10, "94328.webm"),                   # video: skipped, never looked up
                 seed_question(7, 1, "77_1.png", answer="D"),              # data_id with it
                 seed_question(8, 9, "1454426_2591111986", answer="A")]
    obj = {"questions": questions, "question_type": {n: k + 1 for k, n in enumerate(benchmarks.SEED_V1_DIMENSIONS)}}
    write(folder / "SEED-Bench.json", json.dumps(obj))
    return str(tmp_path), obj


def test_seed_reader(seed_root):
    root, _ = seed_root
    items = mme_seed.read_seed(root)
    assert [(it.id, it.target, it.category) for it in items] == [
        (101669, "B", "Instances Counting"), (7, "D", "Scene Understanding"), (8, "A", "Text Understanding")]
    assert items[0].answers == ("One", "Two", "Three", "Four") and items[0].question == "How many towels?"
    assert items[0].image_path.endswith("SEED-Bench-image/1454426_2591111986.jpg")
    assert items[1].image_path.endswith("SEED-Bench-image/77_1.png")
    prompt = data.prompt_text("choice", items[0])
    assert prompt == "<image>Question: How many towels?\nA. One\nB. Two\nC. Three\nD. Four\nAnswer:"


@pytest.mark.parametrize("change, error, pattern", [
    (dict(data_id="missing_1"), FileNotFoundError, r"question 7 in .*SEED-Bench.json: its image 'missing_1'"),
    (dict(answer="E"), ValueError, r"question #2 \(question_id 7\) in .*SEED-Bench.json is malformed.*'E'"),
    (dict(choice_c=None), ValueError, r"question #2 \(question_id 7\) in .*SEED-Bench.json is malformed"),
    (dict(question_id="q7"), ValueError, r"question #2 \(question_id q7\) in .*SEED-Bench.json is malformed"),
])
def test_seed_bad_item_names_file_and_item(seed_root, change, error, pattern):
    root, obj = seed_root
    obj["questions"][2].update(change)
    write(os.path.join(root, "seed-bench", "SEED-Bench.json"), json.dumps(obj))
    with pytest.raises(error, match=pattern):
        mme_seed.read_seed(root)


def test_seed_missing_key_is_named(seed_root):
    root, obj = seed_root
    del obj["questions"][0]["choice_c"]
    write(os.path.join(root, "seed-bench", "SEED-Bench.json"), json.dumps(obj))
    with pytest.raises(ValueError, match=r"question #0 \(question_id 101669\).*'choice_c'"):
        mme_seed.read_seed(root)


def write_image(path, size=(40, 30)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, (10, 200, 30)).save(path)


def seed2_question(qid, dimension, data_id, source="cc3m", answer="B", **extra):
    """A question in SEED-Bench-2's official layout (its DATASET.md)."""
    return {"answer": answer, "choice_a": "One", "choice_b": "Two ", "choice_c": "Three", "choice_d": "Four",
            "data_id": data_id, "data_source": source, "data_type": "Single Image", "level": "L1",
            "question": " How many towels are in the image?", "question_id": qid, "question_type_id": dimension,
            "subpart": "Single-Image & Text Comprehension", "version": "v1" if source == "cc3m" else "v2", **extra}


def write_seed2(root, questions):
    base = os.path.join(root, "seed-bench-2")
    write_image(os.path.join(base, "cc3m-image", "1454426_2591111986.jpg"))
    write_image(os.path.join(base, "SEED-Bench-2-image", "task13", "img", "0.png"))
    names = ["Scene Understanding", "Instance Identity", "Instance Attributes", "Instance Location",
             "Instances Counting"] + [f"dim{k}" for k in range(6, 28)]
    files.write_json(os.path.join(base, mme_seed.SEED2_FILE),
                     {"questions": questions, "question_type": {n: k + 1 for k, n in enumerate(names)}})


def test_seed2_reads_the_single_image_part_of_the_official_layout(tmp_path, capsys):
    multi = dict(data_type="Multiple Images", subpart="Multiple-Images & Text Comprehension")
    write_seed2(tmp_path, [
        seed2_question("5_0", 5, "1454426_2591111986"),                              # cc3m, no extension
        seed2_question("13_7", 13, "task13/img/0.png", "SEED-Bench v2", answer="D"),  # a path under v2's folder
        seed2_question("17_0", 17, ["task17/a_1.png", "task17/a_2.png"], "SEED-Bench v2", **multi),   # skipped
        seed2_question("25_0", 25, ["task25/1.jpg"], "SEED-Bench v2", level="L3", subpart="Image Generation")])
    items = mme_seed.read_seed2(str(tmp_path))
    assert [(it.id, it.category, it.target) for it in items] == [(5_000_000, "Instances Counting", "B"),
                                                                 (13_000_007, "dim13", "D")]
    assert items[0].image_path == os.path.join(str(tmp_path), "seed-bench-2", "cc3m-image", "1454426_2591111986.jpg")
    assert items[1].image_path.endswith(os.path.join("SEED-Bench-2-image", "task13", "img", "0.png"))
    assert items[0].answers == ("One", "Two", "Three", "Four")                   # stripped, as SEED-Bench-1's
    assert items[0].question == "How many towels are in the image?"
    assert "seed2: 2 single-image questions; Instances Counting 1, dim13 1" in capsys.readouterr().out


@pytest.mark.parametrize("question, message", [
    (seed2_question("5_0", 5, "missing_id"), "its image 'missing_id' is not under"),
    (seed2_question("5_0", 5, "1454426_2591111986", answer="E"), "answer 'E' is not one of A, B, C, D"),
    (seed2_question("5_0", 5, ["a.jpg"]), "needs one data_id"),
    ({k: v for k, v in seed2_question("5_0", 5, "x").items() if k != "choice_c"}, "malformed.*choice_c"),
])
def test_seed2_bad_question_names_it(tmp_path, question, message):
    write_seed2(tmp_path, [question])
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        mme_seed.read_seed2(str(tmp_path))


def test_seed2_is_selectable_like_seed():
    val, train = (tasks.load_task("seed2", s, benchmarks.ROOT) for s in ("val", "train"))
    assert len(val) + len(train) == benchmarks.SEED_IMAGES  # the skipped multi-image / video / L3 ones are not read
    assert {it.category for it in val + train} >= {"Visual Mathematics", "Scene Understanding"}
    assert not {it.image_path for it in val} & {it.image_path for it in train}
    assert data.default_shots(data.TASKS["seed2"], "idefics2") == 2 and data.TASKS["seed2"].kind == "choice"


def test_an_mme_subtask_that_yields_no_question_is_an_error(tmp_path):
    root = benchmarks.copy(tmp_path, "mme")
    folder = os.path.join(root, "mme", "count")
    shutil.rmtree(folder)
    os.mkdir(folder)
    with pytest.raises(ValueError, match=rf"mme: the subtask folder {folder} holds no question"):
        mme_seed.read_mme(root)


def test_questions_answers_yn_without_images_is_an_error(tmp_path):
    root = benchmarks.copy(tmp_path, "mme")
    folder = os.path.join(root, "mme", "artwork")
    shutil.rmtree(os.path.join(folder, "images"))
    with pytest.raises(FileNotFoundError, match=rf"mme: {folder}/questions_answers_YN is there but "
                                                rf"{folder}/images is not"):
        mme_seed.read_mme(root)


def test_an_mme_image_without_its_question_file_or_images_without_questions_answers_yn_is_an_error(tmp_path):
    root = benchmarks.copy(tmp_path, "mme")
    os.remove(os.path.join(root, "mme", "existence", "0003.txt"))
    with pytest.raises(FileNotFoundError, match=r"mme: no question file for .*existence/0003.jpg \(expected 0003.txt"):
        mme_seed.read_mme(root, ("existence",))
    shutil.rmtree(os.path.join(root, "mme", "scene", "questions_answers_YN"))
    with pytest.raises(FileNotFoundError, match=r"scene/images is there but .*scene/questions_answers_YN is not"):
        mme_seed.read_mme(root, ("scene",))


@pytest.mark.parametrize("change, message", [
    (lambda q: q.pop("level"), r"\(KeyError: 'level'\)"),
    (lambda q: q.update(data_source="elsewhere"), r"its data_source 'elsewhere' is none of "
                                                  r"\['SEED-Bench v2', 'cc3m'\]"),
])
def test_a_seed_bench_2_question_without_level_or_of_an_unknown_source_is_named(tmp_path, change, message):
    root = benchmarks.copy(tmp_path, "seed-bench-2")
    path = os.path.join(root, "seed-bench-2", mme_seed.SEED2_FILE)
    obj = json.load(open(path))
    change(obj["questions"][0])
    open(path, "w").write(json.dumps(obj))
    with pytest.raises(ValueError, match=rf"seed2: question #0 \(question_id {obj['questions'][0]['question_id']}\) "
                                         rf".*{message}"):
        mme_seed.read_seed2(root)


def test_a_seed_bench_2_question_without_subpart_is_named_by_its_question_id(tmp_path):
    root = benchmarks.copy(tmp_path, "seed-bench-2")
    path = os.path.join(root, "seed-bench-2", mme_seed.SEED2_FILE)
    obj = json.load(open(path))
    del obj["questions"][3]["subpart"]
    open(path, "w").write(json.dumps(obj))
    qid = obj["questions"][3]["question_id"]
    with pytest.raises(ValueError, match=rf"seed2: question #3 \(question_id {qid}\) in {path} has a missing or "
                                         r"malformed field \(KeyError: 'subpart'\)"):
        mme_seed.read_seed2(root)


@pytest.mark.parametrize("data_id", ["/etc/passwd", "../SEED-Bench.json", "a/../../../x.jpg"])
def test_a_seed_data_id_out_of_its_folder_is_refused_naming_it(tmp_path, data_id):
    root = benchmarks.copy(tmp_path, "seed-bench")
    path = os.path.join(root, "seed-bench", "SEED-Bench.json")
    obj = json.loads(open(path).read())
    image = next(q for q in obj["questions"] if int(q["question_type_id"]) in mme_seed.SEED_IMAGE_DIMENSIONS)
    image["data_id"] = data_id
    open(path, "w").write(json.dumps(obj))
    with pytest.raises(ValueError, match=rf"seed: question #\d+ .* in {path} is malformed: its data_id "
                                         rf"'{data_id}' leads out of the dataset's folder"):
        mme_seed.read_seed(root)


@pytest.mark.parametrize("value", [3.7, 3.0, True, "3.7"])
def test_a_seed_question_type_id_that_is_not_an_integer_is_refused(tmp_path, value):
    root = benchmarks.copy(tmp_path / "root", "seed-bench")
    path = os.path.join(root, "seed-bench", "SEED-Bench.json")
    obj = json.load(open(path))
    obj["questions"][0]["question_type_id"] = value
    with open(path, "w") as f:
        json.dump(obj, f)
    with pytest.raises(ValueError, match=r"seed: question #0 .* its question_type_id is .*; it must be an integer"):
        mme_seed.read_seed(root)


def test_seed_question_ids_as_digits_still_read(items):
    assert all(isinstance(it.id, int) for it in mme_seed.read_seed(benchmarks.ROOT))


def changed_seed(tmp_path, change):
    root = benchmarks.copy(tmp_path, "seed-bench")
    path = os.path.join(root, "seed-bench", "SEED-Bench.json")
    obj = json.load(open(path))
    change(obj["questions"])
    open(path, "w").write(json.dumps(obj))
    return root


@pytest.mark.parametrize("change, message", [
    (lambda qs: qs[0].update(choice_b=""), r"question #0 .* its choice_b is ''"),
    (lambda qs: qs[0].update(question=None), r"question #0 .* its question is None"),
    (lambda qs: qs[1].update(question_id=qs[0]["question_id"]), r"question #1 .* duplicate question_id"),
    (lambda qs: qs[3].update(question_type_id=42), r"question #3 .* question_type_id 42 is not in its question_type"),
])
def test_seed_bench_questions_are_checked_when_read(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        mme_seed.read_seed(changed_seed(tmp_path, change))


def test_seed_bench_questions_that_are_not_a_list_name_the_file(tmp_path):
    root = changed_seed(tmp_path, lambda qs: None)
    path = os.path.join(root, "seed-bench", "SEED-Bench.json")
    open(path, "w").write(json.dumps({"questions": 5, "question_type": {"Scene Understanding": 1}}))
    with pytest.raises(ValueError, match=rf"seed: {path} needs `questions`.*not a list"):
        mme_seed.read_seed(root)


def mme_file(tmp_path):
    root = benchmarks.copy(tmp_path, "mme")
    return root, os.path.join(root, "mme", "existence", "0000.txt")


def test_undecodable_text_names_the_file_and_a_byte_order_mark_is_stripped(tmp_path):
    root, path = mme_file(tmp_path)
    text = open(path, "rb").read()
    open(path, "wb").write(b"\xef\xbb\xbf" + text)
    assert mme_seed.read_mme(root, ("existence",))[0].question == text.decode().split("\t")[0]
    open(path, "wb").write(text.replace(b"Is", b"\xff\xfe", 1))
    with pytest.raises(ValueError, match=rf"mme: {path} is not UTF-8 text \(byte 0"):
        mme_seed.read_mme(root, ("existence",))
    seed = changed_seed(tmp_path, lambda qs: None)
    json_path = os.path.join(seed, "seed-bench", "SEED-Bench.json")
    raw = open(json_path, "rb").read()
    open(json_path, "wb").write(b"\xef\xbb\xbf" + raw)
    assert mme_seed.read_seed(seed)
    open(json_path, "wb").write(raw.replace(b"What", b"Wh\xe0t", 1))
    with pytest.raises(ValueError, match=rf"seed: {json_path} is not UTF-8 text"):
        mme_seed.read_seed(seed)


def test_an_mme_line_without_a_question_is_an_error(tmp_path):
    root, path = mme_file(tmp_path)
    open(path, "w").write("\tYes\nIs it red?\tNo\n")
    with pytest.raises(ValueError, match=rf"mme: {path} line 1: expected"):
        mme_seed.read_mme(root, ("existence",))


def seed2_root(tmp_path, change):
    root = benchmarks.copy(tmp_path, "seed-bench-2")
    path = os.path.join(root, "seed-bench-2", mme_seed.SEED2_FILE)
    obj = json.load(open(path))
    change([q for q in obj["questions"] if q["subpart"] == mme_seed.SEED2_SUBPART])
    open(path, "w").write(json.dumps(obj))
    return root


@pytest.mark.parametrize("change, message", [
    (lambda qs: qs[1].update(question_id=qs[0]["question_id"]), r"question #1 .* duplicate question_id"),
    (lambda qs: qs[0].update(choice_b=""), r"question #0 .* its choice_b is ''"),
    (lambda qs: qs[0].update(choice_d=None), r"question #0 .* its choice_d is None"),
    (lambda qs: qs[0].update(question="  "), r"question #0 .* its question is '  '"),
    (lambda qs: qs[0].update(question_id="1_1000000"), r"question #0 .* question_id '1_1000000' is not of the form"),
    (lambda qs: qs[0].update(question_id="1_01"), r"question #0 .* question_id '1_01' is not of the form"),
    (lambda qs: qs[0].update(question_id=7), r"question #0 .* question_id 7 is not of the form"),
])
def test_seed_bench_2_questions_get_seed_bench_1s_checks(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        mme_seed.read_seed2(seed2_root(tmp_path, change))


def test_seed_bench_2_ids_cannot_collide():
    assert mme_seed.seed2_id("2_0") == 2_000_000 and mme_seed.seed2_id("1_999999") == 1_999_999
    for bad in ("1_1000000", "-1_5", "1_-5", "1_+5", "1_5_0", "1_٣"):
        with pytest.raises(ValueError, match="is not of the form"):
            mme_seed.seed2_id(bad)


def test_an_mme_image_present_as_jpg_and_png_is_an_error_naming_both(tmp_path):
    root = benchmarks.copy(tmp_path, "mme")
    folder = os.path.join(root, "mme", "existence")
    jpg = sorted(f for f in os.listdir(folder) if f.endswith(".jpg"))[0]
    shutil.copy(os.path.join(folder, jpg), os.path.join(folder, jpg[:-4] + ".png"))
    with pytest.raises(ValueError, match=rf"mme: .*{jpg} and .*{jpg[:-4]}.png are two images for one question file"):
        mme_seed.read_mme(root, ("existence",))
