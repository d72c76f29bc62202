"""The plan's time on a GPU (lab/studies/roofline.py, table_plan's prefill / step): its bound below and its expected
time within 1.5x of the published measurements of one Idefics2-8B VQAv2 query (issue 61), on COCO-size photographs
and the real-processor twin's processor, no weights; the image FLOPs against torch's FLOP counter at the published
size on the meta device."""
import json
from unittest import mock

import pytest
import torch

import evaluate
from memory_twins import write_photos
from twins import write_twin
from lab.models import published
from lab.studies import roofline, table_plan

STAVE = {0: (98e-3, 23.9e-3), 8: (1430e-3, 23.9e-3)}  # H200, batch 1: to the first token, a generated token
TABLE6 = {0: 56.69e-3, 8: 158.21e-3}                  # the paper's Table 6, a query (read as at batch 1 on an H100)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("roofline")
    return write_twin("idefics2", root / "twin"), write_photos(str(root / "photos"), {"train": 16, "val": 1})


def one_query(setting, shots, accelerator, path):
    """The plan's JSON entry of one VQAv2 query at batch 1 with `shots` ICDs on `accelerator`."""
    twin, photos = setting
    evaluate.main(["--plan", "cuda", "--model", "idefics2", "--processor", str(twin), "--task", "vqav2",
                   "--data-root", photos, "--n-eval", "1", "--batch-size", "1", "--shots", str(shots),
                   "--accelerator", accelerator, "--plan-json", str(path)])
    run, = json.loads(path.read_text())["runs"]
    assert run["batch"] == 1 and run["shots"] == shots
    return run


@pytest.mark.parametrize("shots", [0, 8])
def test_one_idefics2_query_on_an_h200_is_above_the_bound_and_near_the_expected(setting, shots, tmp_path, capsys):
    run = one_query(setting, shots, "h200", tmp_path / "plan.json")
    for key, measured in zip(("ttft_ms", "per_token_ms"), STAVE[shots]):
        bound, expected = run[key]["bound"] / 1e3, run[key]["expected"] / 1e3
        assert bound < measured and measured / 1.5 <= expected <= measured * 1.5, (key, bound, expected, measured)
    out = capsys.readouterr().out
    assert "time on an H200 SXM (989 TFLOP/s dense bf16, 4.8 TB/s)" in out and "one query, bound / expected" in out


@pytest.mark.parametrize("shots", [0, 8])
def test_the_papers_table6_is_the_plan_of_one_query_on_an_h100(setting, shots, tmp_path):
    run = one_query(setting, shots, "h100", tmp_path / "plan.json")
    assert run["ttft_ms"]["bound"] / 1e3 < TABLE6[shots] / 1.5 <= run["ttft_ms"]["expected"] / 1e3 <= \
        TABLE6[shots] * 1.5


def test_a_decoding_step_is_bandwidth_bound_and_a_batch_shares_its_weights():
    """A generated token reads every weight once: ~14.2 GB for Idefics2-8B's decoder in bf16, ~3 ms on an H200; eight
    queries share that read (the step at batch 8 well under 8 steps at batch 1)."""
    f, acc = table_plan.flop_model(published.published_model("idefics2")), roofline.ACCELERATORS["h200"]
    assert 14.0e9 < table_plan.moved(f, 1, 1, 0, 0, 100) < 14.5e9
    one, eight = table_plan.step(acc, f, 1, 100), table_plan.step(acc, f, 8, 100)
    assert one.bound == pytest.approx(table_plan.moved(f, 1, 1, 0, 0, 100) / 4.8e12)
    assert eight.expected < 1.1 * one.expected and 2.9e-3 < one.bound < 3.1e-3
    with pytest.raises(ValueError, match="--accelerator h300: not one the plan knows"):
        roofline.accelerator("h300")


def test_idefics2s_image_flops_are_the_counters_at_the_published_size():
    """table_plan.image_flops of one 640 x 480 image (1,530 patches) against torch's FLOP counter on the published
    vision tower and connector, built on the meta device (its perceiver at 64 latents: before, charged at every patch,
    2x the counter), within 10%."""
    from torch.utils.flop_counter import FlopCounterMode
    import transformers.masking_utils
    model = published.published_model("idefics2")
    pixels = torch.zeros(1, 3, 480, 640, device="meta", dtype=torch.bfloat16)
    patches = torch.ones(1, 480 // 14, 640 // 14, dtype=torch.bool, device="meta")
    no_mask = mock.patch.object(transformers.masking_utils, "_ignore_bidirectional_mask_sdpa", lambda *a, **k: True)
    with no_mask, FlopCounterMode(display=False) as counter:  # no padding: a mask would change no FLOP
        states = model.model.vision_model(pixel_values=pixels, patch_attention_mask=patches).last_hidden_state
        model.model.connector(states, attention_mask=patches.view(1, -1))
    planned = table_plan.image_flops(table_plan.flop_model(model), 34 * 45)
    assert planned == pytest.approx(counter.get_total_flops(), rel=0.1)
