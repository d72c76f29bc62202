"""The cost of a table before it runs (evaluate.py --table N --plan [cuda]): each job's work counted once (teacher
passes, training steps, held-out forwards, evaluation items, prompt and generated tokens, the training vectors'
forwards), backbone loads, peak memory per cell (run_plan.memory), disk, and the time on --accelerator (an H200 by
default) from the FLOPs and bytes of each forward at the run's batch size (roofline.py: a bound and an expected time),
by phase, in total and per --gpus. No weights are read: the processor and a meta-device model (run_plan.plan_backbone),
the data's files and one image for the tokens an image stands for. FLOPs and bytes: lab/studies/flops.py; time:
lab/studies/roofline.py."""
import math
import os

import torch

import data
import model as M
from lab.disk.files import size
from lab.datasets import tasks
from lab.models import families
from lab.methods import registry
from lab.run import runs, teacher_cache
from lab.studies import flops, roofline, run_plan, shard_plan

class Tokens:
    """Tokens of rows without loading their images: a piece's text by the tokenizer (its image placeholder one
    token) plus what an image adds beyond it (one query encoded in full: teacher_cache.query_tokens' count), and
    the vision tower's patches of that image: its crops (tiles) as the processor makes them, cut into patches of
    `patch` (the config's patch size), or where the processor flattens the patches (Qwen) the product of its grid
    (image_grid_thw: temporal x height x width patches)."""

    def __init__(self, processor, family, kind, reference, patch):
        self.processor, self.family, self.kind, self.counted = processor, family, kind, {}
        piece, = data.query_pieces(processor, family, kind, [reference])
        (whole, _), = teacher_cache.query_sizes([piece])
        self.image = whole - self.count(data.prompt_text(kind, reference) + self.answer(reference))
        crops, (height, width) = piece["images"]["pixel_values"], flops.sides(patch)
        crops = crops.reshape(-1, *crops.shape[-3:]) if torch.is_tensor(crops) else crops  # Idefics: one tensor
        self.patches = int(piece["images"]["image_grid_thw"].prod(-1).sum()) if "image_grid_thw" in piece["images"] \
            else sum((c.shape[-2] // height) * (c.shape[-1] // width) for c in crops)
        tok = processor.tokenizer
        self.prefix = (tok.bos_token_id is not None) + self.count(data.PROMPTS[kind]["instruction"])

    def count(self, text):
        """Tokens of a text (each text counted once: an ICD is shown to many queries)."""
        if text not in self.counted:
            self.counted[text] = len(self.processor.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self.counted[text]

    def answer(self, item):
        return data.answer_text(self.processor, self.family, self.kind, item.target)

    def row(self, query, icds, target):
        """Tokens of [instruction, ICDs, query (+ its target)]: data.encode's row."""
        shown = sum(self.count(data.prompt_text(self.kind, d) + self.answer(d) + data.SEPARATOR) + self.image
                    for d in icds)
        return self.prefix + shown + self.count(data.prompt_text(self.kind, query) + (self.answer(query) if target
                                                                                       else "")) + self.image


class Work:
    """What a plan reads once for all its jobs: each task's rows' tokens (Tokens), each training's queries and ICDs
    (tasks.split_pool), each evaluation's items and ICD pool, each method's adapter size, each kind of cell's peak
    memory (run_plan.memory)."""

    def __init__(self, args, family):
        self.args, self.family, self.memo = args, family, {}
        self.processor, self.model, self.images, self.source, _ = run_plan.plan_backbone(
            args.model, family, args.image_splitting, args.processor)
        self.f = flops.flop_model(self.model)
        self.dtype = run_plan.backbones.autocast_dtype(args.plan)
        self.acc = roofline.accelerator(args.accelerator, args.plan)
        self.shards = len(args.gpus.split(",")) if args.shard else 1  # --shard: the processes a job's work is over

    def once(self, key, make):
        if key not in self.memo:
            self.memo[key] = make()
        return self.memo[key]

    def tokens(self, task):
        return self.once(("tokens", task), lambda: Tokens(self.processor, self.family, tasks.spec(task).kind,
                                                          tasks.load_task(task, "val", self.args.data_root)[0],
                                                          self.model.config.vision_config.patch_size))

    def split(self, cfg):
        """(queries, held-out queries, ICD pool, shots) of a training, and each query's ICDs."""
        def make():
            queries, heldout, support, shots = tasks.split_pool(cfg, self.family)
            return queries, heldout, support, shots, data.demonstrations([q.id for q in queries], support, shots,
                                                                         cfg.seed)
        return self.once(("split", cfg.task, cfg.icd_task, cfg.seed, cfg.n_train, cfg.n_heldout, cfg.shots), make)

    def items(self, a):
        """An evaluation's items and the pool its ICDs are drawn from."""
        return self.once(("items", a.task, a.split, a.n_eval, a.eval_draw, a.seed, a.icd_task),
                         lambda: (tasks.eval_items(a), tasks.icd_support(a)))

    def adapter(self, cfg):
        """Parameters of cfg's adapter (attached to the meta-device model, then detached)."""
        sizes = registry.sizes(cfg.method, cfg.rank, cfg.virtual_tokens)

        def make():
            count = sum(p.numel() for p in registry.attach(self.model, cfg.method, **sizes).parameters())
            M.detach(self.model)
            return count
        return self.once(("adapter", cfg.method, tuple(sizes.items())), make)

    def memory(self, a, training):
        """Peak accelerator memory of a job: run_plan.memory on a sample of its rows (training, evaluation zero-shot or
        with the adapter, n-shot ICL), once per task, shots and method: a GPU's of self.shards (shard_plan.per_gpu;
        one GPU without --shard)."""
        shots = a.shots or 0

        def encoded():  # the sampled rows of the task and shots, encoded once for every method
            queries, support = (self.split(a)[0], self.split(a)[2]) if training else self.items(a)
            sample = queries[:run_plan.PLAN_SAMPLE]
            icds = data.demonstrations([q.id for q in sample], support, shots or
                                       tasks.default_shots(a.task, self.family), a.seed)
            batch = min(a.batch_size, len(sample))
            return run_plan.plan_rows(self.processor, self.family, tasks.spec(a.task).kind, sample, icds, batch), batch

        def make():
            rows, batch = self.once(("rows", a.task, shots, training, a.batch_size), encoded)
            at = lambda params, batch: run_plan.memory(
                self.model.config, params, self.adapter(a) if training else 0, rows, batch, self.dtype,
                tasks.spec(a.task).max_new_tokens, self.args.plan == "cpu", self.dtype, self.args.image_memory * 1e9)
            mem = shard_plan.per_gpu(at, self.model, self.shards, batch)
            return mem["train"] if training else mem["eval_icl" if shots else "eval_adapter"]
        return self.once(("memory", a.task, shots, getattr(a, "method", None) if training else bool(shots)), make)


def train_work(cfg, w, computes_teacher):
    """One training job's work: steps, teacher passes (if it is the run that computes its teacher: the others read
    it) and their tokens, held-out forwards, FLOPs, the teacher cache's and the adapter's bytes."""
    queries, heldout, _, shots, icds = w.split(cfg)
    tokens, f = w.tokens(cfg.task), w.f
    student = [tokens.row(q, [], True) for q in queries]
    teacher = [tokens.row(q, d, True) for q, d in zip(queries, icds)] if computes_teacher else []
    per_epoch = runs.epoch_steps(len(queries), cfg.batch_size, cfg.grad_accum)
    steps = min(per_epoch * cfg.epochs, cfg.max_steps or per_epoch * cfg.epochs)
    epochs = math.ceil(steps / per_epoch)
    p = tokens.patches
    count = sum(flops.forward_flops(f, t, shots + 1, 0, p) for t in teacher) + epochs * sum(
        2 * flops.forward_flops(f, t, 1, tokens.count(tokens.answer(q)) + 1, p) for t, q in zip(student, queries))
    count += epochs * sum(flops.forward_flops(f, tokens.row(q, [], True), 1, 1, p) for q in heldout)
    cache = teacher_cache.cache_bytes(w.model.config, teacher_cache.query_tokens(  # states and logits, one pass
        w.processor, w.family, tasks.spec(cfg.task).kind, queries), w.dtype) * len(queries) if teacher else 0
    mean = lambda rows: sum(rows) / max(1, len(rows))
    micro = min(steps * cfg.grad_accum, epochs * math.ceil(len(queries) / cfg.batch_size))
    answer = mean([tokens.count(tokens.answer(q)) for q in queries])
    times = roofline.train_times(w.acc, f, cfg.batch_size, micro, len(queries), mean(teacher), mean(student),
                                 epochs * len(heldout), shots, p, round(answer))
    return {"steps": steps, "teacher_passes": len(teacher), "teacher_tokens": sum(teacher), "times": times,
            "heldout_forwards": epochs * len(heldout), "flops": count, "queries": len(queries),
            "teacher_cache_bytes": cache, "adapter_bytes": 4 * w.adapter(cfg)}


def eval_work(a, w):
    """One evaluation job's work: items, prompt tokens (ICDs drawn as the evaluation draws random ones; RICES's as
    random ones), generated tokens at most, FLOPs (a task or function vector's extraction estimated: its ICL prompts
    as long as the first item's, the layer choice's and the indirect effects' forwards as many as vectors.py runs)."""
    (items, support), tokens, new, f = w.items(a), w.tokens(a.task), tasks.spec(a.task).max_new_tokens, w.f
    icds = data.demonstrations([it.id for it in items], support, a.shots, a.seed) if a.shots else [[] for _ in items]
    prompts = [tokens.row(it, d, False) for it, d in zip(items, icds)]
    count = sum(flops.generate_flops(f, t, len(d) + 1, new, tokens.patches) for t, d in zip(prompts, icds))
    prompt, images = sum(prompts) / len(prompts), (a.shots or 0) + 1
    times = lambda batch: roofline.eval_times(w.acc, f, batch, len(items), prompt, images, tokens.patches, new)
    queries = {b: roofline.query_times(w.acc, f, b, prompt, images, tokens.patches, new)
               for b in sorted({1, a.batch_size})}
    if a.vector:
        shots = tasks.default_shots(a.task, w.family)
        icl = tokens.row(items[0], data.demonstrations([items[0].id], support, shots, 0)[0], True)
        forwards = a.vector_sets + (a.fv_trials * (f["layers"] * f["heads"] + 1) if a.vector == "fv" else 0)
        count += forwards * flops.forward_flops(f, icl, shots + 1, 1, tokens.patches) + a.vector_heldout * \
            f["layers"] * flops.forward_flops(f, tokens.row(items[0], [], True), 1, 1, tokens.patches)
        extraction = roofline.prefill(w.acc, f, 1, icl, shots + 1, tokens.patches) * forwards + roofline.prefill(
            w.acc, f, 1, tokens.row(items[0], [], True), 1, tokens.patches) * (a.vector_heldout * f["layers"])
        times = lambda batch, plain=times: plain(batch) | {"prefill": plain(batch)["prefill"] + extraction}
    return {"items": len(items), "prompt_tokens": sum(prompts), "generated_at_most": new * len(items),
            "flops": count, "times": times(a.batch_size), "at_batch": {b: times(b) for b in queries},
            "queries": queries}


STUDY_PASSES = {"hyperbolicity": (1, 1), "gates": (1, 2)}  # a query's forwards of an analysis: (teacher, student)


def study_work(a, w, study):
    """One study job's work (Tables 6, 9, 10), forwards alone, none generating: an analysis's per query, the
    teacher's [ICDs; query] and the student's [query] (the gates: the student twice, gated and with eager
    attention), at --batch-size; the benchmark's one query per setting (zero-shot, the adapter, --bench-shots ICL),
    each counted once and timed 2 x --rounds times to its first token (its decoding steps left out)."""
    (items, support), tokens, f = w.items(a), w.tokens(a.task), w.f
    shots = a.shots or tasks.default_shots(a.task, w.family)
    if study == "benchmark":
        ids, batch = [items[0].id], 1
        rows = [(tokens.row(items[0], [], False), 1, 2 * (1 + 2 * a.rounds))] + [
            (tokens.row(items[0], data.demonstrations(ids, support, s, a.seed)[0], False), s + 1, 1 + 2 * a.rounds)
            for s in a.bench_shots]
    else:
        teacher, student, batch = *STUDY_PASSES[study], min(a.batch_size, len(items))
        icds = data.demonstrations([it.id for it in items], support, shots, a.seed)
        rows = [(tokens.row(it, d, False), shots + 1, teacher) for it, d in zip(items, icds)] + \
            [(tokens.row(it, [], False), 1, student) for it in items]
    count = sum(n * flops.forward_flops(f, t, images, 1, tokens.patches) for t, images, n in rows)
    time = sum((roofline.prefill(w.acc, f, batch, t, images, tokens.patches) * (n / batch) for t, images, n in rows),
               roofline.ZERO)
    return {"items": 1 if study == "benchmark" else len(items), "prompt_tokens": sum(n * t for t, _, n in rows),
            "generated_at_most": 0,
            "flops": count, "times": {"prefill": time}}


def plan_table(args, table, jobs, parsers):
    """Print and return a table's plan: per job its work, peak memory and time (bound / expected: roofline), an
    evaluation's query at batch 1 and at its batch, then the totals (jobs, backbone loads, the counts, disk, FLOPs)
    and the time by phase, in total and per --gpus (the slower of the work shared out and the longest chain of jobs
    that wait for each other); --plan-json the same times. parsers: train.py's and evaluate.py's parse_args."""
    w = Work(args, families.family_of(args.model))
    print(f"plan of {table.name} for {args.model}: {len(jobs)} jobs; {w.source}" + (f"; {w.images}" if w.images
                                                                                      else ""))
    total = dict.fromkeys(("teacher_passes", "teacher_tokens", "steps", "heldout_forwards", "items", "prompt_tokens",
                           "generated_at_most", "flops", "teacher_cache_bytes", "adapter_bytes"), 0)
    hours, chain, records = {}, {}, []
    phases = dict.fromkeys(("teacher", "training", "prefill", "decoding"), roofline.ZERO)
    for job in jobs:
        a, training = job.args(parsers), job.script == "train.py"
        if training:
            owner = registry.ANCHORS[a.anchor].teacher is not None and not job.after
            work = train_work(a, w, owner)
            mean = work["teacher_tokens"] / max(1, work["teacher_passes"])
            what = (f"{a.method} on {a.task}: {work['queries']:,} queries, {work['steps']:,} steps, teacher " +
                    (f"{work['teacher_passes']:,} passes ({mean:.0f} tokens a row)" if owner else
                     "read from the first run's cache" if registry.ANCHORS[a.anchor].teacher else "none"))
        elif job.script != "evaluate.py":
            work = study_work(a, w, job.script)
            what = (f"{a.task} adapter {os.path.relpath(a.checkpoint, args.out)}: {work['items']:,} queries, "
                    f"{work['prompt_tokens']:,} tokens in its forwards, none generated")
        else:
            work = eval_work(a, w)
            icl = f"{a.shots or 0}-shot" + ("-rices" if a.shots and a.icds == "rices" else "")
            what = (f"{a.task} " + (f"adapter {os.path.relpath(a.checkpoint, args.out)}" if a.checkpoint else
                                    a.vector or icl) +
                    f": {work['items']:,} items, {work['prompt_tokens']:,} prompt tokens, <= "
                    f"{work['generated_at_most']:,} generated")
        hours[job.argv] = sum(work["times"].values(), roofline.ZERO) * (1 / 3600)
        chain[job.argv] = hours[job.argv] + max((chain[x] for x in job.after), default=roofline.ZERO,
                                                key=lambda t: t.expected)
        for k in total:
            total[k] += work.get(k, 0)
        for k, t in work["times"].items():
            phases[k] += t
        method = getattr(a, "method", None) if training else (a.vector or ("adapter" if a.checkpoint else "icl"))
        print(f"  {job.script} {what}; peak ~{size(w.memory(a, training))}; {work['flops']:.3g} FLOPs = "
              f"{hours[job.argv].bound:.3g} / {hours[job.argv].expected:.3g} h")
        if training:
            records.append(roofline.run_record(job.script, a.task, method, a.shots, a.batch_size, None,
                                               hours[job.argv]))
        for b, query in ({} if training else work.get("queries", {})).items():
            print(f"    one query, bound / expected: {roofline.query_line(query, b)}")
            at = sum(work["at_batch"][b].values(), roofline.ZERO) * (1 / 3600)
            records.append(roofline.run_record(job.script, a.task, method, a.shots or 0, b, query, at))
    gpus = len(args.gpus.split(",")) if args.gpus else 1
    loads, gpu_hours = min(gpus, len(jobs)), sum(hours.values(), roofline.ZERO)
    longest = max(chain.values(), default=roofline.ZERO, key=lambda t: t.expected)
    if args.shard:  # each job over all the GPUs, one after another: a load per job, no chain longer than the sum
        loads, longest = len(jobs), roofline.ZERO
        print(f"--shard: each cell's job runs over {gpus} GPUs at once, one job after another; the peaks above are a "
              f"GPU's of {gpus}")
    wall = roofline.Time(max(gpu_hours.bound / gpus, longest.bound), max(gpu_hours.expected / gpus, longest.expected))
    total |= {"jobs": len(jobs), "backbone_loads": loads, "gpu_hours": gpu_hours.expected, "wall_hours":
              wall.expected, "bound_hours": gpu_hours.bound, "gpus": gpus, "runs": records,
              "phases": {k: t * (1 / 3600) for k, t in phases.items()}}
    print(f"total: {len(jobs)} jobs, backbone loaded {loads} time(s) (once per process{', sharded' * args.shard});"
          " teacher "
          f"{total['teacher_passes']:,} passes ({total['teacher_tokens']:,} tokens); {total['steps']:,} training "
          f"steps, {total['heldout_forwards']:,} held-out forwards; {total['items']:,} evaluation items, "
          f"{total['prompt_tokens']:,} prompt tokens, <= {total['generated_at_most']:,} generated")
    print(f"disk: teacher caches {size(total['teacher_cache_bytes'])}, adapters {size(total['adapter_bytes'])}")
    print(roofline.stated(w.acc))
    print("time by phase, bound / expected GPU-hours: " + ", ".join(
        f"{k} {t.bound / 3600:.3g} / {t.expected / 3600:.3g}" for k, t in phases.items()))
    print(f"time: {total['flops']:.3g} FLOPs = {gpu_hours.bound:.3g} / {gpu_hours.expected:.3g} GPU-hours (bound / "
          f"expected) on {w.acc.name}; on {gpus} GPU(s) {wall.bound:.3g} / {wall.expected:.3g} h (the work shared "
          "out, or the longest chain of jobs waiting for each other); time model: lab/studies/table_plan.py")
    if args.plan_json:
        roofline.write_json(args.plan_json, w.acc, records, gpu_hours * 3600)
    return total
