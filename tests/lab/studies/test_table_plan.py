"""The plan of a table (lab/studies/table_plan.py): the time model is the FLOP counter's count, Qwen's flattened
patches and merged connectors counted, GPU hours at the published size without weights."""
import json

import pytest

import benchmarks
import data as D
import evaluate
from lab.datasets import tasks
from lab.models import backbones
from lab.run import shard
from lab.studies import flops, table_plan
from helpers import lab, lab_args, no_weights


@pytest.mark.parametrize("name", ["tiny-idefics2", "tiny-idefics"])
def test_the_time_model_is_the_flop_counters_count(name):
    """forward_flops and generate_flops against torch.utils.flop_counter on an 8-shot prompt of a tiny twin, its
    attention run as "eager" (matmuls the counter counts; it does not count CPU SDPA's kernel): within 10% (Idefics'
    gated cross-attention projects its image keys again at each generated token, which the model leaves out)."""
    from torch.utils.flop_counter import FlopCounterMode
    import model as M
    backbone = backbones.load_backbone(name)
    items = tasks.load_task("vqav2", "val", benchmarks.ROOT)[:1]
    icds = D.demonstrations([items[0].id], tasks.load_task("vqav2", "train", benchmarks.ROOT), 8, 0)
    batch = D.model_inputs(D.prompt_batch(backbone.processor, backbone.family, "vqa", items, icds))
    f, tokens = flops.flop_model(backbone.model), int(batch["attention_mask"].sum())
    counter = table_plan.Tokens(backbone.processor, backbone.family, "vqa", items[0], 14)
    assert counter.row(items[0], icds[0], False) == tokens and counter.patches == f["patches"] == 4  # 28 x 28 / 14
    with M.attention_as(backbone.model, "eager"), FlopCounterMode(display=False) as forward:
        backbone.model(**batch, logits_to_keep=1)
    with M.attention_as(backbone.model, "eager"), FlopCounterMode(display=False) as generating:
        evaluate.generate(backbone, batch, 5, 5)
    assert flops.forward_flops(f, tokens, 9) == pytest.approx(forward.get_total_flops(), rel=0.1)
    assert flops.generate_flops(f, tokens, 9, 5) == pytest.approx(generating.get_total_flops(), rel=0.1)


def test_the_plan_at_the_published_size_reads_no_weights_and_gives_gpu_hours(tmp_path, monkeypatch, capsys):
    processor = tmp_path / "processor"
    backbones.load_backbone("tiny-idefics2").processor.save_pretrained(processor)  # a processor; the model's size
    no_weights(monkeypatch)
    planned = lab(["table", "1", "--model", "idefics2", "--processor", str(processor), "--plan", "cuda",
                            "--data-root", benchmarks.ROOT, "--n-eval", "2", "--gpus", "0,1,2,3",
                            "--train-args", "--n-train 2 --n-heldout 1", "--plan-json", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert planned["gpus"] == 4 and planned["backbone_loads"] == 4 and 0 < planned["wall_hours"] <= planned["gpu_hours"]
    assert 0 < planned["bound_hours"] < planned["gpu_hours"]
    assert "config published_configs.idefics2" in out and "(bound / expected) on an H200 SXM" in out
    assert "on 4 GPU(s)" in out and "time by phase" in out and "one query, bound / expected: batch 1:" in out
    written = json.loads((tmp_path / "plan.json").read_text())  # --plan-json: the schema, the printed hours
    assert written["accelerator"] == "an H200 SXM" and written["runs"] == planned["runs"]
    assert written["hours"]["expected"] == pytest.approx(planned["gpu_hours"])
    assert {"script", "task", "method", "shots", "batch", "ttft_ms", "per_token_ms", "hours"} == set(written["runs"][0])
    evaluations = [r for r in written["runs"] if r["script"] == "evaluate.py"]
    assert {r["batch"] for r in evaluations} == {1, 8}  # each evaluation at batch 1 and at its own
    assert all(0 < r["ttft_ms"]["bound"] < r["ttft_ms"]["expected"] for r in evaluations)


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
    f, tokens = flops.flop_model(backbone.model), int(batch["attention_mask"].sum())
    counter = table_plan.Tokens(backbone.processor, backbone.family, "vqa", items[0],
                                backbone.model.config.vision_config.patch_size)
    assert counter.row(items[0], icds[0], False) == tokens
    with M.attention_as(backbone.model, "eager"), FlopCounterMode(display=False) as forward:
        backbone.model(**batch, logits_to_keep=1)
    assert flops.forward_flops(f, tokens, 3, 1, counter.patches) == \
        pytest.approx(forward.get_total_flops(), rel=0.05)


def test_a_sharded_table_plans_each_job_over_its_gpus(tmp_path, monkeypatch, capsys):
    """--shard --gpus 0-3: each job's peak is a GPU's of four (shard.weight_bytes' shard, a quarter of the batch: the
    unsharded plan's peak is larger), every job loads the backbone and runs over all four, so the wall time is the
    GPU-hours over four."""
    processor = tmp_path / "processor"
    backbones.load_backbone("tiny-idefics2").processor.save_pretrained(processor)
    flags = ["table", "7", "--model", "idefics2", "--processor", str(processor), "--plan", "cuda", "--data-root",
             benchmarks.ROOT, "--n-eval", "8", "--train-args", "--n-train 8 --n-heldout 1", "--gpus", "0-3"]
    peaks = lambda out: [line.split("peak ~")[1].split(";")[0] for line in out.splitlines() if "peak ~" in line]
    whole = lab(flags)
    one = peaks(capsys.readouterr().out)
    planned = lab([*flags, "--shard"])
    out = capsys.readouterr().out
    assert "--shard: each cell's job runs over 4 GPUs at once" in out and planned["gpus"] == 4
    assert planned["backbone_loads"] == planned["jobs"] == whole["jobs"] > whole["backbone_loads"] == 4
    assert planned["wall_hours"] == pytest.approx(planned["gpu_hours"] / 4) and planned["gpu_hours"] == \
        whole["gpu_hours"]
    sized = lambda text: float(text.split()[0]) * {"MB": 1e6, "GB": 1e9}[text.split()[1]]
    model = table_plan.Work(lab_args([*flags, "--shard"]), "idefics2").model  # the meta-device model, no weights
    held = shard.weight_bytes(model, 4)  # a GPU's shard in bf16, two units gathered whole
    assert len(peaks(out)) == len(one) and all(held < sized(s) < sized(w) for s, w in zip(peaks(out), one))
