// y[M, N] = x[M, K] @ W[N, K]^T (+ bias[N]) in bf16 with fp32 accumulation on AMX tiles, for any M
// (a decode step's rows or a prompt chunk), reading the weight as bf16_packing.h packs it. That
// layout is already the one AMX's B tile takes: in a block of BLOCK = 64 output columns, each k pair
// holds the columns' two values side by side, so 16 columns of 16 k pairs form one tile of 16 rows
// of 64 bytes at a stride of 256 bytes. A block's 64 columns are four C tiles; per 32 k, one A tile
// (up to 16 rows of x) meets the four B tiles. From 16 rows on this computes several times faster
// than the AVX-512 kernel, which is bound by its dot-product instruction's rate there.
// A row's result depends on its own x row only: every row takes the same k chunks in the same order,
// whatever M is, so a matrix gives the same bits at every batch size. K must be a multiple of 32
// (the caller keeps other matrices on the AVX-512 kernel).
#include <errno.h>
#include <omp.h>
#include <immintrin.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

#include "avx512_common.h"
#include "bf16_packing.h"

namespace {

constexpr int BLOCK = l3::PACK_BLOCK;  // output columns per packed block
constexpr int TILE_N = 16;        // output columns per C tile
constexpr int TILE_M = 16;        // x rows per A tile
constexpr int TILE_PAIRS = 16;    // k pairs per A/B tile (32 k, 64 bytes a row)
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int XFEATURE_XTILEDATA = 18;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (rows x 16 fp32); 4: A (rows x 32 bf16); 5, 6: B (16 pairs x 16 columns x 2).
void configure(int rows) {
  TileConfig c;
  for (int t = 0; t < 4; ++t) { c.rows[t] = rows; c.colsb[t] = TILE_N * 4; }
  c.rows[4] = rows; c.colsb[4] = TILE_PAIRS * 4;
  for (int t = 5; t < 7; ++t) { c.rows[t] = TILE_PAIRS; c.colsb[t] = TILE_N * 4; }
  _tile_loadconfig(&c);
}

constexpr int64_t CHUNK = TILE_PAIRS * BLOCK * 2;  // uint16 per chunk of a block (4 KB)

// `rows` (<= 16) rows of x against one packed block over all of K, into y[rows][0 .. cols).
// The first row tile of a block prefetches the block's next chunk into L1 while this one computes.
// A later one finds the block in L2 and instead prefetches `ahead_lines` cache lines from `ahead`
// (its share of the next block) into L2, a share per chunk: the next block's read from memory
// then overlaps this block's compute instead of following it.
void block_tile(const uint16_t* x, int64_t ldx, const uint16_t* wb, int64_t chunks, const uint16_t* bias, uint16_t* y,
                int64_t ldy, int64_t rows, int64_t cols, float* c_buf, bool first, const char* ahead,
                int64_t ahead_lines) {
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  const int64_t share = (ahead_lines + chunks - 1) / chunks;
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* wc = wb + c * CHUNK;
    if (first && c + 1 < chunks)
      for (int l = 0; l < CHUNK * 2 / 64; l += 4) {
        const char* next = (const char*)(wc + CHUNK) + l * 64;
        _mm_prefetch(next, _MM_HINT_T0); _mm_prefetch(next + 64, _MM_HINT_T0);
        _mm_prefetch(next + 128, _MM_HINT_T0); _mm_prefetch(next + 192, _MM_HINT_T0);
      }
    for (int64_t l = c * share, end = std::min((c + 1) * share, ahead_lines); l < end; ++l)
      _mm_prefetch(ahead + l * 64, _MM_HINT_T1);
    _tile_loadd(4, x + c * TILE_PAIRS * 2, ldx * 2);
    _tile_loadd(5, wc + 0 * TILE_N * 2, BLOCK * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wc + 1 * TILE_N * 2, BLOCK * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, wc + 2 * TILE_N * 2, BLOCK * 4);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, wc + 3 * TILE_N * 2, BLOCK * 4);
    _tile_dpbf16ps(3, 4, 6);
  }
  _tile_stored(0, c_buf + 0 * TILE_N, BLOCK * 4);
  _tile_stored(1, c_buf + 1 * TILE_N, BLOCK * 4);
  _tile_stored(2, c_buf + 2 * TILE_N, BLOCK * 4);
  _tile_stored(3, c_buf + 3 * TILE_N, BLOCK * 4);
  for (int v = 0; v < BLOCK / l3::VEC; ++v) {
    const int64_t c0 = v * l3::VEC;
    if (c0 >= cols) break;
    const __mmask16 mask = l3::first_lanes(cols - c0);
    const __m512 b = bias ? l3::load_bf16(bias + c0, mask) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) {
      const __m512 acc = _mm512_loadu_ps(c_buf + m * BLOCK + c0);
      l3::store_bf16(y + m * ldy + c0, bias ? _mm512_add_ps(acc, b) : acc, mask);
    }
  }
}

}  // namespace

extern "C" {

// 0 once this process may use AMX tiles (Linux asks each process to request them), else the errno.
int l3_amx_init() {
  return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : errno;
}

// As l3_bf16_linear (bf16_linear.cpp), K a multiple of 32. With one row tile (decode) threads take
// blocks two at a time as they come free; with more, each takes a contiguous range of blocks, so
// it knows the block it reads next and its later row tiles prefetch that one. Each configures its
// tiles for a full row tile and, where M has a remainder, for that, and releases them at the end
// (a thread holding tiles costs every context switch 8 KB more).
void l3_bf16_amx_linear(const uint16_t* x, int64_t ldx, const uint16_t* packed, const uint16_t* bias, uint16_t* y,
                        int64_t ldy, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t blocks = (N + BLOCK - 1) / BLOCK, pairs = K / 2, chunks = pairs / TILE_PAIRS;
  const int64_t block_elems = pairs * BLOCK * 2, full = M / TILE_M, rest = M % TILE_M;
  const int64_t tiles = full + (rest ? 1 : 0), block_lines = block_elems * 2 / 64;
#pragma omp parallel num_threads(threads)
  {
    alignas(64) float c_buf[TILE_M * BLOCK];
    int configured = 0;  // rows of the loaded config
    // With several row tiles, row tiles 1 .. tiles - 1 each prefetch `per_tile` lines of the next block.
    const int nt = omp_get_num_threads(), me = omp_get_thread_num();
    const int64_t mine_to = tiles > 1 ? blocks * (me + 1) / nt : 0;
    const int64_t per_tile = tiles > 1 ? (block_lines + tiles - 2) / (tiles - 1) : 0;
    auto run_block = [&](int64_t b) {
      const int64_t n0 = b * BLOCK, cols = N - n0 < BLOCK ? N - n0 : BLOCK;
      const uint16_t* wb = packed + b * block_elems;
      const char* next = (const char*)(wb + block_elems);  // read only where b + 1 < mine_to
      for (int64_t t = 0; t < tiles; ++t) {
        const int rows = t < full ? TILE_M : (int)rest;
        if (rows != configured) { configure(rows); configured = rows; }
        const int64_t from = std::min((t > 0 ? t - 1 : 0) * per_tile, block_lines), to = std::min(t * per_tile, block_lines);
        const bool ahead = t > 0 && b + 1 < mine_to;
        block_tile(x + t * TILE_M * ldx, ldx, wb, chunks, bias ? bias + n0 : nullptr, y + t * TILE_M * ldy + n0, ldy,
                   rows, cols, c_buf, t == 0, next + from * 64, ahead ? to - from : 0);
      }
    };
    if (tiles > 1) {
      for (int64_t b = blocks * me / nt; b < mine_to; ++b) run_block(b);
    } else {
#pragma omp for schedule(dynamic, 2)
      for (int64_t b = 0; b < blocks; ++b) run_block(b);
    }
    if (configured) _tile_release();
  }
}

}  // extern "C"
