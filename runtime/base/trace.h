/*
 * runtime/base/trace.h - the DMEM_TRACE recorder (internal): a Chrome /
 * Perfetto trace (JSON trace event format) of spills, unspills, push-downs,
 * eviction passes, allocations that waited for room and locks that waited,
 * one track per tier and per stream.
 *
 * Process-wide: the first runtime created while DMEM_TRACE names a file
 * starts it (dmem__trace_start); every runtime of the process records into
 * it. The file is (re)written whole by dmem__trace_write at each runtime's
 * destroy and at exit, so it always holds every event so far. Off (the
 * default), a recording site costs one relaxed load (DMEM__TRACE_ON).
 */
#ifndef DMEM_TRACE_H
#define DMEM_TRACE_H

#include <stddef.h>
#include <stdint.h>

#include "base/atomic.h"

/* 1 while recording. Written once by dmem__trace_start (relaxed: a site that
 * misses the first events of a run loses nothing but those events). */
extern _Atomic int dmem__trace_on;
#define DMEM__TRACE_ON() (dmem_atomic_load_relaxed(&dmem__trace_on) != 0)

/* Tracks: one per tier (dmem_tier_t: device 0, host 1, disk 2, controller 3)
 * and one per stream. */
#define DMEM__TRACK_TIER 0
#define DMEM__TRACK_STREAM 1

/* Start recording into `path` (copied) if not started yet; registers the
 * exit writer. Returns 0, or -1 when out of memory (nothing recorded then). */
int dmem__trace_start(const char *path);

/* Record a complete event ("ph":"X") of `name` (a string literal) on the
 * track of `kind` and `id` (a tier, or a stream pointer; NULL is the default
 * stream), starting at t0_ns (CLOCK_MONOTONIC, as dmem__now_ns) and lasting
 * dur_ns, with args bytes, count (buffers, 0: left out) and handle (0: left
 * out). Thread-safe; drops the event (counted in the file's metadata) past
 * a million events. Call only when DMEM__TRACE_ON(). */
void dmem__trace_event(int kind, uintptr_t id, const char *name, uint64_t t0_ns, uint64_t dur_ns,
                       uint64_t bytes, uint64_t count, uint64_t handle);

/* Write every event so far to the file (replacing it). Thread-safe; a no-op
 * when not recording. Returns 0, or the errno of the failed write (logged
 * at warn). */
int dmem__trace_write(void);

#endif /* DMEM_TRACE_H */
