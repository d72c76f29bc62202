"""A task of one's own (--task PATH): a .jsonl file, a folder of train.jsonl and val.jsonl (and test.jsonl), or a
LLaVA instruction-data .json, read into the Items of one of the four kinds (vqa, caption, yes-no, choice).

One JSON object a line: {"id", "image", "question", "answer"} or "answers": [...] (vqa), {"id", "image", "caption"}
or "captions": [...] (caption), {"id", "image", "question", "answer": "yes" | "no"} (yes-no), {"id", "image",
"question", "options": [2-4 texts], "answer": letter or option text} (choice); optional "kind" and "category" (the
subtask / dimension the MME and SEED scores are split by). Without a kind, a record with caption(s) is a caption,
one with options a choice, any other a vqa (yes-no only when said); a file holds one kind. Image paths are relative
to the file's folder (absolute allowed). Every record is checked: an error names the file, the line and the field
(an image readers.open_image does not open or that a camera's EXIF tag rotates, text that is no plain text
(readers.plain_text: an image placeholder, a chat control token, a lone surrogate), an answer of two lines, a key given
twice, a category that cannot be a file's name: it names a yes-no task's MME results file).
The defaults (shots, new tokens, metric) are those of the paper's nearest task (NEAREST)."""
import functools
import json
import os
import stat

import data
from lab.disk import files
from lab.datasets import readers


NEAREST = {"vqa": "vqav2", "caption": "coco", "yes-no": "mme", "choice": "seed"}  # a kind takes this task's defaults

FOLDER_FILES = {"train": "train.jsonl", "val": "val.jsonl", "test": "test.jsonl"}  # split -> file of a folder task


def is_own(task):
    """Whether --task names a task of one's own (a .jsonl / .json file or a folder), not a benchmark."""
    return task not in data.TASKS and (task.endswith((".jsonl", ".json")) or os.sep in task or os.path.isdir(task))


def name_of(task):
    """The name a task of one's own gives its run folders and result files: the file's stem, or the folder's name."""
    base = os.path.basename(os.path.abspath(task))
    return base if os.path.isdir(task) else os.path.splitext(base)[0]


def task_of(path):
    """The data.Task of a task of one's own: its records' kind, with the defaults of the nearest benchmark."""
    return data.TASKS[NEAREST[read(path)[0]]]


def read(path):
    """(kind, {split: items}) of a task of one's own; a single file's items under the split None (tasks.load_task
    splits them by image). Read once while the files are unchanged."""
    files = [os.path.join(path, f) for f in FOLDER_FILES.values()] if os.path.isdir(path) else [path]
    signature = tuple((f, os.stat(f).st_mtime_ns, os.stat(f).st_size) if os.path.isfile(f) else (f,) for f in files)
    return _read(os.path.abspath(path), signature)


@functools.lru_cache(maxsize=8)
def _read(path, signature):
    """read(path), cached by the files' signature (name, modification time, size)."""
    if not os.path.isdir(path):
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--task {path}: no such file or folder (a benchmark's name, a .jsonl file, a "
                                    "folder of train.jsonl and val.jsonl, or a LLaVA .json)")
        return read_llava(path) if path.endswith(".json") else read_jsonl(path)
    parts = {}
    for split, name in FOLDER_FILES.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            if split == "test":
                continue
            raise FileNotFoundError(f"--task {path}: a folder task needs {file} (train.jsonl and val.jsonl, "
                                    "test.jsonl if any)")
        parts[split] = read_jsonl(file)
    kinds = {split: kind for split, (kind, _) in parts.items()}
    if len(set(kinds.values())) > 1:
        held = ", ".join(f"{FOLDER_FILES[s]}: {k}" for s, k in kinds.items())
        raise ValueError(f"--task {path}: its files hold different kinds ({held}); one task is one kind")
    seen = {}
    for split, (_, items) in parts.items():  # an id in two splits: a query evaluated on what it trained on
        for it in items[None]:
            unique(seen, it, os.path.join(path, FOLDER_FILES[split]))
    return kinds["train"], {split: items[None] for split, (_, items) in parts.items()}


def read_jsonl(path):
    """(kind, {None: items}) of one .jsonl file, every record checked (record_item); blank lines are skipped."""
    items, seen, first, folder = [], {}, None, os.path.dirname(path)
    for n, line in enumerate(readers.read_text(path, "--task").split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path} line {n}"
        try:
            record = json.loads(line, object_pairs_hook=one_value_a_key)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not a JSON object ({e.msg}, column {e.colno})") from e
        except RecursionError as e:
            raise ValueError(f"{where}: not a record (nested too deep for JSON's reader)") from e
        except KeyTwice as e:
            raise ValueError(f"{where}, {e}") from None
        kind, item = record_item(record, folder, where)
        if first is None:
            first = kind, n
        elif kind != first[0]:
            raise ValueError(f"{where}, field `kind`: a {kind} record, but line {first[1]} is a {first[0]}; one file "
                             "holds one kind")
        items.append(unique(seen, item, where))
    if not items:
        raise ValueError(f"{path}: no records (one JSON object a line)")
    return first[0], {None: items}


class KeyTwice(ValueError):
    """A key given twice in one JSON object (one_value_a_key)."""


def one_value_a_key(pairs):
    """json.loads' object_pairs_hook: the object as a dict; a key given twice is a KeyTwice naming it (json keeps the
    last value, silently)."""
    record = dict(pairs)
    if len(record) < len(pairs):
        key = next(k for n, (k, _) in enumerate(pairs) if k in dict(pairs[:n]))
        e = KeyTwice(f"field `{key}`: given twice in one record (JSON would keep the last, silently); keep one")
        e.record = record
        raise e
    return record


def unique(seen, item, where):
    """The item, its id recorded; an id seen before is an error naming both places."""
    if item.id in seen:
        raise ValueError(f"{where}, field `id`: duplicate id {item.id!r} (also at {seen[item.id]})")
    seen[item.id] = where
    return item


def record_kind(record, fail):
    """A record's kind: its "kind", else caption(s) -> caption, options -> choice, any other -> vqa."""
    if "kind" in record:
        if not isinstance(record["kind"], str) or record["kind"] not in NEAREST:
            raise fail("kind", f"unknown kind {record['kind']!r}; choose from {', '.join(NEAREST)}")
        return record["kind"]
    return "caption" if "caption" in record or "captions" in record else "choice" if "options" in record else "vqa"


def record_item(record, folder, where):
    """(kind, data.Item) of one record at `where` ("<file> line <n>"); a bad field is a ValueError naming it."""
    fail = lambda field, problem: ValueError(f"{where}, field `{field}`: {problem}")
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    kind = record_kind(record, fail)
    text = lambda field: text_field(record, field, fail)
    qid = record.get("id")
    if isinstance(qid, bool) or not isinstance(qid, (int, str)) or not str(qid).strip():
        raise fail("id", f"{qid!r}; it must be an integer or non-empty text" if "id" in record else "missing")
    image = os.path.join(folder, text("image"))  # an absolute path stays as it is
    problem = image_problem(image)
    if problem:
        raise fail("image", problem)
    category = name_field(record, "category", fail) if "category" in record else kind
    if kind == "caption":
        answers = texts(record, "caption", fail)
        return kind, data.Item(qid, image, None, answers, answers[0], category)
    question = text("question")
    if kind == "choice":
        options, target = choice_fields(record, text("answer"), fail)
        return kind, data.Item(qid, image, question, options, target, category)
    if kind == "yes-no":
        answer = text("answer")
        if answer.lower() not in ("yes", "no"):
            raise fail("answer", f"{answer!r}; a yes-no answer is yes or no")
        return kind, data.Item(qid, image, question, (answer.capitalize(),), answer.capitalize(), category)
    answers = texts(record, "answer", fail)
    return kind, data.Item(qid, image, question, answers, readers.most_frequent(answers), category)


def image_problem(path):
    """Why the image file `path` is refused (None where it is not): missing, or its header (header_problem) read once
    a version of the file (its size, modification time and inode), however many records share it: 200,000 records on
    24 images reopened an image a record (tools/bench_own_task.py)."""
    try:
        st = os.stat(path)
    except OSError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        return f"no image file {path}"
    return header_problem(path, st.st_size, st.st_mtime_ns, st.st_ino)


@functools.lru_cache(maxsize=4096)
def header_problem(path, *version):
    """image_problem's reading of the header: a format and size data.load_image opens (readers.open_image), upright
    (no EXIF_ORIENTATION that turns it); `version` the file's (the cache's key)."""
    try:
        with readers.open_image(path) as im:
            orientation = im.getexif().get(EXIF_ORIENTATION, 1)
    except (OSError, ValueError) as e:
        return f"{path}: {e}"
    if orientation in range(2, 9):  # 2-8 turn or mirror; other values mean nothing to viewers either
        return (f"{path}: its EXIF orientation is {orientation} (turned); the model would see it as stored, not as a "
                "viewer shows it: save it upright (PIL.ImageOps.exif_transpose, or `mogrify -auto-orient`)")
    return None


EXIF_ORIENTATION = 0x0112  # the EXIF tag a camera sets to say how to turn the stored pixels; 1: as stored, 2-8 turned
# data.load_image decodes the pixels as stored (COCO's annotations are of those), so an own task's image a phone rotates
# by its tag is refused rather than seen on its side


def choice_fields(record, answer, fail):
    """(options, target letter) of a choice record: 2-4 distinct option texts; the answer a letter or an option's
    text, never both a letter and another option's text (ambiguous)."""
    options = record.get("options")
    if not isinstance(options, list) or not 2 <= len(options) <= len(data.SEED_LETTERS):
        raise fail("options", f"{options!r}; it must be a list of 2 to {len(data.SEED_LETTERS)} option texts")
    options = tuple(line_field({"options": o}, "options", fail) for o in options)
    if len(set(options)) < len(options):
        raise fail("options", f"{list(options)!r} repeats an option; each letter needs its own text")
    letters = tuple(data.SEED_LETTERS[:len(options)])
    if answer not in letters and answer not in options:
        raise fail("answer", f"{answer!r} is neither a letter ({', '.join(letters)}) nor one of the options")
    if answer in letters and answer in options and options.index(answer) != letters.index(answer):
        raise fail("answer", f"{answer!r} is both a letter and the text of option "
                             f"{letters[options.index(answer)]}; reorder or reword the options")
    return options, answer if answer in letters else letters[options.index(answer)]


def text_field(record, field, fail):
    """record[field], stripped: missing, not text, empty or holding an image placeholder (readers.plain_text) is an
    error naming the field."""
    if field not in record:
        raise fail(field, "missing")
    value = record[field]
    if not isinstance(value, str):
        raise fail(field, f"{value!r} is {type(value).__name__}; it must be text")
    if readers.blank(value):
        raise fail(field, "empty (or blank); it must be non-empty text")
    try:
        return readers.plain_text(value.strip(), field)
    except ValueError as e:
        raise fail(field, str(e)) from None


def name_field(record, field, fail):
    """text_field, which becomes a file's name, <value>.txt: files.plain_name's check (no path separator, NUL or
    '..'), and at most MAX_NAME_BYTES of UTF-8 (else the results could not be written, after the evaluation ran)."""
    value = text_field(record, field, fail)
    if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise fail(field, f"{value[:40]!r}... is {len(value.encode('utf-8', 'surrogatepass'))} bytes long (UTF-8); it "
                          f"names a results file <{field}>.txt, so it must be at most {MAX_NAME_BYTES}: shorten it")
    try:
        return files.plain_name(value)
    except ValueError as e:
        raise fail(field, str(e)) from None


MAX_NAME_BYTES = 255 - len(".txt")  # a file name's bytes on Linux, macOS and Windows file systems (NAME_MAX)


def texts(record, field, fail):
    """The references of a record: record[field] (one text) or record[field + "s"] (a non-empty list of texts), each
    one line (line_field)."""
    many = field + "s"
    if (field in record) == (many in record):
        raise fail(field, f"give `{field}` (one) or `{many}` (a list), one of the two")
    if field in record:
        return (line_field(record, field, fail),)
    values = record[many]
    if not isinstance(values, list) or not values:
        raise fail(many, f"{values!r}; it must be a non-empty list of texts")
    return tuple(line_field({many: v}, many, fail) for v in values)


def line_field(record, field, fail):
    """text_field on one line: an answer (or caption, option) holding a line break could never be matched, as a
    generated answer is cut at its first line (evaluate.postprocess), and an option would break its prompt's lines."""
    value = text_field(record, field, fail)
    if "\n" in value or "\r" in value:
        raise fail(field, f"{value!r} holds a line break; an answer is one line (a generated one is cut at its first)")
    return value


def read_llava(path):
    """(vqa, {None: items}) of a LLaVA instruction-data .json: a list of {"id", "image", "conversations": [{"from":
    "human", "value": "<image>\\n question"}, {"from": "gpt", "value": answer}]}; a record of more turns is refused,
    naming its id."""
    try:
        records = json.loads(readers.read_text(path, "--task"), object_pairs_hook=one_value_a_key)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} line {e.lineno}: not valid JSON ({e.msg})") from e
    except RecursionError as e:
        raise ValueError(f"{path}: not a list of records (nested too deep for JSON's reader)") from e
    except KeyTwice as e:
        raise ValueError(f"{path}, {e} (the record: {str(e.record)[:80]})") from None
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path}: a LLaVA .json is a non-empty list of records with `conversations`")
    items, seen = [], {}
    for n, r in enumerate(records):
        where = f"{path} record {n}" + (f" (id {r.get('id')!r})" if isinstance(r, dict) else "")
        turns = r.get("conversations") if isinstance(r, dict) else None
        if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
            raise ValueError(f"{where}, field `conversations`: {turns!r}; it must be a list of turns "
                             '{"from", "value"}')
        if [t.get("from") for t in turns] != ["human", "gpt"]:
            raise ValueError(f"{where}, field `conversations`: {len(turns)} turns "
                             f"({', '.join(str(t.get('from')) for t in turns)}); one human question and one gpt "
                             "answer make a vqa item (multi-turn conversations are not read)")
        question = turns[0].get("value", "").replace("<image>", "") if isinstance(turns[0].get("value"), str) else None
        record = {k: v for k, v in r.items() if k != "conversations"} | {"question": question,
                                                                          "answer": turns[1].get("value")}
        _, item = record_item(record, os.path.dirname(path), where)
        items.append(unique(seen, item, where))
    return "vqa", {None: items}
