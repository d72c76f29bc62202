"""RICES demonstration retrieval (lab/datasets/rices.py): the order by hand, cached image features, the vision tower
and a local CLIP, encoders that cannot be used refused."""
import argparse
import os
import time

import pytest
import torch
from PIL import Image

import benchmarks
import data as D
from helpers import dead_pid, lab_args, lab_evaluate_args, lab_train_args, QUIET, refused
from lab.datasets import rices, tasks
from lab.disk import files


def support_items(n):
    return [D.Item(i, f"/images/{i}.jpg", None, (f"c{i}",), f"c{i}") for i in range(1, n + 1)]


def test_rices_order_by_hand():
    support = support_items(5)
    # cosine similarity to [1, 0]: 0, .995, .71, -1, 1
    feats = torch.tensor([[0.0, 1.0], [1.0, 0.1], [2.0, 2.0], [-1.0, 0.0], [3.0, 0.0]])
    query = torch.tensor([[1.0, 0.0], [0.0, 5.0]])
    icds = rices.rices_demonstrations([5, 99], query, support, feats, 3)
    assert [d.id for d in icds[0]] == [1, 3, 2]  # least to most similar; item 5 (the query, cos 1) never retrieved
    assert [d.id for d in icds[1]] == [2, 3, 1]  # cos to [0, 1]: 1, .10, .71, 0, 0 -> 1 .71 .10, reversed
    with pytest.raises(ValueError, match="too small"):
        rices.rices_demonstrations([1], query[:1], support[:3], feats[:3], 3)


def write_image(path, colour):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), colour).save(path)


def test_image_features_are_cached_per_encoder_and_data(tmp_path):
    for name, colour in (("a", (10, 0, 0)), ("b", (0, 200, 0))):
        write_image(tmp_path / f"{name}.png", colour)
    items = [D.Item(k, str(tmp_path / f"{name}.png"), None, ("x",), "x") for k, name in enumerate("aba")]
    calls = []

    def encode(images):  # mean colour of each image
        calls.append(len(images))
        return torch.stack([torch.tensor(im.getpixel((0, 0)), dtype=torch.float32) for im in images])

    cache = tmp_path / "cache"
    first = rices.image_features(encode, "enc-1", items, cache, batch_size=1)
    assert calls == [1, 1]                                 # two distinct images, each encoded once
    assert first.tolist() == [[10, 0, 0], [0, 200, 0], [10, 0, 0]]
    assert torch.equal(rices.image_features(encode, "enc-1", items, cache), first) and calls == [1, 1]  # read back
    rices.image_features(encode, "enc-2", items, cache)        # another encoder: recomputed
    assert calls == [1, 1, 2]
    time.sleep(0.01)
    write_image(tmp_path / "b.png", (0, 0, 7))             # changed data: recomputed, never the stale file
    assert rices.image_features(encode, "enc-1", items, cache)[1].tolist() == [0, 0, 7] and calls == [1, 1, 2, 2]


def test_rices_with_the_vision_tower(backbone, tmp_path):
    support, queries = tasks.load_task("coco", "train", benchmarks.ROOT)[:12], tasks.load_task("coco", "val",
                                                                                               benchmarks.ROOT)[:2]
    queries = queries + [support[3]]                        # a query that is also in the support set
    args = argparse.Namespace(icds="rices", rices_encoder=None, rices_cache=str(tmp_path), seed=0)
    icds = rices.choose_demonstrations(backbone, args, queries, support, 4)
    tower = backbone.record.tower  # the family's own, as its record names it
    one = {it.id: tower.features(backbone, [D.load_image(it)])[0].double() for it in support + queries}
    for q, got in zip(queries, icds):
        cos = {s.id: torch.nn.functional.cosine_similarity(one[q.id], one[s.id], dim=0).item() for s in support
               if s.id != q.id}
        assert [d.id for d in got] == sorted(cos, key=cos.get)[-4:]
    assert support[3].id not in [d.id for d in icds[2]]


def test_clip_encoder_from_a_local_checkpoint(tmp_path):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel
    torch.manual_seed(0)
    clip = CLIPModel(CLIPConfig(text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2), projection_dim=8,
                                vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                   num_attention_heads=2, image_size=28, patch_size=14))).eval()
    process = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    clip.save_pretrained(tmp_path)
    process.save_pretrained(tmp_path)
    images = [D.load_image(it) for it in tasks.load_task("coco", "val", benchmarks.ROOT)[:2]]
    with torch.no_grad():
        expected = clip.get_image_features(pixel_values=process(images, return_tensors="pt")["pixel_values"])
    expected = expected if torch.is_tensor(expected) else expected.pooler_output
    assert torch.allclose(rices.clip_encoder(str(tmp_path))(images), expected, atol=1e-6)


def test_rices_encoder_that_cannot_be_loaded(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}.*own vision tower"):
        rices.clip_encoder(str(tmp_path))


def test_rices_on_a_family_without_its_own_tower_is_refused_before_any_work(tmp_path, capsys):
    """Table 1 on a new family stopped at its RICES cell after every training, and --rices-encoder, the way out, was
    refused with --table; a single evaluation or training was refused only after the backbone loaded."""
    table = ["table", "1", *QUIET, "--out", str(tmp_path)]
    qwen = [a.replace("tiny-idefics2", "tiny-qwen2.5-vl") for a in table]
    assert "RICES row: --icds rices: the backbone's own vision tower is read where its family's record names one" in \
        refused(lab_args, qwen, capsys)
    assert lab_args([*qwen, "--rices-encoder", "clip"]).rices_encoder == "clip"
    single = ["--model", "tiny-gemma3", "--task", "vqav2", "--icds", "rices", "--shots", "2"]
    assert "not gemma3; give --rices-encoder" in refused(lab_evaluate_args, single, capsys)
    assert "not gemma3; give --rices-encoder" in refused(lab_train_args, single[:-2], capsys)


def test_a_rices_encoder_that_is_not_clip_is_refused_naming_it(tmp_path):
    from transformers import CLIPImageProcessor, SiglipVisionConfig, SiglipVisionModel
    SiglipVisionModel(SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14)).save_pretrained(tmp_path)
    CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"cannot load the RICES image encoder '{tmp_path}' as a CLIP checkpoint "
                                         r"\(its config's model_type is 'siglip_vision_model', not 'clip'\)"):
        rices.clip_encoder(str(tmp_path))


def test_a_truncated_or_wrongly_shaped_rices_cache_is_computed_again_with_a_warning(tmp_path, capsys):
    items = tasks.load_task("vqav2", "train", benchmarks.ROOT)[:3]
    encode = lambda images: torch.ones(len(images), 4)
    first = rices.image_features(encode, "enc", items, tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    good = path.read_bytes()
    stale = files.tmp_name(tmp_path / "x.safetensors", dead_pid())
    open(stale, "wb").write(b"half")
    from safetensors.torch import save
    wrong = (save({"features": torch.ones(2, 4)}), save({"features": torch.ones(3, 4, dtype=torch.half)}))
    for bad in (good[:len(good) // 2], *wrong):
        path.write_bytes(bad)
        assert torch.equal(rices.image_features(encode, "enc", items, tmp_path), first)
        assert f"warning: cache file {path} is unusable" in capsys.readouterr().out
        rices.image_features(encode, "enc", items, tmp_path)
        assert capsys.readouterr().out == ""                                 # written again, whole
    assert not os.path.exists(stale)
