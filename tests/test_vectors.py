"""Non-learnable baselines and the hallucination metric: CHAIR (Table 5), RICES demonstration retrieval, task vectors
and function vectors (Table 1), on hand-made data, the toy caption task and the tiny Idefics2 twin (CPU, offline)."""
import argparse
import time

import pytest
import torch
from PIL import Image

import data as D
import evaluate as E
import model as M
import train

# -----------------------------------------------------------------------------
# CHAIR


def test_chair_by_hand():
    vocab = E.chair_vocabulary(E.COCO_SYNONYMS)
    annotated = {1: {"dog"}, 2: {"person", "bicycle", "backpack"}, 3: {"cat"}, 4: set()}
    references = {1: ["A dog lying on a couch."], 2: ["A man riding a bike."], 3: ["A kitten."], 4: ["An empty road."]}
    captions = {
        1: "Two dogs sitting on a sofa next to a hot dog.",   # dog (plural), couch (synonym, from the reference),
                                                             # hot dog (multi-word: hallucinated, not a dog)
        2: "Women riding bicycles near teddy bears.",         # person (irregular plural), bicycle, teddy bear (wrong)
        3: "A cat on the grass.",                             # cat
        4: "A view of the blue sky.",                         # no object at all
    }
    result, wrong = E.chair(captions, annotated, references, vocab)
    assert wrong == {1: ["hot dog"], 2: ["teddy bear"], 3: [], 4: []}
    assert result["chair_i"] == pytest.approx(2 / 7)        # 7 mentions: dog couch hot-dog / woman bicycle teddy / cat
    assert result["chair_s"] == pytest.approx(2 / 4)
    assert result["recall"] == pytest.approx(5 / 6)         # truth: {dog, couch} {person, bicycle, backpack} {cat} {}


@pytest.mark.parametrize("caption, mentions", [
    ("A baby elephant next to adult giraffes.", [("elephant", "elephant"), ("giraffe", "giraffe")]),  # not people
    ("The toilet seat is up.", [("toilet", "toilet")]),     # a toilet seat is no chair
    ("Glasses, buses, skis, knives and scissors.", [("glass", "wine glass"), ("bus", "bus"), ("skis", "skis"),
                                                     ("knife", "knife"), ("scissor", "scissors")]),
    ("Children and mice.", [("child", "person"), ("mouse", "mouse")]),
    ("Two ties.", [("tie", "tie")]),
    ("", []),
])
def test_caption_objects(caption, mentions):
    assert E.caption_objects(caption, E.chair_vocabulary(E.COCO_SYNONYMS)) == mentions


def test_chair_on_toy_instances():
    items = D.load_task("toy-caption", "val")[:2]
    annotated, categories = D.read_instances(items)
    assert categories == set(D.SHAPES)
    shapes = [next(s for s in D.SHAPES if s in it.target) for it in items]
    assert [annotated[it.id] for it in items] == [{s} for s in shapes]
    other = next(s for s in D.SHAPES if s != shapes[1])
    result = E.chair_metrics(items, [items[0].target, f"A red {other}."])
    assert result == {"chair_s": 50.0, "chair_i": 50.0, "recall": 50.0}


def test_chair_missing_instances(tmp_path):
    item = D.Item(1, str(tmp_path / "coco" / "val2014" / "x.jpg"), None, ("a dog",), "a dog")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "coco" / "annotations" / "instances_val2014.json")):
        D.read_instances([item])


# -----------------------------------------------------------------------------
# RICES

def support_items(n):
    return [D.Item(i, f"/images/{i}.jpg", None, (f"c{i}",), f"c{i}") for i in range(1, n + 1)]


def test_rices_order_by_hand():
    support = support_items(5)
    feats = torch.tensor([[0.0, 1.0], [1.0, 0.1], [2.0, 2.0], [-1.0, 0.0], [3.0, 0.0]])  # cos to [1, 0]: 0 .995 .71 -1 1
    query = torch.tensor([[1.0, 0.0], [0.0, 5.0]])
    icds = D.rices_demonstrations([5, 99], query, support, feats, 3)
    assert [d.id for d in icds[0]] == [1, 3, 2]  # least to most similar; item 5 (the query, cos 1) never retrieved
    assert [d.id for d in icds[1]] == [2, 3, 1]  # cos to [0, 1]: 1, .10, .71, 0, 0 -> 1 .71 .10, reversed
    with pytest.raises(ValueError, match="too small"):
        D.rices_demonstrations([1], query[:1], support[:3], feats[:3], 3)


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
    first = D.image_features(encode, "enc-1", items, cache, batch_size=1)
    assert calls == [1, 1]                                 # two distinct images, each encoded once
    assert first.tolist() == [[10, 0, 0], [0, 200, 0], [10, 0, 0]]
    assert torch.equal(D.image_features(encode, "enc-1", items, cache), first) and calls == [1, 1]  # read back
    D.image_features(encode, "enc-2", items, cache)        # another encoder: recomputed
    assert calls == [1, 1, 2]
    time.sleep(0.01)
    write_image(tmp_path / "b.png", (0, 0, 7))             # changed data: recomputed, never the stale file
    assert D.image_features(encode, "enc-1", items, cache)[1].tolist() == [0, 0, 7] and calls == [1, 1, 2, 2]


@pytest.fixture(scope="module")
def backbone():
    return M.load_backbone("tiny-idefics2")


def test_rices_with_the_vision_tower(backbone, tmp_path):
    support, queries = D.load_task("toy-caption", "train")[:12], D.load_task("toy-caption", "val")[:2]
    queries = queries + [support[3]]                        # a query that is also in the support set
    args = argparse.Namespace(icds="rices", rices_encoder=None, rices_cache=str(tmp_path), seed=0)
    icds = train.choose_demonstrations(backbone, args, queries, support, 4)
    one = {it.id: M.vision_tower_features(backbone, [D.load_image(it)])[0].double() for it in support + queries}
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
    images = [D.load_image(it) for it in D.load_task("toy-caption", "val")[:2]]
    with torch.no_grad():
        expected = clip.get_image_features(pixel_values=process(images, return_tensors="pt")["pixel_values"])
    expected = expected if torch.is_tensor(expected) else expected.pooler_output
    assert torch.allclose(M.clip_encoder(str(tmp_path))(images), expected, atol=1e-6)


def test_rices_encoder_that_cannot_be_loaded(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}.*own vision tower"):
        M.clip_encoder(str(tmp_path))
