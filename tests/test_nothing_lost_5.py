"""Nothing lost, part 5: no code from a run folder, no file through a link, no stale teacher cache, resume exact
wherever a signal lands, a full disk named with its way out, missing weights and paths out of a dataset refused.

One test per case of a hostile run (issue 45, items 1-9 and 13): each failed before its fix. Small: the tiny twin,
4 to 12 training queries, files written by hand in the official layouts or copied from tools/benchmarks.py's."""
import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess

import pytest
from PIL import Image
import torch
from safetensors.torch import load_file, save_file

import benchmarks
import train
from lab.disk import files
from lab.datasets import mme_seed, readers
from lab.models import backbones

TRAIN = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-train", "4",
         "--n-heldout", "4", "--batch-size", "4", "--shots", "1", "--epochs", "1"]


def with_flag(argv, flag, value):
    """argv with `flag`'s value replaced."""
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


# ------------------------------------------------------------------------------------- 1. no code from last.pt

class Planted:
    """What a crafted last.pt holds: unpickling it with weights_only=False makes the folder `marker`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_a_crafted_last_pt_runs_no_code_and_is_refused_in_one_line(tmp_path):
    run = [*TRAIN, "--out", str(tmp_path / "run"), "--teacher-cache", str(tmp_path / "teacher")]
    train.main([*run, "--max-steps", "1"])
    path, marker = tmp_path / "run" / "last.pt", tmp_path / "ran"
    assert torch.load(path, weights_only=True)["progress"]["step"] == 1  # the project's own: plain data only
    state = torch.load(path, weights_only=True)
    torch.save({**state, "progress": Planted(str(marker))}, path)
    with pytest.raises(ValueError, match=rf"^--resume: {path} is not a checkpoint of this project") as e:
        train.main([*run, "--resume"])
    assert not marker.exists() and "weights_only" not in str(e.value) and "\n" not in str(e.value)


# --------------------------------------------------------------------------------------- 2. no write via a link

def test_the_lock_file_is_never_opened_through_a_link(tmp_path):
    precious, out = tmp_path / "precious", tmp_path / "run"
    precious.write_text("mine")
    out.mkdir()
    os.symlink(precious, out / ".lock")
    with pytest.raises(OSError, match=rf"the lock file {out / '.lock'} is a symbolic link, which is never followed"):
        train.main([*TRAIN, "--out", str(out), "--teacher-cache", str(tmp_path / "teacher")])
    os.symlink(precious, out / "history.json")
    files.write_json(out / "history.json", [])  # an atomic write replaces the link itself, never its target
    assert precious.read_text() == "mine" and not os.path.islink(out / "history.json")


# ---------------------------------------------------------------- 3, 4. the teacher cache: images, processor

def test_the_teacher_cache_is_recomputed_when_the_images_or_the_processor_change(tmp_path, twin_folder, capsys):
    root, model = benchmarks.copy(tmp_path / "data", "vqav2", "coco"), tmp_path / "model"
    shutil.copytree(twin_folder, model)
    run = with_flag(with_flag(TRAIN, "--data-root", root), "--model", str(model))
    run += ["--out", str(tmp_path / "run"), "--teacher-cache", str(tmp_path / "teacher"), "--overwrite"]

    def counts():
        train.main(run)
        return int(capsys.readouterr().out.split("teacher states computed ")[1].split(",")[0])
    assert counts() == 4
    for folder, _, names in os.walk(os.path.join(root, "coco")):  # every image replaced at its path, other pixels
        for name in (n for n in names if n.endswith(".jpg")):
            path = os.path.join(folder, name)
            Image.open(path).transpose(Image.Transpose.ROTATE_90).save(path)
            os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert counts() == 4
    config = json.loads((model / "processor_config.json").read_text())
    config["image_processor"]["image_mean"] = [0.4, 0.4, 0.4]
    (model / "processor_config.json").write_text(json.dumps(config))
    assert counts() == 4
    assert counts() == 0  # nothing changed: all read back


# ------------------------------------------------------------------------------- 7. the checksum sees swaps

def test_two_swapped_words_of_a_cache_file_are_seen(tmp_path, capsys):
    path = tmp_path / "cache.safetensors"
    files.write_cache(path, {"states": torch.arange(64, dtype=torch.float32)}, "k")
    raw = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(raw[:8], "little")                  # the data after the header
    raw[start:start + 8], raw[start + 8:start + 16] = raw[start + 8:start + 16], raw[start:start + 8]
    path.write_bytes(bytes(raw))
    assert load_file(path)["states"][:4].tolist() == [2, 3, 0, 1]  # a readable file, its words swapped
    assert files.read_cache(path, "k", {"states": ((64,), torch.float32)}) is None
    assert "its bytes do not match their checksum" in capsys.readouterr().out


# ------------------------------------------------------------------- 6. resume exact wherever a signal lands

def test_a_sigint_right_after_the_optimiser_step_resumes_bit_for_bit(tmp_path, monkeypatch):
    run = lambda name, *extra: [*with_flag(TRAIN, "--n-train", "12"), "--out", str(tmp_path / name),
                                "--teacher-cache", str(tmp_path / "teacher"), *extra]
    whole = train.main(run("whole"))
    real, calls = torch.optim.lr_scheduler.LambdaLR.step, []

    def interrupted(self, *a, **k):  # the scheduler's step comes right after AdamW's: the signal lands between them
        real(self, *a, **k)
        calls.append(1)
        if len(calls) == 3:  # its first call is the constructor's; the third: after the 2nd optimiser step
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", interrupted)
    with pytest.raises(SystemExit, match=r"interrupted: saved step 2 to .*last.pt \(Ctrl-C\)"):
        train.main(run("cut"))
    monkeypatch.setattr(torch.optim.lr_scheduler.LambdaLR, "step", real)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # the handler does not outlive the run
    resumed = train.main(run("cut", "--resume"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


# --------------------------------------------------------------- 9. a full disk: its way out, progress kept

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
            train.main([*with_flag(TRAIN, "--n-train", "12"), "--out", str(out), "--teacher-cache", str(teacher)])
    finally:
        monkeypatch.undo()
        if real_tmpfs:
            subprocess.run(["umount", "-l", str(teacher)], check=True)
    assert torch.load(out / "last.pt", weights_only=True)["progress"]["step"] == 1


# ------------------------------------------------------------------------ 5. missing or truncated weights

def test_a_model_folder_missing_a_tensor_or_truncated_is_named(tmp_path, twin_folder):
    model = tmp_path / "model"
    shutil.copytree(twin_folder, model)
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    gone = sorted(tensors)[3]
    save_file({k: v for k, v in tensors.items() if k != gone}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"--model: {weights} lacks the tensor {gone}; restore its weights"):
        backbones.load_backbone(str(model))
    raw = weights.read_bytes()
    weights.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ValueError, match=rf"--model: {weights} is truncated or damaged"):
        backbones.load_backbone(str(model))


# -------------------------------------------------------------------------- 8. paths out of the dataset

@pytest.mark.parametrize("data_id", ["/etc/passwd", "../SEED-Bench.json", "a/../../../x.jpg"])
def test_a_seed_data_id_out_of_its_folder_is_refused_naming_it(tmp_path, data_id):
    root = benchmarks.copy(tmp_path, "seed-bench")
    path = os.path.join(root, "seed-bench", "SEED-Bench.json")
    obj = json.loads(open(path).read())
    image = next(q for q in obj["questions"] if int(q["question_type_id"]) in mme_seed.SEED_IMAGE_DIMENSIONS)
    image["data_id"] = data_id
    open(path, "w").write(json.dumps(obj))
    with pytest.raises(ValueError, match=rf"seed: question #\d+ .* in {path} is malformed: its data_id "
                                         rf"'{data_id}' leads out of the dataset's folder"):
        mme_seed.read_seed(root)


@pytest.mark.parametrize("field, value", [("filepath", "/etc"), ("filepath", ".."), ("filename", "../../x.jpg"),
                                          ("filename", "/etc/passwd")])
def test_a_karpathy_filepath_or_filename_out_of_the_dataset_is_refused_naming_it(tmp_path, field, value):
    os.makedirs(tmp_path / "coco")
    entry = {"cocoid": 1, "split": "test", "filepath": "val2014", "filename": "a.jpg", "sentences": [{"raw": "a"}]}
    path = tmp_path / "coco" / "dataset_coco.json"
    path.write_text(json.dumps({"images": [{**entry, field: value}]}))
    with pytest.raises(ValueError, match=rf"coco: entry 0 of {path} .* is malformed: its {field} '{value}' leads out"):
        readers.read_karpathy(str(tmp_path), "val", "coco")


# ----------------------------------------------------------------------- 13. resume across changed weights

def test_resume_after_the_model_folders_weights_changed_is_refused_naming_it(tmp_path, twin_folder):
    model = tmp_path / "model"
    shutil.copytree(twin_folder, model)
    run = [*with_flag(TRAIN, "--model", str(model)), "--out", str(tmp_path / "run"),
           "--teacher-cache", str(tmp_path / "teacher")]
    train.main([*run, "--max-steps", "1"])
    backbones.load_backbone("tiny-idefics2", seed=1).model.save_pretrained(model)  # other weights, same config
    with pytest.raises(SystemExit, match=rf"last.pt was made with other weights of --model {model} \(fingerprint"):
        train.main([*run, "--resume"])
