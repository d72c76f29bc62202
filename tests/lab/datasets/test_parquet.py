"""The benchmarks as the hub ships them for lmms-eval (lab/datasets/parquet.py): the same questions in the six
lmms-lab parquet layouts (tools/hub_layouts.py) read to the same Items as the original layouts' readers, in the same
order, and score identically; the original files win when both are there; a split the hub lacks, duplicate ids, empty
answers, bad image bytes and a FIFO are refused naming the shard and the row; the image cache; --plan reads them."""
import dataclasses
import hashlib
import io
import os
import shutil

import pyarrow.parquet as pq
import pytest
from PIL import Image

import benchmarks
import hub_layouts
from lab.datasets import parquet, tasks
from lab.scores import metrics
from twins import write_twin
from helpers import lab, lab_evaluate_args


TASKS = ("vqav2", "ok-vqa", "coco", "flickr30k", "mme", "seed")


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    """(original root, hub root, cache): OK-VQA and Flickr30k written beside links to benchmarks.ROOT's originals,
    the six hub layouts from them in a folder of their own; the image cache in a temporary folder."""
    original = tmp_path_factory.mktemp("original")
    for name in ("vqav2", "mme", "seed-bench"):
        os.symlink(os.path.join(benchmarks.ROOT, name), original / name)
    hub_layouts.write_okvqa_original(str(original), benchmarks.ROOT)  # links coco too
    hub_layouts.write_flickr_original(str(original), benchmarks.ROOT)
    hub = tmp_path_factory.mktemp("hub")
    for task in TASKS:
        hub_layouts.write_hub(str(original), str(hub), task)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(parquet, "CACHE", str(tmp_path_factory.mktemp("cache")))
        yield str(original), str(hub), parquet.CACHE


def by_content(items):
    """The items with each image path replaced by the sha256 of the image's bytes (the hub's copy caches them)."""
    def digest(path):
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    return [dataclasses.replace(it, image_path=digest(it.image_path)) for it in items]


def scores(task, items):
    """The task's metric on fixed predictions: the target for two items of three, a wrong answer for the third."""
    predictions = [it.target if k % 3 else "purple" for k, it in enumerate(items)]
    if task in ("mme", "seed"):
        return (metrics.mme_scores if task == "mme" else metrics.seed_scores)(items, predictions)
    if task in ("coco", "flickr30k"):
        return metrics.cider_d({it.id: p for it, p in zip(items, predictions)},
                               {it.id: list(it.answers) for it in items})
    return [metrics.vqa_accuracy(p, it.answers) for it, p in zip(items, predictions)]


@pytest.mark.parametrize("task", TASKS)
def test_the_hub_layout_reads_to_the_original_items_and_scores(roots, task, capsys):
    original, hub, cache = roots
    for split in ("val",) + (("train",) if task in ("mme", "seed") else ()):
        want, got = tasks.load_task(task, split, original), tasks.load_task(task, split, hub)
        assert len(got) >= 10 and by_content(got) == by_content(want)
        assert all(it.image_path.startswith(cache) for it in got)
        assert scores(task, got) == scores(task, want)
    assert "parquet shard(s) of lmms-lab/" in capsys.readouterr().out


def test_a_second_read_writes_no_image_and_reads_the_same(roots):
    _, hub, cache = roots
    first = tasks.load_task("seed", "val", hub)
    stamps = {p: os.stat(p).st_mtime_ns for p in {it.image_path for it in first}}
    assert tasks.load_task("seed", "val", hub) == first
    assert {p: os.stat(p).st_mtime_ns for p in stamps} == stamps


def test_both_layouts_read_the_original_files_and_say_so(roots, tmp_path, capsys):
    original, hub, _ = roots
    both = tmp_path / "both"
    both.mkdir()
    os.symlink(os.path.join(benchmarks.ROOT, "coco"), both / "coco")
    os.symlink(os.path.join(benchmarks.ROOT, "vqav2"), both / "vqav2-original")
    os.makedirs(both / "vqav2")
    for name in os.listdir(both / "vqav2-original"):
        os.symlink(both / "vqav2-original" / name, both / "vqav2" / name)
    shutil.copytree(os.path.join(hub, "vqav2", "data"), both / "vqav2" / "data")  # a linked folder is not walked
    capsys.readouterr()
    items = tasks.load_task("vqav2", "val", str(both))
    assert items == [dataclasses.replace(it, image_path=it.image_path.replace(original, str(both)))
                     for it in tasks.load_task("vqav2", "val", original)]
    out = capsys.readouterr().out
    assert out.count("holds both the original files and the hub's parquet shards; reading the original files") == 1


def test_a_split_the_hub_lacks_names_the_files_to_get(roots):
    _, hub, _ = roots
    with pytest.raises(FileNotFoundError) as e:
        tasks.load_task("vqav2", "train", hub)
    message = str(e.value)
    assert "\n" not in message and "lmms-lab/VQAv2 has no 'train' split" in message and "validation" in message
    assert "v2_OpenEnded_mscoco_train2014_questions.json" in message and "coco/train2014/" in message


def rewrite(hub, tmp_path, change):
    """A copy of the hub's VQAv2 (one shard) whose rows change(rows) alters; returns (root, the shard's path)."""
    rows = [r for k in range(2) for r in
            pq.read_table(os.path.join(hub, "vqav2", "data", f"validation-{k:05d}-of-00002.parquet")).to_pylist()]
    change(rows)
    hub_layouts.write_shards(str(tmp_path / "vqav2"), "validation", rows, hub_layouts.VQAV2, n_shards=1)
    return str(tmp_path), str(tmp_path / "vqav2" / "data" / "validation-00000-of-00001.parquet")


@pytest.mark.parametrize("change, says", [
    (lambda rows: rows[9].update(question_id=rows[3]["question_id"]), "duplicate id"),
    (lambda rows: rows[9].update(answers=[]), "its answers are []"),
    (lambda rows: rows[9].update(multiple_choice_answer=" "), "its multiple_choice_answer is ' '"),
    (lambda rows: rows[9]["image"].update(bytes=b"\xff\xd8 not a jpeg"), "image bytes are not a readable image"),
    (lambda rows: rows[9].update(question=None), "its question is None"),
    (lambda rows: rows[9].update(question="Is <image> red?"), "its question holds '<image>', an image placeholder"),
])
def test_bad_rows_are_refused_naming_the_shard_and_the_row(roots, tmp_path, change, says):
    root, shard = rewrite(roots[1], tmp_path, change)
    with pytest.raises(ValueError) as e:
        tasks.load_task("vqav2", "val", root)
    assert f"{shard} row 9" in str(e.value) and says in str(e.value) and "\n" not in str(e.value)


def test_a_missing_shard_is_named(roots, tmp_path):
    shutil.copytree(os.path.join(roots[1], "mme"), tmp_path / "mme")
    (second,) = (tmp_path / "mme" / "data").glob("test-00001-of-00003-*.parquet")  # the hub's names: a hash suffix
    os.remove(second)
    with pytest.raises(FileNotFoundError, match="test-00001-of-00003.parquet is missing"):
        tasks.load_task("mme", "val", str(tmp_path))


def test_parquet_files_not_named_as_shards_are_named_not_skipped(roots, tmp_path):
    """Issue 52, item 6: lmms-lab/MME's shards carry a hash (read: the roots fixture writes them so); parquet files
    named otherwise were skipped without a word, and the error asked for the original layout."""
    shutil.copytree(os.path.join(roots[1], "mme"), tmp_path / "mme")
    for k, shard in enumerate(sorted((tmp_path / "mme" / "data").iterdir())):
        shard.rename(shard.with_name(f"part{k}.parquet"))
    with pytest.raises(FileNotFoundError, match=r"part0.parquet \(and 2 more parquet files\) is not named as a shard"):
        tasks.load_task("mme", "val", str(tmp_path))


def test_the_plan_counts_the_hub_layouts_tokens(roots, tmp_path, capsys):
    twin = write_twin("idefics2", tmp_path / "twin")
    planned = lab(["plan", "evaluate", "--model", "idefics2", "--processor", twin, "--task", "mme", "--data-root",
                   roots[1], "--n-eval", "4"])
    assert "parquet shard(s) of lmms-lab/MME" in capsys.readouterr().out
    assert planned["queries"] == 4 and min(planned["rows"]["teacher"].values()) > min(
        planned["rows"]["student"].values())


def test_a_shard_that_is_not_parquet_or_lacks_a_column_is_named(roots, tmp_path):
    root, shard = rewrite(roots[1], tmp_path, lambda rows: None)
    pq.write_table(pq.read_table(shard).drop_columns(["multiple_choice_answer"]), shard)
    with pytest.raises(ValueError, match=f"{shard} has no column multiple_choice_answer"):
        tasks.load_task("vqav2", "val", root)
    with open(shard, "wb") as f:
        f.write(b"PAR1 not a parquet file")
    with pytest.raises(ValueError, match=f"{shard} is not a readable parquet file"):
        tasks.load_task("vqav2", "val", root)


@pytest.mark.parametrize("task", ["mme", "seed"])
def test_n_eval_draws_the_same_questions_from_both_layouts(roots, task):
    """Issue 52, item 13: --n-eval's stratified subset draws images by their order, not their paths (the hub's are
    cache hashes): before, 32 of 56 MME question keys differed at --n-eval 28."""
    original, hub, _ = roots
    drawn = [tasks.eval_items(lab_evaluate_args(["--model", "tiny-idefics2", "--task", task, "--data-root", root,
                                                 "--n-eval", "28", "--shots", "0"])) for root in (original, hub)]
    assert len(drawn[0]) >= 20 and by_content(drawn[1]) == by_content(drawn[0])


def test_a_cached_hub_image_of_the_right_size_but_damaged_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setattr(parquet, "CACHE", str(tmp_path / "cache"))
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8), "blue").save(buffer, "PNG")
    raw = buffer.getvalue()
    path = parquet.cached_image({"bytes": raw, "path": "x.png"})
    with open(path, "wb") as f:
        f.write(b"\0" * len(raw))  # a crash of the machine left zeros of the right length (durable=False)
    assert parquet.cached_image({"bytes": raw, "path": "x.png"}) == path
    with open(path, "rb") as f:
        assert f.read() == raw  # before: kept, and the image failed to open at evaluation


def test_a_fifo_named_as_a_shard_is_refused_without_waiting(tmp_path):
    import threading
    shard = tmp_path / "vqav2" / "data" / "validation-00000-of-00001.parquet"
    shard.parent.mkdir(parents=True)
    os.mkfifo(shard)
    said = []

    def read():
        try:
            tasks.load_task("vqav2", "val", str(tmp_path))
        except ValueError as e:
            said.append(str(e))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(20)
    if reader.is_alive():  # before: pyarrow opened the FIFO and waited for a writer forever; let it go
        os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))
    assert said and f"{shard} is not a regular file (a FIFO" in said[0]


def test_an_ok_vqa_rows_target_that_is_no_plain_text_is_refused():
    """Issue 63, item 14: the hub's OK-VQA target (its most frequent answer) reached a row unchecked, as the original
    layout's did (tests/lab/datasets/test_readers.py)."""
    row = {"question_id": "7", "question": "What?", "answers": ["<image> <|image_pad|>"] * 3 + ["a cat"]}
    with pytest.raises(ValueError, match=r"its most frequent answer \(its target\) holds '<image>'"):
        parquet.okvqa_row(row, None)
    assert parquet.okvqa_row(dict(row, answers=["a cat"] * 3 + ["<image>"]), None)[3] == "a cat"
