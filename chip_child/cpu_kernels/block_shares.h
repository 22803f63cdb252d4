// How a projection's packed weight blocks are shared out between an OpenMP region's threads.
//
// Each thread owns one contiguous run of blocks and takes them from its front, so what it reads
// from memory is one long sequential stream that the hardware prefetcher keeps ahead of. A thread
// whose run is done takes the blocks left in the others' runs from their backs, one at a time: a
// thread that other processes preempt holds back only the block it is on, as with a dynamic
// schedule. Handing out blocks two at a time in turn (`schedule(dynamic, 2)`) instead made each
// thread's stream jump every two blocks, and the projections slower at a few rows
// (docs/performance/cpu.md, "Each thread streams its own run of blocks").
// Which thread computes a block never changes its bits.
#pragma once
#include <stdint.h>

#include <atomic>

namespace l3 {

constexpr int MAX_SHARES = 64;  // runs at most: threads past this share one with another thread

struct alignas(64) BlockShare {
  std::atomic<uint64_t> span;  // the blocks [lo, hi) not taken yet, as lo | hi << 32
};

// The runs of one call: set up by the calling thread before its parallel region, read by the
// region's threads. Run t is [blocks * t / count, blocks * (t + 1) / count).
class BlockShares {
 public:
  BlockShares(int threads, int64_t blocks)
      : count_(threads < 1 ? 1 : threads < MAX_SHARES ? threads : MAX_SHARES) {
    for (int t = 0; t < count_; ++t) {
      const uint64_t lo = (uint64_t)(blocks * t / count_), hi = (uint64_t)(blocks * (t + 1) / count_);
      runs_[t].span.store(lo | hi << 32, std::memory_order_relaxed);
    }
  }

  // The next block for the region's thread `thread`: from the front of its own run, else from the
  // back of another's; -1 once every run is done. Each block is handed out exactly once (one
  // compare-and-swap on the run's word); the region's closing barrier orders the blocks' results
  // for the caller.
  int64_t next(int thread) {
    const int me = thread % count_;
    for (int k = 0; k < count_; ++k) {
      BlockShare& s = runs_[(me + k) % count_];
      uint64_t cur = s.span.load(std::memory_order_relaxed);
      for (;;) {
        const uint64_t lo = cur & 0xffffffffu, hi = cur >> 32;
        if (lo >= hi) break;
        const uint64_t next = k == 0 ? (lo + 1) | hi << 32 : lo | (hi - 1) << 32;
        if (s.span.compare_exchange_weak(cur, next, std::memory_order_relaxed)) return (int64_t)(k == 0 ? lo : hi - 1);
      }
    }
    return -1;
  }

 private:
  int count_;
  BlockShare runs_[MAX_SHARES];
};

}  // namespace l3
