"""The toy-icl world: tasks only demonstrations can solve, the meta-trained toy-idefics2 backbone (determinism,
checked cache), and the efficacy of distillation on it (fails when the adapter or the teacher is broken)."""
import io
import os
import shutil

import pytest
import torch
from PIL import Image

import data as D
import evaluate as E
import model as M
import train

SHIPPED = os.path.join(os.path.dirname(__file__), "data", "toy-idefics2.safetensors")
SMALL_RECIPE = {**M.TOY_RECIPE, "named_steps": 2, "episode_steps": 2, "named_batch": 4, "episode_batch": 2,
                "scenes": 64, "probe_every": 10**6}


@pytest.mark.parametrize("attribute", list(D.ICL_ATTRIBUTES))
def test_toy_icl_tasks_ask_an_uninformative_question_in_the_vqav2_format(attribute):
    task = f"toy-icl-{attribute}"
    for split, n in D.ICL_SIZES.items():
        items = D.load_task(task, split)
        assert len(items) == n and {it.question for it in items} == {D.ICL_QUESTION}
        assert {it.target for it in items} == set(D.ICL_ATTRIBUTES[attribute])  # every answer occurs
        assert all(it.answers == (it.target,) * 10 for it in items)
    assert Image.open(items[0].image_path).size == (D.ICL_SIDE, D.ICL_SIDE)


def test_the_tasks_draw_different_images_and_answers_follow_the_scene():
    paths = {a: D.load_task(f"toy-icl-{a}", "val")[0].image_path for a in D.ICL_ATTRIBUTES}
    blobs = [open(p, "rb").read() for p in paths.values()]
    assert len(set(blobs)) == len(blobs)
    scene = {"colour": "blue", "background": "white", "count": "2", "cells": [0, 8], "margins": [[1] * 4] * 2,
             "shade": [0, 0, 0]}
    pixels = Image.open(io.BytesIO(D.icl_jpeg(scene))).convert("RGB")
    assert pixels.getpixel((7, 7))[2] > 180 and pixels.getpixel((35, 35))[2] > 180  # the two squares' centres
    assert pixels.getpixel((21, 21))[2] < 250 and min(pixels.getpixel((21, 21))) > 200  # an empty cell


def test_episodes_read_like_evaluation_prompts():
    """A meta-training row with one ICD is token for token the evaluation's 1-shot prompt + the query's answer."""
    processor = M.toy_processor()
    text = D.icl_text_pieces(processor)
    items = D.load_task("toy-icl-colour", "val")[:2]
    pixels = [D.encode_piece(processor, "idefics2", "<image>", D.load_image(it))["images"] for it in items]
    row = D.icl_episode(processor, [{**text[D.ICL_QUESTION, it.target, k == 1], "images": p}
                                    for k, (it, p) in enumerate(zip(items, pixels))])
    reference = D.encode(processor, "idefics2", "vqa", items[:1], items[1])
    assert row["input_ids"] == reference["input_ids"]
    answers = [i for i, label in zip(row["input_ids"], row["labels"]) if label != -100]
    end = processor.tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    assert answers == [*processor.tokenizer(" " + items[0].target, add_special_tokens=False)["input_ids"], end,
                       *processor.tokenizer(" " + items[1].target, add_special_tokens=False)["input_ids"], end]
    assert [torch.equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(row["images"], reference["images"])] \
        == [True, True]


def test_every_answer_is_one_token():
    tok = M.toy_processor().tokenizer
    for answers in D.ICL_ATTRIBUTES.values():
        assert all(len(tok(" " + a, add_special_tokens=False)["input_ids"]) == 1 for a in answers)


def test_the_builder_is_deterministic_and_the_cache_is_checked(tmp_path, capsys):
    first, _ = M.toy_idefics2(SMALL_RECIPE, cache=str(tmp_path / "a"))
    second, _ = M.toy_idefics2(SMALL_RECIPE, cache=str(tmp_path / "b"))
    a, b = first.state_dict(), second.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    path = M.toy_path(SMALL_RECIPE, str(tmp_path / "a"))
    assert M.weights_digest(M.read_toy(path)) == M.weights_digest(a)
    assert M.recipe_of(path) == M.recipe_of(M.toy_path(SMALL_RECIPE, str(tmp_path / "b"))) == SMALL_RECIPE
    assert "built in" in capsys.readouterr().out
    cached, _ = M.toy_idefics2(SMALL_RECIPE, cache=str(tmp_path / "a"))  # read back, not rebuilt
    assert all(torch.equal(cached.state_dict()[k], a[k]) for k in a) and "built" not in capsys.readouterr().out
    blob = open(path, "rb").read()
    for damage in (blob[:len(blob) // 2], blob[:-8] + bytes(8)):  # truncated; weights changed
        with open(path, "wb") as f:
            f.write(damage)
        rebuilt, _ = M.toy_idefics2(SMALL_RECIPE, cache=str(tmp_path / "a"))
        assert "unusable" in capsys.readouterr().out
        assert all(torch.equal(rebuilt.state_dict()[k], a[k]) for k in a)
        assert M.weights_digest(M.read_toy(path)) == M.weights_digest(a)  # and the file is whole again


def test_an_interrupted_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def interrupted(tensors, metadata=None):  # stopped while serialising, its temporary file already open
        raise KeyboardInterrupt
    monkeypatch.setattr(M, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        M.toy_idefics2(SMALL_RECIPE, cache=str(tmp_path))
    assert os.listdir(tmp_path) == []


# -----------------------------------------------------------------------------
# efficacy: distillation on the shipped toy-idefics2 lifts zero-shot accuracy towards 8-shot ICL

@pytest.fixture(scope="module")
def shipped(tmp_path_factory):
    """The shipped toy-idefics2 (tests/data), placed where load_backbone looks for the current recipe."""
    M.read_toy(SHIPPED)  # intact (raises otherwise)
    if M.recipe_of(SHIPPED) != M.TOY_RECIPE:
        pytest.fail(f"{SHIPPED} was built with another recipe than model.TOY_RECIPE; regenerate it (README)")
    cache = tmp_path_factory.mktemp("cache")
    shutil.copy(SHIPPED, M.toy_path(M.TOY_RECIPE, str(cache)))
    return str(cache)


EFFICACY = ["--model", "toy-idefics2", "--task", "toy-icl-colour"]


@pytest.fixture
def one_thread():
    """One thread: on a shared 2-core machine about 10x faster than two (DESIGN.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def accuracy(out, flags):
    return E.main([*EFFICACY, "--n-eval", "60", "--batch-size", "30", "--out", out, *flags])["vqa_accuracy"]


def test_distillation_lifts_zero_shot_to_eight_shot(shipped, one_thread, tmp_path, monkeypatch):
    """The anchor alone (lambda = 0: no label is seen) on 48 queries carries 8-shot behaviour into the zero-shot
    student. Fails if the adapter cannot move the logits (U_k frozen at 0) or the teacher sees no demonstrations."""
    monkeypatch.setattr(M, "TOY_CACHE", shipped)
    out = str(tmp_path / "run")
    train.main([*EFFICACY, "--out", out, "--lam", "0", "--lr", "2e-2", "--n-train", "48", "--n-heldout", "8",
                "--batch-size", "8", "--epochs", "16"])
    zero, eight = accuracy(out, ["--shots", "0"]), accuracy(out, ["--shots", "8"])
    adapter = accuracy(out, ["--checkpoint", os.path.join(out, "adapter.safetensors")])
    print(f"zero-shot {zero:.1f}, 8-shot {eight:.1f}, anchor-only Hyper-ICL {adapter:.1f}")
    assert zero <= 45 and eight >= 80             # the backbone needs the demonstrations and uses them
    assert adapter - zero >= 50                   # the distilled adapter carries them without the demonstrations
