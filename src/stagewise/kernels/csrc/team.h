/* The stage's kernel team (team.c): the kernels of every library split their work over it through
   one function pointer, handed to each library at load (`<lib>_set_team`), so one team serves
   them all. Where no team was handed over (a test's narrower build, no stage yet) the kernels
   split their work over OpenMP as before. */
#ifndef STAGEWISE_TEAM_H
#define STAGEWISE_TEAM_H
#include <omp.h>
#include <stdint.h>

/* run tasks t0 .. t1 - 1 of a job */
typedef void (*sw_task_fn)(void* ctx, int64_t t0, int64_t t1);
/* tasks 0 .. total - 1 of `fn` on at most `want` threads of the team (the caller is one of them);
   0 when done, -1 when there is no team (the caller runs them some other way) */
typedef int (*sw_team_for_fn)(sw_task_fn fn, void* ctx, int64_t total, int want);

/* A library's copy of the pointer, and its parallel for: the team, else OpenMP (at most `want`
   threads, and no more than the caller's OpenMP setting), else the caller alone. Each task is one unit of work whose results do not depend on
   which thread ran it. */
#define SW_TEAM_CLIENT(PREFIX)                                                                    \
static sw_team_for_fn team_for_;                                                                  \
void PREFIX##_set_team(void* f) { team_for_ = (sw_team_for_fn)f; }                                \
static void parallel_for(sw_task_fn fn, void* ctx, int64_t total, int want) {                     \
    if (total <= 0) return;                                                                       \
    if (want > total) want = (int)total;                                                          \
    if (want <= 1) { fn(ctx, 0, total); return; }                                                 \
    if (team_for_ && team_for_(fn, ctx, total, want) == 0) return;                                \
    if (want > omp_get_max_threads()) want = omp_get_max_threads();                               \
    if (want <= 1) { fn(ctx, 0, total); return; }                                                 \
    _Pragma("omp parallel for schedule(dynamic, 1) num_threads(want)")                           \
    for (int64_t t = 0; t < total; t++) fn(ctx, t, t + 1);                                        \
}

#endif
