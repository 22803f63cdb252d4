// A layer's elementwise stages on the cpu in bf16, each one pass over its rows, computed in fp32
// and rounded to bf16 where the torch reference (chip_child.models.qwen3.TORCH_OPS) rounds:
// add_rms_norm, qk_norm_rope, silu_mul. Rows split over threads past a few thousand elements: for
// one or two rows a thread team costs more than the work.
#include <math.h>
#include <stdint.h>

#include "avx512_common.h"
#include "layer_ops_split.h"

namespace {

using l3::VEC, l3::load_bf16, l3::store_bf16, l3::round_bf16;
using l3::PARALLEL_ELEMENTS;

// silu(x) = x / (1 + e^-x), rounded to bf16 as torch's silu on bf16 is.
inline __m512 silu(__m512 x) {
  return round_bf16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), l3::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
}

// One row of n: out = weight * bf16(x * rsqrt(mean(x^2) + eps)), x read in fp32 from `src`.
inline void rms_norm_row(const float* x, int64_t n, const uint16_t* weight, float eps, uint16_t* out) {
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += VEC) {
    const __m512 v = _mm512_loadu_ps(x + i);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 scale = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)n + eps));
  for (int64_t i = 0; i < n; i += VEC)
    store_bf16(out + i, _mm512_mul_ps(load_bf16(weight + i), round_bf16(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale))));
}

}  // namespace

extern "C" {

// h [T, n] (+ delta [T, n], may be null) -> h_out = bf16(h + delta), x = rms_norm(h_out) * weight.
// n a multiple of 16, at most 16384; row strides in elements.
void l3_add_rms_norm(const uint16_t* h, int64_t h_stride, const uint16_t* delta, int64_t d_stride, const uint16_t* weight,
                     float eps, uint16_t* h_out, int64_t ho_stride, uint16_t* x, int64_t x_stride, int64_t T, int64_t n) {
#pragma omp parallel for schedule(static) if (T * n > PARALLEL_ELEMENTS)
  for (int64_t t = 0; t < T; ++t) {
    float row[16384];
    for (int64_t i = 0; i < n; i += VEC) {
      __m512 v = load_bf16(h + t * h_stride + i);
      if (delta) {
        v = round_bf16(_mm512_add_ps(v, load_bf16(delta + t * d_stride + i)));
        store_bf16(h_out + t * ho_stride + i, v);
      }
      _mm512_storeu_ps(row + i, v);
    }
    rms_norm_row(row, n, weight, eps, x + t * x_stride);
  }
}

// qk [T, heads, hd] (strides in elements) -> out [T, heads, hd] contiguous: each head rms-normed
// with its row of weight (head h's at weight + h * w_stride: a model's q_norm rows then its k_norm
// rows, or one row for all with w_stride 0; null: not normed), then rotate-half RoPE from rope
// [positions, 2, hd] (cos, signed sin) at positions[t] (int64 when pos64, else int32). hd a
// multiple of 32, at most 512.
void l3_qk_norm_rope(const uint16_t* qk, int64_t t_stride, int64_t h_stride, const uint16_t* weight, int64_t w_stride,
                     float eps, const uint16_t* rope, const void* positions, int pos64, uint16_t* out, int64_t T,
                     int64_t heads, int64_t hd) {
#pragma omp parallel for schedule(static) if (T * heads * hd > PARALLEL_ELEMENTS)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = pos64 ? ((const int64_t*)positions)[t] : ((const int32_t*)positions)[t];
    const uint16_t* cos_row = rope + pos * 2 * hd;
    const uint16_t* sin_row = cos_row + hd;
    for (int64_t h = 0; h < heads; ++h) {
      const uint16_t* src = qk + t * t_stride + h * h_stride;
      uint16_t normed[512];
      const uint16_t* x = src;
      if (weight) {
        float row[512];
        for (int64_t i = 0; i < hd; i += VEC) _mm512_storeu_ps(row + i, load_bf16(src + i));
        rms_norm_row(row, hd, weight + h * w_stride, eps, normed);
        x = normed;
      }
      const int64_t half = hd / 2;
      uint16_t* dst = out + (t * heads + h) * hd;
      for (int64_t i = 0; i < hd; i += VEC) {
        const int64_t j = i < half ? i + half : i - half;  // roll by half: the sign is in the sin row
        const __m512 a = round_bf16(_mm512_mul_ps(load_bf16(x + i), load_bf16(cos_row + i)));
        const __m512 b = round_bf16(_mm512_mul_ps(load_bf16(x + j), load_bf16(sin_row + i)));
        store_bf16(dst + i, _mm512_add_ps(a, b));
      }
    }
  }
}

// gate_up [T, 2n] (row stride in elements) -> out [T, n] = bf16(silu(gate)) * up, rounded.
void l3_silu_mul(const uint16_t* gate_up, int64_t stride, uint16_t* out, int64_t T, int64_t n) {
#pragma omp parallel for schedule(static) if (T * n > PARALLEL_ELEMENTS)
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* g = gate_up + t * stride;
    const uint16_t* u = g + n;
    uint16_t* o = out + t * n;
    int64_t i = 0;
    for (; i + VEC <= n; i += VEC) {
      const __m512 x = load_bf16(g + i);
      const __m512 s = silu(x);
      store_bf16(o + i, _mm512_mul_ps(s, load_bf16(u + i)));
    }
    if (i < n) {
      const __mmask16 m = l3::first_lanes(n - i);
      const __m512 x = load_bf16(g + i, m);
      const __m512 s = silu(x);
      store_bf16(o + i, _mm512_mul_ps(s, load_bf16(u + i, m)), m);
    }
  }
}

}  // extern "C"
