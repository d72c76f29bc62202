"""Readers of the official formats: VQAv2 / OK-VQA questions and annotations, COCO / Flickr30k Karpathy splits,
COCO instances; every field checked, naming the file and entry."""
import contextlib
import json
import os
import re
import sys
import unicodedata
import warnings
from collections import Counter

from PIL import Image

import data


VQA_FILES = {  # dataset -> (folder, questions file, annotations file); {} is the split
    "vqav2": ("vqav2", "v2_OpenEnded_mscoco_{}2014_questions.json", "v2_mscoco_{}2014_annotations.json"),
    "ok-vqa": ("ok-vqa", "OpenEnded_mscoco_{}2014_questions.json", "mscoco_{}2014_annotations.json"),
}

KARPATHY_SPLITS = {"train": ("train", "restval"), "val": ("val",), "test": ("test",)}  # --split -> Karpathy's: val
# (COCO's 5,000 images, Flickr30k's 1,000) as the paper's protocol runs in MimIC's code; test by --split test

KARPATHY_IDS = {"coco": "cocoid", "flickr30k": "imgid"}  # an item's id: COCO's image id, Flickr30k's Karpathy id


def read_json(path, dataset):
    """Parse a JSON file; a missing or malformed file is an error naming the path and the dataset."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{dataset}: expected the file {path} (layout: docs/real-models.md)")
    try:
        return json.loads(read_text(path, dataset))
    except json.JSONDecodeError as e:
        raise ValueError(f"{dataset}: {path} is not valid JSON ({e})") from e
    except RecursionError as e:  # Python's parser recurses per level: [[[...]]] 200,000 deep
        raise ValueError(f"{dataset}: {path} is nested too deeply to be an official file (JSON arrays or objects "
                         f"more than {sys.getrecursionlimit()} levels deep)") from None


def read_text(path, dataset):
    """A UTF-8 text file's contents, a byte-order mark stripped; undecodable bytes are an error naming the file."""
    with open(path, "rb") as f:
        raw = f.read()
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{dataset}: {path} is not UTF-8 text (byte {e.start}: {raw[e.start:e.start + 4]!r}); "
                         "save it as UTF-8") from e


def text_field(record, name):
    """record[name] as a stripped string; null, blank, not a string or no plain text (plain_text) is a ValueError
    naming the field."""
    value = record[name]
    if not isinstance(value, str) or blank(value):
        raise ValueError(f"its {name} is {value!r}; it must be non-empty text")
    return plain_text(value.strip(), name)


def blank(text):
    """Whether text shows nothing: empty, or whitespace, control and format characters only (zero-width spaces,
    U+FEFF), which str.strip keeps."""
    return not text.strip() or (not text.isascii() and
                                all(c.isspace() or unicodedata.category(c) in ("Cc", "Cf") for c in text))


IMAGE_PLACEHOLDERS = ("<image>", "<fake_token_around_image>", "<global-img>",  # Idefics2, Idefics, LLaVA, Idefics3
                      "<|image_pad|>", "<|vision_start|>", "<|vision_end|>",  # Qwen2.5-VL and Qwen3-VL
                      "<start_of_image>", "<end_of_image>", "<image_soft_token>",  # Gemma 3
                      "<IMG_CONTEXT>", "<img>", "</img>",  # InternVL3 (lab/models/families.py: each family's)
                      "<|video_pad|>", "<video>")  # the video tokens: Qwen's M-RoPE counts <|video_pad|> as a video's
# text holding one would reach the model as an image (or video) token of no image (plain_text); a new family adds its
# own here (every media token its config names: tests/lab/datasets/test_own_task.py)

CONTROL_TOKENS = ("<s>", "</s>", "<unk>", "<pad>", "<bos>", "<eos>",  # BOS / EOS / padding of every family
                  "<end_of_utterance>",  # Idefics2, Idefics, Idefics3 and SmolVLM: the end of a turn
                  "<start_of_turn>", "<end_of_turn>",  # Gemma 3's turns
                  "<tool_call>", "</tool_call>", "<think>", "</think>",  # Qwen's chat templates
                  "<|im_start|>", "<|im_end|>", "<|endoftext|>")  # ChatML (Qwen, LLaVA, InternVL, SmolVLM)
# a chat or control token: text holding one becomes its id, so a question could end its turn or open the assistant's,
# and an answer `red<end_of_utterance>` be read as a target (plain_text). With them every <|...|> token (Qwen's and
# Llama 3's: <|vision_start|>, <|eot_id|>, ...) and Idefics3's <row_i_col_j>; a family's tokenizer adds none other
# (tests/lab/datasets/test_own_task.py reads every twin tokenizer's added tokens)

NOT_PLAIN = re.compile("|".join(map(re.escape, IMAGE_PLACEHOLDERS + CONTROL_TOKENS)) +
                       r"|<\|\w+\|>|<row_\d+_col_\d+>|[\ud800-\udfff]")


def open_image(file):
    """PIL's image of `file` (a path or a binary file), its header read, opened as data.load_image opens images: one
    of data.IMAGE_FORMATS (never EPS, which PIL hands to Ghostscript), each side at least data.MIN_IMAGE_SIDE and at
    most data.MAX_ASPECT times the other, within PIL's decompression-bomb limit (Image.MAX_IMAGE_PIXELS); else a
    ValueError saying why, which the caller prefixes with the file and line, or the shard and row."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # over the limit: refused, not warned
            im = Image.open(file, formats=data.IMAGE_FORMATS)
    except Image.UnidentifiedImageError:
        raise ValueError(f"not an image of the formats read ({', '.join(data.IMAGE_FORMATS)}; any other, EPS among "
                         "them, could run a program)") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # a traceback at read before
        raise ValueError(f"{e} (PIL.Image.MAX_IMAGE_PIXELS is {Image.MAX_IMAGE_PIXELS:,}); make it smaller") from None
    problem = size_problem(*im.size)
    if problem:
        im.close()
        raise ValueError(problem)
    return im


def size_problem(width, height):
    """Why an image of width x height pixels is refused (None if it is not): each side at least data.MIN_IMAGE_SIDE
    and at most data.MAX_ASPECT times the other, as data.load_image loads images."""
    if min(width, height) >= data.MIN_IMAGE_SIDE and max(width, height) <= data.MAX_ASPECT * min(width, height):
        return None
    return (f"its image is {width} x {height} pixels; each side must be at least {data.MIN_IMAGE_SIDE} (Idefics2's "
            f"image splitting halves each) and at most {data.MAX_ASPECT} times the other (Qwen's processors refuse "
            "more)")


def plain_text(text, name):
    """text, which is text to every family's tokenizer (text is text: refused, never escaped): no image placeholder (a
    question or answer with `<image>` in it would reach the model as an image token without an image, "Image features
    and image tokens do not match" after it loaded), no control token (CONTROL_TOKENS) and no lone surrogate ("\\ud800"
    in JSON, which no tokenizer takes). A ValueError naming the field and what it holds otherwise."""
    held = NOT_PLAIN.search(text) if "<" in text or not text.isascii() else None
    if held is None:
        return text
    held = held.group()
    if len(held) == 1:
        raise ValueError(f"its {name} holds a lone surrogate (U+{ord(held):04X}) at character {text.index(held)}, "
                         "half of a UTF-16 pair, which is no text (a broken \\u escape?); write the character meant")
    if held in IMAGE_PLACEHOLDERS:
        raise ValueError(f"its {name} holds {held!r}, an image placeholder (readers.IMAGE_PLACEHOLDERS), which the "
                         "model would take for an image; write it otherwise")
    raise ValueError(f"its {name} holds {held!r}, a control token of a family's tokenizer (readers.CONTROL_TOKENS), "
                     "which would end or open a chat turn; write it otherwise")


def integer_field(record, name):
    """record[name], an integer; null, a boolean or anything else is a ValueError naming the field."""
    value = record[name]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"its {name} is {value!r}; it must be an integer")
    return value


def plain_integer(record, name):
    """record[name] as an int: an integer, or a string of plain decimal digits (SEED-Bench's question_id is "101669"
    in its official file); a float (3.7, 3.0, NaN), a boolean or any other text is a ValueError naming the field."""
    value = record[name]
    if isinstance(value, str) and value.isascii() and value.isdigit() and str(int(value)) == value:
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"its {name} is {value!r}; it must be an integer (or its plain decimal digits)")
    return value


def unique_id(seen, qid, what):
    """Record an item id; one seen before is a ValueError (every prediction line must name one item)."""
    if qid in seen:
        raise ValueError(f"duplicate {what} {qid!r}")
    seen.add(qid)


def records(path, dataset, key):
    """The list under `key` in a JSON file whose top level is an object; any other shape names the file."""
    obj = read_json(path, dataset)
    if not isinstance(obj, dict) or not isinstance(obj.get(key), list):
        raise ValueError(f"{dataset}: {path} should be a JSON object with a list under {key!r} (the official format)")
    return obj[key]


@contextlib.contextmanager
def entry(path, dataset, n, record, question=False):
    """Turn a missing, mistyped or bad field of the n-th entry of a JSON file into a ValueError naming the file and
    the entry: by its text, or (`question`, SEED-Bench's) by its question_id."""
    def where():  # only on an error: str(record) of every record would slow the readers down
        qid = record.get("question_id") if isinstance(record, dict) else "?"
        return f"question #{n} (question_id {qid}) in {path}" if question else \
            f"entry {n} of {path} ({str(record)[:80]})"
    with named(dataset, where):
        yield


@contextlib.contextmanager
def named(dataset, where):
    """A missing, mistyped or bad field becomes a ValueError "<dataset>: <where()> ..." (where: called on an error)."""
    try:
        yield
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{dataset}: {where()} has a missing or malformed field ({type(e).__name__}: {e})") from e
    except ValueError as e:
        raise ValueError(f"{dataset}: {where()} is malformed: {e}") from e


def relative(value, field):
    """A path from an annotation's `field`, which must stay inside the dataset's folder: an absolute one or one that
    climbs with '..' is a ValueError naming the field (a downloaded file could point at any file on the machine)."""
    if isinstance(value, str) and (os.path.isabs(value) or ".." in value.replace("\\", "/").split("/")):
        raise ValueError(f"its {field} {value!r} leads out of the dataset's folder (absolute or with '..')")
    return value


def coco_image(root, split, image_id):
    """The path of a COCO 2014 image under data_root."""
    return os.path.join(root, "coco", f"{split}2014", f"COCO_{split}2014_{image_id:012d}.jpg")


def vqa_answers(answers):
    """The human answers of a VQA annotation ([{"answer": text}, ...]) as a tuple of strings: an empty list, or an
    answer that is not text, is a ValueError (VQA accuracy and the most frequent answer need them)."""
    if not isinstance(answers, list) or not answers:
        raise ValueError(f"its answers are {answers!r}; they must be a non-empty list of {{'answer': text}}")
    for x in answers:
        if not isinstance(x, dict) or not isinstance(x.get("answer"), str):
            raise ValueError(f"an answer is {x!r}; every answer must be {{'answer': text}}")
    return tuple(x["answer"] for x in answers)


def most_frequent(answers):
    """The most frequent answer; ties go to the one that occurs first."""
    if len(answers) == 1:  # an own task's one answer a record: a Counter each was a fifth of reading 200,000
        return answers[0]
    return Counter(answers).most_common(1)[0][0]  # Counter keeps first-seen order among equal counts


def okvqa_target(answers):
    """OK-VQA's target, its most frequent answer, which reaches a row as an ICD's answer: plain text (plain_text), as
    VQAv2's multiple_choice_answer is checked; the other answers are references only (scored, never in a row)."""
    return plain_text(most_frequent(answers), "most frequent answer (its target)")


def read_vqa(root, split, dataset):
    """VQAv2 or OK-VQA ("vqav2" / "ok-vqa") questions of one split, joined with their annotations."""
    folder, qfile, afile = VQA_FILES[dataset]
    qpath, apath = (os.path.join(root, folder, f.format(split)) for f in (qfile, afile))
    questions, annotations = records(qpath, dataset, "questions"), {}
    for n, a in enumerate(records(apath, dataset, "annotations")):
        with entry(apath, dataset, n, a):
            answers = vqa_answers(a["answers"])
            target = text_field(a, "multiple_choice_answer") if dataset == "vqav2" else okvqa_target(answers)
            qid = integer_field(a, "question_id")  # the official files' ids are integers: no 1.0, "1", NaN or true
            if qid in annotations:  # a second annotation would silently replace the first
                raise ValueError(f"duplicate question_id {qid!r} (another annotation has it)")
            annotations[qid] = answers, target
    items, seen = [], set()
    for n, q in enumerate(questions):
        with entry(qpath, dataset, n, q):
            qid = integer_field(q, "question_id")
            if qid not in annotations:
                raise ValueError(f"question {qid} in {qpath} has no annotation in {apath}")
            unique_id(seen, qid, "question_id")
            items.append(data.Item(qid, coco_image(root, split, integer_field(q, "image_id")),
                                   text_field(q, "question"), *annotations[qid]))
    return items


def read_karpathy(root, split, dataset):
    """COCO Caption or Flickr30k ("coco" / "flickr30k") images of one split from the Karpathy split file."""
    path, id_field = os.path.join(root, dataset, f"dataset_{dataset}.json"), KARPATHY_IDS[dataset]
    items, seen = [], set()
    for n, im in enumerate(records(path, dataset, "images")):
        with entry(path, dataset, n, im):
            image_id = integer_field(im, id_field)  # what a prediction line and CIDEr's per-image score go by
            unique_id(seen, image_id, id_field)
            if im["split"] not in KARPATHY_SPLITS[split]:
                continue
            folder = relative(im["filepath"], "filepath") if dataset == "coco" else "flickr30k-images"
            filename = relative(im["filename"], "filename")
            if not isinstance(filename, str) or not filename or not isinstance(folder, str):
                raise ValueError(f"its filename is {filename!r} in folder {folder!r}; both must be text")
            captions = tuple(text_field(s, "raw") for s in im["sentences"])
            if not captions:
                raise ValueError("it has no captions")
        items.append(data.Item(image_id, os.path.join(root, dataset, folder, filename), None, captions, captions[0]))
    return items


def instances_path(root, folder):
    """The official COCO instance annotations of one image folder ("train2014" / "val2014") under data_root."""
    return os.path.join(root, "coco", "annotations", f"instances_{folder}.json")


def read_instances(items):
    """The COCO objects in each caption item's image (its id is the COCO image id), from the official instances files
    of the images' folders: ({item id: set of category names}, all category names the files declare)."""
    objects, categories = {}, set()
    for folder in sorted({os.path.dirname(it.image_path) for it in items}):
        path = instances_path(os.path.dirname(os.path.dirname(folder)), os.path.basename(folder))
        if not os.path.isfile(path):
            raise FileNotFoundError(f"CHAIR needs the COCO instance annotations {path} (instances_*2014.json of "
                                    "annotations_trainval2014.zip)")
        names = {}
        for n, c in enumerate(records(path, "coco instances", "categories")):
            with entry(path, "coco instances", n, c):
                names[c["id"]] = c["name"]
        categories |= set(names.values())
        per_image = {}
        for n, a in enumerate(records(path, "coco instances", "annotations")):
            with entry(path, "coco instances", n, a):
                if a["category_id"] not in names:
                    raise ValueError(f"category_id {a['category_id']!r} is not among the file's categories")
                per_image.setdefault(a["image_id"], set()).add(names[a["category_id"]])
        objects |= {it.id: per_image.get(it.id, set()) for it in items if os.path.dirname(it.image_path) == folder}
    return objects, categories


TEST_SPLITS = {"test-dev": "test-dev2015", "test": "test2015"}  # --split -> the official files' data subtype

QUESTIONS = "v2_OpenEnded_mscoco_{}_questions.json"             # under <data_root>/vqav2/


def questions_path(root, subtype):
    """The official questions file of a test subtype ("test-dev2015" or "test2015") under data_root."""
    return os.path.join(root, "vqav2", QUESTIONS.format(subtype))


def read_questions(root, subtype):
    """The questions of one test subtype as items without answers (answers (), target ""), every field checked; the
    images are coco/test2015/COCO_test2015_{image_id:012d}.jpg (test-dev's are test2015 images)."""
    path, items, seen = questions_path(root, subtype), [], set()
    for n, q in enumerate(records(path, "vqav2", "questions")):
        with entry(path, "vqav2", n, q):
            qid = integer_field(q, "question_id")
            unique_id(seen, qid, "question_id")
            image = os.path.join(root, "coco", "test2015",
                                 f"COCO_test2015_{integer_field(q, 'image_id'):012d}.jpg")
            items.append(data.Item(qid, image, text_field(q, "question"), (), ""))
    return items


def server_split(task, split):
    """Whether an evaluation of `task` on `split` is VQAv2's test-dev or test: no answers, the server's file instead
    of a score."""
    return task == "vqav2" and split in TEST_SPLITS


def read_test(root, split):
    """The items of --split test-dev or test of VQAv2 (read_questions)."""
    if root is None:
        raise ValueError(f"--split {split} reads {QUESTIONS.format(TEST_SPLITS[split])} from --data-root "
                         "(layout: docs/real-models.md)")
    return read_questions(root, TEST_SPLITS[split])
