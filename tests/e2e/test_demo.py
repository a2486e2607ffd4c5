"""The README's main job, end to end: `kvdepot demo` with the real SmolLM2 model (~50 s); and the
model of ``--random-weights`` (what the GPU machine's demo runs, where the GGUF file cannot be
brought), checked on its own: the demo around it is the same code."""

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


_RANDOM_MODEL = """
import json, sys
import torch
from kvdepot.demo.model import SmolLM

m = SmolLM(dtype=torch.bfloat16, num_threads=1, random_weights=True)
prompt = m.chat_tokens(sys.argv[1])
kv = m.prefill(prompt[:-8])
digest = [float(k.float().sum()) + float(v.float().sum()) for k, v in kv]
print(json.dumps({"prompt": prompt, "shape": [list(kv[0][0].shape), len(kv)], "digest": digest,
                  "with_cache": m.generate(prompt, kv, 6), "without": m.generate(prompt, None, 6),
                  "other": m.generate(m.chat_tokens(sys.argv[2]), None, 6), "text": m.decode([4, 5])}))
"""


def test_random_weights_model_is_the_same_in_every_process_and_its_tokens_follow_the_context():
    """`SmolLM(random_weights=True)`: SmolLM2-135M's KV shape (30 layers, 3 KV heads, head dim
    64), a byte-level tokenizer, weights identical in two processes (engines A and B of the demo
    must compute the same KV), a decode from a cached prefix equal to one without, and tokens
    that depend on the prompt."""
    runs = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-c", _RANDOM_MODEL, "a lighthouse lens, 1822", "who wrote it?"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    a, b = runs
    assert a == b
    assert a["prompt"][0] == 1 and a["prompt"][-1] == 2 and a["prompt"][1:4] == [ord(c) + 3 for c in "a l"]
    assert a["shape"] == [[len(a["prompt"]) - 8, 3, 64], 30]
    assert a["with_cache"] == a["without"] and len(set(a["without"])) > 1
    assert a["other"] != a["without"] and a["text"] == "4 5"
