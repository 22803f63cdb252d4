// What both decode attention kernels (decode_attention.cpp on AVX-512, decode_attention_avx2.cpp)
// do the same way around their own per-pair arithmetic: the step's new keys and values written by
// the pair that reads them, and the pairs run as one OpenMP region or one pair alone on the
// calling thread (a unit of decode_layers.cpp's step team).
#pragma once
#include <stdint.h>
#include <string.h>

#include <vector>

namespace l3 {

// The step's new keys and values, each written by the pair that reads it first (a pair reads only
// its own row's cache for its own kv head, so no thread waits on another's write): one kernel call
// per layer instead of a cache write and then the attention. slots null: already in the cache.
struct NewKV {
  const void* k;  // [rows, kv_heads, head_dim], heads contiguous; row stride k_row_stride elements
  const void* v;
  int64_t k_row_stride, v_row_stride;
  const int64_t* slots;  // [rows]: page * page_size + offset
};

// The new token's key and value of the pair (row r, kv head j) into its slot of the head's cache.
template <typename T>
inline void write_new(const NewKV& nkv, int64_t r, int64_t j, T* k, T* v, int64_t page_stride, int64_t page_size,
                      int64_t head_dim) {
  const int64_t slot = nkv.slots[r];
  const int64_t at = slot / page_size * page_stride + slot % page_size * head_dim;
  memcpy(k + at, (const T*)nkv.k + r * nkv.k_row_stride + j * head_dim, head_dim * sizeof(T));
  memcpy(v + at, (const T*)nkv.v + r * nkv.v_row_stride + j * head_dim, head_dim * sizeof(T));
}

// one(pair, scores, offsets) for every pair in [0, pairs) on `threads` OpenMP threads, each with
// its own scratch; `threads` <= 0: only the pair -threads - 1, on the calling thread.
template <typename One>
inline void run_pairs(int64_t pairs, int threads, const One& one) {
  if (threads <= 0) {
    static thread_local std::vector<float> scores;
    static thread_local std::vector<int64_t> offsets;
    one(-(int64_t)threads - 1, scores, offsets);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
    std::vector<int64_t> offsets;
// dynamic: rows differ in context, and a thread that other processes preempt holds back only its pairs
#pragma omp for schedule(dynamic, 2)
    for (int64_t pair = 0; pair < pairs; ++pair) one(pair, scores, offsets);
  }
}

}  // namespace l3
