"""HF transformers (PyTorch) as the GPU peer of `eagerlm bench offline`: the same synthetic
shapes and the same workload (`service.workload`, same seed), random weights.

Modes (greedy, EOS suppressed, as in eagerlm's benchmark):
- `static`: `generate` with `cache_implementation="static"` on batches of `--batch-size`
  requests in arrival order, prompts left-padded; a batch runs to its longest requested
  output, so two numbers are reported: useful tokens/s (what the requests asked for, the
  number to compare) and generated tokens/s (including the tail of shorter requests);
- `continuous`: transformers' continuous-batching manager (`init_continuous_batching`, the
  engine behind `generate_batch`) with each request's own `max_new_tokens`, if this
  transformers version has it.

torch and transformers are imported lazily; neither is an eagerlm dependency. Status: run
only on the cpu with tiny shapes, as a smoke test of the script (`--device cpu --shape
tiny`); the GPU numbers the issue asks for have not been measured yet.

Run: `python benchmarks/peer_transformers.py --shape qwen3-0.6b --device cuda
[--num-requests 256 --input-len 100-1024 --output-len 100-1024] [--json out.json]`
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagerlm.loader.synthetic import SHAPES, SyntheticSpec, tiny_spec
from eagerlm.service.measure.workload import (
    LengthRange,
    PlannedRequest,
    WorkloadSpec,
    make_workload,
)


def build_model(spec: SyntheticSpec, device: str, dtype: str) -> Any:
    """A randomly initialised transformers model of the synthetic shape (qwen3/llama)."""
    import torch
    import transformers

    common = dict(vocab_size=spec.vocab_size, hidden_size=spec.d_model,
                  intermediate_size=spec.d_ff, num_hidden_layers=spec.n_layers,
                  num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_kv_heads,
                  head_dim=spec.head_dim, max_position_embeddings=spec.context_length,
                  rms_norm_eps=spec.norm_eps, rope_theta=spec.rope_base,
                  tie_word_embeddings=spec.tied_embeddings, eos_token_id=None,
                  pad_token_id=0, bos_token_id=None)
    if spec.architecture == "qwen3":
        config = transformers.Qwen3Config(**common)
        cls = transformers.Qwen3ForCausalLM
    elif spec.architecture == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    else:
        raise ValueError(f"no transformers peer for {spec.architecture}")
    torch.manual_seed(0)
    with torch.device(device):
        model = cls(config).to(getattr(torch, dtype)).eval()
    return model


def run_static(model: Any, requests: list[PlannedRequest], batch_size: int,
               device: str) -> dict[str, float]:
    import torch

    useful = generated = 0
    with torch.inference_mode():  # warm-up: first-call costs are not charged to the run
        model.generate(input_ids=torch.tensor([requests[0].prompt_ids[:8]], device=device),
                       max_new_tokens=2, do_sample=False, cache_implementation="static",
                       pad_token_id=0)
    t0 = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        group = requests[i:i + batch_size]
        width = max(len(r.prompt_ids) for r in group)
        ids = torch.zeros((len(group), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(group):  # left padding
            ids[row, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[row, width - len(r.prompt_ids):] = 1
        n_new = max(r.max_tokens for r in group)
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                 cache_implementation="static", pad_token_id=0)
        generated += (out.shape[1] - width) * len(group)
        useful += sum(r.max_tokens for r in group)
    _sync(device)
    wall = time.perf_counter() - t0
    return {"useful_tok_s": useful / wall, "generated_tok_s": generated / wall,
            "wall_s": wall, "batch_size": batch_size}


def run_continuous(model: Any, requests: list[PlannedRequest], device: str) -> dict[str, float]:
    import transformers

    if not hasattr(model, "init_continuous_batching"):
        raise RuntimeError(f"transformers {transformers.__version__} has no continuous "
                           "batching")
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=max(
        r.max_tokens for r in requests), eos_token_id=None, pad_token_id=0)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        manager.add_request(list(requests[0].prompt_ids[:8]), request_id="warm-up",
                            max_new_tokens=2)  # start-up costs are not charged to the run
        while (warm := manager.get_result(timeout=600)) is None or not warm.is_finished():
            pass
        t0 = time.perf_counter()
        for r in requests:
            manager.add_request(list(r.prompt_ids), request_id=str(r.index),
                                max_new_tokens=r.max_tokens)
        n_out = finished = 0
        while finished < len(requests):
            result = manager.get_result(timeout=60)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the continuous-batching manager stopped")
                continue
            if result.is_finished():
                finished += 1
                n_out += len(result.generated_tokens)
        _sync(device)
        wall = time.perf_counter() - t0
    finally:
        manager.stop(block=True)
    return {"useful_tok_s": n_out / wall, "generated_tok_s": n_out / wall, "wall_s": wall}


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="qwen3-0.6b", help=f"tiny or one of {', '.join(SHAPES)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--input-len", type=LengthRange.parse, default=LengthRange(100, 1024))
    ap.add_argument("--output-len", type=LengthRange.parse, default=LengthRange(100, 1024))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, nargs="+", default=[16, 64],
                    help="static-cache batch sizes to try (default 16 64)")
    ap.add_argument("--modes", nargs="+", default=["static", "continuous"])
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    spec = tiny_spec("qwen3") if args.shape == "tiny" else SHAPES[args.shape]
    workload = WorkloadSpec(args.num_requests, args.input_len, args.output_len, seed=args.seed)
    requests = make_workload(workload, spec.vocab_size, spec.context_length)
    model = build_model(spec, args.device, args.dtype)
    results: dict[str, Any] = {}
    if "static" in args.modes:
        for b in args.batch_size:
            results[f"static b={b}"] = run_static(model, requests, b, args.device)
    if "continuous" in args.modes:
        try:
            results["continuous"] = run_continuous(model, requests, args.device)
        except Exception as e:  # report, keep the static numbers
            results["continuous"] = {"error": f"{type(e).__name__}: {e}"}
    import torch
    import transformers

    report = {"date": time.strftime("%Y-%m-%d"), "shape": args.shape, "device": args.device,
              "device_name": (torch.cuda.get_device_name() if args.device.startswith("cuda")
                              else "cpu"),
              "torch": torch.__version__, "transformers": transformers.__version__,
              "dtype": args.dtype, "workload": {"n": args.num_requests,
                                                "input_len": str(args.input_len),
                                                "output_len": str(args.output_len),
                                                "seed": args.seed},
              "results": results}
    print("| transformers mode | useful tok/s | generated tok/s | wall s |")
    print("|---|---|---|---|")
    for name, r in results.items():
        if "error" in r:
            print(f"| {name} | {r['error']} | | |")
        else:
            print(f"| {name} | {r['useful_tok_s']:.1f} | {r['generated_tok_s']:.1f} | "
                  f"{r['wall_s']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
