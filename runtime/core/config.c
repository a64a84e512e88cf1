/*
 * runtime/core/config.c - what the table of options (DMEM_CONFIG_OPTIONS,
 * include/dmem/config.h) generates in C: the defaults, the DMEM_*
 * environment variables and the range checks of dmem_runtime_create, one
 * parser, message and check per kind of option; and the size parser shared
 * with the Python bridge (dmem_size_parse).
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

/* ---- the kinds of DMEM_CONFIG_OPTIONS (include/dmem/config.h) ------------------
 *
 * Each kind has a parser of the environment's text (0, or -1 when it is
 * malformed), the words of its error ("expected ..."), a store into the
 * field(s) and a check of the fields' values for dmem_runtime_create. */

/* A parsed value, of whichever member the kind uses. */
typedef struct opt_value {
  size_t size;
  double f, f2;
  long i;
  const char *s;
} opt_value_t;

/* The position of `s` among the '|'-separated names of `choices` (empty
 * names match nothing), case-insensitive; -1 when it is none of them. */
static long choice_index(const char *choices, const char *s) {
  long i = 0;
  size_t n = strlen(s);
  for (const char *p = choices;; i++) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len > 0 && len == n && strncasecmp(p, s, n) == 0) return i;
    if (!bar) return -1;
    p = bar + 1;
  }
}

/* How many values `choices` has (named or not). */
static long choice_count(const char *choices) {
  long n = 1;
  for (const char *p = choices; *p; p++) n += *p == '|';
  return n;
}

/* "a, b or c" from "a|b|c" (empty names left out) into buf. */
static void choice_words(const char *choices, char *buf, size_t cap) {
  size_t named = 0, k = 0;
  for (const char *p = choices; *p;) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len) named++;
    p = bar ? bar + 1 : p + len;
  }
  buf[0] = '\0';
  for (const char *p = choices; *p && named;) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len) {
      k++;
      size_t used = strlen(buf);
      snprintf(buf + used, cap - used, "%s%.*s", k == 1 ? "" : k == named ? " or " : ", ",
               (int)len, p);
    }
    p = bar ? bar + 1 : p + len;
  }
}

static int kind_parse_size(const char *s, double lo, double hi, const char *choices,
                           opt_value_t *v) {
  (void)hi, (void)choices;
  if (parse_size(s, &v->size, NULL) != DMEM_OK || (double)v->size < lo) return -1;
  return 0;
}

static int kind_parse_size_or_percent(const char *s, double lo, double hi, const char *choices,
                                 opt_value_t *v) {
  (void)lo, (void)hi, (void)choices;
  return parse_size(s, &v->size, &v->f) == DMEM_OK ? 0 : -1;
}

/* "N%" with lo*100 <= N <= hi*100 (decimals allowed) as a fraction. */
static int kind_parse_fraction(const char *s, double lo, double hi, const char *choices,
                          opt_value_t *v) {
  (void)choices;
  char *end = NULL;
  errno = 0;
  double x = strtod(s, &end);
  if (end == s || errno != 0 || *end != '%' || end[1] != '\0' || !(x >= lo * 100 && x <= hi * 100))
    return -1;
  v->f = x / 100;
  return 0;
}

static int kind_parse_integer(const char *s, double lo, double hi, const char *choices,
                         opt_value_t *v) {
  (void)choices;
  return parse_int(s, (long)lo, (long)hi, &v->i);
}

static int kind_parse_choice(const char *s, double lo, double hi, const char *choices,
                        opt_value_t *v) {
  (void)lo, (void)hi;
  v->i = choice_index(choices, s);
  return v->i < 0 ? -1 : 0;
}

static int kind_parse_log(const char *s, double lo, double hi, const char *choices, opt_value_t *v) {
  v->i = choice_index(choices, s);
  if (v->i >= 0) return 0;
  if (strcasecmp(s, "warning") == 0) {
    v->i = DMEM_LOG_WARN;
    return 0;
  }
  return parse_int(s, (long)lo, (long)hi, &v->i);
}

static int kind_parse_path(const char *s, double lo, double hi, const char *choices, opt_value_t *v) {
  (void)lo, (void)hi, (void)choices;
  v->s = s;
  return 0;
}

static int kind_parse_stats(const char *s, double lo, double hi, const char *choices,
                       opt_value_t *v) {
  (void)choices;
  return parse_int(s, (long)lo, (long)hi, &v->i);
}

/* "off" | "0" -> 0; "on" -> 0.95; "N%" -> N/100 (low 0: the default);
 * "N%,M%" -> both. */
static int kind_parse_ahead(const char *s, double lo, double hi, const char *choices,
                       opt_value_t *v) {
  (void)lo, (void)hi, (void)choices;
  if (strcasecmp(s, "off") == 0 || strcmp(s, "0") == 0) {
    v->f = v->f2 = 0;
    return 0;
  }
  if (strcasecmp(s, "on") == 0) {
    v->f = 0.95;
    v->f2 = 0;
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
  v->f = h;
  v->f2 = l;
  return 0;
}

/* What a well-formed value of each kind is, for the detail of
 * DMEM_ERR_CONFIG. */
static void kind_expect_size(char *b, size_t n, double lo, double hi, const char *c) {
  (void)hi, (void)c;
  snprintf(b, n, "bytes%s (" SIZE_UNITS ")", lo > 0 ? " > 0" : "");
}
static void kind_expect_size_or_percent(char *b, size_t n, double lo, double hi, const char *c) {
  (void)lo, (void)hi, (void)c;
  snprintf(b, n, "bytes (" SIZE_UNITS ") or N%% with 0 < N <= 100");
}
static void kind_expect_fraction(char *b, size_t n, double lo, double hi, const char *c) {
  (void)c;
  snprintf(b, n, "N%% (%g <= N <= %g)", lo * 100, hi * 100);
}
static void kind_expect_integer(char *b, size_t n, double lo, double hi, const char *c) {
  (void)c;
  snprintf(b, n, "an integer, %.0f..%.0f", lo, hi);
}
static void kind_expect_choice(char *b, size_t n, double lo, double hi, const char *c) {
  (void)lo, (void)hi;
  choice_words(c, b, n);
}
static void kind_expect_log(char *b, size_t n, double lo, double hi, const char *c) {
  char words[128];
  choice_words(c, words, sizeof words);
  snprintf(b, n, "%s or %.0f..%.0f", words, lo, hi);
}
static void kind_expect_path(char *b, size_t n, double lo, double hi, const char *c) {
  (void)lo, (void)hi, (void)c;
  snprintf(b, n, "a path");
}
static void kind_expect_stats(char *b, size_t n, double lo, double hi, const char *c) {
  (void)lo, (void)c;
  snprintf(b, n, "0, 1 (at the end) or N seconds (2..%.0f)", hi);
}
static void kind_expect_ahead(char *b, size_t n, double lo, double hi, const char *c) {
  (void)lo, (void)hi, (void)c;
  snprintf(b, n, "off, on, N%% or N%%,M%% (0 < M < N <= 100)");
}

/* Store a parsed value into the field(s). */
#define STORE_size(cfg, field, also, v) ((cfg)->field = (v).size)
#define STORE_size_or_percent(cfg, field, also, v) \
  ((cfg)->field = (v).size, (cfg)->also = (v).f)
#define STORE_fraction(cfg, field, also, v) ((cfg)->field = (v).f)
#define STORE_integer(cfg, field, also, v) ((cfg)->field = (v).i)
#define STORE_choice(cfg, field, also, v) ((cfg)->field = (v).i)
#define STORE_log(cfg, field, also, v) ((cfg)->field = (v).i)
#define STORE_path(cfg, field, also, v) ((cfg)->field = (v).s)
#define STORE_stats(cfg, field, also, v) \
  ((cfg)->field = (v).i != 0, (cfg)->also = (v).i >= 2 ? (unsigned)(v).i : 0)
#define STORE_ahead(cfg, field, also, v) ((cfg)->field = (v).f, (cfg)->also = (v).f2)

/* The checks of dmem_runtime_create: DMEM_OK, or DMEM_ERR_INVALID_ARGUMENT
 * with the detail naming the field. */
static dmem_status_t bad_field(const char *field, double value, double lo, double hi) {
  return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "%s %.15g not in [%.15g, %.15g]", field, value, lo,
                     hi);
}
static dmem_status_t check_range(const char *f, double v, double lo, double hi) {
  return v >= lo && v <= hi ? DMEM_OK : bad_field(f, v, lo, hi);
}
/* any size is valid here (host_backend_capacity's lo is checked with the backend) */
#define CHECK_size(cfg, field, also, lo, hi, c) DMEM_OK
#define CHECK_size_or_percent(cfg, field, also, lo, hi, c) \
  check_range(#also, (cfg)->also, 0, 1)
#define CHECK_fraction(cfg, field, also, lo, hi, c) check_range(#field, (cfg)->field, lo, hi)
#define CHECK_integer(cfg, field, also, lo, hi, c) \
  check_range(#field, (double)(cfg)->field, lo, hi)
#define CHECK_choice(cfg, field, also, lo, hi, c) \
  check_range(#field, (double)(int)(cfg)->field, 0, (double)(choice_count(c) - 1))
#define CHECK_log(cfg, field, also, lo, hi, c) \
  check_range(#field, (double)(int)(cfg)->field, lo, hi)
#define CHECK_path(cfg, field, also, lo, hi, c) DMEM_OK
#define CHECK_stats(cfg, field, also, lo, hi, c) \
  check_range(#also, (double)(cfg)->also, 0, hi)
#define CHECK_ahead(cfg, field, also, lo, hi, c) check_ahead((cfg)->field, (cfg)->also)

static dmem_status_t check_ahead(double high, double low) {
  if (!(high == DMEM_SPILL_AHEAD_DEFAULT || (high >= 0 && high <= 1)))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "spill_ahead %g not in [0, 1]", high);
  if (!(low >= 0 && low < 1) || (high > 0 && low >= high))
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "spill_ahead_low %g not in [0, spill_ahead %g)",
                       low, high);
  return DMEM_OK;
}

dmem_status_t dmem__config_check(const dmem_config_t *cfg) {
  dmem_status_t st = DMEM_OK;
#define CHECK_ROW(field, also, kind, def, env, kw, lo, hi, choices, doc) \
  if (st == DMEM_OK) st = CHECK_##kind(cfg, field, also, lo, hi, choices);
  DMEM_CONFIG_OPTIONS(CHECK_ROW)
#undef CHECK_ROW
  return st;
}

static void set_defaults(dmem_config_t *cfg) {
  memset(cfg, 0, sizeof *cfg);
  cfg->struct_size = sizeof *cfg;
#define DEFAULT_ROW(field, also, kind, def, env, kw, lo, hi, choices, doc) cfg->field = def;
  DMEM_CONFIG_OPTIONS(DEFAULT_ROW)
#undef DEFAULT_ROW
}

static const char *getenv_set(const char *name) {
  const char *v = name ? getenv(name) : NULL;
  return v && *v ? v : NULL;
}

/* A malformed variable: an error when `given` holds its field(s) at the
 * default (or there is no `given`: dmem_config_init), else a warning. The
 * first error's status is kept in *first. */
static void env_malformed(dmem_status_t *first, const dmem_config_t *given, bool at_default,
                          const char *name, const char *v, const char *expect) {
  if (given && !at_default) {
    if ((int)given->log_level >= DMEM_LOG_WARN)
      dmem__log(DMEM_LOG_WARN,
                "%s=\"%s\" is malformed: ignored, the configuration gives the value", name, v);
  } else if (*first == DMEM_OK) {
    *first = dmem__error(DMEM_ERR_CONFIG, "%s=\"%s\": expected %s", name, v, expect);
  }
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
#define ENV_ROW(field, also, kind, def, env, kw, lo, hi, choices, doc)                     \
  if ((v = getenv_set(env)) != NULL) {                                                     \
    opt_value_t val = {0};                                                                 \
    if (kind_parse_##kind(v, lo, hi, choices, &val) != 0) {                                     \
      char expect[256];                                                                    \
      kind_expect_##kind(expect, sizeof expect, lo, hi, choices);                               \
      env_malformed(&first, given,                                                         \
                    !given || (given->field == d.field && given->also == d.also), env, v, \
                    expect);                                                               \
    } else if (cfg) {                                                                      \
      STORE_##kind(cfg, field, also, val);                                                 \
    }                                                                                      \
  }
  DMEM_CONFIG_OPTIONS(ENV_ROW)
#undef ENV_ROW
  if ((v = getenv_set("DMEM_FAULT_INJECT")) != NULL) {
    dmem__fault_plan_t plan;
    if (dmem__fault_parse(v, &plan) != DMEM_OK) /* no field: always an error */
      env_malformed(&first, given, true, "DMEM_FAULT_INJECT", v,
                    "<call>:<n>[:fatal][:persistent] with n >= 1 and <call> any, "
                    "device_alloc, host_alloc, memcpy_async, ... (docs/reliability.md, Fault "
                    "injection)");
  }
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

size_t dmem__config_env_pow2(const char *name, size_t lo, size_t hi, size_t dflt) {
  const char *s = getenv(name);
  if (!s || !*s) return dflt;
  char *end = NULL;
  unsigned long long v = strtoull(s, &end, 10);
  if (end && (*end == 'K' || *end == 'k')) v <<= 10, end++;
  else if (end && (*end == 'M' || *end == 'm')) v <<= 20, end++;
  if (!end || *end || v < lo || v > hi || (v & (v - 1))) return dflt;
  return (size_t)v;
}
