"""The metrics as the official tools compute them: VQA accuracy, CIDEr-D with PTB tokenisation, multiple choice,
MME and SEED-Bench scores."""
import math
import re
import statistics
from collections import Counter

from lab.datasets import mme_seed


# VQA answer normalisation tables, as in the official vqaEval.py (GT-Vision-Lab/VQA).
# The official contraction table also holds capitalised keys (Im, Ive, Id've, I'dve) and identity
# entries (let's, she's); they can never change a lowercased answer and are left out here.
_CONTRACTIONS = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't", "dont": "don't",
    "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't", "havent": "haven't",
    "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's", "howd": "how'd", "howll": "how'll",
    "hows": "how's", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've", "itll": "it'll",
    "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've", "mightn'tve": "mightn't've",
    "mightve": "might've", "mustnt": "mustn't", "mustve": "must've", "neednt": "needn't", "notve": "not've",
    "oclock": "o'clock", "oughtnt": "oughtn't", "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at",
    "shant": "shan't", "shed've": "she'd've", "she'dve": "she'd've", "shouldve": "should've", "shouldnt": "shouldn't",
    "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've", "somebody'd": "somebodyd",
    "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've", "somebodyll": "somebody'll",
    "somebodys": "somebody's", "someoned": "someone'd", "someoned've": "someone'd've", "someone'dve": "someone'd've",
    "someonell": "someone'll", "someones": "someone's", "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's", "thered": "there'd",
    "thered've": "there'd've", "there'dve": "there'd've", "therere": "there're", "theres": "there's", "theyd": "they'd",
    "theyd've": "they'd've", "they'dve": "they'd've", "theyll": "they'll", "theyre": "they're", "theyve": "they've",
    "twas": "'twas", "wasnt": "wasn't", "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't",
    "whatll": "what'll", "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's",
    "whered": "where'd", "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll", "whyre": "why're",
    "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't", "wouldnt've": "wouldn't've",
    "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll", "y'allll": "y'all'll",
    "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've", "youd": "you'd",
    "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're", "youve": "you've",
}

_NUMBERS = {"none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
            "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10"}

_ARTICLES = {"a", "an", "the"}

_PUNCT = [";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!"]

_COMMA_STRIP = re.compile(r"(\d)(,)(\d)")

# The official pattern is "(?!<=\d)(\.)(?!\d)": its "(?!<=" is a lookahead for the literal "<=", not a
# lookbehind, so in effect it deletes every '.' that is not followed by a digit ("5." -> "5", "2.5" kept).
_PERIOD_STRIP = re.compile(r"(?!<=\d)(\.)(?!\d)")

# t(0.975, df) of Student's t for df = 1..30: the half-width of a two-sided 95% interval of a mean, in standard errors
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def _clean_whitespace(s):
    return s.replace("\n", " ").replace("\t", " ").strip()


def normalize_vqa_answer(ans):
    """Normalise an answer as the official VQA evaluation (vqaEval.py, GT-Vision-Lab/VQA) does:
    newline/tab -> space and strip, then processPunctuation, then processDigitArticle (lowercase,
    number words -> digits, drop a/an/the, restore contractions like dont -> don't)."""
    s = out = _clean_whitespace(ans)
    # processPunctuation: each mark is deleted if it touches a space in the *input* or the input has a digit,digit
    # comma; otherwise it becomes a space. The official call passes re.UNICODE (= 32) as sub's *count* argument, so
    # at most 32 periods are removed.
    for p in _PUNCT:
        delete = p + " " in s or " " + p in s or _COMMA_STRIP.search(s) is not None
        out = out.replace(p, "" if delete else " ")
    words = [_NUMBERS.get(w, w) for w in _PERIOD_STRIP.sub("", out, count=32).lower().split()]
    return " ".join(_CONTRACTIONS.get(w, w) for w in words if w not in _ARTICLES)


def vqa_accuracy(prediction, answers):
    """VQA accuracy in [0, 1] of one prediction against the ten human answers, as vqaEval.py computes it: for each human
    answer, min(1, #matches among the other nine / 3), averaged over the ten. Quirk kept: the punctuation/digit/article
    normalisation applies (to answers and prediction) only when the whitespace-cleaned answers are not all identical.
    A lone answer (a task of one's own with one `answer`, which leave-one-out would always score 0): 1 if it and the
    prediction are equal once both are normalised, else 0."""
    if len(answers) == 1:
        return float(normalize_vqa_answer(prediction) == normalize_vqa_answer(answers[0]))
    prediction = _clean_whitespace(prediction)
    answers = [_clean_whitespace(a) for a in answers]
    if len(set(answers)) > 1:
        prediction = normalize_vqa_answer(prediction)
        answers = [normalize_vqa_answer(a) for a in answers]
    matches = [a == prediction for a in answers]
    total = sum(matches)
    return sum(min(1.0, (total - m) / 3) for m in matches) / len(answers)


# Captions are tokenised as pycocoevalcap does: the Java Stanford PTBTokenizer (CoreNLP 3.4.1, its default options,
# -preserveLines -lowerCase) on the raw caption, then ptbtokenizer.py drops the punctuation tokens below. Lowercasing
# comes after tokenising (some rules look at case), so brackets become "-lrb-", "-rrb-", ... and stay: the official
# drop list names "-LRB-", "-RRB-", "-LCB-", "-RCB-" in upper case, which no lowercased token matches.
_PTB_DROPPED = {"''", "'", "``", "`", ".", "?", "!", ",", ":", "-", "--", "...", ";"}


def _caseless_words(words):
    """A regex alternation of words, case-insensitive except a first letter written in brackets ("[M]iss")."""
    return "|".join(w[1] + f"(?i:{w[3:]})" if w.startswith("[") else f"(?i:{w})" for w in words.split())


_L, _LD = r"[^\W\d_]", r"[^\W_]"    # a letter; a letter or digit

_APOS, _APOS_ETC = "['\u0092\u2019]", "['`\u0091\u0092\u2018\u2019\u201B]"

_WORD = rf"{_L}{_LD}*(?:[.!?]{_L}{_LD}*)*"

_REDAUX = rf"{_APOS}(?:[msdMSD]|(?i:re|ve|ll))"          # 's 'm 'd 're 've 'll

_SREDAUX = rf"[nN]{_APOS_ETC}[tT]"                          # n't

_ACRO = r"[A-Za-z](?:\.[A-Za-z])*"                        # u.s, a.m, or a single letter

_NUM = r"\d*(?:[.:,]\d+)+|\d+"                             # 2.5, 1,000, 5:30, 2

_THING = rf"(?:[dDoOlL]{_APOS_ETC}{_LD})?{_LD}+"

# PTB's abbreviations, which keep their period: ABBREV1 (usually followed by lower case), ABBREV2 (titles and
# acronyms), ABBREV3 (only before a number).
_ABBREV1 = _caseless_words(
    "Jan Feb Mar Apr Jun Jul Aug Sep Sept Oct Nov Dec Mon Tue Tues Wed Thu Thurs Fri "
    "Ala Ariz [A]z [A]rk Calif Colo Conn Ct Dak [D]el Fla Ga [I]ll Ind Kans Kan Ky [L]a [M]ass Md Mich Minn [M]iss "
    "Mo Mont Neb Nev Okla [O]re [P]a Penn Tenn [T]ex Va Vt [W]ash Wisc Wis Wyo "
    "Inc Cos Co Corp Ltd Plc Rt Bancorp Bhd Assn Univ Intl Sys tel est ext sq Jr Sr Bros Ed.D Ph.D Blvd Rd Esq "
    "etc al seq Bldg") + r"|(?i:pp?t)[ye](?i:s)?"

_ABBREV2 = _caseless_words(
    "Mr Mrs Ms [M]iss Dr Drs Prof Profs Sen Sens Rep Reps Atty Attys Lt Col Gen Messrs Gov Govs Adm Rev Maj Sgt Cpl "
    "Pvt Capt St Ste Ave Pres Lieut Hon Brig Cmdr Comdr Pfc Spc Supt Supts Det Mt Ft Adj Adv Asst Assoc Ens Insp "
    "Mlle Mme Msgr Sfc vs Alex Wm Jos Cie a.k.a cf TREAS Ph Invt Elec Natl Mfg Mtg Dept").replace(".", r"\.") \
    + "|" + _ACRO

_ABBREV3 = _caseless_words("ca fig figs prop no nos art bldg pp op")

_APOWORD = "|".join([
    rf"{_APOS}[nN]{_APOS}?",                                     # rock 'n' roll
    rf"[lLdDjJ]{_APOS}", rf"(?i:dunkin|somethin|ol){_APOS}", rf"{_APOS}(?i:em|till?|cause)", rf"{_APOS}[2-9]0(?i:s)",
    rf"[A-HJ-XZn]{_APOS_ETC}{_L}{{2,}}", rf"{_L}+[aeiouyAEIOUY]{_APOS_ETC}[aeiouA-Z]{_L}*",
    r"(?i:cont'd\.?|'twas|nor'easter|c'mon|e'er|s'mores|ev'ry|li'l|nat'l)", rf"O{_APOS_ETC}o"])

# (token, trailing context, output) in PTBLexer's rule order. At each position the rule whose token + context is
# longest wins, ties going to the earlier rule; the token is emitted (as `output` when given) and lexing resumes
# after it, so the context is read again. Rules whose output the official wrapper drops anyway are merged.
_PTB_RULES = [(re.compile(tok), re.compile(ctx), out) for tok, ctx, out in [
    ("(?i:can)", "(?i:not)", None),                              # cannot -> can not
    ("'(?i:t)", "(?i:was|is)", None),                            # 'twas -> 't was
    ("(?i:gon|wan)", "(?i:na)", None), ("(?i:got)", "(?i:ta)", None), ("(?i:lem|gim)", "(?i:me)", None),
    (_WORD, _REDAUX, None),                                      # dog|'s
    (r"[A-Za-z]*[A-MO-Za-mo-z]", _SREDAUX, None),                # do|n't, ca|n't
    (_WORD, "", None),
    (_APOWORD, "", None),
    (_REDAUX, "[^A-Za-z]|$", None), (_SREDAUX, "[^A-Za-z]|$", None),
    (r"\d{1,2}[-/]\d{1,2}[-/]\d{2,4}", "", None),                # dates
    (rf"[-+]?(?:{_NUM})", "", None),
    (r"(?:\d{1,4}-)?\d{1,4}\\?/\d{1,4}", "", None),               # 1/2, 1-1/2
    (r"[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}(?:\\?/[A-Za-z0-9]+(?:-[A-Za-z]+){0,2}){1,2}", "", None),  # and/or
    (r"[A-Z]*\$|#", "", None),
    (rf"(?:{_ABBREV3})\.", r"\s?\d", None),                      # no. 5
    (rf"(?:{_ABBREV1})\.", r"(?s:.{0,2})", None),                 # etc.
    (rf"(?:{_ABBREV2})\.", "", None),                             # mr., st., u.s.
    (rf"{_APOS}\d\d", r"\s", None),                                # '90
    (rf"{_WORD}\.", "[,;:]", None),
    ('"', "", "``"), (r"</?[A-Za-z][\w:.-]*\s*/?>", "", None), ("<|>", "", None),  # <angle> is one SGML token
    (r"\{", "", "-LCB-"), (r"\}", "", "-RCB-"), (r"\[", "", "-LSB-"), (r"\]", "", "-RSB-"),
    (r"\(", "", "-LRB-"), (r"\)", "", "-RRB-"),
    ("-{3,4}", "", "--"), ("-+", "", None),
    (r"\.{3,5}|(?:\.\s){2,4}\.|\u2026", "", "..."),
    ("@+|#+|_+|\\*+", "", None), ("[,;:]", "", None), ("[?!]+", "", None), (r"\.", "", None), ("[=/]", "", None),
    (r"[A-Za-z0-9][A-Za-z0-9.,]*(?:-(?:[A-Za-z](?:\.[A-Za-z])+\.|[A-Za-z0-9]+))+", "", None),  # x-ray, 2.5-inch
    (rf"{_THING}(?:-{_THING})*", "", None),
    (r"[A-Z]+(?:[+&][A-Z]+)+", "", None),                          # AT&T
    (rf"{_APOS_ETC}|''|[\u201A-\u201F\u0093\u0094\u2039\u203A\u00AB\u00BB]{{1,2}}", "", "''"),
    (r"\S", "", None)]]


def _ptb_tokens(s):
    """The tokens of the Stanford PTBTokenizer rules above, before lowercasing and the wrapper's drop list."""
    i, tokens = 0, []
    while i < len(s):
        if s[i].isspace():
            i += 1
            continue
        best, length = None, 0
        for tok, ctx, out in _PTB_RULES:
            m = tok.match(s, i)
            c = m and ctx.match(s, m.end())
            if c and m.end() > i and c.end() - i > length:
                best, length = (m, out), c.end() - i
        m, out = best
        tokens.append(out or m.group())
        i = m.end()
    return tokens


def tokenize_caption(s):
    """Tokenise a caption as pycocoevalcap's ptbtokenizer.py does: the Stanford PTBTokenizer's rules (_PTB_RULES,
    longest match, re-implemented for what captions contain), lowercased, then the punctuation tokens it drops removed.
    Clitics are split ("dog's" -> dog 's, "don't" -> do n't) only before a non-letter ("'STOP'" is a quoted "stop", not
    's top); abbreviations keep their period; numbers, dates, fractions, hyphenated words and SGML tags stay whole;
    brackets become "-lrb-", "-rrb-", ... and are kept. Left out: PTB's sentence-final acronym rule (a single letter
    with a period before "The", "He", ... loses its period), which can look into the next caption of the official tool's
    input file; URLs, e-mail addresses, phone numbers and SGML tags with attributes; characters no rule covers are kept
    one by one, where PTB drops most of them."""
    return [t for t in (t.lower() for t in _ptb_tokens(s)) if t not in _PTB_DROPPED]


def cider_d(candidates, references, n=4, sigma=6.0):
    """CIDEr-D as pycocoevalcap's CiderScorer (coco-caption, the "CIDEr" of the COCO caption evaluation) computes
    it. candidates: {id: caption}, references: {id: [captions]}; captions are tokenised with tokenize_caption first.
    Document frequency counts each image once per n-gram (over the union of its references), idf is taken against
    log(#images); per n-gram order a clipped tf-idf cosine times exp(-delta^2 / (2 sigma^2)); averaged over
    references and over n = 1..4, x10. The official code measures length in bigrams; word counts give the same length
    difference whenever both captions are non-empty, and otherwise the cosine is 0, so words are used here. Returns
    (corpus score = mean over ids, {id: score})."""
    unpaired = sorted(map(str, candidates.keys() ^ references.keys()))
    if unpaired or not references or not all(references.values()):
        raise ValueError("CIDEr-D needs the same ids in candidates and references, at least one, each with a reference"
                         + (f"; ids in only one: {', '.join(unpaired[:3])}" if unpaired else ""))
    ngrams = lambda w: Counter(tuple(w[i:i + k]) for k in range(1, n + 1) for i in range(len(w) - k + 1))
    refs = {i: [ngrams(tokenize_caption(r)) for r in references[i]] for i in references}
    df = Counter(g for counts in refs.values() for g in set().union(*counts))
    log_num_images = math.log(len(refs))

    def features(counts):  # per order {ngram: tf * idf} and its L2 norm; idf = log(#images) - log(max(1, df))
        vec = [{} for _ in range(n)]
        for g, tf in counts.items():
            vec[len(g) - 1][g] = tf * (log_num_images - math.log(max(1.0, df.get(g, 0.0))))
        norm = [math.sqrt(sum(v * v for v in d.values())) for d in vec]
        return vec, norm, sum(tf for g, tf in counts.items() if len(g) == 1)

    scores = {}
    for i, cand in candidates.items():
        vec_c, norm_c, len_c = features(ngrams(tokenize_caption(cand)))
        per_order = [0.0] * n
        for r in refs[i]:  # per n-gram order the clipped cosine, times the Gaussian length penalty
            vec_r, norm_r, len_r = features(r)
            penalty = math.exp(-((len_c - len_r) ** 2) / (2 * sigma ** 2))
            for k, (vc, vr, nc, nr) in enumerate(zip(vec_c, vec_r, norm_c, norm_r)):
                val = sum(min(v, vr.get(g, 0.0)) * vr.get(g, 0.0) for g, v in vc.items())
                per_order[k] += val / (nc * nr) * penalty if nc and nr else 0.0  # at norm 0 the official val is 0
        scores[i] = 10.0 * sum(per_order) / n / len(refs[i])
    return sum(scores.values()) / len(scores), scores


def _yes_no(pred):
    # MME's official calculation.py: exact yes/no, else look for "yes" then "no" in the first 4 chars
    if pred in ("yes", "no"):
        return pred
    return "yes" if "yes" in pred[:4] else "no" if "no" in pred[:4] else "other"


_OPTION = re.compile(r"^\(?([a-z])(?![a-z0-9])")

_ANSWER_IS = re.compile(r"\banswer(?: is)?\s*:?\s*\(?([a-z])(?![a-z0-9])")


def option_letter(pred):
    """The option letter of a generation (lowercase), or None: its first character, optionally after "(", when that
    character is a letter not followed by a letter or digit ("B", "B.", "(b) cat", "B) cat"; "Bus" has none), else
    the letter after "answer" / "answer is" ("The answer is B", "Answer: (c)")."""
    pred = pred.strip().lower()
    m = _OPTION.match(pred) or _ANSWER_IS.search(pred)
    return m.group(1) if m else None


def multiple_choice_accuracy(predictions, answers):
    """Accuracy for MME (yes/no) and SEED-Bench style (option letter) questions, in [0, 1]. Both sides are stripped
    and lowercased; against a yes/no answer the prediction is parsed as MME's calculation.py does (_yes_no), against
    an option letter by option_letter, exact match (the generative variant of SEED-Bench; seed_likelihood.py ranks)."""
    if len(predictions) != len(answers) or not answers:
        raise ValueError(f"{len(predictions)} predictions for {len(answers)} answers: one for each, at least one")
    correct = 0
    for pred, ans in zip(predictions, answers):
        pred, ans = pred.strip().lower(), ans.strip().lower()
        correct += (_yes_no(pred) if ans in ("yes", "no") else option_letter(pred)) == ans
    return correct / len(answers)


def mme_scores(items, predictions):
    """MME's metrics as the official eval_tool/calculation.py computes them, in percent. Per subtask: acc (questions
    answered right, the answer parsed by _yes_no; "other" is wrong), acc_plus (images whose questions are all right; MME
    asks two per image) and score = acc + acc_plus (0-200). perception and cognition: the sums of their subtasks' scores
    (the official totals, out of 2000 and 800 on the full benchmark). Beside them: accuracy over all questions and the
    mean of the subtasks' acc; Table 2's MME numbers (55.36-82.13) are percentages, not scores, so the paper appears to
    report such an accuracy (which of the two is not stated)."""
    right = [_yes_no(p.strip().lower()) == it.target.lower() for it, p in zip(items, predictions)]
    subtasks = {}  # {subtask: {image: [each of its questions answered right]}}
    for it, r in zip(items, right):
        subtasks.setdefault(it.category, {}).setdefault(it.image_path, []).append(r)
    out = {"subtasks": {}}
    for name, images in subtasks.items():
        rs = [r for questions in images.values() for r in questions]
        acc, acc_plus = 100 * sum(rs) / len(rs), 100 * sum(map(all, images.values())) / len(images)
        out["subtasks"][name] = {"acc": acc, "acc_plus": acc_plus, "score": acc + acc_plus}
    for total, names in (("perception", mme_seed.MME_PERCEPTION), ("cognition", mme_seed.MME_COGNITION)):
        out[total] = sum(v["score"] for k, v in out["subtasks"].items() if k in names)
    out["accuracy"] = 100 * sum(right) / len(right)
    out["mean_subtask_accuracy"] = statistics.mean(v["acc"] for v in out["subtasks"].values())
    return out


def seed_scores(items, predictions):
    """SEED-Bench accuracy in percent, per dimension and over all questions (as its official eval.py: the overall
    number counts questions, not dimensions). predictions are option letters or generations (option_letter)."""
    dims = {}
    for it, p in zip(items, predictions):
        dims.setdefault(it.category, []).append(option_letter(p) == it.target.lower())
    return {"dimensions": {k: 100 * sum(v) / len(v) for k, v in dims.items()},
            "accuracy": 100 * sum(sum(v) for v in dims.values()) / len(items)}
