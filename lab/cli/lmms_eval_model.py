"""This project's backbones and adapters as an lmms-eval model, `hyper_icl` (README, "In lmms-eval"): model args
backbone= (any name --model takes), checkpoint= (an adapter file of any method, its settings read from it; none: the
backbone alone), device, batch_size. Needs lmms-eval (requirements-lmms-eval.txt), which this file alone imports.

A request's context is the row's text: BOS, then the context, each `<image>` in it taking the next of the request's
images (doc_to_visual); images the context does not place go before it. Rows are tokenised piece by piece and
left-padded by data.collate, as the project's own prompts are (data.py), so a task whose context is the project's
prompt gets the project's answers token for token (tests/lab/cli/test_lmms_eval_model.py)."""
import importlib.machinery
import importlib.util
import os
import sys

import torch
from lmms_eval.api.model import lmms
from tqdm import tqdm

import data as D
import model as M
from lab.datasets import readers
from lab.models import backbones
from lab.run import adapter_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def hugging_face_evaluate():
    """Undo the name clash of this project's evaluate.py with Hugging Face's `evaluate` (an lmms-eval dependency):
    run from the project's root, lmms-eval's `import evaluate` (lmms_eval/api/registry.py) finds evaluate.py first.
    Here the module of that name, and lmms-eval's handle on it, become Hugging Face's, found on sys.path without the
    project's root; where `evaluate` is not imported yet, Hugging Face's is imported now, so that a later `import
    evaluate` finds it. Nothing is done where `evaluate` is already Hugging Face's."""
    held = sys.modules.get("evaluate")
    if held is not None and os.path.dirname(os.path.abspath(getattr(held, "__file__", "") or "")) != ROOT:
        return
    paths = [p for p in sys.path if os.path.abspath(p or ".") != ROOT]
    spec = importlib.machinery.PathFinder.find_spec("evaluate", paths)
    if spec is None:
        raise ImportError("lmms-eval needs Hugging Face's `evaluate` package: "
                          "pip install -r requirements-lmms-eval.txt")
    module = importlib.util.module_from_spec(spec)
    sys.modules["evaluate"] = module
    spec.loader.exec_module(module)
    registry = sys.modules.get("lmms_eval.api.registry")
    if registry is not None:
        registry.hf_evaluate = module


hugging_face_evaluate()


class HyperICL(lmms):
    """lmms-eval's simple model over a project backbone, with an adapter (checkpoint=) or without."""

    def __init__(self, backbone="toy-idefics2", checkpoint=None, device=None, batch_size=1, max_batch_size=None,
                 **unused):
        """max_batch_size: lmms-eval's, for batch_size=auto, which hyper_icl does not take (batch_size N)."""
        super().__init__()
        if unused:
            raise ValueError(f"hyper_icl: unknown model args {', '.join(sorted(unused))} (it takes backbone, "
                             "checkpoint, device, batch_size)")
        if not str(batch_size).isascii() or not str(batch_size).isdigit() or int(batch_size) < 1:  # before loading
            raise ValueError(f"hyper_icl: batch_size={batch_size}: give a number of requests a batch, at least 1")
        self.batch_size, device = int(batch_size), device or ("cuda" if torch.cuda.is_available() else "cpu")
        try:
            kind = torch.device(device).type
        except RuntimeError as e:
            raise ValueError(f"hyper_icl: device={device} is not a device ({e})") from None
        if kind == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"hyper_icl: device={device}, but torch finds no CUDA device here; give device=cpu")
        self.backbone = backbones.load_backbone(backbone, device=device)
        given = checkpoint not in (None, "", "none", "None")
        self.method = adapter_files.load_adapter(checkpoint, self.backbone)["method"] if given else None
        self.ignored = set()  # generation kwargs said to be ignored (once each)

    # ---------------------------------------------------------------------------------------- rows from requests

    def row(self, context, visuals, doc_id, continuation=None):
        """The row of one request: BOS, the context's text before its first image, then one piece an image
        (`<image>` and the text up to the next), as data.encode_prefix and encode_query make them; with a
        continuation, its tokens labelled (read off the tokenisation of the last piece + continuation). A request
        check_request refuses is a ValueError naming the doc."""
        b, tok = self.backbone, self.backbone.processor.tokenizer
        check_request(context, visuals or [], doc_id, continuation)
        visuals = [v.convert("RGB") for v in (visuals or [])]
        placed = context.count("<image>")
        if placed > len(visuals):
            raise ValueError(f"doc {doc_id}: its context has {placed} <image> but the request {len(visuals)} images")
        head, *chunks = ("<image>" * (len(visuals) - placed) + context).split("<image>")
        ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + \
            (tok(head, add_special_tokens=False)["input_ids"] if head else [])
        labels, images = [-100] * len(ids), []
        if continuation is not None and not chunks:
            raise ValueError(f"doc {doc_id}: a likelihood request without an image is not supported by hyper_icl")
        for k, (chunk, image) in enumerate(zip(chunks, visuals)):
            piece = D.encode_piece(b.processor, b.family, "<image>" + chunk, image)
            part, labelled = piece["input_ids"], [-100] * len(piece["input_ids"])
            if continuation is not None and k == len(chunks) - 1:
                whole = D.encode_piece(b.processor, b.family, "<image>" + chunk + continuation, image,
                                       piece["images"] if b.processor.image_layout.reuses_pixels else None)
                if whole["input_ids"][:len(part)] != part:
                    raise ValueError(f"doc {doc_id}: the context's tokens are not a prefix of context + continuation's")
                labelled += whole["input_ids"][len(part):]
                part, piece = whole["input_ids"], whole
            ids, labels, images = ids + part, labels + labelled, images + [piece["images"]]
        return {"input_ids": ids, "labels": labels, "images": images, "query_len": len(ids), "id": doc_id}

    def visuals(self, request):
        """The request's images: its doc_to_visual of its doc (lmms-eval's task_dict)."""
        _, _, doc_to_visual, doc_id, task, split = request.args
        return doc_to_visual(self.task_dict[task][split][doc_id])

    # --------------------------------------------------------------------------------------------- the model API

    def generate_until(self, requests):
        """Each request's continuation: greedy (temperature 0, the default) or sampled, beam search with num_beams, at
        most max_new_tokens (16 by default; generation), stopped at the backbone's end tokens and cut at the first of
        `until`; whitespace stripped. A request without an image is answered from its text alone.
        Requests of the same generation kwargs go in batches of batch_size, in order."""
        answers, groups = {}, {}
        for i, r in enumerate(requests):
            groups.setdefault(repr(sorted(r.args[1].items())), []).append(i)
        with tqdm(total=len(requests), desc=f"{self.backbone.name} generate_until", disable=self.rank != 0) as bar:
            for indices in groups.values():
                for s in range(0, len(indices), self.batch_size):
                    chunk = indices[s:s + self.batch_size]
                    answers.update(zip(chunk, self.generate([requests[i] for i in chunk])))
                    bar.update(len(chunk))
        return [answers[i] for i in range(len(requests))]

    @torch.no_grad()
    def generate(self, requests):
        """The continuations of requests sharing their generation kwargs (generate_until); requests without an image
        (a text-only question) are decoded in a batch of their own."""
        b, tok = self.backbone, self.backbone.processor.tokenizer
        until, settings = self.generation(requests[0].args[1], requests[0].args[4])
        rows = [self.row(r.args[0], self.visuals(r), r.args[3]) for r in requests]
        texts = {}
        for imaged in (True, False):
            part = [i for i, r in enumerate(rows) if bool(r["images"]) == imaged]
            if part:
                batch = D.collate([rows[i] for i in part], b.processor, b.family) if imaged else \
                    text_batch([rows[i] for i in part], tok.pad_token_id)
                inputs = D.model_inputs(batch, b.model.device)
                out = b.model.generate(**inputs, **settings, pad_token_id=tok.pad_token_id,
                                       eos_token_id=backbones.stop_ids(b))
                texts.update(zip(part, tok.batch_decode(out[:, inputs["input_ids"].shape[1]:],
                                                        skip_special_tokens=True)))
        return [cut(texts[i].lstrip(), until).rstrip() for i in range(len(rows))]

    def generation(self, kwargs, task):
        """(until, model.generate's settings) of a request's generation kwargs: max_new_tokens (None or absent: 16;
        more than the backbone's positions: capped at them, said once),
        temperature > 0 or do_sample: sampled at that temperature with top_p, else greedy; num_beams. Any other kwarg
        is said, once, to be ignored; a value these cannot take is a ValueError naming the task."""
        until = kwargs.get("until") or []
        tokens, beams = kwargs.get("max_new_tokens"), kwargs.get("num_beams")
        tokens, beams = 16 if tokens is None else tokens, 1 if beams is None else beams
        temperature, top_p = float(kwargs.get("temperature") or 0), float(kwargs.get("top_p") or 1.0)
        for name, value in (("max_new_tokens", tokens), ("num_beams", beams)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"hyper_icl: task {task}: generation kwarg {name}={value!r}: an integer of at least 1")
        positions = getattr(self.backbone.model.config.get_text_config(), "max_position_embeddings", None)
        if positions and tokens > positions:  # 10**9 ran unbounded: no answer is longer than the backbone reads
            if ("max_new_tokens", task, tokens) not in self.ignored:
                self.ignored.add(("max_new_tokens", task, tokens))
                print(f"hyper_icl: task {task}: generation kwarg max_new_tokens={tokens} is more than "
                      f"{self.backbone.name}'s {positions} positions; capped at {positions}")
            tokens = positions
        if temperature < 0 or not 0 < top_p <= 1:
            raise ValueError(f"hyper_icl: task {task}: temperature={temperature}, top_p={top_p}: temperature at least "
                             "0, top_p in (0, 1]")
        for name in sorted(set(kwargs) - set(GENERATION_KWARGS) - self.ignored):
            self.ignored.add(name)
            print(f"hyper_icl: task {task}: generation kwarg {name}={kwargs[name]!r} is ignored (it takes "
                  f"{', '.join(GENERATION_KWARGS)})")
        sampled = temperature > 0 or bool(kwargs.get("do_sample"))
        settings = dict(do_sample=True, temperature=temperature or 1.0, top_p=top_p) if sampled else \
            dict(do_sample=False)
        return [until] if isinstance(until, str) else list(until), dict(settings, max_new_tokens=tokens,
                                                                          num_beams=beams)

    @torch.no_grad()
    def loglikelihood(self, requests):
        """(nll, is_greedy) for each (context, continuation) request: nll is minus the continuation's summed
        log-probability (SEED-Bench's official rule, not length-normalised), the form lmms-eval's multiple-choice
        scoring takes (its api/task.py picks np.argmin, as for the loss its own models return); is_greedy: greedy
        decoding would produce the continuation's tokens. In batches of batch_size, in order."""
        b, out = self.backbone, []
        for s in tqdm(range(0, len(requests), self.batch_size), desc=f"{b.name} loglikelihood",
                      disable=self.rank != 0):
            chunk = requests[s:s + self.batch_size]
            rows = [self.row(r.args[0], self.visuals(r), r.args[3], continuation=r.args[1]) for r in chunk]
            batch = backbones.to_device(D.collate(rows, b.processor, b.family), b.model.device)
            logits, labels = M.target_logits(b.model, batch)
            logp, labels = torch.log_softmax(logits[:, :-1].float(), -1), labels[:, 1:]  # position t predicts t + 1
            for lp, row in zip(logp, labels):
                lp, target = lp[row != -100], row[row != -100]
                out.append((-float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
        return out

    def generate_until_multi_round(self, requests):
        """Not supported: one line says so."""
        raise NotImplementedError("hyper_icl answers single-round requests only (generate_until, loglikelihood); "
                                  "multi-round tasks are not supported")


GENERATION_KWARGS = ("until", "max_new_tokens", "temperature", "do_sample", "top_p", "num_beams")  # generation()'s


def check_request(context, visuals, doc_id, continuation=None):
    """A ValueError naming the doc for a request no backbone takes, before any is tokenised: an image not of
    data.IMAGE_FORMATS (opened by the task's loader, not loaded yet: an EPS would run Ghostscript now) or of a size
    readers.size_problem refuses (0 x 0: a ZeroDivisionError; 2 x 401: Qwen's processor's message, naming no doc), or
    a context or continuation that is no plain text (readers.plain_text: a lone surrogate, a control token, an image
    placeholder other than the context's `<image>`, which places the request's images)."""
    foreign = [v.format for v in visuals if v.format not in (None, *D.IMAGE_FORMATS)]
    if foreign:
        raise ValueError(f"doc {doc_id}: an image in {foreign[0]} format; hyper_icl takes "
                         f"{', '.join(D.IMAGE_FORMATS)} (data.IMAGE_FORMATS)")
    for k, v in enumerate(visuals, 1):
        problem = readers.size_problem(*v.size)
        if problem:
            raise ValueError(f"doc {doc_id}: {problem.replace('its image', f'its image {k}', 1)}")
    try:
        for text, name in [(chunk, "context") for chunk in context.split("<image>")] + [(continuation, "continuation")]:
            if text is not None:
                readers.plain_text(text, name)
    except ValueError as e:
        raise ValueError(f"doc {doc_id}: {e}") from None


def text_batch(rows, pad):
    """Rows without an image (text-only requests) left-padded as data.collate pads rows: ids, mask and positions."""
    width = max(len(r["input_ids"]) for r in rows)
    mask = torch.tensor([[0] * (width - len(r["input_ids"])) + [1] * len(r["input_ids"]) for r in rows])
    ids = torch.tensor([[pad] * (width - len(r["input_ids"])) + r["input_ids"] for r in rows])
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}


def cut(text, until):
    """text up to the first occurrence of any of `until` (all of it where none occurs)."""
    ends = [text.find(u) for u in until if u and u in text]
    return text[:min(ends)] if ends else text
