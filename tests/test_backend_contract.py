"""Both backends satisfy kernels/backend.py's contract: every member of `Backend` (the
forward's `Ops`, the dispatcher's `RoundBackend`, the single-session extras) is there on
NumpyOps and on CudaOps, with the Protocol's parameters (names, kinds, which have
defaults), and the data members (`kv_dtype`, `stream`, `name`) hold what they promise.
The checker itself is shown to catch a removed or renamed member."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import pytest

from eagerlm.kernels.backend import Backend, DecodeRounds, RoundBackend
from eagerlm.kernels.model import Ops
from eagerlm.kernels.numpy_ops import NumpyOps

if TYPE_CHECKING:  # what a static type checker holds the two classes to
    from eagerlm.kernels.cuda_graphs import DecodeGraphs
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.device_tensor import DeviceTensor

    def _static(cuda: CudaOps, graphs: DecodeGraphs) -> None:
        _cpu: Backend[np.ndarray] = NumpyOps()
        _gpu: Backend[DeviceTensor] = cuda
        _rounds: DecodeRounds = graphs


def protocol_members(proto: type) -> tuple[dict[str, Any], set[str]]:
    """A Protocol's methods (name -> function) and data members (annotated names), over
    the Protocols it extends."""
    methods: dict[str, Any] = {}
    data: set[str] = set()
    for klass in reversed(proto.__mro__):
        if klass in (object, Protocol) or not getattr(klass, "_is_protocol", False):
            continue
        data |= {n for n in inspect.get_annotations(klass) if not n.startswith("_")}
        methods.update({n: f for n, f in vars(klass).items()
                        if inspect.isfunction(f) and not n.startswith("_")})
    return methods, data


def _shape(fn: Any) -> list[tuple[str, Any, bool]]:
    """(name, kind, has a default) per parameter: what a caller by keyword relies on."""
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty)
            for p in inspect.signature(fn).parameters.values()]


def contract_breaches(backend: object, proto: type = Backend) -> list[str]:
    """Each way `backend` (an instance) falls short of `proto`; empty when it satisfies it."""
    methods, data = protocol_members(proto)
    breaches = [f"no data member {name!r}" for name in sorted(data)
                if not hasattr(backend, name)]
    for name, fn in sorted(methods.items()):
        impl = getattr(type(backend), name, None)
        if impl is None or not callable(impl):
            breaches.append(f"no method {name!r}")
        elif _shape(impl) != _shape(fn):
            breaches.append(f"{name}{inspect.signature(impl)} is not the Protocol's "
                            f"{name}{inspect.signature(fn)}")
    return breaches


def test_the_contract_is_the_forwards_ops_and_the_rounds_duties() -> None:
    methods, data = protocol_members(Backend)
    assert set(protocol_members(Ops)[0]) < set(methods)
    assert {"round_inputs", "sample_round", "token_counts", "count_inputs", "logit_bias",
            "session_kv", "decode_graphs", "spec_prepare", "spec_accept", "spec_positions",
            "draft_inputs", "draft_propose", "round_cost", "broadcast_tokens",
            "broadcast_round"} == set(
        protocol_members(RoundBackend)[0])
    assert {"kv_dtype", "stream"} == protocol_members(RoundBackend)[1]
    assert {"contiguous_kv", "to_numpy"} <= set(methods) and "name" in data


def test_numpy_ops_satisfies_the_backend_contract() -> None:
    ops = NumpyOps()
    assert contract_breaches(ops) == []
    assert isinstance(ops, Backend) and isinstance(ops, RoundBackend)
    assert ops.stream is None  # computes when called: the dispatcher brings the stream
    assert ops.decode_graphs(None, None, max_batch=1, max_context=1, layout=None) is None
    assert ops.kv_dtype == np.float32 and ops.name == "cpu"


def test_cuda_ops_satisfies_the_backend_contract() -> None:
    from eagerlm.kernels.cuda_graphs import DecodeGraphs
    from eagerlm.kernels.cuda_ops import CudaOps
    from eagerlm.kernels.device_tensor import KV_DTYPE
    from eagerlm.vmm.device import Stream, open_device
    from tests.emulated_gpu.gpu_emulator import emulated_gpu_for_test

    with emulated_gpu_for_test():
        device = open_device("cuda")
        ops = CudaOps(device)
        try:
            assert contract_breaches(ops) == []
            assert isinstance(ops, Backend) and isinstance(ops, RoundBackend)
            assert isinstance(ops.stream, Stream)  # the rounds' compute stream
            assert ops.kv_dtype == KV_DTYPE and ops.name == "cuda"
        finally:
            ops.close()
            device.close()
    methods, _ = protocol_members(DecodeRounds)
    assert all(_shape(getattr(DecodeGraphs, n)) == _shape(f) for n, f in methods.items())


def _without(name: str, **replace: Any) -> object:
    """A NumpyOps-like instance with `name` removed and `replace` added."""
    attrs = {k: v for klass in reversed(NumpyOps.__mro__) for k, v in vars(klass).items()
             if not k.startswith("__")}
    attrs.pop(name)
    attrs.update(replace)
    return type("Broken", (), attrs)()


@pytest.mark.parametrize("name", ["sample_round", "decode_graphs", "stream", "kv_dtype",
                                  "attention", "to_numpy"])
def test_a_backend_missing_a_member_is_caught(name: str) -> None:
    assert contract_breaches(_without(name))


def test_a_renamed_or_reshaped_parameter_is_caught() -> None:
    def sample_round(self, logits, params, positions, counts, biases, *, out, token_buf,
                     slots, logprobs_out=None):  # out_slots renamed
        pass

    def logit_bias(self, params, vocab, extra):  # one parameter more
        pass

    def count_inputs(self, tokens, spans=()):  # a default the Protocol does not have
        pass

    for name, fn in [("sample_round", sample_round), ("logit_bias", logit_bias),
                     ("count_inputs", count_inputs)]:
        (breach,) = contract_breaches(_without(name, **{name: fn}))
        assert breach.startswith(name)
