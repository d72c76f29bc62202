"""The toy-icl world (lab/datasets/toy_world.py): tasks only demonstrations can solve, in VQAv2's format, written
atomically."""
import io
import os

import pytest
import torch
from PIL import Image

import data as D
from lab.datasets import tasks, toy_world
from lab.models import toy_backbone


def test_generation_is_atomic(tmp_path, monkeypatch):
    def interrupted(root, attribute):
        os.makedirs(os.path.join(root, "vqav2"))
        raise KeyboardInterrupt

    monkeypatch.setattr(toy_world, "write_toy_icl", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tasks.load_task("toy-icl-colour", "train", tmp_path)
    assert os.listdir(tmp_path / "toy-icl") == []  # neither a half-written colour/ nor a temporary folder
    monkeypatch.undo()
    assert len(tasks.load_task("toy-icl-colour", "train", tmp_path)) == toy_world.ICL_SIZES["train"]
    monkeypatch.setattr(toy_world, "write_toy_icl", interrupted)  # generated once, then only read
    assert len(tasks.load_task("toy-icl-colour", "val", tmp_path)) == toy_world.ICL_SIZES["val"]


@pytest.mark.parametrize("attribute", list(toy_world.ICL_ATTRIBUTES))
def test_toy_icl_tasks_ask_an_uninformative_question_in_the_vqav2_format(attribute):
    task = f"toy-icl-{attribute}"
    for split, n in toy_world.ICL_SIZES.items():
        items = tasks.load_task(task, split)
        assert len(items) == n and {it.question for it in items} == {toy_world.ICL_QUESTION}
        assert {it.target for it in items} == set(toy_world.ICL_ATTRIBUTES[attribute])  # every answer occurs
        assert all(it.answers == (it.target,) * 10 for it in items)
    assert Image.open(items[0].image_path).size == (toy_world.ICL_SIDE, toy_world.ICL_SIDE)


def test_the_tasks_draw_different_images_and_answers_follow_the_scene():
    paths = {a: tasks.load_task(f"toy-icl-{a}", "val")[0].image_path for a in toy_world.ICL_ATTRIBUTES}
    blobs = [open(p, "rb").read() for p in paths.values()]
    assert len(set(blobs)) == len(blobs)
    scene = {"colour": "blue", "background": "white", "count": "2", "cells": [0, 8], "margins": [[1] * 4] * 2,
             "shade": [0, 0, 0]}
    pixels = Image.open(io.BytesIO(toy_world.icl_jpeg(scene))).convert("RGB")
    assert pixels.getpixel((7, 7))[2] > 180 and pixels.getpixel((35, 35))[2] > 180  # the two squares' centres
    assert pixels.getpixel((21, 21))[2] < 250 and min(pixels.getpixel((21, 21))) > 200  # an empty cell


def test_episodes_read_like_evaluation_prompts():
    """A meta-training row with one ICD is token for token the evaluation's 1-shot prompt + the query's answer."""
    processor = toy_backbone.toy_processor()
    text = toy_world.icl_text_pieces(processor)
    items = tasks.load_task("toy-icl-colour", "val")[:2]
    pixels = [D.encode_piece(processor, "idefics2", "<image>", D.load_image(it))["images"] for it in items]
    row = toy_world.icl_episode(processor, [{**text[toy_world.ICL_QUESTION, it.target, k == 1], "images": p}
                                            for k, (it, p) in enumerate(zip(items, pixels))])
    reference = D.encode(processor, "idefics2", "vqa", items[:1], items[1])
    assert row["input_ids"] == reference["input_ids"]
    answers = [i for i, label in zip(row["input_ids"], row["labels"]) if label != -100]
    end = processor.tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    assert answers == [*processor.tokenizer(" " + items[0].target, add_special_tokens=False)["input_ids"], end,
                       *processor.tokenizer(" " + items[1].target, add_special_tokens=False)["input_ids"], end]
    assert [[torch.equal(x, y) for x, y in zip(a["pixel_values"], b["pixel_values"], strict=True)]
            for a, b in zip(row["images"], reference["images"])] == [[True], [True]]
