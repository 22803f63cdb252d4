// y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) for bf16 weights on AVX2 + FMA, the cpus without
// AVX-512 BF16 (AMD Zen 2/3, most Intel client parts). It reads the packed layout of bf16_packing.h
// that bf16_linear.cpp reads: a 256-bit load holds 8 output columns' two k values side by side, so
// a shift and a mask widen it into the even-k and odd-k fp32 vectors, and two FMAs take both
// products. x is widened to fp32 once per call. Sums are fp32 and each output's products are
// added in k order whatever the tiling, so a row's result depends on its own x row only, never
// on M or on the other rows. Threads share out the 64-column blocks as bf16_linear.cpp does.
#include <stdint.h>
#include <string.h>

#include <omp.h>
#include <vector>

#include "avx2_common.h"
#include "bf16_packing.h"
#include "block_shares.h"

#define UNROLL L3_UNROLL

namespace {

using l3avx2::VEC;
constexpr int BLOCK = l3::PACK_BLOCK;          // output columns per packed block
constexpr int BLOCK_VECS = BLOCK / VEC;        // 8

// The odd-k value of each column sits in the high half of its 32-bit lane: a mask makes it an
// fp32; the even-k value in the low half: a shift does.
inline __m256 even_k(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline __m256 odd_k(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
}

inline void store_bf16(uint16_t* p, __m256 v, int n) { l3avx2::store(p, v, n); }
inline __m256 load_bf16(const uint16_t* p, int n) { return l3avx2::load(p, n); }

// R rows of x (fp32, row stride ldx) against NV vectors of one packed block starting at vector
// v0, over all K (`pairs` k pairs; an odd K's last pair has a 0 weight and a 0 x beyond K).
// PREFETCH_REST: the first of two passes over a block's halves also fetches the other half's two
// lines of each k pair into L2, so the block leaves memory in order, once (cold, 2 rows ran
// 1.5x the time of 1 without it).
template <int R, int NV, bool PREFETCH_REST = false>
inline void micro_tile(const float* x, int64_t ldx, const uint16_t* wb, int64_t pairs, int v0,
                       const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t cols) {
  __m256 acc[R][NV];
  UNROLL for (int m = 0; m < R; ++m)
    UNROLL for (int v = 0; v < NV; ++v) acc[m][v] = _mm256_setzero_ps();
  const uint16_t* wp = wb + v0 * 2 * VEC;
  for (int64_t p = 0; p < pairs; ++p, wp += BLOCK * 2) {
    if (PREFETCH_REST) {
      _mm_prefetch((const char*)(wp + BLOCK), _MM_HINT_T1);
      _mm_prefetch((const char*)(wp + BLOCK + 32), _MM_HINT_T1);
    }
    __m256 xe[R], xo[R];
    UNROLL for (int m = 0; m < R; ++m) {
      xe[m] = _mm256_broadcast_ss(x + m * ldx + 2 * p);
      xo[m] = _mm256_broadcast_ss(x + m * ldx + 2 * p + 1);
    }
    UNROLL for (int v = 0; v < NV; ++v) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(wp + v * 2 * VEC));
      const __m256 we = even_k(w), wo = odd_k(w);
      UNROLL for (int m = 0; m < R; ++m) acc[m][v] = _mm256_fmadd_ps(xo[m], wo, _mm256_fmadd_ps(xe[m], we, acc[m][v]));
    }
  }
  UNROLL for (int v = 0; v < NV; ++v) {
    const int64_t c0 = (v0 + v) * VEC;
    if (c0 < cols) {
      const int n = cols - c0 < VEC ? (int)(cols - c0) : VEC;
      const __m256 b = bias ? load_bf16(bias + c0, n) : _mm256_setzero_ps();
      UNROLL for (int m = 0; m < R; ++m) store_bf16(y + m * ldy + c0, _mm256_add_ps(acc[m][v], b), n);
    }
  }
}

// One to three rows against one block, the block streamed from memory in order: a row alone in
// one pass over the whole block (8 sums), two rows in two passes over its halves (8 sums, the
// second half then read from L2); of three rows, the first alone, then the other two.
inline void few_rows(const float* x, int64_t ldx, const uint16_t* wb, int64_t M, int64_t pairs,
                     const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t cols) {
  if (M != 2) {
    micro_tile<1, BLOCK_VECS>(x, ldx, wb, pairs, 0, bias, y, ldy, cols);
    if (M == 1) return;
    x += ldx, y += ldy;
  }
  micro_tile<2, BLOCK_VECS / 2, true>(x, ldx, wb, pairs, 0, bias, y, ldy, cols);
  if (cols > BLOCK / 2) micro_tile<2, BLOCK_VECS / 2>(x, ldx, wb, pairs, BLOCK_VECS / 2, bias, y, ldy, cols);
}

constexpr int64_t KC_PAIRS = 128;  // k pairs per chunk of the many-rows path: 256 k x 64 columns, 64 KB of fp32
constexpr int MANY_ROWS = 4;       // from here on rows take the many-rows path

constexpr int STRIP = 2 * VEC;  // the columns of one wide_tile

// k pairs [p0, p0 + np) of one block widened to fp32, a 16-column strip after another, each
// k-major: buf[strip][k][16]. A tile then reads its strip from consecutive lines: in the block's
// own k-major order (a 256-byte stride) a strip's lines fell in a sixteenth of L1's sets and did
// not stay there from one tile to the next.
inline void widen_chunk(const uint16_t* wb, int64_t p0, int64_t np, float* buf) {
  const int64_t kk = 2 * np;
  for (int64_t p = 0; p < np; ++p) {
    const uint16_t* wp = wb + (p0 + p) * BLOCK * 2;
    for (int v = 0; v < BLOCK_VECS; ++v) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(wp + v * 2 * VEC));
      float* even = buf + (v / 2) * kk * STRIP + 2 * p * STRIP + (v % 2) * VEC;
      _mm256_storeu_ps(even, even_k(w));
      _mm256_storeu_ps(even + STRIP, odd_k(w));
    }
  }
}

// R rows x 16 columns (from c0) over the kk k of a widened chunk: the classic AVX2 tile, one FMA
// per weight vector and row. Each output's sum runs over k in order, one FMA each, as in
// micro_tile: the same bits on either path. Sums start at 0 (`first`) or from part [R][64], and
// end in y (`last`) or back in part.
// `lines` cache lines from `pf` on (the block's next chunk) are prefetched into L2, spread over
// the k loop, so memory streams while the tile computes from L1 (cold, 4 to 16 rows ran 0.75x the
// time of this path without it).
template <int R>
inline void wide_tile(const float* x, int64_t ldx, const float* buf, int64_t kk, int c0, float* part, bool first,
                      bool last, const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t cols,
                      const uint16_t* pf, int64_t lines) {
  int64_t owed = 0;  // lines * k / kk, the prefetches due so far, counted without a division
  __m256 acc[R][2];
  UNROLL for (int m = 0; m < R; ++m)
    UNROLL for (int v = 0; v < 2; ++v)
      acc[m][v] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + m * BLOCK + c0 + v * VEC);
  const float* strip = buf + (c0 / STRIP) * kk * STRIP;
  for (int64_t k = 0; k < kk; ++k) {
    for (owed += lines; owed >= kk; owed -= kk, pf += 32) _mm_prefetch((const char*)pf, _MM_HINT_T1);
    const __m256 w0 = _mm256_loadu_ps(strip + k * STRIP), w1 = _mm256_loadu_ps(strip + k * STRIP + VEC);
    UNROLL for (int m = 0; m < R; ++m) {
      const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
      acc[m][0] = _mm256_fmadd_ps(xb, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xb, w1, acc[m][1]);
    }
  }
  UNROLL for (int v = 0; v < 2; ++v) {
    const int64_t c = c0 + v * VEC;
    if (!last) {
      UNROLL for (int m = 0; m < R; ++m) _mm256_storeu_ps(part + m * BLOCK + c, acc[m][v]);
    } else if (c < cols) {
      const int n = cols - c < VEC ? (int)(cols - c) : VEC;
      const __m256 b = bias ? load_bf16(bias + c, n) : _mm256_setzero_ps();
      UNROLL for (int m = 0; m < R; ++m) store_bf16(y + m * ldy + c, _mm256_add_ps(acc[m][v], b), n);
    }
  }
}

// Many rows against one block: the block widened to fp32 KC_PAIRS k pairs at a time (once per
// call, not once per row), then tiles of 6 rows x 16 columns over it, the last 1-5 rows alone.
inline void many_rows(const float* x, int64_t ldx, const uint16_t* wb, int64_t M, int64_t pairs,
                      const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t cols) {
  static thread_local std::vector<float> buf, part;  // each OpenMP thread's own
  buf.resize(2 * KC_PAIRS * BLOCK);
  part.resize(M * BLOCK);
  for (int64_t p0 = 0; p0 < pairs; p0 += KC_PAIRS) {
    const int64_t np = pairs - p0 < KC_PAIRS ? pairs - p0 : KC_PAIRS;
    const bool first = p0 == 0, last = p0 + np >= pairs;
    widen_chunk(wb, p0, np, buf.data());
    const int64_t next = pairs - p0 - np < KC_PAIRS ? pairs - p0 - np : KC_PAIRS;  // the next chunk's k pairs
    const int64_t tiles = (M + 5) / 6 * ((cols + 2 * VEC - 1) / (2 * VEC));
    const int64_t lines = (next * 4 + tiles - 1) / tiles;  // 4 lines a pair, shared out over the tiles
    const uint16_t* pf = wb + (p0 + np) * BLOCK * 2;
    const uint16_t* pf_end = pf + next * BLOCK * 2;
    for (int c0 = 0; c0 < BLOCK && c0 < cols; c0 += 2 * VEC) {
      int64_t m = 0;
      const float* xc = x + 2 * p0;
      auto tile_lines = [&]() {  // this tile's share of the next chunk, none past its end
        const int64_t n = pf >= pf_end ? 0 : (pf_end - pf) / 32 < lines ? (pf_end - pf) / 32 : lines;
        pf += n * 32;
        return n;
      };
      for (; m + 6 <= M; m += 6) {
        const uint16_t* from = pf;
        const int64_t n = tile_lines();
        wide_tile<6>(xc + m * ldx, ldx, buf.data(), 2 * np, c0, part.data() + m * BLOCK, first, last, bias,
                     y + m * ldy, ldy, cols, from, n);
      }
      const float* xm = xc + m * ldx;
      float* pm = part.data() + m * BLOCK;
      uint16_t* ym = y + m * ldy;
      const uint16_t* from = pf;
      const int64_t n = M > m ? tile_lines() : 0;
      const float* b = buf.data();
      switch (M - m) {
        case 5: wide_tile<5>(xm, ldx, b, 2 * np, c0, pm, first, last, bias, ym, ldy, cols, from, n); break;
        case 4: wide_tile<4>(xm, ldx, b, 2 * np, c0, pm, first, last, bias, ym, ldy, cols, from, n); break;
        case 3: wide_tile<3>(xm, ldx, b, 2 * np, c0, pm, first, last, bias, ym, ldy, cols, from, n); break;
        case 2: wide_tile<2>(xm, ldx, b, 2 * np, c0, pm, first, last, bias, ym, ldy, cols, from, n); break;
        case 1: wide_tile<1>(xm, ldx, b, 2 * np, c0, pm, first, last, bias, ym, ldy, cols, from, n); break;
        default: break;
      }
    }
  }
}

// Rows in groups of ROW_GROUP, each group's sums (ROW_GROUP x 64 fp32, 24 KB) staying in L1/L2
// while the chunks pass: a prompt chunk of 2,000 rows would otherwise keep 500 KB of sums per
// thread. Every path sums each output over k in the same order, so the grouping changes no bits.
constexpr int64_t ROW_GROUP = 96;

inline void block_rows(const float* x, int64_t ldx, const uint16_t* wb, int64_t M, int64_t pairs,
                       const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t cols) {
  for (int64_t m0 = 0; m0 < M; m0 += ROW_GROUP) {
    const int64_t rows = M - m0 < ROW_GROUP ? M - m0 : ROW_GROUP;
    if (rows < MANY_ROWS)
      few_rows(x + m0 * ldx, ldx, wb, rows, pairs, bias, y + m0 * ldy, ldy, cols);
    else
      many_rows(x + m0 * ldx, ldx, wb, rows, pairs, bias, y + m0 * ldy, ldy, cols);
  }
}

// Rows [m0, m1) of x [M, K] (bf16, row stride ldx) widened into xp (fp32, row stride ldf = 2 *
// pairs), an odd K's pad with a 0.
inline void widen_rows(const uint16_t* x, int64_t ldx, int64_t m0, int64_t m1, int64_t K, float* xp, int64_t ldf) {
  for (int64_t m = m0; m < m1; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      const uint32_t bits = (uint32_t)x[m * ldx + k] << 16;
      memcpy(xp + m * ldf + k, &bits, 4);
    }
    if (K & 1) xp[m * ldf + K] = 0.0f;
  }
}

}  // namespace

extern "C" {

// The same arguments as bf16_linear.cpp's l3_bf16_linear: x [M, K] bf16 with row stride ldx, the
// packed weight, bias [N] or null, y [M, N] with row stride ldy, on `threads` OpenMP threads.
void l3_bf16_linear(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                    int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t pairs = l3::pairs_of(K), ldf = 2 * pairs, blocks = (N + BLOCK - 1) / BLOCK;
  const int64_t block_elems = pairs * BLOCK * 2;
  static thread_local std::vector<float> xf;  // x in fp32, an odd K padded with a 0
  xf.resize(M * ldf);
  float* xp = xf.data();
  l3::BlockShares shares(threads, blocks);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) widen_rows(x, ldx, m, m + 1, K, xp, ldf);
    for (int64_t b; (b = shares.next(omp_get_thread_num())) >= 0;) {
      const int64_t n0 = b * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK;
      block_rows(xp, ldf, packed + b * block_elems, M, pairs, bias ? bias + n0 : nullptr, y + n0, ldy, cols);
    }
  }
}

// The blocks [b0, b1) of the same product on the calling thread alone (no OpenMP region), as
// bf16_linear.cpp's entry of that name: a unit of decode_layers.cpp's step team. x is widened per
// call (M x K conversions beside M x K x 64 products a block), so units need no shared state.
void l3_bf16_linear_blocks(const uint16_t* x, int64_t ldx, const uint16_t* packed, uint16_t* y, int64_t ldy,
                           int64_t M, int64_t N, int64_t K, int64_t b0, int64_t b1) {
  const int64_t pairs = l3::pairs_of(K), ldf = 2 * pairs, block_elems = pairs * BLOCK * 2;
  static thread_local std::vector<float> xf;
  xf.resize(M * ldf);
  widen_rows(x, ldx, 0, M, K, xf.data(), ldf);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = b * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK;
    block_rows(xf.data(), ldf, packed + b * block_elems, M, pairs, nullptr, y + n0, ldy, cols);
  }
}

}  // extern "C"
