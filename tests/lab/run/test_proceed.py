"""--proceed (lab/run/proceed.py): a run's folder started, continued or, finished, skipped; a finished run of other
data, or one missing its best adapter, refused; one whose last.pt was removed read from its adapter and history."""
import json
import os

import pytest
from PIL import Image

from helpers import lab_train, vqa_task


def test_proceed_refuses_a_finished_run_of_other_data_or_without_its_best_adapter(tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    lines = []
    for i in range(8):
        Image.new("RGB", (16, 16), (30 * i, 0, 0)).save(images / f"{i}.png")
        lines.append(json.dumps({"id": i, "image": f"images/{i}.png", "question": "what colour?", "answer": "red"}))
    task = tmp_path / "colours.jsonl"
    task.write_text("\n".join(lines) + "\n")
    flags = ["--model", "tiny-idefics2", "--task", str(task), "--n-train", "2", "--n-heldout", "1", "--epochs", "1",
             "--batch-size", "2", "--shots", "1", "--workers", "0", "--threads", "1", "--out", str(tmp_path / "run")]
    lab_train([*flags, "--proceed"])
    lab_train([*flags, "--proceed"])
    assert "a finished run of these settings" in capsys.readouterr().out
    task.write_text("\n".join(line.replace("red", "blue") for line in lines) + "\n")  # the answers changed since
    with pytest.raises(ValueError, match=r"--proceed: .*last.pt was made with other training data"):
        lab_train([*flags, "--proceed"])  # before: skipped as finished, its adapter scored for this data
    task.write_text("\n".join(lines) + "\n")
    os.remove(tmp_path / "run" / "adapter.safetensors")
    with pytest.raises(ValueError, match=r"holds a finished run \(1 epoch\(s\) scored\) without its best adapter"):
        lab_train([*flags, "--proceed"])  # before: resumed, "no epoch scored yet ... continue with --resume"
    lab_train([*flags, "--resume"])
    assert "its best adapter" in capsys.readouterr().out.splitlines()[-1]


def test_proceed_takes_a_finished_run_whose_last_pt_is_gone_by_its_adapter_and_history(tmp_path, capsys):
    """last.pt removed to save disk: --proceed reads the adapter's run record and history.json as the finished run
    (before: trained again from scratch, the adapter and history deleted without a word); of other data, or the
    adapter gone too, refused naming the file, which is kept; the adapter alone (a run killed before its first
    checkpoint) trained again, saying so."""
    task = vqa_task(tmp_path, n=8)
    flags = ["--model", "tiny-idefics2", "--task", str(task), "--n-train", "2", "--n-heldout", "1", "--epochs", "1",
             "--batch-size", "2", "--shots", "1", "--workers", "0", "--threads", "1", "--out", str(tmp_path / "run"),
             "--proceed"]
    lab_train(flags)
    run = tmp_path / "run"
    kept = {f: (run / f).read_bytes() for f in ("adapter.safetensors", "history.json")}
    os.remove(run / "last.pt")
    lab_train(flags)
    assert "a finished run of these settings" in capsys.readouterr().out
    assert {f: (run / f).read_bytes() for f in kept} == kept and not (run / "last.pt").exists()
    with pytest.raises(ValueError, match=r"adapter.safetensors was made with --lr 0.005 \(now 0.001\)"):
        lab_train([*flags, "--lr", "1e-3"])
    os.remove(run / "history.json")  # the adapter alone: a run killed before its first checkpoint, said and run
    lab_train(flags)
    assert "holds the adapter of this run but no last.pt nor history.json" in capsys.readouterr().out
    assert {f: (run / f).read_bytes() for f in kept} == kept  # the same run again, bit for bit
    os.remove(run / "adapter.safetensors")
    os.remove(run / "last.pt")
    with pytest.raises(ValueError, match=r"holds a finished run \(history.json\) without its best adapter"):
        lab_train(flags)
