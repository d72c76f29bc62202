"""lmms-eval's entry point for this project's model `hyper_icl`. The model is the project's lab/cli/lmms_eval_model.py,
imported from the folder lmms-eval runs in (the project's root); run from anywhere else, the import says so instead
of lmms-eval's "hyper_icl not found"."""
import importlib
import os

from lmms_eval.models.registry_v2 import ModelManifest


def manifest():
    """The entry point of group `lmms_eval.models` (pyproject.toml beside this file): `hyper_icl`, its class here. Run
    from the project's root, the model's module is imported now: it undoes the clash of the project's evaluate.py with
    Hugging Face's `evaluate` before lmms-eval's registry uses that name."""
    model_module()
    return ModelManifest(model_id="hyper_icl", simple_class_path="hyper_icl_entry.HyperICL")


def model_module():
    """lab.cli.lmms_eval_model, imported from the folder lmms-eval runs in; None where that is not the project's root."""
    try:
        return importlib.import_module("lab.cli.lmms_eval_model")
    except ModuleNotFoundError as e:
        if e.name not in ("lab", "lab.cli", "lab.cli.lmms_eval_model"):
            raise
        return None


def __getattr__(name):
    """HyperICL of the project's root; elsewhere an ImportError naming the folder and what to do."""
    if name != "HyperICL":
        raise AttributeError(name)
    module = model_module()
    if module is None:
        raise ImportError(f"hyper_icl is the Hyper-ICL project's lab/cli/lmms_eval_model.py, imported from the folder "
                          f"lmms-eval runs in, and {os.getcwd()} is not the project's root: run python -m lmms_eval "
                          "from there (README, \"In lmms-eval\")")
    return module.HyperICL
