"""The methods of lab/methods/registry.py (static gates, output level, MimIC, LIVE, LoRA) against independent formulas
and inside the tiny Idefics2 twin: counts on the published configs, identity at init, masks, caching, gradients,
saving, training; no method compared by name outside the registry."""
import ast
import glob
import json
import math
import os
import re

import pytest
import torch

import benchmarks
import data
import model as M
import train
from adapters import OutputLevel, StaticGate, StaticGateHead
from helpers import (assert_cached_decoding_equals_full_forward, lab_evaluate, lab_train, lab_train_args,
                     left_padded_mask, micro_batch, naive_attention, prompts, rand, randomised, ROOT, TEXTS)
from lab.datasets import tasks
from lab.methods import registry
from lab.models import published
from lab.run import adapter_files


BASELINES = ["static-layer", "static-layer-head", "output-level", "mimic", "live", "lora"]


SIZES = {"static-layer": dict(rank=2), "static-layer-head": dict(rank=2), "output-level": dict(rank=2),
         "mimic": {}, "live": {}, "lora": dict(rank=2)}


@pytest.mark.parametrize("cls", [StaticGate, StaticGateHead])
def test_static_gate_is_hyper_icl_with_a_constant_gate_fused_and_reference(cls):
    H, d_h, r, T, S = 3, 8, 2, 4, 6
    adapter = randomised(cls(H, d_h, r).double(), seed=1)
    q, k, v = rand(2, H, T, d_h, seed=1), rand(2, H, S, d_h, seed=2), rand(2, H, S, d_h, seed=3)
    mask = left_padded_mask([0, 2], T, S)
    g = torch.sigmoid(adapter.c).reshape(-1, 1, 1)                    # [H or 1, 1, 1]
    Delta = (q @ adapter.U_q) @ (k @ adapter.U_k).transpose(-1, -2) / math.sqrt(r)
    logits = (q @ k.transpose(-1, -2) / math.sqrt(d_h) + g * Delta).masked_fill(~mask, -math.inf)
    want = logits.softmax(-1) @ v
    torch.testing.assert_close(adapter(q, k, v, mask, d_h ** -0.5), want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(adapter.reference(q, k, v, mask, d_h ** -0.5), want, rtol=1e-10, atol=1e-10)


def test_output_level_is_sa_plus_the_gated_low_rank_offset():
    H, d_h, r, T, S = 3, 8, 2, 4, 6
    adapter = randomised(OutputLevel(H, d_h, r).double(), seed=2)
    q, k, v = rand(2, H, T, d_h, seed=1), rand(2, H, S, d_h, seed=2), rand(2, H, S, d_h, seed=3)
    mask = left_padded_mask([1, 0], T, S)
    ln = (q - q.mean(-1, keepdim=True)) / torch.sqrt(q.var(-1, unbiased=False, keepdim=True) + 1e-5)
    g = torch.sigmoid((ln * adapter.w[:, None]).sum(-1, keepdim=True) + adapter.b[:, None, None])
    want = naive_attention(q, k, v, mask)[0] + g * (q @ adapter.U_q) @ adapter.U_k.transpose(-1, -2) / math.sqrt(r)
    torch.testing.assert_close(adapter(q, k, v, mask, d_h ** -0.5), want, rtol=1e-10, atol=1e-10)


def hyper_icl_count(L, H, d_h, r):
    return L * H * (2 * d_h * r + d_h + 1)


@pytest.mark.parametrize("family,counts", [
    ("idefics2", {"mimic": 263_168, "live": 131_104, "lora": 17_588_224,            # paper: 0.26 M, 0.13 M, 17.6 M
                  "output-level": hyper_icl_count(32, 32, 128, 4),
                  "static-layer": 32 * (32 * 2 * 128 * 4 + 1), "static-layer-head": 32 * 32 * (2 * 128 * 4 + 1)}),
    ("idefics", {"lora": 24_993_792})])                                             # paper: 25.0 M
def test_parameter_counts_on_published_configs(family, counts):
    model = published.published_model(family)
    for method, count in counts.items():
        assert sum(p.numel() for p in registry.attach(model, method).parameters()) == count, method
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == count, method
        M.detach(model)


def perturb(model, seed=0):
    """Move every adapter parameter away from its initialisation (as training would)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in M.adapter_modules(model).parameters():
            p.add_(torch.randn_like(p) * 0.3)


@pytest.mark.parametrize("method", ["static-layer", "static-layer-head", "output-level", "lora"])
def test_identity_at_initialisation(plain, method):
    batch = prompts(plain, TEXTS)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        base = plain.model(**batch).logits
        registry.attach(plain.model, method, **SIZES[method])
        ours = plain.model(**batch).logits
    assert (ours - base)[real].abs().max() <= 1e-5


@pytest.mark.parametrize("method", BASELINES)
def test_without_adapter_and_detach_restore_the_backbone(plain, method):
    batch = prompts(plain, TEXTS)
    keys = set(plain.model.state_dict())
    with torch.no_grad():
        base = plain.model(**batch).logits
        registry.attach(plain.model, method, **SIZES[method])
        perturb(plain.model)
        ours = plain.model(**batch).logits
        with M.without_adapter(plain.model):
            teacher = plain.model(**batch).logits
        again = plain.model(**batch).logits
        M.detach(plain.model)
        after = plain.model(**batch).logits
    assert (ours - base).abs().max() > 1e-3
    torch.testing.assert_close(teacher, base)
    torch.testing.assert_close(again, ours)
    torch.testing.assert_close(after, base)
    assert set(plain.model.state_dict()) == keys


@pytest.mark.parametrize("method", ["mimic", "live", "lora"])
def test_padding_invariance(plain, method):
    registry.attach(plain.model, method, **SIZES[method])
    perturb(plain.model)
    with torch.no_grad():
        together = plain.model(**prompts(plain, TEXTS)).logits
        for i, text in enumerate(TEXTS):
            alone = plain.model(**prompts(plain, [text])).logits[0]
            torch.testing.assert_close(together[i, -alone.shape[0]:], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", BASELINES)
def test_cached_decoding_equals_full_forward(plain, method):
    registry.attach(plain.model, method, **SIZES[method])
    perturb(plain.model, seed=1)
    assert_cached_decoding_equals_full_forward(plain, new_tokens=3)


@pytest.mark.parametrize("method", BASELINES)
def test_only_the_methods_parameters_get_gradients(plain, method):
    adapted = registry.attach(plain.model, method, **SIZES[method])
    perturb(plain.model)
    plain.model(**prompts(plain, TEXTS)).logits.logsumexp(-1).mean().backward()
    own = {id(p) for p in adapted.parameters()}
    with_grad = {id(p) for p in plain.model.parameters() if p.grad is not None}
    assert with_grad == own
    assert all(p.grad.abs().sum() > 0 for p in adapted.parameters())
    adapted.zero_grad(set_to_none=True)


@pytest.mark.parametrize("method", BASELINES)
def test_save_load_roundtrip_and_wrong_method_refused(plain, method, tmp_path):
    path = str(tmp_path / "adapter.safetensors")
    batch = prompts(plain, TEXTS)
    registry.attach(plain.model, method, **SIZES[method])
    perturb(plain.model, seed=2)
    with torch.no_grad():
        saved = plain.model(**batch).logits
        adapter_files.save_adapter(path, plain)
        M.detach(plain.model)
        assert adapter_files.load_adapter(path, plain, method=method)["method"] == method
        torch.testing.assert_close(plain.model(**batch).logits, saved, rtol=0, atol=0)
    other = "live" if method != "live" else "mimic"
    with pytest.raises(ValueError, match=f"holds a '{method}' adapter, not a '{other}' one"):
        adapter_files.load_adapter(path, plain, method=other)


@pytest.mark.parametrize("method", BASELINES)
def test_trains_and_evaluates_end_to_end(method, tmp_path):
    out = str(tmp_path / method)
    lab_train(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--method", method,
               "--out", out, "--n-train", "2", "--n-heldout", "1", "--batch-size", "2", "--shots", "1", "--epochs",
               "1", "--lr", "1e-2"])
    history = json.load(open(f"{out}/history.json"))
    assert len(history) == 1 and math.isfinite(history[0]["heldout_loss"])
    metrics = lab_evaluate(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT,
                            "--checkpoint", f"{out}/adapter.safetensors", "--n-eval", "1"])
    assert metrics["setting"] == method and 0 <= metrics["vqa_accuracy"] <= 100


HIFICL_ABLATIONS = {"hificl-teacher": ("HiFICL", "mse"), "hificl-full-k": ("HiFICLFullK", "none"),
                    "hificl-full-v": ("HiFICLFullV", "none"), "hificl-linear": ("HiFICLLinear", "none")}


@pytest.mark.parametrize("method", HIFICL_ABLATIONS)
def test_hificls_ablations_train_and_evaluate_on_the_toy_world(method, tmp_path, capsys):
    """HiFICL's four ablations (its paper's component table): each its module and loss, HiFICL's sizes (n, rank 8),
    trained a step on the toy world (the teacher's states cached for + teacher alignment alone) and evaluated."""
    cls, anchor = HIFICL_ABLATIONS[method]
    own = registry.METHODS[method]
    assert (own.adapter.__name__, own.anchor, own.sizes, own.rank) == (cls, anchor, ("rank", "n"), 8)
    out = tmp_path / method
    lab_train(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT, "--method", method,
               "--out", str(out), "--n-train", "2", "--n-heldout", "1", "--batch-size", "2", "--shots", "1",
               "--epochs", "1", "--virtual-tokens", "2", "--rank", "2", "--workers", "0"])
    history = json.load(open(out / "history.json"))
    assert len(history) == 1 and math.isfinite(history[0]["heldout_loss"])
    taught = "teacher states computed 2," if anchor != "none" else "teacher states computed 0,"
    assert taught in capsys.readouterr().out
    record = adapter_files.read_record(str(out / "adapter.safetensors"))
    assert (record["method"], record["anchor"], record["rank"], record["virtual_tokens"]) == (method, anchor, 2, 2)
    metrics = lab_evaluate(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT,
                            "--checkpoint", str(out / "adapter.safetensors"), "--n-eval", "1", "--workers", "0"])
    assert metrics["setting"] == method and 0 <= metrics["vqa_accuracy"] <= 100


@pytest.mark.parametrize("method,anchor", [("mimic", "mse"), ("live", "kl"), ("lora", "none")])
def test_each_method_trains_with_its_own_loss_and_reuses_the_teacher(plain, method, anchor, tmp_path):
    args = lab_train_args(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT,
                           "--method", method, "--teacher-cache", str(tmp_path)])
    assert args.anchor == anchor and args.lam == 0.5
    pool = tasks.load_task(args.task, "train", args.data_root)
    queries = pool[:3]
    icds = data.demonstrations([q.id for q in queries], pool, 1, args.seed)
    registry.attach(plain.model, method, **registry.sizes(args.method, args.rank, args.virtual_tokens))
    cache = {"id": adapter_files.fingerprint(plain), "hits": 0, "misses": 0}
    student, teacher = micro_batch(plain, args, queries, icds, cache)
    parts = train.losses(plain, args, student, teacher)
    assert set(parts) == ({"sup", "loss"} if anchor == "none" else {"anchor", "sup", "loss"})
    if anchor == "none":
        return
    assert (cache["hits"], cache["misses"], cache["output"]) == (0, 3, registry.ANCHORS[anchor].teacher)
    _, again = micro_batch(plain, args, queries, icds, cache)
    assert cache["hits"] == 3 and torch.equal(again, teacher)
    with torch.no_grad():  # the student as its own teacher: the distillation loss vanishes
        out, states = M.layer_outputs(plain.model, **data.model_inputs(student))
    own = out.logits[M.answer_positions(student["labels"])] if anchor == "kl" else torch.stack(states)
    if anchor == "kl":
        assert teacher.shape == own.shape  # one row per answer position, in the student's order
    assert parts["anchor"] > 0 and train.losses(plain, args, student, own)["anchor"].abs() < 1e-6


def named_in_comparisons(source):
    """The lines of a Python source that compare with a method's or an anchor's name (== "lora", in ("mimic",
    "live"), != "none" beside an --anchor)."""
    names = (set(registry.METHODS) | set(registry.ANCHORS)) - {"none"}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            words = {n.value for side in sides for n in ast.walk(side) if isinstance(n, ast.Constant)}
            anchor = any(re.search(r"\banchor\b", ast.unparse(side)) for side in sides)
            if words & names or "none" in words and anchor:
                found.append(node.lineno)
    return found


def test_no_method_or_anchor_is_compared_by_name_outside_the_registry():
    """Methods are plug-ins: a method's or an anchor's name is compared nowhere in the six files and lab/ but in
    lab/methods/registry.py; what differs between methods is read from their records."""
    compared = 'a = cfg.method == "lora"\nb = a.anchor != "none"\nc = m in ("mimic", "x")'
    assert named_in_comparisons(compared) == [1, 2, 3]
    assert named_in_comparisons('y = args.anchor_norm != "none"\nz = checkpoint in ("none", "")') == []
    root = ROOT
    paths = [f"{m}.py" for m in ("adapters", "lorentz", "model", "data", "train", "evaluate")] + \
        sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, "lab", "**", "*.py"), recursive=True))
    assert len(paths) > 40 and "lab/methods/registry.py" in paths
    found = {p: lines for p in paths if p != "lab/methods/registry.py"
             if (lines := named_in_comparisons(open(os.path.join(root, p), encoding="utf-8").read()))}
    assert found == {}
