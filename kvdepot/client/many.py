"""Several prompts' stores or retrieves in one request (`Store.chains` / `Retrieve.chains`): one
staging region, one gather or scatter launch, one message, one copy call in the daemon and one
reply for all of them. An engine that moves many small requests at once (one chunk of each of
many prompts in a step, 64-token chunks) pays the per-request costs once per batch instead of
once per prompt (`kvdepot.client.transfers.Transfers.submit_store_many`): the items, their
checks and how they join into one request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from kvdepot.client.registration import Registration
from kvdepot.protocol import messages as m
from kvdepot.protocol.errors import ErrorCode, KVDepotError


class StoreItem(NamedTuple):
    """One prompt's run of a `submit_store_many`: ``keys`` in prefix order (at least one),
    ``block_ids[gid]`` the blocks of their tokens in token order, ``parent`` the key of the chunk
    before ``keys[0]`` (empty: the prompt's chunk 0)."""

    keys: Sequence[bytes]
    block_ids: Sequence[Sequence[int]]
    parent: bytes = b""


class RetrieveItem(NamedTuple):
    """One prompt's run of a `submit_retrieve_many`: ``keys`` (at least one), ``block_ids[gid]``
    (-1: leave that block alone), ``skip_tokens`` leading tokens of ``keys[0]`` not written."""

    keys: Sequence[bytes]
    block_ids: Sequence[Sequence[int]]
    skip_tokens: int = 0


def check_chains(reg: Registration, single_run_field) -> None:
    """Whether a request with ``chains`` may go to ``reg``'s daemon.

    Raises:
        KVDepotError: UNSUPPORTED (the daemon takes no chains: `Registration.chains`),
            INVALID_ARGUMENT (the single-run ``parent`` / ``skip_tokens`` given beside them).
    """
    if not reg.chains:
        raise KVDepotError(ErrorCode.UNSUPPORTED, "this daemon takes no Store / Retrieve chains (RegisterReply.chains)")
    if single_run_field:
        raise KVDepotError(ErrorCode.INVALID_ARGUMENT, "with chains, each run's parent / skip_tokens is in its chain")


def join_runs(items: Sequence[StoreItem] | Sequence[RetrieveItem], store: bool):
    """(keys, block_ids per gid, chains) of ``items`` laid end to end.

    Raises:
        KVDepotError(INVALID_ARGUMENT): no items, an item without keys, or items with different
            numbers of KV-cache groups.
    """
    if not items:
        raise KVDepotError(ErrorCode.INVALID_ARGUMENT, "no items")
    groups = len(items[0].block_ids)
    keys: list[bytes] = []
    ids: list[list[int]] = [[] for _ in range(groups)]
    chains: list[m.Chain] = []
    for it in items:
        if not it.keys or len(it.block_ids) != groups:
            raise KVDepotError(ErrorCode.INVALID_ARGUMENT, "every item needs keys and the block ids of every group")
        chains.append(m.Chain(len(keys), it.parent, 0) if store else m.Chain(len(keys), b"", it.skip_tokens))
        keys.extend(it.keys)
        for out, b in zip(ids, it.block_ids):
            out.extend(b)
    return keys, ids, chains


def masked_block_ids(reg: Registration, block_ids: Sequence[Sequence[int]], chains: Sequence[m.Chain],
                     found: Sequence[int], num_chunks: int) -> list[list[int]]:
    """The block ids a staged retrieve with ``chains`` scatters with: -1 (left alone) for the
    blocks of each run's skipped tokens and of its chunks past the ``found[i]`` the daemon
    wrote into the region, so that one scatter over all ``num_chunks`` positions writes exactly
    what was retrieved."""
    tpb = {g.gid: g.tokens_per_block for g in reg.request.groups}
    cs = reg.chunk_size
    ends = [c.start for c in chains[1:]] + [num_chunks]
    out = []
    for gid, ids in enumerate(block_ids):
        t = tpb[gid]
        per = cs // t
        row = list(ids)
        for c, end, k in zip(chains, ends, found):
            a = c.start * per
            row[a:a + c.skip_tokens // t] = [-1] * (c.skip_tokens // t)
            b = (c.start + k) * per
            row[b:end * per] = [-1] * (end * per - b)
        out.append(row)
    return out
