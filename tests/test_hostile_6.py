"""Hostile cases, round 6 (issue 45): what the 30 cases of docs/hostile-round-6.md found on this round's surface
(tasks of one's own, the parquet readers' image cache, evaluate.predict's argument checks, a dying DataLoader worker
in train.py). Each test failed before its fix, but the last, which checks what held (a killed worker's run keeps its
last completed step). Small: toy images, direct calls, the tiny twin for the one run."""
import io
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image

import data as D
import train
from lab.datasets import api_checks, own_task, parquet
from test_nothing_lost_5b import TRAIN, kill_workers_once


def write(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("own6")
    Image.new("RGB", (8, 8), "red").save(root / "a.png")
    return root


def record(**fields):
    return json.dumps({"id": 1, "image": "a.png", "question": "what?", "answer": "x"} | fields)


@pytest.mark.parametrize("name", ["deep.jsonl", "deep.json"])
def test_a_deeply_nested_task_file_is_one_error_naming_it(folder, name):
    path = folder / name
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=rf"{path}.*nested too deep"):  # before: a RecursionError's traceback
        own_task.read(str(path))


def test_an_id_in_two_files_of_a_folder_task_is_refused_naming_both(folder):
    task = folder / "split"
    task.mkdir()
    Image.new("RGB", (8, 8)).save(task / "a.png")
    write(task / "train.jsonl", [record(id=7), record(id=8)])
    write(task / "val.jsonl", [record(id=7)])  # before: read, a query scored on what it trained on
    with pytest.raises(ValueError, match=rf"val.jsonl, field `id`: duplicate id 7 \(also at .*train.jsonl\)"):
        own_task.read(str(task))
    write(task / "val.jsonl", [record(id="7")])  # the text "7" is another id (kept apart everywhere)
    assert [it.id for it in own_task.read(str(task))[1]["val"]] == ["7"]


@pytest.mark.parametrize("options, answer, message", [
    (["cat", "cat"], "cat", r"field `options`: \['cat', 'cat'\] repeats an option"),
    (["B", "A"], "A", r"field `answer`: 'A' is both a letter and the text of option B"),
])
def test_a_choice_record_that_names_no_one_option_is_refused(folder, options, answer, message):
    path = write(folder / f"choice{len(options)}{answer}.jsonl", [record(options=options, answer=answer)])
    with pytest.raises(ValueError, match=rf"line 1, {message}"):  # before: read as option A, silently
        own_task.read(path)


def test_a_choice_record_whose_letters_are_its_options_in_order_still_reads(folder):
    path = write(folder / "letters.jsonl", [record(options=["A", "B"], answer="B")])
    assert own_task.read(path)[1][None][0].target == "B"


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


ITEMS = [D.Item(1, "a.png", "what?", ("x",), "x"), D.Item(2, "a.png", "what?", ("y",), "y")]


@pytest.mark.parametrize("items, icds, message", [
    ((it for it in ITEMS), None, r"items and icds must be lists \(got generator"),
    (ITEMS, [[], None], r"icds\[1\] is NoneType; each item's demonstrations are a list"),
])
def test_predict_refuses_a_generator_or_an_icd_entry_that_is_no_list(items, icds, message):
    with pytest.raises(ValueError, match=message):  # before: a TypeError inside predict
        api_checks.check_predict("vqav2", items, icds, 1, False)


def test_predict_takes_a_numpy_integer_batch_size():
    api_checks.check_predict("vqav2", ITEMS, None, np.int64(2), False)  # before: refused as "not an integer"
    with pytest.raises(ValueError, match=r"batch_size must be an integer of at least 1"):
        api_checks.check_predict("vqav2", ITEMS, None, np.float64(2), False)


def test_a_worker_killed_in_step_2_leaves_last_pt_of_step_1(tmp_path, monkeypatch):
    real, calls = train.losses, {"n": 0}
    killer = kill_workers_once(real)

    def losses(*args, **kwargs):  # step 1 completes; step 2's loss finds its worker killed
        calls["n"] += 1
        return (killer if calls["n"] == 2 else real)(*args, **kwargs)
    monkeypatch.setattr(train, "losses", losses)
    with pytest.raises(OSError, match=r"a DataLoader worker failed"):
        train.main([*TRAIN, "--n-train", "6", "--workers", "1", "--out", str(tmp_path)])
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    assert state["progress"]["step"] == 1
