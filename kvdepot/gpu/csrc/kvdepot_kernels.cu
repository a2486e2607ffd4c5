// kvdepot transfer kernels: gather engine KV blocks into the flat staging buffer in the
// canonical object format, and scatter them back.
//
// Built by nvcc into libkvdepot_kernels.so that links only the CUDA runtime (statically) and
// exposes the small C ABI below, called from Python through ctypes with raw device pointers
// and a cudaStream_t. No libtorch linkage, so one build serves every torch version.
//
// One layer group (see kvdepot/gpu/layout.py) per launch (the engine process's own gather /
// scatter fuses the groups of a request into one launch: kvd_engine_side.cuh). Engine side,
// layer l of the group:
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
//
// One translation unit in four files: this one (descriptors, the copy kernel, its launches,
// IPC and host registration, kvd_dma, events) includes kvd_lanes.cuh (the daemon's DMA lanes),
// kvd_requests.cuh (KvdEngine, kvd_store / kvd_retrieve) and kvd_engine_side.cuh (the engine
// process's gather / scatter / fence word). The build stamps the SHA-256 of all four
// (kvdepot/gpu/build.py).

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

// One (block, layer) of a group: N*H*KV rows between the engine's block b and its place in the
// staging object of slot `slot` (chunk slot / blocks_per_chunk, block slot % blocks_per_chunk).
template <typename Word>
__device__ __forceinline__ void copy_block(const KvdGroupDesc& d, const uint64_t* __restrict__ layer_ptrs,
                                           int64_t slot, int64_t layer, int64_t b, uint8_t* __restrict__ staging,
                                           int to_staging) {
  const int64_t j = slot / d.blocks_per_chunk;
  const int64_t i = slot - j * d.blocks_per_chunk;
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

// A gated scatter's landed word (kvd_engine_scatter_gated): the daemon's DMA stream writes
// seq | KVD_LANDED_BIT | (chunks copied << KVD_LANDED_COUNT_SHIFT) into it after its copies into
// the ring; the scatter writes only the slots of chunks below that count (the rest of the
// ring region holds older bytes). `gate` is the word's device copy (kvd_gate_copy_kernel).
#define KVD_LANDED_BIT (1ULL << 62)
#define KVD_LANDED_COUNT_SHIFT 40
#define KVD_LANDED_COUNT_MASK ((1ULL << 21) - 1)
#define KVD_GATE_DONE_BIT (1ULL << 61)  // the gated scatter ran (kvd_gate_done_kernel)

__device__ __forceinline__ bool gate_closed(const unsigned long long* gate, int64_t slot, int64_t blocks_per_chunk) {
  const long long have = (long long)((*gate >> KVD_LANDED_COUNT_SHIFT) & KVD_LANDED_COUNT_MASK);
  return slot / blocks_per_chunk >= have;
}

template <typename Word, int N>
__global__ void kvd_copy_kernel(KvdGroupDesc d, const uint64_t* __restrict__ layer_ptrs, KvdInlineIds<N> ids,
                                int64_t first_slot, uint8_t* __restrict__ staging, int to_staging,
                                const unsigned long long* gate) {
  const int64_t b = ids.v[blockIdx.x];
  if (b < 0) return;  // a block left alone (a retrieve's -1: vLLM's null block)
  if (gate != nullptr && gate_closed(gate, first_slot + blockIdx.x, d.blocks_per_chunk)) return;
  copy_block<Word>(d, layer_ptrs, first_slot + blockIdx.x, blockIdx.y, b, staging, to_staging);
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
                            cudaStream_t stream, const unsigned long long* gate) {
  KvdInlineIds<N> ids;
  for (int64_t k = 0; k < n; ++k) ids.v[k] = src.at(s0 + k);
  dim3 grid((unsigned)n, (unsigned)d->num_layers);
  switch (vec_bytes) {
    case 16: kvd_copy_kernel<uint4, N><<<grid, threads_per_cta, 0, stream>>>(*d, layer_ptrs, ids, s0, st, to_staging, gate); break;
    case 8: kvd_copy_kernel<uint2, N><<<grid, threads_per_cta, 0, stream>>>(*d, layer_ptrs, ids, s0, st, to_staging, gate); break;
    case 4: kvd_copy_kernel<uint32_t, N><<<grid, threads_per_cta, 0, stream>>>(*d, layer_ptrs, ids, s0, st, to_staging, gate); break;
    case 2: kvd_copy_kernel<uint16_t, N><<<grid, threads_per_cta, 0, stream>>>(*d, layer_ptrs, ids, s0, st, to_staging, gate); break;
    default: kvd_copy_kernel<uint8_t, N><<<grid, threads_per_cta, 0, stream>>>(*d, layer_ptrs, ids, s0, st, to_staging, gate); break;
  }
  return cudaGetLastError();
}

extern "C" {

// gate: a gated scatter's landed word (device address), else null.
static int launch_copy(const KvdGroupDesc* d, const uint64_t* layer_ptrs, const KvdIdSource& src,
                       int64_t first_slot, int64_t num_slots, uint8_t* st, int to_staging, int vec_bytes,
                       int threads_per_cta, cudaStream_t stream, const unsigned long long* gate = nullptr) {
  for (int64_t s0 = first_slot; s0 < first_slot + num_slots; s0 += KVD_INLINE_IDS) {
    int64_t n = first_slot + num_slots - s0;
    if (n > KVD_INLINE_IDS) n = KVD_INLINE_IDS;
    cudaError_t err;
    if (n <= 16)
      err = launch_n<16>(d, layer_ptrs, src, s0, n, st, to_staging, vec_bytes, threads_per_cta, stream, gate);
    else if (n <= 128)
      err = launch_n<128>(d, layer_ptrs, src, s0, n, st, to_staging, vec_bytes, threads_per_cta, stream, gate);
    else
      err = launch_n<KVD_INLINE_IDS>(d, layer_ptrs, src, s0, n, st, to_staging, vec_bytes, threads_per_cta, stream,
                                         gate);
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

// The driver's stream memory operations (cuStreamWriteValue64 / cuStreamWaitValue64), resolved
// at run time through the runtime's entry-point lookup: the library links no libcuda. Null
// where the driver lacks them.
typedef CUresult (*KvdWriteValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
typedef CUresult (*KvdWaitValue64)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
static std::once_flag g_memops_once;
static KvdWriteValue64 g_write64 = nullptr;
static KvdWaitValue64 g_wait64 = nullptr;

static void* driver_entry(const char* name) {
  void* fn = nullptr;
#if CUDART_VERSION >= 12050  // the by-version lookup; the plain one is deprecated from CUDA 13
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const bool ok = cudaGetDriverEntryPointByVersion(name, &fn, 12000, cudaEnableDefault, &found) == cudaSuccess &&
                  found == cudaDriverEntryPointSuccess;
#elif CUDART_VERSION >= 12000
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const bool ok = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault, &found) == cudaSuccess &&
                  found == cudaDriverEntryPointSuccess;
#else
  const bool ok = cudaGetDriverEntryPoint(name, &fn, cudaEnableDefault) == cudaSuccess;
#endif
  return ok ? fn : nullptr;
}

static void resolve_memops() {
  g_write64 = reinterpret_cast<KvdWriteValue64>(driver_entry("cuStreamWriteValue64"));
  g_wait64 = reinterpret_cast<KvdWaitValue64>(driver_entry("cuStreamWaitValue64"));
}

extern "C" {
// Whether this driver has the stream memory operations a gated scatter needs (the daemon's
// write of a landed word on its DMA stream, the engine stream's wait for it): 1 or 0.
int kvd_stream_memops(void) {
  std::call_once(g_memops_once, resolve_memops);
  return g_write64 != nullptr && g_wait64 != nullptr;
}
}

// Load every kernel of this library into the current context of `device` (defined at the end
// of this file, after the kernels): kvd_engine_create and kvd_lane_create call it.
static int preload_kernels(int device);

#include "kvd_lanes.cuh"
#include "kvd_requests.cuh"
#include "kvd_engine_side.cuh"

// Daemon side: n copies of `bytes` each, srcs[k] -> dsts[k], on the lane's DMA stream
// (to_host = 1: device -> pinned host, 0: host -> device). wait_word (or null): the engine's
// fence word (host memory, see kvd_engine_signal); the copies follow the engine's write of
// `wait_value` into it. If it does not hold the value yet, the request is queued and the
// lane's issuer thread enqueues it once it does (the DMA stream never waits on another
// process). landed_word (or 0): after the copies, the DMA stream writes landed_value into it
// (dma_issue; a gated scatter's word). out_event (or null) is recorded after the copies, when
// they are enqueued.
// Completion note and *notified as in kvd_store (a deferred request is always notified; bit
// 62 of its token says it was cancelled or timed out before any copy).
int kvd_dma(KvdLane* lane, const uint64_t* wait_word, uint64_t wait_value, const uint64_t* srcs, const uint64_t* dsts,
            uint64_t bytes, int64_t n, int to_host, cudaEvent_t out_event, int fd, uint64_t token, int* notified,
            uint64_t landed_word, uint64_t landed_value) {
  if (notified == nullptr) return KVD_EINVAL;
  *notified = 0;
  if (lane == nullptr || srcs == nullptr || dsts == nullptr || n <= 0 || bytes == 0) return KVD_EINVAL;
  if ((wait_word != nullptr && (uintptr_t)wait_word % 8) || landed_word % 8) return KVD_EINVAL;
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
    job.landed_word = landed_word;
    job.landed_value = landed_value;
    try {
      lane->deferred.push_back(std::move(job));
    } catch (...) {
      return KVD_EINVAL;
    }
    lane->issue_cv.notify_one();
    *notified = 1;  // the issuer reports it
    return KVD_OK;
  }
  return dma_issue(lane, srcs, dsts, bytes, n, to_host, out_event, fd, token, notified, landed_word, landed_value);
}

// kvd_dma with its arguments in one block: the daemon's event loop fills a block it keeps with
// one struct.pack_into and passes one pointer, where the twelve-argument call through ctypes
// (each argument converted, two pointer arrays built per request) cost ~2.5 us per request on
// a 2-core VM against ~0.6. The pointers follow the header: srcs = ptrs[0, n), dsts = ptrs[n, 2n).
// Every field is 8 bytes (uint64_t / int64_t), no padding; the block is read before the call
// returns (a deferred request copies the pointers), so the caller may reuse it at once.
struct KvdDmaCall {
  uint64_t lane;        // KvdLane*
  uint64_t wait_word;   // const uint64_t* or 0
  uint64_t wait_value;
  uint64_t bytes;
  int64_t n;
  int64_t to_host;
  int64_t fd;
  uint64_t token;
  uint64_t notified;    // int*
  uint64_t landed_word;   // 0, or see kvd_dma
  uint64_t landed_value;
  uint64_t ptrs[1];     // 2n of them
};

int kvd_dma_call(const KvdDmaCall* c) {
  if (c == nullptr) return KVD_EINVAL;
  if (c->notified != 0) *reinterpret_cast<int*>(c->notified) = 0;
  if (c->n <= 0 || c->n > (int64_t(1) << 24)) return KVD_EINVAL;
  return kvd_dma(reinterpret_cast<KvdLane*>(c->lane), reinterpret_cast<const uint64_t*>(c->wait_word), c->wait_value,
                 c->ptrs, c->ptrs + c->n, c->bytes, c->n, (int)c->to_host, nullptr, (int)c->fd, c->token,
                 reinterpret_cast<int*>(c->notified), c->landed_word, c->landed_value);
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

}  // extern "C"

// CUDA loads a kernel at its first launch by default (lazy loading, CUDA_MODULE_LOADING=LAZY
// since CUDA 12.2), and loading one may wait for the whole context to be idle: the first
// gather or scatter of each kind (word width x id count) in a vLLM worker would block the
// engine thread until the forward on another stream, or a gated scatter's wait for its landed
// word, was over (tests/gpu/test_first_launch.py). cudaFuncGetAttributes loads a kernel, so
// every instantiation is loaded here, at registration, before any of them runs. Once per
// device per process.
template <typename Word>
static cudaError_t preload_word() {
  const void* fns[] = {
      (const void*)kvd_copy_kernel<Word, 16>,        (const void*)kvd_copy_kernel<Word, 128>,
      (const void*)kvd_copy_kernel<Word, KVD_INLINE_IDS>, (const void*)kvd_fused_copy_kernel<Word, 16>,
      (const void*)kvd_fused_copy_kernel<Word, 128>, (const void*)kvd_fused_copy_kernel<Word, KVD_FUSED_IDS>,
  };
  cudaFuncAttributes attr;
  for (const void* fn : fns) {
    const cudaError_t e = cudaFuncGetAttributes(&attr, fn);
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

static std::mutex g_preload_mutex;
static uint64_t g_preloaded = 0;  // bit d: device d's kernels are loaded

static int preload_kernels(int device) {
  if (device < 0 || device >= 64) return KVD_OK;
  std::lock_guard<std::mutex> hold(g_preload_mutex);
  if (g_preloaded >> device & 1) return KVD_OK;
  cudaFuncAttributes attr;
  const void* single[] = {(const void*)kvd_gate_copy_kernel, (const void*)kvd_gate_done_kernel,
                          (const void*)kvd_signal_kernel};
  cudaError_t e = cudaSuccess;
  for (const void* fn : single)
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&attr, fn);
  if (e == cudaSuccess) e = preload_word<uint4>();
  if (e == cudaSuccess) e = preload_word<uint2>();
  if (e == cudaSuccess) e = preload_word<uint32_t>();
  if (e == cudaSuccess) e = preload_word<uint16_t>();
  if (e == cudaSuccess) e = preload_word<uint8_t>();
  if (e != cudaSuccess) return kvd_check(e);
  g_preloaded |= 1ULL << device;
  return KVD_OK;
}

extern "C" {

int kvd_abi_version(void) { return 14; }

// First 16 hex digits of the SHA-256 of this file, passed by the build (-DKVD_SOURCE_HASH=...);
// the loader refuses a library built from other source (a stale build would misread arguments).
#ifndef KVD_SOURCE_HASH
#define KVD_SOURCE_HASH "unknown"
#endif
const char* kvd_source_hash(void) { return KVD_SOURCE_HASH; }

}  // extern "C"
