// Decode attention on the cpu: one new query token per row, its keys and values read in place
// from the paged cache (no gather, no dense copy), in fp32 from bf16 or fp32 storage.
// Threads split the (row, kv head) pairs; each pair's grouped query heads share one pass over
// the keys and one over the values. Scores and softmax stay in fp32; the output is rounded once.
// Cache layout, per layer: k and v each [kv_heads, pages, page_size, head_dim].
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <vector>

namespace {

constexpr int VEC = 16;
constexpr int MAX_GROUP = 16;      // query heads per kv head
constexpr int MAX_HEAD_DIM = 256;

// Loads and stores of 16 lanes, masked: a head size that is not a multiple of 16 ends in a partial vector.
inline __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load(const uint16_t* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __mmask16 lanes(int64_t c, int64_t chunks, int64_t head_dim) {  // chunk c's valid lanes
  const int64_t rest = head_dim - c * VEC;
  return c + 1 < chunks || rest >= VEC ? (__mmask16)0xffff : (__mmask16)((1u << rest) - 1);
}

// e^x for x <= 0 (scores minus their max): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], p the
// degree-6 Taylor polynomial (relative error below 2e-7 there); below -87 the result is 0.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.0f);
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(~tiny, _mm512_scalef_ps(p, n));
}

template <typename T>
void attend_pair(const T* q, const T* k, const T* v, const int32_t* pages, int64_t ctx, int64_t group,
                 int64_t head_dim, int64_t page_size, int64_t page_stride, float scale, T* out,
                 std::vector<float>& scores) {
  const int64_t chunks = (head_dim + VEC - 1) / VEC;
  __mmask16 mask[MAX_HEAD_DIM / VEC];
  for (int64_t c = 0; c < chunks; ++c) mask[c] = lanes(c, chunks, head_dim);
  __m512 qf[MAX_GROUP][MAX_HEAD_DIM / VEC];  // masked lanes are 0, so they add nothing to a dot product
  for (int64_t i = 0; i < group; ++i)
    for (int64_t c = 0; c < chunks; ++c)
      qf[i][c] = _mm512_mul_ps(load(q + i * head_dim + c * VEC, mask[c]), _mm512_set1_ps(scale));
  scores.resize(group * ctx + VEC);
  float* s = scores.data();
  for (int64_t t = 0; t < ctx; ++t) {
    const T* kp = k + pages[t / page_size] * page_stride + (t % page_size) * head_dim;
    __m512 kv[MAX_HEAD_DIM / VEC];
    for (int64_t c = 0; c < chunks; ++c) kv[c] = load(kp + c * VEC, mask[c]);
    for (int64_t i = 0; i < group; ++i) {
      __m512 acc = _mm512_mul_ps(qf[i][0], kv[0]);
      for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(qf[i][c], kv[c], acc);
      s[i * ctx + t] = _mm512_reduce_add_ps(acc);
    }
  }
  float inv_sum[MAX_GROUP];
  for (int64_t i = 0; i < group; ++i) {
    float* si = s + i * ctx;
    float m = -INFINITY;
    for (int64_t t = 0; t < ctx; ++t) m = si[t] > m ? si[t] : m;
    const __m512 mv = _mm512_set1_ps(m);
    __m512 sum = _mm512_setzero_ps();
    int64_t t = 0;
    for (; t + VEC <= ctx; t += VEC) {
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(si + t), mv));
      _mm512_storeu_ps(si + t, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (t < ctx) {
      const __mmask16 tail = (__mmask16)((1u << (ctx - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(tail, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, si + t), mv)));
      _mm512_mask_storeu_ps(si + t, tail, e);
      sum = _mm512_add_ps(sum, e);
    }
    inv_sum[i] = 1.0f / _mm512_reduce_add_ps(sum);
  }
  __m512 acc[MAX_GROUP][MAX_HEAD_DIM / VEC];
  for (int64_t i = 0; i < group; ++i)
    for (int64_t c = 0; c < chunks; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < ctx; ++t) {
    const T* vp = v + pages[t / page_size] * page_stride + (t % page_size) * head_dim;
    __m512 vv[MAX_HEAD_DIM / VEC];
    for (int64_t c = 0; c < chunks; ++c) vv[c] = load(vp + c * VEC, mask[c]);
    for (int64_t i = 0; i < group; ++i) {
      const __m512 p = _mm512_set1_ps(s[i * ctx + t]);
      for (int64_t c = 0; c < chunks; ++c) acc[i][c] = _mm512_fmadd_ps(p, vv[c], acc[i][c]);
    }
  }
  for (int64_t i = 0; i < group; ++i)
    for (int64_t c = 0; c < chunks; ++c)
      store(out + i * head_dim + c * VEC, _mm512_mul_ps(acc[i][c], _mm512_set1_ps(inv_sum[i])), mask[c]);
}

template <typename T>
void decode_attention(const T* q, int64_t q_row_stride, const T* k, const T* v, int64_t head_stride,
                      int64_t page_stride, const int32_t* block_table, int64_t table_stride, const int32_t* seq_lens,
                      int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim, int64_t page_size, float scale,
                      T* out, int64_t out_row_stride, int threads) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(static)
    for (int64_t pair = 0; pair < rows * kv_heads; ++pair) {
      const int64_t r = pair / kv_heads, j = pair % kv_heads;
      attend_pair<T>(q + r * q_row_stride + j * group * head_dim, k + j * head_stride, v + j * head_stride,
                     block_table + r * table_stride, seq_lens[r], group, head_dim, page_size, page_stride, scale,
                     out + r * out_row_stride + j * group * head_dim, scores);
    }
  }
}

}  // namespace

extern "C" {

// The limits the caller checks before any call (a group or head size past them is not run here).
int l3_decode_attention_max_group(void) { return MAX_GROUP; }
int l3_decode_attention_max_head_dim(void) { return MAX_HEAD_DIM; }

// q [rows, kv_heads * group, head_dim] (row stride q_row_stride elements); k, v one layer's
// [kv_heads, pages, page_size, head_dim] (head_stride, page_stride elements); block_table int32
// [rows, >= pages of the row] (table_stride); seq_lens int32 [rows], each >= 1 and counting the new
// token, already in the cache; out like q. `bf16`: 1 for bfloat16 storage, 0 for float32.
void l3_decode_attention(int bf16, const void* q, int64_t q_row_stride, const void* k, const void* v,
                         int64_t head_stride, int64_t page_stride, const int32_t* block_table, int64_t table_stride,
                         const int32_t* seq_lens, int64_t rows, int64_t kv_heads, int64_t group, int64_t head_dim,
                         int64_t page_size, float scale, void* out, int64_t out_row_stride, int threads) {
  if (bf16)
    decode_attention<uint16_t>((const uint16_t*)q, q_row_stride, (const uint16_t*)k, (const uint16_t*)v, head_stride,
                               page_stride, block_table, table_stride, seq_lens, rows, kv_heads, group, head_dim,
                               page_size, scale, (uint16_t*)out, out_row_stride, threads);
  else
    decode_attention<float>((const float*)q, q_row_stride, (const float*)k, (const float*)v, head_stride, page_stride,
                            block_table, table_stride, seq_lens, rows, kv_heads, group, head_dim, page_size, scale,
                            (float*)out, out_row_stride, threads);
}

}  // extern "C"
