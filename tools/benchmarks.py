"""Small benchmarks in the official layouts, for the tests: VQAv2 and COCO (images, Karpathy captions, instance
annotations), OK-VQA (on the COCO images), Flickr30k (its Karpathy file and images), MME (all fourteen subtasks),
SEED-Bench-1 and SEED-Bench-2, drawn with Pillow from fixed seeds.

They are read by the project's own readers (lab/datasets/readers.py, lab/datasets/mme_seed.py) under the real task
names: `--task vqav2 --data-root benchmarks.ROOT` (also ok-vqa, coco, flickr30k, mme, seed, seed2). ROOT is written
once (conftest.py calls `generate`) to a folder of the user's own cache (~/.cache/hyper-icl, or $XDG_CACHE_HOME's),
never a shared temporary folder, whose name holds a hash of this file and of the lab files it writes with, so a
changed fixture is never read from a stale folder; files.generated makes the write atomic.

    python -m tools.benchmarks [DIR]                 write them (to DIR, or ROOT) and print the folder
    python -m tools.benchmarks --paper-sized DIR     Table 1's sizes, for the tables' --plan
"""
import hashlib
import os
import pathlib
import random
import shutil
import sys
from collections import Counter

from PIL import Image, ImageDraw

import data as D
from lab.disk import files
from lab.datasets import mme_seed, readers, toy_world

WRITERS = (__file__, D.__file__, files.__file__, mme_seed.__file__, readers.__file__, toy_world.__file__)
SOURCES = b"".join(pathlib.Path(f).read_bytes() for f in WRITERS)  # this file and the code it writes with
CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
ROOT = os.path.join(CACHE, "hyper-icl", "benchmarks-" + hashlib.sha256(SOURCES).hexdigest()[:12])
COCO_SIZES = {"train": 300, "val": 100}  # images per split; one VQAv2 question and five captions each
OKVQA_SIZES = {"train": 160, "val": 40}  # OK-VQA questions per split, one on each of the first COCO images
FLICKR_SIZES = {"train": 60, "val": 16, "test": 4}  # Flickr30k images per Karpathy split, five captions each
MME_IMAGES = 12                          # per subtask, two questions each
SEED_IMAGES = 150                        # SEED-Bench-1 and -2 each
SEED = 0                                 # each writer draws from random.Random(SEED)
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (240, 210, 30),
           "purple": (140, 50, 170), "orange": (245, 140, 20)}
NEAR_COLOUR = {"red": "orange", "green": "blue", "blue": "purple", "yellow": "orange", "purple": "blue",
               "orange": "red"}
SHAPES = {"circle": "oval", "square": "rectangle", "triangle": "pyramid"}  # shape -> what some annotators say
CATEGORIES = {shape: k + 1 for k, shape in enumerate(SHAPES)}              # the instances files' category ids
WORDS = ["zero", "one", "two", "three", "four"]


def generate(root=ROOT):
    """`root` (ROOT), written first if it is not there; one another user made is refused, not read."""
    if os.path.isdir(root) and os.stat(root).st_uid != os.getuid():
        raise ValueError(f"{root} is another user's folder; name a folder of your own")
    return files.generated(root, write)


def copy(dest, *folders):
    """Copy these folders of ROOT (e.g. "mme") into `dest`, for a test that changes files; returns dest."""
    for folder in folders:
        shutil.copytree(os.path.join(generate(), folder), os.path.join(dest, folder))
    return str(dest)


def write(root):
    write_okvqa(root, write_coco(root))
    write_flickr30k(root)
    write_mme(root)
    write_seed(root)
    write_seed2(root)

# ------------------------------------------------------------------------------------------------------ scenes


def scene(rng):
    """A random scene: `count` shapes of one kind and colour; a single shape sits on the left or the right."""
    shape, colour, count = rng.choice(list(SHAPES)), rng.choice(list(COLOURS)), rng.randint(1, 4)
    if count == 1:
        side = rng.choice(["left", "right"])
        cells = [(0 if side == "left" else 2, rng.randint(0, 2))]
    else:
        side = None
        cells = rng.sample([(x, y) for x in range(3) for y in range(3)], count)
    return dict(shape=shape, colour=colour, count=count, side=side, cells=cells)


def boxes(scene, size=64):
    """The box of each shape: its cell of a 3 x 3 grid, inset by 3 px."""
    cell = size // 3
    return [(x * cell + 3, y * cell + 3, (x + 1) * cell - 3, (y + 1) * cell - 3) for x, y in scene["cells"]]


def draw(scene, size=64):
    """The scene on a light background."""
    im = Image.new("RGB", (size, size), (245, 245, 240))
    pen, fill = ImageDraw.Draw(im), COLOURS[scene["colour"]]
    for x0, y0, x1, y1 in boxes(scene, size):
        if scene["shape"] == "circle":
            pen.ellipse((x0, y0, x1, y1), fill=fill)
        elif scene["shape"] == "square":
            pen.rectangle((x0, y0, x1, y1), fill=fill)
        else:
            pen.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
    return im


def save(scene, path, **kw):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    draw(scene).save(path, **kw)

# --------------------------------------------------------------------------------------- VQAv2 and COCO (Table 1)


def vqa_question(scene, rng):
    """One question about a scene: (question, answer, a plausible wrong answer, VQA answer type)."""
    s, c, n = scene["shape"], scene["colour"], scene["count"]
    kind = rng.choice(["colour", "count", "shape", "yes/no"] + (["side"] if scene["side"] else []))
    if kind == "colour":
        return f"What colour is the {s}?" if n == 1 else f"What colour are the {s}s?", c, NEAR_COLOUR[c], "other"
    if kind == "count":
        return f"How many {s}s are there?", str(n), str(n + rng.choice([-1, 1]) if n > 1 else 2), "number"
    if kind == "shape":
        return "Which shape is in the picture?", s, SHAPES[s], "other"
    if kind == "side":
        return f"Is the {s} on the left or the right?", scene["side"], "middle", "other"
    asked = rng.choice([c, NEAR_COLOUR[c]])
    question = f"Is the {s} {asked}?" if n == 1 else f"Are the {s}s {asked}?"
    return (question, "yes", "no", "yes/no") if asked == c else (question, "no", "yes", "yes/no")


def captions(scene):
    """Five reference captions of a scene."""
    s, c, n = scene["shape"], scene["colour"], scene["count"]
    if n == 1:
        where = f" on the {scene['side']}"
        return [f"A {c} {s}{where}.", f"A single {c} {s} on a plain background.",
                f"One {c} {s}{where} of the image.", f"A small {c} {s}.", f"There is a {c} {s}{where}."]
    w = WORDS[n]
    return [f"{w.capitalize()} {c} {s}s.", f"{w.capitalize()} {c} {s}s on a plain background.",
            f"A picture of {w} {c} {s}s.", f"There are {w} {s}s and they are {c}.", f"Some {c} {s}s."]


def instances(scene, image_id, first_id):
    """COCO instance annotations of one image: one per drawn shape, its category the shape's own name (the scenes
    hold none of COCO's 80 objects; CHAIR reads the objects to look for from the file's categories)."""
    return [{"id": first_id + k, "image_id": image_id, "category_id": CATEGORIES[scene["shape"]],
             "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0), "iscrowd": 0,
             "segmentation": [[x0, y0, x1, y0, x1, y1, x0, y1]]}
            for k, (x0, y0, x1, y1) in enumerate(boxes(scene))]


def write_coco(root):
    """COCO 2014 images, the VQAv2 questions and annotations, the Karpathy split file (the first 80 val images form
    its "val" split, the last 20 its "test") and the instances files. Returns each split's scenes by image id (OK-VQA
    asks about them)."""
    rng, karpathy, scenes = random.Random(SEED), [], {}
    for split, n_images in COCO_SIZES.items():
        questions, annotations, images, objects = [], [], [], []
        for i in range(n_images):
            image_id, s = (i + 1 if split == "train" else 100_000 + i), scene(rng)
            scenes.setdefault(split, {})[image_id] = s
            path = readers.coco_image(root, split, image_id)
            save(s, path, quality=90)
            question, answer, wrong, answer_type = vqa_question(s, rng)
            answers = [answer] * 10  # ten human answers: unanimous, or one to four dissenters for about a third
            if rng.random() < 0.35:
                for k in rng.sample(range(10), rng.randint(1, 4)):
                    answers[k] = wrong
            toy_world.add_vqa(questions, annotations, image_id, question, answers, answer_type)
            imgid = len(karpathy)
            sentences = [{"tokens": c.lower().rstrip(".").split(), "raw": c, "imgid": imgid, "sentid": 5 * imgid + k}
                         for k, c in enumerate(captions(s))]
            karpathy.append({"filepath": f"{split}2014", "filename": os.path.basename(path), "imgid": imgid,
                             "cocoid": image_id, "split": karpathy_split(split, i),
                             "sentences": sentences, "sentids": [x["sentid"] for x in sentences]})
            images.append({"id": image_id, "file_name": os.path.basename(path), "width": 64, "height": 64})
            objects += instances(s, image_id, len(objects) + 1)
        files.write_json(readers.instances_path(root, f"{split}2014"), {
            "info": {"description": "hyper-icl toy instances"}, "licenses": [], "images": images,
            "annotations": objects, "categories": [{"id": i, "name": s, "supercategory": "shape"}
                                                   for s, i in CATEGORIES.items()]})
        toy_world.write_vqa(root, split, "hyper-icl toy VQA", questions, annotations)
    files.write_json(os.path.join(root, "coco", "dataset_coco.json"), {"images": karpathy, "dataset": "coco"})
    return scenes


def karpathy_split(split, i):
    """The Karpathy split of the i-th COCO image of a split: train's in "train", val's first 80 in "val", the rest in
    "test" (--split test)."""
    return "train" if split == "train" else "val" if i < 80 else "test"


def write_okvqa(root, scenes):
    """OK-VQA as released: ok-vqa/OpenEnded_mscoco_<split>2014_questions.json and mscoco_<split>2014_annotations.json
    (ten answers a question, no multiple-choice answer: the reader takes the most frequent), on the COCO images."""
    rng, (_, qfile, afile) = random.Random(SEED + 1), readers.VQA_FILES["ok-vqa"]
    for split, n in OKVQA_SIZES.items():
        questions, annotations = [], []
        for image_id, s in list(scenes[split].items())[:n]:
            question, answer, wrong = rng.choice([
                ("What would you call this shape?", s["shape"], SHAPES[s["shape"]]),
                ("What colour would you paint to match these?", s["colour"], NEAR_COLOUR[s["colour"]])])
            answers, qid = [answer] * 10, image_id * 10 + 3  # OK-VQA's ids: the image's id and one digit
            for k in rng.sample(range(10), rng.randint(0, 4)):
                answers[k] = wrong
            questions.append({"image_id": image_id, "question": question, "question_id": qid})
            annotations.append({"image_id": image_id, "question_id": qid, "question_type": "other",
                                "answer_type": "other", "confidence": 3,
                                "answers": [{"answer": a, "raw_answer": a, "answer_confidence": "yes",
                                             "answer_id": k + 1} for k, a in enumerate(answers)]})
        header = {"info": {"description": "hyper-icl toy OK-VQA"}, "license": {}, "data_subtype": f"{split}2014"}
        files.write_json(os.path.join(root, "ok-vqa", qfile.format(split)), {**header, "questions": questions})
        files.write_json(os.path.join(root, "ok-vqa", afile.format(split)), {**header, "annotations": annotations})


def write_flickr30k(root):
    """Flickr30k as Karpathy released it: flickr30k/dataset_flickr30k.json (an image's id its imgid) and the images
    in flickr30k/flickr30k-images/."""
    rng, images = random.Random(SEED + 2), []
    for split, n in FLICKR_SIZES.items():
        for _ in range(n):
            s, imgid = scene(rng), len(images)
            filename = f"{1_000_000 + rng.randrange(10**8)}.jpg"
            save(s, os.path.join(root, "flickr30k", "flickr30k-images", filename), quality=90)
            sentences = [{"tokens": c.lower().rstrip(".").split(), "raw": c, "imgid": imgid, "sentid": 5 * imgid + k}
                         for k, c in enumerate(captions(s))]
            images.append({"filename": filename, "imgid": imgid, "split": split, "sentences": sentences,
                           "sentids": [x["sentid"] for x in sentences]})
    files.write_json(os.path.join(root, "flickr30k", "dataset_flickr30k.json"), {"images": images,
                                                                                 "dataset": "flickr30k"})

# ------------------------------------------------------------------------------------------------- MME (Table 2)

MME_NESTED = ("artwork", "celebrity", "landmark", "posters", "scene")  # images/ + questions_answers_YN/ as released
MME_ASKS = {"posters": "scene", "celebrity": "existence", "landmark": "scene", "artwork": "color", "OCR": "count",
            "commonsense_reasoning": "existence", "text_translation": "color",
            "code_reasoning": "numerical_calculation"}  # the other subtasks ask what their name says


def mme_pair(ask, scene, rng):
    """MME's two questions about a scene, the one answered Yes first (as in the release)."""
    s, c, n, please = scene["shape"], scene["colour"], scene["count"], " Please answer yes or no."
    other_shape, other_colour = rng.choice([x for x in SHAPES if x != s]), NEAR_COLOUR[c]
    yes, no = {
        "existence": (f"Is there a {s} in this image?", f"Is there a {other_shape} in this image?"),
        "count": (f"Are there {n} {s}s in this image?", f"Are there {n % 4 + 1} {s}s in this image?"),
        "position": (f"Is the {s} on the {scene['side']} of the image?",
                     f"Is the {s} on the {'right' if scene['side'] == 'left' else 'left'} of the image?"),
        "color": (f"Is the colour of the {s}s {c}?", f"Is the colour of the {s}s {other_colour}?"),
        "scene": (f"Is this a picture of {c} shapes?", f"Is this a picture of {other_colour} shapes?"),
        "numerical_calculation": (f"Is the number of {s}s plus two equal to {n + 2}?",
                                  f"Is the number of {s}s plus two equal to {n + 3}?"),
    }[ask]
    return [(yes + please, "Yes"), (no + please, "No")]


def write_mme(root):
    """Every MME subtask in the release layout: the MME_NESTED ones in images/ + questions_answers_YN/, the others
    with the image (.png for cognition, else .jpg) beside its question file."""
    rng = random.Random(SEED)
    for subtask in mme_seed.MME_PERCEPTION + mme_seed.MME_COGNITION:
        folder, ask = os.path.join(root, "mme", subtask), MME_ASKS.get(subtask, subtask)
        nested = subtask in MME_NESTED
        idir, qdir = (os.path.join(folder, "images"), os.path.join(folder, "questions_answers_YN")) if nested \
            else (folder, folder)
        os.makedirs(qdir, exist_ok=True)
        for i in range(MME_IMAGES):
            s = scene(rng)
            while ask == "position" and s["side"] is None:
                s = scene(rng)
            save(s, os.path.join(idir, f"{i:04d}{'.png' if subtask in mme_seed.MME_COGNITION else '.jpg'}"))
            with open(os.path.join(qdir, f"{i:04d}.txt"), "w") as f:
                f.writelines(f"{q}\t{a}\n" for q, a in mme_pair(ask, s, rng))

# ------------------------------------------------------------------------------------------ SEED-Bench (Table 2)

SEED_V1_DIMENSIONS = ("Scene Understanding", "Instance Identity", "Instance Attributes", "Instance Location",
                      "Instances Counting", "Spatial Relation", "Instance Interaction", "Visual Reasoning",
                      "Text Understanding", "Action Recognition", "Action Prediction", "Procedure Understanding")
SEED_V2_DIMENSIONS = SEED_V1_DIMENSIONS[:9] + (
    "Celebrity Recognition", "Landmark Recognition", "Chart Understanding", "Visual Referring Expression",
    "Science Knowledge", "Emotion Recognition", "Visual Mathematics", "Difference Spotting", "Meme Comprehension",
    "Global Video Understanding", "Action Recognition", "Action Prediction", "Procedure Understanding",
    "In-Context Captioning", "Interleaved Image-Text Analysis", "Text-to-Image Generation", "Next Image Prediction",
    "Text-Image Creation")  # SEED-Bench-2's question_type ids 1-27 (its DATASET.md)
SEED2_SKIPPED = [  # (question_type_id, data_type, subpart, level, data_id): questions read_seed2 leaves out
    (17, "Multiple Images", "Multiple-Images & Text Comprehension", "L1", ["task17/a_1.png", "task17/a_2.png"]),
    (19, "Video", "Video & Text Comprehension", "L1", [f"task19/v/{k}.png" for k in range(1, 9)]),
    (25, "Image Generation", "Image Generation", "L3", [f"task25/image/0/{k}.jpg" for k in range(1, 5)])]


def seed_question(dimension, scene, rng):
    """One multiple-choice question about a scene: (question, {"answer": letter, "choice_a": .., "choice_d": ..}),
    the right option shuffled among three wrong ones."""
    s, c, n = scene["shape"], scene["colour"], scene["count"]
    if dimension == 1:
        things = lambda k, colour, shape: f"{WORDS[k]} {colour} {shape}{'s' if k > 1 else ''}"
        question, right, wrong = "What does the picture show?", things(n, c, s), \
            [things(n, NEAR_COLOUR[c], s), things(n % 4 + 1, c, s), things(n, c, SHAPES[s])]
    elif dimension == 2:
        question, right, wrong = "Which shape is in the image?", s, [x for x in ("circle", "square", "triangle",
                                                                                 "star") if x != s]
    elif dimension == 3:
        question, right, wrong = f"What colour is the {s}?", c, rng.sample([x for x in COLOURS if x != c], 3)
    elif dimension == 4:
        question, right, wrong = f"Where is the {s}?", f"on the {scene['side']}", \
            [f"on the {x}" for x in ("left", "right", "top", "bottom") if x != scene["side"]]
    else:
        question, right, wrong = f"How many {s}s are in the image?", WORDS[n].capitalize(), \
            [w.capitalize() for w in WORDS[1:] if w != WORDS[n]]
    options = [right] + list(wrong)
    rng.shuffle(options)
    return question, {"answer": D.SEED_LETTERS[options.index(right)],
                      **{f"choice_{x}": o for x, o in zip("abcd", options)}}


def write_seed(root):
    """SEED-Bench-1: SEED-Bench.json (dimensions 1-5; most images get two questions of different dimensions; two
    video questions that the reader skips) and SEED-Bench-image/<data_id>.jpg (data_id without the extension)."""
    rng, folder, questions = random.Random(SEED), os.path.join(root, "seed-bench", "SEED-Bench-image"), []
    for i in range(SEED_IMAGES):
        s, data_id = scene(rng), f"{1000 + i}_{rng.randrange(10**9)}"
        save(s, os.path.join(folder, data_id + ".jpg"), quality=90)
        for dimension in rng.sample([1, 2, 3, 5] + ([4] if s["side"] else []), rng.choice([1, 2, 2])):
            question, options = seed_question(dimension, s, rng)
            questions.append({**options, "data_id": data_id, "data_type": "image", "question": question,
                              "question_id": str(100_000 + len(questions)), "question_type_id": dimension})
    questions += [{"answer": "A", "choice_a": "rolling", "choice_b": "falling", "choice_c": "sliding",
                   "choice_d": "spinning", "data_id": f"{k}.webm", "data_type": "video",
                   "question": "What is the action being carried out in the video?", "question_id": f"v{k}",
                   "question_type_id": 10} for k in range(2)]
    types = {name: k + 1 for k, name in enumerate(SEED_V1_DIMENSIONS)}
    files.write_json(os.path.join(root, "seed-bench", "SEED-Bench.json"),
                     {"questions": questions, "question_type": types})


def write_seed2(root):
    """SEED-Bench-2: seed-bench-2/SEED-Bench_v2_level1_2_3.json, cc3m-image/<data_id>.jpg (dimensions 1-5, data_id
    without extension) and SEED-Bench-2-image/task16/... (dimension 16, asking the count; data_id a path), plus
    multi-image, video and generation questions that read_seed2 skips."""
    rng, base, questions = random.Random(SEED), os.path.join(root, "seed-bench-2"), []
    for i in range(SEED_IMAGES):
        s, v2 = scene(rng), i % 3 == 0
        data_id = f"task16/toy/{i:04d}.png" if v2 else f"{1000 + i}_{rng.randrange(10**9)}"
        save(s, os.path.join(base, "SEED-Bench-2-image", data_id) if v2 else
             os.path.join(base, "cc3m-image", data_id + ".jpg"))
        dimension = 16 if v2 else rng.choice([1, 2, 3, 5] + ([4] if s["side"] else []))
        question, options = seed_question(5 if dimension == 16 else dimension, s, rng)
        questions.append({**options, "data_id": data_id, "data_source": "SEED-Bench v2" if v2 else "cc3m",
                          "data_type": "Single Image", "level": "L1", "question": question,
                          "question_type_id": dimension, "subpart": mme_seed.SEED2_SUBPART,
                          "version": "v2" if v2 else "v1"})
    questions += [{"answer": "A", **{f"choice_{x}": x for x in "abcd"}, "data_id": data_id,
                   "data_source": "SEED-Bench v2", "data_type": data_type, "level": level, "question": "Which?",
                   "question_type_id": d, "subpart": subpart, "version": "v2"}
                  for d, data_type, subpart, level, data_id in SEED2_SKIPPED]
    per_dimension = Counter()
    for q in questions:  # "{dimension}_{k}", k counting within the dimension, as the release numbers them
        q["question_id"] = f"{q['question_type_id']}_{per_dimension[q['question_type_id']]}"
        per_dimension[q["question_type_id"]] += 1
    types = {name: k + 1 for k, name in enumerate(SEED_V2_DIMENSIONS)}
    files.write_json(os.path.join(base, mme_seed.SEED2_FILE), {"questions": questions, "question_type": types})

# --------------------------------------------------------------- the paper's sizes, for a plan (not for the tests)

PAPER_SIZES = {"vqav2": (2_000, 10_000), "ok-vqa": (9_009, 5_046), "coco": (2_000, 5_000)}  # training pool, evaluation
PAPER_IMAGES = 64  # drawn images a split, shared round-robin by its questions and captions


def paper_sized(root):
    """VQAv2, OK-VQA and COCO's Karpathy split in their official layouts at the sizes Table 1 reads (VQAv2's 10,000
    evaluation questions, OK-VQA's 5,046, COCO's 5,000 Karpathy val images; training pools past the 1,000 queries +
    32 held out, OK-VQA's whole 9,009), the questions and captions of the toy scenes above (short, like the real
    ones), the images PAPER_IMAGES drawn ones shared: for `evaluate.py --table 1 --plan`, which reads the texts of
    every item and the images of a sample only."""
    rng, karpathy = random.Random(SEED), []
    for k, (split, folder) in enumerate((("train", "train"), ("val", "val"))):
        scenes = [scene(rng) for _ in range(PAPER_IMAGES)]
        for i, s in enumerate(scenes):
            save(s, readers.coco_image(root, split, i + 1), quality=90)
        for task, sizes in PAPER_SIZES.items():
            if task == "coco":
                karpathy += [{"filepath": f"{folder}2014", "filename": os.path.basename(readers.coco_image(
                    root, split, i % PAPER_IMAGES + 1)), "cocoid": 10_000_000 * (k + 1) + i, "imgid": len(karpathy),
                    "split": "train" if split == "train" else "val",
                    "sentences": [{"raw": c} for c in captions(scenes[i % PAPER_IMAGES])]} for i in range(sizes[k])]
                continue
            questions, annotations = [], []
            for i in range(sizes[k]):
                image_id, s = i % PAPER_IMAGES + 1, scenes[i % PAPER_IMAGES]
                question, answer, _, answer_type = vqa_question(s, rng)
                toy_world.add_vqa(questions, annotations, image_id, question, [answer] * 10, answer_type)
                questions[-1]["question_id"] = annotations[-1]["question_id"] = i + 1
            _, qfile, afile = readers.VQA_FILES[task]
            files.write_json(os.path.join(root, task, qfile.format(split)), {"questions": questions})
            files.write_json(os.path.join(root, task, afile.format(split)), {"annotations": annotations})
    files.write_json(os.path.join(root, "coco", "dataset_coco.json"), {"images": karpathy, "dataset": "coco"})
    return root


if __name__ == "__main__":  # python -m tools.benchmarks [DIR | --paper-sized DIR]: write, and print the folder
    print(paper_sized(sys.argv[2]) if sys.argv[1:2] == ["--paper-sized"] else
          generate(os.path.abspath(sys.argv[1])) if sys.argv[1:] else generate())
