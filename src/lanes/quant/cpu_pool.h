// The kernels' own worker threads: OpenMP's parallel regions cost ~45 us each when the calling thread is not
// the process's main thread (measured here: torch.add of 70,000 floats 7 us from the main thread, 51 us from
// another; our 1536x576 Q4_1 row product 31 us against 80), and the lane core runs every pass in a worker
// thread, some 200 regions a decode step. These workers spin briefly between regions, then sleep.
#pragma once

#include <immintrin.h>
#include <unistd.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace lanes_quant {

class Pool {
 public:
  // A pool of `threads - 1` workers beside the caller, made once a process (again in a forked child).
  static Pool& get() {
    static std::mutex made;
    static Pool* pool = nullptr;
    std::lock_guard<std::mutex> lock(made);
    if (pool == nullptr || pool->pid_ != getpid()) pool = new Pool(std::max(1, at::get_num_threads()));  // a child's old pool has no threads: left, never joined
    return *pool;
  }

  // f(begin, end) over [0, n) in as many chunks as threads, at most one a `grain`; the caller runs the first.
  void run(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& f) {
    const int64_t chunks = std::min<int64_t>(size_, (n + std::max<int64_t>(grain, 1) - 1) / std::max<int64_t>(grain, 1));
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (chunks <= 1 || !busy.owns_lock()) {  // small, or another thread's kernel has the workers: run here
      if (n > 0) f(0, n);
      return;
    }
    job_ = &f, n_ = n, chunks_ = chunks;
    remaining_.store(size_ - 1, std::memory_order_relaxed);  // every worker answers, so none reads a later job's fields
    {
      std::lock_guard<std::mutex> lock(sleep_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    f(0, n / chunks);
    for (int spin = 0; remaining_.load(std::memory_order_acquire) > 0; ++spin) {
      if (spin < kYieldAfter) _mm_pause();
      else std::this_thread::yield();  // a worker waiting for a core (another runtime's threads spin too)
    }
  }

 private:
  explicit Pool(int threads) : size_(threads), pid_(getpid()) {
    for (int i = 1; i < threads; ++i) std::thread([this, i] { work(i); }).detach();
  }

  void work(int index) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t now = generation_.load(std::memory_order_acquire);
      for (int spin = 0; now == seen && spin < kSpins; ++spin) {
        if (spin < kYieldAfter) _mm_pause();
        else std::this_thread::yield();
        now = generation_.load(std::memory_order_acquire);
      }
      if (now == seen) {
        std::unique_lock<std::mutex> lock(sleep_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        now = generation_.load(std::memory_order_acquire);
      }
      seen = now;
      if (index < chunks_) (*job_)(n_ * index / chunks_, n_ * (index + 1) / chunks_);
      remaining_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  static constexpr int kYieldAfter = 2000;  // pauses before a waiting thread yields its core instead
  static constexpr int kSpins = 20000;  // then sleep: a decode step's regions are closer than this
  const int size_;
  const pid_t pid_;
  std::mutex busy_, sleep_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int64_t> remaining_{0};
  const std::function<void(int64_t, int64_t)>* job_ = nullptr;
  int64_t n_ = 0, chunks_ = 0;
};

// As at::parallel_for, on the pool.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  const std::function<void(int64_t, int64_t)> shifted = [&](int64_t b, int64_t e) { f(begin + b, begin + e); };
  Pool::get().run(end - begin, grain, shifted);
}

}  // namespace lanes_quant
