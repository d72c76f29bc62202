"""The distillation loop on the tiny Idefics2 twin and the VQAv2 of tools/benchmarks.py (CPU): losses, the teacher
without the adapter and its reuse, the schedule, the best epoch and clipping. Resume and interruption:
tests/lab/run/test_checkpoints.py; the teacher cache: tests/lab/run/test_teacher_cache.py."""
import contextlib
import dataclasses
import json
import math

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

import benchmarks
import data
import lorentz
import model as M
import train
from helpers import BENCH, lab_train, lab_train_args, micro_batch, small_run
from lab.datasets import tasks
from lab.methods import registry
from lab.models import backbones
from lab.run import adapter_files, runs


@pytest.mark.parametrize("method", ["hyper-icl", "hificl"])
def test_a_few_steps_reduce_the_training_loss(setup, method, tmp_path):
    args, backbone, queries, icds = setup
    args = lab_train_args([*BENCH, "--method", method, "--teacher-cache", str(tmp_path)])
    registry.attach(backbone.model, method, rank=args.rank, **({"n": 4} if method == "hificl" else {}))
    try:
        cache = {"id": adapter_files.fingerprint(backbone), "hits": 0, "misses": 0}
        student, teacher = micro_batch(backbone, args, queries, icds, cache)
        opt = torch.optim.AdamW(M.adapter_modules(backbone.model).parameters(), lr=1e-2)
        history = []
        for _ in range(8):
            parts = train.losses(backbone, args, student, teacher)
            parts["loss"].backward()
            opt.step()
            opt.zero_grad()
            history.append(parts["loss"].item())
        assert history[-1] < history[0]
        assert set(parts) == ({"anchor", "sup", "loss"} if method == "hyper-icl" else {"sup", "loss"})
    finally:
        M.detach(backbone.model)


def test_teacher_sees_the_demonstrations_and_the_student_does_not(setup, monkeypatch, tmp_path):
    args, backbone, queries, icds = setup
    args.teacher_cache, args.no_teacher_cache = str(tmp_path), True
    seen = []
    forward = backbone.model.forward
    monkeypatch.setattr(backbone.model, "forward", lambda **kw: seen.append(kw["input_ids"]) or forward(**kw))
    registry.attach(backbone.model, "hyper-icl", rank=2)
    try:
        cache = {"id": "x", "hits": 0, "misses": 0}
        student, teacher = micro_batch(backbone, args, queries, icds, cache)
    finally:
        M.detach(backbone.model)
    teacher_ids, = seen                                  # one forward: the teacher's (the student runs later)
    tok = backbone.processor.tokenizer
    for row_t, row_s, ds, query_target in zip(teacher_ids, student["input_ids"], icds, student["query_target"]):
        t_text, s_text = tok.decode(row_t), tok.decode(row_s)
        assert all(d.question in t_text and d.question not in s_text for d in ds if d.question != "")
        assert torch.equal(row_t[-int(query_target.sum()):], row_s[query_target])  # the same query tokens, last in both
    assert teacher.shape[:3] == (len(backbone.model.get_decoder().layers), *student["query_target"].shape)
    assert teacher[:, ~student["query_target"]].abs().sum() == 0


@contextlib.contextmanager
def attached_batch(setup, tmp_path, cache_id):
    """A fresh rank-2 Hyper-ICL on the tiny twin and the setup's micro-batch (student, teacher), detached after."""
    args, backbone, queries, icds = setup
    args.teacher_cache, args.no_teacher_cache = str(tmp_path), False
    registry.attach(backbone.model, "hyper-icl", rank=2)
    try:
        cache = {"id": cache_id, "hits": 0, "misses": 0}
        yield micro_batch(backbone, args, queries, icds, cache)
    finally:
        M.detach(backbone.model)


def test_anchor_loss_reads_only_the_aligned_positions(setup, tmp_path):
    args, backbone = setup[:2]
    with attached_batch(setup, tmp_path, "y") as (student, teacher):
        with torch.no_grad():
            base = train.losses(backbone, args, student, teacher)["anchor"]
            noise = torch.randn_like(teacher) * (~student["query_target"])[None, ..., None]
            assert train.losses(backbone, args, student, teacher + noise)["anchor"] == base
            moved = train.losses(backbone, args, student, teacher + torch.randn_like(teacher))["anchor"]
        assert moved != base


def test_the_loss_is_eq_17_written_out(setup, tmp_path):
    """L = L_H-anchor + lambda L_sup: Eq 16 on each decoder layer's own output against the teacher at the query's
    tokens, plus lambda times the mean cross-entropy of the target tokens (here F.cross_entropy on the shifted
    logits). Fails if lambda weighs the wrong part, the CE is averaged over other tokens, or a part is missing."""
    args, backbone = setup[:2]
    args.lam = 0.3
    try:
        with attached_batch(setup, tmp_path, "eq17") as (student, teacher):
            torch.nn.init.normal_(M.adapter_modules(backbone.model)[0].U_k, std=0.5)  # the adapter changes the states
            with torch.no_grad():
                parts = train.losses(backbone, args, student, teacher)
                out, states = M.layer_outputs(backbone.model, **data.model_inputs(student))
                labels = student["labels"][:, 1:]
                ce = torch.nn.functional.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels.flatten(),
                                                       ignore_index=-100)
                query_target = student["query_target"]
                anchor = lorentz.hyperbolic_anchor_loss(torch.stack(states), teacher, query_target, args.kappa)
            torch.testing.assert_close(parts["sup"], ce)
            torch.testing.assert_close(parts["anchor"], anchor)
            torch.testing.assert_close(parts["loss"], anchor + 0.3 * ce)
            assert anchor > 0 and ce > 0
    finally:
        args.lam = 0.5


def test_anchor_norm_first_divides_the_anchor_by_its_first_step_value(setup, tmp_path):
    args, backbone = setup[:2]
    with attached_batch(setup, tmp_path, "norm") as (student, teacher):
        with torch.no_grad():
            raw, progress = train.losses(backbone, args, student, teacher), {}
            normed = dataclasses.replace(args, anchor_norm="first")
            scaled = train.losses(backbone, normed, student, teacher, progress=progress)  # the first micro-batch
            later = train.losses(backbone, normed, student, teacher * 2, progress=progress)  # divided by the same
        assert progress["anchor_scale"] == pytest.approx(raw["anchor"].item())
        torch.testing.assert_close(scaled["anchor"], torch.tensor(1.0))
        torch.testing.assert_close(scaled["loss"], 1 + args.lam * raw["sup"])
        torch.testing.assert_close(later["anchor"], train.losses(backbone, args, student, teacher * 2)["anchor"] /
                                   progress["anchor_scale"])
    out = tmp_path / "normed"
    lab_train(small_run(tmp_path, "--anchor-norm", "first", "--max-steps", "1", name="normed"))
    scale = torch.load(out / "last.pt", weights_only=False)["progress"]["anchor_scale"]
    assert scale > 1  # the tiny twin's hyperbolic anchor at its start (tens), now the unit of the loss
    with pytest.raises(SystemExit, match="--anchor-norm first .now none."):  # a resume must keep it
        lab_train(small_run(tmp_path, "--resume", name="normed"))


def test_demonstrations_are_drawn_without_the_held_out_queries():
    """The held-out queries pick the best epoch, so they must not reach the adapter as demonstrations in the teacher's
    rows; the training queries may (each never as its own)."""
    args = lab_train_args(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT,
                           "--n-train", "40", "--n-heldout", "60"])
    queries, heldout, support, shots = tasks.split_pool(args, "idefics2")
    held = {q.id for q in heldout}
    assert held and not held & {it.id for it in support}
    assert len(support) == len(tasks.load_task("vqav2", "train", benchmarks.ROOT)) - 60
    icds = data.demonstrations([q.id for q in queries], support, 8, args.seed)
    assert all(d.id not in held and d.id != q.id for q, ds in zip(queries, icds) for d in ds)


@pytest.mark.parametrize("method", ["hyper-icl", "live", "lora"])
def test_the_teacher_runs_without_the_adapter(method):
    """Eq 14's h'^(l) are the frozen backbone's: an attached adapter (trained, so it changes the student) leaves the
    teacher's states as they were without it."""
    backbone = backbones.load_backbone("tiny-idefics2")
    pool = tasks.load_task("vqav2", "train", benchmarks.ROOT)
    queries = pool[:2]
    icds = data.demonstrations([q.id for q in queries], pool, 2, 0)
    pieces = data.query_pieces(backbone.processor, backbone.family, "vqa", queries)
    batch = data.teacher_batch(backbone.processor, backbone.family, "vqa", pieces, icds)
    plain = train.run_teacher(backbone, batch)
    registry.attach(backbone.model, method, **({"rank": 2} if method != "live" else {}))
    torch.manual_seed(0)
    for p in M.adapter_modules(backbone.model).parameters():
        torch.nn.init.normal_(p, std=0.3)
    student = data.model_inputs(data.student_batch(backbone.processor, backbone.family, "vqa", pieces))
    with torch.no_grad():
        adapted = M.layer_outputs(backbone.model, **student)[1][-1]
        with M.without_adapter(backbone.model):
            assert not torch.allclose(adapted, M.layer_outputs(backbone.model, **student)[1][-1])  # it is active
    for a, b in zip(plain, train.run_teacher(backbone, batch)):
        assert torch.equal(a, b)


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One run of the loop (4 epochs of 5 steps, --clip 1e-3, the default warm-up), traced at every AdamW step (its
    learning rate, the adapter's gradient norm) and at every epoch's end (the adapter then), its held-out losses
    handed in: 1, 0.5, 0.75, 2 (the second epoch the best, the last the worst)."""
    out, heldout = tmp_path_factory.mktemp("traced"), iter([1, .5, .75, 2])
    trace = {"lr": [], "norm": [], "adapter": []}

    def at_step(optimizer, args, kwargs):
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        trace["lr"].append(optimizer.param_groups[0]["lr"])
        trace["norm"].append(torch.stack([g.double().square().sum() for g in grads]).sum().sqrt().item())

    def scored(run):
        trace["adapter"].append({k: v.clone() for k, v in M.adapter_modules(run.backbone.model).state_dict().items()})
        return next(heldout)
    hook = register_optimizer_step_pre_hook(at_step)  # every optimiser's, AdamW's here
    try:
        with pytest.MonkeyPatch.context() as m:
            m.setattr(runs, "heldout_loss", scored)
            lab_train([*BENCH, "--n-train", "10", "--n-heldout", "2", "--batch-size", "2", "--shots", "1", "--epochs",
                       "4", "--clip", "1e-3", "--out", str(out), "--teacher-cache", str(out / "teacher")])
    finally:
        hook.remove()
    return trace, out


def test_the_learning_rate_warms_up_over_a_tenth_of_the_steps_then_decays_as_a_cosine_to_0(traced):
    """Section 4.1: linear warm-up over the first 10% of the steps, then cosine decay to 0, written out here as the
    learning rate each of the 20 steps used (5e-3 x k / W for k < W = 2, then 5e-3 x (1 + cos(pi (k - W) / 18)) / 2).
    Fails if the warm-up is removed, or the decay is another."""
    lr, (total, W) = traced[0]["lr"], (20, 2)
    want = [5e-3 * (k / W if k < W else (1 + math.cos(math.pi * (k - W) / (total - W))) / 2) for k in range(total)]
    assert len(lr) == total and lr[0] == 0 and lr[1] == pytest.approx(2.5e-3)
    assert lr == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_the_adapter_kept_is_the_best_epochs_not_the_last(traced):
    """Section 4.1: "all results are reported from the best-performing epoch": adapter.safetensors is the adapter of
    the epoch of the lowest held-out loss (the second), not the last one's, and the history holds every epoch's."""
    trace, out = traced
    kept = adapter_files.read_tensors(str(out / "adapter.safetensors"))
    assert [h["heldout_loss"] for h in json.load(open(out / "history.json"))] == [1, .5, .75, 2]
    assert kept.keys() == trace["adapter"][1].keys()
    assert all(torch.equal(kept[k], trace["adapter"][1][k]) for k in kept)
    assert not all(torch.equal(kept[k], trace["adapter"][3][k]) for k in kept)  # the epochs differ


def test_every_step_clips_the_adapters_gradient_norm_to_clip(traced):
    """--clip: AdamW sees the adapter's gradient with a norm of at most --clip (here 1e-3, below every step's own,
    so each step's is --clip, up to clip_grad_norm_'s 1e-6 in the divisor)."""
    norms = traced[0]["norm"]
    assert len(norms) == 20 and all(0.999e-3 < n <= 1e-3 * (1 + 1e-6) for n in norms), norms


def test_a_run_stopped_by_max_steps_before_an_epoch_keeps_a_partial_adapter_that_evaluates(tmp_path):
    """A smoke run (--max-steps before the first epoch is scored) scores its held-out loss, keeps its adapter as the
    best so far with a record that says it is partial, and evaluate.py scores it (before: "no epoch scored yet, so
    no best adapter", and evaluate.py quietly scored 0-shot and n-shot only); --resume then goes on as it did: the
    same adapter as an uninterrupted run, its first scored epoch replacing the partial one."""
    import evaluate
    lab_train(small_run(tmp_path, "--max-steps", "2", name="smoke"))
    path = str(tmp_path / "smoke" / "adapter.safetensors")
    partial = adapter_files.read_record(path)["partial"]
    assert partial["step"] == 2 and math.isfinite(partial["heldout_loss"]) and partial["heldout_loss"] > 0
    metrics = evaluate.main([*BENCH, "--n-eval", "2", "--checkpoint", path])
    assert metrics["setting"] == "hyper-icl" and "vqa_accuracy" in metrics
    resumed = lab_train(small_run(tmp_path, "--resume", name="smoke"))
    whole = lab_train(small_run(tmp_path, name="whole"))
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert "partial" not in adapter_files.read_record(path)
    kept, best = (adapter_files.read_tensors(p) for p in (path, str(tmp_path / "whole" / "adapter.safetensors")))
    assert kept.keys() == best.keys() and all(torch.equal(kept[k], best[k]) for k in kept)


@pytest.mark.parametrize("steps, flags", [(1, ["--n-train", "4", "--batch-size", "4"]),
                                          (2, ["--n-train", "4", "--batch-size", "2"]),
                                          (3, ["--n-train", "3", "--batch-size", "1"])])
def test_a_run_too_short_for_a_warm_up_step_trains_from_its_first(steps, flags, tmp_path):
    """10% of 1, 2 or 3 steps rounds to no warm-up step: each step runs at the full learning rate and moves the
    adapter's zero-initialised tensors (before: max(1, ...) made a one-step run all warm-up, at lr 0, and its adapter
    stayed the identity: U_k, w and b all 0). A run of 20 steps keeps its 2
    (test_the_learning_rate_warms_up_over_a_tenth_of_the_steps_then_decays_as_a_cosine_to_0)."""
    assert [runs.warmup_steps(0.1, n) for n in (1, 2, 3, 5, 6, 20, 750)] == [0, 0, 0, 0, 1, 2, 75]
    backbone = backbones.load_backbone("tiny-idefics2")
    zero = {k for k, v in registry.attach(backbone.model, "hyper-icl", rank=4).state_dict().items() if not v.any()}
    lr = []
    hook = register_optimizer_step_pre_hook(lambda opt, a, k: lr.append(opt.param_groups[0]["lr"]))
    try:
        trained = lab_train([*BENCH, *flags, "--n-heldout", "1", "--shots", "1", "--epochs", "1", "--workers", "0",
                             "--out", str(tmp_path / "run"), "--teacher-cache", str(tmp_path / "teacher")])
    finally:
        hook.remove()
    assert len(lr) == steps and lr[0] == 5e-3 and zero and any(trained[k].any() for k in zero)
