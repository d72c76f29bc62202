"""data.py: readers on files in the official formats (hand-written, and the benchmarks of tools/benchmarks.py),
demonstrations, teacher/student batches."""
import os
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image

import benchmarks
import data
from data import Item
from lab.disk import files
from lab.datasets import mme_seed, readers, tasks, toy_world
from lab.models import backbones

FAMILIES = ["idefics2", "idefics", "llava-interleave", "llava-onevision"]

# ------------------------------------------------------------------------------------------- fixtures on disk


def write_image(path, size=(40, 30)):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", size, (10, 200, 30)).save(path)


def write_vqa(root, dataset, split="val", answers=None, drop_annotation=False):
    """Two questions about COCO image 42 in the official VQAv2 / OK-VQA layout."""
    folder, qfile, afile = readers.VQA_FILES[dataset]
    answers = answers or ["two", "2", "2", "two", "2", "2", "2", "3", "2", "2"]
    questions = [{"image_id": 42, "question": "How many cats?", "question_id": 42000},
                 {"image_id": 42, "question": "Is it sunny?", "question_id": 42001}]
    annotations = [{"question_id": 42000, "image_id": 42, "question_type": "how many", "answer_type": "number",
                    "multiple_choice_answer": "2",
                    "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1}
                                for i, a in enumerate(answers)]},
                   {"question_id": 42001, "image_id": 42, "question_type": "is it", "answer_type": "yes/no",
                    "multiple_choice_answer": "yes",
                    "answers": [{"answer": "yes", "answer_confidence": "yes", "answer_id": i + 1} for i in range(10)]}]
    files.write_json(os.path.join(root, folder, qfile.format(split)), {"questions": questions})
    files.write_json(os.path.join(root, folder, afile.format(split)),
                     {"annotations": annotations[:1] if drop_annotation else annotations})
    write_image(readers.coco_image(root, split, 42))


def karpathy_image(imgid, split, filename, captions, **extra):
    return {"imgid": imgid, "split": split, "filename": filename, **extra,
            "sentences": [{"raw": c, "tokens": c.lower().split(), "imgid": imgid, "sentid": 10 * imgid + k}
                          for k, c in enumerate(captions)]}


def write_karpathy(root):
    """A COCO and a Flickr30k Karpathy file with one image in each of train, restval, val and test."""
    coco = [karpathy_image(i, s, f"COCO_val2014_{i:012d}.jpg", [f"A dog {i}. ", f"Some dog {i}."],
                           filepath="val2014", cocoid=1000 + i)
            for i, s in enumerate(["train", "restval", "val", "test"])]
    flickr = [karpathy_image(i, s, f"{100 + i}.jpg", [f"A man {i}.", f"Men {i}."])
              for i, s in enumerate(["train", "restval", "val", "test"])]
    files.write_json(os.path.join(root, "coco", "dataset_coco.json"), {"images": coco, "dataset": "coco"})
    files.write_json(os.path.join(root, "flickr30k", "dataset_flickr30k.json"),
                     {"images": flickr, "dataset": "flickr30k"})

# ------------------------------------------------------------------------------------------------------ readers


def test_vqav2_reader(tmp_path):
    write_vqa(tmp_path, "vqav2")
    items = tasks.load_task("vqav2", "val", tmp_path)
    assert [i.id for i in items] == [42000, 42001]
    assert items[0].question == "How many cats?" and items[0].target == "2" and len(items[0].answers) == 10
    assert items[0].image_path == str(tmp_path / "coco" / "val2014" / "COCO_val2014_000000000042.jpg")
    assert data.load_image(items[0]).mode == "RGB"


def test_okvqa_target_is_most_frequent_answer_ties_to_first(tmp_path):
    write_vqa(tmp_path, "ok-vqa", split="train", answers=["cat"] * 4 + ["dog"] * 4 + ["cow"] * 2)
    items = tasks.load_task("ok-vqa", "train", tmp_path)
    assert items[0].target == "cat" and items[1].target == "yes"
    assert readers.most_frequent(["b", "a", "a", "b", "c"]) == "b"


def test_karpathy_readers(tmp_path):
    write_karpathy(tmp_path)
    train, val = tasks.load_task("coco", "train", tmp_path), tasks.load_task("coco", "val", tmp_path)
    assert [i.id for i in train] == [1000, 1001] and [i.id for i in val] == [1003]
    assert val[0].question is None and val[0].answers == ("A dog 3.", "Some dog 3.") and val[0].target == "A dog 3."
    assert val[0].image_path == str(tmp_path / "coco" / "val2014" / "COCO_val2014_000000000003.jpg")
    flickr = tasks.load_task("flickr30k", "val", tmp_path)
    assert [i.id for i in flickr] == [3] and flickr[0].target == "A man 3."
    assert flickr[0].image_path == str(tmp_path / "flickr30k" / "flickr30k-images" / "103.jpg")


@pytest.mark.parametrize("task, missing", [
    ("vqav2", "vqav2/v2_OpenEnded_mscoco_val2014_questions.json"),
    ("ok-vqa", "ok-vqa/OpenEnded_mscoco_val2014_questions.json"),
    ("coco", "coco/dataset_coco.json"), ("flickr30k", "flickr30k/dataset_flickr30k.json")])
def test_missing_file_names_path_and_dataset(tmp_path, task, missing):
    with pytest.raises(FileNotFoundError) as e:
        tasks.load_task(task, "val", tmp_path)
    assert str(tmp_path / missing) in str(e.value) and task in str(e.value)


def test_missing_annotations_file(tmp_path):
    write_vqa(tmp_path, "vqav2")
    os.remove(tmp_path / "vqav2" / "v2_mscoco_val2014_annotations.json")
    with pytest.raises(FileNotFoundError, match="v2_mscoco_val2014_annotations.json"):
        tasks.load_task("vqav2", "val", tmp_path)


def test_malformed_json(tmp_path):
    write_karpathy(tmp_path)
    (tmp_path / "coco" / "dataset_coco.json").write_text('{"images": [')
    with pytest.raises(ValueError, match="coco: .*dataset_coco.json is not valid JSON"):
        tasks.load_task("coco", "val", tmp_path)


def test_question_without_annotation(tmp_path):
    write_vqa(tmp_path, "vqav2", drop_annotation=True)
    with pytest.raises(ValueError, match="question 42001 .* has no annotation"):
        tasks.load_task("vqav2", "val", tmp_path)


def test_unreadable_or_missing_image_names_item_and_path(tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    for path in (bad, tmp_path / "gone.jpg"):
        with pytest.raises(OSError, match=f"item 7: cannot read its image {path}"):
            data.load_image(Item(7, str(path), "q?", ("a",) * 10, "a"))


def test_unknown_task_and_split_list_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match="vqav2, ok-vqa, coco.*seed2, toy-icl-colour"):
        tasks.load_task("gqa", "val", tmp_path)
    with pytest.raises(ValueError, match="train, val"):
        tasks.load_task("vqav2", "test", tmp_path)
    with pytest.raises(ValueError, match="--data-root"):
        tasks.load_task("vqav2", "val")

# ------------------------------------------------------------------------------------- SEED-Bench-2, --n-eval


def seed2_question(qid, dimension, data_id, source="cc3m", answer="B", **extra):
    """A question in SEED-Bench-2's official layout (its DATASET.md)."""
    return {"answer": answer, "choice_a": "One", "choice_b": "Two ", "choice_c": "Three", "choice_d": "Four",
            "data_id": data_id, "data_source": source, "data_type": "Single Image", "level": "L1",
            "question": " How many towels are in the image?", "question_id": qid, "question_type_id": dimension,
            "subpart": "Single-Image & Text Comprehension", "version": "v1" if source == "cc3m" else "v2", **extra}


def write_seed2(root, questions):
    base = os.path.join(root, "seed-bench-2")
    write_image(os.path.join(base, "cc3m-image", "1454426_2591111986.jpg"))
    write_image(os.path.join(base, "SEED-Bench-2-image", "task13", "img", "0.png"))
    names = ["Scene Understanding", "Instance Identity", "Instance Attributes", "Instance Location",
             "Instances Counting"] + [f"dim{k}" for k in range(6, 28)]
    files.write_json(os.path.join(base, mme_seed.SEED2_FILE),
                     {"questions": questions, "question_type": {n: k + 1 for k, n in enumerate(names)}})


def test_seed2_reads_the_single_image_part_of_the_official_layout(tmp_path, capsys):
    multi = dict(data_type="Multiple Images", subpart="Multiple-Images & Text Comprehension")
    write_seed2(tmp_path, [
        seed2_question("5_0", 5, "1454426_2591111986"),                              # cc3m, no extension
        seed2_question("13_7", 13, "task13/img/0.png", "SEED-Bench v2", answer="D"),  # a path under v2's folder
        seed2_question("17_0", 17, ["task17/a_1.png", "task17/a_2.png"], "SEED-Bench v2", **multi),   # skipped
        seed2_question("25_0", 25, ["task25/1.jpg"], "SEED-Bench v2", level="L3", subpart="Image Generation")])
    items = mme_seed.read_seed2(str(tmp_path))
    assert [(it.id, it.category, it.target) for it in items] == [(5_000_000, "Instances Counting", "B"),
                                                                 (13_000_007, "dim13", "D")]
    assert items[0].image_path == os.path.join(str(tmp_path), "seed-bench-2", "cc3m-image", "1454426_2591111986.jpg")
    assert items[1].image_path.endswith(os.path.join("SEED-Bench-2-image", "task13", "img", "0.png"))
    assert items[0].answers == ("One", "Two", "Three", "Four")                   # stripped, as SEED-Bench-1's
    assert items[0].question == "How many towels are in the image?"
    assert "seed2: 2 single-image questions; Instances Counting 1, dim13 1" in capsys.readouterr().out


@pytest.mark.parametrize("question, message", [
    (seed2_question("5_0", 5, "missing_id"), "its image 'missing_id' is not under"),
    (seed2_question("5_0", 5, "1454426_2591111986", answer="E"), "answer 'E' is not one of A, B, C, D"),
    (seed2_question("5_0", 5, ["a.jpg"]), "needs one data_id"),
    ({k: v for k, v in seed2_question("5_0", 5, "x").items() if k != "choice_c"}, "malformed.*choice_c"),
])
def test_seed2_bad_question_names_it(tmp_path, question, message):
    write_seed2(tmp_path, [question])
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        mme_seed.read_seed2(str(tmp_path))


def test_seed2_is_selectable_like_seed():
    val, train = (tasks.load_task("seed2", s, benchmarks.ROOT) for s in ("val", "train"))
    assert len(val) + len(train) == benchmarks.SEED_IMAGES  # the skipped multi-image / video / L3 ones are not read
    assert {it.category for it in val + train} >= {"Visual Mathematics", "Scene Understanding"}
    assert not {it.image_path for it in val} & {it.image_path for it in train}
    assert data.default_shots(data.TASKS["seed2"], "idefics2") == 2 and data.TASKS["seed2"].kind == "choice"


def test_likelihood_prompt_is_the_official_one():
    item = Item(1, "x.jpg", "What is it?", ("a", "b", "c", "d"), "A", "Scene Understanding")
    assert data.PROMPTS["choice-likelihood"]["instruction"] == ""
    assert data.prompt_text("choice-likelihood", item) == "<image>Question: What is it?\nAnswer:"


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


# ---------------------------------------------------------------------------- the benchmarks of tools/benchmarks.py


@pytest.fixture(scope="module")
def bench():
    return {(t, s): tasks.load_task(t, s, benchmarks.ROOT) for t in ("vqav2", "coco") for s in data.SPLITS}


def test_the_benchmarks_are_written_in_the_official_formats_and_read_back(bench):
    root, tasks = benchmarks.ROOT, bench
    assert {k: len(v) for k, v in tasks.items()} == {("vqav2", "train"): 300, ("vqav2", "val"): 100,
                                                     ("coco", "train"): 300, ("coco", "val"): 100}
    assert os.path.isfile(os.path.join(root, "vqav2", "v2_OpenEnded_mscoco_train2014_questions.json"))
    vqa = tasks["vqav2", "train"]
    assert all(len(i.answers) == 10 and i.target == readers.most_frequent(list(i.answers)) for i in vqa)
    assert 0.2 < sum(len(set(i.answers)) > 1 for i in vqa) / len(vqa) < 0.5  # some annotators disagree
    assert {"yes", "no", "left", "red", "circle", "3"} <= {i.target for i in vqa}
    assert data.load_image(vqa[0]).size == (64, 64)
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


def test_generation_is_atomic(tmp_path, monkeypatch):
    def interrupted(root, attribute):
        os.makedirs(os.path.join(root, "vqav2"))
        raise KeyboardInterrupt

    monkeypatch.setattr(toy_world, "write_toy_icl", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tasks.load_task("toy-icl-colour", "train", tmp_path)
    assert os.listdir(tmp_path / "toy-icl") == []  # neither a half-written colour/ nor a temporary folder
    monkeypatch.undo()
    assert len(tasks.load_task("toy-icl-colour", "train", tmp_path)) == toy_world.ICL_SIZES["train"]
    monkeypatch.setattr(toy_world, "write_toy_icl", interrupted)  # generated once, then only read
    assert len(tasks.load_task("toy-icl-colour", "val", tmp_path)) == toy_world.ICL_SIZES["val"]

# ----------------------------------------------------------------------------------------------- demonstrations


def fake_items(ids):
    return [Item(i, f"{i}.jpg", "q?", ("a",) * 10, "a") for i in ids]


@given(st.lists(st.integers(0, 10**9), min_size=2, max_size=60, unique=True), st.integers(0, 2**32),
       st.data())
def test_demonstrations_exclude_the_query_and_do_not_depend_on_order(ids, seed, draw):
    support = fake_items(ids)
    m = draw.draw(st.integers(0, len(ids) - 1))
    queries = draw.draw(st.lists(st.sampled_from(ids) | st.integers(0, 10**9), min_size=1, max_size=8))
    icds = data.demonstrations(queries, support, m, seed)
    for q, d in zip(queries, icds):
        assert len(d) == m and q not in [x.id for x in d] and len({x.id for x in d}) == m
    assert data.demonstrations(queries[::-1], support, m, seed) == icds[::-1]
    assert data.demonstrations(queries, support, m, seed) == icds


def test_demonstrations_depend_on_the_seed_and_need_enough_support():
    support = fake_items(range(100))
    assert data.demonstrations([5], support, 8, 0) != data.demonstrations([5], support, 8, 1)
    with pytest.raises(ValueError, match="too small"):
        data.demonstrations([5], support[:8], 8, 0)

# ------------------------------------------------------------------------------------- batches, every family


@pytest.fixture(scope="module", params=FAMILIES)
def backbone(request):
    return backbones.load_backbone("tiny-" + request.param)


def image_tokens_per_image(processor, family, image):
    """How many <image> tokens one image becomes: what each family's processor documents."""
    if family == "idefics2":
        return processor.image_seq_len * (5 if processor.image_processor.do_image_splitting else 1)
    if family == "idefics":
        return 1  # its images enter through cross-attention; the text holds one placeholder
    if family == "llava-interleave":  # one token per patch of the resized image (less CLS under "default")
        size = processor.image_processor.size
        return ((size["height"] // processor.patch_size) * (size["width"] // processor.patch_size)
                + processor.num_additional_image_tokens - (processor.vision_feature_select_strategy == "default"))
    # LLaVA-OneVision: an image among several (its multi-image mode): the base view and a newline, no anyres tiles
    return processor.num_image_tokens + 1 - (processor.vision_feature_select_strategy == "default")


def n_images(batch, family):
    """Images per row in a collated batch."""
    if family in ("idefics2", "idefics"):
        return [int((pv.flatten(1).abs().sum(1) > 0).sum()) for pv in batch["pixel_values"]]
    return batch["pixel_values"].shape[0]


def teacher_and_student(processor, family, kind, queries, icds):
    """The teacher and the student batch of queries, as train.py builds them (data.query_pieces shared by both)."""
    pieces = data.query_pieces(processor, family, kind, queries)
    return (data.teacher_batch(processor, family, kind, pieces, icds),
            data.student_batch(processor, family, kind, pieces))


@pytest.mark.parametrize("kind", ["vqa", "caption"])
def test_teacher_and_student_rows_line_up(backbone, bench, kind):
    tasks = bench
    p, family = backbone.processor, backbone.family
    items = tasks["vqav2" if kind == "vqa" else "coco", "train"]
    queries, m = items[:3], 2
    teacher, student = teacher_and_student(p, family, kind, queries, data.demonstrations(
        [q.id for q in queries], items, m, seed=0))
    end = p.tokenizer.convert_tokens_to_ids(data.end_token(p, family))
    assert end != p.tokenizer.unk_token_id
    for b in range(len(queries)):
        T = int(student["query_target"][b].sum())
        assert T == int(teacher["query_target"][b].sum())
        for batch in (teacher, student):  # query_target = exactly the last T positions
            assert batch["query_target"][b, -T:].all() and not batch["query_target"][b, :-T].any()
        assert torch.equal(teacher["input_ids"][b, -T:], student["input_ids"][b, -T:])
        assert torch.equal(teacher["labels"][b, -T:], student["labels"][b, -T:])
        assert (teacher["labels"][b, :-T] == -100).all()
        labelled = student["labels"][b][student["labels"][b] != -100]
        assert labelled[-1] == end and p.tokenizer.decode(labelled[:-1]) == " " + queries[b].target
        tokens = student["input_ids"][b][student["labels"][b] != -100]
        assert torch.equal(tokens, labelled)  # labels are the answer's own ids (the model shifts them)
    for batch, per_row in ((teacher, m + 1), (student, 1)):
        image = data.load_image(queries[0])
        expected = per_row * image_tokens_per_image(p, family, image)
        assert ((batch["input_ids"] == p.image_token_id).sum(1) == expected).all()
        assert n_images(batch, family) == ([per_row] * 3 if family in ("idefics2", "idefics") else 3 * per_row)


def test_position_ids_ignore_padding(backbone, bench):
    tasks = bench
    p, family = backbone.processor, backbone.family
    items = tasks["vqav2", "train"]
    batch = data.prompt_batch(p, family, "vqa", items[:2], [[], items[2:5]])  # zero-shot and 3-shot rows
    mask = batch["attention_mask"]
    assert mask[0, 0] == 0 and mask[1].all()  # the short row is left-padded
    for b in range(2):
        n = int(mask[b].sum())
        assert batch["position_ids"][b, -n:].tolist() == list(range(n))
        assert (batch["position_ids"][b, :-n] == 0).all()
        assert (batch["input_ids"][b, :-n] == p.tokenizer.pad_token_id).all()
    assert (batch["labels"] == -100).all()


def test_prompt_is_the_student_row_without_its_answer(backbone, bench):
    tasks = bench
    p, family = backbone.processor, backbone.family
    q = tasks["vqav2", "val"][0]
    _, student = teacher_and_student(p, family, "vqa", [q], [[]])
    prompt = data.prompt_batch(p, family, "vqa", [q])
    n_answer = int((student["labels"] != -100).sum())
    assert torch.equal(prompt["input_ids"][0], student["input_ids"][0, :-n_answer])


def test_idefics_query_cross_attends_as_in_the_student(bench):
    """Idefics' image_attention_mask, rebuilt for the joined row: query tokens see only the query image, as alone."""
    tasks = bench
    bb = backbones.load_backbone("tiny-idefics")
    items = tasks["vqav2", "train"]
    teacher, student = teacher_and_student(bb.processor, "idefics", "vqa", items[:1], [items[1:4]])
    t_mask = teacher["image_attention_mask"][0][teacher["query_target"][0]]  # [query tokens, 4 images]
    s_mask = student["image_attention_mask"][0][student["query_target"][0]]  # [query tokens, 1 image]
    assert (t_mask[:, :3] == 0).all() and torch.equal(t_mask[:, 3:], s_mask) and s_mask.sum() == len(s_mask) - 1


def test_forward_pass_on_collated_batches(backbone, bench):
    tasks = bench
    p, family = backbone.processor, backbone.family
    items = tasks["vqav2", "train"]
    rng = random.Random(0)
    queries = rng.sample(items, 2)
    teacher, student = teacher_and_student(p, family, "vqa", queries, data.demonstrations(
        [q.id for q in queries], items, 2, seed=1))
    for batch in (teacher, student, data.prompt_batch(p, family, "vqa", queries)):
        inputs = {k: v for k, v in batch.items() if k != "query_target"}
        out = backbone.model(**inputs)
        assert out.logits.shape == (*batch["input_ids"].shape, backbone.model.config.get_text_config().vocab_size)
        assert torch.isfinite(out.logits).all()
    assert torch.isfinite(backbone.model(**{k: v for k, v in student.items() if k != "query_target"}).loss)
