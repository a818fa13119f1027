"""First-use compilation of the cpu kernels (kernels/cpu_compile.py,
kernels/cpu_kernel_registry.py): only the file's types, cached on disk, split with a
helper process on a cold cache. Each check runs in a fresh process with its own empty
NUMBA_CACHE_DIR, as a new install would."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from eagerlm.kernels import cpu_compile
from eagerlm.loader.synthetic import tiny_spec, write_synthetic_model

Q = GGMLQuantizationType


def run(code: str, cache_dir, *args: str) -> dict:
    """`code` in a new process with NUMBA_CACHE_DIR=`cache_dir`; its last line of output,
    as JSON."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    out = subprocess.run([sys.executable, "-c", code, *args], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


_LOAD_A_MODEL = """
import json, sys
from eagerlm.kernels import cpu_kernel_registry
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.loader.model_file import ModelFile
cpu_transformer(ModelFile.open(sys.argv[1]))
generated = [n for n in sys.modules if n.startswith("eagerlm_kernels_")]
print(json.dumps({"built": sorted(q.name for q in cpu_kernel_registry._built),
                  "generated": generated}))
"""


@pytest.mark.slow
def test_a_file_of_one_type_compiles_no_other_types_kernels(tmp_path):
    """A fresh process loading a Q4_0 model (norms F32) builds the Q4_0 kernels and no
    other type's: no other type's module is even generated."""
    spec = tiny_spec("llama", d_model=64, weight_type=Q.Q4_0)
    path = write_synthetic_model(tmp_path / "q4_0.gguf", spec)
    result = run(_LOAD_A_MODEL, tmp_path / "cache", str(path))
    assert result["built"] == ["Q4_0"]
    assert len(result["generated"]) == 1 and "q4_0" in result["generated"][0]


_COMPILE = """
import json, sys
from gguf import GGMLQuantizationType as Q
from eagerlm.kernels import cpu_compile
types = [Q[n] for n in sys.argv[1].split(",")]
if sys.argv[2] == "no helper":
    cpu_compile._helper_share = lambda cold, head_start: []
cpu_compile.compile_kernels(types)
cpu_compile.cpu_decode_program.TABLE_READY.wait(600)  # the replay's table, if compiled after
stats = {g.name: [[len(f.stats.cache_hits), len(f.stats.cache_misses)]
                  for f in g.dispatchers()] for g in cpu_compile._groups(types)}
print(json.dumps(stats))
"""


@pytest.mark.slow
def test_the_kernels_load_from_numbas_disk_cache_in_a_new_process(tmp_path):
    """The generated modules keep numba's cache working: in an empty cache the first
    process compiles every kernel once (a miss each; the decode replay's table, compiled
    by the helper in the background, it loads: hits only), the second loads every one
    (hits only)."""
    first = run(_COMPILE, tmp_path, "Q8_0,IQ4_XS", "no helper")
    second = run(_COMPILE, tmp_path, "Q8_0,IQ4_XS", "no helper")
    assert set(first) == {"row_ops", "attention", "activations", "replay", "Q8_0", "IQ4_XS"}
    assert first.pop("replay") == [[1, 0]]
    assert all(misses == 1 and hits == 0 for g in first.values() for hits, misses in g)
    assert all(misses == 0 and hits == 1 for g in second.values() for hits, misses in g)


@pytest.mark.slow
def test_a_cold_cache_is_filled_by_a_helper_process_and_this_one_together(tmp_path):
    """On a cold cache with two cores or more, the helper's groups load from the cache
    in this process (hits only), the others compile here (a miss each: nothing compiles
    in both processes)."""
    stats = run(_COMPILE, tmp_path, "Q8_0,Q6_K,Q4_K", "helper")
    if cpu_compile.core_count() == 1:
        pytest.skip("one core: no helper")
    # (the replay's table the helper compiles last, after its share: it calls the row ops
    # and the attention rows)
    cold = [cpu_compile._Group(name, lambda: None, lambda: []) for name in stats
            if name != "replay"]
    helper = {g.name for g in cpu_compile._helper_share(cold)} | {"replay"}
    assert helper and helper != set(stats)
    for name, kernels in stats.items():
        if name in helper:
            assert all(misses == 0 and hits == 1 for hits, misses in kernels), name
        else:
            assert all(misses == 1 and hits == 0 for hits, misses in kernels), name


def test_the_helpers_share_balances_the_compile_times():
    """The larger groups first, each where it would finish sooner, the helper starting
    `_HELPER_START_SECONDS` late; nothing for a helper when little is cold."""
    def group(name: str):
        return cpu_compile._Group(name, lambda: None, lambda: [])
    cold = [group(n) for n in ("row_ops", "attention", "activations", "Q8_0", "Q5_0", "Q4_K",
                               "Q6_K")]
    share = cpu_compile._helper_share(cold)
    mine = sum(g.seconds for g in cold if g not in share)
    theirs = cpu_compile._HELPER_START_SECONDS + sum(g.seconds for g in share)
    assert share and abs(mine - theirs) <= max(g.seconds for g in cold)
    assert cpu_compile._helper_share([group("Q8_0")]) == []
    # this process busy for a while first (loading the weights): the helper takes more,
    # and everything when that outlasts the whole compile
    late = cpu_compile._helper_share(cold, head_start=2.0)
    late_mine = 2.0 + sum(g.seconds for g in cold if g not in late)
    late_theirs = cpu_compile._HELPER_START_SECONDS + sum(g.seconds for g in late)
    assert sum(g.seconds for g in late) > sum(g.seconds for g in share)
    assert abs(late_mine - late_theirs) <= max(g.seconds for g in cold)
    assert set(cpu_compile._helper_share(cold, head_start=60.0)) == set(cold)


_FORWARD_AFTER_LOAD = """
import json, sys
import numpy as np
from eagerlm.kernels import cpu_decode_program
from eagerlm.kernels.batch import ForwardBatch, SeqSlice
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.kv_layout import KVLayout, TokenMajorKV
tf = cpu_transformer(ModelFile.open(sys.argv[1]))
ready_at_load = cpu_decode_program.TABLE_READY.is_set()
table_at_load = len(cpu_decode_program._run.signatures)
cfg = tf.config
layout = KVLayout(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim)
copies = [[], []]
for n in (5, 9, 14):  # three sessions' prompts, into two identical sets of caches
    for caches in copies:
        kv = TokenMajorKV(np.zeros((32, *layout.token_shape), np.float32))
        tf.forward(ForwardBatch.single(np.arange(10, 10 + n, dtype=np.int32), 0, kv))
        caches.append(kv)
def step(caches):
    return tf.forward(ForwardBatch(np.array([3, 4, 5], np.int32),
                                   [SeqSlice(i, 1, p, kv) for i, (kv, p) in
                                    enumerate(zip(caches, (5, 9, 14)))], np.arange(3)))
ready_at_first = cpu_decode_program.TABLE_READY.is_set()
first = step(copies[0])
replayed_first = tf.ops._programs.get((id(tf), 3)) is not None
cpu_decode_program.TABLE_READY.wait(600)
later = step(copies[1])
print(json.dumps({"ready_at_load": ready_at_load, "table_at_load": table_at_load,
                  "ready_at_first": ready_at_first, "replayed_first": replayed_first,
                  "replayed_later": tf.ops._programs.get((id(tf), 3)) is not None,
                  "table_stats": [len(cpu_decode_program._run.stats.cache_hits),
                                  len(cpu_decode_program._run.stats.cache_misses)],
                  "first": first.tolist(), "later": later.tolist()}))
"""


@pytest.mark.slow
def test_a_cold_load_does_not_wait_for_the_replays_table_and_the_forward_switches_to_it(
        tmp_path):
    """With an empty cache the load returns before the decode replay's table is compiled
    (the helper compiles it in the background): a decode step right after the load runs op
    by op, and gives the logits the replay gives once the table is loaded from the cache
    the helper wrote (this process compiles it not at all: cache hits only). With the
    table cached, the load loads it as before and the first decode step is replayed."""
    path = write_synthetic_model(tmp_path / "m.gguf", tiny_spec("llama", n_layers=2))
    cold = run(_FORWARD_AFTER_LOAD, tmp_path / "cache", str(path))
    assert not cold["ready_at_load"] and cold["table_at_load"] == 0
    assert not cold["ready_at_first"] and not cold["replayed_first"]
    assert cold["replayed_later"] and cold["table_stats"] == [1, 0]
    first, later = np.array(cold["first"]), np.array(cold["later"])
    # the replay test's tolerance (tests/test_cpu_decode_program.py)
    np.testing.assert_allclose(later, first, rtol=1e-4, atol=1e-4 * np.abs(first).max())
    np.testing.assert_array_equal(later.argmax(axis=1), first.argmax(axis=1))

    warm = run(_FORWARD_AFTER_LOAD, tmp_path / "cache", str(path))
    assert warm["ready_at_load"] and warm["table_at_load"] == 1
    assert warm["replayed_first"] and warm["table_stats"] == [1, 0]
    np.testing.assert_allclose(np.array(warm["first"]), first, rtol=1e-4,
                               atol=1e-4 * np.abs(first).max())
