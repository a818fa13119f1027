"""The virtual-memory KV cache: what mapping costs, and how much memory paging saves.

1. Map / unmap latency per page: a range of `--pages` pages reserved, each page mapped and
   then unmapped on its own (cuMemMap + cuMemSetAccess / cuMemUnmap on cuda; mmap of a
   memfd slice / mmap(PROT_NONE) over it on the host), timed call by call. Also reported per
   token of the Qwen3-0.6B KV shape, since a page is mapped once per that many generated
   tokens.
2. Packing: 256 sessions with random lengths (100-2048 tokens) of the Qwen3-0.6B KV shape
   (28 layers, 8 KV heads, head dim 128, bf16: 112 KiB a token), each region grown to its
   length. The physical limit is 1.0: every mapped byte holding live KV. Reported: live KV
   bytes / mapped bytes (target >= 0.95), after growing to full length at once and averaged
   over a decode-style growth (prompt, then one token a round, sessions leaving when done).
3. Fit: how many of those sessions fit in a fixed budget (`--budget-gib`) when pages are
   mapped as sessions grow, against the ideal (their live bytes packed with no waste at all)
   and against reserving the maximum context per session up front (2048 tokens, the longest
   session here, and 40960, Qwen3-0.6B's context length).

Run: `python benchmarks/bench_vmm.py [--backend cpu|cuda|all] [--budget-gib 16]`
Prints a markdown table and a JSON block on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagerlm.vmm.cuda_driver import NoCudaDevice
from eagerlm.vmm.device import Device, open_device
from eagerlm.vmm.kv_layout import KVLayout
from eagerlm.vmm.page_pool import OutOfPages, PagePool

# Qwen3-0.6B: 28 layers, 8 KV heads of 128; bf16 has no numpy dtype, float16 has its size.
QWEN3_06B = KVLayout(n_layers=28, n_kv_heads=8, head_dim=128, dtype=np.dtype(np.float16))
QWEN3_CONTEXT = 40960
GIB = 1 << 30


def _pct(samples: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(samples), q))


def map_latency(device: Device, n_pages: int) -> dict[str, float]:
    """Map each of `n_pages` pages into a reserved range, then unmap each; per-call times."""
    ps = device.page_size
    pages = device.alloc_pages(n_pages)
    vm = device.reserve(n_pages * ps)
    maps, unmaps = [], []
    for rep in range(2):  # the first pass warms the driver / page tables
        for i, p in enumerate(pages):
            t0 = time.perf_counter()
            vm.map(i * ps, p)
            maps.append(time.perf_counter() - t0)
        for i in range(n_pages):
            t0 = time.perf_counter()
            vm.unmap(i * ps)
            unmaps.append(time.perf_counter() - t0)
        if rep == 0:
            maps.clear()
            unmaps.clear()
    vm.free()
    for p in pages:
        p.release()
    us = 1e6
    tokens_per_page = ps / QWEN3_06B.token_bytes
    return {
        "page_bytes": ps,
        "pages": n_pages,
        "map_us_mean": us * float(np.mean(maps)),
        "map_us_p50": us * _pct(maps, 50),
        "map_us_p99": us * _pct(maps, 99),
        "unmap_us_mean": us * float(np.mean(unmaps)),
        "unmap_us_p50": us * _pct(unmaps, 50),
        "unmap_us_p99": us * _pct(unmaps, 99),
        "qwen3_tokens_per_page": tokens_per_page,
        "map_us_per_token": us * float(np.mean(maps)) / tokens_per_page,
    }


def packing(device: Device, lengths: np.ndarray, seed: int) -> dict[str, float]:
    """Live / mapped bytes of the sessions at full length, and averaged over decode growth."""
    layout = QWEN3_06B
    max_len = int(lengths.max())
    need = sum(-(-int(n) * layout.token_bytes // device.page_size) for n in lengths)
    pool = PagePool(device, need)

    t0 = time.perf_counter()
    regions = [pool.new_region(layout, max_len) for _ in lengths]
    for r, n in zip(regions, lengths, strict=True):
        r.ensure(int(n))
    at_once_s = time.perf_counter() - t0
    full = pool.stats()
    for r in regions:
        r.release()

    # Decode-style growth: each session starts with a prompt of 10-50 % of its length, then
    # gains one token a round; it leaves (and its pages return) when it reaches its length.
    rng = np.random.default_rng(seed + 1)
    prompts = np.maximum(1, (lengths * rng.uniform(0.1, 0.5, len(lengths))).astype(int))
    regions = [pool.new_region(layout, max_len) for _ in lengths]
    for r, p in zip(regions, prompts, strict=True):
        r.ensure(int(p))
    n_now = prompts.copy()
    live_sum = mapped_sum = 0
    rounds = ensure_calls = 0
    ensure_s = 0.0
    active = set(range(len(lengths)))
    while active:
        for i in list(active):
            if n_now[i] >= lengths[i]:
                regions[i].release()
                active.discard(i)
                continue
            n_now[i] += 1
            t0 = time.perf_counter()
            regions[i].ensure(int(n_now[i]))
            ensure_s += time.perf_counter() - t0
            ensure_calls += 1
        live_sum += sum(regions[i].live_bytes for i in active)
        mapped_sum += sum(regions[i].mapped_bytes for i in active)
        rounds += 1
    pool.audit()
    assert pool.stats().pages_free == pool.n_pages
    pool.close()
    return {
        "sessions": len(lengths),
        "tokens_mean": float(lengths.mean()),
        "live_over_mapped_at_full_length": full.live_fraction,
        "live_over_mapped_during_decode": live_sum / mapped_sum,
        "pages_at_full_length": full.pages_mapped,
        "ensure_all_at_once_ms": 1e3 * at_once_s,
        "decode_rounds": rounds,
        "ensure_us_mean": 1e6 * ensure_s / ensure_calls,
    }


def fit(device: Device, lengths: np.ndarray, budget: int) -> dict[str, float]:
    """Sessions admitted in arrival order, each mapped to its full length, until the pool
    is out of pages; against the ideal and against up-front reservation."""
    layout = QWEN3_06B
    pool = PagePool.with_budget(device, budget)
    admitted = 0
    regions = []
    for n in lengths:
        r = pool.new_region(layout, int(lengths.max()))
        try:
            r.ensure(int(n))
        except OutOfPages:
            r.release()
            break
        regions.append(r)
        admitted += 1
    st = pool.stats()
    for r in regions:
        r.release()
    pool.close()
    live = np.cumsum(lengths.astype(np.int64) * layout.token_bytes)
    ideal = int(np.searchsorted(live, pool.n_pages * device.page_size, side="right"))
    upfront_2048 = budget // (2048 * layout.token_bytes)
    upfront_ctx = budget // (QWEN3_CONTEXT * layout.token_bytes)
    return {
        "budget_bytes": budget,
        "paged_sessions": admitted,
        "ideal_sessions": ideal,
        "paged_over_ideal": admitted / ideal if ideal else 1.0,
        "upfront_2048_sessions": int(upfront_2048),
        "upfront_40960_sessions": int(upfront_ctx),
        "paged_over_upfront_2048": admitted / upfront_2048 if upfront_2048 else float("inf"),
        "live_over_mapped": st.live_fraction,
    }


def run_backend(name: str, args: argparse.Namespace) -> dict[str, Any] | None:
    try:
        device = open_device(name)
    except NoCudaDevice as exc:
        print(f"[{name}] skipped: {exc}", file=sys.stderr)
        return None
    with device:
        rng = np.random.default_rng(args.seed)
        lengths = rng.integers(100, 2049, args.sessions)
        result = {
            "backend": name,
            "device": device.name,
            "latency": map_latency(device, args.pages),
            "packing": packing(device, lengths, args.seed),
            "fit": fit(device, lengths, int(args.budget_gib * GIB)),
        }
    return result


def report(results: list[dict[str, Any]]) -> None:
    print("| backend | page | map us p50 / p99 | unmap us p50 / p99 | map us per token | "
          "live/mapped full | live/mapped decode | ensure us | sessions in budget: paged / "
          "ideal / up-front 2048 / up-front 40960 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        lat, pk, ft = r["latency"], r["packing"], r["fit"]
        print(f"| {r['backend']} | {lat['page_bytes'] >> 10} KiB | "
              f"{lat['map_us_p50']:.1f} / {lat['map_us_p99']:.1f} | "
              f"{lat['unmap_us_p50']:.1f} / {lat['unmap_us_p99']:.1f} | "
              f"{lat['map_us_per_token']:.2f} | "
              f"{pk['live_over_mapped_at_full_length']:.4f} | "
              f"{pk['live_over_mapped_during_decode']:.4f} | {pk['ensure_us_mean']:.2f} | "
              f"{ft['paged_sessions']} / {ft['ideal_sessions']} / "
              f"{ft['upfront_2048_sessions']} / {ft['upfront_40960_sessions']} |")
    for r in results:
        ratio = r["packing"]["live_over_mapped_at_full_length"]
        verdict = "meets" if ratio >= 0.95 else "MISSES"
        print(f"[{r['backend']}] live/mapped {ratio:.4f} {verdict} the 0.95 target; "
              f"{r['fit']['paged_sessions']} sessions fit in "
              f"{r['fit']['budget_bytes'] / GIB:g} GiB paged vs "
              f"{r['fit']['upfront_2048_sessions']} reserving 2048 tokens up front "
              f"({r['fit']['paged_over_upfront_2048']:.2f}x), "
              f"{r['fit']['paged_over_ideal']:.3f} of the no-waste ideal")
    print(json.dumps(results, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=["cpu", "cuda", "all"], default="all")
    ap.add_argument("--sessions", type=int, default=256)
    ap.add_argument("--pages", type=int, default=256, help="pages in the latency test")
    ap.add_argument("--budget-gib", type=float, default=16.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    names = ["cpu", "cuda"] if args.backend == "all" else [args.backend]
    results = [r for n in names if (r := run_backend(n, args)) is not None]
    report(results)


if __name__ == "__main__":
    main()
