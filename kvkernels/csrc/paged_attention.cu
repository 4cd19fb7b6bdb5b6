// Paged decode attention with per-block attention mass, in two kernels.
//
// Config (#defines from kvkernels/cuda.py): D head dim, BS block size, G query
// heads per kv-head, GP = G rounded up to a power of two (LOG2GP = log2 GP),
// NW warps per thread block, PT positions per tile (PT * DPL <= 32 bounds the
// registers of the tile's K and V rows), DPL = ceil(D / 32)
// head-dim elements per lane, VEC = bytes per vector load (16/8/4) or 0 for
// guarded scalar loads.
//
// paged_attn_partial: grid (S splits, Hkv, B). A thread block owns one
// (sequence, kv-head) and a contiguous range of its resident blocks, and
// serves all G query heads of that kv-head, so every K/V byte is read once per
// kv-head. Its NW warps take the range's blocks round-robin. A lane owns DPL
// consecutive head-dim elements of q (all G heads), of each K/V row, and of
// the G output accumulators; logits are reduced across lanes (see
// group_reduce) and the softmax is online, in fp32, in log2 units (q is
// pre-scaled by scale * log2(e), so exp2 replaces exp).
//
// Block mass without a second pass over K (the trick): the warp that reads a
// block records, when it is done with it, its running max m_j and
// sum_j = sum over the block's positions of exp2(logit - m_j). Those two
// numbers are the block's softmax numerator up to the factor exp2(m_j - M),
// where M is the final max over the whole sequence; once M and the final
// denominator L are known (after all splits), the block's probability mass is
// exactly sum_j * exp2(m_j - M) / L. The combine kernel applies that factor,
// so K is read once and no [Hq, positions] matrix ever exists.
//
// paged_attn_combine: grid (Hq, B). Merges the splits' (m, l, acc) partials
// into the output (flash-decoding style) and rescales the block sums into
// block_mass, zeroing padding columns.

// Loads this lane's `ne` (<= DPL) consecutive elements starting at src.
__device__ __forceinline__ void load_row(const T* __restrict__ src, float (&out)[DPL], int ne) {
#if VEC > 0
  constexpr int BYTES = DPL * (int)sizeof(T);
  unsigned w[BYTES / 4];
#if VEC == 16
#pragma unroll
  for (int c = 0; c < BYTES / 16; ++c) {
    const uint4 x = reinterpret_cast<const uint4*>(src)[c];
    w[4 * c] = x.x; w[4 * c + 1] = x.y; w[4 * c + 2] = x.z; w[4 * c + 3] = x.w;
  }
#elif VEC == 8
#pragma unroll
  for (int c = 0; c < BYTES / 8; ++c) {
    const uint2 x = reinterpret_cast<const uint2*>(src)[c];
    w[2 * c] = x.x; w[2 * c + 1] = x.y;
  }
#else
#pragma unroll
  for (int c = 0; c < BYTES / 4; ++c) w[c] = reinterpret_cast<const unsigned*>(src)[c];
#endif
#pragma unroll
  for (int e = 0; e < DPL; ++e) out[e] = word_elem(w, e);
#else
#pragma unroll
  for (int e = 0; e < DPL; ++e) out[e] = e < ne ? to_f(src[e]) : 0.f;
#endif
}

// Sums v[g] over the 32 lanes for all GP heads at once with a transposing
// butterfly: at each of the first LOG2GP steps a lane keeps one half of its
// values and trades the other half with its partner, so GP - 1 shuffles
// (plus 5 - LOG2GP plain ones) replace GP * 5. Afterwards every lane holds the
// full sum for head g = lane >> (5 - LOG2GP) (its "own" head).
__device__ __forceinline__ float group_reduce(float (&v)[GP], int lane) {
#pragma unroll
  for (int k = 0; k < LOG2GP; ++k) {
    const int off = 16 >> k;
    const int half = GP >> (k + 1);
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(FULL_MASK, send, off);
    }
  }
#pragma unroll
  for (int off = 16 >> LOG2GP; off > 0; off >>= 1) v[0] += __shfl_xor_sync(FULL_MASK, v[0], off);
  return v[0];
}

extern "C" __global__ void __launch_bounds__(NW * 32)
paged_attn_partial(const T* __restrict__ q, const T* __restrict__ k_pages,
                   const T* __restrict__ v_pages, const int* __restrict__ page_table,
                   const int* __restrict__ num_blocks, const int* __restrict__ last_block_len,
                   float scale_log2, int Hkv, int NB, int S, int chunk,
                   float* __restrict__ part_m, float* __restrict__ part_l,
                   float* __restrict__ part_acc, float* __restrict__ blk_max,
                   float* __restrict__ blk_sum) {
  extern __shared__ float smem[];
  const int s = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int Hq = Hkv * G;
  const int n = max(0, min(num_blocks[b], NB));
  const int last = max(0, min(last_block_len[b], BS));
  const int j0 = s * chunk;
  const int j1 = min(j0 + chunk, n);
  const int e0 = lane * DPL;
  const int ne = max(0, min(DPL, D - e0));  // < DPL only when D % 32 != 0 (VEC == 0)
  const int my_g = lane >> (5 - LOG2GP);
  const bool head_lane = (lane & ((32 >> LOG2GP) - 1)) == 0;  // one writer per own-head group

  float qf[GP][DPL];
#pragma unroll
  for (int g = 0; g < GP; ++g) {
#pragma unroll
    for (int e = 0; e < DPL; ++e) qf[g][e] = 0.f;
    if (g < G && ne > 0) {
      load_row(q + ((size_t)b * Hq + kvh * G + g) * D + e0, qf[g], ne);
#pragma unroll
      for (int e = 0; e < DPL; ++e) qf[g][e] *= scale_log2;
    }
  }

  float acc[G][DPL];
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < DPL; ++e) acc[g][e] = 0.f;
  float m_own = NEG_INF, l_own = 0.f;  // running max / denominator of the own head

  for (int j = j0 + warp; j < j1; j += NW) {
    const size_t page = (size_t)page_table[((size_t)b * Hkv + kvh) * NB + j];
    const int len = j == n - 1 ? last : BS;
    const T* kb = k_pages + page * BS * D + e0;
    const T* vb = v_pages + page * BS * D + e0;
    float bsum = 0.f;  // this block's sum of exp2(logit - m_own), kept relative to m_own
    for (int t0 = 0; t0 < len; t0 += PT) {
      // Issue every K and V load of the tile before any math, so a warp
      // keeps 2 * PT row loads in flight instead of waiting on each.
      float kf[PT][DPL], vf[PT][DPL];
#pragma unroll
      for (int p = 0; p < PT; ++p) {
        if (t0 + p < len && ne > 0) {  // t0, len: warp-uniform; ne: lanes past D load nothing
          load_row(kb + (size_t)(t0 + p) * D, kf[p], ne);
          load_row(vb + (size_t)(t0 + p) * D, vf[p], ne);
        } else {
#pragma unroll
          for (int e = 0; e < DPL; ++e) kf[p][e] = vf[p][e] = 0.f;
        }
      }
      float s_own[PT];
      float tmax = NEG_INF;
#pragma unroll
      for (int p = 0; p < PT; ++p) {
        s_own[p] = NEG_INF;
        if (t0 + p < len) {
          float dot[GP];
#pragma unroll
          for (int g = 0; g < GP; ++g) {
            float x = 0.f;
#pragma unroll
            for (int e = 0; e < DPL; ++e) x += qf[g][e] * kf[p][e];
            dot[g] = x;
          }
          s_own[p] = group_reduce(dot, lane);
          tmax = fmaxf(tmax, s_own[p]);
        }
      }
      // The tile has at least one valid position, so m_new is finite and
      // exp2(-inf) = 0 takes care of the first tile and of padded positions.
      const float m_new = fmaxf(m_own, tmax);
      const float c = exp2f(m_own - m_new);
      float w_own[PT];
      float wsum = 0.f;
#pragma unroll
      for (int p = 0; p < PT; ++p) {
        w_own[p] = exp2f(s_own[p] - m_new);
        wsum += w_own[p];
      }
      l_own = l_own * c + wsum;
      bsum = bsum * c + wsum;
      m_own = m_new;
      // Every lane accumulates all G heads for its slice of V, so it fetches
      // each head's rescale factor and weights from that head's owner lane.
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float cg = __shfl_sync(FULL_MASK, c, g << (5 - LOG2GP));
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[g][e] *= cg;
      }
#pragma unroll
      for (int p = 0; p < PT; ++p) {
        if (t0 + p < len) {
#pragma unroll
          for (int g = 0; g < G; ++g) {
            const float wg = __shfl_sync(FULL_MASK, w_own[p], g << (5 - LOG2GP));
#pragma unroll
            for (int e = 0; e < DPL; ++e) acc[g][e] += wg * vf[p][e];
          }
        }
      }
    }
    if (head_lane && my_g < G) {
      const size_t o = ((size_t)b * Hq + kvh * G + my_g) * NB + j;
      blk_max[o] = m_own;
      blk_sum[o] = bsum;
    }
  }

  // Merge the NW warps' partial softmax states of this split through shared memory.
  float* sm_m = smem;                 // [NW][GP]
  float* sm_l = sm_m + NW * GP;       // [NW][GP]
  float* sm_acc = sm_l + NW * GP;     // [NW][G][D]
  if (head_lane) {
    sm_m[warp * GP + my_g] = m_own;
    sm_l[warp * GP + my_g] = l_own;
  }
#pragma unroll
  for (int g = 0; g < G; ++g)
#pragma unroll
    for (int e = 0; e < DPL; ++e)
      if (e < ne) sm_acc[(warp * G + g) * D + e0 + e] = acc[g][e];
  __syncthreads();
  for (int i = threadIdx.x; i < G * D; i += NW * 32) {
    const int g = i / D, dd = i - g * D;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, sm_m[w * GP + g]);
    float L = 0.f, A = 0.f;
    if (M != NEG_INF) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float f = exp2f(sm_m[w * GP + g] - M);
        L += sm_l[w * GP + g] * f;
        A += sm_acc[(w * G + g) * D + dd] * f;
      }
    }
    const size_t hs = ((size_t)b * Hq + kvh * G + g) * S + s;
    part_acc[hs * D + dd] = A;
    if (dd == 0) {
      part_m[hs] = M;
      part_l[hs] = L;
    }
  }
}

extern "C" __global__ void paged_attn_combine(const float* __restrict__ part_m,
                                              const float* __restrict__ part_l,
                                              const float* __restrict__ part_acc,
                                              const float* __restrict__ blk_max,
                                              float* __restrict__ block_mass,
                                              const int* __restrict__ num_blocks,
                                              T* __restrict__ out, int Hq, int NB, int S) {
  const int h = blockIdx.x, b = blockIdx.y;
  const size_t bh = (size_t)b * Hq + h;
  const float* pm = part_m + bh * S;
  const float* pl = part_l + bh * S;
  float M = NEG_INF;
  for (int s = 0; s < S; ++s) M = fmaxf(M, pm[s]);
  float L = 0.f;
  if (M != NEG_INF)
    for (int s = 0; s < S; ++s) L += pl[s] * exp2f(pm[s] - M);
  const float inv = L > 0.f ? 1.f / L : 0.f;  // no resident token: output and mass are 0
  for (int dd = threadIdx.x; dd < D; dd += blockDim.x) {
    float A = 0.f;
    if (M != NEG_INF)
      for (int s = 0; s < S; ++s) A += part_acc[(bh * S + s) * D + dd] * exp2f(pm[s] - M);
    out[bh * D + dd] = from_f(A * inv);
  }
  // block_mass holds the partial kernel's block sums on entry (see the top comment).
  const int n = max(0, min(num_blocks[b], NB));
  for (int j = threadIdx.x; j < NB; j += blockDim.x) {
    const size_t o = bh * NB + j;
    block_mass[o] = (j < n && inv > 0.f) ? block_mass[o] * exp2f(blk_max[o] - M) * inv : 0.f;
  }
}
