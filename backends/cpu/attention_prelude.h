// Source text of the fused attention kernels on the host (flash-attention style), added to a
// generated translation unit that has an Attention kernel (jit/kernel_ir.h AttentionCall). The
// rendered kernel calls them with its sizes, strides and tile sizes as constants.
//
// Scores live in (BR, BC) tiles: a block of query rows against a block of keys, with a running
// maximum and sum per row (online softmax), so no (Tq, Tk) matrix is ever in memory. The
// backward recomputes each tile's probabilities from the saved log-sum-exp of every row. One task
// per (batch, head[, block of query rows]): tasks are independent and each sums in a fixed order,
// so results do not depend on the number of threads.
#pragma once

namespace kiln::cpu {

inline constexpr const char* kAttentionPrelude = R"KILN(
#include <stdlib.h>
#include <string.h>

// q, k and v may be bfloat16 (autocast's matmul outputs): read as float, computed in float.
struct KilnBf16 {
  uint16_t bits;
};
static inline float kiln_attn_value(KilnBf16 x) { return kiln_bf2f(x.bits); }
static inline float kiln_attn_value(float x) { return x; }
static inline double kiln_attn_value(double x) { return x; }
static inline float kiln_attn_exp(float x) { return kiln_expf(x); }
static inline double kiln_attn_exp(double x) { return __builtin_exp(x); }
static inline float kiln_attn_log(float x) { return kiln_logf(x); }
static inline double kiln_attn_log(double x) { return __builtin_log(x); }

// An operand over (batch, head, position, feature) at constant element strides (constants, so
// that the compiler sees contiguous rows where there are some).
template <typename T, int64_t SB, int64_t SH, int64_t ST, int64_t SD>
struct KilnAttnView {
  T* p;
  T& at(int64_t b, int64_t h, int64_t t, int64_t d) const { return p[b * SB + h * SH + t * ST + d * SD]; }
};

// Asks for the rows of (b, h) ahead of their use: a backward's operands were written long before
// and come from far in the memory hierarchy, and a task reading them row by row would wait on
// each (measured: half the backward's time at T = 64).
template <class View>
static inline void kiln_attn_prefetch(const View& x, int64_t b, int64_t h, int64_t rows, int64_t cols) {
  constexpr int64_t per_line = 64 / (int64_t)sizeof(*x.p);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t d = 0; d < cols; d += per_line) __builtin_prefetch(&x.at(b, h, t, d), 0, 2);
}

// Scratch of one task, 64-byte aligned; freed when the task ends.
template <typename T>
struct KilnAttnScratch {
  T* base;
  explicit KilnAttnScratch(int64_t elements) {
    base = (T*)aligned_alloc(64, (size_t)((elements * (int64_t)sizeof(T) + 63) / 64 * 64));
  }
  ~KilnAttnScratch() { free(base); }
};

// Tiles are products of small matrices held in one task's scratch, rows padded with zeros to a
// whole number of 64-byte vectors, so the products below are vector-only (GCC's vector extension
// compiles to the widest vectors -march=native has). Multiply-add contraction is allowed in
// them: attention is compared with a tolerance, never bit for bit with another backend.
template <typename T>
struct KilnAttnVec {
  typedef T type __attribute__((vector_size(64)));
  static constexpr int64_t lanes = 64 / sizeof(T);
};

// C[m][:N] (+)= sum_{k < count} A[m * a_row + k * a_col] * B[k][:N] for m < rows: a tile of
// scores (A query rows, B keys transposed; ADD false: C starts from zero), or of probabilities
// (or their transpose, a_row 1) times values, keys or query rows.
template <typename T, int64_t N, bool ADD = true>
__attribute__((optimize("fp-contract=fast"))) static inline void kiln_tile_acc(const T* A, int64_t a_row,
                                                                               int64_t a_col, int64_t count,
                                                                               const T* B, T* C, int64_t rows) {
  typedef typename KilnAttnVec<T>::type V;
  constexpr int64_t NV = N / KilnAttnVec<T>::lanes;
  constexpr int64_t RB = NV <= 1 ? 8 : (NV <= 2 ? 4 : (NV <= 4 ? 2 : 1));  // rows at once: ~8 accumulators
  const V* b = (const V*)B;
  V* c = (V*)C;
  int64_t m = 0;
  for (; m + RB <= rows; m += RB) {
    V acc[RB][NV];
    #pragma GCC unroll 16
    for (int64_t r = 0; r < RB; ++r)
      #pragma GCC unroll 16
      for (int64_t v = 0; v < NV; ++v) acc[r][v] = ADD ? c[(m + r) * NV + v] : V{};
    for (int64_t k = 0; k < count; ++k)
      #pragma GCC unroll 16
      for (int64_t r = 0; r < RB; ++r) {
        const T a = A[(m + r) * a_row + k * a_col];
        #pragma GCC unroll 16
        for (int64_t v = 0; v < NV; ++v) acc[r][v] += a * b[k * NV + v];
      }
    #pragma GCC unroll 16
    for (int64_t r = 0; r < RB; ++r)
      #pragma GCC unroll 16
      for (int64_t v = 0; v < NV; ++v) c[(m + r) * NV + v] = acc[r][v];
  }
  for (; m < rows; ++m) {
    if (!ADD)
      for (int64_t v = 0; v < NV; ++v) c[m * NV + v] = V{};
    for (int64_t k = 0; k < count; ++k) {
      const T a = A[m * a_row + k * a_col];
      #pragma GCC unroll 16
      for (int64_t v = 0; v < NV; ++v) c[m * NV + v] += a * b[k * NV + v];
    }
  }
}

// The row loops in whole vectors (GCC vectorizes the plain loops only in part). The float exp
// is the prelude's kiln_expf operation for operation on every lane (rint as the 1.5 * 2^23
// round trip, exact for |x| < 2^22), so a lane gives kiln_expf's bits.
typedef int32_t KilnAttnInts __attribute__((vector_size(64)));
static inline KilnAttnVec<float>::type kiln_expf_lanes(KilnAttnVec<float>::type x) {
  typedef KilnAttnVec<float>::type V;
  const V xc = x < -87.33654f ? (V{} - 87.33654f) : (x > 88.72283f ? (V{} + 88.72283f) : x);
  const V n = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;
  const V r = xc - n * 0.693145752f - n * 1.42860677e-6f;
  const V p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f +
              r * (0.00138888892f + r * 0.000198412701f))))));
  const KilnAttnInts ni = __builtin_convertvector(n, KilnAttnInts), half = ni >> 1;
  V y = p * (V)((half + 127) << 23) * (V)((ni - half + 127) << 23);
  y = x > 88.72283f ? (V{} + __builtin_inff()) : y;
  y = x < -87.33654f ? V{} : y;
  return x != x ? x : y;
}

// Hides keys j >= seen of a score row (-inf) and returns the row's maximum.
template <typename T, int64_t BC>
static inline T kiln_attn_mask_max(T* row, int64_t seen) {
  typedef typename KilnAttnVec<T>::type V;
  constexpr int64_t L = KilnAttnVec<T>::lanes, NV = BC / L;
  V* r = (V*)row;
  V lane;
  for (int64_t l = 0; l < L; ++l) lane[l] = (T)l;
  const V minus_inf = V{} - (T)__builtin_inf();
  V top = minus_inf;
  for (int64_t v = 0; v < NV; ++v) {
    V x = r[v];
    if ((v + 1) * L > seen) r[v] = x = lane < (T)(seen - v * L) ? x : minus_inf;
    top = x > top ? x : top;
  }
  T m = top[0];
  for (int64_t l = 1; l < L; ++l) m = top[l] > m ? top[l] : m;
  return m;
}

// row[j] = exp(row[j] - m) for the whole row; returns the sum when SUM.
template <typename T, int64_t BC, bool SUM = true>
static inline T kiln_attn_exp_sum(T* row, T m) {
  if constexpr (sizeof(T) == sizeof(float)) {
    typedef KilnAttnVec<float>::type V;
    constexpr int64_t NV = BC / KilnAttnVec<float>::lanes;
    V* r = (V*)row;
    V sum = V{};
    for (int64_t v = 0; v < NV; ++v) {
      r[v] = kiln_expf_lanes(r[v] - m);
      if (SUM) sum += r[v];
    }
    if (!SUM) return 0;
    T total = 0;  // lanes in a fixed order: the same sum whatever the thread
    for (int64_t l = 0; l < KilnAttnVec<float>::lanes; ++l) total += sum[l];
    return total;
  } else {
    T total = 0;
    for (int64_t j = 0; j < BC; ++j) total += row[j] = kiln_attn_exp(row[j] - m);
    return total;
  }
}

// How many keys of the tile starting at key j0 (cols of them) query i sees: keys beyond
// i + (TK - TQ) are in its future.
template <bool CAUSAL, int64_t TQ, int64_t TK, int64_t BC>
static inline int64_t kiln_attn_seen(int64_t i, int64_t j0, int64_t cols) {
  if (!CAUSAL) return cols;
  const int64_t horizon = i + (TK - TQ) - j0 + 1;
  return horizon < 0 ? 0 : (horizon < cols ? horizon : cols);
}

// Feature counts padded to whole vectors.
template <typename T, int64_t D>
inline constexpr int64_t kiln_attn_pad = (D + KilnAttnVec<T>::lanes - 1) / KilnAttnVec<T>::lanes * KilnAttnVec<T>::lanes;

// o = softmax(scale q kᵀ [causal]) v and lse = the log-sum-exp of each row of scaled scores.
// BC is a multiple of 16 (whole vectors of floats and of doubles).
template <typename T, int64_t B, int64_t H, int64_t TQ, int64_t TK, int64_t D, int64_t DV, int64_t BR, int64_t BC,
          bool CAUSAL, class Q, class K, class V, class O, class L>
static void kiln_attention_forward(Q q, K k, V v, O o, L lse, T scale) {
  constexpr int64_t DP = kiln_attn_pad<T, D>, DVP = kiln_attn_pad<T, DV>;
  constexpr int64_t kBlocks = (TQ + BR - 1) / BR;
  constexpr int64_t kScratch = BR * DP + BR * DVP + BR * BC + DP * BC + BC * DVP + 2 * BR;
  #pragma omp parallel for schedule(dynamic) if (B * H * kBlocks > 1 && B * H * TQ * TK * (D + DV) > 32768)
  for (int64_t task = 0; task < B * H * kBlocks; ++task) {
    const int64_t b = task / (H * kBlocks), h = task / kBlocks % H, i0 = task % kBlocks * BR;
    const int64_t rows = TQ - i0 < BR ? TQ - i0 : BR;
    KilnAttnScratch<T> scratch(kScratch);
    T* qs = scratch.base;      // [BR][DP] scaled query rows
    T* acc = qs + BR * DP;     // [BR][DVP] unnormalized output rows
    T* kt = acc + BR * DVP;    // [DP][BC] keys, transposed
    T* vb = kt + DP * BC;      // [BC][DVP] values
    T* s = vb + BC * DVP;      // [BR][BC] scores, then probabilities
    T* m = s + BR * BC;        // [BR] running maximum
    T* l = m + BR;             // [BR] running sum
    // Padding (rows past `rows`, features past D and DV) reads as zeros in the tile products;
    // the tiles below rewrite only real features.
    memset(qs, 0, sizeof(T) * (BR * DP + BR * DVP + DP * BC + BC * DVP));
    for (int64_t i = 0; i < BR; ++i) m[i] = -__builtin_inf(), l[i] = 0;
    for (int64_t i = 0; i < rows; ++i) {
      #pragma omp simd
      for (int64_t d = 0; d < D; ++d) qs[i * DP + d] = scale * kiln_attn_value(q.at(b, h, i0 + i, d));
    }
    // Keys past the last row's horizon are in every row's future.
    const int64_t key_end = CAUSAL ? (i0 + rows + TK - TQ < TK ? i0 + rows + TK - TQ : TK) : TK;
    for (int64_t j0 = 0; j0 < key_end; j0 += BC) {
      const int64_t cols = key_end - j0 < BC ? key_end - j0 : BC;
      for (int64_t j = 0; j < BC; ++j) {
        for (int64_t d = 0; d < D; ++d) kt[d * BC + j] = j < cols ? kiln_attn_value(k.at(b, h, j0 + j, d)) : (T)0;
        for (int64_t d = 0; d < DV; ++d) vb[j * DVP + d] = j < cols ? kiln_attn_value(v.at(b, h, j0 + j, d)) : (T)0;
      }
      kiln_tile_acc<T, BC, false>(qs, DP, 1, DP, kt, s, rows);                  // scores
      for (int64_t i = 0; i < rows; ++i) {
        T* si = s + i * BC;
        const T top = kiln_attn_mask_max<T, BC>(si, kiln_attn_seen<CAUSAL, TQ, TK, BC>(i0 + i, j0, cols));
        const T m_new = top > m[i] ? top : m[i];
        if (m_new == -__builtin_inf()) {  // no key visible yet: nothing to add
          for (int64_t j = 0; j < BC; ++j) si[j] = 0;
          continue;
        }
        const T alpha = kiln_attn_exp(m[i] - m_new);
        l[i] = l[i] * alpha + kiln_attn_exp_sum<T, BC>(si, m_new);
        m[i] = m_new;
        #pragma omp simd
        for (int64_t d = 0; d < DVP; ++d) acc[i * DVP + d] *= alpha;
      }
      kiln_tile_acc<T, DVP>(s, BC, 1, cols, vb, acc, rows);
    }
    for (int64_t i = 0; i < rows; ++i) {
      const T inv = (T)1 / l[i];  // no visible key at all: 0 / 0, as the composite's softmax
      #pragma omp simd
      for (int64_t d = 0; d < DV; ++d) o.at(b, h, i0 + i, d) = acc[i * DVP + d] * inv;
      lse.at(b, h, i0 + i, 0) = m[i] + kiln_attn_log(l[i]);
    }
  }
}

// dq, dk, dv of the forward above from its o, lse and the output gradient do_: per (batch, head),
// blocks of keys (outer) against blocks of query rows (inner), probabilities recomputed per tile.
template <typename T, int64_t B, int64_t H, int64_t TQ, int64_t TK, int64_t D, int64_t DV, int64_t BR, int64_t BC,
          bool CAUSAL, class Q, class K, class V, class O, class L, class DO, class DQ, class DK, class DV_>
static void kiln_attention_backward(Q q, K k, V v, O o, L lse, DO do_, DQ dq, DK dk, DV_ dv, T scale) {
  constexpr int64_t DP = kiln_attn_pad<T, D>, DVP = kiln_attn_pad<T, DV>;
  constexpr int64_t TQP = (TQ + 15) / 16 * 16;  // keeps the regions after delta vector-aligned
  constexpr int64_t kScratch = TQP + TQ * DP + TQ * DP + TQ * DVP + 3 * BR * BC + DP * BC + BC * DP + DVP * BC +
                               BC * DP + BC * DVP;
  // Static: a thread's next task is task + 1, whose operands it prefetches while it works on this one.
  #pragma omp parallel for schedule(static) if (B * H > 1 && B * H * TQ * TK * (D + DV) > 32768)
  for (int64_t task = 0; task < B * H; ++task) {
    const int64_t b = task / H, h = task % H;
    if (task + 1 < B * H) {
      const int64_t nb = (task + 1) / H, nh = (task + 1) % H;
      kiln_attn_prefetch(q, nb, nh, TQ, D);
      kiln_attn_prefetch(k, nb, nh, TK, D);
      kiln_attn_prefetch(v, nb, nh, TK, DV);
      kiln_attn_prefetch(o, nb, nh, TQ, DV);
      kiln_attn_prefetch(do_, nb, nh, TQ, DV);
    }
    KilnAttnScratch<T> scratch(kScratch);
    T* delta = scratch.base;     // [TQ] rowsum(do * o)
    T* dqa = delta + TQP;        // [TQ][DP] dq, unscaled
    T* qs = dqa + TQ * DP;       // [TQ][DP] scaled query rows (every key block reads them)
    T* dob = qs + TQ * DP;       // [TQ][DVP] output gradient rows
    T* kt = dob + TQ * DVP;      // [DP][BC] keys, transposed
    T* kb = kt + DP * BC;        // [BC][DP] keys
    T* vt = kb + BC * DP;        // [DVP][BC] values, transposed
    T* dka = vt + DVP * BC;      // [BC][DP]
    T* dva = dka + BC * DP;      // [BC][DVP]
    T* p = dva + BC * DVP;       // [BR][BC] probabilities
    T* dp = p + BR * BC;         // [BR][BC] do vᵀ
    T* ds = dp + BR * BC;        // [BR][BC] score gradients
    // dq accumulates from zero; padding (features past D and DV) reads as zeros in the tile
    // products, and the tiles below rewrite only real features.
    memset(dqa, 0, sizeof(T) * (TQ * DP + TQ * DP + TQ * DVP + DP * BC + BC * DP + DVP * BC));
    for (int64_t i = 0; i < TQ; ++i) {
      #pragma omp simd
      for (int64_t d = 0; d < D; ++d) qs[i * DP + d] = scale * kiln_attn_value(q.at(b, h, i, d));
      #pragma omp simd
      for (int64_t d = 0; d < DV; ++d) dob[i * DVP + d] = do_.at(b, h, i, d);
      T sum = 0;
      #pragma omp simd reduction(+:sum)
      for (int64_t d = 0; d < DV; ++d) sum += dob[i * DVP + d] * o.at(b, h, i, d);
      delta[i] = sum;
    }
    for (int64_t j0 = 0; j0 < TK; j0 += BC) {
      const int64_t cols = TK - j0 < BC ? TK - j0 : BC;
      for (int64_t j = 0; j < BC; ++j) {
        #pragma omp simd
        for (int64_t d = 0; d < D; ++d) kb[j * DP + d] = j < cols ? kiln_attn_value(k.at(b, h, j0 + j, d)) : (T)0;
        for (int64_t d = 0; d < D; ++d) kt[d * BC + j] = kb[j * DP + d];
        for (int64_t d = 0; d < DV; ++d) vt[d * BC + j] = j < cols ? kiln_attn_value(v.at(b, h, j0 + j, d)) : (T)0;
      }
      memset(dka, 0, sizeof(T) * (BC * DP + BC * DVP));  // dka and dva
      // Query rows before the first one that sees key j0 contribute nothing.
      const int64_t first = CAUSAL ? (j0 - (TK - TQ) > 0 ? j0 - (TK - TQ) : 0) : 0;
      for (int64_t i0 = first; i0 < TQ; i0 += BR) {
        const int64_t rows = TQ - i0 < BR ? TQ - i0 : BR;
        const T* qi = qs + i0 * DP;
        const T* doi = dob + i0 * DVP;
        kiln_tile_acc<T, BC, false>(qi, DP, 1, DP, kt, p, rows);     // scores
        kiln_tile_acc<T, BC, false>(doi, DVP, 1, DVP, vt, dp, rows);  // do vᵀ
        for (int64_t i = 0; i < rows; ++i) {
          const T li = lse.at(b, h, i0 + i, 0), di = delta[i0 + i];
          T* pi = p + i * BC;
          if (li == -__builtin_inf()) {  // the row sees no key at all
            for (int64_t j = 0; j < BC; ++j) pi[j] = 0;
          } else {
            kiln_attn_mask_max<T, BC>(pi, kiln_attn_seen<CAUSAL, TQ, TK, BC>(i0 + i, j0, cols));
            kiln_attn_exp_sum<T, BC, false>(pi, li);
          }
          #pragma omp simd
          for (int64_t j = 0; j < BC; ++j) ds[i * BC + j] = pi[j] * (dp[i * BC + j] - di);
        }
        kiln_tile_acc<T, DVP>(p, 1, BC, rows, doi, dva, cols);             // dv[j] += p[i][j] do[i]
        kiln_tile_acc<T, DP>(ds, 1, BC, rows, qi, dka, cols);              // dk[j] += ds[i][j] q[i]
        kiln_tile_acc<T, DP>(ds, BC, 1, cols, kb, dqa + i0 * DP, rows);    // dq[i] += ds[i][j] k[j]
      }
      for (int64_t j = 0; j < cols; ++j) {
        #pragma omp simd
        for (int64_t d = 0; d < D; ++d) dk.at(b, h, j0 + j, d) = dka[j * DP + d];
        #pragma omp simd
        for (int64_t d = 0; d < DV; ++d) dv.at(b, h, j0 + j, d) = dva[j * DVP + d];
      }
    }
    for (int64_t i = 0; i < TQ; ++i) {
      #pragma omp simd
      for (int64_t d = 0; d < D; ++d) dq.at(b, h, i, d) = scale * dqa[i * DP + d];
    }
  }
}
)KILN";

}  // namespace kiln::cpu
