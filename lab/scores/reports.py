"""What evaluate.py's evaluate() records and prints around a score: the settings a result file keeps (the adapter's
bytes and run record), the checks before any work (a result of other settings under the same name, the test server's
file), a result read back instead of redone, and after the score the interval, chance, MME's and SEED-Bench's own
scores, the files written and the summary lines; the default job's line and its n-shot ICL's shots; the setting
that evaluate.py's flags name (its adapter attached)."""
import hashlib
import os

from lab.datasets import mme_seed, readers, tasks
from lab.disk import files
from lab.run import adapter_files, torchrun
from lab.scores import results, submission
from lab.scores.metrics import mme_scores, seed_scores


def begin(backbone, args, setting, items, kind, vector_info, params):
    """Before any work: the result's file stem (<out>/<result_name>), its settings (results.result_settings, the
    vector's facts, the adapter's sha256, `params` and run record, SEED's protocol) and the result these settings
    left before (read back, not redone, unless --again; None: none). What killed writes left in --out is removed, and
    a metrics file of other settings under that name, or another evaluation's test-server file, is refused first."""
    files.remove_stale_tmp(args.out)
    stem = os.path.join(args.out, results.result_name(args, setting, len(items), vector_info))
    metrics = {**results.result_settings(backbone, args, setting, items), **vector_info}
    if args.checkpoint:  # which adapter: a run --overwrite'n in its folder leaves these metrics naming the old bytes
        with open(args.checkpoint, "rb") as f:
            metrics["checkpoint_sha256"] = hashlib.sha256(f.read()).hexdigest()
        metrics |= {"params": params, "run": adapter_files.read_record(args.checkpoint)}  # a table's column
    if kind == "choice":
        metrics["protocol"] = args.seed_protocol
    results.check_replaceable(stem + ".metrics.json",  # first: before any work
                              {k: metrics[k] for k in results.RESULT_SETTINGS if k in metrics})
    if readers.server_split(args.task, args.split):  # nor another evaluation's test-server file
        submission.check_replaceable(args, setting, stem)
    elif not args.again and results.same_result(stem, kind, metrics):  # evaluated before: read, not redone
        print(f"{args.model} {args.task}/{args.split} {setting}: read {stem}.metrics.json (the same settings)")
        return stem, metrics, results.same_result(stem, kind, metrics)
    return stem, metrics, None


def server_file(args, kind, items, predictions, setting, stem, metrics):
    """A split without answers (VQAv2's test-dev, test): the test server's file written beside the metrics (by the
    first process under torchrun, the predictions gathered from every process by now)."""
    if torchrun.rank_and_world()[0] == 0:
        metrics["server_file"] = submission.write_server_file(args, items, predictions, setting)
        metrics = results.write_evaluation(stem, kind, items, predictions, metrics)
    return metrics


def written(args, kind, items, predictions, setting, stem, metrics, scored):
    """The scored result: `scored` ({metric: value, then CHAIR's}) with the interval, chance and MME's or SEED's own
    scores into `metrics`, written (by the first process under torchrun), its summary line printed (and MME's totals
    or SEED's dimensions). Returns the metrics."""
    (metric, value), *extra = scored.items()
    metrics |= {metric: value, "interval95": results.item_interval(kind, items, predictions),
                "chance": results.chance(items), **dict(extra)}
    if kind == "yes-no":
        metrics["mme"] = mme_scores(items, predictions)
    elif kind == "choice":
        metrics["seed_bench"] = seed_scores(items, predictions)
    if torchrun.rank_and_world()[0] != 0:  # under torchrun the first process writes
        return metrics
    metrics = results.write_evaluation(stem, kind, items, predictions, metrics)
    print(f"{args.model} {args.task}/{args.split} {setting}: {metric} {value:.2f}"
          + "".join(f", {k} {v:.2f}" for k, v in extra) + f" on {len(items)} items -> {stem}.metrics.json")
    if kind == "yes-no":  # MME's totals only where its subtasks are (a yes-no task of one's own has its own)
        m, mme = metrics["mme"], set(mme_seed.MME_PERCEPTION + mme_seed.MME_COGNITION)
        print(("" if mme.isdisjoint(m["subtasks"]) else f"MME perception {m['perception']:.2f}, cognition "
               f"{m['cognition']:.2f}; ") + ", ".join(f"{k} {v['score']:.1f}" for k, v in m["subtasks"].items()))
    elif kind == "choice":
        print(f"SEED-Bench ({args.seed_protocol}): " +
              ", ".join(f"{k} {v:.1f}" for k, v in metrics["seed_bench"]["dimensions"].items()))
    return metrics


def side_by_side(args, items, done):
    """The default job's line: each setting's headline metric (0-shot, N-shot ICL, the adapter). Where N-shot ICL is
    at chance (at most the most frequent answer's share of the items + 5 points; not for CIDEr), the line says so:
    the backbone does not learn in context and no score beside it shows anything."""
    metric, icl, verdict, chance = results.headline_metric(done[0]), done[1], "", results.chance(items)
    if metric != "cider" and icl[metric] <= chance + 5:
        verdict = (f": NOT A RESULT: {icl['setting']} ICL is at chance ({icl[metric]:.1f} <= {chance:.1f}, always "
                   "the most frequent answer, + 5): this backbone does not learn in context, so nothing here can be "
                   "distilled")
    print("  ".join(f"{m['setting']} {m[metric]:.1f}" for m in done) + f" ({metric}, {args.task}/{args.split}, "
          f"{len(items)} items)" + verdict)


def icl_shots(backbone, args):
    """The ICDs of the default job's n-shot ICL row: the adapter's teacher's (its run record) where there is one, said
    when they are not the backbone's default for the task, else that default (data.default_shots)."""
    default = tasks.default_shots(args.task, backbone.family)
    record = adapter_files.read_record(args.checkpoint) if args.checkpoint else None
    if record and record.get("shots") not in (None, default):
        print(f"n-shot ICL at {record['shots']} shots, as the adapter's teacher had them ({args.checkpoint}'s run "
              f"record; this backbone's default: {default}); --shots N for another")
        return record["shots"]
    return default


def adapted(backbone, args):
    """The setting these flags evaluate on `backbone`, --checkpoint's adapter attached first: its method, n-shot ICL
    ("8-shot", with RICES "8-shot-rices"), or an adapter with ICDs ("hyper-icl+8-shot")."""
    setting = f"{args.shots or 0}-shot" + ("-rices" if args.shots and args.icds == "rices" else "")
    if args.checkpoint:
        method = adapter_files.load_adapter(args.checkpoint, backbone, force=args.force)["method"]
        print(f"adapter: {args.checkpoint} ({method})")
        return method if not args.shots else f"{method}+{setting}"
    asked = args.shots is not None
    print(f"no adapter: {setting} evaluation" + ("" if asked else
                                                 f" ({results.default_checkpoint(args.model, args.task)} not found)"))
    return setting
