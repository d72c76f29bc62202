"""Nothing lost, nothing silently wrong: kills during epoch scoring, SIGTERM, overwritten runs, adapters on the wrong
backbone, corrupt and truncated files, a full disk, bad flags, over-long prompts, malformed dataset JSON; and (part 2)
two processes on one folder, evaluation files killed while written, bad caches, bad input files, fail-fast order.

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
from safetensors.torch import load_file, save

import benchmarks
import data
import evaluate
import model as M
import train
from lab.disk import files
from lab.datasets import mme_seed, readers, rices, tasks
from lab.models import backbones, families, toy_backbone
from lab.run import checkpoints, micro_batches, runs, teacher_cache
from lab.scores import results
from lab.studies import vectors

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-train", "8",
        "--n-heldout", "4", "--batch-size", "4", "--shots", "1", "--epochs", "2", "--save-every", "1"]


def dead_pid():
    """The id of a process that has ended (its temporary files are stale)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


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
    die = "import os, signal, sys, train; from lab.run import runs; " \
          "runs.heldout_loss = lambda *a: os.kill(os.getpid(), signal.SIGKILL); train.main(sys.argv[1:])"
    killed = subprocess.run([sys.executable, "-c", die, *flags(tmp_path, "run")], cwd=ROOT, capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    progress = saved_progress(tmp_path / "run")
    assert progress["step"] == 2 and progress["history"] == []          # epoch 1 trained, its scoring pending
    train.main(flags(tmp_path, "run", "--resume"))
    assert_same_run(whole / "run", tmp_path / "run")


def test_sigterm_while_an_epoch_is_scored_saves_and_resume_scores_it(whole, tmp_path, monkeypatch, capsys):
    score = runs.heldout_loss

    def terminated(*a):
        os.kill(os.getpid(), signal.SIGTERM)
        return score(*a)
    monkeypatch.setattr(runs, "heldout_loss", terminated)
    with pytest.raises(SystemExit, match=r"interrupted: saved step 2 to .*last.pt \(SIGTERM\); continue with --resume"):
        train.main(flags(tmp_path, "run"))
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL              # the handler does not outlive the run
    assert saved_progress(tmp_path / "run")["history"] == []
    monkeypatch.setattr(runs, "heldout_loss", score)
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
    stale = files.tmp_name(tmp_path / "teacher" / "x.safetensors", dead_pid())
    fresh = files.tmp_name(tmp_path / "teacher" / "y.safetensors")
    for f in (stale, fresh):
        open(f, "wb").write(b"half")
    checkpoints.claim(args)
    assert not os.path.exists(stale) and os.path.exists(fresh)            # a live writer's file is left alone
    for umask in (0o022, 0o002):
        previous = os.umask(umask)
        try:
            files.atomic_write(tmp_path / f"f{umask}", lambda f: f.write(b"x"))
        finally:
            os.umask(previous)
        assert os.stat(tmp_path / f"f{umask}").st_mode & 0o777 == 0o666 & ~umask


# ----------------------------------------------------------------------------------------------- a full disk

def test_a_full_disk_is_a_clear_error_and_leaves_the_old_file(whole, tmp_path, monkeypatch):
    """Every write goes to /dev/full, which fails as a full disk does (ENOSPC) for torch.save and safetensors."""
    backbone = backbones.load_backbone("tiny-idefics2")
    checkpoints.load_adapter(whole / "run" / "adapter.safetensors", backbone)
    shutil.copy(whole / "run" / "adapter.safetensors", tmp_path)
    before = (tmp_path / "adapter.safetensors").read_bytes()
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags, mode=0o777: real_open("/dev/full", os.O_WRONLY))
    with pytest.raises(OSError, match=r"could not write .*adapter.safetensors \(No space left on device\); the "
                                      "previous file, if any, is unchanged") as e:
        checkpoints.save_adapter(tmp_path / "adapter.safetensors", backbone)
    assert e.value.__cause__.errno == errno.ENOSPC
    with pytest.raises(OSError, match=r"could not write .*last.pt \(No space left on device\)"):
        files.atomic_write(tmp_path / "last.pt", lambda f: torch.save({"x": torch.zeros(1000)}, f))
    monkeypatch.undo()
    assert (tmp_path / "adapter.safetensors").read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["adapter.safetensors"]


# ----------------------------------------------------------------------------------------------- adapter files

def test_adapter_refuses_another_family_or_other_weights_unless_forced(whole, capsys):
    path = whole / "run" / "adapter.safetensors"
    assert checkpoints.read_settings(path)["family"] == "idefics2"
    for other in (backbones.load_backbone("tiny-idefics2", seed=1), backbones.load_backbone("tiny-llava-interleave")):
        assert M.attention_shape(other.model) == (2, 4, 16)                # the same shape: only the identity differs
        with pytest.raises(ValueError, match="trained on another backbone .*fingerprint .*--force"):
            checkpoints.load_adapter(path, other)
        checkpoints.load_adapter(path, other, force=True)
        assert "warning: --force" in capsys.readouterr().out
    with pytest.raises(ValueError, match="family .saved idefics2, here llava-interleave."):
        checkpoints.load_adapter(path, backbones.load_backbone("tiny-llava-interleave"))
    checkpoints.load_adapter(path, backbones.load_backbone("tiny-idefics2"))       # its own backbone loads silently
    assert capsys.readouterr().out == ""


def test_checkpoint_that_is_not_an_adapter_file_is_a_clear_error(whole, tmp_path):
    adapter = (whole / "run" / "adapter.safetensors").read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(adapter[:len(adapter) // 2])
    for path, message in ((whole / "run", "is a folder; pass the adapter file in it"),
                          (tmp_path / "truncated.safetensors", "not a readable adapter checkpoint"),
                          (whole / "run" / "last.pt", "not a readable adapter checkpoint")):
        with pytest.raises(ValueError, match=message):
            checkpoints.read_settings(path)
    cli = subprocess.run([sys.executable, "evaluate.py", "--model", "tiny-idefics2", "--task", "vqav2", "--data-root",
                          benchmarks.ROOT, "--checkpoint", str(whole / "run")], cwd=ROOT, capture_output=True,
                         text=True)
    assert cli.returncode == 1 and "Traceback" not in cli.stderr
    assert cli.stderr.strip().splitlines()[-1] == f"error: {whole / 'run'} is a folder; pass the adapter file in " \
                                                   "it (train.py writes <out>/adapter.safetensors)"


# -------------------------------------------------------------------------------------------- the teacher cache

def teacher_inputs(tmp_path, n):
    """teacher_states' arguments for the first n VQAv2 training queries, one ICD each, on the tiny twin."""
    args = train.parse_args(flags(tmp_path, "run"))
    backbone = backbones.load_backbone("tiny-idefics2")
    pool = tasks.load_task("vqav2", "train", benchmarks.ROOT)
    queries = pool[:n]
    icds = data.demonstrations([q.id for q in queries], pool, 1, 0)
    return args, backbone, queries, icds, {"id": checkpoints.fingerprint(backbone), "hits": 0, "misses": 0}


def teacher_states(backbone, cfg, queries, icds, cache):
    """Each query's teacher states through the cache, as a micro-batch gets them: read where the cache holds them,
    computed by the teacher and stored where not (lab/run/micro_batches.py)."""
    cache |= {"images": None, "processor": None, "task": cfg.task, "output": "states", "folder": cfg.teacher_cache}
    prepared = micro_batches.prepared_micro_batch(micro_batches.Setup.of(backbone, "vqa", cache), (queries, icds))
    computed = train.run_teacher(backbone, prepared["teacher"]) if prepared["teacher"] else []  # as the loop runs it
    return micro_batches.stored(cache, prepared, computed, cfg.epochs)


def test_a_corrupt_teacher_cache_file_is_computed_again_with_a_warning(whole, tmp_path, capsys):
    args, backbone, queries, icds, cache = teacher_inputs(tmp_path, 2)
    fresh = teacher_states(backbone, args, queries, icds, cache)
    key = teacher_cache.teacher_key(cache["id"], args.task, queries[1], icds[1])
    path = os.path.join(args.teacher_cache, key + ".safetensors")
    good = open(path, "rb").read()
    open(path, "wb").write(good[:len(good) // 3])                          # as a crash or a full disk leaves it
    again = teacher_states(backbone, args, queries, icds, cache)
    assert f"warning: cache file {path} is unusable (unreadable" in capsys.readouterr().out
    assert (cache["hits"], cache["misses"]) == (1, 3)
    for a, b in zip(fresh, again):                                         # batched alone now: float noise only
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    key = teacher_cache.teacher_key(cache["id"], args.task, queries[1], icds[1])
    assert torch.equal(teacher_cache.read_teacher(path, key, again[1].shape), again[1])  # and stored again


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
        evaluate.parse_args(["--model", "tiny-idefics2", "--task", "vqav2", flag, value])
    assert e.value.code == 2 and f"error: {flag} must be at least" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------------- data

def vqa_root(tmp_path, questions, annotations, split="val"):
    folder = tmp_path / "vqav2"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"v2_OpenEnded_mscoco_{split}2014_questions.json").write_text(json.dumps(questions))
    (folder / f"v2_mscoco_{split}2014_annotations.json").write_text(json.dumps(annotations))
    return tmp_path


QUESTION = {"question_id": 7, "image_id": 1, "question": "What colour?"}
ANNOTATION = {"question_id": 7, "answers": [{"answer": "red"}] * 10, "multiple_choice_answer": "red"}


@pytest.mark.parametrize("questions, annotations, message", [
    ([QUESTION], {"annotations": [ANNOTATION]},
     r"questions.json should be a JSON object with a list under 'questions'"),
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
        tasks.load_task("vqav2", "val", str(root))


def test_karpathy_file_of_the_wrong_shape_names_the_file(tmp_path):
    (tmp_path / "coco").mkdir(parents=True)
    (tmp_path / "coco" / "dataset_coco.json").write_text(json.dumps([{"split": "test"}]))
    with pytest.raises(ValueError, match="dataset_coco.json should be a JSON object with a list under 'images'"):
        tasks.load_task("coco", "val", str(tmp_path))


def test_an_empty_split_is_a_clear_error(tmp_path):
    root = vqa_root(tmp_path, {"questions": []}, {"annotations": []})
    with pytest.raises(ValueError, match="vqav2 has no val items to evaluate"):
        evaluate.main(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", str(root), "--shots", "0",
                       "--out", str(tmp_path / "eval")])
    vqa_root(tmp_path, {"questions": [QUESTION]}, {"annotations": [ANNOTATION]}, split="train")
    with pytest.raises(ValueError, match="vqav2 has 1 training items: none left to train on after --n-heldout 4"):
        train.main([*flags(tmp_path, "run"), "--data-root", str(root)])


def test_a_prompt_longer_than_the_context_names_its_item():
    backbone = backbones.load_backbone("tiny-idefics2")
    item = tasks.load_task("vqav2", "train", benchmarks.ROOT)[0]
    long = dataclasses.replace(item, question=" ".join(["quizzical"] * 2000))
    assert backbone.processor.tokenizer.model_max_length == 4096           # the tiny twin's max_position_embeddings
    with pytest.raises(ValueError, match=rf"item {item.id}: its prompt has \d+ tokens, more than the model's 4096 "
                                         "positions"):
        data.prompt_batch(backbone.processor, backbone.family, "vqa", [item, long])
    data.prompt_batch(backbone.processor, backbone.family, "vqa", [item])  # a normal one still passes


# ============================================================================ part 2: the newer surface (issue 24)
# ---------------------------------------------------------------------------------------------- one run a folder

HOLD = "import pathlib, sys, time, train; train.train = lambda args, *_: (pathlib.Path(sys.argv[1]).touch(), " \
       "time.sleep(120)); train.main(sys.argv[2:])"


def test_a_second_process_on_a_claimed_folder_stops_at_once_naming_it_and_the_holder(tmp_path):
    """Two real processes: the first holds --out (its training replaced by a sleep); train.py and evaluate.py on the
    same folder stop with one line naming the folder and the first one's pid; a kill -9 releases the folder."""
    out, ready = tmp_path / "run", tmp_path / "ready"
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(ready), *flags(tmp_path, "run")], cwd=ROOT)
    try:
        while not ready.exists():
            assert first.poll() is None, "the first run ended early"
            time.sleep(0.2)
        second = [[sys.executable, "train.py", *flags(tmp_path, "run", "--lr", "1e-3", "--seed", "1")],
                  [sys.executable, "evaluate.py", "--model", "tiny-idefics2", "--task", "vqav2", "--data-root",
                   benchmarks.ROOT, "--shots", "0", "--out", str(out)]]
        for argv in second:
            cli = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
            assert cli.returncode == 1 and "Traceback" not in cli.stderr, cli.stderr[-2000:]
            assert cli.stderr.strip().splitlines()[-1] == f"error: {out} is in use by another run (pid " \
                                                          f"{first.pid}); wait for it to finish or choose another --out"
        assert not (out / "last.pt").exists()                              # the second run wrote nothing there
    finally:
        first.kill()
        first.wait()
    with checkpoints.locked(str(out)):                                            # the killed holder's lock is gone
        pass


# ------------------------------------------------------------------------------------------ evaluation files

EVAL = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-eval", "3", "--batch-size",
        "3", "--shots", "1"]
KILL_AT_FIRST_PREDICTION = "import json, os, signal, sys, evaluate; dumps = json.dumps; json.dumps = lambda o, " \
    "*a, **k: os.kill(os.getpid(), signal.SIGKILL) if isinstance(o, dict) and 'prediction' in o else " \
    "dumps(o, *a, **k); evaluate.main(sys.argv[1:])"


def read_result(out, name):
    metrics = json.loads((out / f"{name}.metrics.json").read_text())
    return metrics, (out / metrics["predictions"]).read_bytes()


def test_metrics_name_their_predictions_and_a_kill_while_writing_leaves_the_old_pair(tmp_path):
    import hashlib
    evaluate.main([*EVAL, "--out", str(tmp_path)])
    name = "vqav2-val-1-shot-seed0-n3"
    metrics, predictions = read_result(tmp_path, name)
    assert metrics["predictions"] == f"{name}.predictions.jsonl"
    assert metrics["predictions_sha256"] == hashlib.sha256(predictions).hexdigest()
    killed = subprocess.run([sys.executable, "-c", KILL_AT_FIRST_PREDICTION, *EVAL, "--out", str(tmp_path), "--again"],
                            cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL
    assert read_result(tmp_path, name) == (metrics, predictions)             # the old pair, whole and together


def test_results_of_other_seeds_and_protocols_are_other_files(tmp_path):
    for seed in ("0", "1"):
        evaluate.main([*EVAL, "--seed", seed, "--out", str(tmp_path)])
    names = sorted(f for f in os.listdir(tmp_path) if f.endswith(".metrics.json"))
    assert names == ["vqav2-val-1-shot-seed0-n3.metrics.json", "vqav2-val-1-shot-seed1-n3.metrics.json"]
    args = evaluate.parse_args(["--model", "tiny-idefics2", "--task", "seed", "--shots", "2", "--icds", "rices",
                                "--rices-encoder", "enc", "--seed-protocol", "likelihood", "--out", str(tmp_path)])
    assert results.result_name(args, "2-shot-rices", 5, {}).startswith("seed-val-2-shot-rices-likelihood-encoder-")
    info = {"vector_file": "x/m-vqav2-tv-0123456789ab.safetensors", "vector_layer": 1}
    assert results.result_name(evaluate.parse_args(EVAL), "tv", 3, info) == "vqav2-val-tv-layer1-0123456789ab-seed0-n3"


# ---------------------------------------------------------------------------------------------------- caches

def test_a_truncated_or_wrongly_shaped_rices_cache_is_computed_again_with_a_warning(tmp_path, capsys):
    items = tasks.load_task("vqav2", "train", benchmarks.ROOT)[:3]
    encode = lambda images: torch.ones(len(images), 4)
    first = rices.image_features(encode, "enc", items, tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    good = path.read_bytes()
    stale = files.tmp_name(tmp_path / "x.safetensors", dead_pid())
    open(stale, "wb").write(b"half")
    from safetensors.torch import save
    wrong = (save({"features": torch.ones(2, 4)}), save({"features": torch.ones(3, 4, dtype=torch.half)}))
    for bad in (good[:len(good) // 2], *wrong):
        path.write_bytes(bad)
        assert torch.equal(rices.image_features(encode, "enc", items, tmp_path), first)
        assert f"warning: cache file {path} is unusable" in capsys.readouterr().out
        rices.image_features(encode, "enc", items, tmp_path)
        assert capsys.readouterr().out == ""                                 # written again, whole
    assert not os.path.exists(stale)


def test_a_truncated_or_wrongly_shaped_vector_is_computed_again_and_lives_under_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    backbone = backbones.load_backbone("tiny-idefics2")
    args = evaluate.parse_args(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT,
                                "--vector", "tv", "--shots", "1", "--vector-sets", "2", "--vector-heldout", "2",
                                "--out", str(tmp_path / "out")])
    calls = []
    fake = lambda *a: calls.append(1) or {"vectors": torch.ones(2, 32), "losses": torch.tensor([1.0, 0.5])}
    monkeypatch.setattr(vectors, "compute_vector", fake)
    vectors.load_vector(backbone, args)
    path, _ = vectors.vector_path(backbone, args, 1)
    assert path.startswith(str(tmp_path / "out" / "vectors")) and not (tmp_path / "runs").exists()
    good = open(path, "rb").read()
    from safetensors.torch import save
    for bad in (good[:len(good) // 2], save({"vectors": torch.ones(1, 32), "losses": torch.ones(1)})):
        open(path, "wb").write(bad)
        steering, _ = vectors.load_vector(backbone, args)
        assert steering["layer"] == 1 and f"warning: cache file {path} is unusable" in capsys.readouterr().out
    assert len(calls) == 3


def test_a_wrongly_shaped_teacher_cache_file_is_computed_again(tmp_path, capsys):
    args, backbone, queries, icds, cache = teacher_inputs(tmp_path, 1)
    (fresh,) = teacher_states(backbone, args, queries, icds, cache)
    key = teacher_cache.teacher_key(cache["id"], args.task, queries[0], icds[0])
    path = os.path.join(args.teacher_cache, key + ".safetensors")
    files.write_cache(path, {"states": fresh[:, :-1]}, key + "states")      # a right key, a wrong shape
    (again,) = teacher_states(backbone, args, queries, icds, cache)
    assert again.shape == fresh.shape and "is unusable (states is " in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ input files

def seed_root(tmp_path, change):
    root = benchmarks.copy(tmp_path, "seed-bench")
    path = os.path.join(root, "seed-bench", "SEED-Bench.json")
    obj = json.load(open(path))
    change(obj["questions"])
    open(path, "w").write(json.dumps(obj))
    return root


@pytest.mark.parametrize("change, message", [
    (lambda qs: qs[0].update(choice_b=""), r"question #0 .* its choice_b is ''"),
    (lambda qs: qs[0].update(question=None), r"question #0 .* its question is None"),
    (lambda qs: qs[1].update(question_id=qs[0]["question_id"]), r"question #1 .* duplicate question_id"),
    (lambda qs: qs[3].update(question_type_id=42), r"question #3 .* question_type_id 42 is not in its question_type"),
])
def test_seed_bench_questions_are_checked_when_read(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        mme_seed.read_seed(seed_root(tmp_path, change))


def test_seed_bench_questions_that_are_not_a_list_name_the_file(tmp_path):
    root = seed_root(tmp_path, lambda qs: None)
    path = os.path.join(root, "seed-bench", "SEED-Bench.json")
    open(path, "w").write(json.dumps({"questions": 5, "question_type": {"Scene Understanding": 1}}))
    with pytest.raises(ValueError, match=rf"seed: {path} needs `questions`.*not a list"):
        mme_seed.read_seed(root)


@pytest.mark.parametrize("question, message", [(None, "its question is None"), ("  ", "its question is '  '")])
def test_a_null_or_empty_question_names_the_file_and_entry(tmp_path, question, message):
    root = vqa_root(tmp_path, {"questions": [{**QUESTION, "question": question}]}, {"annotations": [ANNOTATION]})
    with pytest.raises(ValueError, match=rf"vqav2: entry 0 of .*questions.json .*: {message}"):
        tasks.load_task("vqav2", "val", str(root))


def test_duplicate_vqa_question_ids_are_an_error(tmp_path):
    root = vqa_root(tmp_path, {"questions": [QUESTION, QUESTION]}, {"annotations": [ANNOTATION]})
    with pytest.raises(ValueError, match=r"entry 1 of .*questions.json .*duplicate question_id 7"):
        tasks.load_task("vqav2", "val", str(root))


def mme_file(tmp_path):
    root = benchmarks.copy(tmp_path, "mme")
    return root, os.path.join(root, "mme", "existence", "0000.txt")


def test_undecodable_text_names_the_file_and_a_byte_order_mark_is_stripped(tmp_path):
    root, path = mme_file(tmp_path)
    text = open(path, "rb").read()
    open(path, "wb").write(b"\xef\xbb\xbf" + text)
    assert mme_seed.read_mme(root, ("existence",))[0].question == text.decode().split("\t")[0]
    open(path, "wb").write(text.replace(b"Is", b"\xff\xfe", 1))
    with pytest.raises(ValueError, match=rf"mme: {path} is not UTF-8 text \(byte 0"):
        mme_seed.read_mme(root, ("existence",))
    seed = seed_root(tmp_path, lambda qs: None)
    json_path = os.path.join(seed, "seed-bench", "SEED-Bench.json")
    raw = open(json_path, "rb").read()
    open(json_path, "wb").write(b"\xef\xbb\xbf" + raw)
    assert mme_seed.read_seed(seed)
    open(json_path, "wb").write(raw.replace(b"What", b"Wh\xe0t", 1))
    with pytest.raises(ValueError, match=rf"seed: {json_path} is not UTF-8 text"):
        mme_seed.read_seed(seed)


def test_an_mme_line_without_a_question_is_an_error(tmp_path):
    root, path = mme_file(tmp_path)
    open(path, "w").write("\tYes\nIs it red?\tNo\n")
    with pytest.raises(ValueError, match=rf"mme: {path} line 1: expected"):
        mme_seed.read_mme(root, ("existence",))


@pytest.mark.parametrize("change, message", [
    (lambda coco: coco.pop("categories"), r"instances_val2014.json should be a JSON object with a list under "
                                          r"'categories'"),
    (lambda coco: coco["annotations"][0].update(category_id=99), r"entry 0 of .*instances_val2014.json .*: "
                                                                 r"category_id 99 is not among the file's categories"),
])
def test_coco_instances_without_categories_or_with_unknown_ones_are_named(tmp_path, change, message):
    items = tasks.load_task("coco", "val", benchmarks.copy(tmp_path, "coco"))[:2]
    path = readers.instances_path(str(tmp_path), "val2014")
    coco = json.load(open(path))
    change(coco)
    open(path, "w").write(json.dumps(coco))
    with pytest.raises(ValueError, match=message):
        readers.read_instances(items)


def test_an_oversized_image_is_refused_by_name_with_its_size(tmp_path):
    import io
    import struct
    import zlib
    from PIL import Image
    small = io.BytesIO()
    Image.new("RGB", (1, 1)).save(small, format="PNG")
    ihdr = b"IHDR" + struct.pack(">II", 20000, 20000) + small.getvalue()[24:29]
    png = small.getvalue()[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + small.getvalue()[33:]
    (tmp_path / "big.png").write_bytes(png)                                # a 1 x 1 PNG whose header says 20000 x 20000
    with pytest.raises(OSError, match=r"item 3: cannot read its image .*big.png as .* \(Image size \(400000000 "
                                      r"pixels\)"):
        data.load_image(data.Item(3, str(tmp_path / "big.png"), "q", ("a",), "a"))


def test_a_data_root_or_cache_that_is_a_file_is_named(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match=f"--data-root {tmp_path / 'file'} is a file"):
        tasks.load_task("vqav2", "train", str(tmp_path / "file"))
    for parse, flag in ((train.parse_args, "--rices-cache"), (evaluate.parse_args, "--rices-cache"),
                        (train.parse_args, "--out"), (evaluate.parse_args, "--out")):
        with pytest.raises(SystemExit):
            parse(["--model", "tiny-idefics2", "--task", "vqav2", flag, str(tmp_path / "file")])
        assert f"error: {flag} {tmp_path / 'file'} is a file; it must be a folder" in capsys.readouterr().err


def test_stale_temporary_folders_of_a_killed_generation_are_removed(tmp_path):
    stale = files.tmp_name(tmp_path / "toy-icl" / "colour", dead_pid())
    os.makedirs(os.path.join(stale, "coco"))
    tasks.load_task("toy-icl-colour", "val", str(tmp_path))
    assert sorted(os.listdir(tmp_path / "toy-icl")) == ["colour"]


# ----------------------------------------------------------------------------------------------------- flags

@pytest.mark.parametrize("flag, value", [("--warmup", "2"), ("--warmup", "1"), ("--warmup", "-0.1"),
                                         ("--lr", "0"), ("--clip", "0"), ("--lam", "-1"), ("--weight-decay", "-1")])
def test_train_rejects_fractions_and_rates_out_of_range(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args([*TINY, flag, value])
    assert e.value.code == 2 and f"error: {flag} must be" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--vector-sets", "0"), ("--vector-heldout", "0"), ("--fv-heads", "0"),
                                         ("--fv-trials", "0"), ("--vector-layer", "-1"), ("--new-tokens", "0"),
                                         ("--attention-tokens", "0"), ("--threads", "0"), ("--bench-shots", "-8")])
def test_evaluate_rejects_counts_out_of_range(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        evaluate.parse_args(["--model", "tiny-idefics2", "--task", "vqav2", flag, value])
    assert e.value.code == 2 and f"error: {flag} must be at least" in capsys.readouterr().err


@pytest.mark.parametrize("train_args, message", [
    ("--epochs '1", "cannot be split into flags (No closing quotation)"),
    ("--epochs 0", "train.py says: --epochs must be at least 1 (got 0)"),
    ("--no-such-flag", "train.py says: unrecognized arguments: --no-such-flag")])
def test_curve_train_args_are_checked_before_any_work(train_args, message, capsys, monkeypatch):
    monkeypatch.setattr(backbones, "load_backbone", lambda *a, **k: pytest.fail("a backbone was loaded"))
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", "tiny-idefics2", "--task", "vqav2", "--curve", f"--train-args={train_args}"])
    assert e.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------- fail fast

def test_bad_data_is_reported_before_the_backbone_loads(tmp_path, monkeypatch):
    root = vqa_root(tmp_path, {"questions": [{**QUESTION, "question": None}]}, {"annotations": [ANNOTATION]})
    vqa_root(tmp_path, {"questions": [{**QUESTION, "question": None}]}, {"annotations": [ANNOTATION]}, split="train")
    monkeypatch.setattr(backbones, "load_backbone", lambda *a, **k: pytest.fail("the backbone was loaded first"))
    with pytest.raises(ValueError, match="its question is None"):
        train.main([*flags(tmp_path, "run"), "--data-root", str(root)])
    with pytest.raises(ValueError, match="its question is None"):
        evaluate.main(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", str(root), "--shots", "0",
                       "--out", str(tmp_path / "eval")])


# --------------------------------------------------------------------------------- part 3: nothing of the user's

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
    args = train.parse_args(flags(tmp_path, "run", "--rices-cache", str(tmp_path / "rices")))
    folders = [args.out, args.teacher_cache, args.rices_cache, str(tmp_path / "data"), str(tmp_path)]
    mine = [p for f in folders for p in user_files(f)]
    stale = [files.tmp_name(os.path.join(f, "x.safetensors"), dead_pid()) for f in folders]
    for p in stale:
        open(p, "w").write("half")
    checkpoints.claim(args)
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


def seed2_root(tmp_path, change):
    root = benchmarks.copy(tmp_path, "seed-bench-2")
    path = os.path.join(root, "seed-bench-2", mme_seed.SEED2_FILE)
    obj = json.load(open(path))
    change([q for q in obj["questions"] if q["subpart"] == mme_seed.SEED2_SUBPART])
    open(path, "w").write(json.dumps(obj))
    return root


@pytest.mark.parametrize("change, message", [
    (lambda qs: qs[1].update(question_id=qs[0]["question_id"]), r"question #1 .* duplicate question_id"),
    (lambda qs: qs[0].update(choice_b=""), r"question #0 .* its choice_b is ''"),
    (lambda qs: qs[0].update(choice_d=None), r"question #0 .* its choice_d is None"),
    (lambda qs: qs[0].update(question="  "), r"question #0 .* its question is '  '"),
    (lambda qs: qs[0].update(question_id="1_1000000"), r"question #0 .* question_id '1_1000000' is not of the form"),
    (lambda qs: qs[0].update(question_id="1_01"), r"question #0 .* question_id '1_01' is not of the form"),
    (lambda qs: qs[0].update(question_id=7), r"question #0 .* question_id 7 is not of the form"),
])
def test_seed_bench_2_questions_get_seed_bench_1s_checks(tmp_path, change, message):
    with pytest.raises(ValueError, match=message):
        mme_seed.read_seed2(seed2_root(tmp_path, change))


def test_seed_bench_2_ids_cannot_collide():
    assert mme_seed.seed2_id("2_0") == 2_000_000 and mme_seed.seed2_id("1_999999") == 1_999_999
    for bad in ("1_1000000", "-1_5", "1_-5", "1_+5", "1_5_0", "1_٣"):
        with pytest.raises(ValueError, match="is not of the form"):
            mme_seed.seed2_id(bad)


def test_an_mme_image_present_as_jpg_and_png_is_an_error_naming_both(tmp_path):
    root = benchmarks.copy(tmp_path, "mme")
    folder = os.path.join(root, "mme", "existence")
    jpg = sorted(f for f in os.listdir(folder) if f.endswith(".jpg"))[0]
    shutil.copy(os.path.join(folder, jpg), os.path.join(folder, jpg[:-4] + ".png"))
    with pytest.raises(ValueError, match=rf"mme: .*{jpg} and .*{jpg[:-4]}.png are two images for one question file"):
        mme_seed.read_mme(root, ("existence",))


def test_a_cache_file_passed_as_model_is_refused_by_content_naming_it(tmp_path):
    path = str(tmp_path / "features.safetensors")
    files.write_cache(path, {"features": torch.ones(3, 4)}, "key")           # a cache file: no sha256 of its weights
    with pytest.raises(ValueError, match=rf"{path} is not a toy backbone \(no checksum"):
        backbones.load_backbone(path)
    with_digest = lambda tensors: files.atomic_write(path, lambda f: f.write(save(
        tensors, metadata={"sha256": files.weights_digest(tensors)})))
    with_digest({"features": torch.ones(3, 4)})                             # a valid checksum, other tensors
    with pytest.raises(ValueError, match=rf"{path} is not a toy backbone: it holds 1 tensors \(features\)"):
        backbones.load_backbone(path)
    real = load_file(toy_backbone.TOY_REFERENCE)
    name = sorted(real)[0]
    with_digest({**real, name: torch.zeros(*real[name].shape[:-1], real[name].shape[-1] + 1)})  # one shape off
    with pytest.raises(ValueError, match=rf"{path} is not a toy backbone: {name} is"):
        backbones.load_backbone(path)


def test_a_model_folder_whose_config_is_not_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"--model: {tmp_path / 'config.json'} is not valid JSON"):
        families.family_of(str(tmp_path))


@pytest.mark.parametrize("out, overwrite, message", [
    ("mytoy", False, r"--out .*mytoy: a toy backbone must be a .safetensors file"),
    ("folder.safetensors", True, r"--out .*folder.safetensors is a folder"),
    ("afile/b.safetensors", False, r"--out .*afile/b.safetensors: .*afile is a file, not a folder"),
    ("readonly/b.safetensors", False, r"--out .*readonly/b.safetensors: cannot write in .*readonly"),
    ("old.safetensors", False, r"--out .*old.safetensors exists; pass --overwrite"),
])
def test_build_toy_checks_out_before_it_builds(tmp_path, monkeypatch, out, overwrite, message):
    (tmp_path / "folder.safetensors").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "old.safetensors").write_text("x")
    (tmp_path / "readonly").mkdir(mode=0o555)
    monkeypatch.setattr(toy_backbone, "build_toy", lambda *a: pytest.fail("built before --out was checked"))
    real_open = os.open
    def refused(path, *a):  # as a read-only folder answers (root could write into one with mode 555)
        if "readonly" in str(path):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, *a)
    monkeypatch.setattr(os, "open", refused)
    with pytest.raises(ValueError, match=message):
        train.main(["--build-toy", "--out", str(tmp_path / out), *(["--overwrite"] if overwrite else [])])
    assert sorted(os.listdir(tmp_path)) == ["afile", "folder.safetensors", "old.safetensors", "readonly"]


def test_a_kill_between_predictions_and_metrics_leaves_no_stale_metrics(tmp_path, monkeypatch):
    evaluate.main([*EVAL, "--out", str(tmp_path)])
    name = "vqav2-val-1-shot-seed0-n3"
    assert (tmp_path / f"{name}.metrics.json").exists()
    def killed(path, obj, indent=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(files, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        evaluate.main([*EVAL, "--out", str(tmp_path), "--again"])
    assert (tmp_path / f"{name}.predictions.jsonl").exists() and not (tmp_path / f"{name}.metrics.json").exists()


def test_a_lock_that_cannot_be_written_names_it_and_is_not_left(tmp_path, monkeypatch):
    def full(fd, b, offset):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match=rf"could not write the lock file {tmp_path / 'run' / '.lock'} \(No space"):
        with checkpoints.locked(str(tmp_path / "run")):
            pass
    assert os.listdir(tmp_path / "run") == []


def test_an_out_that_cannot_be_made_names_the_flag(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=rf"--out {tmp_path / 'file' / 'run'}: cannot make the folder"):
        train.main([*TINY, "--out", str(tmp_path / "file" / "run")])


@pytest.mark.parametrize("extra, message", [
    (["--task", "vqav2", "--seed-protocol", "likelihood"], "--seed-protocol applies to"),
    (["--task", "vqav2", "--seed-protocol", "generate"], "--seed-protocol applies to the SEED-Bench tasks"),
])
def test_seed_flags_that_cannot_apply_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--model", "tiny-idefics2", *extra])
    assert message in capsys.readouterr().err
    args = evaluate.parse_args(["--model", "tiny-idefics2", "--task", "seed"])
    assert args.seed_protocol == "generate"


def test_train_args_may_start_with_a_dash_without_an_equals_sign(capsys):
    args = evaluate.parse_args(["--model", "tiny-idefics2", "--task", "vqav2", "--curve", "--train-args",
                                "--epochs 2"])
    assert args.train_args == "--epochs 2"
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--model", "tiny-idefics2", "--task", "vqav2", "--curve", "--train-args", "--resume"])
    assert "--train-args '--resume': train.py says:" in capsys.readouterr().err


def test_small_backbones_on_cpu_run_on_one_thread_unless_threads_says():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert backbones.choose_threads("idefics2") == 2                             # a real backbone: torch's choice
        for name in ("tiny-idefics2", "toy-idefics2", "runs/x/backbone.safetensors"):
            torch.set_num_threads(2)
            assert backbones.choose_threads(name) == 1
        assert backbones.choose_threads("toy-idefics2", 2) == 2
        assert train.parse_args(["--model", "toy-idefics2", "--threads", "3"]).threads == 3
    finally:
        torch.set_num_threads(before)
