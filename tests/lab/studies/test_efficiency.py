"""Zero-shot cost, Table 6 (lab/studies/efficiency.py): HiFICL's maskless paths, the benchmark sizes and prompts, every
registered method benchmarked, peak memory, the attention benchmark. Benchmarks are measurements: nothing here
asserts a latency."""
import json

import pytest
import torch
from PIL import Image

import adapters
import benchmarks
import data as D
import model as M
from adapters import HiFICL
from helpers import BENCH, lab, lab_args
from lab.methods import registry
from lab.methods.mimic import MimIC
from lab.models import backbones, published
from lab.studies import efficiency


@pytest.mark.parametrize("T, S", [(6, 6), (1, 6), (1, 1)])
def test_hificl_without_padding_builds_no_mask_and_equals_the_masked_path(T, S, monkeypatch):
    torch.manual_seed(0)
    adapter = HiFICL(2, 8, n=3, rank=2).double()
    torch.nn.init.normal_(adapter.V_B)
    q, k, v = torch.randn(2, 2, T, 8, dtype=torch.float64), *torch.randn(2, 2, 2, S, 8, dtype=torch.float64)
    causal = torch.ones(T, S, dtype=torch.bool).tril(S - T)
    want = adapter(q, k, v, causal, 8 ** -0.5)                    # the explicit [B, 1, T, n + S] mask
    monkeypatch.setattr(adapters, "causal_mask", lambda *a: pytest.fail("a mask was built"))
    torch.testing.assert_close(adapter(q, k, v, None, 8 ** -0.5), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("cls", [HiFICL, MimIC])
def test_a_decoding_step_copies_no_cache(cls):
    """One query token against a cache of 4,096 keys (4 MiB of K and V), with and without a padding mask: the step
    allocates under 1/8 of the cache (its logits, 64 kB), where a padded copy of K and V (the virtual-key path this
    replaced) allocated 4.5 MiB."""
    H, d_h, S = 4, 64, 4096
    adapter, q = cls(H, d_h), torch.randn(1, H, 1, d_h)
    k, v = torch.randn(2, 1, 2, S, d_h)
    cache_mib = (k.numel() + v.numel()) * 4 / 2 ** 20
    for mask in (None, (torch.arange(S) >= 5)[None, None, None]):
        with torch.no_grad():
            assert efficiency.peak_memory_mb(lambda: adapter(q, k, v, mask, d_h ** -0.5)) < cache_mib / 8


@pytest.mark.parametrize("family", efficiency.synthetic_families())  # synthetic prompts: the paper's families
def test_grown_twin_has_the_asked_decoder_and_runs(family):
    model, _ = published.grown_twin(family, hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                    num_hidden_layers=3, intermediate_size=64)
    assert M.attention_shape(model) == (3, 6, 16)
    inputs = efficiency.synthetic_prompt(model, family, 0, query_text=5)
    assert model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False).shape[1] == \
        inputs["input_ids"].shape[1] + 2


class Extra(HiFICL):
    """Stands for a method another branch registers."""


def test_every_registered_method_is_benchmarked(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "METHODS", {**registry.METHODS, "extra": registry.Method(Extra)})
    rows = lab(["benchmark", "--rounds", "1", "--model", "tiny-idefics2", "--task", "vqav2",
                         "--data-root", benchmarks.ROOT, "--bench-shots", "--out", str(tmp_path)])
    assert [r["setting"] for r in rows] == ["zero-shot", *registry.METHODS]
    # each row really ran its adapter (LIVE's elementwise shift has no FLOPs FlopCounterMode counts)
    assert all(r["tflops_ratio"] > 1 for r in rows[1:] if r["setting"] != "live")
    assert not hasattr(backbones.load_backbone("tiny-idefics2").model, "icl_settings")
    ms = efficiency.attention_benchmark(backbones.load_backbone("tiny-idefics2").model, T=8, rounds=1)
    assert list(ms) == ["sdpa", *registry.METHODS, "hyper-icl reference"]


def test_peak_memory_counts_allocations():
    mib = efficiency.peak_memory_mb(lambda: torch.ones(16, 2 ** 20) + 1)  # two 64 MiB tensors live at once
    assert 128 <= mib < 130


def test_fused_paths_form_no_t_by_t_tensor():
    model = backbones.load_backbone("tiny-idefics2").model
    T, (_, heads, _) = 512, M.attention_shape(model)
    one_score_matrix = heads * T * T * 4 / 2 ** 20               # MiB of one float32 [1, H, T, T] tensor
    result = efficiency.attention_benchmark(model, T=T, rounds=1)
    for name, (_, mib) in result.items():
        assert (mib > one_score_matrix) == (name == "hyper-icl reference"), (name, mib, one_score_matrix)


def test_paired_latency_cancels_a_drifting_machine():
    """A machine that slows down by 10% per run: every setting's ratio to the zero-shot runs on both sides of it is
    still its true 1.5x (2x), while the ratio of its median time to the reference's median is not."""
    clock = iter(1.1 ** i for i in range(100))                       # the machine's slowness at each run
    runs = {"zero-shot": lambda timer: next(clock), "a": lambda timer: 1.5 * next(clock),
            "b": lambda timer: 2 * next(clock)}
    result = efficiency.paired_latency(runs, "cpu", rounds=3)
    ms, ratio, q1, q3 = result["a"]
    assert ratio == pytest.approx(1.5 * 2 * 1.1 / (1 + 1.1 ** 2)) and (q1, q3) == pytest.approx((ratio, ratio))  # 1.493
    assert result["b"][1] == pytest.approx(2 * 2 * 1.1 / (1 + 1.1 ** 2))
    assert result["zero-shot"][1:] == (1.0, 1.0, 1.0)
    assert abs(ms / result["zero-shot"][0] - 1.5) > 0.05


def test_benchmark_prints_every_setting_and_flops_grow_with_shots(tmp_path, capsys):
    rows = lab(["benchmark", *BENCH, "--rounds", "1", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    names = ["zero-shot", *registry.METHODS, "8-shot", "16-shot", "32-shot"]  # no checkpoint: a row per method
    assert [r["setting"] for r in rows] == names
    for r in rows:
        assert r["tflops"] > 0 and r["ms"] > 0 and r["prefill_ms"] > 0 and 0 < r["prefill_tflops"] < r["tflops"]
        assert any(line.split()[0] == r["setting"] and f"{r['tflops']:.4g}" in line for line in printed.splitlines())
    flops = {r["setting"]: r["tflops"] for r in rows}
    # the adapters cost a little (LIVE's elementwise shift no counted FLOPs at all), ICDs a lot
    assert all(flops["zero-shot"] <= flops[m] < flops["8-shot"] for m in registry.METHODS)
    assert flops["zero-shot"] < flops["hyper-icl"] and flops["8-shot"] < flops["16-shot"] < flops["32-shot"]
    with open(tmp_path / "benchmark.json") as f:
        assert json.load(f)["rows"] == rows


@pytest.mark.parametrize("family", efficiency.synthetic_families())  # the families synthetic_prompt is written for
def test_synthetic_prompts_are_in_the_family_format(family):
    """--random-weights inputs, built from the tiny twin's config, run through the real model class, with as many
    tokens per image as the family's own processor gives an image of that size."""
    backbone = backbones.load_backbone("tiny-" + family)
    lengths = []
    for shots in (0, 2):
        inputs = efficiency.synthetic_prompt(backbone.model, family, shots)
        new = backbone.model.generate(**inputs, max_new_tokens=2, min_new_tokens=2, do_sample=False)
        assert new.shape[1] == inputs["input_ids"].shape[1] + 2
        lengths.append(inputs["input_ids"].shape[1])
    h, w = inputs["pixel_values"].shape[-2:]
    image = Image.new("RGB", (w, h), (200, 30, 30))
    per_image = len(D.encode_piece(backbone.processor, family, "<image>", image)["input_ids"])
    assert lengths[1] - lengths[0] == 2 * (per_image + efficiency.ICD_TEXT)


def test_random_weights_benchmark_path(tmp_path, monkeypatch, capsys):
    """--random-weights end to end on CPU, the real-size backbone replaced by the tiny twin (synthetic prompts)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(published, "published_model",
                        lambda family, device: backbones.load_backbone("tiny-" + family).model)
    rows = lab(["benchmark", "--rounds", "1", "--random-weights", "--model", "llava-interleave", "--task", "vqav2",
                         "--data-root", benchmarks.ROOT, "--out", str(tmp_path)])
    assert [r["setting"] for r in rows] == ["zero-shot", *registry.METHODS, "8-shot", "16-shot", "32-shot"]
    assert [r["prompt_tokens"] for r in rows[-3:]] == [rows[0]["prompt_tokens"] + s * (efficiency.ICD_TEXT + 4)
                                                       for s in (8, 16, 32)]  # the tiny twin: 2 x 2 patches an image
    assert "llava-interleave (random weights)" in capsys.readouterr().out


def test_random_weights_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(SystemExit):
        lab_args(["benchmark", "--random-weights"])
    assert "error: --random-weights published runs a real-size backbone and needs a CUDA GPU" in capsys.readouterr().err


def test_attention_benchmark_runs_every_path(capsys):
    ms = efficiency.attention_benchmark(backbones.load_backbone("tiny-idefics2").model, T=16, rounds=1)
    assert list(ms) == ["sdpa", *registry.METHODS, "hyper-icl reference"]
    assert all(t > 0 and m > 0 for t, m in ms.values())
    assert "hyper-icl reference" in capsys.readouterr().out
