"""The harness's settings beside the paper's: what train() and evaluate() read that the paper does not set (RICES's
encoder and cache, the teacher cache, checkpoints, --proceed, the vision tower's memory). train.py's and evaluate.py's
Config inherit them with their defaults, so the scripts run with them unchanged; only `python -m lab train` and
`python -m lab evaluate` show them as flags (lab/cli/commands.py), each field a flag, its comment the help."""
import os
from dataclasses import dataclass, field
from typing import Literal, Optional

from lab.models import chunks


@dataclass
class TrainSettings:
    """train.py's harness: the fields train() reads beside the paper's settings."""
    icd_task: Optional[str] = None    # the teacher's ICDs from this task's training split, the queries --task's
    anchor_norm: Literal["none", "first"] = "none"  # none: Eq 17; first: the anchor over its first-step value
    image_memory: float = chunks.IMAGE_MEMORY / 1e9  # GB the vision tower may hold at once (chunks.image_work)
    rices_encoder: Optional[str] = None              # RICES's image encoder (default: the backbone's vision tower)
    rices_cache: str = field(default_factory=lambda: os.path.expanduser("~/.cache/hyper-icl/rices"))  # its features
    teacher_cache: Optional[str] = None  # None: <out>/teacher
    no_teacher_cache: bool = False     # recompute the teacher at every step (no disk)
    save_every: int = 50               # checkpoint every this many steps (and every epoch)
    proceed: bool = False              # start, continue (--resume) or, finished, skip: one command whatever --out holds
    shard: bool = False                # under torchrun: the backbone sharded over the processes (lab/run/shard.py)


@dataclass
class EvalSettings:
    """evaluate.py's harness: the fields evaluate() reads beside the evaluation's own."""
    icd_task: Optional[str] = None    # --shots' ICDs from this task's training split (Table 8), the queries --task's
    rices_encoder: Optional[str] = None  # RICES's image encoder, a CLIP hub id or path (None: the backbone's own)
    rices_cache: str = field(default_factory=lambda: os.path.expanduser("~/.cache/hyper-icl/rices"))  # its features
    image_memory: float = chunks.IMAGE_MEMORY / 1e9  # GB the vision tower may hold at once, as train.py's
    shard: bool = False                  # under torchrun: the backbone sharded over the processes, as train.py's
