"""Files written whole or not at all (lab/disk/files.py): atomic writes, stale temporary files and folders, the umask,
locks never opened through a link, checked caches."""
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from helpers import dead_pid, lab_train, lab_train_args, ROOT, run_flags, TRAIN
from lab.datasets import tasks
from lab.disk import files
from lab.run import resume


def test_atomic_write_never_leaves_a_half_written_file(tmp_path):
    path = tmp_path / "f.bin"
    files.atomic_write(path, lambda f: f.write(b"good"))

    def crash(f):
        f.write(b"ha")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        files.atomic_write(path, crash)
    assert path.read_bytes() == b"good" and os.listdir(tmp_path) == ["f.bin"]


def test_the_lock_file_is_never_opened_through_a_link(tmp_path):
    precious, out = tmp_path / "precious", tmp_path / "run"
    precious.write_text("mine")
    out.mkdir()
    os.symlink(precious, out / ".lock")
    with pytest.raises(OSError, match=rf"the lock file {out / '.lock'} is a symbolic link, which is never followed"):
        lab_train([*TRAIN, "--out", str(out), "--teacher-cache", str(tmp_path / "teacher")])
    os.symlink(precious, out / "history.json")
    files.write_json(out / "history.json", [])  # an atomic write replaces the link itself, never its target
    assert precious.read_text() == "mine" and not os.path.islink(out / "history.json")


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


def test_stale_temporary_files_are_removed_and_files_follow_the_umask(tmp_path):
    args = lab_train_args(run_flags(tmp_path, "run"))
    os.makedirs(args.teacher_cache)
    stale = files.tmp_name(tmp_path / "teacher" / "x.safetensors", dead_pid())
    fresh = files.tmp_name(tmp_path / "teacher" / "y.safetensors")
    for f in (stale, fresh):
        open(f, "wb").write(b"half")
    resume.claim(args)
    assert not os.path.exists(stale) and os.path.exists(fresh)            # a live writer's file is left alone
    for umask in (0o022, 0o002):
        previous = os.umask(umask)
        try:
            files.atomic_write(tmp_path / f"f{umask}", lambda f: f.write(b"x"))
        finally:
            os.umask(previous)
        assert os.stat(tmp_path / f"f{umask}").st_mode & 0o777 == 0o666 & ~umask


KILLED_WRITER = """
import os, sys, time
sys.path.insert(0, {root!r})
import torch
from lab.disk import files
real = os.fdopen
class Half:  # writes half of what it is given, says so, and waits to be killed
    def __init__(self, f): self.f = f
    def __enter__(self): return self
    def __exit__(self, *exc): self.f.close()
    def write(self, b):
        self.f.write(b[:len(b) // 2]); self.f.flush(); print("half", flush=True); time.sleep(60)
    def __getattr__(self, name): return getattr(self.f, name)
os.fdopen = lambda *a, **k: Half(real(*a, **k))
files.write_cache({path!r}, {{"states": torch.arange(4096.).view(4, 1024)}}, "key")
"""


def test_a_cache_file_killed_mid_write_is_never_read_and_a_damaged_one_is_refused(tmp_path, capsys):
    path = str(tmp_path / "cache" / "q.safetensors")
    shapes = {"states": ((4, 1024), None)}
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER.format(root=ROOT, path=path)],
                              stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "half\n"                           # half of the file is on disk
    writer.kill()                                                          # kill -9 mid-write
    writer.wait()
    left = os.listdir(tmp_path / "cache")
    assert len(left) == 1 and files.is_stale_tmp(str(tmp_path / "cache" / left[0]))  # only its temporary file
    assert files.read_cache(path, "key", shapes) is None                     # nothing read as valid
    states = torch.arange(4096.).view(4, 1024)
    files.write_cache(path, {"states": states}, "key")                       # the rerun writes it, cleans up
    assert os.listdir(tmp_path / "cache") == ["q.safetensors"]
    assert torch.equal(files.read_cache(path, "key", shapes)["states"], states)
    good = open(path, "rb").read()
    for damaged in (good[:-4096] + bytes(4096),                            # a tail that never reached the disk
                    good[:len(good) // 2] + bytes([good[len(good) // 2] ^ 1]) + good[len(good) // 2 + 1:]):  # a bit
        open(path, "wb").write(damaged)
        assert files.read_cache(path, "key", shapes) is None
        assert "is unusable (its bytes do not match their checksum)" in capsys.readouterr().out


def test_stale_temporary_folders_of_a_killed_generation_are_removed(tmp_path):
    stale = files.tmp_name(tmp_path / "toy-icl" / "colour", dead_pid())
    os.makedirs(os.path.join(stale, "coco"))
    tasks.load_task("toy-icl-colour", "val", str(tmp_path))
    assert sorted(os.listdir(tmp_path / "toy-icl")) == ["colour"]


def user_files(folder):
    """Put a user's *.tmp file and *.tmp folders, an hour old, in `folder`; return their paths."""
    os.makedirs(os.path.join(folder, "scratch.tmp"), exist_ok=True)
    os.makedirs(os.path.join(folder, ".hidden.tmp"), exist_ok=True)
    paths = [os.path.join(folder, n) for n in ("notes.tmp", "scratch.tmp/keep.txt", ".hidden.tmp/a.txt", "x.1a2b.tmp")]
    for p in paths:
        open(p, "w").write("mine")
        os.utime(p, (time.time() - 3600, time.time() - 3600))
    for d in ("scratch.tmp", ".hidden.tmp"):
        os.utime(os.path.join(folder, d), (time.time() - 3600, time.time() - 3600))
    return paths


def test_the_cleanup_never_touches_a_users_tmp_files_or_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = lab_train_args(run_flags(tmp_path, "run", "--rices-cache", str(tmp_path / "rices")))
    folders = [args.out, args.teacher_cache, args.rices_cache, str(tmp_path / "data"), str(tmp_path)]
    mine = [p for f in folders for p in user_files(f)]
    stale = [files.tmp_name(os.path.join(f, "x.safetensors"), dead_pid()) for f in folders]
    for p in stale:
        open(p, "w").write("half")
    resume.claim(args)
    for f in folders:
        files.remove_stale_tmp(f)
    files.generated(str(tmp_path / "data" / "dataset"), lambda folder: open(os.path.join(folder, "f"), "w").close())
    files.atomic_write(tmp_path / "result.json", lambda f: f.write(b"{}"))
    assert all(open(p).read() == "mine" for p in mine) and not any(os.path.exists(p) for p in stale)


def test_a_killed_writes_tmp_is_gone_after_a_successful_rerun_at_once(tmp_path):
    code = ("import os; from lab.disk import files; "
            "files.atomic_write('f.json', lambda f: (f.write(b'half'), f.flush(), os._exit(9)))")
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={**os.environ, "PYTHONPATH": ROOT}).returncode
    assert len(os.listdir(tmp_path)) == 1                                   # the killed write's temporary file
    files.atomic_write(tmp_path / "f.json", lambda f: f.write(b"{}"))
    assert os.listdir(tmp_path) == ["f.json"]


def test_a_temporary_name_of_another_machine_waits_its_15_minutes(tmp_path):
    other = tmp_path / f".x.{files.TMP_MARK}-elsewhere{files.this_host()}-1-0123456789ab.tmp"
    other.write_text("half")
    files.remove_stale_tmp(tmp_path)
    assert other.exists()
    os.utime(other, (time.time() - 3600, time.time() - 3600))
    files.remove_stale_tmp(tmp_path)
    assert not other.exists()
