// A layer's elementwise stages on the cpu in bf16, each one pass over its rows, computed in fp32
// and rounded to bf16 where the torch reference (chip_child.models.qwen3.TORCH_OPS) rounds:
// add_rms_norm, qk_norm_rope, silu_mul. Rows split over threads only when there are many: for
// the few rows of a decode step a thread team costs more than the work.
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

namespace {

constexpr int VEC = 16;
constexpr int64_t PARALLEL_ELEMENTS = 1 << 16;  // below this many elements one thread does it all

inline __m512 load(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline __m512 load_tail(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 round_bf16(__m512 v) {  // to bf16 and back: a rounding the reference makes
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
inline void store(uint16_t* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, (__m256i)_mm512_cvtneps_pbh(v)); }
inline void store_tail(uint16_t* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v)); }
inline __mmask16 tail_mask(int64_t n) { return (__mmask16)((1u << n) - 1); }

// e^x, x clamped to [-87, 88]: 2^n * p(r), r = x - n ln2, p of degree 6 (relative error < 2e-7).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
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
    store(out + i, _mm512_mul_ps(load(weight + i), round_bf16(_mm512_mul_ps(_mm512_loadu_ps(x + i), scale))));
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
      __m512 v = load(h + t * h_stride + i);
      if (delta) {
        v = round_bf16(_mm512_add_ps(v, load(delta + t * d_stride + i)));
        store(h_out + t * ho_stride + i, v);
      }
      _mm512_storeu_ps(row + i, v);
    }
    rms_norm_row(row, n, weight, eps, x + t * x_stride);
  }
}

// qk [T, heads, hd] (strides in elements) -> out [T, heads, hd] contiguous: each head rms-normed
// with weight [hd] (null: not normed), then rotate-half RoPE from rope [positions, 2, hd] (cos,
// signed sin) at positions[t] (int64 when pos64, else int32). hd a multiple of 32, at most 512.
void l3_qk_norm_rope(const uint16_t* qk, int64_t t_stride, int64_t h_stride, const uint16_t* weight, float eps,
                     const uint16_t* rope, const void* positions, int pos64, uint16_t* out, int64_t T, int64_t heads,
                     int64_t hd) {
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
        for (int64_t i = 0; i < hd; i += VEC) _mm512_storeu_ps(row + i, load(src + i));
        rms_norm_row(row, hd, weight, eps, normed);
        x = normed;
      }
      const int64_t half = hd / 2;
      uint16_t* dst = out + (t * heads + h) * hd;
      for (int64_t i = 0; i < hd; i += VEC) {
        const int64_t j = i < half ? i + half : i - half;  // roll by half: the sign is in the sin row
        const __m512 a = round_bf16(_mm512_mul_ps(load(x + i), load(cos_row + i)));
        const __m512 b = round_bf16(_mm512_mul_ps(load(x + j), load(sin_row + i)));
        store(dst + i, _mm512_add_ps(a, b));
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
      const __m512 x = load(g + i);
      const __m512 s = round_bf16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
      store(o + i, _mm512_mul_ps(s, load(u + i)));
    }
    if (i < n) {
      const __mmask16 m = tail_mask(n - i);
      const __m512 x = load_tail(g + i, m);
      const __m512 s = round_bf16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x)))));
      store_tail(o + i, _mm512_mul_ps(s, load_tail(u + i, m)), m);
    }
  }
}

}  // extern "C"
