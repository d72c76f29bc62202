"""Nothing lost, part 4: every result names its settings, every reader refuses what it cannot score, damaged
checkpoints and configs are named, numeric flags are checked before anything loads.

One test per case of a hostile run (issue 39): each failed before its fix. Small: the tiny twin, a few items, files
written by hand in the official layouts or copied from tools/benchmarks.py's."""
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import benchmarks
import evaluate
import train
from lab.datasets import mme_seed, readers, tasks
from lab.models import backbones
from lab.methods import registry
from lab.run import anchors, checkpoints, feed
from lab.scores import results
from lab.studies import analyses
from lab.cli import flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-eval", "2", "--shots", "0"]
TRAIN = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-train", "4",
         "--n-heldout", "4", "--batch-size", "4", "--shots", "1", "--epochs", "1"]


# ---------------------------------------------------------------------------------- results name their settings

def metrics_files(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".metrics.json"))


def test_image_splitting_is_in_the_result_name_and_in_the_metrics(tmp_path):
    for splitting in ("on", "off"):
        evaluate.main([*EVAL, "--image-splitting", splitting, "--out", str(tmp_path)])
    assert metrics_files(tmp_path) == ["vqav2-val-0-shot-splitting-off-seed0-n2.metrics.json",
                                       "vqav2-val-0-shot-splitting-on-seed0-n2.metrics.json"]
    for splitting in ("on", "off"):
        metrics = json.loads((tmp_path / f"vqav2-val-0-shot-splitting-{splitting}-seed0-n2.metrics.json").read_text())
        assert metrics["image_splitting"] == splitting


def test_a_result_of_another_backbone_is_kept_and_the_run_refused_naming_it(tmp_path, monkeypatch):
    evaluate.main([*EVAL, "--out", str(tmp_path)])
    (name,) = metrics_files(tmp_path)
    before = (tmp_path / name).read_bytes()
    real = evaluate.predict
    monkeypatch.setattr(evaluate, "predict", lambda *a, **k: pytest.fail("predicted before the refusal"))
    other = [*EVAL[:1], "tiny-llava-interleave", *EVAL[2:], "--out", str(tmp_path)]
    with pytest.raises(ValueError, match=rf"{tmp_path / name} holds the result of other settings: model "
                                         r"'tiny-idefics2' \(now 'tiny-llava-interleave'\), image_splitting 'off' "
                                         r"\(now None\); it is kept"):
        evaluate.main(other)
    assert (tmp_path / name).read_bytes() == before
    monkeypatch.setattr(evaluate, "predict", real)
    evaluate.main([*EVAL, "--out", str(tmp_path)])                          # the same settings replace it
    assert metrics_files(tmp_path) == [name]


def test_a_kill_while_the_mme_folder_is_written_leaves_the_old_folder_whole(tmp_path):
    folder = tmp_path / "mme-val-0-shot-seed0-n336.mme"
    items = mme_seed.read_mme(benchmarks.ROOT)
    results.write_mme_results(str(folder), items, ["old"] * len(items))
    before = {f: (folder / f).read_bytes() for f in os.listdir(folder)}
    kill_at_third = ("import os, signal, sys; from lab.disk import files; from lab.datasets import mme_seed; "
                     "from lab.scores import results; "
                     "write, calls = files.atomic_write, []; "
                     "files.atomic_write = lambda p, w: (calls.append(p), os.kill(os.getpid(), signal.SIGKILL) if "
                     "len(calls) == 3 else write(p, w)); items = mme_seed.read_mme(sys.argv[2]); "
                     "results.write_mme_results(sys.argv[1], items, ['new'] * len(items))")
    killed = subprocess.run([sys.executable, "-c", kill_at_third, str(folder), benchmarks.ROOT], cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL
    assert {f: (folder / f).read_bytes() for f in os.listdir(folder)} == before   # all 14 files of the old run
    results.write_mme_results(str(folder), items, ["new"] * len(items))
    assert len(os.listdir(folder)) == 14 and all(line.endswith("\tnew") for f in os.listdir(folder)
                                                 for line in (folder / f).read_text().splitlines())
    assert sorted(os.listdir(tmp_path)) == [folder.name]                    # the killed write's folder is gone


# ------------------------------------------------------------------------------------------------ the readers

QUESTION = {"question_id": 7, "image_id": 1, "question": "What colour?"}
ANNOTATION = {"question_id": 7, "answers": [{"answer": "red"}] * 10, "multiple_choice_answer": "red"}


def vqa_root(tmp_path, dataset, questions, annotations):
    folder, qfile, afile = readers.VQA_FILES[dataset]
    (tmp_path / folder).mkdir(exist_ok=True)
    (tmp_path / folder / qfile.format("val")).write_text(json.dumps({"questions": questions}))
    (tmp_path / folder / afile.format("val")).write_text(json.dumps({"annotations": annotations}))
    return str(tmp_path)


@pytest.mark.parametrize("image_id", ["abc", True, None])
def test_a_vqa_image_id_that_is_not_an_integer_is_refused(tmp_path, image_id):
    root = vqa_root(tmp_path, "vqav2", [{**QUESTION, "image_id": image_id}], [ANNOTATION])
    with pytest.raises(ValueError, match=rf"entry 0 of .*questions.json .*: its image_id is {image_id!r}; it must be "
                                         "an integer"):
        tasks.load_task("vqav2", "val", root)


@pytest.mark.parametrize("dataset, annotation, message", [
    ("vqav2", None, r"entry 1 of .*v2_mscoco_val2014_annotations.json .*duplicate question_id 7"),
    ("ok-vqa", None, r"entry 1 of .*mscoco_val2014_annotations.json .*duplicate question_id 7"),
    ("vqav2", {**ANNOTATION, "multiple_choice_answer": None}, r"entry 0 of .*: its multiple_choice_answer is None"),
    ("vqav2", {**ANNOTATION, "answers": []}, r"entry 0 of .*: its answers are \[\]; they must be a non-empty list"),
    ("vqav2", {**ANNOTATION, "answers": [{"answer": 2}] * 10}, r"entry 0 of .*: an answer is \{'answer': 2\}; every "
                                                               r"answer must be"),
    ("ok-vqa", {**ANNOTATION, "answers": []}, r"entry 0 of .*: its answers are \[\]"),
    ("vqav2", {**ANNOTATION, "answers": ["red"] * 10}, r"entry 0 of .*: an answer is 'red'; every answer must be"),
])
def test_vqa_annotations_that_cannot_be_scored_are_refused_naming_file_and_entry(tmp_path, dataset, annotation,
                                                                                message):
    annotations = [ANNOTATION, {**ANNOTATION, "answers": [{"answer": "blue"}] * 10}] if annotation is None else \
        [annotation]
    with pytest.raises(ValueError, match=message):
        tasks.load_task(dataset, "val", vqa_root(tmp_path, dataset, [QUESTION], annotations))


IMAGE = {"filepath": "val2014", "filename": "a.jpg", "imgid": 0, "cocoid": 5, "split": "test",
         "sentences": [{"raw": "A red square."}]}


@pytest.mark.parametrize("dataset, images, message", [
    ("coco", [IMAGE, {**IMAGE, "imgid": 1}], r"coco: entry 1 of .*dataset_coco.json .*duplicate cocoid 5"),
    ("flickr30k", [IMAGE, {**IMAGE, "cocoid": 6}], r"flickr30k: entry 1 of .*dataset_flickr30k.json .*duplicate "
                                                   r"imgid 0"),
    ("flickr30k", [{**IMAGE, "imgid": None}], r"entry 0 of .*: its imgid is None; it must be an integer"),
    ("coco", [{**IMAGE, "split": "train"}, {**IMAGE, "imgid": 1}], r"entry 1 of .*duplicate cocoid 5"),
    ("coco", [{**IMAGE, "cocoid": True}], r"entry 0 of .*: its cocoid is True; it must be an integer"),
    ("coco", [{**IMAGE, "sentences": [{"raw": None}]}], r"entry 0 of .*: its raw is None; it must be non-empty text"),
    ("coco", [{**IMAGE, "sentences": []}], r"entry 0 of .*: it has no captions"),
    ("coco", [{**IMAGE, "filename": None}], r"entry 0 of .*: its filename is None"),
    ("coco", [{k: v for k, v in IMAGE.items() if k != "filename"}],
     r"coco: entry 0 of .*dataset_coco.json .* missing or malformed field \(KeyError: 'filename'"),
])
def test_caption_images_without_one_id_or_a_filename_are_refused(tmp_path, dataset, images, message):
    (tmp_path / dataset).mkdir()
    (tmp_path / dataset / f"dataset_{dataset}.json").write_text(json.dumps({"images": images}))
    with pytest.raises(ValueError, match=message):
        tasks.load_task(dataset, "val", str(tmp_path))


def test_an_mme_subtask_that_yields_no_question_is_an_error(tmp_path):
    root = benchmarks.copy(tmp_path, "mme")
    folder = os.path.join(root, "mme", "count")
    shutil.rmtree(folder)
    os.mkdir(folder)
    with pytest.raises(ValueError, match=rf"mme: the subtask folder {folder} holds no question"):
        mme_seed.read_mme(root)


def test_questions_answers_yn_without_images_is_an_error(tmp_path):
    root = benchmarks.copy(tmp_path, "mme")
    folder = os.path.join(root, "mme", "artwork")
    shutil.rmtree(os.path.join(folder, "images"))
    with pytest.raises(FileNotFoundError, match=rf"mme: {folder}/questions_answers_YN is there but "
                                                rf"{folder}/images is not"):
        mme_seed.read_mme(root)


def test_an_mme_image_without_its_question_file_or_images_without_questions_answers_yn_is_an_error(tmp_path):
    root = benchmarks.copy(tmp_path, "mme")
    os.remove(os.path.join(root, "mme", "existence", "0003.txt"))
    with pytest.raises(FileNotFoundError, match=r"mme: no question file for .*existence/0003.jpg \(expected 0003.txt"):
        mme_seed.read_mme(root, ("existence",))
    shutil.rmtree(os.path.join(root, "mme", "scene", "questions_answers_YN"))
    with pytest.raises(FileNotFoundError, match=r"scene/images is there but .*scene/questions_answers_YN is not"):
        mme_seed.read_mme(root, ("scene",))


@pytest.mark.parametrize("change, message", [
    (lambda q: q.pop("level"), r"\(KeyError: 'level'\)"),
    (lambda q: q.update(data_source="elsewhere"), r"its data_source 'elsewhere' is none of "
                                                  r"\['SEED-Bench v2', 'cc3m'\]"),
])
def test_a_seed_bench_2_question_without_level_or_of_an_unknown_source_is_named(tmp_path, change, message):
    root = benchmarks.copy(tmp_path, "seed-bench-2")
    path = os.path.join(root, "seed-bench-2", mme_seed.SEED2_FILE)
    obj = json.load(open(path))
    change(obj["questions"][0])
    open(path, "w").write(json.dumps(obj))
    with pytest.raises(ValueError, match=rf"seed2: question #0 \(question_id {obj['questions'][0]['question_id']}\) "
                                         rf".*{message}"):
        mme_seed.read_seed2(root)


def test_a_seed_bench_2_question_without_subpart_is_named_by_its_question_id(tmp_path):
    root = benchmarks.copy(tmp_path, "seed-bench-2")
    path = os.path.join(root, "seed-bench-2", mme_seed.SEED2_FILE)
    obj = json.load(open(path))
    del obj["questions"][3]["subpart"]
    open(path, "w").write(json.dumps(obj))
    qid = obj["questions"][3]["question_id"]
    with pytest.raises(ValueError, match=rf"seed2: question #3 \(question_id {qid}\) in {path} has a missing or "
                                         r"malformed field \(KeyError: 'subpart'\)"):
        mme_seed.read_seed2(root)


# ------------------------------------------------------------------------------ adapters, configs, checkpoints

@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A Hyper-ICL adapter file of the tiny twin (untrained), its tensors and its metadata."""
    path = str(tmp_path_factory.mktemp("adapter") / "adapter.safetensors")
    backbone = backbones.load_backbone("tiny-idefics2")
    registry.attach(backbone.model, "hyper-icl", rank=4)
    checkpoints.save_adapter(path, backbone)
    with safe_open(path, "pt") as f:
        return path, load_file(path), f.metadata()


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
])
def test_a_damaged_or_foreign_adapter_names_the_file_and_the_tensor_or_field(tmp_path, adapter, change, message):
    tensors, settings = change(adapter[1], adapter[2]["settings"])
    path = damaged(tmp_path, adapter, tensors, settings)
    with pytest.raises(ValueError, match=rf"{path}(: | ).*{message}"):
        checkpoints.load_adapter(path, backbones.load_backbone("tiny-idefics2"))


def edited(twin_folder, tmp_path, name, change):
    folder = tmp_path / "model"
    shutil.copytree(twin_folder, folder)
    obj = json.loads((folder / name).read_text())
    change(obj)
    (folder / name).write_text(json.dumps(obj))
    return folder


def test_a_non_integer_eos_id_names_generation_config(twin_folder, tmp_path):
    folder = edited(twin_folder, tmp_path, "generation_config.json", lambda g: g.update(eos_token_id="</s>"))
    with pytest.raises(ValueError, match=rf"{folder / 'generation_config.json'}: eos_token_id is '</s>'; it must be a "
                                         "token id"):
        backbones.load_backbone(str(folder))


def test_a_generation_config_that_is_not_json_is_named_not_ignored(twin_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(twin_folder, folder)
    (folder / "generation_config.json").write_text("{half")
    with pytest.raises(ValueError, match=rf"{folder / 'generation_config.json'} cannot be read"):
        backbones.load_backbone(str(folder))


def test_a_config_field_of_the_wrong_type_names_config_json_under_plan(twin_folder, tmp_path):
    folder = edited(twin_folder, tmp_path, "config.json", lambda c: c["text_config"].update(hidden_size="big"))
    with pytest.raises(ValueError, match=rf"{folder / 'config.json'} is not a valid config \(.*hidden_size") as e:
        train.main(["--plan", *TRAIN[:1], str(folder), *TRAIN[2:]])
    assert "\n" not in str(e.value)                                          # one line, as the CLI prints it


def test_a_config_with_fewer_than_one_layer_names_config_json_and_the_field_also_under_plan(twin_folder, tmp_path):
    folder = edited(twin_folder, tmp_path, "config.json", lambda c: c["text_config"].update(num_hidden_layers=-3))
    message = rf"{folder / 'config.json'}: text_config.num_hidden_layers is -3; it must be an integer of at least 1"
    with pytest.raises(ValueError, match=message):
        train.main(["--plan", *TRAIN[:1], str(folder), *TRAIN[2:]])
    with pytest.raises(ValueError, match=message):
        backbones.load_backbone(str(folder))


# ------------------------------------------------------------------------------------------------ numeric flags

@pytest.mark.parametrize("script, filled", [(train, {"rank", "anchor", "out", "teacher_cache"}),
                                            (evaluate, {"checkpoint", "seed_protocol", "out"})])
def test_the_flags_are_the_configs_fields_with_their_values_and_comments(script, filled, capsys, monkeypatch, tmp_path):
    """--help lists one flag per field of the script's Config and no other; the flags' defaults are the fields' values
    (but those parse_args fills in) and each field has its comment, the flag's help."""
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    listed = set(re.findall(r"^  (?:-h, )?(--[\w-]+)", capsys.readouterr().out, re.M)) - {"--help"}
    fields = dataclasses.fields(script.Config)
    assert listed == {"--" + f.name.replace("_", "-") for f in fields}
    monkeypatch.chdir(tmp_path)  # no default checkpoint here
    parsed, defaults = dataclasses.asdict(script.parse_args([])), dataclasses.asdict(script.Config())
    kept = lambda settings: {k: v for k, v in settings.items() if k not in filled}
    assert kept(parsed) == kept(defaults)
    helps = flags.field_help(script.Config)
    assert [f.name for f in fields if not helps.get(f.name)] == []


@pytest.mark.parametrize("flag, value", [
    ("--lr", "1e300"), ("--lr", "inf"), ("--kappa", "inf"), ("--lam", "inf"), ("--weight-decay", "inf"),
    ("--temperature", "inf"), ("--clip", "inf"), ("--temperature", "1e39"), ("--kappa", "1e-300"),
    ("--temperature", "1e-30"), ("--temperature", "1e20")])
def test_float_flags_are_finite_and_in_float32s_range_before_anything_loads(flag, value, capsys, monkeypatch):
    monkeypatch.setattr(backbones, "load_backbone", lambda *a, **k: pytest.fail("a backbone was loaded"))
    with pytest.raises(SystemExit) as e:
        train.main([*TRAIN, f"{flag}={value}"])
    assert e.value.code == 2 and f"error: {flag} must be" in capsys.readouterr().err


@pytest.mark.parametrize("parse, flag, value", [
    (train.parse_args, "--seed", str(2**70)), (evaluate.parse_args, "--seed", str(2**70)),
    (train.parse_args, "--seed", "-1"), (train.parse_args, "--epochs", str(2**64)),
    (evaluate.parse_args, "--n-eval", str(2**64)), (train.parse_args, "--threads", str(2**40)),
    (train.parse_args, "--workers", str(2**62)), (evaluate.parse_args, "--workers", str(flags.MAX_WORKERS + 1))])
def test_integer_flags_fit_their_dtype_and_name_the_flag(parse, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse([*TRAIN[:6], flag, value])
    assert e.value.code == 2 and f"error: {flag} must be at" in capsys.readouterr().err


def test_the_nan_stop_names_every_setting_that_can_cause_it(tmp_path, monkeypatch):
    nan = torch.tensor(float("nan"), requires_grad=True)  # the step reads the parts after backward (once a step)
    monkeypatch.setattr(train, "losses", lambda *a, **k: {"anchor": nan, "sup": nan, "loss": nan})
    monkeypatch.setattr(anchors, "anchor_regime", lambda *a: None)
    with pytest.raises(FloatingPointError, match=r"step 1: loss part 'anchor' is nan; stopping\. The last good "
                                                 r"checkpoint is untouched\. Settings that can cause it: --lr 0\.005, "
                                                 r"--weight-decay 1e-06, --clip 1\.0, --lam 0\.5, --kappa 0\.1"):
        train.main([*TRAIN, "--weight-decay", "1e-6", "--out", str(tmp_path / "run"), "--teacher-cache",
                    str(tmp_path / "teacher")])


def test_an_adapter_too_large_for_memory_and_a_missing_checkpoint_are_named(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"the hyper-icl adapter of \{'rank': 1000000000000\} does not fit in memory .*"
                                         r"lower --rank or --virtual-tokens"):
        train.main([*TRAIN, "--rank", str(10**12), "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit):
        evaluate.parse_args([*EVAL, "--checkpoint", str(tmp_path / "none.safetensors")])
    assert f"error: --checkpoint {tmp_path / 'none.safetensors'}: no such file" in capsys.readouterr().err


def test_chair_and_a_second_checkpoint_of_one_folder_are_in_the_name(tmp_path, adapter):
    coco = ["--model", "tiny-idefics2", "--task", "coco", "--data-root", benchmarks.ROOT, "--n-eval", "2"]
    evaluate.main([*coco, "--shots", "0", "--chair", "--out", str(tmp_path)])
    evaluate.main([*coco, "--shots", "0", "--out", str(tmp_path)])
    for name in ("adapter.safetensors", "other.safetensors"):
        shutil.copy(adapter[0], tmp_path / name)
        evaluate.main([*EVAL[:-2], "--checkpoint", str(tmp_path / name), "--out", str(tmp_path)])
    names = metrics_files(tmp_path)
    assert names[:2] == ["coco-val-0-shot-chair-seed0-n2.metrics.json", "coco-val-0-shot-seed0-n2.metrics.json"]
    assert names[2].startswith("vqav2-val-hyper-icl-checkpoint-")
    assert names[3] == "vqav2-val-hyper-icl-seed0-n2.metrics.json"
    metrics = json.loads((tmp_path / names[3]).read_text())
    import hashlib
    assert metrics["checkpoint_sha256"] == hashlib.sha256((tmp_path / "adapter.safetensors").read_bytes()).hexdigest()


def test_another_data_root_is_refused_and_a_users_file_at_the_mme_folder_is_kept(tmp_path):
    out = tmp_path / "out"
    evaluate.main([*EVAL, "--out", str(out)])
    copy = benchmarks.copy(tmp_path / "copy", "vqav2", "coco")
    with pytest.raises(ValueError, match=r"holds the result of other settings: data_root .* \(now '.*copy'\)"):
        evaluate.main([*EVAL[:5], copy, *EVAL[6:], "--out", str(out)])
    mine = out / "mme-val-0-shot-seed0-n28.mme"
    mine.write_text("mine")
    with pytest.raises(OSError, match=rf"could not write the folder {mine} \({mine} is there and is not a folder"):
        evaluate.main([*EVAL[:2], "--task", "mme", *EVAL[4:6], "--n-eval", "28", "--shots", "0", "--out", str(out)])
    assert mine.read_text() == "mine"


def test_resume_with_another_clip_or_icds_is_refused(tmp_path):
    run = [*TRAIN, "--out", str(tmp_path / "run"), "--teacher-cache", str(tmp_path / "teacher")]
    train.main([*run, "--max-steps", "1"])
    for flag, value in (("--clip", "0.5"), ("--icds", "rices")):
        with pytest.raises(SystemExit, match=rf"last.pt was made with {flag} "):
            train.main([*run, "--resume", flag, value])


def test_an_analysis_or_curve_of_other_settings_is_kept_and_refused_before_the_work(tmp_path, adapter, monkeypatch):
    gates = tmp_path / "gates-vqav2-val.json"
    gates.write_text(json.dumps({"model": "tiny-idefics2", "checkpoint": "elsewhere.safetensors", "n_eval": 2}))
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"model": "tiny-idefics2", "curve_queries": [4, 8, 16, 32]}))
    monkeypatch.setattr(analyses, "gate_analysis", lambda *a: pytest.fail("analysed before the refusal"))
    with pytest.raises(ValueError, match=rf"{gates} holds the result of other settings: checkpoint "
                                         r"'elsewhere.safetensors' \(now '.*adapter.safetensors'\); it is kept"):
        evaluate.main([*EVAL[:-2], "--gates", "--checkpoint", adapter[0], "--out", str(tmp_path)])
    monkeypatch.setattr(backbones, "load_backbone", lambda *a, **k: pytest.fail("loaded before the refusal"))
    with pytest.raises(ValueError, match=rf"{curve} holds the result of other settings: curve_queries \[4, 8, 16, 32\] "
                                         r"\(now \[4\]\)"):
        evaluate.main(["--curve", *EVAL[:4], "--curve-queries", "4", "--out", str(tmp_path)])
    assert json.loads(gates.read_text())["checkpoint"] == "elsewhere.safetensors" and curve.stat().st_size < 100


def unreadable(spec):
    """A build whose every item fails as an unreadable image does (data.load_image's error)."""
    raise OSError(f"item {spec}: cannot read its image /data/{spec}.jpg (cannot identify image file)")


@pytest.mark.parametrize("workers", [0, 1])
def test_an_error_in_a_dataloader_worker_is_raised_as_it_was_raised_there(workers):
    """torch re-raises a worker's error with the worker's traceback in its message; the CLI prints the message, so
    a user saw 30 lines of traceback for one unreadable image (the hostile run, evaluate.py --workers 2)."""
    with pytest.raises(OSError) as e:
        list(feed.prepared(unreadable, [7, 8], workers))
    assert str(e.value) == "item 7: cannot read its image /data/7.jpg (cannot identify image file)"
