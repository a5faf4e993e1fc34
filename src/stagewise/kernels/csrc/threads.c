/* A stage's CPU threads at run time: OpenMP's team pinned to the stage's CPUs, and those CPUs
   kept awake while a step runs.

   Idle OpenMP threads wait passively (they sleep on a futex, so a busy neighbour loses nothing),
   but waking a thread whose CPU has halted costs tens of microseconds on a VM, paid by every
   parallel region of a step. A keeper is one thread per CPU at SCHED_IDLE priority that spins
   only while a step runs: the CPU never halts within a step, and any other thread that wants the
   CPU (ours or a neighbour's) preempts the keeper at once. Between steps the keepers sleep. */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define MAX_KEEPERS 1024

static atomic_int awake;          /* 1 while a step runs */
static atomic_int generation;     /* +1 at every step start; sleeping keepers wait on it */
static atomic_llong deadline_ns;  /* a keeper stops spinning here even if the step never ended */
static atomic_int started;        /* keepers running at SCHED_IDLE */
static pthread_t keepers[MAX_KEEPERS];
static int num_keepers;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static int pin_self(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    return pthread_setaffinity_np(pthread_self(), sizeof set, &set);
}

static void *keeper_main(void *arg) {
    (void)arg;
    struct sched_param idle = {0};
    pthread_setschedparam(pthread_self(), SCHED_IDLE, &idle);
    atomic_fetch_add(&started, 1);
    int expired = -1;     /* the generation whose deadline passed: sleep until the next one */
    for (;;) {
        int gen = atomic_load(&generation);
        if (!atomic_load(&awake) || gen == expired) {
            syscall(SYS_futex, &generation, FUTEX_WAIT_PRIVATE, gen, NULL, NULL, 0);
            continue;
        }
        for (int i = 0; i < 1024 && atomic_load_explicit(&awake, memory_order_relaxed); i++)
            relax();
        if (now_ns() > atomic_load_explicit(&deadline_ns, memory_order_relaxed))
            expired = gen;
    }
    return NULL;
}

/* Start one keeper on each of `cpus` (once per process; later calls return the count running).
   Returns the number of keepers, or -1 if a thread could not be created. */
int sw_keepers_start(const int *cpus, int n) {
    if (num_keepers > 0)
        return num_keepers;
    for (int i = 0; i < n && i < MAX_KEEPERS; i++) {
        pthread_attr_t attr;      /* born on its CPU */
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[i], &set);
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 64 * 1024);
        pthread_attr_setaffinity_np(&attr, sizeof set, &set);
        int rc = pthread_create(&keepers[num_keepers], &attr, keeper_main, NULL);
        pthread_attr_destroy(&attr);
        if (rc != 0)
            return -1;
        pthread_detach(keepers[num_keepers]);
        num_keepers++;
    }
    while (atomic_load(&started) < num_keepers)   /* every keeper at SCHED_IDLE before we return */
        sched_yield();
    return num_keepers;
}

/* A step starts (`on`, spinning at most `max_ns`) or ends. */
void sw_keepers_awake(int on, long long max_ns) {
    if (!on) {
        atomic_store(&awake, 0);
        return;
    }
    atomic_store(&deadline_ns, now_ns() + max_ns);
    atomic_store(&awake, 1);
    atomic_fetch_add(&generation, 1);
    if (num_keepers > 0)
        syscall(SYS_futex, &generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

/* Pin the calling thread's OpenMP team: thread i to cpus[i % n] (thread 0 is the caller).
   Returns the team size, or minus the number of threads that could not be pinned. */
int sw_pin_team(const int *cpus, int n) {
    int failed = 0, team = 1;
    #pragma omp parallel reduction(+ : failed)
    {
        if (pin_self(cpus[omp_get_thread_num() % n]) != 0)
            failed++;
        #pragma omp single
        team = omp_get_num_threads();
    }
    return failed ? -failed : team;
}
