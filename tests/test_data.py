"""data.py: demonstrations, teacher/student rows and batches on the tiny twins of the paper's four families, the
likelihood prompt, and images refused before they are decoded (unreadable, a FIFO, EPS, oversized) or prompts too
long for the context."""
import dataclasses
import io
import os
import random

import pytest
import torch
from PIL import EpsImagePlugin, Image
from hypothesis import given
from hypothesis import strategies as st

import benchmarks
import data
import hub_layouts
from data import Item
from helpers import jsonl
from lab.datasets import parquet, tasks
from lab.models import backbones


BACKBONES = ["idefics2", "idefics", "llava-interleave", "llava-onevision"]  # conftest.py's backbone: the paper's four


def test_unreadable_or_missing_image_names_item_and_path(tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    for path in (bad, tmp_path / "gone.jpg"):
        with pytest.raises(OSError, match=f"item 7: cannot read its image {path}"):
            data.load_image(Item(7, str(path), "q?", ("a",) * 10, "a"))


def test_likelihood_prompt_is_the_official_one():
    item = Item(1, "x.jpg", "What is it?", ("a", "b", "c", "d"), "A", "Scene Understanding")
    assert data.PROMPTS["choice-likelihood"]["instruction"] == ""
    assert data.prompt_text("choice-likelihood", item) == "<image>Question: What is it?\nAnswer:"


def fake_items(ids):
    return [Item(i, f"{i}.jpg", "q?", ("a",) * 10, "a") for i in ids]


@given(st.lists(st.integers(0, 10**9), min_size=2, max_size=60, unique=True), st.integers(0, 2**32),
       st.data())
def test_demonstrations_exclude_the_query_and_do_not_depend_on_order(ids, seed, draw):
    support = fake_items(ids)
    m = draw.draw(st.integers(0, len(ids) - 1))
    queries = draw.draw(st.lists(st.sampled_from(ids) | st.integers(0, 10**9), min_size=1, max_size=8))
    icds = data.demonstrations(queries, support, m, seed)
    for q, d in zip(queries, icds):
        assert len(d) == m and q not in [x.id for x in d] and len({x.id for x in d}) == m
    assert data.demonstrations(queries[::-1], support, m, seed) == icds[::-1]
    assert data.demonstrations(queries, support, m, seed) == icds


def test_demonstrations_depend_on_the_seed_and_need_enough_support():
    support = fake_items(range(100))
    assert data.demonstrations([5], support, 8, 0) != data.demonstrations([5], support, 8, 1)
    with pytest.raises(ValueError, match="too small"):
        data.demonstrations([5], support[:8], 8, 0)


def image_tokens_per_image(processor, family, image):
    """How many <image> tokens one image becomes: what each family's processor documents."""
    if family == "idefics2":
        return processor.image_seq_len * (5 if processor.image_processor.do_image_splitting else 1)
    if family == "idefics":
        return 1  # its images enter through cross-attention; the text holds one placeholder
    if family == "llava-interleave":  # one token per patch of the resized image (less CLS under "default")
        size = processor.image_processor.size
        return ((size["height"] // processor.patch_size) * (size["width"] // processor.patch_size)
                + processor.num_additional_image_tokens - (processor.vision_feature_select_strategy == "default"))
    # LLaVA-OneVision: an image among several (its multi-image mode): the base view and a newline, no anyres tiles
    return processor.num_image_tokens + 1 - (processor.vision_feature_select_strategy == "default")


def n_images(batch, family):
    """Images per row in a collated batch."""
    if family in ("idefics2", "idefics"):
        return [int((pv.flatten(1).abs().sum(1) > 0).sum()) for pv in batch["pixel_values"]]
    return batch["pixel_values"].shape[0]


def teacher_and_student(processor, family, kind, queries, icds):
    """The teacher and the student batch of queries, as train.py builds them (data.query_pieces shared by both)."""
    pieces = data.query_pieces(processor, family, kind, queries)
    return (data.teacher_batch(processor, family, kind, pieces, icds),
            data.student_batch(processor, family, kind, pieces))


@pytest.mark.parametrize("kind", ["vqa", "caption"])
def test_teacher_and_student_rows_line_up(backbone, bench, kind):
    tasks = bench
    p, family = backbone.processor, backbone.family
    items = tasks["vqav2" if kind == "vqa" else "coco", "train"]
    queries, m = items[:3], 2
    teacher, student = teacher_and_student(p, family, kind, queries, data.demonstrations(
        [q.id for q in queries], items, m, seed=0))
    end = p.tokenizer.convert_tokens_to_ids(data.end_token(p, family))
    assert end != p.tokenizer.unk_token_id
    for b in range(len(queries)):
        T = int(student["query_target"][b].sum())
        assert T == int(teacher["query_target"][b].sum())
        for batch in (teacher, student):  # query_target = exactly the last T positions
            assert batch["query_target"][b, -T:].all() and not batch["query_target"][b, :-T].any()
        assert torch.equal(teacher["input_ids"][b, -T:], student["input_ids"][b, -T:])
        assert torch.equal(teacher["labels"][b, -T:], student["labels"][b, -T:])
        assert (teacher["labels"][b, :-T] == -100).all()
        labelled = student["labels"][b][student["labels"][b] != -100]
        assert labelled[-1] == end and p.tokenizer.decode(labelled[:-1]) == " " + queries[b].target
        tokens = student["input_ids"][b][student["labels"][b] != -100]
        assert torch.equal(tokens, labelled)  # labels are the answer's own ids (the model shifts them)
    for batch, per_row in ((teacher, m + 1), (student, 1)):
        image = data.load_image(queries[0])
        expected = per_row * image_tokens_per_image(p, family, image)
        assert ((batch["input_ids"] == p.image_token_id).sum(1) == expected).all()
        assert n_images(batch, family) == ([per_row] * 3 if family in ("idefics2", "idefics") else 3 * per_row)


def test_position_ids_ignore_padding(backbone, bench):
    tasks = bench
    p, family = backbone.processor, backbone.family
    items = tasks["vqav2", "train"]
    batch = data.prompt_batch(p, family, "vqa", items[:2], [[], items[2:5]])  # zero-shot and 3-shot rows
    mask = batch["attention_mask"]
    assert mask[0, 0] == 0 and mask[1].all()  # the short row is left-padded
    for b in range(2):
        n = int(mask[b].sum())
        assert batch["position_ids"][b, -n:].tolist() == list(range(n))
        assert (batch["position_ids"][b, :-n] == 0).all()
        assert (batch["input_ids"][b, :-n] == p.tokenizer.pad_token_id).all()
    assert (batch["labels"] == -100).all()


def test_prompt_is_the_student_row_without_its_answer(backbone, bench):
    tasks = bench
    p, family = backbone.processor, backbone.family
    q = tasks["vqav2", "val"][0]
    _, student = teacher_and_student(p, family, "vqa", [q], [[]])
    prompt = data.prompt_batch(p, family, "vqa", [q])
    n_answer = int((student["labels"] != -100).sum())
    assert torch.equal(prompt["input_ids"][0], student["input_ids"][0, :-n_answer])


def test_idefics_query_cross_attends_as_in_the_student(bench):
    """Idefics' image_attention_mask, rebuilt for the joined row: query tokens see only the query image, as alone."""
    tasks = bench
    bb = backbones.load_backbone("tiny-idefics")
    items = tasks["vqav2", "train"]
    teacher, student = teacher_and_student(bb.processor, "idefics", "vqa", items[:1], [items[1:4]])
    t_mask = teacher["image_attention_mask"][0][teacher["query_target"][0]]  # [query tokens, 4 images]
    s_mask = student["image_attention_mask"][0][student["query_target"][0]]  # [query tokens, 1 image]
    assert (t_mask[:, :3] == 0).all() and torch.equal(t_mask[:, 3:], s_mask) and s_mask.sum() == len(s_mask) - 1


def test_forward_pass_on_collated_batches(backbone, bench):
    tasks = bench
    p, family = backbone.processor, backbone.family
    items = tasks["vqav2", "train"]
    rng = random.Random(0)
    queries = rng.sample(items, 2)
    teacher, student = teacher_and_student(p, family, "vqa", queries, data.demonstrations(
        [q.id for q in queries], items, 2, seed=1))
    for batch in (teacher, student, data.prompt_batch(p, family, "vqa", queries)):
        inputs = {k: v for k, v in batch.items() if k != "query_target"}
        out = backbone.model(**inputs)
        assert out.logits.shape == (*batch["input_ids"].shape, backbone.model.config.get_text_config().vocab_size)
        assert torch.isfinite(out.logits).all()
    assert torch.isfinite(backbone.model(**{k: v for k, v in student.items() if k != "query_target"}).loss)


def test_an_image_path_that_is_a_fifo_is_refused_naming_it(tmp_path, items):
    fifo = tmp_path / "image.jpg"
    os.mkfifo(fifo)
    item = dataclasses.replace(items[0], image_path=str(fifo))
    with pytest.raises(OSError, match=rf"item {item.id}: its image {fifo} is not a regular file"):
        data.load_image(item)  # before: open() waited for a writer forever


def vqav2_shard(root, image_bytes, n=1):
    """root/vqav2/data/validation-00000-of-00001.parquet: n rows of lmms-lab/VQAv2's columns, each image these bytes."""
    answers = [{"answer": "yes", "answer_confidence": "yes", "answer_id": 1}]
    rows = [{"question_type": "is", "multiple_choice_answer": "yes", "answers": answers, "image_id": k,
             "answer_type": "yes/no", "question_id": k, "question": "Is it red?",
             "image": {"bytes": image_bytes, "path": f"{k}.jpg"}} for k in range(n)]
    hub_layouts.write_shards(str(root / "vqav2"), "validation", rows, hub_layouts.VQAV2, n_shards=1)
    return str(root / "vqav2" / "data" / "validation-00000-of-00001.parquet")


@pytest.fixture()
def ghostscript(tmp_path, monkeypatch):
    """A stand-in `gs` first on PATH that leaves a marker file when run (PIL's EPS plugin runs gs to load an EPS)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    marker = tmp_path / "gs-ran"
    (folder / "gs").write_text(f"#!/bin/sh\ntouch {marker}\nexit 1\n")
    (folder / "gs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)  # found again on this PATH
    return marker


def eps_bytes():
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, format="EPS")
    return out.getvalue()


def test_an_eps_image_is_refused_at_read_and_at_load_time_and_runs_no_program(ghostscript, tmp_path, monkeypatch):
    (tmp_path / "red.eps").write_bytes(eps_bytes())
    task = jsonl(tmp_path / "eps.jsonl", [{"id": 1, "image": "red.eps", "question": "Is it red?", "answer": "yes"}])
    with pytest.raises(ValueError, match=rf"{task} line 1, field `image`: .*red.eps: not an image of the formats "
                                         r"read \(JPEG, .*EPS among them"):
        tasks.load_task(task, "train")
    item = data.Item(7, str(tmp_path / "red.eps"), "Is it red?", ("yes",), "yes")
    with pytest.raises(OSError, match=r"item 7: cannot read its image .*red.eps as JPEG/PNG/WEBP/GIF/BMP/TIFF \("):
        data.load_image(item)
    monkeypatch.setattr(parquet, "CACHE", str(tmp_path / "cache"))
    shard = vqav2_shard(tmp_path / "hub", eps_bytes())
    with pytest.raises(ValueError, match=rf"{shard} row 0 \(question_id 0\) is malformed: its image bytes are not a "
                                         r"readable image \(not an image of the formats read"):
        tasks.load_task("vqav2", "val", str(tmp_path / "hub"))
    assert not ghostscript.exists()  # before: the own task read, and load_image ran gs (a CalledProcessError)


def test_a_prompt_longer_than_the_context_names_its_item():
    backbone = backbones.load_backbone("tiny-idefics2")
    item = tasks.load_task("vqav2", "train", benchmarks.ROOT)[0]
    long = dataclasses.replace(item, question=" ".join(["quizzical"] * 2000))
    assert backbone.processor.tokenizer.model_max_length == 4096           # the tiny twin's max_position_embeddings
    with pytest.raises(ValueError, match=rf"item {item.id}: its prompt has \d+ tokens, more than the model's 4096 "
                                         "positions"):
        data.prompt_batch(backbone.processor, backbone.family, "vqa", [item, long])
    data.prompt_batch(backbone.processor, backbone.family, "vqa", [item])  # a normal one still passes


def test_an_oversized_image_is_refused_by_name_with_its_size(tmp_path):
    import io
    import struct
    import zlib
    from PIL import Image
    small = io.BytesIO()
    Image.new("RGB", (1, 1)).save(small, format="PNG")
    ihdr = b"IHDR" + struct.pack(">II", 20000, 20000) + small.getvalue()[24:29]
    png = small.getvalue()[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + small.getvalue()[33:]
    (tmp_path / "big.png").write_bytes(png)                                # a 1 x 1 PNG whose header says 20000 x 20000
    with pytest.raises(OSError, match=r"item 3: cannot read its image .*big.png as .* \(Image size \(400000000 "
                                      r"pixels\)"):
        data.load_image(data.Item(3, str(tmp_path / "big.png"), "q", ("a",), "a"))
