"""The plan's time on a GPU (lab/studies/roofline.py, roofline.prefill / step): its bound below and its expected
time within 1.5x of the published measurements of one Idefics2-8B VQAv2 query (issue 61), on COCO-size photographs
and the real-processor twin's processor, no weights; the image FLOPs against torch's FLOP counter at the published
size on the meta device."""
import json
from unittest import mock

import pytest
import torch

from helpers import lab
from memory_twins import write_photos
from twins import write_twin
from lab.models import families, published
from lab.studies import flops, roofline

STAVE = {0: (98e-3, 23.9e-3), 8: (1430e-3, 23.9e-3)}  # H200, batch 1: to the first token, a generated token
TABLE6 = {0: 56.69e-3, 8: 158.21e-3}                  # the paper's Table 6, a query (read as at batch 1 on an H100)


@pytest.fixture(scope="module")
def setting(tmp_path_factory):
    root = tmp_path_factory.mktemp("roofline")
    return write_twin("idefics2", root / "twin"), write_photos(str(root / "photos"), {"train": 16, "val": 1})


def one_query(setting, shots, accelerator, path):
    """The plan's JSON entry of one VQAv2 query at batch 1 with `shots` ICDs on `accelerator`."""
    twin, photos = setting
    lab(["plan", "evaluate", "--plan", "cuda", "--model", "idefics2", "--processor", str(twin), "--task", "vqav2",
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
    f, acc = flops.flop_model(published.published_model("idefics2")), roofline.ACCELERATORS["h200"]
    assert 14.0e9 < flops.moved(f, 1, 1, 0, 0, 100) < 14.5e9
    one, eight = roofline.step(acc, f, 1, 100), roofline.step(acc, f, 8, 100)
    assert one.bound == pytest.approx(flops.moved(f, 1, 1, 0, 0, 100) / 4.8e12)
    assert eight.expected < 1.1 * one.expected and 2.9e-3 < one.bound < 3.1e-3
    with pytest.raises(ValueError, match="--accelerator h300: not one the plan knows"):
        roofline.accelerator("h300")


def image_side(family, model, height, width):
    """Run the image side of a published-size `family` model on one image of height x width (meta device): its
    vision tower and connector as get_image_features runs them, without its data-dependent steps (the meta device
    has no values: no padding mask, no dropped padding images)."""
    inner, vision = model.model, model.config.vision_config
    pixels = torch.zeros(1, 3, height, width, device="meta", dtype=torch.bfloat16)
    if family in ("idefics2", "idefics3", "smolvlm"):
        patches = torch.ones(1, height // vision.patch_size, width // vision.patch_size, dtype=torch.bool,
                             device="meta")
        states = inner.vision_model(pixel_values=pixels, patch_attention_mask=patches).last_hidden_state
        return inner.connector(states, **({"attention_mask": patches.view(1, -1)} if family == "idefics2" else {}))
    if family == "idefics":
        return inner.perceiver_resampler(inner.vision_model(pixels).last_hidden_state)
    states = inner.vision_tower(pixel_values=pixels).last_hidden_state
    if family == "internvl3":  # its class token dropped, then the pixel shuffle
        side = int((states.shape[1] - 1) ** 0.5)
        states = inner.pixel_shuffle(states[:, 1:].reshape(1, side, side, -1), model.config.downsample_ratio)
        states = states.reshape(1, -1, states.shape[-1])
    return inner.multi_modal_projector(states)


@pytest.mark.parametrize("family", ["idefics2", "idefics", "llava-interleave", "llava-onevision", "internvl3",
                                    "gemma3", "idefics3", "smolvlm"])
def test_each_familys_image_flops_are_the_counters_at_the_published_size(family):
    """flops.image_flops of one image against torch's FLOP counter on the published vision tower and connector
    on the meta device, within 10%: Idefics2's perceiver at its 64 latents (before, charged at every patch: 2x the
    counter) on a 640 x 480 photograph, the others at their config's image size (a pixel shuffle's merged tokens,
    Gemma 3's pooled ones). Qwen's towers read their grid's values (not on the meta device): the next test."""
    from torch.utils.flop_counter import FlopCounterMode
    import transformers.masking_utils
    model = published.published_model(family)
    f = flops.flop_model(model)
    height, width = (480, 640) if family == "idefics2" else flops.sides(model.config.vision_config.image_size)
    patch = flops.sides(model.config.vision_config.patch_size)
    no_mask = mock.patch.object(transformers.masking_utils, "_ignore_bidirectional_mask_sdpa", lambda *a, **k: True)
    with no_mask, FlopCounterMode(display=False) as counter:  # no padding: a mask would change no FLOP
        image_side(family, model, height, width)
    planned = flops.image_flops(f, (height // patch[0]) * (width // patch[1]))
    assert planned == pytest.approx(counter.get_total_flops(), rel=0.1)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl", "llava-onevision-1.5"])
def test_a_qwen_towers_image_flops_are_the_counters_at_the_published_width(family):
    """The Qwen-style towers (flattened patches, a grid, a 2 x 2 merger) read their grid's values, which the meta device
    lacks: their published vision config at two layers (the formula is per layer: the rest extrapolates), random
    weights on the CPU, one 16 x 16-patch image through the tower and merger under torch's FLOP counter, against
    flops.image_flops of the same config's meta-built model, within 10% (Qwen2.5-VL's windowed layers are counted as
    full attention, an upper bound)."""
    from torch.utils.flop_counter import FlopCounterMode
    config = families.FAMILIES[family].published()
    vision = config.vision_config
    vision.depth = 2
    for layers in ("fullatt_block_indexes", "deepstack_visual_indexes"):  # past two layers: the first one's
        if hasattr(vision, layers):
            setattr(vision, layers, [0])
    model = published.published_model(family, config=config)  # meta: no memory
    f, tower = flops.flop_model(model), type(model.model.visual)._from_config(vision).float()
    per_patch = 3 * getattr(vision, "temporal_patch_size", 1) * vision.patch_size ** 2
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tower(torch.randn(256, per_patch), grid_thw=torch.tensor([[1, 16, 16]]))
    assert flops.image_flops(f, 256) == pytest.approx(counter.get_total_flops(), rel=0.1)
