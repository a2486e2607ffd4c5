"""The README's main job, end to end: `kvdepot demo` with the real SmolLM2 model (~50 s), and with
random weights of its architecture (no model file)."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")


def test_demo_real_model_prefix_reuse(tmp_path):
    r = _demo(tmp_path, "--max-new-tokens", "24")
    a, b = r["engine_a"], r["engine_b"]
    assert a["prompt_tokens"] >= 512
    assert b["hit_tokens"] == (a["prompt_tokens"] // 256) * 256 == a["stored_tokens"]
    assert b["retrieved_chunks"] == b["hit_chunks"] == a["stored_chunks"]
    assert b["bytes_equal"] and b["mismatched_bytes"] == 0
    assert b["compared_bytes"] == b["hit_tokens"] * 30 * 3 * 2 * 64 * 2  # layers * heads * K|V * dim * bf16
    assert a["tokens"] == b["tokens"] and len(b["tokens"]) > 0
    assert "Fresnel" in b["text"]


def _demo(tmp_path, *extra: str) -> dict:
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "kvdepot", "demo", "--json-out", str(out), *extra],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "DEMO OK" in proc.stdout
    return json.loads(out.read_text())


def test_demo_with_random_weights_needs_no_model_file(tmp_path):
    """`--random-weights`: SmolLM2-135M's architecture with seeded weights and a byte-level
    tokenizer (what the GPU machine runs, where the GGUF file cannot be brought). The KV bytes
    retrieved are checked as exactly, and the decoded tokens depend on the context."""
    r = _demo(tmp_path, "--random-weights", "--max-new-tokens", "6")
    a, b = r["engine_a"], r["engine_b"]
    assert b["hit_tokens"] == a["stored_tokens"] > 0
    assert b["bytes_equal"] and b["mismatched_bytes"] == 0
    assert b["compared_bytes"] == b["hit_tokens"] * 30 * 3 * 2 * 64 * 2
    assert a["tokens"] == b["tokens"] and len(set(b["tokens"])) > 1
