"""Plan against measurement at full width: full-width, reduced-depth twins, COCO-size photographs, and the
peak RSS of real runs beside what `--plan cpu` says for the same flags. Not a test (each run holds ~5-8 GB): run it
alone, one heavy run at a time.

The twins are the published configs (each family record's, lab/models/published_configs.py) with 1-2 decoder layers,
one vision layer and the perceiver at depth 1, random weights saved in bf16 as the real checkpoints are, the real
tokenizers and processor settings (tools/twins.py). The photographs are skimage.data's colour pictures cut to
640 x 480, every fourth 480 x 640, as JPEG in the VQAv2 layout. Every run is float32 on the CPU, measured by
/usr/bin/time -v (maximum resident set size).

    python tools/memory_twins.py --root /tmp/hyper-icl-memory --lock /tmp/heavy.lock   # every row of the table
    python tools/memory_twins.py --root /tmp/hyper-icl-memory --only idefics2-2-off-b2-train
    python tools/memory_twins.py --root /tmp/hyper-icl-memory --published    # the README's real-model table
    python tools/memory_twins.py --vision                                     # Idefics2's images in chunks
"""
import argparse
import contextlib
import gc
import io
import os
import random
import re
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]
import train  # noqa: E402
import evaluate  # noqa: E402
import twins  # noqa: E402
from lab.cli import commands
from lab.disk import files
from lab.datasets import readers, toy_world
from lab.models import backbones, chunks, families
from lab.studies import efficiency

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "retina", "immunohistochemistry",
          "stereo_motorcycle")  # the colour photographs skimage ships (stereo_motorcycle: its left view)
QUESTIONS = ["What is in the picture?", "What colour is the largest object?", "Is this photo taken indoors?",
             "How many objects can you see in this image?", "What is the main subject of this photograph doing?"]
SPLITS = {"train": 40, "val": 16}
# name: (family, decoder layers, image splitting, batch size, script)
RUNS = {f"{name}-b{batch}-{script}": (family, layers, splitting, batch, script)
        for name, family, layers, splitting, batches in (
            ("idefics2-2-off", "idefics2", 2, "off", (1, 2)),
            ("idefics2-2-on", "idefics2", 2, "on", (1,)), ("onevision-2", "llava-onevision", 2, "checkpoint", (1,)))
        for batch in batches for script in ("train", "evaluate")}


def write_photos(root, splits=SPLITS):
    """The VQAv2 layout under `root` with skimage's photographs cut to 640 x 480 (every fourth 480 x 640): splits
    {split: images}, one question each."""
    import skimage.data
    from PIL import Image
    rng, sources = random.Random(0), [Image.fromarray(photo(getattr(skimage.data, n)())).convert("RGB")
                                      for n in PHOTOS]
    for split, n in splits.items():
        questions, annotations = [], []
        for i in range(n):
            image_id = i + 1 if split == "train" else 100_000 + i
            w, h = (480, 640) if i % 4 == 3 else (640, 480)
            src = sources[i % len(sources)]
            scale = max(w / src.width, h / src.height) * rng.uniform(1.0, 1.3)
            big = src.resize((round(src.width * scale) + 1, round(src.height * scale) + 1))
            x, y = rng.randint(0, big.width - w), rng.randint(0, big.height - h)
            path = readers.coco_image(root, split, image_id)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            big.crop((x, y, x + w, y + h)).save(path, quality=90)
            toy_world.add_vqa(questions, annotations, image_id, QUESTIONS[i % len(QUESTIONS)], ["yes"] * 10, "yes/no")
        toy_world.write_vqa(root, split, "skimage photographs at COCO size", questions, annotations)
    return root


def photo(array):
    """The picture of a skimage.data entry (stereo_motorcycle's is a tuple: its left view first)."""
    return array[0] if isinstance(array, tuple) else array


def twin_config(family, layers):
    """The published config of `family` (its record's) with `layers` decoder layers, one vision layer, the perceiver at
    depth 1."""
    config = families.FAMILIES[family].published()
    text = config.get_text_config()
    text.num_hidden_layers = layers
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:layers]
    config.vision_config.num_hidden_layers = 1
    if hasattr(config, "perceiver_config"):
        config.perceiver_config.resampler_depth = 1
    return config


def write_twin(family, layers, folder):
    """A full-width twin of `family` with `layers` decoder layers in `folder` (random bf16 weights, real processor)."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    os.makedirs(folder, exist_ok=True)
    if family == "idefics2":
        twins.idefics2_processor(folder, False).save_pretrained(folder)
    else:
        twins.onevision_processor_files(folder)
    torch.manual_seed(0)
    model = families.FAMILIES[family].model_cls()._from_config(twin_config(family, layers), dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def flags(run, root):
    """The flags of one run: 8 shots, the photographs, float32 on the CPU; train: one step, the teacher cached."""
    family, layers, splitting, batch, script = RUNS[run]
    common = ["--model", os.path.join(root, f"{family}-{layers}"), "--task", "vqav2", "--data-root",
              os.path.join(root, "photos"), "--shots", "8", "--batch-size", str(batch), "--out",
              os.path.join(root, "runs", run)] + (["--image-splitting", splitting] if splitting != "checkpoint" else [])
    if script == "train":
        return common + ["--n-train", str(batch), "--n-heldout", "1", "--epochs", "1", "--max-steps", "1",
                         "--overwrite"]
    return common + ["--n-eval", str(batch)]


def planned(run, root):
    """What --plan cpu says of the run, training or 8-shot evaluation: (peak bytes, peak bytes once loaded)."""
    script = RUNS[run][4]
    with contextlib.redirect_stdout(io.StringIO()):
        figures = commands.main(["plan", script, *flags(run, root), "--plan", "cpu"])
    part = "train" if script == "train" else "eval_icl"
    return figures["memory"][part], figures["memory"][part + "_loaded"]


def measured(run, root, lock=None):
    """The run's peak RSS in bytes and its peak once the backbone is loaded (VmHWM, read by child), one thread; lock: a
    file to hold (flock) while it runs."""
    cmd = (["flock", lock] if lock else []) + [sys.executable, os.path.abspath(__file__),
                                               "--child", RUNS[run][4], *flags(run, root), "--threads", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if out.returncode:
        raise RuntimeError(f"{run} failed:\n{out.stderr[-3000:]}")
    loading, loaded = (int(re.search(rf"peak {when}: (\d+) kB", out.stderr).group(1)) * 1024
                       for when in ("while loading", "once loaded"))
    return max(loading, loaded), loaded


def child(script, argv):
    """Run train.py's or evaluate.py's main here, the peak RSS reset (/proc/self/clear_refs) as soon as the backbone
    is loaded; then print that peak (VmHWM) to stderr."""
    load = backbones.load_backbone

    def loaded(*args, **kwargs):
        backbone = load(*args, **kwargs)
        print(f"peak while loading: {high_water()} kB", file=sys.stderr)
        gc.collect()  # the checkpoint's file mapping, if nothing holds it any more
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM (and the rusage /usr/bin/time reads) := the RSS now
        return backbone
    backbones.load_backbone = loaded
    (train if script == "train" else evaluate).main(argv)
    print(f"peak once loaded: {high_water()} kB", file=sys.stderr)


def high_water():
    """This process's peak RSS so far in kB (VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1))


def vision_peaks():
    """Peak memory (torch.profiler, efficiency.peak_memory_mb) of Idefics2's image encoding at full width, float32, one
    vision layer, the perceiver at depth 1: the nine images of an 8-shot row on 640 x 640 canvases, every fourth a
    portrait (its right quarter padding), at three --image-memory budgets, against chunks.image_work."""
    from transformers.models.idefics2.modeling_idefics2 import Idefics2Model
    config = twin_config("idefics2", 1)
    inner = Idefics2Model(config).eval()
    holder = torch.nn.Module()
    holder.model, holder.config = inner, config  # what chunk_images reads
    pixels, mask = torch.rand(1, 9, 3, 640, 640), torch.ones(1, 9, 640, 640, dtype=torch.long)
    pixels[:, ::4, :, :, 480:], mask[:, ::4, :, 480:] = 0, 0
    one = chunks.image_work(config, 45 * 45, 4)
    print("| --image-memory | images a call | measured peak | chunks.image_work x images a call |\n"
          "|---|---:|---:|---:|")
    for budget in (1e18, 1e9, 1):
        chunks.chunk_images(holder, budget)
        with torch.no_grad():
            peak = efficiency.peak_memory_mb(lambda: inner.get_image_features(pixels, mask)) * 2 ** 20
        chunk = max(1, min(9, int(budget // one)))
        print(f"| {'all' if budget > 1e12 else files.size(budget)} | {chunk} | {peak / 1e9:.2f} GB | "
              f"{chunk * one / 1e9:.2f} GB |", flush=True)


PUBLISHED_ROWS = (("Idefics2-8B, splitting off", "idefics2", "idefics2", "off"),
                  ("Idefics2-8B, splitting on", "idefics2", "idefics2", "on"),
                  ("LLaVA-Interleave-7B", "llava-interleave", "llava-interleave", "checkpoint"),
                  ("LLaVA-OneVision-7B", "llava-onevision", "llava-onevision", "checkpoint"))


def published_table(root):
    """The README's real-model table: --plan cuda at the published sizes (bf16, batch 4, 8 shots) with each
    real-processor twin's processor (tools/twins.py) on the photographs."""
    print("| backbone | student row / 8-shot teacher row, tokens | teacher cache, 1,000 queries | training memory | "
          "evaluation memory: adapter / 8-shot ICL |\n|---|---:|---:|---:|---:|")
    for name, family, twin, splitting in PUBLISHED_ROWS:
        folder = os.path.join(root, "processors", twin)
        if not os.path.exists(os.path.join(folder, "config.json")):
            twins.write_twin(twin, folder)
        flags = ["--model", family, "--processor", folder, "--task", "vqav2", "--data-root",
                 os.path.join(root, "photos"), "--shots", "8", "--batch-size", "4", "--n-heldout", "1",
                 "--out", os.path.join(root, "runs", "published"), "--plan", "cuda"] + \
            (["--image-splitting", splitting] if splitting != "checkpoint" else [])
        with contextlib.redirect_stdout(io.StringIO()):
            figures = commands.main(["plan", "train", *flags])
        rows, mem = figures["rows"], figures["memory"]
        print(f"| {name} | {max(rows['student'].values())} / {max(rows['teacher'].values()):,} | "
              f"{figures['cache'] / figures['queries'] * 1000 / 1e9:.1f} GB | ~{mem['train'] / 1e9:.1f} GB | "
              f"~{mem['eval_adapter'] / 1e9:.1f} / ~{mem['eval_icl'] / 1e9:.1f} GB |", flush=True)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return child(argv[1], argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default="/tmp/hyper-icl-memory", help="where the twins, photographs and runs go")
    p.add_argument("--only", nargs="*", choices=list(RUNS), help="these runs only (default: all)")
    p.add_argument("--lock", help="hold this file (flock) during each measured run, one heavy run at a time")
    p.add_argument("--published", action="store_true", help="print the README's real-model table instead (the plan "
                   "at the published sizes, no weights)")
    p.add_argument("--vision", action="store_true", help="print the peak of Idefics2's image encoding at three "
                   "--image-memory budgets instead (~2 GB, a minute)")
    args = p.parse_args(argv)
    if args.vision:
        return vision_peaks()
    files.generated(os.path.join(args.root, "photos"), write_photos)
    if args.published:
        return published_table(args.root)
    print("| run | --plan cpu | measured peak RSS | plan / measured | once loaded: plan | measured | plan / measured "
          "|\n|---|---:|---:|---:|---:|---:|---:|")
    for run in args.only or RUNS:
        family, layers = RUNS[run][:2]
        write_twin(family, layers, os.path.join(args.root, f"{family}-{layers}"))
        (plan, plan_loaded), (peak, peak_loaded) = planned(run, args.root), measured(run, args.root, args.lock)
        print(f"| {run} | {plan / 1e9:.2f} GB | {peak / 1e9:.2f} GB | {plan / peak:.2f} | {plan_loaded / 1e9:.2f} GB "
              f"| {peak_loaded / 1e9:.2f} GB | {plan_loaded / peak_loaded:.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
