"""The memory of reading the hub's parquet layout (lab/datasets/parquet.py): a benchmark, not a test.

    python tools/bench_parquet.py --root /tmp/hyper-icl-parquet-bench [--gb 2] [--row-group 100] [--keep]

Writes ~--gb GB of lmms-lab/VQAv2's layout under ROOT/vqav2/data (validation-0000k-of-00008.parquet; each image a
1024 x 1024 BMP of random pixels, 3 MB of incompressible bytes (a PNG's filters would make writing the slow part), in
row groups of up to 100 rows as the hub's `datasets` writes image datasets: 2 GB makes 8 shards of 80 rows, one row
group of 250 MB each), then reads it
through lab/datasets/tasks.py:load_task in a fresh process whose peak resident memory (VmHWM) is reset once its imports
are done: the peak beyond that baseline is what reading costs. Every image is written to the cache (ROOT/cache). ROOT is
deleted at the end unless --keep.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]


def write(root, gb, row_group=100):
    """~gb GB of VQAv2-layout shards of noise PNGs under root/vqav2/data; returns (rows, bytes on disk)."""
    import io

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    import hub_layouts
    rng, folder, shards = np.random.default_rng(0), os.path.join(root, "vqav2", "data"), 8
    os.makedirs(folder, exist_ok=True)
    n = int(gb * 1e9 / (3 * 1024 * 1024 + 54))  # a BMP's bytes
    per_shard = -(-n // shards)
    for k in range(shards):
        path = os.path.join(folder, f"validation-{k:05d}-of-{shards:05d}.parquet")
        with pq.ParquetWriter(path, hub_layouts.VQAV2, compression="snappy") as writer:
            for start in range(k * per_shard, min(n, (k + 1) * per_shard), row_group):
                rows = []
                for i in range(start, min(n, (k + 1) * per_shard, start + row_group)):
                    pixels = rng.integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
                    bmp = io.BytesIO()
                    Image.fromarray(pixels).save(bmp, format="BMP")  # PNG's filters would be the slow part
                    rows.append({"question_type": "what", "multiple_choice_answer": "noise", "image_id": i,
                                 "answers": [{"answer": "noise", "answer_confidence": "yes", "answer_id": j + 1}
                                             for j in range(10)], "answer_type": "other", "question_id": i,
                                 "question": "What is in the picture?",
                                 "image": {"bytes": bmp.getvalue(), "path": f"{i}.bmp"}})
                writer.write_table(pa.Table.from_pylist(rows, schema=hub_layouts.VQAV2), row_group_size=row_group)
    size = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))
    return n, size


def status(field):
    """A VmXXX line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def read(root):
    """Read the layout through load_task in this process; print the baseline, the peak beyond it, rows and time."""
    from lab.datasets import parquet, tasks
    parquet.CACHE = os.path.join(root, "cache")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident memory
    baseline, start = status("VmRSS"), time.time()
    items = tasks.load_task("vqav2", "val", root)
    print(json.dumps({"rows": len(items), "baseline_rss_gb": baseline / 1e9, "peak_rss_gb": status("VmHWM") / 1e9,
                      "peak_beyond_baseline_gb": (status("VmHWM") - baseline) / 1e9, "seconds": time.time() - start}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", required=True, help="a new folder to write the layout and the cache in")
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--row-group", type=int, default=100, help="rows a row group (the hub's datasets: 100)")
    ap.add_argument("--keep", action="store_true", help="keep ROOT")
    ap.add_argument("--read", action="store_true", help=argparse.SUPPRESS)  # the measured child process
    args = ap.parse_args(argv)
    if args.read:
        return read(args.root)
    if os.path.exists(args.root):
        raise SystemExit(f"--root {args.root} exists; name a new folder (it is deleted at the end)")
    try:
        start = time.time()
        n, size = write(args.root, args.gb, args.row_group)
        print(f"wrote {n} rows, {size / 1e9:.2f} GB of parquet in {time.time() - start:.0f} s")
        subprocess.run([sys.executable, __file__, "--root", args.root, "--read"], check=True)
    finally:
        if not args.keep:
            shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
