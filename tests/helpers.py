"""What the tests share beside conftest.py's fixtures: the repository's root; the flags of the tiny runs, one set
(TINY, BENCH, EVAL, TRAIN, TRAIN_NO_CACHE, RUN and run_flags, SMALL and small_run, QUIET; with_flag, and refused for a
parser's one-line error); python -m lab in this process (lab, lab_args; lab_train, lab_evaluate and their
parsers); small inputs written by hand (VQAv2's files, a task of one's own on coloured photos); plans kept from
loading weights (no_weights); prompts for the tiny twins, randomised adapters and the cached-decoding check; a
micro-batch and the teacher's states as the loop makes them; DataLoader workers killed mid-run; float64 references for
the baselines' attention."""
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
import transformers
from PIL import Image

import benchmarks
import data
import model as M
import train
from lab.cli import commands, modes
from lab.datasets import tasks
from lab.methods import registry
from lab.models import backbones
from lab.run import training_batches

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: where train.py runs from

TINY = ["--model", "tiny-idefics2"]                                         # the tiny Idefics2 twin
BENCH = [*TINY, "--task", "vqav2", "--data-root", benchmarks.ROOT]          # on the VQAv2 of tools/benchmarks.py
EVAL = [*BENCH, "--n-eval", "2", "--shots", "0"]                            # a two-item zero-shot evaluation
TRAIN = [*BENCH, "--n-train", "4", "--n-heldout", "4", "--batch-size", "4", "--shots", "1", "--epochs", "1"]  # 1 step
TRAIN_NO_CACHE = [*BENCH, "--n-train", "4", "--n-heldout", "4", "--batch-size", "2", "--shots", "1", "--epochs", "1",
                  "--no-teacher-cache"]                                     # 2 steps, the teacher run every step
RUN = [*BENCH, "--n-train", "8", "--n-heldout", "4", "--batch-size", "4", "--shots", "1", "--epochs", "2",
       "--save-every", "1"]                                                 # 2 epochs of 2 steps, a checkpoint a step
QUIET = [*TINY, "--data-root", benchmarks.ROOT, "--threads", "1", "--workers", "0"]  # a table's or a test's --task
SMALL = [*BENCH, "--n-train", "12", "--n-heldout", "4", "--batch-size", "4", "--shots", "2", "--epochs", "2",
         "--save-every", "1"]                                               # 2 epochs of 3 steps, 2 shots


lab_train, lab_evaluate = modes.train_main, modes.evaluate_main        # python -m lab train / evaluate [flags]
lab_train_args, lab_evaluate_args = modes.parse_train, modes.parse_evaluate  # their flags, parsed and checked


def lab(argv):
    """python -m lab <mode> [flags] of argv (lab/cli/commands.py), in this process: what the mode returns."""
    return commands.main(list(argv))


def lab_args(argv):
    """The flags of python -m lab <mode> [flags], parsed and checked as the mode does before it runs."""
    return commands.parse(list(argv))[1]


def run_flags(tmp, name, *extra):
    """RUN into tmp/name with its teacher cache in tmp/teacher (conftest.py's `whole` and the runs beside it)."""
    return [*RUN, "--out", str(tmp / name), "--teacher-cache", str(tmp / "teacher"), *extra]


def small_run(tmp_path, *extra, name="run"):
    """SMALL into tmp_path/name with its teacher cache in tmp_path/teacher."""
    return ["--out", str(tmp_path / name), "--teacher-cache", str(tmp_path / "teacher"), *SMALL, *extra]


def with_flag(argv, flag, value):
    """argv with `flag`'s value replaced."""
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def refused(parse, argv, capsys):
    """The one-line parser error of argv (SystemExit), its text."""
    with pytest.raises(SystemExit):
        parse(argv)
    return capsys.readouterr().err.strip().splitlines()[-1]


PAPER = ("idefics2", "idefics", "llava-interleave", "llava-onevision")  # the paper's four backbones (tests/paper's):
# their processors' own calls


def no_weights(monkeypatch):
    """Make every way of loading weights fail, so a test proves a plan reads none."""
    def refuse(*args, **kwargs):
        raise AssertionError("the plan loaded weights")
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(refuse))
    monkeypatch.setattr(backbones, "load_backbone", refuse)


def images(texts):
    """One image per prompt, determined by the prompt (so a prompt alone and in a batch sees the same image)."""
    return [Image.new("RGB", (28, 28), (7 * len(t) % 255, 200, 90)) for t in texts]


def randomise(model, seed=0):
    """Every adapter parameter of `model` drawn from N(0, 0.3^2): an adapter far from its identity start."""
    torch.manual_seed(seed)
    for p in M.adapter_modules(model).parameters():
        torch.nn.init.normal_(p, std=0.3)


def prompts(backbone, texts, positions=True):
    """A left-padded batch, one image per prompt, through the family's own processor; positions skip padding."""
    p, imgs = backbone.processor, images(texts)
    if backbone.family not in PAPER:
        return rows_of(backbone, texts, imgs, positions)
    p.tokenizer.padding_side = "left"
    if backbone.family == "idefics":
        batch = p(text=[[im, t] for im, t in zip(imgs, texts)], return_tensors="pt", padding=True)
    else:
        imgs = [[im] for im in imgs] if backbone.family == "idefics2" else imgs
        batch = p(text=["<image>" + t for t in texts], images=imgs, return_tensors="pt", padding=True)
    if positions:
        batch["position_ids"] = (batch["attention_mask"].cumsum(-1) - 1).clamp(min=0)
    return batch


def rows_of(backbone, texts, imgs, positions=True):
    """prompts' batch for the families in use now, as data.py makes rows (BOS, then one piece an image and text, left
    padding; positions as the family takes them: 1-D, or none for M-RoPE, which the model makes itself)."""
    p, tok = backbone.processor, backbone.processor.tokenizer
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    pieces = [data.encode_piece(p, backbone.family, "<image>" + t, im) for t, im in zip(texts, imgs)]
    rows = [{"input_ids": bos + x["input_ids"], "labels": [-100] * (len(bos) + len(x["input_ids"])),
             "images": [x["images"]], "query_len": len(x["input_ids"]), "id": i} for i, x in enumerate(pieces)]
    batch = data.model_inputs(data.collate(rows, p, backbone.family))
    if not positions:
        batch.pop("position_ids", None)
    return batch


QUESTION = {"question_id": 7, "image_id": 1, "question": "What colour?"}                 # one VQAv2 question
ANNOTATION = {"question_id": 7, "answers": [{"answer": "red"}] * 10, "multiple_choice_answer": "red"}  # and its answers


def vqa_files(tmp_path, questions, annotations, split="val"):
    """VQAv2's two files of `split` in tmp_path/vqav2 holding `questions` and `annotations` as given; tmp_path."""
    folder = tmp_path / "vqav2"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"v2_OpenEnded_mscoco_{split}2014_questions.json").write_text(json.dumps(questions))
    (folder / f"v2_mscoco_{split}2014_annotations.json").write_text(json.dumps(annotations))
    return tmp_path


def jsonl(path, records):
    """records written to path as JSON lines; the path as a string."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def coloured_photos(folder, n):
    """n small JPEGs of distinct colours in folder/img/, their paths relative to folder."""
    (folder / "img").mkdir(parents=True, exist_ok=True)
    for k in range(n):
        Image.new("RGB", (32, 24), (30 * k % 256, 90, 200 - 20 * k % 200)).save(folder / "img" / f"{k}.jpg")
    return [f"img/{k}.jpg" for k in range(n)]


def vqa_task(folder, n=8, name="data.jsonl"):
    """A VQA task of one's own on n coloured_photos: folder/name."""
    records = [{"id": k, "image": p, "question": "What colour is it?", "answer": f"colour {k % 3}"}
               for k, p in enumerate(coloured_photos(folder, n))]
    return jsonl(folder / name, records)


def dead_pid():
    """The id of a process that has ended (its temporary files are stale)."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def rand(*shape, seed=0, dtype=torch.float64):
    """A seeded standard normal tensor (float64 unless said)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def randomised(module, seed):
    """`module` with every parameter drawn from N(0, 0.5^2)."""
    torch.manual_seed(seed)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return module


def left_padded_mask(pads, T, S):
    """Causal + left padding (pads[b] padded keys), bool [B, 1, T, S], the query rows being the last T of S."""
    keys = torch.arange(S) >= torch.tensor(pads)[:, None]
    return (torch.ones(T, S, dtype=torch.bool).tril(S - T)[None] & keys[:, None, :])[:, None]


def naive_attention(q, k, v, mask):
    """softmax(q k^T / sqrt(d_h)) v under `mask`, written out; also log Z2 (the log-normaliser over seen keys)."""
    logits = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~mask, -math.inf)
    log_Z2 = torch.logsumexp(logits, -1, keepdim=True)
    return torch.exp(logits - log_Z2) @ v, log_Z2


TEXTS = ["Question: What colour is the shape? Short answer:", "Question: How many? Short answer:"]


ZERO_INIT_WORDS = "question what colour is the shape how many cats are on a table short answer".split()


def assert_zero_init_is_the_unmodified_model(backbone, method, rank, lengths, std, seed):
    """Eq 5-7 with U_k = 0 on `backbone`: random U_q, w, b (or c), U_k = 0, prompts of random `lengths` left-padded in
    one batch; the adapted logits at every real token equal, bit for bit, the unmodified model's."""
    words = random.Random(seed)
    texts = [" ".join(words.choice(ZERO_INIT_WORDS) for _ in range(n)) for n in lengths]
    batch = prompts(backbone, texts)
    with torch.no_grad():
        base = backbone.model(**batch).logits
        try:
            torch.manual_seed(seed)
            for name, p in registry.attach(backbone.model, method, rank=rank).named_parameters():
                torch.nn.init.zeros_(p) if name.endswith("U_k") else torch.nn.init.normal_(p, std=std)
            ours = backbone.model(**batch).logits
        finally:
            M.detach(backbone.model)
    real = batch["attention_mask"].bool()
    assert torch.equal(ours[real], base[real])  # exactly: Q~ = Q bit for bit, and the kernel is the base model's


def assert_cached_decoding_equals_full_forward(backbone, new_tokens):
    """generate() runs the attached adapter on one new query token at a time against the KV cache; its logits must
    match one full forward over the prompts and the generated tokens."""
    batch = prompts(backbone, TEXTS, positions=False)
    with torch.no_grad():
        out = backbone.model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                      return_dict_in_generate=True)
        steps = torch.stack(out.logits, 1)                                   # [B, new_tokens, V]
        full = dict(batch, input_ids=out.sequences, attention_mask=torch.cat(
            [batch["attention_mask"], torch.ones_like(out.sequences[:, -new_tokens:])], 1))
        if "image_attention_mask" in batch:                                  # Idefics: new tokens see the image
            last = batch["image_attention_mask"][:, -1:]
            full["image_attention_mask"] = torch.cat([batch["image_attention_mask"]] + [last] * new_tokens, 1)
        for types in ("mm_token_type_ids", "token_type_ids"):                # new tokens are text
            if types in batch:
                full[types] = torch.cat([batch[types], torch.zeros_like(out.sequences[:, -new_tokens:])], 1)
        if backbone.processor.row_format.positions == "1-d":                 # M-RoPE: the model's own
            full["position_ids"] = (full["attention_mask"].cumsum(-1) - 1).clamp(min=0)
        logits = backbone.model(**full).logits[:, -new_tokens - 1:-1]
    torch.testing.assert_close(steps, logits, rtol=1e-4, atol=1e-4)


def micro_batch(backbone, cfg, queries, icds, cache):
    """The (student batch, teacher tensor) of `queries` (icds: theirs, in order) on the CPU as the loop makes it
    (training_batches.prepared, train.run_teacher on what the cache lacks, training_batches.pair), with what a run would
    share (cache: its id and counts; the rest of its identity from cfg)."""
    cache |= {"images": cache.get("images"), "processor": cache.get("processor"), "task": cfg.task,
              "output": registry.ANCHORS[cfg.anchor].teacher,
              "folder": None if cfg.no_teacher_cache else cfg.teacher_cache}
    run = SimpleNamespace(backbone=backbone, cfg=cfg, kind=tasks.spec(cfg.task).kind, device="cpu", cache=cache,
                          regime=False)
    prepared = next(training_batches.prepared(run, [(queries, icds)], workers=0))
    computed = train.run_teacher(backbone, prepared["teacher"], "both") if prepared["teacher"] else []
    return training_batches.pair(run, prepared, computed)


def teacher_states(backbone, cfg, queries, icds, cache):
    """Each query's teacher states through the cache, as a micro-batch gets them: read where the cache holds them,
    computed by the teacher and stored where not (lab/run/training_batches.py)."""
    cache |= {"images": None, "processor": None, "task": cfg.task, "output": "states", "folder": cfg.teacher_cache}
    prepared = training_batches.prepared_micro_batch(training_batches.Setup.of(backbone, "vqa", cache), (queries, icds))
    computed = train.run_teacher(backbone, prepared["teacher"], "both") if prepared["teacher"] else []  # as the loop
    return training_batches.stored(cache, prepared, computed, cfg.epochs)


def children():
    """The pids of this process's children (the DataLoader's workers)."""
    found = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            found += [int(p) for p in f.read().split()]
    return found


def kill_workers_once(real):
    """`real`, wrapped: at its first call every child of this process is SIGKILLed, and the call waits for the
    SIGCHLD (which torch's handler turns into an error wherever this process is)."""
    state = {"done": False}

    def wrapped(*args, **kwargs):
        if not state["done"]:
            state["done"] = True
            for pid in children():
                os.kill(pid, signal.SIGKILL)
            time.sleep(2)
        return real(*args, **kwargs)
    return wrapped
