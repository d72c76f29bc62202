"""The teacher cache (lab/run/teacher_cache.py): reused states equal fresh ones, keyed by everything they depend on
(the images' bytes, the processor), recomputed when corrupt or wrongly shaped."""
import json
import os
import shutil

import torch
from PIL import Image

import benchmarks
import data
import train
from helpers import lab_train, lab_train_args, run_flags, teacher_states, TRAIN, with_flag
from lab.datasets import tasks
from lab.disk import files
from lab.models import backbones
from lab.run import adapter_files, teacher_cache


def test_reused_teacher_states_equal_fresh_ones_and_are_keyed(setup, tmp_path):
    args, backbone, queries, icds = setup
    args.teacher_cache, args.no_teacher_cache = str(tmp_path), False
    pieces = data.query_pieces(backbone.processor, backbone.family, "vqa", queries)
    cache = {"id": adapter_files.fingerprint(backbone), "hits": 0, "misses": 0}
    first, again = (teacher_states(backbone, args, queries, icds, cache) for _ in range(2))
    fresh = train.run_teacher(backbone, data.teacher_batch(backbone.processor, backbone.family, "vqa", pieces, icds))
    assert cache["misses"] == len(queries) and cache["hits"] == len(queries)
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(first, again, fresh))
    key = teacher_cache.teacher_key(cache["id"], args.task, queries[0], icds[0])
    assert key != teacher_cache.teacher_key(cache["id"], args.task, queries[0], icds[1])   # other demonstrations
    other = adapter_files.fingerprint(backbones.load_backbone(args.model, seed=1))
    assert key != teacher_cache.teacher_key(other, args.task, queries[0], icds[0])         # other backbone
    assert key != teacher_cache.teacher_key(cache["id"], "coco", queries[0], icds[0])       # other task


def test_the_teacher_cache_is_recomputed_when_the_images_or_the_processor_change(tmp_path, twin_folder, capsys):
    root, model = benchmarks.copy(tmp_path / "data", "vqav2", "coco"), tmp_path / "model"
    shutil.copytree(twin_folder, model)
    run = with_flag(with_flag(TRAIN, "--data-root", root), "--model", str(model))
    run += ["--out", str(tmp_path / "run"), "--teacher-cache", str(tmp_path / "teacher"), "--overwrite"]

    def counts():
        lab_train(run)
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


def test_the_teacher_cache_keys_an_image_by_its_bytes_not_its_size_and_time(tmp_path):
    from lab.run import teacher_cache
    first, second = tmp_path / "a.bmp", tmp_path / "b.bmp"  # uncompressed: the same size
    Image.new("RGB", (8, 8), (255, 0, 0)).save(first)
    Image.new("RGB", (8, 8), (0, 0, 255)).save(second)
    item = data.Item(1, str(first), "What colour?", ("red",), "red")
    before = teacher_cache.teacher_key("b", "t", item, [])
    stat = os.stat(first)
    assert stat.st_size == os.path.getsize(second)  # a same-size replacement, its time put back
    os.replace(second, first)
    os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert teacher_cache.teacher_key("b", "t", item, []) != before  # before: the same key, the stale states read


def teacher_inputs(tmp_path, n):
    """teacher_states' arguments for the first n VQAv2 training queries, one ICD each, on the tiny twin."""
    args = lab_train_args(run_flags(tmp_path, "run"))
    backbone = backbones.load_backbone("tiny-idefics2")
    pool = tasks.load_task("vqav2", "train", benchmarks.ROOT)
    queries = pool[:n]
    icds = data.demonstrations([q.id for q in queries], pool, 1, 0)
    return args, backbone, queries, icds, {"id": adapter_files.fingerprint(backbone), "hits": 0, "misses": 0}


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


def test_a_wrongly_shaped_teacher_cache_file_is_computed_again(tmp_path, capsys):
    args, backbone, queries, icds, cache = teacher_inputs(tmp_path, 1)
    (fresh,) = teacher_states(backbone, args, queries, icds, cache)
    key = teacher_cache.teacher_key(cache["id"], args.task, queries[0], icds[0])
    path = os.path.join(args.teacher_cache, key + ".safetensors")
    files.write_cache(path, {"states": fresh[:, :-1]}, key + "states")      # a right key, a wrong shape
    (again,) = teacher_states(backbone, args, queries, icds, cache)
    assert again.shape == fresh.shape and "is unusable (states is " in capsys.readouterr().out
