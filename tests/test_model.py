"""The plug's harness on the real transformers backbones (tiny twins, CPU): where adapters sit, bypassing and
restoring, what trains. The math inside the model: tests/paper/test_plug.py; saving and loading:
tests/lab/run/test_checkpoints.py."""
import pytest
import torch

import model as M
from helpers import prompts, randomise, TEXTS
from lab.methods import registry
from lab.models import families, published
from lab.run import adapter_files


BACKBONES = families.available()  # conftest.py's backbone: each family's tiny twin


def test_the_adapter_is_in_the_text_decoder_only(plain):
    registry.attach(plain.model, "hyper-icl", rank=2)
    owners = [name for name, module in plain.model.named_modules() if hasattr(module, "icl_adapter")]
    decoder_layers = plain.model.get_decoder().layers
    assert len(owners) == len(decoder_layers)
    assert all(".layers." in name and name.endswith("self_attn") for name in owners)
    assert not any(k in name for name in owners for k in ("vision", "perceiver", "cross"))


def test_adapter_changes_logits_and_without_adapter_restores_them(plain):
    batch = prompts(plain, TEXTS)
    with torch.no_grad():
        base = plain.model(**batch).logits
        registry.attach(plain.model, "hyper-icl", rank=4)
        randomise(plain.model)
        ours = plain.model(**batch).logits
        with M.without_adapter(plain.model):
            teacher = plain.model(**batch).logits
    assert (ours - base).abs().max() > 1e-3
    torch.testing.assert_close(teacher, base)


def test_only_adapter_parameters_train(plain):
    registry.attach(plain.model, "hyper-icl", rank=4)
    before = {k: v.clone() for k, v in plain.model.state_dict().items() if "icl_adapter" not in k}
    trainable = [p for p in plain.model.parameters() if p.requires_grad]
    assert {id(p) for p in trainable} == {id(p) for p in M.adapter_modules(plain.model).parameters()}
    batch = prompts(plain, TEXTS)
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    for _ in range(2):
        logits = plain.model(**batch).logits
        logits.logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.equal(v, plain.model.state_dict()[k]) for k, v in before.items())
    assert M.adapter_modules(plain.model)[0].U_k.abs().sum() > 0          # the adapter did move


def test_save_load_roundtrip_and_mismatch(plain, tmp_path):
    registry.attach(plain.model, "hificl", n=2, rank=3)
    randomise(plain.model)
    batch = prompts(plain, TEXTS)
    with torch.no_grad():
        want = plain.model(**batch).logits
    path = tmp_path / "adapter.safetensors"
    adapter_files.save_adapter(path, plain)
    saved = adapter_files.read_settings(path)
    assert saved["method"] == "hificl" and saved["n"] == 2 and saved["rank"] == 3
    from safetensors.torch import load_file
    assert all("icl_adapter" not in k and "." in k for k in load_file(path))   # adapter tensors only
    M.detach(plain.model)
    adapter_files.load_adapter(path, plain)
    with torch.no_grad():
        torch.testing.assert_close(plain.model(**batch).logits, want)
    M.detach(plain.model)
    other = families.Backbone(published.published_model("idefics2"), None, "idefics2", "idefics2")
    with pytest.raises(ValueError, match="layers .saved 2, here 32."):
        adapter_files.load_adapter(path, other)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, tmp_path / "foreign.safetensors")
    with pytest.raises(ValueError, match="not an adapter checkpoint"):
        adapter_files.load_adapter(tmp_path / "foreign.safetensors", plain)
