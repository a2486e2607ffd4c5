"""In-process CUDA transfer benchmark (the building block of STORE / RETRIEVE on GPU engines).

For real model shapes (vLLM 0.33 layout LBNHC, bf16, block size 16) it measures, in one run:

* roofline: plain pinned ``cudaMemcpyAsync`` of the same bytes (D2H, H2D, both at once);
* kvdepot: gather kernel -> double-buffered device staging -> D2H into pinned host objects
  (store), and H2D -> scatter kernel (retrieve), for a stream of chunks and for a lone chunk;
* baseline: per-layer torch ``index_select`` into staging + one copy (what a simple
  connector does);
* the gather kernel alone (device -> device), against a device memcpy of the same bytes.

Every figure is printed as GB/s next to the same-run roofline and written as JSON.

    python benchmarks/kernel_transfer.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvdepot.gpu.cuda_engine import CudaTransferEngine
from kvdepot.gpu.layout import group_layers
from kvdepot.protocol.messages import KVGroupSpec, LayerSpec

# (name, layers, kv heads per TP rank, head_dim) from tests/data/model_kv_shapes.json
SHAPES = [
    ("Llama-3.1-8B TP1", 32, 8, 128),
    ("Llama-3.1-70B TP4", 80, 2, 128),
    ("Llama-3.1-70B TP8", 80, 1, 128),
    ("DeepSeek-V3 MLA", 61, 1, 576),
]
BLOCK = 16


def make_engine_cache(layers: int, heads: int, head_dim: int, num_blocks: int, mla: bool, dev):
    """One int8 allocation, per-layer [NB, H, N, C] views in LBNHC order (vLLM 0.33 default)."""
    if mla:
        row = head_dim * 2
        page = BLOCK * row
        storage = torch.randint(0, 127, (layers * num_blocks * page,), dtype=torch.int8, device=dev)
        specs = [LayerSpec(name=f"l{i}", storage=0, offset_bytes=i * num_blocks * page,
                           shape=[num_blocks, BLOCK, head_dim], strides=[BLOCK * head_dim, head_dim, 1],
                           dtype="bfloat16", kv_dtype="bfloat16", gid=0, layout="mla") for i in range(layers)]
    else:
        c = 2 * head_dim * 2
        page = BLOCK * heads * c
        storage = torch.randint(0, 127, (layers * num_blocks * page,), dtype=torch.int8, device=dev)
        specs = [LayerSpec(name=f"l{i}", storage=0, offset_bytes=i * num_blocks * page,
                           shape=[num_blocks, heads, BLOCK, c], strides=[page, c, heads * c, 1],
                           dtype="int8", kv_dtype="bfloat16", gid=0, layout="vllm") for i in range(layers)]
    return storage, specs


def timed(fn, iters: int) -> float:
    """Median seconds of ``fn`` (which must synchronize) over ``iters`` runs after a warm-up."""
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def bench_shape(name, layers, heads, head_dim, chunk_size, num_chunks, iters, dev):
    mla = "MLA" in name
    num_blocks = max(2 * num_chunks * chunk_size // BLOCK, 64)
    storage, specs = make_engine_cache(layers, heads, head_dim, num_blocks, mla, dev)
    lay = group_layers(specs, [KVGroupSpec(gid=0, tokens_per_block=BLOCK)], chunk_size, [storage.numel()])
    ob = lay.object_bytes
    eng = CudaTransferEngine(lay, [storage.data_ptr()], [storage.numel()], dev)
    ids = torch.randperm(num_blocks)[: num_chunks * chunk_size // BLOCK].tolist()
    bpc = chunk_size // BLOCK
    host = torch.empty(num_chunks * ob, dtype=torch.uint8).pin_memory()
    staging = [torch.empty(ob, dtype=torch.uint8, device=dev) for _ in range(2)]
    big_dev = torch.empty(num_chunks * ob, dtype=torch.uint8, device=dev)
    s_gather, s_copy = torch.cuda.Stream(), torch.cuda.Stream()
    total = num_chunks * ob
    res = {"shape": name, "chunk_tokens": chunk_size, "object_bytes": ob, "chunks": num_chunks,
           "engine": eng.name}

    # roofline: one pinned memcpy of the same bytes each way, and both at once
    def d2h():
        host.copy_(big_dev, non_blocking=True)
        torch.cuda.synchronize()

    def h2d():
        big_dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()

    host2 = torch.empty_like(host).pin_memory()
    big_dev2 = torch.empty_like(big_dev)

    def bidir():
        with torch.cuda.stream(s_gather):
            host.copy_(big_dev, non_blocking=True)
        with torch.cuda.stream(s_copy):
            big_dev2.copy_(host2, non_blocking=True)
        torch.cuda.synchronize()

    res["roofline_d2h_gbps"] = total / timed(d2h, iters) / 1e9
    res["roofline_h2d_gbps"] = total / timed(h2d, iters) / 1e9
    res["roofline_bidir_gbps"] = 2 * total / timed(bidir, iters) / 1e9

    done = [torch.cuda.Event() for _ in range(2)]

    def store_stream():
        for j in range(num_chunks):
            st = staging[j % 2]
            s_gather.wait_event(done[j % 2]) if j >= 2 else None
            eng.copy(st, [ids[j * bpc:(j + 1) * bpc]], 1, True, s_gather)
            ev = torch.cuda.Event()
            ev.record(s_gather)
            s_copy.wait_event(ev)
            with torch.cuda.stream(s_copy):
                host[j * ob:(j + 1) * ob].copy_(st, non_blocking=True)
            done[j % 2].record(s_copy)
        torch.cuda.synchronize()

    def retrieve_stream():
        for j in range(num_chunks):
            st = staging[j % 2]
            s_copy.wait_event(done[j % 2]) if j >= 2 else None
            with torch.cuda.stream(s_copy):
                st.copy_(host[j * ob:(j + 1) * ob], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(s_copy)
            s_gather.wait_event(ev)
            eng.copy(st, [ids[j * bpc:(j + 1) * bpc]], 1, False, s_gather)
            done[j % 2].record(s_gather)
        torch.cuda.synchronize()

    res["store_stream_gbps"] = total / timed(store_stream, iters) / 1e9
    res["retrieve_stream_gbps"] = total / timed(retrieve_stream, iters) / 1e9

    one = host[:ob]

    def lone_store():
        eng.copy(staging[0], [ids[:bpc]], 1, True, s_gather)
        with torch.cuda.stream(s_gather):
            one.copy_(staging[0], non_blocking=True)
        s_gather.synchronize()

    def lone_memcpy():
        with torch.cuda.stream(s_gather):
            one.copy_(staging[0], non_blocking=True)
        s_gather.synchronize()

    t_lone, t_mem = timed(lone_store, iters * 4), timed(lone_memcpy, iters * 4)
    res["lone_store_us"] = t_lone * 1e6
    res["lone_memcpy_us"] = t_mem * 1e6
    res["lone_overhead_us"] = (t_lone - t_mem) * 1e6

    # gather kernel alone (device -> device) vs a device memcpy of the same bytes
    def gather_only():
        eng.copy(big_dev, [ids], num_chunks, True, s_gather)
        s_gather.synchronize()

    def dev_memcpy():
        big_dev2.copy_(big_dev)
        torch.cuda.synchronize()

    res["gather_kernel_gbps"] = total / timed(gather_only, iters) / 1e9
    res["device_memcpy_gbps"] = 2 * total / timed(dev_memcpy, iters) / 1e9 / 2

    # baseline: per-layer torch index_select into staging + one D2H copy, chunk by chunk
    if not mla:
        views = [torch.as_strided(storage, (num_blocks, BLOCK * heads * 4 * head_dim), (BLOCK * heads * 4 * head_dim, 1),
                                  sp.offset_bytes) for sp in specs]
    else:
        views = [torch.as_strided(storage, (num_blocks, BLOCK * 2 * head_dim), (BLOCK * 2 * head_dim, 1),
                                  sp.offset_bytes) for sp in specs]
    per_layer = views[0].shape[1] * bpc
    base_stage = torch.empty((layers, bpc, views[0].shape[1]), dtype=torch.int8, device=dev)

    def baseline_store():
        for j in range(num_chunks):
            idx = torch.tensor(ids[j * bpc:(j + 1) * bpc], device=dev)
            for li, v in enumerate(views):
                torch.index_select(v, 0, idx, out=base_stage[li])
            host[j * ob:j * ob + layers * per_layer].view(torch.int8).copy_(base_stage.view(-1), non_blocking=True)
        torch.cuda.synchronize()

    res["baseline_torch_store_gbps"] = total / timed(baseline_store, iters) / 1e9
    for k in ("store_stream_gbps", "retrieve_stream_gbps"):
        roof = res["roofline_d2h_gbps"] if k.startswith("store") else res["roofline_h2d_gbps"]
        res[k.replace("_gbps", "_vs_roofline")] = res[k] / roof
    res["store_vs_baseline_torch"] = res["store_stream_gbps"] / res["baseline_torch_store_gbps"]
    storage = big_dev = big_dev2 = host = host2 = None  # free (the closures hold these cells) before empty_cache
    torch.cuda.empty_cache()
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chunk-sizes", default="64,256,2048")
    p.add_argument("--bytes-per-point", type=float, default=512e6, help="bytes moved per measurement")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows = []
    for name, layers, heads, hd in SHAPES:
        for cs in [int(x) for x in args.chunk_sizes.split(",")]:
            tok_bytes = layers * (hd * 2 if "MLA" in name else heads * hd * 4)
            n = max(2, min(64, int(args.bytes_per_point // (tok_bytes * cs))))
            r = bench_shape(name, layers, heads, hd, cs, n, args.iters, dev)
            rows.append(r)
            print(f"{name:<20} chunk {cs:>5} ({r['object_bytes'] / 2**20:7.2f} MiB x {n:>2}) "
                  f"store {r['store_stream_gbps']:6.1f} GB/s ({100 * r['store_stream_vs_roofline']:5.1f}% of "
                  f"{r['roofline_d2h_gbps']:.1f})  retrieve {r['retrieve_stream_gbps']:6.1f} GB/s "
                  f"({100 * r['retrieve_stream_vs_roofline']:5.1f}% of {r['roofline_h2d_gbps']:.1f})  "
                  f"torch baseline {r['baseline_torch_store_gbps']:6.1f} (x{r['store_vs_baseline_torch']:.2f})  "
                  f"lone +{r['lone_overhead_us']:.0f} us  gather kernel {r['gather_kernel_gbps']:.0f} GB/s "
                  f"(dev memcpy {r['device_memcpy_gbps']:.0f})", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "results": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
