// y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) in bf16 with fp32 accumulation, for the few rows of a
// decode step, on AVX-512 BF16. W is packed once at load (l3_bf16_pack) into blocks of BLOCK output
// columns: for each pair of k, the BLOCK columns' two values side by side, so a block is one
// sequential stream of K/2 x BLOCK x 4 bytes. Each step broadcasts one x pair and multiplies it into
// BLOCK/16 vectors of the block with the dot-product instruction (two bf16 products added into an
// fp32 lane): no horizontal sums. Threads share out the blocks; a block meets every x row while it
// is in L1/L2, so W leaves memory once per call.
// A row's result depends on its own x row only, never on M or on the other rows.
#include <stdint.h>
#include <string.h>

#include "avx512_common.h"

namespace {

using l3::VEC;
constexpr int NV = 4;             // output vectors per block
constexpr int BLOCK = NV * VEC;   // output columns per block
constexpr int MR = 4;             // x rows per micro-tile: NV * MR accumulators + NV weights + 1 broadcast

inline int64_t pairs_of(int64_t K) { return (K + 1) / 2; }

// acc[m][v] over all k for R rows of x and one packed block; writes y[m][0 .. cols).
template <int R>
inline void micro_tile(const uint16_t* x, int64_t ldx, const uint16_t* wb, int64_t K, const uint16_t* bias,
                       uint16_t* y, int64_t ldy, int64_t cols) {
  __m512 acc[R][NV];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_setzero_ps();
  const int64_t full = K / 2;
  for (int64_t p = 0; p < full; ++p) {
    const uint16_t* wp = wb + p * BLOCK * 2;
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wp + v * 2 * VEC);
    for (int m = 0; m < R; ++m) {
      int32_t pair;
      memcpy(&pair, x + m * ldx + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, w[v]);
    }
  }
  if (K & 1) {  // the last k alone: its pair's second x is not read (the packed weight there is 0)
    const uint16_t* wp = wb + full * BLOCK * 2;
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wp + v * 2 * VEC);
    for (int m = 0; m < R; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)x[m * ldx + K - 1]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, w[v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t c0 = v * VEC;
    if (c0 >= cols) break;
    const __mmask16 mask = l3::first_lanes(cols - c0);
    const __m512 b = bias ? l3::load_bf16(bias + c0, mask) : _mm512_setzero_ps();
    for (int m = 0; m < R; ++m) l3::store_bf16(y + m * ldy + c0, bias ? _mm512_add_ps(acc[m][v], b) : acc[m][v], mask);
  }
}

}  // namespace

extern "C" {

// Elements (uint16) of the packed copy of an [N, K] matrix.
int64_t l3_bf16_packed_elements(int64_t N, int64_t K) { return (N + BLOCK - 1) / BLOCK * pairs_of(K) * BLOCK * 2; }

// w [N, K] with row stride ldw -> packed [N / BLOCK][K / 2][BLOCK][2], zero where N or K runs out.
void l3_bf16_pack(const uint16_t* w, int64_t ldw, int64_t N, int64_t K, uint16_t* packed, int threads) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK, pairs = pairs_of(K);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    uint16_t* out = packed + b * pairs * BLOCK * 2;
    for (int64_t p = 0; p < pairs; ++p)
      for (int64_t j = 0; j < BLOCK; ++j)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t n = b * BLOCK + j, k = 2 * p + h;
          out[(p * BLOCK + j) * 2 + h] = (n < N && k < K) ? w[n * ldw + k] : 0;
        }
  }
}

// x [M, K] with row stride ldx, the packed weight of l3_bf16_pack, bias [N] or null,
// y [M, N] with row stride ldy, on `threads` OpenMP threads (torch's pool: the same libgomp).
// Threads take blocks two at a time as they come free: where a server's other processes share
// the cores, a preempted thread holds back only its current blocks, not the whole call (served
// on 2 cores: about 8% less time per token than a static split, at 1 and at 16 clients).
void l3_bf16_linear(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                    int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK, block_elems = pairs_of(K) * BLOCK * 2;
#pragma omp parallel for schedule(dynamic, 2) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n0 = b * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK;
    const uint16_t* wb = packed + b * block_elems;
    const uint16_t* bb = bias ? bias + n0 : nullptr;
    int64_t m = 0;
    for (; m + MR <= M; m += MR) micro_tile<MR>(x + m * ldx, ldx, wb, K, bb, y + m * ldy + n0, ldy, cols);
    switch (M - m) {
      case 3: micro_tile<3>(x + m * ldx, ldx, wb, K, bb, y + m * ldy + n0, ldy, cols); break;
      case 2: micro_tile<2>(x + m * ldx, ldx, wb, K, bb, y + m * ldy + n0, ldy, cols); break;
      case 1: micro_tile<1>(x + m * ldx, ldx, wb, K, bb, y + m * ldy + n0, ldy, cols); break;
      default: break;
    }
  }
}

}  // extern "C"
