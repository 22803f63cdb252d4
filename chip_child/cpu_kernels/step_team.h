// The threads a decode step's stages run on, in place of an OpenMP region per stage.
//
// An OpenMP region ends in a barrier that waits for every thread of the team, including one that
// another process has taken the core from and that has not even started. On a CPU that the server's
// other threads share (two cores, an API server and an engine core waking at every token) that wait
// is most of what a served step loses. Here the calling thread waits only for units that a helper
// has already taken: a helper that is off its core when a stage starts takes nothing from it, and
// the caller runs the stage's units alone.
//
// Units are shared out as block_shares.h does for a projection's blocks: each member owns one
// contiguous run and takes from its front, then takes what is left of the others' runs from their
// backs. Which member runs a unit never changes its bits. Each claim carries the stage's number, so
// a helper that wakes late cannot take a unit of a later stage as one of its own.
#pragma once
#include <stdint.h>

#include <atomic>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define L3_PAUSE() _mm_pause()
#else
#define L3_PAUSE() std::this_thread::yield()
#endif

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace l3 {

// Pauses a helper spins for the next stage before it sleeps (futex): about 100 us on the 2-core
// Zen 4 machine (25 ns a pause), past the gaps between a step's stages (its norms and rope take
// microseconds), so a helper sleeps only between steps.
constexpr int TEAM_SPIN = 4000;
constexpr int TEAM_MAX = 16;  // members at most
constexpr int64_t MAX_UNITS = 0xffff;  // a run's bounds are 16 bits each in its claim word

using UnitFn = void (*)(const void* ctx, int64_t unit);

class StepTeam {
 public:
  explicit StepTeam(int members) : members_(members < 1 ? 1 : members > TEAM_MAX ? TEAM_MAX : members) {
    for (int t = 1; t < members_; ++t) std::thread([this, t] { helper(t); }).detach();
  }
  int members() const { return members_; }

  // Tests: helpers take no unit while held, as when other processes have their cores; and the
  // units helpers have run since the last call.
  void hold(bool on) { hold_.store(on, std::memory_order_relaxed); }
  int64_t take_helper_units() { return helper_units_.exchange(0, std::memory_order_relaxed); }

  // Runs fn(ctx, u) for every u in [0, units) on the caller and whichever helpers are on a core,
  // and returns once all are done. A second thread calling while one runs runs its units alone.
  void run(UnitFn fn, const void* ctx, int64_t units) {
    if (units > MAX_UNITS || busy_.exchange(true, std::memory_order_acquire)) {  // another caller: run alone
      for (int64_t u = 0; u < units; ++u) fn(ctx, u);
      return;
    }
    const uint32_t stage = stage_.load(std::memory_order_relaxed) + 1;
    fn_.store(fn, std::memory_order_relaxed);
    ctx_.store(ctx, std::memory_order_relaxed);
    for (int t = 0; t < members_; ++t) {
      const uint64_t lo = (uint64_t)(units * t / members_), hi = (uint64_t)(units * (t + 1) / members_);
      runs_[t].word.store(pack(lo, hi, stage), std::memory_order_relaxed);
    }
    helpers_done_.store(0, std::memory_order_relaxed);
    stage_.store(stage, std::memory_order_seq_cst);  // publishes the runs, fn_ and ctx_
    if (sleepers_.load(std::memory_order_seq_cst) > 0) wake();
    int64_t mine = 0;
    for (int64_t u; (u = claim(0, stage)) >= 0; ++mine) fn(ctx, u);
    // Only units a helper has taken are left: wait for those, never for a helper that took none.
    while (helpers_done_.load(std::memory_order_acquire) + mine < units) L3_PAUSE();
    busy_.store(false, std::memory_order_release);
  }

 private:
  struct alignas(64) Run {
    std::atomic<uint64_t> word{0};  // the units [lo, hi) not taken yet, and the stage they belong to
  };
  static uint64_t pack(uint64_t lo, uint64_t hi, uint32_t stage) { return lo | hi << 16 | (uint64_t)stage << 32; }

  // The next unit of `stage` for member `me`, or -1 once none is left (or the stage has passed).
  int64_t claim(int me, uint32_t stage) {
    for (int k = 0; k < members_; ++k) {
      Run& r = runs_[(me + k) % members_];
      uint64_t cur = r.word.load(std::memory_order_acquire);
      for (;;) {
        const uint64_t lo = cur & 0xffff, hi = (cur >> 16) & 0xffff;
        if ((uint32_t)(cur >> 32) != stage || lo >= hi) break;
        const uint64_t next = k == 0 ? pack(lo + 1, hi, stage) : pack(lo, hi - 1, stage);
        if (r.word.compare_exchange_weak(cur, next, std::memory_order_acq_rel)) return (int64_t)(k == 0 ? lo : hi - 1);
      }
    }
    return -1;
  }

  void helper(int me) {
    uint32_t seen = stage_.load(std::memory_order_acquire);
    for (;;) {
      uint32_t stage = stage_.load(std::memory_order_acquire);
      for (int i = 0; stage == seen && i < TEAM_SPIN; ++i) {
        L3_PAUSE();
        stage = stage_.load(std::memory_order_acquire);
      }
      if (stage == seen) {
        sleep(seen);
        continue;
      }
      seen = stage;
      if (hold_.load(std::memory_order_relaxed)) continue;  // as if off its core (tests)
      // A claim that succeeds holds the stage open (the caller waits for the unit), so fn_ and ctx_
      // read after it are the stage's own.
      for (int64_t u; (u = claim(me, stage)) >= 0;) {
        fn_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), u);
        helpers_done_.fetch_add(1, std::memory_order_release);
        helper_units_.fetch_add(1, std::memory_order_relaxed);
      }
    }
  }

  void sleep(uint32_t seen) {
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
#ifdef __linux__
    // Returns at once if the stage moved on since `seen` (no lost wake-up).
    syscall(SYS_futex, (uint32_t*)&stage_, FUTEX_WAIT_PRIVATE, seen, nullptr, nullptr, 0);
#else
    while (stage_.load(std::memory_order_acquire) == seen) std::this_thread::yield();
#endif
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }

  void wake() {
#ifdef __linux__
    syscall(SYS_futex, (uint32_t*)&stage_, FUTEX_WAKE_PRIVATE, TEAM_MAX, nullptr, nullptr, 0);
#endif
  }

  const int members_;
  alignas(64) std::atomic<uint32_t> stage_{0};
  std::atomic<int> sleepers_{0};
  alignas(64) std::atomic<int64_t> helpers_done_{0};
  std::atomic<bool> busy_{false}, hold_{false};
  std::atomic<int64_t> helper_units_{0};
  std::atomic<UnitFn> fn_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  Run runs_[TEAM_MAX];
};

// The process's team of `members` threads (the caller and members - 1 helpers), made on first use
// and kept: one per size, so a runtime that changes its thread count and back makes no new threads.
// Never freed: its helpers may be asleep in it when the process ends.
inline std::atomic<StepTeam*>* step_teams() {
  static std::atomic<StepTeam*> teams[TEAM_MAX + 1];
  return teams;
}

inline StepTeam& step_team(int members) {
  members = members < 1 ? 1 : members > TEAM_MAX ? TEAM_MAX : members;
  std::atomic<StepTeam*>& slot = step_teams()[members];
  StepTeam* team = slot.load(std::memory_order_acquire);
  if (team == nullptr) {
    static std::mutex making;
    std::lock_guard<std::mutex> lock(making);
    team = slot.load(std::memory_order_acquire);
    if (team == nullptr) slot.store(team = new StepTeam(members), std::memory_order_release);
  }
  return *team;
}

}  // namespace l3
