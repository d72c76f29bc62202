"""MME and SEED-Bench (Table 2): the readers on hand-written files in the official formats, the seeded split,
MME's acc / acc+ / score on a hand-computed example, option-letter extraction, SEED's likelihood ranking against
a plain per-option forward pass, and evaluate.py on the benchmarks of tools/benchmarks.py."""
import dataclasses
import json
import os

import pytest
import torch
from hypothesis import given, strategies as st
from PIL import Image

import benchmarks
import data as D
import evaluate as E
import train
from lab.datasets import mme_seed, tasks
from lab.models import backbones
from lab.scores import metrics, results


def write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def image(path, fmt="JPEG"):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.new("RGB", (8, 8), (200, 10, 10)).save(path, fmt)

# -----------------------------------------------------------------------------
# MME reader


@pytest.fixture
def mme_root(tmp_path):
    """Two subtasks as the release lays them out: existence (image beside its questions, .jpg and .png) and
    artwork (images/ and questions_answers_YN/)."""
    flat, nested = tmp_path / "mme" / "existence", tmp_path / "mme" / "artwork"
    image(flat / "0001.jpg")
    write(flat / "0001.txt", "Is there a dog? Please answer yes or no.\tYes\n"
                             "Is there a cat? Please answer yes or no.\tNo\n\n")  # a trailing blank line
    image(flat / "0002.png", "PNG")
    write(flat / "0002.txt", "Is there a car?\tno\r\nIs there a bus?\tYes\r\n")  # lowercase, CRLF
    image(nested / "images" / "10002.jpg")
    write(nested / "questions_answers_YN" / "10002.txt", "Is it a painting?\tYes\nIs it glassware?\tNo")
    return str(tmp_path)


def test_mme_reader_both_layouts(mme_root):
    items = mme_seed.read_mme(mme_root, ("existence", "artwork"))
    assert [it.id for it in items] == list(range(6))
    assert [(it.question, it.target, it.category) for it in items] == [
        ("Is there a dog? Please answer yes or no.", "Yes", "existence"),
        ("Is there a cat? Please answer yes or no.", "No", "existence"),
        ("Is there a car?", "No", "existence"), ("Is there a bus?", "Yes", "existence"),
        ("Is it a painting?", "Yes", "artwork"), ("Is it glassware?", "No", "artwork")]
    assert [os.path.relpath(it.image_path, mme_root) for it in items[::2]] == [
        "mme/existence/0001.jpg", "mme/existence/0002.png", "mme/artwork/images/10002.jpg"]
    assert all(it.answers == (it.target,) for it in items)
    assert D.load_image(items[4]).size == (8, 8)


@pytest.mark.parametrize("text, line", [
    ("Is there a dog?\tYes\nIs there a cat? No\n", 2),          # no tab
    ("Is there a dog?\tMaybe\nIs there a cat?\tNo\n", 1),       # not Yes / No
    ("\nIs there a dog?\tYes\tNo\n", 2),                        # three fields (line numbers count blank lines)
])
def test_mme_malformed_line_names_file_and_line(mme_root, text, line):
    path = os.path.join(mme_root, "mme", "existence", "0001.txt")
    write(path, text)
    with pytest.raises(ValueError, match=f"{path} line {line}:"):
        mme_seed.read_mme(mme_root, ("existence",))


def test_mme_needs_two_questions_per_image(mme_root):
    path = os.path.join(mme_root, "mme", "existence", "0001.txt")
    write(path, "Is there a dog?\tYes\n")
    with pytest.raises(ValueError, match=f"{path} has 1 questions"):
        mme_seed.read_mme(mme_root, ("existence",))


def test_mme_missing_image_and_subtask(mme_root):
    os.remove(os.path.join(mme_root, "mme", "artwork", "images", "10002.jpg"))
    path = os.path.join(mme_root, "mme", "artwork", "questions_answers_YN", "10002.txt")
    with pytest.raises(FileNotFoundError, match=f"no image for {path}"):
        mme_seed.read_mme(mme_root, ("artwork",))
    with pytest.raises(FileNotFoundError, match="mme/OCR"):
        mme_seed.read_mme(mme_root, ("OCR",))

# -----------------------------------------------------------------------------
# SEED-Bench reader


def seed_question(qid, dim, data_id, answer="B", **extra):
    return {"answer": answer, "choice_a": "One", "choice_b": "Two ", "choice_c": "Three", "choice_d": "Four",
            "data_id": data_id, "data_type": "image" if dim <= 9 else "video", "question": "How many towels?",
            "question_id": str(qid), "question_type_id": dim, **extra}


@pytest.fixture
def seed_root(tmp_path):
    folder = tmp_path / "seed-bench"
    image(folder / "SEED-Bench-image" / "1454426_2591111986.jpg")
    image(folder / "SEED-Bench-image" / "77_1.png", "PNG")
    questions = [seed_question(101669, 5, "1454426_2591111986"),            # data_id without its extension
                 seed_question(101670, 10, "94328.webm"),                   # video: skipped, never looked up
                 seed_question(7, 1, "77_1.png", answer="D"),              # data_id with it
                 seed_question(8, 9, "1454426_2591111986", answer="A")]
    obj = {"questions": questions, "question_type": {n: k + 1 for k, n in enumerate(benchmarks.SEED_V1_DIMENSIONS)}}
    write(folder / "SEED-Bench.json", json.dumps(obj))
    return str(tmp_path), obj


def test_seed_reader(seed_root):
    root, _ = seed_root
    items = mme_seed.read_seed(root)
    assert [(it.id, it.target, it.category) for it in items] == [
        (101669, "B", "Instances Counting"), (7, "D", "Scene Understanding"), (8, "A", "Text Understanding")]
    assert items[0].answers == ("One", "Two", "Three", "Four") and items[0].question == "How many towels?"
    assert items[0].image_path.endswith("SEED-Bench-image/1454426_2591111986.jpg")
    assert items[1].image_path.endswith("SEED-Bench-image/77_1.png")
    prompt = D.prompt_text("choice", items[0])
    assert prompt == "<image>Question: How many towels?\nA. One\nB. Two\nC. Three\nD. Four\nAnswer:"


@pytest.mark.parametrize("change, error, pattern", [
    (dict(data_id="missing_1"), FileNotFoundError, r"question 7 in .*SEED-Bench.json: its image 'missing_1'"),
    (dict(answer="E"), ValueError, r"question #2 \(question_id 7\) in .*SEED-Bench.json is malformed.*'E'"),
    (dict(choice_c=None), ValueError, r"question #2 \(question_id 7\) in .*SEED-Bench.json is malformed"),
    (dict(question_id="q7"), ValueError, r"question #2 \(question_id q7\) in .*SEED-Bench.json is malformed"),
])
def test_seed_bad_item_names_file_and_item(seed_root, change, error, pattern):
    root, obj = seed_root
    obj["questions"][2].update(change)
    write(os.path.join(root, "seed-bench", "SEED-Bench.json"), json.dumps(obj))
    with pytest.raises(error, match=pattern):
        mme_seed.read_seed(root)


def test_seed_missing_key_is_named(seed_root):
    root, obj = seed_root
    del obj["questions"][0]["choice_c"]
    write(os.path.join(root, "seed-bench", "SEED-Bench.json"), json.dumps(obj))
    with pytest.raises(ValueError, match=r"question #0 \(question_id 101669\).*'choice_c'"):
        mme_seed.read_seed(root)

# -----------------------------------------------------------------------------
# split, shots


@pytest.mark.parametrize("task", ["mme", "seed"])
def test_split_by_image(task, capsys):
    pool, rest = tasks.load_task(task, "train", benchmarks.ROOT), tasks.load_task(task, "val", benchmarks.ROOT)
    assert "training pool" in capsys.readouterr().out
    everything = mme_seed.read_mme(benchmarks.ROOT) if task == "mme" else mme_seed.read_seed(benchmarks.ROOT)
    assert sorted(it.id for it in pool + rest) == sorted(it.id for it in everything)
    assert not {it.image_path for it in pool} & {it.image_path for it in rest}  # no image on both sides
    fraction = tasks.POOL_FRACTION[task]
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


def test_default_shots():
    assert [D.default_shots(D.TASKS[t], "idefics") for t in ("mme", "seed", "seed2", "vqav2")] == [2, 2, 2, 32]
    args = train.parse_args(["--model", "tiny-idefics2", "--task", "mme", "--data-root", benchmarks.ROOT])
    assert tasks.split_pool(args, "idefics2")[3] == 2

# -----------------------------------------------------------------------------
# metrics


def mme_item(i, subtask, image_name, answer):
    return D.Item(i, f"/mme/{subtask}/{image_name}", "q?", (answer,), answer, subtask)


def official_mme(folder, subtask):
    """acc and acc+ (percent) of one eval_tool results file, computed the way calculation.py does: lines in
    consecutive pairs (one image each), the prediction lowercased, exact yes/no else "yes" then "no" in its first
    4 characters, else other."""
    with open(os.path.join(folder, subtask + ".txt")) as f:
        lines = f.readlines()
    right = []
    for line in lines:
        _, _, gt, pred = line.split("\t")
        pred = pred.lower()
        label = pred if pred in ("yes", "no") else "yes" if "yes" in pred[:4] else "no" if "no" in pred[:4] else "x"
        right.append(label == gt.lower())
    pairs = [right[i:i + 2] for i in range(0, len(right), 2)]
    return 100 * sum(right) / len(right), 100 * sum(all(p) for p in pairs) / len(pairs)


def test_mme_scores_hand_computed(tmp_path):
    items = [mme_item(0, "existence", "1.jpg", "Yes"), mme_item(1, "existence", "1.jpg", "No"),
             mme_item(2, "existence", "2.jpg", "Yes"), mme_item(3, "existence", "2.jpg", "No"),
             mme_item(4, "code_reasoning", "3.png", "Yes"), mme_item(5, "code_reasoning", "3.png", "No")]
    predictions = ["Yes", "no, there is none", "yes", "Yes it is", "Not sure", "maybe"]
    # existence: image 1 both right, image 2 one right -> acc 3/4, acc+ 1/2, score 125.
    # code_reasoning: "Not sure" has "no" in its first 4 characters -> "no" (wrong), "maybe" -> other (wrong).
    m = metrics.mme_scores(items, predictions)
    assert m["subtasks"] == {"existence": {"acc": 75.0, "acc_plus": 50.0, "score": 125.0},
                             "code_reasoning": {"acc": 0.0, "acc_plus": 0.0, "score": 0.0}}
    assert (m["perception"], m["cognition"], m["accuracy"], m["mean_subtask_accuracy"]) == (125.0, 0.0, 50.0, 37.5)
    results.write_mme_results(str(tmp_path), items, predictions)  # the official way on the official results format
    for subtask, v in m["subtasks"].items():
        assert official_mme(str(tmp_path), subtask) == (v["acc"], v["acc_plus"])


@pytest.mark.parametrize("generation, letter", [
    ("(B)", "b"), ("B.", "b"), ("The answer is B", "b"), ("the answer is b.", "b"), ("b", "b"),
    (" C) three", "c"), ("Answer: (d)", "d"), ("answer is: A", "a"), ("D. Four", "d"),
    ("Bus", None), ("", None), ("The bus", None), ("1", None),
])
def test_option_letter(generation, letter):
    assert metrics.option_letter(generation) == letter


def test_seed_scores_per_dimension():
    items = [D.Item(i, "x.jpg", "q", ("1", "2", "3", "4"), t, c)
             for i, (t, c) in enumerate([("A", "d1"), ("B", "d1"), ("C", "d2"), ("D", "d2"), ("A", "d2")])]
    m = metrics.seed_scores(items, ["(A)", "The answer is c", "C.", "d", "B"])
    assert m == {"dimensions": {"d1": 50.0, "d2": 200 / 3}, "accuracy": 60.0}

# -----------------------------------------------------------------------------
# SEED likelihood ranking vs a plain forward per option, and evaluate.py on the benchmarks


@pytest.fixture(scope="module")
def backbone():
    return backbones.load_backbone("tiny-idefics2")


def plain_loglik(backbone, row):
    """sum over the answer tokens t of log p(token t | tokens < t): one unpadded row, float64, a loop."""
    batch = D.collate([row], backbone.processor, backbone.family)
    with torch.no_grad():
        logits = backbone.model(**D.model_inputs(batch)).logits[0].double()
    ids, labels = row["input_ids"], row["labels"]
    return sum(torch.log_softmax(logits[t - 1], -1)[ids[t]].item() for t in range(len(ids)) if labels[t] != -100)


def test_likelihood_ranking_matches_plain_forward(backbone):
    proc, family = backbone.processor, backbone.family
    items, pool = tasks.load_task("seed", "val", benchmarks.ROOT)[:2], tasks.load_task("seed", "train", benchmarks.ROOT)
    icds = D.demonstrations([it.id for it in items], pool, 1, seed=0)
    got = E.option_logliks(backbone, items, icds)
    end = proc.tokenizer.convert_tokens_to_ids("<end_of_utterance>")
    expected = torch.zeros(2, 4, dtype=torch.float64)
    for i, (it, ds) in enumerate(zip(items, icds)):
        demo = dataclasses.replace(ds[0], target=ds[0].answers["ABCD".index(ds[0].target)])  # its answer's text
        for k, option in enumerate(it.answers):
            row = D.encode(proc, family, "choice-likelihood", [demo], dataclasses.replace(it, target=option))
            answer = [t for t, l in zip(row["input_ids"], row["labels"]) if l != -100]
            assert answer == proc.tokenizer(" " + option, add_special_tokens=False)["input_ids"] + [end]
            expected[i, k] = plain_loglik(backbone, row)
    assert len(set(expected.flatten().tolist())) == 8  # the options do differ
    torch.testing.assert_close(got.double(), expected, atol=2e-4, rtol=1e-5)
    ranked = E.predict(backbone, "seed", items, icds, likelihood=True)
    assert ranked == ["ABCD"[k] for k in expected.argmax(-1).tolist()]


@pytest.mark.parametrize("task, protocol", [("mme", None), ("seed", "likelihood")])
def test_evaluate_on_mme_and_seed(backbone, tmp_path, task, protocol):
    protocol = ["--seed-protocol", protocol] if protocol else []  # MME refuses a SEED protocol
    args = E.parse_args(["--model", "tiny-idefics2", "--task", task, "--shots", "2", "--out", str(tmp_path),
                         "--data-root", benchmarks.ROOT, *protocol])
    items = tasks.load_task(task, "val", benchmarks.ROOT)[:4]
    metrics = E.evaluate(backbone, args, items, "2-shot")
    if task == "mme":
        assert metrics["accuracy"] == metrics["mme"]["accuracy"]
        assert set(metrics["mme"]["subtasks"]) == {"existence"}
        with open(tmp_path / "mme-val-2-shot-seed0-n4.mme" / "existence.txt") as f:
            lines = [line.rstrip("\n").split("\t") for line in f]
        assert [(name, q, a) for name, q, a, _ in lines] == [
            (os.path.basename(it.image_path), it.question, it.target) for it in items]
    else:
        assert metrics["protocol"] == "likelihood" and metrics["accuracy"] == metrics["seed_bench"]["accuracy"]
        with open(tmp_path / "seed-val-2-shot-likelihood-seed0-n4.predictions.jsonl") as f:
            assert all(json.loads(line)["prediction"] in "ABCD" for line in f)
