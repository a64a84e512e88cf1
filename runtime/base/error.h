/*
 * runtime/base/error.h - recording error details and logging (internal).
 */
#ifndef DMEM_ERROR_H
#define DMEM_ERROR_H

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

/* Process-wide log level (the most verbose of the live runtimes'). */
extern int dmem__log_level;
void dmem__log(dmem_log_level_t level, const char *fmt, ...) DMEM_PRINTF(2, 3);

#define DMEM_LOG_AT(level, ...)                     \
  do {                                              \
    if ((int)(level) <= dmem__log_level) dmem__log((level), __VA_ARGS__); \
  } while (0)

#endif /* DMEM_ERROR_H */
