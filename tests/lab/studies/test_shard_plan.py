"""The plan past one GPU (lab/studies/shard_plan.py): qwen2.5-vl-72b's memory a GPU under --shard on 1, 2, 4 and 8
H200s, the fewest that hold it and its torchrun line, from its published config with no weights read."""
import pytest

import benchmarks
import twins
from helpers import lab, no_weights
from lab.models import published
from lab.run import shard


@pytest.fixture(scope="module")
def processor(tmp_path_factory):
    """The Qwen2.5-VL twin's folder, for its processor (the plan reaches no hub)."""
    return twins.write_twin("qwen2.5-vl", tmp_path_factory.mktemp("twin") / "qwen2.5-vl")


def test_weights_a_gpu_holds_are_its_shard_and_two_whole_units():
    """72B: embeddings and head are the largest units (152,064 x 8,192 each), two of them gathered at a time."""
    model = published.meta_model("qwen2.5-vl-72b")
    whole, head = sum(p.numel() for p in model.parameters()), 152064 * 8192
    assert whole == pytest.approx(73.4e9, rel=0.002)
    for n in (2, 4, 8):
        assert shard.weight_bytes(model, n) == 2 * (whole / n + 2 * head)
    assert shard.weight_bytes(model, 1) == 2 * whole
    assert shard.gpus_needed(model, 141e9) == 2 and shard.gpus_needed(model, 80e9) == 4


@pytest.mark.parametrize("accelerator, fewest", [("h200", 2), ("h100", 4)])
def test_the_72b_plan_names_the_fewest_gpus_and_their_torchrun_line(processor, accelerator, fewest, monkeypatch,
                                                                    capsys):
    no_weights(monkeypatch)
    planned = lab(["plan", "train", "--plan", "cuda", "--accelerator", accelerator, "--model", "qwen2.5-vl-72b",
                   "--processor", processor, "--task", "vqav2", "--data-root", benchmarks.ROOT, "--shard"])
    out, gpus = capsys.readouterr().out, planned["shard"]["gpus"]
    line = (f"torchrun --nproc_per_node={fewest} train.py --model qwen2.5-vl-72b --task vqav2 --data-root "
            f"{benchmarks.ROOT} --shard")
    assert planned["shard"]["fewest"] == fewest and f"fewest that hold it: {fewest} -> {line}" in out
    assert all(f"{n}: ~" in out for n in (1, 2, 4, 8))
    memory = {"h200": 141e9, "h100": 80e9}[accelerator]
    assert gpus[fewest]["train"] <= 0.9 * memory < gpus[fewest // 2]["train"]
    model = published.meta_model("qwen2.5-vl-72b")
    rest = gpus[1]["train"] - shard.weight_bytes(model, 1)  # one GPU's activations, adapter and AdamW
    for n in (2, 4, 8):  # the weights' shard and two units, and at most one GPU's rest (its activations at B / n)
        assert shard.weight_bytes(model, n) < gpus[n]["train"] <= shard.weight_bytes(model, n) + rest


def test_without_shard_the_plan_says_one_gpu_does_not_hold_it(processor, monkeypatch, capsys):
    no_weights(monkeypatch)
    lab(["plan", "train", "--plan", "cuda", "--model", "qwen2.5-vl-72b", "--processor", processor, "--task",
         "vqav2", "--data-root", benchmarks.ROOT])
    out = capsys.readouterr().out
    assert "one h200 does not hold --model qwen2.5-vl-72b" in out and "--nproc_per_node=2" in out
