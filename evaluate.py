"""
Evaluation: metrics as the official benchmark code computes them, inference, and the efficiency table (Table 6).
"""
import math
import re
from collections import Counter

# -----------------------------------------------------------------------------
# metrics

# VQA answer normalisation tables, as in the official vqaEval.py (GT-Vision-Lab/VQA).
# The official contraction table also holds capitalised keys (Im, Ive, Id've, I'dve) and identity
# entries (let's, she's); they can never change a lowercased answer and are left out here.
_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's",
    "howd": "how'd", "howll": "how'll", "hows": "how's", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've",
    "it'dve": "it'd've", "itll": "it'll", "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've",
    "mightn'tve": "mightn't've", "mightve": "might've", "mustnt": "mustn't", "mustve": "must've",
    "neednt": "needn't", "notve": "not've", "oclock": "o'clock", "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at", "shant": "shan't",
    "shed've": "she'd've", "she'dve": "she'd've", "shouldve": "should've", "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've", "somebodyll": "somebody'll",
    "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've",
    "someone'dve": "someone'd've", "someonell": "someone'll", "someones": "someone's",
    "somethingd": "something'd", "somethingd've": "something'd've", "something'dve": "something'd've",
    "somethingll": "something'll", "thats": "that's", "thered": "there'd", "thered've": "there'd've",
    "there'dve": "there'd've", "therere": "there're", "theres": "there's", "theyd": "they'd",
    "theyd've": "they'd've", "they'dve": "they'd've", "theyll": "they'll", "theyre": "they're",
    "theyve": "they've", "twas": "'twas", "wasnt": "wasn't", "wed've": "we'd've", "we'dve": "we'd've",
    "weve": "we've", "werent": "weren't", "whatll": "what'll", "whatre": "what're", "whats": "what's",
    "whatve": "what've", "whens": "when's", "whered": "where'd", "wheres": "where's", "whereve": "where've",
    "whod": "who'd", "whod've": "who'd've", "who'dve": "who'd've", "wholl": "who'll", "whos": "who's",
    "whove": "who've", "whyll": "why'll", "whyre": "why're", "whys": "why's", "wont": "won't",
    "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've",
    "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll", "yall'd've": "y'all'd've",
    "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd", "youd've": "you'd've",
    "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}
_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
            "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}
_ARTICLES = {"a", "an", "the"}
_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!"]
_COMMA_STRIP = re.compile(r"(\d)(,)(\d)")
# The official pattern is "(?!<=\d)(\.)(?!\d)": its "(?!<=" is a lookahead for the literal "<=", not a
# lookbehind, so in effect it deletes every '.' that is not followed by a digit ("5." -> "5", "2.5" kept).
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")


def _clean_whitespace(s):
    return s.replace("\n", " ").replace("\t", " ").strip()


def _process_punctuation(s):
    # Each mark is deleted if it touches a space in the *input* or the input has a digit,digit comma;
    # otherwise it becomes a space. The official call passes re.UNICODE (= 32) as sub's *count*
    # argument, so at most 32 periods are removed.
    out = s
    for p in _PUNCT:
        if p + " " in s or " " + p in s or _COMMA_STRIP.search(s) is not None:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return _PERIOD_STRIP.sub("", out, count=32)


def _process_digit_article(s):
    words = [_NUMBERS.get(w, w) for w in s.lower().split()]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES)


def normalize_vqa_answer(ans):
    """Normalise an answer as the official VQA evaluation (vqaEval.py, GT-Vision-Lab/VQA) does:
    newline/tab -> space and strip, then processPunctuation, then processDigitArticle (lowercase,
    number words -> digits, drop a/an/the, restore contractions like dont -> don't)."""
    return _process_digit_article(_process_punctuation(_clean_whitespace(ans)))


def vqa_accuracy(prediction, answers):
    """VQA accuracy of one prediction against the ten human answers, as vqaEval.py computes it:
    for each human answer, min(1, #matches among the other nine / 3), averaged over the ten.
    Quirk kept: punctuation/digit/article normalisation is applied (to the answers and to the
    prediction) only when the whitespace-cleaned answers are not all identical. Returns a float in [0, 1]."""
    prediction = _clean_whitespace(prediction)
    answers = [_clean_whitespace(a) for a in answers]
    if len(set(answers)) > 1:
        prediction = normalize_vqa_answer(prediction)
        answers = [normalize_vqa_answer(a) for a in answers]
    matches = [a == prediction for a in answers]
    total = sum(matches)
    return sum(min(1.0, (total - m) / 3) for m in matches) / len(answers)


# Tokens the official PTBTokenizer wrapper (pycocoevalcap/tokenizer/ptbtokenizer.py) drops after
# tokenising; brackets and double quotes are here because PTB rewrites them as -LRB-, ``, '' etc.
_PTB_DROPPED = {"''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";", '"', "(", ")", "{", "}"}
_CLITIC = re.compile(r"(?<=\w)(n't|'s|'re|'ve|'ll|'d|'m)\b")
_TOKEN = re.compile(r"'(?:s|re|ve|ll|d|m)\b|\w+(?:[-.,']\w+)*|\S")


def tokenize_caption(s):
    """Pure-Python approximation of the Java Stanford PTBTokenizer (-lowerCase) plus the punctuation
    removal of pycocoevalcap's ptbtokenizer.py. Lowercases; splits off clitics ("dog's" -> dog 's,
    "don't" -> do n't) and symbols; keeps hyphenated words and numbers like 1,000 / 2.5 whole; drops
    the punctuation tokens the official wrapper removes. Returns the list of tokens. Known differences
    from Java PTB: abbreviations lose their final period ("mr." -> mr), brackets are dropped."""
    s = _CLITIC.sub(r" \1", s.lower())
    return [t for t in _TOKEN.findall(s) if t not in _PTB_DROPPED]


def _ngram_counts(words, n=4):
    return Counter(tuple(words[i:i + k]) for k in range(1, n + 1) for i in range(len(words) - k + 1))


def _tfidf(counts, df, log_num_images, n=4):
    # per order: {ngram: tf * idf}, and its L2 norm; idf = log(#images) - log(max(1, df))
    vec = [{} for _ in range(n)]
    for g, tf in counts.items():
        vec[len(g) - 1][g] = tf * (log_num_images - math.log(max(1.0, df.get(g, 0.0))))
    return vec, [math.sqrt(sum(v * v for v in d.values())) for d in vec]


def _sim(cand, ref, sigma):
    # clipped cosine per n-gram order, times the Gaussian length penalty
    (vec_c, norm_c, len_c), (vec_r, norm_r, len_r) = cand, ref
    penalty = math.exp(-((len_c - len_r) ** 2) / (2 * sigma ** 2))
    out = []
    for vc, vr, nc, nr in zip(vec_c, vec_r, norm_c, norm_r):
        val = sum(min(v, vr.get(g, 0.0)) * vr.get(g, 0.0) for g, v in vc.items())
        out.append(val / (nc * nr) * penalty if nc and nr else 0.0)  # at norm 0 the official val is 0 anyway
    return out


def cider_d(candidates, references, n=4, sigma=6.0):
    """CIDEr-D as pycocoevalcap's CiderScorer (coco-caption, the "CIDEr" of the COCO caption
    evaluation) computes it. candidates: {id: caption}, references: {id: [captions]}; captions are
    tokenised with tokenize_caption first. Document frequency counts each image once per n-gram
    (over the union of its references), idf is taken against log(#images); per n-gram order a clipped
    tf-idf cosine times exp(-delta^2 / (2 sigma^2)); averaged over references and over n = 1..4, x10.
    The official code measures length in bigrams; word counts give the same length difference
    whenever both captions are non-empty, and otherwise the cosine is 0, so words are used here.
    Returns (corpus score = mean over ids, {id: score})."""
    assert candidates.keys() == references.keys(), "candidates and references must share ids"
    refs = {i: [_ngram_counts(tokenize_caption(r), n) for r in references[i]] for i in references}
    assert all(refs.values()), "every id needs at least one reference"
    df = Counter(g for counts in refs.values() for g in set().union(*counts))
    log_num_images = math.log(len(refs))

    def features(counts):
        vec, norm = _tfidf(counts, df, log_num_images, n)
        return vec, norm, sum(tf for g, tf in counts.items() if len(g) == 1)

    scores = {}
    for i, cand in candidates.items():
        c = features(_ngram_counts(tokenize_caption(cand), n))
        per_order = [0.0] * n
        for r in refs[i]:
            per_order = [a + b for a, b in zip(per_order, _sim(c, features(r), sigma))]
        scores[i] = 10.0 * sum(per_order) / n / len(refs[i])
    return sum(scores.values()) / len(scores), scores


def _yes_no(pred):
    # MME's official calculation.py: exact yes/no, else look for "yes" then "no" in the first 4 chars
    if pred in ("yes", "no"):
        return pred
    return "yes" if "yes" in pred[:4] else "no" if "no" in pred[:4] else "other"


_OPTION = re.compile(r"^\(?([a-z])(?![a-z0-9])")


def multiple_choice_accuracy(predictions, answers):
    """Accuracy for MME (yes/no) and SEED-Bench style (option letter) questions, in [0, 1].
    Both sides are stripped and lowercased. If the answer is yes/no, the prediction is parsed as
    MME's official eval_tool/calculation.py does (exact yes/no, else "yes" or, failing that, "no"
    found in its first 4 characters, else wrong). Otherwise the answer is an option letter and the
    prediction's option is its first character, optionally after "(", when that character is a
    letter not followed by a letter or digit ("B", "B.", "(b) cat", "B) cat"; "Bus" has no option).
    SEED-Bench's official evaluation ranks option likelihoods; this is the usual generative variant."""
    assert len(predictions) == len(answers)
    correct = 0
    for pred, ans in zip(predictions, answers):
        pred, ans = pred.strip().lower(), ans.strip().lower()
        if ans in ("yes", "no"):
            correct += _yes_no(pred) == ans
        else:
            m = _OPTION.match(pred)
            correct += m is not None and m.group(1) == ans
    return correct / len(answers)
