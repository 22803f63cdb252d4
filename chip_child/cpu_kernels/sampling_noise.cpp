// The seeded sampler's uniform noise on the cpu: for each row and token id, a 32-bit hash of the
// row's key, its counter and the token's key, as 24 bits in (0, 1). The same integer steps as
// chip_child/sampling/noise.py's torch version, in uint32 lanes (its int64 products masked to 32
// bits are exactly uint32 products), so every value is the same bits. torch's version runs a dozen
// int64 ops over [rows, vocab]: 16 rows of a 32,000 vocabulary cost it milliseconds a step.
#include <stdint.h>

namespace {

inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  return x ^ (x >> 15);
}

}  // namespace

extern "C" {

// keys, counters int64 [rows] (keys below 2^32; counters taken mod 2^32); vocab_keys int64 [vocab],
// below 2^32; out float [rows, vocab] (row stride `vocab`).
void l3_uniform_noise(const int64_t* keys, const int64_t* counters, const int64_t* vocab_keys, int64_t rows,
                      int64_t vocab, float* out, int threads) {
  // Rows are the unit of work: a thread beyond the rows would only be woken to wait at the loop's
  // end (a one-row call, vocabulary 4,096, after a step's Python: 64 us on two threads, 26 on one,
  // on the 2-core CI machine).
  const int team = rows < threads ? (int)rows : threads;
#pragma omp parallel for schedule(static) num_threads(team > 0 ? team : 1)
  for (int64_t r = 0; r < rows; ++r) {
    const uint32_t row = hash32((uint32_t)keys[r] ^ (uint32_t)counters[r]);
    float* o = out + r * vocab;
#pragma omp simd
    for (int64_t v = 0; v < vocab; ++v) {
      const uint32_t bits = hash32(row ^ (uint32_t)vocab_keys[v]) >> 8;
      // The largest 24-bit value is folded to the one below (+ 0.5 would round it to 2^24, a noise
      // of 1.0), by arithmetic: a min or a select here kept gcc 12 from vectorizing the loop. As
      // int32 (the values fit): a uint32 to float conversion has no AVX2 instruction.
      o[v] = ((float)(int32_t)(bits - ((bits + 1) >> 24)) + 0.5f) * (1.0f / 16777216.0f);
    }
  }
}

}  // extern "C"
