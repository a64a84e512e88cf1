/*
 * runtime/core/transit.c - the TRANSIT protocol: taking and ending ownership
 * of one buffer's slow-path move with a CAS on its state word, and waiting
 * for another thread's move to end. No mutex is held while a move runs; the
 * transit mutex and condition variable only carry wake-ups.
 */
#include "core/runtime.h"
#include <time.h>

/* The calling thread's moves that may call callbacks (core.h), innermost
 * first. */
static _Thread_local dmem__moving_t *tl_moving;

void dmem__moving_push(dmem__moving_t *m, const dmem_runtime_t *rt, dmem_handle_t h, bool spill) {
  m->rt = rt;
  m->h = h;
  m->spill = spill;
  m->up = tl_moving;
  tl_moving = m;
}

void dmem__moving_pop(dmem__moving_t *m) {
  DMEM_ASSERT(tl_moving == m);
  tl_moving = m->up;
}

void dmem__moving_end(const dmem_runtime_t *rt, dmem_handle_t h) {
  for (dmem__moving_t *m = tl_moving; m; m = m->up)
    if (m->rt == rt && m->h == h) m->h = DMEM_HANDLE_NULL;
}

bool dmem__moving_self(const dmem_runtime_t *rt, dmem_handle_t h) {
  for (const dmem__moving_t *m = tl_moving; m; m = m->up)
    if (m->rt == rt && m->h == h) return true;
  return false;
}

int dmem__moving_spills(const dmem_runtime_t *rt) {
  int n = 0;
  for (const dmem__moving_t *m = tl_moving; m; m = m->up)
    if (m->rt == rt && m->spill) n++;
  return n;
}

uint64_t dmem__now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

dmem_status_t dmem__stale(dmem_handle_t h) {
  return dmem__error(DMEM_ERR_STALE_HANDLE, "handle 0x%016llx is zero, freed or forged",
                     (unsigned long long)h);
}

bool dmem__transit_take(dmem__buffer_t *b, uint64_t *w, unsigned state, uint32_t locks) {
  DMEM_ASSERT(!(*w & (DMEM__F_TRANSIT | DMEM__F_FREED)));
  DMEM_ASSERT(dmem__w_count(*w) + locks <= DMEM__COUNT_MASK);
  uint64_t nw = (dmem__w_with_state(*w, state) | DMEM__F_TRANSIT) + locks;
  /* acquire: partner is the releasing CAS of the previous owner
   * (dmem__transit_end) or dmem_buffer_alloc's release store */
  if (!dmem_atomic_cas_strong_acq_rel(&b->word, w, nw)) return false;
  *w = nw;
  return true;
}

uint64_t dmem__transit_end(dmem__buffer_t *b, dmem__transit_exit_t exit) {
  uint64_t w = dmem_atomic_load_relaxed(&b->word), nw;
  do {
    DMEM_ASSERT(w & DMEM__F_TRANSIT);
    DMEM_ASSERT(!exit.drop_lock || dmem__w_count(w) > 0);
    nw = (w & ~(exit.clear | DMEM__F_TRANSIT)) | exit.set;
    if (exit.to) nw = dmem__w_with_state(nw, exit.to - 1u);
    if (exit.drop_lock) nw -= 1;
    /* release: publishes the owner's writes (b->dev, b->host, events);
     * partner is the acquire load/CAS of lockers and the next mover */
  } while (!dmem_atomic_cas_acq_rel(&b->word, &w, nw));
  return nw;
}

void dmem__transit_broadcast(dmem_runtime_t *rt) {
  dmem__mutex_lock(&rt->tmu, DMEM__RANK_TRANSIT);
  dmem_atomic_add_relaxed(&rt->transit_epoch, 1);
  pthread_cond_broadcast(&rt->tcv);
  dmem__mutex_unlock(&rt->tmu, DMEM__RANK_TRANSIT);
}

/* Wait on the transit condition variable for at most ns (under tmu). */
static void timed_wait(dmem_runtime_t *rt, uint64_t ns) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t nsec = (uint64_t)ts.tv_nsec + ns;
  ts.tv_sec += (time_t)(nsec / 1000000000u);
  ts.tv_nsec = (long)(nsec % 1000000000u);
  pthread_cond_timedwait(&rt->tcv, &rt->tmu, &ts);
}

void dmem__transit_wait(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t seen) {
  dmem__mutex_lock(&rt->tmu, DMEM__RANK_TRANSIT);
  uint64_t epoch = dmem_atomic_load_relaxed(&rt->transit_epoch);
  /* acquire: partner is the owner's releasing CAS in dmem__transit_end */
  while (dmem_atomic_load_acquire(&b->word) == seen &&
         dmem_atomic_load_relaxed(&rt->transit_epoch) == epoch)
    timed_wait(rt, 10u * 1000 * 1000);
  dmem__mutex_unlock(&rt->tmu, DMEM__RANK_TRANSIT);
}

void dmem__transit_wait_any(dmem_runtime_t *rt, uint64_t ns) {
  dmem__mutex_lock(&rt->tmu, DMEM__RANK_TRANSIT);
  timed_wait(rt, ns);
  dmem__mutex_unlock(&rt->tmu, DMEM__RANK_TRANSIT);
}
