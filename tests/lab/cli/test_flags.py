"""The flags of train.py and evaluate.py (lab/cli/flags.py, train_cli.py, eval_cli.py): made from the Configs'
fields, numeric flags checked before anything loads, flags of another method or mode refused naming them, and bad
folders and data named before the backbone loads."""
import dataclasses
import json
import re

import pytest
from PIL import Image

import evaluate
import train
from helpers import (ANNOTATION, EVAL, lab_args, lab_evaluate, lab_evaluate_args, lab_train, lab_train_args, QUESTION,
                     refused, RUN, run_flags, TINY, TRAIN, vqa_files)
from lab.cli import flags
from lab.datasets import tasks
from lab.models import backbones


def test_icd_task_the_same_as_task_is_refused_as_it_would_hand_the_held_out_queries_over(tmp_path, capsys):
    path = tmp_path / "mine.jsonl"
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    path.write_text("".join(json.dumps({"id": i, "image": "a.png", "question": "q?", "answer": "a"}) + "\n"
                            for i in range(6)))
    for parse, extra in ((lab_train_args, []), (lab_evaluate_args, ["--shots", "1"])):
        for task, icd_task in (("vqav2", "vqav2"), (str(path), str(tmp_path / "." / "mine.jsonl"))):
            assert f"--icd-task {icd_task} is --task itself" in refused(parse, ["--task", task, "--icd-task", icd_task,
                                                                                *extra], capsys)
    assert "--eval-draw applies with --n-eval" in refused(lab_evaluate_args, ["--eval-draw", "seeded"], capsys)
    assert "--eval-draw applies with --n-eval" in refused(lab_evaluate_args, ["--task", "mme", "--n-eval", "4",
                                                                                "--eval-draw", "seeded"], capsys)


@pytest.mark.parametrize("script, filled", [(train, {"rank", "anchor", "out", "teacher_cache"}),
                                            (evaluate, {"checkpoint", "seed_protocol", "out"})])
def test_the_flags_are_the_configs_fields_with_their_values_and_comments(script, filled, capsys, monkeypatch, tmp_path):
    """--help lists one flag per field the script's Config writes itself (at most 30; the harness's fields it inherits
    are lab's flags) and no other; the flags' defaults are the fields' values (but those parse_args fills in) and each
    field has its comment, the flag's help."""
    with pytest.raises(SystemExit):
        script.parse_args(["--help"])
    listed = set(re.findall(r"^  (?:-h, )?(--[\w-]+)", capsys.readouterr().out, re.M)) - {"--help"}
    fields = dataclasses.fields(script.Config)
    assert listed == {"--" + name.replace("_", "-") for name in script.Config.__annotations__} and len(listed) <= 30
    monkeypatch.chdir(tmp_path)  # no default checkpoint here
    parsed, defaults = dataclasses.asdict(script.parse_args([])), dataclasses.asdict(script.Config())
    kept = lambda settings: {k: v for k, v in settings.items() if k not in filled}
    assert kept(parsed) == kept(defaults)
    helps = flags.field_help(script.Config)
    assert [f.name for f in fields if not helps.get(f.name)] == []


def test_a_configs_source_is_read_once_a_process_however_often_its_flags_are_parsed(monkeypatch):
    """A table parses its jobs' flags hundreds of times: the comments that are the flags' help are read once."""
    lab_train_args([]), lab_evaluate_args([])
    monkeypatch.setattr(flags.inspect, "getsource", lambda obj: pytest.fail(f"{obj} read again"))
    for _ in range(3):
        lab_train_args([]), lab_evaluate_args([])


@pytest.mark.parametrize("flag, value", [
    ("--lr", "1e300"), ("--lr", "inf"), ("--kappa", "inf"), ("--lam", "inf"), ("--weight-decay", "inf"),
    ("--temperature", "inf"), ("--clip", "inf"), ("--temperature", "1e39"), ("--kappa", "1e-300"),
    ("--temperature", "1e-30"), ("--temperature", "1e20")])
def test_float_flags_are_finite_and_in_float32s_range_before_anything_loads(flag, value, capsys, monkeypatch):
    monkeypatch.setattr(backbones, "load_backbone", lambda *a, **k: pytest.fail("a backbone was loaded"))
    with pytest.raises(SystemExit) as e:
        lab_train([*TRAIN, f"{flag}={value}"])
    assert e.value.code == 2 and f"error: {flag} must be" in capsys.readouterr().err


@pytest.mark.parametrize("parse, flag, value", [
    (lab_train_args, "--seed", str(2**70)), (lab_evaluate_args, "--seed", str(2**70)),
    (lab_train_args, "--seed", "-1"), (lab_train_args, "--epochs", str(2**64)),
    (lab_evaluate_args, "--n-eval", str(2**64)), (lab_train_args, "--threads", str(2**40)),
    (lab_train_args, "--workers", str(2**62)), (lab_evaluate_args, "--workers", str(flags.MAX_WORKERS + 1)),
    (lambda argv: lab_args(["benchmark", *argv]), "--rounds", str(10**12))])  # issue 63, item 18: could never finish
def test_integer_flags_fit_their_dtype_and_name_the_flag(parse, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        parse([*TRAIN[:6], flag, value])
    assert e.value.code == 2 and f"error: {flag} must be at" in capsys.readouterr().err


def test_an_adapter_too_large_for_memory_and_a_missing_checkpoint_are_named(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"the hyper-icl adapter of \{'rank': 1000000000000\} does not fit in memory .*"
                                         r"lower --rank or --virtual-tokens"):
        lab_train([*TRAIN, "--rank", str(10**12), "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit):
        lab_evaluate_args([*EVAL, "--checkpoint", str(tmp_path / "none.safetensors")])
    assert f"error: --checkpoint {tmp_path / 'none.safetensors'}: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["1e300", "nan", "inf", "-1", "0"])
def test_image_memory_out_of_range_is_a_parser_error(value, capsys):
    for parse in (lab_evaluate_args, lab_train_args):
        with pytest.raises(SystemExit):
            parse(["--image-memory", value])
        assert "--image-memory must be a finite number of GB > 0" in capsys.readouterr().err


def test_attention_tokens_beyond_memory_is_one_line_naming_the_flag():
    from lab.models import backbones
    from lab.studies import efficiency
    model = backbones.load_backbone("tiny-idefics2").model
    with pytest.raises(ValueError, match=r"^--attention-tokens 1000000000: one attention layer at 1000000000 tokens "
                                         r"does not fit in memory \(.*\); lower --attention-tokens$"):
        efficiency.attention_benchmark(model, T=10 ** 9, rounds=1)  # before: torch's RuntimeError traceback


@pytest.mark.parametrize("script, flags, says", [
    ("train", ["--temperature", "2"], "--temperature applies with --anchor kl"),
    ("train", ["--virtual-tokens", "4"], "--virtual-tokens applies to --method hificl"),
    ("train", ["--method", "hificl", "--anchor-norm", "first"], "--anchor-norm applies with an anchor"),
    ("train", ["--no-teacher-cache", "--teacher-cache", "elsewhere"], "--teacher-cache applies without --no-teacher"),
    ("table 1", ["--processor", "folder"], "--processor applies with --plan"),
    ("train", ["--rices-encoder", "clip"], "--rices-encoder applies with --icds rices"),
    ("evaluate", ["--shots", "0", "--force"], "--force applies to a --checkpoint"),
    ("evaluate", ["--shots", "2", "--rices-encoder", "clip"], "--rices-encoder applies with --icds rices"),
    ("evaluate", ["--shots", "0", "--fv-heads", "2"], "--fv-heads applies with --vector fv"),
    ("evaluate", ["--shots", "0", "--seed-protocol", "likelihood"], "--seed-protocol applies to the SEED-Bench"),
])
def test_a_flag_of_another_method_or_mode_is_refused_naming_it(script, flags, says, capsys):
    with pytest.raises(SystemExit):
        lab_args([*script.split(), *TINY, *flags])  # python -m lab <script> [flags]
    assert f"{says}" in capsys.readouterr().err  # before: taken, doing nothing, without a word


def test_the_flags_of_the_method_or_mode_in_use_are_taken():
    import evaluate
    import train
    assert lab_train_args([*TINY, "--method", "live", "--temperature", "2"]).temperature == 2
    assert lab_train_args([*TINY, "--method", "hificl", "--virtual-tokens", "4"]).virtual_tokens == 4
    assert lab_args(["benchmark-attention", *TINY, "--attention-tokens", "64"]).attention_tokens == 64


@pytest.mark.parametrize("flag, value", [
    ("--rank", "0"), ("--rank", "-1"), ("--batch-size", "0"), ("--n-train", "0"), ("--n-heldout", "0"),
    ("--grad-accum", "0"), ("--save-every", "0"), ("--epochs", "0"), ("--max-steps", "0"), ("--shots", "-1"),
    ("--virtual-tokens", "0"), ("--kappa", "0"), ("--kappa", "-1")])
def test_train_rejects_flags_that_would_be_silently_rewritten_or_fail_later(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        lab_train_args([*RUN, flag, value])
    assert e.value.code == 2 and f"error: {flag} must be" in capsys.readouterr().err


def test_rank_default_is_per_method_and_never_replaces_a_given_rank():
    assert lab_train_args(RUN).rank == 4
    assert lab_train_args([*RUN, "--method", "hificl"]).rank == 8
    assert lab_train_args([*RUN, "--method", "hificl", "--rank", "1"]).rank == 1


@pytest.mark.parametrize("flag, value", [("--n-eval", "0"), ("--batch-size", "0"), ("--shots", "-1")])
def test_evaluate_rejects_bad_flags(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        lab_evaluate_args(["--model", "tiny-idefics2", "--task", "vqav2", flag, value])
    assert e.value.code == 2 and f"error: {flag} must be at least" in capsys.readouterr().err


def test_a_data_root_or_cache_that_is_a_file_is_named(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match=f"--data-root {tmp_path / 'file'} is a file"):
        tasks.load_task("vqav2", "train", str(tmp_path / "file"))
    for parse, flag in ((lab_train_args, "--rices-cache"), (lab_evaluate_args, "--rices-cache"),
                        (lab_train_args, "--out"), (lab_evaluate_args, "--out")):
        with pytest.raises(SystemExit):
            parse(["--model", "tiny-idefics2", "--task", "vqav2", flag, str(tmp_path / "file")])
        assert f"error: {flag} {tmp_path / 'file'} is a file; it must be a folder" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--warmup", "2"), ("--warmup", "1"), ("--warmup", "-0.1"),
                                         ("--lr", "0"), ("--clip", "0"), ("--lam", "-1"), ("--weight-decay", "-1")])
def test_train_rejects_fractions_and_rates_out_of_range(flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        lab_train_args([*RUN, flag, value])
    assert e.value.code == 2 and f"error: {flag} must be" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--vector-sets", "0"), ("--vector-heldout", "0"), ("--fv-heads", "0"),
                                         ("--fv-trials", "0"), ("--vector-layer", "-1"), ("--new-tokens", "0"),
                                         ("--attention-tokens", "0"), ("--threads", "0"), ("--bench-shots", "-8")])
def test_evaluate_rejects_counts_out_of_range(flag, value, capsys):
    mode = "benchmark" if flag in ("--attention-tokens", "--bench-shots") else "evaluate"  # Table 6's own flags
    with pytest.raises(SystemExit) as e:
        lab_args([mode, "--model", "tiny-idefics2", "--task", "vqav2", flag, value])
    assert e.value.code == 2 and f"error: {flag} must be at least" in capsys.readouterr().err


def test_bad_data_is_reported_before_the_backbone_loads(tmp_path, monkeypatch):
    root = vqa_files(tmp_path, {"questions": [{**QUESTION, "question": None}]}, {"annotations": [ANNOTATION]})
    vqa_files(tmp_path, {"questions": [{**QUESTION, "question": None}]}, {"annotations": [ANNOTATION]}, split="train")
    monkeypatch.setattr(backbones, "load_backbone", lambda *a, **k: pytest.fail("the backbone was loaded first"))
    with pytest.raises(ValueError, match="its question is None"):
        lab_train([*run_flags(tmp_path, "run"), "--data-root", str(root)])
    with pytest.raises(ValueError, match="its question is None"):
        lab_evaluate(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", str(root), "--shots", "0",
                      "--out", str(tmp_path / "eval")])


def test_an_out_that_cannot_be_made_names_the_flag(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OSError, match=rf"--out {tmp_path / 'file' / 'run'}: cannot make the folder"):
        lab_train([*RUN, "--out", str(tmp_path / "file" / "run")])


@pytest.mark.parametrize("extra, message", [
    (["--task", "vqav2", "--seed-protocol", "likelihood"], "--seed-protocol applies to"),
    (["--task", "vqav2", "--seed-protocol", "generate"], "--seed-protocol applies to the SEED-Bench tasks"),
])
def test_seed_flags_that_cannot_apply_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit):
        lab_evaluate_args(["--model", "tiny-idefics2", *extra])
    assert message in capsys.readouterr().err
    args = lab_evaluate_args(["--model", "tiny-idefics2", "--task", "seed"])
    assert args.seed_protocol == "generate"


def test_train_args_may_start_with_a_dash_without_an_equals_sign(capsys):
    args = lab_args(["curve", "--model", "tiny-idefics2", "--task", "vqav2", "--train-args",
                              "--epochs 2"])
    assert args.train_args == "--epochs 2"
    with pytest.raises(SystemExit):
        lab_args(["curve", "--model", "tiny-idefics2", "--task", "vqav2", "--train-args", "--resume"])
    assert "--train-args '--resume': train.py says:" in capsys.readouterr().err


def test_train_args_asking_for_help_and_table_flags_of_odd_text_name_their_flag(tmp_path, capsys):
    """--train-args "-h" (a table, --curve): a one-line error naming the flag (before: train.py's help, then an
    IndexError); --gpus ² (a Unicode digit) and --gpus "" (an empty shell variable): named (before: `invalid literal
    for int()`, and the whole table in one process without a word); a missing --icd-task file names --icd-task
    (before: --task)."""
    table = ["table", "7", *TINY, "--out", str(tmp_path)]
    for argv in ([*table, "--train-args", "-h"], ["curve", *TINY, "--train-args", "--help"]):
        assert "--train-args asks for train.py's help" in refused(lab_args, argv, capsys)
    for gpus in ("²", "", "0,"):
        assert f"--gpus takes device numbers separated by commas, as 0,1,2,3 (got {gpus!r})" in refused(
            lab_args, [*table, "--gpus", gpus], capsys)
    for parse, extra in ((lab_train_args, []), (lab_evaluate_args, ["--shots", "1"])):
        missing = str(tmp_path / "none.jsonl")
        argv = [*TINY, "--task", "vqav2", "--icd-task", missing, *extra]
        assert f"--icd-task {missing}: no such file or folder" in refused(parse, argv, capsys)
