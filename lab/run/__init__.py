"""One training run's plumbing: its folder and checkpoints, the teacher cache and its room, micro-batches prepared by
DataLoader workers, torchrun, the baselines' losses. Imports the paper's bottom four files, disk, datasets and
models; never scores, studies or cli (tests/test_readme.py)."""
