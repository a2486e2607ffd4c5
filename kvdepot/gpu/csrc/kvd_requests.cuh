// Part of kvdepot_kernels.cu (included there, inside its extern "C" block): a registration's
// layer groups in the library (KvdEngine) and the daemon-gathers whole-request transfers,
// kvd_store / kvd_retrieve.

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
  if (e->gate_counts) cudaFree(e->gate_counts);
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
  if (!rc) rc = preload_kernels(device);
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
  rc = kvd_check(cudaMalloc(reinterpret_cast<void**>(&e->gate_counts), KVD_GATE_SLOTS * sizeof(unsigned long long)));
  if (rc) {
    kvd_engine_destroy(e);
    return rc;
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
