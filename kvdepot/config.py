"""Settings of ``kvdepot serve``: each declared once here, with its flag, environment variable,
configuration-file key, default and meaning; the CLI's flags, ``--print-config`` and the
README's table come from this list.

Precedence, per setting: command-line flag > environment variable > configuration file
(``--config FILE`` or ``$KVDEPOT_CONFIG``; TOML, read with the standard library's `tomllib`,
keys as in `SETTINGS`) > default. An unknown key or a value of the wrong type in the file is an
error that names the key, never ignored.

Example ``kvdepot.toml``::

    endpoint = ["ipc:///run/kvdepot/kvdepot.sock"]
    l1_bytes = "64g"
    metrics_port = 9400
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ENV_CONFIG = "KVDEPOT_CONFIG"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ConfigError(ValueError):
    """A setting's value cannot be used (names the setting and where the value came from)."""


def user_cache_dir() -> Path:
    """kvdepot's per-user cache: ``$XDG_CACHE_HOME/kvdepot``, else ``~/.cache/kvdepot`` (built
    kernel libraries, the demo's converted model). Not created here."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvdepot"


def parse_bytes(text: str | int) -> int:
    """``"512m"``, ``"4GiB"``, ``"1073741824"`` or an int -> bytes (binary units).

    Raises:
        ValueError: not a size.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    if not isinstance(text, str):
        raise ValueError(f"not a size: {text!r} (e.g. 512m, 4g)")
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        return int(float(t[: len(t) - len(unit)]) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 512m, 4g)") from None


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"not an integer: {v!r}")
    return int(v)


def _float(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise ValueError(f"not a number: {v!r}")
    return float(v)


def _str(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"not a string: {v!r}")
    return v


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.lower() in ("1", "true", "yes", "on")
    raise ValueError(f"not a boolean: {v!r}")


def _endpoints(v: Any) -> list[str]:
    items = v.split(",") if isinstance(v, str) else v
    if not isinstance(items, list) or not items or not all(isinstance(x, str) and x.strip() for x in items):
        raise ValueError(f"not an endpoint or a list of endpoints: {v!r}")
    return [x.strip() for x in items]


def _quotas(v: Any) -> dict[str, int]:
    from kvdepot.server.quotas import parse_quotas

    return parse_quotas(v)


def _log_level(v: Any) -> str:
    level = _str(v).lower()
    if level not in ("debug", "info", "warning", "error"):
        raise ValueError(f"not a log level (debug, info, warning, error): {v!r}")
    return level


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting of ``kvdepot serve``.

    Attributes:
        key: its name in the configuration file (and in `Settings.values`).
        flag: its command-line flag.
        parse: turns a flag / environment string or a TOML value into the value; raises ValueError.
        default: the value when nothing sets it (None: decided at run time, see ``help``).
        help: what it means, with its unit.
        env: its environment variable, if it has one.
        metavar: the flag's argument in ``--help``; "" for an on/off flag (``--x`` / ``--no-x``).
    """

    key: str
    flag: str
    parse: Callable[[Any], Any]
    default: Any
    help: str
    env: str = ""
    metavar: str = "VALUE"


def _default_endpoint() -> list[str]:
    from kvdepot.protocol.transport import default_endpoint

    return [default_endpoint()]


SETTINGS: tuple[Setting, ...] = (
    Setting("endpoint", "--endpoint", _endpoints, None,
            "addresses to bind: ipc:///path.sock (same host; a Unix stream socket is also made at path.sock.stream) "
            "and/or tcp://HOST:PORT; the flag may repeat, the variable and the file take a comma-separated string or "
            "a list (default ipc://$TMPDIR/kvdepot-$UID.sock)", env="KVDEPOT_ENDPOINT", metavar="ADDR"),
    Setting("l1_bytes", "--l1-bytes", parse_bytes, 4 << 30,
            "pinned host memory for cached KV (L1), e.g. 512m, 64g", env="KVDEPOT_L1_BYTES", metavar="BYTES"),
    Setting("l2_path", "--l2-path", _str, None,
            "directory of the L2 disk tier (stored objects are written through to it and found again after a "
            "restart); unset = no L2", env="KVDEPOT_L2_PATH", metavar="DIR"),
    Setting("l2_bytes", "--l2-bytes", parse_bytes, 64 << 30,
            "capacity of the L2 disk tier (object files, headers included), e.g. 500g", env="KVDEPOT_L2_BYTES",
            metavar="BYTES"),
    Setting("l2_queue_bytes", "--l2-queue-bytes", parse_bytes, None,
            "most bytes of L2 writes queued or in progress (their L1 memory stays in use until written; a write "
            "beyond it is dropped and counted); default min(2g, l1_bytes / 8)", metavar="BYTES"),
    Setting("l2_io_threads", "--l2-io-threads", _int, 4, "threads doing L2 file I/O", metavar="N"),
    Setting("shutdown_drain_s", "--shutdown-drain-s", _float, 30.0,
            "on SIGTERM / SIGINT, write L1's chunks that L2 lacks to L2 for at most this long before exiting "
            "(with L2 configured; stores are also written through as they commit); 0 = exit at once",
            metavar="SECONDS"),
    Setting("l2_direct_io", "--l2-direct-io", _bool, None,
            "O_DIRECT file I/O for L2 (no page cache); default: where the filesystem supports it", metavar=""),
    Setting("l3_url", "--l3-url", _str, None,
            "redis://[user:password@]host:port[/db] (or rediss://) of a Redis or Valkey server shared by daemons: "
            "stored chunks are written there and lookups that miss L1 and L2 find them there; unset = no L3",
            env="KVDEPOT_L3_URL", metavar="URL"),
    Setting("l3_cluster", "--l3-cluster", _bool, False, "the L3 URL names a node of a Redis Cluster",
            env="KVDEPOT_L3_CLUSTER", metavar=""),
    Setting("l3_prefix", "--l3-prefix", _str, "kvdepot:", "prefix of every L3 key (a namespace per deployment)",
            env="KVDEPOT_L3_PREFIX", metavar="TEXT"),
    Setting("l3_ttl_s", "--l3-ttl-s", _float, 86400.0,
            "expiry of L3 objects in seconds; 0 = none (the server's eviction policy decides)", metavar="SECONDS"),
    Setting("l3_timeout_s", "--l3-timeout-s", _float, 0.5,
            "timeout of each L3 command; L3 is skipped for 5 s after 3 failures in a row", metavar="SECONDS"),
    Setting("l3_queue_bytes", "--l3-queue-bytes", parse_bytes, None,
            "most bytes of L3 writes in flight (a write beyond it is dropped and counted); default "
            "min(1g, l1_bytes / 8)", metavar="BYTES"),
    Setting("metrics_port", "--metrics-port", _int, 0,
            "HTTP port of /metrics, /healthz and /readyz; 0 = no HTTP endpoint", env="KVDEPOT_METRICS_PORT",
            metavar="PORT"),
    Setting("metrics_addr", "--metrics-addr", _str, "127.0.0.1",
            "address the HTTP endpoint binds (0.0.0.0 in a container)", env="KVDEPOT_METRICS_ADDR", metavar="ADDR"),
    Setting("pin_ttl_s", "--pin-ttl-s", _float, 120.0,
            "seconds after which a lookup's pins on its hit chunks expire", metavar="SECONDS"),
    Setting("pin_l1", "--pin-l1", _bool, None,
            "page-lock L1 for DMA at full speed (needs a memlock limit >= l1_bytes); default: when a GPU is visible",
            env="KVDEPOT_PIN_L1", metavar=""),
    Setting("transfer_threads", "--transfer-threads", _int, 2, "copy threads for CPU engines", metavar="N"),
    Setting("allow_shm_names", "--allow-shm-names", _bool, False,
            "accept CPU engines' KV caches in named /dev/shm segments (default: only sealed memfds). RISK: an "
            "engine that shrinks its segment while the daemon copies from it kills the daemon (SIGBUS) for "
            "every engine it serves", metavar=""),
    Setting("watchdog_s", "--watchdog-s", _float, 30.0,
            "a copy not completed after this many seconds (plus its bytes at 100 MB/s) is declared stuck: its "
            "request is answered TIMEOUT and describe lists it; 0 = no watchdog", metavar="SECONDS"),
    Setting("staging_batch_bytes", "--staging-batch-bytes", parse_bytes, 64 << 20,
            "daemon-side GPU staging per slot, 2 slots per direction per GPU (for engines that do not stage "
            "themselves)", metavar="BYTES"),
    Setting("copy_piece_bytes", "--copy-piece-bytes", parse_bytes, 8 << 20,
            "daemon-side GPU copies move a chunk object larger than this in pieces of about this size (whole "
            "blocks, at most 64 pieces) through the staging slots; 0 = whole chunks",
            metavar="BYTES"),
    Setting("busy_poll_us", "--busy-poll-us", _int, 2000,
            "after each request or reply, poll without sleeping this many microseconds (one core busy while "
            "few requests flow; lower latency); 0 = sleep at once", metavar="US"),
    Setting("busy_poll_max_inflight", "--busy-poll-max-inflight", _int, 2,
            "busy-poll only while at most this many copies are in flight: with more, the copies queued "
            "on the link keep it busy through a sleeping loop's wake-up, and polling would only burn a "
            "core; -1 = whatever is in flight", metavar="N"),
    Setting("log_level", "--log-level", _log_level, "info", "debug, info, warning or error",
            env="KVDEPOT_LOG_LEVEL", metavar="LEVEL"),
    Setting("tenant_quota", "--tenant-quota", _quotas, None,
            "SALT=BYTES: the most bytes of chunks a tenant (a request's cache_salt) holds in L1, and the same "
            "share of L2; a tenant over it evicts its own least recently used chunks, never another's. The flag "
            "may repeat; '*=BYTES' bounds each salt not named, '=BYTES' requests without a salt; the variable "
            "takes a comma-separated string, the file a table (e.g. {acme = \"8g\", \"*\" = \"2g\"}); unset = "
            "no quotas", env="KVDEPOT_TENANT_QUOTA", metavar="SALT=BYTES"),
    Setting("curve_secret_key", "--curve-secret-key", _str, None,
            "the daemon's CURVE secret key file (NAME.key_secret of `kvdepot keygen`): tcp:// endpoints then "
            "accept only clients whose public key is in curve_clients; without it a tcp:// endpoint must be "
            "a loopback address", env="KVDEPOT_CURVE_SECRET_KEY", metavar="FILE"),
    Setting("curve_clients", "--curve-clients", _str, None,
            "directory of the public key files (*.key) of the clients tcp:// endpoints accept",
            env="KVDEPOT_CURVE_CLIENTS", metavar="DIR"),
)
BY_KEY = {s.key: s for s in SETTINGS}
_REPEATABLE = {"endpoint": "endpoint_list", "tenant_quota": "tenant_quota_list"}  # flags that may repeat: their dest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The settings' flags (every default None: `resolve` tells a given flag from an absent one),
    plus ``--config`` and ``--print-config``."""
    parser.add_argument("--config", default=None, metavar="FILE",
                        help=f"TOML file of settings (keys as the flags without '--', '-' as '_'; env {ENV_CONFIG})")
    parser.add_argument("--print-config", action="store_true",
                        help="print the effective settings and where each comes from, then exit")
    for s in SETTINGS:
        where = f" (env {s.env})" if s.env else ""
        default = "" if s.default is None else f"; default {s.default}"
        if s.metavar == "":
            parser.add_argument(s.flag, dest=s.key, action="store_true", default=None, help=s.help + where)
            parser.add_argument("--no-" + s.flag[2:], dest=s.key, action="store_false", default=None)
        elif s.key in _REPEATABLE:
            parser.add_argument(s.flag, dest=_REPEATABLE[s.key], action="append", default=None, metavar=s.metavar,
                                help=s.help + where)
        else:
            parser.add_argument(s.flag, dest=s.key, default=None, metavar=s.metavar, help=s.help + where + default)


@dataclasses.dataclass
class Settings:
    """The effective settings: ``values[key]`` and ``sources[key]`` (``"flag --x"``,
    ``"env KVDEPOT_X"``, ``"file PATH"`` or ``"default"``)."""

    values: dict[str, Any]
    sources: dict[str, str]

    def to_toml(self) -> str:
        """The settings as a configuration file, each line commented with its source."""
        lines = []
        for s in SETTINGS:
            v = self.values[s.key]
            if v is None:
                lines.append(f"# {s.key} = (not set)")
                continue
            lines.append(f"{s.key} = {_toml_value(v)}  # {self.sources[s.key]}")
        return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_value(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def load_file(path: str) -> dict[str, Any]:
    """The settings of a TOML file.

    Raises:
        ConfigError: unreadable, not TOML, or a key that is no setting.
    """
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read the configuration file {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(BY_KEY))
    if unknown:
        raise ConfigError(f"{path}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(BY_KEY)}")
    return data


def resolve(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Settings:
    """Each setting from its flag, else its environment variable, else the configuration file,
    else its default; every value parsed and checked.

    Raises:
        ConfigError: a value that does not parse (naming the setting and its source), or a bad file.
    """
    environ = os.environ if environ is None else environ
    path = getattr(args, "config", None) or environ.get(ENV_CONFIG) or ""
    file = load_file(path) if path else {}
    values, sources = {}, {}
    for s in SETTINGS:
        given = getattr(args, _REPEATABLE.get(s.key, s.key), None)
        if given is not None:
            raw, src = given, f"flag {s.flag if given is not False else '--no-' + s.flag[2:]}"
        elif s.env and environ.get(s.env, "") != "":
            raw, src = environ[s.env], f"env {s.env}"
        elif s.key in file:
            raw, src = file[s.key], f"file {path}"
        else:
            values[s.key] = _default_endpoint() if s.key == "endpoint" else s.default
            sources[s.key] = "default"
            continue
        try:
            values[s.key] = s.parse(raw)
        except ValueError as exc:
            raise ConfigError(f"{s.key} ({src}): {exc}") from None
        sources[s.key] = src
    return Settings(values, sources)


def env_vars() -> Sequence[str]:
    """Every environment variable `resolve` reads."""
    return [ENV_CONFIG, *(s.env for s in SETTINGS if s.env)]
