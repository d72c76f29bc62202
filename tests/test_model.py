"""Adapters inside the real transformers backbones (tiny twins, CPU): identity at init, masks, caching, saving."""
import copy
import os

import pytest
import torch

import data as D
import model as M

from helpers import TEXTS, assert_cached_decoding_equals_full_forward, prompts
from lab import backbones, checkpoints, files, published

FAMILIES = sorted(M.FAMILIES)


@pytest.fixture(scope="module", params=FAMILIES)
def backbone(request):
    return backbones.load_backbone("tiny-" + request.param)


def randomise(model, seed=0):
    torch.manual_seed(seed)
    for p in M.adapter_modules(model).parameters():
        torch.nn.init.normal_(p, std=0.3)


@pytest.fixture()
def plain(backbone):
    """The backbone with no adapter before and after the test."""
    yield backbone
    if hasattr(backbone.model, "icl_settings"):
        M.detach(backbone.model)


def test_hyper_icl_at_init_is_the_base_model(plain):
    batch = prompts(plain, TEXTS)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        base = plain.model(**batch).logits
        base_gen = plain.model.generate(**prompts(plain, TEXTS, positions=False), max_new_tokens=4, do_sample=False)
        M.attach(plain.model, "hyper-icl", rank=4)
        ours = plain.model(**batch).logits
        ours_gen = plain.model.generate(**prompts(plain, TEXTS, positions=False), max_new_tokens=4, do_sample=False)
    assert (ours - base)[real].abs().max() <= 1e-5
    assert torch.equal(ours_gen, base_gen)


def test_attention_without_an_adapter_is_transformers_sdpa():
    """Eq 4 where no adapter sits: Idefics' vision tower and gated cross-attention also run through
    calibrated_attention. Their gates start closed in the twin (alpha = 0), so they are opened here, as a trained
    checkpoint has them; the attached model at init must then equal the unadapted one."""
    backbone = backbones.load_backbone("tiny-idefics")
    for layer in backbone.model.model.gated_cross_attn_layers:
        torch.nn.init.normal_(layer.alpha_cross_attn, std=1.0)
        torch.nn.init.normal_(layer.alpha_dense, std=1.0)
    batch = prompts(backbone, TEXTS)
    with torch.no_grad():
        base = backbone.model(**batch).logits
        M.attach(backbone.model, "hyper-icl", rank=4)
        ours = backbone.model(**batch).logits
    assert (ours - base)[batch["attention_mask"].bool()].abs().max() <= 1e-5


def test_the_adapter_is_in_the_text_decoder_only(plain):
    M.attach(plain.model, "hyper-icl", rank=2)
    owners = [name for name, module in plain.model.named_modules() if hasattr(module, "icl_adapter")]
    decoder_layers = plain.model.get_decoder().layers
    assert len(owners) == len(decoder_layers)
    assert all(".layers." in name and name.endswith("self_attn") for name in owners)
    assert not any(k in name for name in owners for k in ("vision", "perceiver", "cross"))


def test_adapter_changes_logits_and_without_adapter_restores_them(plain):
    batch = prompts(plain, TEXTS)
    with torch.no_grad():
        base = plain.model(**batch).logits
        M.attach(plain.model, "hyper-icl", rank=4)
        randomise(plain.model)
        ours = plain.model(**batch).logits
        with M.without_adapter(plain.model):
            teacher = plain.model(**batch).logits
    assert (ours - base).abs().max() > 1e-3
    torch.testing.assert_close(teacher, base)


@pytest.mark.parametrize("method,sizes", [("hyper-icl", dict(rank=4)), ("hificl", dict(n=3, rank=2))])
def test_padding_invariance_with_trained_adapter(plain, method, sizes):
    M.attach(plain.model, method, **sizes)
    randomise(plain.model)
    batch = prompts(plain, TEXTS)
    with torch.no_grad():
        together = plain.model(**batch).logits
        for i, text in enumerate(TEXTS):
            alone = plain.model(**prompts(plain, [text])).logits[0]
            length = alone.shape[0]
            torch.testing.assert_close(together[i, -length:], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method,sizes", [("hyper-icl", dict(rank=4)), ("hificl", dict(n=3, rank=2))])
def test_cached_decoding_equals_full_forward(plain, method, sizes):
    M.attach(plain.model, method, **sizes)
    randomise(plain.model, seed=1)
    assert_cached_decoding_equals_full_forward(plain, new_tokens=4)


def test_only_adapter_parameters_train(plain):
    M.attach(plain.model, "hyper-icl", rank=4)
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
    M.attach(plain.model, "hificl", n=2, rank=3)
    randomise(plain.model)
    batch = prompts(plain, TEXTS)
    with torch.no_grad():
        want = plain.model(**batch).logits
    path = tmp_path / "adapter.safetensors"
    checkpoints.save_adapter(path, plain)
    saved = checkpoints.read_settings(path)
    assert saved["method"] == "hificl" and saved["n"] == 2 and saved["rank"] == 3
    from safetensors.torch import load_file
    assert all("icl_adapter" not in k and "." in k for k in load_file(path))   # adapter tensors only
    M.detach(plain.model)
    checkpoints.load_adapter(path, plain)
    with torch.no_grad():
        torch.testing.assert_close(plain.model(**batch).logits, want)
    M.detach(plain.model)
    other = M.Backbone(published.published_model("idefics2"), None, "idefics2", "idefics2")
    with pytest.raises(ValueError, match="layers .saved 2, here 32."):
        checkpoints.load_adapter(path, other)
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(1)}, tmp_path / "foreign.safetensors")
    with pytest.raises(ValueError, match="not an adapter checkpoint"):
        checkpoints.load_adapter(tmp_path / "foreign.safetensors", plain)


@pytest.mark.parametrize("family,method,sizes,count", [
    ("idefics2", "hyper-icl", dict(rank=4), 1_180_672), ("idefics", "hyper-icl", dict(rank=4), 1_180_672),
    ("idefics2", "hificl", dict(n=8, rank=8), 2_228_224), ("llava-interleave", "hificl", dict(n=8, rank=8), 2_228_224)])
def test_parameter_counts_on_published_sizes(family, method, sizes, count):
    model = published.published_model(family)                      # meta device: no memory, no download
    M.attach(model, method, **sizes)
    assert sum(p.numel() for p in M.adapter_modules(model).parameters()) == count
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == count


def test_unknown_backbone_lists_the_valid_names():
    with pytest.raises(ValueError, match="idefics2.*llava-onevision"):
        backbones.load_backbone("gpt-5")


def test_atomic_write_never_leaves_a_half_written_file(tmp_path):
    path = tmp_path / "f.bin"
    files.atomic_write(path, lambda f: f.write(b"good"))

    def crash(f):
        f.write(b"ha")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        files.atomic_write(path, crash)
    assert path.read_bytes() == b"good" and os.listdir(tmp_path) == ["f.bin"]


def explicit_forward(adapter, q, k, v, mask, scaling):
    """Eq 3-9 as test_adapters.explicit_hyper_icl writes them (float64 per-head loops), on what the model passes."""
    from test_adapters import explicit_hyper_icl
    T, S = q.shape[-2], k.shape[-2]
    assert scaling == pytest.approx(q.shape[-1] ** -0.5)
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    seen = (torch.ones(T, S, dtype=torch.bool).tril(S - T) if mask is None else mask).expand(len(q), 1, T, S)
    out = explicit_hyper_icl(copy.deepcopy(adapter).double(), q.double(), k.double(), v.double(), seen)
    return out.nan_to_num(0).to(q.dtype)  # a padding query that sees no key: 0, as SDPA gives


def test_fast_path_equals_reference_inside_the_model(plain, monkeypatch):
    """Fused path vs the T x S reference and vs the explicit Eq 3-9 loops, random adapter, padded batch,
    grouped-query attention (all but Idefics)."""
    M.attach(plain.model, "hyper-icl", rank=3)
    randomise(plain.model, seed=2)
    batch = prompts(plain, TEXTS)
    with torch.no_grad():
        fast = plain.model(**batch).logits
        monkeypatch.setattr(M.METHODS["hyper-icl"], "forward", M.METHODS["hyper-icl"].reference)
        reference = plain.model(**batch).logits
        monkeypatch.setattr(M.METHODS["hyper-icl"], "forward", explicit_forward)
        explicit = plain.model(**batch).logits
    real = batch["attention_mask"].bool()
    for want in (reference, explicit):
        assert ((fast - want)[real].norm() / want[real].norm()).item() <= 1e-5


def test_hyper_icl_at_init_is_the_base_model_in_bf16():
    """Q and K reach the kernel untouched, so zero-initialised Hyper-ICL adds no rounding in bf16 either."""
    backbone = backbones.load_backbone("tiny-idefics2", dtype=torch.bfloat16)
    batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in prompts(backbone, TEXTS).items()}
    with torch.no_grad():
        base = backbone.model(**batch).logits
        M.attach(backbone.model, "hyper-icl", rank=4)
        ours = backbone.model(**batch).logits
    real = batch["attention_mask"].bool()
    assert (ours - base)[real].abs().max() <= 1e-2   # about one bf16 step at these logits; 0 on this machine


def test_a_model_folder_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"there is no folder {tmp_path / 'missing'}"):
        M.family_of(str(tmp_path / "missing"))


@pytest.mark.parametrize("name", ["toy-idefics", "toy-llava-interleave", "toy-llava-onevision"])
def test_only_toy_idefics2_is_a_toy_name(name):
    """toy-idefics2 is the one toy backbone; another family after "toy-" is no name (it was read as that family's
    hub checkpoint before)."""
    assert not backbones.is_built(name)
    with pytest.raises(ValueError, match=f"unknown backbone {name!r}"):
        M.family_of(name)
