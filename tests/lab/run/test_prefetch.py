"""Batches from DataLoader workers (lab/run/prefetch.py): the same batches and adapter for 0, 1 and 2 workers, the
default number of workers, a worker's error raised as it was raised there, dead and stopped workers named."""
import os
import signal

import pytest
import torch

import evaluate
import train
from helpers import EVAL, kill_workers_once, lab_evaluate, lab_train, SMALL, TRAIN_NO_CACHE
from lab.run import prefetch, training_batches


def test_zero_one_and_two_workers_prepare_the_same_batches_and_train_the_same_adapter(tmp_path, monkeypatch):
    """--workers N: the micro-batches (their order, every tensor of the student batch, the teacher's states, computed
    in epoch 1 and read from the cache by the workers in epoch 2) and the trained adapter are those of --workers 0."""
    pair, seen = training_batches.pair, {}

    def spy(run, prepared, computed):
        student, teacher = pair(run, prepared, computed)
        seen[run.cfg.workers].append(([q.id for q in prepared["queries"]], student, teacher,
                                      [s is None for s in prepared["found"]["states"]]))
        return student, teacher
    monkeypatch.setattr(training_batches, "pair", spy)
    adapters = {}
    for workers in (0, 1, 2):
        seen[workers] = []
        adapters[workers] = lab_train(["--out", str(tmp_path / str(workers)), "--teacher-cache",
                                       str(tmp_path / str(workers) / "teacher"), *SMALL, "--workers", str(workers)])
    computed, read = [True] * 4, [False] * 4  # the teacher runs in the loop, in the first epoch only
    assert [missing for *_, missing in seen[0]] == [computed, computed, computed, read, read, read]
    for workers in (1, 2):
        assert len(seen[workers]) == len(seen[0])
        for (ids, student, teacher, missing), (ids0, student0, teacher0, missing0) in zip(seen[workers], seen[0]):
            assert ids == ids0 and missing == missing0 and torch.equal(teacher, teacher0)
            assert student.keys() == student0.keys() and student["window"] == student0["window"]
            assert all(torch.equal(student[k], student0[k]) for k in student if k != "window")
        assert all(torch.equal(adapters[workers][k], adapters[0][k]) for k in adapters[0])
        assert (tmp_path / str(workers) / "history.json").read_text() == (tmp_path / "0" / "history.json").read_text()


def test_the_default_workers_are_the_cores_less_one_with_a_gpu_and_none_without(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert prefetch.default_workers() == 0                                   # the model's threads use the cores
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert prefetch.default_workers() == 8                                   # 15, at most 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert prefetch.default_workers() == 3                                   # 16 cores shared by 4 processes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    assert prefetch.default_workers() == 0


def unreadable(spec):
    """A build whose every item fails as an unreadable image does (data.load_image's error)."""
    raise OSError(f"item {spec}: cannot read its image /data/{spec}.jpg (cannot identify image file)")


@pytest.mark.parametrize("workers", [0, 1])
def test_an_error_in_a_dataloader_worker_is_raised_as_it_was_raised_there(workers):
    """torch re-raises a worker's error with the worker's traceback in its message; the CLI prints the message, so
    a user saw 30 lines of traceback for one unreadable image (the hostile run, evaluate.py --workers 2)."""
    with pytest.raises(OSError) as e:
        list(prefetch.prepared(unreadable, [7, 8], workers))
    assert str(e.value) == "item 7: cannot read its image /data/7.jpg (cannot identify image file)"


def test_a_killed_worker_in_evaluate_is_one_named_error(tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "generate", kill_workers_once(evaluate.generate))
    with pytest.raises(prefetch.WorkerFailed, match=r"a DataLoader worker failed \(DataLoader worker \(pid.*\) "
                                                    r"(is killed by signal: Killed|exited unexpectedly).*"
                                                    r"--workers 0") as e:
        lab_evaluate([*EVAL, "--n-eval", "6", "--batch-size", "1", "--workers", "1", "--out", str(tmp_path)])
    assert isinstance(e.value, OSError) and "\n" not in str(e.value)  # what evaluate.py and train.py print in a line


def test_a_killed_worker_in_train_is_one_named_error(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "losses", kill_workers_once(train.losses))
    with pytest.raises(prefetch.WorkerFailed, match=r"a DataLoader worker failed \(DataLoader worker"):
        lab_train([*TRAIN_NO_CACHE, "--workers", "1", "--out", str(tmp_path)])


def test_a_worker_that_dies_while_a_batch_is_awaited_is_named_with_the_batch():
    def build(spec):
        if spec == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"x": spec}
    with pytest.raises(prefetch.WorkerFailed, match=r"batch [12] of 3: a DataLoader worker failed"):
        list(prefetch.prepared(build, [0, 1, 2], 1))


def stop_self(spec):
    """A build whose worker stops itself (SIGSTOP) at its second batch, leaving its pid in the spec's file."""
    if spec[0] == 1:
        with open(spec[1], "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    return {"x": spec[0]}


def test_a_stopped_worker_times_out_with_a_message(tmp_path, monkeypatch):
    monkeypatch.setattr(prefetch, "WORKER_TIMEOUT", 2)
    pid_file = tmp_path / "pid"
    try:
        with pytest.raises(prefetch.WorkerFailed, match=r"batch [12] of 3: a DataLoader worker failed \(DataLoader "
                                                    r"timed out after 2 seconds\)"):
            list(prefetch.prepared(stop_self, [(k, str(pid_file)) for k in range(3)], 1))
        with pytest.raises(ProcessLookupError):  # the stopped worker is not left behind
            os.kill(int(pid_file.read_text()), 0)
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
