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
    with pytest.raises(OSError, match=r"item 7: cannot read its image .*red.eps as JPEG/PNG/WEBP/GIF/BMP/TIFF \("):
        D.load_image(item)
    monkeypatch.setattr(parquet, "CACHE", str(tmp_path / "cache"))
    shard = vqav2_shard(tmp_path / "hub", eps_bytes())
    with pytest.raises(ValueError, match=rf"{shard} row 0 \(question_id 0\) is malformed: its image bytes are not a "
                                         r"readable image \(not an image of the formats read"):
        tasks.load_task("vqav2", "val", str(tmp_path / "hub"))
    assert not ghostscript.exists()  # before: the own task read, and load_image ran gs (a CalledProcessError)


# ---------------------------------------------- items 3 and 4: the run records its task and data; other ones refused

def photos(folder, n):
    """n small JPEGs of distinct colours in folder/img/, their paths relative to folder."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for k in range(n):
        Image.new("RGB", (32, 24), (30 * k % 256, 90, 200 - 20 * k % 200)).save(folder / "img" / f"{k}.jpg")
    return [f"img/{k}.jpg" for k in range(n)]


def vqa_task(folder, n=8, name="data.jsonl"):
    records = [{"id": k, "image": p, "question": "What colour is it?", "answer": f"colour {k % 3}"}
               for k, p in enumerate(photos(folder, n))]
    return jsonl(folder / name, records)


def test_two_tasks_of_one_name_get_two_run_folders_and_the_benchmarks_keep_theirs(tmp_path):
    import evaluate
    import train
    a, b = vqa_task(tmp_path / "a"), vqa_task(tmp_path / "b")
    mine = vqa_task(tmp_path / "my", name="vqav2.jsonl")
    outs = {task: train.parse_args([*TINY, "--task", task]).out for task in (a, b, mine, "vqav2")}
    assert len(set(outs.values())) == 4 and outs["vqav2"] == "runs/tiny-idefics2-vqav2-hyper-icl"
    assert outs[a].startswith("runs/tiny-idefics2-data-") and outs[a].endswith("-hyper-icl")
    assert train.parse_args([]).out == "runs/toy-idefics2-toy-icl-colour-hyper-icl"  # the default job's, as README
    assert evaluate.parse_args([*TINY, "--task", a, "--shots", "0"]).out != \
        evaluate.parse_args([*TINY, "--task", b, "--shots", "0"]).out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-step run of the tiny twin on a task of one's own in one file: (task file, run folder)."""
    import train
    folder = tmp_path_factory.mktemp("own")
    task, out = vqa_task(folder), str(folder / "run")
    train.main([*TINY, "--task", task, "--out", out, "--n-train", "2", "--n-heldout", "1", "--batch-size", "1",
                "--shots", "1", "--epochs", "1", "--workers", "0"])
    return task, out


def test_an_adapter_of_another_task_is_not_scored_as_this_tasks(trained, tmp_path, monkeypatch, capsys):
    import evaluate
    from lab.run import checkpoints
    from lab.scores import results
    task, out = trained
    other = vqa_task(tmp_path / "other")
    monkeypatch.chdir(tmp_path)
    default = results.default_checkpoint("tiny-idefics2", other)  # where train.py --task other would write
    os.makedirs(os.path.dirname(default))
    os.link(os.path.join(out, "adapter.safetensors"), default)
    with pytest.raises(SystemExit):
        evaluate.parse_args([*TINY, "--task", other])
    said = capsys.readouterr().err
    assert f"adapter.safetensors is an adapter of the task {os.path.realpath(task)}, not of {other}" in said
    assert evaluate.parse_args([*TINY, "--task", other, "--checkpoint", default]).checkpoint == default  # named: taken
    record = checkpoints.read_record(default)
    assert record["task"] == os.path.realpath(task) and len(record["data"]) == 16 and record["n_train"] == 2


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
            train.main([*TINY, "--task", task, "--out", str(copy), "--n-train", "2", "--n-heldout", "1",
                        "--batch-size", "1", "--shots", "1", "--epochs", "1", "--workers", "0", "--resume"])
        assert (copy / "last.pt").read_bytes() == last
        capsys.readouterr()
        evaluate.parse_args([*TINY, "--task", task, "--checkpoint", str(copy / "adapter.safetensors")])
        assert "warning: the training pool of" in capsys.readouterr().out
    finally:
        lines = open(task).read().splitlines(keepends=True)
        open(task, "w").write("".join(lines[:-1]))


# --------------------------------------------------------------- item 5: one image written two ways is one image

def test_an_image_written_two_ways_lands_on_one_side_of_the_split(tmp_path):
    paths = photos(tmp_path, 12)
    ways = lambda k, p: [p, "./" + p, str(tmp_path / p)][k % 3]  # relative, ./relative, absolute
    records = [{"id": f"{k}-{j}", "image": ways(k + j, p), "question": f"Question {j}?", "answer": "yes"}
               for k, p in enumerate(paths) for j in range(2)]
    task = jsonl(tmp_path / "ways.jsonl", records)
    pool, rest = (tasks.load_task(task, s) for s in D.SPLITS)
    real = lambda part: {os.path.realpath(it.image_path) for it in part}
    assert not real(pool) & real(rest) and len(real(pool)) == len(real(rest)) == 6  # before: 6 of 12 on both sides


# ----------------------------------------------------------------------------- item 10: a FIFO as a parquet shard

def test_a_fifo_named_as_a_shard_is_refused_without_waiting(tmp_path):
    import threading
    shard = tmp_path / "vqav2" / "data" / "validation-00000-of-00001.parquet"
    shard.parent.mkdir(parents=True)
    os.mkfifo(shard)
    said = []

    def read():
        try:
            tasks.load_task("vqav2", "val", str(tmp_path))
        except ValueError as e:
            said.append(str(e))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(20)
    if reader.is_alive():  # before: pyarrow opened the FIFO and waited for a writer forever; let it go
        os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))
    assert said and f"{shard} is not a regular file (a FIFO" in said[0]


# ------------------------------------------------------------------- item 11: --new-tokens outside --benchmark

def test_new_tokens_bounds_every_evaluation(tmp_path, monkeypatch):
    import benchmarks
    import evaluate
    asked = []
    real = evaluate.generate
    monkeypatch.setattr(evaluate, "generate", lambda b, inputs, n, *a: asked.append(n) or real(b, inputs, n, *a))
    flags = [*TINY, "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-eval", "2", "--shots", "0", "--out",
             str(tmp_path), "--workers", "0"]
    metrics = evaluate.main([*flags, "--new-tokens", "1"])
    assert asked == [1] and metrics["new_tokens"] == 1  # before: the task's 5, the flag taken without effect
    with pytest.raises(ValueError, match="holds the result of other settings: new_tokens 1 \\(now 5\\)"):
        evaluate.main(flags)  # the result of 1 token is not replaced by one of 5 under the same name


# ----------------------------------------------------------------------- item 12: an adapter of NaN or inf

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
        evaluate.main([*TINY, "--task", task, "--checkpoint", str(tmp_path / "nan.safetensors"), "--workers", "0"])
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".metrics.json")]  # before: scored, 0.00 written


# --------------------------------------------------------- item 14: a 1-pixel side, which Idefics2's splitting divides

def test_an_image_with_a_one_pixel_side_is_refused_naming_the_line_or_the_item(tmp_path):
    Image.new("RGB", (1, 1)).save(tmp_path / "dot.png")
    Image.new("RGB", (3000, 1)).save(tmp_path / "line.png")
    task = jsonl(tmp_path / "tiny.jsonl", [{"id": 1, "image": "dot.png", "question": "What?", "answer": "a dot"}])
    with pytest.raises(ValueError, match=rf"{task} line 1, field `image`: .*dot.png: its image is 1 x 1 pixels; each "
                                         "side must be at least 2"):
        tasks.load_task(task, "train")
    with pytest.raises(OSError, match=r"item 4: cannot read its image .*line.png as .* \(3000 x 1 pixels; each side"):
        D.load_image(D.Item(4, str(tmp_path / "line.png"), "What?", ("a line",), "a line"))  # before: a ZeroDivision-
        # Error inside transformers' Idefics2 image splitting, after the model loaded, naming no item


# --------------------------------------------------------------------------------------- item 15, the smaller ones

def test_a_category_per_record_names_why_the_training_pool_is_empty(tmp_path):
    records = [{"id": k, "image": p, "question": "What?", "answer": "x", "category": f"c{k}"}
               for k, p in enumerate(photos(tmp_path, 6))]
    task = jsonl(tmp_path / "each.jsonl", records)
    with pytest.raises(ValueError, match=r"the training pool is empty: the images are split category by category "
                                         r"\(field `category`\), round\(0.5 x images\) of each, and each of its 6 "
                                         r"categories has 1 image\(s\) at most"):
        tasks.load_task(task, "train")  # before: "has 0 training items: none left to train on", later, no reason
    assert len(tasks.load_task(task, "val")) == 6


def test_attention_tokens_beyond_memory_is_one_line_naming_the_flag():
    from lab.models import backbones
    from lab.studies import table6
    model = backbones.load_backbone("tiny-idefics2").model
    with pytest.raises(ValueError, match=r"^--attention-tokens 1000000000: one attention layer at 1000000000 tokens "
                                         r"does not fit in memory \(.*\); lower --attention-tokens$"):
        table6.attention_benchmark(model, T=10 ** 9, rounds=1)  # before: torch's RuntimeError traceback


def test_the_teacher_cache_keys_an_image_by_its_bytes_not_its_size_and_time(tmp_path):
    from lab.run import teacher_cache
    first, second = tmp_path / "a.bmp", tmp_path / "b.bmp"  # uncompressed: the same size
    Image.new("RGB", (8, 8), (255, 0, 0)).save(first)
    Image.new("RGB", (8, 8), (0, 0, 255)).save(second)
    item = D.Item(1, str(first), "What colour?", ("red",), "red")
    before = teacher_cache.teacher_key("b", "t", item, [])
    stat = os.stat(first)
    assert stat.st_size == os.path.getsize(second)  # a same-size replacement, its time put back
    os.replace(second, first)
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert teacher_cache.teacher_key("b", "t", item, []) != before  # before: the same key, the stale states read


@pytest.mark.parametrize("script, flags, says", [
    ("train", ["--temperature", "2"], "--temperature applies with --anchor kl"),
    ("train", ["--virtual-tokens", "4"], "--virtual-tokens applies to --method hificl"),
    ("train", ["--method", "hificl", "--anchor-norm", "first"], "--anchor-norm applies with an anchor"),
    ("train", ["--no-teacher-cache", "--teacher-cache", "elsewhere"], "--teacher-cache applies without --no-teacher"),
    ("train", ["--processor", "folder"], "--processor applies with --plan"),
    ("train", ["--rices-encoder", "clip"], "--rices-encoder applies with --icds rices"),
    ("evaluate", ["--shots", "0", "--force"], "--force applies to a --checkpoint"),
    ("evaluate", ["--shots", "2", "--rices-encoder", "clip"], "--rices-encoder applies with --icds rices"),
    ("evaluate", ["--shots", "0", "--attention-tokens", "64"], "--attention-tokens applies with --benchmark or"),
    ("evaluate", ["--shots", "0", "--seed-protocol", "likelihood"], "--seed-protocol applies to the SEED-Bench"),
])
def test_a_flag_of_another_method_or_mode_is_refused_naming_it(script, flags, says, capsys):
    import evaluate
    import train
    with pytest.raises(SystemExit):
        (train if script == "train" else evaluate).parse_args([*TINY, *flags])
    assert f"{says}" in capsys.readouterr().err  # before: taken, doing nothing, without a word


def test_the_flags_of_the_method_or_mode_in_use_are_taken():
    import evaluate
    import train
    assert train.parse_args([*TINY, "--method", "live", "--temperature", "2"]).temperature == 2
    assert train.parse_args([*TINY, "--method", "hificl", "--virtual-tokens", "4"]).virtual_tokens == 4
    assert evaluate.parse_args([*TINY, "--benchmark-attention", "--attention-tokens", "64"]).attention_tokens == 64
