"""Checks and small pure helpers of STORE / RETRIEVE requests (`kvdepot.server.transfers`): the
runs of a request with ``chains``, ``skip_tokens``, deadlines, settled requests, and the landed
words the DMA stream writes after a staged request's copies."""

from __future__ import annotations

import time

from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, RequestError
from kvdepot.server.registration import Registration


def stored_word(reg: Registration, req: m.Store, copied: int) -> tuple[int, int] | None:
    """A landed store's word (`Store.landed`): (device address, `stored_value`) where every
    chunk of the request is copied and its region is fenced under its own number; else None
    (the reply alone ends the store)."""
    if not req.landed or req.chains or copied != len(req.keys) or req.fence != req.staging_seq:
        return None
    return _landed_word(reg, req.staging_seq, copied, m.stored_value)


def landed_word(reg: Registration, req: m.Retrieve, retrieved: int) -> tuple[int, int] | None:
    """A gated retrieve's landed word (`Retrieve.landed`): (device address, value) for the
    DMA stream to write after its copies, or None (not gated, or the words are not mapped for
    this daemon's GPU: the engine then writes its word itself when the reply comes)."""
    return _landed_word(reg, req.staging_seq, retrieved, m.landed_value) if req.landed else None


def _landed_word(reg: Registration, seq: int, chunks: int, value) -> tuple[int, int] | None:
    """(device address of region ``seq``'s fence word, ``value(seq, chunks)``) for the DMA stream
    to write after its copies; None where the value cannot carry them or the words are not
    mapped for this daemon's GPU."""
    fence = reg.fence
    if not 0 < seq <= m.LANDED_MAX_SEQ or chunks > m.LANDED_MAX_CHUNKS or fence is None or not fence.dev_ptr:
        return None
    return fence.landed_ptr(seq), value(seq, chunks)


def _runs(req, n: int) -> list[tuple[int, int, m.Chain]]:
    """(start, end, chain) of each run of ``req.chains`` over its ``n`` keys.

    Raises:
        RequestError(INVALID_ARGUMENT): the first run does not start at 0, starts do not
            increase, or one lies past the keys.
    """
    chains = req.chains
    starts = [c.start for c in chains]
    if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])) or starts[-1] >= n:
        raise RequestError(ErrorCode.INVALID_ARGUMENT,
                           f"chains must start at 0 with increasing starts below the {n} keys; got starts {starts}")
    ends = starts[1:] + [n]
    return list(zip(starts, ends, chains))


def store_runs(req: m.Store, n: int) -> list[tuple[int, int, bytes]]:
    """(start, end, parent) of each run of a `Store` with ``chains`` (see `_runs`).

    Raises:
        RequestError(INVALID_ARGUMENT): as `_runs`, or ``parent`` given beside ``chains``.
    """
    if req.parent:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "a store with chains gives each run's parent in its chain; "
                                                       "its parent field must be empty")
    return [(s, e, c.parent) for s, e, c in _runs(req, n)]


def check_skip(skip_tokens: int, num_chunks: int, lay) -> None:
    """Raises RequestError(INVALID_ARGUMENT) unless ``skip_tokens`` is a multiple of every
    group's tokens per block and less than the ``num_chunks`` chunks' tokens."""
    if skip_tokens >= num_chunks * lay.chunk_size or any(skip_tokens % t for t in lay.tokens_per_block):
        raise RequestError(ErrorCode.INVALID_ARGUMENT,
                           f"skip_tokens {skip_tokens} must be a multiple of every group's tokens per block "
                           f"{lay.tokens_per_block} and less than {num_chunks * lay.chunk_size}")


def retrieve_runs(req: m.Retrieve, n: int, lay) -> list[tuple[int, int, m.Chain]]:
    """`_runs` of a `Retrieve` with ``chains``, each run's ``skip_tokens`` checked (`check_skip`).

    Raises:
        RequestError(INVALID_ARGUMENT): as `_runs` or `check_skip`, or ``skip_tokens`` given
            beside ``chains``.
    """
    if req.skip_tokens:
        raise RequestError(ErrorCode.INVALID_ARGUMENT, "a retrieve with chains gives each run's skip_tokens in its "
                                                       "chain; its skip_tokens field must be 0")
    runs = _runs(req, n)
    for s, e, c in runs:
        if c.skip_tokens:
            check_skip(c.skip_tokens, e - s, lay)
    return runs


def check_settled(reg: Registration, identity: bytes, rid: int) -> None:
    """Raise INVALID_ARGUMENT for a request its client settled already (`m.Settle`)."""
    if rid <= reg.settled.get(identity, 0):
        raise RequestError(ErrorCode.INVALID_ARGUMENT, f"request {rid} was settled as lost by its client "
                                                       "(`Settle`): nothing copied")


def check_deadline(deadline_ns: int, op: str) -> None:
    """Raise DEADLINE once ``CLOCK_MONOTONIC`` passed ``deadline_ns`` (`Store.deadline_ns`)."""
    late_ns = time.monotonic_ns() - deadline_ns
    if late_ns >= 0:
        raise RequestError(ErrorCode.DEADLINE, f"the {op}'s deadline passed {late_ns / 1e6:.1f} ms before its copy "
                                               "began; the engine may have reused its blocks, nothing was copied")


def stalled(stall_s: float, fn, *args):
    time.sleep(stall_s)
    return fn(*args)
