"""Injected faults, for soak tests (`kvdepot soak`): with ``$KVDEPOT_INJECT_FAULTS`` set, the
daemon drops or delays a random share of its replies, as a lossy or stalled link between an
engine and the daemon would, and stalls a share of its CPU copies, as a stuck copy thread would
(for the watchdog, `kvdepot.server.watchdog`). Off (and free) unless the variable is set; the
daemon logs a warning at start when it is on, and `describe` counts what it injected.

Format: comma-separated ``key=value``: ``drop`` (share of replies never sent, 0..1), ``delay``
(share sent late), ``delay_s`` (how late, seconds; each delayed reply waits a uniform time in
``[0, delay_s]``), ``stall`` (share of CPU copies that first sleep ``stall_s`` seconds in their
copy thread), ``seed`` (of the random choices). Example: ``drop=0.001,delay=0.01,delay_s=0.2``.
"""

from __future__ import annotations

import os
import random

ENV_INJECT_FAULTS = "KVDEPOT_INJECT_FAULTS"


class InjectedFaults:
    """Decides, per reply, whether to drop it, delay it (seconds) or send it now.

    Raises:
        ValueError: a malformed spec (unknown key, a share outside [0, 1], a negative delay).
    """

    def __init__(self, spec: str) -> None:
        values = {"drop": 0.0, "delay": 0.0, "delay_s": 0.1, "stall": 0.0, "stall_s": 5.0, "seed": 0.0}
        for part in filter(None, (p.strip() for p in spec.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in values:
                raise ValueError(f"${ENV_INJECT_FAULTS}: '{part}' is not one of {sorted(values)}=<number>")
            try:
                values[key] = float(value)
            except ValueError:
                raise ValueError(f"${ENV_INJECT_FAULTS}: '{part}': {value!r} is not a number") from None
        if not (0 <= values["drop"] <= 1 and 0 <= values["delay"] <= 1 and values["drop"] + values["delay"] <= 1):
            raise ValueError(f"${ENV_INJECT_FAULTS}: drop and delay are shares of replies in [0, 1]")
        if not 0 <= values["stall"] <= 1:
            raise ValueError(f"${ENV_INJECT_FAULTS}: stall is a share of copies in [0, 1]")
        if values["delay_s"] < 0 or values["stall_s"] < 0:
            raise ValueError(f"${ENV_INJECT_FAULTS}: delay_s and stall_s must be >= 0")
        self.drop, self.delay, self.delay_s = values["drop"], values["delay"], values["delay_s"]
        self.stall, self.stall_s = values["stall"], values["stall_s"]
        self._rng = random.Random(int(values["seed"]))
        self._copy_rng = random.Random(int(values["seed"]) + 1)
        self.counts = {"dropped_replies": 0, "delayed_replies": 0, "stalled_copies": 0}

    @classmethod
    def from_env(cls) -> InjectedFaults | None:
        """The injector ``$KVDEPOT_INJECT_FAULTS`` asks for, or None (unset or empty)."""
        spec = os.environ.get(ENV_INJECT_FAULTS, "").strip()
        return cls(spec) if spec else None

    def decide(self) -> float | None:
        """None: drop this reply; 0.0: send it now; > 0: send it after that many seconds."""
        x = self._rng.random()
        if x < self.drop:
            self.counts["dropped_replies"] += 1
            return None
        if x < self.drop + self.delay:
            self.counts["delayed_replies"] += 1
            return self._rng.uniform(0.0, self.delay_s) or 1e-6
        return 0.0

    def copy_stall_s(self) -> float:
        """Seconds this CPU copy sleeps before it runs (0.0 for most)."""
        if self.stall and self._copy_rng.random() < self.stall:
            self.counts["stalled_copies"] += 1
            return self.stall_s
        return 0.0

    def __str__(self) -> str:
        return (f"drop {self.drop:g} of replies, delay {self.delay:g} by up to {self.delay_s:g} s, "
                f"stall {self.stall:g} of CPU copies for {self.stall_s:g} s")
