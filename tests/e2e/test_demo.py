"""The README's main job, end to end: `kvdepot demo` with the real SmolLM2 model (~50 s)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def test_demo_real_model_prefix_reuse(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "kvdepot", "demo", "--json-out", str(out), "--max-new-tokens", "24"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DEMO OK" in proc.stdout
    r = json.loads(out.read_text())
    a, b = r["engine_a"], r["engine_b"]
    assert a["prompt_tokens"] >= 512
    assert b["hit_tokens"] == (a["prompt_tokens"] // 256) * 256 == a["stored_tokens"]
    assert b["retrieved_chunks"] == b["hit_chunks"] == a["stored_chunks"]
    assert b["bytes_equal"] and b["mismatched_bytes"] == 0
    assert b["compared_bytes"] == b["hit_tokens"] * 30 * 3 * 2 * 64 * 2  # layers * heads * K|V * dim * bf16
    assert a["tokens"] == b["tokens"] and len(b["tokens"]) > 0
    assert "Fresnel" in b["text"]
