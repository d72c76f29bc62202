"""Shared test settings: hypothesis without per-example deadlines (CI machines are slow)."""
from hypothesis import settings

settings.register_profile("repo", deadline=None, print_blob=True)
settings.load_profile("repo")
