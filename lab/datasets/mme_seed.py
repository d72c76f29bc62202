"""Readers of MME (its folders of images and question files) and SEED-Bench / SEED-Bench-2 (their JSON)."""
import os
from collections import Counter

import data
from lab.datasets import readers


MME_PERCEPTION = ("existence", "count", "position", "color", "posters", "celebrity", "scene", "landmark", "artwork",
                  "OCR")  # subtask lists and order of the official eval_tool/calculation.py

MME_COGNITION = ("commonsense_reasoning", "numerical_calculation", "text_translation", "code_reasoning")

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")


def mme_files(folder):
    """(question file, image) paths of one MME subtask folder, in either official layout."""
    qdir, idir = os.path.join(folder, "questions_answers_YN"), os.path.join(folder, "images")
    if os.path.isdir(qdir) != os.path.isdir(idir):  # half of the nested layout: its questions would vanish
        have, lack = (qdir, idir) if os.path.isdir(qdir) else (idir, qdir)
        raise FileNotFoundError(f"mme: {have} is there but {lack} is not; the release keeps both (layout: "
                                "docs/real-models.md)")
    if not os.path.isdir(qdir):
        qdir = idir = folder
    images = {}
    for f in sorted(os.listdir(idir)):
        if f.lower().endswith(IMAGE_EXTENSIONS):
            stem = os.path.splitext(f)[0]
            if stem in images:
                raise ValueError(f"mme: {os.path.join(idir, images[stem])} and {os.path.join(idir, f)} are two "
                                 "images for one question file; keep one")
            images[stem] = f
    names = sorted(f for f in os.listdir(qdir) if f.endswith(".txt"))
    alone = sorted(images.keys() - {name[:-len(".txt")] for name in names})  # their questions would vanish
    if alone:
        more = f", nor for {len(alone) - 1} more images" if alone[1:] else ""
        raise FileNotFoundError(f"mme: no question file for {os.path.join(idir, images[alone[0]])} (expected "
                                f"{alone[0]}.txt in {qdir}){more}")
    for name in names:
        path, stem = os.path.join(qdir, name), name[:-len(".txt")]
        if stem not in images:
            raise FileNotFoundError(f"mme: no image for {path} (expected {stem}.jpg or .png in {idir})")
        yield path, os.path.join(idir, images[stem])


def read_mme_questions(path):
    """The (question, Yes|No) lines of one MME question file: exactly two, blank lines skipped."""
    pairs = []
    for n, line in enumerate(readers.read_text(path, "mme").split("\n"), 1):
        if not line.strip():
            continue
        fields = line.rstrip("\r").split("\t")
        if len(fields) != 2 or not fields[0].strip() or fields[1].strip().lower() not in ("yes", "no"):
            raise ValueError(f"mme: {path} line {n}: expected `question<TAB>Yes|No`, got {line.strip()!r}")
        try:
            pairs.append((readers.plain_text(fields[0].strip(), "question"), fields[1].strip().capitalize()))
        except ValueError as e:
            raise ValueError(f"mme: {path} line {n}: {e}") from None
    if len(pairs) != 2:
        raise ValueError(f"mme: {path} has {len(pairs)} questions; MME asks two about each image")
    return pairs


def read_mme(root, subtasks=MME_PERCEPTION + MME_COGNITION):
    """MME's questions from root/mme/<subtask>/..., subtask by subtask, files in name order. Ids count from 0."""
    items = []
    for subtask in subtasks:
        folder = os.path.join(root, "mme", subtask)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"mme: expected the subtask folder {folder} (layout: docs/real-models.md)")
        before = len(items)
        for path, image in mme_files(folder):
            items += [data.Item(len(items) + k, image, q, (a,), a, subtask)
                      for k, (q, a) in enumerate(read_mme_questions(path))]
        if len(items) == before:  # MME's totals sum every subtask: one missing is not comparable with Table 2
            raise ValueError(f"mme: the subtask folder {folder} holds no question; expected <name>.txt and its image "
                             "(or questions_answers_YN/ and images/; layout: docs/real-models.md)")
    return items


SEED_IMAGE_DIMENSIONS = range(1, 10)  # question_type_id of the image questions; 10-12 are video

SEED2_FILE = "SEED-Bench_v2_level1_2_3.json"  # the official eval.py's --anno_path

SEED2_FOLDERS = {"cc3m": "cc3m-image", "SEED-Bench v2": "SEED-Bench-2-image"}  # data_source -> image folder

SEED2_SUBPART = "Single-Image & Text Comprehension"  # dimensions 1-16: one image, a text answer

SEED2_MAX_K = 1_000_000


def read_seed(root):
    """SEED-Bench-1's image questions (dimensions 1-9) from root/seed-bench, in file order. Ids: question_id."""
    path, folder = (os.path.join(root, "seed-bench", f) for f in ("SEED-Bench.json", "SEED-Bench-image"))
    questions, names = seed_questions(path, "seed")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"seed: expected the image folder {folder} (layout: docs/real-models.md)")
    items, seen = [], set()
    for n, q in enumerate(questions):
        with readers.entry(path, "seed", n, q, question=True):
            if readers.plain_integer(q, "question_type_id") in names.keys() - set(SEED_IMAGE_DIMENSIONS):
                continue  # a video question
            qid = readers.plain_integer(q, "question_id")
            readers.unique_id(seen, qid, "question_id")
            items.append(seed_item("seed", path, folder, q, qid, names))
    return items


def read_seed2(root):
    """SEED-Bench-2's single-image questions (subpart "Single-Image & Text Comprehension", dimensions 1-16, levels
    L1-L2 as its eval.py's default) from root/seed-bench-2, in file order; prints the count per dimension. The
    multi-image, video, interleaved and generation dimensions (17-27) need more than one image or an image output,
    which a single-image model cannot give, and are skipped."""
    path = os.path.join(root, "seed-bench-2", SEED2_FILE)
    questions, names = seed_questions(path, "seed2")
    items, seen = [], set()
    for n, q in enumerate(questions):
        with readers.entry(path, "seed2", n, q, question=True):
            if q["subpart"] != SEED2_SUBPART or q["level"] not in ("L1", "L2"):
                continue  # not the single-image part
            if not isinstance(q["data_id"], str):
                raise ValueError(f"a single-image question needs one data_id, got {q['data_id']!r}")
            if q["data_source"] not in SEED2_FOLDERS:
                raise ValueError(f"its data_source {q['data_source']!r} is none of {sorted(SEED2_FOLDERS)}")
            folder = os.path.join(root, "seed-bench-2", SEED2_FOLDERS[q["data_source"]])
            readers.unique_id(seen, q["question_id"], "question_id")  # the plain form only (seed2_id): one number each
            items.append(seed_item("seed2", path, folder, q, seed2_id(q["question_id"]), names))
    counts = Counter(it.category for it in items)
    print(f"seed2: {len(items)} single-image questions; " +
          ", ".join(f"{names[k]} {counts[names[k]]}" for k in sorted(names) if names[k] in counts))
    return items


def seed_questions(path, dataset):
    """A SEED-Bench file's questions and its dimensions {question_type_id: name}."""
    obj = readers.read_json(path, dataset)
    try:
        names = {int(v): k for k, v in obj["question_type"].items()}
        if not isinstance(obj["questions"], list):
            raise TypeError(f"`questions` is {type(obj['questions']).__name__}, not a list")
        return obj["questions"], names
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{dataset}: {path} needs `questions` and a `question_type` name -> id mapping ({e!r})") from e


def seed_item(dataset, path, folder, q, qid, names):
    """A SEED-Bench(-2) question as an Item, after the checks of both: a known dimension, four options, an answer
    letter, a question, and its image in `folder` (data_id, else data_id with an image extension)."""
    dimension = readers.plain_integer(q, "question_type_id")  # 3.7 is no dimension (int() would make it 3)
    if dimension not in names:
        raise ValueError(f"question_type_id {q['question_type_id']!r} is not in its question_type mapping")
    answer, options = q["answer"].strip(), tuple(readers.text_field(q, f"choice_{x}") for x in "abcd")
    if answer not in tuple(data.SEED_LETTERS):
        raise ValueError(f"answer {answer!r} is not one of A, B, C, D")
    question = readers.text_field(q, "question")
    candidates = [os.path.join(folder, readers.relative(q["data_id"], "data_id") + e) for e in ("", *IMAGE_EXTENSIONS)]
    image = next((p for p in candidates if os.path.isfile(p)), None)
    if image is None:
        raise FileNotFoundError(f"{dataset}: question {q['question_id']} in {path}: its image {q['data_id']!r} is "
                                f"not under {folder}")
    return data.Item(qid, image, question, options, answer, names[dimension])


def seed2_id(question_id):
    """An int id for a SEED-Bench-2 question_id "{dimension}_{k}": dimension x SEED2_MAX_K + k. Only the plain form
    is read (no sign, no leading zero, k below SEED2_MAX_K), so two ids never share a number."""
    parts = str(question_id).split("_") if isinstance(question_id, str) else ()
    if len(parts) != 2 or not all(p.isdigit() and p.isascii() and str(int(p)) == p for p in parts) or \
            int(parts[1]) >= SEED2_MAX_K:
        raise ValueError(f"question_id {question_id!r} is not of the form <dimension>_<k> (plain numbers, k below "
                         f"{SEED2_MAX_K:,})")
    return int(parts[0]) * SEED2_MAX_K + int(parts[1])
