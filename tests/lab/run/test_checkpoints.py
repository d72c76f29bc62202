"""Checkpoints and run folders (lab/run/adapter_files.py): adapter files saved and loaded, refused when damaged, foreign
or of another task, last.pt resumed exactly wherever a kill or a signal lands, a crafted last.pt refused, folders
claimed by one process at a time.

The runs are tiny: the tiny twin, 4 to 8 training queries, 1 or 2 epochs (helpers.RUN, helpers.TRAIN)."""
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import benchmarks
import evaluate
import model as M
import train
from helpers import (kill_workers_once, lab_evaluate, lab_evaluate_args, lab_train, lab_train_args, QUIET, ROOT, RUN,
                     run_flags, small_run, TINY, TRAIN, TRAIN_NO_CACHE, vqa_task, with_flag)
from lab.disk import files
from lab.methods import registry
from lab.models import backbones
from lab.run import adapter_files, locks, runs


def test_resume_reproduces_the_uninterrupted_run(tmp_path):
    whole = lab_train(small_run(tmp_path, name="whole"))
    lab_train(small_run(tmp_path, "--max-steps", "4", name="split"))
    assert torch.load(tmp_path / "split" / "last.pt", weights_only=False)["progress"]["step"] == 4
    resumed = lab_train(small_run(tmp_path, "--resume", name="split"))
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert os.path.exists(tmp_path / "whole" / "adapter.safetensors")
    with pytest.raises(SystemExit, match="--lr 0.005 .now 0.1."):
        lab_train(small_run(tmp_path, "--resume", "--lr", "0.1", name="split"))


def test_ctrl_c_saves_and_resume_continues(tmp_path, monkeypatch):
    whole = lab_train(small_run(tmp_path, name="whole"))
    step = train.losses
    calls = []

    def interrupt(*a):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return step(*a)
    monkeypatch.setattr(train, "losses", interrupt)
    with pytest.raises(SystemExit, match="interrupted: saved step 3"):
        lab_train(small_run(tmp_path, name="cut"))
    monkeypatch.setattr(train, "losses", step)
    resumed = lab_train(small_run(tmp_path, "--resume", name="cut"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_a_worker_killed_in_step_2_leaves_last_pt_of_step_1(tmp_path, monkeypatch):
    real, calls = train.losses, {"n": 0}
    killer = kill_workers_once(real)

    def losses(*args, **kwargs):  # step 1 completes; step 2's loss finds its worker killed
        calls["n"] += 1
        return (killer if calls["n"] == 2 else real)(*args, **kwargs)
    monkeypatch.setattr(train, "losses", losses)
    with pytest.raises(OSError, match=r"a DataLoader worker failed"):
        lab_train([*TRAIN_NO_CACHE, "--n-train", "6", "--workers", "1", "--out", str(tmp_path)])
    state = torch.load(tmp_path / "last.pt", weights_only=True)
    assert state["progress"]["step"] == 1


def test_two_evaluations_share_their_folder_and_a_training_waits_for_neither(tmp_path, monkeypatch):
    """A table's evaluations of one task share eval/<task> (and --print-commands' lines run side by side): one that
    starts while another evaluates there runs too (before: "in use by another run", a --gpus worker lost)."""
    flags = [*QUIET, "--task", "vqav2", "--n-eval", "2", "--out", str(tmp_path)]
    inside, leave, predict = threading.Event(), threading.Event(), evaluate.predict

    def held(*args, **kwargs):
        inside.set()
        leave.wait(60)
        return predict(*args, **kwargs)
    monkeypatch.setattr(evaluate, "predict", held)
    first = threading.Thread(target=lab_evaluate, args=([*flags, "--shots", "0"],))
    first.start()
    try:
        assert inside.wait(60)
        monkeypatch.setattr(evaluate, "predict", predict)
        assert lab_evaluate([*flags, "--shots", "1"])["setting"] == "1-shot"
        with pytest.raises(ValueError, match="is in use by another run"):  # a training there: refused, as before
            with locks.locked(str(tmp_path)):
                pass
    finally:
        leave.set()
        first.join()
    assert len(list(tmp_path.glob("*.metrics.json"))) == 2


def damaged(tmp_path, adapter, tensors=None, settings=None):
    path, real, meta = adapter
    out = str(tmp_path / "adapter.safetensors")
    save_file(real if tensors is None else tensors, out, metadata=meta if settings is None else {"settings": settings})
    return out


@pytest.mark.parametrize("change, message", [
    (lambda t, s: ({("x" + k if i == 0 else k): v for i, (k, v) in enumerate(sorted(t.items()))}, None),
     r"does not hold the adapter its settings describe: .* is missing; x.* is not one of the adapter's"),
    (lambda t, s: ({k: v[..., :-1].contiguous() if i == 0 else v for i, (k, v) in enumerate(sorted(t.items()))}, None),
     r"does not hold the adapter its settings describe: .* is \(\d+(, \d+)*\), not \("),
    (lambda t, s: (None, json.dumps({k: v for k, v in json.loads(s).items() if k != "method"})),
     r"its settings lack method"),
    (lambda t, s: (None, s[:-3]), r"its settings \(metadata\) are not JSON"),
    (lambda t, s: (None, "[1, 2]"), r"its settings lack method, backbone, layers, heads, head_dim"),
    (lambda t, s: (None, json.dumps({**json.loads(s), "method": "magic"})), r"do not make an adapter \(unknown method"),
    (lambda t, s: (None, json.dumps({**json.loads(s), "rank": -1})), r"sizes \{'rank': -1\}\) do not make an adapter"),
    (lambda t, s: ({**t, "extra": torch.zeros(2)}, None), r"extra is not one of the adapter's"),
    (lambda t, s: ({k: v.long() for k, v in t.items()}, None), r"is torch.int64, not floating point"),
    (lambda t, s: (None, json.dumps({**json.loads(s), "layers": "2"})), r"its settings' layers is '2', not a whole"),
])
def test_a_damaged_or_foreign_adapter_names_the_file_and_the_tensor_or_field(tmp_path, adapter, change, message):
    tensors, settings = change(adapter[1], adapter[2]["settings"])
    path = damaged(tmp_path, adapter, tensors, settings)
    with pytest.raises(ValueError, match=rf"{path}(: | ).*{message}"):
        adapter_files.load_adapter(path, backbones.load_backbone("tiny-idefics2"))


def test_resume_with_another_clip_or_icds_is_refused(tmp_path):
    run = [*TRAIN, "--out", str(tmp_path / "run"), "--teacher-cache", str(tmp_path / "teacher")]
    lab_train([*run, "--max-steps", "1"])
    for flag, value in (("--clip", "0.5"), ("--icds", "rices")):
        with pytest.raises(SystemExit, match=rf"last.pt was made with {flag} "):
            lab_train([*run, "--resume", flag, value])


class Planted:
    """What a crafted last.pt holds: unpickling it with weights_only=False makes the folder `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_crafted_last_pt_runs_no_code_and_is_refused_in_one_line(tmp_path):
    run = [*TRAIN, "--out", str(tmp_path / "run"), "--teacher-cache", str(tmp_path / "teacher")]
    lab_train([*run, "--max-steps", "1"])
    path, marker = tmp_path / "run" / "last.pt", tmp_path / "ran"
    assert torch.load(path, weights_only=True)["progress"]["step"] == 1  # the project's own: plain data only
    state = torch.load(path, weights_only=True)
    torch.save({**state, "progress": Planted(str(marker))}, path)
    with pytest.raises(ValueError, match=rf"^--resume: {path} is not a checkpoint of this project") as e:
        lab_train([*run, "--resume"])
    assert not marker.exists() and "weights_only" not in str(e.value) and "\n" not in str(e.value)


def test_a_sigint_right_after_the_optimiser_step_resumes_bit_for_bit(tmp_path, monkeypatch):
    run = lambda name, *extra: [*with_flag(TRAIN, "--n-train", "12"), "--out", str(tmp_path / name),
                                "--teacher-cache", str(tmp_path / "teacher"), *extra]
    whole = lab_train(run("whole"))
    real, calls, before = torch.optim.lr_scheduler.LambdaLR.step, [], signal.getsignal(signal.SIGINT)

    def interrupted(self, *a, **k):  # the scheduler's step comes right after AdamW's: the signal lands between them
        real(self, *a, **k)
        calls.append(1)
        if len(calls) == 3:  # its first call is the constructor's; the third: after the 2nd optimiser step
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", interrupted)
    with pytest.raises(SystemExit, match=r"interrupted: saved step 2 to .*last.pt \(Ctrl-C\)"):
        lab_train(run("cut"))
    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", real)
    assert signal.getsignal(signal.SIGINT) is before   # the handler does not outlive the run (Python's, or SIG_IGN)
    resumed = lab_train(run("cut", "--resume"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def mounted_tmpfs(folder, size):
    """A real filesystem of `size` bytes at `folder` (tmpfs; needs root); whether it could be mounted."""
    folder.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


def test_a_disk_full_mid_run_names_the_way_out_and_saves_the_last_completed_step(tmp_path, monkeypatch):
    """The teacher cache's disk fills up after the first step (another process's files): a real tmpfs filled to
    the last byte, or where none can be mounted, writes there sent to /dev/full (the kernel's own ENOSPC)."""
    teacher, out = tmp_path / "teacher", tmp_path / "run"
    real_tmpfs = mounted_tmpfs(teacher, 1 << 20)
    step, real_open = train.runs.step, os.open

    @contextlib.contextmanager
    def then_full(run, parts):
        with step(run, parts):
            yield
        if run.progress["step"] == 1 and real_tmpfs:
            fd = os.open(teacher / "filler", os.O_WRONLY | os.O_CREAT)
            try:
                while True:
                    os.write(fd, b"\0" * 4096)
            except OSError as e:
                assert e.errno == errno.ENOSPC
            finally:
                os.close(fd)
        elif run.progress["step"] == 1:
            monkeypatch.setattr(os, "open", lambda path, flags, mode=0o777: real_open(
                "/dev/full", os.O_WRONLY) if str(path).startswith(str(teacher)) else real_open(path, flags, mode))
    monkeypatch.setattr(train.runs, "step", then_full)
    try:
        with pytest.raises(OSError, match=r"No space left on device writing .*teacher.*: the teacher cache needs .*"
                                          r"give --teacher-cache DIR on a disk with room, or --no-teacher-cache"):
            lab_train([*with_flag(TRAIN, "--n-train", "12"), "--out", str(out), "--teacher-cache", str(teacher)])
    finally:
        monkeypatch.undo()
        if real_tmpfs:
            subprocess.run(["umount", "-l", str(teacher)], check=True)
    assert torch.load(out / "last.pt", weights_only=True)["progress"]["step"] == 1


def test_resume_after_the_model_folders_weights_changed_is_refused_naming_it(tmp_path, twin_folder):
    model = tmp_path / "model"
    shutil.copytree(twin_folder, model)
    run = [*with_flag(TRAIN, "--model", str(model)), "--out", str(tmp_path / "run"),
           "--teacher-cache", str(tmp_path / "teacher")]
    lab_train([*run, "--max-steps", "1"])
    backbones.load_backbone("tiny-idefics2", seed=1).model.save_pretrained(model)  # other weights, same config
    with pytest.raises(SystemExit, match=rf"last.pt was made with other weights of --model {model} \(fingerprint"):
        lab_train([*run, "--resume"])


def test_a_refused_adapter_file_leaves_the_attached_adapter_in_place(tmp_path, backbone):
    from safetensors.torch import load_file, save
    from safetensors import safe_open
    registry.attach(backbone.model, "hyper-icl", rank=4)
    torch.manual_seed(1)
    for p in M.adapter_modules(backbone.model).parameters():
        p.data.normal_()
    before = {k: v.clone() for k, v in M.adapter_modules(backbone.model).state_dict().items()}
    good = tmp_path / "good.safetensors"
    adapter_files.save_adapter(str(good), backbone)
    with safe_open(str(good), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(good))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first][..., :-1].contiguous()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(save(tensors, metadata=metadata))
    try:
        with pytest.raises(ValueError, match="does not hold the adapter its settings describe"):
            adapter_files.load_adapter(str(bad), backbone)
        assert backbone.model.icl_settings["method"] == "hyper-icl"
        after = M.adapter_modules(backbone.model).state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    finally:
        M.detach(backbone.model)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-step run of the tiny twin on a task of one's own in one file: (task file, run folder)."""
    import train
    folder = tmp_path_factory.mktemp("own")
    task, out = vqa_task(folder), str(folder / "run")
    lab_train([*TINY, "--task", task, "--out", out, "--n-train", "2", "--n-heldout", "1", "--batch-size", "1",
               "--shots", "1", "--epochs", "1", "--workers", "0"])
    return task, out


def test_an_adapter_of_another_task_is_not_scored_as_this_tasks(trained, tmp_path, monkeypatch, capsys):
    import evaluate
    from safetensors import safe_open
    from lab.run import adapter_files, locks
    from lab.scores import results
    task, out = trained
    other = vqa_task(tmp_path / "other")
    monkeypatch.chdir(tmp_path)
    default = results.default_checkpoint("tiny-idefics2", other)  # where train.py --task other would write
    os.makedirs(os.path.dirname(default))
    os.link(os.path.join(out, "adapter.safetensors"), default)
    with pytest.raises(SystemExit):
        lab_evaluate_args([*TINY, "--task", other])
    said = capsys.readouterr().err
    assert f"adapter.safetensors is an adapter of the task {os.path.realpath(task)}, not of {other}" in said
    with pytest.raises(SystemExit):  # named, it is still another task's (before: taken, scored as other's)
        evaluate.parse_args([*TINY, "--task", other, "--checkpoint", default])
    assert f"give --checkpoint {default} --checkpoint-task {os.path.realpath(task)}" in capsys.readouterr().err
    assert evaluate.parse_args([*TINY, "--task", other, "--checkpoint", default, "--checkpoint-task", task]
                               ).checkpoint == default  # a transfer, said so: taken
    record = adapter_files.read_record(default)
    assert record["task"] == os.path.realpath(task) and len(record["data"]) == 16 and record["n_train"] == 2
    with safe_open(default, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for run in ("[1, 2]", '"vqav2"'):  # before: AttributeError in check_task
        save_file(tensors, tmp_path / "listed.safetensors", metadata={**meta, "run": run})
        with pytest.raises(SystemExit):
            evaluate.parse_args([*TINY, "--task", other, "--checkpoint", str(tmp_path / "listed.safetensors")])
        assert "listed.safetensors: its metadata 'run' (the run that made it) is " in capsys.readouterr().err


def test_resume_on_other_data_is_refused_and_keeps_last_pt_and_a_moved_split_is_said(trained, tmp_path, capsys):
    import evaluate
    import train
    task, out = trained
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in ("last.pt", "adapter.safetensors"):
        (copy / f).write_bytes(open(os.path.join(out, f), "rb").read())
    last = (copy / "last.pt").read_bytes()
    Image.new("RGB", (32, 24), (0, 250, 0)).save(os.path.join(os.path.dirname(task), "img", "new.jpg"))
    with open(task, "a") as f:  # one record more: the seeded split by image moves items between the halves
        f.write(json.dumps({"id": 99, "image": "img/new.jpg", "question": "And now?", "answer": "green"}) + "\n")
    try:
        with pytest.raises(SystemExit, match=r"--resume: .*copy/last.pt was made with other training data \(.*"
                                             r"fingerprint [0-9a-f]{16}, now [0-9a-f]{16}"):
            lab_train([*TINY, "--task", task, "--out", str(copy), "--n-train", "2", "--n-heldout", "1",
                       "--batch-size", "1", "--shots", "1", "--epochs", "1", "--workers", "0", "--resume"])
        assert (copy / "last.pt").read_bytes() == last
        capsys.readouterr()
        lab_evaluate_args([*TINY, "--task", task, "--checkpoint", str(copy / "adapter.safetensors")])
        assert "warning: the training pool of" in capsys.readouterr().out
    finally:
        lines = open(task).read().splitlines(keepends=True)
        open(task, "w").write("".join(lines[:-1]))


def test_an_adapter_holding_nan_or_inf_is_refused_naming_the_tensor(trained, tmp_path):
    import evaluate
    from safetensors import safe_open
    from safetensors.torch import save_file
    task, out = trained
    with safe_open(os.path.join(out, "adapter.safetensors"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    name = sorted(tensors)[1]
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, tmp_path / "nan.safetensors", metadata=meta)
    with pytest.raises(ValueError, match=rf"nan.safetensors: its tensor {name} holds NaN or inf"):
        lab_evaluate([*TINY, "--task", task, "--checkpoint", str(tmp_path / "nan.safetensors"), "--workers", "0"])
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".metrics.json")]  # before: scored, 0.00 written


def assert_same_run(a, b):
    for name in ("adapter.safetensors", "history.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def saved_progress(out):
    return torch.load(out / "last.pt", weights_only=False)["progress"]


def test_kill_9_while_an_epoch_is_scored_then_resume_reproduces_the_run(whole, tmp_path):
    """A real kill -9 in a subprocess at the start of epoch 1's held-out scoring (after its last step's checkpoint)."""
    shutil.copytree(whole / "teacher", tmp_path / "teacher")
    die = "import os, signal, sys; from lab.cli import modes; from lab.run import runs; " \
          "runs.heldout_loss = lambda *a: os.kill(os.getpid(), signal.SIGKILL); modes.train_main(sys.argv[1:])"
    killed = subprocess.run([sys.executable, "-c", die, *run_flags(tmp_path, "run")], cwd=ROOT, capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    progress = saved_progress(tmp_path / "run")
    assert progress["step"] == 2 and progress["history"] == []          # epoch 1 trained, its scoring pending
    lab_train(run_flags(tmp_path, "run", "--resume"))
    assert_same_run(whole / "run", tmp_path / "run")


def test_sigterm_while_an_epoch_is_scored_saves_and_resume_scores_it(whole, tmp_path, monkeypatch, capsys):
    score = runs.heldout_loss

    def terminated(*a):
        os.kill(os.getpid(), signal.SIGTERM)
        return score(*a)
    monkeypatch.setattr(runs, "heldout_loss", terminated)
    with pytest.raises(SystemExit, match=r"interrupted: saved step 2 to .*last.pt \(SIGTERM\); continue with --resume"):
        lab_train(run_flags(tmp_path, "run"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL              # the handler does not outlive the run
    assert saved_progress(tmp_path / "run")["history"] == []
    monkeypatch.setattr(runs, "heldout_loss", score)
    lab_train(run_flags(tmp_path, "run", "--resume"))
    assert_same_run(whole / "run", tmp_path / "run")


def test_a_folder_holding_a_run_is_refused_and_overwrite_replaces_it(whole, tmp_path, capsys):
    with pytest.raises(ValueError, match=f"{whole / 'run'} holds a run .*--resume.*--overwrite"):
        lab_train(run_flags(whole, "run"))
    shutil.copytree(whole / "run", tmp_path / "run")
    lab_train(run_flags(tmp_path, "run", "--overwrite", "--max-steps", "1"))
    partial = adapter_files.read_record(str(tmp_path / "run" / "adapter.safetensors"))["partial"]  # not the old one's
    assert partial["step"] == 1 and partial["heldout_loss"] > 0   # a smoke run's adapter: the best so far, partial
    assert json.loads((tmp_path / "run" / "history.json").read_text()) == []
    assert "(a partial run's: no epoch scored yet; --resume continues)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        lab_train_args([*RUN, "--resume", "--overwrite"])
    assert "argument --overwrite: not allowed with argument --resume" in capsys.readouterr().err


def test_truncated_or_empty_last_pt_is_a_clear_error(whole, tmp_path):
    (tmp_path / "run").mkdir()
    last = (whole / "run" / "last.pt").read_bytes()
    for content in (last[:len(last) // 2], b""):
        (tmp_path / "run" / "last.pt").write_bytes(content)
        with pytest.raises(ValueError, match=r"--resume: .*last.pt is unreadable \(truncated or corrupt"):
            lab_train(run_flags(tmp_path, "run", "--resume"))


def test_a_full_disk_is_a_clear_error_and_leaves_the_old_file(whole, tmp_path, monkeypatch):
    """Every write goes to /dev/full, which fails as a full disk does (ENOSPC) for torch.save and safetensors."""
    backbone = backbones.load_backbone("tiny-idefics2")
    adapter_files.load_adapter(whole / "run" / "adapter.safetensors", backbone)
    shutil.copy(whole / "run" / "adapter.safetensors", tmp_path)
    before = (tmp_path / "adapter.safetensors").read_bytes()
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, mode=0o777: real_open("/dev/full", os.O_WRONLY))
    with pytest.raises(OSError, match=r"could not write .*adapter.safetensors \(No space left on device\); the "
                                      "previous file, if any, is unchanged") as e:
        adapter_files.save_adapter(tmp_path / "adapter.safetensors", backbone)
    assert e.value.__cause__.errno == errno.ENOSPC
    with pytest.raises(OSError, match=r"could not write .*last.pt \(No space left on device\)"):
        files.atomic_write(tmp_path / "last.pt", lambda f: torch.save({"x": torch.zeros(1000)}, f))
    monkeypatch.undo()
    assert (tmp_path / "adapter.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["adapter.safetensors"]


def test_adapter_refuses_another_family_or_other_weights_unless_forced(whole, capsys):
    path = whole / "run" / "adapter.safetensors"
    assert adapter_files.read_settings(path)["family"] == "idefics2"
    for other in (backbones.load_backbone("tiny-idefics2", seed=1), backbones.load_backbone("tiny-llava-interleave")):
        assert M.attention_shape(other.model) == (2, 4, 16)                # the same shape: only the identity differs
        with pytest.raises(ValueError, match="trained on another backbone .*fingerprint .*--force"):
            adapter_files.load_adapter(path, other)
        adapter_files.load_adapter(path, other, force=True)
        assert "warning: --force" in capsys.readouterr().out
    with pytest.raises(ValueError, match="family .saved idefics2, here llava-interleave."):
        adapter_files.load_adapter(path, backbones.load_backbone("tiny-llava-interleave"))
    adapter_files.load_adapter(path, backbones.load_backbone("tiny-idefics2"))       # its own backbone loads silently
    assert capsys.readouterr().out == ""


def test_checkpoint_that_is_not_an_adapter_file_is_a_clear_error(whole, tmp_path):
    adapter = (whole / "run" / "adapter.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(adapter[:len(adapter) // 2])
    for path, message in ((whole / "run", "is a folder; pass the adapter file in it"),
                          (tmp_path / "truncated.safetensors", "not a readable adapter checkpoint"),
                          (whole / "run" / "last.pt", "not a readable adapter checkpoint")):
        with pytest.raises(ValueError, match=message):
            adapter_files.read_settings(path)
    cli = subprocess.run([sys.executable, "evaluate.py", "--model", "tiny-idefics2", "--task", "vqav2", "--data-root",
                          benchmarks.ROOT, "--checkpoint", str(whole / "run")], cwd=ROOT, capture_output=True,
                         text=True)
    assert cli.returncode == 1 and "Traceback" not in cli.stderr
    assert cli.stderr.strip().splitlines()[-1] == f"error: {whole / 'run'} is a folder; pass the adapter file in " \
                                                   "it (train.py writes <out>/adapter.safetensors)"


HOLD = "import pathlib, sys, time, train; from lab.cli import modes; train.train = lambda args, *_: (" \
       "pathlib.Path(sys.argv[1]).touch(), time.sleep(120)); modes.train_main(sys.argv[2:])"


def test_a_second_process_on_a_claimed_folder_stops_at_once_naming_it_and_the_holder(tmp_path):
    """Two real processes: the first holds --out (its training replaced by a sleep); train.py and evaluate.py on the
    same folder stop with one line naming the folder and the first one's pid; a kill -9 releases the folder."""
    out, ready = tmp_path / "run", tmp_path / "ready"
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(ready), *run_flags(tmp_path, "run")], cwd=ROOT)
    try:
        while not ready.exists():
            assert first.poll() is None, "the first run ended early"
            time.sleep(0.2)
        second = [[sys.executable, "-m", "lab", "train", *run_flags(tmp_path, "run", "--lr", "1e-3", "--seed", "1")],
                  [sys.executable, "evaluate.py", "--model", "tiny-idefics2", "--task", "vqav2", "--data-root",
                   benchmarks.ROOT, "--shots", "0", "--out", str(out)]]
        for cli in [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                    for argv in second]:  # both at once
            err = cli.communicate()[1]
            assert cli.returncode == 1 and "Traceback" not in err, err[-2000:]
            assert err.strip().splitlines()[-1] == f"error: {out} is in use by another run (pid {first.pid}); wait " \
                                                   "for it to finish or choose another --out"
        assert not (out / "last.pt").exists()                              # the second run wrote nothing there
    finally:
        first.kill()
        first.wait()
    with locks.locked(str(out)):                                            # the killed holder's lock is gone
        pass


def test_a_lock_that_cannot_be_written_names_it_and_is_not_left(tmp_path, monkeypatch):
    def full(fd, b, offset):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match=rf"could not write the lock file {tmp_path / 'run' / '.lock'} \(No space"):
        with locks.locked(str(tmp_path / "run")):
            pass
    assert os.listdir(tmp_path / "run") == []
