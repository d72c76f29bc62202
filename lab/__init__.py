"""The harness beside the paper's six files, in wings by concept, a concept a file. Bottom to top: disk (files
written safely), datasets (tasks and their readers), models (backbones by name), methods (the learnable methods and
their losses by name), run (a training run's plumbing), scores (metrics and result files), studies (the paper's
analyses and the plan), cli (the command lines). A wing imports data, lorentz, adapters, model and the wings below
it, never one above, never train or evaluate, but lab's command line (python -m lab: cli/commands.py and cli/modes.py),
which alone imports the two scripts (tests/test_readme.py checks it)."""
