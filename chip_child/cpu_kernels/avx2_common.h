// What the AVX2 kernels (*_avx2.cpp, for cpus without AVX-512) share: bf16 <-> fp32 vectors of 8
// lanes, horizontal sums, and a vectorised e^x (avx512_common.h's, in 8 lanes).
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

namespace l3avx2 {

constexpr int VEC = 8;  // fp32 lanes in a ymm

// n (1..8) lanes of fp32 or bf16 widened to fp32, the rest 0.
inline __m256 load(const float* p, int n = VEC) {
  if (n == VEC) return _mm256_loadu_ps(p);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}
inline __m256 load(const uint16_t* p, int n = VEC) {
  __m128i h;
  if (n == VEC) {
    h = _mm_loadu_si128((const __m128i*)p);
  } else {
    alignas(16) uint16_t tmp[VEC] = {0};
    memcpy(tmp, p, n * sizeof(uint16_t));
    h = _mm_load_si128((const __m128i*)tmp);
  }
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// 8 fp32 rounded to nearest even bf16 (as torch rounds; NaN stays a quiet NaN): the bf16 bits in
// the high half of each 32-bit lane, the low half left for the caller to mask or shift away.
inline __m256i rounded_high_half(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

// In 16-bit lanes, for a store.
inline __m128i to_bf16(__m256 v) {
  const __m256i r = _mm256_srli_epi32(rounded_high_half(v), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// To bf16 and back, as fp32: a rounding the torch reference makes between two ops.
inline __m256 round_bf16(__m256 v) {
  return _mm256_castsi256_ps(_mm256_and_si256(rounded_high_half(v), _mm256_set1_epi32((int)0xffff0000u)));
}

// n (1..8) lanes stored, the rest of memory untouched.
inline void store(float* p, __m256 v, int n = VEC) {
  if (n == VEC) return _mm256_storeu_ps(p, v);
  _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)), v);
}
inline void store(uint16_t* p, __m256 v, int n = VEC) {
  const __m128i h = to_bf16(v);
  if (n == VEC) return _mm_storeu_si128((__m128i*)p, h);
  alignas(16) uint16_t tmp[VEC];
  _mm_store_si128((__m128i*)tmp, h);
  memcpy(p, tmp, n * sizeof(uint16_t));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}
inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// e^x, x clamped to [-87, 88]: 2^n * p(r), r = x - n ln2 (ln2 in two parts), p the degree-6 Taylor
// polynomial (relative error below 2e-7), 2^n built in the exponent bits.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187045e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace l3avx2

// Every loop over a tile's rows and vectors unrolled, so that its sums stay in registers (GCC 12
// otherwise kept an array of them on the stack, storing each one every iteration: half the speed).
#define L3_UNROLL _Pragma("GCC unroll 16")
