"""The family records (lab/models/families.py:Family, FAMILIES) and the image layouts (lab/models/image_layouts.py):
a family added from one record loads, plans, trains and evaluates; no family or layout name is compared outside the
records; a record is checked when registered; a transformers without a family's classes refuses that family by name
and serves the others; tests/paper's tests over the paper's four families (test_plug.py's, test_fidelity.py's),
collected here again on every registered family: the module's `family` and `backbone` serve them."""
import ast
import dataclasses
import glob
import inspect
import json
import os
import pickle
import re
import subprocess
import sys

import pytest
import torch
import transformers
from hypothesis import given, settings, strategies as st

import data
import evaluate
import train
from helpers import PAPER, ROOT, TRAIN, assert_zero_init_is_the_unmodified_model, lab_args, with_flag
from lab.datasets import tasks
from lab.models import backbones, families, image_layouts, tiny
from lab.models.image_only import image_only
from lab.studies import run_plan
import benchmarks
import twins
from test_fidelity import test_layer_outputs_are_every_layers_own_output  # noqa: F401 (collected here: all families)
from test_plug import (  # noqa: F401 (collected here on every family)
    test_cached_decoding_equals_full_forward, test_fast_path_equals_reference_inside_the_model,
    test_hyper_icl_at_init_is_the_base_model, test_hyper_icl_at_init_is_the_base_model_in_bf16,
    test_padding_invariance_with_trained_adapter)

FAMILIES = families.available()  # those this transformers serves (every one at the newest)
RECORDS = {"lab/models/families.py", "lab/models/image_layouts.py"}  # where family and layout names are compared


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """Every registered family, for tests/paper's tests collected here."""
    return request.param


@pytest.fixture(scope="module")
def backbone(family):
    return backbones.load_backbone("tiny-" + family)


@pytest.fixture
def copy_family(monkeypatch):
    """A family added from one record, in this test only: idefics2's record under the name "copy-idefics2" (its own
    config model_type), registered into a copy of FAMILIES (and data.SHOTS)."""
    monkeypatch.setattr(families, "FAMILIES", dict(families.FAMILIES))
    monkeypatch.setattr(data, "SHOTS", dict(data.SHOTS))
    monkeypatch.setattr(data, "SHOTS_ON_EVERY_TASK", set(data.SHOTS_ON_EVERY_TASK))
    return families.register(dataclasses.replace(families.FAMILIES["idefics2"], name="copy-idefics2",
                                                 config_types=("copy_idefics2",)))


def record(**changed):
    """idefics2's record with `changed` fields, under a new name unless one is given."""
    return dataclasses.replace(families.FAMILIES["idefics2"], **{"name": "new", "config_types": ("new",), **changed})


def names_in_comparisons(source):
    """The lines of a Python source that compare with a family's or an image layout's name (==, !=, in, not in), or
    look one up by a literal key (x["idefics2"])."""
    names = set(families.FAMILIES) | set(image_layouts.LAYOUTS)
    found = []
    for node in ast.walk(ast.parse(source)):
        sides = [node.left, *node.comparators] if isinstance(node, ast.Compare) else \
            [node.slice] if isinstance(node, ast.Subscript) else []
        if {n.value for side in sides for n in ast.walk(side) if isinstance(n, ast.Constant)} & names:
            found.append(node.lineno)
    return found


def test_no_family_or_layout_is_compared_by_name_outside_the_records():
    """Families are records: a family's or a layout's name is compared nowhere in the six files and lab/ but in the
    records (RECORDS); what differs between families is read from their records."""
    compared = 'a = b.family == "idefics"\nc = f in ("gemma3", "x")\nd = form.images != "canvas"\ne = T["smolvlm"]'
    assert names_in_comparisons(compared) == [1, 2, 3, 4]
    assert names_in_comparisons('y = name == "tiny"\nz = kind in ("vqa", "caption")\nw = T[family]') == []
    paths = [f"{m}.py" for m in ("adapters", "lorentz", "model", "data", "train", "evaluate")] + \
        sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "lab", "**", "*.py"), recursive=True))
    assert len(paths) > 40 and RECORDS <= set(paths)
    found = {p: len(lines) for p in paths if p not in RECORDS
             if (lines := names_in_comparisons(open(os.path.join(ROOT, p), encoding="utf-8").read()))}
    assert found == {}


def test_a_family_added_from_one_record_loads_plans_trains_and_evaluates(copy_family, tmp_path):
    """A copy of idefics2's record under a new name, and nothing else: its tiny twin loads by `tiny-<name>`, the plan
    counts its rows, train.py trains two steps on it and evaluate.predict answers with it."""
    backbone = backbones.load_backbone("tiny-copy-idefics2")
    assert backbone.family == "copy-idefics2" and backbone.processor.image_layout is image_layouts.LAYOUTS["canvas"]
    flags = [*with_flag(with_flag(TRAIN, "--model", "tiny-copy-idefics2"), "--batch-size", "2"),  # 2 steps
             "--out", str(tmp_path / "run")]
    planned = run_plan.plan(lab_args(["plan", "train", *flags, "--plan", "cpu"]))
    assert planned["shots"] == 1 and planned["queries"] == 4 and planned["rows"]["teacher"]
    train.main(flags)
    history = json.load(open(tmp_path / "run" / "history.json"))
    assert len(history) == 1 and os.path.exists(tmp_path / "run" / "adapter.safetensors")  # one epoch of 2 steps
    items = tasks.load_task("vqav2", "val", benchmarks.ROOT)[:2]
    answers = evaluate.predict(backbone, "vqav2", items, new_tokens=2)
    assert len(answers) == 2 and all(isinstance(a, str) for a in answers)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=20, deadline=None)
@given(method=st.sampled_from(["hyper-icl", "static-layer", "static-layer-head", "output-level"]),
       rank=st.integers(1, 8), lengths=st.lists(st.integers(1, 10), min_size=1, max_size=3),
       std=st.floats(0.01, 3.0), seed=st.integers(0, 2**16))
def test_zero_init_is_the_unmodified_model(family, method, rank, lengths, std, seed):
    """tests/paper/test_plug.py's zero-init equivalence (Eq 5-7 with U_k = 0: the adapted logits at every real token
    equal the unmodified model's, bit for bit) on every registered family's tiny twin."""
    assert_zero_init_is_the_unmodified_model(twin(family), method, rank, lengths, std, seed)


TWINS = {}


def twin(family):
    """One tiny twin per family for the module (hypothesis examples cannot share a fixture's copy)."""
    if family not in TWINS:
        TWINS[family] = backbones.load_backbone("tiny-" + family)
    return TWINS[family]


# -------------------------------------------------------------------------------- hostile: records and registration

def test_a_record_with_an_unknown_layout_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"image layout 'mosaic' is none of \['canvas', 'concat', 'cross-attention', "
                                         r"'multi-image'\]; add its class to lab/models/image_layouts.py"):
        families.register(record(layout="mosaic"))
    assert "new" not in families.FAMILIES


def test_a_second_record_of_a_registered_name_is_refused():
    with pytest.raises(ValueError, match="family 'gemma3' is registered already"):
        families.register(record(name="gemma3"))
    assert families.FAMILIES["gemma3"].layout == "concat"  # the first record stays


def test_two_records_claiming_one_model_type_are_refused_naming_the_owner():
    with pytest.raises(ValueError, match=r"taken: llava \(llava-interleave\)"):
        families.register(record(config_types=("new_type", "llava")))


def test_a_record_without_a_model_type_is_refused():
    with pytest.raises(ValueError, match=r"config model_types \[\] must be at least one"):
        families.register(record(config_types=()))


@pytest.mark.parametrize("shots", [None, 0, -8, True, 8.0])
def test_a_record_without_default_shots_is_refused(shots):
    with pytest.raises(ValueError, match=rf"family 'new': default_shots is {shots!r}; give the ICDs a query"):
        families.register(record(default_shots=shots))
    assert "new" not in data.SHOTS


def test_a_registered_record_gives_its_default_shots_to_data(copy_family):
    families.register(record(name="five-shot", config_types=("five",), default_shots=5))
    assert data.default_shots(data.TASKS["vqav2"], "five-shot") == 5
    assert data.default_shots(data.TASKS["mme"], "five-shot") == 2  # the task's own first
    assert data.default_shots(data.TASKS["vqav2"], "idefics") == 32
    families.register(record(name="everywhere", config_types=("everywhere",), default_shots=5,
                             shots_on_every_task=True))
    assert data.default_shots(data.TASKS["mme"], "everywhere") == 5  # the family's first (Idefics-9b's record)


def test_a_family_without_a_record_has_no_default_shots_and_says_so():
    with pytest.raises(ValueError, match="backbone family 'unknown' has no default shots; register its record"):
        data.default_shots(data.TASKS["vqav2"], "unknown")


WITHOUT = """
import transformers
lazy, gone = type(transformers), set(GONE)
real = lazy.__getattr__
def lacking(self, name):  # a transformers that never had them
    if name in gone:
        raise AttributeError(name)
    return real(self, name)
lazy.__getattr__ = lacking
for name in gone:
    transformers.__dict__.pop(name, None)
"""  # transformers' lazy module reads a class on first use: this one lacks GONE


def test_a_missing_transformers_class_refuses_that_family_by_name_and_serves_the_others(monkeypatch):
    gone, real = {"LlavaOnevision15ForConditionalGeneration", "SmolVLMProcessor"}, type(transformers).__getattr__

    def lacking(self, name):  # WITHOUT's, in this process, undone after the test
        if name in gone:
            raise AttributeError(name)
        return real(self, name)
    monkeypatch.setattr(type(transformers), "__getattr__", lacking)
    for name in gone:
        monkeypatch.delitem(transformers.__dict__, name, raising=False)
    with pytest.raises(ImportError, match=rf"llava-onevision-1.5 needs transformers >= 5.25 \(for "
                                          rf"LlavaOnevision15ForConditionalGeneration\); this is "
                                          rf"{transformers.__version__}"):
        families.FAMILIES["llava-onevision-1.5"].model_cls()
    assert families.FAMILIES["idefics2"].model_cls() is transformers.Idefics2ForConditionalGeneration
    with pytest.raises(ImportError, match=r"smolvlm needs transformers >= 5.23( \(for SmolVLMProcessor\))?; this"):
        families.FAMILIES["smolvlm"].processor_cls()


def test_a_transformers_older_than_a_familys_needs_refuses_it_by_name_and_the_tests_skip_it(monkeypatch):
    """Issue 59: at the floor (transformers 5.18) Idefics3's and SmolVLM's processors break (KeyError 'rows' until
    5.23) and LLaVA-OneVision-1.5 has no classes (5.25): each is refused by name, its twin too, and available() (what
    the tests loop over) leaves them out, the paper's four kept."""
    monkeypatch.setattr(transformers, "__version__", "5.18.0")
    for name, needs in (("idefics3", "5.23"), ("smolvlm", "5.23"), ("llava-onevision-1.5", "5.25")):
        with pytest.raises(ImportError, match=rf"^{re.escape(name)} needs transformers >= {needs}( \(for \w+\))?; "
                                              r"this is 5.18.0$"):  # (for a class): where it is missing too
            families.FAMILIES[name].built_twin()
    assert families.FAMILIES["idefics3"].missing() == "idefics3 needs transformers >= 5.23; this is 5.18.0"
    assert {"idefics3", "smolvlm", "llava-onevision-1.5"}.isdisjoint(families.available())
    assert set(PAPER) <= set(families.available())


def test_the_records_import_under_a_transformers_without_a_newer_familys_classes():
    """families.py (and the twins, configs and layouts it reads) imports its classes by name when a family is asked
    for: with LLaVA-OneVision-1.5's and the *ImageProcessorPil classes gone, the others still load."""
    gone = ["LlavaOnevision15ForConditionalGeneration", "LlavaOnevision15Config", "Gemma3ImageProcessorPil",
            "Idefics3ImageProcessorPil"]
    code = (WITHOUT.replace("GONE", repr(gone)) + "from lab.models import backbones, families\n"
            "print(backbones.load_backbone('tiny-llava-interleave').family)\n"
            "try:\n    backbones.load_backbone('tiny-llava-onevision-1.5')\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == "llava-interleave"
    assert f"llava-onevision-1.5 needs transformers >= 5.25 (for LlavaOnevision15ForConditionalGeneration); this is " \
        f"{transformers.__version__}" in out.stdout  # before its twin's imports fail unnamed


def test_a_config_whose_model_type_matches_no_record_names_the_known_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "paligemma"}))
    known = sorted(t for f in families.FAMILIES.values() for t in f.config_types)
    with pytest.raises(ValueError, match=rf"model_type 'paligemma', none of {__import__('re').escape(str(known))}"):
        families.family_of(str(tmp_path))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_name_of_a_record_finds_it(family, tmp_path):
    """Its short name, `tiny-<name>`, its hub id and a folder of each of its config model_types."""
    spec = families.FAMILIES[family]
    assert families.family_of(family) == families.family_of("tiny-" + family) == families.family_of(spec.hub_id) \
        == family
    for kind in spec.config_types:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": kind}))
        assert families.family_of(str(tmp_path)) == family


@pytest.mark.parametrize("family", ["gemma3", "llava-onevision"])
def test_a_twin_loaded_by_name_is_the_one_its_record_builds(family):
    model, processor = families.FAMILIES[family].twin(0)
    loaded = backbones.load_backbone("tiny-" + family)
    assert type(loaded.model) is type(model) is families.FAMILIES[family].model_cls()
    own = model.state_dict()
    assert all(torch.equal(v, own[k]) for k, v in loaded.model.state_dict().items()) and len(own) > 10
    assert loaded.processor.row_format is families.FAMILIES[family].rows
    assert loaded.processor.image_layout is image_layouts.LAYOUTS[families.FAMILIES[family].layout]


def test_the_real_processor_twins_share_the_tiny_twins_qwen_constants():
    """tools/twins.py keeps no second copy of the Qwen vision tower or M-RoPE: the tiny twins', at the published
    rope_theta."""
    assert twins.QWEN_VISION is tiny.QWEN_VISION
    assert twins.MROPE == {**tiny.MROPE, "rope_theta": 1e6} and twins.MROPE["mrope_section"] is tiny.MROPE[
        "mrope_section"]


def test_an_image_only_processor_keeps_its_signature_and_is_found_again_after_pickling():
    if missing := families.FAMILIES["smolvlm"].missing():  # CI's floor leg
        pytest.skip(missing)
    cls = image_only(transformers.SmolVLMProcessor)
    assert inspect.signature(cls.__init__) == inspect.signature(transformers.SmolVLMProcessor.__init__)
    assert image_only(transformers.SmolVLMProcessor) is cls  # one class a base
    processor = backbones.load_backbone("tiny-smolvlm").processor
    again = pickle.loads(pickle.dumps(processor))
    assert type(again) is cls and again.image_seq_len == processor.image_seq_len


def test_smolvlm_is_built_without_num2words_and_it_is_restored(monkeypatch):
    from transformers.models.smolvlm import processing_smolvlm as module
    monkeypatch.setattr(module, "num2words", None)
    processor = families.FAMILIES["smolvlm"].twin(0)[1]
    assert module.num2words is None and type(processor).__name__ == "ImageOnlySmolVLMProcessor"
    with pytest.raises(AttributeError, match="no attribute ImageOnlyNotAProcessor"):
        __import__("lab.models.image_only", fromlist=["x"]).ImageOnlyNotAProcessor


def test_data_lays_images_out_by_the_processors_layout_alone(monkeypatch):
    """data.py reads no family: a processor carrying another layout gets that layout's pieces and batches."""
    backbone = backbones.load_backbone("tiny-llava-interleave")
    calls = []

    class Traced(image_layouts.Concat):
        def batch(self, rows, processor, input_ids):
            calls.append(len(rows))
            return super().batch(rows, processor, input_ids)

    backbone.processor.image_layout = Traced()
    items = tasks.load_task("vqav2", "val", benchmarks.ROOT)[:2]
    batch = data.prompt_batch(backbone.processor, "not-a-family", "vqa", items)
    assert calls == [2] and batch["pixel_values"].shape[0] == 2


@pytest.mark.parametrize("name, family, billions", [  # the hub's parameter counts of the checkpoints (safetensors)
    ("qwen2.5-vl-32b", "qwen2.5-vl", 33.5), ("qwen2.5-vl-72b", "qwen2.5-vl", 73.4), ("qwen3-vl-32b", "qwen3-vl", 33.4),
    ("internvl3-38b", "internvl3", 38.4), ("internvl3-78b", "internvl3", 78.4)])
def test_the_larger_checkpoints_by_short_name(name, family, billions):
    """families.SIZES: the family, hub id and published config of each; built on the meta device, the parameters of
    the published checkpoint."""
    from lab.models import published
    assert families.family_of(name) == family and families.family_of(families.hub_id(name)) == family
    assert f"-{name.split('-')[-1]}-" in families.hub_id(name).lower()  # 72b in Qwen/Qwen2.5-VL-72B-Instruct
    model = published.meta_model(name)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.003)
