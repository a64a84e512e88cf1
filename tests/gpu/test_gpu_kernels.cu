/*
 * tests/gpu/test_gpu_kernels.cu - the CUDA backend with real kernels: locked
 * buffers read and written by kernels through many spill/unspill cycles on
 * several streams, stream-ordered retrieve, the second locker's event wait,
 * cancellation of a spill by a lock, oversubscription (past a device limit,
 * and past the card's physical memory), dmem_stream_release with long
 * kernels, free during a kernel, launch errors, device selection.
 *
 * Every case exits 77 (CTest: skipped) when dmem_runtime_create on the CUDA
 * backend answers DMEM_ERR_NO_DEVICE. DMEM_GPU_SMALL=1 shrinks every case
 * (the compute-sanitizer runs); DMEM_GPU_OVERSUB (default 1.5) is the size
 * of oversubscription_past_physical_memory in multiples of the device's
 * memory, DMEM_GPU_OVERSUB_ROUNDS (default 2) its verify+update rounds,
 * DMEM_GPU_OVERSUB_HOST_GIB (default 40 % of the host's memory) the most it
 * may spill to pinned host memory.
 */
#include <atomic>

#include <unistd.h>

#include "check.h"
#include "gpu_check.cuh"

/* ---- launch functions ---------------------------------------------------- */

/* Kernel work on dev_ptrs[0..n): one kind per job. */
enum job_kind { JOB_FILL, JOB_CHECK, JOB_CHECK_INC, JOB_SPIN_CHECK_INC, JOB_BAD_CONFIG };

typedef struct job {
  enum job_kind kind;
  size_t bytes;            /* of each buffer */
  uint32_t seed[4];        /* per buffer */
  uint32_t gen;            /* generation expected (fill: written) */
  unsigned long long *bad; /* device counter */
  double spin_s;           /* JOB_SPIN_CHECK_INC: spin first */
} job_t;

static dmem_status_t run_job(void *user, dmem_stream_t s, void *const *p, size_t n) {
  const job_t *j = (const job_t *)user;
  cudaStream_t cs = (cudaStream_t)s;
  dmem_status_t st = DMEM_OK;
  if (j->kind == JOB_SPIN_CHECK_INC) st = gpu_spin(j->spin_s, NULL, cs);
  if (j->kind == JOB_BAD_CONFIG) {
    gpu_k_fill<<<1, 4096, 0, cs>>>((uint32_t *)p[0], 1, 0, 0); /* 4096 threads: invalid */
    return gpu_launched("gpu_k_fill<<<1, 4096>>>");
  }
  for (size_t i = 0; i < n && i < 4 && st == DMEM_OK; i++) {
    switch (j->kind) {
      case JOB_FILL: st = gpu_fill(p[i], j->bytes, j->seed[i], j->gen, cs); break;
      case JOB_CHECK: st = gpu_check(p[i], j->bytes, j->seed[i], j->gen, j->bad, cs); break;
      default: st = gpu_check_inc(p[i], j->bytes, j->seed[i], j->gen, j->bad, cs); break;
    }
  }
  return st;
}

static job_t job1(enum job_kind kind, size_t bytes, uint32_t seed, uint32_t gen,
                  unsigned long long *bad) {
  job_t j;
  memset(&j, 0, sizeof j);
  j.kind = kind;
  j.bytes = bytes;
  j.seed[0] = seed;
  j.gen = gen;
  j.bad = bad;
  return j;
}

/* ---- many spill/unspill cycles, 4 threads with a stream each, a spiller ----- */

#define CYC_THREADS 4
#define CYC_NBUF 64
#define CYC_BATCH 4 /* launches on a stream before it is synchronised or released */

typedef struct cyc_world {
  dmem_runtime_t *rt;
  size_t bytes;
  int cycles;
  dmem_handle_t h[CYC_NBUF];
  uint32_t seed[CYC_NBUF];
  uint32_t gen[CYC_NBUF]; /* written by the owning thread only (i % CYC_THREADS) */
  unsigned long long *bad; /* CYC_THREADS device counters */
  std::atomic<int> stop;
  std::atomic<long> host_bad, errors, verified, spiller_moves;
} cyc_world_t;

typedef struct cyc_arg {
  cyc_world_t *w;
  int t;
} cyc_arg_t;

static void cyc_fail(cyc_world_t *w, const char *what, dmem_status_t st) {
  fprintf(stderr, "%s: %s (%s)\n", what, dmem_status_name(st), dmem_last_error_detail());
  w->errors++;
}

static void *cyc_worker(void *p) {
  cyc_arg_t *a = (cyc_arg_t *)p;
  cyc_world_t *w = a->w;
  dmem_runtime_t *rt = w->rt;
  CUDA_DIE(cudaSetDevice(g_gpu_device));
  dmem_stream_t s;
  DMEM_DIE(dmem_stream_create(rt, &s));
  uint32_t *host = NULL;
  CUDA_DIE(cudaMallocHost(&host, w->bytes));
  const int mine = CYC_NBUF / CYC_THREADS;
  for (int c = 0; c < w->cycles; c++) {
    /* kernels: check the previous generation and increment, in batches */
    for (int k0 = 0; k0 < mine; k0 += CYC_BATCH) {
      for (int k = k0; k < k0 + CYC_BATCH; k++) {
        int i = a->t + CYC_THREADS * k; /* neighbours belong to other threads */
        job_t j = job1(JOB_CHECK_INC, w->bytes, w->seed[i], w->gen[i], w->bad + a->t);
        dmem_status_t st = dmem_launch_async(rt, s, &w->h[i], 1, run_job, &j);
        if (st == DMEM_OK) w->gen[i]++;
        else cyc_fail(w, "dmem_launch_async", st);
      }
      dmem_status_t st = (c + k0 / CYC_BATCH) % 2 ? dmem_stream_release(rt, s)
                                                  : dmem_sync_and_unlock(rt, s);
      if (st != DMEM_OK) cyc_fail(w, "release/sync_and_unlock", st);
    }
    /* explicit moves, each verified on the host after the round trip */
    for (int k = c % 4; k < mine; k += 4) {
      int i = a->t + CYC_THREADS * k;
      DMEM_DIE(dmem_stream_synchronize(rt, s));
      DMEM_DIE(dmem_runtime_poll(rt)); /* our released locks are gone now */
      dmem_tier_t tier = (c + k) % 8 < 5 ? DMEM_TIER_HOST : DMEM_TIER_DISK;
      dmem_status_t st = dmem_buffer_spill(rt, w->h[i], tier);
      /* BUSY: the spiller thread is moving it; INVALID_ARGUMENT: it is on
       * disk already and tier is the host */
      if (st != DMEM_OK && st != DMEM_ERR_BUSY && st != DMEM_ERR_INVALID_ARGUMENT)
        cyc_fail(w, "dmem_buffer_spill", st);
      st = dmem_buffer_unspill(rt, w->h[i], s);
      if (st != DMEM_OK && st != DMEM_ERR_BUSY) cyc_fail(w, "dmem_buffer_unspill", st);
      size_t bad = gpu_host_verify_into(rt, w->h[i], w->bytes, w->seed[i], w->gen[i], s, host);
      if (bad) {
        fprintf(stderr, "buffer %d cycle %d: %zu bad words after spill+unspill\n", i, c, bad);
        w->host_bad++;
      }
      w->verified++;
    }
  }
  DMEM_DIE(dmem_sync_and_unlock(rt, s));
  DMEM_DIE(dmem_runtime_poll(rt));
  DMEM_DIE(dmem_stream_destroy(rt, s));
  CUDA_DIE(cudaFreeHost(host));
  return NULL;
}

/* Moves any buffer at random without coordinating with the workers: the
 * runtime must keep moves and locks apart by itself. */
static void *cyc_spiller(void *p) {
  cyc_world_t *w = ((cyc_arg_t *)p)->w;
  CUDA_DIE(cudaSetDevice(g_gpu_device));
  uint64_t x = 88172645463325252ull;
  while (!w->stop.load()) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    dmem_handle_t h = w->h[x % CYC_NBUF];
    dmem_status_t st;
    switch ((x >> 8) % 4) {
      case 0: st = dmem_buffer_spill(w->rt, h, DMEM_TIER_HOST); break;
      case 1: st = dmem_buffer_spill(w->rt, h, DMEM_TIER_DISK); break;
      case 2: st = dmem_buffer_unspill(w->rt, h, NULL); break;
      default: {
        size_t freed = 0;
        st = dmem_runtime_evict(w->rt, 2 * w->bytes, &freed);
      }
    }
    if (st == DMEM_OK) w->spiller_moves++;
    else if (st != DMEM_ERR_BUSY && st != DMEM_ERR_INVALID_ARGUMENT && st != DMEM_ERR_OUT_OF_MEMORY)
      cyc_fail(w, "spiller", st);
  }
  return NULL;
}

TEST_CASE(kernels_through_spill_cycles_4_streams) {
  cyc_world_t *wp = new cyc_world_t(); /* value-initialised: zeroes */
  cyc_world_t &w = *wp;
  w.bytes = gpu_tiny() ? 16 << 10 : gpu_small() ? 256 << 10 : 4 * MiB;
  w.cycles = gpu_tiny() ? 1 : gpu_small() ? 3 : 16;
  /* room for 24 of the 64 buffers: at most 4 x 4 are locked at once */
  /* spill-ahead on: its thread races the workers and the spiller too */
  dmem_runtime_t *rt = gpu_runtime_ahead(24 * w.bytes, 16 * w.bytes); /* the rest goes to disk */
  w.rt = rt;
  w.bad = gpu_counters(CYC_THREADS);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  for (int i = 0; i < CYC_NBUF; i++) {
    w.seed[i] = 1000u + (uint32_t)i;
    REQUIRE_OK(dmem_buffer_alloc(rt, w.bytes, 0, &w.h[i]));
    job_t j = job1(JOB_FILL, w.bytes, w.seed[i], 0, NULL);
    REQUIRE_OK(dmem_launch_async(rt, s, &w.h[i], 1, run_job, &j));
    REQUIRE_OK(dmem_sync_and_unlock(rt, s));
  }
  double t0 = gpu_now();
  pthread_t th[CYC_THREADS + 1];
  cyc_arg_t args[CYC_THREADS + 1];
  for (int t = 0; t <= CYC_THREADS; t++) {
    args[t].w = &w;
    args[t].t = t;
    REQUIRE_EQ(pthread_create(&th[t], NULL, t < CYC_THREADS ? cyc_worker : cyc_spiller, &args[t]),
               0);
  }
  for (int t = 0; t < CYC_THREADS; t++) pthread_join(th[t], NULL);
  w.stop = 1;
  pthread_join(th[CYC_THREADS], NULL);
  double secs = gpu_now() - t0;

  /* every byte of every buffer, on the host */
  long final_bad = 0;
  for (int i = 0; i < CYC_NBUF; i++) {
    size_t bad = gpu_host_verify(rt, w.h[i], w.bytes, w.seed[i], w.gen[i], s);
    if (bad) {
      fprintf(stderr, "buffer %d: %zu bad words at the end\n", i, bad);
      final_bad++;
    }
  }
  unsigned long long kernel_bad = 0;
  for (int t = 0; t < CYC_THREADS; t++) kernel_bad += gpu_counter_read(w.bad + t);
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  fprintf(stderr,
          "%d buffers x %zu KiB, limit %zu KiB, %d cycles in %.2f s: host checks %ld, spiller "
          "moves %ld, spills %llu, unspills %llu, on-demand %llu, cancelled %llu\n",
          CYC_NBUF, w.bytes >> 10, st.device_limit >> 10, w.cycles, secs,
          w.verified.load(), w.spiller_moves.load(),
          (unsigned long long)st.spill_count, (unsigned long long)st.unspill_count,
          (unsigned long long)st.oom_evictions, (unsigned long long)st.cancelled_spills);
  CHECK_UEQ(kernel_bad, 0);
  CHECK_EQ(w.host_bad.load(), 0);
  CHECK_EQ(final_bad, 0);
  CHECK_EQ(w.errors.load(), 0);
  CHECK_GT(w.verified.load(), 0);
  CHECK_GT(st.spill_count, (uint64_t)CYC_NBUF);
  CHECK_GT(st.unspill_count, (uint64_t)CYC_NBUF);
  CHECK_GT(st.oom_evictions + st.ahead_evictions, 0);
  for (int i = 0; i < CYC_NBUF; i++) CHECK_OK(dmem_buffer_free(rt, w.h[i]));
  CHECK_OK(dmem_stream_destroy(rt, s));
  /* a push-down the I/O threads were writing when its buffer was freed
   * reclaims it as it ends */
  st = gpu_stats_once_reclaimed(rt, 10.0);
  CHECK_UEQ(st.buffer_count, 0);
  CHECK_UEQ(st.device_used, 0);
  CHECK_UEQ(st.host_used, 0);
  CHECK_UEQ(st.disk_used, 0);
  CUDA_REQUIRE(cudaFree(w.bad));
  dmem_runtime_destroy(rt);
  delete wp;
}

/* ---- stream-ordered retrieve ------------------------------------------------ */

/* A buffer spilled a moment before is locked by dmem_launch_async on s, and
 * the kernel that checks it is enqueued on s at once: no host
 * synchronisation between the lock and the kernel. The device memory it
 * comes back to was overwritten first, so if the host->device copy were not
 * ordered before the kernel, the kernel would see 0xA5 bytes. */
TEST_CASE(stream_ordered_retrieve) {
  dmem_runtime_t *rt = gpu_runtime(0, 0);
  const size_t bytes = gpu_small() ? 4 * MiB : 128 * MiB;
  const int rounds = gpu_small() ? 3 : 8;
  unsigned long long *bad = gpu_counters(1);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  for (int r = 0; r < rounds; r++) {
    uint32_t seed = 77u + (uint32_t)r * 1000u;
    dmem_handle_t h;
    REQUIRE_OK(dmem_buffer_alloc(rt, bytes, 0, &h));
    job_t fill = job1(JOB_FILL, bytes, seed, 3, NULL);
    REQUIRE_OK(dmem_lock_and_launch(rt, &h, 1, run_job, &fill));
    CHECK_OK(dmem_buffer_spill(rt, h, r % 2 ? DMEM_TIER_DISK : DMEM_TIER_HOST));
    CHECK_EQ(gpu_state(rt, h), r % 2 ? DMEM_STATE_DEFERRED_DISK : DMEM_STATE_DEFERRED_HOST);
    gpu_poison_free_memory(bytes);
    job_t check = job1(JOB_CHECK, bytes, seed, 3, bad);
    CHECK_OK(dmem_launch_async(rt, s, &h, 1, run_job, &check)); /* retrieve + kernel */
    CHECK_EQ(gpu_state(rt, h), DMEM_STATE_RESIDENT);
    CHECK_OK(dmem_sync_and_unlock(rt, s));
    CHECK_UEQ(gpu_counter_read(bad), 0);
    CHECK_OK(dmem_buffer_free(rt, h));
  }
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.unspill_count, (uint64_t)rounds);
  CHECK_OK(dmem_stream_destroy(rt, s));
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}

/* ---- the second locker on another stream waits on the copy's event ----------- */

/* s1 is kept busy by a 200 ms kernel. The lock on s1 queues the
 * host->device copy on the runtime's unspill stream (not behind s1's
 * unrelated kernel) and makes s1 wait for it. The lock on s2 must neither
 * wait on the host (it returns at once) nor let s2 run ahead of the copy: a
 * checking kernel enqueued on s2 right after the lock sees the right data
 * (the memory the buffer comes back to was overwritten first). And since
 * the copy does not queue behind s1's kernel, neither does s2's. */
TEST_CASE(second_locker_waits_for_copy_event) {
  dmem_runtime_t *rt = gpu_runtime(0, 0);
  const size_t bytes = gpu_small() ? 2 * MiB : 256 * MiB;
  const int rounds = gpu_small() ? 2 : 4;
  unsigned long long *bad = gpu_counters(1);
  dmem_stream_t s1, s2;
  REQUIRE_OK(dmem_stream_create(rt, &s1));
  REQUIRE_OK(dmem_stream_create(rt, &s2));
  for (int r = 0; r < rounds; r++) {
    uint32_t seed = 5u + (uint32_t)r;
    dmem_handle_t h;
    REQUIRE_OK(dmem_buffer_alloc(rt, bytes, 0, &h));
    job_t fill = job1(JOB_FILL, bytes, seed, 0, NULL);
    REQUIRE_OK(dmem_lock_and_launch(rt, &h, 1, run_job, &fill));
    CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
    gpu_poison_free_memory(bytes);
    double t_spin = gpu_now();
    REQUIRE_OK(gpu_spin(0.2, NULL, (cudaStream_t)s1));
    void *p1, *p2;
    CHECK_OK(dmem_buffer_lock(rt, h, s1, &p1)); /* copy on the unspill stream; s1 waits */
    double t_lock1 = gpu_now() - t_spin;
    double t0 = gpu_now();
    CHECK_OK(dmem_buffer_lock(rt, h, s2, &p2)); /* s2 waits on the copy's event */
    double lock_s = gpu_now() - t0;
    CHECK_TRUE(p1 == p2);
    REQUIRE_OK(gpu_check(p2, bytes, seed, 0, bad, (cudaStream_t)s2));
    CUDA_REQUIRE(cudaStreamSynchronize((cudaStream_t)s2));
    double done_s = gpu_now() - t_spin;
    CHECK_UEQ(gpu_counter_read(bad), 0);
    fprintf(stderr,
            "round %d: lock on s1 returned after %.3f s, lock on s2 took %.3f s, s2's kernel "
            "done %.3f s after the 0.2 s kernel on s1 started\n",
            r, t_lock1, lock_s, done_s);
    /* the premise: the lock on s1 returned while the kernel still ran (had
     * it blocked on it, a device allocation say, the event wait would hardly
     * be exercised). Outside the sanitizers, which serialise. */
    if (t_lock1 > 0.15) {
      fprintf(stderr, "the lock on s1 blocked on the running kernel for %.3f s%s\n", t_lock1,
              gpu_small() ? " (under the sanitizers: not judged)" : "");
      if (!gpu_small()) CHECK_TRUE(t_lock1 <= 0.15);
    }
    CHECK_TRUE(lock_s < 0.1);  /* no host wait for the kernel on s1 */
    /* the copy did not queue behind s1's kernel (the sanitizers serialise
     * kernels, so only outside them) */
    if (!gpu_small()) CHECK_TRUE(done_s < 0.15);
    CUDA_REQUIRE(cudaStreamSynchronize((cudaStream_t)s1));
    CHECK_OK(dmem_buffer_unlock(rt, h));
    CHECK_OK(dmem_buffer_unlock(rt, h));
    CHECK_OK(dmem_buffer_free(rt, h));
  }
  CHECK_OK(dmem_stream_destroy(rt, s1));
  CHECK_OK(dmem_stream_destroy(rt, s2));
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}

/* ---- a lock during a spill cancels it ------------------------------------------- */

typedef struct ctl {
  dmem_runtime_t *rt;
  size_t bytes;
  uint32_t new_seed;
  int lock_during_store;
  dmem_status_t side_st;
  pthread_mutex_t mu;
  dmem_handle_t key;
  void *val; /* one stored copy is enough here */
  int stores, retrieves;
} ctl_t;

/* Another thread locks the buffer (which cancels the spill under way) and
 * writes new data into it with a kernel. */
static void *overwrite_thread(void *p) {
  ctl_t *c = (ctl_t *)p;
  CUDA_DIE(cudaSetDevice(g_gpu_device));
  dmem_stream_t s;
  DMEM_DIE(dmem_stream_create(c->rt, &s));
  job_t fill = job1(JOB_FILL, c->bytes, c->new_seed, 0, NULL);
  c->side_st = dmem_launch_async(c->rt, s, &c->key, 1, run_job, &fill);
  DMEM_DIE(dmem_sync_and_unlock(c->rt, s));
  DMEM_DIE(dmem_stream_destroy(c->rt, s));
  return NULL;
}

static dmem_status_t ctl_store(void *user, dmem_handle_t h, const void *data, size_t size) {
  ctl_t *c = (ctl_t *)user;
  if (c->lock_during_store) {
    c->key = h;
    pthread_t t;
    if (pthread_create(&t, NULL, overwrite_thread, c) != 0) return DMEM_ERR_CALLBACK;
    pthread_join(t, NULL);
  }
  pthread_mutex_lock(&c->mu);
  free(c->val);
  c->val = malloc(size);
  memcpy(c->val, data, size);
  c->key = h;
  c->stores++;
  pthread_mutex_unlock(&c->mu);
  return DMEM_OK;
}

static dmem_status_t ctl_retrieve(void *user, dmem_handle_t h, void *out, size_t size) {
  ctl_t *c = (ctl_t *)user;
  pthread_mutex_lock(&c->mu);
  dmem_status_t st = DMEM_ERR_INVALID_ARGUMENT;
  if (c->val && c->key == h) {
    memcpy(out, c->val, size);
    c->retrieves++;
    st = DMEM_OK;
  }
  pthread_mutex_unlock(&c->mu);
  return st;
}

TEST_CASE(lock_during_spill_cancels_it) {
  dmem_runtime_t *rt = gpu_runtime(0, 0);
  ctl_t c;
  memset(&c, 0, sizeof c);
  pthread_mutex_init(&c.mu, NULL);
  c.rt = rt;
  c.bytes = gpu_small() ? MiB : 32 * MiB;
  c.new_seed = 4242;
  dmem_controller_t dc;
  memset(&dc, 0, sizeof dc);
  dc.struct_size = sizeof dc;
  dc.user = &c;
  dc.store = ctl_store;
  dc.retrieve = ctl_retrieve;
  REQUIRE_OK(dmem_controller_set(rt, &dc));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, c.bytes, 0, &h));
  job_t fill = job1(JOB_FILL, c.bytes, 17, 0, NULL);
  REQUIRE_OK(dmem_lock_and_launch(rt, &h, 1, run_job, &fill));
  /* store runs after the device->host copy, before the commit */
  c.lock_during_store = 1;
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER), DMEM_ERR_BUSY);
  CHECK_OK(c.side_st);
  CHECK_EQ(gpu_state(rt, h), DMEM_STATE_RESIDENT);
  CHECK_UEQ(gpu_host_verify(rt, h, c.bytes, c.new_seed, 0, NULL), 0); /* the new data */
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.cancelled_spills, 1);
  CHECK_UEQ(st.controller_used, 0);
  CHECK_UEQ(st.spill_count, 0);
  /* a later spill to the controller keeps the new data, and a kernel sees it */
  c.lock_during_store = 0;
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_CONTROLLER));
  CHECK_EQ(gpu_state(rt, h), DMEM_STATE_DEFERRED_CONTROLLER);
  unsigned long long *bad = gpu_counters(1);
  job_t check = job1(JOB_CHECK, c.bytes, c.new_seed, 0, bad);
  CHECK_OK(dmem_lock_and_launch(rt, &h, 1, run_job, &check));
  CHECK_UEQ(gpu_counter_read(bad), 0);
  CHECK_EQ(c.retrieves, 1);
  CHECK_OK(dmem_buffer_free(rt, h));
  CUDA_REQUIRE(cudaFree(bad));
  CHECK_OK(dmem_controller_set(rt, NULL));
  dmem_runtime_destroy(rt);
  free(c.val);
  pthread_mutex_destroy(&c.mu);
}

/* ---- oversubscription ------------------------------------------------------------- */

#define OVS_STREAMS 4

/* nbuf buffers of `bytes` under `limit` (0: the device's memory): fill each
 * with a kernel, then `rounds` rounds of verify+update kernels over all of
 * them through dmem_launch_async + dmem_stream_release on 4 streams, then a
 * final check of every byte by a kernel and of a few buffers on the host.
 * Spilling is driven by the runtime alone. */
static void oversubscribe(size_t limit, size_t nbuf, size_t bytes, int rounds) {
  /* as users run it: the defaults (spill-ahead on demand; DMEM_SPILL_AHEAD=off
   * to compare, see docs/design.md) */
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.device_limit = limit;
  dmem_runtime_t *rt = gpu_runtime_cfg(&cfg);
  dmem_stats_t st;
  REQUIRE_OK(dmem_stats(rt, &st));
  const double total = (double)nbuf * (double)bytes;
  fprintf(stderr,
          "oversubscription: %zu x %zu MiB = %.2f GiB of buffers, device %.2f GiB, limit %.2f "
          "GiB, %d rounds\n",
          nbuf, bytes >> 20, total / GiB, (double)st.device_capacity / GiB,
          (double)st.device_limit / GiB, rounds);
  unsigned long long *bad = gpu_counters(1);
  dmem_stream_t s[OVS_STREAMS];
  for (int i = 0; i < OVS_STREAMS; i++) REQUIRE_OK(dmem_stream_create(rt, &s[i]));
  dmem_handle_t *h = (dmem_handle_t *)calloc(nbuf, sizeof *h);
  double t0 = gpu_now();
  for (size_t i = 0; i < nbuf; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, bytes, 0, &h[i]));
    dmem_stream_t si = s[i % OVS_STREAMS];
    job_t j = job1(JOB_FILL, bytes, (uint32_t)i * 7919u, 0, NULL);
    REQUIRE_OK(dmem_launch_async(rt, si, &h[i], 1, run_job, &j));
    REQUIRE_OK(dmem_stream_release(rt, si));
  }
  double t_fill = gpu_now() - t0;
  for (int r = 0; r <= rounds; r++) {
    for (size_t i = 0; i < nbuf; i++) {
      dmem_stream_t si = s[i % OVS_STREAMS];
      job_t j = job1(r < rounds ? JOB_CHECK_INC : JOB_CHECK, bytes, (uint32_t)i * 7919u,
                     (uint32_t)r, bad);
      REQUIRE_OK(dmem_launch_async(rt, si, &h[i], 1, run_job, &j));
      REQUIRE_OK(dmem_stream_release(rt, si));
    }
  }
  for (int i = 0; i < OVS_STREAMS; i++) REQUIRE_OK(dmem_stream_synchronize(rt, s[i]));
  double secs = gpu_now() - t0;
  CHECK_UEQ(gpu_counter_read(bad), 0);
  size_t probe[3] = {0, nbuf / 2, nbuf - 1};
  for (int k = 0; k < 3; k++)
    CHECK_UEQ(gpu_host_verify(rt, h[probe[k]], bytes, (uint32_t)probe[k] * 7919u,
                              (uint32_t)rounds, s[0]),
              0);
  CHECK_OK(dmem_stats(rt, &st));
  fprintf(stderr,
          "oversubscription: fill %.2f s, total %.2f s; spills %llu (%.1f GiB, %.2f s), "
          "unspills %llu (%.1f GiB), on-demand evictions %llu, ahead %llu, waits for room "
          "%llu (%.2f s), host tier peak now %.1f GiB\n",
          t_fill, secs, (unsigned long long)st.spill_count, (double)st.bytes_spilled / GiB,
          st.seconds_spilling, (unsigned long long)st.unspill_count,
          (double)st.bytes_unspilled / GiB, (unsigned long long)st.oom_evictions,
          (unsigned long long)st.ahead_evictions, (unsigned long long)st.room_waits,
          st.seconds_waiting_for_room,
          (double)st.host_used / GiB);
  printf("oversubscription %.2f GiB on a %.2f GiB device (limit %.2f GiB): %.2f s\n",
         total / GiB, (double)st.device_capacity / GiB, (double)st.device_limit / GiB, secs);
  /* more than the limit exists, so some of it must have been spilled */
  CHECK_GE((double)st.bytes_spilled, total - (double)st.device_limit);
  CHECK_GT(st.oom_evictions + st.ahead_evictions, 0);
  CHECK_GT(st.unspill_count, 0);
  CHECK_LE(st.device_used, st.device_limit);
  for (size_t i = 0; i < nbuf; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  for (int i = 0; i < OVS_STREAMS; i++) CHECK_OK(dmem_stream_destroy(rt, s[i]));
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.buffer_count, 0);
  CHECK_UEQ(st.device_used, 0);
  CHECK_UEQ(st.host_used, 0);
  free(h);
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}

/* 1.5x a 4 GiB device limit (quick). */
TEST_CASE(oversubscription_past_device_limit) {
  /* racecheck (DMEM_GPU_SMALL=2) instruments every access of every
   * kernel: 24 x 4 MiB took it past its limit */
  if (gpu_tiny()) oversubscribe(2 * MiB, 12, 256 << 10, 1);
  else if (gpu_small()) oversubscribe(64 * MiB, 24, 4 * MiB, 2);
  else oversubscribe(4 * GiB, 24, 256 * MiB, 2);
}

/* DMEM_GPU_OVERSUB (default 1.5) times the card's memory in 1 GiB buffers,
 * no device limit: the backend's out-of-memory drives the spilling. Not run
 * with DMEM_GPU_SMALL (compute-sanitizer). */
TEST_CASE(oversubscription_past_physical_memory) {
  if (gpu_small()) SKIP_CASE("oversubscription_past_physical_memory: not run with DMEM_GPU_SMALL");
  double factor = gpu_env_double("DMEM_GPU_OVERSUB", 1.5);
  int rounds = (int)gpu_env_double("DMEM_GPU_OVERSUB_ROUNDS", 2);
  dmem_runtime_t *probe = gpu_runtime(0, 0);
  dmem_stats_t st;
  REQUIRE_OK(dmem_stats(probe, &st));
  dmem_runtime_destroy(probe);
  size_t nbuf = (size_t)(factor * (double)st.device_capacity / (double)GiB + 0.999);
  /* What does not fit the card is pinned host memory, which the kernel can
   * neither swap nor reclaim: keep it to 40 % of the host's memory (as the
   * VM reports it now; lent VMs start with less and grow), or the OOM
   * killer ends the run (seen: 70 GiB of a 128 GiB H200 machine). */
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  double host_gib = pages > 0 && page > 0 ? (double)pages * (double)page / (double)GiB : 0;
  size_t card = (size_t)((double)st.device_capacity / (double)GiB + 0.999);
  size_t spill_max = (size_t)(gpu_env_double("DMEM_GPU_OVERSUB_HOST_GIB", 0.4 * host_gib));
  if (spill_max < 8) spill_max = 8; /* past the card in any case */
  if (nbuf > card + spill_max) {
    fprintf(stderr, "oversubscription_past_physical_memory: %zu GiB past the card, not %zu: "
            "the host reports %.1f GiB (DMEM_GPU_OVERSUB_HOST_GIB to change)\n",
            spill_max, nbuf - card, host_gib);
    nbuf = card + spill_max;
  }
  oversubscribe(0, nbuf, GiB, rounds);
}

/* The CUDA backend's default: spill-ahead on demand
 * (dmem_config_t.spill_ahead_trigger) at 95 % down to 90 %: under the mark
 * the thread polls nothing; above it, with no allocation that waited for
 * room, it spills nothing either (no pass, not armed). */
TEST_CASE(spill_ahead_on_by_default_idle_without_waits) {
  const size_t bytes = gpu_small() ? MiB : 16 * MiB, limit = 64 * bytes;
  unsetenv("DMEM_SPILL_AHEAD"); /* the defaults, whatever the environment says */
  unsetenv("DMEM_SPILL_AHEAD_TRIGGER");
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  CHECK_TRUE(cfg.spill_ahead == DMEM_SPILL_AHEAD_DEFAULT);
  CHECK_EQ(cfg.spill_ahead_trigger, DMEM_SPILL_AHEAD_DEMAND);
  cfg.device_limit = limit;
  dmem_runtime_t *rt = gpu_runtime_cfg(&cfg);
  dmem_stats_t st;
  REQUIRE_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.spill_ahead_high, (size_t)((double)limit * 0.95));
  CHECK_UEQ(st.spill_ahead_low, (size_t)((double)limit * (0.95 - 0.05)));
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  enum { N = 62 }; /* past the mark (60.8 buffers), under the limit */
  dmem_handle_t h[N];
  unsigned long long *bad = gpu_counters(1);
  struct timespec pause = {0, 160 * 1000 * 1000};
  for (int i = 0; i < N; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, bytes, 0, &h[i]));
    job_t j = job1(JOB_FILL, bytes, 11u + (uint32_t)i, 0, NULL);
    REQUIRE_OK(dmem_launch_async(rt, s, &h[i], 1, run_job, &j));
    REQUIRE_OK(dmem_stream_release(rt, s));
    if (i == 8) { /* under the mark, a release in flight: no poll */
      dmem_stats_t a;
      REQUIRE_OK(dmem_stats(rt, &a));
      nanosleep(&pause, NULL);
      REQUIRE_OK(dmem_stats(rt, &st));
      CHECK_GT(st.ahead_wakeups - a.ahead_wakeups, 0);
      CHECK_UEQ(st.ahead_polls, 0);
    }
  }
  REQUIRE_OK(dmem_stream_synchronize(rt, s));
  nanosleep(&pause, NULL);
  REQUIRE_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.device_used, N * bytes);
  CHECK_UEQ(st.room_waits, 0);
  CHECK_UEQ(st.ahead_arms, 0);
  CHECK_UEQ(st.ahead_passes, 0);
  CHECK_UEQ(st.ahead_evictions, 0);
  for (int i = 0; i < N; i++) {
    job_t chk = job1(JOB_CHECK, bytes, 11u + (uint32_t)i, 0, bad);
    REQUIRE_OK(dmem_launch_async(rt, s, &h[i], 1, run_job, &chk));
  }
  REQUIRE_OK(dmem_sync_and_unlock(rt, s));
  CHECK_UEQ(gpu_counter_read(bad), 0);
  for (int i = 0; i < N; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_OK(dmem_stream_destroy(rt, s));
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}

/* ---- dmem_stream_release with long-running kernels ----------------------------- */

TEST_CASE(stream_release_waits_for_long_kernel) {
  dmem_runtime_t *rt = gpu_runtime(0, 0);
  const size_t bytes = gpu_small() ? MiB : 64 * MiB;
  unsigned long long *bad = gpu_counters(1);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, bytes, 0, &h));
  job_t fill = job1(JOB_FILL, bytes, 99, 0, NULL);
  REQUIRE_OK(dmem_lock_and_launch(rt, &h, 1, run_job, &fill));
  job_t j = job1(JOB_SPIN_CHECK_INC, bytes, 99, 0, bad);
  j.spin_s = 0.2;
  double t0 = gpu_now();
  REQUIRE_OK(dmem_launch_async(rt, s, &h, 1, run_job, &j));
  CHECK_OK(dmem_stream_release(rt, s));
  CHECK_TRUE(gpu_now() - t0 < 0.1); /* returns at once */
  CHECK_OK(dmem_runtime_poll(rt));
  CHECK_EQ(gpu_lock_count(rt, h), 1); /* the kernel is still running */
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_BUSY);
  size_t freed = 1;
  CHECK_OK(dmem_runtime_evict(rt, bytes, &freed));
  CHECK_UEQ(freed, 0);
  double t_unlock = -1;
  while (gpu_now() - t0 < 10) {
    CHECK_OK(dmem_runtime_poll(rt));
    if (gpu_lock_count(rt, h) == 0) {
      t_unlock = gpu_now() - t0;
      break;
    }
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  fprintf(stderr, "unlocked %.3f s after the launch of a 0.2 s kernel\n", t_unlock);
  CHECK_TRUE(t_unlock >= 0.15);
  CHECK_TRUE(t_unlock < 5);
  CHECK_EQ(cudaStreamQuery((cudaStream_t)s), cudaSuccess); /* found after it finished */
  CHECK_UEQ(gpu_counter_read(bad), 0);
  CHECK_UEQ(gpu_host_verify(rt, h, bytes, 99, 1, s), 0);
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST)); /* spillable again */
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_OK(dmem_stream_destroy(rt, s));
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}

/* Memory is full of buffers locked by a running kernel whose stream was
 * released: an allocation that needs their memory waits for the kernel,
 * then spills them. */
TEST_CASE(allocation_waits_for_released_kernel) {
  const size_t bytes = gpu_small() ? MiB : 64 * MiB;
  dmem_runtime_t *rt = gpu_runtime(2 * bytes, 0);
  unsigned long long *bad = gpu_counters(1);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t ab[2], c;
  for (int i = 0; i < 2; i++) REQUIRE_OK(dmem_buffer_alloc(rt, bytes, 0, &ab[i]));
  job_t fill = job1(JOB_FILL, bytes, 1, 0, NULL);
  fill.seed[1] = 2;
  REQUIRE_OK(dmem_lock_and_launch(rt, ab, 2, run_job, &fill));
  job_t j = job1(JOB_SPIN_CHECK_INC, bytes, 1, 0, bad);
  j.seed[1] = 2;
  j.spin_s = 0.3;
  double t0 = gpu_now();
  REQUIRE_OK(dmem_launch_async(rt, s, ab, 2, run_job, &j));
  REQUIRE_OK(dmem_stream_release(rt, s));
  CHECK_OK(dmem_buffer_alloc(rt, bytes, 0, &c));
  double waited = gpu_now() - t0;
  fprintf(stderr, "allocation returned %.3f s after the launch of a 0.3 s kernel\n", waited);
  CHECK_TRUE(waited >= 0.2);
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.spill_count, 1);
  CHECK_UEQ(gpu_counter_read(bad), 0);
  for (int i = 0; i < 2; i++) CHECK_UEQ(gpu_host_verify(rt, ab[i], bytes, 1u + (uint32_t)i, 1, s), 0);
  for (int i = 0; i < 2; i++) CHECK_OK(dmem_buffer_free(rt, ab[i]));
  CHECK_OK(dmem_buffer_free(rt, c));
  CHECK_OK(dmem_stream_destroy(rt, s));
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}

/* ---- free while a kernel still uses the buffer ---------------------------------- */

static dmem_status_t inc_then_copy(void *user, dmem_stream_t s, void *const *p, size_t n) {
  (void)n;
  const job_t *j = (const job_t *)user;
  cudaStream_t cs = (cudaStream_t)s;
  dmem_status_t st = gpu_spin(0.1, NULL, cs);
  if (st == DMEM_OK) st = gpu_check_inc(p[0], j->bytes, j->seed[0], j->gen, j->bad, cs);
  if (st != DMEM_OK) return st;
  cudaError_t e = cudaMemcpyAsync(p[1], p[0], j->bytes, cudaMemcpyDeviceToDevice, cs);
  return e == cudaSuccess ? DMEM_OK : DMEM_ERR_DEVICE;
}

TEST_CASE(free_while_kernel_uses_buffer) {
  dmem_runtime_t *rt = gpu_runtime(0, 0);
  const size_t bytes = gpu_small() ? MiB : 64 * MiB;
  unsigned long long *bad = gpu_counters(1);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t hs[2]; /* source, destination */
  for (int i = 0; i < 2; i++) REQUIRE_OK(dmem_buffer_alloc(rt, bytes, 0, &hs[i]));
  job_t fill = job1(JOB_FILL, bytes, 31, 0, NULL);
  REQUIRE_OK(dmem_lock_and_launch(rt, hs, 1, run_job, &fill));
  job_t j = job1(JOB_CHECK_INC, bytes, 31, 0, bad);
  REQUIRE_OK(dmem_launch_async(rt, s, hs, 2, inc_then_copy, &j));
  CHECK_OK(dmem_buffer_free(rt, hs[0])); /* the kernel is still spinning */
  void *p;
  dmem_buffer_info_t info;
  CHECK_STATUS(dmem_buffer_lock(rt, hs[0], s, &p), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_buffer_info(rt, hs[0], &info), DMEM_ERR_STALE_HANDLE);
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.device_used, 2 * bytes); /* not reclaimed while locked */
  CHECK_UEQ(st.buffer_count, 2);
  CHECK_EQ(cudaStreamQuery((cudaStream_t)s), cudaErrorNotReady); /* still spinning */
  (void)cudaGetLastError();
  CHECK_OK(dmem_sync_and_unlock(rt, s)); /* last unlock reclaims */
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.device_used, bytes);
  CHECK_UEQ(st.buffer_count, 1);
  CHECK_UEQ(gpu_counter_read(bad), 0);
  CHECK_UEQ(gpu_host_verify(rt, hs[1], bytes, 31, 1, s), 0); /* the kernel's result */
  CHECK_OK(dmem_buffer_free(rt, hs[1]));
  CHECK_OK(dmem_stream_destroy(rt, s));
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}

/* ---- the synchronous entry point, launch errors -------------------------------- */

/* dmem_lock_and_launch retrieves a spilled buffer on the default stream,
 * runs the kernel and returns after it: its result is there at once. */
TEST_CASE(lock_and_launch_runs_kernel_on_spilled_buffer) {
  dmem_runtime_t *rt = gpu_runtime(0, 0);
  const size_t bytes = gpu_small() ? MiB : 32 * MiB;
  unsigned long long *bad = gpu_counters(1);
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, bytes, 0, &h));
  job_t fill = job1(JOB_FILL, bytes, 8, 10, NULL);
  REQUIRE_OK(dmem_lock_and_launch(rt, &h, 1, run_job, &fill));
  for (uint32_t g = 10; g < 14; g++) {
    CHECK_OK(dmem_buffer_spill(rt, h, g % 2 ? DMEM_TIER_DISK : DMEM_TIER_HOST));
    job_t j = job1(JOB_CHECK_INC, bytes, 8, g, bad);
    CHECK_OK(dmem_lock_and_launch(rt, &h, 1, run_job, &j));
    CHECK_EQ(gpu_lock_count(rt, h), 0);
  }
  CHECK_UEQ(gpu_counter_read(bad), 0);
  CHECK_UEQ(gpu_host_verify(rt, h, bytes, 8, 14, NULL), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}

/* A launch that fails (invalid configuration) is the launch function's
 * status; it is not a sticky error: the runtime goes on working. */
TEST_CASE(launch_error_is_returned_not_sticky) {
  dmem_runtime_t *rt = gpu_runtime(0, 0);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  job_t bad_cfg = job1(JOB_BAD_CONFIG, MiB, 0, 0, NULL);
  CHECK_STATUS(dmem_launch_async(rt, s, &h, 1, run_job, &bad_cfg), DMEM_ERR_DEVICE);
  CHECK_EQ(gpu_lock_count(rt, h), 1); /* registered all the same */
  CHECK_OK(dmem_sync_and_unlock(rt, s));
  CHECK_EQ(gpu_lock_count(rt, h), 0);
  CHECK_STATUS(dmem_lock_and_launch(rt, &h, 1, run_job, &bad_cfg), DMEM_ERR_DEVICE);
  CHECK_EQ(gpu_lock_count(rt, h), 0);
  job_t fill = job1(JOB_FILL, MiB, 3, 0, NULL);
  CHECK_OK(dmem_launch_async(rt, s, &h, 1, run_job, &fill));
  CHECK_OK(dmem_sync_and_unlock(rt, s));
  CHECK_OK(dmem_buffer_spill(rt, h, DMEM_TIER_HOST));
  CHECK_UEQ(gpu_host_verify(rt, h, MiB, 3, 0, s), 0);
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_OK(dmem_stream_destroy(rt, s));
  dmem_runtime_destroy(rt);
}

/* ---- device selection --------------------------------------------------------------- */

static dmem_status_t create_on(int device, dmem_runtime_t **rt) {
  dmem_config_t cfg;
  dmem_config_init(&cfg);
  cfg.backend = DMEM_BACKEND_CUDA;
  if (device >= 0) cfg.device = device;
  return dmem_runtime_create(&cfg, rt);
}

TEST_CASE(device_selection) {
  const char *saved_env = getenv("DMEM_DEVICE");
  char *saved = saved_env ? strdup(saved_env) : NULL;
  unsetenv("DMEM_DEVICE");
  dmem_runtime_t *rt = gpu_runtime(0, 0); /* skips without a device */
  dmem_runtime_destroy(rt);
  int count = 0;
  CUDA_REQUIRE(cudaGetDeviceCount(&count));
  REQUIRE_TRUE(count > 0);
  /* DMEM_DEVICE picks the device: 0, and the last one */
  int picks[2] = {0, count - 1};
  for (int k = 0; k < (count > 1 ? 2 : 1); k++) {
    char v[16];
    snprintf(v, sizeof v, "%d", picks[k]);
    setenv("DMEM_DEVICE", v, 1);
    dmem_config_t cfg;
    dmem_config_init(&cfg);
    CHECK_EQ(cfg.device, picks[k]);
    rt = NULL;
    REQUIRE_OK(create_on(-1, &rt));
    CHECK_EQ(dmem_runtime_backend(rt), DMEM_BACKEND_CUDA);
    dmem_handle_t h;
    REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
    void *p;
    REQUIRE_OK(dmem_buffer_lock(rt, h, NULL, &p));
    cudaPointerAttributes attr;
    CUDA_REQUIRE(cudaPointerGetAttributes(&attr, p));
    CHECK_EQ(attr.type, cudaMemoryTypeDevice);
    CHECK_EQ(attr.device, picks[k]);
    CHECK_OK(dmem_buffer_unlock(rt, h));
    CHECK_OK(dmem_buffer_free(rt, h));
    dmem_runtime_destroy(rt);
  }
  /* an ordinal past the last device */
  char v[16];
  snprintf(v, sizeof v, "%d", count);
  setenv("DMEM_DEVICE", v, 1);
  rt = (dmem_runtime_t *)0x1;
  CHECK_STATUS(create_on(-1, &rt), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_TRUE(rt == (dmem_runtime_t *)0x1); /* untouched on failure */
  CHECK_TRUE(strstr(dmem_last_error_detail(), "present") != NULL);
  unsetenv("DMEM_DEVICE");
  CHECK_STATUS(create_on(count + 100, &rt), DMEM_ERR_INVALID_ARGUMENT);
  /* malformed */
  setenv("DMEM_DEVICE", "-1", 1);
  CHECK_STATUS(create_on(-1, &rt), DMEM_ERR_CONFIG);
  if (saved) {
    setenv("DMEM_DEVICE", saved, 1);
    free(saved);
  } else {
    unsetenv("DMEM_DEVICE");
  }
}

/* ---- raw allocations (dmem_device_malloc) with real kernels --------------------- */

/* A block freed on stream A while A's kernels still use it is handed to
 * stream B only in stream order: B's kernels run after A's. A spins, then
 * checks the pattern it wrote; B overwrites the block it got. Without the
 * ordering B's fill lands during A's spin and A's check counts it. */
TEST_CASE(raw_block_reuse_across_streams_is_stream_ordered) {
  /* larger than the pool's cached classes, and the limit holds one block:
   * B can only get the block A freed */
  const size_t bytes = gpu_small() ? 2 * MiB : 64 * MiB;
  dmem_runtime_t *rt = gpu_runtime(bytes, 0);
  unsigned long long *bad = gpu_counters(2);
  dmem_stream_t a, b;
  REQUIRE_OK(dmem_stream_create(rt, &a));
  REQUIRE_OK(dmem_stream_create(rt, &b));
  int same = 0;
  for (int round = 0; round < 4; round++) {
    void *p = NULL, *q = NULL;
    REQUIRE_OK(dmem_device_malloc(rt, bytes, a, &p));
    REQUIRE_OK(gpu_fill(p, bytes, 11, (uint32_t)round, (cudaStream_t)a));
    REQUIRE_OK(gpu_spin(gpu_small() ? 0.02 : 0.1, NULL, (cudaStream_t)a));
    REQUIRE_OK(gpu_check(p, bytes, 11, (uint32_t)round, &bad[0], (cudaStream_t)a));
    REQUIRE_OK(dmem_device_free(rt, p, a));
    REQUIRE_OK(dmem_device_malloc(rt, bytes, b, &q));
    same += q == p;
    REQUIRE_OK(gpu_fill(q, bytes, 22, (uint32_t)round, (cudaStream_t)b));
    REQUIRE_OK(gpu_check(q, bytes, 22, (uint32_t)round, &bad[1], (cudaStream_t)b));
    REQUIRE_OK(dmem_device_free(rt, q, b));
  }
  CHECK_OK(dmem_stream_synchronize(rt, a));
  CHECK_OK(dmem_stream_synchronize(rt, b));
  fprintf(stderr, "raw reuse: the same block went to the other stream in %d of 4 rounds\n", same);
  CHECK_EQ(same, 4); /* the case under test happened every round */
  CHECK_UEQ(gpu_counter_read(&bad[0]), 0);
  CHECK_UEQ(gpu_counter_read(&bad[1]), 0);
  CHECK_OK(dmem_stream_destroy(rt, a));
  CHECK_OK(dmem_stream_destroy(rt, b));
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}

/* Raw allocations spill buffers (whose kernels' data survives the round
 * trip); a raw block reused from spilled buffers' ranges is ordered after
 * their spill copies. */
TEST_CASE(raw_allocations_spill_buffers_with_kernels) {
  const size_t bytes = gpu_small() ? MiB : 64 * MiB;
  const size_t nbuf = 16;
  dmem_runtime_t *rt = gpu_runtime(nbuf * bytes, 0);
  unsigned long long *bad = gpu_counters(1);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t h[16];
  for (size_t i = 0; i < nbuf; i++) {
    REQUIRE_OK(dmem_buffer_alloc(rt, bytes, 0, &h[i]));
    job_t j = job1(JOB_FILL, bytes, 300u + (uint32_t)i, 0, NULL);
    REQUIRE_OK(dmem_launch_async(rt, s, &h[i], 1, run_job, &j));
    REQUIRE_OK(dmem_stream_release(rt, s));
  }
  /* half the limit in raw blocks, written at once on another stream */
  dmem_stream_t r;
  REQUIRE_OK(dmem_stream_create(rt, &r));
  void *raw[8];
  for (int k = 0; k < 8; k++) {
    REQUIRE_OK(dmem_device_malloc(rt, bytes, r, &raw[k]));
    REQUIRE_OK(gpu_fill(raw[k], bytes, 900u + (uint32_t)k, 0, (cudaStream_t)r));
  }
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_GE(st.spill_count, 8);
  CHECK_UEQ(st.raw_used, 8 * bytes);
  CHECK_LE(st.device_used, nbuf * bytes);
  /* every buffer comes back intact (spilling others), raw blocks stay */
  for (size_t i = 0; i < nbuf; i++) {
    job_t j = job1(JOB_CHECK, bytes, 300u + (uint32_t)i, 0, bad);
    REQUIRE_OK(dmem_launch_async(rt, s, &h[i], 1, run_job, &j));
    REQUIRE_OK(dmem_sync_and_unlock(rt, s));
  }
  for (int k = 0; k < 8; k++) REQUIRE_OK(gpu_check(raw[k], bytes, 900u + (uint32_t)k, 0, bad, (cudaStream_t)r));
  CHECK_OK(dmem_stream_synchronize(rt, r));
  CHECK_UEQ(gpu_counter_read(bad), 0);
  /* bad frees on the CUDA backend */
  CHECK_STATUS(dmem_device_free(rt, (char *)raw[0] + 256, r), DMEM_ERR_INVALID_ARGUMENT);
  for (int k = 0; k < 8; k++) CHECK_OK(dmem_device_free(rt, raw[k], r));
  CHECK_STATUS(dmem_device_free(rt, raw[0], r), DMEM_ERR_INVALID_ARGUMENT);
  for (size_t i = 0; i < nbuf; i++) CHECK_OK(dmem_buffer_free(rt, h[i]));
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_UEQ(st.device_used, 0);
  CHECK_UEQ(st.raw_used, 0);
  CHECK_OK(dmem_stream_destroy(rt, s));
  CHECK_OK(dmem_stream_destroy(rt, r));
  CUDA_REQUIRE(cudaFree(bad));
  dmem_runtime_destroy(rt);
}
