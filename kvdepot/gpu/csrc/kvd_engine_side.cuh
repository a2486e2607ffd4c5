// Part of kvdepot_kernels.cu (included there, inside its extern "C" block): what an engine
// process runs itself with engine-side staging: gather / scatter into / out of the ring, the
// fence word's write.

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
int kvd_engine_signal_by_kernel(void* word, uint64_t value, cudaStream_t stream);

}  // extern "C"

// Every group of a request in one launch (a hybrid model's gather / scatter, e.g. gpt-oss's
// full-attention and sliding-window groups): each launch costs the calling thread 10-15 us of
// CPU in the driver on the H100 hosts measured, against a few microseconds of Python around
// it, so one launch per group was most of a small request's engine-side CPU. The launch's x
// dimension is its parts one after another (part q: group slots [first_slot[q], ...) at x from
// x_start[q]), y the layer; the CTAs past their group's layer count return at once. A part's
// descriptor is chosen with static indices so that it stays in parameter space.
#define KVD_FUSED_PARTS 4
#define KVD_FUSED_IDS 800  // the parameter block stays under the classic 4 KiB
struct KvdFused {
  KvdGroupDesc d[KVD_FUSED_PARTS];
  const uint64_t* layer_ptrs[KVD_FUSED_PARTS];
  int64_t first_slot[KVD_FUSED_PARTS];
  int32_t x_start[KVD_FUSED_PARTS];
  int32_t nparts;
};

template <typename Word, int N>
__global__ void kvd_fused_copy_kernel(KvdFused f, KvdInlineIds<N> ids, uint8_t* __restrict__ staging,
                                      int to_staging, const unsigned long long* gate) {
  const int x = blockIdx.x;
  int p = 0;
#pragma unroll
  for (int q = 1; q < KVD_FUSED_PARTS; ++q) p += (q < f.nparts && x >= f.x_start[q]);
  KvdGroupDesc d = f.d[0];
  const uint64_t* lp = f.layer_ptrs[0];
  int64_t slot = f.first_slot[0] + x;
#pragma unroll
  for (int q = 1; q < KVD_FUSED_PARTS; ++q) {
    if (q == p) {
      d = f.d[q];
      lp = f.layer_ptrs[q];
      slot = f.first_slot[q] + (x - f.x_start[q]);
    }
  }
  if ((int64_t)blockIdx.y >= d.num_layers) return;
  const int64_t b = ids.v[x];
  if (b < 0) return;  // vLLM's null block in a retrieve
  if (gate != nullptr && gate_closed(gate, slot, d.blocks_per_chunk)) return;  // not landed
  copy_block<Word>(d, lp, slot, blockIdx.y, b, staging, to_staging);
}

// Group g's slots [first, first + count) of a request; ids[slot] is the block of slot `slot`.
struct KvdPart {
  int g;
  const int32_t* ids;
  int64_t first, count;
};

// Launch the next `n` slots of `parts` from the cursor (part *p, its slot *off), advancing it.
template <int N>
static cudaError_t launch_fused_n(const KvdEngine* eng, const KvdPart* parts, int nparts, int* p, int64_t* off,
                                  int n, int vec, uint8_t* st, int to_staging, cudaStream_t stream,
                                  const unsigned long long* gate) {
  KvdFused f;
  KvdInlineIds<N> ids;
  f.nparts = 0;
  int x = 0;
  unsigned max_layers = 0;
  while (x < n) {
    const KvdPart& part = parts[*p];
    const int64_t left = part.count - *off;
    const int take = (int)(left < n - x ? left : n - x);
    const int q = f.nparts++;
    f.d[q] = eng->desc[part.g];
    f.layer_ptrs[q] = eng->layer_ptrs_dev[part.g];
    f.first_slot[q] = part.first + *off;
    f.x_start[q] = x;
    if ((unsigned)f.d[q].num_layers > max_layers) max_layers = (unsigned)f.d[q].num_layers;
    for (int k = 0; k < take; ++k) ids.v[x + k] = part.ids[part.first + *off + k];
    x += take;
    *off += take;
    if (*off == part.count) {
      ++*p;
      *off = 0;
      while (*p < nparts && parts[*p].count == 0) ++*p;
    }
  }
  for (int q = f.nparts; q < KVD_FUSED_PARTS; ++q) f.x_start[q] = n;  // never chosen
  dim3 grid((unsigned)n, max_layers);
  switch (vec) {
    case 16: kvd_fused_copy_kernel<uint4, N><<<grid, 256, 0, stream>>>(f, ids, st, to_staging, gate); break;
    case 8: kvd_fused_copy_kernel<uint2, N><<<grid, 256, 0, stream>>>(f, ids, st, to_staging, gate); break;
    case 4: kvd_fused_copy_kernel<uint32_t, N><<<grid, 256, 0, stream>>>(f, ids, st, to_staging, gate); break;
    case 2: kvd_fused_copy_kernel<uint16_t, N><<<grid, 256, 0, stream>>>(f, ids, st, to_staging, gate); break;
    default: kvd_fused_copy_kernel<uint8_t, N><<<grid, 256, 0, stream>>>(f, ids, st, to_staging, gate); break;
  }
  return cudaGetLastError();
}

// Copy the parts' slots between engine memory and staging (256-byte aligned): one launch per
// group for a one-group engine (its smaller parameter block) or one of more than
// KVD_FUSED_PARTS groups, else fused launches of up to KVD_FUSED_IDS slots of any groups.
static int engine_copy(const KvdEngine* eng, const KvdPart* parts, int nparts, uint8_t* st, int to_staging,
                       cudaStream_t stream, const unsigned long long* gate = nullptr) {
  if (nparts == 1 || nparts > KVD_FUSED_PARTS) {
    int rc = KVD_OK;
    for (int q = 0; !rc && q < nparts; ++q) {
      const KvdPart& part = parts[q];
      const KvdGroupDesc* d = &eng->desc[part.g];
      KvdIdSource src{part.ids, nullptr, 0, d->blocks_per_chunk};
      rc = launch_copy(d, eng->layer_ptrs_dev[part.g], src, part.first, part.count, st, to_staging,
                       eng->vec[part.g], 256, stream, gate);
    }
    return rc;
  }
  int vec = 16;
  int64_t left = 0;
  for (int q = 0; q < nparts; ++q) {
    if (eng->vec[parts[q].g] < vec) vec = eng->vec[parts[q].g];
    left += parts[q].count;
  }
  int p = 0;
  int64_t off = 0;
  while (p < nparts && parts[p].count == 0) ++p;
  while (left > 0) {
    const int n = (int)(left < KVD_FUSED_IDS ? left : KVD_FUSED_IDS);
    cudaError_t err;
    if (n <= 16)
      err = launch_fused_n<16>(eng, parts, nparts, &p, &off, n, vec, st, to_staging, stream, gate);
    else if (n <= 128)
      err = launch_fused_n<128>(eng, parts, nparts, &p, &off, n, vec, st, to_staging, stream, gate);
    else
      err = launch_fused_n<KVD_FUSED_IDS>(eng, parts, nparts, &p, &off, n, vec, st, to_staging, stream, gate);
    if (err != cudaSuccess) {
      g_last_cuda_error = err;
      return KVD_ECUDA;
    }
    left -= n;
  }
  return KVD_OK;
}

extern "C" {

// Engine side: gather every chunk of a request (ids as in kvd_store, total_chunks chunks) into
// `dst` (chunk j at dst + j*object_bytes, dst aligned to 256 bytes) on the engine's `stream`;
// then, if `fence_word` is not null, the write of `fence_value` into it (kvd_engine_signal), so
// that a staged store costs one call. Every group in one launch (engine_copy). On an error
// nothing more is enqueued, but a launch enqueued before it may still run: the caller waits
// for the stream before reusing dst.
int kvd_engine_gather(const KvdEngine* eng, const int32_t* ids, int64_t total_chunks, void* dst, void* fence_word,
                      uint64_t fence_value, cudaStream_t stream) {
  if (eng == nullptr || ids == nullptr || dst == nullptr || total_chunks <= 0) return KVD_EINVAL;
  if ((uintptr_t)dst % 256 || (uintptr_t)fence_word % 8) return KVD_EALIGN;
  int rc = use_device(eng->device);
  std::vector<KvdPart> many;
  KvdPart few[KVD_FUSED_PARTS];
  KvdPart* parts = eng->ngroups <= KVD_FUSED_PARTS ? few : (many.resize(eng->ngroups), many.data());
  const int32_t* gids = ids;
  for (int g = 0; g < eng->ngroups; ++g) {
    const int64_t total = total_chunks * eng->desc[g].blocks_per_chunk;
    parts[g] = KvdPart{g, gids, 0, total};
    gids += total;
  }
  if (!rc) rc = engine_copy(eng, parts, eng->ngroups, static_cast<uint8_t*>(dst), 1, stream);
  if (!rc && fence_word != nullptr) rc = kvd_engine_signal(fence_word, fence_value, stream);
  return rc;
}

// Engine side: the gather of kvd_engine_gather for the chunks of several requests (pieces of one
// store, each with its own ring region and fence word): piece q's piece_chunks[q] chunks (the
// next ones of `ids`, as in kvd_store: per group, every piece's chunks in order) into dsts[q]
// (256-byte aligned), one launch for each run of pieces whose regions lie end to end
// (engine_copy), then fence_values[q] written into fence_words[q] (device addresses) for
// every piece, in order. A separate gather + word per piece cost the engine thread 25-30 us of
// CPU each on the H100 hosts measured, most of it the launch; a sliding-window model's step
// (gathered on the engine thread, before the next forward may reuse the blocks) made one per
// piece. The words are written after the whole gather: a piece's copy starts that much later
// (~0.1 ms for 200 MB on an H100). On an error nothing more is enqueued (no word written), but
// a launch enqueued before it may still run: the caller waits for the stream.
int kvd_engine_gather_pieces(const KvdEngine* eng, const int32_t* ids, int64_t total_chunks, int npieces,
                             const uint64_t* dsts, const int64_t* piece_chunks, const uint64_t* fence_words,
                             const uint64_t* fence_values, cudaStream_t stream) {
  if (eng == nullptr || ids == nullptr || npieces <= 0 || dsts == nullptr || piece_chunks == nullptr ||
      fence_words == nullptr || fence_values == nullptr || total_chunks <= 0)
    return KVD_EINVAL;
  int64_t sum = 0;
  for (int q = 0; q < npieces; ++q) {
    if (piece_chunks[q] <= 0) return KVD_EINVAL;
    if (dsts[q] == 0 || dsts[q] % 256 || fence_words[q] == 0 || fence_words[q] % 8) return KVD_EALIGN;
    sum += piece_chunks[q];
  }
  if (sum != total_chunks) return KVD_EINVAL;
  int rc = use_device(eng->device);
  std::vector<KvdPart> many;
  KvdPart few[KVD_FUSED_PARTS];
  KvdPart* parts = eng->ngroups <= KVD_FUSED_PARTS ? few : (many.resize(eng->ngroups), many.data());
  int64_t first = 0;  // the span's first chunk
  for (int q = 0; !rc && q < npieces;) {
    int64_t n = piece_chunks[q];
    int e = q + 1;
    while (e < npieces && dsts[e] == dsts[q] + (uint64_t)(n * eng->object_bytes)) n += piece_chunks[e++];
    const int32_t* gids = ids;
    for (int g = 0; g < eng->ngroups; ++g) {
      const int64_t bpc = eng->desc[g].blocks_per_chunk;
      parts[g] = KvdPart{g, gids + first * bpc, 0, n * bpc};
      gids += total_chunks * bpc;
    }
    rc = engine_copy(eng, parts, eng->ngroups, reinterpret_cast<uint8_t*>(dsts[q]), 1, stream);
    first += n;
    q = e;
  }
  for (int q = 0; !rc && q < npieces; ++q)
    rc = kvd_engine_signal(reinterpret_cast<void*>(fence_words[q]), fence_values[q], stream);
  return rc;
}

// A scatter's parts: per group, the slots of the leading `nchunks` chunks (ids as in kvd_store,
// total_chunks chunks) past the blocks of the first skip_tokens tokens. KVD_EINVAL unless
// skip_tokens is a multiple of every group's block size.
static int scatter_parts(const KvdEngine* eng, const int32_t* ids, int64_t total_chunks, int64_t nchunks,
                         int64_t skip_tokens, KvdPart* parts) {
  const int32_t* gids = ids;
  for (int g = 0; g < eng->ngroups; ++g) {
    const KvdGroupDesc* d = &eng->desc[g];
    if (skip_tokens % d->block_size) return KVD_EINVAL;
    const int64_t total = nchunks * d->blocks_per_chunk;
    int64_t first_slot = skip_tokens / d->block_size;
    if (first_slot > total) first_slot = total;
    parts[g] = KvdPart{g, gids, first_slot, total - first_slot};
    gids += total_chunks * d->blocks_per_chunk;
  }
  return KVD_OK;
}

// Engine side: scatter the request's leading `nchunks` chunks (of total_chunks; ids as in
// kvd_store) from `src` (chunk j at src + j*object_bytes) into the engine's blocks on `stream`,
// skipping the blocks of the first skip_tokens tokens (a multiple of every group's block size,
// else KVD_EINVAL with nothing enqueued); then, if `done_word` is not null, the write of
// `done_value` into it (kvd_engine_signal): the ring region may be reused once the word holds
// the value, read from the CPU, with no CUDA event to create, record, query and destroy per
// retrieve (each a driver call of several microseconds of CPU on the hosts measured).
int kvd_engine_scatter(const KvdEngine* eng, const int32_t* ids, int64_t total_chunks, int64_t nchunks,
                       const void* src_staging, int64_t skip_tokens, void* done_word, uint64_t done_value,
                       cudaStream_t stream) {
  if (eng == nullptr || ids == nullptr || src_staging == nullptr || nchunks <= 0 || nchunks > total_chunks ||
      skip_tokens < 0)
    return KVD_EINVAL;
  if ((uintptr_t)src_staging % 256 || (uintptr_t)done_word % 8) return KVD_EALIGN;
  std::vector<KvdPart> many;
  KvdPart few[KVD_FUSED_PARTS];
  KvdPart* parts = eng->ngroups <= KVD_FUSED_PARTS ? few : (many.resize(eng->ngroups), many.data());
  int rc = scatter_parts(eng, ids, total_chunks, nchunks, skip_tokens, parts);
  if (rc) return rc;
  rc = use_device(eng->device);
  if (!rc) rc = engine_copy(eng, parts, eng->ngroups, static_cast<uint8_t*>(const_cast<void*>(src_staging)), 0,
                            stream);
  if (!rc && done_word != nullptr) rc = kvd_engine_signal(done_word, done_value, stream);
  return rc;
}

// One thread: the landed word (host memory) into its device copy, which the scatter's CTAs read
// (each CTA reading the host word itself cost ~0.9 us per CTA on an H200: 0.4 ms for 512).
__global__ void kvd_gate_copy_kernel(const unsigned long long* word, unsigned long long* copy) {
  *copy = *reinterpret_cast<const volatile unsigned long long*>(word);
}

// One thread, after the gated scatter: the landed value it ran with, | KVD_GATE_DONE_BIT, into
// the host word (the count stays readable there for the engine's CPU, which may look only now).
__global__ void kvd_gate_done_kernel(const unsigned long long* copy, unsigned long long* word) {
  __threadfence_system();
  *reinterpret_cast<volatile unsigned long long*>(word) = *copy | KVD_GATE_DONE_BIT;
  __threadfence_system();
}

// Engine side, a retrieve's scatter enqueued before its bytes are in the ring: on `stream`, a
// wait until the landed word `gate_word` (a fence word: the device address of host memory
// registered with kvd_host_register_mapped) has KVD_LANDED_BIT set, then the scatter of
// kvd_engine_scatter for all `total_chunks` chunks, each CTA writing only chunks below the
// count the word carries (the daemon's DMA stream writes seq | KVD_LANDED_BIT | count << 40
// after its copies into the ring, kvd_dma; the engine writes it from the CPU for a retrieve
// that copied nothing or failed), then the landed value it ran with | KVD_GATE_DONE_BIT into
// `done_word` (the same word: kvd_gate_done_kernel; `done_value`, the region's number, picks
// the word's device copy). The reply's hop back and this call's launch then run while the
// bytes cross the link, and the scatter starts when they landed. KVD_EINVAL with nothing
// enqueued where the driver lacks the wait (kvd_stream_memops) or the arguments are bad.
// The stream waits until the word is written: the caller must write it if no reply comes.
int kvd_engine_scatter_gated(const KvdEngine* eng, const int32_t* ids, int64_t total_chunks, const void* src_staging,
                             int64_t skip_tokens, const void* gate_word, void* done_word, uint64_t done_value,
                             cudaStream_t stream) {
  if (eng == nullptr || ids == nullptr || src_staging == nullptr || total_chunks <= 0 || skip_tokens < 0 ||
      gate_word == nullptr)
    return KVD_EINVAL;
  if ((uintptr_t)src_staging % 256 || (uintptr_t)done_word % 8 || (uintptr_t)gate_word % 8) return KVD_EALIGN;
  std::call_once(g_memops_once, resolve_memops);
  if (g_wait64 == nullptr) return KVD_EINVAL;
  std::vector<KvdPart> many;
  KvdPart few[KVD_FUSED_PARTS];
  KvdPart* parts = eng->ngroups <= KVD_FUSED_PARTS ? few : (many.resize(eng->ngroups), many.data());
  int rc = scatter_parts(eng, ids, total_chunks, total_chunks, skip_tokens, parts);
  if (!rc) rc = use_device(eng->device);
  if (rc) return rc;
  if (g_wait64(reinterpret_cast<CUstream>(stream), (CUdeviceptr)gate_word, KVD_LANDED_BIT,
               CU_STREAM_WAIT_VALUE_AND) != CUDA_SUCCESS)
    return KVD_EINVAL;  // refused: nothing enqueued
  unsigned long long* count = eng->gate_counts + done_value % KVD_GATE_SLOTS;
  kvd_gate_copy_kernel<<<1, 1, 0, stream>>>(static_cast<const unsigned long long*>(gate_word), count);
  rc = kvd_check(cudaGetLastError());
  if (!rc)
    rc = engine_copy(eng, parts, eng->ngroups, static_cast<uint8_t*>(const_cast<void*>(src_staging)), 0, stream,
                     count);
  if (!rc && done_word != nullptr) {
    kvd_gate_done_kernel<<<1, 1, 0, stream>>>(count, static_cast<unsigned long long*>(done_word));
    rc = kvd_check(cudaGetLastError());
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
// STREAM_MEM_OPS), a one-thread kernel writes it (kvd_engine_signal_by_kernel, exported so that
// tests check the fallback on hosts that have the operation); a refused call enqueues nothing.
static bool g_write64_refused = false;

int kvd_engine_signal_by_kernel(void* word, uint64_t value, cudaStream_t stream) {
  if (word == nullptr || (uintptr_t)word % 8) return KVD_EINVAL;
  kvd_signal_kernel<<<1, 1, 0, stream>>>(static_cast<unsigned long long*>(word), (unsigned long long)value);
  return kvd_check(cudaGetLastError());
}

int kvd_engine_signal(void* word, uint64_t value, cudaStream_t stream) {
  if (word == nullptr || (uintptr_t)word % 8) return KVD_EINVAL;
  std::call_once(g_memops_once, resolve_memops);
  if (g_write64 != nullptr && !__atomic_load_n(&g_write64_refused, __ATOMIC_RELAXED)) {
    if (g_write64(reinterpret_cast<CUstream>(stream), reinterpret_cast<CUdeviceptr>(word), value,
                  CU_STREAM_WRITE_VALUE_DEFAULT) == CUDA_SUCCESS)
      return KVD_OK;
    __atomic_store_n(&g_write64_refused, true, __ATOMIC_RELAXED);
  }
  return kvd_engine_signal_by_kernel(word, value, stream);
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
