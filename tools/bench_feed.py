"""How fast batches are prepared (no model forward), and what that does end to end: a benchmark, not a test.

    git worktree add --detach /tmp/before b7b8401      # the code to compare with (read-only; lab/ layout)
    flock /tmp/heavy.lock python tools/bench_feed.py --before /tmp/before [--rounds 3]
    flock /tmp/heavy.lock python tools/bench_feed.py --before /tmp/before --rounds 2 --end-to-end

On real-processor twins (tools/twins.py: the real tokenizers and processor settings, tiny weights) and a VQAv2
layout whose images are photographs of skimage.data at COCO sizes (640 x 480, every fourth 480 x 640), it times
preparation alone: 8-shot teacher rows, student rows and 8-shot evaluation prompts (batches of 4), of Idefics2
(splitting off and on) and LLaVA-OneVision, for `--before`'s code and this one, alternately in fresh processes,
each process on one thread; then this code's batches made by 0, 1 and 2 DataLoader workers
(lab/run/prefetch.py:prepared); then one query's cached teacher states read back, against reading the file's bytes.
--end-to-end times instead
`train.py` (8 shots, 64 queries, 2 epochs; Idefics2) and `evaluate.py --shots 8` (64 items; Idefics2 and
LLaVA-OneVision) at their defaults, old and new alternately. Medians over --rounds; ratios new / old. The worker
runs include a control, a CPU-bound loop of no data ("spin"): what a second worker can gain on the machine then.
"""
import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NEW = os.path.dirname(HERE)
BACKBONES = {"idefics2": ("idefics2", "off"), "idefics2-split": ("idefics2", "on"),
             "llava-onevision": ("llava-onevision", "checkpoint")}
ROWS = {"idefics2": 8, "idefics2-split": 4, "llava-onevision": 8}  # rows a measurement (batches of 4)
PHOTOS = ["astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "hubble_deep_field", "retina",
          "stereo_motorcycle", "camera", "coins", "grass", "gravel", "brick", "clock", "moon"]


def photo_layout(root):
    """The VQAv2 of tools/benchmarks.py with every image replaced by a photograph at a COCO size."""
    import numpy as np
    import skimage.data
    from PIL import Image, ImageOps
    sys.path[:0] = [NEW, HERE]
    import benchmarks
    for folder in ("vqav2", "coco"):
        shutil.copytree(os.path.join(benchmarks.generate(), folder), os.path.join(root, folder))
    photos = []
    for name in PHOTOS:
        im = getattr(skimage.data, name)()
        im = im[0] if isinstance(im, tuple) else im
        photos.append(Image.fromarray(np.asarray(im, dtype=np.uint8)).convert("RGB"))
    for split in ("train2014", "val2014"):
        folder = os.path.join(root, "coco", split)
        for k, name in enumerate(sorted(os.listdir(folder))):
            size = (480, 640) if k % 4 == 3 else (640, 480)
            ImageOps.fit(photos[k % len(photos)], size).save(os.path.join(folder, name), quality=90)
    return root


def child(args):
    """One measurement in this process, with the code under args.code: prints one JSON line."""
    sys.path[:0] = [args.code]
    import torch
    import data as D
    from lab.datasets import tasks
    from lab.models import backbones
    from lab.run import prefetch
    torch.set_num_threads(1)
    family, splitting = BACKBONES[args.backbone]
    b = backbones.load_backbone(args.twin, image_splitting=splitting)
    pool = tasks.load_task("vqav2", "train", args.data)
    n = ROWS[args.backbone]
    queries = pool[:n]
    icds = D.demonstrations([q.id for q in queries], pool, 8, 0)
    specs = [(queries[i:i + 4], icds[i:i + 4]) for i in range(0, n, 4)]
    builders = {"teacher": functools.partial(teacher_rows, b.processor, family),
                "student": functools.partial(student_rows, b.processor, family),
                "eval": functools.partial(eval_rows, b.processor, family)}
    out = {}
    for name, build in builders.items():
        build(specs[0])  # warm: the tokenizer's caches, the first image decode
        start = time.perf_counter()
        for spec in specs:
            build(spec)
        out[name] = n / (time.perf_counter() - start)
    if args.workers:  # this code only: the same builds by 0, 1, 2 DataLoader workers, as a CUDA run makes them
        more = specs * 4
        for name, build in {**builders, "spin": spin}.items():  # spin: what 2 workers can gain on this machine now
            for w in (0, 1, 2):
                loader = torch.utils.data.DataLoader(prefetch.Prepared(build, more, False), batch_size=None,
                                                     num_workers=w, prefetch_factor=2 if w else None)
                start = time.perf_counter()
                for _ in loader:
                    pass
                out[f"{name}-{w}w"] = 4 * n / (time.perf_counter() - start)
        build = lambda spec: prefetch.on_host(builders["teacher"](spec))  # a CPU run: normalised in the worker
        start = time.perf_counter()
        for spec in specs:
            build(spec)
        out["teacher-cpu-run"] = n / (time.perf_counter() - start)
    print(json.dumps(out))


def spin(spec):
    """A CPU-bound build of no data (a pure-Python loop): the control of the worker runs."""
    return sum(range(2_000_000))


def teacher_rows(processor, family, spec):
    import data as D
    pieces = D.query_pieces(processor, family, "vqa", spec[0])
    return D.teacher_batch(processor, family, "vqa", pieces, spec[1])


def student_rows(processor, family, spec):
    import data as D
    return D.student_batch(processor, family, "vqa", D.query_pieces(processor, family, "vqa", spec[0]))


def eval_rows(processor, family, spec):
    import data as D
    return D.prompt_batch(processor, family, "vqa", *spec)


def cache_child(args):
    """One query's cached LLaVA-OneVision-size teacher states (28 layers x 745 tokens x 3584, bf16: 150 MB), read
    back by lab/run/teacher_cache.py:read_teacher against reading the file's bytes (both from the page cache), with the
    code under args.code."""
    sys.path[:0] = [args.code]
    import torch
    from lab.disk import files
    from lab.run import teacher_cache
    path, key = os.path.join(args.data, "states.safetensors"), "key"
    states = torch.randn(28, 745, 3584).to(torch.bfloat16)
    files.write_cache(path, {"states": states}, key + "states")
    read, raw = [], []
    for _ in range(7):
        start = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        raw.append(time.perf_counter() - start)
        start = time.perf_counter()
        found = teacher_cache.read_teacher(path, key, states.shape)
        read.append(time.perf_counter() - start)
        if found is None:
            raise RuntimeError(f"{path}: the cache file just written is not read back")
    print(json.dumps({"bytes": os.path.getsize(path), "raw_s": statistics.median(raw),
                      "read_s": statistics.median(read)}))


def run_child(code, *extra):
    out = subprocess.run([sys.executable, __file__, "--code", code, *extra], capture_output=True, text=True)
    if out.returncode:
        sys.exit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def end_to_end(code, twin, splitting, data, out, what):
    """Wall seconds of the default train.py or evaluate.py run on a twin, with the code under `code`."""
    common = ["--model", twin, "--task", "vqav2", "--data-root", data, "--image-splitting", splitting]
    cmd = ["train.py", *common, "--shots", "8", "--n-train", "64", "--epochs", "2", "--out", out, "--overwrite"] \
        if what == "train" else ["evaluate.py", *common, "--shots", "8", "--n-eval", "64", "--out", out]
    shutil.rmtree(out, ignore_errors=True)  # no teacher cache of an earlier round
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *cmd], cwd=code, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="a checkout of the code to compare with")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--end-to-end", action="store_true")
    p.add_argument("--only", nargs="+", choices=list(BACKBONES), default=list(BACKBONES))
    p.add_argument("--code", help=argparse.SUPPRESS)  # a child: the code to measure
    p.add_argument("--backbone", help=argparse.SUPPRESS)
    p.add_argument("--twin", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--workers", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cache", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.code:
        return cache_child(args) if args.cache else child(args)
    tmp = tempfile.mkdtemp(prefix="bench-feed-")
    data = photo_layout(os.path.join(tmp, "data"))
    from twins import write_twin
    twins = {name: write_twin(name, os.path.join(tmp, name)) for name in ("idefics2", "llava-onevision")}
    sides = {"new": NEW, **({"old": args.before} if args.before else {})}
    print(f"{os.cpu_count()} cores; load {os.getloadavg()}; {args.rounds} rounds")
    for name in [] if args.end_to_end else args.only:
        family, _ = BACKBONES[name]
        got = {side: [] for side in sides}
        for _ in range(args.rounds):
            for side, code in sides.items():
                got[side].append(run_child(code, "--backbone", name, "--twin", twins[family], "--data", data,
                                           *(["--workers"] if side == "new" else [])))
        med = {side: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for side, runs in got.items()}
        for k, v in med["new"].items():
            old = None if k.endswith("w") else med.get("old", {}).get(k.split("-")[0])
            print(f"{name} {k}: {v:.2f} rows/s" + (f" (old {old:.2f}; s a row new / old {old / v:.2f})" if old
                                                   else ""))
        for kind in ("teacher", "student", "eval", "spin"):
            print(f"{name} {kind}: 2 workers / 1 worker {med['new'][f'{kind}-2w'] / med['new'][f'{kind}-1w']:.2f}")
    for side, code in {} if args.end_to_end else sides.items():
        c = run_child(code, "--cache", "--data", tmp)
        print(f"cache read ({side}): {c['bytes'] / 1e6:.0f} MB, read_teacher {c['read_s'] * 1e3:.0f} ms, "
              f"reading the bytes {c['raw_s'] * 1e3:.0f} ms: x{c['read_s'] / c['raw_s']:.2f}")
    if not args.end_to_end:
        return
    for name, family, splitting, what in (("idefics2", "idefics2", "off", "eval"),
                                          ("llava-onevision", "llava-onevision", "checkpoint", "eval"),
                                          ("idefics2", "idefics2", "off", "train")):
        walls = {side: [] for side in sides}
        for r in range(args.rounds):
            for side, code in sides.items():
                walls[side].append(end_to_end(code, twins[family], splitting, data,
                                              os.path.join(tmp, f"e2e-{side}-{name}-{what}"), what))
        med = {side: statistics.median(v) for side, v in walls.items()}
        ratios = [n / o for n, o in zip(walls["new"], walls.get("old", walls["new"]))]
        print(f"load {os.getloadavg()}; end to end {name} {what}: new {med['new']:.1f} s, old "
              f"{med.get('old', float('nan')):.1f} s; paired ratios {', '.join(f'{x:.2f}' for x in ratios)}, "
              f"median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
