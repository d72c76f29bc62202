"""The time of a forward on a GPU: the roofline bound and the expected time (docs/efficiency.md, "The plan's time").

A forward that does F FLOPs and moves Q bytes (weights read once, the KV cache read and written, the activations
written and read once) on an accelerator of peak compute P and bandwidth W takes at least max(F / P, Q / W): the
bound. It is expected to take max(F / (c P), Q / (b W)) + o x (layers it runs): c, the share of its peak compute a
transformers forward achieves, and o, the host's time a layer costs (kernel launches, Python), are the two constants
fitted per accelerator (Accelerator.fitted names the measurements); b, the share of the bandwidth a weight read
achieves, is the same for every accelerator (BANDWIDTH_SHARE)."""
from collections import namedtuple

import torch

Accelerator = namedtuple("Accelerator", "name flops bandwidth compute overhead fitted")

BANDWIDTH_SHARE = 0.8  # streamed reads of GBs of weights reach ~80% of the data sheet's bandwidth (docs/efficiency.md)

STAVE = ("fitted on one Idefics2-8B VQAv2 query at batch 1 on an H200 (STAVE, 2026): o on its 23.9 ms a generated "
         "token, c on its 98 ms and 1,430 ms to the first token zero-shot and with 8 ICDs (the worse ratio least)")
TABLE6 = ("c fitted on the paper's Table 6 (Idefics2-8B, 56.69 and 158.21 ms a query zero-shot and 8-shot, read as "
          "the time to the first token at batch 1), o the H200's")
CARRIED = "not fitted: the H200's c and o carried over (no published measurement of this class of run on it)"

OVERHEAD = 0.631e-3  # o, seconds a layer run: STAVE's fit

ACCELERATORS = {  # the data sheets' dense bf16 peak FLOP/s and memory bandwidth (bytes/s): docs/efficiency.md
    "h200": Accelerator("an H200 SXM", 989e12, 4.8e12, 0.035, OVERHEAD, STAVE),
    "h100": Accelerator("an H100 SXM", 989e12, 3.35e12, 0.263, OVERHEAD, TABLE6),
    "h100-pcie": Accelerator("an H100 PCIe", 756e12, 2.0e12, 0.035, OVERHEAD, CARRIED),
    "a100": Accelerator("an A100 SXM 80GB", 312e12, 2.039e12, 0.035, OVERHEAD, CARRIED),
    "l40s": Accelerator("an L40S", 362e12, 0.864e12, 0.035, OVERHEAD, CARRIED),
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
        return {"bound": self.bound / unit, "expected": self.expected / unit}


ZERO = Time(0.0, 0.0)


def forward(acc, flops, moved, layers, passes=1):
    """Time of `passes` passes (1: a forward; 2: a forward and its backward) doing `flops` FLOPs and moving `moved`
    bytes in all, running `layers` layers each pass."""
    bound = max(flops / acc.flops, moved / acc.bandwidth)
    compute = max(flops / (acc.flops * acc.compute), moved / (acc.bandwidth * BANDWIDTH_SHARE))
    return Time(bound, compute + passes * layers * acc.overhead)


def stated(acc):
    """The line the plan prints of the accelerator and its constants."""
    return (f"time on {acc.name} ({acc.flops / 1e12:.0f} TFLOP/s dense bf16, {acc.bandwidth / 1e12:.3g} TB/s): "
            f"bound max(FLOPs / peak, bytes / bandwidth); expected max(FLOPs / ({acc.compute:.3g} x peak), bytes / "
            f"({BANDWIDTH_SHARE} x bandwidth)) + {acc.overhead * 1e3:.3g} ms a layer run ({acc.fitted}); "
            "lab/studies/roofline.py")
