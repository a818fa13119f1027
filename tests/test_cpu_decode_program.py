"""A batch of decode rows' forward recorded once and replayed in one compiled call
(kernels/cpu_decode_program.py) gives what the forward run op by op gives (the same
Transformer's `run` with the same ops, on copies of the same caches): logits and the K/V
it appends, within float32 rounding (the same bits but for the float32 products' order
and the activation's exp), for every architecture it records, a mixture of experts with
quantized experts included (the same bits); and what the recording cannot express (float32
experts, prompt rows, logits of fewer than half the rows) runs op by op; logits of at
least half the rows replay (every row's, then those)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from eagerlm.kernels import cpu_decode_program
from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.kernels.cpu_threads import CoreWorkers
from eagerlm.kernels.model import Transformer
from eagerlm.loader.model_file import ModelFile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model
from eagerlm.vmm.kv_layout import KVLayout, TokenMajorKV

Q = GGMLQuantizationType
PROMPTS = (5, 19, 30)  # past gemma3's 16-token test window


def loaded(model: ModelFile) -> Transformer:
    """The model's transformer once its replay's table is loaded (on a cold numba cache
    it compiles in the background after the load: kernels/cpu_compile.py)."""
    tf = cpu_transformer(model)
    assert cpu_decode_program.TABLE_READY.wait(600)
    return tf


def prefilled(tf, n_copies: int = 2) -> tuple[list[list[TokenMajorKV]], list[int]]:
    """`n_copies` identical sets of caches (token-major host arrays, as the engine's),
    each session's prompt already in."""
    cfg = tf.config
    layout = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
    rng = np.random.default_rng(0)
    sets: list[list[TokenMajorKV]] = [[] for _ in range(n_copies)]
    for n in PROMPTS:
        toks = rng.integers(10, cfg.vocab_size, n).astype(np.int32)
        for caches in sets:
            kv = TokenMajorKV(np.zeros((64, *layout.token_shape), np.float32))
            tf.forward(ForwardBatch.single(toks, 0, kv))
            caches.append(kv)
    return sets, list(PROMPTS)


def decode_batch(tokens: np.ndarray, caches: list[TokenMajorKV], positions: list[int]
                 ) -> ForwardBatch:
    return ForwardBatch(tokens, [SeqSlice(i, 1, p, kv) for i, (kv, p) in
                                 enumerate(zip(caches, positions, strict=True))],
                        np.arange(len(caches)))


def replayed_against_ops(tf, steps: int = 3) -> None:
    """`steps` decode steps replayed and op by op on copies of the same caches: logits
    within float32 rounding, the same greedy tokens, the caches alike."""
    (replayed, by_ops), positions = prefilled(tf)
    rng = np.random.default_rng(1)
    tokens = rng.integers(10, tf.config.vocab_size, len(positions)).astype(np.int32)
    for _ in range(steps):
        got = tf.forward(decode_batch(tokens, replayed, positions))
        want = tf.run(decode_batch(tokens, by_ops, positions), tf.ops)
        assert tf.ops._programs[(id(tf), len(positions))] is not None  # it was replayed
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))
        for a, b in zip(replayed, by_ops, strict=True):
            np.testing.assert_allclose(a.data, b.data, rtol=1e-4, atol=1e-5)
        tokens = want.argmax(axis=1).astype(np.int32)
        positions = [p + 1 for p in positions]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "phi3"])
def test_a_replayed_decode_step_gives_the_logits_and_caches_of_the_ops(tmp_path, arch):
    """float32 matrices (the table's own row kernel); qwen2's biases, qwen3's QK-norm,
    gemma3's post-norms, sliding window and softcap, phi3's partial rope."""
    extra = {"final_logit_softcap": 30.0} if arch == "gemma3" else {}
    model = ModelFile.open(write_synthetic_model(tmp_path / "m.gguf",
                                                 tiny_spec(arch, n_layers=3, **extra)))
    replayed_against_ops(loaded(model))


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.IQ4_XS, Q.F16])
def test_a_replayed_decode_step_of_a_quantized_model_gives_the_logits_of_the_ops(tmp_path,
                                                                               qtype):
    """Each type's `gemv` and activation quantizer through the row kernels' C signature:
    the same products as the ops' (only the activation's exp differs in its last bits), so
    the logits agree within float32 rounding and greedy decoding picks the same tokens.
    Rows of 256 values: the superblock types' unit."""
    spec = tiny_spec("qwen2", n_layers=2, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64,
                     d_ff=512, weight_type=qtype)
    replayed_against_ops(loaded(ModelFile.open(
        write_synthetic_model(tmp_path / "m.gguf", spec))))


def test_a_sessions_several_rows_replay_with_the_logits_of_the_ops(tmp_path):
    """A speculative round's verification rows (a session's consecutive rows, every row's
    logits wanted) beside other sessions' decode rows: replayed, each row attending at its
    own position, with the ops' logits and caches."""
    tf = loaded(ModelFile.open(write_synthetic_model(tmp_path / "m.gguf",
                                                     tiny_spec("llama", n_layers=2))))
    (replayed, by_ops), positions = prefilled(tf)

    def batch(caches):
        return ForwardBatch(np.array([11, 12, 13, 14, 15], np.int32),
                            [SeqSlice(0, 1, positions[0], caches[0]),
                             SeqSlice(1, 3, positions[1], caches[1]),
                             SeqSlice(4, 1, positions[2], caches[2])], np.arange(5))
    got = tf.forward(batch(replayed))
    want = tf.run(batch(by_ops), tf.ops)
    assert tf.ops._programs[(id(tf), 5)] is not None  # it was replayed
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))
    for a, b in zip(replayed, by_ops, strict=True):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-4, atol=1e-5)


def test_half_the_rows_logits_or_more_replay_with_the_ops_logits_of_those_rows(tmp_path):
    """A draft model's first forward of a round (two rows a session, the last's logits
    wanted) and any batch wanting at least half its rows' logits: replayed for every row,
    then those rows, each within float32 rounding of the ops' (which compute only them)."""
    tf = loaded(ModelFile.open(write_synthetic_model(tmp_path / "m.gguf",
                                                     tiny_spec("llama", n_layers=2))))
    (replayed, by_ops), positions = prefilled(tf)

    def batch(caches, rows):
        return ForwardBatch(np.array([11, 12, 13, 14, 15, 16], np.int32),
                            [SeqSlice(2 * i, 2, positions[i] - 1, caches[i])
                             for i in range(3)], np.array(rows))
    for rows in ([1, 3, 5], [0, 1, 2, 5]):
        got = tf.ops.replay(tf, batch(replayed, rows))
        assert got is not None and tf.ops._programs[(id(tf), 6)] is not None
        want = tf.run(batch(by_ops, rows), tf.ops)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        np.testing.assert_array_equal(got.argmax(axis=1), want.argmax(axis=1))
    for a, b in zip(replayed, by_ops, strict=True):
        np.testing.assert_allclose(a.data, b.data, rtol=1e-4, atol=1e-5)
    assert tf.ops.replay(tf, batch(replayed, [5])) is None  # one row of six: op by op


@pytest.mark.parametrize("n_rows", [1, 3])
@pytest.mark.parametrize("arch, expert_type", [("qwen3moe", Q.Q8_0), ("qwen3moe", Q.Q4_K),
                                               ("qwen3moe", Q.Q6_K), ("gpt-oss", Q.MXFP4)])
def test_a_mixture_of_experts_replays_with_the_bits_of_the_ops(tmp_path, arch, expert_type,
                                                               n_rows):
    """Quantized matrices: the router (float32, as llama.cpp leaves it), the routing, each
    row's chosen experts' products (the expert found from the id the table wrote), the
    activation and the weighted sum, replayed: the ops' logits bit for bit (the same
    kernels on the same rows), step after step. gpt-oss adds attention sinks, sliding
    window layers, biases (the router's, each expert's, the attention's), the clamped
    SwiGLU and the softmax over the chosen experts' logits."""
    spec = tiny_spec(arch, n_layers=2, d_model=256, n_heads=4, n_kv_heads=2,
                     head_dim=64, d_ff_expert=256, weight_type=Q.Q8_0,
                     expert_type=expert_type)
    tf = loaded(ModelFile.open(write_synthetic_model(tmp_path / "m.gguf", spec)))
    (replayed, by_ops), positions = prefilled(tf)
    replayed, by_ops, positions = replayed[:n_rows], by_ops[:n_rows], positions[:n_rows]
    tokens = np.arange(11, 11 + n_rows, dtype=np.int32)
    for _ in range(3):
        got = tf.forward(decode_batch(tokens, replayed, positions))
        want = tf.run(decode_batch(tokens, by_ops, positions), tf.ops)
        assert tf.ops._programs[(id(tf), n_rows)] is not None  # it was replayed
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        for a, b in zip(replayed, by_ops, strict=True):
            np.testing.assert_array_equal(a.data, b.data)
        tokens = want.argmax(axis=1).astype(np.int32)
        positions = [p + 1 for p in positions]


def test_what_the_table_cannot_express_runs_op_by_op(tmp_path):
    """A prompt (the logits of its last row only: fewer than half the rows') takes the
    ops; float32 experts (the tiny specs' default) are not recorded (tried once, not
    again)."""
    model = ModelFile.open(write_synthetic_model(tmp_path / "m.gguf", tiny_spec("llama")))
    tf = loaded(model)
    (caches,), positions = prefilled(tf, 1)
    tokens = np.array([11, 12, 13], np.int32)
    prompt = ForwardBatch.single(np.array([11, 12, 13, 14], np.int32), 19, caches[1])
    assert tf.ops.replay(tf, prompt) is None
    assert tf.ops._programs == {}

    for arch in ("qwen3moe", "gpt-oss"):  # float32 experts
        other = loaded(ModelFile.open(write_synthetic_model(
            tmp_path / f"{arch}.gguf", tiny_spec(arch))))
        (caches,), positions = prefilled(other, 1)
        assert other.ops.replay(other, decode_batch(tokens, caches, positions)) is None
        assert other.ops._programs == {(id(other), 3): None}


def test_attention_sinks_replay_with_the_logits_of_the_ops(tmp_path):
    """A layer's attention sinks (one logit per head, in each head's softmax without a
    value) go into the replayed attention items."""
    model = ModelFile.open(write_synthetic_model(tmp_path / "m.gguf",
                                                 tiny_spec("llama", n_layers=2)))
    tf = loaded(model)
    layer = tf.weights.layers[0]
    sinks = np.random.default_rng(4).standard_normal(tf.config.n_heads).astype(np.float32)
    tf.weights.layers[0] = dataclasses.replace(layer, sinks=2 * sinks)
    replayed_against_ops(tf)


@pytest.mark.parametrize("n_threads", [1, 3])
def test_any_number_of_threads_runs_the_whole_table(tmp_path, monkeypatch, n_threads):
    """The steps' chunks are claimed, not assigned: one thread does them all, and three
    threads on two cores neither deadlock nor compute a chunk twice."""
    model = ModelFile.open(write_synthetic_model(tmp_path / "m.gguf", tiny_spec("qwen3")))
    tf = loaded(model)
    (replayed, by_ops), positions = prefilled(tf)
    tokens = np.array([21, 22, 23], np.int32)
    monkeypatch.setattr(cpu_decode_program, "SERIAL_MAX_VALUES", 0)  # always the workers
    monkeypatch.setattr(cpu_decode_program, "core_workers", lambda: CoreWorkers(n_threads))
    got = tf.forward(decode_batch(tokens, replayed, positions))
    want = tf.run(decode_batch(tokens, by_ops, positions), tf.ops)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_more_rows_than_a_row_kernel_takes_run_op_by_op(tmp_path, monkeypatch):
    """A kernel that takes at most 2 rows of x (as the quantized kernels' stack buffers
    bound theirs): a batch of 3 decode rows is not recorded."""
    from eagerlm.kernels import cpu_row_kernel

    model = ModelFile.open(write_synthetic_model(tmp_path / "m.gguf", tiny_spec("llama")))
    tf = loaded(model)
    (caches,), positions = prefilled(tf, 1)
    real = cpu_row_kernel.row_kernel
    monkeypatch.setattr(cpu_decode_program, "row_kernel",
                        lambda w: dataclasses.replace(real(w), max_rows=2))
    tokens = np.array([11, 12, 13], np.int32)
    assert tf.ops.replay(tf, decode_batch(tokens, caches, positions)) is None
    assert tf.ops._programs == {(id(tf), 3): None}


def test_a_step_waits_for_the_steps_before_it_only_where_it_reads_their_output(tmp_path):
    """Q, K and V's products read one input and write three outputs: the threads go on
    from one to the next without waiting; the rope of q waits for its product, the
    attention for the KV append, and the table's last step for everything."""
    model = ModelFile.open(write_synthetic_model(tmp_path / "m.gguf", tiny_spec("llama")))
    tf = loaded(model)
    (replayed,), positions = prefilled(tf, 1)
    tf.forward(decode_batch(np.array([11, 12, 13], np.int32), replayed, positions))
    steps = tf.ops._programs[(id(tf), 3)]._steps
    ops, go_on = list(steps[:, 0]), list(steps[:, cpu_decode_program.GO_ON])
    p = cpu_decode_program
    first = [p.NORM, p.GEMV, p.GEMV, p.GEMV, p.ROPE, p.ROPE, p.APPEND, p.ATTN, p.GEMV]
    assert ops[:9] == first
    assert go_on[:9] == [0, 1, 1, 0, 1, 0, 0, 0, 0]
    assert go_on[-1] == 0


def test_a_row_replayed_alone_is_the_same_bits_as_beside_a_prompt_op_by_op(tmp_path):
    """Batch invariance (docs/architecture.md): a session's decode row replayed in a
    batch of its own and the same row beside another session's prompt rows (a batch the
    replay declines, the prompt's last logits only: run op by op) give the same logits,
    bit for bit, on a quantized model (8-bit activations would turn a last-bit difference
    into a rounding step)."""
    spec = tiny_spec("qwen3", d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512,
                     weight_type=Q.Q8_0)
    tf = loaded(ModelFile.open(write_synthetic_model(tmp_path / "m.gguf", spec)))
    (alone, mixed), positions = prefilled(tf)
    got = tf.forward(decode_batch(np.array([42], np.int32), alone[:1], positions[:1]))
    assert tf.ops._programs[(id(tf), 1)] is not None
    cfg = tf.config
    other = TokenMajorKV(np.zeros((64, *KVLayout(cfg.n_layers, cfg.n_kv_heads,
                                                  cfg.head_dim).token_shape), np.float32))
    batch = ForwardBatch(np.array([42, 7, 8, 9, 10, 11], np.int32),
                         [SeqSlice(0, 1, positions[0], mixed[0]), SeqSlice(1, 5, 0, other)],
                         np.array([0, 5]))  # the prompt's last row's logits
    assert tf.ops.replay(tf, batch) is None
    np.testing.assert_array_equal(got[0], tf.forward(batch)[0])
