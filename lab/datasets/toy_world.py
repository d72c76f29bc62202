"""toy-icl: a world where demonstrations are needed. Every question is the same uninformative "What is it?"; which
attribute of the image is asked (the colour of its squares or of the background) is readable only from the
demonstrations' image-answer pairs. One VQAv2 dataset per attribute, task `toy-icl-<attribute>`, written once in
~/.cache/hyper-icl/toy-icl/<attribute> (or data_root/toy-icl/<attribute>), then read. Images are 42 x 42, a 3 x 3
grid of 14-px cells: one vision patch per cell of the toy backbone (lab/models/toy_backbone.py), which is
meta-trained on scenes of its own drawing, never on these files."""
import io
import os
import random

from PIL import Image, ImageDraw

import data
from lab.disk import files
from lab.datasets import readers

ICL_QUESTION = "What is it?"

ICL_COLOURS = {"red": (220, 30, 30), "green": (30, 160, 60), "blue": (40, 70, 220), "yellow": (240, 210, 30)}

ICL_BACKGROUNDS = {"white": (245, 245, 240), "grey": (128, 128, 128), "black": (20, 20, 20), "purple": (120, 40, 140)}

ICL_ATTRIBUTES = {"colour": tuple(ICL_COLOURS), "background": tuple(ICL_BACKGROUNDS)}

ICL_NAMED = {"colour": "What colour are the squares?", "background": "What colour is the background?"}

ICL_SIZES = {"train": 1100, "val": 300}  # images (= questions) per split and attribute

ICL_SIDE, ICL_CELL = 42, 14


def icl_scene(rng):
    """1-4 shapes of one kind and colour in distinct cells; each shape's margins (size, place) and the shade vary."""
    count = rng.randint(1, 4)
    return dict(colour=rng.choice(ICL_ATTRIBUTES["colour"]), background=rng.choice(ICL_ATTRIBUTES["background"]),
                count=str(count), cells=rng.sample(range(9), count),
                margins=[[rng.randint(1, 2) for _ in range(4)] for _ in range(count)],
                shade=[rng.randint(-15, 15) for _ in range(3)])


def icl_jpeg(scene):
    """The scene drawn on a light background and encoded as a JPEG (4:4:4, quality 95): the bytes of its file."""
    im = Image.new("RGB", (ICL_SIDE, ICL_SIDE), ICL_BACKGROUNDS[scene["background"]])
    draw = ImageDraw.Draw(im)
    fill = tuple(max(0, min(255, c + s)) for c, s in zip(ICL_COLOURS[scene["colour"]], scene["shade"]))
    for cell, (left, top, right, bottom) in zip(scene["cells"], scene["margins"]):
        x, y = cell % 3 * ICL_CELL, cell // 3 * ICL_CELL
        draw.rectangle((x + left, y + top, x + ICL_CELL - 1 - right, y + ICL_CELL - 1 - bottom), fill=fill)
    buffer = io.BytesIO()
    im.save(buffer, format="JPEG", quality=95, subsampling=0)
    return buffer.getvalue()


def icl_text_pieces(processor):
    """Every piece a meta-training episode is made of, as ids and labels: {(question, answer, last): piece}. A piece
    is `<image>Question: q Short answer: a<end>` (+ the separator unless `last`, the query), tokenised once (its ids
    do not depend on the image) exactly as PROMPTS writes evaluation prompts, labels on the answer + end token."""
    blank = Image.new("RGB", (ICL_SIDE, ICL_SIDE))
    ids = lambda text: data.encode_piece(processor, "idefics2", text, blank)["input_ids"]
    pieces = {}
    for attribute, answers in ICL_ATTRIBUTES.items():
        for question, answer, last in [(q, a, l) for q in (ICL_QUESTION, ICL_NAMED[attribute]) for a in answers
                                       for l in (False, True)]:
            prompt = data.prompt_text("vqa", data.Item(0, "", question, (answer,), answer))
            with_answer = prompt + data.answer_text(processor, "idefics2", "vqa", answer)
            p, a = ids(prompt), ids(with_answer)
            full = a if last else ids(with_answer + data.SEPARATOR)
            if a[:len(p)] != p or full[:len(a)] != a:
                raise ValueError(f"the answer {answer!r} does not tokenise as a continuation of its prompt")
            pieces[question, answer, last] = {"input_ids": full, "labels": [-100] * len(p) + a[len(p):] +
                                              [-100] * (len(full) - len(a))}
    return pieces


def icl_episode(processor, pieces):
    """A meta-training row: BOS, the instruction, then the pieces (ICDs, the query last; each with its "images"),
    labels on every answer, so one row trains every number of demonstrations up to its own."""
    start = data.encode_prefix(processor, "idefics2", "vqa", [])["input_ids"]
    return {"input_ids": start + [i for p in pieces for i in p["input_ids"]],
            "labels": [-100] * len(start) + [i for p in pieces for i in p["labels"]],
            "images": [p["images"] for p in pieces], "query_len": len(pieces[-1]["input_ids"])}


def write_toy_icl(root, attribute):
    """Write the toy-icl-<attribute> dataset under `root` in the official VQAv2 + COCO formats."""
    rng = random.Random(f"toy-icl:{attribute}")  # str seeds hash with sha512: the same in every process
    for split, n_images in ICL_SIZES.items():
        os.makedirs(os.path.join(root, "coco", f"{split}2014"))
        questions, annotations = [], []
        for i in range(n_images):
            image_id, scene = (i + 1 if split == "train" else 100_000 + i), icl_scene(rng)
            with open(readers.coco_image(root, split, image_id), "wb") as f:
                f.write(icl_jpeg(scene))
            add_vqa(questions, annotations, image_id, ICL_QUESTION, [scene[attribute]] * 10, "other")
        write_vqa(root, split, f"hyper-icl toy-icl-{attribute}", questions, annotations)


def write_vqa(root, split, description, questions, annotations):
    """A split's VQAv2 questions and annotations files under `root`, as the official ones are laid out."""
    _, qfile, afile = readers.VQA_FILES["vqav2"]
    header = {"info": {"description": description}, "license": {}, "data_type": "mscoco",
              "data_subtype": f"{split}2014"}
    files.write_json(os.path.join(root, "vqav2", qfile.format(split)),
                     {**header, "task_type": "Open-Ended", "questions": questions})
    files.write_json(os.path.join(root, "vqav2", afile.format(split)), {**header, "annotations": annotations})


def add_vqa(questions, annotations, image_id, question, answers, answer_type):
    """Append a VQAv2 question about a toy image and its annotation (the ten answers; the question type its first
    two words, the multiple-choice answer the most frequent)."""
    qid = image_id * 1000
    questions.append({"image_id": image_id, "question": question, "question_id": qid})
    annotations.append({"question_id": qid, "image_id": image_id,
                        "question_type": " ".join(question.split()[:2]).lower(), "answer_type": answer_type,
                        "multiple_choice_answer": readers.most_frequent(answers),
                        "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": k + 1}
                                    for k, a in enumerate(answers)]})


def toy_icl_root(attribute, data_root=None):
    """The data_root of toy-icl-<attribute>: data_root/toy-icl/<attribute>, or ~/.cache/hyper-icl/toy-icl/<attribute>
    (generated on first use)."""
    folder = os.path.join(data_root or os.path.expanduser("~/.cache/hyper-icl"), "toy-icl", attribute)
    return files.generated(folder, lambda tmp: write_toy_icl(tmp, attribute))
