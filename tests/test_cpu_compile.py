"""First-use compilation of the cpu kernels (kernels/cpu_compile.py,
kernels/cpu_kernel_registry.py): only the file's types, cached on disk, split with a
helper process on a cold cache. Each check runs in a fresh process with its own empty
NUMBA_CACHE_DIR, as a new install would."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from eagerlm.kernels import cpu_compile, quantized
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
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.F32], ids=lambda q: q.name)
def test_a_file_of_one_type_compiles_no_other_types_kernels(tmp_path, qtype):
    """A fresh process loading a model of Q4_0 (or F32) matrices, its norms F32 vectors,
    builds that type's kernels and no other type's: no other type's module is even
    generated (F32's are its float loops, kernels/cpu_kernel_registry.py's `FLOAT32`)."""
    spec = tiny_spec("llama", d_model=64, weight_type=qtype)
    path = write_synthetic_model(tmp_path / "model.gguf", spec)
    result = run(_LOAD_A_MODEL, tmp_path / "cache", str(path))
    assert result["built"] == [qtype.name]
    assert len(result["generated"]) == 1 and qtype.name.lower() in result["generated"][0]


_LOAD_AND_RUN = """
import json, sys
import numpy as np
from eagerlm.kernels import cpu_kernel_registry
from eagerlm.kernels.batch import ForwardBatch
from eagerlm.kernels.cpu_backend import cpu_transformer
from eagerlm.loader.model_file import ModelFile
from eagerlm.vmm.kv_layout import KVLayout, TokenMajorKV
from eagerlm.kernels import quantized
quantized.PROMPT_RUNS = sys.argv[2] == "runs"
quantized.PROMPT_PANELS = quantized.SIGNED_PANELS = sys.argv[2] == "panels"
def compiled():
    kernels = {q.name: {name: len(getattr(cpu_kernel_registry.kernels(q), name).signatures)
                        for name in ("gemv", "dequant", "pack_panels", "panel_product")}
               for q in cpu_kernel_registry._built}
    return kernels
tf = cpu_transformer(ModelFile.open(sys.argv[1]))
loaded = compiled()
quantized.PANELS_READY.wait(600)  # (on a cold cache compiled after the load)
at_load = compiled()
cfg = tf.config
kv = TokenMajorKV(np.zeros((64, *KVLayout(cfg.n_layers, cfg.n_kv_heads,
                                          cfg.head_dim).token_shape), np.float32))
tf.forward(ForwardBatch.single(np.arange(1, 41, dtype=np.int32), 0, kv))  # a prompt
tf.forward(ForwardBatch.single(np.array([7], np.int32), 40, kv))  # a decode step
print(json.dumps({"loaded": loaded, "at_load": at_load, "after": compiled()}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("prompts", ["runs", "tiles", "panels"])
def test_a_load_compiles_only_the_prompt_path_it_takes(tmp_path, prompts):
    """Prompts take one of three paths, by machine: `gemv` in runs of rows
    (`quantized.PROMPT_RUNS`: machines without AVX-512, for the superblock types), 8-bit
    panels (`quantized.PROMPT_PANELS`: 512-bit VNNI) or float32 tiles (the rest). A load
    of a Q4_K model on a cold cache compiles Q4_K's `dequant` except for the runs (the
    panels' prompts take the tiles until their kernels are ready), and returns before the
    panels' kernels (both types' `pack_panels` and `panel_product`), which the
    helper compiles after it and this process then loads. Its Q8_0 embedding table is
    looked up by `dequant` whatever the path. A prompt and a decode step then compile
    nothing more: the load compiled what a forward runs."""
    spec = tiny_spec("llama", d_model=256, head_dim=64, d_ff=512, weight_type=Q.Q4_K,
                     embedding_type=Q.Q8_0)
    path = write_synthetic_model(tmp_path / "q4_k.gguf", spec)
    result = run(_LOAD_AND_RUN, tmp_path / "cache", str(path), prompts)
    panels = int(prompts == "panels")
    assert result["loaded"] == {
        "Q4_K": {"gemv": 1, "dequant": int(prompts != "runs"), "pack_panels": 0,
                 "panel_product": 0},
        "Q8_0": {"gemv": 1, "dequant": 1, "pack_panels": 0, "panel_product": 0}}
    assert result["at_load"] == {
        "Q4_K": {"gemv": 1, "dequant": int(prompts != "runs"), "pack_panels": panels,
                 "panel_product": panels},
        "Q8_0": {"gemv": 1, "dequant": 1, "pack_panels": panels, "panel_product": panels}}
    assert result["after"] == result["at_load"]


_COMPILE = """
import json, sys
from gguf import GGMLQuantizationType as Q
from eagerlm.kernels import cpu_compile, quantized
types = [Q[n] for n in sys.argv[1].split(",")]
if sys.argv[2] == "no helper":
    cpu_compile.core_count = lambda: 1
if sys.argv[2] == "a helper that fails":
    cpu_compile.sys.executable = "/bin/false"
compiling = cpu_compile.start_compile(types)
compiling.finish()
if sys.argv[2] != "a helper that fails":  # the replay's and the panels', if compiled after
    cpu_compile.cpu_decode_program.TABLE_READY.wait(600)
    quantized.PANELS_READY.wait(600)
stats = {g.name: [[len(f.stats.cache_hits), len(f.stats.cache_misses)]
                  for f in g.dispatchers()] for g in cpu_compile._groups(types)}
helper = compiling.helper
print(json.dumps({"stats": stats, "helper": [g.name for g in helper.taken] if helper else None}))
"""


@pytest.mark.slow
def test_the_kernels_load_from_numbas_disk_cache_in_a_new_process(tmp_path):
    """The generated modules keep numba's cache working: in an empty cache the first
    process compiles every kernel once (a miss each; the decode replay's table and the
    prompts' panels, compiled by the helper in the background, it loads: hits only), the
    second loads every one (hits only)."""
    first = run(_COMPILE, tmp_path, "Q8_0,IQ4_XS", "no helper")["stats"]
    second = run(_COMPILE, tmp_path, "Q8_0,IQ4_XS", "no helper")["stats"]
    # (this machine's prompt path, as the process's)
    panels = {q.name + ".panels" for q in quantized.panel_types([Q.Q8_0, Q.IQ4_XS])}
    assert set(first) == {"row_ops", "attention", "activations", "replay", "Q8_0", "IQ4_XS",
                          "Q8_0.dequant", "IQ4_XS.dequant", *panels}
    for later in ("replay", *panels):
        assert all(f == [1, 0] for f in first.pop(later)), later
    assert all(misses == 1 and hits == 0 for g in first.values() for hits, misses in g)
    assert all(misses == 0 and hits == 1 for g in second.values() for hits, misses in g)


@pytest.mark.slow
def test_a_cold_cache_is_filled_by_a_helper_process_and_this_one_together(tmp_path):
    """On a cold cache with two cores or more, the groups the helper took load from the
    cache in this process (hits only), the others compile here (a miss each: nothing
    compiles in both processes), and each side took some."""
    if cpu_compile.core_count() == 1:
        pytest.skip("one core: no helper")
    result = run(_COMPILE, tmp_path, "Q8_0,Q6_K,Q4_K", "helper")
    stats = result["stats"]
    # (the replay's table the helper compiles last, after the load: it calls the row ops
    # and the attention rows)
    helper = {*result["helper"], "replay"}
    helper |= {q.name + ".panels" for q in quantized.panel_types([Q.Q8_0, Q.Q6_K, Q.Q4_K])}
    assert len(helper) > 1 and helper != set(stats)
    for name, kernels in stats.items():
        if name in helper:
            assert all(misses == 0 and hits == 1 for hits, misses in kernels), name
        else:
            assert all(misses == 1 and hits == 0 for hits, misses in kernels), name


@pytest.mark.slow
def test_a_helper_that_fails_leaves_its_groups_to_this_process(tmp_path):
    """A helper that exits at once (here not even Python) reports nothing: the group it
    was given and every other compile in this process (a miss each), and the load
    completes."""
    if cpu_compile.core_count() == 1:
        pytest.skip("one core: no helper")
    result = run(_COMPILE, tmp_path, "Q8_0,Q4_K", "a helper that fails")
    stats = result["stats"]
    assert result["helper"]  # it was given a group before it was found to have failed
    assert stats.pop("replay") == [[0, 0]]  # left to the next load: op by op meanwhile
    for name in [n for n in stats if n.endswith(".panels")]:
        assert all(f == [0, 0] for f in stats.pop(name)), name  # likewise: the tiles meanwhile
    assert all(misses == 1 and hits == 0 for g in stats.values() for hits, misses in g)


def test_cold_groups_are_taken_larger_first_each_once_by_whoever_is_free():
    """The order the two processes take the cold groups in (`_Claims`): the larger
    first, so that the last to finish is short; from two threads at once, each once."""
    def group(name: str):
        return cpu_compile._Group(name, lambda: None, lambda: [])
    names = ("Q8_0.dequant", "row_ops", "Q8_0", "attention", "activations", "Q4_K")
    claims = cpu_compile._Claims(group(n) for n in names)
    first = [claims.claim().name for _ in range(3)]
    assert first == ["attention", "row_ops", "Q8_0"]
    taken: list[str] = []

    def take() -> None:
        while (g := claims.claim()) is not None:
            taken.append(g.name)
    threads = [threading.Thread(target=take) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(taken) == sorted(["Q4_K", "activations", "Q8_0.dequant"])
    assert claims.claim() is None


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


def test_another_versions_module_of_a_type_leaves_this_ones_compilable(tmp_path, monkeypatch):
    """Two versions of the engine sharing one cache (two installs, a server started
    before an upgrade) generate two modules of a type. The newer must not remove the
    older's: the process running it still compiles from it (here the decode replay's
    row kernel, compiled on first use), and numba cannot cache a function whose source
    file is gone."""
    import dataclasses

    import numba

    from eagerlm.kernels import cpu_kernel_registry as registry
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path))
    block_type = registry.BLOCK_TYPES[GGMLQuantizationType.Q8_0]
    running = registry._import(block_type)
    registry._import(dataclasses.replace(block_type,
                                         binding=block_type.binding + "# a newer version\n"))
    assert len(list((tmp_path / "eagerlm_kernels").glob("q8_0_*.py"))) == 2
    assert running.row_kernel_address() > 0


def test_the_default_cache_folder_is_named_for_the_kernel_sources(tmp_path):
    """numba checks a cached kernel against its own file's time stamp only, so a kernel
    that inlines a function of another module (the decode replay's table inlines the row
    ops and the routing) kept its old code once that module changed: an editable install
    updated in place computed with it. Without NUMBA_CACHE_DIR, the cache folder is named
    for a digest of every kernel module and loader/config.py, which any change moves."""
    from eagerlm.kernels import numba_settings

    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    folder = subprocess.run(
        [sys.executable, "-c", "import numba, eagerlm.kernels.numba_settings; "
                               "print(numba.config.CACHE_DIR)"],
        env=env, check=True, capture_output=True, text=True).stdout.strip()
    digest = numba_settings.source_digest(numba_settings._SOURCES)
    assert os.path.basename(folder) == f"numba-{digest}"
    assert any(p.endswith("cpu_decode_program.py") for p in numba_settings._SOURCES)
    files = [tmp_path / "a.py", tmp_path / "b.py"]
    for f in files:
        f.write_text("x = 1\n")
    before = numba_settings.source_digest(map(str, files))
    files[1].write_text("x = 2\n")
    assert numba_settings.source_digest(map(str, files)) != before
