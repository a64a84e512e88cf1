/*
 * examples/demo.c - dmem end to end: twice the device limit in spillable
 * buffers, several rounds of stream-ordered work over all of them through the
 * RMMEP-1 entry points, and a check of every byte at the end.
 *
 *   dmem_demo [device_limit_MiB [buffers (>= 8, default 32) [rounds (default 4)]]]
 *
 * The backend is DMEM_BACKEND (default auto: CUDA when a device is present,
 * else the host backend). The device limit defaults to 64 MiB on the host
 * backend and 1 GiB under CUDA (DMEM_DEVICE_LIMIT, when set, wins over the
 * default; an argument wins over both); the buffers together hold twice the
 * limit, so the runtime must spill and unspill to get through a round.
 *
 * The "kernel" of a round is a byte transform T_r(x) = (x ^ key_r) + r, run in
 * stream order:
 *   - host backend: a host function enqueued on the stream
 *     (dmem_stream_enqueue_host) transforms the simulated device memory in
 *     place;
 *   - CUDA: a host function cannot touch device memory, so the launch
 *     function copies the buffer to host scratch (dmem_stream_copy), enqueues the
 *     transform on the same stream, and copies the result back. The scratch is
 *     pageable memory (dmem offers no pinned host allocation, and the demo
 *     stays pure C), and cudaMemcpyAsync from pageable memory reads its
 *     source when it is called, not in stream order (on an H100 with CUDA 13
 *     the demo without the synchronisation got every buffer wrong); so the
 *     launch function synchronises the stream before the copy back.
 *
 * Each round goes over the buffers in waves: one dmem_launch_async per stream
 * with a few handles, then dmem_sync_and_unlock on every stream. One round
 * uses dmem_stream_release instead (no host stall) and completes the
 * releases with dmem_runtime_poll. Exit status 0 when every byte matches.
 */
#define _POSIX_C_SOURCE 200809L

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <dmem/dmem.h>

#define MiB ((size_t)1 << 20)
#define NSTREAMS 2
#define HANDLES_PER_LAUNCH 2
#define RELEASE_ROUND 2 /* the round (1-based) that uses dmem_stream_release */

/* ---- the pattern and the transform ---------------------------------------- */

static const uint64_t LO7 = UINT64_C(0x7F7F7F7F7F7F7F7F);
static const uint64_t HI1 = UINT64_C(0x8080808080808080);
static const uint64_t ONES = UINT64_C(0x0101010101010101);

static uint8_t round_key(unsigned r) { return (uint8_t)(0x9Du * r + 0x37u); }

/* T_r on the eight bytes of a word: xor with key_r, then add r to each byte
 * without carries between bytes (SWAR). */
static uint64_t transform_word(uint64_t x, unsigned r) {
  uint64_t k = ONES * round_key(r);
  uint64_t a = ONES * (uint8_t)r;
  uint64_t y = x ^ k;
  return ((y & LO7) + (a & LO7)) ^ ((y ^ a) & HI1);
}

/* Initial contents of word i of buffer b (splitmix64 of (b, i)). */
static uint64_t initial_word(size_t b, size_t i) {
  uint64_t z = ((uint64_t)b << 40) + (uint64_t)i + UINT64_C(0x9E3779B97F4A7C15);
  z = (z ^ (z >> 30)) * UINT64_C(0xBF58476D1CE4E5B9);
  z = (z ^ (z >> 27)) * UINT64_C(0x94D049BB133111EB);
  return z ^ (z >> 31);
}

/* ---- the "kernel" --------------------------------------------------------- */

/* One buffer's work in one round; also the host function's argument, so it
 * lives until the stream has run it (the demo synchronises every round). */
typedef struct job {
  uint64_t *words; /* device memory (host backend) or host scratch (CUDA) */
  size_t nwords;
  unsigned round;
} job_t;

static void transform_host_fn(void *user) {
  job_t *j = (job_t *)user;
  for (size_t i = 0; i < j->nwords; i++) j->words[i] = transform_word(j->words[i], j->round);
}

typedef struct demo {
  dmem_runtime_t *rt;
  bool cuda;
  size_t nbuf, buf_size, nwords;
  unsigned rounds;
  dmem_handle_t *h;
  job_t *jobs;                /* one per buffer */
  dmem_stream_t s[NSTREAMS];
  uint64_t *scratch[NSTREAMS]; /* host scratch, one buffer's worth per stream */
  uint64_t *expect;            /* verification: expected words of one buffer */
} demo_t;

/* What dmem_launch_async hands the launch function. */
typedef struct launch_arg {
  demo_t *d;
  int stream_index;
  const size_t *buffers; /* buffer indices, parallel to dev_ptrs */
  unsigned round;
} launch_arg_t;

static dmem_status_t launch_fn(void *user, dmem_stream_t s, void *const *dev_ptrs, size_t n) {
  launch_arg_t *a = (launch_arg_t *)user;
  demo_t *d = a->d;
  for (size_t k = 0; k < n; k++) {
    job_t *j = &d->jobs[a->buffers[k]];
    j->nwords = d->nwords;
    j->round = a->round;
    if (!d->cuda) {
      j->words = (uint64_t *)dev_ptrs[k];
      dmem_status_t st = dmem_stream_enqueue_host(d->rt, s, transform_host_fn, j);
      if (st != DMEM_OK) return st;
      continue;
    }
    j->words = d->scratch[a->stream_index];
    dmem_status_t st = dmem_stream_copy(d->rt, j->words, dev_ptrs[k], d->buf_size, s);
    if (st == DMEM_OK) st = dmem_stream_enqueue_host(d->rt, s, transform_host_fn, j);
    /* the copy back reads pageable scratch: wait for the transform first */
    if (st == DMEM_OK) st = dmem_stream_synchronize(d->rt, s);
    if (st == DMEM_OK) st = dmem_stream_copy(d->rt, dev_ptrs[k], j->words, d->buf_size, s);
    if (st != DMEM_OK) return st;
  }
  return DMEM_OK;
}

/* ---- helpers -------------------------------------------------------------- */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void report(const char *what, dmem_status_t st, int line) {
  fprintf(stderr, "demo: %s failed (line %d): %s: %s [%s]\n", what, line, dmem_status_name(st),
          dmem_status_string(st), dmem_last_error_detail());
}

#define TRY(call)                        \
  do {                                   \
    dmem_status_t st_ = (call);          \
    if (st_ != DMEM_OK) {                \
      report(#call, st_, __LINE__);      \
      return 1;                          \
    }                                    \
  } while (0)

static int parse_size_arg(const char *s, size_t *out) {
  char *end = NULL;
  unsigned long long v = strtoull(s, &end, 10);
  if (!end || *end || v == 0) return 1;
  *out = (size_t)v;
  return 0;
}

/* Copy buffer b's bytes to host memory `dst` through lock / copy / unlock. */
static int read_buffer(demo_t *d, size_t b, void *dst) {
  void *p = NULL;
  TRY(dmem_buffer_lock(d->rt, d->h[b], d->s[0], &p));
  TRY(dmem_stream_copy(d->rt, dst, p, d->buf_size, d->s[0]));
  TRY(dmem_stream_synchronize(d->rt, d->s[0]));
  TRY(dmem_buffer_unlock(d->rt, d->h[b]));
  return 0;
}

/* ---- the phases ------------------------------------------------------------- */

static int fill_all(demo_t *d) {
  for (size_t b = 0; b < d->nbuf; b++) {
    TRY(dmem_buffer_alloc(d->rt, d->buf_size, DMEM_ALLOC_DEFAULT, &d->h[b]));
    uint64_t *stage = d->scratch[0];
    for (size_t i = 0; i < d->nwords; i++) stage[i] = initial_word(b, i);
    void *p = NULL;
    TRY(dmem_buffer_lock(d->rt, d->h[b], d->s[0], &p));
    TRY(dmem_stream_copy(d->rt, p, stage, d->buf_size, d->s[0]));
    TRY(dmem_stream_synchronize(d->rt, d->s[0]));
    TRY(dmem_buffer_unlock(d->rt, d->h[b]));
  }
  return 0;
}

static int run_round(demo_t *d, unsigned r) {
  bool release = r == RELEASE_ROUND;
  size_t per_wave = (size_t)NSTREAMS * HANDLES_PER_LAUNCH;
  size_t idx[NSTREAMS][HANDLES_PER_LAUNCH];
  dmem_handle_t hs[NSTREAMS][HANDLES_PER_LAUNCH];
  launch_arg_t args[NSTREAMS];
  for (size_t w = 0; w < d->nbuf; w += per_wave) {
    for (int si = 0; si < NSTREAMS; si++) {
      size_t n = 0;
      for (size_t k = 0; k < HANDLES_PER_LAUNCH; k++) {
        size_t pos = w + (size_t)si * HANDLES_PER_LAUNCH + k;
        if (pos >= d->nbuf) break;
        /* even rounds walk the buffers backwards: LRU then keeps some warm */
        size_t b = (r % 2 == 0) ? d->nbuf - 1 - pos : pos;
        idx[si][n] = b;
        hs[si][n] = d->h[b];
        n++;
      }
      if (n == 0) continue;
      args[si] = (launch_arg_t){d, si, idx[si], r};
      TRY(dmem_launch_async(d->rt, d->s[si], hs[si], n, launch_fn, &args[si]));
    }
    for (int si = 0; si < NSTREAMS; si++) {
      if (release)
        TRY(dmem_stream_release(d->rt, d->s[si]));
      else
        TRY(dmem_sync_and_unlock(d->rt, d->s[si]));
    }
  }
  if (release) {
    /* Wait for the work, then let the runtime complete the releases. */
    for (int si = 0; si < NSTREAMS; si++) TRY(dmem_stream_synchronize(d->rt, d->s[si]));
    TRY(dmem_runtime_poll(d->rt));
    for (size_t b = 0; b < d->nbuf; b++) {
      dmem_buffer_info_t info;
      TRY(dmem_buffer_info(d->rt, d->h[b], &info));
      if (info.lock_count != 0) {
        fprintf(stderr,
                "demo: buffer %zu still has %u lock(s) after its stream finished and "
                "dmem_runtime_poll\n",
                b, info.lock_count);
        return 1;
      }
    }
  }
  return 0;
}

static int verify_all(demo_t *d, size_t *bad_buffers_out) {
  size_t bad_buffers = 0;
  uint64_t *got = d->scratch[0];
  for (size_t b = 0; b < d->nbuf; b++) {
    for (size_t i = 0; i < d->nwords; i++) {
      uint64_t x = initial_word(b, i);
      for (unsigned r = 1; r <= d->rounds; r++) x = transform_word(x, r);
      d->expect[i] = x;
    }
    if (read_buffer(d, b, got) != 0) return 1;
    if (memcmp(got, d->expect, d->buf_size) != 0) {
      const unsigned char *g = (const unsigned char *)got, *e = (const unsigned char *)d->expect;
      size_t first = 0, nbad = 0;
      for (size_t k = 0; k < d->buf_size; k++)
        if (g[k] != e[k] && nbad++ == 0) first = k;
      fprintf(stderr, "demo: buffer %zu: %zu bad bytes, first at %zu (got 0x%02x, want 0x%02x)\n",
              b, nbad, first, g[first], e[first]);
      bad_buffers++;
    }
  }
  *bad_buffers_out = bad_buffers;
  return 0;
}

static int print_stats(demo_t *d) {
  dmem_stats_t s;
  TRY(dmem_stats(d->rt, &s));
  printf("stats: limit %zu MiB, used %zu MiB, host %zu MiB, disk %zu MiB, %zu buffers\n",
         s.device_limit / MiB, s.device_used / MiB, s.host_used / MiB, s.disk_used / MiB,
         s.buffer_count);
  printf("stats: spills %" PRIu64 " (%.1f MiB, %.3f s), unspills %" PRIu64
         " (%.1f MiB, %.3f s)\n",
         s.spill_count, (double)s.bytes_spilled / (double)MiB, s.seconds_spilling,
         s.unspill_count, (double)s.bytes_unspilled / (double)MiB, s.seconds_unspilling);
  printf("stats: on-demand evictions %" PRIu64 ", cancelled spills %" PRIu64 "\n",
         s.oom_evictions, s.cancelled_spills);
  if (s.spill_count == 0 || s.unspill_count == 0 || s.oom_evictions == 0) {
    fprintf(stderr, "demo: expected spills, unspills and on-demand evictions with %zu MiB "
                    "of buffers under a %zu MiB limit\n",
            d->nbuf * d->buf_size / MiB, s.device_limit / MiB);
    return 1;
  }
  return 0;
}

/* ---- main ------------------------------------------------------------------- */

static int run_demo(demo_t *d) {
  double t0 = now_s();
  if (fill_all(d) != 0) return 1;
  printf("filled %zu buffers of %zu KiB in %.2f s\n", d->nbuf, d->buf_size >> 10, now_s() - t0);
  for (unsigned r = 1; r <= d->rounds; r++) {
    double t = now_s();
    if (run_round(d, r) != 0) return 1;
    printf("round %u (%s): %.2f s\n", r,
           r == RELEASE_ROUND ? "dmem_stream_release + dmem_runtime_poll" : "dmem_sync_and_unlock",
           now_s() - t);
  }
  size_t bad = 0;
  if (verify_all(d, &bad) != 0) return 1;
  if (print_stats(d) != 0) return 1;
  if (bad) {
    fprintf(stderr, "demo: FAILED, %zu of %zu buffers hold wrong bytes\n", bad, d->nbuf);
    return 1;
  }
  printf("demo: OK, %zu buffers verified (%.2f s)\n", d->nbuf, now_s() - t0);
  return 0;
}

static int create_runtime(demo_t *d, size_t arg_limit) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  bool env_limit = getenv("DMEM_DEVICE_LIMIT") != NULL;
  if (arg_limit) cfg.device_limit = arg_limit;
  else if (!env_limit) cfg.device_limit = 64 * MiB; /* host default; CUDA: see below */
  TRY(dmem_runtime_create(&cfg, &d->rt));
  d->cuda = dmem_runtime_backend(d->rt) == DMEM_BACKEND_CUDA;
  if (d->cuda && !arg_limit && !env_limit) {
    dmem_runtime_destroy(d->rt);
    d->rt = NULL;
    cfg.device_limit = 1024 * MiB;
    TRY(dmem_runtime_create(&cfg, &d->rt));
  }
  return 0;
}

int main(int argc, char **argv) {
  size_t arg_limit_mib = 0, nbuf = 32, rounds = 4;
  if ((argc > 1 && parse_size_arg(argv[1], &arg_limit_mib)) ||
      (argc > 2 && parse_size_arg(argv[2], &nbuf)) ||
      (argc > 3 && parse_size_arg(argv[3], &rounds)) || argc > 4 || rounds > 1000 ||
      nbuf < 2 * NSTREAMS * HANDLES_PER_LAUNCH) {
    /* A wave locks NSTREAMS * HANDLES_PER_LAUNCH buffers at once; with fewer
     * than twice that many buffers a wave would need more than the limit. */
    fprintf(stderr, "usage: %s [device_limit_MiB [buffers (>= %d) [rounds]]]\n", argv[0],
            2 * NSTREAMS * HANDLES_PER_LAUNCH);
    return 2;
  }
  demo_t d;
  memset(&d, 0, sizeof d);
  d.nbuf = nbuf;
  d.rounds = (unsigned)rounds;
  int rc = 1;
  if (create_runtime(&d, arg_limit_mib * MiB) != 0) goto out;

  dmem_stats_t s;
  dmem_status_t st = dmem_stats(d.rt, &s);
  if (st != DMEM_OK) {
    report("dmem_stats", st, __LINE__);
    goto out_runtime;
  }
  /* Twice the limit in total, each buffer a whole number of 4 KiB pages. */
  d.buf_size = (2 * s.device_limit / d.nbuf) & ~(size_t)4095;
  if (d.buf_size == 0) {
    fprintf(stderr, "demo: limit %zu too small for %zu buffers\n", s.device_limit, d.nbuf);
    goto out_runtime;
  }
  d.nwords = d.buf_size / sizeof(uint64_t);
  printf("backend: %s; device limit %zu MiB (capacity %zu MiB); %zu buffers x %zu KiB = %zu MiB; "
         "%u rounds on %d streams\n",
         d.cuda ? "cuda" : "host", s.device_limit / MiB, s.device_capacity / MiB, d.nbuf,
         d.buf_size >> 10, d.nbuf * d.buf_size / MiB, d.rounds, NSTREAMS);

  d.h = calloc(d.nbuf, sizeof *d.h);
  d.jobs = calloc(d.nbuf, sizeof *d.jobs);
  d.expect = malloc(d.buf_size);
  for (int i = 0; i < NSTREAMS; i++) d.scratch[i] = malloc(d.buf_size);
  if (!d.h || !d.jobs || !d.expect || !d.scratch[0] || !d.scratch[1]) {
    fprintf(stderr, "demo: out of host memory\n");
    goto out_memory;
  }
  int made = 0;
  for (; made < NSTREAMS; made++) {
    st = dmem_stream_create(d.rt, &d.s[made]);
    if (st != DMEM_OK) {
      report("dmem_stream_create", st, __LINE__);
      goto out_streams;
    }
  }

  rc = run_demo(&d);

  /* On failure buffers may still be registered: unlock them so the streams
   * can be destroyed. */
  for (int i = 0; i < NSTREAMS; i++) {
    st = dmem_sync_and_unlock(d.rt, d.s[i]);
    if (st != DMEM_OK) {
      report("dmem_sync_and_unlock", st, __LINE__);
      rc = 1;
    }
  }
  for (size_t b = 0; b < d.nbuf; b++) {
    if (d.h[b] == DMEM_HANDLE_NULL) continue;
    st = dmem_buffer_free(d.rt, d.h[b]);
    if (st != DMEM_OK) {
      report("dmem_buffer_free", st, __LINE__);
      rc = 1;
    }
  }
out_streams:
  for (int i = made - 1; i >= 0; i--) {
    st = dmem_stream_destroy(d.rt, d.s[i]);
    if (st != DMEM_OK) {
      report("dmem_stream_destroy", st, __LINE__);
      rc = 1;
    }
  }
out_memory:
  for (int i = 0; i < NSTREAMS; i++) free(d.scratch[i]);
  free(d.expect);
  free(d.jobs);
  free(d.h);
out_runtime:
  dmem_runtime_destroy(d.rt);
out:
  return rc;
}
