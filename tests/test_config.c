/* dmem_config_init defaults, DMEM_* environment parsing, backend selection. */
#include <sys/stat.h>
#include <unistd.h>

#include "check.h"

/* Every variable of the table of options (DMEM_CONFIG_OPTIONS), so that a
 * new option's variable is cleared too. */
#define ENV_OF_ROW(field, also, kind, def, env, kw, lo, hi, choices, doc) env,
static const char *vars[] = {DMEM_CONFIG_OPTIONS(ENV_OF_ROW)};
#undef ENV_OF_ROW

static void clear_env(void) {
  for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++)
    if (vars[i]) unsetenv(vars[i]);
}

static dmem_status_t create_with_env(const char *var, const char *value, dmem_runtime_t **rt) {
  clear_env();
  setenv("DMEM_BACKEND", "host", 1);
  if (var) setenv(var, value, 1);
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  return dmem_runtime_create(&cfg, rt);
}

TEST_CASE(defaults) {
  clear_env();
  dmem_config_t cfg;
  memset(&cfg, 0xAB, sizeof cfg);
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.struct_size, sizeof cfg);
  CHECK_EQ(cfg.backend, DMEM_BACKEND_AUTO);
  CHECK_EQ(cfg.device, 0);
  CHECK_UEQ(cfg.device_limit, 0);
  CHECK_UEQ(cfg.host_limit, 0);
  CHECK_TRUE(cfg.spill_dir == NULL);
  CHECK_EQ(cfg.log_level, DMEM_LOG_WARN);
  CHECK_UEQ(cfg.host_backend_capacity, (size_t)1 << 30);
  CHECK_UEQ(cfg.oom_wait_ms, 5000);
  dmem_config_init(NULL); /* ignored */
}

TEST_CASE(env_values_applied) {
  clear_env();
  setenv("DMEM_BACKEND", "host", 1);
  setenv("DMEM_DEVICE_LIMIT", "64Mi", 1);
  setenv("DMEM_HOST_LIMIT", "1g", 1); /* as Dask reads it: 10^9 */
  setenv("DMEM_HOST_CAPACITY", "256MiB", 1);
  setenv("DMEM_LOG", "error", 1);
  setenv("DMEM_STATS", "0", 1);
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  CHECK_EQ(cfg.backend, DMEM_BACKEND_HOST);
  CHECK_UEQ(cfg.device_limit, 64u << 20);
  CHECK_UEQ(cfg.host_limit, (size_t)1000000000);
  CHECK_UEQ(cfg.host_backend_capacity, 256u << 20);
  CHECK_EQ(cfg.log_level, DMEM_LOG_ERROR);
  dmem_runtime_t *rt = NULL;
  REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
  CHECK_EQ(dmem_runtime_backend(rt), DMEM_BACKEND_HOST);
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_limit, 64u << 20);
  CHECK_UEQ(s.device_capacity, 256u << 20);
  dmem_runtime_destroy(rt);
  clear_env();
}

TEST_CASE(env_percent_limit) {
  dmem_runtime_t *rt = NULL;
  clear_env();
  setenv("DMEM_HOST_CAPACITY", "100MiB", 1);
  setenv("DMEM_BACKEND", "host", 1);
  setenv("DMEM_DEVICE_LIMIT", "80%", 1);
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.device_limit, (size_t)(100u << 20) / 10 * 8);
  dmem_runtime_destroy(rt);
  clear_env();
}

TEST_CASE(env_malformed_is_config_error) {
  static const struct { const char *var, *value; } bad[] = {
      {"DMEM_BACKEND", "gpu"},        {"DMEM_DEVICE", "-1"},       {"DMEM_DEVICE", "one"},
      {"DMEM_DEVICE_LIMIT", "12Q"},   {"DMEM_DEVICE_LIMIT", "-5"}, {"DMEM_DEVICE_LIMIT", "150%"},
      {"DMEM_DEVICE_LIMIT", "0%"},    {"DMEM_DEVICE_LIMIT", "1.5"}, {"DMEM_HOST_LIMIT", "50%"},
      {"DMEM_HOST_LIMIT", "lots"},    {"DMEM_LOG", "loud"},        {"DMEM_LOG", "7"},
      {"DMEM_STATS", "yes"},          {"DMEM_HOST_CAPACITY", "0"}, {"DMEM_DEVICE_LIMIT", "1e400"},
      {"DMEM_SPILL_AHEAD", "maybe"},  {"DMEM_SPILL_AHEAD", "90%,95%"}, {"DMEM_SPILL_AHEAD", "8G"},
      {"DMEM_SPILL_AHEAD", "150%"},   {"DMEM_HOST_BURST", "0.2"},  {"DMEM_HOST_BURST", "150%"},
      {"DMEM_HOST_BURST", "-5%"},     {"DMEM_HOST_BURST", "lots"}, {"DMEM_HOST_BURST", "20%x"},
      {"DMEM_HOST_HEADROOM", "lots"}, {"DMEM_HOST_HEADROOM", "50%"},
      {"DMEM_HOST_HEADROOM", "-1"},   {"DMEM_HOST_HEADROOM", "64MiBx"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    dmem_runtime_t *rt = (dmem_runtime_t *)0x1;
    dmem_status_t st = create_with_env(bad[i].var, bad[i].value, &rt);
    if (st != DMEM_ERR_CONFIG)
      fprintf(stderr, "%s=%s gave %s\n", bad[i].var, bad[i].value, dmem_status_name(st));
    CHECK_EQ(st, DMEM_ERR_CONFIG);
    CHECK_TRUE(rt == (dmem_runtime_t *)0x1); /* output untouched */
    CHECK_TRUE(strstr(dmem_last_error_detail(), bad[i].var) != NULL);
  }
  /* also with cfg == NULL */
  clear_env();
  setenv("DMEM_LOG", "chatty", 1);
  dmem_runtime_t *rt = NULL;
  CHECK_STATUS(dmem_runtime_create(NULL, &rt), DMEM_ERR_CONFIG);
  CHECK_TRUE(rt == NULL);
  clear_env();
}

TEST_CASE(env_good_forms) {
  static const struct { const char *var, *value; } good[] = {
      {"DMEM_BACKEND", "HOST"}, {"DMEM_DEVICE_LIMIT", "1048576"}, {"DMEM_DEVICE_LIMIT", "2K"},
      {"DMEM_DEVICE_LIMIT", "1.5G"}, {"DMEM_DEVICE_LIMIT", "50 %"}, {"DMEM_HOST_LIMIT", "0"},
      {"DMEM_LOG", "3"}, {"DMEM_LOG", "off"}, {"DMEM_STATS", "1"}, {"DMEM_DEVICE", "0"},
      {"DMEM_SPILL_AHEAD", "off"}, {"DMEM_SPILL_AHEAD", "on"}, {"DMEM_SPILL_AHEAD", "80%"},
      {"DMEM_SPILL_AHEAD", "95%,85%"}, {"DMEM_HOST_BURST", "0%"}, {"DMEM_HOST_BURST", "12.5%"},
      {"DMEM_HOST_BURST", "100%"}, {"DMEM_HOST_HEADROOM", "0"}, {"DMEM_HOST_HEADROOM", "64MiB"},
      {"DMEM_HOST_HEADROOM", "1GB"},
  };
  for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
    dmem_runtime_t *rt = NULL;
    dmem_status_t st = create_with_env(good[i].var, good[i].value, &rt);
    if (st != DMEM_OK) fprintf(stderr, "%s=%s gave %s\n", good[i].var, good[i].value, dmem_status_name(st));
    CHECK_EQ(st, DMEM_OK);
    dmem_runtime_destroy(rt);
  }
  clear_env();
}

/* DMEM_HOST_BURST: default half the limit, N% as a fraction. */
TEST_CASE(host_burst_from_env) {
  clear_env();
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  CHECK_TRUE(cfg.host_burst == DMEM_HOST_BURST_DEFAULT && cfg.host_burst == 0.5);
  setenv("DMEM_HOST_BURST", "20%", 1);
  dmem_config_init(&cfg);
  CHECK_TRUE(cfg.host_burst > 0.1999 && cfg.host_burst < 0.2001);
  setenv("DMEM_HOST_BURST", "0%", 1);
  dmem_config_init(&cfg);
  CHECK_TRUE(cfg.host_burst == 0);
  setenv("DMEM_HOST_BURST", "250%", 1); /* malformed: left at the default here */
  dmem_config_init(&cfg);
  CHECK_TRUE(cfg.host_burst == 0.5);
  clear_env();
}

/* The host_headroom of a runtime created from cfg (dmem_runtime_info);
 * SIZE_MAX when it cannot be created. */
static size_t headroom_in_effect(const dmem_config_t *cfg) {
  dmem_runtime_t *rt = NULL;
  if (dmem_runtime_create(cfg, &rt) != DMEM_OK) return SIZE_MAX;
  dmem_runtime_info_t info;
  info.struct_size = sizeof info;
  size_t h = dmem_runtime_info(rt, &info) == DMEM_OK ? info.host_headroom : SIZE_MAX;
  dmem_runtime_destroy(rt);
  return h;
}

/* DMEM_HOST_HEADROOM: default 4 GiB, a size as Dask reads it; malformed:
 * left at the default, and dmem_runtime_create fails naming it unless the
 * field was given, which wins over the variable, well formed or not. */
TEST_CASE(host_headroom_from_env) {
  clear_env();
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_headroom, DMEM_HOST_HEADROOM_DEFAULT);
  CHECK_UEQ(cfg.host_headroom, (size_t)4 << 30);
  setenv("DMEM_HOST_HEADROOM", "64MiB", 1);
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_headroom, (size_t)64 << 20);
  setenv("DMEM_HOST_HEADROOM", "256MB", 1);
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_headroom, (size_t)256000000);
  setenv("DMEM_HOST_HEADROOM", "0", 1);
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_headroom, 0);
  setenv("DMEM_HOST_HEADROOM", "plenty", 1); /* malformed: the default here */
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_headroom, DMEM_HOST_HEADROOM_DEFAULT);
  setenv("DMEM_BACKEND", "host", 1);
  dmem_runtime_t *rt = (dmem_runtime_t *)0x1;
  CHECK_STATUS(dmem_runtime_create(&cfg, &rt), DMEM_ERR_CONFIG);
  CHECK_TRUE(rt == (dmem_runtime_t *)0x1);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "DMEM_HOST_HEADROOM=\"plenty\"") != NULL);
  /* the field given: the malformed variable is ignored */
  cfg.log_level = DMEM_LOG_ERROR; /* no warning on the test's stderr */
  cfg.host_headroom = (size_t)32 << 20;
  CHECK_UEQ(headroom_in_effect(&cfg), (size_t)32 << 20);
  /* the variable alone sets it */
  setenv("DMEM_HOST_HEADROOM", "1GiB", 1);
  dmem_config_init(&cfg);
  CHECK_UEQ(headroom_in_effect(&cfg), (size_t)1 << 30);
  /* and a well-formed one loses to the field too */
  cfg.host_headroom = 0;
  CHECK_UEQ(headroom_in_effect(&cfg), 0);
  clear_env();
}

TEST_CASE(bad_config_struct) {
  clear_env();
  dmem_runtime_t *rt = NULL;
  CHECK_STATUS(dmem_runtime_create(NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.struct_size = 8;
  CHECK_STATUS(dmem_runtime_create(&cfg, &rt), DMEM_ERR_INVALID_ARGUMENT);
  dmem_config_init(&cfg);
  cfg.backend = (dmem_backend_t)42;
  CHECK_STATUS(dmem_runtime_create(&cfg, &rt), DMEM_ERR_INVALID_ARGUMENT);
  dmem_config_init(&cfg);
  cfg.device = -3;
  CHECK_STATUS(dmem_runtime_create(&cfg, &rt), DMEM_ERR_INVALID_ARGUMENT);
  dmem_config_init(&cfg);
  cfg.device_limit_fraction = 1.5;
  CHECK_STATUS(dmem_runtime_create(&cfg, &rt), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(rt == NULL);
}

/* Every variable of the table: a malformed value makes dmem_runtime_create
 * fail with DMEM_ERR_CONFIG naming it (a path's kind takes any text), and
 * leaves the field at its default in dmem_config_init. */
TEST_CASE(table_every_variable_malformed_is_config_error) {
#define ROW_OF(field, also, kind, def, env, kw, lo, hi, choices, doc) {env, #kind},
  static const struct { const char *env, *kind; } rows[] = {DMEM_CONFIG_OPTIONS(ROW_OF)};
#undef ROW_OF
  size_t checked = 0;
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
    if (!rows[i].env || strcmp(rows[i].kind, "path") == 0) continue;
    dmem_runtime_t *rt = (dmem_runtime_t *)0x1;
    dmem_status_t st = create_with_env(rows[i].env, "not-a-value", &rt);
    if (st != DMEM_ERR_CONFIG) fprintf(stderr, "%s gave %s\n", rows[i].env, dmem_status_name(st));
    CHECK_EQ(st, DMEM_ERR_CONFIG);
    CHECK_TRUE(rt == (dmem_runtime_t *)0x1);
    CHECK_TRUE(strstr(dmem_last_error_detail(), rows[i].env) != NULL);
    CHECK_TRUE(strstr(dmem_last_error_detail(), "expected") != NULL);
    checked++;
  }
  CHECK_GT(checked, 10);
  clear_env();
  dmem_config_t def, cfg;
  dmem_config_init(&def);
  for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++)
    if (rows[i].env && strcmp(rows[i].kind, "path") != 0) setenv(rows[i].env, "not-a-value", 1);
  dmem_config_init(&cfg);
  CHECK_TRUE(memcmp(&def, &cfg, sizeof cfg) == 0); /* each left at its default */
  clear_env();
}

/* dmem_runtime_create checks each field against its row's range or
 * choices: DMEM_ERR_INVALID_ARGUMENT naming the field, nothing created. */
TEST_CASE(table_ranges_checked_at_create) {
  clear_env();
  static const char *const names[] = {"device",          "oom_wait_ms",      "host_burst",
                                      "log_level",       "backend",          "host_pin",
                                      "eviction_policy", "stats_interval_s", "device_limit_fraction",
                                      "spill_ahead",     "spill_ahead_low",  "host_burst"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    dmem_config_t cfg;
    dmem_config_init(&cfg);
    cfg.backend = DMEM_BACKEND_HOST;
    switch (i) {
      case 0: cfg.device = 1024; break;
      case 1: cfg.oom_wait_ms = 3600001; break;
      case 2: cfg.host_burst = 1.5; break;
      case 3: cfg.log_level = (dmem_log_level_t)5; break;
      case 4: cfg.backend = (dmem_backend_t)3; break;
      case 5: cfg.host_pin = (dmem_host_pin_t)3; break;
      case 6: cfg.eviction_policy = (dmem_eviction_policy_t)-1; break;
      case 7: cfg.stats_interval_s = DMEM_STATS_INTERVAL_MAX + 1; break;
      case 8: cfg.device_limit_fraction = -0.5; break;
      case 9: cfg.spill_ahead = 1.5; break;
      case 10: cfg.spill_ahead = 0.5, cfg.spill_ahead_low = 0.6; break;
      case 11: cfg.host_burst = 0.0 / 0.0; break; /* NaN */
    }
    dmem_runtime_t *rt = (dmem_runtime_t *)0x1;
    CHECK_STATUS(dmem_runtime_create(&cfg, &rt), DMEM_ERR_INVALID_ARGUMENT);
    CHECK_TRUE(rt == (dmem_runtime_t *)0x1);
    CHECK_TRUE(strstr(dmem_last_error_detail(), names[i]) != NULL);
  }
  /* the ends of each range are valid */
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.device = 1023;
  cfg.oom_wait_ms = 3600000;
  cfg.host_burst = 1.0;
  cfg.log_level = DMEM_LOG_DEBUG;
  cfg.stats_interval_s = DMEM_STATS_INTERVAL_MAX;
  cfg.eviction_policy = DMEM_EVICTION_REUSE;
  cfg.host_pin = DMEM_HOST_PIN_REGISTER;
  dmem_runtime_t *rt = NULL;
  REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
  dmem_runtime_destroy(rt);
}

/* host_staging (DMEM_HOST_STAGING): the pinned pool's room beside the host
 * tier. With host_limit 8 MiB and no burst the pool holds 8 MiB + the
 * staging: 64 MiB by default, so a reserve of 80 MiB does not fit; with
 * 80 MiB of staging it does. A malformed variable is DMEM_ERR_CONFIG. */
static dmem_status_t create_staged(size_t staging, dmem_runtime_t **rt) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.host_limit = (size_t)8 << 20;
  cfg.host_burst = 0;
  cfg.host_reserve = (size_t)80 << 20;
  if (staging) cfg.host_staging = staging;
  return dmem_runtime_create(&cfg, rt);
}

TEST_CASE(host_staging_from_struct_and_env) {
  clear_env();
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_staging, 0);
  dmem_runtime_t *rt = (dmem_runtime_t *)0x1;
  CHECK_STATUS(create_staged(0, &rt), DMEM_ERR_INVALID_ARGUMENT); /* 8 + 64 MiB < 80 */
  CHECK_TRUE(rt == (dmem_runtime_t *)0x1);
  CHECK_STATUS(create_staged((size_t)1 << 20, &rt), DMEM_ERR_INVALID_ARGUMENT); /* raised to 64 */
  rt = NULL;
  REQUIRE_OK(create_staged((size_t)80 << 20, &rt)); /* 8 + 80 MiB */
  dmem_runtime_destroy(rt);

  setenv("DMEM_HOST_STAGING", "80MiB", 1);
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_staging, (size_t)80 << 20);
  rt = NULL;
  REQUIRE_OK(create_staged(0, &rt));
  dmem_runtime_destroy(rt);
  setenv("DMEM_HOST_STAGING", "80MB", 1); /* as Dask reads it: 8e7 */
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_staging, (size_t)80000000);

  setenv("DMEM_HOST_STAGING", "lots", 1);
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_staging, 0); /* left at the default here ... */
  rt = (dmem_runtime_t *)0x1;
  CHECK_STATUS(create_staged(0, &rt), DMEM_ERR_CONFIG); /* ... an error at create */
  CHECK_TRUE(strstr(dmem_last_error_detail(), "DMEM_HOST_STAGING") != NULL);
  rt = NULL;
  REQUIRE_OK(create_staged((size_t)80 << 20, &rt)); /* the field given: ignored */
  dmem_runtime_destroy(rt);
  clear_env();
}

TEST_CASE(backend_selection_without_gpu) {
  clear_env();
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_CUDA;
  dmem_runtime_t *rt = NULL;
  dmem_status_t st = dmem_runtime_create(&cfg, &rt);
  if (st == DMEM_OK) {
    /* a GPU machine: auto must pick CUDA too */
    dmem_runtime_destroy(rt);
    cfg.backend = DMEM_BACKEND_AUTO;
    REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
    CHECK_EQ(dmem_runtime_backend(rt), DMEM_BACKEND_CUDA);
    dmem_runtime_destroy(rt);
    return;
  }
  CHECK_EQ(st, DMEM_ERR_NO_DEVICE);
  CHECK_GT(strlen(dmem_last_error_detail()), 5);
  CHECK_TRUE(rt == NULL);
  cfg.backend = DMEM_BACKEND_AUTO;
  REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
  CHECK_EQ(dmem_runtime_backend(rt), DMEM_BACKEND_HOST);
  dmem_runtime_destroy(rt);
  setenv("DMEM_BACKEND", "cuda", 1);
  CHECK_STATUS(dmem_runtime_create(NULL, &rt), DMEM_ERR_NO_DEVICE);
  clear_env();
}

TEST_CASE(destroy_null_and_backend_of_null) {
  dmem_runtime_destroy(NULL);
  CHECK_EQ(dmem_runtime_backend(NULL), DMEM_BACKEND_AUTO);
  CHECK_STATUS(dmem_runtime_poll(NULL), DMEM_ERR_INVALID_ARGUMENT);
}

/* The public parser is the one the environment goes through: same answers. */
TEST_CASE(size_parse_matches_env) {
  size_t b = 1;
  double f = 1;
  CHECK_STATUS(dmem_size_parse("1.5Gi", &b, &f), DMEM_OK);
  CHECK_UEQ(b, (size_t)3 << 29);
  CHECK_TRUE(f == 0);
  CHECK_STATUS(dmem_size_parse("512MiB", &b, NULL), DMEM_OK);
  CHECK_UEQ(b, (size_t)512 << 20);
  CHECK_STATUS(dmem_size_parse("80%", &b, &f), DMEM_OK);
  CHECK_UEQ(b, 0);
  CHECK_TRUE(f > 0.799 && f < 0.801);
  b = 7;
  CHECK_STATUS(dmem_size_parse("80%", &b, NULL), DMEM_ERR_CONFIG); /* no fraction wanted */
  CHECK_UEQ(b, 7);
  CHECK_STATUS(dmem_size_parse("1.5", &b, NULL), DMEM_ERR_CONFIG); /* not whole bytes */
  CHECK_STATUS(dmem_size_parse("-1", &b, NULL), DMEM_ERR_CONFIG);
  CHECK_STATUS(dmem_size_parse("12Q", &b, NULL), DMEM_ERR_CONFIG);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "12Q") != NULL);
  CHECK_STATUS(dmem_size_parse("12Q", &b, &f), DMEM_ERR_CONFIG);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "or N% with") != NULL); /* not "N%%" */
  CHECK_STATUS(dmem_size_parse(NULL, &b, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_size_parse("1", NULL, NULL), DMEM_ERR_INVALID_ARGUMENT);
  /* the environment reading gives the same limit */
  dmem_runtime_t *rt = NULL;
  REQUIRE_EQ(create_with_env("DMEM_DEVICE_LIMIT", "1.5M", &rt), DMEM_OK);
  dmem_stats_t s;
  REQUIRE_EQ(dmem_stats(rt, &s), DMEM_OK);
  CHECK_TRUE(dmem_size_parse("1.5M", &b, NULL) == DMEM_OK && s.device_limit == b);
  dmem_runtime_destroy(rt);
  clear_env();
}

/* Sizes are read as dask.utils.parse_bytes reads them: K/M/G/T/P (alone or
 * with B) are powers of 1000, Ki..Pi (alone or with B) powers of 1024. */
TEST_CASE(size_parse_reads_sizes_as_dask) {
  static const struct {
    const char *text;
    unsigned long long bytes;
  } ok[] = {
      {"100", 100ull},
      {"100B", 100ull},
      {"8G", 8000000000ull},
      {"8GB", 8000000000ull},
      {"8 GB", 8000000000ull},
      {"8gb", 8000000000ull},
      {"8Gi", 8ull << 30},
      {"8GiB", 8ull << 30},
      {"8gib", 8ull << 30},
      {"1.5kB", 1500ull},
      {"5K", 5000ull},
      {"2KiB", 2048ull},
      {"512MiB", 512ull << 20},
      {"100MB", 100000000ull},
      {"1e6", 1000000ull},
      {"2TB", 2000000000000ull},
      {"1Ti", 1ull << 40},
      {"3PB", 3000000000000000ull},
      {"2PiB", 2ull << 50},
  };
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    size_t b = 0;
    CHECK_STATUS(dmem_size_parse(ok[i].text, &b, NULL), DMEM_OK);
    CHECK_UEQ(b, (size_t)ok[i].bytes);
  }
  static const char *const bad[] = {"8GiBB", "8iB", "8Bi", "8 G B", "1.5", "0.5KiB x", "GB", "8E"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    size_t b = 7;
    CHECK_STATUS(dmem_size_parse(bad[i], &b, NULL), DMEM_ERR_CONFIG);
    CHECK_UEQ(b, 7);
  }
  size_t b = 0;
  CHECK_STATUS(dmem_size_parse("8Q", &b, NULL), DMEM_ERR_CONFIG);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "powers of 1000") != NULL);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "KiB") != NULL);
  /* DMEM_DEVICE_LIMIT=8GB is 8 * 10^9 bytes, as device_memory_limit="8GB" is for Dask */
  clear_env();
  setenv("DMEM_DEVICE_LIMIT", "8GB", 1);
  setenv("DMEM_HOST_LIMIT", "2GiB", 1);
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.device_limit, (size_t)8000000000ull);
  CHECK_UEQ(cfg.host_limit, (size_t)2 << 30);
  clear_env();
}

TEST_CASE(oom_wait_from_env_and_struct) {
  clear_env();
  setenv("DMEM_OOM_WAIT", "250", 1);
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.oom_wait_ms, 250);
  setenv("DMEM_OOM_WAIT", "0", 1);
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.oom_wait_ms, 0);
  const char *bad[] = {"-1", "5s", "abc", "3600001", "1.5"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    dmem_runtime_t *rt = (dmem_runtime_t *)0x1;
    CHECK_STATUS(create_with_env("DMEM_OOM_WAIT", bad[i], &rt), DMEM_ERR_CONFIG);
    CHECK_TRUE(rt == (dmem_runtime_t *)0x1);
    CHECK_TRUE(strstr(dmem_last_error_detail(), "DMEM_OOM_WAIT") != NULL);
  }
  clear_env();
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.oom_wait_ms = 3600001;
  dmem_runtime_t *rt = NULL;
  CHECK_STATUS(dmem_runtime_create(&cfg, &rt), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(rt == NULL);
}

/* DMEM_HOST_RESERVE and DMEM_HOST_PIN: applied when well formed, a
 * DMEM_ERR_CONFIG naming the variable otherwise; defaults 0 and auto. */
TEST_CASE(host_reserve_and_pin_from_env) {
  clear_env();
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_reserve, 0);
  CHECK_EQ(cfg.host_pin, DMEM_HOST_PIN_AUTO);
  setenv("DMEM_HOST_RESERVE", "1.5GiB", 1);
  setenv("DMEM_HOST_PIN", "register", 1);
  dmem_config_init(&cfg);
  CHECK_UEQ(cfg.host_reserve, (size_t)3 << 29);
  CHECK_EQ(cfg.host_pin, DMEM_HOST_PIN_REGISTER);
  setenv("DMEM_HOST_PIN", "MALLOC_HOST", 1);
  dmem_config_init(&cfg);
  CHECK_EQ(cfg.host_pin, DMEM_HOST_PIN_MALLOC_HOST);
  const char *bad_reserve[] = {"-1", "10%", "abc", "1.5X"};
  for (size_t i = 0; i < sizeof bad_reserve / sizeof bad_reserve[0]; i++) {
    dmem_runtime_t *rt = (dmem_runtime_t *)0x1;
    CHECK_STATUS(create_with_env("DMEM_HOST_RESERVE", bad_reserve[i], &rt), DMEM_ERR_CONFIG);
    CHECK_TRUE(rt == (dmem_runtime_t *)0x1);
    CHECK_TRUE(strstr(dmem_last_error_detail(), "DMEM_HOST_RESERVE") != NULL);
  }
  const char *bad_pin[] = {"mmap", "1", "registered"};
  for (size_t i = 0; i < sizeof bad_pin / sizeof bad_pin[0]; i++) {
    dmem_runtime_t *rt = (dmem_runtime_t *)0x1;
    CHECK_STATUS(create_with_env("DMEM_HOST_PIN", bad_pin[i], &rt), DMEM_ERR_CONFIG);
    CHECK_TRUE(rt == (dmem_runtime_t *)0x1);
    CHECK_TRUE(strstr(dmem_last_error_detail(), "DMEM_HOST_PIN") != NULL);
  }
  /* the host backend takes the reserve from the heap at create */
  dmem_runtime_t *rt = NULL;
  REQUIRE_OK(create_with_env("DMEM_HOST_RESERVE", "6MiB", &rt));
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_GE(s.host_pool_reserved, (size_t)6 << 20);
  dmem_runtime_destroy(rt);
  clear_env();
}

/* DMEM_EVICTION_POLICY: reuse or lru (any case) into eviction_policy
 * (default DMEM_EVICTION_DEFAULT, in effect DMEM_EVICTION_REUSE, as
 * dmem_runtime_info reports); malformed: DMEM_ERR_CONFIG naming the
 * variable, unless the config gives the policy (then ignored); an
 * eviction_policy outside the enum: DMEM_ERR_INVALID_ARGUMENT. */
TEST_CASE(eviction_policy_from_env_and_struct) {
  clear_env();
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  CHECK_EQ(cfg.eviction_policy, DMEM_EVICTION_DEFAULT);
  cfg.backend = DMEM_BACKEND_HOST;
  dmem_runtime_t *rt = NULL;
  REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
  dmem_runtime_info_t info;
  info.struct_size = sizeof info;
  CHECK_OK(dmem_runtime_info(rt, &info));
  CHECK_EQ(info.eviction_policy, DMEM_EVICTION_REUSE);
  dmem_runtime_destroy(rt);
  setenv("DMEM_EVICTION_POLICY", "LRU", 1);
  dmem_config_init(&cfg);
  CHECK_EQ(cfg.eviction_policy, DMEM_EVICTION_LRU);
  REQUIRE_OK(create_with_env("DMEM_EVICTION_POLICY", "lru", &rt));
  CHECK_OK(dmem_runtime_info(rt, &info));
  CHECK_EQ(info.eviction_policy, DMEM_EVICTION_LRU);
  dmem_runtime_destroy(rt);
  setenv("DMEM_EVICTION_POLICY", "reuse", 1);
  dmem_config_init(&cfg);
  CHECK_EQ(cfg.eviction_policy, DMEM_EVICTION_REUSE);
  const char *bad[] = {"mru", "1", "lru,reuse"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    rt = (dmem_runtime_t *)0x1;
    CHECK_STATUS(create_with_env("DMEM_EVICTION_POLICY", bad[i], &rt), DMEM_ERR_CONFIG);
    CHECK_TRUE(rt == (dmem_runtime_t *)0x1);
    CHECK_TRUE(strstr(dmem_last_error_detail(), "DMEM_EVICTION_POLICY") != NULL);
  }
  /* the config gives the policy: the malformed variable is ignored */
  setenv("DMEM_EVICTION_POLICY", "mru", 1);
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.eviction_policy = DMEM_EVICTION_LRU;
  rt = NULL;
  REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
  dmem_runtime_destroy(rt);
  clear_env();
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.eviction_policy = (dmem_eviction_policy_t)3;
  rt = (dmem_runtime_t *)0x1;
  CHECK_STATUS(dmem_runtime_create(&cfg, &rt), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(rt == (dmem_runtime_t *)0x1);
}

/* DMEM_SPILL_AHEAD sets the marks: "N%,M%" both, "N%" the high one with
 * the low one 5 points under it, "off" none. */
TEST_CASE(env_spill_ahead_marks) {
  clear_env();
  setenv("DMEM_SPILL_AHEAD", "80%,50%", 1);
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  CHECK_TRUE(cfg.spill_ahead == 0.8 && cfg.spill_ahead_low == 0.5);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.device_limit = 100 << 20;
  dmem_runtime_t *rt = NULL;
  REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
  dmem_stats_t s;
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.spill_ahead_high, 80 << 20);
  CHECK_UEQ(s.spill_ahead_low, 50 << 20);
  dmem_runtime_destroy(rt);
  setenv("DMEM_SPILL_AHEAD", "40%", 1);
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.device_limit = 100 << 20;
  REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
  CHECK_OK(dmem_stats(rt, &s));
  CHECK_UEQ(s.spill_ahead_high, 40 << 20);
  CHECK_UEQ(s.spill_ahead_low, 35 << 20);
  dmem_runtime_destroy(rt);
  setenv("DMEM_SPILL_AHEAD", "off", 1);
  dmem_config_init(&cfg);
  CHECK_TRUE(cfg.spill_ahead == 0);
  clear_env();
}

/* dmem_runtime_info reports the spill-ahead trigger in effect: demand by
 * default, always from DMEM_SPILL_AHEAD_TRIGGER or the config. */
TEST_CASE(runtime_info_reports_the_spill_ahead_trigger) {
  dmem_runtime_t *rt = NULL;
  dmem_runtime_info_t info;
  info.struct_size = sizeof info;
  REQUIRE_OK(create_with_env("DMEM_SPILL_AHEAD", "80%", &rt));
  CHECK_OK(dmem_runtime_info(rt, &info));
  CHECK_EQ(info.spill_ahead_trigger, DMEM_SPILL_AHEAD_DEMAND);
  dmem_runtime_destroy(rt);
  REQUIRE_OK(create_with_env("DMEM_SPILL_AHEAD_TRIGGER", "always", &rt));
  CHECK_OK(dmem_runtime_info(rt, &info));
  CHECK_EQ(info.spill_ahead_trigger, DMEM_SPILL_AHEAD_ALWAYS);
  dmem_runtime_destroy(rt);
  clear_env();
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.spill_ahead_trigger = DMEM_SPILL_AHEAD_ALWAYS;
  REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
  CHECK_OK(dmem_runtime_info(rt, &info));
  CHECK_EQ(info.spill_ahead_trigger, DMEM_SPILL_AHEAD_ALWAYS);
  dmem_runtime_destroy(rt);
}

/* device_limit_fraction of a capacity near SIZE_MAX: f * capacity rounds
 * up to 2^64 as a double, and its conversion to size_t gave 0 (a limit of
 * 0: every allocation failed), the spill-ahead marks too. They saturate
 * at the capacity (the high mark just under the limit). */
TEST_CASE(huge_capacity_fraction_saturates) {
  const double fracs[] = {1.0, 0.9999999999, 0.5};
  for (int i = 0; i < 3; i++) {
    dmem_config_t cfg;
    dmem_config_init(&cfg);
    cfg.backend = DMEM_BACKEND_HOST;
    cfg.host_backend_capacity = SIZE_MAX;
    cfg.device_limit_fraction = fracs[i];
    cfg.spill_ahead = 0.99;
    cfg.spill_ahead_low = 0.5;
    dmem_runtime_t *rt = NULL;
    REQUIRE_OK(dmem_runtime_create(&cfg, &rt));
    dmem_stats_t s;
    CHECK_OK(dmem_stats(rt, &s));
    double want = (double)SIZE_MAX * fracs[i];
    CHECK_TRUE(s.device_limit > 0);
    CHECK_TRUE((double)s.device_limit >= want * 0.999 && (double)s.device_limit <= want * 1.001);
    CHECK_TRUE(s.spill_ahead_high > s.spill_ahead_low);
    CHECK_TRUE(s.spill_ahead_high < s.device_limit);
    CHECK_TRUE((double)s.spill_ahead_low >= (double)s.device_limit * 0.49);
    dmem_handle_t h;
    CHECK_OK(dmem_buffer_alloc(rt, (size_t)1 << 20, 0, &h));
    CHECK_OK(dmem_buffer_free(rt, h));
    dmem_runtime_destroy(rt);
  }
}
