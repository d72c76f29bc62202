"""Nothing lost, part 5 (issue 45, items 10-12, 14-16 and the three "also" items): dead and stuck DataLoader
workers, the Python API's arguments, reader ids, tracebacks, float flags, result files compared by what they scored,
no model folder's code, a refused adapter keeping the one attached before it.

Each test failed before its fix. Small: the tiny twin, a few items, files copied from tools/benchmarks.py's."""
import dataclasses
import json
import os
import signal
import sys
import time

import pytest
import torch

import benchmarks
import data as D
import evaluate
import model as M
import train
from lab.datasets import mme_seed, readers, rices, tasks
from lab.models import backbones
from lab.run import checkpoints, feed
from lab.methods import registry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EVAL = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-eval", "2", "--shots", "0"]
TRAIN = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-train", "4",
         "--n-heldout", "4", "--batch-size", "2", "--shots", "1", "--epochs", "1", "--no-teacher-cache"]


@pytest.fixture(scope="module")
def backbone():
    return backbones.load_backbone("tiny-idefics2")


@pytest.fixture(scope="module")
def items():
    return tasks.load_task("vqav2", "val", benchmarks.ROOT)[:3]


def children():
    """The pids of this process's children (the DataLoader's workers)."""
    found = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def kill_workers_once(real):
    """`real`, wrapped: at its first call every child of this process is SIGKILLed, and the call waits for the
    SIGCHLD (which torch's handler turns into an error wherever this process is)."""
    state = {"done": False}

    def wrapped(*args, **kwargs):
        if not state["done"]:
            state["done"] = True
            for pid in children():
                os.kill(pid, signal.SIGKILL)
            time.sleep(2)
        return real(*args, **kwargs)
    return wrapped


# ------------------------------------------------------------------------------- item 10: a dead DataLoader worker

def test_a_killed_worker_in_evaluate_is_one_named_error(tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "generate", kill_workers_once(evaluate.generate))
    with pytest.raises(feed.WorkerFailed, match=r"a DataLoader worker failed \(DataLoader worker \(pid.*\) (is killed "
                                                r"by signal: Killed|exited unexpectedly).*--workers 0") as e:
        evaluate.main([*EVAL, "--n-eval", "6", "--batch-size", "1", "--workers", "1", "--out", str(tmp_path)])
    assert isinstance(e.value, OSError) and "\n" not in str(e.value)  # what evaluate.py and train.py print in a line


def test_a_killed_worker_in_train_is_one_named_error(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "losses", kill_workers_once(train.losses))
    with pytest.raises(feed.WorkerFailed, match=r"a DataLoader worker failed \(DataLoader worker"):
        train.main([*TRAIN, "--workers", "1", "--out", str(tmp_path)])


def test_a_worker_that_dies_while_a_batch_is_awaited_is_named_with_the_batch():
    def build(spec):
        if spec == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"x": spec}
    with pytest.raises(feed.WorkerFailed, match=r"batch [12] of 3: a DataLoader worker failed"):
        list(feed.prepared(build, [0, 1, 2], 1))


# ------------------------------------------------------------------------------- item 11: a stuck worker, a FIFO

def stop_self(spec):
    """A build whose worker stops itself (SIGSTOP) at its second batch, leaving its pid in the spec's file."""
    if spec[0] == 1:
        with open(spec[1], "w") as f:
            f.write(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)
    return {"x": spec[0]}


def test_a_stopped_worker_times_out_with_a_message(tmp_path, monkeypatch):
    monkeypatch.setattr(feed, "WORKER_TIMEOUT", 2)
    pid_file = tmp_path / "pid"
    try:
        with pytest.raises(feed.WorkerFailed, match=r"batch [12] of 3: a DataLoader worker failed \(DataLoader "
                                                    r"timed out after 2 seconds\)"):
            list(feed.prepared(stop_self, [(k, str(pid_file)) for k in range(3)], 1))
        with pytest.raises(ProcessLookupError):  # the stopped worker is not left behind
            os.kill(int(pid_file.read_text()), 0)
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_an_image_path_that_is_a_fifo_is_refused_naming_it(tmp_path, items):
    fifo = tmp_path / "image.jpg"
    os.mkfifo(fifo)
    item = dataclasses.replace(items[0], image_path=str(fifo))
    with pytest.raises(OSError, match=rf"item {item.id}: its image {fifo} is not a regular file"):
        D.load_image(item)  # before: open() waited for a writer forever


# ---------------------------------------------------------------------------------- item 12: the Python API

@pytest.mark.parametrize("call, message", [
    (lambda b, its: evaluate.predict(b, "vqav2", its, icds=[[]] * (len(its) - 1)),
     r"icds holds 2 demonstration lists for 3 items"),
    (lambda b, its: evaluate.predict(b, "vqav2", its[:2], likelihood=True),
     r"likelihood ranks a multiple-choice item's options; vqav2 is a vqa task"),
    (lambda b, its: evaluate.predict(b, "vqav2", its, batch_size=0), r"batch_size must be an integer of at least 1 "
     r"\(got 0\)"),
    (lambda b, its: evaluate.predict(b, "vqa-v2", its), r"unknown task 'vqa-v2'; choose from .*vqav2"),
    (lambda b, its: evaluate.predict(b, "vqav2", [dataclasses.replace(its[0], question=None)]),
     rf"item \d+: its question is None; a vqa task asks one"),
    (lambda b, its: evaluate.predict(b, "vqav2", [dataclasses.replace(its[0], image_path=None)]),
     rf"item \d+: its image_path is None; every item needs an image file"),
])
def test_the_python_api_refuses_what_would_misalign_naming_the_argument_or_item(backbone, items, call, message):
    with pytest.raises(ValueError, match=message):
        call(backbone, items)


def test_load_backbone_refuses_an_image_splitting_it_does_not_know():
    for splitting in ("yes", True):
        with pytest.raises(ValueError, match=rf"image splitting {splitting!r} is none of checkpoint, on, off"):
            backbones.load_backbone("tiny-idefics2", image_splitting=splitting)


# ----------------------------------------------------------------------------------------- item 14: reader fields

def vqa_copy(tmp_path, change):
    """A copy of the benchmarks' VQAv2 val questions and annotations, `change`(questions, annotations) applied."""
    root = benchmarks.copy(tmp_path / "root", "vqav2", "coco")
    folder, qfile, afile = readers.VQA_FILES["vqav2"]
    qpath, apath = (os.path.join(root, folder, f.format("val")) for f in (qfile, afile))
    q, a = (json.load(open(p)) for p in (qpath, apath))
    change(q["questions"], a["annotations"])
    for path, obj in ((qpath, q), (apath, a)):
        with open(path, "w") as f:
            json.dump(obj, f)
    return root


@pytest.mark.parametrize("value", [float("nan"), True, 1.5, "100000000", float(10**8)])
def test_a_vqa_question_id_that_is_not_an_integer_is_refused(tmp_path, value):
    def change(questions, annotations):
        questions[0]["question_id"] = annotations[0]["question_id"] = value
    root = vqa_copy(tmp_path, change)
    with pytest.raises(ValueError, match=r"vqav2: entry 0 of .*annotations.json.* its question_id is .*; it must be an "
                                         r"integer"):
        readers.read_vqa(root, "val", "vqav2")


def test_a_string_question_id_and_its_integer_are_not_two_questions(tmp_path):
    def change(questions, annotations):
        annotations.append({**annotations[0], "question_id": str(annotations[0]["question_id"])})
    with pytest.raises(ValueError, match=r"its question_id is '\d+'; it must be an integer"):
        readers.read_vqa(vqa_copy(tmp_path, change), "val", "vqav2")


@pytest.mark.parametrize("value", [3.7, 3.0, True, "3.7"])
def test_a_seed_question_type_id_that_is_not_an_integer_is_refused(tmp_path, value):
    root = benchmarks.copy(tmp_path / "root", "seed-bench")
    path = os.path.join(root, "seed-bench", "SEED-Bench.json")
    obj = json.load(open(path))
    obj["questions"][0]["question_type_id"] = value
    with open(path, "w") as f:
        json.dump(obj, f)
    with pytest.raises(ValueError, match=r"seed: question #0 .* its question_type_id is .*; it must be an integer"):
        mme_seed.read_seed(root)


def test_seed_question_ids_as_digits_still_read(items):
    assert all(isinstance(it.id, int) for it in mme_seed.read_seed(benchmarks.ROOT))


# ------------------------------------------------------------------------------------------- item 15: tracebacks

def test_a_deeply_nested_json_is_one_error_naming_the_file(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(ValueError, match=rf"vqav2: {path} is nested too deeply"):
        readers.read_json(str(path), "vqav2")


def test_a_rices_encoder_that_is_not_clip_is_refused_naming_it(tmp_path):
    from transformers import CLIPImageProcessor, SiglipVisionConfig, SiglipVisionModel
    SiglipVisionModel(SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14)).save_pretrained(tmp_path)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"cannot load the RICES image encoder '{tmp_path}' as a CLIP checkpoint "
                                         r"\(its config's model_type is 'siglip_vision_model', not 'clip'\)"):
        rices.clip_encoder(str(tmp_path))


def test_ctrl_c_in_evaluate_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(evaluate, "predict", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *EVAL, "--out", str(tmp_path)])
    source = open(os.path.join(ROOT, "evaluate.py")).read()
    with pytest.raises(BaseException) as e:  # evaluate.py's own __main__ block, on the patched module
        exec(source[source.index("if __name__"):], {**vars(evaluate), "__name__": "__main__"})
    err = capsys.readouterr().err
    assert isinstance(e.value, SystemExit) and e.value.code == 130
    assert err.strip().splitlines()[-1].startswith("interrupted (Ctrl-C)")
    assert not [f for f in os.listdir(tmp_path) if "metrics" in f or "predictions" in f]


# -------------------------------------------------------------------------------------- item 16: float flags

@pytest.mark.parametrize("value", ["1e300", "nan", "inf", "-1", "0"])
def test_image_memory_out_of_range_is_a_parser_error(value, capsys):
    for parse in (evaluate.parse_args, train.parse_args):
        with pytest.raises(SystemExit):
            parse(["--image-memory", value])
        assert "--image-memory must be a finite number of GB > 0" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ the "also" items

def test_the_same_items_without_n_eval_or_through_a_symlink_replace_their_result(tmp_path):
    root = benchmarks.copy(tmp_path / "root", "vqav2", "coco")
    n = len(tasks.load_task("vqav2", "val", root))
    out = tmp_path / "out"
    flags = ["--model", "tiny-idefics2", "--task", "vqav2", "--shots", "0", "--batch-size", "64", "--out", str(out)]
    evaluate.main([*flags, "--data-root", root, "--n-eval", str(n)])
    os.symlink(root, tmp_path / "link")
    evaluate.main([*flags, "--data-root", str(tmp_path / "link")])  # the same items of the same data: replaced
    (name,) = [f for f in os.listdir(out) if f.endswith(".metrics.json")]
    assert json.loads((out / name).read_text())["n_eval"] is None


def test_other_items_of_the_same_count_are_other_settings(backbone, items, tmp_path):
    from lab.scores import results
    args = evaluate.parse_args(EVAL)
    settings = [results.result_settings(backbone, args, "0-shot", its) for its in (items[:2], items[1:])]
    assert settings[0]["n"] == settings[1]["n"] and settings[0]["items"] != settings[1]["items"]
    path = tmp_path / "m.metrics.json"
    path.write_text(json.dumps(settings[0]))
    with pytest.raises(ValueError, match=r"holds the result of other settings: items '[0-9a-f]{16}' \(now "):
        results.check_replaceable(str(path), {k: settings[1][k] for k in results.RESULT_SETTINGS if k in settings[1]})


def test_a_folder_with_auto_map_loads_without_asking_or_running_its_code(tmp_path, monkeypatch):
    import twins
    folder = tmp_path / "idefics2"
    twins.write_twin("idefics2", str(folder))
    classes = {"AutoConfig": "custom.Config", "AutoModelForImageTextToText": "custom.Model",
               "AutoProcessor": "custom.Processor", "AutoImageProcessor": "custom.ImageProcessor",
               "AutoTokenizer": ["custom.Tokenizer", None]}
    for name in os.listdir(folder):
        if name.endswith("config.json"):
            obj = json.loads((folder / name).read_text())
            (folder / name).write_text(json.dumps({**obj, "auto_map": classes}))
    (folder / "custom.py").write_text("raise SystemExit('custom code ran')\n")
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked whether to run the folder's code"))
    monkeypatch.setattr("transformers.dynamic_module_utils.TIME_OUT_REMOTE_CODE", 0)  # no prompt: an error instead
    import importlib
    asked = []  # what each transformers loader was told: None is "ask the user if the folder has code"
    for name in ("configuration_auto", "processing_auto", "image_processing_auto", "tokenization_auto",
                 "auto_factory"):
        module = importlib.import_module(f"transformers.models.auto.{name}")
        real = getattr(module, "resolve_trust_remote_code", None)
        if real is not None:
            monkeypatch.setattr(module, "resolve_trust_remote_code",
                                lambda trust, *a, real=real, **k: asked.append(trust) or real(trust, *a, **k))
    assert backbones.load_backbone(str(folder)).family == "idefics2"
    assert asked and all(trust is False for trust in asked), asked


def test_a_refused_adapter_file_leaves_the_attached_adapter_in_place(tmp_path, backbone):
    from safetensors.torch import load_file, save
    from safetensors import safe_open
    registry.attach(backbone.model, "hyper-icl", rank=4)
    torch.manual_seed(1)
    for p in M.adapter_modules(backbone.model).parameters():
        p.data.normal_()
    before = {k: v.clone() for k, v in M.adapter_modules(backbone.model).state_dict().items()}
    good = tmp_path / "good.safetensors"
    checkpoints.save_adapter(str(good), backbone)
    with safe_open(str(good), "pt") as f:
        metadata = f.metadata()
    tensors = load_file(str(good))
    first = sorted(tensors)[0]
    tensors[first] = tensors[first][..., :-1].contiguous()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(save(tensors, metadata=metadata))
    try:
        with pytest.raises(ValueError, match="does not hold the adapter its settings describe"):
            checkpoints.load_adapter(str(bad), backbone)
        assert backbone.model.icl_settings["method"] == "hyper-icl"
        after = M.adapter_modules(backbone.model).state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())
    finally:
        M.detach(backbone.model)
