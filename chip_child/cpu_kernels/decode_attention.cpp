// Decode attention on the cpu: one new query token per row, its keys and values read in place
// from the paged cache (no gather, no dense copy), in fp32 from bf16 or fp32 storage.
// Threads take the (row, kv head) pairs two at a time; each pair's grouped query heads share one
// pass over the keys and one over the values. Scores and softmax stay in fp32; the output is rounded once.
// Cache layout, per layer: k and v each [kv_heads, pages, page_size, head_dim].
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

#include "attention_pairs.h"
#include "avx512_common.h"

namespace {

using l3::VEC;
constexpr int MAX_HEAD_DIM = 256;

// Loads and stores of 16 lanes, masked: a head size that is not a multiple of 16 ends in a partial vector.
inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const uint16_t* p, __mmask16 m) { return l3::load_bf16(p, m); }
inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store(uint16_t* p, __m512 v, __mmask16 m) { l3::store_bf16(p, v, m); }
inline __mmask16 lanes(int64_t c, int64_t head_dim) { return l3::first_lanes(head_dim - c * VEC); }  // chunk c's

// The four horizontal sums of a, b, c, d, in one vector: a shuffle tree shared by the four.
inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // per 128 bits: a b a b
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512 abcd = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
                                    _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  const __m256 halves = _mm256_add_ps(_mm512_castps512_ps256(abcd), _mm512_extractf32x8_ps(abcd, 1));
  return _mm_add_ps(_mm256_castps256_ps128(halves), _mm256_extractf128_ps(halves, 1));
}

template <int CH>
inline __m512 dot(const __m512* q, const __m512* k) {
  __m512 acc = _mm512_mul_ps(q[0], k[0]);
  for (int c = 1; c < CH; ++c) acc = _mm512_fmadd_ps(q[c], k[c], acc);
  return acc;
}

// The first pass over a pair's keys asks for the key this many positions ahead, and for the value
// at each position, which the pass over the values then finds in cache: each pair's keys and
// values start cold (a pair reads 2 x 24 KB at 192 tokens of the 128M shape), and the hardware
// prefetcher alone left the passes waiting on memory. 0.87-0.96x the time, the same bits.
constexpr int64_t PREFETCH_KEYS_AHEAD = 8;

template <typename T, int CH>
inline void prefetch_vector(const T* p) {  // one key's or value's CH vectors
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < CH * VEC * (int64_t)sizeof(T); b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

// Scores of NH query heads against every key, into s + i * s_stride for head i: four keys at a
// time are loaded (and widened from bf16) once for the NH heads; each head's four dot products
// share one reduction. `offs[t]`: key t's offset from the head's cache start. `v`: the values to
// prefetch alongside (the pair's first pass), or null.
template <typename T, int CH, int NH>
inline void heads_scores(const __m512* qf, const T* k, const T* v, const int64_t* offs, int64_t ctx,
                         const __mmask16* mask, float* s, int64_t s_stride) {
  int64_t t = 0;
  for (; t + 4 <= ctx; t += 4) {
    if (v != nullptr)
      for (int j = 0; j < 4; ++j) {
        prefetch_vector<T, CH>(v + offs[t + j]);
        if (t + j + PREFETCH_KEYS_AHEAD < ctx) prefetch_vector<T, CH>(k + offs[t + j + PREFETCH_KEYS_AHEAD]);
      }
    __m512 kv[4][CH];
    for (int j = 0; j < 4; ++j)
      for (int c = 0; c < CH; ++c) kv[j][c] = load(k + offs[t + j] + c * VEC, mask[c]);
    for (int i = 0; i < NH; ++i) {
      const __m512* q = qf + i * CH;
      _mm_storeu_ps(s + i * s_stride + t, reduce4(dot<CH>(q, kv[0]), dot<CH>(q, kv[1]), dot<CH>(q, kv[2]),
                                                   dot<CH>(q, kv[3])));
    }
  }
  for (; t < ctx; ++t) {
    __m512 kv[CH];
    for (int c = 0; c < CH; ++c) kv[c] = load(k + offs[t] + c * VEC, mask[c]);
    for (int i = 0; i < NH; ++i) s[i * s_stride + t] = _mm512_reduce_add_ps(dot<CH>(qf + i * CH, kv));
  }
}

// out_i = sum over keys of p_i[t] * v_t for NH query heads: each value loaded once for the NH heads,
// CH accumulators per head in registers.
template <typename T, int CH, int NH>
inline void heads_values(const float* p, int64_t p_stride, const T* v, const int64_t* offs, int64_t ctx,
                         const __mmask16* mask, const float* inv_sum, T* out, int64_t head_dim) {
  __m512 acc[NH][CH];
  for (int i = 0; i < NH; ++i)
    for (int c = 0; c < CH; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    __m512 vt[CH];
    for (int c = 0; c < CH; ++c) vt[c] = load(v + offs[t] + c * VEC, mask[c]);
    for (int i = 0; i < NH; ++i) {
      const __m512 pt = _mm512_set1_ps(p[i * p_stride + t]);
      for (int c = 0; c < CH; ++c) acc[i][c] = _mm512_fmadd_ps(pt, vt[c], acc[i][c]);
    }
  }
  for (int i = 0; i < NH; ++i)
    for (int c = 0; c < CH; ++c)
      store(out + i * head_dim + c * VEC, _mm512_mul_ps(acc[i][c], _mm512_set1_ps(inv_sum[i])), mask[c]);
}

// Softmax of s[0 .. ctx) in place (exponentials, not yet divided); returns 1 / their sum.
inline float softmax_unnormalised(float* s, int64_t ctx) {
  __m512 mx = _mm512_set1_ps(-INFINITY);  // the maximum in vectors: a scalar loop cost a cycle chain per key
  int64_t t = 0;
  for (; t + VEC <= ctx; t += VEC) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
  if (t < ctx) {
    const __mmask16 tail = (__mmask16)((1u << (ctx - t)) - 1);
    mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + t));
  }
  const __m512 mv = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (t = 0; t + VEC <= ctx; t += VEC) {
    const __m512 e = l3::exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (t < ctx) {
    const __mmask16 tail = (__mmask16)((1u << (ctx - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(tail, l3::exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + t), mv)));
    _mm512_mask_storeu_ps(s + t, tail, e);
    sum = _mm512_add_ps(sum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(sum);
}

constexpr int HEADS_PER_PASS = 4;  // query heads that share one pass over the keys and one over the values

// NH query heads of a pair (q and out at the first of them): scores, softmax, values. `first`: the
// pair's first heads, whose pass over the keys prefetches the values.
template <typename T, int CH, int NH>
void attend_heads(const T* q, const T* k, const T* v, const int64_t* offs, int64_t ctx, int64_t head_dim, float scale,
                  const __mmask16* mask, T* out, float* s, bool first) {
  __m512 qf[NH * CH];  // masked lanes are 0, so they add nothing to a dot product
  for (int i = 0; i < NH; ++i)
    for (int c = 0; c < CH; ++c)
      qf[i * CH + c] = _mm512_mul_ps(load(q + i * head_dim + c * VEC, mask[c]), _mm512_set1_ps(scale));
  const int64_t s_stride = ctx + VEC;
  heads_scores<T, CH, NH>(qf, k, first ? v : nullptr, offs, ctx, mask, s, s_stride);
  float inv_sum[NH];
  for (int i = 0; i < NH; ++i) inv_sum[i] = softmax_unnormalised(s + i * s_stride, ctx);
  heads_values<T, CH, NH>(s, s_stride, v, offs, ctx, mask, inv_sum, out, head_dim);
}

// One (row, kv head) pair: its `group` query heads, up to HEADS_PER_PASS at a time. The keys' and
// values' offsets are computed once per pair (page lookups without a division per key).
template <typename T, int CH>
void attend_pair(const T* q, const T* k, const T* v, const int32_t* pages, int64_t ctx, int64_t group,
                 int64_t head_dim, int64_t page_size, int64_t page_stride, float scale, T* out,
                 std::vector<float>& scores, std::vector<int64_t>& offsets) {
  __mmask16 mask[CH];
  for (int c = 0; c < CH; ++c) mask[c] = lanes(c, head_dim);
  offsets.resize(ctx);
  int64_t* offs = offsets.data();
  for (int64_t t = 0, page = 0; t < ctx; ++page)
    for (int64_t o = 0, base = pages[page] * page_stride; o < page_size && t < ctx; ++o, ++t)
      offs[t] = base + o * head_dim;
  scores.resize(HEADS_PER_PASS * (ctx + VEC));
  float* s = scores.data();
  for (int64_t i = 0; i < group;) {
    const int64_t nh = group - i < HEADS_PER_PASS ? group - i : HEADS_PER_PASS;
    const T* qi = q + i * head_dim;
    T* oi = out + i * head_dim;
    switch (nh) {
      case 1: attend_heads<T, CH, 1>(qi, k, v, offs, ctx, head_dim, scale, mask, oi, s, i == 0); break;
      case 2: attend_heads<T, CH, 2>(qi, k, v, offs, ctx, head_dim, scale, mask, oi, s, i == 0); break;
      case 3: attend_heads<T, CH, 3>(qi, k, v, offs, ctx, head_dim, scale, mask, oi, s, i == 0); break;
      default: attend_heads<T, CH, HEADS_PER_PASS>(qi, k, v, offs, ctx, head_dim, scale, mask, oi, s, i == 0); break;
    }
    i += nh;
  }
}

template <typename T>
using PairFn = void (*)(const T*, const T*, const T*, const int32_t*, int64_t, int64_t, int64_t, int64_t, int64_t,
                        float, T*, std::vector<float>&, std::vector<int64_t>&);

template <typename T, int CH>
PairFn<T> pair_fn_at_least(int64_t chunks) {  // the instance for `chunks` vectors per head
  if constexpr (CH > MAX_HEAD_DIM / VEC) {
    return nullptr;
  } else {
    return chunks == CH ? &attend_pair<T, CH> : pair_fn_at_least<T, CH + 1>(chunks);
  }
}

template <typename T>
void decode_attention(const T* q, int64_t q_row_stride, T* k, T* v, int64_t head_stride,
                      int64_t page_stride, const int32_t* block_table, int64_t table_stride, const int32_t* seq_lens,
                      int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t page_size, float scale,
                      T* out, int64_t out_row_stride, const l3::NewKV& nkv, int threads) {
  const PairFn<T> attend = pair_fn_at_least<T, 1>((head_dim + VEC - 1) / VEC);
  const auto one = [&](int64_t pair, std::vector<float>& scores, std::vector<int64_t>& offsets) {
    const int64_t r = pair / kv_heads, j = pair % kv_heads;
    if (nkv.slots)
      l3::write_new(nkv, r, j, k + j * head_stride, v + j * head_stride, page_stride, page_size, head_dim);
    attend(q + r * q_row_stride + j * group * head_dim, k + j * head_stride, v + j * head_stride,
           block_table + r * table_stride, seq_lens[r], group, head_dim, page_size, page_stride, scale,
           out + r * out_row_stride + j * group * head_dim, scores, offsets);
  };
  l3::run_pairs(rows * kv_heads, threads, one);
}

}  // namespace

extern "C" {

// The limit the caller checks before any call (a head size past it is not run here).
int l3_decode_attention_max_head_dim(void) { return MAX_HEAD_DIM; }

// q [rows, kv_heads * group, head_dim] (row stride q_row_stride elements); k, v one layer's
// [kv_heads, pages, page_size, head_dim] (head_stride, page_stride elements); block_table int32
// [rows, >= pages of the row] (table_stride); seq_lens int32 [rows], each >= 1 and counting the new
// token; out like q. `bf16`: 1 for bfloat16 storage, 0 for float32. new_slots null: the new
// tokens' keys and values are in the cache already; else new_k and new_v [rows, kv_heads, head_dim]
// (row strides in elements) are written to int64 new_slots [rows] first. `threads` <= 0: only the
// pair (row, kv head) numbered -threads - 1 (row * kv_heads + head), on the calling thread, with no
// OpenMP region (a unit of decode_layers.cpp's step team).
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
