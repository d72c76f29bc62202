"""The checks of evaluate.predict's arguments (the Python API): one ValueError naming the argument or the item,
before any batch is built, instead of answers misaligned with their items."""
import numbers
from collections.abc import Sequence

import data
from lab.datasets import readers, tasks


def check_predict(task, items, icds, batch_size, likelihood, new_tokens=None):
    """Refuse items or icds that are not lists, a batch_size or new_tokens that is not an integer >= 1, ICD lists not
    one per item (each a list), an item's or ICD's text that is no plain text (check_text), an unknown task (listing
    the tasks), likelihood on a task that is not multiple choice or on an item without one option per letter."""
    if not isinstance(items, Sequence) or (icds is not None and not isinstance(icds, Sequence)):
        raise ValueError(f"items and icds must be lists (got {type(items).__name__}, {type(icds).__name__}); a "
                         "generator is read once and its length is unknown")
    for name, value in (("batch_size", batch_size), ("new_tokens", 1 if new_tokens is None else new_tokens)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer of at least 1 (got {value!r})")
    if icds is not None and len(icds) != len(items):
        raise ValueError(f"icds holds {len(icds)} demonstration lists for {len(items)} items; give one list per item "
                         "(an empty one for none), or icds=None")
    bad = next((n for n, d in enumerate(icds or ()) if isinstance(d, str) or not isinstance(d, Sequence)), None)
    if bad is not None:
        raise ValueError(f"icds[{bad}] is {type(icds[bad]).__name__}; each item's demonstrations are a list of Items")
    for it in items:  # a question holding `<image>`: an image token without its image, after the model ran
        check_text(it, f"item {getattr(it, 'id', '?')}")
    for k, demos in enumerate(icds or ()):
        for j, d in enumerate(demos):
            check_text(d, f"icds[{k}][{j}] (item {getattr(d, 'id', '?')})")
    kind = tasks.spec(task).kind  # an unknown task: a ValueError listing the tasks
    if likelihood and kind != "choice":
        raise ValueError(f"likelihood ranks a multiple-choice item's options; {task} is a {kind} task, not one")
    for it in items if likelihood else ():
        if len(it.answers) != len(data.SEED_LETTERS):
            raise ValueError(f"item {it.id}: likelihood needs {len(data.SEED_LETTERS)} options "
                             f"({', '.join(data.SEED_LETTERS)}), it has {len(it.answers)}")


def check_text(item, where):
    """The texts of an item that reach a row (its question, answers and target: an ICD's answer, a choice's options),
    each plain text (readers.plain_text: no image placeholder, control token or lone surrogate, which the tokenizer
    would take for an image or a turn's end, or refuse after the model loaded); a ValueError naming `where`."""
    texts = [("question", getattr(item, "question", None)), ("target", getattr(item, "target", None))]
    answers = getattr(item, "answers", None)
    texts += [("answers", a) for a in (answers if isinstance(answers, (list, tuple)) else ())]
    for name, text in texts:
        if isinstance(text, str):
            try:
                readers.plain_text(text, name)
            except ValueError as e:
                raise ValueError(f"{where}: {e}") from None
