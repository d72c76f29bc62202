"""Nothing lost, nothing silently wrong: kills during epoch scoring, SIGTERM, overwritten runs, adapters on the wrong
backbone, corrupt and truncated files, a full disk, bad flags, over-long prompts, malformed dataset JSON.

Every run names --model and --task (never the defaults) and is tiny: 8 training queries, 2 steps per epoch."""
import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

import data
import evaluate
import model as M
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "tiny-idefics2", "--task", "toy-vqa", "--n-train", "8", "--n-heldout", "4", "--batch-size", "4",
        "--shots", "1", "--epochs", "2", "--save-every", "1"]


def flags(tmp, name, *extra):
    return [*TINY, "--out", str(tmp / name), "--teacher-cache", str(tmp / "teacher"), *extra]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """An uninterrupted run: its folder (adapter.safetensors, history.json, last.pt) and teacher cache."""
    tmp = tmp_path_factory.mktemp("whole")
    train.main(flags(tmp, "run"))
    return tmp


def assert_same_run(a, b):
    for name in ("adapter.safetensors", "history.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def saved_progress(out):
    return torch.load(out / "last.pt", weights_only=False)["progress"]


# ------------------------------------------------------------------------------ interrupted end-of-epoch scoring

def test_kill_9_while_an_epoch_is_scored_then_resume_reproduces_the_run(whole, tmp_path):
    """A real kill -9 in a subprocess at the start of epoch 1's held-out scoring (after its last step's checkpoint)."""
    shutil.copytree(whole / "teacher", tmp_path / "teacher")
    die = "import os, signal, sys, train; train.heldout_loss = lambda *a: os.kill(os.getpid(), signal.SIGKILL); " \
          "train.main(sys.argv[1:])"
    killed = subprocess.run([sys.executable, "-c", die, *flags(tmp_path, "run")], cwd=ROOT, capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    progress = saved_progress(tmp_path / "run")
    assert progress["step"] == 2 and progress["history"] == []          # epoch 1 trained, its scoring pending
    train.main(flags(tmp_path, "run", "--resume"))
    assert_same_run(whole / "run", tmp_path / "run")


def test_sigterm_while_an_epoch_is_scored_saves_and_resume_scores_it(whole, tmp_path, monkeypatch, capsys):
    score = train.heldout_loss

    def terminated(*a):
        os.kill(os.getpid(), signal.SIGTERM)
        return score(*a)
    monkeypatch.setattr(train, "heldout_loss", terminated)
    with pytest.raises(SystemExit, match=r"interrupted: saved step 2 to .*last.pt \(SIGTERM\); continue with --resume"):
        train.main(flags(tmp_path, "run"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL              # the handler does not outlive the run
    assert saved_progress(tmp_path / "run")["history"] == []
    monkeypatch.setattr(train, "heldout_loss", score)
    train.main(flags(tmp_path, "run", "--resume"))
    assert_same_run(whole / "run", tmp_path / "run")


# ------------------------------------------------------------------------------------------------ run folders

def test_a_folder_holding_a_run_is_refused_and_overwrite_replaces_it(whole, tmp_path, capsys):
    with pytest.raises(ValueError, match=f"{whole / 'run'} holds a run .*--resume.*--overwrite"):
        train.main(flags(whole, "run"))
    shutil.copytree(whole / "run", tmp_path / "run")
    train.main(flags(tmp_path, "run", "--overwrite", "--max-steps", "1"))
    assert not (tmp_path / "run" / "adapter.safetensors").exists()       # the old run's adapter is gone with it
    assert json.loads((tmp_path / "run" / "history.json").read_text()) == []
    assert "no epoch scored yet, so no best adapter" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        train.parse_args([*TINY, "--resume", "--overwrite"])


def test_truncated_or_empty_last_pt_is_a_clear_error(whole, tmp_path):
    (tmp_path / "run").mkdir()
    last = (whole / "run" / "last.pt").read_bytes()
    for content in (last[:len(last) // 2], b""):
        (tmp_path / "run" / "last.pt").write_bytes(content)
        with pytest.raises(ValueError, match=r"--resume: .*last.pt is unreadable \(truncated or corrupt"):
            train.main(flags(tmp_path, "run", "--resume"))


def test_stale_temporary_files_are_removed_and_files_follow_the_umask(tmp_path):
    args = train.parse_args(flags(tmp_path, "run"))
    os.makedirs(args.teacher_cache)
    stale, fresh = tmp_path / "teacher" / "x.safetensors.1a2b.tmp", tmp_path / "teacher" / "y.safetensors.3c4d.tmp"
    for f in (stale, fresh):
        f.write_bytes(b"half")
    an_hour_ago = time.time() - 3600
    os.utime(stale, (an_hour_ago, an_hour_ago))
    train.claim(args)
    assert not stale.exists() and fresh.exists()                          # a live writer's file is left alone
    for umask in (0o022, 0o002):
        previous = os.umask(umask)
        try:
            M.atomic_write(tmp_path / f"f{umask}", lambda f: f.write(b"x"))
        finally:
            os.umask(previous)
        assert os.stat(tmp_path / f"f{umask}").st_mode & 0o777 == 0o666 & ~umask


# ----------------------------------------------------------------------------------------------- a full disk

def test_a_full_disk_is_a_clear_error_and_leaves_the_old_file(whole, tmp_path, monkeypatch):
    """Every write goes to /dev/full, which fails as a full disk does (ENOSPC) for torch.save and safetensors."""
    backbone = M.load_backbone("tiny-idefics2")
    M.load_adapter(whole / "run" / "adapter.safetensors", backbone)
    shutil.copy(whole / "run" / "adapter.safetensors", tmp_path)
    before = (tmp_path / "adapter.safetensors").read_bytes()
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, mode=0o777: real_open("/dev/full", os.O_WRONLY))
    with pytest.raises(OSError, match=r"could not write .*adapter.safetensors \(No space left on device\); the "
                                      "previous file, if any, is unchanged") as e:
        M.save_adapter(tmp_path / "adapter.safetensors", backbone)
    assert e.value.__cause__.errno == errno.ENOSPC
    with pytest.raises(OSError, match=r"could not write .*last.pt \(No space left on device\)"):
        M.atomic_write(tmp_path / "last.pt", lambda f: torch.save({"x": torch.zeros(1000)}, f))
    monkeypatch.undo()
    assert (tmp_path / "adapter.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["adapter.safetensors"]


# ----------------------------------------------------------------------------------------------- adapter files

def test_adapter_refuses_another_family_or_other_weights_unless_forced(whole, capsys):
    path = whole / "run" / "adapter.safetensors"
    assert M.read_settings(path)["family"] == "idefics2"
    for other in (M.load_backbone("tiny-idefics2", seed=1), M.load_backbone("tiny-llava-interleave")):
        assert M.attention_shape(other.model) == (2, 4, 16)                # the same shape: only the identity differs
        with pytest.raises(ValueError, match="trained on another backbone .*fingerprint .*--force"):
            M.load_adapter(path, other)
        M.load_adapter(path, other, force=True)
        assert "warning: --force" in capsys.readouterr().out
    with pytest.raises(ValueError, match="family .saved idefics2, here llava-interleave."):
        M.load_adapter(path, M.load_backbone("tiny-llava-interleave"))
    M.load_adapter(path, M.load_backbone("tiny-idefics2"))                 # its own backbone loads silently
    assert capsys.readouterr().out == ""


def test_checkpoint_that_is_not_an_adapter_file_is_a_clear_error(whole, tmp_path):
    adapter = (whole / "run" / "adapter.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(adapter[:len(adapter) // 2])
    for path, message in ((whole / "run", "is a folder; pass the adapter file in it"),
                          (tmp_path / "truncated.safetensors", "not a readable adapter checkpoint"),
                          (whole / "run" / "last.pt", "not a readable adapter checkpoint")):
        with pytest.raises(ValueError, match=message):
            M.read_settings(path)
    cli = subprocess.run([sys.executable, "evaluate.py", "--model", "tiny-idefics2", "--task", "toy-vqa",
                          "--checkpoint", str(whole / "run")], cwd=ROOT, capture_output=True, text=True)
    assert cli.returncode == 1 and "Traceback" not in cli.stderr
    assert cli.stderr.strip().splitlines()[-1] == f"error: {whole / 'run'} is a folder; pass the adapter file in " \
                                                   "it (train.py writes <out>/adapter.safetensors)"


# -------------------------------------------------------------------------------------------- the teacher cache

def test_a_corrupt_teacher_cache_file_is_computed_again_with_a_warning(whole, tmp_path, capsys):
    args = train.parse_args(flags(tmp_path, "run"))
    backbone = M.load_backbone("tiny-idefics2")
    queries = data.load_task("toy-vqa", "train")[:2]
    icds = data.demonstrations([q.id for q in queries], data.load_task("toy-vqa", "train"), 1, 0)
    pieces = [data.encode_query(backbone.processor, backbone.family, "vqa", q) for q in queries]
    cache = {"id": M.fingerprint(backbone), "hits": 0, "misses": 0}
    fresh = train.teacher_states(backbone, args, "vqa", queries, icds, pieces, "cpu", cache)
    path = os.path.join(args.teacher_cache, train.teacher_key(cache["id"], args, queries[1], icds[1]) + ".safetensors")
    good = open(path, "rb").read()
    open(path, "wb").write(good[:len(good) // 3])                          # as a crash or a full disk leaves it
    again = train.teacher_states(backbone, args, "vqa", queries, icds, pieces, "cpu", cache)
    assert f"warning: teacher cache file {path} is unreadable" in capsys.readouterr().out
    assert cache == {"id": cache["id"], "hits": 1, "misses": 3}
    for a, b in zip(fresh, again):                                         # batched alone now: float noise only
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert torch.equal(train.read_teacher(path), again[1])                 # and stored again


# ----------------------------------------------------------------------------------------------------- flags

@pytest.mark.parametrize("flag, value", [
    ("--rank", "0"), ("--rank", "-1"), ("--batch-size", "0"), ("--n-train", "0"), ("--n-heldout", "0"),
    ("--grad-accum", "0"), ("--save-every", "0"), ("--epochs", "0"), ("--max-steps", "0"), ("--shots", "-1"),
    ("--virtual-tokens", "0"), ("--kappa", "0"), ("--kappa", "-1")])
def test_train_rejects_flags_that_would_be_silently_rewritten_or_fail_later(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args([*TINY, flag, value])
    assert e.value.code == 2 and f"error: {flag} must be" in capsys.readouterr().err


def test_rank_default_is_per_method_and_never_replaces_a_given_rank():
    assert train.parse_args(TINY).rank == 4
    assert train.parse_args([*TINY, "--method", "hificl"]).rank == 8
    assert train.parse_args([*TINY, "--method", "hificl", "--rank", "1"]).rank == 1


@pytest.mark.parametrize("flag, value", [("--n-eval", "0"), ("--batch-size", "0"), ("--shots", "-1")])
def test_evaluate_rejects_bad_flags(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.parse_args(["--model", "tiny-idefics2", "--task", "toy-vqa", flag, value])
    assert e.value.code == 2 and f"error: {flag} must be at least" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------- data

def vqa_root(tmp_path, questions, annotations, split="val"):
    folder = tmp_path / data.TOY_DIR / "vqav2"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"v2_OpenEnded_mscoco_{split}2014_questions.json").write_text(json.dumps(questions))
    (folder / f"v2_mscoco_{split}2014_annotations.json").write_text(json.dumps(annotations))
    return tmp_path


QUESTION = {"question_id": 7, "image_id": 1, "question": "What colour?"}
ANNOTATION = {"question_id": 7, "answers": [{"answer": "red"}] * 10, "multiple_choice_answer": "red"}


@pytest.mark.parametrize("questions, annotations, message", [
    ([QUESTION], {"annotations": [ANNOTATION]}, r"questions.json should be a JSON object with a list under 'questions'"),
    ({"questions": [QUESTION]}, {"annotations": {}}, r"annotations.json should be a JSON object with a list under"),
    ({"questions": [{"question_id": 7, "image_id": 1}]}, {"annotations": [ANNOTATION]},
     r"entry 0 of .*questions.json .* missing or malformed field \(KeyError: 'question'\)"),
    ({"questions": [QUESTION]}, {"annotations": [{"question_id": 7, "multiple_choice_answer": "red"}]},
     r"entry 0 of .*annotations.json .* missing or malformed field \(KeyError: 'answers'\)"),
    ({"questions": [QUESTION, 5]}, {"annotations": [ANNOTATION]}, r"entry 1 of .*questions.json \(5\)"),
])
def test_malformed_dataset_json_names_the_file_and_entry(tmp_path, questions, annotations, message):
    root = vqa_root(tmp_path, questions, annotations)
    with pytest.raises(ValueError, match=message):
        data.load_task("toy-vqa", "val", str(root))


def test_karpathy_file_of_the_wrong_shape_names_the_file(tmp_path):
    (tmp_path / data.TOY_DIR / "coco").mkdir(parents=True)
    (tmp_path / data.TOY_DIR / "coco" / "dataset_coco.json").write_text(json.dumps([{"split": "test"}]))
    with pytest.raises(ValueError, match="dataset_coco.json should be a JSON object with a list under 'images'"):
        data.load_task("toy-caption", "val", str(tmp_path))


def test_an_empty_split_is_a_clear_error(tmp_path):
    root = vqa_root(tmp_path, {"questions": []}, {"annotations": []})
    with pytest.raises(ValueError, match="toy-vqa has no val items to evaluate"):
        evaluate.main(["--model", "tiny-idefics2", "--task", "toy-vqa", "--data-root", str(root), "--shots", "0",
                       "--out", str(tmp_path / "eval")])
    vqa_root(tmp_path, {"questions": [QUESTION]}, {"annotations": [ANNOTATION]}, split="train")
    with pytest.raises(ValueError, match="toy-vqa has 1 training items: none left to train on after --n-heldout 4"):
        train.main([*flags(tmp_path, "run"), "--data-root", str(root)])


def test_a_prompt_longer_than_the_context_names_its_item():
    backbone = M.load_backbone("tiny-idefics2")
    item = data.load_task("toy-vqa", "train")[0]
    long = dataclasses.replace(item, question=" ".join(["quizzical"] * 2000))
    assert backbone.processor.tokenizer.model_max_length == 4096           # the tiny twin's max_position_embeddings
    with pytest.raises(ValueError, match=rf"item {item.id}: its prompt has \d+ tokens, more than the model's 4096 "
                                         "positions"):
        data.prompt_batch(backbone.processor, backbone.family, "vqa", [item, long])
    data.prompt_batch(backbone.processor, backbone.family, "vqa", [item])  # a normal one still passes
