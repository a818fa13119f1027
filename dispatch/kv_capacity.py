"""Sizing the KV page pool and the context together, once, where both are known.

The context the engine announces (`max_model_len`, `Engine.context_length`) is a promise:
a request the server admits may run to it. A session's KV lives in whole pages of one
token-major range, so one session of `n` tokens needs `ceil(n * token_bytes / page_size)`
pages; when the pool holds fewer, a request that runs long fails midway for lack of pages,
which no amount of preemption or prefix-cache eviction can fix. So the rule is:

    context = min(the model's context (or --ctx), the tokens one session can map alone)

Cached prefixes are evicted and newer sessions preempted to make room (dispatch/scheduler),
so "one session alone can reach the context" is the only invariant needed: every admitted
request ends with `stop` or `length`, never for lack of pages.

How big the pool is, on both backends from the same function:
- cuda: `memory_fraction` of the device memory free after the weights (the GPU is the
  engine's; the pool takes what it is given);
- cpu, with `kv_budget_bytes` (--kv-budget-mib): exactly that;
- cpu by default: enough for one full-context session and at least 1 GiB (room for a few
  sessions of a small model), but no more than `memory_fraction` of the host memory
  available now (MemAvailable, or a container's cgroup limit): host pages are committed as
  sessions touch them, so a pool larger than the memory would fail late, in the kernel's
  out-of-memory killer, rather than here.

A context the user asked for (--ctx) that the pool cannot hold is refused (`KVPoolTooSmall`)
naming both numbers and the flag to raise: someone who asked for a length explicitly wants
to hear it is not there. Without --ctx the pool's limit wins quietly but visibly: the
start-up message (`KVCapacity.describe`) says which limit won, with numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagerlm.errors import ContextTooLong, InvalidParameters
from eagerlm.kernels.weight_memory import available_memory
from eagerlm.vmm.device import Device
from eagerlm.vmm.kv_layout import KVLayout

DEFAULT_HOST_POOL_BYTES = 1 << 30  # the cpu pool's floor by default (a few sessions' room)
MIN_SESSION_TOKENS = 2  # a one-token prompt and its reply


class KVPoolTooSmall(ContextTooLong):
    """The KV page pool cannot hold one session of the context asked for (or any session
    at all). A configuration error, raised at start-up."""


def _mib(n_bytes: int) -> int:
    return -(-n_bytes // (1 << 20))


@dataclass(frozen=True)
class KVCapacity:
    """The pool's size and the context it lets one session reach, decided together."""

    n_pages: int
    page_size: int
    token_bytes: int
    model_context: int  # the model's trained context, or --ctx
    context_from: str  # "the model's" or "--ctx"
    sized_by: str  # how the pool's size was chosen, for the messages
    raise_with: str  # what the user changes to make the pool larger

    @property
    def session_tokens(self) -> int:
        """The most tokens one session can map with every page of the pool."""
        return self.n_pages * self.page_size // self.token_bytes

    @property
    def context_length(self) -> int:
        """The context the engine announces and enforces."""
        return min(self.model_context, self.session_tokens)

    @property
    def limited_by_pool(self) -> bool:
        return self.session_tokens < self.model_context

    @property
    def pool_bytes(self) -> int:
        return self.n_pages * self.page_size

    def pages_for(self, n_tokens: int) -> int:
        """Pages one session of `n_tokens` tokens maps (whole pages of one range)."""
        return -(-n_tokens * self.token_bytes // self.page_size)

    def describe(self) -> str:
        """One line for start-up: the context, which limit set it, and how to raise it."""
        pages = f"{self.n_pages} page{'s' if self.n_pages != 1 else ''}"
        pool = (f"the KV pool of {_mib(self.pool_bytes)} MiB ({pages} of "
                f"{self.page_size >> 10} KiB; {self.sized_by}) holds {self.session_tokens} "
                f"tokens for one session")
        if not self.limited_by_pool:
            return f"context {self.context_length} tokens ({self.context_from}); {pool}"
        need = _mib(self.pages_for(self.model_context) * self.page_size)
        return (f"context {self.context_length} tokens, less than {self.context_from} "
                f"{self.model_context}: {pool}; the full context needs {need} MiB: "
                f"{self.raise_with}")


def plan_capacity(device: Device, layout: KVLayout, model_context: int, *,
                  context_requested: bool, kv_budget_bytes: int | None,
                  memory_fraction: float) -> KVCapacity:
    """Size the pool for `device` and check it against the context. `model_context` is
    what the model allows (its trained context, or --ctx when `context_requested`).
    Raises KVPoolTooSmall for a requested context one session cannot reach, or a pool
    that holds no session at all."""
    if not 0.0 < memory_fraction <= 1.0:
        raise InvalidParameters(f"memory_fraction {memory_fraction} is not in (0, 1]")
    ps, tb = device.page_size, layout.token_bytes
    full = -(-model_context * tb // ps) * ps  # one session at the whole context
    if not device.host_accessible:
        free = device.mem_info()[0]
        budget = int(free * memory_fraction)
        sized_by = f"--memory-fraction {memory_fraction:g} of {_mib(free)} MiB free"
        raise_with = "raise --memory-fraction (or free GPU memory)"
    elif kv_budget_bytes is not None:
        budget = kv_budget_bytes
        sized_by = f"--kv-budget-mib {kv_budget_bytes >> 20}"
        raise_with = "raise --kv-budget-mib"
    else:
        budget = max(DEFAULT_HOST_POOL_BYTES, full)
        sized_by = "the default: one full-context session, at least 1 GiB"
        free = available_memory()
        if free is not None and budget > int(free * memory_fraction):
            budget = int(free * memory_fraction)
            sized_by = (f"the default, capped at --memory-fraction {memory_fraction:g} of "
                        f"{_mib(free)} MiB of memory available")
        raise_with = "free memory or set --kv-budget-mib"
    cap = KVCapacity(max(0, budget) // ps, ps, tb, model_context,
                     "--ctx" if context_requested else "the model's", sized_by, raise_with)
    if cap.session_tokens < MIN_SESSION_TOKENS:
        raise KVPoolTooSmall(
            f"the KV pool ({cap.n_pages} pages, {sized_by}) cannot hold a session: one "
            f"token takes {tb} bytes, a page {ps >> 10} KiB; {raise_with}")
    if context_requested and cap.limited_by_pool:
        raise KVPoolTooSmall(
            f"--ctx {model_context} needs {cap.pages_for(model_context)} KV pages "
            f"({_mib(full)} MiB) for one session, but the pool has {cap.n_pages} "
            f"({_mib(cap.pool_bytes)} MiB, {sized_by}), enough for {cap.session_tokens} "
            f"tokens; {raise_with} to at least {_mib(full)} MiB, or lower --ctx to at most "
            f"{cap.session_tokens}")
    return cap
