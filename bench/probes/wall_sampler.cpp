// A probe, not part of the build: a sampling profiler loaded with LD_PRELOAD. PROF_OUT=FILE
// turns it on (FILE.<pid> written at exit: the process's maps, then one line per sample of
// return addresses); every PROF_US microseconds (500) of process CPU time (SIGPROF), or with
// PROF_WALL=1 of wall time on every thread the program starts (blocked threads are sampled
// too). Symbolize on the build machine with addr2line against the same binary built with -g.
//   g++ -O2 -fPIC -shared -o libsampler.so bench/probes/wall_sampler.cpp -lpthread -ldl -lrt
//   PROF_WALL=1 PROF_OUT=/tmp/p LD_PRELOAD=$PWD/libsampler.so ./batched_threads 16 26 so 3
// Results: bench/RESULTS.md, "batched".
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {
constexpr int kDepth = 24;
constexpr size_t kMax = 2'000'000;
struct Sample {
  int n;
  void* pc[kDepth];
};
Sample* samples = nullptr;
std::atomic<size_t> count{0};
std::atomic<bool> on{false};
const char* out_path = nullptr;
timespec wall0;

void handler(int, siginfo_t*, void*) {
  if (!on.load(std::memory_order_relaxed)) return;
  int saved = errno;
  size_t i = count.fetch_add(1, std::memory_order_relaxed);
  if (i < kMax) samples[i].n = backtrace(samples[i].pc, kDepth);
  errno = saved;
}

bool wall_mode = false;
long period_us = 500;
void start_thread_timer() {
  sigevent ev{};
  ev.sigev_notify = SIGEV_THREAD_ID;
  ev.sigev_signo = SIGPROF;
  ev._sigev_un._tid = static_cast<pid_t>(syscall(SYS_gettid));
  timer_t t;
  if (timer_create(CLOCK_MONOTONIC, &ev, &t) != 0) return;
  itimerspec its{};
  its.it_interval.tv_nsec = period_us * 1000;
  its.it_value.tv_nsec = period_us * 1000;
  timer_settime(t, 0, &its, nullptr);
}
struct Start {
  void* (*fn)(void*);
  void* arg;
};
void* trampoline(void* p) {
  Start s = *static_cast<Start*>(p);
  delete static_cast<Start*>(p);
  start_thread_timer();
  return s.fn(s.arg);
}
}  // namespace
extern "C" int pthread_create(pthread_t* th, const pthread_attr_t* attr, void* (*fn)(void*),
                              void* arg) {
  using Real = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
  static Real real = reinterpret_cast<Real>(dlsym(RTLD_NEXT, "pthread_create"));
  if (!wall_mode) return real(th, attr, fn, arg);
  return real(th, attr, trampoline, new Start{fn, arg});
}
namespace {
void dump() {
  if (out_path == nullptr) return;
  on.store(false);
  itimerval zero{};
  setitimer(ITIMER_PROF, &zero, nullptr);
  timespec wall1;
  clock_gettime(CLOCK_MONOTONIC, &wall1);
  rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  std::string path = std::string(out_path) + "." + std::to_string(getpid());
  FILE* f = fopen(path.c_str(), "w");
  if (!f) return;
  size_t n = count.load();
  if (n > kMax) n = kMax;
  fprintf(f, "# wall %.3f user %.3f sys %.3f samples %zu\n",
          (wall1.tv_sec - wall0.tv_sec) + (wall1.tv_nsec - wall0.tv_nsec) * 1e-9,
          ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6,
          ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6, n);
  FILE* m = fopen("/proc/self/maps", "r");
  char line[4096];
  while (m && fgets(line, sizeof line, m)) fprintf(f, "M %s", line);
  if (m) fclose(m);
  for (size_t i = 0; i < n; ++i) {
    fputc('S', f);
    for (int k = 0; k < samples[i].n; ++k) fprintf(f, " %lx", (unsigned long)samples[i].pc[k]);
    fputc('\n', f);
  }
  fclose(f);
}

__attribute__((constructor)) void start() {
  out_path = getenv("PROF_OUT");
  if (out_path == nullptr) return;
  samples = static_cast<Sample*>(calloc(kMax, sizeof(Sample)));
  void* warm[4];
  backtrace(warm, 4);  // loads libgcc_s before any signal
  struct sigaction sa {};
  sa.sa_sigaction = handler;
  sa.sa_flags = SA_SIGINFO | SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGPROF, &sa, nullptr);
  const char* us = getenv("PROF_US");
  long period = us ? atol(us) : 500;
  period_us = period;
  wall_mode = getenv("PROF_WALL") != nullptr;
  itimerval t{};
  t.it_interval.tv_usec = period;
  t.it_value.tv_usec = period;
  clock_gettime(CLOCK_MONOTONIC, &wall0);
  on.store(true);
  if (wall_mode)
    start_thread_timer();
  else
    setitimer(ITIMER_PROF, &t, nullptr);
  atexit(dump);
}
}  // namespace
