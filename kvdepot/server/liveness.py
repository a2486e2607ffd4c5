"""Engine liveness: what reclaims a dead engine's registrations and lookup pins.

* **Stream-socket clients** (every ``ipc://`` client unless ``$KVDEPOT_TRANSPORT=zmq``, so every
  vLLM worker and scheduler beside a local daemon): registrations and pins belong to the
  client's connection identity. When its connection closes and no connection of that identity
  came back within ``peer_grace_s``, they are reclaimed. The kernel closes a process's sockets
  when it dies (SIGKILL, OOM kill, container stop), so a dead engine is reclaimed within the
  grace in whatever PID namespace it ran: no pid is consulted, and a recycled pid keeps nothing.
* **ZMQ ``ipc://`` clients** (``$KVDEPOT_TRANSPORT=zmq``): ZMQ says nothing of a peer's
  connection, so the pid the client reported is watched (``kill(pid, 0)`` every
  ``liveness_interval_s``); that needs the daemon in the engines' PID namespace.
* **tcp clients**: their pid is another host's and is never watched; registrations last until
  unregistered or the daemon restarts, pins until ``pin_ttl_s``.

`PeerLiveness` owns the connections' state; the registrations, lookup pins and ZMQ clients'
pids it reclaims are the daemon's (`kvdepot.server.daemon.Daemon`, `kvdepot.server.lookups`),
passed to it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

from kvdepot.server.netsec import TCP_TAG

log = logging.getLogger("kvdepot.daemon")


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists in this PID namespace (0 or less: unknown, True)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PeerLiveness:
    """Connection-bound and pid-watched reclaim of registrations and pins (see the module).

    Args:
        registrations: the daemon's registrations by id (read; `Registration.identity`,
            ``watch_pid``).
        lookups: the `kvdepot.server.lookups.Lookups` whose pins it reclaims (``pins``,
            ``unpin``, ``client_pids``).
        unregister: ends a registration (the daemon's).
        metrics: ``engines_reclaimed`` is counted here.
        peer_grace_s: how long a closed stream connection's identity may come back.
    """

    def __init__(self, registrations: dict, lookups, unregister: Callable, metrics, peer_grace_s: float) -> None:
        self.registrations = registrations
        self.lookups = lookups
        self._unregister = unregister
        self.metrics = metrics
        self.peer_grace_s = peer_grace_s
        self.connected_peers: set[bytes] = set()  # identities with an open stream connection
        self._peer_reclaims: dict[bytes, asyncio.TimerHandle] = {}  # closed, reclaim scheduled

    def watch_pid(self, identity: bytes, pid: int) -> int:
        """The pid to watch for a client (0: none): only a ZMQ ``ipc://`` client's."""
        if identity in self.connected_peers or identity.startswith(TCP_TAG):
            return 0
        return pid

    def peer_attached(self, identity: bytes) -> None:
        """A stream connection of ``identity`` is open (a reconnect keeps what it owned)."""
        self.connected_peers.add(identity)
        handle = self._peer_reclaims.pop(identity, None)
        if handle is not None:
            handle.cancel()

    def peer_detached(self, identity: bytes) -> None:
        """The stream connection of ``identity`` closed: its registrations and pins go after
        ``peer_grace_s`` unless it connects again."""
        self.connected_peers.discard(identity)
        if not self._owns_anything(identity):
            return
        loop = asyncio.get_running_loop()
        old = self._peer_reclaims.pop(identity, None)
        if old is not None:
            old.cancel()
        self._peer_reclaims[identity] = loop.call_later(self.peer_grace_s, self._reclaim_peer, identity)

    def _owns_anything(self, identity: bytes) -> bool:
        return (any(r.identity == identity for r in self.registrations.values())
                or any(k[0] == identity for k in self.lookups.pins))

    def _reclaim_peer(self, identity: bytes) -> None:
        self._peer_reclaims.pop(identity, None)
        if identity in self.connected_peers:
            return
        regs = [r for r in self.registrations.values() if r.identity == identity]
        for reg in regs:
            log.warning("the connection of %s (model %s shard %s, pid %d) closed; reclaiming the registration",
                        reg.id, reg.model, reg.shard, reg.pid)
            self._unregister(reg)
            self.metrics.engines_reclaimed.labels("connection_closed").inc()
        lookups = self.lookups
        for key in [k for k in lookups.pins if k[0] == identity]:
            lookups.unpin(*key)
        lookups.client_pids.pop(identity, None)

    def sweep(self) -> None:
        """Reclaim registrations of exited (watched) engine processes, expired or orphaned pins
        and the pids of exited ZMQ clients (from the daemon's sweeper)."""
        for reg in list(self.registrations.values()):
            if reg.watch_pid and not pid_alive(reg.watch_pid):
                log.warning("engine pid %d of %s exited; reclaiming its registration", reg.watch_pid, reg.id)
                self._unregister(reg)
                self.metrics.engines_reclaimed.labels("pid_exited").inc()
        now = time.monotonic()
        lookups = self.lookups
        for key, pin in list(lookups.pins.items()):
            if pin.deadline < now or not pid_alive(pin.pid):
                lookups.unpin(*key)
        for ident, pid in list(lookups.client_pids.items()):
            if not pid_alive(pid):
                del lookups.client_pids[ident]
