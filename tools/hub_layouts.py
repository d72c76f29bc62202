"""The benchmarks in the hub's layouts for lmms-eval (lmms-lab/VQAv2, OK-VQA, COCO-Caption, flickr30k, MME,
SEED-Bench), written from the original layouts' files of the same questions: their columns as the datasets' cards
and lmms-eval's task files (lmms_eval/tasks/vqav2, ok_vqa, coco_cap, flickr30k, mme, seedbench) read them, the images'
bytes embedded as the hub's `image` struct {bytes, path} (SEED-Bench: a list of them). Also OK-VQA and Flickr30k in
their original layouts (tools/benchmarks.py writes neither), from the VQAv2 and COCO files. Read straight from the
JSON, not through the project's readers, except MME's question files (mme_seed.mme_files / read_mme_questions)."""
import hashlib
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq

from lab.disk import files
from lab.datasets import mme_seed, readers

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def embedded(path):
    """The hub's image struct of a file."""
    with open(path, "rb") as f:
        return {"bytes": f.read(), "path": os.path.basename(path)}


def write_shards(folder, split, rows, schema, n_shards=2, hashed=False):
    """rows as n_shards parquet files folder/data/<split>-0000k-of-0000n.parquet, in order, small row groups; hashed:
    named as the hub's older uploads are, <split>-0000k-of-0000n-<16 hex>.parquet (lmms-lab/MME)."""
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    size = -(-len(rows) // n_shards)
    for k in range(n_shards):
        table = pa.Table.from_pylist(rows[k * size:(k + 1) * size], schema=schema)
        suffix = f"-{hashlib.sha256(f'{split}{k}'.encode()).hexdigest()[:16]}" if hashed else ""
        pq.write_table(table, os.path.join(folder, "data", f"{split}-{k:05d}-of-{n_shards:05d}{suffix}.parquet"),
                       row_group_size=7)


def load(path):
    with open(path) as f:
        return json.load(f)


def vqa_rows(root, folder, split, okvqa=False):
    """VQAv2's (answers: {answer, answer_confidence, answer_id}) or OK-VQA's (answers: strings, question_id a
    string) rows of one split's questions, in the questions file's order."""
    _, qfile, afile = readers.VQA_FILES["ok-vqa" if okvqa else "vqav2"]
    annotations = {a["question_id"]: a for a in load(os.path.join(root, folder, afile.format(split)))["annotations"]}
    rows = []
    for q in load(os.path.join(root, folder, qfile.format(split)))["questions"]:
        a = annotations[q["question_id"]]
        row = {"question_type": a["question_type"], "answer_type": a["answer_type"], "question": q["question"],
               "image": embedded(readers.coco_image(root, split, q["image_id"]))}
        if okvqa:
            row |= {"question_id": str(q["question_id"]), "answers": [x["answer"] for x in a["answers"]]}
        else:
            row |= {"question_id": q["question_id"], "image_id": q["image_id"], "answers": a["answers"],
                    "multiple_choice_answer": a["multiple_choice_answer"]}
        rows.append(row)
    return rows


VQAV2 = pa.schema([("question_type", pa.string()), ("multiple_choice_answer", pa.string()),
                   ("answers", pa.list_(pa.struct([("answer", pa.string()), ("answer_confidence", pa.string()),
                                                   ("answer_id", pa.int64())]))),
                   ("image_id", pa.int64()), ("answer_type", pa.string()), ("question_id", pa.int64()),
                   ("question", pa.string()), ("image", IMAGE)])
OKVQA = pa.schema([("question_id", pa.string()), ("image", IMAGE), ("question", pa.string()),
                   ("answers", pa.list_(pa.string())), ("question_type", pa.string()), ("answer_type", pa.string())])
COCO = pa.schema([("question_id", pa.string()), ("image", IMAGE), ("question", pa.string()),
                  ("answer", pa.list_(pa.string())), ("id", pa.int64()), ("license", pa.int8()),
                  ("file_name", pa.string()), ("coco_url", pa.string()), ("height", pa.int32()),
                  ("width", pa.int32()), ("date_captured", pa.string())])
FLICKR = pa.schema([("image", IMAGE), ("caption", pa.list_(pa.string())), ("sentids", pa.list_(pa.string())),
                    ("img_id", pa.string()), ("filename", pa.string())])
MME = pa.schema([("question_id", pa.string()), ("image", IMAGE), ("question", pa.string()), ("answer", pa.string()),
                 ("category", pa.string())])
SEED = pa.schema([("answer", pa.string()), ("choice_a", pa.string()), ("choice_b", pa.string()),
                  ("choice_c", pa.string()), ("choice_d", pa.string()), ("data_id", pa.string()),
                  ("data_type", pa.string()), ("question", pa.string()), ("question_id", pa.string()),
                  ("question_type_id", pa.int16()), ("image", pa.list_(IMAGE))])


def write_okvqa_original(root, source):
    """OK-VQA's val files (root/ok-vqa/...) from the VQAv2 val files of `source`, answers made distinct so that the
    most frequent is the target; root/coco links to source's images."""
    _, qfile, afile = readers.VQA_FILES["ok-vqa"]
    questions = load(os.path.join(source, "vqav2", readers.VQA_FILES["vqav2"][1].format("val")))
    annotations = load(os.path.join(source, "vqav2", readers.VQA_FILES["vqav2"][2].format("val")))
    for n, a in enumerate(annotations["annotations"]):
        if n % 3 == 0:  # a tie or a changed majority, so the target is the most frequent's, not the VQAv2 one's
            for x in a["answers"][:5]:
                x["answer"] = "ok " + x["answer"]
    files.write_json(os.path.join(root, "ok-vqa", qfile.format("val")), questions)
    files.write_json(os.path.join(root, "ok-vqa", afile.format("val")), annotations)
    if not os.path.exists(os.path.join(root, "coco")):
        os.symlink(os.path.join(source, "coco"), os.path.join(root, "coco"))


def write_flickr_original(root, source, n=40):
    """A Flickr30k Karpathy file and images (root/flickr30k) from the first n COCO images of source's Karpathy file,
    a quarter in Karpathy's val split."""
    images = load(os.path.join(source, "coco", "dataset_coco.json"))["images"][:n]
    os.makedirs(os.path.join(root, "flickr30k", "flickr30k-images"), exist_ok=True)
    out = []
    for k, im in enumerate(images):
        name = f"{1000 + k}.jpg"
        shutil.copy(os.path.join(source, "coco", im["filepath"], im["filename"]),
                    os.path.join(root, "flickr30k", "flickr30k-images", name))
        out.append({"filename": name, "imgid": k, "split": "val" if k % 4 == 0 else "train",
                    "sentences": [{**s, "imgid": k} for s in im["sentences"]], "sentids": im["sentids"]})
    files.write_json(os.path.join(root, "flickr30k", "dataset_flickr30k.json"), {"images": out, "dataset": "flickr30k"})


def write_hub(root, out, task):
    """Write `task`'s hub layout under out (its folder, as docs/real-models.md names it) from the original files of
    the same questions under root: VQAv2 / OK-VQA val, COCO / Flickr30k Karpathy val, MME and SEED-Bench whole."""
    if task == "vqav2":
        write_shards(os.path.join(out, "vqav2"), "validation", vqa_rows(root, "vqav2", "val"), VQAV2)
    elif task == "ok-vqa":
        write_shards(os.path.join(out, "ok-vqa"), "val2014", vqa_rows(root, "ok-vqa", "val", okvqa=True), OKVQA)
    elif task == "coco":
        rows = [{"question_id": im["filename"], "image": embedded(os.path.join(root, "coco", im["filepath"],
                                                                               im["filename"])),
                 "question": "Provide a one-sentence caption for the provided image.",
                 "answer": [s["raw"] for s in im["sentences"]], "id": im["cocoid"], "license": 1,
                 "file_name": im["filename"], "coco_url": "", "height": 64, "width": 64, "date_captured": ""}
                for im in load(os.path.join(root, "coco", "dataset_coco.json"))["images"]
                if im["split"] in readers.KARPATHY_SPLITS["val"]]
        write_shards(os.path.join(out, "coco"), "val", rows, COCO)
    elif task == "flickr30k":
        rows = [{"image": embedded(os.path.join(root, "flickr30k", "flickr30k-images", im["filename"])),
                 "caption": [s["raw"] for s in im["sentences"]], "sentids": [str(i) for i in im["sentids"]],
                 "img_id": str(im["imgid"]), "filename": im["filename"]}
                for im in load(os.path.join(root, "flickr30k", "dataset_flickr30k.json"))["images"]
                if im["split"] in readers.KARPATHY_SPLITS["val"]]
        write_shards(os.path.join(out, "flickr30k"), "test", rows, FLICKR)
    elif task == "mme":
        rows = []
        for subtask in mme_seed.MME_PERCEPTION + mme_seed.MME_COGNITION:
            for path, image in mme_seed.mme_files(os.path.join(root, "mme", subtask)):
                rows += [{"question_id": f"{subtask}/{os.path.basename(image)}", "image": embedded(image),
                          "question": q, "answer": a, "category": subtask}
                         for q, a in mme_seed.read_mme_questions(path)]
        write_shards(os.path.join(out, "mme"), "test", rows, MME, n_shards=3, hashed=True)  # as the hub names them
    else:
        seed = load(os.path.join(root, "seed-bench", "SEED-Bench.json"))
        rows = []
        for q in seed["questions"]:
            image = os.path.join(root, "seed-bench", "SEED-Bench-image", q["data_id"] + ".jpg")
            frames = [embedded(image)] if q["data_type"] == "image" else [embedded(first_seed_image(root))] * 2
            rows.append({**{k: q[k] for k in SEED.names if k not in ("image",)}, "image": frames})
        write_shards(os.path.join(out, "seed-bench"), "test", rows, SEED)


def first_seed_image(root):
    folder = os.path.join(root, "seed-bench", "SEED-Bench-image")
    return os.path.join(folder, sorted(os.listdir(folder))[0])
