"""Result files (lab/scores/results.py): every result names its settings, another setting's result is kept and the run
refused naming it, predictions and metrics are written as a pair, MME's results folder whole or not at all."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

import benchmarks
import evaluate
from helpers import BENCH, EVAL, lab, lab_evaluate, lab_evaluate_args, ROOT
from lab.datasets import mme_seed, tasks
from lab.disk import files
from lab.models import backbones
from lab.scores import results
from lab.studies import analyses


def metrics_files(folder):
    return sorted(f for f in os.listdir(folder) if f.endswith(".metrics.json"))


def test_image_splitting_is_in_the_result_name_and_in_the_metrics(tmp_path):
    for splitting in ("on", "off"):
        lab_evaluate([*EVAL, "--image-splitting", splitting, "--out", str(tmp_path)])
    assert metrics_files(tmp_path) == ["vqav2-val-0-shot-splitting-off-seed0-n2.metrics.json",
                                       "vqav2-val-0-shot-splitting-on-seed0-n2.metrics.json"]
    for splitting in ("on", "off"):
        metrics = json.loads((tmp_path / f"vqav2-val-0-shot-splitting-{splitting}-seed0-n2.metrics.json").read_text())
        assert metrics["image_splitting"] == splitting


def test_a_result_of_another_backbone_is_kept_and_the_run_refused_naming_it(tmp_path, monkeypatch):
    lab_evaluate([*EVAL, "--out", str(tmp_path)])
    (name,) = metrics_files(tmp_path)
    before = (tmp_path / name).read_bytes()
    real = evaluate.predict
    monkeypatch.setattr(evaluate, "predict", lambda *a, **k: pytest.fail("predicted before the refusal"))
    other = [*EVAL[:1], "tiny-llava-interleave", *EVAL[2:], "--out", str(tmp_path)]
    with pytest.raises(ValueError, match=rf"{tmp_path / name} holds the result of other settings: model "
                                         r"'tiny-idefics2' \(now 'tiny-llava-interleave'\), image_splitting 'off' "
                                         r"\(now None\); it is kept"):
        lab_evaluate(other)
    assert (tmp_path / name).read_bytes() == before
    monkeypatch.setattr(evaluate, "predict", real)
    lab_evaluate([*EVAL, "--out", str(tmp_path)])                          # the same settings replace it
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


def test_chair_and_a_second_checkpoint_of_one_folder_are_in_the_name(tmp_path, adapter):
    coco = ["--model", "tiny-idefics2", "--task", "coco", "--data-root", benchmarks.ROOT, "--n-eval", "2"]
    lab_evaluate([*coco, "--shots", "0", "--chair", "--out", str(tmp_path)])
    lab_evaluate([*coco, "--shots", "0", "--out", str(tmp_path)])
    for name in ("adapter.safetensors", "other.safetensors"):
        shutil.copy(adapter[0], tmp_path / name)
        lab_evaluate([*EVAL[:-2], "--checkpoint", str(tmp_path / name), "--out", str(tmp_path)])
    names = metrics_files(tmp_path)
    assert names[:2] == ["coco-val-0-shot-chair-seed0-n2.metrics.json", "coco-val-0-shot-seed0-n2.metrics.json"]
    assert names[2].startswith("vqav2-val-hyper-icl-checkpoint-")
    assert names[3] == "vqav2-val-hyper-icl-seed0-n2.metrics.json"
    metrics = json.loads((tmp_path / names[3]).read_text())
    import hashlib
    assert metrics["checkpoint_sha256"] == hashlib.sha256((tmp_path / "adapter.safetensors").read_bytes()).hexdigest()


def test_another_data_root_is_refused_and_a_users_file_at_the_mme_folder_is_kept(tmp_path):
    out = tmp_path / "out"
    lab_evaluate([*EVAL, "--out", str(out)])
    copy = benchmarks.copy(tmp_path / "copy", "vqav2", "coco")
    with pytest.raises(ValueError, match=r"holds the result of other settings: data_root .* \(now '.*copy'\)"):
        lab_evaluate([*EVAL[:5], copy, *EVAL[6:], "--out", str(out)])
    mine = out / "mme-val-0-shot-seed0-n28.mme"
    mine.write_text("mine")
    with pytest.raises(OSError, match=rf"could not write the folder {mine} \({mine} is there and is not a folder"):
        lab_evaluate([*EVAL[:2], "--task", "mme", *EVAL[4:6], "--n-eval", "28", "--shots", "0", "--out", str(out)])
    assert mine.read_text() == "mine"


def test_an_analysis_or_curve_of_other_settings_is_kept_and_refused_before_the_work(tmp_path, adapter, monkeypatch):
    gates = tmp_path / "gates-vqav2-val.json"
    gates.write_text(json.dumps({"model": "tiny-idefics2", "checkpoint": "elsewhere.safetensors", "n_eval": 2}))
    curve = tmp_path / "curve.json"
    curve.write_text(json.dumps({"model": "tiny-idefics2", "curve_queries": [4, 8, 16, 32]}))
    monkeypatch.setattr(analyses, "gate_analysis", lambda *a: pytest.fail("analysed before the refusal"))
    with pytest.raises(ValueError, match=rf"{gates} holds the result of other settings: checkpoint "
                                         r"'elsewhere.safetensors' \(now '.*adapter.safetensors'\); it is kept"):
        lab(["gates", *EVAL[:-2], "--checkpoint", adapter[0], "--out", str(tmp_path)])
    monkeypatch.setattr(backbones, "load_backbone", lambda *a, **k: pytest.fail("loaded before the refusal"))
    with pytest.raises(ValueError, match=rf"{curve} holds the result of other settings: curve_queries \[4, 8, 16, 32\] "
                                         r"\(now \[4\]\)"):
        lab(["curve", *EVAL[:4], "--curve-queries", "4", "--out", str(tmp_path)])
    assert json.loads(gates.read_text())["checkpoint"] == "elsewhere.safetensors" and curve.stat().st_size < 100


def test_the_same_items_without_n_eval_or_through_a_symlink_replace_their_result(tmp_path):
    root = benchmarks.copy(tmp_path / "root", "vqav2", "coco")
    n = len(tasks.load_task("vqav2", "val", root))
    out = tmp_path / "out"
    flags = ["--model", "tiny-idefics2", "--task", "vqav2", "--shots", "0", "--batch-size", "64", "--out", str(out)]
    lab_evaluate([*flags, "--data-root", root, "--n-eval", str(n)])
    os.symlink(root, tmp_path / "link")
    lab_evaluate([*flags, "--data-root", str(tmp_path / "link")])  # the same items of the same data: not refused
    (name,) = [f for f in os.listdir(out) if f.endswith(".metrics.json")]
    assert json.loads((out / name).read_text())["n_eval"] == n  # read as the same result (--n-eval is not compared)
    evaluate.main([*flags, "--data-root", str(tmp_path / "link"), "--again"])
    assert json.loads((out / name).read_text())["n_eval"] is None  # and replaced when evaluated again


def test_other_items_of_the_same_count_are_other_settings(backbone, items, tmp_path):
    from lab.scores import results
    args = lab_evaluate_args(EVAL)
    settings = [results.result_settings(backbone, args, "0-shot", its) for its in (items[:2], items[1:])]
    assert settings[0]["n"] == settings[1]["n"] and settings[0]["items"] != settings[1]["items"]
    path = tmp_path / "m.metrics.json"
    path.write_text(json.dumps(settings[0]))
    with pytest.raises(ValueError, match=r"holds the result of other settings: items '[0-9a-f]{16}' \(now "):
        results.check_replaceable(str(path), {k: settings[1][k] for k in results.RESULT_SETTINGS if k in settings[1]})


EVAL3 = [*BENCH, "--n-eval", "3", "--batch-size", "3", "--shots", "1"]


KILL_AT_FIRST_PREDICTION = "import json, os, signal, sys, evaluate; dumps = json.dumps; json.dumps = lambda o, " \
    "*a, **k: os.kill(os.getpid(), signal.SIGKILL) if isinstance(o, dict) and 'prediction' in o else " \
    "dumps(o, *a, **k); evaluate.main(sys.argv[1:])"


def read_result(out, name):
    metrics = json.loads((out / f"{name}.metrics.json").read_text())
    return metrics, (out / metrics["predictions"]).read_bytes()


def test_metrics_name_their_predictions_and_a_kill_while_writing_leaves_the_old_pair(tmp_path):
    import hashlib
    lab_evaluate([*EVAL3, "--out", str(tmp_path)])
    name = "vqav2-val-1-shot-seed0-n3"
    metrics, predictions = read_result(tmp_path, name)
    assert metrics["predictions"] == f"{name}.predictions.jsonl"
    assert metrics["predictions_sha256"] == hashlib.sha256(predictions).hexdigest()
    killed = subprocess.run([sys.executable, "-c", KILL_AT_FIRST_PREDICTION, *EVAL3, "--out", str(tmp_path), "--again"],
                            cwd=ROOT)
    assert killed.returncode == -signal.SIGKILL
    assert read_result(tmp_path, name) == (metrics, predictions)             # the old pair, whole and together


def test_results_of_other_seeds_and_protocols_are_other_files(tmp_path):
    for seed in ("0", "1"):
        lab_evaluate([*EVAL3, "--seed", seed, "--out", str(tmp_path)])
    names = sorted(f for f in os.listdir(tmp_path) if f.endswith(".metrics.json"))
    assert names == ["vqav2-val-1-shot-seed0-n3.metrics.json", "vqav2-val-1-shot-seed1-n3.metrics.json"]
    args = lab_evaluate_args(["--model", "tiny-idefics2", "--task", "seed", "--shots", "2", "--icds", "rices",
                              "--rices-encoder", "enc", "--seed-protocol", "likelihood", "--out", str(tmp_path)])
    assert results.result_name(args, "2-shot-rices", 5, {}).startswith("seed-val-2-shot-rices-likelihood-encoder-")
    info = {"vector_file": "x/m-vqav2-tv-0123456789ab.safetensors", "vector_layer": 1}
    assert results.result_name(lab_evaluate_args(EVAL3), "tv", 3, info) == "vqav2-val-tv-layer1-0123456789ab-seed0-n3"


def test_a_kill_between_predictions_and_metrics_leaves_no_stale_metrics(tmp_path, monkeypatch):
    lab_evaluate([*EVAL3, "--out", str(tmp_path)])
    name = "vqav2-val-1-shot-seed0-n3"
    assert (tmp_path / f"{name}.metrics.json").exists()
    def killed(path, obj, indent=None):
        raise KeyboardInterrupt
    monkeypatch.setattr(files, "write_json", killed)
    with pytest.raises(KeyboardInterrupt):
        lab_evaluate([*EVAL3, "--out", str(tmp_path), "--again"])
    assert (tmp_path / f"{name}.predictions.jsonl").exists() and not (tmp_path / f"{name}.metrics.json").exists()


def test_a_result_of_data_edited_since_is_refused_naming_what_changed(tmp_path):
    """The scored items' answers edited under a finished result (the same ids): the result is kept and the run
    refused naming the data (before: read as "the same settings", the old score kept for the new answers)."""
    root = benchmarks.copy(tmp_path / "root", "vqav2", "coco")
    flags = [*EVAL, "--data-root", root, "--out", str(tmp_path / "out"), "--workers", "0"]
    evaluate.main(flags)
    (name,) = metrics_files(tmp_path / "out")
    before = (tmp_path / "out" / name).read_bytes()
    path = os.path.join(root, "vqav2", "v2_mscoco_val2014_annotations.json")
    annotations = json.load(open(path))
    for a in annotations["annotations"]:
        a["multiple_choice_answer"] = "zebra"
        a["answers"] = [{**x, "answer": "zebra"} for x in a["answers"]]
    with open(path, "w") as f:
        json.dump(annotations, f)
    with pytest.raises(ValueError, match=r"holds the result of other settings: data '[0-9a-f]{16}' \(now "
                                         r"'[0-9a-f]{16}'\) \(the scored items' questions, answers or images changed"):
        evaluate.main(flags)
    assert (tmp_path / "out" / name).read_bytes() == before


@pytest.mark.parametrize("field, value, said", [("vqa_accuracy", "high", "its vqa_accuracy is 'high', not a number"),
                                                ("interval95", "wide", "its interval95 is 'wide', not null or"),
                                                ("run", [1], "its run is [1], not null or the adapter's run record")])
def test_a_damaged_metrics_file_is_named_and_evaluated_again(tmp_path, capsys, field, value, said):
    """A field of a result damaged (text for a number, a list for a record): said, naming the file and the field, and
    evaluated again, which heals the file (before: read as "the same settings", then a format error naming nothing
    or an AttributeError)."""
    flags = [*EVAL, "--out", str(tmp_path), "--workers", "0"]
    first = evaluate.main(flags)
    (name,) = metrics_files(tmp_path)
    whole = (tmp_path / name).read_text()
    (tmp_path / name).write_text(json.dumps({**json.loads(whole), field: value}))
    assert evaluate.main(flags) == first and (tmp_path / name).read_text() == whole
    out = capsys.readouterr().out
    assert f"note: {tmp_path / name}: {said}" in out and "no result; evaluated again" in out
