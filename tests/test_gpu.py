"""The real size on a GPU (issue 37), for the day one is lent: `python -m pytest -m gpu -s` trains the full-size
Idefics2-8B (published.published_model: random weights, bf16, on CUDA) with a real-processor twin's processor on
COCO-size photographs (tools/memory_twins.py): --plan, 20 steps at batch 4 with 8 shots and the teacher cache, then 64
evaluation items at 0 and 8 shots and with the adapter, then Table 6 (evaluate.py --benchmark). It prints one table:
peak torch.cuda.max_memory_allocated against the plan, step time, the share of a step spent waiting for its batches,
cache bytes per query against the plan, Table 6. About 12 minutes on one H200 (estimated; not run yet).

The normal suite runs the same code path on the CPU at toy size (test_the_gpu_run_rehearsed_on_the_cpu), so it cannot
rot unnoticed."""
import os
import statistics
import time

import pytest
import torch

import adapters
import evaluate
import model as M
from memory_twins import write_photos
from twins import write_twin
from lab.disk import files
from lab.models import backbones, chunks, families, published
from lab.methods import mimic
from lab.run import prefetch, runs
from helpers import lab, lab_evaluate, lab_train


def peak(device, run):
    """run()'s result and the peak bytes torch.cuda allocated meanwhile (None on a CPU)."""
    if device != "cuda":
        return run(), None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    result = run()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated()


def rehearse(backbone, plan_flags, root, monkeypatch, steps, batch, shots, n_eval, bench):
    """The GPU run on `backbone` (what every load_backbone call returns meanwhile): plan, train, evaluate at 0 and
    `shots` shots and with the adapter, Table 6. Returns the table's rows {what: (measured, planned)} and Table 6."""
    device = "cuda" if next(backbone.model.parameters()).is_cuda else "cpu"
    photos = files.generated(os.path.join(root, "photos"), lambda f: write_photos(f, {"train": batch * steps + 16,
                                                                                    "val": n_eval}))
    common = ["--task", "vqav2", "--data-root", photos, "--shots", str(shots), "--batch-size", str(batch)]
    flags = [*common, "--n-train", str(batch * steps), "--n-heldout", "4", "--epochs", "1",
             "--out", os.path.join(root, "run")]
    plan = lab(["plan", "train", *plan_flags, *flags, "--plan", device])
    monkeypatch.setattr(backbones, "load_backbone", lambda *args, **kwargs: backbone)
    step_times, waiting, stepping = [], [], []
    steps_of, prepared = runs.remaining_steps, prefetch.prepared

    def timed_steps(run, epoch):  # a step's seconds, the waits for its batches (timed_batches) among them
        for step in steps_of(run, epoch):
            start, stepping[:] = time.perf_counter(), [True]
            yield step  # the loop asks for the next step once this step is taken
            if device == "cuda":
                torch.cuda.synchronize()
            step_times.append(time.perf_counter() - start)
            stepping.clear()

    def timed_batches(*args):  # the seconds a step waits for each micro-batch (DataLoader workers' lag)
        batches = prepared(*args)
        while True:
            start = time.perf_counter()
            batch = next(batches, None)
            if batch is None:
                return
            if stepping:
                waiting.append(time.perf_counter() - start)
            yield batch
    monkeypatch.setattr(runs, "remaining_steps", timed_steps)
    monkeypatch.setattr(prefetch, "prepared", timed_batches)
    _, trained = peak(device, lambda: lab_train(["--model", "idefics2", *flags]))
    cache = os.path.join(root, "run", "teacher")
    cached = [f for f in os.listdir(cache) if f.endswith(".safetensors")]
    queries = {f.split("-")[0].split(".")[0] for f in cached}  # a query's states and logits: two files, one key
    rows = {"training peak": (trained, plan["memory"]["train"]),
            "step time, s (median)": (statistics.median(step_times[1:] or step_times), None),
            "share of a step waiting for its batches": (sum(waiting) / sum(step_times), None),
            "cache bytes a query": (sum(os.path.getsize(os.path.join(cache, f)) for f in cached) / len(queries),
                                    plan["cache"] / plan["queries"])}
    adapter = os.path.join(root, "run", "adapter.safetensors")
    for setting, extra, planned in (("0-shot", ["--shots", "0"], "eval_adapter"),
                                    (f"{shots}-shot", ["--shots", str(shots)], "eval_icl"),
                                    ("adapter", ["--checkpoint", adapter], "eval_adapter")):
        if hasattr(backbone.model, "icl_settings"):
            M.detach(backbone.model)
        evaluation = [*common, "--n-eval", str(n_eval), "--split", "val", "--out", os.path.join(root, setting)]
        _, used = peak(device, lambda: lab_evaluate(["--model", "idefics2", *evaluation, *extra]))
        rows[f"evaluation peak, {setting}"] = (used, plan["memory"][planned])
    table6 = lab(["benchmark", "--model", "idefics2", "--task", "vqav2", "--data-root", photos, "--split", "val",
                  "--checkpoint", adapter, "--out", os.path.join(root, "bench"), *bench])
    print_table(rows, table6)
    return rows, table6


def print_table(rows, table6):
    """One table: measured against planned, then Table 6's rows."""
    print("\n| what | measured | planned |\n|---|---:|---:|")
    for what, (measured, planned) in rows.items():
        show = lambda v: "-" if v is None else files.size(v) if "peak" in what or "bytes" in what else f"{v:.3g}"
        print(f"| {what} | {show(measured)} | {show(planned)} |")
    print("\n| Table 6 setting | tokens | TFLOPs | x zero-shot | ms | x zero-shot |\n|---|---:|---:|---:|---:|---:|")
    for r in table6:
        print(f"| {r['setting']} | {r['prompt_tokens']} | {r['tflops']:.4g} | {r['tflops_ratio']:.3f} | {r['ms']:.1f} "
              f"| {r['ms_ratio']:.3f} |")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_real_size_on_a_gpu(tmp_path, monkeypatch):
    processor, images = families.load_processor(write_twin("idefics2", tmp_path / "twin"), "idefics2")
    model = chunks.chunk_images(published.published_model("idefics2", device="cuda"))
    families.context_limit(processor, model.config)
    backbone = families.Backbone(model, processor, "idefics2", "idefics2", images)
    rows, table6 = rehearse(backbone, ["--model", "idefics2", "--processor", str(tmp_path / "twin")], str(tmp_path),
                            monkeypatch, steps=20, batch=4, shots=8, n_eval=64, bench=[])
    for what, (measured, planned) in rows.items():
        if planned is not None and "peak" in what:
            assert measured <= 1.15 * planned, (what, measured, planned)  # the plan is not an underestimate
    assert rows["cache bytes a query"][0] == pytest.approx(rows["cache bytes a query"][1], rel=0.05)
    assert [r["setting"] for r in table6] == ["zero-shot", "hyper-icl", "8-shot", "16-shot", "32-shot"]


def test_the_gpu_run_rehearsed_on_the_cpu(tmp_path, monkeypatch):
    """The GPU test's code path at toy size on the CPU (a couple of steps): it runs, every measured row is filled in,
    the cache bytes are the plan's."""
    backbone = backbones.load_backbone("tiny-idefics2")
    rows, table6 = rehearse(backbone, ["--model", "tiny-idefics2"], str(tmp_path), monkeypatch, steps=2, batch=2,
                            shots=2, n_eval=2, bench=["--bench-shots", "2", "--rounds", "1", "--new-tokens", "2"])
    assert all(measured is not None for what, (measured, _) in rows.items() if "peak" not in what)
    assert 0 < rows["share of a step waiting for its batches"][0] < 1  # 0 workers on a CPU: the loop builds them
    assert rows["cache bytes a query"][0] == pytest.approx(rows["cache bytes a query"][1], rel=0.05)
    assert [r["setting"] for r in table6] == ["zero-shot", "hyper-icl", "2-shot"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cls", [adapters.HiFICL, mimic.MimIC])
@pytest.mark.usefixtures("attention_kernels")
def test_hificl_and_mimic_on_cuda_equal_the_float64_reference(cls):
    """adapters.fused_attention_lse's CUDA branch (the memory-efficient kernel's log-sum-exp, the mask aligned as SDPA
    aligns it, then the public path) runs nowhere else: outputs and gradients in float32 on CUDA against the float64
    reference on the CPU, for a left-padded prefill of 37 tokens (not a multiple of 8), 37 tokens after a cached prefix
    of 13, plain causal, and a padded decoding step; grouped heads (8 query, 2 key/value, 64 wide)."""
    H, H_kv, d_h = 8, 2, 64
    torch.manual_seed(0)
    reference = cls(H, d_h).double()
    for p in reference.parameters():
        torch.nn.init.normal_(p, std=0.5)
    adapter = cls(H, d_h).cuda()
    adapter.load_state_dict(reference.state_dict())
    for T, S, pad in [(37, 37, 5), (37, 50, 3), (37, 37, 0), (1, 50, 7)]:
        q, k, v = torch.randn(2, H, T, d_h).double(), *torch.randn(2, 2, H_kv, S, d_h).double()
        keys = torch.arange(S) >= torch.tensor([0, pad])[:, None]                      # row 1 left-padded
        mask = torch.ones(T, S, dtype=torch.bool).tril(S - T) & keys[:, None, None] if pad else None
        weights = torch.randn(2, H, T, d_h).double()
        results = []
        for module, device, dtype in ((reference, "cpu", torch.float64), (adapter, "cuda", torch.float32)):
            inputs = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
            out = module(*inputs, None if mask is None else mask.to(device), d_h ** -0.5)
            grads = torch.autograd.grad((out * weights.to(device, dtype)).sum(), [*inputs, *module.parameters()])
            results.append([out, *grads])
        for want, got in zip(*results):
            seen = torch.isfinite(want)
            assert ((got.double().cpu() - want)[seen].norm() / want[seen].norm()).item() <= 1e-4, (T, S, pad)


# The plan's time against a GPU's (issue 61): one Idefics2-8B query (published config, random weights, bf16) at
# batch 1 and 8, zero-shot and 8-shot, on COCO-size photographs with the real-processor twin's processor.
def planned_queries(twin, photos):
    """The plan's query times {(shots, batch): its --plan-json entry} (on a GPU: its own device's figures)."""
    planned = {}
    for shots in (0, 8):
        figures = lab(["plan", "evaluate", "--plan", "cuda", "--model", "idefics2", "--processor", str(twin),
                       "--task", "vqav2", "--data-root", photos, "--n-eval", "8", "--batch-size", "8",
                       "--shots", str(shots)])
        planned |= {(shots, r["batch"]): r for r in figures["times"]}
    return planned


def query_photos(root):
    return write_twin("idefics2", root / "twin"), write_photos(str(root / "photos"), {"train": 16, "val": 8})


def test_the_gpu_query_plan_dry(tmp_path):
    """The plan side of test_query_times_on_a_gpu, on any machine: four entries, each bound below its expected."""
    planned = planned_queries(*query_photos(tmp_path))
    assert sorted(planned) == [(0, 1), (0, 8), (8, 1), (8, 8)]
    for key, run in planned.items():
        for what in ("ttft_ms", "per_token_ms"):
            assert 0 < run[what]["bound"] < run[what]["expected"], (key, what)
    assert planned[8, 8]["ttft_ms"]["expected"] > planned[8, 1]["ttft_ms"]["expected"]  # a batch's prefill: 8 rows


def measure(backbone, batch, new=8):
    """Seconds to the first token and per generated token of generate on `batch` (CUDA), the median of 3."""
    def timed(tokens):
        torch.cuda.synchronize()
        start = time.perf_counter()
        evaluate.generate(backbone, batch, tokens, tokens)
        torch.cuda.synchronize()
        return time.perf_counter() - start
    timed(2)  # warm-up: kernels chosen, memory allocated
    first = statistics.median(timed(1) for _ in range(3))
    return first, (statistics.median(timed(new) for _ in range(3)) - first) / (new - 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_query_times_on_a_gpu(tmp_path):
    """Measured time to the first token and per generated token beside the plan's: at or above the roofline bound (a
    count would be wrong), at most 1.5x the expected time."""
    import data
    from lab.datasets import tasks
    twin, photos = query_photos(tmp_path)
    planned = planned_queries(twin, photos)
    processor = backbones.load_backbone(str(twin)).processor
    backbone = families.ready(published.published_model("idefics2", device="cuda"), processor, "idefics2",
                              "idefics2 (random weights)", None)
    items, pool = tasks.load_task("vqav2", "val", photos)[:8], tasks.load_task("vqav2", "train", photos)
    failures = []
    for (shots, batch), run in sorted(planned.items()):
        icds = data.demonstrations([q.id for q in items[:batch]], pool, shots, 0) if shots else None
        inputs = data.model_inputs(data.prompt_batch(processor, "idefics2", "vqa", items[:batch], icds), "cuda")
        for what, seconds in zip(("ttft_ms", "per_token_ms"), measure(backbone, inputs)):
            ms, bound, expected = seconds * 1e3, run[what]["bound"], run[what]["expected"]
            print(f"{shots}-shot batch {batch} {what}: measured {ms:.1f}, plan bound {bound:.1f} expected "
                  f"{expected:.1f}")
            if not bound <= ms <= 1.5 * expected:
                failures.append((shots, batch, what, ms, bound, expected))
    assert not failures, failures
