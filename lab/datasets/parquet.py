"""The benchmarks as the hub ships them for lmms-eval (lmms-lab/VQAv2, OK-VQA, COCO-Caption, flickr30k, MME,
SEED-Bench): parquet shards `<split>-NNNNN-of-NNNNN[-<hash>].parquet` anywhere below the benchmark's folder, the
images' bytes inside. Read with pyarrow a batch of rows at a time, shard by shard (never a whole table in memory);
each image's bytes are written once to a content-addressed cache (CACHE/<sha256>.<format>) so that an Item keeps an
image path and the image is read lazily, as from the original layout. The Items are those of the original readers
(lab/datasets/readers.py, lab/datasets/mme_seed.py) for the same questions, in the order the shards hold them."""
import contextlib
import dataclasses
import hashlib
import io
import os
import re

import pyarrow.parquet as pq
from tqdm import tqdm

import data
from lab.disk import files
from lab.datasets import mme_seed, readers

CACHE = os.path.expanduser("~/.cache/hyper-icl/hub-images")  # content-addressed: a second read writes nothing

SHARD = re.compile(r"(?P<split>[A-Za-z0-9_.]+)-(?P<index>\d{5})-of-(?P<total>\d{5})(-[0-9a-f]{16})?\.parquet")
# <split>-NNNNN-of-NNNNN.parquet, or with the hash of the hub's older uploads (lmms-lab/MME: test-00000-of-00004-
# a25dbe3b44c4fda6.parquet)

BATCH_ROWS = 16  # rows a batch: with images of a few MB, a batch holds some tens of MB

SEED_DIMENSIONS = ("Scene Understanding", "Instance Identity", "Instance Attributes", "Instance Location",
                   "Instances Counting", "Spatial Relation", "Instance Interaction", "Visual Reasoning",
                   "Text Understanding", "Action Recognition", "Action Prediction", "Procedure Understanding")
# SEED-Bench-1's question_type_id 1-12 (its SEED-Bench.json's question_type); the hub's copy has only the ids

COCO_NAME = re.compile(r"COCO_(?:train|val|test)2014_(\d{12})\.jpg")  # COCO-Caption's question_id


def vqav2_row(row, state):
    """A row of lmms-lab/VQAv2: answers a list of {answer, ...}, the target its multiple_choice_answer."""
    return (readers.integer_field(row, "question_id"), readers.text_field(row, "question"),
            readers.vqa_answers(row["answers"]), readers.text_field(row, "multiple_choice_answer"), "")


def okvqa_row(row, state):
    """A row of lmms-lab/OK-VQA: question_id a string of digits, answers a list of strings, the target the most
    frequent (as readers.read_vqa)."""
    answers = row["answers"]
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"its answers are {answers!r}; they must be a non-empty list of text")
    return digits(row, "question_id"), readers.text_field(row, "question"), tuple(answers), \
        readers.okvqa_target(answers), ""


def coco_row(row, state):
    """A row of lmms-lab/COCO-Caption: question_id the image's file name (its COCO id, as lmms-eval reads it)."""
    name = row["question_id"]
    match = COCO_NAME.fullmatch(name) if isinstance(name, str) else None
    if match is None:
        raise ValueError(f"its question_id {name!r} is not a COCO 2014 file name (COCO_val2014_<12 digits>.jpg)")
    captions = caption_list(row, "answer")
    return int(match.group(1)), None, captions, captions[0], ""


def flickr_row(row, state):
    """A row of lmms-lab/flickr30k: img_id the Karpathy imgid (a string of digits), caption the references."""
    captions = caption_list(row, "caption")
    return digits(row, "img_id"), None, captions, captions[0], ""


def mme_row(row, state):
    """A row of lmms-lab/MME: ids count from 0 in row order (readers count them in file order); two rows of one
    image share its question_id, so a row is a duplicate when its question_id and question were seen."""
    category, answer = row["category"], readers.text_field(row, "answer").capitalize()
    if category not in mme_seed.MME_PERCEPTION + mme_seed.MME_COGNITION:
        raise ValueError(f"its category {category!r} is not an MME subtask")
    if answer not in ("Yes", "No"):
        raise ValueError(f"its answer is {row['answer']!r}; it must be Yes or No")
    question = readers.text_field(row, "question")
    readers.unique_id(state.setdefault("pairs", set()), (row["question_id"], question), "question_id and question")
    state["n"] = state.get("n", -1) + 1
    return state["n"], question, (answer,), answer, category


def seed_row(row, state):
    """A row of lmms-lab/SEED-Bench: image questions (dimensions 1-9) only, as mme_seed.read_seed; None skips a video
    question."""
    dimension = int(row["question_type_id"])
    if not 1 <= dimension <= len(SEED_DIMENSIONS):
        raise ValueError(f"its question_type_id {row['question_type_id']!r} is not one of SEED-Bench's 1-12")
    if dimension not in mme_seed.SEED_IMAGE_DIMENSIONS:
        return None
    answer, options = row["answer"].strip(), tuple(readers.text_field(row, f"choice_{x}") for x in "abcd")
    if answer not in tuple(data.SEED_LETTERS):
        raise ValueError(f"answer {answer!r} is not one of A, B, C, D")
    return digits(row, "question_id"), readers.text_field(row, "question"), options, answer, \
        SEED_DIMENSIONS[dimension - 1]


def digits(row, name):
    """row[name], a string of digits (or an integer), as an int."""
    value = row[name]
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return readers.integer_field(row, name)


def caption_list(row, name):
    """row[name], a non-empty list of captions, each stripped (readers.text_field)."""
    captions = row[name]
    if not isinstance(captions, list) or not captions:
        raise ValueError(f"its {name} is {captions!r}; it must be a non-empty list of captions")
    return tuple(readers.text_field({name: c}, name) for c in captions)


@dataclasses.dataclass(frozen=True)
class Hub:
    """One benchmark's copy on the hub: where it sits, what it is called, its splits and columns, how a row reads."""
    folder: str          # under --data-root, as docs/real-models.md names it
    dataset: str         # the hub's name
    splits: dict         # our split -> the hub's
    columns: tuple       # read besides `image`
    row: object          # the row reader: (row, state) -> (id, question, answers, target, category) or None (skip)
    instead: str         # the original files to get where the hub's copy lacks a split ({0}: the split)
    image_list: bool = False  # `image` a list of images (SEED-Bench)
    image_key: str | None = None  # the column naming an image where two images may be the same bytes (MME, SEED)


HUB = {
    "vqav2": Hub("vqav2", "lmms-lab/VQAv2", {"val": "validation"},
                 ("question_id", "question", "answers", "multiple_choice_answer"), vqav2_row,
                 "vqav2/v2_OpenEnded_mscoco_{0}2014_questions.json, vqav2/v2_mscoco_{0}2014_annotations.json and the "
                 "images coco/{0}2014/"),
    "ok-vqa": Hub("ok-vqa", "lmms-lab/OK-VQA", {"val": "val2014"}, ("question_id", "question", "answers"), okvqa_row,
                  "ok-vqa/OpenEnded_mscoco_{0}2014_questions.json, ok-vqa/mscoco_{0}2014_annotations.json and the "
                  "images coco/{0}2014/"),
    "coco": Hub("coco", "lmms-lab/COCO-Caption", {"val": "val"}, ("question_id", "answer"), coco_row,
                "coco/dataset_coco.json (Karpathy's split) and the images coco/train2014/, coco/val2014/"),
    "flickr30k": Hub("flickr30k", "lmms-lab/flickr30k", {"val": "test"}, ("img_id", "caption"), flickr_row,
                     "flickr30k/dataset_flickr30k.json (Karpathy's split) and the images flickr30k/flickr30k-images/"),
    "mme": Hub("mme", "lmms-lab/MME", {"train": "test", "val": "test"},
               ("question_id", "question", "answer", "category"), mme_row,
               "MME_Benchmark_release_version/'s 14 subtask folders into mme/", image_key="question_id"),
    "seed": Hub("seed-bench", "lmms-lab/SEED-Bench", {"train": "test", "val": "test"},
                ("question_id", "question", "answer", "question_type_id", "data_id") +
                tuple(f"choice_{x}" for x in "abcd"), seed_row,
                "seed-bench/SEED-Bench.json and seed-bench/SEED-Bench-image/", image_list=True, image_key="data_id"),
}


def original_present(root, task, split):
    """Whether the original release's files of this split are under root (their reader then reads them)."""
    if task in readers.VQA_FILES:
        folder, questions, _ = readers.VQA_FILES[task]
        return os.path.isfile(os.path.join(root, folder, questions.format(split)))
    if task in readers.KARPATHY_IDS:
        return os.path.isfile(os.path.join(root, task, f"dataset_{task}.json"))
    if task == "mme":
        return any(os.path.isdir(os.path.join(root, "mme", s))
                   for s in mme_seed.MME_PERCEPTION + mme_seed.MME_COGNITION)
    return os.path.isfile(os.path.join(root, "seed-bench", "SEED-Bench.json"))


def find_shards(folder):
    """{split: its shard paths in index order} of the parquet shards anywhere below folder (symbolic links to
    folders not followed); a split missing one of its NNNNN-of-NNNNN shards is an error naming it, and so are parquet
    files none of which is named as a shard (SHARD)."""
    found, others = {}, []
    for parent, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            match = SHARD.fullmatch(name)
            if match:
                found.setdefault(match["split"], []).append((int(match["index"]), int(match["total"]),
                                                              os.path.join(parent, name)))
            elif name.endswith(".parquet"):
                others.append(os.path.join(parent, name))
    if others and not found:
        raise FileNotFoundError(f"{others[0]} (and {len(others) - 1} more parquet files) is not named as a shard of "
                                "the hub's copy, <split>-NNNNN-of-NNNNN[-<hash>].parquet; keep the hub's names")
    shards = {}
    for split, entries in sorted(found.items()):
        entries.sort()
        total = entries[0][1]
        indexes = [i for i, _, _ in entries]
        if indexes != list(range(total)) or any(t != total for _, t, _ in entries):
            missing = sorted(set(range(total)) - set(indexes))
            raise FileNotFoundError(f"the parquet shards of split {split!r} under {folder} are not one whole set: "
                                    f"expected {split}-00000-of-{total:05d} to {split}-{total - 1:05d}-of-"
                                    f"{total:05d}" + (f"; {split}-{missing[0]:05d}-of-{total:05d}.parquet is missing"
                                                      if missing else "; two sets or a repeated index"))
        shards[split] = [path for _, _, path in entries]
    return shards


def hub_items(root, task, split):
    """The items of one split of a benchmark from the hub's parquet shards under root/<folder>, or None when its
    original files are there (a line says so when shards are there too) or no shard is (the original reader then
    names what is missing). A split the hub's copy lacks is a one-line error naming the files to get instead."""
    if task not in HUB:
        return None
    hub = HUB[task]
    folder, dataset, splits = os.path.join(root, hub.folder), hub.dataset, hub.splits
    shards = find_shards(folder) if os.path.isdir(folder) else {}
    if original_present(root, task, split):
        if shards:
            print(f"{task}: {folder} holds both the original files and the hub's parquet shards; reading the "
                  "original files")
        return None
    if not shards:
        return None
    if splits.get(split) not in shards:
        raise FileNotFoundError(f"{task}: the parquet shards under {folder} hold the split(s) {', '.join(shards)}; "
                                f"{dataset} has no {split!r} split for this command" +
                                (f" (--split {split} reads its {splits[split]!r})" if split in splits else "") +
                                f": get the original {hub.instead.format(split)} (layout: docs/real-models.md)")
    items = read_shards(task, shards[splits[split]])
    print(f"{task}: {len(items)} items from {len(shards[splits[split]])} parquet shard(s) of {dataset}'s "
          f"{splits[split]!r} under {folder}; images cached in {CACHE}")
    return items


def read_shards(task, paths):
    """The items of these shards, in their order: each row read by the task's row reader, its image cached."""
    hub = HUB[task]
    items, seen, state = [], set(), {}
    total = sum(open_shard(p).metadata.num_rows for p in paths)
    with tqdm(total=total, desc=f"{task} parquet", unit="row", disable=None) as bar:
        for path in paths:
            for n, row in rows(path, hub.columns + ("image",)):
                bar.update()
                with at_row(task, path, n, row):
                    fields = hub.row(row, state)
                    if fields is None:
                        continue
                    qid, question, answers, target, category = fields
                    readers.unique_id(seen, qid, "id")
                    image = row["image"]
                    if hub.image_list:
                        if not isinstance(image, list) or len(image) != 1:
                            raise ValueError(f"an image question needs one image, it has "
                                             f"{len(image) if isinstance(image, list) else image!r}")
                        image = image[0]
                    image_path = cached_image(image, row[hub.image_key] if hub.image_key else None)
                    items.append(data.Item(qid, image_path, question, answers, target, category))
    if task == "mme":
        missing = [s for s in mme_seed.MME_PERCEPTION + mme_seed.MME_COGNITION if s not in
                   {it.category for it in items}]
        if missing:  # MME's totals sum every subtask: one missing is not comparable with Table 2
            raise ValueError(f"mme: the parquet shards {paths[0]}... hold no question of the subtask(s) "
                             f"{', '.join(missing)}")
    return items


def rows(path, columns):
    """(row number in the shard, row as a dict) of one shard, BATCH_ROWS rows converted at a time (pyarrow still
    decodes a row group's image column whole: the peak memory follows the largest row group, docs/efficiency.md); a
    missing column is an error naming the shard and the columns it has."""
    shard = open_shard(path)
    missing = [c for c in columns if c not in shard.schema_arrow.names]
    if missing:
        raise ValueError(f"{path} has no column {', '.join(missing)} (it has {', '.join(shard.schema_arrow.names)}); "
                         "is it the lmms-lab copy? (layout: docs/real-models.md)")
    n = 0
    for batch in shard.iter_batches(batch_size=BATCH_ROWS, columns=list(columns)):
        for row in batch.to_pylist():
            yield n, row
            n += 1


def open_shard(path):
    """A shard opened for buffered reads (1 MB at a time, nothing read ahead); not parquet, or not a regular file (a
    FIFO would be waited on forever), is a ValueError naming it."""
    if not os.path.isfile(path):
        raise ValueError(f"{path} is not a regular file (a FIFO, device or folder); a shard is a parquet file")
    try:
        return pq.ParquetFile(path, buffer_size=1 << 20, pre_buffer=False)
    except Exception as e:  # pyarrow's ArrowInvalid, OSError and friends
        raise ValueError(f"{path} is not a readable parquet file ({type(e).__name__}: {e})") from e


@contextlib.contextmanager
def at_row(task, path, n, row):
    """A bad field of a row becomes a ValueError naming the task, the shard and the row (and its question_id)."""
    with readers.named(task, lambda: f"{path} row {n}" +
                       (f" (question_id {row['question_id']!r})" if "question_id" in row else "")):
        yield


def cached_image(image, key=None):
    """The cache path of an embedded image ({bytes, path}): CACHE/<sha256>.<format>, written once (atomically; a
    file already there with the same bytes is kept). key: the image's name in the benchmark (MME's question_id,
    SEED-Bench's data_id), where two images of the same bytes must stay two (questions are split by image):
    CACHE/<sha256>-<sha256 of key>.<format>. Bytes that are no image of readers.open_image's formats and sizes are a
    ValueError."""
    raw = image.get("bytes") if isinstance(image, dict) else None
    if not isinstance(raw, bytes) or not raw:
        raise ValueError(f"its image holds no bytes ({str(image)[:60]})")
    try:
        with readers.open_image(io.BytesIO(raw)) as im:  # its formats only: no EPS handed to Ghostscript
            kind = im.format
            im.verify()
    except Exception as e:  # PIL raises many kinds on bad bytes
        raise ValueError(f"its image bytes are not a readable image ({e})") from e
    digest = hashlib.sha256(raw).hexdigest()
    name = digest if key is None else f"{digest}-{hashlib.sha256(str(key).encode()).hexdigest()[:16]}"
    path = os.path.join(CACHE, digest[:2], f"{name}.{kind.lower()}")
    if os.path.islink(path) or not same_bytes(path, raw):
        files.atomic_write(path, lambda f: f.write(raw), durable=False)  # replaces a link, never writes through it
    return path


def same_bytes(path, raw):
    """Whether the file at path holds exactly raw (a cached file of the right size but damaged bytes does not)."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) != len(raw):
            return False
        with open(path, "rb") as f:
            return f.read() == raw
    except OSError:
        return False
