"""--plan and the teacher cache that fits (lab/studies/run_plan.py), on real-processor twins (tools/twins.py), CPU: the
plan's token counts are the collated rows', its cache size the bytes a run writes, it loads no weights; a cache that
does not fit stops the run before its first step; Idefics2's image splitting is explicit (flag, printed source, cache
key)."""
import os
from collections import namedtuple

import pytest

import benchmarks
import data
import train
from lab.datasets import tasks
from lab.disk import files
from lab.models import backbones
from lab.run import teacher_cache
from lab.studies import run_plan
from twins import write_twin
from helpers import lab, lab_args, lab_train, lab_train_args, no_weights


Free = namedtuple("Free", "total used free")


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """One folder per real-processor twin, written once for the module."""
    root = tmp_path_factory.mktemp("twins")
    return {name: write_twin(name, root / name) for name in ("idefics2", "idefics2-split", "llava-onevision")}


def recorded_rows(monkeypatch):
    """Record the tokens of every row data.teacher_batch and data.student_batch collate, by query id."""
    rows = {"teacher": {}, "student": {}}
    for name in rows:
        original = getattr(data, f"{name}_batch")

        def recording(processor, family, kind, pieces, *icds, original=original, name=name):
            batch = original(processor, family, kind, pieces, *icds)
            if name == "student" or any(icds[0]):  # student_batch calls teacher_batch without ICDs: not a teacher row
                rows[name].update(zip((p["id"] for p in pieces), batch["attention_mask"].sum(1).tolist()))
            return batch
        monkeypatch.setattr(data, f"{name}_batch", recording)
    return rows


@pytest.mark.parametrize("name, shots", [("idefics2", "8"), ("idefics2-split", "2"), ("llava-onevision", "2")])
def test_the_plan_is_what_a_run_collates_and_caches(twins, name, shots, tmp_path, monkeypatch, capsys):
    flags = ["--model", twins[name], "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-train", "3",
             "--n-heldout", "1", "--batch-size", "3", "--shots", shots, "--epochs", "1", "--max-steps", "1",
             "--out", str(tmp_path / "run")]
    with monkeypatch.context() as m:
        no_weights(m)
        planned = lab(["plan", "train", *flags, "--plan", "cpu"])  # float32: the dtype a CPU run caches in
    assert not os.path.exists(tmp_path / "run")  # the plan makes no folder
    rows = recorded_rows(monkeypatch)
    lab_train(flags)
    for kind in ("teacher", "student"):  # every sampled query, the same tokens as the run's collated row
        assert planned["rows"][kind] == {q: rows[kind][q] for q in planned["rows"][kind]}, kind
    folder = tmp_path / "run" / "teacher"
    files = [f for f in os.listdir(folder) if f.endswith(".safetensors")]
    assert len(files) == 3 * 2  # each query's states and answer logits, from its one teacher pass
    measured = sum(os.path.getsize(folder / f) for f in files)
    assert abs(planned["cache"] - measured) <= 0.05 * measured, (planned["cache"], measured)
    out = capsys.readouterr().out
    assert f"teacher ({shots} ICDs)" in out and "teacher cache:" in out and "peak memory, training" in out


@pytest.mark.parametrize("twin, splitting, per_query", [("idefics2", "checkpoint", 21e6), ("idefics2", "on", 89e6),
                                                        ("idefics2-split", "checkpoint", 89e6)])
def test_the_paper_plan_on_a_twins_processor_loads_no_weights(twins, twin, splitting, per_query, monkeypatch, capsys):
    no_weights(monkeypatch)
    planned = lab(["plan", "train", "--plan", "cuda", "--model", "idefics2", "--processor", twins[twin], "--task",
                   "vqav2", "--data-root", benchmarks.ROOT, "--image-splitting", splitting])
    n = len(planned["rows"]["query"])
    assert planned["cache"] / planned["queries"] == pytest.approx(per_query, rel=0.1)  # issue 30: ~21 MB, ~89 MB
    out = capsys.readouterr().out
    source = "--image-splitting on" if splitting == "on" else "the checkpoint's processor config"
    assert f"image splitting: {'off' if per_query < 50e6 else 'on'} ({source})" in out
    assert f"({n} queries encoded)" in out and "8.40 B parameters = 16.8 GB" in out and "assumptions:" in out


def test_evaluate_plan_loads_no_weights(twins, monkeypatch, capsys):
    no_weights(monkeypatch)
    planned = lab(["plan", "evaluate", "--model", "llava-onevision", "--processor", twins["llava-onevision"],
                   "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-eval", "4", "--shots", "2"])
    out = capsys.readouterr().out
    assert "images: multi-image mode, 730 tokens each (image_layouts.onevision_piece)" in out
    assert "peak memory, evaluation at batch 4" in out and "cache" not in planned
    assert min(planned["rows"]["teacher"].values()) > 3 * 730  # three images of 730 tokens, multi-image mode


def test_a_short_name_without_its_processor_says_what_to_pass(tmp_path, monkeypatch):
    import huggingface_hub
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))  # an empty cache; no hub call
    with pytest.raises(ValueError, match="--processor DIR"):
        run_plan.plan_backbone("llava-interleave", "llava-interleave")


def test_a_cache_that_does_not_fit_stops_before_the_first_step(twins, tmp_path, monkeypatch):
    flags = ["--model", twins["idefics2"], "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-train", "4",
             "--n-heldout", "1", "--batch-size", "2", "--shots", "2", "--epochs", "2", "--max-steps", "1",
             "--out", str(tmp_path / "run"), "--teacher-cache", str(tmp_path / "cache")]
    monkeypatch.setattr(run_plan.shutil, "disk_usage", lambda path: Free(10**6, 10**6 - 1000, 1000))
    steps = []
    with monkeypatch.context() as m, pytest.raises(ValueError) as e:
        m.setattr(train, "losses", lambda *a, **k: steps.append(1))
        lab_train(flags)
    message = str(e.value)
    for part in ("MB for 4 queries", str(tmp_path / "cache"), "1.0 kB free", "--teacher-cache DIR",
                 "--no-teacher-cache", "8 teacher forwards instead of 4"):
        assert part in message, part
    assert "\n" not in message and steps == [] and os.listdir(tmp_path / "cache") == []
    assert not os.path.exists(tmp_path / "run" / "last.pt")
    lab_train([*flags[:-2], "--no-teacher-cache", "--overwrite"])  # recomputes the teacher instead: runs, caches
    # nothing (--teacher-cache beside it would be refused: it would do nothing)
    assert os.path.exists(tmp_path / "run" / "last.pt") and os.listdir(tmp_path / "cache") == []


def test_image_splitting_is_explicit(twins):
    split = backbones.load_backbone(twins["idefics2-split"])
    unsplit = backbones.load_backbone(twins["idefics2-split"], image_splitting="off")
    assert split.images.startswith("image splitting: on (the checkpoint's processor config): 5 crop(s)")
    assert unsplit.images.startswith("image splitting: off (--image-splitting off): 1 crop(s)")
    query = tasks.load_task("vqav2", "train", benchmarks.ROOT)[:1]
    tokens = lambda b: len(data.query_pieces(b.processor, b.family, "vqa", query)[0]["input_ids"])
    assert tokens(split) - tokens(unsplit) == 4 * 65  # 4 more crops: 64 latents and a fake token each
    args = lab_train_args(["--model", twins["idefics2-split"], "--task", "vqav2", "--data-root", benchmarks.ROOT])
    keys = {teacher_cache.teacher_key("b", args.task, query[0], [], teacher_cache.image_key(b.processor))
            for b in (split, unsplit)}
    assert len(keys) == 2  # the cache key names the setting, so one cache folder never mixes the two
    with pytest.raises(ValueError, match="--image-splitting on: only Idefics2 splits images"):
        backbones.load_backbone(twins["llava-onevision"], image_splitting="on")


# Hostile inputs of the newest surface (issue 32): each ends in a one-line ValueError naming the file, flag or entry.
def plan_flags(model, tmp_path, *more):
    return ["plan", "train", "--model", str(model), "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-train", "3",
            "--n-heldout", "1", "--batch-size", "2", "--shots", "2", "--epochs", "1", "--out", str(tmp_path / "run"),
            "--plan", "cpu", *more]


def copy_twin(twins, name, tmp_path):
    import shutil
    return shutil.copytree(twins[name], tmp_path / name)


def test_plan_names_a_missing_config_an_unknown_model_type_and_a_bad_processor_folder(twins, tmp_path):
    folder = copy_twin(twins, "idefics2", tmp_path)
    config = folder / "config.json"
    config.write_text(config.read_text().replace('"model_type": "idefics2"', '"model_type": "gpt2"'))
    with pytest.raises(ValueError, match="config.json has model_type 'gpt2'"):
        lab(plan_flags(folder, tmp_path))
    config.unlink()
    with pytest.raises(ValueError, match="has no config.json"):
        lab(plan_flags(folder, tmp_path))
    (tmp_path / "afile").write_text("")
    for bad in (tmp_path / "nope", tmp_path / "afile"):
        with pytest.raises(ValueError, match="--processor .*: not a folder"):
            lab(plan_flags(twins["idefics2"], tmp_path, "--processor", str(bad)))
    with pytest.raises(ValueError, match="is not a idefics2 processor"):  # LLaVA-OneVision's, for an Idefics2
        lab(plan_flags(twins["idefics2"], tmp_path, "--processor", twins["llava-onevision"]))


def test_plan_names_missing_tokenizer_files_and_processor_settings(twins, tmp_path):
    folder = copy_twin(twins, "idefics2", tmp_path)
    for f in folder.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match="has no tokenizer file"):  # was: a 6-token tokenizer, silently
        lab(plan_flags(folder, tmp_path))
    folder = copy_twin(twins, "llava-onevision", tmp_path)
    settings = folder / "processor_config.json"
    settings.write_text(settings.read_text().replace('"num_image_tokens"', '"renamed"'))
    with pytest.raises(ValueError, match="processor_config.json lacks num_image_tokens"):  # was: a TypeError
        lab(plan_flags(folder, tmp_path))
    settings.unlink()
    with pytest.raises(ValueError, match="processor_config.json cannot be read"):
        lab(plan_flags(folder, tmp_path))


def test_plan_batch_is_at_most_the_queries_and_an_unwritable_cache_is_said(twins, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # the tests may run as root, who writes anywhere
    flags = plan_flags(twins["idefics2"], tmp_path, "--teacher-cache", str(tmp_path / "cache"))
    flags[flags.index("--batch-size") + 1] = "100000"
    lab(flags)
    out = capsys.readouterr().out
    assert "batch 3," in out and "at batch 3:" in out and "is NOT writable" in out


def test_the_plan_says_whether_reading_the_cache_costs_less_than_recomputing_the_teacher(tmp_path, capsys):
    """The line's read time is the query's cache bytes at the read speed it measured, its teacher FLOPs 2 x the
    parameters x the mean teacher row, its time those at run_plan.ACCELERATOR_TFLOPS, and its verdict their order."""
    import re
    figures = lab(["plan", "train", "--model", "tiny-llava-onevision", "--task", "vqav2", "--data-root",
                   benchmarks.ROOT, "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if l.startswith("teacher cache or recomputing"))
    read_ms, speed, compute_ms, tflop = map(float, re.search(
        r"back ~([\d.e+-]+) ms \(.* reads (\d+) MB/s, measured\), recomputing its teacher ~([\d.e+-]+) ms "
        r"\(([\d.e+-]+) TFLOP", line).groups())
    per_query = figures["cache"] / figures["queries"]
    assert read_ms == pytest.approx(per_query / (speed * 1e6) * 1e3, rel=0.01)
    params = float(re.search(r"weights: ([\d,]+) parameters", out).group(1).replace(",", ""))
    teacher = sum(figures["rows"]["teacher"].values()) / len(figures["rows"]["teacher"])
    assert tflop == pytest.approx(2 * params * teacher / 1e12, rel=1e-2)
    assert compute_ms == pytest.approx(tflop / run_plan.ACCELERATOR_TFLOPS * 1e3, rel=1e-2)
    assert line.endswith("reading is cheaper") == (read_ms <= compute_ms)


@pytest.mark.parametrize("name", ["idefics2", "idefics2-split", "llava-onevision", "tiny-idefics",
                                  "tiny-llava-interleave"])
@pytest.mark.parametrize("task", ["vqav2", "coco"])
def test_query_tokens_without_images_are_the_encoded_queries(twins, name, task):
    backbone = backbones.load_backbone(twins.get(name, name))
    kind, queries = data.TASKS[task].kind, tasks.load_task(task, "train", benchmarks.ROOT)[:12]
    pieces = data.query_pieces(backbone.processor, backbone.family, kind, queries)
    tokens = teacher_cache.query_tokens(backbone.processor, backbone.family, kind, queries)
    assert tokens == teacher_cache.query_sizes(pieces)


def test_the_cache_room_is_every_querys_and_a_full_disk_mid_run_names_the_way_out(tmp_path, monkeypatch):
    """The room check counts every query's tokens (40 here, past the plan's sample of 32, questions of several
    lengths): its size is the bytes the run writes. A full disk while caching ends in one line naming the size, the
    folder, --teacher-cache and --no-teacher-cache."""
    flags = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-train", "40",
             "--n-heldout", "1", "--batch-size", "8", "--shots", "1", "--epochs", "1", "--out", str(tmp_path / "run")]
    needs = []
    original = teacher_cache.check_cache_room
    monkeypatch.setattr(teacher_cache, "check_cache_room", lambda *a: needs.append(original(*a)) or needs[-1])
    lab_train(flags)
    folder = tmp_path / "run" / "teacher"
    written = sum(os.path.getsize(folder / f) for f in os.listdir(folder))
    assert len(os.listdir(folder)) == 40 * 2 and abs(needs[0] - written) <= 0.01 * written, (needs, written)

    def full(*args):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(files, "write_cache", full)
    with pytest.raises(OSError) as e:
        lab_train([*flags, "--overwrite", "--teacher-cache", str(tmp_path / "elsewhere")])
    message = str(e.value)
    for part in ("No space left on device", "kB for 40 queries", str(tmp_path / "elsewhere"), "--teacher-cache DIR",
                 "--no-teacher-cache", "40 teacher forwards instead of 40"):
        assert part in message, (part, message)
    assert "\n" not in message


def test_a_bare_plan_plans_the_machine_it_runs_on_and_reads_the_images_off_the_builders_batches(twins, tmp_path,
                                                                                                monkeypatch):
    """--plan without a value is this machine's run (float32 on a CPU: what the run itself computes in); the images
    it counts are read off the batches the builder returns (data.teacher_batch), whatever their layout."""
    import torch
    assert lab_args(["plan", "train"]).plan == ("cuda" if torch.cuda.is_available() else "cpu")
    no_weights(monkeypatch)
    built, original = [], data.teacher_batch

    def recording(processor, family, kind, pieces, icds):
        batch = original(processor, family, kind, pieces, icds)
        if any(icds):  # a teacher batch (student_batch calls teacher_batch without ICDs)
            built.append(run_plan.image_sizes(batch))
        return batch
    monkeypatch.setattr(data, "teacher_batch", recording)
    planned = lab(plan_flags(twins["idefics2"], tmp_path))
    assert planned["rows"]["images"]["teacher"] == built[:-1] and built[0]["images"] == 2 * 3  # 2 rows of 2 ICDs +
    assert built[-1]["images"] == 3  # query; the last batch the query alone: its canvas at batch 1 (plan_times)
    assert built[0]["bytes"] > 0 and planned["memory"]["vision"] > built[0]["bytes"]
