"""Per-tenant quotas: how many bytes each tenant (a request's ``cache_salt``) may hold in a tier.

``--tenant-quota SALT=BYTES`` (repeatable; ``*=BYTES``: every salt not named, each on its own;
``=BYTES``: requests without a salt) bounds a tenant's chunk objects in L1 to BYTES and in L2 to
the same share of L2's capacity (``BYTES * l2_bytes / l1_bytes``). A store (or promotion) that
would take a tenant over its quota first evicts that tenant's own least recently used chunks
(leaves first in L1, as every eviction there), never another tenant's; if its own cannot make
room (all in use) the chunk is not cached. Within its quota a tenant competes for the tier's
free room as before (the quotas may add up to more than the tier).

`TenantLedger` keeps one tier's bytes per tenant and, for tenants under a quota, their entries in
LRU order, so that an eviction for a tenant visits only that tenant's entries. The tier (the
`kvdepot.server.index.ChunkIndex` of L1, the `kvdepot.server.disk.DiskTier` of L2) calls
`add` / `remove` / `touch` as its own index changes; only the event loop touches either.

Metrics (`kvdepot.server.metrics`) label tenants by the configured salts plus ``"other"`` (every
salt not named, summed): their number is fixed by the configuration, never by traffic.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping

OTHER = "other"  # the metric label of every salt not named in the quotas
NONE = "(none)"  # the metric label of the empty salt (requests without one)
DEFAULT = "*"  # the quota key of every salt not named (each its own quota of this size)


def parse_quotas(items) -> dict[str, int]:
    """``["acme=8g", "*=2g"]``, ``"acme=8g,*=2g"`` or ``{"acme": "8g", "*": "2g"}`` -> salt -> bytes.

    Raises:
        ValueError: an item without ``=``, a size that does not parse, or one of 0 or less.
    """
    from kvdepot.config import parse_bytes

    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        if isinstance(items, str):
            items = [x for x in items.split(",") if x.strip()]
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError(f"not a list of SALT=BYTES: {items!r}")
        pairs = []
        for item in items:
            salt, eq, size = item.partition("=")
            if not eq:
                raise ValueError(f"not SALT=BYTES: {item!r} (e.g. acme=8g, *=2g)")
            pairs.append((salt.strip(), size))
    out = {}
    for salt, size in pairs:
        if not isinstance(salt, str) or salt in (OTHER, NONE):
            raise ValueError(f"not a salt: {salt!r} ({OTHER!r} and {NONE!r} are the metrics' labels)")
        n = parse_bytes(size)
        if n <= 0:
            raise ValueError(f"the quota of {salt or '(no salt)'!r} must be > 0 bytes, got {size!r}")
        out[salt] = n
    return out


class TenantLedger:
    """One tier's bytes per tenant and its tenants' quotas.

    Args:
        quotas: salt -> most bytes in this tier (`parse_quotas`, scaled to the tier); the key
            `DEFAULT` applies to each salt not named. Empty: no quota, bytes still counted.
    """

    def __init__(self, quotas: Mapping[str, int]) -> None:
        self.quotas = dict(quotas)
        self._default = self.quotas.get(DEFAULT, 0)
        self.used_bytes: dict[str, int] = {}  # salt -> bytes of its entries in the tier
        self.evictions: dict[str, int] = {}  # salt -> entries evicted to keep it within its quota
        self._lru: dict[str, OrderedDict] = {}  # salt under a quota -> key -> entry, least recent first
        # per metric label, kept as entries come and go: a scrape reads them without walking
        # every salt in use (it holds the GIL the event loop needs)
        self._labels = {label(s): q for s, q in self.quotas.items() if s != DEFAULT}
        self._labels[OTHER] = self._default
        self._label_used = dict.fromkeys(self._labels, 0)
        self._label_evictions = dict.fromkeys(self._labels, 0)

    def _label_of(self, salt: str) -> str:
        return label(salt) if salt in self.quotas and salt != DEFAULT else OTHER

    def limit(self, salt: str) -> int:
        """The most bytes ``salt`` may hold here; 0: no quota."""
        return self.quotas.get(salt, self._default)

    def over(self, salt: str, nbytes: int) -> bool:
        """Whether ``nbytes`` more would take ``salt`` over its quota."""
        limit = self.quotas.get(salt, self._default)
        return limit > 0 and self.used_bytes.get(salt, 0) + nbytes > limit

    def add(self, salt: str, key: bytes, entry, nbytes: int) -> None:
        """An entry of ``nbytes`` joined the tier (most recently used)."""
        self.used_bytes[salt] = self.used_bytes.get(salt, 0) + nbytes
        self._label_used[self._label_of(salt)] += nbytes
        if self.quotas.get(salt, self._default):
            lru = self._lru.get(salt)
            if lru is None:
                lru = self._lru[salt] = OrderedDict()
            lru[key] = entry

    def remove(self, salt: str, key: bytes, nbytes: int) -> None:
        """An entry of ``nbytes`` left the tier."""
        left = self.used_bytes.get(salt, 0) - nbytes
        if left > 0:
            self.used_bytes[salt] = left
        else:
            self.used_bytes.pop(salt, None)
        self._label_used[self._label_of(salt)] -= nbytes
        lru = self._lru.get(salt)
        if lru is not None:
            lru.pop(key, None)
            if not lru:
                del self._lru[salt]

    def touch(self, salt: str, key: bytes) -> None:
        """The entry was used: most recent of its tenant's."""
        lru = self._lru.get(salt)
        if lru is not None and key in lru:
            lru.move_to_end(key)

    def oldest(self, salt: str) -> Iterator:
        """``salt``'s entries, least recently used first (a tenant under a quota only). A lazy
        view: the tier removes what it picked only after it stopped iterating."""
        lru = self._lru.get(salt)
        return iter(()) if lru is None else iter(lru.values())

    def evicted(self, salt: str) -> None:
        self.evictions[salt] = self.evictions.get(salt, 0) + 1
        self._label_evictions[self._label_of(salt)] += 1

    def labels(self) -> list[str]:
        """The metric labels: each named salt, `NONE` for the empty one, `OTHER`."""
        return list(self._labels)

    def label_used(self, k: str) -> int:
        return self._label_used[k]

    def label_quota(self, k: str) -> int:
        """The quota of label ``k`` (0: none; `OTHER`: each unnamed salt's)."""
        return self._labels[k]

    def label_evictions(self, k: str) -> int:
        return self._label_evictions[k]

    def by_label(self) -> dict[str, tuple[int, int, int]]:
        """Per metric label: (bytes held, quota bytes, quota evictions)."""
        return {k: (self._label_used[k], self._labels[k], self._label_evictions[k]) for k in self._labels}


def label(salt: str) -> str:
    """The metric label of a named salt (the empty salt: ``"(none)"``)."""
    return salt if salt else NONE


def scaled(quotas: Mapping[str, int], num: int, den: int) -> dict[str, int]:
    """``quotas`` times ``num / den`` (L1's quotas as L2's: the same share of the tier), at least 1 byte."""
    return {s: max(1, q * num // den) for s, q in quotas.items()}
