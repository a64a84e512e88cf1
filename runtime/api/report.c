/*
 * runtime/api/report.c - what a runtime tells about itself unasked: its
 * statistics on stderr (DMEM_STATS: at destroy, at exit for the runtimes
 * never destroyed, such as the default ones, and every N seconds) and the
 * DMEM_TRACE file (written at each destroy and at exit).
 */
#include "api/api.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static double mib(uint64_t b) { return (double)b / (1024.0 * 1024.0); }

void dmem__report_print(dmem_runtime_t *rt, const char *when) {
  dmem_stats_t s;
  if (dmem_stats(rt, &s) != DMEM_OK) return;
  fprintf(stderr,
          "dmem stats (%s backend, %s): limit %zu, used %zu, host %zu, disk %zu, buffers %zu\n"
          "  peaks: device %zu (%.1f MiB), host %zu, disk %zu, raw %zu\n"
          "  spills %llu (%llu bytes, %.3f s), unspills %llu (%llu bytes, %.3f s), "
          "push-downs to disk %llu, on-demand evictions %llu, cancelled %llu\n",
          rt->be->name, when, s.device_limit, s.device_used, s.host_used, s.disk_used,
          s.buffer_count, s.device_used_peak, mib(s.device_used_peak), s.host_used_peak,
          s.disk_used_peak, s.raw_used_peak, (unsigned long long)s.spill_count,
          (unsigned long long)s.bytes_spilled, s.seconds_spilling,
          (unsigned long long)s.unspill_count, (unsigned long long)s.bytes_unspilled,
          s.seconds_unspilling, (unsigned long long)s.host_to_disk_pushdowns,
          (unsigned long long)s.oom_evictions, (unsigned long long)s.cancelled_spills);
  fprintf(stderr,
          "  spill-ahead %llu buffers (%llu bytes, %llu passes, %llu wakeups, %llu polls, "
          "armed %llu times), "
          "prefetched %llu (%llu bytes), "
          "waits for room %llu (%.3f s); pinned pool %zu bytes (%llu grows, %llu in the "
          "background, %llu trims; %llu pageable blocks while it grew)\n",
          (unsigned long long)s.ahead_evictions, (unsigned long long)s.ahead_bytes,
          (unsigned long long)s.ahead_passes, (unsigned long long)s.ahead_wakeups,
          (unsigned long long)s.ahead_polls, (unsigned long long)s.ahead_arms,
          (unsigned long long)s.prefetch_count,
          (unsigned long long)s.prefetch_bytes, (unsigned long long)s.room_waits,
          s.seconds_waiting_for_room, s.host_pool_reserved, (unsigned long long)s.host_pool_grows,
          (unsigned long long)s.host_pool_background_grows, (unsigned long long)s.host_pool_trims,
          (unsigned long long)s.host_pageable_allocs);
}

/* ---- at exit: every live runtime with print_stats ----------------------------- */

static void print_at_exit(dmem_runtime_t *rt, void *arg) {
  (void)arg;
  if (rt->cfg.print_stats && dmem_atomic_load_relaxed(&rt->fatal) != DMEM__FORKED)
    dmem__report_print(rt, "at exit");
}

static void report_at_exit(void) { dmem__fork_each(print_at_exit, NULL); }

static pthread_once_t exit_once = PTHREAD_ONCE_INIT;
static void exit_register(void) { atexit(report_at_exit); }

/* ---- every N seconds ------------------------------------------------------------ */

static void *report_main(void *arg) {
  dmem_runtime_t *rt = arg;
  unsigned n = rt->cfg.stats_interval_s;
  char when[48];
  snprintf(when, sizeof when, "every %u s", n);
  pthread_mutex_lock(&rt->report_mu);
  for (;;) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += (time_t)n;
    while (!rt->report_stop) {
      int e = pthread_cond_timedwait(&rt->report_cv, &rt->report_mu, &ts);
      if (e == ETIMEDOUT) break;
    }
    if (rt->report_stop) break;
    pthread_mutex_unlock(&rt->report_mu);
    dmem__report_print(rt, when);
    pthread_mutex_lock(&rt->report_mu);
  }
  pthread_mutex_unlock(&rt->report_mu);
  return NULL;
}

dmem_status_t dmem__report_start(dmem_runtime_t *rt) {
  pthread_mutex_init(&rt->report_mu, NULL);
  pthread_cond_init(&rt->report_cv, NULL);
  const char *trace = getenv("DMEM_TRACE");
  if (trace && *trace && !DMEM__TRACE_ON() && dmem__trace_start(trace) != 0)
    DMEM_RT_LOG(rt, DMEM_LOG_WARN, "DMEM_TRACE=%s: out of memory, no trace", trace);
  if (rt->cfg.print_stats) pthread_once(&exit_once, exit_register);
  if (rt->cfg.print_stats && rt->cfg.stats_interval_s) {
    int e = pthread_create(&rt->report_thread, NULL, report_main, rt);
    if (e != 0) {
      pthread_cond_destroy(&rt->report_cv);
      pthread_mutex_destroy(&rt->report_mu);
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY,
                         "DMEM_STATS: the statistics thread did not start: %s", strerror(e));
    }
    rt->report_started = true;
  }
  return DMEM_OK;
}

void dmem__report_stop(dmem_runtime_t *rt) {
  if (rt->report_started) {
    pthread_mutex_lock(&rt->report_mu);
    rt->report_stop = true;
    pthread_cond_signal(&rt->report_cv);
    pthread_mutex_unlock(&rt->report_mu);
    pthread_join(rt->report_thread, NULL);
    rt->report_started = false;
  }
  pthread_cond_destroy(&rt->report_cv);
  pthread_mutex_destroy(&rt->report_mu);
}
