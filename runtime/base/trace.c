/*
 * runtime/base/trace.c - the DMEM_TRACE recorder: events in memory under one
 * mutex (taken only while recording), written as JSON trace events
 * (https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU)
 * that chrome://tracing and ui.perfetto.dev open.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "trace.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <pthread.h>

#include "error.h"

_Atomic int dmem__trace_on;

typedef struct trace_ev {
  const char *name;
  uint64_t t0, dur, bytes, count, handle;
  uint32_t track; /* 0..3 tiers, 16.. streams */
} trace_ev_t;

#define TRACE_MAX_EVENTS ((size_t)1 << 20)
#define TRACE_MAX_STREAMS 256
#define TRACK_STREAM0 16

/* Not ranked: a leaf, taken with any runtime mutex held and nothing taken
 * under it. */
static pthread_mutex_t trace_mu = PTHREAD_MUTEX_INITIALIZER;
static char *trace_path;     /* under trace_mu */
static uint64_t trace_base;  /* CLOCK_MONOTONIC ns at start */
static trace_ev_t *trace_ev; /* under trace_mu */
static size_t trace_n, trace_cap;
static uint64_t trace_dropped;
static uintptr_t trace_streams[TRACE_MAX_STREAMS]; /* stream pointer of track 16 + i */
static size_t trace_nstreams;

static uint64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void trace_at_exit(void) { (void)dmem__trace_write(); }

int dmem__trace_start(const char *path) {
  pthread_mutex_lock(&trace_mu);
  int rc = 0;
  if (!trace_path) {
    trace_path = strdup(path);
    if (!trace_path) rc = -1;
    else {
      trace_base = mono_ns();
      atexit(trace_at_exit);
      dmem_atomic_store_relaxed(&dmem__trace_on, 1);
      DMEM_LOG_AT(DMEM_LOG_INFO, "DMEM_TRACE: recording a trace into %s", trace_path);
    }
  }
  pthread_mutex_unlock(&trace_mu);
  return rc;
}

/* The stream's track (under trace_mu); the last one when there are too many. */
static uint32_t stream_track(uintptr_t s) {
  for (size_t i = 0; i < trace_nstreams; i++)
    if (trace_streams[i] == s) return TRACK_STREAM0 + (uint32_t)i;
  if (trace_nstreams == TRACE_MAX_STREAMS) return TRACK_STREAM0 + TRACE_MAX_STREAMS - 1;
  trace_streams[trace_nstreams] = s;
  return TRACK_STREAM0 + (uint32_t)trace_nstreams++;
}

void dmem__trace_event(int kind, uintptr_t id, const char *name, uint64_t t0_ns, uint64_t dur_ns,
                       uint64_t bytes, uint64_t count, uint64_t handle) {
  pthread_mutex_lock(&trace_mu);
  if (trace_n == trace_cap) {
    size_t cap = trace_cap ? trace_cap * 2 : 1024;
    trace_ev_t *v = cap <= TRACE_MAX_EVENTS ? realloc(trace_ev, cap * sizeof *v) : NULL;
    if (!v) {
      trace_dropped++;
      pthread_mutex_unlock(&trace_mu);
      return;
    }
    trace_ev = v;
    trace_cap = cap;
  }
  trace_ev_t *e = &trace_ev[trace_n++];
  e->name = name;
  e->t0 = t0_ns;
  e->dur = dur_ns;
  e->bytes = bytes;
  e->count = count;
  e->handle = handle;
  e->track = kind == DMEM__TRACK_TIER ? (uint32_t)(id & 3) : stream_track(id);
  pthread_mutex_unlock(&trace_mu);
}

static const char *const tier_track_names[4] = {"tier: device", "tier: host", "tier: disk",
                                                "tier: controller"};

int dmem__trace_write(void) {
  if (!DMEM__TRACE_ON()) return 0;
  pthread_mutex_lock(&trace_mu);
  int err = 0;
  char tmp[4096];
  int n = snprintf(tmp, sizeof tmp, "%s.tmp%ld", trace_path, (long)getpid());
  FILE *f = n > 0 && (size_t)n < sizeof tmp ? fopen(tmp, "w") : NULL;
  if (!f) {
    err = errno ? errno : ENAMETOOLONG;
    goto out;
  }
  long pid = (long)getpid();
  fprintf(f, "{\"displayTimeUnit\":\"ms\",\"otherData\":{\"producer\":\"dmem\","
             "\"dropped_events\":%llu},\"traceEvents\":[\n",
          (unsigned long long)trace_dropped);
  fprintf(f, "{\"ph\":\"M\",\"pid\":%ld,\"tid\":0,\"name\":\"process_name\","
             "\"args\":{\"name\":\"dmem\"}}",
          pid);
  for (int t = 0; t < 4; t++)
    fprintf(f, ",\n{\"ph\":\"M\",\"pid\":%ld,\"tid\":%d,\"name\":\"thread_name\","
               "\"args\":{\"name\":\"%s\"}}",
            pid, t, tier_track_names[t]);
  for (size_t i = 0; i < trace_nstreams; i++) {
    if (trace_streams[i])
      fprintf(f, ",\n{\"ph\":\"M\",\"pid\":%ld,\"tid\":%zu,\"name\":\"thread_name\","
                 "\"args\":{\"name\":\"stream 0x%llx\"}}",
              pid, TRACK_STREAM0 + i, (unsigned long long)trace_streams[i]);
    else
      fprintf(f, ",\n{\"ph\":\"M\",\"pid\":%ld,\"tid\":%zu,\"name\":\"thread_name\","
                 "\"args\":{\"name\":\"stream (default)\"}}",
              pid, TRACK_STREAM0 + i);
  }
  for (size_t i = 0; i < trace_n; i++) {
    const trace_ev_t *e = &trace_ev[i];
    double ts = e->t0 >= trace_base ? (double)(e->t0 - trace_base) / 1e3 : 0.0;
    fprintf(f, ",\n{\"ph\":\"X\",\"pid\":%ld,\"tid\":%u,\"name\":\"%s\",\"cat\":\"dmem\","
               "\"ts\":%.3f,\"dur\":%.3f,\"args\":{\"bytes\":%llu",
            pid, e->track, e->name, ts, (double)e->dur / 1e3, (unsigned long long)e->bytes);
    if (e->count) fprintf(f, ",\"buffers\":%llu", (unsigned long long)e->count);
    if (e->handle) fprintf(f, ",\"handle\":\"0x%016llx\"", (unsigned long long)e->handle);
    fputs("}}", f);
  }
  fputs("\n]}\n", f);
  if (ferror(f)) err = EIO;
  if (fclose(f) != 0 && !err) err = errno;
  if (!err && rename(tmp, trace_path) != 0) err = errno;
  if (err) unlink(tmp);
out:
  if (err)
    DMEM_LOG_AT(DMEM_LOG_WARN, "DMEM_TRACE: cannot write %s: %s", trace_path, strerror(err));
  pthread_mutex_unlock(&trace_mu);
  return err;
}
