"""Efficiency (Table 6): latency and peak memory of 0-shot, n-shot ICL and the adapter, FLOPs, and attention alone."""
import contextlib
import ctypes
import itertools
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch.utils.flop_counter import FlopCounterMode
from tqdm import tqdm

import data
import model as M
from lab.disk import files
from lab.datasets import tasks
from lab.models import backbones, families, published
from lab.methods import registry
from lab.scores import results


ROUNDS = 10  # --rounds' default: rounds of timed runs; the FLOP count (Table 6) or the peak-memory run warms up
BENCH_SHOTS = (8, 16, 32)  # --bench-shots' default: the n-shot ICL rows


@dataclass
class Settings:
    """The flags of python -m lab benchmark and benchmark-attention, Table 6 (lab/cli/modes.py:Evaluation gathers
    them: a field = a flag, its comment the help)."""
    benchmark: bool = False           # Table 6: FLOPs, latency of 0-shot, the adapter(s), --bench-shots (lab/studies)
    benchmark_attention: bool = False  # one attention layer: latency and peak memory of SDPA and of each method
    random_weights: Optional[Literal["published", "mid"]] = None  # --benchmark*: random weights, real size or mid
    bench_shots: list[int] = field(default_factory=lambda: list(BENCH_SHOTS))  # the ICL rows (none: no value)
    attention_tokens: int = 2048      # query and key tokens of the attention benchmarks
    rounds: int = ROUNDS              # rounds of timed runs, each setting once between two of the reference

# Synthetic prompts (--random-weights): text tokens per piece, estimated from the toy prompts of data.PROMPTS as a
# LLaMA-style tokenizer splits them: BOS + the instruction line; one ICD's "Question: ... Short answer: ..." + end
# token + newline (about 20 for a VQAv2 question); the query's question without the answer.
PREFIX_TEXT, ICD_TEXT, QUERY_TEXT = 14, 20, 16

MID_QUERY_TEXT = 512  # --random-weights mid: a long query, so that attention's share of the cost shows on a CPU


def synthetic_families():
    """The families whose records can make Table 6's synthetic prompts (families.Family.synthetic)."""
    return tuple(name for name, f in families.FAMILIES.items() if f.synthetic is not None)


def synthetic_prompt(model, family, shots, seed=0, query_text=QUERY_TEXT):
    """One query with `shots` ICDs (the query with `query_text` text tokens) in the family's real input format, with
    random text ids and pixels (Table 6): each image as the family's processor expands it, from its record
    (lab/models/synthetic_images.py). Sizes come from the model's config, so tiny twins get the same format."""
    make = families.FAMILIES[family].synthetic
    if make is None:
        raise ValueError(f"--random-weights: synthetic Table 6 prompts are written for "
                         f"{', '.join(synthetic_families())}, not {family}; run --benchmark on a checkpoint folder of "
                         "it (its processor makes the prompts)")
    cfg, n, gen = model.config, shots + 1, torch.Generator().manual_seed(seed)
    vocab = cfg.get_text_config().vocab_size
    image_id = getattr(cfg, "image_token_id", None) or getattr(cfg, "image_token_index", vocab)

    def text(k):  # random ids, never the image token
        t = torch.randint(vocab - 1, (k,), generator=gen)
        return t + (t >= image_id).long()

    image, pixels, cross = make(cfg, n, text, image_id)
    pieces = [text(PREFIX_TEXT)] + [torch.cat([image(), text(ICD_TEXT if i < shots else query_text)]) for i in range(n)]
    ids = torch.cat(pieces)[None]
    if cross:  # which image each token cross-attends to: the latest one before it
        owner = torch.cat([torch.full_like(p, i - 1) for i, p in enumerate(pieces)])
        pixels["image_attention_mask"] = torch.nn.functional.one_hot(owner + 1, n + 1)[None, :, 1:]
    pixels = {k: v.to(model.dtype) if v.is_floating_point() else v for k, v in pixels.items()}
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), **pixels}


def benchmark_prompt(backbone, args, shots):
    """The Table 6 input with `shots` ICDs: synthetic (--random-weights), else the first --split item of --task."""
    if backbone.processor is None:
        query_text = MID_QUERY_TEXT if args.random_weights == "mid" else QUERY_TEXT
        batch = synthetic_prompt(backbone.model, backbone.family, shots, args.seed, query_text)
    else:
        query = tasks.load_task(args.task, args.split, args.data_root)[:1]
        support = tasks.load_task(args.task, "train", args.data_root) if shots else None
        icds = data.demonstrations([query[0].id], support, shots, args.seed) if shots else None
        batch = data.prompt_batch(backbone.processor, backbone.family, tasks.spec(args.task).kind, query, icds)
    return data.model_inputs(batch, backbone.model.device)


def keep_freed_memory():
    """CPU benchmarks: glibc's malloc keeps freed blocks (up to 32 MiB each) for reuse, so that a run does not
    page-fault its activations in again (docs/efficiency.md, "How latency is measured"). A no-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(-3, 32 * 2 ** 20)   # M_MMAP_THRESHOLD: blocks up to 32 MiB come from the heap, not from mmap
    libc.mallopt(-1, 2 ** 31 - 1)    # M_TRIM_THRESHOLD: the heap's free top is never given back


def paired_latency(runs, device, rounds):
    """Latency of every runs[name] relative to the first (the reference: zero-shot, plain SDPA) on a machine whose
    speed drifts. run(timer) runs one call under its setting, timed by timer(f) (seconds; the GPU synchronised).
    Each of `rounds` rounds times the reference before and after every other setting, so each run has reference runs
    on both sides; its ratio is its time over their mean. Returns {name: (ms, ratio, q1, q3)}: the median time, and
    the median and quartiles over rounds of the ratio (the reference's are 1). Why paired, not torch.utils.benchmark:
    docs/efficiency.md, "How latency is measured"."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None

    def timer(f):
        sync()
        start = time.perf_counter()
        f()
        sync()
        return time.perf_counter() - start

    (reference, *others), times = list(runs), {name: [] for name in runs}
    ratios = {name: [1.0] if name == reference else [] for name in runs}
    with tqdm(total=rounds * (2 * len(others) + 1), desc="latency", unit="run") as bar:
        for _ in range(rounds):
            times[reference].append(runs[reference](timer))
            for name in others:
                times[name].append(runs[name](timer))
                times[reference].append(runs[reference](timer))
                ratios[name].append(times[name][-1] / statistics.mean(times[reference][-2:]))
                bar.update(2)
            bar.update()
    quantiles = lambda r: torch.tensor(r, dtype=torch.float64).quantile(torch.tensor([.5, .25, .75]).double()).tolist()
    return {name: (1000 * statistics.median(times[name]), *quantiles(r)) for name, r in ratios.items()}


@contextlib.contextmanager
def run_as(model, method):
    """The model as one Table 6 row runs it. method None: the backbone (zero-shot, n-shot ICL); "loaded": the adapter
    of --checkpoint; else a fresh `method` adapter (lab/methods/registry.py, its default sizes) attached
    with every parameter drawn at random, so that no zero-initialised factor hides a cost, and detached after."""
    if method is None:
        with M.without_adapter(model):
            yield
    elif method == "loaded":
        yield
    else:
        with torch.no_grad():
            for p in registry.attach(model, method).parameters():
                p.normal_(0, 0.02)
        try:
            yield
        finally:
            M.detach(model)


def flops(backbone, inputs, new_tokens, generate):
    """FLOPs of one `generate` call (evaluate.generate, handed in) of exactly new_tokens tokens
    (torch.utils.flop_counter); also a warm-up."""
    with FlopCounterMode(display=False) as counter:
        generate(backbone, inputs, new_tokens, min_new_tokens=new_tokens)
    return counter.get_total_flops()


def benchmark(backbone, args, generate):
    """Table 6: per query, FLOPs and latency (paired_latency, --rounds rounds) of the prefill (one new token) and of
    generating --new-tokens tokens for zero-shot, each adapter (the --checkpoint's, else every method of
    lab/methods/registry.py) and --bench-shots-shot ICL, each with its ratio to zero-shot; for zero-shot and each
    adapter also the peak memory of one decoder attention layer at --attention-tokens tokens (attention_call). Writes
    benchmark.json. generate: evaluate.generate (greedy decoding), handed in."""
    new_tokens = args.new_tokens or (8 if args.random_weights == "mid" else tasks.spec(args.task).max_new_tokens)
    loaded = getattr(backbone.model, "icl_settings", {}).get("method")
    methods = [(loaded, "loaded")] if loaded else [(m, m) for m in registry.METHODS]
    settings = [("zero-shot", None, 0)] + [(name, m, 0) for name, m in methods] + \
        [(f"{s}-shot", None, s) for s in args.bench_shots]
    path = os.path.join(args.out, "benchmark.json")
    results.check_replaceable(path, {"model": backbone.name})  # the latest measurement of this backbone
    device, (attention, _, _) = backbone.model.device, attention_call(backbone.model, args.attention_tokens)
    rows, runs = [], {"prefill": {}, "generate": {}}
    for name, method, shots in tqdm(settings, desc="FLOPs, memory", unit="setting"):
        inputs = benchmark_prompt(backbone, args, shots)
        with run_as(backbone.model, method):
            rows.append({"setting": name, "prompt_tokens": inputs["input_ids"].shape[1],
                         "prefill_tflops": flops(backbone, inputs, 1, generate) / 1e12,
                         "tflops": flops(backbone, inputs, new_tokens, generate) / 1e12,
                         "attention_mib": None if shots else peak_memory_mb(attention, device)})
        for part, k in (("prefill", 1), ("generate", new_tokens)):
            runs[part][name] = lambda timer, m=method, i=inputs, k=k: run_as(backbone.model, m)(
                lambda: timer(lambda: generate(backbone, i, k, min_new_tokens=k)))()
    for part, key in (("prefill", "prefill_ms"), ("generate", "ms")):
        for r, (ms, ratio, q1, q3) in zip(rows, paired_latency(runs[part], device, args.rounds).values()):
            r[key], r[key + "_ratio"], r[key + "_quartiles"] = ms, ratio, [q1, q3]
    for r in rows:
        for key in ("prefill_tflops", "tflops", "attention_mib"):
            r[key + "_ratio"] = r[key] / rows[0][key] if r[key] is not None else None
    print(f"{backbone.name} on {device}, {torch.get_num_threads()} threads; prefill (1 new token) and {new_tokens} new "
          f"tokens per query; latency: median ms, and the median [quartiles] over {args.rounds} rounds of the time "
          f"over zero-shot runs on both sides; attention: peak memory of one decoder attention layer at "
          f"{args.attention_tokens} tokens")
    print(f"{'setting':<17} {'tokens':>6} | prefill {'TFLOPs':>8} {'x':>6} {'ms':>8} {'x [quartiles]':>19} | "
          f"generate {'TFLOPs':>8} {'x':>6} {'ms':>8} {'x [quartiles]':>19} | attention {'MiB':>7} {'x':>5}")
    part = lambda r, tflops, ms: f"{r[tflops]:>8.4g} {r[tflops + '_ratio']:>6.3f} {r[ms]:>8.1f} " \
        f"{r[ms + '_ratio']:>6.3f} [{r[ms + '_quartiles'][0]:.3f}, {r[ms + '_quartiles'][1]:.3f}]"
    for r in rows:
        memory = f"{r['attention_mib']:>7.1f} {r['attention_mib_ratio']:>5.2f}" if r["attention_mib"] is not None \
            else f"{'-':>7} {'-':>5}"
        print(f"{r['setting']:<17} {r['prompt_tokens']:>6} | {'':7} {part(r, 'prefill_tflops', 'prefill_ms')} | "
              f"{'':8} {part(r, 'tflops', 'ms')} | {'':9} {memory}")
    files.write_json(path, {"model": backbone.name, "device": str(device), "threads": torch.get_num_threads(),
                            "new_tokens": new_tokens, "attention_tokens": args.attention_tokens, "rows": rows},
                     indent=2)
    print(f"-> {path}")
    return rows


def peak_memory_mb(run, device="cpu"):
    """Peak of the memory run() allocates beyond what is live before it, in MiB. CPU: from torch.profiler's allocation
    records (profile_memory: every allocation and free of torch's CPU allocator, in time order), summed up in order;
    CUDA: torch.cuda.max_memory_allocated."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2 ** 20
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    records = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]")
    return max(itertools.accumulate((nbytes for _, nbytes in records), initial=0)) / 2 ** 20


def attention_call(model, T):
    """One decoder self-attention of `model` (its first layer's module and head sizes) on random q [1, H, T, d_h] and
    k, v [1, H_kv, T, d_h], causal: (forward, reference, sizes), closures running model.calibrated_attention (the
    module's adapter, or the stock SDPA forward without one) and the adapter's T x S reference, both without autograd
    (the adapter's parameters would otherwise keep its activations), and the sizes in words."""
    attn = M.decoder_self_attentions(model)[0]
    device, dtype = model.device, model.dtype
    _, heads, head_dim = M.attention_shape(model)
    kv_heads = getattr(attn.config, "num_key_value_heads", None) or heads
    with fitting(T):
        q = torch.randn(1, heads, T, head_dim, device=device, dtype=dtype)
        k, v = (torch.randn(1, kv_heads, T, head_dim, device=device, dtype=dtype) for _ in range(2))
    return (fitting(T)(torch.no_grad()(lambda: M.calibrated_attention(attn, q, k, v, None, scaling=attn.scaling))),
            fitting(T)(torch.no_grad()(lambda: attn.icl_adapter.reference(q, k, v, None, attn.scaling))),
            f"{heads} heads ({kv_heads} key/value) x {head_dim}")


@contextlib.contextmanager
def fitting(T):
    """Torch's RuntimeError inside (memory it cannot allocate: the T x T reference at --attention-tokens 1e9)
    becomes a one-line ValueError naming --attention-tokens; a decorator too."""
    try:
        yield
    except RuntimeError as e:
        why = (str(e).splitlines() or [type(e).__name__])[0][:160]
        raise ValueError(f"--attention-tokens {T}: one attention layer at {T} tokens does not fit in memory ({why}); "
                         "lower --attention-tokens") from None


def attention_benchmark(model, T=2048, rounds=ROUNDS):
    """One decoder self-attention of `model` at T query and key tokens (attention_call), batch 1: latency
    (paired_latency, `rounds` rounds) and peak memory (peak_memory_mb) of the stock SDPA forward, of every method of
    lab/methods/registry.py, and of Hyper-ICL's T x T reference; each relative to SDPA. Returns
    {name: (ms, MiB)}."""
    device, dtype = model.device, model.dtype
    forward, reference, sizes = attention_call(model, T)
    paths = [("sdpa", None, forward)] + [(m, m, forward) for m in registry.METHODS] + \
        [("hyper-icl reference", "hyper-icl", reference)]
    runs, memory = {}, {}
    for name, method, run in paths:  # attention_call's closures run without autograd
        with run_as(model, method):
            memory[name] = peak_memory_mb(run, device)
        runs[name] = lambda timer, m=method, run=run: run_as(model, m)(lambda: timer(run))()  # in its setting
    latency = paired_latency(runs, device, rounds)
    print(f"one attention layer: {sizes}, T = {T}, {dtype} on {device}, {torch.get_num_threads()} threads; latency: "
          f"median ms, and the median [quartiles] over {rounds} rounds of the time over SDPA runs on both sides; "
          "peak memory: " + ("torch.cuda.max_memory_allocated" if torch.device(device).type == "cuda" else
                             "torch.profiler's allocation records"))
    for name, (ms, ratio, q1, q3) in latency.items():
        print(f"{name:<20} {ms:>9.2f} ms {ratio:>6.2f}x [{q1:.2f}, {q3:.2f}] {memory[name]:>10.1f} MiB "
              f"{memory[name] / memory['sdpa']:>6.2f}x")
    return {name: (latency[name][0], memory[name]) for name in latency}


def attention_model(name, random_weights=None):
    """The model whose first attention layer --benchmark-attention measures: --model `name`, or with --random-weights
    the mid-size model or a one-layer model with the published attention sizes (published.grown_twin)."""
    family = families.family_of(name)
    if random_weights == "mid":
        return published.mid_model(family)[0]
    if random_weights == "published":
        text = families.FAMILIES[family].published().get_text_config()
        sizes = {k: getattr(text, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
                 if getattr(text, k, None)}
        return published.grown_twin(family, num_hidden_layers=1, intermediate_size=64, **sizes)[0]
    return backbones.load_backbone(name).model
