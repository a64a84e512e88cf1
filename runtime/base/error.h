/*
 * runtime/base/error.h - recording error details and logging (internal).
 */
#ifndef DMEM_ERROR_H
#define DMEM_ERROR_H

#include "base/atomic.h"
#include "dmem/config.h"
#include "dmem/status.h"

#if defined(__GNUC__)
#define DMEM_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define DMEM_PRINTF(a, b)
#endif

/* Record the detail of a failure on this thread (the code that first detects
 * an error calls this; upper layers pass the status on). Returns `status` so
 * that `return dmem__error(DMEM_ERR_X, "...")` reads naturally. */
dmem_status_t dmem__error(dmem_status_t status, const char *fmt, ...) DMEM_PRINTF(2, 3);

/* Process-wide log level: the most verbose of the live runtimes' (set by
 * runtime/api/fork.c as runtimes come and go or change level; DMEM_LOG_WARN when
 * none is live). Messages about one runtime test that runtime's own level
 * instead (DMEM_RT_LOG in runtime/core/runtime.h); this one gates the messages
 * of code that knows no runtime (the pool, the disk tier's file, error
 * details at debug). Relaxed: a message more or less while a level changes
 * is harmless. */
extern _Atomic int dmem__log_level;
void dmem__log(dmem_log_level_t level, const char *fmt, ...) DMEM_PRINTF(2, 3);

#define DMEM_LOG_AT(level, ...)                                                            \
  do {                                                                                     \
    if ((int)(level) <= dmem_atomic_load_relaxed(&dmem__log_level))                        \
      dmem__log((level), __VA_ARGS__);                                                     \
  } while (0)

/* Names for messages (never numbers): "resident", "spilling", "host",
 * "disk", "controller", "unspilling" for a dmem_state_t; "device", "host",
 * "disk", "controller" for a dmem_tier_t.
 * An unknown value gives "unknown". */
const char *dmem__state_name(unsigned state);
const char *dmem__tier_name(int tier);

#endif /* DMEM_ERROR_H */
