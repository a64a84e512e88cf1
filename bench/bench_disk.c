/*
 * bench/bench_disk.c - throughput of dmem's disk tier against a plain
 * sequential dd-like pwrite/pread of the same directory with the same
 * sizes, measured in the same run:
 *
 *   dmem write   dmem_buffer_spill(h, DMEM_TIER_DISK) of host-tier buffers, one
 *                after the other from one thread: the host -> disk move the
 *                push-down makes (extent reservation, chunked pwrite, the
 *                bookkeeping)
 *   raw write    one file in the same directory, the same mode (O_DIRECT
 *                when dmem's file got it, else buffered), one pwrite per
 *                buffer (pieces of at most 1 GiB), each from its own memory
 *                as dmem writes each from its host copy: n buffers in one
 *                aligned allocation, of the kind dmem's host memory is
 *                (under CUDA advised to use huge pages, as the pinned pool
 *                is; on the host backend not). One buffer written n times,
 *                as before, stayed hot: with 4 KiB pages, 1 MiB pwrites
 *                from 128 distinct buffers ran at 0.80 of the same pwrites
 *                from one (ext4 in CI); with huge pages at 1.00.
 *   dmem read    dmem_buffer_unspill(h, stream) of the disk-tier buffers, then one
 *                dmem_stream_synchronize: disk -> pinned staging -> device,
 *                the host -> device copies ordered on the stream
 *   raw read     one pread per buffer into an aligned buffer
 *
 * and prints dmem/raw for each (target: >= 0.90), and beside it dmem's
 * throughput counting only the time in its disk I/O (dmem_stats:
 * seconds_host_to_disk, seconds_disk_to_device), which tells the I/O from
 * the bookkeeping and the host -> device copies (a CPU memcpy competing for
 * the cores on the host backend; DMA under CUDA). Each repetition is a
 * pair: a new runtime (so a new spill file) and a new raw file, set up
 * untimed, then the writes in batches of about 32 MiB, dmem's batch and
 * raw's batch of the same buffers in turn, then the reads alike; each
 * side's time is the sum of its batches, and which side goes first
 * alternates from batch to batch and from pair to pair. A ratio is the
 * median of the pairs' own ratios (their range is printed under the row);
 * the throughputs are medians. Before, each side ran its whole phase (a
 * GiB, about half a second) in turn, and the disk's own swings of a second
 * or so went to one side: one pair's ratio read 0.6-1.9 on an H100
 * machine's virtio disk, and the worst row of a median of 3 pairs
 * 0.60-0.90 in four runs. Each phase starts after a syncfs of the
 * directory's filesystem (the journal and the discards of the blocks the
 * setup or an earlier file freed are done, not charged to the phase).
 * --reps: pairs, default 5, at most 31. Backend: DMEM_BACKEND (auto: CUDA
 * when a device is present), so the same binary runs in CI on the host
 * backend (--quick) and on the GPU machine.
 *
 *   bench_disk [--quick] [--dir DIR] [--total BYTES] [--reps N] [--size BYTES]
 *
 * --size: that buffer size alone (default: 1, 8, 64 and 256 MiB).
 * --dir: parent of the spill directory and of the raw file (default:
 * DMEM_SPILL_DIR, $TMPDIR or /tmp). --total: bytes per buffer size
 * (default 2G; --quick 32M). Without --quick each ratio is also printed
 * as `RESULT bench_disk.write.<bytes>=`, `RESULT bench_disk.read.<bytes>=`
 * and `RESULT bench_disk.worst=` (scripts/gpu-test judges the worst
 * against 0.90: scripts/gpu_targets.py). Exit 1 on any dmem or I/O error
 * (never on speed), 77 when DMEM_BACKEND asks for a device that is not
 * there.
 */
#define _GNU_SOURCE

#include <errno.h>
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define BENCH_NAME "bench_disk"
#include "bench_common.h"

#define MiB ((size_t)1 << 20)
#define ALIGN ((size_t)4096)
#define RAW_PIECE ((size_t)1 << 30)
#define HUGE ((size_t)2 << 20)
#define MAX_REPS 31
#define BATCH ((size_t)32 << 20) /* bytes a side moves before the other's turn */

static const char *g_dir;

static void die_errno(const char *what) {
  fprintf(stderr, "bench_disk: %s: %s\n", what, strerror(errno));
  exit(1);
}

static size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

/* Before each timed phase: the filesystem's pending work (journal commits,
 * the discards of freed blocks) done, whichever side left it. */
static void settle(void) {
  int fd = open(g_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) die_errno("open the directory");
  if (syncfs(fd) != 0) die_errno("syncfs");
  close(fd);
}

/* ---- raw: a plain sequential pwrite/pread of one file ------------------------------ */

static int raw_open(bool direct) {
  int fd = open(g_dir, O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) {
    char path[4200];
    snprintf(path, sizeof path, "%s/bench-disk-XXXXXX", g_dir);
    fd = mkostemp(path, O_CLOEXEC);
    if (fd < 0) die_errno("raw file");
    unlink(path);
  }
  if (direct) {
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_DIRECT) != 0) die_errno("raw file: O_DIRECT");
  }
  return fd;
}

static void raw_io(int fd, bool write, char *buf, size_t len, off_t off) {
  size_t done = 0;
  while (done < len) {
    size_t piece = len - done < RAW_PIECE ? len - done : RAW_PIECE;
    ssize_t r = write ? pwrite(fd, buf + done, piece, off + (off_t)done)
                      : pread(fd, buf + done, piece, off + (off_t)done);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      if (r == 0) errno = EIO;
      die_errno(write ? "raw pwrite" : "raw pread");
    }
    done += (size_t)r;
  }
}

/* n buffers of `size` bytes, each from its own memory, written to one new
 * file and read back into one buffer (as a retrieve reads into staging it
 * reuses). */
typedef struct {
  int fd;
  char *src, *buf;
  size_t stride, len;
} raw_side_t;

static void raw_setup(raw_side_t *r, size_t size, size_t n, bool direct, bool huge) {
  r->stride = round_up(size, ALIGN); /* O_DIRECT wants aligned offsets and lengths */
  r->len = direct ? r->stride : size;
  if (posix_memalign((void **)&r->buf, ALIGN, r->stride) != 0) die_errno("raw buffer");
  if (posix_memalign((void **)&r->src, HUGE, n * r->stride) != 0) die_errno("raw buffers");
  if (huge) (void)madvise(r->src, n * r->stride, MADV_HUGEPAGE); /* a hint, as the pinned pool's */
  for (size_t i = 0; i < r->stride; i++) r->buf[i] = (char)(i * 131u);
  for (size_t b = 0; b < n; b++) memcpy(r->src + b * r->stride, r->buf, r->stride);
  r->fd = raw_open(direct);
}

/* Seconds to write (read) buffers [i0, i1). */
static double raw_batch(raw_side_t *r, bool write, size_t i0, size_t i1) {
  uint64_t t0 = now_ns();
  for (size_t i = i0; i < i1; i++)
    raw_io(r->fd, write, write ? r->src + i * r->stride : r->buf, r->len, (off_t)(i * r->stride));
  return (double)(now_ns() - t0) * 1e-9;
}

static void raw_finish(raw_side_t *r) {
  close(r->fd);
  free(r->buf);
  free(r->src);
}

/* ---- dmem: host tier -> disk, disk -> device ---------------------------------------- */

typedef struct {
  dmem_runtime_t *rt;
  dmem_stream_t s;
  dmem_handle_t *h;
  char *pattern;
  size_t size, n;
} dmem_side_t;

typedef struct {
  double write_io_s, read_io_s; /* seconds in the disk tier's I/O (dmem_stats) */
} dmem_result_t;

/* A runtime (so a new disk file) with n buffers of `size` bytes in the host
 * tier. Returns whether the disk tier's file took O_DIRECT. */
static bool dmem_setup(dmem_side_t *d, size_t size, size_t n) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.spill_dir = g_dir;
  cfg.host_limit = 0; /* the moves are explicit */
  size_t total = n * size;
  cfg.device_limit = total + 64 * MiB;
  if (cfg.host_backend_capacity < total + 128 * MiB) cfg.host_backend_capacity = total + 128 * MiB;
  d->size = size;
  d->n = n;
  TRY(dmem_runtime_create(&cfg, &d->rt));
  TRY(dmem_stream_create(d->rt, &d->s));
  d->h = calloc(n, sizeof *d->h);
  d->pattern = malloc(size);
  if (!d->h || !d->pattern) die_errno("malloc");
  for (size_t i = 0; i < size; i++) d->pattern[i] = (char)(i * 131u);
  for (size_t i = 0; i < n; i++) {
    void *p;
    TRY(dmem_buffer_alloc(d->rt, size, 0, &d->h[i]));
    TRY(dmem_buffer_lock(d->rt, d->h[i], d->s, &p));
    TRY(dmem_stream_copy(d->rt, p, d->pattern, size, d->s));
    TRY(dmem_stream_synchronize(d->rt, d->s));
    TRY(dmem_buffer_unlock(d->rt, d->h[i]));
  }
  /* into the host tier (not timed: this also grows the pinned pool that
   * the reads take their staging from). Those device -> host copies run
   * asynchronously on the runtime's one spill stream; a last small buffer
   * spilled after them and moved to disk waits for its own copy, and so
   * for theirs: the timed writes start with the bytes on the host, and the
   * file has been written once (which tells whether it took O_DIRECT). */
  for (size_t i = 0; i < n; i++) TRY(dmem_buffer_spill(d->rt, d->h[i], DMEM_TIER_HOST));
  dmem_handle_t last;
  TRY(dmem_buffer_alloc(d->rt, 4096, 0, &last));
  TRY(dmem_buffer_spill(d->rt, last, DMEM_TIER_HOST));
  TRY(dmem_buffer_spill(d->rt, last, DMEM_TIER_DISK));
  TRY(dmem_buffer_free(d->rt, last));
  dmem_stats_t st;
  TRY(dmem_stats(d->rt, &st));
  return st.disk_direct_io != 0;
}

/* Seconds to move buffers [i0, i1) to disk (write), or back to the device
 * (read: each unspilled, then one dmem_stream_synchronize). */
static double dmem_batch(dmem_side_t *d, bool write, size_t i0, size_t i1) {
  uint64_t t0 = now_ns();
  if (write) {
    for (size_t i = i0; i < i1; i++) TRY(dmem_buffer_spill(d->rt, d->h[i], DMEM_TIER_DISK));
  } else {
    for (size_t i = i0; i < i1; i++) TRY(dmem_buffer_unspill(d->rt, d->h[i], d->s));
    TRY(dmem_stream_synchronize(d->rt, d->s));
  }
  return (double)(now_ns() - t0) * 1e-9;
}

/* dmem's own count of the bytes and seconds, the bytes checked, the
 * runtime destroyed. */
static dmem_result_t dmem_finish(dmem_side_t *d) {
  size_t n = d->n, size = d->size;
  dmem_stats_t st;
  TRY(dmem_stats(d->rt, &st));
  dmem_result_t r;
  /* the disk I/O alone, from dmem's own statistics (the sentinel's write
   * is in there too: 4 KiB, a few microseconds) */
  r.write_io_s = st.seconds_host_to_disk;
  r.read_io_s = st.seconds_disk_to_device;
  if (st.host_to_disk_bytes != (uint64_t)(n * size) + 4096 ||
      st.disk_to_device_bytes != (uint64_t)(n * size)) {
    fprintf(stderr, "bench_disk: stats say %llu bytes written and %llu read, expected %zu\n",
            (unsigned long long)st.host_to_disk_bytes - 4096,
            (unsigned long long)st.disk_to_device_bytes, n * size);
    exit(1);
  }
  /* the bytes came back */
  void *p;
  char *back = malloc(size);
  if (!back) die_errno("malloc");
  for (size_t i = 0; i < n; i += n > 4 ? n / 4 : 1) {
    TRY(dmem_buffer_lock(d->rt, d->h[i], d->s, &p));
    TRY(dmem_stream_copy(d->rt, back, p, size, d->s));
    TRY(dmem_stream_synchronize(d->rt, d->s));
    TRY(dmem_buffer_unlock(d->rt, d->h[i]));
    if (memcmp(back, d->pattern, size) != 0) {
      fprintf(stderr, "bench_disk: buffer %zu of %zu bytes came back wrong\n", i, size);
      exit(1);
    }
  }
  free(back);
  for (size_t i = 0; i < n; i++) TRY(dmem_buffer_free(d->rt, d->h[i]));
  TRY(dmem_stream_destroy(d->rt, d->s));
  dmem_runtime_destroy(d->rt);
  free(d->h);
  free(d->pattern);
  return r;
}

/* ---- one pair: dmem and raw interleaved in batches --------------------------------- */

typedef struct {
  double raw_write_s, raw_read_s, dmem_write_s, dmem_read_s;
  dmem_result_t io;
  bool direct;
} pair_t;

/* Both sides set up (untimed), then the writes in batches of about BATCH
 * bytes, dmem's and raw's in turn, the side that goes first alternating
 * from batch to batch (and from pair to pair); then the reads alike. Each
 * side's time is the sum of its batches. */
static pair_t pair_run(size_t size, size_t n, bool huge, int rep) {
  pair_t q;
  dmem_side_t d;
  raw_side_t r;
  q.direct = dmem_setup(&d, size, n);
  raw_setup(&r, size, n, q.direct, huge);
  size_t per = BATCH / size ? BATCH / size : 1;
  for (int phase = 0; phase < 2; phase++) {
    bool write = phase == 0;
    double dt = 0, rt = 0;
    settle();
    for (size_t i0 = 0, b = 0; i0 < n; i0 += per, b++) {
      size_t i1 = n - i0 < per ? n : i0 + per;
      if ((b + (size_t)rep) % 2 == 0) {
        dt += dmem_batch(&d, write, i0, i1);
        rt += raw_batch(&r, write, i0, i1);
      } else {
        rt += raw_batch(&r, write, i0, i1);
        dt += dmem_batch(&d, write, i0, i1);
      }
    }
    if (write) {
      q.dmem_write_s = dt;
      q.raw_write_s = rt;
    } else {
      q.dmem_read_s = dt;
      q.raw_read_s = rt;
    }
  }
  raw_finish(&r);
  q.io = dmem_finish(&d);
  return q;
}

static double gbps(size_t bytes, double s) { return s > 0 ? (double)bytes / s * 1e-9 : 0; }

int main(int argc, char **argv) {
  bool quick = false;
  size_t total = 0;
  int reps = 0;
  size_t one = 0;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (strcmp(argv[i], "--dir") == 0 && i + 1 < argc) {
      g_dir = argv[++i];
    } else if (strcmp(argv[i], "--total") == 0 && i + 1 < argc) {
      TRY(dmem_size_parse(argv[++i], &total, NULL));
    } else if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) {
      reps = atoi(argv[++i]);
    } else if (strcmp(argv[i], "--size") == 0 && i + 1 < argc) {
      TRY(dmem_size_parse(argv[++i], &one, NULL));
      if (one == 0) {
        fprintf(stderr, "bench_disk: --size must be above 0\n");
        return 2;
      }
    } else {
      fprintf(stderr, "usage: %s [--quick] [--dir DIR] [--total BYTES] [--reps N] [--size BYTES]\n",
              argv[0]);
      return 2;
    }
  }
  if (!g_dir || !*g_dir) g_dir = getenv("DMEM_SPILL_DIR");
  if (!g_dir || !*g_dir) g_dir = getenv("TMPDIR");
  if (!g_dir || !*g_dir) g_dir = "/tmp";
  if (!total) total = quick ? 32 * MiB : (size_t)2 << 30;
  if (reps <= 0) reps = quick ? 1 : 5;
  if (reps > MAX_REPS) reps = MAX_REPS;
  static const size_t full_sizes[] = {1 * MiB, 8 * MiB, 64 * MiB, 256 * MiB};
  static const size_t quick_sizes[] = {1 * MiB, 8 * MiB + 4096 + 7};
  const size_t *sizes = quick ? quick_sizes : full_sizes;
  size_t nsizes = quick ? 2 : 4;
  if (one) {
    sizes = &one;
    nsizes = 1;
  }

  /* which backend? (a tiny runtime answers) */
  dmem_runtime_t *probe;
  TRY(dmem_runtime_create(NULL, &probe));
  const bool huge = dmem_runtime_backend(probe) == DMEM_BACKEND_CUDA;
  const char *backend = huge ? "cuda" : "host";
  dmem_runtime_destroy(probe);

  printf("bench_disk: %s backend, directory %s, %.0f MiB per size, %d pairs (medians; a ratio "
         "is the median of the pairs' own)\n", backend,
         g_dir, (double)total / (double)MiB, reps);
  printf("%10s %6s %6s | %10s %10s %6s %10s | %10s %10s %6s %10s\n", "size", "n", "I/O",
         "raw write", "dmem h->d", "ratio", "(in I/O)", "raw read", "dmem d->dv", "ratio",
         "(in I/O)");
  double worst = 1e9;
  for (size_t k = 0; k < nsizes; k++) {
    size_t size = sizes[k];
    size_t n = total / size ? total / size : 1;
    double rw[MAX_REPS], rr[MAX_REPS], dw[MAX_REPS], dr[MAX_REPS], dwio[MAX_REPS],
        drio[MAX_REPS], qw[MAX_REPS], qr[MAX_REPS];
    bool direct = false;
    for (int rep = 0; rep < reps; rep++) {
      pair_t q = pair_run(size, n, huge, rep);
      direct = q.direct;
      rw[rep] = q.raw_write_s;
      rr[rep] = q.raw_read_s;
      dw[rep] = q.dmem_write_s;
      dr[rep] = q.dmem_read_s;
      dwio[rep] = q.io.write_io_s;
      drio[rep] = q.io.read_io_s;
      qw[rep] = q.raw_write_s / q.dmem_write_s; /* dmem / raw throughput, this pair */
      qr[rep] = q.raw_read_s / q.dmem_read_s;
    }
    size_t bytes = n * size;
    double wr = median(qw, reps), rr_ = median(qr, reps); /* (sorts qw, qr) */
    if (wr < worst) worst = wr;
    if (rr_ < worst) worst = rr_;
    printf("%8.2fMi %6zu %6s | %6.2f GB/s %6.2f GB/s %6.2f %5.2f GB/s | %6.2f GB/s %6.2f GB/s "
           "%6.2f %5.2f GB/s\n",
           (double)size / (double)MiB, n, direct ? "direct" : "buffer", gbps(bytes, median(rw, reps)),
           gbps(bytes, median(dw, reps)), wr, gbps(bytes, median(dwio, reps)),
           gbps(bytes, median(rr, reps)), gbps(bytes, median(dr, reps)), rr_,
           gbps(bytes, median(drio, reps)));
    printf("%10s %6s %6s   pairs' ratios: write %.2f-%.2f, read %.2f-%.2f\n", "", "", "",
           qw[0], qw[reps - 1], qr[0], qr[reps - 1]);
    if (!quick) {
      printf("RESULT bench_disk.write.%zu=%.4f\n", size, wr);
      printf("RESULT bench_disk.read.%zu=%.4f\n", size, rr_);
    }
    fflush(stdout);
  }
  printf("bench_disk: worst dmem/raw %.2f (target >= 0.90)%s\n", worst,
         quick ? "; --quick sizes are too small to judge" : "");
  if (!quick) printf("RESULT bench_disk.worst=%.4f\n", worst);
  return 0;
}
