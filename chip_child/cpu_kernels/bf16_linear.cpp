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

#include <omp.h>

#include "avx512_common.h"
#include "bf16_packing.h"
#include "block_shares.h"

namespace {

using l3::VEC;
constexpr int NV = 4;             // output vectors per block
constexpr int BLOCK = NV * VEC;   // output columns per block
static_assert(BLOCK == l3::PACK_BLOCK, "the packed layout's block");
constexpr int MR = 4;             // x rows per micro-tile: NV * MR accumulators + NV weights + 1 broadcast

using l3::pairs_of;

constexpr int KC = 32;            // k pairs per chunk when several micro-tiles share a block (8 KB of it)
constexpr int MG = 64;            // most x rows that take the block in chunks: their fp32 sums fit 16 KB

// acc[m][v] over the k pairs [p0, p1) (and the odd last k when `tail`) for R rows of x and one
// packed block. The sums start at 0 (`first`) or from `part` [R][BLOCK], and end in y[m][0 .. cols)
// (`last`) or back in `part`. fp32 sums stored and reloaded are exact, so a row's result is the
// same bits whether its k pairs ran in one go or in chunks.
template <int R, bool CHUNKED = false, bool PREFETCH = false>
inline void micro_tile(const uint16_t* x, int64_t ldx, const uint16_t* wb, int64_t p0, int64_t p1, bool tail,
                       float* part, bool first, bool last, const uint16_t* bias, uint16_t* y, int64_t ldy,
                       int64_t cols, const uint16_t* pf = nullptr, int64_t pf_step = 0) {
  __m512 acc[R][NV];
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < NV; ++v)
      acc[m][v] = !CHUNKED || first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + (m * NV + v) * VEC);
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* wp = wb + p * BLOCK * 2;
    if (PREFETCH) {  // pf_step lines (32 uint16 each) of the next chunk, spread over this chunk's tiles
      for (int64_t l = 0; l < pf_step; ++l) _mm_prefetch((const char*)(pf + ((p - p0) * pf_step + l) * 32), _MM_HINT_T1);
    }
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wp + v * 2 * VEC);
    for (int m = 0; m < R; ++m) {
      int32_t pair;
      memcpy(&pair, x + m * ldx + 2 * p, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, w[v]);
    }
  }
  if (tail) {  // the last k alone (K odd): its pair's second x is not read (the packed weight there is 0)
    const uint16_t* wp = wb + p1 * BLOCK * 2;
    __m512bh w[NV];
    for (int v = 0; v < NV; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wp + v * 2 * VEC);
    for (int m = 0; m < R; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32((int32_t)x[m * ldx + 2 * p1]);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], xb, w[v]);
    }
  }
  if (CHUNKED && !last) {
    for (int m = 0; m < R; ++m)
      for (int v = 0; v < NV; ++v) _mm512_storeu_ps(part + (m * NV + v) * VEC, acc[m][v]);
    return;
  }
  for (int v = 0; v < NV; ++v) {
    const int64_t c0 = v * VEC;
    if (c0 >= cols) break;
    const __mmask16 mask = l3::first_lanes(cols - c0);
    const __m512 b = bias ? l3::load_bf16(bias + c0, mask) : _mm512_setzero_ps();
    for (int m = 0; m < R; ++m) l3::store_bf16(y + m * ldy + c0, bias ? _mm512_add_ps(acc[m][v], b) : acc[m][v], mask);
  }
}

// Rows [0, M) of x against one block, k pairs [p0, p1): micro-tiles of MR rows, then the rest.
// CHUNKED: the sums carry over in `part` between calls, and `next`, the `next_lines` cache lines
// (32 uint16 each) that follow, are prefetched into L2, shared out over the full micro-tiles'
// iterations so the stream from memory runs beside the compute. Else the whole K in one call.
template <bool CHUNKED>
inline void rows_range(const uint16_t* x, int64_t ldx, const uint16_t* wb, int64_t M, int64_t p0, int64_t p1,
                       bool tail, float* part, bool first, bool last, const uint16_t* bias, uint16_t* y,
                       int64_t ldy, int64_t cols, const uint16_t* next = nullptr, int64_t next_lines = 0) {
  const int64_t tiles = M / MR, span = p1 - p0;
  const int64_t per_tile = CHUNKED && tiles && next ? (next_lines + tiles - 1) / tiles : 0;
  const int64_t pf_step = span ? (per_tile + span - 1) / span : 0;  // lines per k pair
  int64_t m = 0;
  for (int64_t i = 0; m + MR <= M; m += MR, ++i) {
    const int64_t from = i * pf_step * span;  // this tile's first line
    const uint16_t* pf = pf_step && from + pf_step * span <= next_lines ? next + from * 32 : nullptr;
    float* pm = CHUNKED ? part + m * BLOCK : nullptr;
    if (pf)
      micro_tile<MR, CHUNKED, true>(x + m * ldx, ldx, wb, p0, p1, tail, pm, first, last, bias, y + m * ldy, ldy,
                                    cols, pf, pf_step);
    else
      micro_tile<MR, CHUNKED>(x + m * ldx, ldx, wb, p0, p1, tail, pm, first, last, bias, y + m * ldy, ldy, cols);
  }
  float* pm = CHUNKED ? part + m * BLOCK : nullptr;
  switch (M - m) {
    case 3: micro_tile<3, CHUNKED>(x + m * ldx, ldx, wb, p0, p1, tail, pm, first, last, bias, y + m * ldy, ldy, cols); break;
    case 2: micro_tile<2, CHUNKED>(x + m * ldx, ldx, wb, p0, p1, tail, pm, first, last, bias, y + m * ldy, ldy, cols); break;
    case 1: micro_tile<1, CHUNKED>(x + m * ldx, ldx, wb, p0, p1, tail, pm, first, last, bias, y + m * ldy, ldy, cols); break;
    default: break;
  }
}

// Every row of x against one block. One micro-tile, or more than MG rows (a prompt chunk): each
// micro-tile takes the whole K, the block streamed once and then read from L2. From MR + 1 to MG
// rows (a decode step's): the micro-tiles take the block KC pairs at a time, and while they
// compute a chunk from L1 the next one is prefetched. A whole-K pass per micro-tile there read the
// block from memory in the first pass (bound by bandwidth) and computed the others from L2 (bound
// by compute), one after the other: 16 rows ran 0.84x the time this way, 8 and 32 rows 0.89-0.90x,
// 64 rows the same, 256 rows 1.05x (hence whole K there); python scripts/bench_cpu_gemm.py.
inline void block_rows(const uint16_t* x, int64_t ldx, const uint16_t* wb, int64_t M, int64_t K,
                       const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t cols) {
  const int64_t full = K / 2;
  const bool odd = K & 1;
  if (M <= MR || M > MG) {
    rows_range<false>(x, ldx, wb, M, 0, full, odd, nullptr, true, true, bias, y, ldy, cols);
    return;
  }
  alignas(64) float part[MG * BLOCK];
  const int64_t chunks = full > 0 ? (full + KC - 1) / KC : 1;
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t p0 = c * KC, p1 = p0 + KC < full ? p0 + KC : full;
    const int64_t next_pairs = full - p1 < KC ? full - p1 : KC;  // 4 lines a pair
    const bool last = c == chunks - 1;
    rows_range<true>(x, ldx, wb, M, p0, p1, last && odd, part, c == 0, last, bias, y, ldy, cols,
                     next_pairs > 0 ? wb + p1 * BLOCK * 2 : nullptr, next_pairs * 4);
  }
}

}  // namespace

extern "C" {

// x [M, K] with row stride ldx, the packed weight of l3_bf16_pack, bias [N] or null,
// y [M, N] with row stride ldy, on `threads` OpenMP threads (torch's pool: the same libgomp).
// Each thread streams its own run of blocks and then helps with the others' (block_shares.h).
void l3_bf16_linear(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                    int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK, block_elems = pairs_of(K) * BLOCK * 2;
  const auto one = [&](int64_t b) {
    const int64_t n0 = b * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK;
    block_rows(x, ldx, packed + b * block_elems, M, K, bias ? bias + n0 : nullptr, y + n0, ldy, cols);
  };
  l3::BlockShares shares(threads, blocks);
#pragma omp parallel num_threads(threads)
  for (int64_t b; (b = shares.next(omp_get_thread_num())) >= 0;) one(b);
}

// The blocks [b0, b1) of the same product on the calling thread alone (no OpenMP region): a unit
// of a projection on decode_layers.cpp's step team.
void l3_bf16_linear_blocks(const uint16_t* x, int64_t ldx, const uint16_t* packed, uint16_t* y, int64_t ldy,
                           int64_t M, int64_t N, int64_t K, int64_t b0, int64_t b1) {
  const int64_t block_elems = pairs_of(K) * BLOCK * 2;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK;
    block_rows(x, ldx, packed + b * block_elems, M, K, nullptr, y + n0, ldy, cols);
  }
}

}  // extern "C"
