"""CHAIR (Rohrbach et al. 2018, "Object Hallucination in Image Captioning"): the hallucinated COCO objects of
captions, counted as chair.py counts them."""
import hashlib
import os

from lab.datasets import readers
from lab.scores import metrics


# The synonym list of Rohrbach et al. as published (data/synonyms.txt of github.com/LisaAnne/Hallucination, read by
# their utils/chair.py), shipped byte for byte as lab/scores/chair-synonyms.txt (its sha256 checked on import): one
# COCO category a line, its instances_*2014.json name first, then the words a caption may use for it, in singular
# form (captions are singularised first), repetitions and stray spaces included.
CHAIR_SYNONYMS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chair-synonyms.txt")

CHAIR_SYNONYMS_SHA256 = "b685537b36fe21b791c87151b96a991ceb582edff19f3da204dcc7a7905502f2"


def published_synonyms(path=CHAIR_SYNONYMS, sha256=CHAIR_SYNONYMS_SHA256):
    """The text of the published synonyms.txt; a ValueError if the file is not the published one."""
    with open(path, "rb") as f:
        raw = f.read()
    if hashlib.sha256(raw).hexdigest() != sha256:
        raise ValueError(f"{path} is not the published CHAIR synonyms.txt (sha256 differs); "
                         "restore it with `git checkout lab/scores/chair-synonyms.txt`")
    return raw.decode()


def read_synonyms(text):
    """{category: "word, word, ..."} of a synonyms.txt (one category a line, its name first, ", " between words).
    Each word is stripped and lowercased, where chair.py keeps it as split: its " motor bike", " cheesecake" (a
    leading space) and "iPhone" (a capital, against lowercased captions) can never match there, and do here."""
    out = {}
    for n, line in enumerate(text.splitlines(), 1):
        words = [w.strip().lower() for w in line.split(", ")]
        if not all(words):
            raise ValueError(f"synonyms line {n}: expected `category, word, ...`, got {line!r}")
        out[words[0]] = ", ".join(dict.fromkeys(words))
    return out


COCO_SYNONYMS = read_synonyms(published_synonyms())

# Word pairs read as another word before matching, as chair.py's double_word_dict: an age qualifier or "passenger"
# before an animal or a vehicle is not a person ("baby elephant" -> elephant), a toilet seat is the toilet, not a
# chair, a bow tie a tie, and "train track" and "home plate" are no object (no train; "plate" is none anyway).
_ANIMALS = ("bird", "cat", "dog", "horse", "sheep", "cow", "elephant", "bear", "zebra", "giraffe", "animal", "cub")

_READ_AS = {f"{q} {a}": a for q in ("baby", "adult") for a in _ANIMALS} | \
    {"passenger jet": "jet", "passenger train": "train", "toilet seat": "toilet", "bow tie": "tie"} | \
    {"train track": "train track", "home plate": "home plate"}  # chair.py's: no train, no object at all

_IRREGULAR = {"taxis": "taxi", "scissors": "scissors", "tvs": "tv", "buffaloes": "buffalo", "flamingoes": "flamingo",
              "pocketknives": "pocketknife", "people": "people", "children": "child", "mice": "mouse",
              "knives": "knife", "geese": "goose", "oxen": "oxen", "calves": "calf", "feet": "foot", "teeth": "tooth",
              "wolves": "wolf", "leaves": "leaf", "shelves": "shelf", "loaves": "loaf", "halves": "half",
              "wives": "wife", "corgis": "corgi", "broccolis": "broccoli", "zebus": "zebu", "mouses": "mouse"}


def singularize(word):
    """The singular of an English noun, by rule (irregular forms, -men, -ies, -(s|x|z|ch|sh)es, -s); words ending in
    ss / us / is, and words of at most three letters, are kept (glass, bus, tennis, yes) unless _IRREGULAR names
    them (taxis -> taxi, as chair.py's singulariser reads it; tvs -> tv)."""
    if word in _IRREGULAR:
        return _IRREGULAR[word]
    if word.endswith("men") and word not in ("omen", "specimen"):
        return word[:-3] + "man"
    if len(word) <= 3 or word.endswith(("ss", "us", "is")):
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "uses", "xes", "zes", "ches", "shes")):
        return word[:-2]
    return word[:-1] if word.endswith("s") else word


# chair.py's quirks, which its published numbers (the paper's Table 5 among them) include, so counted by default
# (--chair; --chair corrected counts without them): pattern.en's singularize turns these caption words into
# non-words ("bus" -> "bu", so a singular bus is never counted; "ties" -> "ty", "canoes" -> "cano"), and three
# synonyms of synonyms.txt can never match as written there (CHAIR_PY_UNMATCHED; read_synonyms says why).
# pattern.en also keeps "doggies" as it is (no dog) and reads people, skis, oxen, tennis as person, ski, ox, "tenni"
# (so "tennis racket" is a racket); chair.py joins no "dining table" (a table) and keeps punctuation tokens, which
# part a pair ("hot, dog" is a dog).
CHAIR_PY_SINGULAR = {"bus": "bu", "minibus": "minibu", "airbus": "airbu", "ties": "ty", "canoes": "cano",
                     "doggies": "doggies", "people": "person", "skis": "ski", "oxen": "ox", "tennis": "tenni"}

CHAIR_PY_UNMATCHED = ("motor bike", "cheesecake", "iphone")

CHAIR_PY_UNJOINED = ("dining table",)


def chair_vocabulary(categories):
    """{word or phrase: category} for the given categories (the instances file's), from COCO_SYNONYMS (a category
    missing from it is read by its own name)."""
    return {w: c for c in categories for w in (COCO_SYNONYMS.get(c) or c).split(", ")}


def caption_objects(caption, vocabulary, count="chair.py"):
    """The object mentions of a caption, in order, with repetition: [(word, category)], counted as chair.py counts.
    Tokenised as for CIDEr, each word singularised, then read left to right: two words that form a multi-word
    synonym or a _READ_AS phrase are taken as one word ("hot dog" is a hot dog, not a dog; "teddy bears" a teddy
    bear; "train tracks" no train), else the word alone. Only pairs are joined, as in chair.py, so "stove top oven"
    is two ovens (stove, oven). "seat" does not count when the caption mentions a toilet. count "chair.py" keeps
    chair.py's quirks (CHAIR_PY_SINGULAR, CHAIR_PY_UNMATCHED); "corrected" counts those words as what they are."""
    quirks = count == "chair.py"
    tokens = [t.lower() for t in metrics._ptb_tokens(caption)] if quirks else metrics.tokenize_caption(caption)
    words = [CHAIR_PY_SINGULAR.get(w) if quirks and w in CHAIR_PY_SINGULAR else singularize(w) for w in tokens]
    out, i = [], 0
    while i < len(words):
        pair = " ".join(words[i:i + 2])
        joined = i + 1 < len(words) and (pair in vocabulary and not (quirks and pair in CHAIR_PY_UNJOINED)
                                         or pair in _READ_AS)
        out.append(_READ_AS.get(pair, pair) if joined else words[i])
        i += 2 if joined else 1
    if "toilet" in out:
        out = [w for w in out if w != "seat"]
    return [(w, vocabulary[w]) for w in out if w in vocabulary and not (quirks and w in CHAIR_PY_UNMATCHED)]


def chair(captions, annotated, references, vocabulary, count="chair.py"):
    """CHAIR_s, CHAIR_i (Rohrbach et al. 2018) and object Recall of generated captions, as fractions, and {id:
    hallucinated words}. captions: {id: generated caption}; annotated: {id: set of categories in the image's instance
    annotations}; references: {id: [reference captions]}. An image's ground-truth objects are its annotated categories
    plus the categories its references mention (caption_objects, by `count` as for the captions); a mention is
    hallucinated if its category is not among them.
        CHAIR_i = hallucinated mentions / all mentions       (mentions counted with repetition)
        CHAIR_s = captions with a hallucinated mention / captions
        Recall  = sum over images |mentioned categories & ground truth| / sum over images |ground truth|
    A ratio whose denominator is 0 (no mention; no ground-truth object) is reported as 0."""
    mentions = hallucinated = bad_captions = covered = truth_total = 0
    per_caption = {}
    for i, caption in captions.items():
        truth = set(annotated[i]) | {c for r in references[i] for _, c in caption_objects(r, vocabulary, count)}
        found = caption_objects(caption, vocabulary, count)
        per_caption[i] = [w for w, c in found if c not in truth]
        mentions, hallucinated = mentions + len(found), hallucinated + len(per_caption[i])
        bad_captions += bool(per_caption[i])
        covered, truth_total = covered + len({c for _, c in found} & truth), truth_total + len(truth)
    return {"chair_s": bad_captions / len(captions), "chair_i": hallucinated / mentions if mentions else 0.0,
            "recall": covered / truth_total if truth_total else 0.0}, per_caption


def chair_metrics(items, predictions, count="chair.py"):
    """Table 5 for caption items: CHAIR_s, CHAIR_i and Recall x 100, with the objects of the COCO instances files of
    the items' image folders (readers.read_instances) and the items' reference captions. count "chair.py" (chair.py's
    count, quirks included) names them chair_s, chair_i, recall; "corrected" chair_s_corrected, ..."""
    annotated, categories = readers.read_instances(items)
    vocabulary = chair_vocabulary(categories)
    result, _ = chair({it.id: p for it, p in zip(items, predictions)}, annotated,
                      {it.id: it.answers for it in items}, vocabulary, count)
    suffix = "" if count == "chair.py" else "_" + count
    return {k + suffix: 100 * v for k, v in result.items()}
