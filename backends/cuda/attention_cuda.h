// Source text of the fused attention kernels for CUDA (and the host emulator), put once before
// the functions of a plan that has an Attention kernel (jit/kernel_ir.h AttentionCall); the
// rendered __global__ functions call these with every size and stride constant.
//
// One thread per query row: its scaled query and output rows in registers, keys and values
// streamed from memory with an online softmax (a running maximum and sum), so no (Tq, Tk) matrix
// exists. The backward is two passes without atomics: one thread per query row computes
// delta = rowsum(do * o) (kept in the plan's scratch) and dq; then one thread per key row
// computes dk and dv, each recomputing the probabilities from the saved log-sum-exp.
#pragma once

namespace kiln::cuda {

inline constexpr const char* kCudaAttention = R"KILN(
// q, k and v may be bfloat16 (autocast's matmul outputs): read as float, computed in float.
static __device__ __forceinline__ float kiln_attn_value(kiln_bf16 x) { return kiln_bf2f(x); }
static __device__ __forceinline__ float kiln_attn_value(float x) { return x; }
static __device__ __forceinline__ double kiln_attn_value(double x) { return x; }
static __device__ __forceinline__ float kiln_attn_exp(float x) { return expf(x); }
static __device__ __forceinline__ double kiln_attn_exp(double x) { return exp(x); }
static __device__ __forceinline__ float kiln_attn_log(float x) { return logf(x); }
static __device__ __forceinline__ double kiln_attn_log(double x) { return log(x); }

// An operand over (batch, head, position, feature) at constant element strides.
template <typename T, long long SB, long long SH, long long ST, long long SD>
struct KilnAttnView {
  T* p;
  __device__ __forceinline__ T& at(long long b, long long h, long long t, long long d) const {
    return p[b * SB + h * SH + t * ST + d * SD];
  }
};

// The number of keys query i sees: keys beyond i + (TK - TQ) are in its future.
template <bool CAUSAL, long long TQ, long long TK>
static __device__ __forceinline__ long long kiln_attn_keys(long long i) {
  if (!CAUSAL) return TK;
  const long long n = i + (TK - TQ) + 1;
  return n < 0 ? 0 : (n < TK ? n : TK);
}

template <typename T, long long B, long long H, long long TQ, long long TK, long long D, long long DV, bool CAUSAL,
          class Q, class K, class V, class O, class L>
static __device__ void kiln_attention_forward(Q q, K k, V v, O o, L lse, T scale) {
  for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < B * H * TQ;
       t += (long long)gridDim.x * blockDim.x) {
    const long long i = t % TQ, h = t / TQ % H, b = t / (TQ * H);
    T qs[D], acc[DV];
    for (long long d = 0; d < D; ++d) qs[d] = scale * kiln_attn_value(q.at(b, h, i, d));
    for (long long d = 0; d < DV; ++d) acc[d] = 0;
    T m = -(T)KILN_INF, l = 0;
    const long long keys = kiln_attn_keys<CAUSAL, TQ, TK>(i);
    for (long long j = 0; j < keys; ++j) {
      T s = 0;
      for (long long d = 0; d < D; ++d) s += qs[d] * kiln_attn_value(k.at(b, h, j, d));
      const T m_new = s > m ? s : m;
      const T alpha = kiln_attn_exp(m - m_new), p = kiln_attn_exp(s - m_new);
      l = l * alpha + p;
      for (long long d = 0; d < DV; ++d) acc[d] = acc[d] * alpha + p * kiln_attn_value(v.at(b, h, j, d));
      m = m_new;
    }
    const T inv = (T)1 / l;  // no visible key: 0 / 0, as the composite's softmax
    for (long long d = 0; d < DV; ++d) o.at(b, h, i, d) = acc[d] * inv;
    lse.at(b, h, i, 0) = m + kiln_attn_log(l);
  }
}

// Pass 1 of the backward: per query row, delta (into `delta`, B * H * TQ values) and dq.
template <typename T, long long B, long long H, long long TQ, long long TK, long long D, long long DV, bool CAUSAL,
          class Q, class K, class V, class O, class L, class DO, class DQ>
static __device__ void kiln_attention_backward_q(Q q, K k, V v, O o, L lse, DO do_, DQ dq, T* delta, T scale) {
  for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < B * H * TQ;
       t += (long long)gridDim.x * blockDim.x) {
    const long long i = t % TQ, h = t / TQ % H, b = t / (TQ * H);
    T qs[D], dob[DV], dqa[D];
    T di = 0;
    for (long long d = 0; d < DV; ++d) {
      dob[d] = do_.at(b, h, i, d);
      di += dob[d] * o.at(b, h, i, d);
    }
    delta[t] = di;
    for (long long d = 0; d < D; ++d) qs[d] = scale * kiln_attn_value(q.at(b, h, i, d)), dqa[d] = 0;
    const T li = lse.at(b, h, i, 0);
    const long long keys = li == -(T)KILN_INF ? 0 : kiln_attn_keys<CAUSAL, TQ, TK>(i);
    for (long long j = 0; j < keys; ++j) {
      T s = 0, dp = 0;
      for (long long d = 0; d < D; ++d) s += qs[d] * kiln_attn_value(k.at(b, h, j, d));
      for (long long d = 0; d < DV; ++d) dp += dob[d] * kiln_attn_value(v.at(b, h, j, d));
      const T ds = kiln_attn_exp(s - li) * (dp - di);
      for (long long d = 0; d < D; ++d) dqa[d] += ds * kiln_attn_value(k.at(b, h, j, d));
    }
    for (long long d = 0; d < D; ++d) dq.at(b, h, i, d) = scale * dqa[d];
  }
}

// Pass 2: per key row, dk and dv from every query row that sees it.
template <typename T, long long B, long long H, long long TQ, long long TK, long long D, long long DV, bool CAUSAL,
          class Q, class K, class V, class L, class DO, class DK, class DV_>
static __device__ void kiln_attention_backward_kv(Q q, K k, V v, L lse, DO do_, DK dk, DV_ dv, const T* delta,
                                                  T scale) {
  for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < B * H * TK;
       t += (long long)gridDim.x * blockDim.x) {
    const long long j = t % TK, h = t / TK % H, b = t / (TK * H);
    T kr[D], vr[DV], dka[D], dva[DV];
    for (long long d = 0; d < D; ++d) kr[d] = kiln_attn_value(k.at(b, h, j, d)), dka[d] = 0;
    for (long long d = 0; d < DV; ++d) vr[d] = kiln_attn_value(v.at(b, h, j, d)), dva[d] = 0;
    const long long first = CAUSAL ? (j - (TK - TQ) > 0 ? j - (TK - TQ) : 0) : 0;
    for (long long i = first; i < TQ; ++i) {
      const T li = lse.at(b, h, i, 0);
      if (li == -(T)KILN_INF) continue;
      T s = 0, dp = 0;
      for (long long d = 0; d < D; ++d) s += scale * kiln_attn_value(q.at(b, h, i, d)) * kr[d];
      for (long long d = 0; d < DV; ++d) dp += do_.at(b, h, i, d) * vr[d];
      const T p = kiln_attn_exp(s - li), ds = p * (dp - delta[(b * H + h) * TQ + i]);
      for (long long d = 0; d < DV; ++d) dva[d] += p * do_.at(b, h, i, d);
      for (long long d = 0; d < D; ++d) dka[d] += ds * scale * kiln_attn_value(q.at(b, h, i, d));
    }
    for (long long d = 0; d < D; ++d) dk.at(b, h, j, d) = dka[d];
    for (long long d = 0; d < DV; ++d) dv.at(b, h, j, d) = dva[d];
  }
}
)KILN";

}  // namespace kiln::cuda
