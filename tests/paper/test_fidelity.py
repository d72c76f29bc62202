"""Fidelity details: the last layer's own output (Eq 16's h^(L)), Eq 16's per-query averaging, PTB caption tokens."""
import pytest
import torch

import benchmarks
import data
import model as M
import train
from helpers import PAPER
from lorentz import euclidean_anchor_loss, hyperbolic_anchor_loss, layer_norm, tangent_distance
from lab.datasets import tasks
from lab.models import backbones
from lab.run import teacher_cache, training_batches
from lab.scores import metrics
from helpers import lab_train_args


# ------------------------------------------------------------------------- h^(L): the last layer's own output

def with_final_norm_not_one(family, seed=0):
    """A tiny twin whose final norm has a non-uniform weight (as real checkpoints do; the twins have weight 1)."""
    backbone = backbones.load_backbone(f"tiny-{family}")
    norm = backbone.model.get_decoder().norm
    with torch.no_grad():
        norm.weight.copy_(0.5 + torch.rand(norm.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return backbone, norm


def prompts(backbone):
    """Two VQAv2 prompts (images included) in the family's format, left-padded."""
    items = tasks.load_task("vqav2", "val", benchmarks.ROOT)[:2]
    return data.model_inputs(data.prompt_batch(backbone.processor, backbone.family, "vqa", items, None), "cpu")


@pytest.fixture(scope="module", params=PAPER)
def family(request):
    """The paper's four families (every registered one: tests/lab/models/test_family_records.py)."""
    return request.param


def test_layer_outputs_are_every_layers_own_output(family):
    backbone, norm = with_final_norm_not_one(family)
    inputs = prompts(backbone)
    with torch.no_grad():
        out, states = M.layer_outputs(backbone.model, **inputs)
        hidden = backbone.model(**inputs, output_hidden_states=True).hidden_states
    assert len(states) == len(backbone.model.get_decoder().layers) == len(hidden) - 1
    for l in range(len(states) - 1):                       # layers 1..L-1: what transformers reports
        assert torch.equal(states[l], hidden[l + 1])
    # layer L: transformers reports it after the final norm; h^(L) is the layer's output before it
    assert torch.allclose(norm(states[-1]), hidden[-1], atol=1e-6)
    assert not torch.allclose(states[-1], hidden[-1], atol=1e-2)
    assert torch.equal(out.logits, backbone.model(**inputs).logits)


def test_teacher_and_student_both_align_the_last_layers_own_output():
    backbone, norm = with_final_norm_not_one("idefics2")
    args = lab_train_args(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT,
                           "--no-teacher-cache"])
    queries = tasks.load_task(args.task, "train", args.data_root)[:3]
    pieces = data.query_pieces(backbone.processor, backbone.family, "vqa", queries)
    student = data.student_batch(backbone.processor, backbone.family, "vqa", pieces)
    with torch.no_grad():
        # no ICDs and no adapter: the teacher reads what the student reads, so the anchor is exactly 0 ...
        teacher = train.run_teacher(backbone, data.teacher_batch(backbone.processor, backbone.family, "vqa", pieces,
                                                                 [[]] * 3))
        laid = training_batches.align_teacher(teacher, student["query_target"])
        assert train.losses(backbone, args, student, laid)["anchor"] == 0
        # ... and the teacher's last layer is h^(L), which the final norm maps onto transformers' last hidden state
        last = backbone.model(**data.model_inputs(student), output_hidden_states=True).hidden_states[-1]
        for b, states in enumerate(teacher):
            assert torch.allclose(norm(states[-1]), last[b, student["query_target"][b]], atol=1e-5)
            assert not torch.allclose(states[-1], last[b, student["query_target"][b]], atol=1e-2)


def test_the_teacher_cache_key_names_the_state_definition(monkeypatch):
    args = lab_train_args(["--model", "tiny-idefics2", "--task", "vqav2", "--data-root", benchmarks.ROOT])
    query = tasks.load_task(args.task, "train", args.data_root)[0]
    key = teacher_cache.teacher_key("b", args.task, query, [])
    monkeypatch.setattr(M, "LAYER_OUTPUTS_VERSION", M.LAYER_OUTPUTS_VERSION + 1)
    assert teacher_cache.teacher_key("b", args.task, query, []) != key


# ---------------------------------------------------------------------------- Eq 16: per query, then the batch

def test_anchor_losses_average_per_query_then_over_the_batch():
    g = torch.Generator().manual_seed(0)
    L, B, T, d, kappa = 3, 3, 6, 5, 0.3
    student, teacher = 2 * torch.randn(2, L, B, T, d, generator=g, dtype=torch.float64)
    mask = torch.zeros(B, T, dtype=torch.bool)
    mask[0, :6], mask[1, 4:], mask[2, 3] = True, True, True     # 6, 2 and 1 tokens
    hyp = lambda s, t: tangent_distance(layer_norm(s), layer_norm(t), kappa) ** 2
    euc = lambda s, t: ((layer_norm(s) - layer_norm(t)) ** 2).sum()
    for dist, loss in ((hyp, lambda: hyperbolic_anchor_loss(student, teacher, mask, kappa)),
                       (euc, lambda: euclidean_anchor_loss(student, teacher, mask))):
        per_query = []
        for b in range(B):
            tokens = mask[b].nonzero().flatten().tolist()
            per_query.append(sum(sum(dist(student[l, b, i], teacher[l, b, i]) for i in tokens) / len(tokens)
                                 for l in range(L)) / L)
        expected = sum(per_query) / B
        pooled = sum(dist(student[l, b, i], teacher[l, b, i]) for l in range(L) for b, i in mask.nonzero().tolist()) \
            / (L * int(mask.sum()))
        assert torch.allclose(loss(), expected, rtol=1e-10, atol=0)
        assert not torch.allclose(expected, pooled, rtol=1e-3)   # the rows' lengths differ enough to tell


def test_a_query_without_aligned_tokens_is_left_out():
    g = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 2, 2, 4, 3, generator=g, dtype=torch.float64)
    mask = torch.tensor([[True, True, False, False], [False] * 4])
    assert torch.allclose(euclidean_anchor_loss(student, teacher, mask),
                          euclidean_anchor_loss(student[:, :1], teacher[:, :1], mask[:1]), rtol=1e-12)


# ------------------------------------------------------------- captions: the PTB tokenizer as pycocoevalcap runs it
# Expected tokens written by hand from the Stanford PTBTokenizer's rules (CoreNLP 3.4.1 PTBLexer, default options,
# -lowerCase), then pycocoevalcap's drop list ('' ' `` ` . ? ! , : - -- ... ; and the upper-case -LRB- ...).

@pytest.mark.parametrize("raw, expected", [
    # abbreviations keep their period: acronyms and titles (ABBREV2), ABBREV1 even at the end of the caption
    ("A bus in the U.S. on St. Mark's street", ["a", "bus", "in", "the", "u.s.", "on", "st.", "mark", "'s", "street"]),
    ("Mr. Smith sells fruit, vegetables etc.", ["mr.", "smith", "sells", "fruit", "vegetables", "etc."]),
    ("A t.v. on a stand", ["a", "t.v.", "on", "a", "stand"]),
    ("The No. 5 bus", ["the", "no.", "5", "bus"]),               # ABBREV3: only before a number
    ("He said no.", ["he", "said", "no"]),
    ("A farm in Springfield, Ill.", ["a", "farm", "in", "springfield", "ill."]),  # [I]ll: capital I only
    ("A man who looks ill.", ["a", "man", "who", "looks", "ill"]),
    ("A horse.", ["a", "horse"]),                                # an ordinary word loses the sentence's period
])
def test_ptb_abbreviations(raw, expected):
    assert metrics.tokenize_caption(raw) == expected


@pytest.mark.parametrize("raw, expected", [
    ("A clock showing 5:30 and 10:45.", ["a", "clock", "showing", "5:30", "and", "10:45"]),   # NUM: digits[.:,]digits
    ("1/2 of a pizza and 1-1/2 cakes", ["1/2", "of", "a", "pizza", "and", "1-1/2", "cakes"]),  # FRAC
    ("A 1,000 piece puzzle, 2.5 feet wide", ["a", "1,000", "piece", "puzzle", "2.5", "feet", "wide"]),
    ("Dated 12/25/2014", ["dated", "12/25/2014"]),                                              # DATE
])
def test_ptb_numbers_times_fractions(raw, expected):
    assert metrics.tokenize_caption(raw) == expected


@pytest.mark.parametrize("raw, expected", [
    ("A sign says cannot park", ["a", "sign", "says", "can", "not", "park"]),
    ("Cannot", ["can", "not"]),
    ("I'm gonna eat", ["i", "'m", "gon", "na", "eat"]),
    ("You gotta see", ["you", "got", "ta", "see"]),
    ("Wanna play? Lemme see", ["wan", "na", "play", "lem", "me", "see"]),
    ("Don't, can't, they're", ["do", "n't", "ca", "n't", "they", "'re"]),
])
def test_ptb_split_assimilations_and_clitics(raw, expected):
    assert metrics.tokenize_caption(raw) == expected


@pytest.mark.parametrize("raw, expected", [
    ("A rock 'n' roll band", ["a", "rock", "'n'", "roll", "band"]),
    ("A car from the '90s", ["a", "car", "from", "the", "'90s"]),
    ("At five o'clock", ["at", "five", "o'clock"]),
    ("Two dogs' toys", ["two", "dogs", "toys"]),                 # a lone apostrophe is a quote: dropped
])
def test_ptb_apostrophe_words(raw, expected):
    assert metrics.tokenize_caption(raw) == expected


@pytest.mark.parametrize("raw, expected", [
    ("A cat (black) on a [red] {mat}", ["a", "cat", "-lrb-", "black", "-rrb-", "on", "a", "-lsb-", "red", "-rsb-",
                                        "-lcb-", "mat", "-rcb-"]),
    ('A "stop" sign -- and... a dog; ok?', ["a", "stop", "sign", "and", "a", "dog", "ok"]),
    ("Salt and/or pepper", ["salt", "and/or", "pepper"]),
    ("A black-and-white x-ray", ["a", "black-and-white", "x-ray"]),
])
def test_ptb_brackets_quotes_and_compounds(raw, expected):
    assert metrics.tokenize_caption(raw) == expected
