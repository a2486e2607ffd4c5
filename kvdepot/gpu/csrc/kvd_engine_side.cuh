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
#if CUDART_VERSION >= 12050  // the by-version lookup; the plain one is deprecated from CUDA 13
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const bool ok = cudaGetDriverEntryPointByVersion("cuStreamWriteValue64", &fn, 12000, cudaEnableDefault, &found) ==
                      cudaSuccess &&
                  found == cudaDriverEntryPointSuccess;
#elif CUDART_VERSION >= 12000
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const bool ok = cudaGetDriverEntryPoint("cuStreamWriteValue64", &fn, cudaEnableDefault, &found) == cudaSuccess &&
                  found == cudaDriverEntryPointSuccess;
#else
  const bool ok = cudaGetDriverEntryPoint("cuStreamWriteValue64", &fn, cudaEnableDefault) == cudaSuccess;
#endif
  if (ok && fn != nullptr) g_write64 = reinterpret_cast<KvdWriteValue64>(fn);
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
