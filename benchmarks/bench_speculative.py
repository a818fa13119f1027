"""Speculative decoding by prompt lookup on the demo model at batch 1, beside llama.cpp's.

What is compared, in one run, on the same greedy requests (completion prompts: the demo
model is a base model):

- eagerlm without speculation and with prompt lookup (`speculative="ngram"`, the adaptive
  number of drafts, at most `--k`), per request on one engine;
- llama.cpp through llama-cpp-python, plain and with its prompt lookup
  (`llama_cpp.llama_speculative.LlamaPromptLookupDecoding`, `max_ngram_size` 2 and
  `num_pred_tokens` `--peer-draft`, 2 by default: its documentation's choice for CPU-only
  machines), same threads.

Two workloads of three prompts each: input-grounded (the answer repeats spans of the input:
a code file edited, a record's fields extracted, a text summarised with quotes) and free
text (a list of tips, a news report, a travel account: prompts whose greedy continuation
does not soon loop, as most of a small base model's do). Each engine generates `--tokens` tokens per
prompt; decode tokens/s is (tokens - 1) / (time from the first token to the last), the
first token being the prompt's (prefill is not what speculation changes), in wall time and
in this process's CPU time (the work: on a machine whose cores other jobs share, wall time
also counts the waits for a core). Then eagerlm at 8
concurrent requests (the six prompts and two again) with and without speculation: output
tokens/s over the whole batch.

`--draft-self` adds "eagerlm draft": a second engine opened with the demo model as its own
draft model (`draft_model=` the same file, `speculative="draft"`). It is a check of the
mechanics, not a speed-up: a draft as large as the target costs a forward per draft token,
but its proposals are the target's own greedy tokens, so nearly all must be accepted.
`--draft PATH` adds the same configuration with another file (one vocabulary) as the draft
model: a smaller model, or a smaller quantization of the target.

The physical limit of batch-1 decode is memory bandwidth: a forward reads every weight once,
so tokens/s <= bandwidth / weight bytes (measured: numpy copy of 512 MiB, read + write).
Speculation gets past that limit by emitting several tokens per forward; the table prints
both the tokens/s and the tokens per forward (accepted drafts + 1 per round).

The machine may be shared: every configuration runs `--repeats` times, alternating (ABBA
over the configurations), and each figure is the median. The acceptance rate (drafts
accepted / drafts verified) and the steady-decode bubble of eagerlm's rounds are reported
per workload.

Run: `python benchmarks/bench_speculative.py [--model PATH] [--tokens 128] [--repeats 3]
[--k 8] [--no-peer] [--draft-self | --draft PATH] [--json OUT]`. The llama.cpp columns
need llama-cpp-python (`pip install 'eagerlm[reference]'`).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_cpu_decode import copy_bandwidth_gb_s, tensor_bytes
from eagerlm import SamplingParams, SyncEngine
from eagerlm.service.api.metrics import recent_steady_bubble

CODE = '''import json
from dataclasses import dataclass


@dataclass
class Item:
    name: str
    price: float
    quantity: int


def total_price(items, tax_rate):
    subtotal = 0.0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)


def load_items(path):
    with open(path) as f:
        rows = json.load(f)
    return [Item(r["name"], float(r["price"]), int(r["quantity"])) for r in rows]


def apply_discount(total, discount):
    if not 0 <= discount <= 0.5:
        raise ValueError("discount must be between 0 and 0.5")
    return round(total * (1 - discount), 2)
'''

RECORD = """Name: Maria Lopez
Date of birth: 12 March 1987
Address: 44 Harbour Street, Lisbon, Portugal
Occupation: marine biologist
Employer: Atlantic Ocean Research Institute
Email: maria.lopez@example.org
Phone: +351 21 555 0199
"""

ARTICLE = """The lighthouse on the northern cape was built in 1874 to guide fishing boats through \
the narrow channel between the cape and the island. For almost a century a keeper lived in \
the small stone house beside it, climbing the spiral stairs every evening to light the lamp \
and every morning to clean the lens. In 1969 the light was automated, and the keeper's house \
became a museum about the lives of the families who kept it. Today the museum receives \
about twenty thousand visitors a year, most of them in the summer months."""

INPUT_GROUNDED = {
    "code edit": ("Below is a Python module, then the same module with the function "
                  "total_price renamed to compute_total.\n\n### Original\n```python\n" + CODE
                  + "```\n\n### Edited\n```python\n"),
    "extract fields": ("Record:\n" + RECORD + "\nThe same record as JSON, with every field:\n"
                       "{\n  \"name\": \""),
    "quote summary": (ARTICLE + "\n\nSummary, quoting the text word for word:\n"
                      "The text says that \""),
}
# Prompts whose greedy continuation on the demo model (a small base model) does not soon
# repeat itself, as most of its greedy continuations do (a story, an essay, a recipe or a
# letter loops within 128 tokens, and prompt lookup then accepts most drafts): text that
# proposals rarely predict.
FREE_TEXT = {
    "tips": "Here are some practical tips for growing tomatoes in a small garden:\n1.",
    "news": "GENEVA (Reuters) - Delegates from more than forty countries met on Tuesday to "
            "discuss",
    "travel": "Our trip to Japan started in Tokyo, where we",
}
WORKLOADS = {"input-grounded": INPUT_GROUNDED, "free text": FREE_TEXT}


def eagerlm_run(engine: SyncEngine, spec: str, prompt: str, tokens: int, k: int
                ) -> dict[str, float]:
    """One greedy request: decode tok/s, its tokens, and the drafts it verified/accepted."""
    stats = engine.engine.dispatcher.service.stats
    d0, a0, r0 = stats.draft_tokens, stats.accepted_tokens, stats.rounds
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            speculative=spec, num_speculative_tokens=k)
    t0 = time.perf_counter()
    first = end = t0
    cpu_first = cpu_end = time.process_time()
    ids: list[int] = []
    for chunk in engine.generate(prompt, params):
        now = time.perf_counter()
        if not ids and chunk.token_ids:
            first, cpu_first = now, time.process_time()
        ids.extend(chunk.token_ids)
        end, cpu_end = now, time.process_time()
    dispatcher = engine.engine.dispatcher
    while stats.rounds < dispatcher.control.round_id:  # rounds launched past the end
        time.sleep(0.001)
    return {"decode_tok_s": (len(ids) - 1) / (end - first), "ttft_s": first - t0,
            "cpu_tok_s": (len(ids) - 1) / (cpu_end - cpu_first), "tokens": ids,
            "drafted": stats.draft_tokens - d0,
            "accepted": stats.accepted_tokens - a0, "rounds": stats.rounds - r0,
            "bubble": recent_steady_bubble(dispatcher.traces, window=stats.rounds - r0)}


def eagerlm_concurrent(engine: SyncEngine, prompts: list[str], tokens: int, spec: str,
                       k: int) -> float:
    """Output tok/s of all the prompts submitted at once."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            speculative=spec, num_speculative_tokens=k)
    dispatcher = engine.engine.dispatcher
    ids = [list(engine.engine.prepare(p).ids) for p in prompts]
    finished: queue.Queue[int] = queue.Queue()
    counts = [0] * len(ids)

    def sink_for(i: int):
        def sink(out) -> None:
            counts[i] += len(out.token_ids)
            if out.finish_reason is not None:
                finished.put(i)
        return sink

    t0 = time.perf_counter()
    for i, prompt_ids in enumerate(ids):
        dispatcher.submit(prompt_ids, params, sink_for(i))
    for _ in ids:
        finished.get(timeout=600)
    return sum(counts) / (time.perf_counter() - t0)


class LlamaCppPeer:
    """llama.cpp plain and with prompt lookup, same model and threads."""

    def __init__(self, path: str, threads: int, draft_tokens: int, n_ctx: int) -> None:
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        common = dict(model_path=path, n_ctx=n_ctx, n_batch=512, n_threads=threads,
                      n_threads_batch=threads, n_gpu_layers=0, verbose=False)
        self.plain = llama_cpp.Llama(**common)
        self.lookup = llama_cpp.Llama(**common, draft_model=LlamaPromptLookupDecoding(
            max_ngram_size=2, num_pred_tokens=draft_tokens))

    def run(self, which: str, prompt: str, tokens: int) -> dict[str, float]:
        llm = self.plain if which == "plain" else self.lookup
        llm.reset()  # no KV reused from the previous request: each starts alike
        t0 = time.perf_counter()
        first = end = t0
        cpu_first = cpu_end = time.process_time()
        n = 0
        for _ in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0,
                                       top_k=1, stream=True, logit_bias={1: -100.0}):
            now = time.perf_counter()
            if n == 0:
                first, cpu_first = now, time.process_time()
            n += 1
            end, cpu_end = now, time.process_time()
        return {"decode_tok_s": (n - 1) / (end - first) if n > 1 else 0.0,
                "cpu_tok_s": (n - 1) / (cpu_end - cpu_first) if n > 1 else 0.0,
                "ttft_s": first - t0, "n": n}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the demo model)")
    ap.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--k", type=int, default=16,
                    help="eagerlm: most drafts per round (16, the most allowed; the "
                         "adaptive choice takes fewer where they do not pay)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    ap.add_argument("--peer-draft", type=int, default=2,
                    help="llama.cpp lookup: num_pred_tokens (its README: 2 for CPU)")
    ap.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    ap.add_argument("--no-concurrent", action="store_true", help="skip the 8-request run")
    drafts = ap.add_mutually_exclusive_group()
    drafts.add_argument("--draft-self", action="store_true",
                        help="add eagerlm with the model as its own draft model (a "
                             "mechanics check: nearly every draft must be accepted)")
    drafts.add_argument("--draft", default=None,
                        help="add eagerlm with this GGUF (the model's vocabulary) as its "
                             "draft model")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    from eagerlm.loader.demo_model import demo_model_path

    path = args.model or demo_model_path()
    weight_bytes = tensor_bytes(path)[1]  # read per forward
    bandwidth = copy_bandwidth_gb_s()
    roofline = bandwidth * 1e9 / weight_bytes
    print(f"model {Path(path).name}: {weight_bytes / 1e6:.1f} MB of weights; copy bandwidth "
          f"{bandwidth:.1f} GB/s; batch-1 roofline {roofline:.1f} tok/s (one forward per "
          f"token)", flush=True)

    engine = SyncEngine.open(path, max_batch=8)
    # the draft configuration on an engine of its own, so the others' KV and rounds are
    # those of an engine without a draft model
    draft_path = path if args.draft_self else args.draft
    draft_engine = (SyncEngine.open(path, max_batch=8, draft_model=draft_path)
                    if draft_path else None)
    peer = None if args.no_peer else LlamaCppPeer(path, args.threads, args.peer_draft,
                                                  n_ctx=1024)
    configs = (["eagerlm", "eagerlm ngram"] + ([] if draft_engine is None else ["eagerlm draft"])
               + ([] if peer is None else
                                          ["llama.cpp", "llama.cpp lookup"]))
    results: dict[str, dict[str, dict[str, list]]] = {}
    outputs: dict[tuple[str, str], list[list[int]]] = {}

    def engine_for(config: str) -> tuple[SyncEngine, str]:
        if config == "eagerlm draft":
            assert draft_engine is not None
            return draft_engine, "draft"
        return engine, "ngram" if "ngram" in config else "off"

    # warm-up: compiles, first allocations, and every prompt once per engine, so that
    # every measured eagerlm request finds its prompt in the prefix cache alike (a cold
    # prompt is one prefill of all its rows, a cached one a few rows beside its cached
    # KV: the first measured configuration of a prompt was otherwise the only one to pay
    # the cold prefill, and could sample a different first token, so its pairs compared
    # different text)
    for prompts in WORKLOADS.values():
        for i, prompt in enumerate(prompts.values()):
            for c in configs:
                if c.startswith("eagerlm"):
                    eagerlm_run(*engine_for(c), prompt, 8, args.k)
                elif peer is not None and i == 0:
                    peer.run("plain" if c == "llama.cpp" else "lookup", prompt, 8)
    for rep in range(args.repeats):
        order = configs if rep % 2 == 0 else configs[::-1]
        for workload, prompts in WORKLOADS.items():
            for name, prompt in prompts.items():
                for c in order:
                    if c.startswith("eagerlm"):
                        r = eagerlm_run(*engine_for(c), prompt, args.tokens, args.k)
                        outputs.setdefault((name, c), []).append(r.pop("tokens"))
                    else:
                        assert peer is not None
                        r = peer.run("plain" if c == "llama.cpp" else "lookup", prompt,
                                     args.tokens)
                    cell = results.setdefault(workload, {}).setdefault(c, {})
                    for key, value in r.items():
                        cell.setdefault(key, []).append(value)
                    cell.setdefault("prompt", []).append(name)
                    print(f"  pass {rep + 1} {workload:14s} {name:14s} {c:16s} "
                          f"{r['decode_tok_s']:6.1f} tok/s", flush=True)

    same = all(outputs[(name, "eagerlm")] == outputs[(name, c)]
               for prompts in WORKLOADS.values() for name in prompts
               for c in configs if c.startswith("eagerlm "))
    print(f"\ngreedy output identical with and without speculation: {same}")
    for prompts in WORKLOADS.values():
        for name in prompts:
            for c in configs:
                if c.startswith("eagerlm ") and outputs[(name, "eagerlm")] != outputs[(name, c)]:
                    plain, spec = outputs[(name, "eagerlm")], outputs[(name, c)]
                    at = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True))
                                if x != y), None) for a, b in zip(plain, spec, strict=True)]
                    print(f"  {name} with {c}: first differing token per pass {at}")
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for workload, cells in results.items():
        print(f"\n{workload} (median of {args.repeats} passes x {len(WORKLOADS[workload])} "
              f"prompts, {args.tokens} tokens each)")
        print(f"{'':18s}{'decode tok/s':>14s}{'x own plain':>13s}{'per CPU s':>11s}"
              f"{'tokens/forward':>16s}{'accepted':>10s}{'bubble':>8s}")
        base = median(cells["eagerlm"]["decode_tok_s"])
        summary[workload] = {}
        for c in configs:
            cell = cells[c]
            tok_s = median(cell["decode_tok_s"])
            row = {"decode_tok_s": tok_s, "cpu_tok_s": median(cell["cpu_tok_s"])}
            own = base if c.startswith("eagerlm") else median(cells["llama.cpp"]["decode_tok_s"])
            line = f"{c:18s}{tok_s:14.1f}{tok_s / own:12.2f}x{row['cpu_tok_s']:11.1f}"
            if c.startswith("eagerlm"):
                drafted, accepted = sum(cell["drafted"]), sum(cell["accepted"])
                per_forward = (args.tokens * len(cell["rounds"])) / sum(cell["rounds"])
                rate = accepted / drafted if drafted else 0.0
                row |= {"tokens_per_forward": per_forward, "acceptance": rate,
                        "bubble": median(cell["bubble"]), "drafted": drafted,
                        "accepted": accepted}
                line += f"{per_forward:16.2f}{rate:10.1%}{median(cell['bubble']):8.1%}"
            summary[workload][c] = row
            print(line)
        # the same prompt in the same pass, with and without: drift on a shared machine
        # falls on both sides of each ratio
        for unit, key in (("wall", "decode_tok_s"), ("CPU", "cpu_tok_s")):
            pairs = [a / b for a, b in zip(cells["eagerlm ngram"][key],
                                           cells["eagerlm"][key], strict=True)]
            summary[workload]["eagerlm ngram"][f"pair_ratios_{key}"] = pairs
            print(f"eagerlm ngram / eagerlm, per request pair ({unit} time): median "
                  f"{median(pairs):.2f}x (geometric mean "
                  f"{statistics.geometric_mean(pairs):.2f}x, {min(pairs):.2f}-"
                  f"{max(pairs):.2f})")
        if peer is not None:
            vs = [a / b for a, b in zip(cells["eagerlm ngram"]["decode_tok_s"],
                                        cells["llama.cpp lookup"]["decode_tok_s"],
                                        strict=True)]
            summary[workload]["eagerlm ngram"]["vs_llama_lookup"] = vs
            print(f"eagerlm ngram / llama.cpp lookup, per request pair: median "
                  f"{median(vs):.2f}x ({min(vs):.2f}-{max(vs):.2f})")
    concurrent: dict[str, list[float]] = {}
    if not args.no_concurrent:
        prompts = [*INPUT_GROUNDED.values(), *FREE_TEXT.values()]
        prompts = prompts + prompts[:2]
        for rep in range(args.repeats):
            for spec in (["off", "ngram"] if rep % 2 == 0 else ["ngram", "off"]):
                concurrent.setdefault(spec, []).append(
                    eagerlm_concurrent(engine, prompts, args.tokens, spec, args.k))
        off, on = median(concurrent["off"]), median(concurrent["ngram"])
        print(f"\n8 concurrent requests, output tok/s: off {off:.1f}, ngram {on:.1f} "
              f"({on / off:.2f}x; each pass: "
              + ", ".join(f"{a:.0f}/{b:.0f}" for a, b in zip(concurrent["ngram"],
                                                             concurrent["off"], strict=True))
              + ")")
    engine.close()
    if draft_engine is not None:
        draft_engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "model": Path(path).name,
            "bandwidth_gb_s": bandwidth, "roofline_tok_s": roofline, "tokens": args.tokens,
            "repeats": args.repeats, "k": args.k, "identical": same, "summary": summary,
            "raw": results, "concurrent": concurrent}, indent=1, default=str))


if __name__ == "__main__":
    main()
