/*
 * spill/ahead.c - eviction ahead of need. When device use passes the
 * high-water mark (rt->ahead_high; DMEM_SPILL_AHEAD, or the backend's
 * default: runtime/api/runtime.c, ahead_marks) a background thread
 * spills by policy down to the low-water mark, so that an allocation
 * rarely has to wait for a spill. Spills to the host tier are
 * stream-ordered: the thread only enqueues copies; the device ranges go
 * back to the pool tagged with the copies' events.
 *
 * It sleeps on rt->ahead_cv; allocations that find the charge above the
 * mark wake it (dmem__ahead_note: one relaxed load otherwise), and it looks
 * on its own every 50 ms. It stays out of the way when there is nothing
 * useful to do (issue 25; before, it ran a pass with backend queries every
 * millisecond in the two cases below, and polled every 50 ms under the
 * mark):
 *  - Under the mark it does nothing but read the use: no poll of stream
 *    releases or copies (backend event queries, which take the driver's
 *    locks beside the application's calls), no pass. When it was woken
 *    because the charge (device_charged: live bytes plus every thread's
 *    unused budget, what dmem__ahead_note reads) is past the mark while
 *    the use is not, it gives that budget back (dmem__charge_drain), so
 *    that allocations stop waking it.
 *  - A pass that spilled nothing (every buffer locked, pinned or moving)
 *    is followed by a quiet time, 1 ms doubling to 50 ms while it stays
 *    so (a kick that found nothing to do: 1 ms); allocations past the mark
 *    during it set the kick without a signal after the first, and are
 *    looked at when it ends. A pass that spilled, or a look at its period
 *    that found nothing to do, ends it.
 *  - Above the mark, finished stream releases and copies are completed
 *    first (their buffers become victims), then it spills in steps of half
 *    the marks' distance, reading the use again before each: on-demand
 *    evictions and frees of other threads meanwhile do not take it below
 *    the low mark.
 *  - With the demand trigger (dmem_config_t.spill_ahead_trigger,
 *    DMEM_SPILL_AHEAD_TRIGGER=demand, the default), above the mark it
 *    spills only while armed: an allocation or retrieve waited
 *    DMEM_SPILL_AHEAD_ARM_WAIT_US or more for room (dmem__ahead_waited,
 *    from spill/pressure.c), and since then neither did a wait end sooner,
 *    nor did a wait begin (the thread was not ahead of it), nor did
 *    DMEM_SPILL_AHEAD_ARM_MS pass. A long wait that began while it was
 *    armed also holds it off, for DMEM_SPILL_AHEAD_ARM_MS the first time
 *    and twice as long each time after (up to 64 s), until an arming runs
 *    out with no wait that began in it. Unarmed it is
 *    kicked by nobody and does nothing at its period but read the use and
 *    the flag; a pass stops as soon as it is disarmed.
 *    Spilling ahead costs bytes: every buffer spilled early that is used
 *    again before the allocation it made room for comes back over the
 *    link. It pays where callers wait for spills and the link has time
 *    between them; where on-demand evictions are stream-ordered and cost
 *    the caller microseconds (a loop that prefetches: 67 waits of 45 us on
 *    average in examples/cupy_loop.py on an H100), spilling whenever use
 *    is above the mark moved 1.75 GiB more each way and took 5 % longer.
 *    So a short wait disarms it at once (that loop's first allocations,
 *    its fill while the pinned pool grows, wait milliseconds: a second of
 *    arming from them covered the whole loop), and a wait while armed
 *    disarms and holds it off: in one run of three the loop armed it
 *    once, and the waits for its own spills in flight (1.5 ms each) kept
 *    it armed to the end (54 evictions, the same 1.75 GiB).
 */
#include "spill/spill.h"
#include "spill/ahead.h"
#include <errno.h>
#include <time.h>

#define AHEAD_PERIOD_NS (50ull * 1000 * 1000)
#define AHEAD_QUIET_MIN_NS (1ull * 1000 * 1000)
#define AHEAD_QUIET_MAX_NS AHEAD_PERIOD_NS
/* The longest hold-off of the demand trigger (dmem__ahead_waited). */
#define AHEAD_HOLD_MAX_NS (64ull * 1000 * 1000 * 1000)

static void deadline_in(struct timespec *dl, uint64_t ns) {
  clock_gettime(CLOCK_REALTIME, dl);
  ns += (uint64_t)dl->tv_nsec;
  dl->tv_sec += (time_t)(ns / 1000000000ull);
  dl->tv_nsec = (long)(ns % 1000000000ull);
}

/* Why the thread looks (ahead_wait). */
typedef enum { AHEAD_STOP, AHEAD_PERIOD, AHEAD_KICKED } ahead_why_t;

/* Wait for the next look. First `quiet_ns` during which kicks are only
 * noted (the first one signals, the thread waits on), then, unless one
 * came, for a kick, a stop or the period. The kick is cleared at the
 * start: an allocation past the mark from then on sets it again. */
static ahead_why_t ahead_wait(dmem_runtime_t *rt, uint64_t quiet_ns) {
  dmem__mutex_lock(&rt->ahead_mu, DMEM__RANK_AHEAD);
  dmem_atomic_store_relaxed(&rt->ahead_kick, 0);
  struct timespec dl;
  if (quiet_ns) {
    deadline_in(&dl, quiet_ns);
    while (!dmem_atomic_load_relaxed(&rt->ahead_stop)) {
      if (pthread_cond_timedwait(&rt->ahead_cv, &rt->ahead_mu, &dl) == ETIMEDOUT) break;
    }
  }
  if (!dmem_atomic_load_relaxed(&rt->ahead_kick)) {
    deadline_in(&dl, AHEAD_PERIOD_NS);
    while (!dmem_atomic_load_relaxed(&rt->ahead_stop) &&
           !dmem_atomic_load_relaxed(&rt->ahead_kick)) {
      if (pthread_cond_timedwait(&rt->ahead_cv, &rt->ahead_mu, &dl) == ETIMEDOUT) break;
    }
  }
  ahead_why_t why = dmem_atomic_load_relaxed(&rt->ahead_stop)   ? AHEAD_STOP
                    : dmem_atomic_load_relaxed(&rt->ahead_kick) ? AHEAD_KICKED
                                                                : AHEAD_PERIOD;
  dmem__mutex_unlock(&rt->ahead_mu, DMEM__RANK_AHEAD);
  return why;
}

static uint64_t quiet_next(uint64_t quiet_ns) {
  if (quiet_ns == 0) return AHEAD_QUIET_MIN_NS;
  return quiet_ns >= AHEAD_QUIET_MAX_NS / 2 ? AHEAD_QUIET_MAX_NS : 2 * quiet_ns;
}

/* Spill by policy down to the low mark, in steps of half the distance
 * between the marks, the use read again before each. Returns the bytes
 * freed. */
static size_t spill_down(dmem_runtime_t *rt) {
  size_t step = (rt->ahead_high - rt->ahead_low) / 2;
  if (step == 0) step = 1;
  size_t total = 0;
  while (!dmem_atomic_load_relaxed(&rt->ahead_stop)) {
    /* disarmed meanwhile (demand trigger): stop at once */
    if (rt->ahead_demand && !dmem_atomic_load_relaxed(&rt->ahead_armed)) break;
    size_t used = dmem__device_used(rt);
    if (used <= rt->ahead_low) break;
    size_t need = used - rt->ahead_low < step ? used - rt->ahead_low : step;
    size_t freed = 0;
    if (dmem__evict(rt, need, 0, DMEM__EVICT_AHEAD, &freed, NULL) != DMEM_OK || freed == 0)
      break;
    total += freed;
  }
  return total;
}

/* The demand trigger: whether the thread may spill now. The flag is
 * cleared once its time has passed; a wait that armed it again meanwhile
 * stored its time before it set the flag, so the exchange that clears the
 * flag (acquire) sees that time, and the flag is set back. */
static bool ahead_armed(dmem_runtime_t *rt) {
  if (!rt->ahead_demand) return true;
  if (!dmem_atomic_load_relaxed(&rt->ahead_armed)) return false;
  uint64_t now = dmem__now_ns();
  if (now < dmem_atomic_load_relaxed(&rt->ahead_armed_until)) return true;
  (void)dmem_atomic_exchange_acq_rel(&rt->ahead_armed, 0);
  if (now < dmem_atomic_load_relaxed(&rt->ahead_armed_until)) {
    dmem_atomic_store_release(&rt->ahead_armed, 1);
    return true;
  }
  /* it ran out with no wait that began meanwhile: it kept ahead */
  dmem_atomic_store_relaxed(&rt->ahead_hold_ns, 0);
  return false;
}

void dmem__ahead_waited(dmem_runtime_t *rt, uint64_t start_ns, uint64_t now_ns) {
  if (!rt->ahead_started || !rt->ahead_demand) return;
  const uint64_t arm_ns = (uint64_t)DMEM_SPILL_AHEAD_ARM_MS * 1000000u;
  uint64_t waited_ns = now_ns > start_ns ? now_ns - start_ns : 0;
  bool longer = waited_ns >= (uint64_t)DMEM_SPILL_AHEAD_ARM_WAIT_US * 1000u;
  uint64_t until = dmem_atomic_load_relaxed(&rt->ahead_armed_until);
  if (dmem_atomic_load_relaxed(&rt->ahead_armed) && start_ns >= until) {
    /* the arming ran out before this wait began (the thread, under the
     * mark, did not look): it kept ahead */
    dmem_atomic_store_relaxed(&rt->ahead_armed, 0);
    dmem_atomic_store_relaxed(&rt->ahead_hold_ns, 0);
  }
  if (dmem_atomic_load_relaxed(&rt->ahead_armed)) {
    bool began_armed = start_ns + arm_ns >= until; /* armed at until - arm_ns */
    /* Began before the arming (it may be what armed it): no news. */
    if (longer && !began_armed) return;
    /* The thread was armed and the caller still waited: it was not ahead
     * (its own spills in flight were what the caller waited for, or the
     * link is the bound), and every buffer it spills early that is used
     * again comes back over the link. A wait that short: on-demand
     * eviction costs little. Either way disarm; after a long one, hold it
     * off (the next long wait would be as long: the thread's spills are
     * still in flight). */
    if (longer) {
      /* each hold-off in a row twice as long as the one before, up to
       * AHEAD_HOLD_MAX_NS; an arming that ran out unbroken starts over */
      uint64_t hold = dmem_atomic_load_relaxed(&rt->ahead_hold_ns);
      if (hold < arm_ns) hold = arm_ns;
      dmem_atomic_store_relaxed(&rt->ahead_hold_until, now_ns + hold);
      dmem_atomic_store_relaxed(&rt->ahead_hold_ns,
                                hold >= AHEAD_HOLD_MAX_NS / 2 ? AHEAD_HOLD_MAX_NS : 2 * hold);
    }
    dmem_atomic_store_relaxed(&rt->ahead_armed, 0);
    return;
  }
  if (!longer || now_ns < dmem_atomic_load_relaxed(&rt->ahead_hold_until)) return;
  dmem_atomic_store_relaxed(&rt->ahead_armed_until, now_ns + arm_ns);
  /* release (acq_rel): the time above is seen by the thread's exchange */
  if (!dmem_atomic_exchange_acq_rel(&rt->ahead_armed, 1))
    dmem_atomic_add_relaxed(&rt->xs.ahead_arms, 1);
  dmem__ahead_kick_slow(rt);
}

static void *ahead_main(void *arg) {
  dmem_runtime_t *rt = arg;
  uint64_t quiet = 0;
  for (ahead_why_t why; (why = ahead_wait(rt, quiet)) != AHEAD_STOP;) {
    dmem_atomic_add_relaxed(&rt->xs.ahead_wakeups, 1);
    if (dmem_atomic_load_relaxed(&rt->fatal)) {
      quiet = AHEAD_QUIET_MAX_NS;
      continue;
    }
    if (dmem__device_used(rt) <= rt->ahead_high) {
      /* Nothing to do. Woken by the charge alone (other threads' unused
       * budget): give it back, or every allocation would wake it again;
       * and a short quiet time in case it comes back at once. Its period:
       * no quiet time, so that the next kick is answered at once. */
      if (why == AHEAD_KICKED && dmem_atomic_load_relaxed(&rt->device_charged) > rt->ahead_high)
        dmem__charge_drain(rt);
      quiet = why == AHEAD_KICKED ? AHEAD_QUIET_MIN_NS : 0;
      continue;
    }
    if (!ahead_armed(rt)) { /* demand trigger, no wait for room lately */
      quiet = 0;
      continue;
    }
    dmem_atomic_add_relaxed(&rt->xs.ahead_passes, 1);
    /* finished stream releases and copies: their buffers become victims */
    dmem_atomic_add_relaxed(&rt->xs.ahead_polls, 1);
    dmem__pending_poll(rt, false);
    dmem__staging_poll(rt, false);
    size_t freed = spill_down(rt);
    /* the spills' budget went to this thread's shard, which never
     * allocates: back to the charge that allocations compare */
    if (freed > 0) dmem__charge_drain(rt);
    /* spilled nothing (all locked, pinned or moving): back off */
    quiet = freed > 0 ? 0 : quiet_next(quiet);
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
