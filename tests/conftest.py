"""Shared test settings: the repository root, tests/, tests/paper/ and tools/ on sys.path (so `python -m pytest
tests/paper`, the whole suite, a bare `pytest` and a run from inside tests/ all import the same files), hypothesis
without per-example deadlines (CI machines are slow), the shared fixtures (`backbone`: the tiny Idefics2 twin, or
each family's in a module that sets BACKBONES; `plain`: a module's backbone without an adapter; `twin_folder`: the
tiny twin as a checkpoint folder; `whole`: one uninterrupted tiny run; `items`, `pool`, `bench`:
tools/benchmarks.py's VQAv2 and COCO; `setup`: a 2-shot micro-batch's inputs; `adapter`, `checkpoint`: Hyper-ICL
adapter files), and the benchmarks in their official layouts (tools/benchmarks.py) written once, before any test
reads them from benchmarks.ROOT. The flags of the tiny runs and the other shared helpers: helpers.py."""
import os
import sys

import pytest
from hypothesis import settings

TESTS = os.path.dirname(os.path.abspath(__file__))
TOOLS = os.path.join(os.path.dirname(TESTS), "tools")
sys.path[:0] = [p for p in (os.path.dirname(TESTS), TESTS, os.path.join(TESTS, "paper"), TOOLS) if p not in sys.path]

import benchmarks  # noqa: E402 (after the paths above)
import model as M  # noqa: E402
from helpers import lab_train

settings.register_profile("repo", deadline=None, print_blob=True)
settings.load_profile("repo")


@pytest.fixture(scope="module")
def backbone(request):
    """The tiny Idefics2 twin, or the tiny twin of each family in the module's BACKBONES, loaded once for the module."""
    from lab.models import backbones
    return backbones.load_backbone("tiny-" + getattr(request, "param", "idefics2"))


@pytest.fixture()
def plain(backbone):
    """The test module's `backbone` fixture with no adapter before and after the test."""
    yield backbone
    if hasattr(backbone.model, "icl_settings"):
        M.detach(backbone.model)


@pytest.fixture(scope="module")
def twin_folder(tmp_path_factory):
    """The tiny Idefics2 twin saved as a checkpoint folder (config.json, model.safetensors, generation_config.json,
    the processor's files)."""
    from lab.models import backbones
    folder = tmp_path_factory.mktemp("twin") / "idefics2"
    backbone = backbones.load_backbone("tiny-idefics2")
    backbone.model.save_pretrained(folder)
    backbone.processor.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def items():
    """The first 3 VQAv2 validation items of tools/benchmarks.py."""
    from lab.datasets import tasks
    return tasks.load_task("vqav2", "val", benchmarks.ROOT)[:3]


@pytest.fixture(scope="module")
def pool():
    """VQAv2's training split of tools/benchmarks.py (the ICDs' pool)."""
    from lab.datasets import tasks
    return tasks.load_task("vqav2", "train", benchmarks.ROOT)


@pytest.fixture(scope="module")
def bench():
    """{(task, split): items} of tools/benchmarks.py's VQAv2 and COCO."""
    import data
    from lab.datasets import tasks
    return {(t, s): tasks.load_task(t, s, benchmarks.ROOT) for t in ("vqav2", "coco") for s in data.SPLITS}


@pytest.fixture(scope="module")
def setup():
    """(args, the tiny twin, 4 VQAv2 training queries, their 2 ICDs each) of a 2-shot run on tools/benchmarks.py."""
    import data
    import train
    from helpers import BENCH
    from lab.datasets import tasks
    from lab.models import backbones
    args = train.parse_args([*BENCH, "--shots", "2"])
    backbone = backbones.load_backbone(args.model)
    queries = tasks.load_task(args.task, "train", args.data_root)[:4]
    pool = tasks.load_task(args.task, "train", args.data_root)
    icds = data.demonstrations([q.id for q in queries], pool, 2, args.seed)
    return args, backbone, queries, icds


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A Hyper-ICL adapter file of the tiny twin (untrained), its tensors and its metadata."""
    from safetensors import safe_open
    from safetensors.torch import load_file
    from lab.methods import registry
    from lab.models import backbones
    from lab.run import adapter_files
    path = str(tmp_path_factory.mktemp("adapter") / "adapter.safetensors")
    backbone = backbones.load_backbone("tiny-idefics2")
    registry.attach(backbone.model, "hyper-icl", rank=4)
    adapter_files.save_adapter(path, backbone)
    with safe_open(path, "pt") as f:
        return path, load_file(path), f.metadata()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Hyper-ICL checkpoint for tiny-idefics2 with random (non-identity) weights, so the gate varies."""
    import torch
    from lab.methods import registry
    from lab.models import backbones
    from lab.run import adapter_files
    backbone = backbones.load_backbone("tiny-idefics2")
    registry.attach(backbone.model, "hyper-icl", rank=4)
    torch.manual_seed(0)
    for p in M.adapter_modules(backbone.model).parameters():
        torch.nn.init.normal_(p, std=0.3)
    path = str(tmp_path_factory.mktemp("run") / "adapter.safetensors")
    adapter_files.save_adapter(path, backbone)
    return path


@pytest.fixture(scope="session")
def whole(tmp_path_factory):
    """An uninterrupted run (helpers.run_flags): its folder `run` (adapter.safetensors, history.json, last.pt) and
    its teacher cache `teacher`, made once for the session; tests read it and copy what they change."""
    from helpers import lab_train, run_flags
    tmp = tmp_path_factory.mktemp("whole")
    lab_train(run_flags(tmp, "run"))
    return tmp


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: the real size on a CUDA GPU; runs only when selected (python -m pytest "
                            "-m gpu) and skips without CUDA")
    benchmarks.generate()


@pytest.fixture(params=["private", "public"])
def attention_kernels(request):
    """Each of adapters.fused_attention_lse's paths in turn: torch's private kernels, then the public path they are
    taken away for (adapters.PRIVATE_KERNELS naming kernels no torch has, as on a torch that lacks them). The same for
    every example of a hypothesis test: such a test suppresses HealthCheck.function_scoped_fixture."""
    import adapters
    with pytest.MonkeyPatch.context() as patch:
        if request.param == "public":
            patch.setattr(adapters, "PRIVATE_KERNELS", {device: ("_taken_away" + name, schema)
                                                        for device, (name, schema) in adapters.PRIVATE_KERNELS.items()})
        yield request.param


def pytest_generate_tests(metafunc):
    """A module's BACKBONES (family names) parametrise its tests that take `backbone` (or `plain`): one run each."""
    families = getattr(metafunc.module, "BACKBONES", None)
    if families and "backbone" in metafunc.fixturenames:
        metafunc.parametrize("backbone", families, indirect=True, scope="module")


def pytest_collection_modifyitems(config, items):
    """A gpu test runs only when `-m gpu` selects it: never in the normal suite, even on a GPU machine. A test of a
    family this transformers cannot serve (one of its parameters names it: CI's floor leg) is skipped, saying why."""
    from lab.models import families
    if "gpu" not in (config.getoption("-m") or ""):
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="a GPU test: run it with python -m pytest -m gpu"))
    for item in items:
        named = [v for v in getattr(getattr(item, "callspec", None), "params", {}).values()
                 if isinstance(v, str) and v.removeprefix("tiny-") in families.FAMILIES]
        missing = [families.FAMILIES[v.removeprefix("tiny-")].missing() for v in named]
        if any(missing):
            item.add_marker(pytest.mark.skip(reason=next(m for m in missing if m)))
