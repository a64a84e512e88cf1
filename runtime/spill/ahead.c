/*
 * spill/ahead.c - eviction ahead of need. When device use passes the
 * high-water mark (rt->ahead_high; DMEM_SPILL_AHEAD, default 95 % of the
 * limit on the CUDA backend, off on the host backend) a background thread
 * spills by policy down to the low-water mark, so that an allocation
 * rarely has to wait for a spill. Spills to the host tier are
 * stream-ordered: the thread only enqueues copies; the device ranges go
 * back to the pool tagged with the copies' events.
 *
 * The thread also completes finished stream releases and copies (the
 * buffers a dmem_stream_release unlocks become victims without anyone
 * polling). It sleeps on rt->ahead_cv; allocations that find device use
 * above the mark wake it (dmem__ahead_note: one relaxed load otherwise),
 * and it looks on its own every 50 ms.
 */
#include "spill/spill.h"
#include "spill/ahead.h"
#include <errno.h>
#include <time.h>

#define AHEAD_PERIOD_NS (50ull * 1000 * 1000)
#define AHEAD_QUIET_NS (1ull * 1000 * 1000)

static void sleep_ns(uint64_t ns) {
  struct timespec ts = {(time_t)(ns / 1000000000ull), (long)(ns % 1000000000ull)};
  while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
  }
}

/* Wait for a kick, a stop or the period. Returns false on stop. */
static bool ahead_wait(dmem_runtime_t *rt) {
  dmem__mutex_lock(&rt->ahead_mu, DMEM__RANK_AHEAD);
  struct timespec dl;
  clock_gettime(CLOCK_REALTIME, &dl);
  uint64_t ns = (uint64_t)dl.tv_nsec + AHEAD_PERIOD_NS;
  dl.tv_sec += (time_t)(ns / 1000000000ull);
  dl.tv_nsec = (long)(ns % 1000000000ull);
  while (!dmem_atomic_load_relaxed(&rt->ahead_stop) && !dmem_atomic_load_relaxed(&rt->ahead_kick)) {
    if (pthread_cond_timedwait(&rt->ahead_cv, &rt->ahead_mu, &dl) == ETIMEDOUT) break;
  }
  bool go = !dmem_atomic_load_relaxed(&rt->ahead_stop);
  dmem__mutex_unlock(&rt->ahead_mu, DMEM__RANK_AHEAD);
  return go;
}

static void *ahead_main(void *arg) {
  dmem_runtime_t *rt = arg;
  while (ahead_wait(rt)) {
    if (dmem_atomic_load_relaxed(&rt->fatal)) {
      dmem_atomic_store_relaxed(&rt->ahead_kick, 0);
      continue;
    }
    /* finished stream releases: their buffers become victims */
    dmem__pending_poll(rt, false);
    dmem__staging_poll(rt, false);
    size_t used = dmem__device_used(rt);
    size_t freed = 0;
    if (used > rt->ahead_high) {
      dmem_atomic_add_relaxed(&rt->xs.ahead_passes, 1);
      (void)dmem__evict(rt, used - rt->ahead_low, 0, DMEM__EVICT_AHEAD, &freed, NULL);
    }
    if (freed == 0) {
      /* Nothing to do, or nothing spillable now: stay quiet a moment
       * (allocations see the kick still set and do not signal). */
      sleep_ns(AHEAD_QUIET_NS);
    }
    dmem_atomic_store_relaxed(&rt->ahead_kick, 0);
  }
  return NULL;
}

void dmem__ahead_kick_slow(dmem_runtime_t *rt) {
  if (!rt->ahead_started) return;
  if (dmem_atomic_exchange_acq_rel(&rt->ahead_kick, 1)) return; /* already awake */
  dmem__mutex_lock(&rt->ahead_mu, DMEM__RANK_AHEAD);
  pthread_cond_signal(&rt->ahead_cv);
  dmem__mutex_unlock(&rt->ahead_mu, DMEM__RANK_AHEAD);
}

dmem_status_t dmem__ahead_start(dmem_runtime_t *rt) {
  if (!rt->ahead_high) return DMEM_OK;
  dmem_atomic_store_relaxed(&rt->ahead_stop, 0);
  dmem_atomic_store_relaxed(&rt->ahead_kick, 0);
  int rc = pthread_create(&rt->ahead_thread, NULL, ahead_main, rt);
  if (rc != 0)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "spill-ahead thread: pthread_create: %d", rc);
  rt->ahead_started = true;
  DMEM_RT_LOG(rt, DMEM_LOG_INFO, "spill-ahead: above %zu bytes of device use, spill down to %zu",
              rt->ahead_high, rt->ahead_low);
  return DMEM_OK;
}

void dmem__ahead_stop(dmem_runtime_t *rt) {
  if (!rt->ahead_started) return;
  dmem__mutex_lock(&rt->ahead_mu, DMEM__RANK_AHEAD);
  dmem_atomic_store_relaxed(&rt->ahead_stop, 1);
  pthread_cond_broadcast(&rt->ahead_cv);
  dmem__mutex_unlock(&rt->ahead_mu, DMEM__RANK_AHEAD);
  pthread_join(rt->ahead_thread, NULL);
  rt->ahead_started = false;
}
