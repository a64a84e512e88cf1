/*
 * runtime/base/error.c - status names and messages (from the X-macro table),
 * the thread-local error detail, and the logger. This is the floor of the
 * layers: every layer, the backends included, records failures through it,
 * and it calls nothing else of dmem.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "dmem/status.h"
#include "error.h"

const char *dmem_status_name(dmem_status_t status) {
  switch (status) {
#define DMEM_STATUS_NAME_(name, value, msg) \
  case DMEM_##name:                         \
    return "DMEM_" #name;
    DMEM_STATUS_MAP(DMEM_STATUS_NAME_)
#undef DMEM_STATUS_NAME_
  }
  return "DMEM_UNKNOWN_STATUS";
}

const char *dmem_status_string(dmem_status_t status) {
  switch (status) {
#define DMEM_STATUS_MSG_(name, value, msg) \
  case DMEM_##name:                        \
    return msg;
    DMEM_STATUS_MAP(DMEM_STATUS_MSG_)
#undef DMEM_STATUS_MSG_
  }
  return "unknown status";
}

static _Thread_local char dmem__detail[512];

const char *dmem_last_error_detail(void) { return dmem__detail; }

dmem_status_t dmem__error(dmem_status_t status, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(dmem__detail, sizeof dmem__detail, fmt, ap);
  va_end(ap);
  DMEM_LOG_AT(DMEM_LOG_DEBUG, "%s: %s", dmem_status_name(status), dmem__detail);
  return status;
}

_Atomic int dmem__log_level = DMEM_LOG_WARN;

const char *dmem__state_name(unsigned state) {
  static const char *const names[] = {"resident (on the device)", "spilling",
                                      "in the host tier",         "in the disk tier",
                                      "held by the controller",   "unspilling"};
  return state < sizeof names / sizeof names[0] ? names[state] : "unknown";
}

const char *dmem__tier_name(int tier) {
  static const char *const names[] = {"device", "host", "disk", "controller"};
  return tier >= 0 && tier < 4 ? names[tier] : "unknown";
}

void dmem__log(dmem_log_level_t level, const char *fmt, ...) {
  static const char *const names[] = {"off", "error", "warn", "info", "debug"};
  char line[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line, sizeof line, fmt, ap);
  va_end(ap);
  fprintf(stderr, "dmem[%s]: %s\n", ((unsigned)level <= 4u ? names[level] : "?"), line);
}
