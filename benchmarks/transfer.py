"""End-to-end STORE / RETRIEVE benchmark through a running kvdepot daemon (CUDA engines).

This process is the engine: it holds a paged KV cache on the GPU (vLLM 0.33 layouts, via
`ShmKVCache(device="cuda")`), registers it with a daemon in another process (real CUDA IPC,
engine-side staging by default) and times requests from "request sent" to "data in place":

* STORE: the reply comes once the chunk is in the daemon's pinned L1 (the engine's gather into
  its staging ring runs on its stream; the daemon copies the region once the GPU wrote the
  request's fence word);
* RETRIEVE: the reply comes once the daemon's copies into the ring completed; the clock stops
  after the scatter out of it, ``stream.synchronize()``, i.e. when the blocks hold the data.

Per (shape, chunk size) it measures, in the same run and on the same bytes:

* roofline: one pinned ``cudaMemcpy`` of all the point's bytes D2H, H2D, and both at once;
* store / retrieve streams: N distinct one-chunk requests, ``--outstanding`` of them in flight
  per direction: by default one thread per direction pipelines them on one client
  (``submit_store`` / ``submit_retrieve``, as an engine's worker would), or with
  ``--client-mode threads`` one blocking request per thread; GB/s = object bytes / wall time;
* both at once: one direction storing new chunks while the other retrieves stored ones;
* lone request: median latency of one-chunk requests minus the bytes' time on the link
  (object bytes / roofline GB/s) = overhead, next to the median of a bare ZMQ ipc round trip
  (DEALER <-> ROUTER echo in a subprocess) and of the daemon's ping. Clients talk to the
  daemon over its stream socket (see kvdepot/protocol/transport.py);
* baselines in this process: per-layer torch ``index_select`` into staging + one copy
  (``index_copy_`` for retrieve), and batched DMA of raw pages (``cuMemcpyBatchAsync``, one
  copy per (layer, block) page; a per-page ``cuMemcpyAsync`` loop where the batch API is
  missing).

One row per point is printed, the goals are checked at the end (`transfer_bench.report`), and
everything is written as JSON (rewritten after each row). The daemon is started here
(``--pin-l1``) unless ``--endpoint`` is given; set ``KVDEPOT_KERNELS_SO``
(``.kbuild/libkvdepot_kernels.so`` is used when present). The parts live in
benchmarks/transfer_bench/.

    python benchmarks/transfer.py --out benchmarks/results/transfer_h200.json
    python benchmarks/transfer.py --quick
"""

from __future__ import annotations

import sys

from transfer_bench import main as _main

_main.DESCRIPTION = __doc__

if __name__ == "__main__":
    sys.exit(_main.main())
