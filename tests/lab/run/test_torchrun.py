"""train.py under torchrun (lab/run/torchrun.py): 2 CPU processes (gloo) against 1, a rank killed mid-run, resume with
another world size.

Every run names --model and --task and is tiny: 8 training queries, micro-batches of 4 (2 per process)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import benchmarks
import evaluate
import train
from helpers import lab_evaluate, lab_train, lab_train_args, ROOT, RUN


# rank 1 dies (kill -9) in its third micro-batch; the others are stopped by torchrun
KILL_RANK_1 = ("import os, signal, sys; sys.path.insert(0, {root!r}); import train; calls = []; step = train.losses\n"
               "def losses(*a):\n"
               "    calls.append(1)\n"
               "    if os.environ['RANK'] == '1' and len(calls) == 3: os.kill(os.getpid(), signal.SIGKILL)\n"
               "    return step(*a)\n"
               "train.losses = losses; from lab.cli import modes; modes.train_main(sys.argv[1:])\n")


def flags(tmp, *extra):
    return [*RUN, "--out", str(tmp / "run"), "--teacher-cache", str(tmp / "teacher"), *extra]


def torchrun(script, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           script, *args], cwd=ROOT, capture_output=True, text=True, env=env)


def test_torchrun_with_too_small_a_batch_is_refused_before_anything_loads(monkeypatch, capsys):
    """The README's eight processes at train.py's default --batch-size 4: refused by the parser, naming the flag."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(SystemExit):
        lab_train_args(["--model", "idefics2", "--task", "vqav2"])
    assert "--batch-size 4 with --n-train 1000 gives 4: give --batch-size 8" in capsys.readouterr().err
    assert lab_train_args(["--model", "idefics2", "--task", "vqav2", "--batch-size", "8"]).batch_size == 8


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    """An uninterrupted 2-process run."""
    tmp = tmp_path_factory.mktemp("two")
    done = torchrun("-m", "lab", "train", *flags(tmp))
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp


def test_two_processes_train_the_adapter_one_process_trains(two, tmp_path):
    one = lab_train(flags(tmp_path))
    adapter = load_file(two / "run" / "adapter.safetensors")
    best = load_file(tmp_path / "run" / "adapter.safetensors")
    last = torch.load(two / "run" / "last.pt", weights_only=False)["adapter"]
    for k in one:                        # float32; the gradients are summed in another order, nothing else differs
        torch.testing.assert_close(last[k], one[k], rtol=0, atol=1e-6)
        torch.testing.assert_close(adapter[k], best[k], rtol=0, atol=1e-6)
    history_two, history_one = (json.loads((d / "run" / "history.json").read_text()) for d in (two, tmp_path))
    assert [h["step"] for h in history_two] == [h["step"] for h in history_one] == [2, 4]
    for a, b in zip(history_two, history_one):
        assert a["heldout_loss"] == pytest.approx(b["heldout_loss"], rel=1e-6)
    files = sorted(os.listdir(two / "run"))
    assert files == [".lock", "adapter.safetensors", "history.json", "last.pt"]   # rank 0 alone wrote, atomically


def test_a_resume_with_another_number_of_processes_is_refused(two, tmp_path):
    shutil.copytree(two / "run", tmp_path / "run")
    with pytest.raises(SystemExit, match="2 processes .now 1; a resume is exact only with as many as before."):
        lab_train(flags(tmp_path, "--resume"))


def test_a_killed_rank_stops_the_job_and_resume_finishes_the_same_adapter(two, tmp_path):
    script = tmp_path / "kill_rank_1.py"
    script.write_text(KILL_RANK_1.format(root=ROOT))
    killed = torchrun(str(script), *flags(tmp_path))
    assert killed.returncode != 0
    step = torch.load(tmp_path / "run" / "last.pt", weights_only=False)["progress"]["step"]
    assert 1 <= step < 4                                                    # intact, from before the kill
    resumed = torchrun("-m", "lab", "train", *flags(tmp_path, "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name in ("adapter.safetensors", "history.json"):
        assert (tmp_path / "run" / name).read_bytes() == (two / "run" / name).read_bytes(), name


# the "generated" answer echoes a piece of each item's question, so answers differ and their order shows
ECHO = "lambda backbone, inputs, *a: inputs['input_ids'][:, -12:-4]"


ECHO_SCRIPT = "import sys; sys.path.insert(0, {root!r}); import evaluate; evaluate.generate = " + ECHO + \
              "; evaluate.main(sys.argv[1:])\n"


def test_two_processes_write_the_predictions_and_metrics_of_one(tmp_path, monkeypatch):
    flags = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-eval", "7",
             "--batch-size", "2", "--shots", "1"]
    monkeypatch.setattr(evaluate, "generate", eval(ECHO))
    one = lab_evaluate([*flags, "--out", str(tmp_path / "one")])
    script = tmp_path / "echo.py"
    script.write_text(ECHO_SCRIPT.format(root=ROOT))
    two = torchrun(str(script), *flags, "--out", str(tmp_path / "two"))
    assert two.returncode == 0, two.stderr[-3000:]
    stem = "vqav2-val-1-shot-seed0-n7"
    for name in (stem + ".predictions.jsonl", stem + ".metrics.json"):
        assert (tmp_path / "one" / name).read_text() == (tmp_path / "two" / name).read_text(), name
    answers = [json.loads(line)["prediction"] for line in (tmp_path / "one" / (stem + ".predictions.jsonl")).open()]
    assert len(answers) == one["n"] == 7 and len(set(answers)) > 2
