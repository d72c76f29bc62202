"""The adapters plugged into the real transformers backbones (tiny twins, CPU), against the unmodified model: the
zero-init equivalence (Eq 4-9 with U_k = 0) as a property over random adapters, ranks and left padding; the fused path
against Eq 3-9 written out; padding and the KV cache (Eq 8); the published parameter counts. On the paper's four
families (`family`); tests/lab/models/test_family_records.py runs the same tests on every registered family."""
import copy
import functools

import pytest
import torch
from hypothesis import given, settings, strategies as st

import model as M
from adapters import HyperICL
from helpers import PAPER, TEXTS, assert_cached_decoding_equals_full_forward, \
    assert_zero_init_is_the_unmodified_model, prompts, randomise
from lab.models import backbones, published
from lab.methods import registry
from test_adapters import explicit_hyper_icl


@pytest.fixture(scope="module", params=PAPER)
def family(request):
    return request.param


@pytest.fixture(scope="module")
def backbone(family):
    return backbones.load_backbone("tiny-" + family)


@functools.cache
def twin(family):
    """One tiny twin per family for the whole session (hypothesis examples cannot share a fixture's copy)."""
    return backbones.load_backbone("tiny-" + family)


@pytest.mark.parametrize("family", PAPER)
@settings(max_examples=20)
@given(method=st.sampled_from(["hyper-icl", "static-layer", "static-layer-head", "output-level"]),
       rank=st.integers(1, 8), lengths=st.lists(st.integers(1, 10), min_size=1, max_size=3),
       std=st.floats(0.01, 3.0), seed=st.integers(0, 2**16))
def test_zero_init_is_the_unmodified_model(family, method, rank, lengths, std, seed):
    """Eq 5-7 with U_k = 0: B = K U_k = 0, so Delta = 0 and S~ = S whatever U_q, w and b are (the gate of Eq 9 may
    take any value); every method that carries U_k is then the base attention of Eq 4. Checked on the real model:
    random U_q, w, b (or c), U_k = 0, prompts of random lengths left-padded in one batch; the adapted logits at every
    real token equal, bit for bit, the logits of the unmodified transformers model (stock SDPA, no adapter)."""
    assert_zero_init_is_the_unmodified_model(twin(family), method, rank, lengths, std, seed)


def test_hyper_icl_at_init_is_the_base_model(plain):
    batch = prompts(plain, TEXTS)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        base = plain.model(**batch).logits
        base_gen = plain.model.generate(**prompts(plain, TEXTS, positions=False), max_new_tokens=4, do_sample=False)
        registry.attach(plain.model, "hyper-icl", rank=4)
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
        registry.attach(backbone.model, "hyper-icl", rank=4)
        ours = backbone.model(**batch).logits
    assert (ours - base)[batch["attention_mask"].bool()].abs().max() <= 1e-5


@pytest.mark.parametrize("method,sizes", [("hyper-icl", dict(rank=4)), ("hificl", dict(n=3, rank=2))])
def test_padding_invariance_with_trained_adapter(plain, method, sizes):
    registry.attach(plain.model, method, **sizes)
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
    registry.attach(plain.model, method, **sizes)
    randomise(plain.model, seed=1)
    assert_cached_decoding_equals_full_forward(plain, new_tokens=4)


@pytest.mark.parametrize("family,method,sizes,count", [
    ("idefics2", "hyper-icl", dict(rank=4), 1_180_672), ("idefics", "hyper-icl", dict(rank=4), 1_180_672),
    ("idefics2", "hificl", dict(n=8, rank=8), 2_228_224), ("llava-interleave", "hificl", dict(n=8, rank=8), 2_228_224),
    ("qwen2.5-vl", "hyper-icl", dict(rank=4), 903_952), ("qwen3-vl", "hyper-icl", dict(rank=4), 1_328_256),
    ("llava-onevision-1.5", "hyper-icl", dict(rank=4), 1_328_256), ("internvl3", "hyper-icl", dict(rank=4), 903_952),
    ("gemma3", "hyper-icl", dict(rank=4), 626_960), ("idefics3", "hyper-icl", dict(rank=4), 1_180_672),
    ("smolvlm", "hyper-icl", dict(rank=4), 155_790), ("gemma3", "hificl", dict(n=8, rank=8), 1_148_928)])
def test_parameter_counts_on_published_sizes(family, method, sizes, count):
    model = published.published_model(family)                      # meta device: no memory, no download
    registry.attach(model, method, **sizes)
    assert sum(p.numel() for p in M.adapter_modules(model).parameters()) == count
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == count


def explicit_forward(adapter, q, k, v, mask, scaling):
    """Eq 3-9 as explicit_hyper_icl writes them (float64 per-head loops), on what the model passes."""
    T, S = q.shape[-2], k.shape[-2]
    assert scaling == pytest.approx(q.shape[-1] ** -0.5)
    k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
    seen = (torch.ones(T, S, dtype=torch.bool).tril(S - T) if mask is None else mask).expand(len(q), 1, T, S)
    out = explicit_hyper_icl(copy.deepcopy(adapter).double(), q.double(), k.double(), v.double(), seen)
    return out.nan_to_num(0).to(q.dtype)  # a padding query that sees no key: 0, as SDPA gives


def test_fast_path_equals_reference_inside_the_model(plain, monkeypatch):
    """Fused path vs the T x S reference and vs the explicit Eq 3-9 loops, random adapter, padded batch,
    grouped-query attention (all but Idefics)."""
    registry.attach(plain.model, "hyper-icl", rank=3)
    randomise(plain.model, seed=2)
    batch = prompts(plain, TEXTS)
    with torch.no_grad():
        fast = plain.model(**batch).logits
        monkeypatch.setattr(HyperICL, "forward", HyperICL.reference)
        reference = plain.model(**batch).logits
        monkeypatch.setattr(HyperICL, "forward", explicit_forward)
        explicit = plain.model(**batch).logits
    real = batch["attention_mask"].bool()
    for want in (reference, explicit):
        assert ((fast - want)[real].norm() / want[real].norm()).item() <= 1e-5


def test_hyper_icl_at_init_is_the_base_model_in_bf16(family):
    """Q and K reach the kernel untouched, so zero-initialised Hyper-ICL adds no rounding in bf16 either: bit for
    bit on every family."""
    backbone = backbones.load_backbone("tiny-" + family, dtype=torch.bfloat16)
    batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in prompts(backbone, TEXTS).items()}
    with torch.no_grad():
        base = backbone.model(**batch).logits
        registry.attach(backbone.model, "hyper-icl", rank=4)
        ours = backbone.model(**batch).logits
    real = batch["attention_mask"].bool()
    assert torch.equal(ours[real], base[real])
