/*
 * dmem/config.h - runtime creation parameters and environment variables.
 *
 * Environment variables, read by dmem_config_init into the fields they name.
 * An explicit value wins: a field the caller sets after dmem_config_init
 * replaces what the environment gave. A malformed variable leaves its field
 * at the default, and dmem_runtime_create, which reads the environment
 * again, fails with DMEM_ERR_CONFIG (the detail names the variable) unless
 * the field (both fields, for DMEM_DEVICE_LIMIT and DMEM_SPILL_AHEAD) no
 * longer holds its default: then the caller gave the value, and the
 * malformed variable is ignored with a warning (logged at warn when the
 * config's log_level allows). A field set explicitly to its default value
 * cannot be told from one left alone: the malformed variable is an error
 * then. DMEM_FAULT_INJECT, which has no field, is an error when malformed.
 * Sizes are read as Dask's parse_bytes reads them (dmem_size_parse): a
 * K/M/G/T/P suffix alone or with B is a power of 1000 ("8G" = "8GB" =
 * 8 * 10^9 bytes), Ki/Mi/Gi/Ti/Pi alone or with B a power of 1024 ("8GiB" =
 * 8 * 2^30); no suffix or "B": bytes.
 *   DMEM_BACKEND       auto | cuda | host
 *   DMEM_DEVICE        device ordinal (0..1023)
 *   DMEM_DEVICE_LIMIT  bytes, with an optional unit suffix ("40GB", "40GiB"),
 *                      or "N%" of the device's capacity (0 < N <= 100); a
 *                      limit above the capacity is clamped to it (logged at
 *                      warn)
 *   DMEM_HOST_LIMIT    bytes, with an optional unit suffix; 0 = unlimited:
 *                      the host tier's size, beyond which the least recently
 *                      used host-tier buffers are pushed down to disk
 *                      (see dmem_config_t.host_limit)
 *   DMEM_HOST_BURST    N% (0 <= N <= 100): how far past host_limit the host
 *                      tier may grow while the push-down to disk catches up
 *                      (see dmem_config_t.host_burst; default 50%)
 *   DMEM_HOST_HEADROOM bytes, with an optional unit suffix: the most free
 *                      pinned bytes the pinned pool keeps ahead of demand
 *                      (see dmem_config_t.host_headroom; default 4GiB;
 *                      0: the pool grows only by what spills need)
 *   DMEM_HOST_RESERVE  bytes, with an optional unit suffix; 0 = none: pinned
 *                      host memory taken at creation and kept until destroy
 *                      (see dmem_config_t.host_reserve)
 *   DMEM_HOST_STAGING  bytes, with an optional unit suffix; 0 = derived: the
 *                      pinned memory for copies in flight beside the host
 *                      tier (see dmem_config_t.host_staging)
 *   DMEM_HOST_PIN      auto | malloc_host | register: how the CUDA backend
 *                      pins host memory (see dmem_config_t.host_pin)
 *   DMEM_SPILL_DIR     directory under which the private spill directory is
 *                      made (default: $TMPDIR or /tmp); dmem_runtime_create
 *                      checks that it is a writable directory
 *   DMEM_LOG           off | error | warn | info | debug, or 0..4: the
 *                      runtime's log level (dmem_config_t.log_level); info
 *                      logs the backend chosen and why, the limits, and at
 *                      most one summary a second of spills, unspills,
 *                      push-downs and evictions
 *   DMEM_STATS         0 | 1 | N: 1 prints the runtime's statistics to stderr
 *                      at destroy, or at exit for a runtime never destroyed
 *                      (the default runtimes); N >= 2 also every N seconds
 *                      (dmem_config_t.print_stats, stats_interval_s)
 *   DMEM_TRACE         a file name: record a Chrome / Perfetto trace (JSON
 *                      trace event format) of spills, unspills, push-downs,
 *                      eviction passes, allocations that waited for room
 *                      and locks that waited, one track per tier and per
 *                      stream, for every runtime of the process (the first
 *                      runtime created while it is set starts it); the file
 *                      is written whole at each runtime's destroy and at
 *                      exit (docs/observability.md)
 *   DMEM_HOST_CAPACITY simulated device capacity of the host backend (bytes,
 *                      with an optional unit suffix)
 *   DMEM_OOM_WAIT      milliseconds an allocation waits for moves and stream
 *                      releases in flight before DMEM_ERR_OUT_OF_MEMORY
 *                      (0..3600000; see dmem_config_t.oom_wait_ms)
 *   DMEM_SPILL_AHEAD   spill ahead of need: off | on | N% | N%,M% - when
 *                      device use passes N % of the limit (on: 95 %), a
 *                      background thread spills by policy down to M %
 *                      (default N - 5). Default: on (95 %) on the CUDA
 *                      backend, off on the host backend
 *                      (dmem_config_t.spill_ahead says why).
 *   DMEM_SPILL_AHEAD_TRIGGER  demand | always: when the spill-ahead
 *                      thread spills above its mark: only while waits
 *                      for room arm it (demand, the default), or always
 *                      (dmem_config_t.spill_ahead_trigger)
 *   DMEM_EVICTION_POLICY  reuse | lru: which unlocked buffers eviction
 *                      takes first within a priority class (see
 *                      dmem_config_t.eviction_policy; default reuse)
 *   DMEM_FAULT_INJECT  <call>:<n>[:fatal][:persistent], for testing only:
 *                      fail the n-th call (counted process-wide) of a
 *                      backend function (device_alloc, host_alloc,
 *                      memcpy_async, event_record, ...), of backend_create,
 *                      or of the disk tier's I/O (disk_open, disk_alloc,
 *                      disk_write, disk_read), or of any of them ("any"),
 *                      with the status that call really gives;
 *                      docs/reliability.md, "Fault injection" lists the calls
 */
#ifndef DMEM_CONFIG_H
#define DMEM_CONFIG_H

#include "dmem/types.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dmem_log_level {
  DMEM_LOG_OFF = 0,
  DMEM_LOG_ERROR = 1,
  DMEM_LOG_WARN = 2,
  DMEM_LOG_INFO = 3,
  DMEM_LOG_DEBUG = 4
} dmem_log_level_t;

/** How the CUDA backend gets pinned host memory for its pool (the memory
 *  that holds spilled bytes): dmem_config_t.host_pin, DMEM_HOST_PIN. */
typedef enum dmem_host_pin {
  DMEM_HOST_PIN_AUTO = 0,        /**< the backend's choice: DMEM_HOST_PIN_REGISTER */
  /** cudaMallocHost: 2.5-3 GB/s on the lent H200 (bench/bench_pin.c) */
  DMEM_HOST_PIN_MALLOC_HOST = 1,
  /** mmap with transparent huge pages (madvise), first touched by up to 8
   *  threads, then cudaHostRegister; not inherited by a forked child
   *  (MADV_DONTFORK): 22-24 GB/s on the lent H200 */
  DMEM_HOST_PIN_REGISTER = 2
} dmem_host_pin_t;

/** Which unlocked buffers eviction takes first within a priority class
 *  (lower priorities always go first, and a controller's select_victims
 *  before either): dmem_config_t.eviction_policy, DMEM_EVICTION_POLICY.
 *  docs/design.md, "The eviction policy", says how each works and what it
 *  costs; dmem_buffer_set_priority (buffer.h) states what each promises. */
typedef enum dmem_eviction_policy {
  DMEM_EVICTION_DEFAULT = 0, /**< DMEM_EVICTION_REUSE */
  /** Least recently unlocked first: an LRU stamp per unlock, victims
   *  sorted at each eviction pass (O(buffers log buffers) a pass). */
  DMEM_EVICTION_LRU = 1,
  /** Scan-resistant (hot and cold buffers, promoted by reuse; a mark per
   *  unlock, consumed by the policy): a loop over more buffers than fit
   *  keeps most of them resident instead of evicting each just before its
   *  use; amortised O(1) a victim. */
  DMEM_EVICTION_REUSE = 2
} dmem_eviction_policy_t;

/**
 * Creation parameters. Always start from dmem_config_init(), which sets
 * struct_size so that the struct can grow without breaking callers.
 */
typedef struct dmem_config {
  size_t struct_size;            /**< sizeof(dmem_config_t), set by dmem_config_init */
  dmem_backend_t backend;        /**< default DMEM_BACKEND_AUTO */
  int device;                    /**< CUDA device ordinal, 0..1023; default 0 */
  size_t device_limit;           /**< bytes; 0: device_limit_fraction or the capacity.
                                      Above the capacity (up to SIZE_MAX) it is
                                      clamped to the capacity, with a warning
                                      in the log (dmem_runtime_info gives the
                                      limit in effect) */
  double device_limit_fraction;  /**< 0 < f <= 1: limit = f * capacity (used when device_limit is 0) */
  /** Bytes of spilled data kept in (pinned) host memory; 0: unlimited.
   *  Spills go to the host tier; when it holds more than host_limit, the
   *  runtime's I/O threads move its least recently used buffers (lowest
   *  priority first) to disk in the background, so that no spill or lock
   *  waits for that write. While they catch up the host tier may hold up to
   *  host_limit * host_burst more; past that (the disk slower than the
   *  spills, or failing), and for a buffer larger than host_limit, a spill
   *  goes straight to disk and the spilling thread writes it. */
  size_t host_limit;
  /** Parent of the private spill directory (mode 0700, made on first use
   *  of the disk tier; NULL: $TMPDIR or /tmp). The disk tier keeps its
   *  bytes in one file there that has no name (O_TMPFILE, or unlinked as
   *  soon as it is open; mode 0600), read and written with O_DIRECT where
   *  the filesystem allows it: nothing is left on disk when the process
   *  ends, even by SIGKILL; the directory is removed once the file is open,
   *  so at most a process killed in between leaves it, empty). A relative
   *  path (and a relative $TMPDIR) is taken against the current directory
   *  at dmem_runtime_create: a later chdir does not move it.
   *  dmem_runtime_create checks that it (or $TMPDIR, /tmp) is a directory
   *  it may write. */
  const char *spill_dir;
  /** The runtime's own log level (default DMEM_LOG_WARN); messages go to
   *  stderr as "dmem[level]: ...". dmem_runtime_set_log_level changes it. */
  dmem_log_level_t log_level;
  /** Print statistics to stderr at destroy, or at exit for a runtime that
   *  is never destroyed (the default runtimes). */
  bool print_stats;
  size_t host_backend_capacity;  /**< simulated device memory of the host backend; default 1 GiB */
  /** How long an allocation that finds no room waits for moves and stream
   *  releases already in flight to free some, in milliseconds, before it
   *  gives DMEM_ERR_OUT_OF_MEMORY; default 5000. 0: it does not wait. It
   *  returns as soon as room appears, not at the end of the wait. */
  unsigned oom_wait_ms;
  /** Spill-ahead high-water mark, a fraction of the device limit: above it
   *  a background thread spills by policy (down to spill_ahead_low) so that
   *  allocations rarely wait for a spill. 0: off.
   *  DMEM_SPILL_AHEAD_DEFAULT (the default): 0.95 on the CUDA backend,
   *  with the demand trigger (spill_ahead_trigger), off on the host
   *  backend (its copies are memcpy on the caller's thread). Spilling
   *  whenever use is above the mark shrinks the device's share of a loop
   *  over more than fits (examples/cupy_loop.py moved 1.75 GiB more each
   *  way on an H100); on demand it spills only for callers that waited
   *  for room and stops when it is not ahead of them (docs/design.md,
   *  "Spill-ahead"; bench/ahead_compare has it against off).
   *  "on" in DMEM_SPILL_AHEAD means 0.95. Python: spill_ahead= False,
   *  True (0.95), a fraction, (high, low), or a string as in the
   *  environment. */
  double spill_ahead;
  /** Low-water mark (fraction of the limit, below spill_ahead); 0:
   *  spill_ahead - 0.05. */
  double spill_ahead_low;
  /** Pinned host memory taken by dmem_runtime_create and kept until
   *  destroy, in bytes; 0 (the default): none, the pool grows as spills
   *  need it. Getting pinned memory is slower than the copies it feeds
   *  (22-24 GB/s through DMEM_HOST_PIN_REGISTER, 2.5-3 GB/s through
   *  cudaMallocHost, against 55 GB/s of spills on the lent H200:
   *  docs/benchmarks.md), so a workload that spills gigabytes at once can
   *  wait for the pinning rather than the link. A reserve moves that cost
   *  to creation, as Spark RAPIDS' and RMM's pinned pools do:
   *  creation pins it (several threads at once, chunks of at most 1 GiB)
   *  and fails with DMEM_ERR_HOST_OUT_OF_MEMORY if it cannot. Trims
   *  (dmem_host_trim, the idle trim) never go below it. With host_limit
   *  set, it must fit in the pinned pool's bound (host_limit's host tier
   *  plus staging). The host backend takes it from the C heap. */
  size_t host_reserve;
  /** How the CUDA backend pins host memory (DMEM_HOST_PIN_AUTO). */
  dmem_host_pin_t host_pin;
  /** With host_limit: how far past it, as a fraction of it (0 to 1), the
   *  host tier may grow while the I/O threads push buffers down to disk;
   *  default DMEM_HOST_BURST_DEFAULT (0.5). The pinned pool is bounded by
   *  host_limit * (1 + host_burst) plus staging (a quarter of host_limit,
   *  64 MiB to 1 GiB), and it grows to that bound under sustained
   *  spilling, so this sets the process's pinned memory for a given
   *  host_limit. Less burst keeps more of that memory holding spilled data
   *  (a higher host_limit in the same pinned memory: fewer disk writes), at
   *  the price of spills that go straight to disk sooner when the disk
   *  falls behind. */
  double host_burst;
  /** With print_stats: also print the statistics every this many seconds
   *  (a thread of the runtime's sleeps in between); 0 (the default): only
   *  at destroy or exit. At most 86400. DMEM_STATS=N sets it to N (N >= 2). */
  unsigned stats_interval_s;
  /** The most free pinned host memory the pinned pool keeps ahead of
   *  demand, in bytes; default DMEM_HOST_HEADROOM_DEFAULT (4 GiB). With the
   *  CUDA backend a background thread pins chunks before spills need them,
   *  keeping free the bytes carved in the last 100-200 ms, at least the
   *  backend's minimum chunk (64 MiB) and at most host_headroom; and no
   *  chunk the pool adds, there or for a block that found no room, is
   *  larger than the largest of the block's bytes (rounded up to 2 MiB),
   *  host_headroom and the backend's minimum chunk (otherwise chunks grow
   *  geometrically, up to 1 GiB). The pool then holds at most about
   *  host_headroom (or one minimum chunk) more than its blocks. A smaller
   *  headroom keeps less pinned memory unused, at the price of spills that
   *  pin their own chunk (22-24 GB/s through DMEM_HOST_PIN_REGISTER,
   *  2.5-3 GB/s through cudaMallocHost) instead of finding one pinned
   *  ahead; 0: the pool grows only by what spills need. dmem.dask uses 0
   *  (docs/dask.md). Any value is valid. */
  size_t host_headroom;
  /** Which unlocked buffers eviction takes first within a priority class
   *  (DMEM_EVICTION_DEFAULT: DMEM_EVICTION_REUSE). Any other value:
   *  dmem_runtime_create gives DMEM_ERR_INVALID_ARGUMENT. */
  dmem_eviction_policy_t eviction_policy;
  /** With host_limit: the pinned memory the pinned pool may hold beside the
   *  host tier, for copies in flight (the staging of spills, unspills,
   *  moves to disk and to the controller), in bytes. 0 (the default): a
   *  quarter of host_limit, at least 64 MiB and at most 1 GiB. A value
   *  below 64 MiB is raised to it. The pinned pool is bounded by
   *  host_limit * (1 + host_burst) + host_staging, so with host_burst this
   *  sets the process's pinned memory for a given host_limit; the disk
   *  tier pipelines its reads and writes only from 128 MiB of staging. */
  size_t host_staging;
  /** A retrieve from the host tier into a full device trades places with
   *  one victim of its size (spill/swap.c): the victim's bytes go into the
   *  retrieved buffer's pinned memory, through a small device bounce
   *  buffer, rather than into newly pinned memory. 0 (DMEM_RETRIEVE_SWAP
   *  on), 1 (off: the victim is spilled first, as any eviction) or 2
   *  (pieces, the default: the retrieve takes the victim's device block;
   *  the victim's copy out, into pinned memory of its own as off, and the
   *  retrieved buffer's copy in run piece by piece, each piece in once it
   *  is out, so that both directions of the link start at once). On, no
   *  retrieve pins memory anew, and a loop bound by the link ran 3-5 %
   *  slower than off on an H100 (examples/cupy_loop.py); pieces ran it
   *  4-7 % faster than off (docs/benchmarks.md). On is worth it
   *  where pinned memory, not the link, is what runs short.
   *  DMEM_RETRIEVE_SWAP; no Python keyword. */
  int retrieve_swap;
  /** When the spill-ahead thread spills above its mark (its marks:
   *  spill_ahead): DMEM_SPILL_AHEAD_DEMAND (1, the default) or ALWAYS (0).
   *  ALWAYS: whenever device use is above the mark. DEMAND:
   *  only while it is armed: an allocation or retrieve waited
   *  DMEM_SPILL_AHEAD_ARM_WAIT_US or longer for room (it waited for a
   *  spill: what the thread is there to hide), and since then no wait was
   *  shorter, no wait began (one that does shows the thread is not ahead:
   *  it disarms, and when long holds it off for DMEM_SPILL_AHEAD_ARM_MS,
   *  twice as long each time in a row, up to 64 s), and
   *  DMEM_SPILL_AHEAD_ARM_MS did not pass.
   *  Where on-demand evictions cost the caller nothing (stream-ordered,
   *  as a prefetching loop's are), spilling ahead only shrinks the device's
   *  share: 1.75 GiB more each way for examples/cupy_loop.py, 5 % of its
   *  time on an H100, with ALWAYS.
   *  DMEM_SPILL_AHEAD_TRIGGER=demand|always; Python: spill_ahead_trigger=. */
  int spill_ahead_trigger;
} dmem_config_t;

/** dmem_config_t.spill_ahead_trigger values. */
#define DMEM_SPILL_AHEAD_ALWAYS 0
#define DMEM_SPILL_AHEAD_DEMAND 1
/** DEMAND: how long a wait for room arms the thread (milliseconds) ... */
#define DMEM_SPILL_AHEAD_ARM_MS 1000u
/** ... and how long a wait must be to arm it (microseconds). */
#define DMEM_SPILL_AHEAD_ARM_WAIT_US 1000u

/** dmem_config_t.stats_interval_s: the most it may be (a day). */
#define DMEM_STATS_INTERVAL_MAX 86400u

/** dmem_config_t.host_burst: the default, half the host limit. */
#define DMEM_HOST_BURST_DEFAULT 0.5

/** dmem_config_t.host_headroom: the default, 4 GiB. */
#define DMEM_HOST_HEADROOM_DEFAULT ((size_t)4 << 30)

/** dmem_config_t.spill_ahead: the backend's default. */
#define DMEM_SPILL_AHEAD_DEFAULT (-1.0)

/**
 * The configuration table: one row per option. dmem generates from it the
 * defaults (dmem_config_init), the DMEM_* environment parsing and its
 * errors, the range checks of dmem_runtime_create, the keyword arguments of
 * the Python dmem.Runtime(...) and dmem.configure(...) (and dmem.dask's
 * pass-through of them), and the list that the README's table of
 * environment variables is checked against. Adding an option: a field in
 * dmem_config_t, a row here, the code that uses it, a line of the README's
 * table (docs/design.md, "Adding an option").
 *
 * X(field, also, kind, default, env, keyword, lo, hi, choices, doc):
 *   field     the dmem_config_t field the option sets;
 *   also      a second field the same variable sets (the kinds
 *             size_or_percent, stats, ahead), else field again;
 *   kind      how its values are written:
 *     size             bytes, as dmem_size_parse reads them ("8GB" = 8e9,
 *                      "8GiB" = 2^33); Python: an int or such a str; at
 *                      least lo
 *     size_or_percent  the same, or "N%" (0 < N <= 100) of the device into
 *                      `also` (a fraction; field then 0)
 *     fraction         environment "N%", Python a float, lo..hi (a fraction)
 *     integer          a whole number, lo..hi
 *     choice           one of the names of `choices` ("a|b|c"), each name
 *                      meaning its position there (an empty name: a valid
 *                      value with no name); case-insensitive in the
 *                      environment
 *     log              a choice of `choices`, or "warning", or 0..hi
 *     path             a file system path (any non-empty text)
 *     stats            0 | 1 | N seconds (2..hi): field (bool) and also
 *     ahead            off | on | N% | N%,M% (0 < M < N <= 100): field,
 *                      also; in Python also False | True | a fraction |
 *                      (high, low)
 *   default   the field's default (`also` defaults to 0);
 *   env       the DMEM_* variable, or NULL;
 *   keyword   the Python keyword, or NULL; keyword rows are in the order
 *             dmem.Runtime takes its arguments positionally, so a new one
 *             goes after the last;
 *   lo, hi    the valid range (kinds fraction, integer: lo..hi; size: at
 *             least lo; stats, log: up to hi), checked in the environment
 *             and in Python, and except a size's lo by dmem_runtime_create
 *             (DMEM_ERR_INVALID_ARGUMENT naming the field);
 *   choices   the names of a choice or log option, else NULL;
 *   doc       one line: what it sets.
 */
#define DMEM_CONFIG_OPTIONS(X)                                                                  \
  X(backend, backend, choice, DMEM_BACKEND_AUTO, "DMEM_BACKEND", "backend", 0, 0,               \
    "auto|cuda|host", "backend")                                                               \
  X(device, device, integer, 0, "DMEM_DEVICE", "device", 0, 1023, NULL, "device")               \
  X(device_limit, device_limit_fraction, size_or_percent, 0, "DMEM_DEVICE_LIMIT",               \
    "device_limit", 0, 0, NULL, "device limit")                                                 \
  X(host_limit, host_limit, size, 0, "DMEM_HOST_LIMIT", "host_limit", 0, 0, NULL, "host limit") \
  X(spill_dir, spill_dir, path, NULL, "DMEM_SPILL_DIR", "spill_dir", 0, 0, NULL,                \
    "spill directory")                                                                          \
  X(host_backend_capacity, host_backend_capacity, size, (size_t)1 << 30, "DMEM_HOST_CAPACITY",  \
    "host_capacity", 1, 0, NULL, "host backend capacity")                                       \
  X(host_reserve, host_reserve, size, 0, "DMEM_HOST_RESERVE", "host_reserve", 0, 0, NULL,       \
    "host reserve")                                                                             \
  X(host_burst, host_burst, fraction, DMEM_HOST_BURST_DEFAULT, "DMEM_HOST_BURST", "host_burst", \
    0, 1, NULL, "host burst")                                                                   \
  X(log_level, log_level, log, DMEM_LOG_WARN, "DMEM_LOG", "log_level", 0, 4,                    \
    "off|error|warn|info|debug", "log level")                                                   \
  X(host_headroom, host_headroom, size, DMEM_HOST_HEADROOM_DEFAULT, "DMEM_HOST_HEADROOM",       \
    "host_headroom", 0, 0, NULL, "pinned pool headroom")                                        \
  X(eviction_policy, eviction_policy, choice, DMEM_EVICTION_DEFAULT, "DMEM_EVICTION_POLICY",    \
    "eviction_policy", 0, 0, "|lru|reuse", "eviction policy")                                   \
  X(host_pin, host_pin, choice, DMEM_HOST_PIN_AUTO, "DMEM_HOST_PIN", NULL, 0, 0,                \
    "auto|malloc_host|register", "host pinning")                                                \
  X(oom_wait_ms, oom_wait_ms, integer, 5000, "DMEM_OOM_WAIT", NULL, 0, 3600000, NULL,           \
    "allocation wait")                                                                     \
  X(print_stats, stats_interval_s, stats, false, "DMEM_STATS", NULL, 0, DMEM_STATS_INTERVAL_MAX, \
    NULL, "statistics")                                                                         \
  X(host_staging, host_staging, size, 0, "DMEM_HOST_STAGING", "host_staging", 0, 0, NULL,       \
    "pinned staging")                                                                           \
  X(retrieve_swap, retrieve_swap, choice, 2, "DMEM_RETRIEVE_SWAP", NULL, 0, 0, "on|off|pieces", \
    "retrieve swap")                                                                            \
  X(spill_ahead, spill_ahead_low, ahead, DMEM_SPILL_AHEAD_DEFAULT, "DMEM_SPILL_AHEAD",          \
    "spill_ahead", 0, 0, NULL, "spill-ahead")                                                   \
  X(spill_ahead_trigger, spill_ahead_trigger, choice, DMEM_SPILL_AHEAD_DEMAND,                  \
    "DMEM_SPILL_AHEAD_TRIGGER", "spill_ahead_trigger", 0, 0, "always|demand",                   \
    "spill-ahead trigger")

/**
 * Fill *cfg with defaults, then apply the DMEM_* environment variables whose
 * values are well formed. Malformed values are left at their defaults here and
 * reported by dmem_runtime_create as DMEM_ERR_CONFIG, unless the caller sets
 * the field after this call (see the top of this header). cfg == NULL is
 * ignored. Thread-safe (reads the environment only).
 */
DMEM_API void dmem_config_init(dmem_config_t *cfg);

/**
 * Parse a size the way the DMEM_* environment variables are parsed, which is
 * how Dask's dask.utils.parse_bytes reads sizes: a non-negative number
 * (optionally fractional or with an exponent), optionally followed by a unit,
 * case-insensitive, spaces allowed before it:
 *   - none or "B": bytes ("4096");
 *   - K, M, G, T, P alone or followed by B: powers of 1000 (SI, as Dask
 *     means them): "8G" = "8GB" = 8 * 10^9, "1.5MB" = 1500000;
 *   - Ki, Mi, Gi, Ti, Pi alone or followed by B: powers of 1024 (IEC):
 *     "8Gi" = "8GiB" = 8 * 2^30, "512MiB" = 2^29;
 * or, when fraction_out is not NULL, a percentage "N%" with 0 < N <= 100.
 * The result must be a whole number of bytes below 2^64. (K/M/G/T used to
 * mean powers of 1024: write "8GiB" for what "8G" meant then.)
 *
 * On success *bytes_out is the byte count (0 for a percentage) and, when
 * fraction_out is not NULL, *fraction_out is the fraction (0 for a byte
 * count). Outputs are written only on success.
 *
 * Returns DMEM_OK; DMEM_ERR_CONFIG for a malformed or out-of-range text (the
 * detail names it); DMEM_ERR_INVALID_ARGUMENT when text or bytes_out is NULL.
 * Thread-safe.
 */
DMEM_API dmem_status_t dmem_size_parse(const char *text, size_t *bytes_out, double *fraction_out);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_CONFIG_H */
