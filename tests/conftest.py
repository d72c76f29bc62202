"""Shared test settings: hypothesis without per-example deadlines (CI machines are slow), and the benchmarks in
their official layouts (benchmarks.py) written once, before any test reads them from benchmarks.ROOT."""
from hypothesis import settings

import benchmarks

settings.register_profile("repo", deadline=None, print_blob=True)
settings.load_profile("repo")


def pytest_configure(config):
    benchmarks.generate()
