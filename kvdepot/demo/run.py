"""`kvdepot demo`: two engine processes share a real model's prompt KV through the daemon.

1. The demo starts a daemon (or uses ``--endpoint``).
2. Engine A (its own process) loads SmolLM2-135M-Instruct, keeps a paged KV cache in shared
   memory in vLLM 0.33's layout LBNHC (NHD; block size 16; per-layer ``[num_blocks, H, N, C]``
   int8 views, K|V packed in C), prefills a multi-paragraph prompt, writes the KV into blocks
   it picks at random, STOREs the whole chunks, and answers the question by greedy decoding
   from the KV it reads back out of its own paged cache.
3. Engine B (another process) has an empty cache in layout LBHNC (HND) and other block ids.
   It LOOKUPs prompt + question, RETRIEVEs the cached prefix into its blocks, checks every
   retrieved byte against A's KV, answers the same question from the retrieved KV, and also
   answers it with a full recompute (no cache).

The demo exits non-zero if any retrieved byte differs or B's tokens differ from A's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct:Q4_1.gguf"
TOKENS_PER_BLOCK = 16
NUM_BLOCKS = 256

DOCUMENT = """\
Lighthouses have guided sailors along dangerous coasts for more than two thousand years. The \
most famous early example was the Pharos of Alexandria, built on a small island at the entrance \
of the harbour in the third century before the common era. Ancient writers described a tower of \
three stages, square at the bottom, octagonal in the middle and round at the top, with a fire \
burning at the summit. It stood for well over a thousand years before a series of earthquakes \
brought it down, and its stones were later reused in a fortress built on the same spot.

For most of history a lighthouse was little more than a tower with an open fire or a cluster \
of candles at the top. Wood and coal fires were smoky and dim, and keepers spent long nights \
carrying fuel up narrow stairs. In the eighteenth century oil lamps with hollow wicks and glass \
chimneys gave a brighter and steadier flame, and polished metal reflectors began to throw the \
light further out to sea. Even so, much of the light escaped upwards or sideways, where it was \
of no use to a ship on the horizon.

The great change came in 1822, when the French physicist Augustin Fresnel presented a new kind \
of lens. Instead of one heavy curved piece of glass, his lens was built from concentric rings \
of prisms arranged around a central bull's-eye. The rings bent the light from a single lamp into \
a narrow horizontal beam, so that far more of it reached the sea. A first-order Fresnel lens \
could stand taller than a person and weigh several tonnes, yet its beam could be seen more than \
twenty nautical miles away on a clear night. Within a few decades such lenses were installed \
in lighthouses on almost every continent.

Each lighthouse also needed a way to be recognised. Sailors who saw a light at night had to \
know which light it was, or they could mistake one headland for another. Engineers therefore \
gave every station its own signature: a fixed light, a light that flashed once every few \
seconds, groups of two or three flashes, or a light that changed colour. Rotating lenses, often \
floating on a bath of mercury so that they turned with very little friction, produced the \
flashes. The pattern of each light was printed in official lists and on nautical charts.

Keeping a lighthouse was hard and lonely work. Keepers trimmed wicks, polished brass and glass, \
wound the clockwork that turned the lens, and recorded the weather in a logbook. Some stations \
stood on bare rocks far from land, where supply boats could not reach them for weeks during \
winter storms. Families sometimes lived at the stations on the coast, and many children grew up \
learning to read the sea and the sky.

During the twentieth century electricity replaced oil, and automatic equipment replaced most of \
the keepers. Radio beacons and then satellite navigation made ships far less dependent on lights \
along the shore. Many old towers are now museums or holiday homes, but hundreds of them still \
shine every night, because a bright light on a dark coast remains one of the simplest and most \
reliable signals a sailor can have."""

QUESTION = "Who invented the lens that made lighthouse beams visible far out to sea, and in what year?"
OTHER_QUESTION = "Why did each lighthouse need its own pattern of flashes?"


def prompt_tokens(model, question: str) -> list[int]:
    return model.chat_tokens(f"{DOCUMENT}\n\nAnswer in one sentence. Question: {question}")


def shared_prefix_tokens(model) -> list[int]:
    """The tokens every question shares: the chat header and the document."""
    a, b = prompt_tokens(model, QUESTION), prompt_tokens(model, OTHER_QUESTION)
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def _kv_tokens(k, v):
    """(K, V) ``[T, H, D]`` -> ``[T, H, 2, D]`` (vLLM's K|V packing per head)."""
    import torch

    return torch.stack([k, v], dim=2)


def _write_prefix(cache, kv, block_ids: list[int]) -> None:
    """Write per-layer KV ``[T, H, D]`` into ``block_ids`` (last block may be partial)."""
    n = TOKENS_PER_BLOCK
    for layer, (k, v) in enumerate(kv):
        data = _kv_tokens(k, v)
        view = cache.token_view(layer)
        for i in range((data.shape[0] + n - 1) // n):
            part = data[i * n : (i + 1) * n]
            view[block_ids[i], : part.shape[0]].copy_(part)


def _read_prefix(cache, block_ids: list[int], num_tokens: int):
    """Per-layer (K, V) ``[num_tokens, H, D]`` read out of the paged cache."""
    out = []
    for layer in range(len(cache.layer_names)):
        t = cache.read_tokens(layer, block_ids[: num_tokens // TOKENS_PER_BLOCK])
        out.append((t[:, :, 0].contiguous(), t[:, :, 1].contiguous()))
    return out


def _setup(args, layout: str):
    import torch

    from kvdepot.client import KVDepotClient, shard_name
    from kvdepot.client.kvcache import KVGroupShape, ShmKVCache
    from kvdepot.demo.model import SmolLM

    t0 = time.perf_counter()
    model = SmolLM(dtype=torch.bfloat16, num_threads=args.threads, device=args.device,
                   random_weights=args.random_weights)
    load_s = time.perf_counter() - t0
    shape = KVGroupShape(0, model.num_layers, model.num_kv_heads, model.head_dim, TOKENS_PER_BLOCK, model.dtype)
    cuda = args.device == "cuda"
    # CPU: a sealed memfd handed to the daemon, which nobody can shrink under its copies
    cache = ShmKVCache([shape], NUM_BLOCKS, layout, device="cuda" if cuda else None, sealed=not cuda)
    client = KVDepotClient(args.endpoint, timeout_s=60.0, name=f"demo-{layout}")
    # CUDA: engine-side staging, the gather / scatter kernels run in this process on its stream
    model_id = MODEL_ID + (":random-weights" if args.random_weights else "")
    reg = client.register(model_id, shard_name(0, 1), args.chunk_size, cache.storage_specs(), cache.layer_specs(),
                          cache.group_specs(), device=args.device, local_storages=[cache.storage] if cuda else None,
                          storage_fds=cache.storage_fds())
    return model, cache, client, reg, load_s


def engine_a(args) -> dict:
    """Prefill, store, and answer from its own cache; returns a result dict."""
    import torch

    model, cache, client, reg, load_s = _setup(args, "LBNHC")
    try:
        prompt = shared_prefix_tokens(model)
        full = prompt_tokens(model, QUESTION)
        t0 = time.perf_counter()
        kv = model.prefill(prompt)
        prefill_s = time.perf_counter() - t0
        rng = random.Random(1234)
        block_ids = rng.sample(range(NUM_BLOCKS), (len(prompt) + TOKENS_PER_BLOCK - 1) // TOKENS_PER_BLOCK)
        _write_prefix(cache, kv, block_ids)
        keys = reg.keys(prompt)
        stored_tokens = len(keys) * args.chunk_size
        t0 = time.perf_counter()
        r = client.store(reg, keys, [block_ids[: stored_tokens // TOKENS_PER_BLOCK]], request="demo-a")
        store_s = time.perf_counter() - t0
        # reference bytes for engine B: the stored tokens' KV as A's paged cache holds it
        ref = torch.stack([cache.read_tokens(li, block_ids[: stored_tokens // TOKENS_PER_BLOCK], as_bytes=True)
                           for li in range(model.num_layers)])
        torch.save(ref.cpu(), args.ref_path)
        # answer the question from A's own paged cache (the same prefix length B will hit)
        t0 = time.perf_counter()
        tokens = model.generate(full, _read_prefix(cache, block_ids, stored_tokens), args.max_new_tokens)
        gen_s = time.perf_counter() - t0
        client.unregister(reg)
        return {
            "prompt_tokens": len(prompt), "full_tokens": len(full), "stored_chunks": r.stored,
            "present_chunks": r.present, "stored_tokens": stored_tokens, "stored_bytes": r.stored * reg.object_bytes,
            "object_bytes": reg.object_bytes, "store_s": store_s, "prefill_s": prefill_s, "load_s": load_s,
            "generate_s": gen_s, "tokens": tokens, "text": model.decode(tokens), "block_ids": block_ids,
        }
    finally:
        client.close()
        cache.close()


def engine_b(args) -> dict:
    """Lookup, retrieve into different blocks of an HND cache, verify, answer."""
    import torch

    model, cache, client, reg, load_s = _setup(args, "LBHNC")
    try:
        full = prompt_tokens(model, QUESTION)
        keys = reg.keys(full)
        t0 = time.perf_counter()
        hit_chunks = client.lookup(keys, args.chunk_size, num_tokens=len(full), model=reg.model, pin_request="demo-b")
        lookup_s = time.perf_counter() - t0
        hit_tokens = hit_chunks * args.chunk_size
        nb = hit_tokens // TOKENS_PER_BLOCK
        rng = random.Random(98765)
        block_ids = rng.sample(range(NUM_BLOCKS), nb)
        t0 = time.perf_counter()
        retrieved = client.retrieve(reg, keys[:hit_chunks], [block_ids], request="demo-b")
        retrieve_s = time.perf_counter() - t0
        client.end_request("demo-b")
        got = torch.stack([cache.read_tokens(li, block_ids, as_bytes=True) for li in range(model.num_layers)]).cpu()
        ref = torch.load(args.ref_path)
        bytes_equal = retrieved == hit_chunks and got.shape == ref.shape and torch.equal(got, ref)
        mismatched = int((got != ref).sum()) if got.shape == ref.shape else -1
        t0 = time.perf_counter()
        tokens = model.generate(full, _read_prefix(cache, block_ids, hit_tokens), args.max_new_tokens) if hit_tokens \
            else []
        gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        recompute = model.generate(full, None, args.max_new_tokens)
        recompute_s = time.perf_counter() - t0
        client.unregister(reg)
        return {
            "full_tokens": len(full), "hit_chunks": hit_chunks, "hit_tokens": hit_tokens, "retrieved_chunks": retrieved,
            "retrieved_bytes": retrieved * reg.object_bytes, "lookup_s": lookup_s, "retrieve_s": retrieve_s,
            "bytes_equal": bytes_equal, "mismatched_bytes": mismatched, "compared_bytes": got.numel(),
            "generate_s": gen_s, "tokens": tokens, "text": model.decode(tokens), "recompute_tokens": recompute,
            "recompute_text": model.decode(recompute), "recompute_s": recompute_s, "load_s": load_s,
            "block_ids": block_ids,
        }
    finally:
        client.close()
        cache.close()


def _run_engine(role: str, args, workdir: str) -> dict:
    out = os.path.join(workdir, f"engine-{role}.json")
    cmd = [sys.executable, "-m", "kvdepot.demo.run", role, "--endpoint", args.endpoint, "--out", out,
           "--chunk-size", str(args.chunk_size), "--max-new-tokens", str(args.max_new_tokens),
           "--threads", str(args.threads), "--ref-path", os.path.join(workdir, "engine-a-kv.pt"),
           "--device", args.device] + (["--random-weights"] if args.random_weights else [])
    env = dict(os.environ, TQDM_DISABLE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"engine {role} failed with exit code {proc.returncode}")
    with open(out) as f:
        return json.load(f)


def _start_daemon(workdir: str) -> tuple[subprocess.Popen, str]:
    endpoint = f"ipc://{os.path.join(workdir, 'kvdepot.sock')}"
    proc = subprocess.Popen([sys.executable, "-m", "kvdepot", "serve", "--endpoint", endpoint, "--l1-bytes", "1g",
                             "--log-level", "warning"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "ready" not in line:
        proc.kill()
        raise RuntimeError(f"daemon did not start: {line!r}")
    return proc, endpoint


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def main(args) -> int:
    """Entry of `kvdepot demo`; returns the exit code (0 = identical tokens, bytes equal)."""
    from kvdepot.demo.model import find_gguf

    if not args.random_weights:
        find_gguf()  # fail early with the install hint
    with tempfile.TemporaryDirectory(prefix="kvdepot-demo-") as workdir:
        daemon = None
        if not args.endpoint:
            daemon, args.endpoint = _start_daemon(workdir)
            print(f"started daemon at {args.endpoint}")
        try:
            what = "random weights of SmolLM2-135M's architecture" if args.random_weights else "SmolLM2-135M-Instruct"
            print(f"engine A: loading {what} on {args.device}, prefill, store (vLLM LBNHC / NHD cache) ...",
                  flush=True)
            a = _run_engine("engine-a", args, workdir)
            print("engine B: loading, lookup, retrieve (vLLM LBHNC / HND cache, other block ids), generate ...",
                  flush=True)
            b = _run_engine("engine-b", args, workdir)
            from kvdepot.client import KVDepotClient

            with KVDepotClient(args.endpoint) as c:
                info = c.describe()
        finally:
            if daemon is not None:
                daemon.terminate()
                daemon.wait(timeout=30)
    same_tokens = a["tokens"] == b["tokens"] and bool(b["tokens"])
    ok = b["bytes_equal"] and same_tokens and b["hit_tokens"] > 0
    print()
    print(f"prompt: {a['prompt_tokens']} shared tokens (document), {b['full_tokens']} with the question; "
          f"chunk {args.chunk_size} tokens = {a['object_bytes']} bytes")
    print(f"engine A stored {a['stored_chunks']} chunks ({a['stored_bytes']} bytes) in {a['store_s'] * 1e3:.2f} ms "
          f"= {_gbps(a['stored_bytes'], a['store_s']):.2f} GB/s  [NHD blocks {a['block_ids'][:4]}...]")
    print(f"engine B lookup hit {b['hit_tokens']} of {b['full_tokens']} tokens in {b['lookup_s'] * 1e3:.2f} ms; "
          f"retrieved {b['retrieved_chunks']} chunks ({b['retrieved_bytes']} bytes) in {b['retrieve_s'] * 1e3:.2f} ms "
          f"= {_gbps(b['retrieved_bytes'], b['retrieve_s']):.2f} GB/s  [HND blocks {b['block_ids'][:4]}...]")
    print(f"retrieved bytes equal engine A's KV: {b['bytes_equal']} ({b['compared_bytes']} bytes compared, "
          f"{b['mismatched_bytes']} differ)")
    print(f"daemon: lookup hit {info.lookup_hit_tokens}/{info.lookup_requested_tokens} tokens, "
          f"stored {info.stored_chunks} chunks, retrieved {info.retrieved_chunks}")
    print(f"question: {QUESTION}")
    print(f"engine A answer (own cache, {a['generate_s']:.2f} s): {a['text']!r}")
    print(f"engine B answer (retrieved KV, {b['generate_s']:.2f} s): {b['text']!r}")
    print(f"full recompute, no cache ({b['recompute_s']:.2f} s): {b['recompute_text']!r}")
    print(f"tokens identical A vs B: {same_tokens}; B vs full recompute: {b['tokens'] == b['recompute_tokens']}")
    result = {"ok": ok, "engine_a": a, "engine_b": b, "same_tokens": same_tokens,
              "same_as_recompute": b["tokens"] == b["recompute_tokens"]}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result, f, indent=1)
    print("DEMO OK" if ok else "DEMO FAILED")
    return 0 if ok else 1


def _engine_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=["engine-a", "engine-b"])
    p.add_argument("--endpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--ref-path", required=True)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--random-weights", action="store_true")
    args = p.parse_args(argv)
    result = (engine_a if args.role == "engine-a" else engine_b)(args)
    with open(args.out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(_engine_main(sys.argv[1:]))
