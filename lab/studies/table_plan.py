"""The cost of a table before it runs (evaluate.py --table N --plan [cuda]): each job's work counted once (teacher
passes, training steps, held-out forwards, evaluation items, prompt and generated tokens, the training vectors'
forwards), backbone loads, peak memory per cell (plan.memory), disk, and the time on an H200 from the FLOPs of that
work (forward_flops) at plan.ACCELERATOR_TFLOPS, in total and per --gpus. No weights are read: the processor and a
meta-device model (plan.plan_backbone), the data's files and one image for the tokens an image stands for.

Time model (stated in the output): a forward over T tokens costs 2 x (decoder parameters) x T for the linear layers,
4 x layers x heads x head size x T^2 for attention (as torch's FLOP counter counts SDPA, unmasked), 2 x width x
vocabulary at each position whose logits are computed, and per image 2 x (vision tower and connector parameters) x
patches + 4 x vision layers x width x patches^2; a training step's student is a forward and a backward of about the
same cost (the frozen backbone's weights get no gradient); generating a token is a forward of one token over the
cache. Checked against torch.utils.flop_counter on the tiny twins (tests/test_tables.py)."""
import math
import os

import torch

import data
import model as M
from lab.disk.files import size
from lab.datasets import tasks
from lab.models import families
from lab.run import runs, teacher_cache
from lab.studies import plan, vectors

ACCELERATOR = "an H200 (~989 TFLOP/s dense bf16) at ~40% of its peak"


def module_params(module, names):
    """Parameters of the children of `module` named in `names` (those it has)."""
    return sum(p.numel() for n, child in module.named_children() if n in names for p in child.parameters())


def flop_model(model):
    """What forward_flops needs of a model (meta device is enough): decoder-layer parameters, attention and vision
    sizes, the LM head's width x vocabulary."""
    text, inner = model.config.get_text_config(), model.model
    layers, heads, head_dim = M.attention_shape(model)
    decoder = model.get_decoder()
    vision = getattr(model.config, "vision_config", None)
    return {"decoder": module_params(decoder, ("layers", "gated_cross_attn_layers")), "layers": layers,
            "heads": heads, "attention": layers * heads * head_dim, "head": text.hidden_size * text.vocab_size,
            "vision": module_params(inner, ("vision_model", "vision_tower", "connector", "multi_modal_projector",
                                            "perceiver_resampler")),
            "vision_attention": vision.num_hidden_layers * vision.hidden_size,
            "patches": (vision.image_size // vision.patch_size) ** 2}


def forward_flops(f, tokens, images, logits=1):
    """FLOPs of one forward over `tokens` tokens holding `images` images, computing logits at `logits` positions
    (the time model in the module's docstring)."""
    image = 2 * f["vision"] * f["patches"] + 4 * f["vision_attention"] * f["patches"] ** 2
    return 2 * f["decoder"] * tokens + 4 * f["attention"] * tokens ** 2 + 2 * f["head"] * logits + images * image


def generate_flops(f, prompt, images, new):
    """FLOPs of answering one prompt: its forward, then `new` tokens, each a one-token forward over the cache."""
    return forward_flops(f, prompt, images) + sum(2 * f["decoder"] + 4 * f["attention"] * (prompt + k) + 2 * f["head"]
                                                  for k in range(new))


class Tokens:
    """Tokens of rows without loading their images: a piece's text by the tokenizer (its image placeholder one
    token) plus what an image adds beyond it (one query encoded in full: teacher_cache.query_tokens' count)."""

    def __init__(self, processor, family, kind, reference):
        self.processor, self.family, self.kind = processor, family, kind
        (whole, _), = teacher_cache.query_sizes(data.query_pieces(processor, family, kind, [reference]))
        self.image = whole - self.count(data.prompt_text(kind, reference) + self.answer(reference))
        tok = processor.tokenizer
        self.prefix = (tok.bos_token_id is not None) + self.count(data.PROMPTS[kind]["instruction"])

    def count(self, text):
        return len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])

    def answer(self, item):
        return data.answer_text(self.processor, self.family, self.kind, item.target)

    def row(self, query, icds, target):
        """Tokens of [instruction, ICDs, query (+ its target)]: data.encode's row."""
        shown = sum(self.count(data.prompt_text(self.kind, d) + self.answer(d) + data.SEPARATOR) + self.image
                    for d in icds)
        return self.prefix + shown + self.count(data.prompt_text(self.kind, query) + (self.answer(query) if target
                                                                                       else "")) + self.image


def train_work(cfg, family, f, computes_teacher, tokens_of):
    """One training job's work: steps, teacher passes (if it is the run that computes its teacher: the others read
    it), held-out forwards, tokens, FLOPs."""
    queries, heldout, support, shots = tasks.split_pool(cfg, family)
    icds = data.demonstrations([q.id for q in queries], support, shots, cfg.seed)
    tokens = tokens_of(cfg.task)
    student = [tokens.row(q, [], True) for q in queries]
    teacher = [tokens.row(q, d, True) for q, d in zip(queries, icds)] if computes_teacher else []
    steps = runs.epoch_steps(len(queries), cfg.batch_size, cfg.grad_accum) * cfg.epochs
    steps = min(steps, cfg.max_steps or steps)
    epochs = math.ceil(steps / runs.epoch_steps(len(queries), cfg.batch_size, cfg.grad_accum))
    flops = sum(forward_flops(f, t, shots + 1, 0) for t in teacher) + \
        epochs * sum(2 * forward_flops(f, t, 1, tokens.count(tokens.answer(q)) + 1) for t, q in zip(student, queries))
    flops += epochs * sum(forward_flops(f, tokens.row(q, [], True), 1) for q in heldout)
    return {"steps": steps, "teacher_passes": len(teacher), "teacher_tokens": sum(teacher),
            "heldout_forwards": epochs * len(heldout), "flops": flops, "queries": len(queries)}


def eval_work(eargs, family, f, tokens_of):
    """One evaluation job's work: items, prompt tokens (ICDs drawn as the evaluation draws random ones; RICES's as
    random ones), generated tokens at most, FLOPs (a task or function vector's extraction estimated: its ICL prompts
    as long as the first item's, the layer choice's and the indirect effects' forwards as many as vectors.py runs)."""
    items, tokens, new = tasks.eval_items(eargs), tokens_of(eargs.task), tasks.spec(eargs.task).max_new_tokens
    icds = data.demonstrations([it.id for it in items], tasks.icd_support(eargs), eargs.shots, eargs.seed) \
        if eargs.shots else [[] for _ in items]
    prompts = [tokens.row(it, d, False) for it, d in zip(items, icds)]
    flops = sum(generate_flops(f, t, len(d) + 1, new) for t, d in zip(prompts, icds))
    if eargs.vector:
        shots = data.default_shots(tasks.spec(eargs.task), family)
        icl = tokens.row(items[0], data.demonstrations([items[0].id], tasks.icd_support(eargs), shots, 0)[0], True)
        forwards = eargs.vector_sets + (eargs.fv_trials * (f["layers"] * f["heads"] + 1) if eargs.vector == "fv"
                                        else 0)
        flops += forwards * forward_flops(f, icl, shots + 1) + eargs.vector_heldout * f["layers"] * \
            forward_flops(f, tokens.row(items[0], [], True), 1)
    return {"items": len(items), "prompt_tokens": sum(prompts), "generated_at_most": new * len(items),
            "flops": flops}


def job_memory(args, model, processor, family, params, a, training, memo):
    """Peak accelerator memory of a job (plan.memory on a sample of its rows: training, or evaluation with the
    adapter or zero-shot, or n-shot ICL), one estimate per (task, shots, method)."""
    shots = a.shots or 0
    key = (a.task, shots, getattr(a, "method", None) if training else bool(shots))
    if key not in memo:
        queries = tasks.eval_items(a)[:plan.PLAN_SAMPLE] if not training else \
            tasks.split_pool(a, family)[0][:plan.PLAN_SAMPLE]
        support = tasks.icd_support(a) if not training else tasks.split_pool(a, family)[2]
        n = shots or data.default_shots(tasks.spec(a.task), family)
        icds = data.demonstrations([q.id for q in queries], support, n, a.seed)
        batch = min(a.batch_size, len(queries))
        rows = plan.plan_rows(processor, family, tasks.spec(a.task).kind, queries, icds, batch)
        adapter = sum(p.numel() for p in M.attach(model, a.method, **runs.method_sizes(a)).parameters()) \
            if training else 0
        if training:
            M.detach(model)
        dtype = plan.backbones.autocast_dtype(args.plan)
        mem = plan.memory(model.config, params, adapter, rows, batch, dtype, tasks.spec(a.task).max_new_tokens,
                          args.plan == "cpu", dtype, args.image_memory * 1e9)
        memo[key] = mem["train"] if training else mem["eval_icl" if shots else "eval_adapter"]
    return memo[key]


def plan_table(args, table, jobs, parsers):
    """Print and return a table's plan: per job its work and peak memory, then the totals (jobs, backbone loads, the
    counts, disk, FLOPs) and the time on ACCELERATOR, in total and per --gpus (the slower of the work shared out
    and the longest chain of jobs that wait for each other)."""
    family = families.family_of(args.model)
    processor, model, images, source, _ = plan.plan_backbone(args.model, family, args.image_splitting,
                                                             args.processor)
    f, params = flop_model(model), sum(p.numel() for p in model.parameters())
    dtype, memo, seen, token_counters = plan.backbones.autocast_dtype(args.plan), {}, {}, {}

    def tokens_of(task):
        if task not in token_counters:
            reference = tasks.load_task(task, "val", args.data_root)[0]
            token_counters[task] = Tokens(processor, family, tasks.spec(task).kind, reference)
        return token_counters[task]

    print(f"plan of {table.name} for {args.model}: {len(jobs)} jobs; {source}" + (f"; {images}" if images else ""))
    total = {"teacher_passes": 0, "teacher_tokens": 0, "steps": 0, "heldout_forwards": 0, "items": 0,
             "prompt_tokens": 0, "generated_at_most": 0, "flops": 0, "teacher_cache_bytes": 0, "adapter_bytes": 0}
    hours = {}
    for job in jobs:
        training = job.script == "train.py"
        a = job.args(parsers)
        if training:
            owner = a.anchor != "none" and not job.after
            work = train_work(a, family, f, owner, tokens_of)
            if owner:
                queries = tasks.split_pool(a, family)[0]
                sizes = teacher_cache.query_tokens(processor, family, tasks.spec(a.task).kind, queries)
                work["teacher_cache_bytes"] = teacher_cache.cache_file_bytes(a.anchor, model.config, sizes, dtype) \
                    * len(queries)
            adapter = M.attach(model, a.method, **runs.method_sizes(a))
            work["adapter_bytes"] = 4 * sum(p.numel() for p in adapter.parameters())
            M.detach(model)
            mean = work["teacher_tokens"] / max(1, work["teacher_passes"])
            what = (f"{a.method} on {a.task}: {work['queries']:,} queries, {work['steps']:,} steps, teacher " +
                    (f"{work['teacher_passes']:,} passes ({mean:.0f} tokens a row)" if owner else
                     "read from the first run's cache" if a.anchor != "none" else "none"))
        else:
            work = eval_work(a, family, f, tokens_of)
            what = (f"{a.task} " + (f"adapter {os.path.relpath(a.checkpoint, args.out)}" if a.checkpoint else
                                    f"{a.vector or f'{a.shots or 0}-shot'}") +
                    f": {work['items']:,} items, {work['prompt_tokens']:,} prompt tokens, <= "
                    f"{work['generated_at_most']:,} generated")
        memory = job_memory(args, model, processor, family, params, a, training, memo)
        hours[job.argv] = work["flops"] / (plan.ACCELERATOR_TFLOPS * 1e12) / 3600
        seen[job.argv] = hours[job.argv] + max((seen[x] for x in job.after), default=0)
        for k in total:
            total[k] += work.get(k, 0)
        print(f"  {job.script} {what}; peak ~{size(memory)}; {work['flops']:.3g} FLOPs = {hours[job.argv]:.3g} h")
    gpus = len(args.gpus.split(",")) if args.gpus else 1
    loads, gpu_hours = min(gpus, len(jobs)), sum(hours.values())
    wall = max(gpu_hours / gpus, max(seen.values(), default=0))
    total |= {"jobs": len(jobs), "backbone_loads": loads, "gpu_hours": gpu_hours, "wall_hours": wall, "gpus": gpus}
    print(f"total: {len(jobs)} jobs, backbone loaded {loads} time(s) (once per process); teacher "
          f"{total['teacher_passes']:,} passes ({total['teacher_tokens']:,} tokens); {total['steps']:,} training steps, "
          f"{total['heldout_forwards']:,} held-out forwards; {total['items']:,} evaluation items, "
          f"{total['prompt_tokens']:,} prompt tokens, <= {total['generated_at_most']:,} generated")
    print(f"disk: teacher caches {size(total['teacher_cache_bytes'])}, adapters {size(total['adapter_bytes'])}")
    print(f"time: {total['flops']:.3g} FLOPs = {gpu_hours:.3g} GPU-hours on {ACCELERATOR} "
          f"({plan.ACCELERATOR_TFLOPS} TFLOP/s); on {gpus} GPU(s) ~{wall:.3g} h (the work shared out, or the longest "
          "chain of jobs waiting for each other); time model: lab/studies/table_plan.py")
    return total
