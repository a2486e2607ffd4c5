// kvdepot transfer kernels: gather engine KV blocks into the flat staging buffer in the
// canonical object format, and scatter them back.
//
// Built by nvcc into libkvdepot_kernels.so that links only the CUDA runtime (statically) and
// exposes the small C ABI below, called from Python through ctypes with raw device pointers
// and a cudaStream_t. No libtorch linkage, so one build serves every torch version.
//
// One layer group (see kvdepot/gpu/layout.py) per launch. Engine side, layer l of the group:
//
//   byte(l, block b, token n, head h, kv k, x) = layer_ptrs[l] + b*block_stride + n*token_stride
//                                                + h*head_stride + k*kv_stride + x,  x < row_bytes
//
// Staging side: chunk j is object j (object_bytes apart); inside it the group occupies
//
//   object_offset + ((t*L + l)*H*KV + h*KV + k)*row_bytes + x,   t = i*N + n (token in chunk)
//
// i.e. [chunk_tokens, L, H, KV, row] token-major. Grid: x = block slot (chunk j, block i of the
// chunk, slot = j*blocks_per_chunk + i, starting at first_slot so leading blocks can be
// skipped), y = layer. Each CTA moves one (block, layer): N*H*KV rows. Copies use the widest
// of 16/8/4/2/1-byte words that divides every stride, offset, row and pointer.

#include <cuda.h>  // driver types only (cuStreamWriteValue64 is resolved at run time)
#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>
#include <time.h>
#include <sys/prctl.h>

#include <condition_variable>
#include <deque>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

extern "C" {

struct KvdGroupDesc {
  int64_t num_layers;        // L
  int64_t block_size;        // N, tokens per block
  int64_t num_heads;         // H
  int64_t num_kv;            // KV: 2 (K, V) or 1 (MLA / packed rows)
  int64_t row_bytes;         // contiguous bytes of one (token, head, kv) row
  int64_t block_stride;      // bytes
  int64_t token_stride;      // bytes
  int64_t head_stride;       // bytes
  int64_t kv_stride;         // bytes
  int64_t object_offset;     // bytes: where the group starts inside an object
  int64_t object_bytes;      // bytes of one whole object (all groups)
  int64_t blocks_per_chunk;  // chunk_size / N
};

enum {
  KVD_OK = 0,
  KVD_EINVAL = 1,      // bad descriptor / arguments
  KVD_EALIGN = 2,      // vec_bytes does not divide the strides / pointers
  KVD_ECUDA = 3,       // a CUDA runtime error (see kvd_last_cuda_error)
};

}  // extern "C"

static thread_local cudaError_t g_last_cuda_error = cudaSuccess;

// Block ids travel inside the launch's parameters (no host->device copy, no pinned buffer to
// recycle): up to KVD_INLINE_IDS per launch; kvd_copy_blocks splits longer lists.
// The parameter block is sized to the launch (16, 128 or 900 ids): the driver copies it into
// every launch, and a 3.6 KB block cost measurably more per launch than a small one.
#define KVD_INLINE_IDS 900
template <int N>
struct KvdInlineIds {
  int32_t v[N];
};

template <typename Word, int N>
__global__ void kvd_copy_kernel(KvdGroupDesc d, const uint64_t* __restrict__ layer_ptrs, KvdInlineIds<N> ids,
                                int64_t first_slot, uint8_t* __restrict__ staging, int to_staging) {
  const int64_t slot = first_slot + blockIdx.x;
  const int64_t layer = blockIdx.y;
  const int64_t j = slot / d.blocks_per_chunk;
  const int64_t i = slot - j * d.blocks_per_chunk;
  const int64_t b = ids.v[blockIdx.x];
  if (b < 0) return;  // a block left alone (a retrieve's -1: vLLM's null block)
  const int hk_count = (int)(d.num_heads * d.num_kv);
  const int words_per_row = (int)(d.row_bytes / sizeof(Word));
  const int rows = (int)d.block_size * hk_count;
  const int total = rows * words_per_row;

  uint8_t* eng = reinterpret_cast<uint8_t*>(layer_ptrs[layer]) + b * d.block_stride;
  uint8_t* obj = staging + j * d.object_bytes + d.object_offset;
  const int64_t t0 = i * d.block_size;

  for (int idx = threadIdx.x; idx < total; idx += blockDim.x) {
    const int r = idx / words_per_row;
    const int w = idx - r * words_per_row;
    const int n = r / hk_count;
    const int hk = r - n * hk_count;
    const int h = hk / (int)d.num_kv;
    const int k = hk - h * (int)d.num_kv;
    Word* e = reinterpret_cast<Word*>(eng + n * d.token_stride + h * d.head_stride + k * d.kv_stride) + w;
    Word* o = reinterpret_cast<Word*>(
                  obj + (((t0 + n) * d.num_layers + layer) * hk_count + hk) * d.row_bytes) + w;
    if (to_staging) {
      *o = *e;
    } else {
      *e = *o;
    }
  }
}

static bool divides(int64_t v, int64_t x) { return x % v == 0; }

extern "C" {

// Widest word (16, 8, 4, 2, 1 bytes) usable for this group with these pointers.
int kvd_vec_bytes(const KvdGroupDesc* d, const uint64_t* layer_ptrs_host, int64_t num_layer_ptrs,
                  uint64_t staging) {
  for (int v = 16; v > 1; v /= 2) {
    bool ok = divides(v, d->row_bytes) && divides(v, d->block_stride) && divides(v, d->token_stride) &&
              divides(v, d->head_stride) && divides(v, d->kv_stride) && divides(v, d->object_offset) &&
              divides(v, d->object_bytes) && divides(v, (int64_t)staging);
    for (int64_t l = 0; ok && l < num_layer_ptrs; ++l) ok = divides(v, (int64_t)layer_ptrs_host[l]);
    if (ok) return v;
  }
  return 1;
}

// Slot -> block id for a launch: ids are block_ids[chunk_map(slot / bpc) * bpc + slot % bpc],
// with chunk_map the identity when `chunks` is null (the ids are already in slot order).
struct KvdIdSource {
  const int32_t* ids;     // host array
  const int32_t* chunks;  // host array of source chunk indices per staging object, or null
  int64_t chunk_base;     // added to the staging object index before mapping
  int64_t bpc;
  inline int32_t at(int64_t slot) const {
    if (chunks == nullptr && chunk_base == 0) return ids[slot];
    const int64_t j = slot / bpc, i = slot - j * bpc;
    const int64_t src = chunks ? chunks[chunk_base + j] : chunk_base + j;
    return ids[src * bpc + i];
  }
};

}  // extern "C"

template <int N>
static cudaError_t launch_n(const KvdGroupDesc* d, const uint64_t* layer_ptrs, const KvdIdSource& src, int64_t s0,
                            int64_t n, uint8_t* st, int to_staging, int vec_bytes, int threads_per_cta,
                            cudaStream_t stream) {
  KvdInlineIds<N> ids;
  for (int64_t k = 0; k < n; ++k) ids.v[k] = src.at(s0 + k);
  dim3 grid((unsigned)n, (unsigned)d->num_layers);
  switch (vec_bytes) {
    case 16: kvd_copy_kernel<uint4, N><<<grid, threads_per_cta, 0, stream>>>(*d, layer_ptrs, ids, s0, st, to_staging); break;
    case 8: kvd_copy_kernel<uint2, N><<<grid, threads_per_cta, 0, stream>>>(*d, layer_ptrs, ids, s0, st, to_staging); break;
    case 4: kvd_copy_kernel<uint32_t, N><<<grid, threads_per_cta, 0, stream>>>(*d, layer_ptrs, ids, s0, st, to_staging); break;
    case 2: kvd_copy_kernel<uint16_t, N><<<grid, threads_per_cta, 0, stream>>>(*d, layer_ptrs, ids, s0, st, to_staging); break;
    default: kvd_copy_kernel<uint8_t, N><<<grid, threads_per_cta, 0, stream>>>(*d, layer_ptrs, ids, s0, st, to_staging); break;
  }
  return cudaGetLastError();
}

extern "C" {

static int launch_copy(const KvdGroupDesc* d, const uint64_t* layer_ptrs, const KvdIdSource& src,
                       int64_t first_slot, int64_t num_slots, uint8_t* st, int to_staging, int vec_bytes,
                       int threads_per_cta, cudaStream_t stream) {
  for (int64_t s0 = first_slot; s0 < first_slot + num_slots; s0 += KVD_INLINE_IDS) {
    int64_t n = first_slot + num_slots - s0;
    if (n > KVD_INLINE_IDS) n = KVD_INLINE_IDS;
    cudaError_t err;
    if (n <= 16)
      err = launch_n<16>(d, layer_ptrs, src, s0, n, st, to_staging, vec_bytes, threads_per_cta, stream);
    else if (n <= 128)
      err = launch_n<128>(d, layer_ptrs, src, s0, n, st, to_staging, vec_bytes, threads_per_cta, stream);
    else
      err = launch_n<KVD_INLINE_IDS>(d, layer_ptrs, src, s0, n, st, to_staging, vec_bytes, threads_per_cta, stream);
    if (err != cudaSuccess) {
      g_last_cuda_error = err;
      return KVD_ECUDA;
    }
  }
  return KVD_OK;
}

static bool desc_ok(const KvdGroupDesc* d) {
  return d->num_layers > 0 && d->num_layers <= 65535 && d->block_size > 0 && d->num_heads > 0 && d->num_kv > 0 &&
         d->row_bytes > 0 && d->blocks_per_chunk > 0 &&
         d->block_size * d->num_heads * d->num_kv * d->row_bytes <= 0x7fffffff;
}

static int use_device(int device) {
  int cur = -1;
  if (cudaGetDevice(&cur) != cudaSuccess || cur != device) {
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) {
      g_last_cuda_error = e;
      return KVD_ECUDA;
    }
  }
  return KVD_OK;
}

// Copy num_slots block slots (starting at first_slot) of one layer group between engine memory
// and staging. to_staging = 1: gather (engine -> staging); 0: scatter (staging -> engine).
// layer_ptrs is a DEVICE array of num_layers pointers; block_ids is a HOST array with one int32
// block id per slot from slot 0 (only [first_slot, first_slot + num_slots) are read), passed to
// the kernel by value. vec_bytes must come from kvd_vec_bytes. device: the CUDA ordinal the
// stream belongs to. Returns KVD_OK or an error code.
int kvd_copy_blocks(const KvdGroupDesc* d, const uint64_t* layer_ptrs, const int32_t* block_ids,
                    int64_t first_slot, int64_t num_slots, void* staging, int to_staging, int vec_bytes,
                    int threads_per_cta, int device, cudaStream_t stream) {
  if (d == nullptr || layer_ptrs == nullptr || block_ids == nullptr || staging == nullptr) return KVD_EINVAL;
  if (!desc_ok(d) || first_slot < 0 || num_slots < 0) return KVD_EINVAL;
  if (num_slots == 0) return KVD_OK;
  if (threads_per_cta <= 0 || threads_per_cta > 1024) threads_per_cta = 256;
  int64_t checks[] = {d->row_bytes, d->block_stride, d->token_stride, d->head_stride, d->kv_stride,
                      d->object_offset, d->object_bytes, (int64_t)(uintptr_t)staging};
  if (vec_bytes != 1 && vec_bytes != 2 && vec_bytes != 4 && vec_bytes != 8 && vec_bytes != 16) return KVD_EINVAL;
  for (int64_t c : checks)
    if (c % vec_bytes) return KVD_EALIGN;
  int rc = use_device(device);
  if (rc) return rc;
  KvdIdSource src{block_ids, nullptr, 0, d->blocks_per_chunk};
  return launch_copy(d, layer_ptrs, src, first_slot, num_slots, static_cast<uint8_t*>(staging), to_staging,
                     vec_bytes, threads_per_cta, stream);
}

static void write_token(int fd, uint64_t token) {
  const char* p = reinterpret_cast<const char*>(&token);
  size_t left = sizeof(token);
  while (left > 0) {  // 8 bytes into a pipe are written at once; loop only on EINTR
    ssize_t w = write(fd, p, left);
    if (w > 0) {
      p += w;
      left -= (size_t)w;
    } else if (w < 0 && errno != EINTR) {
      break;
    }
  }
}

const char* kvd_last_cuda_error(void) { return cudaGetErrorString(g_last_cuda_error); }

static int kvd_check(cudaError_t err) {
  if (err != cudaSuccess) {
    g_last_cuda_error = err;
    cudaGetLastError();  // clear a sticky-free error so later calls are not poisoned
    return KVD_ECUDA;
  }
  return KVD_OK;
}

// Open another process's allocation from its cudaIpcMemHandle_t (64 bytes) on `device`.
int kvd_ipc_open_mem(const void* handle, int device, void** out_ptr) {
  if (handle == nullptr || out_ptr == nullptr) return KVD_EINVAL;
  int rc = kvd_check(cudaSetDevice(device));
  if (rc) return rc;
  cudaIpcMemHandle_t h;
  memcpy(&h, handle, sizeof(h));
  return kvd_check(cudaIpcOpenMemHandle(out_ptr, h, cudaIpcMemLazyEnablePeerAccess));
}

int kvd_ipc_close_mem(void* ptr, int device) {
  int rc = kvd_check(cudaSetDevice(device));
  if (rc) return rc;
  return kvd_check(cudaIpcCloseMemHandle(ptr));
}

// Page-lock an existing host range (the L1 arena, progressively) / undo it.
int kvd_host_register(void* ptr, size_t size_bytes) {
  return kvd_check(cudaHostRegister(ptr, size_bytes, cudaHostRegisterPortable));
}

int kvd_host_unregister(void* ptr) { return kvd_check(cudaHostUnregister(ptr)); }

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
};

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
static void watcher_main(KvdLane* lane) {
  cudaSetDevice(lane->device);
  prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0);
  std::unique_lock<std::mutex> lk(lane->mu);
  int64_t prev_done_ns = 0;
  for (;;) {
    lane->cv.wait(lk, [lane] { return lane->stop || !lane->pending.empty(); });
    if (lane->pending.empty()) return;  // stopping, and everything reported
    KvdWatch w = lane->pending.front();
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

// Enqueue one kvd_dma request's copies on ds, then its out event and its completion watch.
// Caller holds issue_mu. `*notified` = 1 once the watch is queued (its token will be written).
static int dma_issue(KvdLane* lane, const uint64_t* srcs, const uint64_t* dsts, uint64_t bytes, int64_t n,
                     int to_host, cudaEvent_t out_event, int fd, uint64_t token, int* notified) {
  const cudaMemcpyKind kind = to_host ? cudaMemcpyDeviceToHost : cudaMemcpyHostToDevice;
  int rc = KVD_OK;
  for (int64_t k = 0; !rc && k < n; ++k)
    rc = kvd_check(cudaMemcpyAsync(reinterpret_cast<void*>(dsts[k]), reinterpret_cast<const void*>(srcs[k]), bytes,
                                   kind, lane->ds));
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
                         job.out_event, job.fd, job.token, &notified);
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

static int64_t gcd64(int64_t a, int64_t b) {
  while (b) {
    const int64_t t = a % b;
    a = b;
    b = t;
  }
  return a;
}

static int64_t group_token_bytes(const KvdGroupDesc* d) {
  return d->num_layers * d->num_heads * d->num_kv * d->row_bytes;
}

// Cut a chunk into ceil(object_bytes / piece_bytes) pieces (at most KVD_MAX_PIECES) on token
// boundaries that are whole blocks of every group; piece_bytes 0 = one piece.
static void engine_set_pieces(KvdEngine* e, uint64_t piece_bytes) {
  int64_t g = 1;
  for (int i = 0; i < e->ngroups; ++i) g = g / gcd64(g, e->desc[i].block_size) * e->desc[i].block_size;
  const int64_t granules = e->chunk_size / g;
  int64_t want = piece_bytes ? (e->object_bytes + (int64_t)piece_bytes - 1) / (int64_t)piece_bytes : 1;
  if (want > granules) want = granules;
  if (want > KVD_MAX_PIECES) want = KVD_MAX_PIECES;
  if (want < 1) want = 1;
  for (int64_t k = 0; k <= want; ++k) e->piece_tok[k] = (k * granules / want) * g;
  e->npieces = (int)want;
}

// Piece size of an engine's transfers (default 8 MiB; 0 = whole chunks).
int kvd_engine_set_piece_bytes(KvdEngine* e, uint64_t piece_bytes) {
  if (e == nullptr) return KVD_EINVAL;
  engine_set_pieces(e, piece_bytes);
  return KVD_OK;
}

int kvd_engine_pieces(const KvdEngine* e) { return e ? e->npieces : 0; }

void kvd_engine_destroy(KvdEngine* e) {
  if (e == nullptr) return;
  cudaSetDevice(e->device);
  for (int g = 0; g < e->ngroups; ++g)
    if (e->layer_ptrs_dev && e->layer_ptrs_dev[g]) cudaFree(e->layer_ptrs_dev[g]);
  cudaGetLastError();
  free(e->desc);
  free(e->layer_ptrs_dev);
  free(e->vec);
  free(e);
}

// One registration's groups on `device`: descs[ngroups] and, concatenated group after group,
// the device pointer of each layer (descs[g].num_layers of them). chunk_size in tokens,
// object_bytes of one chunk object (all groups).
int kvd_engine_create(int device, const KvdGroupDesc* descs, int ngroups, const uint64_t* layer_ptrs_host,
                      int64_t chunk_size, int64_t object_bytes, KvdEngine** out) {
  if (out == nullptr || descs == nullptr || layer_ptrs_host == nullptr || ngroups < 1 || chunk_size <= 0 ||
      object_bytes <= 0)
    return KVD_EINVAL;
  for (int g = 0; g < ngroups; ++g)
    if (!desc_ok(&descs[g]) || descs[g].blocks_per_chunk * descs[g].block_size != chunk_size) return KVD_EINVAL;
  int rc = kvd_check(cudaSetDevice(device));
  if (rc) return rc;
  KvdEngine* e = static_cast<KvdEngine*>(calloc(1, sizeof(KvdEngine)));
  if (e == nullptr) return KVD_EINVAL;
  e->device = device;
  e->ngroups = ngroups;
  e->chunk_size = chunk_size;
  e->object_bytes = object_bytes;
  e->desc = static_cast<KvdGroupDesc*>(malloc(sizeof(KvdGroupDesc) * ngroups));
  e->layer_ptrs_dev = static_cast<uint64_t**>(calloc(ngroups, sizeof(uint64_t*)));
  e->vec = static_cast<int*>(calloc(ngroups, sizeof(int)));
  if (!e->desc || !e->layer_ptrs_dev || !e->vec) {
    kvd_engine_destroy(e);
    return KVD_EINVAL;
  }
  memcpy(e->desc, descs, sizeof(KvdGroupDesc) * ngroups);
  const uint64_t* p = layer_ptrs_host;
  for (int g = 0; g < ngroups; ++g) {
    const int64_t L = descs[g].num_layers;
    e->vec[g] = kvd_vec_bytes(&descs[g], p, L, 0);
    rc = kvd_check(cudaMalloc(reinterpret_cast<void**>(&e->layer_ptrs_dev[g]), L * sizeof(uint64_t)));
    if (!rc) rc = kvd_check(cudaMemcpy(e->layer_ptrs_dev[g], p, L * sizeof(uint64_t), cudaMemcpyHostToDevice));
    if (rc) {
      kvd_engine_destroy(e);
      return rc;
    }
    p += L;
  }
  engine_set_pieces(e, KVD_DEFAULT_PIECE_BYTES);
  *out = e;
  return KVD_OK;
}

// After an error part of a request may be pending on either stream: make the DMA stream wait
// for the kernel stream, so a completion watched on the DMA stream covers both.
static void lane_join(KvdLane* lane) {
  if (cudaEventRecord(lane->join, lane->ks) == cudaSuccess) cudaStreamWaitEvent(lane->ds, lane->join, 0);
  cudaGetLastError();
}

static int lane_take(KvdLane* lane, cudaStream_t producer) {
  const int s = lane->next;
  lane->next = (s + 1) % lane->nslots;
  if (lane->slot_used[s] && kvd_check(cudaStreamWaitEvent(producer, lane->slot_free[s], 0))) return -1;
  return s;
}

// Pieces pay off for a request that finds the lane idle (its gather would otherwise be exposed
// before its first byte crosses PCIe); behind other requests the lane already overlaps one
// request's gather with another's copy, and pieces would only add launches.
static bool lane_idle(KvdLane* lane) {
  std::lock_guard<std::mutex> g(lane->mu);
  return lane->pending.empty();
}

static int check_call(const KvdLane* lane, const KvdEngine* eng, const int32_t* ids, const uint64_t* host_ptrs) {
  if (lane == nullptr || eng == nullptr || ids == nullptr || host_ptrs == nullptr) return KVD_EINVAL;
  if (lane->device != eng->device || (uint64_t)eng->object_bytes > lane->slot_bytes) return KVD_EINVAL;
  return KVD_OK;
}

// STORE: gather chunks chunks[0..nchunks) of a request of `total_chunks` chunks from the
// engine's blocks into the pinned host objects host_ptrs[0..nchunks) (object_bytes each).
// ids: per group, concatenated in gid order, total_chunks * blocks_per_chunk[g] block ids in
// token order (range-checked by the caller). The engine's writes of the blocks have completed
// (its client waits for them before sending the store: no cross-process event is trusted).
// When everything completed (or failed on the GPU), `token` is written to `fd`.
// *notified = 1 once that note is enqueued: then the caller must wait for it even when an
// error is returned (some copies may be in flight); 0 means nothing will be written.
int kvd_store(KvdLane* lane, const KvdEngine* eng, const int32_t* ids, int64_t total_chunks, const int32_t* chunks,
              int64_t nchunks, const uint64_t* host_ptrs, int fd, uint64_t token, int* notified) {
  if (notified == nullptr) return KVD_EINVAL;
  *notified = 0;
  int rc = check_call(lane, eng, ids, host_ptrs);
  if (rc || chunks == nullptr || nchunks <= 0 || total_chunks <= 0) return rc ? rc : KVD_EINVAL;
  for (int64_t k = 0; k < nchunks; ++k)
    if (chunks[k] < 0 || chunks[k] >= total_chunks) return KVD_EINVAL;
  rc = use_device(lane->device);
  if (rc) return rc;
  const int64_t ob = eng->object_bytes;
  const int64_t per = (int64_t)(lane->slot_bytes / (uint64_t)ob);
  const bool pieces = eng->npieces > 1 && lane_idle(lane);
  for (int64_t b0 = 0; !rc && b0 < nchunks; b0 += per) {
    const int64_t nb = nchunks - b0 < per ? nchunks - b0 : per;
    const int s = lane_take(lane, lane->ks);
    if (s < 0) {
      rc = KVD_ECUDA;
      break;
    }
    uint8_t* st = lane->staging[s];
    if (!pieces) {  // whole chunks: one launch per group for the batch, then the copies
      const int32_t* gids = ids;
      for (int g = 0; !rc && g < eng->ngroups; ++g) {
        const KvdGroupDesc* d = &eng->desc[g];
        KvdIdSource src{gids, chunks, b0, d->blocks_per_chunk};
        rc = launch_copy(d, eng->layer_ptrs_dev[g], src, 0, nb * d->blocks_per_chunk, st, 1, eng->vec[g], 256,
                         lane->ks);
        gids += total_chunks * d->blocks_per_chunk;
      }
      if (!rc) rc = kvd_check(cudaEventRecord(lane->handoff[s], lane->ks));
      if (!rc) rc = kvd_check(cudaStreamWaitEvent(lane->ds, lane->handoff[s], 0));
      for (int64_t k = 0; !rc && k < nb; ++k)
        rc = kvd_check(cudaMemcpyAsync(reinterpret_cast<void*>(host_ptrs[b0 + k]), st + k * ob, ob,
                                       cudaMemcpyDeviceToHost, lane->ds));
    } else {  // pieces: gather piece p+1 while piece p crosses PCIe
      for (int64_t k = 0; !rc && k < nb; ++k) {
        uint8_t* host = reinterpret_cast<uint8_t*>(host_ptrs[b0 + k]);
        for (int p = 0; !rc && p < eng->npieces; ++p) {
          const int64_t t0 = eng->piece_tok[p], t1 = eng->piece_tok[p + 1];
          const int32_t* gids = ids;
          for (int g = 0; !rc && g < eng->ngroups; ++g) {
            const KvdGroupDesc* d = &eng->desc[g];
            KvdIdSource src{gids, chunks, b0, d->blocks_per_chunk};
            rc = launch_copy(d, eng->layer_ptrs_dev[g], src, k * d->blocks_per_chunk + t0 / d->block_size,
                             (t1 - t0) / d->block_size, st, 1, eng->vec[g], 256, lane->ks);
            gids += total_chunks * d->blocks_per_chunk;
          }
          if (!rc) rc = kvd_check(cudaEventRecord(lane->piece, lane->ks));
          if (!rc) rc = kvd_check(cudaStreamWaitEvent(lane->ds, lane->piece, 0));
          for (int g = 0; !rc && g < eng->ngroups; ++g) {
            const KvdGroupDesc* d = &eng->desc[g];
            const int64_t tb = group_token_bytes(d), off = d->object_offset + t0 * tb;
            rc = kvd_check(cudaMemcpyAsync(host + off, st + k * ob + off, (t1 - t0) * tb, cudaMemcpyDeviceToHost,
                                           lane->ds));
          }
        }
      }
    }
    // mark the slot used even after an error: work may be pending on it
    if (kvd_check(cudaEventRecord(lane->slot_free[s], lane->ds)) == KVD_OK) lane->slot_used[s] = 1;
  }
  if (rc) lane_join(lane);
  const int nrc = lane_watch(lane, lane->ds, fd, token, nchunks * ob);  // the gather precedes the D2H on ds
  if (nrc == KVD_OK) *notified = 1;
  return rc ? rc : nrc;
}

// RETRIEVE: copy the pinned host objects host_ptrs[0..nchunks) (chunk j = object j, the request's
// leading nchunks <= total_chunks chunks) into the engine's blocks (ids as in kvd_store), skipping the blocks of the
// first skip_tokens tokens (a multiple of every group's block size: the caller checks), then
// record out_event (or nothing if null) after the scatter. Completion note and *notified as in
// kvd_store.
int kvd_retrieve(KvdLane* lane, const KvdEngine* eng, const int32_t* ids, int64_t total_chunks, int64_t nchunks,
                 const uint64_t* host_ptrs, int64_t skip_tokens, cudaEvent_t out_event, int fd, uint64_t token,
                 int* notified) {
  if (notified == nullptr) return KVD_EINVAL;
  *notified = 0;
  int rc = check_call(lane, eng, ids, host_ptrs);
  if (rc || nchunks <= 0 || nchunks > total_chunks || skip_tokens < 0) return rc ? rc : KVD_EINVAL;
  rc = use_device(lane->device);
  if (rc) return rc;
  const int64_t ob = eng->object_bytes, cs = eng->chunk_size;
  const int64_t per = (int64_t)(lane->slot_bytes / (uint64_t)ob);
  const int64_t first = skip_tokens / cs;
  const bool pieces = eng->npieces > 1 && lane_idle(lane);
  for (int64_t b0 = first; !rc && b0 < nchunks; b0 += per) {
    const int64_t nb = nchunks - b0 < per ? nchunks - b0 : per;
    const int s = lane_take(lane, lane->ds);
    if (s < 0) {
      rc = KVD_ECUDA;
      break;
    }
    uint8_t* st = lane->staging[s];
    if (!pieces) {  // whole chunks: the copies, then one launch per group for the batch
      for (int64_t k = 0; !rc && k < nb; ++k)
        rc = kvd_check(cudaMemcpyAsync(st + k * ob, reinterpret_cast<const void*>(host_ptrs[b0 + k]), ob,
                                       cudaMemcpyHostToDevice, lane->ds));
      if (!rc) rc = kvd_check(cudaEventRecord(lane->handoff[s], lane->ds));
      if (!rc) rc = kvd_check(cudaStreamWaitEvent(lane->ks, lane->handoff[s], 0));
      const int64_t skip = skip_tokens - b0 * cs > 0 ? skip_tokens - b0 * cs : 0;
      const int32_t* gids = ids;
      for (int g = 0; !rc && g < eng->ngroups; ++g) {
        const KvdGroupDesc* d = &eng->desc[g];
        int64_t total = nb * d->blocks_per_chunk;
        int64_t first_slot = skip / d->block_size;
        if (first_slot > total) first_slot = total;
        KvdIdSource src{gids, nullptr, b0, d->blocks_per_chunk};
        rc = launch_copy(d, eng->layer_ptrs_dev[g], src, first_slot, total - first_slot, st, 0, eng->vec[g], 256,
                         lane->ks);
        gids += total_chunks * d->blocks_per_chunk;
      }
    } else {  // pieces: scatter piece p while piece p+1 crosses PCIe; skipped pieces are not copied
      for (int64_t k = 0; !rc && k < nb; ++k) {
        const uint8_t* host = reinterpret_cast<const uint8_t*>(host_ptrs[b0 + k]);
        int64_t skip_c = skip_tokens - (b0 + k) * cs;
        if (skip_c < 0) skip_c = 0;
        for (int p = 0; !rc && p < eng->npieces; ++p) {
          const int64_t t0 = eng->piece_tok[p], t1 = eng->piece_tok[p + 1];
          if (t1 <= skip_c) continue;
          for (int g = 0; !rc && g < eng->ngroups; ++g) {
            const KvdGroupDesc* d = &eng->desc[g];
            const int64_t tb = group_token_bytes(d), off = d->object_offset + t0 * tb;
            rc = kvd_check(cudaMemcpyAsync(st + k * ob + off, host + off, (t1 - t0) * tb, cudaMemcpyHostToDevice,
                                           lane->ds));
          }
          if (!rc) rc = kvd_check(cudaEventRecord(lane->piece, lane->ds));
          if (!rc) rc = kvd_check(cudaStreamWaitEvent(lane->ks, lane->piece, 0));
          const int64_t from = t0 > skip_c ? t0 : skip_c;
          const int32_t* gids = ids;
          for (int g = 0; !rc && g < eng->ngroups; ++g) {
            const KvdGroupDesc* d = &eng->desc[g];
            KvdIdSource src{gids, nullptr, b0, d->blocks_per_chunk};
            rc = launch_copy(d, eng->layer_ptrs_dev[g], src, k * d->blocks_per_chunk + from / d->block_size,
                             (t1 - from) / d->block_size, st, 0, eng->vec[g], 256, lane->ks);
            gids += total_chunks * d->blocks_per_chunk;
          }
        }
      }
    }
    if (kvd_check(cudaEventRecord(lane->slot_free[s], lane->ks)) == KVD_OK) lane->slot_used[s] = 1;
  }
  if (!rc && out_event != nullptr) rc = kvd_check(cudaEventRecord(out_event, lane->ks));
  cudaStream_t last = lane->ks;  // the scatter follows the H2D on ks
  if (rc) {
    lane_join(lane);
    last = lane->ds;
  }
  const int nrc = lane_watch(lane, last, fd, token, (nchunks - first) * ob);
  if (nrc == KVD_OK) *notified = 1;
  return rc ? rc : nrc;
}

// ---------------------------------------------------------------------------------------------
// Engine-side staging (ABI 5). Measured on an H100 without MPS (two processes, one GPU): a kernel
// the daemon launches in its own CUDA context waits for the engine's context to give up the SMs
// (a busy engine's 1.4 ms kernel delayed a daemon gather + D2H of 32 MiB from 0.66 to 2.3 ms),
// and every switch between the two contexts costs 150-250 us; a copy-engine DMA from the
// daemon's context ran beside the engine's kernels at full speed (0.66 ms, the engine's kernel
// undelayed). So the engine process runs the gather / scatter kernels on its own stream into /
// out of a device staging ring it shares with the daemon by IPC, and the daemon only moves the
// ring's bytes over PCIe on a lane's DMA stream.

int kvd_engine_signal(void* word, uint64_t value, cudaStream_t stream);

// Engine side: gather every chunk of a request (ids as in kvd_store, total_chunks chunks) into
// `dst` (chunk j at dst + j*object_bytes, dst aligned to 256 bytes) on the engine's `stream`;
// then, if `fence_word` is not null, the write of `fence_value` into it (kvd_engine_signal), so
// that a staged store costs one call. On an error nothing more is enqueued, but a group's
// gather enqueued before it may still run: the caller waits for the stream before reusing dst.
int kvd_engine_gather(const KvdEngine* eng, const int32_t* ids, int64_t total_chunks, void* dst, void* fence_word,
                      uint64_t fence_value, cudaStream_t stream) {
  if (eng == nullptr || ids == nullptr || dst == nullptr || total_chunks <= 0) return KVD_EINVAL;
  if ((uintptr_t)dst % 256 || (uintptr_t)fence_word % 8) return KVD_EALIGN;
  int rc = use_device(eng->device);
  const int32_t* gids = ids;
  for (int g = 0; !rc && g < eng->ngroups; ++g) {
    const KvdGroupDesc* d = &eng->desc[g];
    KvdIdSource src{gids, nullptr, 0, d->blocks_per_chunk};
    rc = launch_copy(d, eng->layer_ptrs_dev[g], src, 0, total_chunks * d->blocks_per_chunk,
                     static_cast<uint8_t*>(dst), 1, eng->vec[g], 256, stream);
    gids += total_chunks * d->blocks_per_chunk;
  }
  if (!rc && fence_word != nullptr) rc = kvd_engine_signal(fence_word, fence_value, stream);
  return rc;
}

// Engine side: scatter the request's leading `nchunks` chunks (of total_chunks; ids as in
// kvd_store) from `src` (chunk j at src + j*object_bytes) into the engine's blocks on `stream`,
// skipping the blocks of the first skip_tokens tokens (a multiple of every group's block size).
int kvd_engine_scatter(const KvdEngine* eng, const int32_t* ids, int64_t total_chunks, int64_t nchunks,
                       const void* src_staging, int64_t skip_tokens, cudaStream_t stream) {
  if (eng == nullptr || ids == nullptr || src_staging == nullptr || nchunks <= 0 || nchunks > total_chunks ||
      skip_tokens < 0)
    return KVD_EINVAL;
  if ((uintptr_t)src_staging % 256) return KVD_EALIGN;
  int rc = use_device(eng->device);
  const int32_t* gids = ids;
  for (int g = 0; !rc && g < eng->ngroups; ++g) {
    const KvdGroupDesc* d = &eng->desc[g];
    if (skip_tokens % d->block_size) return KVD_EINVAL;
    const int64_t total = nchunks * d->blocks_per_chunk;
    int64_t first_slot = skip_tokens / d->block_size;
    if (first_slot > total) first_slot = total;
    KvdIdSource src{gids, nullptr, 0, d->blocks_per_chunk};
    rc = launch_copy(d, eng->layer_ptrs_dev[g], src, first_slot, total - first_slot,
                     static_cast<uint8_t*>(const_cast<void*>(src_staging)), 0, eng->vec[g], 256, stream);
    gids += total_chunks * d->blocks_per_chunk;
  }
  return rc;
}

// Engine side: write `value` into the fence word `word` (host memory registered with
// kvd_host_register_mapped; its device address) on `stream`, after the work enqueued there so
// far (the gather of a staged store). The daemon polls the word from the CPU (kvd_dma) and
// copies the request's ring region once it holds the value. Why a word and not an
// interprocess event: with 14 engine processes on one H200 the daemon's cudaEventQuery on an
// engine's interprocess event reported its record complete before the gather ahead of it had
// run (the engine's context waiting for its time slice), and the early copy returned a wrong
// chunk about once in 1,000; a word in host memory is written by the GPU itself once the
// gather is done, so it cannot run ahead of it.
__global__ void kvd_signal_kernel(unsigned long long* word, unsigned long long value) {
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long*>(word) = value;
  __threadfence_system();
}

// The word is written by the driver's stream memory operation (cuStreamWriteValue64, with its
// default memory barrier: like __threadfence_system() before the write, for the stream's earlier
// work) where the driver has it: no kernel to launch, which costs the calling thread 10-13 us of
// CPU per call on an H100 host (measured in the vLLM connector's runs) against a few for the
// memory operation. Else, or if the operation is refused (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_
// STREAM_MEM_OPS), a one-thread kernel writes it; a refused call enqueues nothing.
typedef CUresult (*KvdWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
static std::once_flag g_write64_once;
static KvdWriteValue64 g_write64 = nullptr;
static bool g_write64_refused = false;

static void resolve_write64() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000, cudaEnableDefault, &found) ==
          cudaSuccess &&
      found == cudaDriverEntryPointSuccess)
    g_write64 = reinterpret_cast<KvdWriteValue64>(fn);
  if (getenv("KVDEPOT_FENCE_KERNEL") != nullptr) g_write64 = nullptr;  // diagnosis: always the kernel
}

int kvd_engine_signal(void* word, uint64_t value, cudaStream_t stream) {
  if (word == nullptr || (uintptr_t)word % 8) return KVD_EINVAL;
  std::call_once(g_write64_once, resolve_write64);
  if (g_write64 != nullptr && !__atomic_load_n(&g_write64_refused, __ATOMIC_RELAXED)) {
    if (g_write64(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value,
                  CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS)
      return KVD_OK;
    __atomic_store_n(&g_write64_refused, true, __ATOMIC_RELAXED);
  }
  kvd_signal_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long*>(word), (unsigned long long)value);
  return kvd_check(cudaGetLastError());
}

// Page-lock a host range for the GPU to write (fence words): *out_dev = its device address.
int kvd_host_register_mapped(void* ptr, size_t size_bytes, void** out_dev) {
  if (ptr == nullptr || out_dev == nullptr) return KVD_EINVAL;
  int rc = kvd_check(cudaHostRegister(ptr, size_bytes, cudaHostRegisterPortable | cudaHostRegisterMapped));
  if (rc) return rc;
  rc = kvd_check(cudaHostGetDevicePointer(out_dev, ptr, 0));
  if (rc) {
    cudaHostUnregister(ptr);
    cudaGetLastError();  // an error left here would be read as the next launch's own
  }
  return rc;
}

// Daemon side: n copies of `bytes` each, srcs[k] -> dsts[k], on the lane's DMA stream
// (to_host = 1: device -> pinned host, 0: host -> device). wait_word (or null): the engine's
// fence word (host memory, see kvd_engine_signal); the copies follow the engine's write of
// `wait_value` into it. If it does not hold the value yet, the request is queued and the
// lane's issuer thread enqueues it once it does (the DMA stream never waits on another
// process). out_event (or null) is recorded after the copies, when they are enqueued.
// Completion note and *notified as in kvd_store (a deferred request is always notified; bit
// 62 of its token says it was cancelled or timed out before any copy).
int kvd_dma(KvdLane* lane, const uint64_t* wait_word, uint64_t wait_value, const uint64_t* srcs, const uint64_t* dsts,
            uint64_t bytes, int64_t n, int to_host, cudaEvent_t out_event, int fd, uint64_t token, int* notified) {
  if (notified == nullptr) return KVD_EINVAL;
  *notified = 0;
  if (lane == nullptr || srcs == nullptr || dsts == nullptr || n <= 0 || bytes == 0) return KVD_EINVAL;
  if (wait_word != nullptr && (uintptr_t)wait_word % 8) return KVD_EINVAL;
  int rc = use_device(lane->device);
  if (rc) return rc;
  std::lock_guard<std::mutex> g(lane->issue_mu);
  if (wait_word != nullptr && __atomic_load_n(wait_word, __ATOMIC_ACQUIRE) != wait_value) {
    KvdDeferred job;
    try {
      job.srcs.assign(srcs, srcs + n);
      job.dsts.assign(dsts, dsts + n);
    } catch (...) {
      return KVD_EINVAL;
    }
    job.word = wait_word;
    job.value = wait_value;
    job.bytes = bytes;
    job.to_host = to_host;
    job.out_event = out_event;
    job.fd = fd;
    job.token = token;
    job.since_ns = now_ns();
    job.cancelled = false;
    try {
      lane->deferred.push_back(std::move(job));
    } catch (...) {
      return KVD_EINVAL;
    }
    lane->issue_cv.notify_one();
    *notified = 1;  // the issuer reports it
    return KVD_OK;
  }
  return dma_issue(lane, srcs, dsts, bytes, n, to_host, out_event, fd, token, notified);
}

// Interprocess events (cudaEventInterprocess | cudaEventDisableTiming).
int kvd_event_create_ipc(int device, void** out_event, void* out_handle) {
  if (out_event == nullptr || out_handle == nullptr) return KVD_EINVAL;
  int rc = kvd_check(cudaSetDevice(device));
  if (rc) return rc;
  cudaEvent_t ev;
  rc = kvd_check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess));
  if (rc) return rc;
  cudaIpcEventHandle_t h;
  rc = kvd_check(cudaIpcGetEventHandle(&h, ev));
  if (rc) {
    cudaEventDestroy(ev);
    return rc;
  }
  memcpy(out_handle, &h, sizeof(h));
  *out_event = ev;
  return KVD_OK;
}

int kvd_event_open_ipc(const void* handle, int device, void** out_event) {
  if (handle == nullptr || out_event == nullptr) return KVD_EINVAL;
  int rc = kvd_check(cudaSetDevice(device));
  if (rc) return rc;
  cudaIpcEventHandle_t h;
  memcpy(&h, handle, sizeof(h));
  cudaEvent_t ev;
  rc = kvd_check(cudaIpcOpenEventHandle(&ev, h));
  if (!rc) *out_event = ev;
  return rc;
}

int kvd_event_destroy(void* ev) { return kvd_check(cudaEventDestroy(static_cast<cudaEvent_t>(ev))); }

int kvd_ipc_event_handle_bytes(void) { return (int)sizeof(cudaIpcEventHandle_t); }

// Block until the lane's enqueued work completed (shutdown and error recovery only).
int kvd_lane_synchronize(KvdLane* lane) {
  if (lane == nullptr) return KVD_EINVAL;
  int rc = kvd_check(cudaSetDevice(lane->device));
  if (!rc) rc = kvd_check(cudaStreamSynchronize(lane->ks));
  if (!rc) rc = kvd_check(cudaStreamSynchronize(lane->ds));
  return rc;
}

int kvd_ipc_handle_bytes(void) { return (int)sizeof(cudaIpcMemHandle_t); }

int kvd_abi_version(void) { return 9; }

// First 16 hex digits of the SHA-256 of this file, passed by the build (-DKVD_SOURCE_HASH=...);
// the loader refuses a library built from other source (a stale build would misread arguments).
#ifndef KVD_SOURCE_HASH
#define KVD_SOURCE_HASH "unknown"
#endif
const char* kvd_source_hash(void) { return KVD_SOURCE_HASH; }

}  // extern "C"
