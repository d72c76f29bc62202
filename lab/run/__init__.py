"""One training run's plumbing: its folder and checkpoints, the teacher cache and its room, micro-batches prepared by
DataLoader workers, torchrun, the anchor's scale. Imports the paper's bottom four files, disk, datasets, models and
methods; never scores, studies or cli (tests/test_readme.py)."""
