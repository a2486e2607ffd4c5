// Part of kvdepot_kernels.cu (included there, inside its extern "C" block: one translation
// unit, so the static helpers stay shared): the daemon's DMA lanes, their issuer and watcher
// threads.

// ---------------------------------------------------------------------------------------------
// Whole-request transfers (ABI 3). The daemon's event loop makes ONE call per STORE / RETRIEVE:
// event waits, every batch's launches and copies, slot recycling and the completion note are
// enqueued here, so the Python cost per request does not grow with layers, groups or chunks.
//
// A lane is one direction on one GPU: a kernel stream, a DMA stream, `nslots` device staging
// slots and a watcher thread that reports each request's completion to the daemon's pipe
// (polling the request's last event; a cudaLaunchHostFunc note per request, the earlier design,
// cost two more event records, two waits and the launch on the event loop's thread). STORE per batch of chunks:
//   kernel: wait slot free -> gather launches -> record handoff
//   dma:    wait handoff -> D2H staging -> each host object -> record slot free
// RETRIEVE per batch: dma: wait slot free -> H2D -> record handoff; kernel: wait handoff ->
// scatter launches -> record slot free; then the out event (the engine waits on it) on kernel.
// Events are created once and re-recorded: a wait captures the record current when it is
// enqueued, so re-recording never changes waits already enqueued.

#define KVD_MAX_SLOTS 8

// A kvd_dma request waiting for its engine's fence word (see KvdLane::deferred).
struct KvdDeferred {
  const uint64_t* word;  // host memory the engine's GPU writes `value` into after its gather
  uint64_t value;
  std::vector<uint64_t> srcs, dsts;
  uint64_t bytes;
  int to_host;
  cudaEvent_t out_event;
  int fd;
  uint64_t token;
  int64_t since_ns;
  bool cancelled;
  uint64_t landed_word, landed_value;  // see dma_issue
};

// A completion to report: when `ev` has completed, write `token` (bit 63 set if the GPU
// reported an error) to `fd`.
struct KvdWatch {
  cudaEvent_t ev;
  int fd;
  uint64_t token;
  int64_t bytes;      // bytes the request moves over PCIe (0: unknown)
  int64_t start_ns;   // when the lane should start on it: max(enqueue, previous expected end)
  int64_t expect_ns;  // expected completion at the lane's observed rate
};

struct KvdLane {
  int device = 0;
  cudaStream_t ks = nullptr, ds = nullptr;
  int nslots = 0, next = 0;
  uint64_t slot_bytes = 0;
  uint8_t* staging[KVD_MAX_SLOTS] = {};
  cudaEvent_t slot_free[KVD_MAX_SLOTS] = {};
  cudaEvent_t handoff[KVD_MAX_SLOTS] = {};
  int slot_used[KVD_MAX_SLOTS] = {};
  cudaEvent_t join = nullptr;  // joins the kernel stream into the DMA stream on error paths
  // completion watcher: one thread per lane polls the oldest pending request's event (requests
  // complete in order on a lane) and writes its token to the daemon's pipe; it sleeps on `cv`
  // while nothing is pending
  std::mutex mu;
  std::condition_variable cv;
  std::deque<KvdWatch> pending;
  std::vector<cudaEvent_t> spare_events;
  bool stop = false;
  std::thread watcher;
  // expected-completion model (under mu): the watcher sleeps until shortly before a request
  // should end and spins from there, instead of polling all along
  double ns_per_byte = 1.0 / 60.0;  // observed PCIe time per byte, starts at 60 GB/s (optimistic)
  int64_t busy_until_ns = 0;        // expected end of the last request queued
  cudaEvent_t piece = nullptr;      // hand-off between the streams per piece (re-recorded)
  // deferred DMA (kvd_dma): a request whose engine fence word does not hold its value yet is
  // queued here; the issuer thread polls the words from the CPU and enqueues each request's
  // copies once its word holds the value, so the DMA stream never waits on another process
  // (see kvd_engine_signal for why words and not interprocess events). Under issue_mu: the
  // queue and every enqueue on ds by kvd_dma.
  std::mutex issue_mu;
  std::condition_variable issue_cv;
  std::deque<struct KvdDeferred> deferred;
  bool issue_stop = false;
  std::thread issuer;
};

#define KVD_MAX_PIECES 64
#define KVD_DEFAULT_PIECE_BYTES (8ull << 20)

struct KvdEngine {
  int device;
  int ngroups;
  int64_t chunk_size, object_bytes;
  // a chunk larger than the piece size moves in pieces (token ranges of every group) so that
  // gathering piece p+1 overlaps the PCIe copy of piece p (scatter / H2D likewise); tokens of
  // piece p: [piece_tok[p], piece_tok[p+1])
  int npieces;
  int64_t piece_tok[KVD_MAX_PIECES + 1];
  KvdGroupDesc* desc;         // [ngroups]
  uint64_t** layer_ptrs_dev;  // [ngroups] device arrays of num_layers pointers
  int* vec;                   // [ngroups] widest word, for 256-byte aligned staging
  // device copies of gated scatters' landed words (kvd_engine_scatter_gated), one per ring
  // region number modulo KVD_GATE_SLOTS: the scatter's CTAs read the copy, not host memory
  unsigned long long* gate_counts;
};
#define KVD_GATE_SLOTS 4096

static const unsigned kEventFlags = cudaEventDisableTiming;

static int64_t now_ns() {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

// Watch the oldest pending request (requests complete in order on a lane). It sleeps until
// 40 us before the request's expected end (bytes at the lane's observed rate), spins on the
// event from there, and after 300 us past the expected end polls every 5 us (timer slack 1 us).
// A completion is so seen within microseconds without a core spinning through every copy.
// With more requests queued behind it, it naps instead of spinning: the queued copies keep the
// link busy, so a completion seen a nap later delays nothing but its reply. The nap is an eighth
// of the next request's expected time, between KVD_WATCH_QUEUED_NAP_NS and
// KVD_WATCH_QUEUED_NAP_MAX_NS (a 32 MiB request at 55 GB/s: ~75 us).
#define KVD_WATCH_QUEUED_NAP_NS 20000LL
#define KVD_WATCH_QUEUED_NAP_MAX_NS 100000LL
static void watcher_main(KvdLane* lane) {
  cudaSetDevice(lane->device);
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  prctl(PR_SET_NAME, "kvd-watch", 0, 0, 0);  // per-thread CPU in top / benchmarks/transfer.py
  std::unique_lock<std::mutex> lk(lane->mu);
  int64_t prev_done_ns = 0;
  for (;;) {
    lane->cv.wait(lk, [lane] { return lane->stop || !lane->pending.empty(); });
    if (lane->pending.empty()) return;  // stopping, and everything reported
    KvdWatch w = lane->pending.front();
    const bool queued = lane->pending.size() > 1;
    int64_t queued_nap_ns = KVD_WATCH_QUEUED_NAP_NS;
    if (queued) {
      const KvdWatch& next = lane->pending[1];
      const int64_t eighth = (next.expect_ns - next.start_ns) / 8;
      if (eighth > queued_nap_ns) queued_nap_ns = eighth < KVD_WATCH_QUEUED_NAP_MAX_NS ? eighth : KVD_WATCH_QUEUED_NAP_MAX_NS;
    }
    lk.unlock();
    cudaError_t e;
    while ((e = cudaEventQuery(w.ev)) == cudaErrorNotReady) {
      const int64_t now = now_ns();
      int64_t nap = 0;
      if (now < w.expect_ns - 40000) {
        nap = w.expect_ns - 40000 - now;
        if (nap > 500000) nap = 500000;
      } else if (now > w.expect_ns + 300000) {
        nap = 5000;
      }
      if (queued && nap < queued_nap_ns) nap = queued_nap_ns;
      if (nap > 0) {
        struct timespec d = {0, (long)nap};
        nanosleep(&d, nullptr);
      }
    }
    const int64_t done = now_ns();
    lk.lock();  // off the pending list before the token goes out: the lane is idle once it is read
    lane->pending.pop_front();
    lane->spare_events.push_back(w.ev);
    const int64_t began = w.start_ns > prev_done_ns ? w.start_ns : prev_done_ns;
    if (e == cudaSuccess && w.bytes >= (4 << 20) && done > began) {
      double r = (double)(done - began) / (double)w.bytes;
      if (r < 1.0 / 400.0) r = 1.0 / 400.0;  // never expect more than 400 GB/s
      lane->ns_per_byte = 0.75 * lane->ns_per_byte + 0.25 * r;
    }
    prev_done_ns = done;
    lk.unlock();
    write_token(w.fd, e == cudaSuccess ? w.token : (w.token | (1ULL << 63)));
    lk.lock();
  }
}

// Report `token` to `fd` once the work enqueued so far on `last` completed.
static int lane_watch(KvdLane* lane, cudaStream_t last, int fd, uint64_t token, int64_t bytes) {
  cudaEvent_t ev = nullptr;
  {
    std::lock_guard<std::mutex> g(lane->mu);
    if (!lane->spare_events.empty()) {
      ev = lane->spare_events.back();
      lane->spare_events.pop_back();
    }
  }
  int rc = ev ? KVD_OK : kvd_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  if (rc) return rc;
  rc = kvd_check(cudaEventRecord(ev, last));
  std::lock_guard<std::mutex> g(lane->mu);
  if (rc) {
    lane->spare_events.push_back(ev);
    return rc;
  }
  const int64_t now = now_ns();
  const int64_t start = lane->busy_until_ns > now ? lane->busy_until_ns : now;
  const int64_t expect = start + (int64_t)((double)bytes * lane->ns_per_byte);
  lane->busy_until_ns = expect;
  lane->pending.push_back(KvdWatch{ev, fd, token, bytes, start, expect});
  lane->cv.notify_one();
  return KVD_OK;
}

// Enqueue one kvd_dma request's copies on ds, then (landed_word not 0: a gated scatter waits in
// the engine for it, kvd_engine_scatter_gated) the driver's write of landed_value into that
// word (device address of the engine's fence memory mapped here), then its out event and its
// completion watch: the completion reported means the word was written. Caller holds
// issue_mu. `*notified` = 1 once the watch is queued (its token will be written).
static int dma_issue(KvdLane* lane, const uint64_t* srcs, const uint64_t* dsts, uint64_t bytes, int64_t n,
                     int to_host, cudaEvent_t out_event, int fd, uint64_t token, int* notified,
                     uint64_t landed_word, uint64_t landed_value) {
  const cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  int rc = KVD_OK;
  // Copies that continue the one before on both sides (a batched request's chunks: one staging
  // region, and L1 extents the first-fit allocator handed out back to back) go as one: each
  // cudaMemcpyAsync leaves the copy engine idle a few us between copies. L1 keeps a free page at
  // the end of each page-locked segment, so a merged copy never spans two registrations.
  for (int64_t k = 0; !rc && k < n;) {
    const uint64_t s = srcs[k], d = dsts[k];
    uint64_t len = bytes;
    int64_t j = k + 1;
    while (j < n && srcs[j] == s + len && dsts[j] == d + len) {
      len += bytes;
      ++j;
    }
    rc = kvd_check(cudaMemcpyAsync(reinterpret_cast<void*>(d), reinterpret_cast<const void*>(s), len, kind, lane->ds));
    k = j;
  }
  if (!rc && landed_word != 0) {
    std::call_once(g_memops_once, resolve_memops);
    if (g_write64 == nullptr)
      rc = KVD_EINVAL;
    else if (g_write64(reinterpret_cast<CUstream>(lane->ds), (CUdeviceptr)landed_word, landed_value,
                       CU_STREAM_WRITE_VALUE_DEFAULT) != CUDA_SUCCESS)
      rc = KVD_ECUDA;
  }
  if (!rc && out_event != nullptr) rc = kvd_check(cudaEventRecord(out_event, lane->ds));
  // a failed enqueue is reported through the watch too (bit 63): the request completes once
  // what was enqueued has drained, as failed
  const int nrc = lane_watch(lane, lane->ds, fd, rc ? (token | (1ULL << 63)) : token, n * (int64_t)bytes);
  if (nrc == KVD_OK) *notified = 1;
  return rc ? rc : nrc;
}

#define KVD_DEFER_TIMEOUT_NS 30000000000LL  // a word not written after 30 s fails its request (nothing copied)
#define KVD_DEFER_SPIN_NS 300000LL           // spin this long on a fresh deferred request first
#define KVD_NOT_COPIED_BIT (1ULL << 62)      // token bit: failed before any copy (cancelled / timed out)

#define KVD_FENCE_ABANDONED_BIT (1ULL << 63)  // word = value | this: the engine gave the gather up (copy nothing)

static bool word_holds(const KvdDeferred& d) { return __atomic_load_n(d.word, __ATOMIC_ACQUIRE) == d.value; }
static bool word_abandoned(const KvdDeferred& d) {
  return __atomic_load_n(d.word, __ATOMIC_ACQUIRE) == (d.value | KVD_FENCE_ABANDONED_BIT);
}

// The issuer thread: polls the fence words of the deferred requests from the CPU and issues
// every request whose word holds its value (in arrival order among those ready: one engine's
// late gather never holds up another engine's copies). It spins while the youngest request
// has waited less than KVD_DEFER_SPIN_NS (an engine's gather of a large chunk, 32 MiB, takes
// ~25 us with its launch, and a nap costs tens of microseconds of wake-up on a VM), then naps
// 2 us, 20 us after 1 ms, 200 us after 100 ms. A request cancelled (kvd_lane_cancel), given up
// by its engine (its word holds value | KVD_FENCE_ABANDONED_BIT), older
// than KVD_DEFER_TIMEOUT_NS or still queued at shutdown copies nothing and is reported with
// bit 62 set; a failed enqueue with bit 63.
static void issuer_main(KvdLane* lane) {
  cudaSetDevice(lane->device);
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  prctl(PR_SET_NAME, "kvd-issue", 0, 0, 0);
  std::unique_lock<std::mutex> lk(lane->issue_mu);
  for (;;) {
    lane->issue_cv.wait(lk, [lane] { return lane->issue_stop || !lane->deferred.empty(); });
    if (lane->deferred.empty()) return;  // stopping, and nothing queued
    const int64_t now = now_ns();
    int64_t youngest = INT64_MAX;
    bool progressed = false;
    for (size_t i = 0; i < lane->deferred.size();) {
      KvdDeferred& d = lane->deferred[i];
      const bool ready = !d.cancelled && word_holds(d);
      const bool dropped = !ready && (d.cancelled || lane->issue_stop || word_abandoned(d) ||
                                      now - d.since_ns > KVD_DEFER_TIMEOUT_NS);
      if (!ready && !dropped) {
        if (now - d.since_ns < youngest) youngest = now - d.since_ns;
        ++i;
        continue;
      }
      KvdDeferred job = std::move(d);
      lane->deferred.erase(lane->deferred.begin() + (std::ptrdiff_t)i);
      progressed = true;
      if (dropped) {
        write_token(job.fd, job.token | KVD_NOT_COPIED_BIT);
        continue;
      }
      int notified = 0;
      int rc = dma_issue(lane, job.srcs.data(), job.dsts.data(), job.bytes, (int64_t)job.srcs.size(), job.to_host,
                         job.out_event, job.fd, job.token, &notified, job.landed_word, job.landed_value);
      if (rc) {
        cudaGetLastError();
        if (!notified) {  // nothing will report it: wait out what was enqueued, then fail it
          cudaStreamSynchronize(lane->ds);
          cudaGetLastError();
          write_token(job.fd, job.token | (1ULL << 63));
        }  // else the watch carries the error bit
      }
    }
    if (progressed || lane->deferred.empty()) continue;
    lk.unlock();  // let kvd_dma append while this thread waits
    if (youngest > KVD_DEFER_SPIN_NS) {
      struct timespec t = {0, youngest < 1000000 ? 2000L : youngest < 100000000 ? 20000L : 200000L};
      nanosleep(&t, nullptr);
    }
    lk.lock();
  }
}

// Fail every deferred request of `lane` whose fence word lies in [lo, hi) (an engine's words,
// when its registration closes): they copy nothing and are reported with bit 62 set. Returns
// how many were cancelled (their tokens follow), or -1 for bad arguments.
int kvd_lane_cancel(KvdLane* lane, const void* lo, const void* hi) {
  if (lane == nullptr) return -1;
  int n = 0;
  {
    std::lock_guard<std::mutex> g(lane->issue_mu);
    for (KvdDeferred& d : lane->deferred) {
      const void* w = static_cast<const void*>(d.word);
      if (!d.cancelled && w >= lo && w < hi) {
        d.cancelled = true;
        ++n;
      }
    }
  }
  if (n) lane->issue_cv.notify_one();
  return n;
}

void kvd_lane_destroy(KvdLane* lane) {
  if (lane == nullptr) return;
  cudaSetDevice(lane->device);
  if (lane->issuer.joinable()) {
    {
      std::lock_guard<std::mutex> g(lane->issue_mu);
      lane->issue_stop = true;
    }
    lane->issue_cv.notify_one();
    lane->issuer.join();  // fails what is still deferred first (bit 62)
  }
  if (lane->ks) cudaStreamSynchronize(lane->ks);
  if (lane->ds) cudaStreamSynchronize(lane->ds);
  if (lane->watcher.joinable()) {
    {
      std::lock_guard<std::mutex> g(lane->mu);
      lane->stop = true;
    }
    lane->cv.notify_one();
    lane->watcher.join();  // reports what is still pending first
  }
  for (cudaEvent_t ev : lane->spare_events) cudaEventDestroy(ev);
  for (int i = 0; i < lane->nslots; ++i) {
    if (lane->staging[i]) cudaFree(lane->staging[i]);
    if (lane->slot_free[i]) cudaEventDestroy(lane->slot_free[i]);
    if (lane->handoff[i]) cudaEventDestroy(lane->handoff[i]);
  }
  if (lane->join) cudaEventDestroy(lane->join);
  if (lane->piece) cudaEventDestroy(lane->piece);
  if (lane->ks) cudaStreamDestroy(lane->ks);
  if (lane->ds) cudaStreamDestroy(lane->ds);
  cudaGetLastError();
  delete lane;
}

// A lane on `device` with `nslots` (1..8) staging slots of `slot_bytes` each.
int kvd_lane_create(int device, uint64_t slot_bytes, int nslots, KvdLane** out) {
  if (out == nullptr || nslots < 1 || nslots > KVD_MAX_SLOTS || slot_bytes == 0) return KVD_EINVAL;
  int rc = kvd_check(cudaSetDevice(device));
  if (!rc) rc = preload_kernels(device);
  if (rc) return rc;
  KvdLane* lane = new (std::nothrow) KvdLane();
  if (lane == nullptr) return KVD_EINVAL;
  lane->device = device;
  lane->nslots = nslots;
  lane->slot_bytes = slot_bytes;
  rc = kvd_check(cudaStreamCreateWithFlags(&lane->ks, cudaStreamNonBlocking));
  if (!rc) rc = kvd_check(cudaStreamCreateWithFlags(&lane->ds, cudaStreamNonBlocking));
  if (!rc) rc = kvd_check(cudaEventCreateWithFlags(&lane->join, kEventFlags));
  if (!rc) rc = kvd_check(cudaEventCreateWithFlags(&lane->piece, kEventFlags));
  for (int i = 0; !rc && i < nslots; ++i) {
    rc = kvd_check(cudaMalloc(reinterpret_cast<void**>(&lane->staging[i]), slot_bytes));
    if (!rc) rc = kvd_check(cudaEventCreateWithFlags(&lane->slot_free[i], kEventFlags));
    if (!rc) rc = kvd_check(cudaEventCreateWithFlags(&lane->handoff[i], kEventFlags));
  }
  if (!rc) {
    try {
      lane->watcher = std::thread(watcher_main, lane);
      lane->issuer = std::thread(issuer_main, lane);
    } catch (...) {
      rc = KVD_EINVAL;
    }
  }
  if (rc) {
    kvd_lane_destroy(lane);
    return rc;
  }
  *out = lane;
  return KVD_OK;
}

// Grow every slot to at least `slot_bytes` (waits for the lane's pending work: call it at
// registration, not per request).
int kvd_lane_reserve(KvdLane* lane, uint64_t slot_bytes) {
  if (lane == nullptr) return KVD_EINVAL;
  if (slot_bytes <= lane->slot_bytes) return KVD_OK;
  int rc = kvd_check(cudaSetDevice(lane->device));
  if (!rc) rc = kvd_check(cudaStreamSynchronize(lane->ks));
  if (!rc) rc = kvd_check(cudaStreamSynchronize(lane->ds));
  if (rc) return rc;
  for (int i = 0; i < lane->nslots; ++i) {
    uint8_t* p = nullptr;
    rc = kvd_check(cudaMalloc(reinterpret_cast<void**>(&p), slot_bytes));
    if (rc) return rc;  // slots grown so far stay grown; slot_bytes stays the old minimum
    cudaFree(lane->staging[i]);
    lane->staging[i] = p;
  }
  lane->slot_bytes = slot_bytes;
  return KVD_OK;
}

uint64_t kvd_lane_slot_bytes(const KvdLane* lane) { return lane ? lane->slot_bytes : 0; }
