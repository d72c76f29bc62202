"""The hyper_icl model (lab/cli/lmms_eval_model.py) in the real lmms-eval, offline: local tasks over a parquet file in
lmms-lab's VQAv2 layout and a multiple-choice twin, scored by lmms-eval's own VQAv2 functions. The adapter (the default
job's recipe, a short run) answers item by item as evaluate.predict does, 100 with it and 0 zero-shot, through
simple_evaluate and through `python -m lmms_eval` run from the project's root; the gold option has the best
likelihood. Skipped where lmms-eval is not installed (requirements-lmms-eval.txt; .ci/run installs it)."""
import glob
import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

E = pytest.importorskip("evaluate")  # this project's evaluate.py, taken before lmms-eval swaps the name (see below)
pytest.importorskip("lmms_eval", reason="lmms-eval is not installed (README, 'In lmms-eval': pip install -r "
                    "requirements-lmms-eval.txt && pip install --no-deps --no-build-isolation lmms-eval==0.7.3 "
                    "./lab/cli/lmms-eval-entry; .ci/run runs these tests)")
import datasets  # noqa: E402 (lmms-eval's dependency)
from lmms_eval import evaluator  # noqa: E402
from lmms_eval.tasks import TaskManager, get_task_dict  # noqa: E402

import data as D  # noqa: E402
from lab.datasets import tasks, toy_world  # noqa: E402
from lab.cli import lmms_eval_model  # noqa: E402
from helpers import lab_train, ROOT  # noqa: E402
TASK, N = "toy-icl-colour", 16
assert E.__file__ == os.path.join(ROOT, "evaluate.py")

UTILS = '''"""The local tasks' functions: lmms-eval's own VQAv2 image and scoring, this project's prompt."""
import data
from lmms_eval.tasks.vqav2.utils import vqav2_doc_to_visual, vqav2_process_results_val

COLOURS = {colours!r}


def doc_to_text(doc, lmms_eval_specific_kwargs=None):
    return data.PROMPTS["vqa"]["instruction"] + data.PROMPTS["vqa"]["query"].format(question=doc["question"])


def doc_to_choice(doc):
    return list(COLOURS)


def doc_to_target(doc):
    return COLOURS.index(doc["multiple_choice_answer"])
'''
COMMON = """dataset_path: parquet
dataset_kwargs:
  data_files:
    validation: {parquet}
test_split: validation
doc_to_visual: !function utils.vqav2_doc_to_visual
doc_to_text: !function utils.doc_to_text
"""
VQA = """task: toy_vqav2
output_type: generate_until
doc_to_target: multiple_choice_answer
generation_kwargs:
  until: ["\\n", "Question", "Short answer"]
  max_new_tokens: {tokens}
  temperature: 0
process_results: !function utils.vqav2_process_results_val
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""
CHOICE = """task: toy_choice
output_type: multiple_choice
doc_to_choice: !function utils.doc_to_choice
doc_to_target: !function utils.doc_to_target
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def items():
    return tasks.load_task(TASK, "val")[:N]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """The default job's adapter (Hyper-ICL, toy-idefics2, toy-icl-colour), from a short run (about 25 s)."""
    out = str(tmp_path_factory.mktemp("run"))
    lab_train(["--model", "toy-idefics2", "--task", TASK, "--out", out, "--n-train", "64", "--n-heldout", "8",
               "--epochs", "3", "--lr", "2e-2"])
    return os.path.join(out, "adapter.safetensors")


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, items):
    """The two task YAMLs, their utils.py and the items as lmms-lab/VQAv2's validation parquet (its columns)."""
    folder = tmp_path_factory.mktemp("lmms_tasks")
    answers = [{"answer": datasets.Value("string"), "answer_confidence": datasets.Value("string"),
                "answer_id": datasets.Value("int64")}]  # a list of these structs, as lmms-lab's file holds
    features = datasets.Features({"question_type": datasets.Value("string"),
                                  "multiple_choice_answer": datasets.Value("string"), "answers": answers,
                                  "image_id": datasets.Value("int64"), "answer_type": datasets.Value("string"),
                                  "question_id": datasets.Value("int64"), "question": datasets.Value("string"),
                                  "image": datasets.Image()})
    rows = [{"question_type": "what is", "multiple_choice_answer": it.target,
             "answers": [{"answer": a, "answer_confidence": "yes", "answer_id": k + 1}
                         for k, a in enumerate(it.answers)],
             "image_id": it.id, "answer_type": "other", "question_id": it.id, "question": it.question,
             "image": {"bytes": open(it.image_path, "rb").read(), "path": None}} for it in items]
    parquet = folder / "validation-00000-of-00001.parquet"
    datasets.Dataset.from_list(rows, features=features).to_parquet(str(parquet))
    (folder / "utils.py").write_text(UTILS.format(colours=tuple(toy_world.ICL_COLOURS)))
    common = COMMON.format(parquet=parquet)
    (folder / "toy_vqav2.yaml").write_text(VQA.format(tokens=D.TASKS[TASK].max_new_tokens) + common)
    (folder / "toy_choice.yaml").write_text(CHOICE + common)
    return str(folder)


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No hub, no download, and datasets' cache in the test's folder (the subprocess inherits them)."""
    cache = str(tmp_path / "cache")
    for k, v in {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": cache}.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="module")
def expected(items, adapter):
    """evaluate.predict's answers zero-shot and with the adapter."""
    from lab.models import backbones
    from lab.run import adapter_files
    backbone = backbones.load_backbone("toy-idefics2")
    zero = E.predict(backbone, TASK, items, batch_size=8)
    adapter_files.load_adapter(adapter, backbone)
    return {None: zero, adapter: E.predict(backbone, TASK, items, batch_size=8)}


def by_doc(samples):
    """lmms-eval's logged samples of a task: doc_id -> the filtered answer (a list of one in simple_evaluate's samples,
    the answer itself in the samples file)."""
    answer = lambda r: r[0] if isinstance(r, list) else r  # noqa: E731
    return {s["doc_id"]: answer(s["filtered_resps"]) for s in samples}


@pytest.mark.parametrize("with_adapter", [False, True], ids=["zero-shot", "adapter"])
def test_simple_evaluate_answers_as_predict(with_adapter, adapter, task_dir, items, expected):
    checkpoint = adapter if with_adapter else None
    model = lmms_eval_model.HyperICL("toy-idefics2", checkpoint, batch_size=8)
    out = evaluator.simple_evaluate(model=model, tasks=["toy_vqav2"], log_samples=True,
                                    task_manager=TaskManager(include_path=task_dir))
    answers = by_doc(out["samples"]["toy_vqav2"])
    assert [answers[k] for k in range(N)] == expected[checkpoint]
    assert out["results"]["toy_vqav2"]["exact_match,none"] == (1.0 if with_adapter else 0.0)


def test_the_command_line_from_the_project_root(adapter, task_dir, items, expected, tmp_path):
    """`python -m lmms_eval --model hyper_icl` run from the root: the entry point registers the model, the clash of
    evaluate.py with Hugging Face's `evaluate` is undone, and the results file (lmms-eval exits 0 even when a run
    fails) holds 100 and the answers of evaluate.predict."""
    assert any(ep.name == "hyper_icl" for ep in importlib.metadata.entry_points(group="lmms_eval.models")), \
        "hyper_icl is not registered: pip install --no-deps --no-build-isolation ./lab/cli/lmms-eval-entry"
    run = subprocess.run([sys.executable, "-m", "lmms_eval", "--model", "hyper_icl", "--model_args",
                          f"backbone=toy-idefics2,checkpoint={adapter}", "--tasks", "toy_vqav2", "--include_path",
                          task_dir, "--batch_size", "8", "--device", "cpu", "--log_samples", "--output_path",
                          str(tmp_path / "out")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    found = glob.glob(str(tmp_path / "out" / "**" / "*_results.json"), recursive=True)
    assert len(found) == 1, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.returncode == 0 and "exact_match" in run.stdout and "toy_vqav2" in run.stdout, run.stderr[-3000:]
    assert json.load(open(found[0]))["results"]["toy_vqav2"]["exact_match,none"] == 1.0
    samples = glob.glob(str(tmp_path / "out" / "**" / "*_samples_toy_vqav2.jsonl"), recursive=True)
    answers = by_doc(json.loads(line) for line in open(samples[0]))
    assert [answers[k] for k in range(N)] == expected[adapter]


def choice_pairs(model, task_dir):
    """The (nll, is_greedy) pairs of toy_choice's requests, by doc: lmms-eval's own requests of its own task."""
    task = get_task_dict(["toy_choice"], TaskManager(include_path=task_dir))["toy_choice"]
    task.build_all_requests(rank=0, world_size=1)
    model.task_dict["toy_choice"] = task.dataset
    requests = sorted(task.instances, key=lambda r: (r.doc_id, r.idx))
    pairs = model.loglikelihood(requests)
    return task, {d: [p for r, p in zip(requests, pairs) if r.doc_id == d] for d in range(N)}


def test_the_gold_option_has_the_best_likelihood(adapter, task_dir, items):
    """With the adapter every greedy answer is the gold colour, so the gold option must have the lowest nll (lmms-eval
    takes np.argmin of the pair's first member) and be the greedy one; scored here by lmms-eval's rule."""
    model = lmms_eval_model.HyperICL("toy-idefics2", adapter, batch_size=8)
    task, pairs = choice_pairs(model, task_dir)
    colours = list(toy_world.ICL_COLOURS)
    for d, it in enumerate(items):
        nll = [p[0] for p in pairs[d]]
        assert len(nll) == 4 and min(range(4), key=nll.__getitem__) == colours.index(it.target)
        assert [p[1] for p in pairs[d]] == [c == it.target for c in colours]
        assert task.process_results(task.dataset["validation"][d], pairs[d])["acc"] == 1.0


def test_lmms_eval_073_multiple_choice_breaks_on_every_model(adapter, task_dir):
    """The README's note: lmms-eval 0.7.3's evaluator stores each response through api/instance.py's
    unwrap_generation_output, which turns a (float, bool) pair into its string, so its multiple-choice scoring cannot
    unpack them, whatever the model (simple_evaluate fails after tenacity's five tries). Fails once an lmms-eval
    version keeps the pairs (then the README's note goes)."""
    from lmms_eval.api.instance import unwrap_generation_output
    model = lmms_eval_model.HyperICL("toy-idefics2", adapter, batch_size=8)
    task, pairs = choice_pairs(model, task_dir)
    stored = [unwrap_generation_output(p)[0] for p in pairs[0]]
    assert stored == [str(p) for p in pairs[0]]
    with pytest.raises(ValueError, match="too many values to unpack"):  # without tenacity's retries around it
        task.process_results.__wrapped__(task, task.dataset["validation"][0], stored)


def test_multi_round_and_bad_model_args_are_refused_in_one_line():
    model = lmms_eval_model.HyperICL("tiny-idefics2")
    with pytest.raises(NotImplementedError, match="single-round"):
        model.generate_until_multi_round([])
    with pytest.raises(ValueError, match="unknown model args colour"):
        lmms_eval_model.HyperICL("tiny-idefics2", colour="red")
    with pytest.raises(ValueError, match="batch_size=auto: give a number"):
        lmms_eval_model.HyperICL("tiny-idefics2", batch_size="auto")


def test_lmms_eval_gets_hugging_face_evaluate_from_the_project_root():
    """Run from the root, where evaluate.py comes first on sys.path, lmms-eval's registry holds Hugging Face's
    `evaluate` once the model registry (and so lab/cli/lmms_eval_model.py) has loaded, in either import order."""
    import lmms_eval.api.registry as registry
    assert registry.hf_evaluate is sys.modules["evaluate"] and hasattr(registry.hf_evaluate, "load")
    for first, then in [("lmms_eval.evaluator", "lmms_eval.models"), ("lmms_eval.models", "lmms_eval.api.registry")]:
        code = f"import {first}, {then}, lmms_eval.api.registry as r, evaluate; print(r.hf_evaluate.__file__, " \
               "evaluate.__file__)"
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
        held = out.stdout.split()
        assert len(held) == 2 and not any(p.startswith(ROOT + os.sep) for p in held), out.stdout + out.stderr[-2000:]


class Request:
    """An lmms-eval Instance's args: (context, generation kwargs, doc_to_visual, doc_id, task, split)."""

    def __init__(self, context, doc_id, kwargs=None):
        self.args = (context, kwargs or {"until": ["\n"], "max_new_tokens": 3}, lambda doc: doc, doc_id, "t", "s")


def test_text_only_requests_generation_kwargs_and_bad_model_args(tmp_path, monkeypatch):
    """Issue 52, items 8 and 15: a request without an image (ScienceQA's text-only questions) is answered, not "max()
    arg is an empty sequence"; max_new_tokens null is the default, num_beams and top_p are taken, another kwarg is
    said to be ignored; device=cuda without CUDA and batch_size=0 are refused before the backbone loads; an EPS image
    is refused naming the doc."""
    from PIL import Image
    model = lmms_eval_model.HyperICL("tiny-idefics2", batch_size=4)
    image = Image.new("RGB", (32, 32), (200, 10, 10))
    model.task_dict = {"t": {"s": {0: [], 1: [image], 2: []}}}  # a doc is its own visuals here
    answers = model.generate_until([Request("Question: Is it red? Answer:", d) for d in (0, 2)] +
                                   [Request("<image>Question: Is it red? Answer:", 1)])
    assert len(answers) == 3 and all(isinstance(a, str) for a in answers)
    until, settings = model.generation({"until": "\n", "max_new_tokens": None, "num_beams": 2, "top_p": 0.5,
                                        "temperature": 0.7, "image_aspect_ratio": "pad"}, "t")
    assert until == ["\n"] and settings == dict(do_sample=True, temperature=0.7, top_p=0.5, max_new_tokens=16,
                                                 num_beams=2)
    with pytest.raises(ValueError, match="task t: generation kwarg max_new_tokens=0"):
        model.generation({"max_new_tokens": 0}, "t")
    eps = tmp_path / "x.eps"
    image.save(eps)
    with pytest.raises(ValueError, match="doc 5: an image in EPS format"):
        model.row("<image>Is it red?", [Image.open(eps)], 5)
    monkeypatch.setattr(lmms_eval_model.backbones, "load_backbone", None)  # loading would fail: checked before
    monkeypatch.setattr(lmms_eval_model.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device=cuda, but torch finds no CUDA device here"):
        lmms_eval_model.HyperICL("tiny-idefics2", device="cuda")
    with pytest.raises(ValueError, match="batch_size=0"):
        lmms_eval_model.HyperICL("tiny-idefics2", batch_size=0)
    with pytest.raises(ValueError, match="batch_size=²: give a number"):  # a Unicode digit: before, int()'s error
        lmms_eval_model.HyperICL("tiny-idefics2", batch_size="²")


def test_hyper_icl_outside_the_project_root_says_why(tmp_path):
    code = "from lmms_eval.models import get_model; get_model('hyper_icl')"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and f"{tmp_path} is not the project's root" in out.stderr, out.stderr[-2000:]


@pytest.fixture(scope="module")
def qwen():
    """hyper_icl on the tiny Qwen2.5-VL twin, whose processor refuses a side over 200 times the other."""
    return lmms_eval_model.HyperICL("tiny-qwen2.5-vl")


@pytest.mark.parametrize("context, size, continuation, message", [
    # issue 63, item 13: a lone surrogate reached the tokenizer ("TextEncodeInput must be ...", a traceback)
    ("<image>Is it red\ud800?", (32, 32), None, r"doc 3: its context holds a lone surrogate \(U\+D800\)"),
    # issue 63, item 14: Qwen's placeholders in a context: StopIteration in get_rope_index; <image> in a continuation
    ("<image>Is it <|vision_start|><|image_pad|><|vision_end|> red?", (32, 32), None,
     r"doc 3: its context holds '<\|vision_start\|>', an image placeholder"),
    ("<image>Is it red?", (32, 32), " yes <image>", r"doc 3: its continuation holds '<image>', an image placeholder"),
    ("<image>Is it red?<|im_end|>", (32, 32), None, r"doc 3: its context holds '<\|im_end\|>', a control token"),
    # issue 63, item 18: a 0 x 0 image: a ZeroDivisionError; 2 x 401: Qwen's processor's message, no doc named
    ("<image>Is it red?", (0, 0), None, r"doc 3: its image 1 is 0 x 0 pixels; each side must be at least 2"),
    ("<image>Is it red?", (2, 401), " yes", r"doc 3: its image 1 is 2 x 401 pixels; .* at most 200 times the other"),
])
def test_a_request_no_backbone_takes_is_refused_naming_the_doc(qwen, context, size, continuation, message):
    from PIL import Image
    with pytest.raises(ValueError, match=message):
        qwen.row(context, [Image.new("RGB", size, "red")], 3, continuation)


def test_a_generation_longer_than_the_backbones_context_is_capped_and_said(qwen, capsys):
    """Issue 63, item 18: max_new_tokens 10**9 ran unbounded; capped at the backbone's positions, said once."""
    positions = qwen.backbone.model.config.get_text_config().max_position_embeddings
    for _ in range(2):
        assert qwen.generation({"max_new_tokens": 10**9}, "t")[1]["max_new_tokens"] == positions < 10**9
    said = capsys.readouterr().out
    assert said.count(f"max_new_tokens=1000000000 is more than tiny-qwen2.5-vl's {positions} positions; "
                      f"capped at {positions}") == 1
    assert qwen.generation({"max_new_tokens": positions}, "t")[1]["max_new_tokens"] == positions
