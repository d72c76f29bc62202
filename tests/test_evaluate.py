"""evaluate.py end to end on the tiny twins and the benchmarks of tools/benchmarks.py (CPU): evaluation files,
post-processing, the efficiency table (Table 6), and the gate (Table 10) and delta-hyperbolicity (Table 9) analyses."""
import hashlib
import json
import math
import os
import shlex

import pytest
import torch
from PIL import Image

import benchmarks
import data as D
import evaluate as E
import model as M
import train
from lab.datasets import mme_seed, tasks
from lab.models import backbones, families, published
from lab.run import checkpoints
from lab.studies import analyses, curves, table6
from lab.methods import registry

N_EVAL = 6
# the random twin (the defaults build toy-idefics2) on the VQAv2 of tools/benchmarks.py
TINY = ["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Hyper-ICL checkpoint for tiny-idefics2 with random (non-identity) weights, so the gate varies."""
    backbone = backbones.load_backbone("tiny-idefics2")
    registry.attach(backbone.model, "hyper-icl", rank=4)
    torch.manual_seed(0)
    for p in M.adapter_modules(backbone.model).parameters():
        torch.nn.init.normal_(p, std=0.3)
    path = str(tmp_path_factory.mktemp("run") / "adapter.safetensors")
    checkpoints.save_adapter(path, backbone)
    return path


# -----------------------------------------------------------------------------
# answer post-processing

@pytest.mark.parametrize("generated, answer", [
    (" yes", "yes"),
    ("  blue  ", "blue"),
    (" two\nQuestion: How many", "two"),                  # cut at the first newline
    (" red Question: What colour", "red"),                # ... or at the next prompt piece
    (" left Short answer: right", "left"),
    (" A red circle. Caption: A", "A red circle."),       # punctuation and case are the metric's business
    ("\n yes\n", "yes"),                                  # leading whitespace (newlines too) goes first
    (" The Cat", "The Cat"),
    ("", ""),
    ("\n", ""),
])
def test_postprocess(generated, answer):
    assert E.postprocess(generated) == answer


# -----------------------------------------------------------------------------
# evaluation

def read_outputs(out, stem, n):
    """The records and metrics of the one evaluation named <stem>[-checkpoint-<hash>]-seed0-n<n> in `out`."""
    (name,) = [f for f in os.listdir(out) if f.startswith(stem) and f.endswith(f"-seed0-n{n}.metrics.json")]
    with open(os.path.join(out, name)) as f:
        metrics = json.load(f)
    with open(os.path.join(out, metrics["predictions"])) as f:
        return [json.loads(line) for line in f], metrics


@pytest.mark.parametrize("task, flags, setting", [
    ("vqav2", ["--shots", "0"], "0-shot"),
    ("vqav2", ["--shots", "2"], "2-shot"),
    ("vqav2", ["--checkpoint", None], "hyper-icl"),
    ("coco", ["--shots", "0", "--n-eval", "3"], "0-shot"),
])
def test_evaluation_writes_predictions_and_metrics(tmp_path, checkpoint, task, flags, setting):
    flags = [checkpoint if f is None else f for f in flags]
    metrics = E.main(["--model", "tiny-idefics2", "--task", task, "--n-eval", str(N_EVAL), "--batch-size", "4",
                      "--data-root", benchmarks.ROOT, "--out", str(tmp_path), *flags])
    n = int(flags[-1]) if "--n-eval" in flags else N_EVAL
    records, saved = read_outputs(str(tmp_path), f"{task}-val-{setting}-", n)
    items = tasks.load_task(task, "val", benchmarks.ROOT)[:n]
    assert saved == metrics and saved["n"] == n == len(records) and saved["setting"] == setting
    assert [r["id"] for r in records] == [it.id for it in items]
    assert all(set(r) == {"id", "prediction", "references"} and isinstance(r["prediction"], str) for r in records)
    assert all(r["references"] == list(it.answers) for r, it in zip(records, items))
    if task == "vqav2":
        assert 0 <= saved["vqa_accuracy"] <= 100
    else:
        assert saved["cider"] >= 0


def test_n_eval_on_mme_is_stratified_and_its_results_file_pairs_every_image(tmp_path):
    metrics = E.main(["--model", "tiny-idefics2", "--task", "mme", "--shots", "0", "--n-eval", "29",
                      "--data-root", benchmarks.ROOT, "--out", str(tmp_path)])
    # the evaluation part holds 168 questions on 84 images, 6 per subtask: round(29 x 84 / 168) = 14 images
    # (round half to even), one per subtask, both of its questions
    subtasks = mme_seed.MME_PERCEPTION + mme_seed.MME_COGNITION
    assert metrics["n"] == 28 and set(metrics["mme"]["subtasks"]) == set(subtasks)
    for subtask in subtasks:
        with open(tmp_path / "mme-val-0-shot-seed0-n28.mme" / f"{subtask}.txt") as f:
            images = [line.split("\t")[0] for line in f]
        assert len(images) == 2 and images[0] == images[1]  # calculation.py reads an image's two lines in a row


def test_no_flags_uses_the_default_checkpoint_if_it_exists(tmp_path, monkeypatch, checkpoint, capsys):
    monkeypatch.chdir(tmp_path)
    assert E.main([*TINY, "--n-eval", "2"])["setting"] == "0-shot"
    assert "no adapter: 0-shot evaluation" in capsys.readouterr().out
    default = os.path.join(train.parse_args(TINY).out, "adapter.safetensors")  # where `python train.py` writes
    os.makedirs(os.path.dirname(default))
    with open(checkpoint, "rb") as src, open(default, "wb") as dst:
        dst.write(src.read())
    metrics = E.main([*TINY, "--n-eval", "2"])
    assert metrics["setting"] == "hyper-icl" and metrics["checkpoint"] == default
    assert os.path.isfile(os.path.join(os.path.dirname(default), "vqav2-val-hyper-icl-seed0-n2.metrics.json"))


@pytest.mark.parametrize("family", sorted(families.FAMILIES))
def test_batched_generation_matches_one_at_a_time(family):
    """Left padding changes nothing: the same answers batched (rows of different lengths) and one by one."""
    backbone = backbones.load_backbone("tiny-" + family)
    items = tasks.load_task("vqav2", "val", benchmarks.ROOT)[:4]
    icds = D.demonstrations([it.id for it in items], tasks.load_task("vqav2", "train", benchmarks.ROOT), 1, seed=0)
    assert len({len(D.prompt_batch(backbone.processor, family, "vqa", [it], [d])["input_ids"][0])
                for it, d in zip(items, icds)}) > 1
    assert E.predict(backbone, "vqav2", items, icds, batch_size=4) == \
        E.predict(backbone, "vqav2", items, icds, batch_size=1)


# -----------------------------------------------------------------------------
# efficiency (Table 6)

def test_benchmark_prints_every_setting_and_flops_grow_with_shots(tmp_path, capsys):
    rows = E.main([*TINY, "--benchmark", "--rounds", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    names = ["zero-shot", *registry.METHODS, "8-shot", "16-shot", "32-shot"]  # no checkpoint: a row per method
    assert [r["setting"] for r in rows] == names
    for r in rows:
        assert r["tflops"] > 0 and r["ms"] > 0 and r["prefill_ms"] > 0 and 0 < r["prefill_tflops"] < r["tflops"]
        assert any(line.split()[0] == r["setting"] and f"{r['tflops']:.4g}" in line for line in printed.splitlines())
    flops = {r["setting"]: r["tflops"] for r in rows}
    # the adapters cost a little (LIVE's elementwise shift no counted FLOPs at all), ICDs a lot
    assert all(flops["zero-shot"] <= flops[m] < flops["8-shot"] for m in registry.METHODS)
    assert flops["zero-shot"] < flops["hyper-icl"] and flops["8-shot"] < flops["16-shot"] < flops["32-shot"]
    with open(tmp_path / "benchmark.json") as f:
        assert json.load(f)["rows"] == rows


@pytest.mark.parametrize("family", table6.SYNTHETIC)  # the families synthetic_prompt is written for
def test_synthetic_prompts_are_in_the_family_format(family):
    """--random-weights inputs, built from the tiny twin's config, run through the real model class, with as many
    tokens per image as the family's own processor gives an image of that size."""
    backbone = backbones.load_backbone("tiny-" + family)
    lengths = []
    for shots in (0, 2):
        inputs = table6.synthetic_prompt(backbone.model, family, shots)
        new = backbone.model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        assert new.shape[1] == inputs["input_ids"].shape[1] + 2
        lengths.append(inputs["input_ids"].shape[1])
    h, w = inputs["pixel_values"].shape[-2:]
    image = Image.new("RGB", (w, h), (200, 30, 30))
    per_image = len(D.encode_piece(backbone.processor, family, "<image>", image)["input_ids"])
    assert lengths[1] - lengths[0] == 2 * (per_image + table6.ICD_TEXT)


def test_random_weights_benchmark_path(tmp_path, monkeypatch, capsys):
    """--random-weights end to end on CPU, the real-size backbone replaced by the tiny twin (synthetic prompts)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(published, "published_model",
                        lambda family, device: backbones.load_backbone("tiny-" + family).model)
    rows = E.main(["--benchmark", "--rounds", "1", "--random-weights", "--model", "llava-interleave", "--task", "vqav2",
                   "--data-root", benchmarks.ROOT, "--out", str(tmp_path)])
    assert [r["setting"] for r in rows] == ["zero-shot", *registry.METHODS, "8-shot", "16-shot", "32-shot"]
    assert [r["prompt_tokens"] for r in rows[-3:]] == [rows[0]["prompt_tokens"] + s * (table6.ICD_TEXT + 4)
                                                       for s in (8, 16, 32)]  # the tiny twin: 2 x 2 patches an image
    assert "llava-interleave (random weights)" in capsys.readouterr().out


def test_random_weights_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        E.parse_args(["--benchmark", "--random-weights"])


# -----------------------------------------------------------------------------
# analyses (Table 10, Table 9)

def test_aligned_shift_compares_shared_keys_and_counts_icd_keys():
    """Eq 19's alignment: BOS + instruction keys first, query keys last, ICD keys only in the teacher."""
    T, start, icd, pad_plain, pad_icd = 2, 3, 4, 1, 2
    plain = torch.rand(1, 1, T, pad_plain + start + T).softmax(-1)
    plain[..., :pad_plain] = 0
    plain = plain / plain.sum(-1, keepdim=True)
    teacher = torch.cat([torch.zeros(1, 1, T, pad_icd), plain[..., pad_plain:pad_plain + start],
                         torch.zeros(1, 1, T, icd), plain[..., -T:]], -1)
    n_plain, n_icd = start + T, start + icd + T
    assert torch.allclose(analyses.aligned_shift(teacher, plain, n_icd, n_plain, T), torch.zeros(1, 1, T))
    moved = teacher.clone()
    moved[..., pad_icd + start] += 0.25 * moved[..., -1]  # a quarter of the last key's weight moves onto an ICD key
    moved[..., -1] *= 0.75
    expected = 0.5 * teacher[..., -1]
    assert torch.allclose(analyses.aligned_shift(moved, plain, n_icd, n_plain, T), expected)


def test_gates(tmp_path, checkpoint):
    r = E.main([*TINY, "--gates", "--checkpoint", checkpoint, "--n-eval", "4", "--shots", "2", "--out", str(tmp_path)])
    layers = len(M.decoder_self_attentions(backbones.load_backbone("tiny-idefics2").model))
    assert len(r["per_layer_mean"]) == layers
    for v in r["per_layer_mean"] + [r["early_mean"], r["late_mean"]]:
        assert 0 < v < 1
    assert 0 < r["per_layer_std"] < 0.5
    assert -1 <= r["corr_g_delta_attention"] <= 1
    assert os.path.isfile(tmp_path / "gates-vqav2-val.json")


def test_gates_need_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        E.main(["--gates"])


def test_hyperbolicity(tmp_path, checkpoint):
    r = E.main([*TINY, "--hyperbolicity", "--checkpoint", checkpoint, "--n-eval", "4", "--shots", "2", "--out",
                str(tmp_path)])
    for name in ("teacher", "student"):
        assert 0 <= r[name]["mean"] <= 1 and r[name]["std"] >= 0
    assert r["teacher"] != r["student"]
    assert os.path.isfile(tmp_path / "hyperbolicity-vqav2-val.json")


def test_middle_layers():
    assert list(analyses.middle_layers(32)) == [14, 15, 16, 17]
    assert list(analyses.middle_layers(2)) == [0, 1]


def test_attention_benchmark_runs_every_path(capsys):
    ms = table6.attention_benchmark(backbones.load_backbone("tiny-idefics2").model, T=16, rounds=1)
    assert list(ms) == ["sdpa", *registry.METHODS, "hyper-icl reference"]
    assert all(t > 0 and m > 0 for t, m in ms.values())
    assert "hyper-icl reference" in capsys.readouterr().out


# -----------------------------------------------------------------------------
# learning curves (--curve): intervals over seeds, graded measures

def test_mean_interval_by_hand():
    mean, low, high = curves.mean_interval([1.0, 2.0, 3.0])          # s = 1, t(0.975, 2) = 4.303
    assert mean == 2 and abs(high - 2 - 4.303 / 3 ** 0.5) < 1e-9 and abs(2 - low - 4.303 / 3 ** 0.5) < 1e-9
    mean, low, high = curves.mean_interval([2.0, 4.0, 4.0, 6.0])     # s = sqrt(8 / 3), t(0.975, 3) = 3.182
    assert mean == 4 and abs((high - low) / 2 - 3.182 * (8 / 3) ** 0.5 / 2) < 1e-9
    assert curves.mean_interval([5.0, 5.0, 5.0]) == (5.0, 5.0, 5.0)
    mean, low, high = curves.mean_interval([7.0])
    assert mean == 7 and math.isnan(low) and math.isnan(high)


def test_answer_measures_against_the_models_own_logits():
    """With the teacher's logits replaced by the model's own zero-shot ones the KL is 0, and log p(target) summed
    over the items is minus the cross-entropy of model.supervised_loss times the number of target tokens."""
    backbone = backbones.load_backbone("tiny-idefics2")
    items = tasks.load_task("vqav2", "val", benchmarks.ROOT)[:5]
    rows = [D.encode(backbone.processor, backbone.family, "vqa", [], q) for q in items]
    batch = D.collate(rows, backbone.processor, backbone.family)
    with torch.no_grad():
        logits = backbone.model(**D.model_inputs(batch)).logits
    answer = M.answer_positions(batch["labels"])
    own = [logits[b, answer[b]] for b in range(len(items))]
    measures = curves.answer_measures(backbone, "vqa", items, own, batch_size=2)
    assert abs(measures["teacher_kl"]) < 1e-6
    ce = M.supervised_loss(logits, batch["labels"]).item()
    assert abs(measures["answer_logprob"] * len(items) + ce * answer.sum().item()) < 1e-3
    shifted = [t + torch.randn_like(t) for t in own]                # another teacher: a positive KL
    assert curves.answer_measures(backbone, "vqa", items, shifted, batch_size=5)["teacher_kl"] > 1e-3


def test_curve_trains_every_row_budget_and_seed_and_continues_where_it_stopped(tmp_path, monkeypatch):
    out = tmp_path / "curve"
    flags = ["--curve", "--model", "tiny-idefics2", "--task", "toy-icl-colour", "--n-eval", "6", "--batch-size", "6",
             "--curve-queries", "4", "8", "--curve-seeds", "2", "--curve-methods", "hyper-icl", "hificl", "--no-tune",
             "--train-args", "--epochs 1 --n-heldout 2 --batch-size 4", "--out", str(out)]
    runs, levels = E.main(flags)
    assert sorted((r["setting"], r["queries"], r["seed"]) for r in runs) == sorted(
        (s, n, k) for s in ("hyper-icl", "hificl") for n in (4, 8) for k in (0, 1))
    assert set(levels) == {f"{n}-shot ICL" for n in curves.ICL_LEVELS} and "teacher_kl" in levels["0-shot ICL"]
    table = (out / "curve.md").read_text()
    assert table.count("| hificl |") == 4 and "N = 8" in table and "| hificl | `--method hificl` |" in table
    assert (out / "curve.png").stat().st_size > 0
    steps = []
    monkeypatch.setattr(E, "predict", lambda *a, **k: steps.append("evaluated"))
    monkeypatch.setattr(train, "train", lambda *a, **k: steps.append("trained"))
    assert E.main(flags) == (runs, levels) and steps == []  # the same command again: every run read, none redone


def test_tuning_widens_the_sweep_at_an_edge_and_picks_the_lowest_heldout_loss(tmp_path, monkeypatch):
    """With a held-out loss |log10(lr / best)| per run (train.main replaced), the sweep around each published rate
    walks a decade at a time to the best rate, stops TUNE_DECADES from the published one, and picks lambda."""
    best = {"hificl": 5e-5, "mimic": 1e-1, "live": 1e-3}   # 2 decades below / 4 above (capped at 3) / the published
    trained = []

    def fake_train(argv):
        a = train.parse_args(argv)
        trained.append((a.method, a.lr, a.lam))
        loss = abs(math.log10(a.lr / best[a.method])) + (a.lam == 5.0) * 0.1
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "history.json"), "w") as f:
            json.dump([{"epoch": 1, "heldout_loss": loss + 1}, {"epoch": 2, "heldout_loss": loss}], f)
    monkeypatch.setattr(train, "main", fake_train)
    args = E.parse_args(["--curve", "--model", "tiny-idefics2", "--task", "toy-icl-colour", "--out", str(tmp_path)])
    flags = ["--model", "tiny-idefics2", "--task", "toy-icl-colour", *shlex.split(args.train_args)]
    chosen, runs = curves.tune(args.out, flags, list(best), train.main, train.Config.lam)
    assert chosen["hificl"] == {"lr": pytest.approx(5e-5), "lam": None}
    assert chosen["mimic"] == {"lr": pytest.approx(1e-2), "lam": 0.5}      # 1e-5 x 10^3: the widest it goes
    assert chosen["live"] == {"lr": pytest.approx(1e-3), "lam": 0.5}
    assert sorted(lr for m, lr, _ in trained if m == "hificl") == pytest.approx([5e-6, 5e-5, 5e-4, 5e-3, 5e-2])
    assert sorted(lr for m, lr, _ in trained if m == "mimic") == pytest.approx([1e-6, 1e-5, 1e-4, 1e-3] + [1e-2] * 2)
    assert sorted(lam for m, _, lam in trained if m == "live") == [0.5] * 3 + [5.0]   # lambda 0.5: the rate's run
    assert len(runs) == len(trained)
    assert json.loads((tmp_path / "tune.json").read_text())["chosen"]["live"]["lam"] == 0.5
    assert curves.row_flags(["--method", "live", "--lam", "2"], chosen) == ["--lr", "0.001", "--lam", "0.5",
                                                                            "--method", "live", "--lam", "2"]


def test_the_tuning_split_is_disjoint_from_the_evaluation_items_and_from_its_training_queries():
    args = E.parse_args(["--curve", "--model", "tiny-idefics2", "--task", "toy-icl-colour"])
    tuning_run = train.parse_args(["--model", args.model, "--task", args.task, *shlex.split(args.train_args),
                                   *curves.tune_flags(1e-3)])  # the flags E.tune gives train.main, whose split this is
    trained, scored = tasks.split_pool(tuning_run, families.family_of(args.model))[:2]
    evaluated = tasks.eval_items(args)
    assert len(scored) == curves.TUNE["n_heldout"] and len(trained) == curves.TUNE["n_train"] and len(evaluated) == 300
    images = lambda items: {hashlib.sha256(open(it.image_path, "rb").read()).hexdigest() for it in items}
    assert not images(scored) & images(evaluated) and not images(trained) & images(evaluated)
    assert not images(scored) & images(trained) and not {it.id for it in scored} & {it.id for it in evaluated}


@pytest.mark.parametrize("flags,message", [(["--curve-seeds", "1"], "--curve-seeds must be in"),
                                           (["--curve-methods", "nope"], "--curve-methods: unknown"),
                                           (["--curve-queries", "0"], "--curve-queries must be at least 1")])
def test_curve_flags_are_checked(flags, message, capsys):
    with pytest.raises(SystemExit):
        E.parse_args(["--curve", *flags])
    assert message in capsys.readouterr().err
