"""The plan of a run (--plan): tokens per row, the images a batch holds, the teacher cache on disk and its room, the
peak memory of training and evaluation, and whether reading the cache or recomputing the teacher is cheaper.

train.py / evaluate.py --plan: the rows of a sample of the task's queries, encoded by the real processor exactly as
a run encodes them (data.teacher_batch, data.student_batch), and the model's config on the meta device, give the
tokens per row, the teacher cache on disk and an estimate of peak accelerator memory; no weights are read."""
import os
import shutil
import time
from dataclasses import dataclass
from typing import Optional

import torch

import data
from lab.disk import files
from lab.disk.files import size
from lab.datasets import tasks
from lab.models import backbones, chunks, families, published
from lab.methods import registry
from lab.run import runs, teacher_cache
from lab.studies import flops, roofline, shard_plan


@dataclass
class Settings:
    """The plan's flags of its times (the scripts' Configs gather them: a field = a flag, its comment the help)."""
    accelerator: str = "h200"         # the GPU the plan's times are for (roofline.ACCELERATORS); --plan cuda: here's
    plan_json: Optional[str] = None   # also write the plan's times to this file as JSON (docs/efficiency.md)


PLAN_SAMPLE = 32    # queries whose rows the plan encodes (every query when there are fewer)

RUNTIME = 0.45e9     # bytes: a CPU run's resident Python, torch, transformers and tokenizer before any weight

MEMORY_ASSUMPTIONS = (
    "assumptions: weights and activations in {dtype}, the adapter's state in float32 (16 bytes a parameter); "
    "loading: on a CPU the weights plus the {file} file's copy (mapped while the weights are converted), on a GPU the "
    "weights; images: the batch's pixel tensors as the batch builder returns them for the sampled rows, the real "
    "images' copy in {dtype}, each image's vision-tower output, and one chunk of images (--image-memory {budget}) at "
    "chunks.image_work; decoder: one layer's work B T (3 i + 5 d) and a B x T x T bool mask (SDPA without T x T "
    "scores), in evaluation the KV cache 2 L B (T + new) kv (training forwards keep none), the teacher's kept states "
    "L B T_q d (no [L, B, T, d] stack), the student's B T_s L (10 d + 3 i) saved for the backward; a phase's peak is "
    "its pixels + the larger of its image and decoder parts; on a CPU the runtime (0.45 GB) is added; rows at the "
    "sample's longest, random ICDs (run_plan.memory)")


def plan_backbone(name, family, image_splitting="checkpoint", processor_dir=None):
    """The processor and a meta-device model (no weights) of --model `name`, its image setting, where each came from
    and the dtype of its weight files (the config's; the published checkpoints' bf16 for a short name; float32 built):
    a folder's own config.json and processor; for a short name its record's published config (published_configs) and
    the processor of --processor `processor_dir` or of the local Hugging Face cache (the plan never reaches the hub); a
    tiny or toy backbone is built (with --image-splitting `image_splitting`)."""
    if backbones.is_built(name):
        backbone = backbones.load_backbone(name, image_splitting=image_splitting)
        return backbone.processor, backbone.model, backbone.images, f"{name} (built)", torch.float32
    if processor_dir and not os.path.isdir(processor_dir):
        raise ValueError(f"--processor {processor_dir}: not a folder; give the folder of the checkpoint's tokenizer "
                         "and preprocessor files")
    folder = processor_dir or (name if os.path.isdir(name) else None)
    if folder is None:  # the local Hugging Face cache's copy: the plan downloads nothing
        from huggingface_hub import snapshot_download
        hub_id = families.hub_id(name)
        try:
            folder = snapshot_download(hub_id, local_files_only=True)
        except Exception as e:  # LocalEntryNotFoundError and its kin: not cached here
            raise ValueError(f"--plan: the processor of {hub_id} is not in the local Hugging Face cache and the plan "
                             f"reaches no hub ({type(e).__name__}); pass --processor DIR, a folder with its tokenizer "
                             f"and preprocessor files (`hf download {hub_id} --exclude '*.safetensors'`)") from None
    config = backbones.read_config(name) if os.path.isdir(name) else None
    if config is not None:
        backbones.check_config(config, name)
    try:
        processor, images = families.load_processor(folder, family, image_splitting)
    except (AttributeError, ImportError) as e:  # another family's processor: lacks its settings, needs a video one
        raise ValueError(f"{'--processor' if processor_dir else '--model'} {folder} is not a {family} processor "
                         f"({e})") from None
    made = families.published_of(name, family)
    model = published.published_model(family, config=config or made())  # on the meta device: no weights
    source = f"published_configs.{made.__name__}" if config is None else f"{name}/config.json"
    families.context_limit(processor, model.config)
    file_dtype = getattr(torch, str(getattr(model.config, "dtype", None) or "bfloat16").split(".")[-1])
    return processor, model, images, f"config {source}, processor {folder}, no weights", file_dtype


def plan_rows(processor, family, kind, queries, icds, batch):
    """The sampled queries' rows collated as a run collates them, `batch` at a time: {"student": {id: tokens},
    "teacher": {id: tokens}, "query": {id: T_q}, "answers": {id: target tokens}, "images": {"student": [...],
    "teacher": [...]}, each batch's image_sizes}."""
    rows = {"student": {}, "teacher": {}, "query": {}, "answers": {}, "images": {"student": [], "teacher": []}}
    for start in range(0, len(queries), batch):
        qs = queries[start:start + batch]
        pieces = data.query_pieces(processor, family, kind, qs)
        for name, collated in (("student", data.student_batch(processor, family, kind, pieces)),
                               ("teacher", data.teacher_batch(processor, family, kind, pieces,
                                                              icds[start:start + batch]))):
            rows[name].update(zip((q.id for q in qs), collated["attention_mask"].sum(1).tolist()))
            rows["images"][name].append(image_sizes(collated))
        for q, (tokens, answers) in zip(qs, teacher_cache.query_sizes(pieces)):
            rows["query"][q.id], rows["answers"][q.id] = tokens, answers
    return rows


def image_sizes(batch):
    """What the image modules of a collated batch run over, read off its pixel tensors as the builder made them:
    {"images": real images (all-zero padding images are dropped by the model), "pixels": [H, W] of each (its canvas),
    "bytes": the pixel tensors' bytes, "patches" and "values": the largest image's vision patches (None: from its
    pixels) and its pixel values}. Qwen's flattened patches (image_grid_thw) are images_of_patches'."""
    if "image_grid_thw" in batch:
        return images_of_patches(batch)
    pixels = batch["pixel_values"]
    flat = pixels.reshape(-1, *pixels.shape[-3:])
    real = flat.flatten(1).ne(0).any(1)
    return {"images": int(real.sum()), "pixels": tuple(pixels.shape[-2:]), "patches": None,
            "values": flat[0].numel(), "bytes": sum(v.nbytes for k, v in batch.items() if k.startswith("pixel"))}


def images_of_patches(batch):
    """image_sizes of a batch of flattened patches [patches, values] and each image's grid [t, h, w] in patches."""
    grid, pixels = batch["image_grid_thw"], batch["pixel_values"]
    largest = int(grid.prod(-1).max())
    t, h, w = grid[grid.prod(-1).argmax()].tolist()
    return {"images": len(grid), "pixels": (h, w), "patches": largest, "values": largest * pixels.shape[-1],
            "bytes": pixels.nbytes + grid.nbytes}


def memory(config, params, adapter_params, rows, batch, dtype, new_tokens, on_cpu, file_dtype, image_memory):
    """Estimated peak bytes of each part, of training and of evaluation (MEMORY_ASSUMPTIONS, every term here)."""
    text = config.get_text_config()
    b, L, d, i, heads = dtype.itemsize, text.num_hidden_layers, text.hidden_size, text.intermediate_size, \
        text.num_attention_heads
    kv = (getattr(text, "num_key_value_heads", None) or heads) * (getattr(text, "head_dim", None) or d // heads)
    t_s, t_t = max(rows["student"].values()), max(rows["teacher"].values())
    kept = L * batch * max(rows["query"].values()) * d * b   # the teacher's states at the query + target tokens

    def vision(sizes):  # the batch's pixels, a chunk's working set, every image's tower output and features
        patch = chunks.side(config.vision_config.patch_size)
        patches = sizes["patches"] or (sizes["pixels"][0] // patch) * (sizes["pixels"][1] // patch)
        one = chunks.image_work(config, patches, b)
        d_v = getattr(config.vision_config, "hidden_size", None) or config.vision_config.embed_dim
        chunk = min(sizes["images"], max(1, int(image_memory // one)))
        return sizes["bytes"] + sizes["images"] * (sizes["values"] + patches * d_v) * b + chunk * one

    def layer(tokens, cached=False):  # one decoder layer's working set and inputs, the bool mask (+ KV cache)
        return batch * tokens * (3 * i + 5 * d) * b + batch * tokens ** 2 + cached * 2 * L * batch * tokens * kv * b

    pixels = lambda name: max(s["bytes"] for s in rows["images"][name])
    worst = lambda name: max(vision(s) for s in rows["images"][name])
    out = {"weights": params * b, "adapter": adapter_params * 16, "runtime": RUNTIME if on_cpu else 0,
           "load": params * (b + file_dtype.itemsize) if on_cpu else params * b,
           "vision": worst("teacher"), "teacher": max(worst("teacher"), pixels("teacher") + layer(t_t) + kept),
           "student": max(worst("student"), pixels("student") + layer(t_s) + batch * t_s * L * (10 * d + 3 * i) * b)}
    out["train_loaded"] = out["runtime"] + out["weights"] + out["adapter"] + kept + max(out["teacher"], out["student"])
    evaluation = lambda tokens, name: out["runtime"] + out["weights"] + max(
        worst(name), pixels(name) + layer(tokens + new_tokens, cached=True))
    out["eval_adapter_loaded"], out["eval_icl_loaded"] = evaluation(t_s, "student"), evaluation(t_t, "teacher")
    for run in ("train", "eval_adapter", "eval_icl"):  # the peak: loading, or the run once loaded
        out[run] = max(out["runtime"] + out["load"], out[run + "_loaded"])
    return out


def plan(args, queries=None):
    """Print what a run of these flags costs, without loading weights: tokens per student and teacher row at the
    configured shots (the collated rows of a sample of the queries), the images the vision tower runs over, the teacher
    cache on disk (every query's tokens) and the peak memory of training and evaluation (MEMORY_ASSUMPTIONS) in the
    run's own dtype and device (--plan cuda | cpu). Returns the figures as a dict.
    queries: evaluate.py's items (ICDs then come from the training split); None: train.py's training queries."""
    family, kind, training = families.family_of(args.model), tasks.spec(args.task).kind, queries is None
    if training:
        queries, _, pool, shots = tasks.split_pool(args, family)
    else:
        shots = args.shots if args.shots else tasks.default_shots(args.task, family)
        pool = tasks.icd_support(args)
    processor, model, images, source, file_dtype = plan_backbone(args.model, family, args.image_splitting,
                                                                 args.processor)
    sample = queries[:PLAN_SAMPLE]
    icds = data.demonstrations([q.id for q in sample], pool, shots, args.seed)
    batch = min(args.batch_size, len(queries))  # a run's batches hold at most the queries there are
    rows = plan_rows(processor, family, kind, sample, icds, batch)
    dtype, on_cpu = backbones.autocast_dtype(args.plan), args.plan == "cpu"  # cuda: bf16; cpu: float32
    params = sum(p.numel() for p in model.parameters())
    sizes = training and registry.sizes(args.method, args.rank, args.virtual_tokens)  # evaluate.py's: none
    adapter = sum(p.numel() for p in registry.attach(model, args.method, **sizes).parameters()) if training else 0
    at = lambda params, batch: memory(model.config, params, adapter, rows, batch, dtype,
                                      tasks.spec(args.task).max_new_tokens, on_cpu, file_dtype, args.image_memory * 1e9)
    mem = at(params, batch)
    mean = lambda values: sum(values) / len(values)
    count = lambda n: f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M" if n >= 1e6 else f"{n:,}"
    print(f"plan: {args.model} on {args.task}, {len(queries)} queries, {shots} shots, batch {batch}, "
          f"{str(dtype).split('.')[-1]} ({'a CPU' if on_cpu else 'a CUDA'} run); {source}")
    if images:
        print(images)
    seen = max(rows["images"]["teacher"], key=lambda s: s["images"])
    print(f"tokens a row ({len(sample)} queries encoded): student {mean(rows['student'].values()):.0f} mean, "
          f"{max(rows['student'].values())} max; teacher ({shots} ICDs) {mean(rows['teacher'].values()):.0f} mean, "
          f"{max(rows['teacher'].values())} max; query + target T_q {mean(rows['query'].values()):.1f} mean; a "
          f"teacher batch's images: {seen['images']} of {seen['pixels'][0]} x {seen['pixels'][1]} "
          f"{'patches' if seen['patches'] else 'pixels'} (as collated)")
    figures = {"rows": rows, "memory": mem, "shots": shots, "dtype": dtype, "queries": len(queries)}
    print(f"weights: {count(params)} parameters = {size(mem['weights'])} (loading: {size(mem['load'])})"
          + (f"; adapter ({args.method}) {count(adapter)} parameters" if training else ""))
    if training:
        sizes = teacher_cache.query_tokens(processor, family, kind, queries)  # every query's tokens, no image loaded
        figures["cache"] = plan_cache(args, model.config, sizes, dtype, 2 * params * mean(rows["teacher"].values()))
        print(f"peak memory, training: ~{size(mem['train'])} (weights {size(mem['weights'])} + max(teacher "
              f"{size(mem['teacher'])}, student {size(mem['student'])}; vision in them {size(mem['vision'])}) + "
              f"adapter {size(mem['adapter'])}" + (f" + runtime {size(mem['runtime'])}" if on_cpu else "") + ")")
    print(f"peak memory, evaluation at batch {batch}: ~{size(mem['eval_adapter'])} with the adapter or "
          f"zero-shot, ~{size(mem['eval_icl'])} for {shots}-shot ICL")
    figures["shard"] = shard_plan.plan(args, at, model, batch, training)  # --shard: a GPU of N's
    print(MEMORY_ASSUMPTIONS.format(dtype=str(dtype).split(".")[-1], file=str(file_dtype).split(".")[-1],
                                    budget=size(args.image_memory * 1e9)))
    figures["times"] = plan_times(args, model, rows, batch, shots if training else args.shots or 0, len(queries),
                                  training, processor, family, kind, sample, icds)
    return figures


def plan_times(args, model, rows, batch, shots, n, training, processor, family, kind, sample, icds):
    """Print (and --plan-json) the run's time on --accelerator, bound and expected (roofline): one query's time to
    the first token and per generated token at batch 1 and at the run's batch (an evaluation's prompt; a training's
    teacher row), and the run's hours by phase. Rows: the sample's, as collated (each batch's image canvas); shots:
    the run's (an evaluation's 0: zero-shot or an adapter, its student rows)."""
    acc, f, new = roofline.accelerator(args.accelerator, args.plan), flops.flop_model(model), \
        tasks.spec(args.task).max_new_tokens
    patch = flops.sides(model.config.vision_config.patch_size)
    name = "teacher" if shots else "student"
    patches = lambda s: s["patches"] or (s["pixels"][0] // patch[0]) * (s["pixels"][1] // patch[1])
    one = plan_rows(processor, family, kind, sample[:1], icds[:1], 1)  # a query alone: its own image canvas
    mean = lambda values: sum(values) / len(values)
    at = {1: (max(one[name].values()), patches(one["images"][name][0])),
          batch: (mean(rows[name].values()), max(map(patches, rows["images"][name])))}
    images, records = shots + 1, []
    print(roofline.stated(acc))
    for b, (prompt, p) in at.items():
        query = roofline.query_times(acc, f, b, prompt, images, p, new)
        if training:
            micro = runs.epoch_steps(n, b, 1) * args.epochs
            times = roofline.train_times(acc, f, b, micro, n, prompt, mean(rows["student"].values()),
                                         args.epochs * args.n_heldout, shots, p, mean(rows["answers"].values()))
        else:
            times = roofline.eval_times(acc, f, b, n, prompt, images, p, new)
        hours = sum(times.values(), roofline.ZERO) * (1 / 3600)
        print(f"one query, bound / expected: {roofline.query_line(query, b)}; the run at batch {b}: "
              + ", ".join(f"{k} {t.bound / 3600:.3g} / {t.expected / 3600:.3g} h" for k, t in times.items()))
        records.append(roofline.run_record("train.py" if training else "evaluate.py", args.task,
                                           getattr(args, "method", None), shots, b, query, hours))
    if args.plan_json:
        roofline.write_json(args.plan_json, acc, records, hours * 3600)  # the run's, at its own batch (last)
    return records


def plan_cache(args, config, sizes, dtype, teacher_flops=None):
    """Print and return the planned teacher cache of the run's queries (sizes: their query_sizes), against the free
    space of --teacher-cache (or of the nearest folder above it that exists); and, given the FLOPs of one query's
    teacher forward, whether reading a query's file back costs less than recomputing its teacher (read_or_recompute)."""
    n_queries = len(sizes)
    if registry.ANCHORS[args.anchor].teacher is None:
        print(f"teacher cache: none (--anchor none: {args.method} trains without a teacher)")
        return 0
    per_query = teacher_cache.cache_bytes(config, sizes, dtype)  # both tensors: every method's run reads this pass
    total = per_query * n_queries
    folder = args.teacher_cache
    while not os.path.isdir(folder):
        folder = os.path.dirname(os.path.abspath(folder))
    writable = os.access(folder, os.W_OK | os.X_OK)
    versus = read_or_recompute(folder, per_query, teacher_flops) if teacher_flops and writable else None
    if args.no_teacher_cache:
        print(f"teacher cache: none (--no-teacher-cache: {args.epochs * n_queries} teacher forwards instead of "
              f"{n_queries}; it would take {size(total)})")
    else:
        free, text = shutil.disk_usage(folder).free, config.get_text_config()
        tensor = f"states {text.num_hidden_layers} layers x T_q x {text.hidden_size} in {str(dtype).split('.')[-1]}" \
            " and logits answer tokens x vocabulary in float32, one pass's for every distilling method"
        print(f"teacher cache: {size(total)} for {n_queries} queries ({size(per_query)} each: {tensor}; "
              f"{size(per_query * 1000)} per 1,000) in {args.teacher_cache}; "
              f"{size(free)} free there"
              + ("" if total <= free else " -- it does NOT fit: give --teacher-cache DIR or --no-teacher-cache")
              + ("" if writable else f" -- {folder} is NOT writable: give --teacher-cache DIR"))
    if versus:
        print(versus)
    return total


ACCELERATOR_TFLOPS = 400  # what an H200 sustains in bf16 on these forwards (an estimate; its dense peak is ~990)


def read_or_recompute(folder, per_query, teacher_flops, probe=64 << 20):
    """The plan's line on which costs less a query in later epochs: reading its cached teacher tensor back
    (per_query bytes at the speed this folder's disk reads a file that is not in memory: a probe file written,
    flushed, dropped from the page cache and read once) or recomputing its teacher forward (teacher_flops, about 2 x
    parameters x teacher-row tokens, at ACCELERATOR_TFLOPS)."""
    path = files.tmp_name(os.path.join(folder, "read-probe"))
    try:
        files.atomic_write(path, lambda f: f.write(os.urandom(probe)))
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # Linux: the clean pages leave the page cache
            start = time.perf_counter()
            while f.read(8 << 20):
                pass
            speed = probe / (time.perf_counter() - start)
    finally:
        if os.path.exists(path):
            os.remove(path)
    read, compute = per_query / speed, teacher_flops / (ACCELERATOR_TFLOPS * 1e12)
    return (f"teacher cache or recomputing, a query: reading its file back ~{read * 1e3:.3g} ms ({folder} reads "
            f"{speed / 1e6:.0f} MB/s, measured), recomputing its teacher ~{compute * 1e3:.3g} ms "
            f"({teacher_flops / 1e12:.3g} TFLOP at ~{ACCELERATOR_TFLOPS} TFLOP/s, an H200's estimate): "
            + ("reading is cheaper" if read <= compute else "recomputing is cheaper here (--no-teacher-cache), unless "
               "the accelerator is slower than that"))
