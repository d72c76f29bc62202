"""Nothing lost, part 6 (issue 52): the cases that cross the readers, the loops and the command lines. Each test failed
before its fix. Small: the tiny twin, a few items, one-row shards."""
import dataclasses
import io
import json
import os

import pytest
from PIL import EpsImagePlugin, Image

import data as D
import hub_layouts
from lab.datasets import parquet, tasks

TINY = ["--model", "tiny-idefics2"]


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def vqav2_shard(root, image_bytes, n=1):
    """root/vqav2/data/validation-00000-of-00001.parquet: n rows of lmms-lab/VQAv2's columns, each image these bytes."""
    answers = [{"answer": "yes", "answer_confidence": "yes", "answer_id": 1}]
    rows = [{"question_type": "is", "multiple_choice_answer": "yes", "answers": answers, "image_id": k,
             "answer_type": "yes/no", "question_id": k, "question": "Is it red?",
             "image": {"bytes": image_bytes, "path": f"{k}.jpg"}} for k in range(n)]
    hub_layouts.write_shards(str(root / "vqav2"), "validation", rows, hub_layouts.VQAV2, n_shards=1)
    return str(root / "vqav2" / "data" / "validation-00000-of-00001.parquet")


# ------------------------------------------------------------------------ item 2: no image format that runs a program

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
    item = D.Item(7, str(tmp_path / "red.eps"), "Is it red?", ("yes",), "yes")
    with pytest.raises(ValueError, match=r"item 7: its image .*red.eps: not an image of the formats read"):
        D.load_image(item)
    monkeypatch.setattr(parquet, "CACHE", str(tmp_path / "cache"))
    shard = vqav2_shard(tmp_path / "hub", eps_bytes())
    with pytest.raises(ValueError, match=rf"{shard} row 0 \(question_id 0\) is malformed: its image bytes are not a "
                                         r"readable image \(not an image of the formats read"):
        tasks.load_task("vqav2", "val", str(tmp_path / "hub"))
    assert not ghostscript.exists()  # before: the own task read, and load_image ran gs (a CalledProcessError)
