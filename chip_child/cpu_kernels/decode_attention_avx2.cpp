// Decode attention on cpus with AVX2 + FMA and no AVX-512 (AMD Zen 2/3, most Intel client parts):
// the arguments, cache layout and results of decode_attention.cpp, with 8-lane vectors and sixteen
// registers. One new query token per row, its keys and values read in place from the paged cache
// in fp32 from bf16 or fp32 storage; threads take the (row, kv head) pairs two at a time. Where
// the AVX-512 kernel holds a head's whole query in registers, here the work is cut to fit 16:
// two query heads at a time against four keys (8 sums), and the values in slices of 32 lanes.
// Cache layout, per layer: k and v each [kv_heads, pages, page_size, head_dim].
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "attention_pairs.h"
#include "avx2_common.h"

#define UNROLL L3_UNROLL

namespace {

using l3avx2::VEC, l3avx2::load, l3avx2::store, l3avx2::hsum, l3avx2::hmax, l3avx2::exp_ps;
constexpr int MAX_HEAD_DIM = 256;
constexpr int MAX_CHUNKS = MAX_HEAD_DIM / VEC;
constexpr int HEADS_PER_PASS = 2;  // query heads that share one pass over the keys and over the values
constexpr int KEYS = 4;            // keys per step of the pass over the keys
constexpr int SLICE = 4;           // vectors of a value per pass over the values

// The four horizontal sums of a, b, c, d, in one vector.
inline __m128 reduce4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));  // per 128 bits: a b c d
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

constexpr int64_t PREFETCH_KEYS_AHEAD = 8;  // as decode_attention.cpp: keys and values start cold for every pair

template <typename T>
inline void prefetch_vector(const T* p, int64_t head_dim) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < head_dim * (int64_t)sizeof(T); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// Scores of NH query heads (qf: each head's ch scaled fp32 vectors) against every key, into
// s + i * s_stride: KEYS keys at a time, their dot products summed over the head's vectors in
// NH x KEYS registers, one reduction per head. `v`: the values to prefetch alongside, or null.
template <typename T, int NH>
inline void heads_scores(const float* qf, int ch, const T* k, const T* v, const int64_t* offs, int64_t ctx,
                         const int* lanes, int64_t head_dim, float* s, int64_t s_stride) {
  int64_t t = 0;
  for (; t + KEYS <= ctx; t += KEYS) {
    if (v != nullptr)
      for (int j = 0; j < KEYS; ++j) {
        prefetch_vector(v + offs[t + j], head_dim);
        if (t + j + PREFETCH_KEYS_AHEAD < ctx) prefetch_vector(k + offs[t + j + PREFETCH_KEYS_AHEAD], head_dim);
      }
    __m256 acc[NH][KEYS];
    UNROLL for (int i = 0; i < NH; ++i) UNROLL for (int j = 0; j < KEYS; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int c = 0; c < ch; ++c) {
      __m256 kv[KEYS];
      UNROLL for (int j = 0; j < KEYS; ++j) kv[j] = load(k + offs[t + j] + c * VEC, lanes[c]);
      UNROLL for (int i = 0; i < NH; ++i) {
        const __m256 q = _mm256_loadu_ps(qf + (i * MAX_CHUNKS + c) * VEC);
        UNROLL for (int j = 0; j < KEYS; ++j) acc[i][j] = _mm256_fmadd_ps(q, kv[j], acc[i][j]);
      }
    }
    UNROLL for (int i = 0; i < NH; ++i) _mm_storeu_ps(s + i * s_stride + t, reduce4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
  }
  for (; t < ctx; ++t) {
    __m256 acc[NH];
    UNROLL for (int i = 0; i < NH; ++i) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < ch; ++c) {
      const __m256 kv = load(k + offs[t] + c * VEC, lanes[c]);
      UNROLL for (int i = 0; i < NH; ++i)
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + (i * MAX_CHUNKS + c) * VEC), kv, acc[i]);
    }
    UNROLL for (int i = 0; i < NH; ++i) s[i * s_stride + t] = hsum(acc[i]);
  }
}

// out_i = (sum over keys of p_i[t] * v_t) * inv_sum[i] for NH query heads, SLICE vectors of the
// head at a time: each slice of a value loaded once for the NH heads.
template <typename T, int NH>
inline void heads_values(const float* p, int64_t p_stride, const T* v, const int64_t* offs, int64_t ctx, int ch,
                         const int* lanes, const float* inv_sum, T* out, int64_t head_dim) {
  for (int c0 = 0; c0 < ch; c0 += SLICE) {
    const int n = ch - c0 < SLICE ? ch - c0 : SLICE;
    __m256 acc[NH][SLICE];
    UNROLL for (int i = 0; i < NH; ++i) UNROLL for (int j = 0; j < SLICE; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t t = 0; t < ctx; ++t) {
      __m256 vt[SLICE];
      UNROLL for (int j = 0; j < SLICE; ++j) vt[j] = j < n ? load(v + offs[t] + (c0 + j) * VEC, lanes[c0 + j])
                                                           : _mm256_setzero_ps();
      UNROLL for (int i = 0; i < NH; ++i) {
        const __m256 pt = _mm256_set1_ps(p[i * p_stride + t]);
        UNROLL for (int j = 0; j < SLICE; ++j) acc[i][j] = _mm256_fmadd_ps(pt, vt[j], acc[i][j]);
      }
    }
    UNROLL for (int i = 0; i < NH; ++i)
      UNROLL for (int j = 0; j < SLICE; ++j)
        if (j < n) store(out + i * head_dim + (c0 + j) * VEC, _mm256_mul_ps(acc[i][j], _mm256_set1_ps(inv_sum[i])),
                         lanes[c0 + j]);
  }
}

// Softmax of s[0 .. ctx) in place (exponentials, not yet divided); returns 1 / their sum.
inline float softmax_unnormalised(float* s, int64_t ctx) {
  __m256 mx = _mm256_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + VEC <= ctx; t += VEC) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + t));
  float m = hmax(mx);
  for (int64_t u = t; u < ctx; ++u) m = s[u] > m ? s[u] : m;
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (t = 0; t + VEC <= ctx; t += VEC) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = hsum(sum);
  if (t < ctx) {  // the last 1-7 scores: their lanes alone
    const int n = (int)(ctx - t);
    alignas(32) float tail[VEC];
    _mm256_store_ps(tail, exp_ps(_mm256_sub_ps(load(s + t, n), mv)));
    for (int u = 0; u < n; ++u) total += (s[t + u] = tail[u]);
  }
  return 1.0f / total;
}

// NH query heads of a pair (q and out at the first of them): scores, softmax, values. `first`:
// the pair's first heads, whose pass over the keys prefetches the values.
template <typename T, int NH>
void attend_heads(const T* q, const T* k, const T* v, const int64_t* offs, int64_t ctx, int64_t head_dim, int ch,
                  float scale, const int* lanes, T* out, float* s, bool first) {
  alignas(32) float qf[NH * MAX_CHUNKS * VEC];  // masked lanes are 0, so they add nothing to a dot product
  for (int i = 0; i < NH; ++i)
    for (int c = 0; c < ch; ++c)
      _mm256_store_ps(qf + (i * MAX_CHUNKS + c) * VEC,
                      _mm256_mul_ps(load(q + i * head_dim + c * VEC, lanes[c]), _mm256_set1_ps(scale)));
  const int64_t s_stride = ctx + VEC;
  heads_scores<T, NH>(qf, ch, k, first ? v : nullptr, offs, ctx, lanes, head_dim, s, s_stride);
  float inv_sum[NH];
  for (int i = 0; i < NH; ++i) inv_sum[i] = softmax_unnormalised(s + i * s_stride, ctx);
  heads_values<T, NH>(s, s_stride, v, offs, ctx, ch, lanes, inv_sum, out, head_dim);
}

// One (row, kv head) pair: its `group` query heads, HEADS_PER_PASS at a time; the keys' and
// values' offsets computed once per pair.
template <typename T>
void attend_pair(const T* q, const T* k, const T* v, const int32_t* pages, int64_t ctx, int64_t group,
                 int64_t head_dim, int64_t page_size, int64_t page_stride, float scale, T* out,
                 std::vector<float>& scores, std::vector<int64_t>& offsets) {
  const int ch = (int)((head_dim + VEC - 1) / VEC);
  int lanes[MAX_CHUNKS];
  for (int c = 0; c < ch; ++c) lanes[c] = head_dim - c * VEC < VEC ? (int)(head_dim - c * VEC) : VEC;
  offsets.resize(ctx);
  int64_t* offs = offsets.data();
  for (int64_t t = 0, page = 0; t < ctx; ++page)
    for (int64_t o = 0, base = pages[page] * page_stride; o < page_size && t < ctx; ++o, ++t)
      offs[t] = base + o * head_dim;
  scores.resize(HEADS_PER_PASS * (ctx + VEC));
  float* s = scores.data();
  for (int64_t i = 0; i < group; i += HEADS_PER_PASS) {
    const T* qi = q + i * head_dim;
    T* oi = out + i * head_dim;
    if (group - i >= 2)
      attend_heads<T, 2>(qi, k, v, offs, ctx, head_dim, ch, scale, lanes, oi, s, i == 0);
    else
      attend_heads<T, 1>(qi, k, v, offs, ctx, head_dim, ch, scale, lanes, oi, s, i == 0);
  }
}

template <typename T>
void decode_attention(const T* q, int64_t q_row_stride, T* k, T* v, int64_t head_stride, int64_t page_stride,
                      const int32_t* block_table, int64_t table_stride, const int32_t* seq_lens, int64_t rows,
                      int64_t kv_heads, int64_t group, int64_t head_dim, int64_t page_size, float scale, T* out,
                      int64_t out_row_stride, const l3::NewKV& nkv, int threads) {
  const auto one = [&](int64_t pair, std::vector<float>& scores, std::vector<int64_t>& offsets) {
    const int64_t r = pair / kv_heads, j = pair % kv_heads;
    if (nkv.slots)
      l3::write_new(nkv, r, j, k + j * head_stride, v + j * head_stride, page_stride, page_size, head_dim);
    attend_pair(q + r * q_row_stride + j * group * head_dim, k + j * head_stride, v + j * head_stride,
                block_table + r * table_stride, seq_lens[r], group, head_dim, page_size, page_stride, scale,
                out + r * out_row_stride + j * group * head_dim, scores, offsets);
  };
  l3::run_pairs(rows * kv_heads, threads, one);
}

}  // namespace

extern "C" {

int l3_decode_attention_max_head_dim(void) { return MAX_HEAD_DIM; }

// The arguments of decode_attention.cpp's l3_decode_attention, `threads` <= 0 (one pair on the
// calling thread) included.
void l3_decode_attention(int bf16, const void* q, int64_t q_row_stride, void* k, void* v,
                         int64_t head_stride, int64_t page_stride, const int32_t* block_table, int64_t table_stride,
                         const int32_t* seq_lens, int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                         int64_t page_size, float scale, void* out, int64_t out_row_stride, const void* new_k,
                         int64_t new_k_row_stride, const void* new_v, int64_t new_v_row_stride,
                         const int64_t* new_slots, int threads) {
  const l3::NewKV nkv{new_k, new_v, new_k_row_stride, new_v_row_stride, new_slots};
  if (bf16)
    decode_attention<uint16_t>((const uint16_t*)q, q_row_stride, (uint16_t*)k, (uint16_t*)v, head_stride,
                               page_stride, block_table, table_stride, seq_lens, rows, kv_heads, group, head_dim,
                               page_size, scale, (uint16_t*)out, out_row_stride, nkv, threads);
  else
    decode_attention<float>((const float*)q, q_row_stride, (float*)k, (float*)v, head_stride, page_stride,
                            block_table, table_stride, seq_lens, rows, kv_heads, group, head_dim, page_size, scale,
                            (float*)out, out_row_stride, nkv, threads);
}

}  // extern "C"
