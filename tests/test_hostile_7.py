"""Hostile cases, round 7 (issue 52's "Also"): what the 30 cases of docs/hostile-round-7.md found on the surface the
tables runner (issue 50) and the new backbone families (issue 51) added: --gpus and the folders evaluations share,
--print from files of other settings, the flags a table hands on or takes itself, --proceed on a finished run,
--icd-task, the plan's image FLOPs of Qwen's flattened patches and merged connectors, the media tokens of the new
families, an image Qwen's processors refuse, a processor folder without its tokenizer settings. Each test failed
before its fix. Small: parser calls, tiny twins, two items an evaluation."""
import json
import os
import shutil
import subprocess
import threading

import pytest
import torch
from PIL import Image

import benchmarks
import data as D
import evaluate
import train
from lab.datasets import own_task, readers, tasks
from lab.models import backbones, families, tiny
from lab.run import checkpoints
from lab.studies import table_plan, table_runs, tables

TINY = ["--model", "tiny-idefics2", "--data-root", benchmarks.ROOT, "--threads", "1", "--workers", "0"]


def refused(parse, argv, capsys):
    """The one-line parser error of argv (SystemExit), its text."""
    with pytest.raises(SystemExit):
        parse(argv)
    return capsys.readouterr().err.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------ --gpus, and shared folders

def test_gpus_names_each_device_of_this_machine_once_counted_as_a_scheduler_lists_them(tmp_path, monkeypatch, capsys):
    table = ["--table", "7", *TINY, "--out", str(tmp_path)]
    assert "names a device twice" in refused(evaluate.parse_args, [*table, "--gpus", "0,0"], capsys)  # before: 2 on 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert "this machine has 2 CUDA device(s) visible (0 to 1)" in refused(evaluate.parse_args, [*table, "--gpus",
                                                                                                 "1,2"], capsys)
    assert evaluate.parse_args([*table, "--gpus", "2,3", "--plan", "cuda"]).gpus == "2,3"  # a plan for other machines
    started = []

    class Process:  # the workers, recorded instead of started
        def __init__(self, argv, env):
            started.append(env["CUDA_VISIBLE_DEVICES"])

        def wait(self):
            return 0
    monkeypatch.setattr(subprocess, "Popen", Process)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # a scheduler's share of the machine
    args = evaluate.parse_args([*table, "--gpus", "0,1"])
    table_runs.on_devices(args, [], "evaluate.py")
    assert started == ["4", "5"]  # before: "0", "1", devices of another job


def test_two_evaluations_share_their_folder_and_a_training_waits_for_neither(tmp_path, monkeypatch):
    """A table's evaluations of one task share eval/<task> (and --print-commands' lines run side by side): one that
    starts while another evaluates there runs too (before: "in use by another run", a --gpus worker lost)."""
    flags = [*TINY, "--task", "vqav2", "--n-eval", "2", "--out", str(tmp_path)]
    inside, leave, predict = threading.Event(), threading.Event(), evaluate.predict

    def held(*args, **kwargs):
        inside.set()
        leave.wait(60)
        return predict(*args, **kwargs)
    monkeypatch.setattr(evaluate, "predict", held)
    first = threading.Thread(target=evaluate.main, args=([*flags, "--shots", "0"],))
    first.start()
    try:
        assert inside.wait(60)
        monkeypatch.setattr(evaluate, "predict", predict)
        assert evaluate.main([*flags, "--shots", "1"])["setting"] == "1-shot"
        with pytest.raises(ValueError, match="is in use by another run"):  # a training there: refused, as before
            with checkpoints.locked(str(tmp_path)):
                pass
    finally:
        leave.set()
        first.join()
    assert len(list(tmp_path.glob("*.metrics.json"))) == 2


# ------------------------------------------------------------------------------ --print: the job's own result only

def test_print_shows_a_cell_only_from_a_result_of_its_own_job(tmp_path, capsys):
    """Table 7's zero-shot VQAv2 evaluated once; --print of another backbone, another --data-root, and after the
    metrics were damaged or the predictions they score removed: no number (before: another backbone's or data's
    number beside the paper's; the damaged file a JSON error naming nothing)."""
    flags = ["--table", "7", *TINY, "--n-eval", "2", "--out", str(tmp_path)]
    args = evaluate.parse_args(flags)
    of_cell, _ = table_runs.table_jobs(args, evaluate.parse_args([]), train.parse_args, tables.layout("7", "idefics2"))
    job = of_cell["Zero-shot", "vqav2"]
    evaluate.main(list(job.argv))
    cell = lambda argv: {(c["row"], c["column"]): c for c in evaluate.main(argv)["cells"]}["Zero-shot", "vqav2"]
    assert cell([*flags, "--print"])["ours"] is not None
    other = [a.replace("tiny-idefics2", "tiny-llava-interleave") for a in flags]
    assert cell([*other, "--print"])["ours"] is None
    root = shutil.copytree(os.path.join(benchmarks.ROOT, "vqav2"), tmp_path / "root" / "vqav2")
    moved = [str(root.parent) if a == benchmarks.ROOT else a for a in flags]
    assert cell([*moved, "--print"])["ours"] is None
    metrics, = tmp_path.glob("eval/vqav2/*.metrics.json")
    predictions = str(metrics).replace(".metrics.json", ".predictions.jsonl")
    os.rename(predictions, predictions + ".away")
    assert cell([*flags, "--print"])["marks"][-1] == "missing"  # the run would evaluate it again
    os.rename(predictions + ".away", predictions)
    metrics.write_text(metrics.read_text()[:100])
    assert cell([*flags, "--print"])["ours"] is None


# ------------------------------------------------------------------------- the flags a table hands on or takes itself

def test_a_table_takes_the_flags_its_cells_take_and_refuses_the_rest(tmp_path, capsys):
    table = lambda n, *more: ["--table", n, *TINY, "--out", str(tmp_path), *more]
    for flag in (["--again"], ["--new-tokens", "3"], ["--task", "coco"], ["--eval-draw", "seeded"]):
        assert "reaches no cell of Table 1: its cells choose their own" in refused(  # before: taken, doing nothing
            evaluate.parse_args, table("1", *flag), capsys)
    for flag in ("--task coco", "--meth lora", "--out x"):  # before: every training on coco, LoRA, into x
        assert f"--train-args --{flag.split()[0][2:]}" in refused(evaluate.parse_args, table("1", "--train-args", flag),
                                                                  capsys)
    args = evaluate.parse_args(table("2", "--seed-protocol", "likelihood"))  # before: refused, SEED cells' own flag
    _, jobs = table_runs.table_jobs(args, evaluate.parse_args([]), train.parse_args, tables.layout("2", "idefics2"))
    assert {"likelihood" in j.argv for j in jobs if "seed" in j.argv and j.script == "evaluate.py"} == {True}
    args = evaluate.parse_args(table("1", "--vector-layer", "1", "--rices-encoder", "clip"))
    _, jobs = table_runs.table_jobs(args, evaluate.parse_args([]), train.parse_args, tables.layout("1", "idefics2"))
    for word, flag in (("--vector", "--vector-layer"), ("rices", "--rices-encoder")):  # before: dropped / refused
        assert {flag in j.argv for j in jobs if word in j.argv} == {True} and \
            not any(flag in j.argv for j in jobs if word not in j.argv)
    evaluate.parse_args(table("2", "--vector-sets", "2"))  # a flag of other tables' rows: a note, not an error
    assert "note: --vector-sets reaches no cell of Table 2" in capsys.readouterr().err


def test_rices_on_a_family_without_its_own_tower_is_refused_before_any_work(tmp_path, capsys):
    """Table 1 on a new family stopped at its RICES cell after every training, and --rices-encoder, the way out, was
    refused with --table; a single evaluation or training was refused only after the backbone loaded."""
    table = ["--table", "1", *TINY, "--out", str(tmp_path)]
    qwen = [a.replace("tiny-idefics2", "tiny-qwen2.5-vl") for a in table]
    assert "RICES row: --icds rices: the backbone's own vision tower is read for" in refused(evaluate.parse_args, qwen,
                                                                                             capsys)
    assert evaluate.parse_args([*qwen, "--rices-encoder", "clip"]).rices_encoder == "clip"
    single = ["--model", "tiny-gemma3", "--task", "vqav2", "--icds", "rices", "--shots", "2"]
    assert "not gemma3; give --rices-encoder" in refused(evaluate.parse_args, single, capsys)
    assert "not gemma3; give --rices-encoder" in refused(train.parse_args, single[:-2], capsys)


def test_icd_task_the_same_as_task_is_refused_as_it_would_hand_the_held_out_queries_over(tmp_path, capsys):
    path = tmp_path / "mine.jsonl"
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    path.write_text("".join(json.dumps({"id": i, "image": "a.png", "question": "q?", "answer": "a"}) + "\n"
                            for i in range(6)))
    for parse, extra in ((train.parse_args, []), (evaluate.parse_args, ["--shots", "1"])):
        for task, icd_task in (("vqav2", "vqav2"), (str(path), str(tmp_path / "." / "mine.jsonl"))):
            assert f"--icd-task {icd_task} is --task itself" in refused(parse, ["--task", task, "--icd-task", icd_task,
                                                                                *extra], capsys)
    assert "--eval-draw applies with --n-eval" in refused(evaluate.parse_args, ["--eval-draw", "seeded"], capsys)
    assert "--eval-draw applies with --n-eval" in refused(evaluate.parse_args, ["--task", "mme", "--n-eval", "4",
                                                                                "--eval-draw", "seeded"], capsys)


# ------------------------------------------------------------------------------------- --proceed on a finished run

def test_proceed_refuses_a_finished_run_of_other_data_or_without_its_best_adapter(tmp_path, capsys):
    images = tmp_path / "images"
    images.mkdir()
    lines = []
    for i in range(8):
        Image.new("RGB", (16, 16), (30 * i, 0, 0)).save(images / f"{i}.png")
        lines.append(json.dumps({"id": i, "image": f"images/{i}.png", "question": "what colour?", "answer": "red"}))
    task = tmp_path / "colours.jsonl"
    task.write_text("\n".join(lines) + "\n")
    flags = ["--model", "tiny-idefics2", "--task", str(task), "--n-train", "2", "--n-heldout", "1", "--epochs", "1",
             "--batch-size", "2", "--shots", "1", "--workers", "0", "--threads", "1", "--out", str(tmp_path / "run")]
    train.main([*flags, "--proceed"])
    train.main([*flags, "--proceed"])
    assert "a finished run of these settings" in capsys.readouterr().out
    task.write_text("\n".join(line.replace("red", "blue") for line in lines) + "\n")  # the answers changed since
    with pytest.raises(ValueError, match=r"--proceed: .*last.pt was made with other training data"):
        train.main([*flags, "--proceed"])  # before: skipped as finished, its adapter scored for this data
    task.write_text("\n".join(lines) + "\n")
    os.remove(tmp_path / "run" / "adapter.safetensors")
    with pytest.raises(ValueError, match=r"holds a finished run \(1 epoch\(s\) scored\) without its best adapter"):
        train.main([*flags, "--proceed"])  # before: resumed, "no epoch scored yet ... continue with --resume"
    train.main([*flags, "--resume"])
    assert "its best adapter" in capsys.readouterr().out.splitlines()[-1]


# ----------------------------------------------------------------------------- the plan's image FLOPs, new families

@pytest.mark.parametrize("name", ["tiny-qwen3-vl", "tiny-internvl3"])
def test_the_time_model_counts_flattened_patches_and_merged_connectors(name):
    """forward_flops against torch's FLOP counter on a 2-shot prompt, as test_tables checks the paper's twins: Qwen's
    patches are flattened rows (its grid counts them; before: 2.3-3.2x the FLOPs), its mergers see a 2 x 2 merge of
    them, InternVL's image and patch sizes are pairs (before: a TypeError)."""
    from torch.utils.flop_counter import FlopCounterMode
    import model as M
    backbone = backbones.load_backbone(name)
    items = tasks.load_task("vqav2", "val", benchmarks.ROOT)[:1]
    icds = D.demonstrations([items[0].id], tasks.load_task("vqav2", "train", benchmarks.ROOT), 2, 0)
    batch = D.model_inputs(D.prompt_batch(backbone.processor, backbone.family, "vqa", items, icds))
    f, tokens = table_plan.flop_model(backbone.model), int(batch["attention_mask"].sum())
    counter = table_plan.Tokens(backbone.processor, backbone.family, "vqa", items[0],
                                backbone.model.config.vision_config.patch_size)
    assert counter.row(items[0], icds[0], False) == tokens
    with M.attention_as(backbone.model, "eager"), FlopCounterMode(display=False) as forward:
        backbone.model(**batch, logits_to_keep=1)
    assert table_plan.forward_flops(f, tokens, 3, 1, counter.patches) == \
        pytest.approx(forward.get_total_flops(), rel=0.05)


# ------------------------------------------------------------------------------- the new families' data path

def test_every_media_token_a_family_names_is_refused_in_text(tmp_path):
    """The image and video tokens each twin's config names; <|video_pad|> in a question reached Qwen's M-RoPE as a
    video of no frames (a TypeError traceback after the model loaded)."""
    named = set()
    for build in tiny.TINY_BUILDERS.values():
        model, processor = build()
        config = model.config
        for key in ("image_token_id", "video_token_id", "image_token_index", "video_token_index",
                    "vision_start_token_id", "vision_end_token_id", "boi_token_index", "eoi_token_index"):
            if isinstance(getattr(config, key, None), int):
                named.add(processor.tokenizer.convert_ids_to_tokens(getattr(config, key)))
    assert named - {None} <= set(readers.IMAGE_PLACEHOLDERS) and "<|video_pad|>" in named
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "t.jsonl").write_text(json.dumps({"id": 1, "image": "a.png", "question": "a <|video_pad|>?",
                                                  "answer": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1, field `question`: .*'<\|video_pad\|>', an image placeholder"):
        own_task.read(str(tmp_path / "t.jsonl"))


def test_an_image_qwens_processors_refuse_is_refused_for_every_family_naming_it(tmp_path):
    """A side over 200 times the other: Qwen's processors raise "absolute aspect ratio must be smaller than 200"
    naming nothing, after the model loaded; refused when read (the task's file and line) and when loaded (the item),
    as a 1-pixel side is, so a task reads the same on every backbone."""
    Image.new("RGB", (401, 2)).save(tmp_path / "long.png")
    Image.new("RGB", (2, 400)).save(tmp_path / "ok.png")
    with pytest.raises(OSError, match=r"item 3: cannot read its image .*long.png .*401 x 2 pixels; each side must be "
                                      "at least 2 and at most 200 times the other"):
        D.load_image(D.Item(3, str(tmp_path / "long.png"), "q?", ("a",), "a"))
    assert D.load_image(D.Item(4, str(tmp_path / "ok.png"), "q?", ("a",), "a")).size == (2, 400)
    record = {"id": 1, "image": "long.png", "question": "q?", "answer": "a"}
    (tmp_path / "t.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl line 1, field `image`: .*at most 200 times the other"):
        own_task.read(str(tmp_path / "t.jsonl"))


def test_a_processor_folder_without_its_tokenizer_settings_is_one_error_naming_it(tmp_path):
    """InternVL's processor reads its image tokens' names off tokenizer_config.json; without it, an AttributeError
    traceback after the command started (the plan said more)."""
    _, processor = tiny.tiny_internvl3()
    processor.tokenizer.save_pretrained(tmp_path)
    processor.image_processor.save_pretrained(tmp_path)
    assert families.load_processor(str(tmp_path), "internvl3")[0].image_token == "<IMG_CONTEXT>"
    os.remove(tmp_path / "tokenizer_config.json")
    with pytest.raises(ValueError, match=rf"{tmp_path}: its tokenizer and processor files do not make a internvl3 "
                                         "processor .*restore the checkpoint's tokenizer_config.json"):
        families.load_processor(str(tmp_path), "internvl3")
