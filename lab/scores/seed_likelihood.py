"""SEED-Bench's official likelihood protocol (evaluate.py --seed-protocol likelihood): each option's log-probability
after the query, the option of the highest chosen (evaluate.predict)."""
import torch

import model as M
from lab.run import prefetch


@torch.no_grad()
def option_logliks(backbone, items, icds=None):
    """SEED-Bench's official likelihood protocol: log p(option) for each item's four options, [len(items), 4].
    As the official code sums each option's per-token losses, end token included, log p(option) is the sum (not
    length-normalised) of the log-probabilities of the option's text tokens and the end token after the query, under
    the official prompt "Question: {q}\nAnswer:" (data.PROMPTS "choice-likelihood"). icds[i] (with their answer's
    text as the answer) precede item i. All 4 x len(items) rows go through one left-padded forward pass."""
    return option_scores(backbone, prefetch.option_rows(backbone.processor, backbone.family, None, (items, icds)),
                         len(items))


@torch.no_grad()
def option_scores(backbone, batch, n_items):
    """log p(option) [n_items, 4] from an option_rows batch (see option_logliks)."""
    batch = {k: v.to(backbone.model.device) for k, v in batch.items()}
    rows = len(batch["labels"])
    logits, labels = M.target_logits(backbone.model, batch)  # the options' positions only
    logits, labels = logits[:, :-1], labels[:, 1:]
    answer = labels != -100                                   # position t predicts token t + 1
    logp = torch.log_softmax(logits[answer].float(), -1).gather(-1, labels[answer][:, None])[:, 0]
    per_row = torch.zeros(rows, device=logp.device).index_add(0, answer.nonzero()[:, 0], logp)
    return per_row.view(n_items, -1).cpu()  # an item's four rows in a row
