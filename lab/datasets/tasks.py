"""Tasks by name: which reader reads them, the benchmarks' pool splits, stratified subsets, a training run's
queries, held-out queries and ICD pool, an evaluation's items."""
import argparse
import hashlib
import math
import os
import random
from dataclasses import replace

import data
from lab.datasets import mme_seed, own_task, parquet, readers, toy_world


def spec(task):
    """The data.Task of a task: a benchmark's, or a task of one's own (a path: own_task.task_of)."""
    if own_task.is_own(task):
        return own_task.task_of(task)
    if task not in data.TASKS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(data.TASKS)}, or give a .jsonl file, a "
                         "folder of train.jsonl and val.jsonl, or a LLaVA .json (README, \"Your own data\")")
    return data.TASKS[task]


def default_shots(task, family):
    """data.default_shots of a task by name."""
    return data.default_shots(spec(task), family)


def file_name(task):
    """The task as run folders and result files name it: a benchmark's name, or a task of one's own's name
    (own_task.name_of) and a short hash of its real path, so two tasks named data.jsonl, or my/vqav2.jsonl and the
    benchmark vqav2, never share a run folder."""
    if not own_task.is_own(task):
        return task
    return f"{own_task.name_of(task)}-{hashlib.sha256(task_id(task).encode()).hexdigest()[:8]}"


def task_id(task):
    """What a task is to a run's record: a benchmark's name, or the real path of a task of one's own (however it was
    written: data.jsonl, ./data.jsonl, a link to it)."""
    return os.path.realpath(task) if own_task.is_own(task) else task


def pool_ids(task):
    """The ids of a task of one's own in one file's training pool (pool_split), which its evaluation half must not
    hold; None for every other task (their training and evaluation items are separate files)."""
    if not own_task.is_own(task) or None not in own_task.read(task)[1]:
        return None
    return [it.id for it in pool_split(own_task.read(task)[1][None], OWN_POOL_FRACTION)[0]]


def task_arg(value):
    """argparse's type of --task: a benchmark's name or a task of one's own (checked when it is read)."""
    if value not in data.TASKS and not own_task.is_own(value):
        raise argparse.ArgumentTypeError(f"{value!r} is neither a task ({', '.join(data.TASKS)}) nor a .jsonl / "
                                         ".json file or a folder")
    return value


def load_task(task, split, data_root=None):
    """The items of one split ("train" or "val") of a task; the toy-icl tasks are generated on first use. MME and
    SEED-Bench have no training split: "train" is their training pool, "val" the evaluation part (pool_split), and
    the sizes of both are printed; so has a task of one's own in one file (a folder's: its train.jsonl, val.jsonl and
    test.jsonl)."""
    if own_task.is_own(task):
        return own_items(task, split)
    spec(task)
    if data_root is not None and os.path.exists(data_root) and not os.path.isdir(data_root):
        raise NotADirectoryError(f"--data-root {data_root} is a file; it must be the folder of the datasets")
    if split not in data.SPLITS and not (split == "test" and task in readers.KARPATHY_IDS):  # Karpathy's test
        raise ValueError(f"unknown split {split!r}; choose from {', '.join(data.SPLITS)}")
    if task.startswith("toy-icl-"):
        return readers.read_vqa(toy_world.toy_icl_root(task.removeprefix("toy-icl-"), data_root), split, "vqav2")
    if data_root is None:
        raise ValueError(f"task {task!r} reads its files from --data-root (layout: docs/real-models.md)")
    items = parquet.hub_items(data_root, task, split)  # None: the original layout (the hub's: lab/datasets/parquet.py)
    if spec(task).kind not in ("yes-no", "choice"):
        return items if items is not None else \
            (readers.read_vqa if spec(task).kind == "vqa" else readers.read_karpathy)(data_root, split, task)
    items = items if items is not None else BENCHMARK_READERS[task](data_root)
    return pooled(task, items, pool_fraction(task, items), split)


def pooled(task, items, fraction, split):
    """The training pool ("train") or evaluation part ("val") of items (pool_split), both sizes printed."""
    pool, rest = pool_split(items, fraction)
    count = lambda part: f"{len(part)} questions on {len(set(real_images(part)))} images"
    print(f"{task}: {count(items)}; seeded split by image: training pool {count(pool)}, evaluation {count(rest)}")
    by_category = images_by_category(items, real_images(items))
    if split == "train" and not pool and len(by_category) == 1:  # too few images, however many questions
        n = len(by_category.popitem()[1])
        least = next(k for k in range(1, 100) if round(fraction * k))
        raise ValueError(f"{task}: the training pool is empty: its {len(items)} question(s) are on {n} image(s), and "
                         f"the split is by image (every question of an image on one side), round({fraction} x {n}) "
                         f"= 0 to train on; give questions on at least {least} images (a task of one's own: or a "
                         "folder of train.jsonl and val.jsonl)")
    if split == "train" and not pool:  # each category's share rounds to no image
        raise ValueError(f"{task}: the training pool is empty: the images are split category by category (field "
                         f"`category`), round({fraction} x images) of each, and each of its {len(by_category)} "
                         f"categories has {max(map(len, by_category.values()))} image(s) at most; give fewer "
                         "categories (one a subtask, not one a record)")
    return pool if split == "train" else rest


def own_items(task, split):
    """A split of a task of one's own: a folder's file of that split, or of a single file its training pool or
    evaluation part (pool_split, OWN_POOL_FRACTION)."""
    _, parts = own_task.read(task)
    if None in parts:
        if split not in data.SPLITS:
            raise ValueError(f"--task {task}: a single file splits into train and val only (a folder may hold "
                             "test.jsonl)")
        return pooled(file_name(task), parts[None], OWN_POOL_FRACTION, split)
    if split not in parts:
        raise FileNotFoundError(f"--task {task}: no {own_task.FOLDER_FILES[split]} in the folder for --split {split}")
    return list(parts[split])  # a copy: own_task.read's lists are cached


BENCHMARK_READERS = {"mme": mme_seed.read_mme, "seed": mme_seed.read_seed, "seed2": mme_seed.read_seed2}

# A benchmark's training pool holds the images of POOL_QUESTIONS questions, the paper's 1,000 training queries and
# train.py's 32 held out, and every other question is evaluated (MME: 1,340 of its 2,374); a benchmark too small for
# them keeps POOL_FRACTION of each subtask's (dimension's) images to evaluate.
POOL_QUESTIONS = 1_032
POOL_FRACTION = {"mme": 0.5, "seed": 0.2, "seed2": 0.2}
OWN_POOL_FRACTION = 0.5  # a task of one's own in one file: half its images train, half evaluate

SPLIT_SEED = 0


def pool_fraction(task, items):
    """The share of each category's images in a benchmark's training pool (pool_split): POOL_QUESTIONS' share of its
    questions in thousandths, rounded up, and raised a thousandth at a time until the pool holds POOL_QUESTIONS
    questions (rounding per category may leave it a few short); at most POOL_FRACTION[task]."""
    most = POOL_FRACTION[task]
    fraction = min(most, math.ceil(1000 * POOL_QUESTIONS / max(1, len(items))) / 1000)
    while fraction < most and len(pool_split(items, fraction)[0]) < POOL_QUESTIONS:
        fraction = min(most, (round(1000 * fraction) + 1) / 1000)
    return fraction


def pool_split(items, fraction, seed=SPLIT_SEED):
    """(training pool, evaluation part) of a benchmark without a training split: a seeded split by image. The images
    of each category (an image's first question's) are shuffled with (seed, category) and the first
    round(fraction x count) go to the pool, so every question of an image lands on the same side and each
    subtask / dimension is split in the same proportion. An image is its real path (real_images). Item order is kept
    on both sides."""
    images, pool = real_images(items), set()
    for c, of_c in images_by_category(items, images).items():
        pool.update(random.Random(f"{seed}:{c}").sample(of_c, round(fraction * len(of_c))))
    return [it for it, im in zip(items, images) if im in pool], [it for it, im in zip(items, images) if im not in pool]


def real_images(items):
    """Each item's image as its real path: img/3.jpg, ./img/3.jpg and an absolute path to it are one image."""
    real = {}
    return [real.setdefault(it.image_path, os.path.realpath(it.image_path)) for it in items]


def images_by_category(items, images):
    """{category: its images}, in order of first appearance; an image's category is its first question's. images:
    real_images(items)."""
    category, by_category = {}, {}
    for it, image in zip(items, images):
        category.setdefault(image, it.category)
    for image, c in category.items():
        by_category.setdefault(c, []).append(image)
    return by_category


def largest_remainder(total, sizes):
    """Whole shares of `total` in proportion to sizes (Hamilton's method; ties go to the earlier size)."""
    exact = [total * k / sum(sizes) for k in sizes]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(sizes)), key=lambda i: shares[i] - exact[i])
    for i in by_remainder[:total - sum(shares)]:
        shares[i] += 1
    return shares


def stratified_subset(items, n, seed=0):
    """A seeded subset of about n questions of a benchmark, stratified by category, drawn by image (--n-eval). The
    m = round(n x images / questions) images (MME: n / 2) are shared among the categories (an image's first
    question's) in proportion to their images (largest remainders), and each category's images, in their order of
    first appearance (which the original layout and the hub's parquet copy share; not their paths), are drawn with
    (seed, category); every question of a drawn image is kept, so both questions of an MME image are, and its
    results file is one official calculation.py accepts. Item order is kept."""
    if n <= 0:
        raise ValueError(f"--n-eval must be at least 1, got {n}")
    if not items:
        return items
    images = real_images(items)
    by_category = dict(sorted(images_by_category(items, images).items()))
    n_images = sum(len(of_c) for of_c in by_category.values())
    m = min(n_images, max(1, round(n * n_images / len(items))))
    shares = largest_remainder(m, [len(of_c) for of_c in by_category.values()])
    chosen = {image for (c, of_c), k in zip(by_category.items(), shares)
              for image in random.Random(f"n-eval:{seed}:{c}").sample(of_c, k)}
    return [it for it, im in zip(items, images) if im in chosen]


def split_pool(args, family):
    """Training queries, held-out queries (best epoch), the ICDs' support set (the training split less the held-out
    queries, which would reach the adapter through the teacher and bias the best epoch) and the shots."""
    pool = load_task(args.task, "train", args.data_root)
    shots = args.shots if args.shots is not None else data.default_shots(spec(args.task), family)
    check_pool_size(args, len(pool), shots)
    order = random.Random(args.seed).sample(range(len(pool)), len(pool))
    heldout = [pool[i] for i in order[:args.n_heldout]]
    train = [pool[i] for i in order[args.n_heldout:args.n_heldout + args.n_train]]
    if len(train) < args.n_train:
        print(f"note: {args.task} has {len(pool)} training items; using {len(train)} queries "
              f"(+{len(heldout)} held out)")
    held = {it.id for it in heldout}
    support = icd_support(args) if args.icd_task else [it for it in pool if it.id not in held]
    if args.icd_task and len(support) <= shots:
        raise ValueError(f"--icd-task {args.icd_task} has {len(support)} training items, too few for {shots} ICDs per "
                         f"query: --shots {max(0, len(support) - 1)} fits")
    return train, heldout, support, shots


def check_pool_size(args, n, shots):
    """Refuse, before any backbone loads, a training split of n items too small for --n-heldout held-out queries and
    a query to train on with `shots` ICDs per query drawn from the rest, never the query itself (where the ICDs come
    from this split: n >= n_heldout + shots + 1; else n >= n_heldout + 1). The error names flags that fit."""
    own_icds = not args.icd_task or args.icd_task == args.task
    need = args.n_heldout + (shots + 1 if own_icds else 1)
    if n >= need:
        return
    heldout = max(1, min(args.n_heldout, n // 5))
    fit = min(shots, n - heldout - 1) if own_icds else shots
    fits = n > heldout and (fit >= 1 or not own_icds)
    advice = f"--n-heldout {heldout}" + (f" --shots {fit}" if own_icds else "") + " fit" if fits else \
        "a task needs at least 3 training items (--n-heldout 1 --shots 1)"
    default = "" if args.shots is not None else " (the backbone's default --shots)"
    raise ValueError(f"{args.task} has {n} training items, too few for --n-heldout {args.n_heldout} and a query to "
                     f"train on" + (f" with {shots} ICDs{default} from the rest" if own_icds else "") +
                     f" (at least {need}): {advice}")


def icd_support(args):
    """The items a query's ICDs are drawn from: --task's training split, or --icd-task's (Table 8: demonstrations from
    another task), each of its ids then prefixed with that task's name ("vqav2:1000"), so that ids stay apart: no ICD
    is taken for the query it shares a number with, and no cache key or RICES row confuses the two."""
    if not args.icd_task or args.icd_task == args.task:
        return load_task(args.task, "train", args.data_root)
    return [replace(it, id=f"{args.icd_task}:{it.id}") for it in load_task(args.icd_task, "train", args.data_root)]


def check_icd_task(task, icd_task):
    """The reason --icd-task cannot give --task's queries their ICDs (None if it can): --task itself (its training
    split is where ICDs come from anyway, and as --icd-task it would hand a run its held-out queries as ICDs), or a task
    of another kind, or a file that is not there."""
    if icd_task and own_task.is_own(icd_task) and not os.path.exists(icd_task):
        return f"--icd-task {icd_task}: no such file or folder (a benchmark's name or a task of one's own, as --task)"
    if icd_task and task_id(icd_task) == task_id(task):
        return f"--icd-task {icd_task} is --task itself, whose training split the ICDs come from anyway; drop it"
    if icd_task and spec(icd_task).kind != spec(task).kind:
        return (f"--icd-task {icd_task} is a {spec(icd_task).kind} task and --task {task} a {spec(task).kind} one; "
                "their ICDs and queries must be of one kind")
    return None


def eval_items(args):
    """The items to evaluate: the split, or --n-eval of them (MME and SEED: a seeded subset drawn by image and
    stratified by subtask / dimension, stratified_subset; otherwise the first N, or with --eval-draw seeded N drawn
    with --seed, kept in the split's order). VQAv2's test-dev and test have no
    answers (lab/scores/submission.py)."""
    items = readers.read_test(args.data_root, args.split) if readers.server_split(args.task, args.split) else \
        load_task(args.task, args.split, args.data_root)
    if args.n_eval and spec(args.task).kind in ("yes-no", "choice"):
        return stratified_subset(items, args.n_eval, args.seed)
    if args.n_eval and args.eval_draw == "seeded" and args.n_eval < len(items):  # VQAv2's 10,000 (a table's)
        kept = set(random.Random(f"n-eval:{args.seed}").sample(range(len(items)), args.n_eval))
        return [it for k, it in enumerate(items) if k in kept]
    return items[:args.n_eval]
