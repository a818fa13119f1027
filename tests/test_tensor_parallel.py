"""Tensor parallelism below the dispatcher: a model split over 2 and 4 cpu devices
(loader/sharding.py, kernels/tensor_parallel.py) against the same model on one.

References: the one-device forward (itself checked against a float64 forward and
llama.cpp in test_forward.py / test_architectures_vs_llama_cpp.py), gguf-py's dequantizer
for the shards of quantized blocks, a float64 numpy sum for the host all-reduce.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, quants
from gguf import GGMLQuantizationType as Q

from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import held_bytes
from eagerlm.kernels.cpu_compile import wait_for_later_kernels
from eagerlm.kernels.cpu_decode_program import REDUCE
from eagerlm.kernels.host_collective import Exchange, HostGroup
from eagerlm.kernels.numpy_ops import NumpyOps
from eagerlm.kernels.tensor_parallel import TensorParallelModel, cpu_group
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.sharding import Split, UnevenShard, plan_shards, shard_bytes, shard_info
from eagerlm.loader.synthetic import (
    RANDOM_BYTE_TYPES,
    random_blocks,
    tiny_spec,
    write_synthetic_model,
)
from eagerlm.loader.weights import SUPPORTED_TYPES
from eagerlm.vmm.kv_layout import ContiguousKV
from tests import block_reference
from tests.block_reference import LLAMA_CPP_TYPES, fixture_blocks

SPECS = {  # as test_forward.py's: qwen3 with one KV head (replicated on every device)
    "llama": tiny_spec("llama"),
    "qwen2": tiny_spec("qwen2", tied_embeddings=True),
    "qwen3": tiny_spec("qwen3", n_kv_heads=1),
    "gemma3": tiny_spec("gemma3", n_layers=6, sliding_window=4, tied_embeddings=True,
                        final_logit_softcap=30.0),
    # mixtures: each expert's features split (8 of 2 chosen, 32 wide), the router whole;
    # gpt-oss with its sinks split by head and its output biases on device 0 alone
    "qwen3moe": tiny_spec("qwen3moe"),
    "gpt-oss": tiny_spec("gpt-oss"),
    # Mixtral-style llama (its experts d_ff wide) with a shared expert beside them
    "llama-moe": tiny_spec("llama", n_experts=4, n_experts_used=2, d_ff_shared=64),
}
PROMPT = [1, 17, 300, 42, 42, 7, 99, 256, 3, 511, 128, 64]
DECODED = [5, 9, 33, 480]


def _model(tmp_path, spec) -> ModelFile:
    return ModelFile.open(write_synthetic_model(tmp_path / f"{spec.architecture}.gguf", spec))


def _logits(group: TensorParallelModel) -> list[np.ndarray]:
    """A prefill (every row's logits) then one decode step per token of DECODED, each
    device with its own cache of its KV heads."""
    kvs = [ContiguousKV(group.kv_layout(r), 64) for r in range(group.size)]
    out = [group.forward([ForwardBatch.single(PROMPT, 0, kv, np.arange(len(PROMPT)))
                          for kv in kvs])]
    for step, t in enumerate(DECODED):
        out.append(group.forward([ForwardBatch.single([t], len(PROMPT) + step, kv)
                                  for kv in kvs]))
    return out


def _run(model: ModelFile, n: int, **kw) -> list[np.ndarray]:
    group = cpu_group(model, n, **kw)
    try:
        return _logits(group)
    finally:
        group.close()


def _assert_split_within_8_bit_noise(model: ModelFile) -> None:
    """Split on block boundaries, the blocks multiply as on one device; but the quantized
    kernels round their inputs to 8 bits (kernels/cpu_activations.py), and the all-reduce
    adds the devices' partial sums in another order, a last-bit difference that the next
    layer's rounding can turn into a whole step. So the model's logits over two devices
    must be as close to the float path's (the same file dequantized to float32, gguf-py's
    values) as the one-device quantized model's are: the mean distance within 1.5x, the
    top token kept as often to one row in 20 (tests/test_cpu_quantized.py's 8-bit noise
    rule)."""
    one, two = (np.concatenate(_run(model, n)) for n in (1, 2))
    exact = np.concatenate(_run(model, 1, weights="float"))
    assert np.abs(two - exact).mean() <= 1.5 * np.abs(one - exact).mean()
    assert (two.argmax(-1) == exact.argmax(-1)).mean() >= (
        (one.argmax(-1) == exact.argmax(-1)).mean() - 0.05)


def _assert_close(ref: list[np.ndarray], got: list[np.ndarray]) -> None:
    # float32 rounding: the devices' partial sums are added in another order
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=0, atol=2e-5 * np.abs(a).max())


@pytest.mark.parametrize("arch", sorted(SPECS))  # the families it splits
def test_logits_over_two_and_four_cpu_devices_equal_one_devices_within_float32_rounding(
        tmp_path, arch):
    model = _model(tmp_path, SPECS[arch])
    ref = _run(model, 1)
    for n in (2, 4):
        _assert_close(ref, _run(model, n))


@pytest.mark.parametrize("arch", ["qwen3", "gemma3", "qwen3moe-q8_0"])
def test_each_devices_decode_steps_replay_its_share_with_the_all_reduces_in_the_table(
        tmp_path, arch, monkeypatch):
    """A device of a group replays its decode steps, and rows whose logits are all wanted
    (kernels/cpu_decode_program.py): each all-reduce a REDUCE step of its table, two a
    layer, its share of the logits gathered after.
    The logits are the op-by-op forward's: the same bits, but for gemma3's softcap
    (numpy's tanh op by op, within float32 rounding; as on one device). The mixture's
    experts are Q8_0: float32 experts are not replayed."""
    spec = tiny_spec("qwen3moe", weight_type=Q.Q8_0, d_ff_expert=64) \
        if arch == "qwen3moe-q8_0" else SPECS[arch]
    model = _model(tmp_path, spec)
    group = cpu_group(model, 2)
    # (a cold cache: the table's kernels for these types compile after the load)
    assert wait_for_later_kernels(600)
    try:
        replayed = _logits(group)
        for tf in group.transformers:  # the prompt's 12 rows (all logits) and a step's 1
            programs = {p.n: p for p in tf.ops._programs.values() if p is not None}
            assert sorted(programs) == [1, len(PROMPT)]
            for program in programs.values():
                reduces = sum(step[0] == REDUCE for step in program.steps)
                assert program.gather and reduces == 2 * model.config.n_layers
    finally:
        group.close()
    monkeypatch.setattr(NumpyOps, "replay", lambda self, transformer, batch: None)
    by_ops = _run(model, 2)
    for a, b in zip(replayed, by_ops, strict=True):
        if arch == "gemma3":
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())
        else:
            np.testing.assert_array_equal(a, b)


def test_a_family_without_sharding_rules_is_refused_naming_a_tensor(tmp_path):
    """phi3's fused tensors (query, key and value in one matrix, gate and up in another):
    no rule splits them yet, so such a model is refused for more than one device."""
    model = _model(tmp_path, tiny_spec("phi3"))
    with pytest.raises(UnevenShard, match="attn_qkv"):
        plan_shards(model.config, model.gguf.tensors, 2)
    assert len(plan_shards(model.config, model.gguf.tensors, 1)) == 1


def test_each_device_holds_its_share_of_every_expert_and_device_0_the_output_biases(
        tmp_path):
    """gpt-oss over 2 devices (4 experts of 64 features, 4 heads): each device holds
    features 32 r .. 32 r + 31 of every expert (gate and up rows with their biases, down
    columns), half the heads' sinks, the router whole; the biases added after an
    all-reduce (attention output, experts' down) are device 0's, zeros on device 1."""
    model = _model(tmp_path, SPECS["gpt-oss"])
    full = model.gguf
    group = cpu_group(model, 2, weights="float")
    try:
        for r, tf in enumerate(group.transformers):
            lw, moe = tf.weights.layers[0], tf.config.moe
            assert moe is not None and moe.d_ff == 32
            cols = slice(32 * r, 32 * (r + 1))
            gate = full.tensor_bytes("blk.0.ffn_gate_exps.weight").view(np.float32)
            np.testing.assert_array_equal(lw.moe.gate, gate.reshape(4, 64, -1)[:, cols])
            down = full.tensor_bytes("blk.0.ffn_down_exps.weight").view(np.float32)
            np.testing.assert_array_equal(lw.moe.down, down.reshape(4, -1, 64)[:, :, cols])
            up_bias = full.tensor_bytes("blk.0.ffn_up_exps.bias").view(np.float32)
            np.testing.assert_array_equal(lw.moe.up_bias, up_bias.reshape(4, 64)[:, cols])
            router = full.tensor_bytes("blk.0.ffn_gate_inp.weight").view(np.float32)
            np.testing.assert_array_equal(lw.moe.router.reshape(-1), router)
            sinks = full.tensor_bytes("blk.0.attn_sinks.weight").view(np.float32)
            np.testing.assert_array_equal(lw.sinks, sinks[2 * r:2 * (r + 1)])
            for bias, name in ((lw.bo, "attn_output.bias"),
                               (lw.moe.down_bias, "ffn_down_exps.bias")):
                whole = full.tensor_bytes(f"blk.0.{name}").view(np.float32)
                want = whole if r == 0 else np.zeros_like(whole)
                np.testing.assert_array_equal(np.asarray(bias).reshape(-1), want)
    finally:
        group.close()


def test_a_devices_share_of_every_experts_rows_is_read_in_place(tmp_path):
    """One device reads a mixture's quantized experts in place (the page cache's, not
    counted as held). A device's share of each expert's gate / up rows is one stretch of
    each expert's bytes: a view of the file's map as well; its share of each expert's
    down columns is a copy, counted in what it holds (the memory check before the load),
    as every other tensor's share is."""
    model = _model(tmp_path, tiny_spec("qwen3moe", weight_type=Q.Q8_0, d_ff_expert=64))
    tensors = model.gguf.tensors

    def held(parts) -> int:
        return sum(4 * p.n_elements if p.qtype == Q.F32 else p.n_bytes for p in parts)
    assert held_bytes(model, "quantized") == held(
        i for i in tensors.values() if len(i.shape) < 3)
    downs = []
    for s in plan_shards(model.config, tensors, 2):
        parts = {name: shard_info(i, s.split(name, model.config.head_dim))
                 for name, i in tensors.items()}
        downs.append(held(p for n, p in parts.items() if "down_exps" in n))
        assert held_bytes(model, "quantized", s) == held(
            p for n, p in parts.items() if "gate_exps" not in n and "up_exps" not in n)
    assert sum(downs) == sum(i.n_bytes for n, i in tensors.items() if "down_exps" in n)
    group = cpu_group(model, 2)
    try:
        for r, tf in enumerate(group.transformers):
            moe = tf.weights.layers[0].moe
            assert moe.gate.mapped and moe.up.mapped and not moe.down.mapped
            mapped = model.gguf.mapped_bytes("blk.0.ffn_gate_exps.weight")
            assert np.shares_memory(moe.gate.blocks, mapped)  # the map's bytes, not a copy
            assert not np.shares_memory(
                moe.down.blocks, model.gguf.mapped_bytes("blk.0.ffn_down_exps.weight"))
            gate = model.gguf.tensor_bytes("blk.0.ffn_gate_exps.weight").reshape(8, 64, -1)
            np.testing.assert_array_equal(moe.gate.blocks, gate[:, 32 * r:32 * (r + 1)])
    finally:
        group.close()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_K, Q.MXFP4], ids=lambda q: q.name)
def test_quantized_experts_split_over_devices_give_the_one_devices_logits(tmp_path, qtype):
    """A mixture's quantized experts (mapped in place on one device; each device's share
    a copy of whole blocks) give the split model the one device's logits to the 8-bit
    noise rule (`_assert_split_within_8_bit_noise`). 512 features per expert: one Q4_K
    superblock a device, eight MXFP4 / Q8_0 blocks."""
    spec = tiny_spec("qwen3moe", weight_type=qtype, embedding_type=Q.Q8_0, d_model=256,
                     n_heads=8, n_kv_heads=2, head_dim=64, d_ff_expert=512)
    _assert_split_within_8_bit_noise(_model(tmp_path, spec))


def test_each_device_holds_its_share_of_the_heads_the_ffn_and_the_vocabulary(tmp_path):
    model = _model(tmp_path, SPECS["qwen3"])  # 4 heads, 1 KV head, d_ff 128, vocab 512
    group = cpu_group(model, 4, weights="float")
    try:
        for r, tf in enumerate(group.transformers):
            lw, c = tf.weights.layers[0], tf.config
            assert (c.n_heads, c.n_kv_heads, c.d_ff, c.vocab_size) == (1, 1, 32, 512)
            assert lw.wq.shape == (16, 64) and lw.wk.shape == (16, 64)
            assert lw.wo.shape == (64, 16) and lw.w_down.shape == (64, 32)
            assert lw.w_gate.shape == (32, 64) and tf.weights.output.shape == (128, 64)
            full = model.gguf.tensor_bytes("blk.0.ffn_gate.weight").view(np.float32)
            np.testing.assert_array_equal(lw.w_gate, full.reshape(128, 64)[32 * r:32 * (r + 1)])
    finally:
        group.close()


def _blocks(qtype: Q, rows: int, cols: int) -> np.ndarray:
    """Random raw bytes of a `rows x cols` matrix of `qtype`, as a file stores them."""
    rng = np.random.default_rng(int(qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    if qtype in RANDOM_BYTE_TYPES:
        return random_blocks(qtype, np.full(rows * cols // block, 0.01, np.float32), rng
                             ).reshape(-1)
    if qtype in LLAMA_CPP_TYPES:
        return fixture_blocks(qtype, rows * cols // block, rng).reshape(-1)
    values = rng.standard_normal((rows, cols), dtype=np.float32)
    return quants.quantize(values, qtype).reshape(-1).view(np.uint8)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=lambda q: q.name)
def test_every_weight_type_is_split_on_block_boundaries_without_dequantizing(qtype):
    from eagerlm.loader.gguf_file import TensorInfo

    block = GGML_QUANT_SIZES[qtype][0]
    rows, cols = 6, 4 * max(block, 32)
    raw = _blocks(qtype, rows, cols)
    info = TensorInfo("blk.0.ffn_down.weight", qtype, (rows, cols), 0, raw.size)
    full = block_reference.dequantize(raw.reshape(rows, -1), qtype).reshape(rows, cols)
    for cut in (Split(0, 2, 5), Split(1, cols // 4, 3 * cols // 4), Split(1, 0, cols // 4)):
        part = shard_bytes(raw, info, cut)
        part_info = shard_info(info, cut)
        assert part.size == part_info.n_bytes  # whole blocks, the same bytes
        got = block_reference.dequantize(part.reshape(part_info.shape[0], -1), qtype)
        want = full[cut.start:cut.stop] if cut.axis == 0 else full[:, cut.start:cut.stop]
        np.testing.assert_array_equal(got.reshape(want.shape), want)
    # the same bytes as 3 experts of 2 rows: a range of each expert's rows, of its columns
    experts = dataclasses.replace(info, name="blk.0.ffn_down_exps.weight", shape=(3, 2, cols))
    by_expert = full.reshape(3, 2, cols)
    for cut, want in ((Split(1, 1, 2), by_expert[:, 1:2]),
                      (Split(2, cols // 4, cols // 2), by_expert[:, :, cols // 4:cols // 2])):
        part, part_info = shard_bytes(raw, experts, cut), shard_info(experts, cut)
        assert part.size == part_info.n_bytes and part_info.shape == want.shape
        got = block_reference.dequantize(part.reshape(-1, part.size // want[..., 0].size),
                                         qtype)
        np.testing.assert_array_equal(got.reshape(want.shape), want)


def test_a_column_split_inside_a_block_is_refused_naming_the_tensor(tmp_path):
    # 4 heads of 16 over 4 devices: 16 columns of attn_output each, half a Q8_0 block
    model = _model(tmp_path, tiny_spec("llama", weight_type=Q.Q8_0))
    plan_shards(model.config, model.gguf.tensors, 2)  # 32 columns each: whole blocks
    with pytest.raises(UnevenShard, match="blk.0.attn_output.weight.*Q8_0") as err:
        plan_shards(model.config, model.gguf.tensors, 4)
    assert err.value.param == "tensor_parallel"


def test_heads_that_do_not_divide_are_refused(tmp_path):
    model = _model(tmp_path, SPECS["llama"])  # 4 heads, 2 KV heads
    with pytest.raises(UnevenShard, match="4 attention heads.*head_count"):
        plan_shards(model.config, model.gguf.tensors, 3)
    kv3 = _model(tmp_path, tiny_spec("qwen2", n_heads=6, n_kv_heads=3))
    with pytest.raises(UnevenShard, match="3 KV heads.*head_count_kv"):
        plan_shards(kv3.config, kv3.gguf.tensors, 2)


def test_an_ffn_of_an_odd_number_of_blocks_is_split_unevenly_on_whole_blocks(tmp_path):
    # 96 features = 3 Q8_0 blocks over 2 devices: 64 and 32 (Llama 2 7B's 43 superblocks)
    spec = tiny_spec("llama", weight_type=Q.Q8_0, d_ff=96, head_dim=32, n_heads=2,
                     n_kv_heads=2)
    model = _model(tmp_path, spec)
    assert [s.ffn for s in plan_shards(model.config, model.gguf.tensors, 2)] == \
        [(0, 32), (32, 96)]
    _assert_close(_run(model, 1), _run(model, 2))


def test_a_vocabulary_that_does_not_divide_keeps_the_lm_head_whole(tmp_path):
    model = _model(tmp_path, tiny_spec("qwen2", vocab_size=514, tied_embeddings=True))
    shards = plan_shards(model.config, model.gguf.tensors, 4)
    assert not any(s.vocab_parallel for s in shards)
    _assert_close(_run(model, 1), _run(model, 4))


def test_the_lm_head_kept_whole_gives_the_logits_of_the_split_one(tmp_path):
    model = _model(tmp_path, SPECS["llama"])
    _assert_close(_run(model, 2), _run(model, 2, split_lm_head=False))


def test_quantized_blocks_split_over_devices_give_the_one_devices_logits(tmp_path):
    """Q4_K blocks split over two devices give the one device's logits to the 8-bit noise
    rule (`_assert_split_within_8_bit_noise`)."""
    # Q4_K rows are 256-value superblocks: 8 heads of 64 give each of 2 devices 256
    # columns of attn_output, and d_ff 512 gives 256 of ffn_down
    spec = tiny_spec("qwen3", weight_type=Q.Q4_K, embedding_type=Q.Q8_0, d_model=256,
                     n_heads=8, n_kv_heads=2, head_dim=64, d_ff=512)
    _assert_split_within_8_bit_noise(_model(tmp_path, spec))


def test_a_device_that_fails_ends_the_forward_on_every_device_without_a_hang(tmp_path):
    model = _model(tmp_path, SPECS["llama"])
    group = cpu_group(model, 2)
    try:
        def broken(*args, **kwargs):
            raise RuntimeError("device 1 failed")
        ops = group.transformers[1].ops
        ops.attention = broken  # type: ignore[method-assign]
        kvs = [ContiguousKV(group.kv_layout(r), 64) for r in range(2)]
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="device 1 failed"):
            group.forward([ForwardBatch.single(PROMPT, 0, kv) for kv in kvs])
        del ops.attention  # the device is fine again, but its group is over
        with pytest.raises(threading.BrokenBarrierError):
            group.forward([ForwardBatch.single(PROMPT, 0, kv) for kv in kvs])
        assert time.monotonic() - t0 < 30
    finally:
        group.close()


def test_the_host_all_reduce_is_the_sum_with_the_same_bits_on_every_device():
    rng = np.random.default_rng(1)
    parts = [rng.standard_normal((3, 1001), dtype=np.float32) for _ in range(4)]
    group = HostGroup(4)
    got: list[np.ndarray] = [np.empty(0)] * 4
    gathered: list[np.ndarray] = [np.empty(0)] * 4

    def device(r: int) -> None:
        me = group.member(r)
        got[r] = me.all_reduce(parts[r]).copy()
        gathered[r] = me.all_gather(parts[r][:, :5]).copy()

    threads = [threading.Thread(target=device, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    exact = np.sum([p.astype(np.float64) for p in parts], axis=0)
    np.testing.assert_allclose(got[0], exact, rtol=1e-6, atol=1e-6)
    for r in range(4):
        np.testing.assert_array_equal(got[r], got[0])
        np.testing.assert_array_equal(gathered[r], np.concatenate([p[:, :5] for p in parts], 1))


def _exchange_sums(exchange: Exchange, parts: list[list[np.ndarray]],
                   delays: np.ndarray) -> list[list[np.ndarray]]:
    """Each device r sums parts[r][i] for every i in turn over `exchange` (a thread a
    device, sleeping delays[r, i] seconds before its i-th)."""
    got: list[list[np.ndarray]] = [[] for _ in parts]

    def device(r: int) -> None:
        for i, part in enumerate(parts[r]):
            time.sleep(delays[r, i])
            x = part.copy()
            exchange.sum(r, x)
            got[r].append(x)

    threads = [threading.Thread(target=device, args=(r,)) for r in range(len(parts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return got


def test_the_exchanges_all_reduces_are_rank_order_sums_in_any_arrival_order():
    """The all-reduce the replay's REDUCE steps and the ops share (`Exchange`): 30 in a
    row over 4 devices arriving in random orders, sizes from 1 value to several times a
    slot (`capacity`: the sum goes in pieces, the two slot sets alternating): every
    device gets numpy's float32 sum in rank order ((p0 + p1) + p2) + p3, the same bits."""
    rng = np.random.default_rng(5)
    size, capacity = 4, 64
    sizes = rng.integers(1, 5 * capacity, 30)
    parts = [[rng.standard_normal(n).astype(np.float32) for n in sizes] for _ in range(size)]
    exchange = Exchange(size, capacity)
    got = _exchange_sums(exchange, parts, rng.uniform(0, 2e-3, (size, len(sizes))))
    for i in range(len(sizes)):
        want = parts[0][i].copy()
        for r in range(1, size):
            want += parts[r][i]
        for r in range(size):
            np.testing.assert_array_equal(got[r][i].view(np.uint32), want.view(np.uint32))
    assert [exchange.counts(r)[0] for r in range(size)] == [int(sum(-(-sizes // capacity)))] * 4


def test_a_device_waiting_in_the_exchange_raises_once_the_group_is_aborted():
    """A device whose peer never comes (it failed) waits in the exchange until the group
    is aborted, then raises BrokenBarrierError, as every later all-reduce does."""
    group = HostGroup(2)
    raised: list[BaseException] = []

    def device_0() -> None:
        try:
            group.member(0).all_reduce(np.ones(8, np.float32))
        except threading.BrokenBarrierError as e:
            raised.append(e)

    t = threading.Thread(target=device_0)
    t.start()
    time.sleep(0.2)
    assert t.is_alive() and not raised  # waiting for device 1
    group.abort()
    t.join(10)
    assert not t.is_alive() and len(raised) == 1
    with pytest.raises(threading.BrokenBarrierError):
        group.member(1).all_reduce(np.ones(8, np.float32))
