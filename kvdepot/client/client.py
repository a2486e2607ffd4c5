"""The engine's client of the kvdepot daemon: `KVDepotClient`, a connection
(`kvdepot.client.connection.Connection`) and what is built on it: registrations
(`kvdepot.client.registration.Registrar`), stores and retrieves
(`kvdepot.client.transfers.Transfers`) and their engine-side staging
(`kvdepot.client.staged.Stager`).

Blocking calls (`store`, `retrieve`, `lookup`, ...) raise `KVDepotError` for an error reply and
TIMEOUT for a reply that does not come within ``timeout_s``. The ``submit_*`` forms return a
pending handle at once (`kvdepot.client.pending`); an engine whose step must never wait on the
daemon (the vLLM connector) uses them with the connection's `poll`, `available` and
`mark_down` (see `kvdepot.client.connection`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvdepot.client.connection import Connection
from kvdepot.client.many import RetrieveItem, StoreItem
from kvdepot.client.pending import PendingRetrieve, PendingStore
from kvdepot.client.registrar import Registrar
from kvdepot.client.registration import Registration
from kvdepot.client.staged import Stager
from kvdepot.client.transfers import Transfers
from kvdepot.protocol import messages as m


class KVDepotClient:
    """An engine's client: one connection, its registrations, stores and retrieves.

    Args:
        endpoint: daemon address (default `kvdepot.protocol.transport.default_endpoint()`).
        timeout_s: per-request reply timeout.
        name: client name shown in daemon logs.
        spin_us: a wait polls for its reply without sleeping for this long first (see
            `Connection`). 0 = sleep at once.
        connect: say hello to the daemon now (raises if it does not answer); False: on first
            use, so a client can be made while the daemon is down.
        retry_interval_s: after `mark_down`, `available` pings the daemon at most this often.
        copy_deadline_s: unstaged stores and retrieves of CPU engines carry a deadline this far
            after their send (default ``timeout_s``; see `Transfers`).

    Attributes:
        conn: the `Connection` (socket, request ids, replies, liveness).
        registrar, transfers, stager: the parts built on it; the methods below forward to them.

    Raises:
        KVDepotError: with ``connect``: UNAVAILABLE (no daemon at an ``ipc://`` endpoint),
            TIMEOUT, VERSION_MISMATCH.
    """

    def __init__(self, endpoint: str | None = None, timeout_s: float = 10.0, name: str = "",
                 spin_us: float = 200.0, connect: bool = True, retry_interval_s: float = 1.0,
                 copy_deadline_s: float | None = None) -> None:
        self.conn = Connection(endpoint, timeout_s, name, spin_us, connect, retry_interval_s)
        self.registrar = Registrar(self.conn)
        self.stager = Stager(self.conn)
        self.transfers = Transfers(self.conn, self.stager, timeout_s if copy_deadline_s is None else copy_deadline_s)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> KVDepotClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ registrations

    def register(self, model: str, shard: str, chunk_size: int, storages: list[m.StorageSpec],
                 layers: list[m.LayerSpec], groups: list[m.KVGroupSpec], device: str = "cpu",
                 local_storages: Sequence | None = None, staging_bytes: int | None = None,
                 storage_fds: Sequence[int | None] | None = None, load_staging_bytes: int = 0) -> Registration:
        """`Registrar.register`."""
        return self.registrar.register(model, shard, chunk_size, storages, layers, groups, device, local_storages,
                                       staging_bytes, storage_fds, load_staging_bytes)

    def reregister(self, reg: Registration) -> Registration:
        """`Registrar.reregister` (after a daemon restart: ``generation`` changed)."""
        return self.registrar.reregister(reg)

    def unregister(self, reg: Registration) -> None:
        """`Registrar.unregister`."""
        self.registrar.unregister(reg)

    # ------------------------------------------------------------------ stores and retrieves

    def store(self, reg: Registration, keys: Sequence[bytes], block_ids: Sequence[Sequence[int]],
              parent: bytes = b"", cache_salt: str = "", request: str = "", after=None,
              early: bool = False, cpu_wait: bool = False, in_l1: bool = False) -> m.StoreReply:
        """`Transfers.store`."""
        return self.transfers.store(reg, keys, block_ids, parent, cache_salt, request, after, early, cpu_wait, in_l1)

    def submit_store(self, reg: Registration, keys: Sequence[bytes], block_ids: Sequence[Sequence[int]],
                     parent: bytes = b"", cache_salt: str = "", request: str = "", after=None,
                     early: bool = False, wait_for_room: bool = True, staged=None,
                     chains: Sequence[m.Chain] = ()) -> PendingStore | None:
        """`Transfers.submit_store`."""
        return self.transfers.submit_store(reg, keys, block_ids, parent, cache_salt, request, after, early,
                                           wait_for_room, staged, chains)

    def retrieve(self, reg: Registration, keys: Sequence[bytes], block_ids: Sequence[Sequence[int]],
                 skip_tokens: int = 0, request: str = "", before=None, cpu_wait: bool = False) -> int:
        """`Transfers.retrieve`."""
        return self.transfers.retrieve(reg, keys, block_ids, skip_tokens, request, before, cpu_wait)

    def submit_retrieve(self, reg: Registration, keys: Sequence[bytes], block_ids: Sequence[Sequence[int]],
                        skip_tokens: int = 0, request: str = "", wait_for_room: bool = True,
                        chains: Sequence[m.Chain] = (), scatter_on=None) -> PendingRetrieve | None:
        """`Transfers.submit_retrieve`."""
        return self.transfers.submit_retrieve(reg, keys, block_ids, skip_tokens, request, wait_for_room, chains,
                                              scatter_on)

    def submit_store_many(self, reg: Registration, items: Sequence[StoreItem], cache_salt: str = "",
                          request: str = "", after=None, wait_for_room: bool = True,
                          staged=None) -> PendingStore | None:
        """`Transfers.submit_store_many`."""
        return self.transfers.submit_store_many(reg, items, cache_salt, request, after, wait_for_room, staged)

    def store_many(self, reg: Registration, items: Sequence[StoreItem], cache_salt: str = "",
                   after=None) -> m.StoreReply:
        """`Transfers.store_many`."""
        return self.transfers.store_many(reg, items, cache_salt, after)

    def submit_retrieve_many(self, reg: Registration, items: Sequence[RetrieveItem], request: str = "",
                             wait_for_room: bool = True) -> PendingRetrieve | None:
        """`Transfers.submit_retrieve_many`."""
        return self.transfers.submit_retrieve_many(reg, items, request, wait_for_room)

    def retrieve_many(self, reg: Registration, items: Sequence[RetrieveItem], before=None) -> list[int]:
        """`Transfers.retrieve_many`."""
        return self.transfers.retrieve_many(reg, items, before)

    def stage_store(self, reg: Registration, block_ids: Sequence[Sequence[int]], num_chunks: int,
                    after=None, wait_for_room: bool = True):
        """`Stager.stage_store`."""
        return self.stager.stage_store(reg, block_ids, num_chunks, after, wait_for_room)

    def stage_store_pieces(self, reg: Registration, block_ids: Sequence[Sequence[int]], piece_chunks: Sequence[int],
                           after) -> list | None:
        """`Stager.stage_store_pieces`."""
        return self.stager.stage_store_pieces(reg, block_ids, piece_chunks, after)

    abandon_region = staticmethod(Stager.abandon_region)

    @property
    def last_retrieve_event(self):
        """A ``torch.cuda.Event`` after the scatter of the last retrieve whose ``result`` ran
        (engine-side staging), for another stream or the host to wait on; None if it wrote
        nothing (or the retrieve was not staged: its reply came once the blocks were written).
        With fence words the scatter records no event (its region frees by its fence word): the
        event is recorded here, when first read, on the stream the scatter was enqueued on, so
        it covers the scatter and whatever that stream had before this read."""
        return self.conn.last_scatter.event()

    @property
    def unstaged_requests(self) -> int:
        """Staged registrations' stores / retrieves that went the daemon-gathers way (no ring room)."""
        return self.transfers.unstaged_requests

    # ------------------------------------------------------------------ other requests

    def lookup(self, keys: Sequence[Sequence[bytes]] | Sequence[bytes], chunk_size: int, num_tokens: int = 0,
               model: str = "", pin_request: str = "") -> int:
        """Leading chunks cached for every shard. ``keys`` is one chain, or one chain per shard."""
        if keys and isinstance(keys[0], bytes):
            keys = [keys]
        r = self.conn.call(m.Lookup(rid=0, keys=[list(k) for k in keys], chunk_size=chunk_size,
                                    num_tokens=num_tokens, model=model, pin_request=pin_request))
        return r.hit_chunks

    def end_request(self, request: str) -> None:
        self.conn.call(m.EndRequest(rid=0, request=request))

    def describe(self) -> m.DaemonInfo:
        return self.conn.call(m.Describe(rid=0)).info

    def flush(self, model: str = "", cache_salt: str | None = None, tier: str = "") -> m.FlushReply:
        return self.conn.call(m.Flush(rid=0, model=model, cache_salt=cache_salt, tier=tier))

    def hello(self) -> m.HelloReply:
        return self.conn.hello()

    def ping(self) -> str:
        """The daemon's boot id (a new one means the daemon restarted)."""
        return self.conn.ping()

    # ------------------------------------------------------------------ the connection's

    def call(self, req: m.Msg, timeout_s: float | None = None) -> m.Msg:
        """`Connection.call`."""
        return self.conn.call(req, timeout_s)

    def submit(self, req: m.Msg, on_reply: Callable[[m.Msg], None] | None = None) -> int:
        """`Connection.submit`."""
        return self.conn.submit(req, on_reply)

    def wait(self, rid: int, timeout_s: float | None = None, spin_from: float = 0.0,
             until: Callable[[], bool] | None = None) -> m.Msg | None:
        """`Connection.wait`."""
        return self.conn.wait(rid, timeout_s, spin_from, until)

    def poll(self, timeout_s: float = 0.0, wake_fd: int | None = None) -> None:
        """`Connection.poll`."""
        self.conn.poll(timeout_s, wake_fd)

    def done(self, rid: int) -> bool:
        """`Connection.done`."""
        return self.conn.done(rid)

    def forget(self, rid: int) -> None:
        """`Connection.forget`."""
        self.conn.forget(rid)

    def available(self) -> bool:
        """`Connection.available`."""
        return self.conn.available()

    def mark_down(self) -> None:
        """`Connection.mark_down`."""
        self.conn.mark_down()

    @property
    def generation(self) -> int:
        """Daemon boots seen after the first (a restart bumps it: `reregister`)."""
        return self.conn.generation

    @property
    def up(self) -> bool:
        """False after `mark_down`, until a ping is answered."""
        return self.conn.up

    @property
    def timeout_s(self) -> float:
        return self.conn.timeout_s

    @property
    def endpoint(self) -> str:
        return self.conn.endpoint
