"""The time of a forward on a GPU: the roofline bound and the expected time (docs/efficiency.md, "The plan's time").

A forward that does F FLOPs and moves Q bytes (weights read once, the KV cache read and written, the activations
written and read once) on an accelerator of peak compute P and bandwidth W takes at least max(F / P, Q / W): the
bound. It is expected to take max(F / (c P), Q / (b W)) + o x (layers it runs): c, the share of its peak compute a
transformers forward achieves, and o, the host's time a layer costs (kernel launches, Python), are the two constants
fitted per accelerator (Accelerator.fitted names the measurements); b, the share of the bandwidth a weight read
achieves, is the same for every accelerator (BANDWIDTH_SHARE)."""
import json
import math
from collections import namedtuple

import torch

from lab.disk import files
from lab.studies import flops

Accelerator = namedtuple("Accelerator", "name flops bandwidth compute overhead fitted memory")

BANDWIDTH_SHARE = 0.8  # streamed reads of GBs of weights reach ~80% of the data sheet's bandwidth (docs/efficiency.md)

STAVE = ("fitted on one Idefics2-8B VQAv2 query at batch 1 on an H200 (STAVE, 2026): o on its 23.9 ms a generated "
         "token, c on its 98 ms and 1,430 ms to the first token zero-shot and with 8 ICDs (the worse ratio least)")
TABLE6 = ("c fitted on the paper's Table 6 (Idefics2-8B, 56.69 and 158.21 ms a query zero-shot and 8-shot, read as "
          "the time to the first token at batch 1), o the H200's")
CARRIED = "not fitted: the H200's c and o carried over (no published measurement of this class of run on it)"

OVERHEAD = 0.631e-3  # o, seconds a layer run: STAVE's fit

ACCELERATORS = {  # the data sheets' dense bf16 peak FLOP/s, memory bandwidth (bytes/s) and memory (bytes, the plan
    # past one GPU's: lab/studies/shard_plan.py): docs/efficiency.md
    "h200": Accelerator("an H200 SXM", 989e12, 4.8e12, 0.035, OVERHEAD, STAVE, 141e9),
    "h100": Accelerator("an H100 SXM", 989e12, 3.35e12, 0.263, OVERHEAD, TABLE6, 80e9),
    "h100-pcie": Accelerator("an H100 PCIe", 756e12, 2.0e12, 0.035, OVERHEAD, CARRIED, 80e9),
    "a100": Accelerator("an A100 SXM 80GB", 312e12, 2.039e12, 0.035, OVERHEAD, CARRIED, 80e9),
    "l40s": Accelerator("an L40S", 362e12, 0.864e12, 0.035, OVERHEAD, CARRIED, 48e9),
}


def accelerator(name, plan=None):
    """The Accelerator of --accelerator `name`; with --plan cuda on a machine that has one, its own device's (its
    name read from torch: "NVIDIA H100 80GB HBM3" is h100), else `name`'s."""
    if plan == "cuda" and torch.cuda.is_available():
        device = torch.cuda.get_device_name().lower()
        found = [k for k in sorted(ACCELERATORS, key=len, reverse=True) if k.split("-")[0] in device]
        pcie = [k for k in found if "pcie" in k] if "pcie" in device else [k for k in found if "pcie" not in k]
        if pcie:
            return ACCELERATORS[pcie[0]]
    if name not in ACCELERATORS:
        raise ValueError(f"--accelerator {name}: not one the plan knows; give one of {', '.join(ACCELERATORS)}")
    return ACCELERATORS[name]


class Time(namedtuple("Time", "bound expected")):
    """Seconds: the roofline bound and the expected time; added and scaled as one."""

    def __add__(self, other):
        return Time(self.bound + other.bound, self.expected + other.expected)

    def __mul__(self, k):
        return Time(self.bound * k, self.expected * k)

    def json(self, unit=1.0):
        """{"bound", "expected"} in `unit`s of a second (1e-3: ms; 3600: hours)."""
        return {"bound": self.bound / unit, "expected": self.expected / unit}


ZERO = Time(0.0, 0.0)


def forward(acc, work, moved, layers, passes=1):
    """Time of `passes` passes (1: a forward; 2: a forward and its backward) doing `work` FLOPs and moving `moved`
    bytes in all, running `layers` layers each pass."""
    bound = max(work / acc.flops, moved / acc.bandwidth)
    compute = max(work / (acc.flops * acc.compute), moved / (acc.bandwidth * BANDWIDTH_SHARE))
    return Time(bound, compute + passes * layers * acc.overhead)


def stated(acc):
    """The line the plan prints of the accelerator and its constants."""
    return (f"time on {acc.name} ({acc.flops / 1e12:.0f} TFLOP/s dense bf16, {acc.bandwidth / 1e12:.3g} TB/s): "
            f"bound max(FLOPs / peak, bytes / bandwidth); expected max(FLOPs / ({acc.compute:.3g} x peak), bytes / "
            f"({BANDWIDTH_SHARE} x bandwidth)) + {acc.overhead * 1e3:.3g} ms a layer run ({acc.fitted}); "
            "lab/studies/roofline.py")


def prefill(acc, f, batch, tokens, images, patches, logits=1, passes=1):
    """Time of a forward (passes=2: and its backward) of `batch` rows of `tokens` tokens holding `images` images of
    `patches` patches each, logits at `logits` positions (f: flops.flop_model)."""
    return forward(acc, passes * batch * flops.forward_flops(f, tokens, images, logits, patches),
                   passes * flops.moved(f, batch, tokens, images, patches),
                   f["layers"] + (f["image_layers"] if images else 0), passes)


def step(acc, f, batch, past):
    """Time of one generated token of `batch` rows over a cache of `past` tokens."""
    return forward(acc, batch * flops.step_flops(f, past), flops.moved(f, batch, 1, 0, 0, past), f["layers"])


def query_times(acc, f, batch, prompt, images, patches, new):
    """One query's time to the first token (its batch's prefill) and a generated token's (the cache half-grown)."""
    return {"ttft": prefill(acc, f, batch, prompt, images, patches),
            "per_token": step(acc, f, batch, prompt + new // 2)}


def train_times(acc, f, batch, micro_batches, n, teacher, student, heldout, shots, patches, answer):
    """A training's time by phase: "teacher" (its passes over the n queries, in batches; teacher: their mean tokens,
    0: it reads another run's cache), "training" (micro_batches forwards and backwards of the student at its mean
    tokens, logits at the answer's, and `heldout` held-out forwards)."""
    k = math.ceil(n / batch)
    return {"teacher": prefill(acc, f, batch, teacher, shots + 1, patches, 0) * k if teacher else ZERO,
            "training": prefill(acc, f, batch, student, 1, patches, answer + 1, passes=2) * micro_batches +
            prefill(acc, f, batch, student, 1, patches) * math.ceil(heldout / batch)}


def eval_times(acc, f, batch, n, prompt, images, patches, new):
    """An evaluation's time by phase, its n items in batches of `batch` at the mean prompt: "prefill" and "decoding"
    (`new` tokens, the most the task generates)."""
    k = math.ceil(n / batch)
    return {"prefill": prefill(acc, f, batch, prompt, images, patches) * k,
            "decoding": sum((step(acc, f, batch, prompt + j) for j in range(new)), ZERO) * k}


def run_record(script, task, method, shots, batch, query, hours):
    """One entry of the plan's JSON: a run at one batch size, its query's times (None: a training) and hours."""
    ms = lambda key: query[key].json(1e-3) if query else None
    return {"script": script, "task": task, "method": method, "shots": shots, "batch": batch,
            "ttft_ms": ms("ttft"), "per_token_ms": ms("per_token"), "hours": hours.json(3600)}


def query_line(query, batch):
    """The plan's words for one query's times at `batch`."""
    pair = lambda t: f"{t.bound * 1e3:.3g} / {t.expected * 1e3:.3g} ms"
    return f"batch {batch}: to the first token {pair(query['ttft'])}, a generated token {pair(query['per_token'])}"


def write_json(path, acc, runs, hours):
    """--plan-json: the plan's times ({"accelerator", "runs", "hours"}: docs/efficiency.md), written atomically."""
    text = json.dumps({"accelerator": acc.name, "runs": runs, "hours": hours.json(3600)}, indent=1)
    files.atomic_write(path, lambda f: f.write(text.encode()))
    print(f"plan's times written to {path}")
