"""`kvdepot serve`'s settings: flag > environment > file > default, with where each came from;
bad files and values fail naming the setting; --print-config round-trips through --config."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from kvdepot import cli
from kvdepot.config import SETTINGS, ConfigError, env_vars, resolve


def args(*argv: str):
    return cli.build_parser().parse_args(["serve", *argv])


def test_precedence_flag_env_file_default(tmp_path):
    f = tmp_path / "k.toml"
    f.write_text('l1_bytes = "2g"\nmetrics_port = 9500\npin_ttl_s = 30\nendpoint = ["ipc:///x/a.sock", '
                 '"tcp://127.0.0.1:5555"]\n')
    env = {"KVDEPOT_L1_BYTES": "8g", "KVDEPOT_METRICS_PORT": "9600"}
    st = resolve(args("--config", str(f), "--l1-bytes", "16g"), env)
    assert st.values["l1_bytes"] == 16 << 30 and st.sources["l1_bytes"] == "flag --l1-bytes"
    assert st.values["metrics_port"] == 9600 and st.sources["metrics_port"] == "env KVDEPOT_METRICS_PORT"
    assert st.values["pin_ttl_s"] == 30.0 and st.sources["pin_ttl_s"] == f"file {f}"
    assert st.values["endpoint"] == ["ipc:///x/a.sock", "tcp://127.0.0.1:5555"]
    assert st.values["busy_poll_us"] == 2000 and st.sources["busy_poll_us"] == "default"
    st = resolve(args("--no-pin-l1"), {"KVDEPOT_CONFIG": str(f), "KVDEPOT_PIN_L1": "true"})
    assert st.values["pin_l1"] is False and st.sources["pin_l1"] == "flag --no-pin-l1"
    assert st.values["l1_bytes"] == 2 << 30  # the file named by $KVDEPOT_CONFIG
    st = resolve(args("--endpoint", "ipc:///a.sock", "--endpoint", "tcp://127.0.0.1:1"), {})
    assert st.values["endpoint"] == ["ipc:///a.sock", "tcp://127.0.0.1:1"]
    assert resolve(args(), {"KVDEPOT_ENDPOINT": "ipc:///e.sock,tcp://127.0.0.1:2"}).values["endpoint"] == \
        ["ipc:///e.sock", "tcp://127.0.0.1:2"]


@pytest.mark.parametrize("text, words", [
    ("l1_bytez = 1\n", ["unknown setting", "l1_bytez"]),
    ("l1_bytes = [1]\n", ["l1_bytes", "file", "not a size"]),
    ("metrics_port = true\n", ["metrics_port", "not an integer"]),
    ("log_level = 'loud'\n", ["log_level", "not a log level"]),
    ("endpoint = []\n", ["endpoint"]),
    ("l1_bytes = \n", ["not valid TOML"]),
])
def test_bad_files_name_the_setting(tmp_path, text, words):
    f = tmp_path / "k.toml"
    f.write_text(text)
    with pytest.raises(ConfigError) as ei:
        resolve(args("--config", str(f)), {})
    assert all(w in str(ei.value) for w in words), str(ei.value)


def test_bad_env_value_names_its_source():
    with pytest.raises(ConfigError, match=r"l1_bytes \(env KVDEPOT_L1_BYTES\): not a size"):
        resolve(args(), {"KVDEPOT_L1_BYTES": "lots"})
    with pytest.raises(ConfigError, match="cannot read"):
        resolve(args("--config", "/nonexistent/k.toml"), {})


def test_print_config_round_trips(tmp_path):
    run = lambda *a, env=None: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "kvdepot", "serve", "--print-config", *a], capture_output=True, text=True,
        timeout=60, env=env)
    r = run("--l1-bytes", "3g", "--metrics-port", "9401", "--pin-l1", "--endpoint", "ipc:///r/k.sock")
    assert r.returncode == 0, r.stderr
    assert "l1_bytes = 3221225472  # flag --l1-bytes" in r.stdout
    printed = tomllib.loads(r.stdout)
    assert printed["pin_l1"] is True and printed["endpoint"] == ["ipc:///r/k.sock"]
    f = tmp_path / "k.toml"
    f.write_text(r.stdout)
    again = tomllib.loads(run("--config", str(f), env={"PATH": "/usr/bin:/bin"}).stdout)
    assert again == printed
    bad = run("--config", str(tmp_path / "missing.toml"))
    assert bad.returncode == 1 and "cannot read the configuration file" in bad.stderr and "Traceback" not in bad.stderr


def test_every_setting_has_a_distinct_flag_key_and_env():
    assert len({s.key for s in SETTINGS}) == len({s.flag for s in SETTINGS}) == len(SETTINGS)
    assert len(set(env_vars())) == len(env_vars())
    for s in SETTINGS:
        assert s.flag == "--" + s.key.replace("_", "-")
