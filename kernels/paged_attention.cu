// Paged attention over prefixkv's block pools: decode, extend and split-context with a reduction.
//
// Layout (issue 4, the seed's layout): K and V pools are separate, each contiguous
// [num_blocks, block_size, kv_heads, head_dim] in fp16 or bf16. Element (block p, slot s, head h, dim d)
// lives at ((p * B + s) * Hkv + h) * D + d. A sequence's logical block i is block_tables[seq][i];
// position t is in logical block t / B at slot t % B.
//
// One CTA (128 threads) serves one query token, R query heads of one KV head group (GQA: the R heads
// share every K/V vector the CTA loads) and one range of the context (the whole context, or one split).
// The context is walked in tiles of 64 positions:
//   A. each group of TPT = D/8 threads loads one position's K row with 16-byte vector loads (8
//      elements per thread) and computes R partial dot products; a reduce-scatter over the TPT lanes
//      leaves each row's score with one lane, which writes it to shared memory (-inf where masked);
//   B. one warp per row turns the tile's scores into probabilities against the running maximum
//      (online softmax: m, l kept in shared memory, the accumulator rescaled by 2^(m_old - m_new));
//   C. the same thread mapping loads V and accumulates p * v in fp32 registers.
// Positions at or beyond the CTA's end (the tail of the last block, later splits, or the causal limit
// of an extend query) are never loaded: their scores are -inf and their V contribution is skipped,
// so NaN garbage in unused slots cannot reach the result.
// Scores are kept in log2 units (the caller passes scale * log2(e)); lse is returned in natural log.
//
// With one split the CTA writes the normalised output (and lse). With several, each CTA writes an
// unnormalised partial (acc, m, l) and paged_attention_reduce_kernel merges them.
//
// No PyTorch headers; compiled by NVRTC (CuPy RawModule, name_expressions), by nvcc, and by the host
// compiler against tests/cuda_emu's shims. NVRTC builds define PREFIXKV_NO_INSTANTIATIONS and
// instantiate through name expressions; every other build gets the explicit instantiations at the end.

#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace prefixkv {

constexpr int kThreads = 128;                 // threads per CTA
constexpr int kWarps = kThreads / 32;
constexpr int kTile = 64;                     // context positions per tile
constexpr int kVec = 8;                       // fp16/bf16 elements per 16-byte load
constexpr int kMaxSplits = 512;               // the reduction's shared-memory bound
constexpr unsigned int kFullMask = 0xffffffffu;
constexpr float kLn2 = 0.693147180559945309f;

constexpr int kFlagExtend = 1;                // query_start_loc is valid: flat extend queries
constexpr int kFlagLse = 2;                   // write lse

// Occupancy hint for ptxas: its default register heuristics spill the smallest configurations.
__host__ __device__ constexpr int attn_min_blocks(int rows, int head_dim) {
  return rows * head_dim <= 256 ? 4 : (rows * head_dim <= 512 ? 3 : 2);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// -- conversions ----------------------------------------------------------------------------------
template <typename T> struct Pack;

template <> struct Pack<__half> {
  static __device__ __forceinline__ float2 unpack(unsigned int w) {
    return make_float2(__half2float(__ushort_as_half((unsigned short)(w & 0xffffu))),
                       __half2float(__ushort_as_half((unsigned short)(w >> 16))));
  }
  static __device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
};

template <> struct Pack<__nv_bfloat16> {
  // bf16 is the top half of an fp32: widening is a shift (element 0 is the low half-word).
  static __device__ __forceinline__ float2 unpack(unsigned int w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
};

template <typename T>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[kVec]) {
  const float2 a = Pack<T>::unpack(v.x);
  const float2 b = Pack<T>::unpack(v.y);
  const float2 c = Pack<T>::unpack(v.z);
  const float2 d = Pack<T>::unpack(v.w);
  f[0] = a.x; f[1] = a.y; f[2] = b.x; f[3] = b.y;
  f[4] = c.x; f[5] = c.y; f[6] = d.x; f[7] = d.y;
}

template <typename T>
__device__ __forceinline__ uint4 load16(const T* p) {
  return *reinterpret_cast<const uint4*>(p);
}

// -- warp reductions --------------------------------------------------------------------------------
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) x = fmaxf(x, __shfl_xor_sync(kFullMask, x, off));
  return x;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off >= 1; off /= 2) x += __shfl_xor_sync(kFullMask, x, off);
  return x;
}

// R partial sums per lane, summed over groups of TPT consecutive lanes. A reduce-scatter: at each of
// the first log2(R) steps a lane keeps half of its rows and trades the other half with its partner,
// so R rows cost R-1 + log2(TPT/R) shuffles instead of R*log2(TPT). Afterwards every lane holds the
// full sum of row (lane % TPT) / (TPT / R).
template <int R, int TPT>
__device__ __forceinline__ float group_reduce_scatter(float (&v)[R], int lane) {
#pragma unroll
  for (int h = R / 2, off = TPT / 2; h >= 1; h /= 2, off /= 2) {
    const bool upper = (lane & off) != 0;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const float send = upper ? v[i] : v[i + h];
      const float keep = upper ? v[i + h] : v[i];
      v[i] = keep + __shfl_xor_sync(kFullMask, send, off);
    }
  }
#pragma unroll
  for (int off = TPT / (2 * R); off >= 1; off /= 2) v[0] += __shfl_xor_sync(kFullMask, v[0], off);
  return v[0];
}

// -- the attention kernel ---------------------------------------------------------------------------
#define PREFIXKV_ATTN_PARAMS(T)                                                                     \
  T* __restrict__ out,                      /* [tokens, Hq, D]            (one split)          */  \
  float* __restrict__ lse,                  /* [tokens, Hq]               (one split, flag)    */  \
  float* __restrict__ part_acc,             /* [tokens, Hq, splits, D]    (several splits)     */  \
  float* __restrict__ part_ml,              /* [tokens, Hq, splits, 2]    (several splits)     */  \
  const T* __restrict__ query,              /* [tokens, Hq, D]                                 */  \
  const T* __restrict__ k_pool,             /* [blocks, B, Hkv, D]                             */  \
  const T* __restrict__ v_pool,             /* [blocks, B, Hkv, D]                             */  \
  const int* __restrict__ block_tables,     /* [seqs, table_stride]                            */  \
  const int* __restrict__ seq_lens,         /* [seqs]                                          */  \
  const int* __restrict__ query_start_loc,  /* [seqs + 1] (kFlagExtend)                       */  \
  int num_seqs, int table_stride, int num_kv_heads, int group, int blocks_per_split, int flags,     \
  float scale_log2

// grid: (tokens, Hkv * ceil(group / R), splits); block: kThreads.
template <typename T, int D, int B, int R>
__global__ void __launch_bounds__(kThreads, attn_min_blocks(R, D)) paged_attention_kernel(PREFIXKV_ATTN_PARAMS(T)) {
  constexpr int TPT = D / kVec;               // threads per context position
  constexpr int NSUB = kThreads / TPT;        // positions in flight per pass
  constexpr int U = kTile / NSUB;             // positions per thread per tile
  constexpr int ROW_LANES = TPT / R;          // lanes holding the same row after the reduce-scatter
  constexpr int LB = (R >= 4 && U > 2) ? U / 2 : U;  // 16-byte loads in flight per thread (registers)
  static_assert(D % kVec == 0 && 32 % TPT == 0, "head_dim must be 64 or 128");
  static_assert(R >= 1 && R <= TPT && (R & (R - 1)) == 0, "rows must be a power of two <= D/8");
  static_assert(kTile % NSUB == 0 && kTile == 64, "phase B assumes two scores per lane");
  static_assert(U <= 32, "valid-position bitmask");

  __shared__ float s_p[R][kTile];             // scores, then probabilities, of the current tile
  __shared__ float s_m[R];                    // running max (log2 units)
  __shared__ float s_l[R];                    // running sum of 2^(s - m)
  __shared__ float s_corr[R];                 // this tile's rescale factor
  __shared__ float s_red[NSUB][R][D];         // per position slot partial outputs

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const int col = tid % TPT;                  // this thread's 8 dimensions: [col * 8, col * 8 + 8)
  const int sub = tid / TPT;                  // this thread's position slot

  const int chunks = (group + R - 1) / R;
  const int token = blockIdx.x;
  const int kvh = blockIdx.y / chunks;
  const int chunk = blockIdx.y % chunks;
  const int split = blockIdx.z;
  const int num_splits = gridDim.z;
  const int num_q_heads = num_kv_heads * group;
  const int head0 = kvh * group + chunk * R;
  const int nrows = min(R, group - chunk * R);

  // The sequence of this query and how many positions it sees (causal limit).
  int seq;
  int limit;
  if (flags & kFlagExtend) {
    int lo = 0;
    int hi = num_seqs - 1;
    while (lo < hi) {                         // last sequence whose first query is <= token
      const int mid = (lo + hi + 1) >> 1;
      if (query_start_loc[mid] <= token) lo = mid; else hi = mid - 1;
    }
    seq = lo;
    const int first = query_start_loc[seq];
    const int q_len = query_start_loc[seq + 1] - first;
    limit = seq_lens[seq] - q_len + (token - first) + 1;
  } else {
    seq = token;
    limit = seq_lens[seq];
  }
  const int span = blocks_per_split * B;
  const int start = split * span;
  const int end = min(limit, start + span);

  // Queries of the R rows, pre-scaled into log2 units.
  float q[R][kVec];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (r < nrows) {
      const long long off = ((long long)token * num_q_heads + head0 + r) * D + col * kVec;
      unpack8<T>(load16(query + off), q[r]);
#pragma unroll
      for (int i = 0; i < kVec; ++i) q[r][i] *= scale_log2;
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) q[r][i] = 0.f;
    }
  }
  float acc[R][kVec];
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[r][i] = 0.f;
  }
  if (tid < R) {
    s_m[tid] = neg_inf();
    s_l[tid] = 0.f;
  }

  const int* table = block_tables + (long long)seq * table_stride;
  const long long slot_stride = (long long)num_kv_heads * D;
  const long long head_off = (long long)kvh * D + col * kVec;

  for (int t0 = start; t0 < end; t0 += kTile) {
    // Which of this thread's U positions are inside [start, end): the only mask there is.
    unsigned int valid = 0u;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (t0 + u * NSUB + sub < end) valid |= 1u << u;
    }

    // A. scores, LB positions' loads in flight per thread at a time
#pragma unroll
    for (int u0 = 0; u0 < U; u0 += LB) {
      uint4 kv[LB];
#pragma unroll
      for (int j = 0; j < LB; ++j) {
        const int u = u0 + j;
        if (valid & (1u << u)) {
          const int t = t0 + u * NSUB + sub;
          const long long blk = table[t / B];
          kv[j] = load16(k_pool + (blk * B + t % B) * slot_stride + head_off);
        } else {
          kv[j] = make_uint4(0u, 0u, 0u, 0u);
        }
      }
#pragma unroll
      for (int j = 0; j < LB; ++j) {
        const int u = u0 + j;
        float kf[kVec];
        unpack8<T>(kv[j], kf);
        float part[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          float s = 0.f;
#pragma unroll
          for (int i = 0; i < kVec; ++i) s = fmaf(q[r][i], kf[i], s);
          part[r] = s;
        }
        const float score = group_reduce_scatter<R, TPT>(part, lane);
        if (col % ROW_LANES == 0) {
          s_p[col / ROW_LANES][u * NSUB + sub] = (valid & (1u << u)) ? score : neg_inf();
        }
      }
    }
    __syncthreads();  // scores visible

    // B. online softmax: one warp per row
    for (int r = warp; r < R; r += kWarps) {
      const float x0 = s_p[r][lane];
      const float x1 = s_p[r][lane + 32];
      const float m_old = s_m[r];
      const float m_new = fmaxf(m_old, warp_max(fmaxf(x0, x1)));
      const float m_use = (m_new == neg_inf()) ? 0.f : m_new;  // nothing seen yet: keep exp2 finite
      const float corr = exp2f(m_old - m_use);
      const float p0 = exp2f(x0 - m_use);
      const float p1 = exp2f(x1 - m_use);
      s_p[r][lane] = p0;
      s_p[r][lane + 32] = p1;
      const float sum = warp_sum(p0 + p1);
      __syncwarp();
      if (lane == 0) {
        s_l[r] = s_l[r] * corr + sum;
        s_m[r] = m_new;
        s_corr[r] = corr;
      }
    }
    __syncthreads();  // probabilities visible

    // C. acc = acc * corr + p * v
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float corr = s_corr[r];
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[r][i] *= corr;
    }
#pragma unroll
    for (int u0 = 0; u0 < U; u0 += LB) {
      uint4 vv[LB];
#pragma unroll
      for (int j = 0; j < LB; ++j) {
        const int u = u0 + j;
        if (valid & (1u << u)) {
          const int t = t0 + u * NSUB + sub;
          const long long blk = table[t / B];
          vv[j] = load16(v_pool + (blk * B + t % B) * slot_stride + head_off);
        }
      }
#pragma unroll
      for (int j = 0; j < LB; ++j) {
        const int u = u0 + j;
        if (valid & (1u << u)) {
          float vf[kVec];
          unpack8<T>(vv[j], vf);
#pragma unroll
          for (int r = 0; r < R; ++r) {
            const float p = s_p[r][u * NSUB + sub];
#pragma unroll
            for (int i = 0; i < kVec; ++i) acc[r][i] = fmaf(p, vf[i], acc[r][i]);
          }
        }
      }
    }
    __syncthreads();  // s_p, s_corr free for the next tile
  }

  // Sum the position slots' partial outputs.
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) s_red[sub][r][col * kVec + i] = acc[r][i];
  }
  __syncthreads();  // partial outputs and the final m, l visible

  for (int o = tid; o < R * D; o += kThreads) {
    const int r = o / D;
    const int d = o % D;
    if (r >= nrows) continue;
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < NSUB; ++s) sum += s_red[s][r][d];
    const int head = head0 + r;
    const float m = s_m[r];
    const float l = s_l[r];
    const long long row = (long long)token * num_q_heads + head;
    if (num_splits == 1) {
      out[row * D + d] = Pack<T>::from_float(l > 0.f ? sum / l : 0.f);
      if ((flags & kFlagLse) && d == 0) lse[row] = l > 0.f ? (m + log2f(l)) * kLn2 : neg_inf();
    } else {
      const long long part = row * num_splits + split;
      if (l > 0.f) part_acc[part * D + d] = sum;  // an empty split leaves its acc unwritten
      if (d == 0) {
        part_ml[part * 2] = m;
        part_ml[part * 2 + 1] = l;
      }
    }
  }
}

// -- merging the splits -----------------------------------------------------------------------------
#define PREFIXKV_REDUCE_PARAMS(T)                                                                   \
  T* __restrict__ out, float* __restrict__ lse, const float* __restrict__ part_acc,                 \
  const float* __restrict__ part_ml, int num_splits, int flags

// grid: (tokens, Hq); block: kThreads. out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s.
template <typename T, int D>
__global__ void __launch_bounds__(kThreads) paged_attention_reduce_kernel(PREFIXKV_REDUCE_PARAMS(T)) {
  __shared__ float s_w[kMaxSplits];           // 2^(m_s - M), 0 for empty splits
  __shared__ float s_warp[kWarps];
  __shared__ float s_total[2];                // M, L

  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int warp = tid >> 5;
  const long long row = (long long)blockIdx.x * gridDim.y + blockIdx.y;
  const float* ml = part_ml + row * num_splits * 2;

  float mx = neg_inf();
  for (int s = tid; s < num_splits; s += kThreads) {
    if (ml[2 * s + 1] > 0.f) mx = fmaxf(mx, ml[2 * s]);
  }
  mx = warp_max(mx);
  if (lane == 0) s_warp[warp] = mx;
  __syncthreads();
  if (tid == 0) {
    float m = s_warp[0];
#pragma unroll
    for (int w = 1; w < kWarps; ++w) m = fmaxf(m, s_warp[w]);
    s_total[0] = m;
  }
  __syncthreads();
  const float big_m = s_total[0];

  float lsum = 0.f;
  for (int s = tid; s < num_splits; s += kThreads) {
    const float l = ml[2 * s + 1];
    const float w = l > 0.f ? exp2f(ml[2 * s] - big_m) : 0.f;
    s_w[s] = w;
    lsum += w * l;
  }
  lsum = warp_sum(lsum);
  __syncthreads();  // everyone has read s_warp before it is reused
  if (lane == 0) s_warp[warp] = lsum;
  __syncthreads();
  if (tid == 0) {
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) l += s_warp[w];
    s_total[1] = l;
  }
  __syncthreads();
  const float big_l = s_total[1];

  for (int d = tid; d < D; d += kThreads) {
    float a = 0.f;
    for (int s = 0; s < num_splits; ++s) {
      const float w = s_w[s];
      if (w > 0.f) a = fmaf(w, part_acc[(row * num_splits + s) * D + d], a);
    }
    out[row * D + d] = Pack<T>::from_float(big_l > 0.f ? a / big_l : 0.f);
  }
  if ((flags & kFlagLse) && tid == 0) lse[row] = big_l > 0.f ? (big_m + log2f(big_l)) * kLn2 : neg_inf();
}

}  // namespace prefixkv

#ifndef PREFIXKV_NO_INSTANTIATIONS
// Every configuration the Python side launches: dtype x head_dim x block_size x rows per CTA.
#define PREFIXKV_INST_ATTN(T, D, B, R) \
  template __global__ void prefixkv::paged_attention_kernel<T, D, B, R>(PREFIXKV_ATTN_PARAMS(T));
#define PREFIXKV_INST_ROWS(T, D, B) \
  PREFIXKV_INST_ATTN(T, D, B, 1) PREFIXKV_INST_ATTN(T, D, B, 2) \
  PREFIXKV_INST_ATTN(T, D, B, 4) PREFIXKV_INST_ATTN(T, D, B, 8)
#define PREFIXKV_INST_DTYPE_DIM(T, D)                                             \
  PREFIXKV_INST_ROWS(T, D, 8) PREFIXKV_INST_ROWS(T, D, 16) PREFIXKV_INST_ROWS(T, D, 32) \
  template __global__ void prefixkv::paged_attention_reduce_kernel<T, D>(PREFIXKV_REDUCE_PARAMS(T));
PREFIXKV_INST_DTYPE_DIM(__half, 64)
PREFIXKV_INST_DTYPE_DIM(__half, 128)
PREFIXKV_INST_DTYPE_DIM(__nv_bfloat16, 64)
PREFIXKV_INST_DTYPE_DIM(__nv_bfloat16, 128)
#endif
