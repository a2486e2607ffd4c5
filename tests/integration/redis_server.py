"""A throwaway `redis-server` (the Debian package) on 127.0.0.1 for the L3 tests: no
persistence, a free port, killed at teardown; ``kill()`` / ``start()`` for outages."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from daemon_proc import free_port


def redis_server_binary() -> str | None:
    """Path of redis-server (or valkey-server), if installed."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


class RedisServer:
    """One redis-server process (``url``; ``kill`` and ``start`` again on the same port)."""

    def __init__(self, workdir: Path, *extra: str) -> None:
        binary = redis_server_binary()
        if binary is None:
            if os.environ.get("KVDEPOT_REQUIRE_TOOLS"):
                pytest.fail("redis-server is not installed (.ci/run installs the Debian package)")
            pytest.skip("redis-server is not installed (apt-get install redis-server)")
        self.binary, self.workdir, self.extra = binary, workdir, extra
        self.port = free_port()
        while self.port > 55000:  # a cluster node's bus port is port + 10000
            self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        workdir.mkdir(parents=True, exist_ok=True)
        self.start()

    def start(self) -> None:
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), *self.extra]
        with open(self.workdir / "redis.log", "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while self.cli("PING") not in ("PONG", "True"):
            assert self.proc.poll() is None, (self.workdir / "redis.log").read_text()
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.02)

    def cli(self, *args: str) -> str:
        """One command through redis-py (synchronous); its reply as text, or "" on an error."""
        import redis

        try:
            r = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2, socket_connect_timeout=0.5)
            try:
                out = r.execute_command(*args)
            finally:
                r.close()
        except redis.RedisError:
            return ""
        if isinstance(out, bytes):
            return out.decode(errors="replace")
        return str(out)

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
