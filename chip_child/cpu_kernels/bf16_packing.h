// The packed layout both bf16 projection kernels read (bf16_linear.cpp on AVX-512 BF16, bf16_amx.cpp
// on AMX), and the functions that make it, exported by both libraries: a matrix packed once serves
// either. Blocks of PACK_BLOCK output columns; in a block, for each pair of k, the columns' two
// values side by side ([N / PACK_BLOCK][K / 2][PACK_BLOCK][2], zero where N or K runs out).
#pragma once
#include <stdint.h>

namespace l3 {

constexpr int PACK_BLOCK = 64;

inline int64_t pairs_of(int64_t K) { return (K + 1) / 2; }

}  // namespace l3

extern "C" {

// Elements (uint16) of the packed copy of an [N, K] matrix.
int64_t l3_bf16_packed_elements(int64_t N, int64_t K) {
  using namespace l3;
  return (N + PACK_BLOCK - 1) / PACK_BLOCK * pairs_of(K) * PACK_BLOCK * 2;
}

// w [N, K] with row stride ldw -> the packed layout.
void l3_bf16_pack(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, uint16_t* packed, int threads) {
  using namespace l3;
  const int64_t blocks = (N + PACK_BLOCK - 1) / PACK_BLOCK, pairs = pairs_of(K);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    uint16_t* out = packed + b * pairs * PACK_BLOCK * 2;
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t j = 0; j < PACK_BLOCK; ++j)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t n = b * PACK_BLOCK + j, k = 2 * p + h;
          out[(p * PACK_BLOCK + j) * 2 + h] = (n < N && k < K) ? w[n * ldw + k] : 0;
        }
  }
}

}  // extern "C"
