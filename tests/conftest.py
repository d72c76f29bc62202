"""Shared test settings: hypothesis without per-example deadlines (CI machines are slow), and the benchmarks in
their official layouts (benchmarks.py) written once, before any test reads them from benchmarks.ROOT."""
import pytest
from hypothesis import settings

import benchmarks

settings.register_profile("repo", deadline=None, print_blob=True)
settings.load_profile("repo")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: the real size on a CUDA GPU; runs only when selected (python -m pytest "
                            "-m gpu) and skips without CUDA")
    benchmarks.generate()


def pytest_collection_modifyitems(config, items):
    """A gpu test runs only when `-m gpu` selects it: never in the normal suite, even on a GPU machine."""
    if "gpu" not in (config.getoption("-m") or ""):
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="a GPU test: run it with python -m pytest -m gpu"))
