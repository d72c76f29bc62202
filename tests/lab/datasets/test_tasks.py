"""Tasks (lab/datasets/tasks.py): names and splits, the seeded split by image, stratified subsets, the benchmarks of
tools/benchmarks.py written in the official formats and read back, an empty split."""
import os

import pytest
from PIL import Image
from hypothesis import given
from hypothesis import strategies as st

import benchmarks
import data as D
from data import Item
from helpers import ANNOTATION, lab_evaluate, lab_train, lab_train_args, QUESTION, run_flags, vqa_files
from lab.datasets import mme_seed, readers, tasks


def image(path, fmt="JPEG"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(path, fmt)


@pytest.mark.parametrize("task", ["mme", "seed"])
def test_split_by_image(task, capsys):
    pool, rest = tasks.load_task(task, "train", benchmarks.ROOT), tasks.load_task(task, "val", benchmarks.ROOT)
    assert "training pool" in capsys.readouterr().out
    everything = mme_seed.read_mme(benchmarks.ROOT) if task == "mme" else mme_seed.read_seed(benchmarks.ROOT)
    assert sorted(it.id for it in pool + rest) == sorted(it.id for it in everything)
    assert not {it.image_path for it in pool} & {it.image_path for it in rest}  # no image on both sides
    fraction = tasks.pool_fraction(task, everything)
    assert fraction == tasks.POOL_FRACTION[task]  # too small for the paper's 1,000 queries: its share
    assert [it.id for it in pool] == [it.id for it in tasks.pool_split(everything, fraction)[0]]
    for category in {it.category for it in everything if it.category != "Instance Location"}:
        share = sum(it.category == category for it in pool) / sum(it.category == category for it in everything)
        assert fraction / 2 < share < 1.5 * fraction, category
    if task == "mme":  # MME: both questions of every image on the same side
        assert all(len([it for it in pool if it.image_path == p]) == 2 for p in {it.image_path for it in pool})


@given(st.lists(st.tuples(st.integers(0, 30), st.sampled_from("abc")), min_size=1, max_size=80),
       st.sampled_from([0.0, 0.2, 0.5, 1.0]), st.integers(0, 3))
def test_pool_split_properties(questions, fraction, seed):
    """Any items: the two parts partition them in order, share no image, and each category's pool holds
    round(fraction x its images) images (an image counts for the category of its first question)."""
    items = [D.Item(i, f"{image}.jpg", "q", ("Yes",), "Yes", c) for i, (image, c) in enumerate(questions)]
    pool, rest = tasks.pool_split(items, fraction, seed)
    assert sorted(pool + rest, key=lambda it: it.id) == items and pool == sorted(pool, key=lambda it: it.id)
    assert not {it.image_path for it in pool} & {it.image_path for it in rest}
    first = {}
    for it in items:
        first.setdefault(it.image_path, it.category)
    for c in set(first.values()):
        images = [p for p, fc in first.items() if fc == c]
        assert len({it.image_path for it in pool} & set(images)) == round(fraction * len(images))
    assert tasks.pool_split(items, fraction, seed) == (pool, rest)


MME_IMAGES = {"existence": 30, "count": 30, "position": 30, "color": 30, "posters": 147, "celebrity": 170,
              "scene": 200, "landmark": 200, "artwork": 200, "OCR": 20, "commonsense_reasoning": 70,
              "numerical_calculation": 20, "text_translation": 20, "code_reasoning": 20}  # the release's: 2 questions
# on each image


def test_a_benchmark_pool_holds_the_papers_training_queries_and_every_other_question_is_evaluated():
    """MME at its real size (2,374 questions on 1,187 images): the pool holds the images of the paper's 1,000
    training queries + 32 held out (a share of each subtask's images), and the other 1,340 are evaluated; SEED-Bench-1's
    size as much, a few questions over (each dimension's share rounded)."""
    images = [(c, n) for c, count in MME_IMAGES.items() for n in range(count)]
    items = [Item(2 * i + k, f"/mme/{c}/{n}.jpg", f"q{k}", ("Yes",), "Yes", c) for i, (c, n) in enumerate(images)
             for k in range(2)]
    assert len(items) == 2_374
    fraction = tasks.pool_fraction("mme", items)
    pool, rest = tasks.pool_split(items, fraction)
    assert (fraction, len(pool), len(rest)) == (0.435, 1_034, 1_340)
    seed = [Item(n, f"/seed/{n}.jpg", "q", ("a",) * 4, "A", f"dim{n % 9}") for n in range(14_233)]
    assert len(tasks.pool_split(seed, tasks.pool_fraction("seed", seed))[0]) in range(1_032, 1_041)
    small = [Item(n, f"/s/{n}.jpg", "q", ("a",) * 4, "A", f"dim{n // 7}") for n in range(2_996)]  # 428 of 7 images
    assert tasks.pool_fraction("mme", small) == 0.358  # 0.345 x 7 rounds to 2 (856 questions): raised until 3


def test_default_shots():
    """The paper's 2-shot MME and SEED are Idefics2-8B-base's (Table 2's text); Idefics-9b runs its 32 ICDs on every
    task, the other families the task's 2."""
    asked = ("mme", "seed", "seed2", "vqav2")
    assert [D.default_shots(D.TASKS[t], "idefics") for t in asked] == [32, 32, 32, 32]
    assert [D.default_shots(D.TASKS[t], "idefics2") for t in asked] == [2, 2, 2, 8]
    assert [D.default_shots(D.TASKS[t], "llava-interleave") for t in asked] == [2, 2, 2, 8]
    args = lab_train_args(["--model", "tiny-idefics2", "--task", "mme", "--data-root", benchmarks.ROOT])
    assert tasks.split_pool(args, "idefics2")[3] == 2


def test_unknown_task_and_split_list_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="vqav2, ok-vqa, coco.*seed2, toy-icl-colour"):
        tasks.load_task("gqa", "val", tmp_path)
    with pytest.raises(ValueError, match="train, val"):
        tasks.load_task("vqav2", "test", tmp_path)
    with pytest.raises(ValueError, match="--data-root"):
        tasks.load_task("vqav2", "val")


def test_largest_remainder_by_hand():
    assert tasks.largest_remainder(5, [3, 3, 4]) == [2, 1, 2]   # 1.5 1.5 2.0: the first .5 gets the spare one
    assert tasks.largest_remainder(10, [1, 1, 1]) == [4, 3, 3]
    assert tasks.largest_remainder(7, [10, 0, 4]) == [5, 0, 2]   # 5.0 0 2.0


def mme_like(images_per_subtask):
    """Two questions per image, subtask by subtask, as read_mme gives them."""
    return [Item(2 * k + j, f"/{c}/{k}.jpg", f"q{j}", ("Yes",), "Yes", c)
            for c, n in images_per_subtask.items() for k in range(n) for j in range(2)]


def test_stratified_subset_keeps_both_questions_of_an_image_and_every_subtask():
    items = mme_like({"existence": 30, "count": 30, "OCR": 20})  # 160 questions on 80 images
    subset = tasks.stratified_subset(items, 17, seed=0)
    # m = round(17 x 80 / 160) = 8 images, shared 30:30:20 -> 3, 3, 2 (exact 3, 3, 2)
    assert len(subset) == 16
    per_image = {}
    for it in subset:
        per_image.setdefault(it.image_path, []).append(it.question)
    assert all(qs == ["q0", "q1"] for qs in per_image.values())
    assert [sum(it.category == c for it in subset) for c in ("existence", "count", "OCR")] == [6, 6, 4]
    assert subset == [it for it in items if it in subset]             # the reader's order
    assert tasks.stratified_subset(items, 17, seed=0) == subset        # seeded
    assert tasks.stratified_subset(items, 17, seed=1) != subset
    assert tasks.stratified_subset(items, 500, seed=0) == items        # more than there are: all
    with pytest.raises(ValueError, match="--n-eval must be at least 1"):
        tasks.stratified_subset(items, 0)


def test_stratified_subset_of_single_question_images_is_exact():
    items = [Item(k, f"/{k}.jpg", "q", ("a",) * 4, "A", "dim1" if k < 90 else "dim2") for k in range(100)]
    subset = tasks.stratified_subset(items, 10, seed=3)
    assert len(subset) == 10 and sum(it.category == "dim2" for it in subset) == 1   # 9 : 1 as 90 : 10


def test_the_benchmarks_are_written_in_the_official_formats_and_read_back(bench):
    root, tasks = benchmarks.ROOT, bench
    assert {k: len(v) for k, v in tasks.items()} == {("vqav2", "train"): 300, ("vqav2", "val"): 100,
                                                     ("coco", "train"): 300, ("coco", "val"): 80}
    assert os.path.isfile(os.path.join(root, "vqav2", "v2_OpenEnded_mscoco_train2014_questions.json"))
    vqa = tasks["vqav2", "train"]
    assert all(len(i.answers) == 10 and i.target == readers.most_frequent(list(i.answers)) for i in vqa)
    assert 0.2 < sum(len(set(i.answers)) > 1 for i in vqa) / len(vqa) < 0.5  # some annotators disagree
    assert {"yes", "no", "left", "red", "circle", "3"} <= {i.target for i in vqa}
    assert D.load_image(vqa[0]).size == (64, 64)
    caption = tasks["coco", "val"][0]
    assert caption.question is None and len(caption.answers) == 5 and caption.target == caption.answers[0]
    assert not {i.id for i in vqa} & {i.id for i in tasks["vqav2", "val"]}


def test_the_benchmarks_are_seeded(tmp_path):
    root = benchmarks.ROOT
    benchmarks.write(tmp_path)
    for f in ("vqav2/v2_mscoco_val2014_annotations.json", "coco/dataset_coco.json", "mme/count/0003.txt",
              "seed-bench/SEED-Bench.json", f"seed-bench-2/{mme_seed.SEED2_FILE}", "coco/val2014/COCO_val2014_"
              "000000100007.jpg"):
        assert (tmp_path / f).read_bytes() == open(os.path.join(root, f), "rb").read(), f


def test_an_empty_split_is_a_clear_error(tmp_path):
    root = vqa_files(tmp_path, {"questions": []}, {"annotations": []})
    with pytest.raises(ValueError, match="vqav2 has no val items to evaluate"):
        lab_evaluate(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", str(root), "--shots", "0",
                      "--out", str(tmp_path / "eval")])
    vqa_files(tmp_path, {"questions": [QUESTION]}, {"annotations": [ANNOTATION]}, split="train")
    with pytest.raises(ValueError, match=r"vqav2 has 1 training items, too few for --n-heldout 4 and a query to train "
                                         r"on with 1 ICDs from the rest \(at least 6\): a task needs at least 3"):
        lab_train([*run_flags(tmp_path, "run"), "--data-root", str(root)])


def test_the_benchmarks_go_to_the_users_cache_or_a_folder_named_and_another_users_is_refused(tmp_path, monkeypatch):
    """tools/benchmarks.py writes under the user's own cache (before: the shared system temporary folder, where a
    folder another process made was read without a word) or a folder the user names, and prints where."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    assert os.path.dirname(benchmarks.ROOT) == os.path.join(cache, "hyper-icl")  # the user's own, whatever $TMPDIR
    mine = tmp_path / "mine"
    assert benchmarks.generate(str(mine)) == str(mine) and (mine / "vqav2").is_dir()
    monkeypatch.setattr(os, "getuid", lambda: os.stat(mine).st_uid + 1)
    with pytest.raises(ValueError, match=f"{mine} is another user's folder; name a folder of your own"):
        benchmarks.generate(str(mine))
