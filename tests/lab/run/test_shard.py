"""--shard under torchrun (lab/run/shard.py): 2 CPU processes (gloo), the tiny twin's backbone sharded with FSDP2,
against one unsharded process with the same global batch: the same adapter, teacher cache and predictions, and each
process holding half of the backbone's parameters. Every run is tiny (helpers.RUN: 8 training queries, micro-batches
of 4, 2 per process)."""
import json
import os
import shutil
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

import benchmarks
from helpers import lab_evaluate, lab_train, run_flags, ROOT
from lab.run import shard

# each process reports the backbone's parameter bytes it holds before and after sharding, and its stand-in teacher
# passes, a line each in tmp/stand-ins (the runner swaps the data module that shard.py reads, where teacher_in_step
# alone builds teacher batches); with KILL set, rank 1 dies (kill -9) in its third micro-batch and torchrun stops the
# other
RUNNER = """import json, os, signal, sys; sys.path.insert(0, {root!r})
from types import SimpleNamespace
import train
from lab.run import shard
from lab.cli import modes
report, sharding, losses, calls = {{}}, shard.sharded, train.losses, []
def killing(*a):
    calls.append(1)
    if os.environ.get("KILL") and os.environ["RANK"] == "1" and len(calls) == 3: os.kill(os.getpid(), signal.SIGKILL)
    return losses(*a)
train.losses = killing
def measured(backbone):
    report["whole"] = shard.local_bytes(backbone.model)
    sharding(backbone)
    report["local"] = shard.local_bytes(backbone.model)
    return backbone
shard.sharded = measured
data = shard.data
shard.data = SimpleNamespace(query_pieces=data.query_pieces,
                             teacher_batch=lambda *a: stand_in.write("x\\n") and data.teacher_batch(*a))
stand_in = open(os.path.join({out!r}, "stand-ins"), "a", buffering=1)
(modes.train_main if sys.argv[1] == "train" else modes.evaluate_main)(sys.argv[2:])
open(os.path.join({out!r}, "rank" + os.environ["RANK"] + ".json"), "w").write(json.dumps(report))
"""


def torchrun(tmp, mode, *flags, kill=False):
    """`python -m lab <mode> <flags> --shard` on 2 processes (RUNNER): (return code, stderr). A run that outlives
    240 s (processes out of step wait for each other) is killed with all its processes, and fails the test."""
    script = tmp / "runner.py"
    script.write_text(RUNNER.format(root=ROOT, out=str(tmp)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL": "1" if kill else ""}
    with subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script), mode, *flags, "--shard"], cwd=ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, env=env, start_new_session=True) as job:
        try:
            return job.wait(timeout=240), job.stderr.read()
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGKILL)
            raise


def sharded(tmp, mode, *flags):
    """torchrun's run, which must succeed; each process's report."""
    code, err = torchrun(tmp, mode, *flags)
    assert code == 0, err[-3000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in (0, 1)]


def same_adapter(a, b):
    """Within 1e-5 (float32; the gradients are summed in another order, nothing else differs)."""
    a, b = load_file(a), load_file(b)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5)


def test_two_sharded_processes_train_the_adapter_and_cache_of_one(twin_folder, tmp_path):
    """The tiny twin's checkpoint folder, each process reading only its shard of it (transformers shards it as it
    loads), against one process. Killed (rank 1, kill -9) in the third step, then resumed: the adapter of one process.
    All of the one process's teacher cache but one query's is there before: in the micro-batch of that query, the
    process whose queries the cache holds runs a stand-in teacher pass while the other computes its own (else they
    would wait for each other for ever), whichever run (killed or resumed) reaches it."""
    flags = lambda tmp, *extra: [str(twin_folder) if f == "tiny-idefics2" else f for f in run_flags(tmp, "run", *extra)]
    one, two = tmp_path / "one", tmp_path / "two"
    lab_train(flags(one))
    files = sorted(os.listdir(one / "teacher"))
    os.makedirs(two / "teacher")
    for name in files[:-1]:  # one query's states missing: a stand-in is certain, whatever order the names sort in
        shutil.copy(one / "teacher" / name, two / "teacher" / name)
    assert torchrun(two, "train", *flags(two), kill=True)[0] != 0
    assert torch.load(two / "run" / "last.pt", weights_only=False)["progress"]["step"] == 2
    reports = sharded(two, "train", *flags(two, "--resume"))
    same_adapter(two / "run" / "adapter.safetensors", one / "run" / "adapter.safetensors")
    for a, b in zip(*(json.loads((d / "run" / "history.json").read_text()) for d in (two, one))):
        assert a["step"] == b["step"] and a["heldout_loss"] == pytest.approx(b["heldout_loss"], rel=1e-6)
    assert sorted(os.listdir(two / "teacher")) == files
    for name in files:
        for k, v in load_file(one / "teacher" / name).items():
            torch.testing.assert_close(load_file(two / "teacher" / name)[k], v, rtol=0, atol=1e-5)
    whole_bytes = sum(t.nbytes for t in load_file(twin_folder / "model.safetensors").values())
    for r in reports:  # half of the backbone a process from loading on (the adapter, attached after sharding, apart)
        assert r["whole"] == r["local"] == pytest.approx(whole_bytes / 2, rel=0.1)
    assert (two / "stand-ins").read_text()  # the stand-in ran (in the killed or the resumed run's first epoch)


def test_two_sharded_processes_write_the_predictions_of_one(whole, tmp_path):
    """5 items in batches of 2: one process has 2 batches, the other 1, which it repeats to keep in step. Each image
    its own call of the vision tower (--image-memory of a byte): in the last step one process has 1 image, the other
    2, and the first repeats its call (chunks.in_step)."""
    flags = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-eval", "5",
             "--batch-size", "2", "--checkpoint", str(whole / "run" / "adapter.safetensors"), "--image-memory", "1e-9"]
    lab_evaluate([*flags, "--out", str(tmp_path / "one")])
    sharded(tmp_path, "evaluate", *flags, "--out", str(tmp_path / "two"))
    names = sorted(os.listdir(tmp_path / "one"))  # the lock, the metrics and the predictions
    assert sorted(os.listdir(tmp_path / "two")) == names and len(names) == 3
    for name in names[1:]:
        assert (tmp_path / "one" / name).read_text() == (tmp_path / "two" / name).read_text(), name
    answers = [json.loads(line)["prediction"] for line in open(tmp_path / "one" / names[-1])]
    assert len(answers) == 5 and len(set(answers)) > 1   # answers differ: their order shows


def test_qwen2_5_vl_sharded_trains_the_adapter_of_one(tmp_path):
    """Another family: its vision tower, merger and decoder sharded the same way."""
    flags = lambda name: ["tiny-qwen2.5-vl" if f == "tiny-idefics2" else f for f in run_flags(tmp_path, name)]
    lab_train(flags("one"))
    shutil.rmtree(tmp_path / "teacher")
    reports = sharded(tmp_path, "train", *flags("two"))
    same_adapter(tmp_path / "two" / "adapter.safetensors", tmp_path / "one" / "adapter.safetensors")
    assert all(r["local"] == pytest.approx(r["whole"] / 2, rel=0.1) for r in reports)


def test_shard_without_torchrun_names_the_launch_line():
    """Refused before anything loads (shard.loading), and by shard.sharded; without --shard, the loader as it is."""
    backbone = type("B", (), {"model": torch.nn.Linear(2, 2)})()
    with pytest.raises(ValueError, match=r"torchrun --nproc_per_node=N train.py .* --shard"):
        shard.loading(None, "tiny-idefics2", True)
    with pytest.raises(ValueError, match=r"torchrun --nproc_per_node=N train.py .* --shard"):
        shard.sharded(backbone)
    assert shard.loading(None, "tiny-idefics2", False) is shard.backbones.load_backbone
    assert not shard.is_sharded(backbone.model)


def test_a_backbone_one_gpu_cannot_hold_is_refused_unsharded_before_loading(monkeypatch):
    """On CUDA (faked: an H200's memory): qwen2.5-vl-72b's weights alone (147 GB) are refused, naming the launch on
    2; the 7B loads; with --shard each process is to read its shard."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=141e9))
    monkeypatch.setattr(shard.torchrun, "rank_and_world", lambda: (0, 2))
    calls = []
    monkeypatch.setattr(shard.backbones, "load_backbone", lambda *a, **options: calls.append(options) or "loaded")
    monkeypatch.setattr(shard, "sharded", lambda backbone: f"{backbone}, sharded")
    with pytest.raises(ValueError, match=r"qwen2.5-vl-72b: its weights \(147 GB in bf16\) do not fit this GPU "
                                         r"\(141 GB\): shard them over 2 or more, `torchrun --nproc_per_node=2"):
        shard.loading(None, "qwen2.5-vl-72b", False)
    assert shard.loading(None, "qwen2.5-vl", False) is shard.backbones.load_backbone
    assert shard.loading(None, "qwen2.5-vl-72b", True)("qwen2.5-vl-72b", device="cuda") == "loaded, sharded"
    assert calls == [{"device": "cuda", "shards": 2}]  # each process reads its shard of the 2


def test_share_keeps_a_sharded_run_in_step(monkeypatch):
    """Without sharding each N-th batch; sharded, as many for every process, the last repeated."""
    monkeypatch.setattr(shard.torchrun, "rank_and_world", lambda: (1, 2))
    assert shard.share(range(0, 10, 2), torch.nn.Linear(1, 1)) == [2, 6]
    monkeypatch.setattr(shard, "is_sharded", lambda model: True)
    assert shard.share(range(0, 10, 2), None) == [2, 6, 6]
    monkeypatch.setattr(shard.torchrun, "rank_and_world", lambda: (3, 4))
    assert shard.share(range(0, 4, 2), None) == [2]  # no batch of its own: the last of all


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_sharded_gpus_train_and_answer_as_one(twin_folder, tmp_path):
    """The sharded path on CUDA with NCCL (`python -m pytest -m gpu`): 2 GPUs against 1, the tiny twin's checkpoint
    folder (each process loading its shard) in bf16; the adapter within 1e-2 (bf16 GPU kernels sum in their own
    order), the predictions of the built twin the same."""
    flags = lambda name: [str(twin_folder) if f == "tiny-idefics2" else f for f in run_flags(tmp_path, name)]
    lab_train(flags("one"))
    shutil.rmtree(tmp_path / "teacher")
    sharded(tmp_path, "train", *flags("two"))
    a, b = (load_file(tmp_path / name / "adapter.safetensors") for name in ("one", "two"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-2)
    flags = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-eval", "5",
             "--batch-size", "2"]
    lab_evaluate([*flags, "--out", str(tmp_path / "e1")])
    sharded(tmp_path, "evaluate", *flags, "--out", str(tmp_path / "e2"))
    for name in os.listdir(tmp_path / "e1"):
        if name.endswith(".predictions.jsonl"):
            assert (tmp_path / "e1" / name).read_text() == (tmp_path / "e2" / name).read_text()
