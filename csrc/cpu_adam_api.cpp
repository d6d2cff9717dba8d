// C ABI of zenflow's CPU optimizer library, loaded from Python with ctypes (which releases the
// GIL for the duration of every call). Python mirrors TensorWork and Hyper with ctypes
// structures; zf_record_sizes lets it check the layouts before the first call.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "adamw_kernels.h"
#include "thread_pool.h"

#define ZF_API extern "C" __attribute__((visibility("default")))

namespace {

using zf::Hyper;
using zf::TensorWork;

// Elements per task: large enough that handing out a task costs nothing next to running it,
// small enough to balance the threads.
constexpr int64_t kChunk = 1 << 16;

zf::LazyPool g_pool(1, 0);  // the AdamW jobs' pool: size and niceness set from Python
std::atomic<int> g_isa{zf::kAuto};
std::atomic<int> g_inject_failures{0};

struct Handle {
  std::shared_ptr<zf::Job> job;
};

zf::Isa effective_isa() {
  const int isa = g_isa.load();
  return isa == zf::kAuto ? zf::best_isa() : static_cast<zf::Isa>(isa);
}

bool valid_dtype(int32_t d) { return d == zf::kF32 || d == zf::kBF16 || d == zf::kF16; }

// Gathered gradient rows: whole rows of the tensor, each index inside the gradient's rows.
std::string check_grad_rows(const TensorWork& t) {
  if (!t.grad_rows) return "";
  if (!t.grad) return "grad_rows without a grad";
  if (t.grad_row_len < 1 || t.numel % t.grad_row_len != 0) {
    return "gathered rows need grad_row_len >= 1 dividing numel";
  }
  for (int64_t r = 0; r < t.numel / t.grad_row_len; ++r) {
    if (t.grad_rows[r] < 0 || t.grad_rows[r] >= t.grad_row_count) {
      return "grad row index " + std::to_string(t.grad_rows[r]) + " (row " + std::to_string(r) +
             ") outside the gradient's " + std::to_string(t.grad_row_count) + " rows";
    }
  }
  return "";
}

std::string check_tensor(const TensorWork& t) {
  if (t.numel < 0) return "negative numel";
  if (t.numel == 0) return "";
  if (!t.param || !t.exp_avg || !t.exp_avg_sq) return "null param, exp_avg or exp_avg_sq";
  if (!t.grad && !t.accumulator) return "no gradient (grad and accumulator are both null)";
  if (t.grad && !valid_dtype(t.grad_dtype)) return "grad dtype must be fp32, bf16 or fp16";
  if (const std::string rows = check_grad_rows(t); !rows.empty()) return rows;
  if (t.out && !valid_dtype(t.out_dtype)) {
    return "out dtype must be fp32, bf16 or fp16";
  }
  if (!t.segment_steps) return t.step >= 1 ? "" : "step must be >= 1 (the count after increment)";
  if (t.segment_len < 1) return "segment_len must be >= 1";
  const int64_t segments = (t.numel + t.segment_len - 1) / t.segment_len;
  for (int64_t s = 0; s < segments; ++s) {
    if (t.segment_steps[s] < 1) return "segment " + std::to_string(s) + " has step < 1";
  }
  return "";
}

void copy_message(const std::string& msg, char* buf, int64_t len) {
  if (buf && len > 0) std::snprintf(buf, static_cast<size_t>(len), "%s", msg.c_str());
}

// Slices the tensors into tasks of at most kChunk elements, queues them as one job running
// `fn` and returns its handle. `problem` validates each tensor record (empty: valid).
int submit_job(const TensorWork* tensors, int64_t n, const Hyper* hyper, zf::RangeFn fn,
               std::string (*problem)(const TensorWork&), void** handle_out, char* err,
               int64_t err_len) {
  try {
    if (n < 0 || (n > 0 && !tensors) || !hyper || !handle_out) {
      copy_message("invalid arguments", err, err_len);
      return 1;
    }
    std::vector<TensorWork> work(tensors, tensors + n);
    struct Task {
      int64_t tensor, begin, end;
    };
    std::vector<Task> tasks;
    for (int64_t i = 0; i < n; ++i) {
      const std::string reason = problem(work[i]);
      if (!reason.empty()) {
        copy_message("tensor " + std::to_string(i) + ": " + reason, err, err_len);
        return 1;
      }
      for (int64_t b = 0; b < work[i].numel; b += kChunk) {
        tasks.push_back({i, b, std::min(work[i].numel, b + kChunk)});
      }
    }
    bool fail = false;
    for (int left = g_inject_failures.load(); !tasks.empty() && left > 0;) {
      if (g_inject_failures.compare_exchange_weak(left, left - 1)) {
        fail = true;
        break;
      }
    }
    const size_t num_tasks = tasks.size();
    auto job = std::make_shared<zf::Job>(
        num_tasks, [work = std::move(work), tasks = std::move(tasks), h = *hyper, fn,
                    fail](size_t i) {
          if (fail && i == 0) throw std::runtime_error("injected failure (zf_inject_failure)");
          fn(work[tasks[i].tensor], h, tasks[i].begin, tasks[i].end);
        });
    if (num_tasks > 0) g_pool.submit(job);
    *handle_out = new Handle{std::move(job)};
    return 0;
  } catch (const std::exception& e) {
    copy_message(std::string("submission failed: ") + e.what(), err, err_len);
    return 2;
  }
}

std::string check_accumulation(const TensorWork& t) {
  if (t.numel < 0) return "negative numel";
  if (t.numel == 0) return "";
  if (!t.accumulator || !t.grad) return "null accumulator or grad";
  if (!valid_dtype(t.grad_dtype)) return "grad dtype must be fp32, bf16 or fp16";
  return check_grad_rows(t);
}

}  // namespace

ZF_API int zf_abi_version() { return 10; }

ZF_API void zf_record_sizes(int64_t* tensor_work, int64_t* hyper) {
  *tensor_work = sizeof(TensorWork);
  *hyper = sizeof(Hyper);
}

// New settings wait for every queued job (zf::LazyPool::configure).
ZF_API int zf_set_num_threads(int n) {
  if (n < 1) return -1;
  g_pool.configure(n, -1);
  return 0;
}

ZF_API int zf_get_num_threads() { return g_pool.num_threads(); }

// Niceness of the worker threads, 0-19 (Linux; elsewhere accepted and ignored).
ZF_API int zf_set_worker_nice(int nice) {
  if (nice < 0 || nice > 19) return -1;
  g_pool.configure(-1, nice);
  return 0;
}

ZF_API int zf_get_worker_nice() { return g_pool.nice(); }

// The logical CPUs the worker threads are pinned to (Linux; elsewhere accepted and ignored);
// n == 0: none, they run on any CPU the process may use.
ZF_API int zf_set_worker_cpus(const int* cpus, int n) {
  if (n < 0 || (n > 0 && !cpus)) return -1;
  std::vector<int> pinned(cpus, cpus + n);
  for (int cpu : pinned) {
    if (cpu < 0) return -1;
  }
  std::sort(pinned.begin(), pinned.end());
  pinned.erase(std::unique(pinned.begin(), pinned.end()), pinned.end());
  g_pool.pin(std::move(pinned));
  return 0;
}

// Writes up to `capacity` of the pinned CPUs (ascending) into `out`; returns how many there are.
ZF_API int zf_get_worker_cpus(int* out, int capacity) {
  const std::vector<int> cpus = g_pool.cpus();
  for (int i = 0; i < capacity && i < static_cast<int>(cpus.size()); ++i) out[i] = cpus[i];
  return static_cast<int>(cpus.size());
}

ZF_API int zf_isa() { return effective_isa(); }

// isa: 0 picks the best this CPU supports. Returns -1 if the CPU lacks it. Jobs already
// submitted keep the variant they were submitted with.
ZF_API int zf_set_isa(int isa) {
  if (isa != zf::kAuto && !zf::isa_supported(static_cast<zf::Isa>(isa))) return -1;
  g_isa.store(isa);
  return 0;
}

// Test hook: each of the next `jobs` submitted jobs with at least one element throws from a
// worker thread instead of running its first task (the job's other tasks are then skipped).
ZF_API void zf_inject_failure(int jobs) { g_inject_failures.store(std::max(jobs, 0)); }

// Queues one multi-tensor AdamW update and returns at once. 0: *handle_out is a job handle to
// wait on and release. Otherwise the arguments are invalid, nothing was queued and err holds
// the reason.
ZF_API int zf_submit(const TensorWork* tensors, int64_t n, const Hyper* hyper, void** handle_out,
                     char* err, int64_t err_len) {
  return submit_job(tensors, n, hyper, zf::range_fn(effective_isa()), check_tensor, handle_out,
                    err, err_len);
}

// Queues accumulator += hyper->grad_scale * grad for each record (accumulator, grad, grad_dtype,
// numel), behind the jobs already queued; returns as zf_submit does.
ZF_API int zf_submit_accumulate(const TensorWork* tensors, int64_t n, const Hyper* hyper,
                                void** handle_out, char* err, int64_t err_len) {
  return submit_job(tensors, n, hyper, zf::accumulate_fn(effective_isa()), check_accumulation,
                    handle_out, err, err_len);
}

// 1 once the job has finished (successfully or not), 0 if timeout_ms (< 0: no limit) passed.
ZF_API int zf_job_wait(void* handle, int64_t timeout_ms) {
  return static_cast<Handle*>(handle)->job->wait(static_cast<long>(timeout_ms)) ? 1 : 0;
}

ZF_API int zf_job_done(void* handle) { return static_cast<Handle*>(handle)->job->done() ? 1 : 0; }

// Seconds the job ran, from its first task's start to its last task's end (0 until done).
ZF_API double zf_job_seconds(void* handle) { return static_cast<Handle*>(handle)->job->seconds(); }

// Copies the failure message of a finished job into buf; returns its length (0: no failure).
ZF_API int64_t zf_job_error(void* handle, char* buf, int64_t len) {
  const std::string msg = static_cast<Handle*>(handle)->job->error();
  copy_message(msg, buf, len);
  return static_cast<int64_t>(msg.size());
}

// The caller must not release a job that is still running: its tensors must outlive it anyway.
ZF_API void zf_job_release(void* handle) { delete static_cast<Handle*>(handle); }
