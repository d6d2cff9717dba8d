#include "thread_pool.h"

#include <pthread.h>

#ifdef __linux__
#include <sched.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <chrono>
#include <exception>
#include <utility>
#include <vector>

namespace zf {

Job::Job(size_t num_tasks, std::function<void(size_t)> task)
    : num_tasks_(num_tasks), task_(std::move(task)) {}

bool Job::run_task(size_t i) {
  bool skip;
  {
    std::lock_guard<std::mutex> lock(mu_);
    skip = failed_;
    if (!started_) {
      started_ = true;
      began_ = std::chrono::steady_clock::now();
    }
  }
  std::string error;
  if (!skip) {
    try {
      task_(i);
    } catch (const std::exception& e) {
      error = e.what();
      if (error.empty()) error = "unknown C++ exception";
    } catch (...) {
      error = "unknown C++ exception";
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (!error.empty() && !failed_) {
    failed_ = true;
    error_ = std::move(error);
  }
  if (++finished_ != num_tasks_) return false;
  seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - began_).count();
  cv_.notify_all();
  return true;
}

bool Job::wait(long timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  auto all_done = [this] { return finished_ == num_tasks_; };
  if (timeout_ms < 0) {
    cv_.wait(lock, all_done);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), all_done);
}

bool Job::done() {
  std::lock_guard<std::mutex> lock(mu_);
  return finished_ == num_tasks_;
}

double Job::seconds() {
  std::lock_guard<std::mutex> lock(mu_);
  return seconds_;
}

std::string Job::error() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

ThreadPool::ThreadPool(int num_threads, int nice, std::vector<int> cpus) {
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this, nice, cpus] { worker(nice, cpus); });
  }
  // Return once every worker has set itself up, so that the pool's settings hold for all of
  // them from the first job on.
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this, num_threads] { return started_ == num_threads; });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::submit(std::shared_ptr<Job> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(job));
  }
  cv_.notify_all();
}

void ThreadPool::worker(int nice, const std::vector<int>& cpus) {
#ifdef __linux__
  // Named for whoever looks at the process's threads (top -H, py-spy, /proc/PID/task).
  pthread_setname_np(pthread_self(), "zenflow-adamw");
  // Per thread on Linux; raising niceness needs no privilege. Failure only costs priority.
  if (nice > 0) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), nice);
  if (!cpus.empty()) {
    // Only CPUs the thread may already run on (it inherits the mask of the thread that started
    // the pool): the kernel would take others, outside a mask the process was given. None of
    // them: the worker stays where it may run.
    cpu_set_t allowed, set;
    CPU_ZERO(&set);
    if (pthread_getaffinity_np(pthread_self(), sizeof(allowed), &allowed) == 0) {
      for (int cpu : cpus) {
        if (cpu < CPU_SETSIZE && CPU_ISSET(cpu, &allowed)) CPU_SET(cpu, &set);
      }
    }
    if (CPU_COUNT(&set) > 0) pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
  }
#else
  (void)cpus;
#endif
  std::unique_lock<std::mutex> lock(mu_);
  ++started_;
  cv_.notify_all();
  for (;;) {
    // A job starts once the one before it has finished, not merely been handed out: jobs
    // that update the same tensors then apply in submission order.
    cv_.wait(lock, [this] {
      return queue_.empty() ? stop_ : queue_.front()->next_ < queue_.front()->num_tasks_;
    });
    if (queue_.empty()) return;  // stopping, and nothing left to run
    std::shared_ptr<Job> job = queue_.front();
    const size_t task = job->next_++;
    lock.unlock();
    const bool finished = job->run_task(task);
    lock.lock();
    if (finished) {
      queue_.pop_front();
      cv_.notify_all();
    }
  }
}

namespace {

// Every LazyPool of the process (they are globals of the library), for the fork handlers.
std::vector<LazyPool*>& lazy_pools() {
  static std::vector<LazyPool*> pools;
  return pools;
}

}  // namespace

LazyPool::LazyPool(int num_threads, int nice) : num_threads_(num_threads), nice_(nice) {
  static const int registered = pthread_atfork(before_fork, after_fork_in_parent,
                                               after_fork_in_child);
  (void)registered;
  lazy_pools().push_back(this);
}

// A fork while another thread holds a pool's mutex would leave it locked forever in the child:
// the handlers take every pool's mutex across the fork.
void LazyPool::before_fork() {
  for (LazyPool* p : lazy_pools()) p->mu_.lock();
}

void LazyPool::after_fork_in_parent() {
  for (LazyPool* p : lazy_pools()) p->mu_.unlock();
}

void LazyPool::after_fork_in_child() {
  for (LazyPool* p : lazy_pools()) {
    p->pool_ = nullptr;
    p->mu_.unlock();
  }
}

void LazyPool::submit(std::shared_ptr<Job> job) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!pool_) pool_ = new ThreadPool(num_threads_, nice_, cpus_);
  pool_->submit(std::move(job));
}

void LazyPool::configure(int num_threads, int nice) {
  std::lock_guard<std::mutex> lock(mu_);
  restart_with(num_threads < 0 ? num_threads_ : num_threads, nice < 0 ? nice_ : nice, cpus_);
}

void LazyPool::pin(std::vector<int> cpus) {
  std::lock_guard<std::mutex> lock(mu_);
  restart_with(num_threads_, nice_, std::move(cpus));
}

void LazyPool::restart_with(int num_threads, int nice, std::vector<int> cpus) {
  if (num_threads == num_threads_ && nice == nice_ && cpus == cpus_) return;
  delete pool_;
  pool_ = nullptr;
  num_threads_ = num_threads;
  nice_ = nice;
  cpus_ = std::move(cpus);
}

int LazyPool::num_threads() {
  std::lock_guard<std::mutex> lock(mu_);
  return num_threads_;
}

int LazyPool::nice() {
  std::lock_guard<std::mutex> lock(mu_);
  return nice_;
}

std::vector<int> LazyPool::cpus() {
  std::lock_guard<std::mutex> lock(mu_);
  return cpus_;
}

}  // namespace zf
