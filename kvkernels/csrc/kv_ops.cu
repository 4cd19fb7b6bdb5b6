// Small per-row kernels: writing new K/V into pages, block summaries for the
// cache-manager, and per-row eviction selection. DT (storage dtype) comes
// from kvkernels/cuda.py; shapes are runtime arguments.

// Row i of k_new / v_new goes to (page[i], offset[i]). Rows naming a slot
// outside the pool are dropped rather than written out of bounds: the
// kernel cannot raise, and checking on the host would cost a device sync.
extern "C" __global__ void kv_append(T* __restrict__ k_pages, T* __restrict__ v_pages,
                                     const T* __restrict__ k_new, const T* __restrict__ v_new,
                                     const long long* __restrict__ page,
                                     const long long* __restrict__ offset, long long N, int D,
                                     int BS, long long P, long long k_stride, long long v_stride) {
  const long long total = N * D;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
       i += (long long)gridDim.x * blockDim.x) {
    const long long r = i / D;
    const int e = (int)(i - r * D);
    const long long pg = page[r], of = offset[r];
    if (pg < 0 || pg >= P || of < 0 || of >= BS) continue;
    const size_t dst = ((size_t)pg * BS + of) * D + e;
    k_pages[dst] = k_new[r * k_stride + e];
    v_pages[dst] = v_new[r * v_stride + e];
  }
}

// One warp per requested page: mean key (per head-dim element) and the mean
// over the block's positions of the value vector's L2 norm, both fp32.
extern "C" __global__ void block_features(const T* __restrict__ k_pages,
                                          const T* __restrict__ v_pages,
                                          const long long* __restrict__ pages, int N, int D,
                                          int BS, float* __restrict__ key_mean,
                                          float* __restrict__ value_norm) {
  const int lane = threadIdx.x & 31;
  const int r = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  if (r >= N) return;  // whole warp leaves together
  const T* kb = k_pages + (size_t)pages[r] * BS * D;
  const T* vb = v_pages + (size_t)pages[r] * BS * D;
  for (int e = lane; e < D; e += 32) {
    float s = 0.f;
    for (int p = 0; p < BS; ++p) s += to_f(kb[(size_t)p * D + e]);
    key_mean[(size_t)r * D + e] = s / BS;
  }
  float total = 0.f;
  for (int p = 0; p < BS; ++p) {
    float ss = 0.f;
    for (int e = lane; e < D; e += 32) {
      const float x = to_f(vb[(size_t)p * D + e]);
      ss += x * x;
    }
    total += sqrtf(warp_sum(ss));
  }
  if (lane == 0) value_norm[r] = total / BS;
}

// One thread block per row. A column's place in the eviction order is its
// rank among the row's evictable columns under the key (score, column), NaN
// scores last (as torch.sort orders them); columns ranked below K are
// written to their rank. O(NB^2 / threads) per row, which is cheap for the
// NB of a decode step (kvkernels/cuda.py sends larger rows to torch.sort).
extern "C" __global__ void eviction_select(const float* __restrict__ scores,
                                           const unsigned char* __restrict__ evictable, int NB,
                                           int K, long long* __restrict__ cols) {
  extern __shared__ float sh[];
  float* sc = sh;
  unsigned char* ev = reinterpret_cast<unsigned char*>(sh + NB);
  const size_t row = blockIdx.x;
  for (int c = threadIdx.x; c < NB; c += blockDim.x) {
    sc[c] = scores[row * NB + c];
    ev[c] = evictable[row * NB + c];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < NB; c += blockDim.x) {
    if (!ev[c]) continue;
    const float s = sc[c];
    const bool nan = s != s;
    int rank = 0;
    for (int c2 = 0; c2 < NB; ++c2) {
      if (!ev[c2] || c2 == c) continue;
      const float s2 = sc[c2];
      const bool nan2 = s2 != s2;
      // A NaN column comes after every number and after the NaNs left of it.
      const bool before = nan ? (!nan2 || c2 < c) : (!nan2 && (s2 < s || (s2 == s && c2 < c)));
      rank += before;
    }
    if (rank < K) cols[row * K + rank] = c;
  }
}
