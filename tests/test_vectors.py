"""Non-learnable baselines and the hallucination metric: CHAIR (Table 5), RICES demonstration retrieval, task vectors
and function vectors (Table 1), on hand-made data, the COCO of tools/benchmarks.py and the tiny Idefics2 twin (CPU,
offline)."""
import argparse
import time

import pytest
import torch
from PIL import Image

import benchmarks
import data as D
import evaluate as E
import model as M
from lab.datasets import readers, rices, tasks
from lab.models import backbones
from lab.scores import chair
from lab.studies import vectors

# -----------------------------------------------------------------------------
# CHAIR


def test_chair_by_hand():
    vocab = chair.chair_vocabulary(chair.COCO_SYNONYMS)
    annotated = {1: {"dog"}, 2: {"person", "bicycle", "backpack"}, 3: {"cat"}, 4: set()}
    references = {1: ["A dog lying on a couch."], 2: ["A man riding a bike."], 3: ["A kitten."], 4: ["An empty road."]}
    captions = {
        1: "Two dogs sitting on a sofa next to a hot dog.",   # dog (plural), couch (synonym, from the reference),
                                                             # hot dog (multi-word: hallucinated, not a dog)
        2: "Women riding bicycles near teddy bears.",         # person (irregular plural), bicycle, teddy bear (wrong)
        3: "A cat on the grass.",                             # cat
        4: "A view of the blue sky.",                         # no object at all
    }
    result, wrong = chair.chair(captions, annotated, references, vocab)
    assert wrong == {1: ["hot dog"], 2: ["teddy bear"], 3: [], 4: []}
    assert result["chair_i"] == pytest.approx(2 / 7)        # 7 mentions: dog couch hot-dog / woman bicycle teddy / cat
    assert result["chair_s"] == pytest.approx(2 / 4)
    assert result["recall"] == pytest.approx(5 / 6)         # truth: {dog, couch} {person, bicycle, backpack} {cat} {}


@pytest.mark.parametrize("caption, mentions", [
    ("A baby elephant next to adult giraffes.", [("elephant", "elephant"), ("giraffe", "giraffe")]),  # not people
    ("The toilet seat is up.", [("toilet", "toilet")]),     # a toilet seat is no chair
    ("Glasses, wine glasses, buses, skis, knives and scissors.", [("wine glass", "wine glass"), ("bus", "bus"),
                                                                  ("ski", "skis"), ("knife", "knife"),
                                                                  ("scissors", "scissors")]),  # "glass": none
    ("Children and mice.", [("child", "person"), ("mouse", "mouse")]),
    ("Two ties.", []),                                       # as chair.py: "ty" (--chair corrected: a tie)
    ("", []),
])
def test_caption_objects(caption, mentions):
    assert chair.caption_objects(caption, chair.chair_vocabulary(chair.COCO_SYNONYMS)) == mentions


def test_chair_on_toy_instances():
    items = tasks.load_task("coco", "val", benchmarks.ROOT)[:2]
    annotated, categories = readers.read_instances(items)
    assert categories == set(benchmarks.SHAPES)
    shapes = [next(s for s in benchmarks.SHAPES if s in it.target) for it in items]
    assert [annotated[it.id] for it in items] == [{s} for s in shapes]
    other = next(s for s in benchmarks.SHAPES if s != shapes[1])
    result = chair.chair_metrics(items, [items[0].target, f"A red {other}."])  # each shape read by its own name
    assert result == {"chair_s": 50.0, "chair_i": 50.0, "recall": 50.0}


def test_chair_missing_instances(tmp_path):
    item = D.Item(1, str(tmp_path / "coco" / "val2014" / "x.jpg"), None, ("a dog",), "a dog")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "coco" / "annotations" / "instances_val2014.json")):
        readers.read_instances([item])


# -----------------------------------------------------------------------------
# RICES

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


@pytest.fixture(scope="module")
def backbone():
    return backbones.load_backbone("tiny-idefics2")


def test_rices_with_the_vision_tower(backbone, tmp_path):
    support, queries = tasks.load_task("coco", "train", benchmarks.ROOT)[:12], tasks.load_task("coco", "val",
                                                                                               benchmarks.ROOT)[:2]
    queries = queries + [support[3]]                        # a query that is also in the support set
    args = argparse.Namespace(icds="rices", rices_encoder=None, rices_cache=str(tmp_path), seed=0)
    icds = rices.choose_demonstrations(backbone, args, queries, support, 4)
    one = {it.id: rices.vision_tower_features(backbone, [D.load_image(it)])[0].double() for it in support + queries}
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


# -----------------------------------------------------------------------------
# task vectors and function vectors: the hooks, against a forward written out layer by layer here

def text_ids(backbone, *texts):
    tok = backbone.processor.tokenizer
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    n = min(map(len, ids))
    return torch.tensor([i[:n] for i in ids])


def layer_by_layer(model, ids, patch=None):
    """The Mistral text decoder of the tiny Idefics2 twin run by hand (causal, no padding), with patch(layer, h)
    applied to each decoder layer's output; returns the logits."""
    lm = model.model.text_model
    h = lm.embed_tokens(ids)
    position_ids = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
    rotary = lm.rotary_emb(h, position_ids)
    for l, layer in enumerate(lm.layers):
        h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=rotary)
        h = h[0] if isinstance(h, tuple) else h
        h = patch(l, h) if patch else h
    return model.lm_head(lm.norm(h))


@torch.no_grad()
@pytest.mark.parametrize("layer, add", [(0, False), (1, True)])
def test_steer_equals_the_forward_written_out(backbone, layer, add):
    model = backbone.model
    ids = text_ids(backbone, "Question: What colour is the shape? Short answer:", "Caption: a red circle on the left")
    torch.manual_seed(layer)
    vector, positions = torch.randn(model.config.text_config.hidden_size), torch.tensor([ids.shape[1] - 1, 3])
    assert torch.allclose(layer_by_layer(model, ids), model(input_ids=ids).logits, atol=1e-5)  # the reference holds

    def patch(l, h):
        if l == layer:
            h = h.clone()
            for b, p in enumerate(positions.tolist()):
                h[b, p] = vector + (h[b, p] if add else 0)
        return h
    with vectors.steer(model, layer, vector, positions, add=add):
        got = model(input_ids=ids).logits
    assert torch.allclose(got, layer_by_layer(model, ids, patch), atol=1e-5)
    assert not torch.allclose(got, model(input_ids=ids).logits, atol=1e-3)  # the patch did something


@torch.no_grad()
def test_zero_function_vector_and_own_state_leave_the_model_unchanged(backbone):
    model, items = backbone.model, tasks.load_task("vqav2", "val", benchmarks.ROOT)[:2]
    inputs = D.model_inputs(D.prompt_batch(backbone.processor, backbone.family, "vqa", items))
    plain = model(**inputs).logits
    d = model.config.text_config.hidden_size
    with vectors.steer(model, 1, torch.zeros(d), add=True):
        assert torch.equal(model(**inputs).logits, plain)
        tokens = E.generate(backbone, inputs, 4)
    assert torch.equal(tokens, E.generate(backbone, inputs, 4))
    states = {}
    with vectors.layer_states_at(model, states):
        model(**inputs)
    for l in range(2):  # a task vector equal to the states already there changes nothing
        with vectors.steer(model, l, states[l][0]):
            assert torch.equal(model(**inputs).logits, plain)


@torch.no_grad()
def test_head_outputs_add_up_to_the_attention_output(backbone):
    model = backbone.model
    ids = text_ids(backbone, "Question: How many shapes are there? Short answer:")
    heads, attn_out = {}, {}
    hooks = [a.register_forward_hook(lambda m, i, o, l=l: attn_out.__setitem__(l, o[0][:, -1]))
             for l, a in enumerate(M.decoder_self_attentions(model))]
    with vectors.head_outputs(model, heads):
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    layers, n_heads, _ = M.attention_shape(model)
    for l in range(layers):
        total = sum(vectors.head_contribution(model, l, h, heads[l][0][:, h]) for h in range(n_heads))
        assert torch.allclose(total, attn_out[l], atol=1e-5)
    with vectors.set_head_output(model, 1, 2, heads[1][0][0, 2]):  # a head set to its own output: nothing changes
        assert torch.allclose(model(input_ids=ids).logits, model(input_ids=ids).logits)
    with vectors.set_head_output(model, 1, 2, torch.ones(heads[1][0].shape[-1])):  # else only the last position moves
        patched = model(input_ids=ids).logits
    plain = model(input_ids=ids).logits
    assert torch.equal(patched[:, :-1], plain[:, :-1]) and not torch.allclose(patched[:, -1], plain[:, -1])


def vector_args(tmp_path, method, *extra):
    return E.parse_args(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--vector",
                         method, "--shots", "2", "--vector-sets", "3", "--vector-heldout", "2", "--batch-size", "2",
                         "--out", str(tmp_path), *extra])


@torch.no_grad()
def test_task_vector_is_the_mean_last_token_state(backbone, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = vector_args(tmp_path, "tv")
    out = vectors.compute_vector(backbone, args, 2)
    queries, icds, heldout = vectors.vector_sets(tasks.load_task("vqav2", "train", benchmarks.ROOT), args, 2)
    assert len(queries) == 3 and not {q.id for q in queries} & {q.id for q in heldout}
    states = []
    for q, d in zip(queries, icds):  # one prompt at a time, no padding: the layer outputs of the hidden states
        batch = D.prompt_batch(backbone.processor, backbone.family, "vqa", [q], [d])
        hidden = backbone.model(**D.model_inputs(batch), output_hidden_states=True).hidden_states
        states.append(torch.stack(hidden[1:-1])[:, 0, -1])
    assert torch.allclose(out["vectors"][:-1], torch.stack(states).mean(0), atol=1e-5)  # the last one is normed
    steering, info = vectors.load_vector(backbone, args)
    assert info["vector_layer"] == int(out["losses"].argmin()) and torch.equal(steering["vector"],
                                                                               out["vectors"][info["vector_layer"]])
    assert torch.equal(vectors.load_vector(backbone, args)[0]["vector"], steering["vector"])  # read back, same


@torch.no_grad()
def test_function_vector_sums_the_top_heads(backbone, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = vector_args(tmp_path, "fv", "--fv-heads", "3", "--fv-trials", "2")
    out = vectors.compute_vector(backbone, args, 2)
    assert out["aie"].shape == (2, 4) and out["aie"].abs().sum() > 0
    top = sorted(range(8), key=lambda i: -out["aie"].flatten()[i])[:3]
    assert sorted(map(tuple, out["heads"].tolist())) == sorted((i // 4, i % 4) for i in top)
    w = [a.o_proj.weight for a in M.decoder_self_attentions(backbone.model)]
    fv = sum(w[l][:, 16 * h:16 * (h + 1)] @ out["mean_heads"][l, h] for l, h in out["heads"].tolist())
    assert torch.allclose(out["vectors"][0], fv, atol=1e-6) and torch.equal(out["vectors"][0], out["vectors"][1])


def test_vector_layer_out_of_range(backbone, tmp_path):
    with pytest.raises(ValueError, match=r"--vector-layer 2 is out of range: tiny-idefics2 has decoder layers 0\.\.1"):
        vectors.load_vector(backbone, vector_args(tmp_path, "tv", "--vector-layer", "2"))


@torch.no_grad()
def test_function_vector_at_every_generated_token(backbone):
    """Cached greedy decoding with the FV added at the prompt's last token and at every new token equals greedy
    decoding without a cache, where each full forward adds it at those positions (written out here with a hook)."""
    model = backbone.model
    ids = text_ids(backbone, "Question: Which shape is it? Short answer:")
    torch.manual_seed(0)
    fv, layer, first = 3 * torch.randn(model.config.text_config.hidden_size), 1, ids.shape[1] - 1

    def add_from_first(module, inputs, output):
        h = (output[0] if isinstance(output, tuple) else output).clone()
        h[:, first:] += fv
        return (h, *output[1:]) if isinstance(output, tuple) else h
    handle = model.get_decoder().layers[layer].register_forward_hook(add_from_first)
    expected = ids
    for _ in range(5):
        expected = torch.cat([expected, model(input_ids=expected, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    handle.remove()
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with vectors.steer(model, layer, fv, add=True, decoding=True):
        got = E.generate(argparse.Namespace(model=model, processor=None, family="idefics2"), inputs, 5, 5)
    assert torch.equal(got, expected[:, ids.shape[1]:])
    assert not torch.equal(expected[:, ids.shape[1]:], model.generate(**inputs, do_sample=False, max_new_tokens=5,
                                                                      min_new_tokens=5)[:, ids.shape[1]:])
