// layer_ops.cpp's three elementwise stages in 8-lane vectors, for cpus with AVX2 + FMA and no
// AVX-512: the same functions, arguments and roundings (computed in fp32, rounded to bf16 where
// the torch reference rounds), rows split over threads past a few thousand elements.
#include <math.h>
#include <stdint.h>

#include "avx2_common.h"
#include "layer_ops_split.h"

namespace {

using l3avx2::VEC, l3avx2::load, l3avx2::store, l3avx2::round_bf16;
using l3::PARALLEL_ELEMENTS;

// silu(x) = x / (1 + e^-x), rounded to bf16 as torch's silu on bf16 is.
inline __m256 silu(__m256 x) {
  const __m256 e = l3avx2::exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return round_bf16(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}

// One row of n (a multiple of 8): out = weight * bf16(x * rsqrt(mean(x^2) + eps)).
inline void rms_norm_row(const float* x, int64_t n, const uint16_t* weight, float eps, uint16_t* out) {
  __m256 ss = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += VEC) {
    const __m256 v = _mm256_loadu_ps(x + i);
    ss = _mm256_fmadd_ps(v, v, ss);
  }
  const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(l3avx2::hsum(ss) / (float)n + eps));
  for (int64_t i = 0; i < n; i += VEC)
    store(out + i, _mm256_mul_ps(load(weight + i), round_bf16(_mm256_mul_ps(_mm256_loadu_ps(x + i), scale))));
}

}  // namespace

extern "C" {

// As layer_ops.cpp: h [T, n] (+ delta, may be null) -> h_out = bf16(h + delta), x = rms_norm(h_out)
// * weight; n a multiple of 16, at most 16384.
void l3_add_rms_norm(const uint16_t* h, int64_t h_stride, const uint16_t* delta, int64_t d_stride,
                     const uint16_t* weight, float eps, uint16_t* h_out, int64_t ho_stride, uint16_t* x,
                     int64_t x_stride, int64_t T, int64_t n) {
#pragma omp parallel for schedule(static) if (T * n > PARALLEL_ELEMENTS)
  for (int64_t t = 0; t < T; ++t) {
    float row[16384];
    for (int64_t i = 0; i < n; i += VEC) {
      __m256 v = load(h + t * h_stride + i);
      if (delta) {
        v = round_bf16(_mm256_add_ps(v, load(delta + t * d_stride + i)));
        store(h_out + t * ho_stride + i, v);
      }
      _mm256_storeu_ps(row + i, v);
    }
    rms_norm_row(row, n, weight, eps, x + t * x_stride);
  }
}

// As layer_ops.cpp: qk [T, heads, hd] -> out [T, heads, hd], each head rms-normed with its row of
// weight (w_stride 0: one row for all; null: not normed), then rotate-half RoPE; hd a multiple of
// 32, at most 512.
void l3_qk_norm_rope(const uint16_t* qk, int64_t t_stride, int64_t h_stride, const uint16_t* weight,
                     int64_t w_stride, float eps, const uint16_t* rope, const void* positions, int pos64,
                     uint16_t* out, int64_t T, int64_t heads, int64_t hd) {
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
        for (int64_t i = 0; i < hd; i += VEC) _mm256_storeu_ps(row + i, load(src + i));
        rms_norm_row(row, hd, weight + h * w_stride, eps, normed);
        x = normed;
      }
      const int64_t half = hd / 2;
      uint16_t* dst = out + (t * heads + h) * hd;
      for (int64_t i = 0; i < hd; i += VEC) {
        const int64_t j = i < half ? i + half : i - half;  // roll by half: the sign is in the sin row
        const __m256 a = round_bf16(_mm256_mul_ps(load(x + i), load(cos_row + i)));
        const __m256 b = round_bf16(_mm256_mul_ps(load(x + j), load(sin_row + i)));
        store(dst + i, _mm256_add_ps(a, b));
      }
    }
  }
}

// As layer_ops.cpp: gate_up [T, 2n] -> out [T, n] = bf16(silu(gate)) * up, rounded; any n.
void l3_silu_mul(const uint16_t* gate_up, int64_t stride, uint16_t* out, int64_t T, int64_t n) {
#pragma omp parallel for schedule(static) if (T * n > PARALLEL_ELEMENTS)
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* g = gate_up + t * stride;
    const uint16_t* u = g + n;
    uint16_t* o = out + t * n;
    for (int64_t i = 0; i < n; i += VEC) {
      const int lanes = n - i < VEC ? (int)(n - i) : VEC;
      store(o + i, _mm256_mul_ps(silu(load(g + i, lanes)), load(u + i, lanes)), lanes);
    }
  }
}

}  // extern "C"
