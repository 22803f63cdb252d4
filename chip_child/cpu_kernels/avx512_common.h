// What the cpu kernels share: bf16 <-> fp32 vectors of 16 lanes and a vectorised e^x.
#pragma once
#include <immintrin.h>
#include <stdint.h>

namespace l3 {

constexpr int VEC = 16;  // fp32 lanes in a zmm

inline __mmask16 first_lanes(int64_t n) { return n >= VEC ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1); }

// 16 bf16 (masked lanes read as 0) widened to fp32.
inline __m512 load_bf16(const uint16_t* p, __mmask16 m = 0xffff) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

// 16 fp32 rounded to nearest even bf16 (as torch rounds), masked lanes left as they were.
inline void store_bf16(uint16_t* p, __m512 v, __mmask16 m = 0xffff) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}

// To bf16 and back: a rounding the torch reference makes between two ops.
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// e^x, x clamped to [-87, 88]: 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2] (ln2 in two parts),
// p the degree-6 Taylor polynomial (relative error below 2e-7).
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

}  // namespace l3
