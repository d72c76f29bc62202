"""evaluate.py end to end on the tiny twins and the benchmarks of tools/benchmarks.py (CPU): evaluation files,
post-processing, batched generation, the default checkpoint, MME and SEED-Bench (likelihood ranking against a plain
forward), --new-tokens, Ctrl-C."""
import dataclasses
import json
import os
import sys

import pytest
import torch

import benchmarks
import data as D
import evaluate as E
import model as M
import train
from helpers import BENCH, EVAL, lab_evaluate, lab_evaluate_args, lab_train_args, ROOT, TINY
from lab.datasets import mme_seed, tasks
from lab.scores import seed_likelihood
from lab.models import backbones, families


def plain_loglik(backbone, row):
    """sum over the answer tokens t of log p(token t | tokens < t): one unpadded row, float64, a loop."""
    batch = D.collate([row], backbone.processor, backbone.family)
    with torch.no_grad():
        logits = backbone.model(**D.model_inputs(batch)).logits[0].double()
    ids, labels = row["input_ids"], row["labels"]
    return sum(torch.log_softmax(logits[t - 1], -1)[ids[t]].item() for t in range(len(ids)) if labels[t] != -100)


def test_likelihood_ranking_matches_plain_forward(backbone):
    proc, family = backbone.processor, backbone.family
    items, pool = tasks.load_task("seed", "val", benchmarks.ROOT)[:2], tasks.load_task("seed", "train", benchmarks.ROOT)
    icds = D.demonstrations([it.id for it in items], pool, 1, seed=0)
    got = seed_likelihood.option_logliks(backbone, items, icds)
    end = proc.tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    expected = torch.zeros(2, 4, dtype=torch.float64)
    for i, (it, ds) in enumerate(zip(items, icds)):
        demo = dataclasses.replace(ds[0], target=ds[0].answers["ABCD".index(ds[0].target)])  # its answer's text
        for k, option in enumerate(it.answers):
            row = D.encode(proc, family, "choice-likelihood", [demo], dataclasses.replace(it, target=option))
            answer = [t for t, l in zip(row["input_ids"], row["labels"]) if l != -100]
            assert answer == proc.tokenizer(" " + option, add_special_tokens=False)["input_ids"] + [end]
            expected[i, k] = plain_loglik(backbone, row)
    assert len(set(expected.flatten().tolist())) == 8  # the options do differ
    torch.testing.assert_close(got.double(), expected, atol=2e-4, rtol=1e-5)
    ranked = E.predict(backbone, "seed", items, icds, likelihood=True)
    assert ranked == ["ABCD"[k] for k in expected.argmax(-1).tolist()]


@pytest.mark.parametrize("task, protocol", [("mme", None), ("seed", "likelihood")])
def test_evaluate_on_mme_and_seed(backbone, tmp_path, task, protocol):
    protocol = ["--seed-protocol", protocol] if protocol else []  # MME refuses a SEED protocol
    args = lab_evaluate_args(["--model", "tiny-idefics2", "--task", task, "--shots", "2", "--out", str(tmp_path),
                              "--data-root", benchmarks.ROOT, *protocol])
    items = tasks.load_task(task, "val", benchmarks.ROOT)[:4]
    metrics = E.evaluate(backbone, args, items, "2-shot")
    if task == "mme":
        assert metrics["accuracy"] == metrics["mme"]["accuracy"]
        assert set(metrics["mme"]["subtasks"]) == {"existence"}
        with open(tmp_path / "mme-val-2-shot-seed0-n4.mme" / "existence.txt") as f:
            lines = [line.rstrip("\n").split("\t") for line in f]
        assert [(name, q, a) for name, q, a, _ in lines] == [
            (os.path.basename(it.image_path), it.question, it.target) for it in items]
    else:
        assert metrics["protocol"] == "likelihood" and metrics["accuracy"] == metrics["seed_bench"]["accuracy"]
        with open(tmp_path / "seed-val-2-shot-likelihood-seed0-n4.predictions.jsonl") as f:
            assert all(json.loads(line)["prediction"] in "ABCD" for line in f)


N_EVAL = 6


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
    metrics = lab_evaluate(["--model", "tiny-idefics2", "--task", task, "--n-eval", str(N_EVAL), "--batch-size", "4",
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


def test_an_adapter_evaluates_with_the_icds_back_in_its_prompt(tmp_path, checkpoint, monkeypatch):
    """--checkpoint with --shots n (the robustness table's n-shot cells): each prompt holds the n ICDs (longer than
    the adapter alone's) while the adapter is plugged (the first answer token's logits are the adapter's, not the
    backbone's), and the result is named and recorded as the adapter with n shots."""
    seen, generate = [], E.generate

    def recording(backbone, inputs, max_new_tokens, min_new_tokens=0):
        with torch.no_grad():
            adapted = backbone.model(**inputs).logits[:, -1]
            with M.without_adapter(backbone.model):
                plain = backbone.model(**inputs).logits[:, -1]
        seen.append((int(inputs["attention_mask"].sum()), (adapted - plain).abs().max().item()))
        return generate(backbone, inputs, max_new_tokens, min_new_tokens)
    monkeypatch.setattr(E, "generate", recording)
    flags = [*BENCH, "--n-eval", "2", "--batch-size", "2", "--checkpoint", checkpoint, "--out", str(tmp_path)]
    alone, with_icds = lab_evaluate(flags), lab_evaluate([*flags, "--shots", "2"])
    assert (alone["setting"], with_icds["setting"]) == ("hyper-icl", "hyper-icl+2-shot")
    assert (alone["shots"], with_icds["shots"], with_icds["checkpoint"]) == (0, 2, checkpoint)
    (alone_tokens, alone_shift), (icd_tokens, icd_shift) = seen
    assert icd_tokens > alone_tokens and min(alone_shift, icd_shift) > 1e-3
    assert len(list(tmp_path.glob("vqav2-val-hyper-icl+2-shot-checkpoint-*-seed0-n2.metrics.json"))) == 1


def test_n_eval_on_mme_is_stratified_and_its_results_file_pairs_every_image(tmp_path):
    metrics = lab_evaluate(["--model", "tiny-idefics2", "--task", "mme", "--shots", "0", "--n-eval", "29",
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
    assert lab_evaluate([*BENCH, "--n-eval", "2"])["setting"] == "0-shot"
    assert "no adapter: 0-shot evaluation" in capsys.readouterr().out
    default = os.path.join(lab_train_args(BENCH).out, "adapter.safetensors")  # where `python train.py` writes
    os.makedirs(os.path.dirname(default))
    with open(checkpoint, "rb") as src, open(default, "wb") as dst:
        dst.write(src.read())
    metrics = lab_evaluate([*BENCH, "--n-eval", "2"])
    assert metrics["setting"] == "hyper-icl" and metrics["checkpoint"] == default
    assert os.path.isfile(os.path.join(os.path.dirname(default), "vqav2-val-hyper-icl-seed0-n2.metrics.json"))


@pytest.mark.parametrize("family", families.available())
def test_batched_generation_matches_one_at_a_time(family):
    """Left padding changes nothing: the same answers batched (rows of different lengths) and one by one."""
    backbone = backbones.load_backbone("tiny-" + family)
    items = tasks.load_task("vqav2", "val", benchmarks.ROOT)[:4]
    icds = D.demonstrations([it.id for it in items], tasks.load_task("vqav2", "train", benchmarks.ROOT), 1, seed=0)
    assert len({len(D.prompt_batch(backbone.processor, family, "vqa", [it], [d])["input_ids"][0])
                for it, d in zip(items, icds)}) > 1
    assert E.predict(backbone, "vqav2", items, icds, batch_size=4) == \
        E.predict(backbone, "vqav2", items, icds, batch_size=1)


def test_ctrl_c_in_evaluate_is_one_line_and_exit_130(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(E, "predict", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt()))
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *EVAL, "--out", str(tmp_path)])
    source = open(os.path.join(ROOT, "evaluate.py")).read()
    with pytest.raises(BaseException) as e:  # evaluate.py's own __main__ block, on the patched module
        exec(source[source.index("if __name__"):], {**vars(E), "__name__": "__main__"})
    err = capsys.readouterr().err
    assert isinstance(e.value, SystemExit) and e.value.code == 130
    assert err.strip().splitlines()[-1].startswith("interrupted (Ctrl-C)")
    assert not [f for f in os.listdir(tmp_path) if "metrics" in f or "predictions" in f]


def test_new_tokens_bounds_every_evaluation(tmp_path, monkeypatch):
    import benchmarks
    import evaluate
    asked = []
    real = evaluate.generate
    monkeypatch.setattr(evaluate, "generate", lambda b, inputs, n, *a: asked.append(n) or real(b, inputs, n, *a))
    flags = [*TINY, "--task", "vqav2", "--data-root", benchmarks.ROOT, "--n-eval", "2", "--shots", "0", "--out",
             str(tmp_path), "--workers", "0"]
    metrics = lab_evaluate([*flags, "--new-tokens", "1"])
    assert asked == [1] and metrics["new_tokens"] == 1  # before: the task's 5, the flag taken without effect
    with pytest.raises(ValueError, match="holds the result of other settings: new_tokens 1 \\(now 5\\)"):
        lab_evaluate(flags)  # the result of 1 token is not replaced by one of 5 under the same name
