/*
 * spill/reuse.c - the default eviction policy (DMEM_EVICTION_REUSE): which
 * unlocked buffers of a priority class an eviction pass takes first.
 *
 * Least recently used first, except for buffers predicted dead, which go
 * before anything, and the members of a loop over more than fits, which
 * LRU would evict each just before its next use. The resident buffers of
 * each priority class are on lists of slots:
 *
 *   cold  buffers that came to the device (allocated, or brought back)
 *         and were not used again since, oldest arrival first;
 *   hot   buffers used again (unlocked a second time) since they arrived,
 *         on DMEM__PHOT lists by their last reuse interval (hot_list):
 *         each a CLOCK whose head is the least recently seen used;
 *   win   buffers brought back after longer than the class's oldest
 *         resident buffer has been unused (their reuse distance is at
 *         least the age of the cold and hot heads: LRU would not have kept
 *         them either), unless used in bursts (their interval before the
 *         pause more than DMEM__BURST times shorter than it): a loop's (or
 *         a long scan's) members, until they are used; and buffers
 *         brought back by dmem_buffer_prefetch (or on the window unused
 *         when prefetched), marked DMEM__PB_SOON until their first unlock
 *         and kept there whatever the window's size, while such buffers
 *         hold less than soon_top (3/4 of the limit: past it the newest
 *         goes to back, as if its prefetch had been dropped). A resident
 *         buffer prefetched again after a use (on back, or marked on the
 *         window) fits: it is hot; a cold one stays cold;
 *   back  the loop's members once used (or past the window's size).
 *         Newest first out.
 *
 * Reuse intervals: the policy's clock (rt->pol.tick) counts victims taken
 * and allocations. An unlock that brings the count to 0 stamps the buffer
 * with it (b->last_use) and shifts the ticks since its last unlock into
 * b->pivs, the last two intervals as 7-bit codes (dmem__piv_code); a
 * buffer brought back records the ticks since its last unlock before it
 * left at its arrival (and its next unlock only clears the flag that says
 * so), an allocated one has none.
 *
 * Victims: first a buffer predicted dead (overdue): of the hot lists'
 * heads, one whose last two intervals agree within DMEM__STABLE times and
 * which has been idle for more than DMEM__OVERDUE times the last, the most
 * idle for its interval; then back's newest (so a loop keeps the buffers
 * it brought back earlier, and cycles the one it used last through one
 * place, as Belady's MIN does); then whichever of the cold and hot heads
 * was unlocked least recently; then the window's oldest. A buffer whose
 * mark shows it was used again is passed over on the way: promoted from
 * cold, win or back to hot, or moved to its hot list's far end.
 *
 * The mark (dmem__policy_mark): an unlock that brings the count to 0 adds
 * 1 to a byte on the buffer's first line, up to 2; an arrival sets it to
 * 0, so its own unlock makes 1 and a later one 2. The policy consumes
 * marks (an exchange) when it looks at a buffer. The unlock writes only its
 * own buffer's first line (the mark, the stamp, the intervals), and reads
 * the clock; an unlock counts for every pass that begins after it,
 * whichever thread made it.
 *
 * Cost: an arrival pushes the slot on a lock-free stack (one CAS; an
 * allocation also adds 1 to the clock); eviction passes drain that stack
 * and walk the lists under rt->pol.mu. Each step of a walk takes a victim,
 * consumes a mark, or drops an entry whose buffer left the device (lists
 * are cleaned lazily: a spill or a free does not touch them), and the
 * dead-block check looks at each non-empty hot list's head, so a victim
 * costs amortised O(1) whatever the number of buffers; locked or moving
 * buffers are passed over (at most once each per list per pass).
 * docs/design.md, "The eviction policy".
 */
#include "spill/spill.h"
#include <limits.h>
#include <stdlib.h>

#define COLD 0
#define BACK 1
#define WIN 2
#define HOT0 3 /* the hot lists: HOT0 + bucket (hot_list) */

/* Dead-block prediction: a hot buffer whose last two reuse intervals agree
 * within DMEM__STABLE times, idle for more than DMEM__OVERDUE times the
 * last one, is predicted dead. */
#define DMEM__STABLE 2
#define DMEM__OVERDUE 2
/* A buffer brought back whose interval before the pause was more than
 * DMEM__BURST times shorter than the pause is back for a new burst of
 * uses, not a loop's member. */
#define DMEM__BURST 32

/* b->parr of an arrival the drain has linked, until it ends */
#define DONE 0xFF

/* b->pback's bits (core/core.h) */
#define DMEM__PB_BACK 1u /* last taken from the back list */
#define DMEM__PB_SOON 2u /* on the window, prefetched and not used since */
/* taken by the collect running now (cleared before it returns): no walk of
 * that collect takes it again. A victim goes to the cold list's newest end
 * and stays resident until its spill starts, so without it the next
 * first(COLD) of the same collect found it again whenever nothing older
 * was left there: after a prefetch of n buffers (all on the window), every
 * victim but the first of a collect was the first again, one real victim
 * per collect of 64, and dmem_runtime_evict of 1024 x 64 KiB took 1024
 * collects (bench_spill's batch row at 0.16-0.27 of raw) */
#define DMEM__PB_TAKEN 4u

/* Arrivals drained by the arriving thread (when the policy is free). */
#define DMEM__DRAIN_EVERY 256u

/* A class's window: a sixteenth of the limit at first, then between a
 * 64th and a half. */
#define DMEM__WIN_START 16
#define DMEM__WIN_MIN 64
#define DMEM__WIN_TOP 2

/* The most priority classes (pcls is an id + 1 in 16 bits); a priority
 * past them joins the nearest class below it (or the lowest). */
#define DMEM__MAX_CLASSES 65535u

void dmem__policy_init(dmem_runtime_t *rt) {
  pthread_mutex_init(&rt->pol.mu, NULL);
  rt->pol.win_max = rt->limit / DMEM__WIN_START;
  rt->pol.win_min = rt->limit / DMEM__WIN_MIN;
  rt->pol.win_top = rt->limit / DMEM__WIN_TOP;
  rt->pol.soon_top = rt->limit - rt->limit / 4;
  atomic_init(&rt->pol.arrivals, (uint64_t)DMEM__NO_SLOT);
  atomic_init(&rt->pol.tick, 0);
}

void dmem__policy_fini(dmem_runtime_t *rt) {
  free(rt->pol.cls);
  free(rt->pol.order);
  rt->pol.cls = NULL;
  rt->pol.order = NULL;
  pthread_mutex_destroy(&rt->pol.mu);
}

static void drain(dmem_runtime_t *rt);

/* The interval a 7-bit code stands for (its lower end); UINT64_MAX for
 * DMEM__PIV_NONE. */
static uint64_t piv_ticks(unsigned c) {
  if (c == DMEM__PIV_NONE) return UINT64_MAX;
  if (c < 16) return c;
  unsigned e = (c - 16) / 4 + 4;
  return (uint64_t)(4 + (c - 16) % 4) << (e - 2);
}

static uint64_t now(const dmem__policy_t *p) {
  return dmem_atomic_load_relaxed(&p->tick);
}

void dmem__policy_arrive(dmem_runtime_t *rt, dmem__buffer_t *b, dmem__arrival_t kind) {
  if (rt->pol_lru) return;
  if (kind == DMEM__ARRIVE_NEW || kind == DMEM__ARRIVE_BACK) {
    /* The reuse interval: none yet for a new buffer; for one brought back,
     * the ticks since its last unlock (which its next unlock must not
     * count again: the flag). Dated now: recency from its arrival. */
    /* an allocation is a tick of the policy's clock too: intervals mean
     * something before the first victim */
    uint64_t t = kind == DMEM__ARRIVE_NEW ? dmem_atomic_add_relaxed(&rt->pol.tick, 1) + 1
                                          : now(&rt->pol);
    uint16_t v = dmem_atomic_load_relaxed(&b->pivs);
    if (kind == DMEM__ARRIVE_NEW) {
      v = (uint16_t)(DMEM__PIV_SKIP | DMEM__PIV_NONE << 7 | DMEM__PIV_NONE);
    } else {
      uint64_t l = dmem_atomic_load_relaxed(&b->last_use), d = t > l ? t - l : 0;
      dmem_atomic_store_relaxed(&b->preuse, d < UINT32_MAX ? (uint32_t)d : UINT32_MAX);
      v = (uint16_t)(DMEM__PIV_SKIP | (v & 0x7F) << 7 | dmem__piv_code(d));
    }
    dmem_atomic_store_relaxed(&b->pivs, v);
    dmem_atomic_store_relaxed(&b->last_use, t);
  }
  if (kind == DMEM__ARRIVE_PRIO || kind == DMEM__ARRIVE_SOON) {
    /* an arrival already pending re-classes the buffer too, and puts it at
     * its list's newest end; a pending return (BACK) that this prefetch
     * made is marked as prefetched (BACK_SOON). A prefetch of a buffer
     * marked used since it came (SOON_USED) says so now: the drain may link
     * it after the use it announces, which marks it too. */
    if (kind == DMEM__ARRIVE_SOON && dmem_atomic_load_relaxed(&b->ref) > 0)
      kind = DMEM__ARRIVE_SOON_USED;
    uint8_t none = 0;
    if (!dmem_atomic_cas_strong_relaxed(&b->parr, &none, (uint8_t)kind)) {
      if (kind != DMEM__ARRIVE_PRIO && none == DMEM__ARRIVE_BACK)
        (void)dmem_atomic_cas_strong_relaxed(&b->parr, &none, (uint8_t)DMEM__ARRIVE_BACK_SOON);
      return;
    }
  } else {
    /* the arrival's own unlock marks 1; a second unlock, 2: used again */
    dmem_atomic_store_relaxed(&b->ref, 0);
    if (dmem_atomic_exchange_acq_rel(&b->parr, (uint8_t)kind) != 0) return; /* pending */
  }
  uint64_t head = dmem_atomic_load_relaxed(&rt->pol.arrivals), top;
  do {
    dmem_atomic_store_relaxed(&b->anext, (uint32_t)head);
    top = ((head >> 32) + 1) << 32 | b->slot;
    /* release: publishes anext; partner is the drain's acquiring exchange */
  } while (!dmem_atomic_cas_acq_rel(&rt->pol.arrivals, &head, top));
  /* Every DMEM__DRAIN_EVERY arrivals, once device use is past half the
   * limit (evictions in sight), the arriving thread drains them if no
   * eviction pass holds the policy: so a pass links at most about that
   * many (a million buffers allocated, then one eviction, cost the
   * eviction no more than a thousand do). Below half the limit nothing is
   * linked: a workload that never evicts pays one CAS an arrival (and none
   * for a slot whose arrival is still pending). The charge read is one
   * relaxed load, every DMEM__DRAIN_EVERY arrivals. */
  if ((top >> 32) % DMEM__DRAIN_EVERY == 0 &&
      dmem_atomic_load_relaxed(&rt->device_charged) >= rt->limit / 2 &&
      dmem__mutex_trylock(&rt->pol.mu, DMEM__RANK_POLICY)) {
    drain(rt);
    dmem__mutex_unlock(&rt->pol.mu, DMEM__RANK_POLICY);
  }
}

/* ---- lists (under rt->pol.mu) --------------------------------------------------- */

static dmem__buffer_t *at(dmem_runtime_t *rt, uint32_t slot) {
  return dmem__table_slot(rt->table, slot);
}

static void unlink_b(dmem_runtime_t *rt, dmem__buffer_t *b) {
  dmem__pclass_t *c = &rt->pol.cls[b->pcls - 1];
  int l = b->plist;
  if (b->pprev != DMEM__NO_SLOT) at(rt, b->pprev)->pnext = b->pnext;
  else c->head[l] = b->pnext;
  if (b->pnext != DMEM__NO_SLOT) at(rt, b->pnext)->pprev = b->pprev;
  else c->tail[l] = b->pprev;
  c->n[l]--;
  if (l == WIN) c->win_bytes -= (size_t)b->psize * 256;
  if (l == WIN && (b->pback & DMEM__PB_SOON)) { /* the mark means "on the window" */
    c->soon_bytes -= (size_t)b->psize * 256;
    b->pback &= (uint8_t)~DMEM__PB_SOON;
  }
  b->pcls = 0;
}

static void link_tail(dmem_runtime_t *rt, dmem__buffer_t *b, uint32_t cid, int l) {
  dmem__pclass_t *c = &rt->pol.cls[cid];
  b->pcls = (uint16_t)(cid + 1);
  b->plist = (uint8_t)l;
  b->pnext = DMEM__NO_SLOT;
  b->pprev = c->tail[l];
  if (c->tail[l] != DMEM__NO_SLOT) at(rt, c->tail[l])->pnext = b->slot;
  else c->head[l] = b->slot;
  c->tail[l] = b->slot;
  c->n[l]++;
  b->psize = dmem__psize_units(dmem__bsize(b));
  if (l == WIN) c->win_bytes += (size_t)b->psize * 256;
}

/* To the head of list l of class cid (under the policy's mutex). */
static void link_head(dmem_runtime_t *rt, dmem__buffer_t *b, uint32_t cid, int l) {
  dmem__pclass_t *c = &rt->pol.cls[cid];
  b->pcls = (uint16_t)(cid + 1);
  b->plist = (uint8_t)l;
  b->pprev = DMEM__NO_SLOT;
  b->pnext = c->head[l];
  if (c->head[l] != DMEM__NO_SLOT) at(rt, c->head[l])->pprev = b->slot;
  else c->tail[l] = b->slot;
  c->head[l] = b->slot;
  c->n[l]++;
  b->psize = dmem__psize_units(dmem__bsize(b));
  if (l == WIN) c->win_bytes += (size_t)b->psize * 256;
}

/* To the tail of list l of its class. */
static void move_tail(dmem_runtime_t *rt, dmem__buffer_t *b, int l) {
  uint32_t cid = b->pcls - 1u;
  unlink_b(rt, b);
  link_tail(rt, b, cid, l);
}

/* b, on its class's window: prefetched and not used since. */
static void set_soon(dmem_runtime_t *rt, dmem__buffer_t *b) {
  if (b->pback & DMEM__PB_SOON) return;
  b->pback |= DMEM__PB_SOON;
  rt->pol.cls[b->pcls - 1].soon_bytes += (size_t)b->psize * 256;
}

/* The hot list of b: by its last reuse interval (a bucket per 7-bit code's
 * power of two; the last bucket: none known). */
static int hot_list(const dmem__buffer_t *b) {
  unsigned c = dmem_atomic_load_relaxed(&b->pivs) & 0x7Fu;
  return HOT0 + (c == DMEM__PIV_NONE ? DMEM__PHOT - 1 : c < 4 ? (int)c : (int)(c >> 2) + 3);
}

/* Used (a mark consumed, or locked): to the tail of its hot list. */
static void to_hot(dmem_runtime_t *rt, dmem__buffer_t *b) {
  move_tail(rt, b, hot_list(b));
}

/* The class id for priority prio, made if new; the nearest class when no
 * more can be made. false: there is no class at all (no memory). */
static bool class_of(dmem__policy_t *p, int prio, uint32_t *cid_out) {
  uint32_t lo = 0, hi = p->ncls;
  while (lo < hi) {
    uint32_t mid = (lo + hi) / 2;
    if (p->cls[p->order[mid]].prio < prio) lo = mid + 1;
    else hi = mid;
  }
  if (lo < p->ncls && p->cls[p->order[lo]].prio == prio) {
    *cid_out = p->order[lo];
    return true;
  }
  if (p->ncls == p->capcls) {
    uint32_t cap = p->capcls ? p->capcls * 2 : 8;
    if (cap > DMEM__MAX_CLASSES) cap = DMEM__MAX_CLASSES;
    dmem__pclass_t *cls = cap > p->capcls ? realloc(p->cls, cap * sizeof *cls) : NULL;
    if (cls) p->cls = cls;
    uint16_t *order = cls ? realloc(p->order, cap * sizeof *order) : NULL;
    if (order) p->order = order;
    if (!cls || !order) {
      if (p->ncls == 0) return false;
      *cid_out = p->order[lo > 0 ? lo - 1 : 0];
      return true;
    }
    p->capcls = cap;
  }
  uint32_t id = p->ncls++;
  p->cls[id] = (dmem__pclass_t){.prio = prio};
  for (int l = 0; l < DMEM__PLISTS; l++) p->cls[id].head[l] = p->cls[id].tail[l] = DMEM__NO_SLOT;
  for (uint32_t i = p->ncls - 1; i > lo; i--) p->order[i] = p->order[i - 1];
  p->order[lo] = (uint16_t)id;
  *cid_out = id;
  return true;
}

/* The buffer has left the device, for good or for now (its entry is
 * stale): spilled (and not coming back yet), freed, or its slot empty. */
static bool gone(uint64_t w) {
  if (w & DMEM__F_FREED) return true;
  unsigned s = dmem__w_state(w);
  /* free, or held by a tier (any state but these three; spill/tier.c) */
  return s != DMEM_STATE_RESIDENT && s != DMEM_STATE_SPILLING && s != DMEM_STATE_UNSPILLING;
}

/* Resident, unlocked, nobody moving it: a victim now. */
static bool takeable(uint64_t w) {
  return dmem__w_state(w) == DMEM_STATE_RESIDENT && dmem__w_count(w) == 0 &&
         !(w & (DMEM__F_TRANSIT | DMEM__F_FREED));
}

/* Give back a mark that first() consumed but did not act on (the
 * arrival's own unlock): unless an unlock marked the buffer since, which
 * then counts instead. */
static void restore(dmem__buffer_t *b, uint8_t mark) {
  uint8_t none = 0;
  if (mark) (void)dmem_atomic_cas_strong_relaxed(&b->ref, &none, mark);
}

/* The first entry of list l of class c that is a victim now, walking from
 * the head (newest_first: from the tail): stale entries are dropped,
 * locked ones passed over (to the hot list's far end: in use), moving ones
 * too (to their list's far end: a spill may yet be cancelled),
 * marked ones promoted to hot (from cold and back: used again since they
 * arrived, a mark of 2) or moved to the hot CLOCK's far end (from hot: a
 * mark of 1), their recency renewed. NULL when none is left. Each entry
 * is looked at once (on the hot list, at most twice). */
static dmem__buffer_t *first(dmem_runtime_t *rt, dmem__pclass_t *c, int l, bool newest_first,
                             uint64_t *w_out) {
  /* the hot CLOCK may need two turns: the first may only consume marks */
  size_t steps = (l >= HOT0 ? 2 : 1) * c->n[l];
  while (steps-- > 0) {
    uint32_t s = newest_first ? c->tail[l] : c->head[l];
    if (s == DMEM__NO_SLOT) break;
    dmem__buffer_t *b = at(rt, s);
    uint64_t w = dmem_atomic_load_acquire(&b->word); /* partner: the last mover's release */
    if (gone(w) || dmem__w_state(w) == DMEM_STATE_UNSPILLING) {
      unlink_b(rt, b); /* left (coming back: its arrival links it again) */
      continue;
    }
    if (dmem__w_count(w) > 0 && dmem__w_state(w) == DMEM_STATE_RESIDENT) { /* locked: in use */
      to_hot(rt, b);
      continue;
    }
    if (!takeable(w) || (b->pback & DMEM__PB_TAKEN)) { /* being moved (a spill, maybe
                                                        cancelled), or taken: later */
      uint32_t cid = b->pcls - 1u;
      bool soon = b->pback & DMEM__PB_SOON;
      unlink_b(rt, b);
      if (newest_first) link_head(rt, b, cid, l); /* the end this walk reaches last */
      else link_tail(rt, b, cid, l);
      if (soon) set_soon(rt, b);
      continue;
    }
    uint8_t mark = dmem_atomic_exchange_relaxed(&b->ref, 0);
    if (mark >= (l >= HOT0 ? 1 : 2)) {
      to_hot(rt, b);
      continue;
    }
    restore(b, mark); /* the arrival's own */
    *w_out = w;
    return b;
  }
  return NULL;
}

/* Of class c's cold head and hot heads (after first()), the one used
 * least recently; NULL when all those lists are empty. */
static dmem__buffer_t *oldest(dmem_runtime_t *rt, dmem__pclass_t *c, uint64_t *w_out) {
  uint64_t w = 0;
  dmem__buffer_t *best = first(rt, c, COLD, false, &w);
  *w_out = w;
  for (int l = HOT0; l < HOT0 + DMEM__PHOT; l++) {
    if (c->n[l] == 0) continue;
    dmem__buffer_t *b = first(rt, c, l, false, &w);
    if (b && (!best || dmem_atomic_load_relaxed(&b->last_use) <
                           dmem_atomic_load_relaxed(&best->last_use))) {
      best = b;
      *w_out = w;
    }
  }
  return best;
}

/* Of class c's hot heads (after first()), the one predicted dead: its last
 * two reuse intervals agree (within DMEM__STABLE times), and it has been
 * idle for more than DMEM__OVERDUE times the last one; of several, the one
 * idle for the most of its intervals. NULL when none is. */
static dmem__buffer_t *overdue(dmem_runtime_t *rt, dmem__pclass_t *c, uint64_t *w_out) {
  uint64_t t = now(&rt->pol), w = 0;
  dmem__buffer_t *best = NULL;
  double best_r = 0;
  for (int l = HOT0; l < HOT0 + DMEM__PHOT - 1; l++) {
    if (c->n[l] == 0) continue;
    dmem__buffer_t *b = first(rt, c, l, false, &w);
    if (!b) continue;
    uint16_t v = dmem_atomic_load_relaxed(&b->pivs);
    uint64_t iv = piv_ticks(v & 0x7Fu), iv2 = piv_ticks(v >> 7 & 0x7Fu);
    if (iv == UINT64_MAX) continue;
    uint64_t lo = iv < iv2 ? iv : iv2, hi = iv < iv2 ? iv2 : iv;
    if (iv2 != UINT64_MAX && hi > DMEM__STABLE * (lo ? lo : 1)) continue; /* not steady */
    uint64_t l_use = dmem_atomic_load_relaxed(&b->last_use);
    uint64_t idle = t > l_use ? t - l_use : 0, m = iv;
    if (idle <= DMEM__OVERDUE * m) continue;
    double r = (double)idle / (double)(m ? m : 1);
    if (r > best_r) {
      best_r = r;
      best = b;
      *w_out = w;
    }
  }
  return best;
}

/* Link b, which arrived (kind), to its class's lists. */
static void link_arrival(dmem_runtime_t *rt, dmem__buffer_t *b, unsigned kind) {
  dmem__policy_t *p = &rt->pol;
  uint64_t w = dmem_atomic_load_acquire(&b->word); /* partner: the arrival's release */
  if (gone(w) || (dmem__bflags(b) & DMEM_ALLOC_PINNED)) {
    if (b->pcls) unlink_b(rt, b);
    return;
  }
  uint32_t cid;
  if (!class_of(p, dmem_atomic_load_relaxed(&b->priority), &cid)) {
    p->no_class = true; /* eviction scans the table from now on */
    if (b->pcls) unlink_b(rt, b);
    return;
  }
  if (kind == DMEM__ARRIVE_PRIO && b->pcls) {
    if (b->pcls != cid + 1) { /* the same list of its new class */
      int l = b->plist;
      bool soon = b->pback & DMEM__PB_SOON;
      unlink_b(rt, b);
      link_tail(rt, b, cid, l);
      if (soon) set_soon(rt, b);
    }
    return;
  }
  if ((kind == DMEM__ARRIVE_SOON || kind == DMEM__ARRIVE_SOON_USED) && b->pcls) {
    /* prefetched while resident: about to be locked, so the newest of its
     * list, recency renewed; not a use: a loop that prefetches ahead stays
     * a loop. One that was marked used at the prefetch, on back or on the
     * window, is wanted again before it was evicted: it fits, and is hot
     * (a loop's buffer that survived a pass, a GEMM's A tile that each
     * product of a row prefetches); its mark is consumed. One on back not
     * marked joins the window, unused. A cold one stays cold. */
    int l = b->plist;
    if (kind == DMEM__ARRIVE_SOON_USED && (l == BACK || l == WIN)) {
      (void)dmem_atomic_exchange_relaxed(&b->ref, 0);
      l = hot_list(b);
    } else if (l == BACK) {
      l = WIN;
    }
    unlink_b(rt, b);
    link_tail(rt, b, cid, l);
    if (l == WIN) set_soon(rt, b);
    return;
  }
  if (b->pcls) unlink_b(rt, b);
  bool was_back = b->pback & DMEM__PB_BACK;
  b->pback = 0;
  int l = COLD;
  if (kind == DMEM__ARRIVE_BACK || kind == DMEM__ARRIVE_BACK_SOON) {
    /* Back after as many victims as the class's oldest buffer has been
     * unused, or more: LRU would have evicted it too. (Not when no victim
     * was taken since its last known use: a dmem_buffer_spill and the lock or
     * prefetch that brought it back say nothing about loops.) */
    dmem__pclass_t *c = &p->cls[cid];
    uint64_t reuse = dmem_atomic_load_relaxed(&b->preuse), w2; /* the ticks its arrival counted */
    dmem__buffer_t *o = oldest(rt, c, &w2);
    uint64_t t = now(p), lo = o ? dmem_atomic_load_relaxed(&o->last_use) : t;
    uint64_t age = t > lo ? t - lo : 0;
    /* the interval before: a buffer used in bursts (its uses close
     * together, then a long pause) is back for a new burst, not a loop */
    uint64_t before = piv_ticks(dmem_atomic_load_relaxed(&b->pivs) >> 7 & 0x7Fu);
    bool burst = before != UINT64_MAX && before * DMEM__BURST < reuse;
    if (reuse > 0 && reuse >= age && !burst) l = WIN;
    if (was_back) {
      /* It went through the window unused and was evicted from back: if
       * it is back soon (used again shortly after its window: a buffer
       * prefetched ahead, a GEMM's A tile), the window was too small: it
       * grows by the buffer's size; if it is back as a loop's member
       * again, the window may be larger than it needs: it shrinks by an
       * eighth of that (so a loop that prefetches d buffers ahead keeps a
       * window of about d + 1 at the price of a few early evictions a
       * pass, and one that does not lets it shrink). */
      size_t size = dmem__bsize(b);
      if (l == WIN)
        p->win_max = p->win_max > p->win_min + size / 8 ? p->win_max - size / 8 : p->win_min;
      else p->win_max = p->win_max + size < p->win_top ? p->win_max + size : p->win_top;
    }
  }
  /* prefetched: about to be used, whatever its past (a loop's member that
   * the heuristic above cannot tell from a buffer unused as long: the
   * loop's kept buffers are idle for about as many victims) */
  bool soon = kind == DMEM__ARRIVE_BACK_SOON || kind == DMEM__ARRIVE_SOON ||
              kind == DMEM__ARRIVE_SOON_USED;
  if (soon) l = WIN;
  link_tail(rt, b, cid, l);
  if (soon) set_soon(rt, b);
}

/* Link the buffers that arrived since the last drain, in arrival order. */
static void drain(dmem_runtime_t *rt) {
  dmem__policy_t *p = &rt->pol;
  /* acquire: partner is dmem__policy_arrive's releasing CAS */
  uint32_t s = (uint32_t)dmem_atomic_exchange_acq_rel(&p->arrivals, (uint64_t)DMEM__NO_SLOT);
  uint32_t rev = DMEM__NO_SLOT;
  while (s != DMEM__NO_SLOT) { /* the stack is newest first: reverse it */
    dmem__buffer_t *b = at(rt, s);
    uint32_t next = dmem_atomic_load_relaxed(&b->anext);
    dmem_atomic_store_relaxed(&b->anext, rev); /* still pending: nobody pushes it */
    rev = s;
    s = next;
  }
  /* allocations and priority changes first, then buffers brought back:
   * a buffer allocated and brought back before one drain is pushed once,
   * at its allocation, but arrived last */
  for (s = rev; s != DMEM__NO_SLOT; s = dmem_atomic_load_relaxed(&at(rt, s)->anext)) {
    dmem__buffer_t *b = at(rt, s);
    uint8_t kind = dmem_atomic_load_relaxed(&b->parr);
    /* DONE, not 0: still pending for arrivals (they push nothing), so
     * anext stays as it is until the second loop */
    if (kind != DMEM__ARRIVE_BACK && kind != DMEM__ARRIVE_BACK_SOON &&
        dmem_atomic_cas_strong_acq_rel(&b->parr, &kind, (uint8_t)DONE))
      link_arrival(rt, b, kind);
  }
  for (s = rev; s != DMEM__NO_SLOT;) {
    dmem__buffer_t *b = at(rt, s);
    s = dmem_atomic_load_relaxed(&b->anext);
    /* anext read first: once parr is 0 the buffer may be pushed again; a
     * kind other than DONE arrived since the first loop */
    uint8_t kind = dmem_atomic_exchange_acq_rel(&b->parr, 0);
    if (kind != DONE) link_arrival(rt, b, kind);
  }
}

size_t dmem__policy_collect(dmem_runtime_t *rt, size_t need, dmem__victim_t *out, size_t max,
                            size_t *entries_out, bool *fallback_out) {
  dmem__policy_t *p = &rt->pol;
  size_t k = 0, bytes = 0, entries = 0;
  dmem__mutex_lock(&p->mu, DMEM__RANK_POLICY);
  drain(rt);
  for (uint32_t i = 0; i < p->ncls && bytes < need && k < max; i++) {
    dmem__pclass_t *c = &p->cls[p->order[i]];
    /* The window's oldest go on to back once used (or to hot, used again
     * meanwhile), and beyond its size even if not. Once a collect, and at
     * most 4 x max entries: it was once a victim and the whole window, so
     * that with n prefetched buffers not used yet (each rotated to the
     * newest end) an eviction of n walked the window n times (0.7 s for
     * 1024 buffers of 64 KiB, bench_spill's batch row at 0.005 of raw); a
     * longer window is walked on over the next collects. */
    size_t walk = c->n[WIN] < 4 * max ? c->n[WIN] : 4 * max;
    for (size_t steps = walk; steps > 0 && c->head[WIN] != DMEM__NO_SLOT; steps--) {
      dmem__buffer_t *b = at(rt, c->head[WIN]);
      uint64_t wb = dmem_atomic_load_acquire(&b->word); /* partner: the last mover's release */
      if (gone(wb) || dmem__w_state(wb) == DMEM_STATE_UNSPILLING) {
        unlink_b(rt, b);
        continue;
      }
      uint8_t mark = dmem_atomic_exchange_relaxed(&b->ref, 0);
      if (mark >= 2) {
        to_hot(rt, b); /* used again meanwhile */
        continue;
      }
      restore(b, mark);
      /* in its first use (locked: its unlock marks it), or prefetched and
       * not used yet: it stays, whatever the window's size (to its newest
       * end: the walk goes on) */
      bool soon = b->pback & DMEM__PB_SOON;
      if (mark == 0 && (dmem__w_count(wb) > 0 || soon)) {
        move_tail(rt, b, WIN);
        if (soon && dmem__w_count(wb) == 0) set_soon(rt, b);
        continue;
      }
      if (mark == 0 && (c->win_bytes <= p->win_max || c->n[WIN] <= 1)) break;
      move_tail(rt, b, BACK);
    }
    while (bytes < need && k < max) {
      uint64_t w = 0;
      /* Unused prefetched buffers holding soon_top or more: the newest
       * (the one needed last) goes to back, the next victim, as if its
       * prefetch had been dropped, rather than a buffer in use (a prefetch
       * of more than fits does not push everything else out) */
      while (c->soon_bytes >= p->soon_top && c->tail[WIN] != DMEM__NO_SLOT &&
             (at(rt, c->tail[WIN])->pback & DMEM__PB_SOON))
        move_tail(rt, at(rt, c->tail[WIN]), BACK);
      /* a buffer predicted dead, then back's newest */
      dmem__buffer_t *b = overdue(rt, c, &w);
      if (!b && (b = first(rt, c, BACK, true, &w)) != NULL) b->pback = DMEM__PB_BACK;
      if (!b) b = oldest(rt, c, &w);
      if (!b) b = first(rt, c, WIN, false, &w);
      if (!b) b = oldest(rt, c, &w); /* what the window promoted to hot */
      if (!b) break;
      /* taken: to the cold list's newest end, so that a pass running
       * beside this one takes others; if its spill fails it stays there,
       * resident */
      move_tail(rt, b, COLD);
      b->pback |= DMEM__PB_TAKEN;
      out[k++] = (dmem__victim_t){.priority = c->prio, .b = b, .h = dmem__handle_of(b, w)};
      bytes += dmem__bsize(b);
      dmem_atomic_add_relaxed(&p->tick, 1);
    }
  }
  for (uint32_t i = 0; i < p->ncls; i++)
    for (int l = 0; l < DMEM__PLISTS; l++) entries += p->cls[i].n[l];
  for (size_t i = 0; i < k; i++) out[i].b->pback &= (uint8_t)~DMEM__PB_TAKEN;
  *fallback_out = p->no_class;
  dmem__mutex_unlock(&p->mu, DMEM__RANK_POLICY);
  *entries_out = entries;
  return k;
}
