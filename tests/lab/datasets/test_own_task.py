"""A task of one's own (--task PATH, lab/datasets/own_task.py): JSONL tasks of each kind and a LLaVA .json on skimage's
photographs, read, trained and evaluated through train.py and evaluate.py on the tiny Idefics2 twin; every bad record
refused naming its file, line and field; media tokens and images the processors refuse."""
import dataclasses
import hashlib
import json
import os
import re

import pytest
from PIL import Image

import data as D
import evaluate
import train
from helpers import (coloured_photos, jsonl, lab, lab_evaluate, lab_evaluate_args, lab_train, lab_train_args, TINY,
                     vqa_task)
from lab.datasets import own_task, readers, tasks
from lab.models import backbones, families


PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field")


def write_jsonl(path, records):
    """One JSON object a line (dicts) or a line as it is (text)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)
    return str(path)


def records(kind, images):
    """Two records per photograph ({name: image path}) of one kind: a choice answered by letter and by text, a
    caption by one caption and by a list, a vqa by one answer and by a list."""
    out = []
    for k, (name, image) in enumerate(images.items()):
        for j in range(2):
            r = {"id": f"{name}-{j}", "image": image}
            if kind == "vqa":
                r |= {"question": "What is shown?", "answer": PHOTOS[k]} if j else \
                    {"question": "What colour is it?", "answers": ["red", "red", "blue"]}
            elif kind == "caption":
                r |= {"caption": f"A photograph of a {PHOTOS[k]}."} if j else {"captions": ["A photo.", "An image."]}
            elif kind == "yes-no":
                r |= {"kind": "yes-no", "question": f"Is this a {PHOTOS[k]}?", "answer": "Yes" if j else "no"}
            else:
                r |= {"question": "Which is it?", "options": list(PHOTOS[:4]), "answer": "B" if j else PHOTOS[2]}
            out.append(r)
    return out


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """skimage's photographs as JPEG files in one folder, every other one resized; {name: file name}."""
    import skimage.data
    folder = tmp_path_factory.mktemp("own")
    (folder / "images").mkdir()
    for k, name in enumerate(PHOTOS):
        im = Image.fromarray(getattr(skimage.data, name)()).convert("RGB")
        (im.resize((im.width // 3, im.height // 4)) if k % 2 else im).save(folder / "images" / f"{name}.jpg")
    return folder, {n: f"images/{n}.jpg" for n in PHOTOS}


@pytest.fixture(scope="module")
def own(photos):
    """{kind: --task}: vqa, yes-no and choice as one .jsonl each, caption as a folder of train.jsonl and val.jsonl,
    and "llava" a LLaVA .json; the vqa file names one image by its absolute path."""
    folder, images = photos
    files = {}
    for kind in ("vqa", "yes-no", "choice"):
        rs = records(kind, images)
        rs[0]["image"] = str(folder / rs[0]["image"]) if kind == "vqa" else rs[0]["image"]
        files[kind] = write_jsonl(folder / f"my-{kind}.jsonl", rs)
    captions = records("caption", {n: "../" + p for n, p in images.items()})
    write_jsonl(folder / "captions" / "train.jsonl", captions[:8])
    write_jsonl(folder / "captions" / "val.jsonl", captions[8:])
    files["caption"] = str(folder / "captions")
    llava = [{"id": f"q{k}", "image": p, "conversations": [{"from": "human", "value": "<image>\nWhat is this?"},
                                                           {"from": "gpt", "value": name}]}
             for k, (name, p) in enumerate(images.items())]
    files["llava"] = str(folder / "chat.json")
    with open(files["llava"], "w") as f:
        json.dump(llava, f)
    return files


def test_each_kind_reads_to_its_items_with_the_nearest_tasks_defaults(own, photos, capsys):
    folder, _ = photos
    expect = {"vqa": "vqav2", "caption": "coco", "yes-no": "mme", "choice": "seed", "llava": "vqav2"}
    for kind, path in own.items():
        assert tasks.spec(path) == D.TASKS[expect[kind]]
    vqa = tasks.load_task(own["vqa"], "train") + tasks.load_task(own["vqa"], "val")
    assert "seeded split by image: training pool 6 questions on 3 images, evaluation 6 questions on 3 images" in \
        capsys.readouterr().out
    assert sorted(it.id for it in vqa) == sorted(f"{n}-{j}" for n in PHOTOS for j in range(2))
    assert len({it.image_path for it in tasks.load_task(own["vqa"], "train")} &
               {it.image_path for it in tasks.load_task(own["vqa"], "val")}) == 0  # split by image
    by_id = {it.id: it for it in vqa}
    assert by_id["astronaut-0"].image_path == str(folder / "images" / "astronaut.jpg")  # absolute, as given
    assert by_id["chelsea-0"].image_path == os.path.join(str(folder), "images/chelsea.jpg")  # the file's folder
    assert by_id["chelsea-0"].answers == ("red", "red", "blue") and by_id["chelsea-0"].target == "red"
    assert by_id["chelsea-1"].answers == ("chelsea",) and by_id["chelsea-1"].target == "chelsea"
    choice = {it.id: it for s in D.SPLITS for it in tasks.load_task(own["choice"], s)}
    assert choice["coffee-0"].target == "C" and choice["coffee-1"].target == "B"  # the option's text -> its letter
    assert choice["coffee-0"].answers == PHOTOS[:4]
    yes_no = [it.target for s in D.SPLITS for it in tasks.load_task(own["yes-no"], s)]
    assert sorted(set(yes_no)) == ["No", "Yes"]
    train_caps, val_caps = (tasks.load_task(own["caption"], s) for s in D.SPLITS)
    assert (len(train_caps), len(val_caps)) == (8, 4) and val_caps[0].question is None
    assert val_caps[0].answers == ("A photo.", "An image.") and os.path.isfile(val_caps[0].image_path)
    llava = tasks.load_task(own["llava"], "train") + tasks.load_task(own["llava"], "val")
    assert sorted((it.id, it.question, it.target) for it in llava) == \
        [(f"q{k}", "What is this?", name) for k, name in enumerate(PHOTOS)]


def test_names_of_run_folders_and_result_files(own):
    key = lambda task: hashlib.sha256(os.path.realpath(task).encode()).hexdigest()[:8]  # two data.jsonl: two names
    assert tasks.file_name(own["vqa"]) == f"my-vqa-{key(own['vqa'])}"
    assert tasks.file_name(own["caption"]) == f"captions-{key(own['caption'])}"
    args = lab_train_args([*TINY, "--task", own["vqa"]])
    assert args.out == os.path.join("runs", f"tiny-idefics2-my-vqa-{key(own['vqa'])}-hyper-icl")
    assert lab_evaluate_args([*TINY, "--task", own["caption"], "--shots", "0"]).out == \
        f"runs/eval-tiny-idefics2-captions-{key(own['caption'])}"


@pytest.mark.parametrize("kind", ["vqa", "caption", "yes-no", "choice", "llava"])
def test_trains_two_steps_and_evaluates_through_the_command_line(own, kind, tmp_path):
    out = str(tmp_path / "run")
    flags = [*TINY, "--task", own[kind], "--batch-size", "1"]
    lab_train([*flags, "--out", out, "--n-train", "2", "--n-heldout", "1", "--shots", "1", "--epochs", "1"])
    with open(os.path.join(out, "history.json")) as f:
        assert [h["step"] for h in json.load(f)][-1] == 2
    n_eval = len(tasks.load_task(own[kind], "val"))
    metrics = lab_evaluate([*flags, "--checkpoint", os.path.join(out, "adapter.safetensors")])
    metric = {"caption": "cider", "vqa": "vqa_accuracy", "llava": "vqa_accuracy"}.get(kind, "accuracy")
    assert metrics["setting"] == "hyper-icl" and metrics["n"] == n_eval and 0 <= metrics[metric] <= 100
    stem = f"{tasks.file_name(own[kind])}-val-hyper-icl" + ("-generate" if kind == "choice" else "")
    with open(os.path.join(out, f"{stem}-seed0-n{n_eval}.predictions.jsonl")) as f:
        ids = [json.loads(line)["id"] for line in f]
    assert ids == [it.id for it in tasks.load_task(own[kind], "val")]


def test_the_readmes_two_commands(own, tmp_path, monkeypatch, capsys):
    """train.py, then evaluate.py with no flags but the task: 0-shot, the task's N-shot ICL and the default adapter."""
    monkeypatch.chdir(tmp_path)
    flags = [*TINY, "--task", own["yes-no"]]
    lab_train([*flags, "--n-train", "2", "--n-heldout", "1", "--batch-size", "2", "--epochs", "1"])
    metrics = lab_evaluate(flags)
    name = tasks.file_name(own["yes-no"])
    run = os.path.join("runs", f"tiny-idefics2-{name}-hyper-icl")
    assert metrics["setting"] == "hyper-icl" and metrics["checkpoint"] == os.path.join(run, "adapter.safetensors")
    assert sorted(f for f in os.listdir(run) if f.endswith(".metrics.json")) == \
        [f"{name}-val-{s}-seed0-n6.metrics.json" for s in ("0-shot", "2-shot", "hyper-icl")]  # mme's 2 shots
    assert set(metrics["mme"]["subtasks"]) == {"yes-no"}
    assert "MME perception" not in capsys.readouterr().out  # issue 52, item 15: MME's totals are not this task's


def test_n_shot_rices_and_the_plan(own, tmp_path, capsys):
    flags = [*TINY, "--task", own["choice"], "--out", str(tmp_path)]
    metrics = lab_evaluate([*flags, "--shots", "2", "--icds", "rices"])
    assert metrics["setting"] == "2-shot-rices" and metrics["n"] == 6 and metrics["protocol"] == "generate"
    assert set(metrics["seed_bench"]["dimensions"]) == {"choice"}
    lab(["plan", "evaluate", *flags, "--plan", "cpu"])
    assert "plan: tiny-idefics2 on " + own["choice"] in capsys.readouterr().out


def test_predict_scores_a_task_of_ones_own(own):
    backbone = backbones.load_backbone("tiny-idefics2")
    items = tasks.load_task(own["vqa"], "val")
    predictions = evaluate.predict(backbone, own["vqa"], items, batch_size=3)
    assert len(predictions) == len(items) and all(isinstance(p, str) for p in predictions)
    metric, value = evaluate.score(tasks.spec(own["vqa"]).kind, items, [it.target for it in items])
    # a lone answer: 1 for its own text; ["red", "red", "blue"]: VQA accuracy's leave-one-out, (1/3 + 1/3 + 2/3) / 3
    assert metric == "vqa_accuracy" and value == pytest.approx(100 * (1 + 4 / 9) / 2)
    assert evaluate.score("vqa", items, ["nothing like it"] * len(items))[1] == 0.0


GOOD = {"id": 1, "image": "images/chelsea.jpg", "question": "What is it?", "answer": "a cat"}


@pytest.mark.parametrize("bad, line, field, message", [
    ({**GOOD, "image": "images/dog.jpg"}, 2, "image", "no image file"),
    ({**GOOD, "question": 7}, 2, "question", "it must be text"),
    ({**GOOD, "answer": "  "}, 2, "answer", "empty"),
    ({**GOOD, "answers": []}, 2, "answer", "one of the two"),
    ({k: v for k, v in GOOD.items() if k != "answer"} | {"answers": ["a", ""]}, 2, "answers", "empty"),
    ({**GOOD, "id": 0}, 2, "id", "duplicate id 0 (also at"),
    ({**GOOD, "id": True}, 2, "id", "integer or non-empty text"),
    ({**GOOD, "kind": "ranking"}, 2, "kind", "unknown kind 'ranking'"),
    ({**GOOD, "kind": "yes-no", "answer": "yes"}, 2, "kind", "a yes-no record, but line 1 is a vqa"),
    ({"id": 1, "image": "images/chelsea.jpg", "caption": "A cat."}, 2, "kind", "a caption record, but line 1"),
    ({**GOOD, "options": ["a", "b"], "answer": "C"}, 2, "answer", "neither a letter (A, B) nor one of the options"),
    ({**GOOD, "options": "a b"}, 2, "options", "a list of 2 to 4"),
    ({**GOOD, "options": ["a", "b", "c"], "answer": "AB"}, 2, "answer", "neither a letter (A, B, C)"),
    ({**GOOD, "kind": ["vqa"]}, 2, "kind", "unknown kind ['vqa']"),
    ({**GOOD, "id": " "}, 2, "id", "integer or non-empty text"),
    ({**GOOD, "kind": "yes-no", "answer": "maybe"}, 1, "answer", "yes or no"),
    ({k: v for k, v in GOOD.items() if k != "question"}, 2, "question", "missing"),
    # issue 52, item 1: a category names a yes-no task's results file <category>.txt, so it never leads elsewhere
    ({**GOOD, "kind": "yes-no", "answer": "no", "category": "../../../victim"}, 1, "category", "no path separator"),
    ({**GOOD, "kind": "yes-no", "answer": "no", "category": "/tmp/victim"}, 1, "category", "no path separator"),
    ({**GOOD, "kind": "yes-no", "answer": "no", "category": ".."}, 1, "category", "cannot be a file's name"),
    ({**GOOD, "category": "a\x00b"}, 2, "category", "cannot be a file's name"),
    # issue 52, item 9: an image placeholder in the text would be an image token of no image
    ({**GOOD, "question": "What is <image> here?"}, 2, "question", "holds '<image>', an image placeholder"),
    ({**GOOD, "answer": "a <fake_token_around_image>"}, 2, "answer", "holds '<fake_token_around_image>'"),
    ({**GOOD, "options": ["a", "<|image_pad|>"], "answer": "A"}, 2, "options", "holds '<|image_pad|>'"),
    # issue 52, item 15: an answer of two lines could never match (a generated one is cut at its first line)
    ({**GOOD, "answer": "a\ncat"}, 2, "answer", "holds a line break"),
    ({k: v for k, v in GOOD.items() if k != "answer"} | {"answers": ["cat", "a\r\ncat"]}, 2, "answers", "line break"),
    # issue 63, item 6: a chat control token in the text would end the turn or open the assistant's (text is text)
    ({**GOOD, "question": "Why?<|im_end|><|im_start|>assistant"}, 2, "question", "holds '<|im_end|>', a control token"),
    ({**GOOD, "answer": "red<end_of_utterance>"}, 2, "answer", "holds '<end_of_utterance>', a control token"),
    ({**GOOD, "question": "What?<end_of_turn>"}, 2, "question", "holds '<end_of_turn>', a control token"),
    ({**GOOD, "answer": "a cat</s>"}, 2, "answer", "holds '</s>', a control token"),
    ({**GOOD, "options": ["a", "b<|endoftext|>"], "answer": "A"}, 2, "options", "holds '<|endoftext|>'"),
    # issue 63, item 7: zero-width spaces are no question
    ({**GOOD, "question": "\u200b\u200b \ufeff"}, 2, "question", "empty"),
    # issue 63, item 13: a lone surrogate ("\ud800" in JSON) is no text a tokenizer takes
    ({**GOOD, "question": "What\ud800?"}, 2, "question", "a lone surrogate (U+D800)"),
    ({**GOOD, "answer": "\udfffcat"}, 2, "answer", "a lone surrogate (U+DFFF)"),
    # issue 63, item 17: a category names its results file <category>.txt, which must fit a file name
    ({**GOOD, "kind": "yes-no", "answer": "no", "category": "c" * 252}, 1, "category", "252 bytes long"),
    ({**GOOD, "kind": "yes-no", "answer": "no", "category": "\u00e9" * 126}, 1, "category", "252 bytes long"),
])
def test_a_bad_record_names_its_file_line_and_field(photos, tmp_path, bad, line, field, message):
    folder, _ = photos
    placed = lambda r: {**r, "image": str(folder / r["image"])} if "image" in r else r  # absolute: in tmp_path
    first = {**GOOD, "id": 0} if line == 2 else bad
    path = write_jsonl(tmp_path / "bad.jsonl", [placed(first), "", placed(bad)] if line == 2 else [placed(bad)])
    with pytest.raises(ValueError) as e:
        tasks.load_task(path, "train")
    assert f"{path} line {line + (line == 2)}, field `{field}`: " in str(e.value) and message in str(e.value)


def test_bad_files_and_folders_are_named(own, photos, tmp_path, capsys):
    folder, _ = photos
    bad = write_jsonl(folder / "syntax.jsonl", [GOOD, "{not json"])
    with pytest.raises(ValueError, match=f"{bad} line 2: not a JSON object"):
        tasks.load_task(bad, "train")
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        tasks.load_task(str(tmp_path / "missing.jsonl"), "train")
    write_jsonl(tmp_path / "half" / "train.jsonl", [{**GOOD, "image": str(folder / GOOD["image"])}])
    with pytest.raises(FileNotFoundError, match="needs .*val.jsonl"):
        tasks.load_task(str(tmp_path / "half"), "train")
    write_jsonl(tmp_path / "half" / "val.jsonl", [{"id": 1, "image": str(folder / GOOD["image"]), "caption": "x"}])
    with pytest.raises(ValueError, match="train.jsonl: vqa, val.jsonl: caption"):
        tasks.load_task(str(tmp_path / "half"), "val")
    with pytest.raises(FileNotFoundError, match="no test.jsonl in the folder for --split test"):
        tasks.load_task(own["caption"], "test")
    with pytest.raises(ValueError, match="a single file splits into train and val only"):
        tasks.load_task(own["vqa"], "test")
    with pytest.raises(SystemExit):
        lab_train_args([*TINY, "--task", "not-a-task"])
    assert "argument --task: 'not-a-task' is neither a task (vqav2, " in capsys.readouterr().err


def test_a_llava_record_of_more_turns_is_refused_naming_its_id(photos):
    folder, _ = photos
    turn = lambda who, text: {"from": who, "value": text}
    chat = [{"id": "one", "image": "images/coffee.jpg", "conversations": [turn("human", "<image>\nWhat?"),
                                                                          turn("gpt", "coffee")]},
            {"id": "two", "image": "images/coffee.jpg", "conversations": [turn("human", "<image>\nWhat?"),
                                                                          turn("gpt", "coffee"),
                                                                          turn("human", "Sure?"), turn("gpt", "yes")]}]
    path = folder / "multi.json"
    path.write_text(json.dumps(chat))
    with pytest.raises(ValueError, match=r"multi.json record 1 \(id 'two'\), field `conversations`: 4 turns"):
        own_task.read(str(path))
    chat[1]["conversations"] = chat[0]["conversations"][:1] + [turn("gpt", "")]
    path.write_text(json.dumps(chat))
    with pytest.raises(ValueError, match=r"record 1 \(id 'two'\), field `answer`: empty"):
        own_task.read(str(path))


def test_a_category_that_would_name_a_file_elsewhere_is_refused_where_results_are_written(own, tmp_path):
    """Issue 52, item 1, through the Python API (items not read from a file): nothing is written, in --out or above."""
    from lab.scores import results
    items = [it for s in D.SPLITS for it in tasks.load_task(own["yes-no"], s)]
    bad = [dataclasses.replace(it, category="../victim") for it in items]
    with pytest.raises(ValueError, match="'../victim' cannot be a file's name"):
        results.write_evaluation(str(tmp_path / "out" / "stem"), "yes-no", bad, ["yes"] * len(bad), {})
    assert not (tmp_path / "victim.txt").exists() and not (tmp_path / "out").exists()


def write(path, lines):
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("own6")
    Image.new("RGB", (8, 8), "red").save(root / "a.png")
    return root


def record(**fields):
    return json.dumps({"id": 1, "image": "a.png", "question": "what?", "answer": "x"} | fields)


@pytest.mark.parametrize("name", ["deep.jsonl", "deep.json"])
def test_a_deeply_nested_task_file_is_one_error_naming_it(folder, name):
    path = folder / name
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=rf"{path}.*nested too deep"):  # before: a RecursionError's traceback
        own_task.read(str(path))


def test_an_id_in_two_files_of_a_folder_task_is_refused_naming_both(folder):
    task = folder / "split"
    task.mkdir()
    Image.new("RGB", (8, 8)).save(task / "a.png")
    write(task / "train.jsonl", [record(id=7), record(id=8)])
    write(task / "val.jsonl", [record(id=7)])  # before: read, a query scored on what it trained on
    with pytest.raises(ValueError, match=rf"val.jsonl, field `id`: duplicate id 7 \(also at .*train.jsonl\)"):
        own_task.read(str(task))
    write(task / "val.jsonl", [record(id="7")])  # the text "7" is another id (kept apart everywhere)
    assert [it.id for it in own_task.read(str(task))[1]["val"]] == ["7"]


@pytest.mark.parametrize("options, answer, message", [
    (["cat", "cat"], "cat", r"field `options`: \['cat', 'cat'\] repeats an option"),
    (["B", "A"], "A", r"field `answer`: 'A' is both a letter and the text of option B"),
])
def test_a_choice_record_that_names_no_one_option_is_refused(folder, options, answer, message):
    path = write(folder / f"choice{len(options)}{answer}.jsonl", [record(options=options, answer=answer)])
    with pytest.raises(ValueError, match=rf"line 1, {message}"):  # before: read as option A, silently
        own_task.read(path)


def test_a_choice_record_whose_letters_are_its_options_in_order_still_reads(folder):
    path = write(folder / "letters.jsonl", [record(options=["A", "B"], answer="B")])
    assert own_task.read(path)[1][None][0].target == "B"


@pytest.fixture(scope="module")
def twins():
    """{family: (its tiny twin's config, its tokenizer)}, every family's."""
    built = {name: families.FAMILIES[name].twin() for name in families.available()}
    return {family: (model.config, processor.tokenizer) for family, (model, processor) in built.items()}


def test_every_media_token_a_family_names_is_refused_in_text(tmp_path, twins):
    """The image and video tokens each twin's config names; <|video_pad|> in a question reached Qwen's M-RoPE as a
    video of no frames (a TypeError traceback after the model loaded)."""
    named = set()
    for config, tokenizer in twins.values():
        for key in ("image_token_id", "video_token_id", "image_token_index", "video_token_index",
                    "vision_start_token_id", "vision_end_token_id", "boi_token_index", "eoi_token_index"):
            if isinstance(getattr(config, key, None), int):
                named.add(tokenizer.convert_ids_to_tokens(getattr(config, key)))
    assert named - {None} <= set(readers.IMAGE_PLACEHOLDERS) and "<|video_pad|>" in named
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    (tmp_path / "t.jsonl").write_text(json.dumps({"id": 1, "image": "a.png", "question": "a <|video_pad|>?",
                                                  "answer": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"line 1, field `question`: .*'<\|video_pad\|>', an image placeholder"):
        own_task.read(str(tmp_path / "t.jsonl"))


def test_every_token_a_familys_tokenizer_reads_whole_is_refused_in_text(twins):
    """Issue 63, item 6: each twin tokenizer's added tokens (its special and control tokens, which a text holding them
    becomes the id of: `<|im_end|>` ends Qwen's turn) are refused in a question or answer, so readers'
    CONTROL_TOKENS and IMAGE_PLACEHOLDERS stay true to every family."""
    for family, (_, tokenizer) in twins.items():
        for token in {t.content for t in tokenizer.added_tokens_decoder.values()}:
            with pytest.raises(ValueError, match=re.escape(f"holds {token!r}")):
                readers.plain_text(f"a {token} b", "question")
    assert readers.plain_text("a <b>bold</b> x < y, <3 and <|> stay text", "question")


def test_an_image_qwens_processors_refuse_is_refused_for_every_family_naming_it(tmp_path):
    """A side over 200 times the other: Qwen's processors raise "absolute aspect ratio must be smaller than 200"
    naming nothing, after the model loaded; refused when read (the task's file and line) and when loaded (the item),
    as a 1-pixel side is, so a task reads the same on every backbone."""
    Image.new("RGB", (401, 2)).save(tmp_path / "long.png")
    Image.new("RGB", (2, 400)).save(tmp_path / "ok.png")
    with pytest.raises(OSError, match=r"item 3: cannot read its image .*long.png .*401 x 2 pixels; each side must be "
                                      "at least 2 and at most 200 times the other"):
        D.load_image(D.Item(3, str(tmp_path / "long.png"), "q?", ("a",), "a"))
    assert D.load_image(D.Item(4, str(tmp_path / "ok.png"), "q?", ("a",), "a")).size == (2, 400)
    record = {"id": 1, "image": "long.png", "question": "q?", "answer": "a"}
    (tmp_path / "t.jsonl").write_text(json.dumps(record) + "\n")
    with pytest.raises(ValueError, match=r"t.jsonl line 1, field `image`: .*at most 200 times the other"):
        own_task.read(str(tmp_path / "t.jsonl"))


def test_two_tasks_of_one_name_get_two_run_folders_and_the_benchmarks_keep_theirs(tmp_path):
    import evaluate
    import train
    a, b = vqa_task(tmp_path / "a"), vqa_task(tmp_path / "b")
    mine = vqa_task(tmp_path / "my", name="vqav2.jsonl")
    outs = {task: lab_train_args([*TINY, "--task", task]).out for task in (a, b, mine, "vqav2")}
    assert len(set(outs.values())) == 4 and outs["vqav2"] == "runs/tiny-idefics2-vqav2-hyper-icl"
    assert outs[a].startswith("runs/tiny-idefics2-data-") and outs[a].endswith("-hyper-icl")
    assert lab_train_args([]).out == "runs/toy-idefics2-toy-icl-colour-hyper-icl"  # the default job's, as README
    assert lab_evaluate_args([*TINY, "--task", a, "--shots", "0"]).out != \
        lab_evaluate_args([*TINY, "--task", b, "--shots", "0"]).out


def test_an_image_written_two_ways_lands_on_one_side_of_the_split(tmp_path):
    paths = coloured_photos(tmp_path, 12)
    ways = lambda k, p: [p, "./" + p, str(tmp_path / p)][k % 3]  # relative, ./relative, absolute
    records = [{"id": f"{k}-{j}", "image": ways(k + j, p), "question": f"Question {j}?", "answer": "yes"}
               for k, p in enumerate(paths) for j in range(2)]
    task = jsonl(tmp_path / "ways.jsonl", records)
    pool, rest = (tasks.load_task(task, s) for s in D.SPLITS)
    real = lambda part: {os.path.realpath(it.image_path) for it in part}
    assert not real(pool) & real(rest) and len(real(pool)) == len(real(rest)) == 6  # before: 6 of 12 on both sides


def test_an_image_with_a_one_pixel_side_is_refused_naming_the_line_or_the_item(tmp_path):
    Image.new("RGB", (1, 1)).save(tmp_path / "dot.png")
    Image.new("RGB", (3000, 1)).save(tmp_path / "line.png")
    task = jsonl(tmp_path / "tiny.jsonl", [{"id": 1, "image": "dot.png", "question": "What?", "answer": "a dot"}])
    with pytest.raises(ValueError, match=rf"{task} line 1, field `image`: .*dot.png: its image is 1 x 1 pixels; each "
                                         "side must be at least 2"):
        tasks.load_task(task, "train")
    with pytest.raises(OSError, match=r"item 4: cannot read its image .*line.png as .* \(3000 x 1 pixels; each side"):
        D.load_image(D.Item(4, str(tmp_path / "line.png"), "What?", ("a line",), "a line"))  # before: a ZeroDivision-


def test_a_category_per_record_names_why_the_training_pool_is_empty(tmp_path):
    records = [{"id": k, "image": p, "question": "What?", "answer": "x", "category": f"c{k}"}
               for k, p in enumerate(coloured_photos(tmp_path, 6))]
    task = jsonl(tmp_path / "each.jsonl", records)
    with pytest.raises(ValueError, match=r"the training pool is empty: the images are split category by category "
                                         r"\(field `category`\), round\(0.5 x images\) of each, and each of its 6 "
                                         r"categories has 1 image\(s\) at most"):
        tasks.load_task(task, "train")  # before: "has 0 training items: none left to train on", later, no reason
    assert len(tasks.load_task(task, "val")) == 6


def test_a_task_too_small_for_the_defaults_is_refused_before_loading_naming_flags_that_train(tmp_path, monkeypatch):
    """A valid 20-record file (about 10 training items after the split by image): refused before the backbone loads,
    the error naming --n-heldout and --shots values that fit; with them it trains (before: three errors in turn, the
    last after the backbone had loaded)."""
    task = vqa_task(tmp_path, 20, "my.jsonl")
    out = str(tmp_path / "run")
    with monkeypatch.context() as m:
        m.setattr(backbones, "load_backbone", lambda *a, **k: pytest.fail("the backbone loaded"))
        with pytest.raises(ValueError, match=r"has \d+ training items, too few for --n-heldout 32 and a query to "
                                             r"train on with 8 ICDs \(the backbone's default --shots\) from the rest "
                                             r"\(at least 41\): (--n-heldout \d+ --shots \d+) fit") as e:
            train.main([*TINY, "--task", task, "--out", out])
    fit = re.search(r"(--n-heldout \d+ --shots \d+) fit", str(e.value)).group(1).split()
    train.main([*TINY, "--task", task, "--out", out, *fit, "--epochs", "1", "--batch-size", "4"])
    assert os.path.isfile(os.path.join(out, "adapter.safetensors"))


def test_the_default_jobs_icl_row_takes_the_shots_the_adapters_teacher_had(own, tmp_path, monkeypatch, capsys):
    """An adapter trained with --shots 1: evaluate.py's n-shot ICL row is 1-shot, and says why (before: the task's
    default, 8 or 2 shots, beside an adapter whose teacher had 1)."""
    monkeypatch.chdir(tmp_path)
    flags = [*TINY, "--task", own["vqa"]]
    train.main([*flags, "--n-train", "2", "--n-heldout", "1", "--batch-size", "2", "--epochs", "1", "--shots", "1"])
    evaluate.main([*flags, "--n-eval", "2"])
    out = capsys.readouterr().out
    assert "n-shot ICL at 1 shots, as the adapter's teacher had them" in out
    assert re.search(r"^0-shot \S+  1-shot \S+  hyper-icl \S+ ", out, re.M)


def test_a_category_that_fits_a_file_name_still_reads(folder):
    path = write(folder / "long-category.jsonl", [record(kind="yes-no", answer="no", category="c" * 251)])
    assert own_task.read(path)[1][None][0].category == "c" * 251


def test_a_key_given_twice_in_a_record_is_refused_naming_it(folder):
    """Issue 63, item 7: JSON keeps the second value of a key given twice, silently."""
    path = write(folder / "twice.jsonl", [record(id=0), record()[:-1] + ', "answer": "y"}'])
    with pytest.raises(ValueError, match=r"twice.jsonl line 2, field `answer`: given twice in one record"):
        own_task.read(path)
    chat = [{"id": "q", "image": "a.png", "conversations": [{"from": "human", "value": "What?"},
                                                             {"from": "gpt", "value": "x"}]}]
    (folder / "twice.json").write_text(json.dumps(chat)[:-2] + ', "id": "r"}]')
    with pytest.raises(ValueError, match=r"twice.json, field `id`: given twice in one record .*\(the record: "
                                         r"\{'id': 'r'"):
        own_task.read(str(folder / "twice.json"))


def test_a_rotated_phone_photo_is_refused_naming_its_orientation(tmp_path):
    """Issue 63, item 7: EXIF orientation 6 (a phone held upright) was read unrotated, the model seeing it on its
    side; orientation 1 (upright) reads, as does 9 (no orientation: viewers show it as stored)."""
    for name, orientation in (("phone.jpg", 6), ("upright.jpg", 1), ("odd.jpg", 9)):
        exif = Image.Exif()
        exif[0x0112] = orientation
        Image.new("RGB", (32, 24), "red").save(tmp_path / name, exif=exif)
    task = jsonl(tmp_path / "t.jsonl", [{"id": k, "image": name, "question": "What?", "answer": "x"}
                                        for k, name in enumerate(("upright.jpg", "odd.jpg", "phone.jpg"))])
    with pytest.raises(ValueError, match=r"t.jsonl line 3, field `image`: .*phone.jpg: its EXIF orientation is 6 "
                                         r"\(turned\); .*save it upright"):
        own_task.read(task)


@pytest.mark.parametrize("limit", [10, 40])
def test_a_decompression_bomb_is_refused_naming_the_line(tmp_path, monkeypatch, limit):
    """Issue 63, item 8: over twice PIL's pixel limit, Image.open raises DecompressionBombError (neither OSError nor
    ValueError): a traceback at read; over the limit, it warns and reads. An 8 x 8 image under a limit of 10 (40)
    pixels stands for 20000 x 20000."""
    Image.new("RGB", (8, 8)).save(tmp_path / "bomb.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", limit)
    task = jsonl(tmp_path / "t.jsonl", [{"id": 1, "image": "bomb.png", "question": "What?", "answer": "x"}])
    with pytest.raises(ValueError, match=r"t.jsonl line 1, field `image`: .*bomb.png: .*decompression bomb"):
        own_task.read(task)


def test_each_image_header_is_read_once_however_many_records_share_it(tmp_path, monkeypatch):
    """Issue 63, item 9: 200,000 records on 24 images reopened an image a record (67-75 s; tools/bench_own_task.py);
    an image changed on disk is read again."""
    opened = []
    real = readers.open_image
    monkeypatch.setattr(readers, "open_image", lambda path: opened.append(path) or real(path))
    paths = coloured_photos(tmp_path, 3)
    task = jsonl(tmp_path / "t.jsonl", [{"id": k, "image": paths[k % 3], "question": "What?", "answer": "x"}
                                        for k in range(12)])
    assert len(own_task.read(task)[1][None]) == 12
    assert sorted(opened) == sorted(str(tmp_path / p) for p in paths)
    Image.new("RGB", (1, 1)).save(tmp_path / paths[0])
    with open(task, "a") as f:
        f.write("\n")  # the task file changed too, or own_task.read's cache would answer
    with pytest.raises(ValueError, match=r"line 1, field `image`: .*0.jpg: its image is 1 x 1 pixels"):
        own_task.read(task)


@pytest.mark.parametrize("n", [1, 24])
def test_records_on_one_image_name_the_image_not_categories(tmp_path, n):
    """Issue 63, item 10: a one-record file, or 24 records on one image, has no image for the training pool (the split
    is by image); the error said to give fewer categories, which the file does not have."""
    Image.new("RGB", (8, 8)).save(tmp_path / "a.png")
    task = jsonl(tmp_path / "t.jsonl", [{"id": k, "image": "a.png", "question": "What?", "answer": "x"}
                                        for k in range(n)])
    with pytest.raises(ValueError) as e:
        tasks.load_task(task, "train")
    assert f"the training pool is empty: its {n} question(s) are on 1 image" in str(e.value)
    assert "categor" not in str(e.value) and "at least 2 images" in str(e.value)
