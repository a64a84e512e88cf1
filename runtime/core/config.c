/*
 * runtime/core/config.c - defaults, DMEM_* environment variables and the size
 * parser they share with the Python bridge (dmem_size_parse).
 */
#include "core/runtime.h"
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>


/* Parse "123", "64K", "1.5GB", "8GiB", "80%" (fraction_out may be NULL:
 * then % is an error) as dask.utils.parse_bytes reads sizes: a unit letter
 * K/M/G/T/P alone or followed by B is a power of 1000 ("8G" = "8GB" =
 * 8*10^9); followed by i or iB a power of 1024 ("8Gi" = "8GiB" = 2^33); a
 * bare "B" or no unit is bytes. Case-insensitive. Records no detail:
 * callers name the variable or argument. */
/* How sizes are read, for the details of DMEM_ERR_CONFIG. */
#define SIZE_UNITS "K/M/G/T/P or KB..PB: powers of 1000; Ki..Pi or KiB..PiB: powers of 1024"

static dmem_status_t parse_size(const char *s, size_t *bytes_out, double *fraction_out) {
  if (!s) return DMEM_ERR_CONFIG;
  while (isspace((unsigned char)*s)) s++;
  if (*s == '\0' || *s == '-' || *s == '+') return DMEM_ERR_CONFIG;
  errno = 0;
  char *end = NULL;
  double v = strtod(s, &end);
  if (end == s || errno != 0 || !(v >= 0) || isinf(v)) return DMEM_ERR_CONFIG;
  while (isspace((unsigned char)*end)) end++;
  if (*end == '%') {
    if (!fraction_out || v <= 0 || v > 100) return DMEM_ERR_CONFIG;
    end++;
    while (isspace((unsigned char)*end)) end++;
    if (*end != '\0') return DMEM_ERR_CONFIG;
    *fraction_out = v / 100.0;
    *bytes_out = 0;
    return DMEM_OK;
  }
  static const char units[] = "KMGTP";
  double mult = 1;
  const char *u = *end ? strchr(units, toupper((unsigned char)*end)) : NULL;
  if (u) {
    int power = (int)(u - units) + 1;
    end++;
    double base = 1000.0;
    if (*end == 'i' || *end == 'I') {
      base = 1024.0;
      end++;
    }
    for (int i = 0; i < power; i++) mult *= base;
  }
  if (*end == 'b' || *end == 'B') end++;
  while (isspace((unsigned char)*end)) end++;
  if (*end != '\0') return DMEM_ERR_CONFIG;
  double bytes = v * mult;
  if (bytes >= 18446744073709551615.0 || bytes != floor(bytes)) return DMEM_ERR_CONFIG;
  *bytes_out = (size_t)bytes;
  if (fraction_out) *fraction_out = 0;
  return DMEM_OK;
}

dmem_status_t dmem_size_parse(const char *text, size_t *bytes_out, double *fraction_out) {
  if (!text || !bytes_out)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_size_parse: NULL argument");
  size_t bytes = 0;
  double frac = 0;
  /* The "N%" below goes through %s, so it is written with a single '%'. */
  if (parse_size(text, &bytes, fraction_out ? &frac : NULL) != DMEM_OK)
    return dmem__error(DMEM_ERR_CONFIG,
                       "\"%s\": expected bytes, as Dask reads them (" SIZE_UNITS ")%s", text,
                       fraction_out ? " or N% with 0 < N <= 100" : "");
  *bytes_out = bytes;
  if (fraction_out) *fraction_out = frac;
  return DMEM_OK;
}

static int parse_backend(const char *s, dmem_backend_t *out) {
  if (strcasecmp(s, "auto") == 0) *out = DMEM_BACKEND_AUTO;
  else if (strcasecmp(s, "cuda") == 0) *out = DMEM_BACKEND_CUDA;
  else if (strcasecmp(s, "host") == 0) *out = DMEM_BACKEND_HOST;
  else return -1;
  return 0;
}

static int parse_pin(const char *s, dmem_host_pin_t *out) {
  if (strcasecmp(s, "auto") == 0) *out = DMEM_HOST_PIN_AUTO;
  else if (strcasecmp(s, "malloc_host") == 0) *out = DMEM_HOST_PIN_MALLOC_HOST;
  else if (strcasecmp(s, "register") == 0) *out = DMEM_HOST_PIN_REGISTER;
  else return -1;
  return 0;
}

static int parse_int(const char *s, long lo, long hi, long *out) {
  char *end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (end == s || errno != 0 || v < lo || v > hi) return -1;
  while (isspace((unsigned char)*end)) end++;
  if (*end != '\0') return -1;
  *out = v;
  return 0;
}

static int parse_log(const char *s, dmem_log_level_t *out) {
  static const char *const names[] = {"off", "error", "warn", "info", "debug"};
  for (int i = 0; i < 5; i++)
    if (strcasecmp(s, names[i]) == 0) {
      *out = (dmem_log_level_t)i;
      return 0;
    }
  if (strcasecmp(s, "warning") == 0) {
    *out = DMEM_LOG_WARN;
    return 0;
  }
  long v;
  if (parse_int(s, 0, 4, &v) == 0) {
    *out = (dmem_log_level_t)v;
    return 0;
  }
  return -1;
}

/* "off" | "0" -> 0; "on" -> 0.95; "N%" -> N/100 (low 0: the default);
 * "N%,M%" -> both. */
static int parse_ahead(const char *s, double *high, double *low) {
  if (strcasecmp(s, "off") == 0 || strcmp(s, "0") == 0) {
    *high = 0;
    *low = 0;
    return 0;
  }
  if (strcasecmp(s, "on") == 0) {
    *high = 0.95;
    *low = 0;
    return 0;
  }
  char buf[64];
  if (strlen(s) >= sizeof buf) return -1;
  strcpy(buf, s);
  char *comma = strchr(buf, ',');
  if (comma) *comma = '\0';
  size_t bytes;
  double h = 0, l = 0;
  if (parse_size(buf, &bytes, &h) != DMEM_OK || h <= 0) return -1;
  if (comma && (parse_size(comma + 1, &bytes, &l) != DMEM_OK || l <= 0 || l >= h)) return -1;
  *high = h;
  *low = l;
  return 0;
}

static int parse_eviction(const char *s, dmem_eviction_policy_t *p) {
  if (strcasecmp(s, "reuse") == 0) *p = DMEM_EVICTION_REUSE;
  else if (strcasecmp(s, "lru") == 0) *p = DMEM_EVICTION_LRU;
  else return -1;
  return 0;
}

/* "N%" with 0 <= N <= 100 (decimals allowed) as a fraction; 0 or -1. */
static int parse_percent(const char *s, double *f) {
  char *end = NULL;
  errno = 0;
  double v = strtod(s, &end);
  if (end == s || errno != 0 || *end != '%' || end[1] != '\0' || !(v >= 0 && v <= 100))
    return -1;
  *f = v / 100;
  return 0;
}

static void set_defaults(dmem_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->struct_size = sizeof *cfg;
  cfg->backend = DMEM_BACKEND_AUTO;
  cfg->device = 0;
  cfg->log_level = DMEM_LOG_WARN;
  cfg->host_backend_capacity = (size_t)1 << 30;
  cfg->oom_wait_ms = DMEM__OOM_WAIT_DEFAULT_MS;
  cfg->spill_ahead = DMEM_SPILL_AHEAD_DEFAULT;
  cfg->host_burst = DMEM_HOST_BURST_DEFAULT;
  cfg->host_headroom = DMEM_HOST_HEADROOM_DEFAULT;
}

/* Apply the environment to cfg (cfg != NULL), or check it against `given`,
 * the config a runtime is created with (given != NULL): a malformed
 * variable whose field `given` holds at the default is an error (the first
 * one's status is returned, its detail recorded); one whose field the
 * caller set is ignored with a warning (at given->log_level). */
static dmem_status_t apply_env(dmem_config_t *cfg, const dmem_config_t *given) {
  const char *v;
  dmem_status_t first = DMEM_OK;
  dmem_config_t d; /* the defaults */
  set_defaults(&d);
  /* ENV_FAIL(field_is_default, name, message...): a malformed variable */
#define ENV_FAIL(at_default, ...)                                                       \
  do {                                                                                  \
    if (given && !(at_default)) {                                                       \
      if ((int)given->log_level >= DMEM_LOG_WARN)                                       \
        dmem__log(DMEM_LOG_WARN, "%s=\"%s\" is malformed: ignored, the configuration "  \
                                 "gives the value",                                     \
                  name, v);                                                             \
    } else if (first == DMEM_OK) {                                                      \
      first = dmem__error(DMEM_ERR_CONFIG, __VA_ARGS__);                                \
    }                                                                                   \
  } while (0)
  const char *name;
#define ENV(n) (v = getenv(name = (n))) && *v
  if (ENV("DMEM_BACKEND")) {
    dmem_backend_t b;
    if (parse_backend(v, &b) != 0)
      ENV_FAIL(!given || given->backend == d.backend,
               "DMEM_BACKEND=\"%s\": expected auto, cuda or host", v);
    else if (cfg) cfg->backend = b;
  }
  if (ENV("DMEM_DEVICE")) {
    long dev;
    if (parse_int(v, 0, 1023, &dev) != 0)
      ENV_FAIL(!given || given->device == d.device,
               "DMEM_DEVICE=\"%s\": expected a device ordinal", v);
    else if (cfg) cfg->device = (int)dev;
  }
  if (ENV("DMEM_DEVICE_LIMIT")) {
    size_t bytes;
    double frac;
    if (parse_size(v, &bytes, &frac) != DMEM_OK)
      ENV_FAIL(!given || (given->device_limit == d.device_limit &&
                          given->device_limit_fraction == d.device_limit_fraction),
               "DMEM_DEVICE_LIMIT=\"%s\": expected bytes (" SIZE_UNITS ") or N%% "
               "with 0 < N <= 100",
               v);
    else if (cfg) {
      cfg->device_limit = bytes;
      cfg->device_limit_fraction = frac;
    }
  }
  if (ENV("DMEM_HOST_LIMIT")) {
    size_t bytes;
    if (parse_size(v, &bytes, NULL) != DMEM_OK)
      ENV_FAIL(!given || given->host_limit == d.host_limit,
               "DMEM_HOST_LIMIT=\"%s\": expected bytes (" SIZE_UNITS ")", v);
    else if (cfg) cfg->host_limit = bytes;
  }
  if (ENV("DMEM_HOST_RESERVE")) {
    size_t bytes;
    if (parse_size(v, &bytes, NULL) != DMEM_OK)
      ENV_FAIL(!given || given->host_reserve == d.host_reserve,
               "DMEM_HOST_RESERVE=\"%s\": expected bytes (" SIZE_UNITS ")", v);
    else if (cfg) cfg->host_reserve = bytes;
  }
  if (ENV("DMEM_HOST_HEADROOM")) {
    size_t bytes;
    if (parse_size(v, &bytes, NULL) != DMEM_OK)
      ENV_FAIL(!given || given->host_headroom == d.host_headroom,
               "DMEM_HOST_HEADROOM=\"%s\": expected bytes (" SIZE_UNITS ")", v);
    else if (cfg) cfg->host_headroom = bytes;
  }
  if (ENV("DMEM_HOST_BURST")) {
    double f;
    if (parse_percent(v, &f) != 0)
      ENV_FAIL(!given || given->host_burst == d.host_burst,
               "DMEM_HOST_BURST=\"%s\": expected N%% (0 <= N <= 100)", v);
    else if (cfg) cfg->host_burst = f;
  }
  if (ENV("DMEM_HOST_PIN")) {
    dmem_host_pin_t pin;
    if (parse_pin(v, &pin) != 0)
      ENV_FAIL(!given || given->host_pin == d.host_pin,
               "DMEM_HOST_PIN=\"%s\": expected auto, malloc_host or register", v);
    else if (cfg) cfg->host_pin = pin;
  }
  if (ENV("DMEM_HOST_CAPACITY")) {
    size_t bytes;
    if (parse_size(v, &bytes, NULL) != DMEM_OK || bytes == 0)
      ENV_FAIL(!given || given->host_backend_capacity == d.host_backend_capacity,
               "DMEM_HOST_CAPACITY=\"%s\": expected bytes > 0 (" SIZE_UNITS ")", v);
    else if (cfg) cfg->host_backend_capacity = bytes;
  }
  if (ENV("DMEM_SPILL_DIR")) {
    if (cfg) cfg->spill_dir = v;
  }
  if (ENV("DMEM_LOG")) {
    dmem_log_level_t l;
    if (parse_log(v, &l) != 0)
      ENV_FAIL(!given || given->log_level == d.log_level,
               "DMEM_LOG=\"%s\": expected off, error, warn, info, debug or 0..4", v);
    else if (cfg) cfg->log_level = l;
  }
  if (ENV("DMEM_OOM_WAIT")) {
    long ms;
    if (parse_int(v, 0, DMEM__OOM_WAIT_MAX_MS, &ms) != 0)
      ENV_FAIL(!given || given->oom_wait_ms == d.oom_wait_ms,
               "DMEM_OOM_WAIT=\"%s\": expected milliseconds, 0..%d", v,
               DMEM__OOM_WAIT_MAX_MS);
    else if (cfg) cfg->oom_wait_ms = (unsigned)ms;
  }
  if (ENV("DMEM_STATS")) {
    long s;
    if (parse_int(v, 0, DMEM_STATS_INTERVAL_MAX, &s) != 0)
      ENV_FAIL(!given || (given->print_stats == d.print_stats &&
                          given->stats_interval_s == d.stats_interval_s),
               "DMEM_STATS=\"%s\": expected 0, 1 (at the end) or N seconds (2..%u)", v,
               DMEM_STATS_INTERVAL_MAX);
    else if (cfg) {
      cfg->print_stats = s != 0;
      cfg->stats_interval_s = s >= 2 ? (unsigned)s : 0;
    }
  }
  if (ENV("DMEM_SPILL_AHEAD")) {
    double high = 0, low = 0;
    if (parse_ahead(v, &high, &low) != 0)
      ENV_FAIL(!given || (given->spill_ahead == d.spill_ahead &&
                          given->spill_ahead_low == d.spill_ahead_low),
               "DMEM_SPILL_AHEAD=\"%s\": expected off, on, N%% or N%%,M%% "
               "(0 < M < N <= 100)",
               v);
    else if (cfg) {
      cfg->spill_ahead = high;
      cfg->spill_ahead_low = low;
    }
  }
  if (ENV("DMEM_EVICTION_POLICY")) {
    dmem_eviction_policy_t pol;
    if (parse_eviction(v, &pol) != 0)
      ENV_FAIL(!given || given->eviction_policy == d.eviction_policy,
               "DMEM_EVICTION_POLICY=\"%s\": expected reuse or lru", v);
    else if (cfg) cfg->eviction_policy = pol;
  }
  if (ENV("DMEM_FAULT_INJECT")) {
    dmem__fault_plan_t plan;
    if (dmem__fault_parse(v, &plan) != DMEM_OK)
      ENV_FAIL(true, /* no field: always an error */
               "DMEM_FAULT_INJECT=\"%s\": expected <call>:<n>[:fatal][:persistent] "
               "with n >= 1 and <call> any, device_alloc, host_alloc, memcpy_async, "
               "... (docs/reliability.md, Fault injection)",
               v);
  }
#undef ENV
#undef ENV_FAIL
  return first;
}

void dmem_config_init(dmem_config_t *cfg) {
  if (!cfg) return;
  set_defaults(cfg);
  /* A malformed variable leaves only itself at the default;
   * dmem_runtime_create reports it, unless the caller sets the field. */
  (void)apply_env(cfg, NULL);
}

dmem_status_t dmem__config_check_env(const dmem_config_t *cfg) { return apply_env(NULL, cfg); }
