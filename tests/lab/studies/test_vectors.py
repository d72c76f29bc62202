"""Task vectors and function vectors (Table 1; lab/studies/vectors.py) on the tiny Idefics2 twin (CPU, offline):
steering written out, zero vectors, head outputs, the top heads, cached vectors."""
import argparse

import pytest
import torch

import benchmarks
import data as D
import evaluate as E
import model as M
from lab.datasets import tasks
from lab.models import backbones
from lab.studies import vectors
from helpers import lab_evaluate_args


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
    return lab_evaluate_args(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT,
                              "--vector", method, "--shots", "2", "--vector-sets", "3", "--vector-heldout", "2",
                              "--batch-size", "2", "--out", str(tmp_path), *extra])


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


def test_a_truncated_or_wrongly_shaped_vector_is_computed_again_and_lives_under_out(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    backbone = backbones.load_backbone("tiny-idefics2")
    args = lab_evaluate_args(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT,
                                     "--vector", "tv", "--shots", "1", "--vector-sets", "2", "--vector-heldout", "2",
                                     "--out", str(tmp_path / "out")])
    calls = []
    fake = lambda *a: calls.append(1) or {"vectors": torch.ones(2, 32), "losses": torch.tensor([1.0, 0.5])}
    monkeypatch.setattr(vectors, "compute_vector", fake)
    vectors.load_vector(backbone, args)
    path, _ = vectors.vector_path(backbone, args, 1)
    assert path.startswith(str(tmp_path / "out" / "vectors")) and not (tmp_path / "runs").exists()
    good = open(path, "rb").read()
    from safetensors.torch import save
    for bad in (good[:len(good) // 2], save({"vectors": torch.ones(1, 32), "losses": torch.ones(1)})):
        open(path, "wb").write(bad)
        steering, _ = vectors.load_vector(backbone, args)
        assert steering["layer"] == 1 and f"warning: cache file {path} is unusable" in capsys.readouterr().out
    assert len(calls) == 3
