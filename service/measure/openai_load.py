"""Load an OpenAI-compatible server: Poisson arrivals of streaming `/v1/completions`
requests, each token timed where it arrives, as vLLM's serving benchmark does.

Works against any server that streams completions as server-sent events (`data: {...}`
lines, `data: [DONE]` at the end): eagerlm's own `serve`, vLLM, llama.cpp's server, SGLang.
Each request asks for greedy decoding with `max_tokens` and `ignore_eos` (a vLLM extension
that other servers ignore: there the output may end early at an end token, and the counts
reported are what actually came back). Prompts are text; their token counts are the
server's `usage.prompt_tokens` when it sends usage, else the planned counts.

httpx is imported lazily (it is in the `test` extra); the engine does not need it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from typing import Any

from eagerlm.service.measure.request_metrics import RequestRecord
from eagerlm.service.measure.workload import PlannedRequest

_WORDS = ("the", "cat", "sat", "on", "a", "mat", "and", "looked", "at", "bird", "in", "tree",
          "while", "sun", "was", "shining", "over", "quiet", "town", "river")


def word_prompt(n_tokens: int, seed: int) -> str:
    """About `n_tokens` tokens of plain words (common English words are one token each in
    the usual vocabularies), for servers whose tokenizer we do not have."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_tokens))


async def _one(client: Any, url: str, model: str, prompt: str, req: PlannedRequest,
               rec: RequestRecord) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    rec.arrival = time.perf_counter()
    usage_out = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {text[:200]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    rec.prompt_tokens = usage.get("prompt_tokens", rec.prompt_tokens)
                    usage_out = usage.get("completion_tokens")
                for choice in chunk.get("choices") or ():
                    if choice.get("text"):
                        rec.token_times.append(now)
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
    except Exception as exc:  # a failed request is counted, the run goes on
        rec.error = f"{type(exc).__name__}: {exc}"
        return
    if usage_out and rec.token_times and usage_out > len(rec.token_times):
        # a chunk may carry several tokens: spread the missing ones over its arrival time
        rec.token_times.extend([rec.token_times[-1]] * (usage_out - len(rec.token_times)))


async def _run(base_url: str, model: str, requests: Sequence[PlannedRequest],
               prompts: Sequence[str], timeout_s: float) -> list[RequestRecord]:
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    records = [RequestRecord(r.index, 0.0, len(r.prompt_ids)) for r in requests]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for req, rec, prompt in sorted(zip(requests, records, prompts),
                                       key=lambda p: p[0].arrival_s):
            delay = start + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, url, model, prompt, req, rec)))
        await asyncio.gather(*tasks)
    return records


def run_against_url(base_url: str, model: str, requests: Sequence[PlannedRequest],
                    prompts: Sequence[str], timeout_s: float = 600.0) -> list[RequestRecord]:
    """Send the workload to `base_url` (e.g. http://localhost:8000) and time it."""
    if len(prompts) != len(requests):
        raise ValueError("one prompt per request")
    return asyncio.run(_run(base_url, model, requests, prompts, timeout_s))
