"""The time of reading a large task of one's own (lab/datasets/own_task.py): a benchmark, not a test.

    python tools/bench_own_task.py [--root DIR] [--records 200000] [--images 24] [--keep]

Writes --images small PNG photographs and a .jsonl of --records vqa records on them (each image shared by
records / images records, as a real task shares its images among its questions) under ROOT (a fresh temporary folder
unless --root names one, which must not exist yet), then times own_task.read on it in this process and prints the
seconds (and the CPU seconds, the measure on a shared machine). ROOT is deleted at the end unless --keep.
"""
import argparse
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def write(root, records, images):
    """`images` PNGs and a task of `records` vqa records on them under root; returns the task's path."""
    from PIL import Image
    os.makedirs(os.path.join(root, "images"))
    for k in range(images):
        Image.new("RGB", (32, 24), (10 * k % 256, 40, 90)).save(os.path.join(root, "images", f"{k}.png"))
    path = os.path.join(root, "task.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for i in range(records):
            f.write(json.dumps({"id": i, "image": f"images/{i % images}.png", "question": f"What is shown in {i}?",
                                "answer": "a square"}) + "\n")
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", help="a folder to create and write the task in (default: a fresh temporary folder)")
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--images", type=int, default=24)
    p.add_argument("--keep", action="store_true", help="keep ROOT")
    args = p.parse_args(argv)
    if args.root is not None and os.path.lexists(args.root):
        p.error(f"--root {args.root} exists; name a folder to create (it is deleted at the end unless --keep)")
    root = args.root or tempfile.mkdtemp(prefix="bench-own-task-")
    if args.root:
        os.makedirs(root)
    try:
        path = write(root, args.records, args.images)
        from lab.datasets import own_task
        start, cpu = time.perf_counter(), time.process_time()
        kind, parts = own_task.read(path)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"own_task.read: {len(parts[None]):,} {kind} records on {args.images} images in {seconds:.2f} s "
              f"({cpu:.2f} s of CPU; {path})")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
