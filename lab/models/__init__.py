"""Backbones: the paper's four families and their checkpoints, loading one by name, the published configs, tiny
random twins, the shipped toy backbone (toy-idefics2.safetensors) and its builder, the vision tower in chunks.
Imports data.py, model.py, disk and datasets."""
