// A persistent pool of std::threads running jobs one after another, in submission order. A job
// is a number of independent tasks; any worker may run any task, so a job's result must not
// depend on which thread runs which task (the AdamW tasks are disjoint element ranges).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace zf {

class Job {
 public:
  Job(size_t num_tasks, std::function<void(size_t)> task);

  size_t num_tasks() const { return num_tasks_; }
  // Runs one task; an exception is recorded (the first message wins) and the remaining tasks
  // are skipped, so a failed job finishes quickly and reports at wait(). True if this was the
  // job's last unfinished task.
  bool run_task(size_t i);
  // Waits up to timeout_ms (forever if negative); true once every task has finished.
  bool wait(long timeout_ms);
  bool done();
  std::string error();  // empty unless a task failed; valid once done
  // From the start of its first task to the end of its last (0 until done): the time the job
  // ran, not the time it waited in the queue.
  double seconds();

 private:
  friend class ThreadPool;
  const size_t num_tasks_;
  const std::function<void(size_t)> task_;
  size_t next_ = 0;  // next task to hand out, guarded by the pool's mutex
  std::mutex mu_;
  std::condition_variable cv_;
  size_t finished_ = 0;
  bool failed_ = false;
  std::string error_;
  bool started_ = false;
  std::chrono::steady_clock::time_point began_;
  double seconds_ = 0.0;
};

class ThreadPool {
 public:
  // nice > 0 lowers the workers' scheduling priority (Linux niceness), so that work running
  // beside a busy training thread yields the cores to it. cpus (Linux; empty: any the process
  // may use) are the logical CPUs every worker is pinned to.
  ThreadPool(int num_threads, int nice, std::vector<int> cpus);
  ~ThreadPool();  // finishes every queued job, then joins the workers
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  void submit(std::shared_ptr<Job> job);  // a job with no tasks must not be submitted
  int num_threads() const { return static_cast<int>(threads_.size()); }

 private:
  void worker(int nice, const std::vector<int>& cpus);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  bool stop_ = false;
  int started_ = 0;  // workers past their set-up
  std::vector<std::thread> threads_;
};

// A ThreadPool started on first use, with the size, niceness and CPUs its owner sets. A forked
// child of a process that used one starts its own: the parent's worker threads do not exist
// there, so the parent's pool object is leaked rather than joined. Never destroyed at exit
// either, for the same reason (exit may come from a child, or while a job still runs).
class LazyPool {
 public:
  LazyPool(int num_threads, int nice);
  LazyPool(const LazyPool&) = delete;
  LazyPool& operator=(const LazyPool&) = delete;

  void submit(std::shared_ptr<Job> job);  // starts the pool if there is none
  // New settings (a negative value keeps one): waits for every queued job, and the next
  // submission starts a new pool; settings equal to the current ones change nothing.
  void configure(int num_threads, int nice);
  void pin(std::vector<int> cpus);  // the same, for the CPUs the workers are pinned to
  int num_threads();
  int nice();
  std::vector<int> cpus();

 private:
  static void before_fork();
  static void after_fork_in_parent();
  static void after_fork_in_child();
  void restart_with(int num_threads, int nice, std::vector<int> cpus);  // holding mu_

  std::mutex mu_;
  ThreadPool* pool_ = nullptr;
  int num_threads_;
  int nice_;
  std::vector<int> cpus_;
};

}  // namespace zf
