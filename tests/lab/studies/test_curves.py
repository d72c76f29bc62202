"""Learning curves (lab/studies/curves.py): the mean interval by hand, the answer measures against the model's own
logits, every row budget and seed trained and continued, the learning-rate tuning and its split, the flags."""
import hashlib
import json
import math
import os
import shlex

import pytest
import torch

import benchmarks
import data as D
import evaluate as E
import model as M
import train
from lab.datasets import tasks
from lab.models import backbones, families
from lab.studies import curves
from helpers import lab, lab_args, lab_train_args


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
    flags = ["curve", "--model", "tiny-idefics2", "--task", "toy-icl-colour", "--n-eval", "6", "--batch-size", "6",
             "--curve-queries", "4", "8", "--curve-seeds", "2", "--curve-methods", "hyper-icl", "hificl", "--no-tune",
             "--train-args", "--epochs 1 --n-heldout 2 --batch-size 4", "--out", str(out)]
    runs, levels = lab(flags)
    assert sorted((r["setting"], r["queries"], r["seed"]) for r in runs) == sorted(
        (s, n, k) for s in ("hyper-icl", "hificl") for n in (4, 8) for k in (0, 1))
    assert set(levels) == {f"{n}-shot ICL" for n in curves.ICL_LEVELS} and "teacher_kl" in levels["0-shot ICL"]
    table = (out / "curve.md").read_text()
    assert table.count("| hificl |") == 4 and "N = 8" in table and "| hificl | `--method hificl` |" in table
    assert (out / "curve.png").stat().st_size > 0
    steps = []
    monkeypatch.setattr(E, "predict", lambda *a, **k: steps.append("evaluated"))
    monkeypatch.setattr(train, "train", lambda *a, **k: steps.append("trained"))
    assert lab(flags) == (runs, levels) and steps == []  # the same command again: every run read, none redone


def test_tuning_widens_the_sweep_at_an_edge_and_picks_the_lowest_heldout_loss(tmp_path, monkeypatch):
    """With a held-out loss |log10(lr / best)| per run (the training replaced), the sweep around each published rate
    walks a decade at a time to the best rate, stops TUNE_DECADES from the published one, and picks lambda."""
    best = {"hificl": 5e-5, "mimic": 1e-1, "live": 1e-3}   # 2 decades below / 4 above (capped at 3) / the published
    trained = []

    def fake_train(argv):
        a = lab_train_args(argv)
        trained.append((a.method, a.lr, a.lam))
        loss = abs(math.log10(a.lr / best[a.method])) + (a.lam == 5.0) * 0.1
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "history.json"), "w") as f:
            json.dump([{"epoch": 1, "heldout_loss": loss + 1}, {"epoch": 2, "heldout_loss": loss}], f)
    args = lab_args(["curve", "--model", "tiny-idefics2", "--task", "toy-icl-colour", "--out", str(tmp_path)])
    flags = ["--model", "tiny-idefics2", "--task", "toy-icl-colour", *shlex.split(args.train_args)]
    chosen, runs = curves.tune(args.out, flags, list(best), fake_train, train.Config.lam)
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
    args = lab_args(["curve", "--model", "tiny-idefics2", "--task", "toy-icl-colour"])
    tuning_run = lab_train_args(["--model", args.model, "--task", args.task, *shlex.split(args.train_args),
                                 *curves.tune_flags(1e-3)])  # the flags curves.tune trains with, whose split this is
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
        lab_args(["curve", *flags])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("train_args, message", [
    ("--epochs '1", "cannot be split into flags (No closing quotation)"),
    ("--epochs 0", "train.py says: --epochs must be at least 1 (got 0)"),
    ("--no-such-flag", "train.py says: unrecognized arguments: --no-such-flag")])
def test_curve_train_args_are_checked_before_any_work(train_args, message, capsys, monkeypatch):
    monkeypatch.setattr(backbones, "load_backbone", lambda *a, **k: pytest.fail("a backbone was loaded"))
    with pytest.raises(SystemExit) as e:
        lab(["curve", "--model", "tiny-idefics2", "--task", "vqav2", f"--train-args={train_args}"])
    assert e.value.code == 2 and message in capsys.readouterr().err
