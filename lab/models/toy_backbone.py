"""toy-idefics2: the small Idefics2 that learns in context on the toy-icl world: its processor, its shipped
reference file, and meta-training from scratch with the probe that accepts a build (train.py --build-toy)."""
import io
import json
import os
import random
import time

from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file, save
from tqdm import tqdm
from transformers import Idefics2Config, Idefics2ForConditionalGeneration, Idefics2Processor, Idefics2ImageProcessorPil
from transformers import get_cosine_schedule_with_warmup
import torch

import data
from lab.disk import files
from lab.datasets import toy_world
from lab.models import families, image_layouts, tiny


# The real Idefics2 class and processor at a size a CPU meta-trains in minutes (about 1 M parameters): images of
# 42 x 42 (one 14-px vision patch per grid cell), 9 perceiver latents per image, a tokenizer in which every answer is
# one token. train.py meta-trains it on episodes of the toy-icl world (train.build_toy). Every result of the project
# that needs it uses one reference copy, the same bytes everywhere: TOY_REFERENCE, checked against TOY_SHA256 on every
# load. A copy built on another machine differs in its last bits (another CPU sums in another order) and, since the
# in-context phase transition depends on them, possibly in whether it learns in context at all; so a build is only
# ever used when named (--model <its file>), never in place of the reference.

TOY_CORPUS = " ".join([data.PROMPTS["vqa"]["instruction"], toy_world.ICL_QUESTION, *toy_world.ICL_NAMED.values(),
                       "Question: Short answer:", *(a for v in toy_world.ICL_ATTRIBUTES.values() for a in v)] * 8)

TOY_REFERENCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "toy-idefics2.safetensors")

TOY_SHA256 = "94ddc506fac0b506d2c297e7d0e7c75396da7e2c8673c89586a28a74070d0463"  # weights_digest of TOY_REFERENCE


def toy_processor():
    """Idefics2's processor for 42 x 42 images and 9 latents, with a tokenizer that spells every answer as one token."""
    tok = tiny._idefics_tokenizer(vocab_size=400, corpus=TOY_CORPUS)
    side = toy_world.ICL_SIDE
    images = Idefics2ImageProcessorPil(do_image_splitting=False, size={"longest_edge": side, "shortest_edge": side})
    return families.formatted(Idefics2Processor(images, tok, image_seq_len=9), "idefics2")


def toy_model(processor, seed=0):
    """The untrained toy Idefics2: text 128 wide x 4 layers, vision 64 x 2, perceiver latents drawn N(0, 0.02), not
    Idefics2's ones, from which images differ by a fraction of a percent of an image token's size and training
    stalls at "knows the task, ignores the image"."""
    tok = processor.tokenizer
    config = Idefics2Config(
        text_config=dict(model_type="mistral", vocab_size=len(tok), hidden_size=128, intermediate_size=256,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=toy_world.ICL_SIDE, patch_size=toy_world.ICL_CELL),
        perceiver_config=dict(hidden_size=128, resampler_n_latents=9, resampler_depth=1, resampler_n_heads=4,
                              resampler_head_dim=32, num_key_value_heads=2),
        image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    model = tiny._seeded(Idefics2ForConditionalGeneration, config, seed)
    with torch.no_grad():
        model.model.connector.perceiver_resampler.latents.normal_(0, 0.02)
    return model


def read_toy(path, sha256=None, shapes=None):
    """The weights of the toy backbone file at `path`, checked against the checksum in its metadata, `sha256` and the
    toy model's {name: shape} (when given); a ValueError naming the file if they differ or it cannot be read."""
    try:
        with safe_open(path, "pt") as f:
            expected = (f.metadata() or {}).get("sha256")
        tensors = load_file(path)
    except Exception as e:  # a missing, truncated or foreign file: safetensors raises its own error types
        raise ValueError(f"toy backbone {path} cannot be read ({e})") from e
    if expected is None:
        raise ValueError(f"{path} is not a toy backbone (no checksum in its metadata; an adapter is loaded with "
                         "evaluate.py --checkpoint, a toy backbone is written by `python train.py --build-toy`)")
    digest = files.weights_digest(tensors)
    if digest != expected or sha256 not in (None, digest):
        raise ValueError(f"toy backbone {path}: its weights do not match their checksum; restore the reference with "
                         "`git checkout lab/models/toy-idefics2.safetensors` or build another with "
                         "`python train.py --build-toy`")
    if shapes is None:
        return tensors
    if set(tensors) != set(shapes):  # a cache file (RICES features, teacher states, a task vector) has a checksum too
        missing = sorted(set(shapes) - set(tensors))
        names = ", ".join(sorted(tensors)[:3]) + (", ..." if len(tensors) > 3 else "")
        raise ValueError(f"{path} is not a toy backbone: it holds {len(tensors)} tensors ({names}), not the toy "
                         f"Idefics2's {len(shapes)}" + (f" ({missing[0]} is missing)" if missing else "") +
                         "; pass a file written by `python train.py --build-toy`")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{path} is not a toy backbone: {name} is {tuple(tensors[name].shape)}, the toy "
                             f"Idefics2's is {tuple(shape)}; pass a file written by `python train.py --build-toy`")
    return tensors


def toy_metadata(path):
    """What a toy backbone file records of its build: recipe (with the accepted seed), probe, learning curve."""
    with safe_open(path, "pt") as f:
        return {k: json.loads(v) for k, v in (f.metadata() or {}).items() if k != "sha256"}


def toy_idefics2(path=None):
    """The meta-trained toy Idefics2 and its processor: the reference (checked by TOY_SHA256) or the build at `path`."""
    processor = toy_processor()
    model = toy_model(processor)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    model.load_state_dict(read_toy(path or TOY_REFERENCE, None if path else TOY_SHA256, shapes))
    return model.eval(), processor


# From scratch, on the toy-icl world (data.py), with a curriculum: first single images whose question names the
# attribute (perception), then episodes of 0..8 demonstrations with the uninformative question (in-context
# learning), some batches still naming it. Without demonstrations the model falls back on the more frequent task of
# the episodes (background), as a pretrained model falls back on its prior; with them it answers the task they show.
# Whether a build learns in context is a phase transition that the last bits of the weights can tip (another CPU,
# another thread count): 900 episode steps left some seeds on the prior task for good, 1,800 (a slower cosine decay)
# let every measured seed through (README). So every build is probed on held-out episodes and used only if it
# learns in context (ACCEPT); otherwise the next seed is tried.

TOY_RECIPE = dict(seed=0, named_steps=300, episode_steps=1800, named_batch=32, episode_batch=16, lr=2e-3, warmup=100,
                  named_fraction=0.3, max_shots=8, scenes=4096, probe_every=200, version=2,
                  episode_tasks={"colour": 1, "background": 2})  # colour, the target, is the rarer task in episodes

TOY_TARGET = "colour"

TOY_BUILD_OUT = os.path.join("runs", "toy-idefics2", "backbone.safetensors")

ACCEPT = {"8-shot": 0.9, "0-shot": 0.3}  # the target task's accuracy on held-out episodes: at least / at most

PROBE_EPISODES = 128  # per attribute and number of shots in the acceptance probe (32 in the learning curve)


def toy_scenes(processor, n, rng):
    """n scenes of the meta-training world and their pixels (through the processor, once): (scenes, pixel dicts)."""
    scenes = [toy_world.icl_scene(rng) for _ in range(n)]
    images = [[Image.open(io.BytesIO(toy_world.icl_jpeg(s))).convert("RGB")] for s in scenes]
    out = processor.image_processor(images, do_rescale=False, do_normalize=False, do_pad=False)  # image_layouts.Canvas
    return scenes, [{"pixel_values": [image_layouts.chw(c) for c in crops]} for crops in out["pixel_values"]]


def toy_batch(processor, text, scenes, pixels, episodes):
    """One batch of episodes [(attribute, question, scene indices)]: ICDs, then the query (last), answers labelled."""
    rows = []
    for attribute, question, picks in episodes:
        pieces = [{**text[question, scenes[i][attribute], k == len(picks) - 1], "images": pixels[i]}
                  for k, i in enumerate(picks)]
        rows.append(toy_world.icl_episode(processor, pieces))
    return data.collate(rows, processor, "idefics2")


def draw_episodes(recipe, rng, n_scenes, named):
    """One step's episodes: single images with named questions (phase 1, named None; attributes equally often),
    else rows of the same number (0..max_shots, drawn per batch: no padding) of ICDs + a query, named or not, the
    attribute drawn with the weights recipe["episode_tasks"]."""
    shots = 0 if named is None else rng.randint(0, recipe["max_shots"])
    names = list(toy_world.ICL_ATTRIBUTES)
    weights = [1] * len(names) if named is None else [recipe["episode_tasks"][a] for a in names]
    episodes = []
    for _ in range(recipe["named_batch" if named is None else "episode_batch"]):
        attribute = rng.choices(names, weights)[0]
        question = toy_world.ICL_QUESTION if named is False else toy_world.ICL_NAMED[attribute]
        episodes.append((attribute, question, rng.sample(range(n_scenes), shots + 1)))
    return episodes


@torch.no_grad()
def probe_row(model, processor, text, probe_set, n=32):
    """Accuracy of the query's answer token (argmax, teacher-forced) per attribute on n held-out episodes each:
    perception (zero-shot, named question), zero-shot and 8-shot."""
    (scenes, pixels), row = probe_set, {}
    model.eval()
    for setting, shots, named in (("named", 0, True), ("0-shot", 0, False), ("8-shot", 8, False)):
        rng, row[setting] = random.Random(1234), {}
        for attribute in toy_world.ICL_ATTRIBUTES:
            question = toy_world.ICL_NAMED[attribute] if named else toy_world.ICL_QUESTION
            episodes = [(attribute, question, rng.sample(range(len(scenes)), shots + 1)) for _ in range(n)]
            batch = toy_batch(processor, text, scenes, pixels, episodes)
            logits = model(**data.model_inputs(batch)).logits
            last = batch["labels"].shape[1] - 1 - torch.flip(batch["labels"] != -100, [1]).int().argmax(1)  # end token
            rows = torch.arange(n)
            answer = batch["input_ids"][rows, last - 1]       # every answer is one token, then the end token
            row[setting][attribute] = (logits[rows, last - 2].argmax(-1) == answer).float().mean().item()
    model.train()
    return row


def describe_probe(row):
    return "  ".join(f"{k}: " + " ".join(f"{a} {v:.2f}" for a, v in row[k].items())
                     for k in ("named", "0-shot", "8-shot"))


def meta_train(recipe, threads=1, log=print):
    """Meta-train the toy Idefics2 from scratch with the curriculum above, recipe["named_steps"] then
    recipe["episode_steps"] (bit-identical for recipe["seed"] on one thread of one machine). Returns (model,
    processor, learning curve, acceptance probe): probe rows on scenes never trained on."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        processor = toy_processor()
        model = toy_model(processor, recipe["seed"]).train()
        rng = random.Random(recipe["seed"])
        text = toy_world.icl_text_pieces(processor)
        scenes, pixels = toy_scenes(processor, recipe["scenes"], rng)
        probe_set = toy_scenes(processor, max(64, recipe["scenes"] // 8), random.Random(recipe["seed"] + 1))
        total = recipe["named_steps"] + recipe["episode_steps"]
        optimizer = torch.optim.AdamW(model.parameters(), lr=recipe["lr"])
        scheduler = get_cosine_schedule_with_warmup(optimizer, recipe["warmup"], total)
        curve, losses = [], []
        for step in (bar := tqdm(range(total), desc=f"meta-training toy-idefics2 (seed {recipe['seed']})",
                                 dynamic_ncols=True)):
            named = None if step < recipe["named_steps"] else rng.random() < recipe["named_fraction"]
            batch = toy_batch(processor, text, scenes, pixels, draw_episodes(recipe, rng, len(scenes), named))
            loss = model(**data.model_inputs(batch), labels=batch["labels"]).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{loss.item():.3f}")
            if (step + 1) % recipe["probe_every"] == 0:
                curve.append({"step": step + 1, "loss": sum(losses) / len(losses),
                              **probe_row(model, processor, text, probe_set)})
                losses = []
                log(f"step {step + 1}: loss {curve[-1]['loss']:.3f}  " + describe_probe(curve[-1]))
        final = probe_row(model, processor, text, probe_set, n=PROBE_EPISODES)  # leaves the model in train mode
        return model.eval(), processor, curve, final
    finally:
        torch.set_num_threads(before)


def learns_in_context(row, accept=ACCEPT):
    """Whether an acceptance probe shows in-context learning of the target task (ACCEPT's bounds)."""
    return row["8-shot"][TOY_TARGET] >= accept["8-shot"] and row["0-shot"][TOY_TARGET] <= accept["0-shot"]


def build_toy(path, recipe=TOY_RECIPE, tries=3, threads=1, accept=ACCEPT):
    """Meta-train toy-idefics2 with seeds recipe["seed"], +1, ... until a build passes the acceptance probe; write
    that one atomically to `path` (checksum, recipe with the accepted seed, probe and curve in the metadata).
    A ValueError if none of the `tries` passes: then nothing is written. Returns (model, processor)."""
    for seed in range(recipe["seed"], recipe["seed"] + tries):
        start = time.perf_counter()
        model, processor, curve, final = meta_train({**recipe, "seed": seed}, threads, log=tqdm.write)
        passed = learns_in_context(final, accept)
        print(f"toy-idefics2 seed {seed} ({time.perf_counter() - start:.0f} s, {threads} thread(s)): "
              + describe_probe(final) + (" -> accepted" if passed else " -> does not learn in context, rejected"))
        if passed:
            tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
            meta = {"sha256": files.weights_digest(tensors), "recipe": json.dumps({**recipe, "seed": seed}),
                    "probe": json.dumps(final), "curve": json.dumps(curve), "threads": json.dumps(threads)}
            files.atomic_write(path, lambda f: f.write(save(tensors, metadata=meta)))
            print(f"toy-idefics2: -> {path} (use it with --model {path})")
            return model, processor
    raise ValueError(f"no toy-idefics2 build learned in context in {tries} tries (seeds {recipe['seed']}.."
                     f"{recipe['seed'] + tries - 1}: 8-shot {TOY_TARGET} below {accept['8-shot']} or 0-shot above "
                     f"{accept['0-shot']}); nothing was written. Try other seeds (--seed) or more (--build-tries)")
