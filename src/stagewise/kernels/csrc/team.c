/* The kernel team of a stage: its threads stay awake (spinning) through a step, so handing a
   kernel's tasks to them costs a cache line, not a thread's wake-up.

   A job is a parallel for over tasks, claimed one at a time from a shared counter by the caller
   and by every worker that sees the job; the caller returns when every task has run. A worker
   the OS has descheduled therefore delays a job by at most the one task it claimed, and a job
   needs no worker at all (the caller runs whatever is left). After its last job a worker spins
   for SPIN_NS (yielding its CPU to any other runnable thread as it goes), then sleeps on a futex
   until the next job: a step keeps the team awake, an idle engine costs nothing.

   gen: odd while a job runs (its fields are set), even between jobs. A worker joins a job by
   raising `active` and checking gen again; the caller ends a job by making gen even and waiting
   for active to fall to zero, so no worker touches a job's fields after its caller returned. */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "team.h"

#define MAX_WORKERS 255
#define SPIN_NS 2000000LL         /* a worker spins this long after its last job before it sleeps */

static atomic_uint gen;           /* odd: a job runs */
static atomic_int active;         /* workers inside the current job */
static atomic_int sleepers;       /* workers asleep on gen */
static atomic_llong next_task, done_tasks;
static sw_task_fn job_fn;
static void* job_ctx;
static int64_t job_total;
static int job_want;              /* threads the job may use (the caller is number 0) */
static int team_size;             /* caller + workers; 0: no team */
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void run_tasks(void) {
    int64_t t;
    while ((t = atomic_fetch_add(&next_task, 1)) < job_total) {
        job_fn(job_ctx, t, t + 1);
        atomic_fetch_add(&done_tasks, 1);
    }
}

static void* worker_main(void* arg) {
    int id = (int)(intptr_t)arg;
    unsigned seen = 0;
    long long spin_until = now_ns() + SPIN_NS;
    for (unsigned i = 0;; i++) {
        unsigned g = atomic_load(&gen);
        if ((g & 1) && g != seen) {
            seen = g;
            atomic_fetch_add(&active, 1);
            if (atomic_load(&gen) == g && id < job_want) run_tasks();
            atomic_fetch_sub(&active, 1);
            spin_until = now_ns() + SPIN_NS;
            continue;
        }
        relax();
        if (i % 64)
            continue;
        if (now_ns() < spin_until) {
            sched_yield();          /* any runnable thread on this CPU goes first */
            continue;
        }
        atomic_fetch_add(&sleepers, 1);
        if (atomic_load(&gen) == g)
            syscall(SYS_futex, &gen, FUTEX_WAIT_PRIVATE, g, NULL, NULL, 0);
        atomic_fetch_sub(&sleepers, 1);
        spin_until = now_ns() + SPIN_NS;
    }
    return NULL;
}

/* Start the team: `threads` in all (the caller counts as one), workers allowed on `cpus` (n of
   them; n = 0: anywhere). Once per process; returns the team's size (a later call returns the
   first size), or -1 if a thread could not be created. */
int sw_team_start(int threads, const int* cpus, int n) {
    pthread_mutex_lock(&start_lock);
    int size = team_size;
    if (size == 0 && threads > 1) {
        cpu_set_t set;
        CPU_ZERO(&set);
        for (int i = 0; i < n; i++) CPU_SET(cpus[i], &set);
        size = 1;
        for (int w = 1; w < threads && w <= MAX_WORKERS; w++) {
            pthread_t t;
            pthread_attr_t attr;
            pthread_attr_init(&attr);
            pthread_attr_setstacksize(&attr, 8 << 20);     /* the kernels' tiles live on the stack */
            if (n > 0) pthread_attr_setaffinity_np(&attr, sizeof set, &set);
            int rc = pthread_create(&t, &attr, worker_main, (void*)(intptr_t)w);
            pthread_attr_destroy(&attr);
            if (rc != 0) { size = -1; break; }
            pthread_detach(t);
            size++;
        }
        team_size = size > 0 ? size : 0;
    }
    pthread_mutex_unlock(&start_lock);
    return size;
}

int sw_team_size(void) { return team_size; }

/* A job whose caller waited LATE_NS longer for a worker than it spent on its own tasks found a
   worker descheduled (another process wants the CPU): the team's jobs then run on their callers
   alone for a backoff, SOLO_NS at first, doubling while it keeps happening (up to SOLO_MAX_NS),
   so a busy machine costs a step no more than one thread would. */
#define LATE_NS 200000LL
#define SOLO_NS 20000000LL
#define SOLO_MAX_NS 1000000000LL
static long long solo_until, solo_ns = SOLO_NS;
static atomic_llong late_jobs;

/* sw_team_for_fn (team.h). Jobs come from one thread at a time (a stage runs one step at a time);
   a job asked for while one runs (another thread's kernel) runs on its caller alone. */
static atomic_flag busy = ATOMIC_FLAG_INIT;

int sw_team_for(sw_task_fn fn, void* ctx, int64_t total, int want) {
    if (team_size < 2)
        return -1;
    if (atomic_flag_test_and_set(&busy)) {
        fn(ctx, 0, total);
        return 0;
    }
    long long t0 = now_ns();
    if (t0 < solo_until) {
        atomic_flag_clear(&busy);
        fn(ctx, 0, total);
        return 0;
    }
    job_fn = fn, job_ctx = ctx, job_total = total;
    job_want = want < team_size ? want : team_size;
    atomic_store(&next_task, 0);
    atomic_store(&done_tasks, 0);
    atomic_fetch_add(&gen, 1);                          /* odd: the job is on */
    if (atomic_load(&sleepers) > 0)
        syscall(SYS_futex, &gen, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_tasks();
    long long t1 = now_ns();
    for (unsigned i = 1; atomic_load(&done_tasks) < total; i++)     /* a worker's claimed task */
        i % 64 ? relax() : (void)sched_yield();
    atomic_fetch_add(&gen, 1);                          /* even: no worker may join now */
    for (unsigned i = 1; atomic_load(&active) > 0; i++)
        i % 64 ? relax() : (void)sched_yield();
    long long t2 = now_ns();
    if (t2 - t1 > LATE_NS + (t1 - t0)) {
        atomic_fetch_add(&late_jobs, 1);
        solo_until = t2 + solo_ns;
        solo_ns = solo_ns * 2 < SOLO_MAX_NS ? solo_ns * 2 : SOLO_MAX_NS;
    } else {
        solo_ns = SOLO_NS;
    }
    atomic_flag_clear(&busy);
    return 0;
}

/* jobs that found a worker descheduled so far (each began a backoff) */
long long sw_team_late_jobs(void) { return atomic_load(&late_jobs); }
