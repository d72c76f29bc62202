"""One decoding step and one prefill of one attention layer with Idefics2-8B's heads, each method over plain SDPA: a
benchmark, not a test (docs/efficiency.md, "Decoding at zero-shot cost").

    python tools/bench_attention.py [--tokens 512 4096 16384] [--prefill-tokens 512 4096] [--rounds 31]
    mkdir /tmp/before && git show COMMIT:adapters.py > /tmp/before/adapters.py         # another version
    python tools/bench_attention.py --before /tmp/before --methods hyper-icl hificl mimic

The first decoder self-attention of a one-layer model with Idefics2-8B's attention sizes (32 query heads, 8 key/value
heads of 128; lab/studies/efficiency.py:attention_model, --random-weights published), batch 1, float32, one thread
(--threads), random q, k, v. A decoding step: one query token against a cache of T keys (--tokens), no mask, as
generate() runs it; a prefill: T query tokens over T keys, causal (--prefill-tokens; at 16,384 tokens a CPU takes
minutes a round). Every attention-level method of lab/methods/registry.py (or --methods) runs through
model.calibrated_attention with every parameter drawn at random (efficiency.run_as's N(0, 0.02^2)) and, with --before,
the same methods of that folder's adapters.py as "<method> (before)", with the same parameters: all in one paired
run (efficiency.paired_latency: each run between two SDPA runs, the median over the rounds of its time over theirs).
Each timed run repeats its call for at least --min-ms of SDPA's time (a decoding step at T = 512 alone is too short
to time above a shared machine's noise). Prints one markdown table.
"""
import argparse
import importlib.util
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import torch  # noqa: E402

import model as M  # noqa: E402
from lab.methods import registry  # noqa: E402
from lab.studies import efficiency  # noqa: E402

ATTENTION = [m for m, own in registry.METHODS.items() if type(own.plug) is M.Plug]  # through calibrated_attention


def adapters_of(folder):
    """The adapters.py of another checkout, imported under its own name."""
    spec = importlib.util.spec_from_file_location("adapters_before", os.path.join(folder, "adapters.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def adapters_for(methods, attn, before=None, seed=0):
    """{row name: adapter} for the layer `attn`: each method's (seeded random parameters) and, with `before` (a
    module), that module's class of the same name with the same parameters."""
    heads, head_dim = attn.config.num_attention_heads, attn.head_dim
    rows = {}
    for name in methods:
        torch.manual_seed(seed)
        rows[name] = registry.METHODS[name].adapter(heads, head_dim)
        with torch.no_grad():
            for p in rows[name].parameters():
                p.normal_(0, 0.02)
        if before is not None:
            rows[f"{name} (before)"] = getattr(before, registry.METHODS[name].adapter.__name__)(heads, head_dim)
            rows[f"{name} (before)"].load_state_dict(rows[name].state_dict())
    return rows


def step_runs(attn, rows, q, k, v, calls):
    """paired_latency's runs: plain SDPA (transformers' forward: the layer without an adapter) and every row's
    adapter on q, k, v with no mask (decoding when q has one token, else causal), each timing `calls` calls in a
    row (seconds a call)."""
    def run(adapter):
        def timed_calls(timer):
            attn.icl_adapter = adapter
            try:
                return timer(lambda: [M.calibrated_attention(attn, q, k, v, None, scaling=attn.scaling)
                                      for _ in range(calls)]) / calls
            finally:
                del attn.icl_adapter
        return timed_calls
    return {"sdpa": run(None), **{name: run(adapter) for name, adapter in rows.items()}}


def timed(f):
    """f()'s seconds."""
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[512, 4096, 16384], help="cache lengths T to decode at")
    ap.add_argument("--prefill-tokens", type=int, nargs="*", default=[512, 4096], help="prompt lengths to prefill")
    ap.add_argument("--rounds", type=int, default=31, help="paired rounds a setting")
    ap.add_argument("--prefill-rounds", type=int, default=7, help="paired rounds a prefill setting")
    ap.add_argument("--methods", nargs="+", default=ATTENTION, choices=ATTENTION)
    ap.add_argument("--before", help="a folder holding an older adapters.py, timed beside this one")
    ap.add_argument("--min-ms", type=float, default=50, help="each timed run repeats a call for at least this long")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    efficiency.keep_freed_memory()
    attn = M.decoder_self_attentions(efficiency.attention_model("idefics2", "published"))[0]
    rows = adapters_for(args.methods, attn, adapters_of(args.before) if args.before else None)
    settings = [("decode", 1, T, args.rounds) for T in args.tokens] + \
        [("prefill", T, T, args.prefill_rounds) for T in args.prefill_tokens]
    heads, kv_heads, d_h = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    results = {}
    with torch.no_grad():
        for part, T_q, T, rounds in settings:
            q, (k, v) = torch.randn(1, heads, T_q, d_h), torch.randn(2, 1, kv_heads, T, d_h)
            once = step_runs(attn, rows, q, k, v, 1)
            for run in once.values():  # warm-up
                run(timed)
            calls = max(1, math.ceil(args.min_ms / 1000 / once["sdpa"](timed)))  # each run lasts >= --min-ms of SDPA
            results[f"{part} {T} ({rounds})"] = efficiency.paired_latency(step_runs(attn, rows, q, k, v, calls), "cpu",
                                                                      rounds)
    print(f"one attention layer: {heads} query heads, {kv_heads} key/value heads of {d_h}, batch 1, float32, "
          f"{torch.get_num_threads()} thread(s); each method's time over SDPA runs on both sides, the median "
          "[quartiles] over the (rounds); SDPA's median ms")
    print("| method | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    print("| plain SDPA | " + " | ".join(f"{latency['sdpa'][0]:.2f} ms" for latency in results.values()) + " |")
    for name in rows:
        print(f"| {name} | " + " | ".join(f"{latency[name][1]:.2f} [{latency[name][2]:.2f}, {latency[name][3]:.2f}]"
                                          for latency in results.values()) + " |")
    return results


if __name__ == "__main__":
    main()
