/*
 * spill/policy.c - choosing spill victims and spilling them: the controller's
 * selection when it gives one, else lowest priority first and, within a
 * priority, the runtime's eviction policy: the default (spill/reuse.c: cold
 * buffers before hot, victims from lists, amortised O(1) each) or, with
 * DMEM_EVICTION_LRU, least recently unlocked first (every slot scanned and
 * sorted at each pass).
 */
#include "spill/spill.h"
#include "spill/summary.h"
#include <sched.h>
#include <stdlib.h>


static int cmp_victims(const void *a, const void *b) {
  const dmem__victim_t *x = a, *y = b;
  if (x->priority != y->priority) return x->priority < y->priority ? -1 : 1;
  if (x->last_use != y->last_use) return x->last_use < y->last_use ? -1 : 1;
  return 0;
}

dmem_status_t dmem__victims_sorted(dmem_runtime_t *rt,
                                   bool (*want)(uint64_t w, const dmem__buffer_t *b),
                                   dmem__victim_t **out_v, size_t *n_out) {
  uint32_t hw = dmem_atomic_load_acquire(&rt->table->high_water); /* partner: table_take */
  dmem__victim_t *v = malloc((size_t)(hw ? hw : 1) * sizeof *v);
  if (!v) return DMEM_ERR_HOST_OUT_OF_MEMORY;
  size_t n = 0;
  for (uint32_t slot = 0; slot < hw; slot++) {
    dmem__buffer_t *b = dmem__table_slot(rt->table, slot);
    if (!b) break;
    uint64_t w = dmem_atomic_load_acquire(&b->word); /* partner: the last mover's release */
    if (!want(w, b)) continue;
    v[n].priority = dmem_atomic_load_relaxed(&b->priority);
    v[n].last_use = dmem_atomic_load_relaxed(&b->last_use);
    v[n].b = b;
    v[n].h = dmem__handle_of(b, w);
    n++;
  }
  qsort(v, n, sizeof *v, cmp_victims);
  *out_v = v;
  *n_out = n;
  return DMEM_OK;
}

/* Resident, unlocked, not moving, not freed, not pinned: spillable now. */
static bool spillable(uint64_t w, const dmem__buffer_t *b) {
  return dmem__w_state(w) == DMEM_STATE_RESIDENT && dmem__w_count(w) == 0 &&
         !(w & (DMEM__F_TRANSIT | DMEM__F_FREED)) && !(dmem__bflags(b) & DMEM_ALLOC_PINNED);
}

/* Stop early on errors that every further victim would hit too. */
static bool hopeless(dmem_status_t st) {
  return st == DMEM_ERR_DEVICE || st == DMEM_ERR_DEVICE_FATAL;
}

static void note(dmem_status_t st, dmem_status_t *first) {
  if (st != DMEM_OK && st != DMEM_ERR_BUSY && st != DMEM_ERR_STALE_HANDLE && *first == DMEM_OK)
    *first = st;
}

/* What one pass did, for the stats and the log line. */
typedef struct pass {
  dmem__evict_reason_t reason;
  size_t victims;
  size_t freed;
  dmem_status_t first;
  dmem__swap_t *swap; /* a retrieve's offer to trade places, or NULL */
} pass_t;

/* Under a pass with a swap offer: take b for the swap rather than spill it
 * when it can trade places with the retrieved buffer (spill.h:
 * dmem__swap_t). true: taken, counted as freed. */
static bool swap_take(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h, pass_t *ps) {
  dmem__swap_t *sw = ps->swap;
  if (!sw || sw->b || b == sw->self || dmem__bsize(b) != sw->size) return false;
  if (dmem__bflags(b) & (DMEM_BUFFER_STABLE_ADDRESS | DMEM_ALLOC_PINNED)) return false;
  /* pieces: the victim's bytes go to the host tier as a spill's do; with
   * that tier at its limit the victim spills the usual way (down the
   * chain), rather than being taken and given back (swap.c: the host tier
   * would refuse it, and a victim given back at every retrieve reorders
   * the policy's lists) */
  if (rt->swap_pieces && rt->host_limit &&
      dmem_atomic_load_relaxed(&rt->host_used) + sw->size > rt->host_limit)
    return false;
  /* acquire: partner is the release of the last mover / dmem_buffer_alloc */
  uint64_t w = dmem_atomic_load_acquire(&b->word);
  for (;;) {
    if (!dmem__word_live(w, h) || dmem__w_state(w) != DMEM_STATE_RESIDENT ||
        dmem__w_count(w) > 0 || (w & DMEM__F_TRANSIT))
      return false;
    /* counted before it leaves the spillable set, as dmem__spill_buffer does */
    dmem_atomic_add_relaxed(&rt->spills_in_flight, 1);
    if (dmem__transit_take(b, &w, DMEM_STATE_SPILLING, 0)) break;
    dmem_atomic_sub_relaxed(&rt->spills_in_flight, 1);
  }
  if (b->host && !rt->swap_pieces) {
    /* staging of its own (b->host is stable while we own TRANSIT): its
     * spill reuses that and pins nothing; spilled the usual way (a pieces
     * swap spills into it too: swap.c) */
    dmem__move_end(rt, b, (dmem__transit_exit_t){.to = DMEM__TO(DMEM_STATE_RESIDENT)});
    dmem__move_finished(rt);
    return false;
  }
  sw->b = b;
  sw->h = h;
  sw->w = w;
  ps->freed += sw->size;
  ps->victims++;
  dmem_atomic_add_relaxed(&rt->oom_evictions, 1);
  return true;
}

static dmem_status_t spill_victim(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                  pass_t *ps) {
  if (swap_take(rt, b, h, ps)) return DMEM_OK;
  size_t size = dmem__bsize(b);
  /* to the chain's first tier (spill/tier.c: the host tier) */
  dmem_status_t st = dmem__spill_buffer(rt, b, h, dmem__tier_top()->tier, true);
  if (st == DMEM_OK) {
    ps->freed += size;
    ps->victims++;
    if (ps->reason == DMEM__EVICT_ON_DEMAND) dmem_atomic_add_relaxed(&rt->oom_evictions, 1);
    if (ps->reason == DMEM__EVICT_AHEAD) {
      dmem_atomic_add_relaxed(&rt->xs.ahead_evictions, 1);
      dmem_atomic_add_relaxed(&rt->xs.ahead_bytes, size);
    }
  }
  note(st, &ps->first);
  return st;
}

/* Spill victims from cand[0..n) to the host tier (the tier whose row takes
 * batches) as one batch
 * (move_out.c's dmem__spill_batch: one copy event, one pool release, one
 * staging carve for all of them); when the host tier or the pinned pool
 * cannot take the batch at once, the same candidates one by one.
 * *used_out: candidates consumed. */
static dmem_status_t spill_batch(dmem_runtime_t *rt, dmem__victim_t *cand, size_t n, size_t need,
                                 pass_t *ps, size_t *used_out) {
  /* the batch's first candidate is the victim a swap would take */
  if (n > 0 && cand[0].b && swap_take(rt, cand[0].b, cand[0].h, ps)) {
    *used_out = 1;
    return DMEM_OK;
  }
  dmem__spill_batch_result_t r;
  dmem_status_t st = dmem__spill_batch(rt, cand, n, need - ps->freed, &r);
  *used_out = r.used ? r.used : 1;
  if (r.single) {
    for (size_t j = 0; j < r.used && ps->freed < need; j++) {
      if (!cand[j].b) continue;
      st = spill_victim(rt, cand[j].b, cand[j].h, ps);
      if (hopeless(st) || st == DMEM_ERR_HOST_OUT_OF_MEMORY || st == DMEM_ERR_IO) {
        *used_out = j + 1;
        return st;
      }
    }
    return DMEM_OK;
  }
  if (r.victims > 0) {
    ps->freed += r.freed;
    ps->victims += r.victims;
    if (ps->reason == DMEM__EVICT_ON_DEMAND) dmem_atomic_add_relaxed(&rt->oom_evictions, r.victims);
    if (ps->reason == DMEM__EVICT_AHEAD) {
      dmem_atomic_add_relaxed(&rt->xs.ahead_evictions, r.victims);
      dmem_atomic_add_relaxed(&rt->xs.ahead_bytes, r.freed);
    }
  }
  note(st, &ps->first);
  return st;
}

static const char *reason_name(dmem__evict_reason_t r) {
  switch (r) {
    case DMEM__EVICT_ON_DEMAND: return "on-demand (an allocation needed room)";
    case DMEM__EVICT_AHEAD: return "ahead (device use above the high-water mark)";
    default: return "explicit (dmem_evict)";
  }
}

/* The first candidate (in policy order) whose block, freed, would join the
 * free ranges beside it into one of at least `contig` bytes; -1 if none. */
static long find_range_maker(dmem_runtime_t *rt, const dmem__victim_t *cand, size_t n,
                             size_t contig) {
  size_t want = dmem__pool_block_size(contig);
  dmem__pool_flush(rt->pool); /* cached free blocks count as free ranges */
  for (size_t i = 0; i < n; i++) {
    void *dev = dmem__bdev(cand[i].b); /* a hint: the spill re-validates */
    if (dev && dmem__pool_range_if_freed(rt->pool, dev, dmem__bsize(cand[i].b)) >= want)
      return (long)i;
  }
  return -1;
}

static dmem_status_t evict_pass(dmem_runtime_t *rt, size_t need, size_t contig, pass_t *ps);

/* A pass that freed nothing: candidates that their owners freed since the
 * scan gave their device memory back (or are giving it), which the
 * allocation waiting for room has not seen. Count that as a finished move
 * (spill/pressure.c then tries again instead of failing); a free whose
 * reclaim is still running (FREED, unlocked, not moving) is waited for
 * first, briefly, so that its memory is back when the allocation retries. */
static void note_freed_since_scan(dmem_runtime_t *rt, const dmem__victim_t *cand, size_t n) {
  bool any = false;
  for (size_t i = 0; i < n; i++) {
    if (!cand[i].b) continue;
    /* acquire: partner is dmem_buffer_free's CAS / the table's release of the slot */
    uint64_t w = dmem_atomic_load_acquire(&cand[i].b->word);
    if (dmem__word_live(w, cand[i].h)) continue;
    any = true;
    for (int spin = 0; spin < 1000; spin++) {
      bool reclaiming = dmem__w_gen(w) == dmem__h_gen(cand[i].h) &&
                        dmem__w_state(w) != DMEM__STATE_FREE && dmem__w_count(w) == 0 &&
                        !(w & DMEM__F_TRANSIT);
      if (!reclaiming) break;
      sched_yield();
      w = dmem_atomic_load_acquire(&cand[i].b->word); /* partner: as above */
    }
  }
  if (any) dmem_atomic_add_relaxed(&rt->moves_done, 1);
}

static dmem_status_t evict(dmem_runtime_t *rt, size_t need, size_t contig,
                           dmem__evict_reason_t reason, dmem__swap_t *swap, size_t *freed_out,
                           dmem_status_t *first_error_out) {
  pass_t ps = {.reason = reason, .first = DMEM_OK, .swap = swap};
  DMEM_NVTX_PUSH("dmem eviction pass");
  uint64_t t0 = dmem__now_ns();
  dmem_atomic_add_relaxed(&rt->xs.evict_passes, 1);
  dmem_status_t st = evict_pass(rt, need, contig, &ps);
  DMEM_NVTX_POP();
  if (ps.victims > 0 && DMEM__TRACE_ON())
    dmem__trace_event(DMEM__TRACK_TIER, DMEM_TIER_DEVICE,
                      reason == DMEM__EVICT_ON_DEMAND ? "evict (on demand)"
                      : reason == DMEM__EVICT_AHEAD   ? "evict (spill-ahead)"
                                                      : "evict (dmem_evict)",
                      t0,
                      dmem__now_ns() - t0, ps.freed, ps.victims, 0);
  if (ps.victims > 0) dmem__summary_note(rt);
  /* one line a pass: debug (info has the summary of spill/summary.c) */
  if (ps.victims > 0) {
    char ask[64]; /* "asked N" or "asked N, contiguous M" */
    if (contig)
      snprintf(ask, sizeof ask, "asked %zu, contiguous %zu", need, contig);
    else
      snprintf(ask, sizeof ask, "asked %zu", need);
    DMEM_RT_LOG(rt, DMEM_LOG_DEBUG,
                "evict: %zu victims, %zu bytes (%s), %s, %.3f ms, device used %zu of %zu",
                ps.victims, ps.freed, ask, reason_name(reason),
                (double)(dmem__now_ns() - t0) * 1e-6, dmem__device_used(rt), rt->limit);
  }
  if (st != DMEM_OK) return st;
  *freed_out = ps.freed;
  if (first_error_out) *first_error_out = ps.first;
  return DMEM_OK;
}

dmem_status_t dmem__evict(dmem_runtime_t *rt, size_t need, size_t contig,
                          dmem__evict_reason_t reason, size_t *freed_out,
                          dmem_status_t *first_error_out) {
  return evict(rt, need, contig, reason, NULL, freed_out, first_error_out);
}

dmem_status_t dmem__evict_swap(dmem_runtime_t *rt, size_t need, size_t contig, dmem__swap_t *swap,
                               size_t *freed_out, dmem_status_t *first_error_out) {
  return evict(rt, need, contig, DMEM__EVICT_ON_DEMAND, swap, freed_out, first_error_out);
}

/* The default policy's victims (spill/reuse.c), a batch at a time, until
 * `need` bytes are freed, the lists are exhausted, or the host tier and
 * the disk cannot take more. With `contig`, the first victim of the first
 * batch whose block makes a free range of that size is spilled first,
 * alone, as the LRU path does (spill/policy.c: find_range_maker). *scan_out:
 * scan the table instead: the lists could not hold every buffer (no
 * memory), or no victim of the first batch makes the contiguous range
 * (the scan looks at every candidate for one). */
static dmem_status_t evict_reuse(dmem_runtime_t *rt, size_t need, size_t contig, pass_t *ps,
                                 bool *scan_out) {
  dmem__victim_t cand[DMEM__SPILL_BATCH_MAX];
  size_t looked = 0, entries = 0;
  bool fallback = false;
  *scan_out = false;
  while (ps->freed < need) {
    size_t n = dmem__policy_collect(rt, need - ps->freed, cand, DMEM__SPILL_BATCH_MAX, &entries,
                                    &fallback);
    if (fallback) {
      *scan_out = true;
      return DMEM_OK;
    }
    if (n == 0) break;
    if (contig) {
      long pick = find_range_maker(rt, cand, n, contig);
      if (pick < 0) {
        *scan_out = true;
        return DMEM_OK;
      }
      dmem_status_t st = spill_victim(rt, cand[pick].b, cand[pick].h, ps);
      if (hopeless(st)) return st;
      if (st == DMEM_OK && dmem__pool_fits(rt->pool, contig, NULL)) need = ps->freed;
      cand[pick].b = NULL; /* done: the batches skip it */
      contig = 0;
    }
    size_t before = ps->freed;
    for (size_t i = 0; i < n && ps->freed < need;) {
      size_t used = 0;
      dmem_status_t st = spill_batch(rt, cand + i, n - i, need, ps, &used);
      i += used;
      if (hopeless(st)) return st;
      if (st == DMEM_ERR_HOST_OUT_OF_MEMORY || st == DMEM_ERR_IO) return DMEM_OK;
    }
    if (ps->freed == 0) note_freed_since_scan(rt, cand, n);
    /* Candidates that could not be spilled (locked, moved or freed since)
     * went to the lists' newest ends: the next batch takes others. Stop
     * once as many as the lists hold were looked at. */
    looked += n;
    if (ps->freed == before && looked > entries) break;
  }
  return DMEM_OK;
}

static dmem_status_t evict_pass(dmem_runtime_t *rt, size_t need, size_t contig, pass_t *ps) {
  if (rt->pol_lru) dmem_atomic_add_relaxed(&rt->lru_epoch, 1); /* unlocks from now on are newer */
  dmem_controller_t c;
  if (dmem__controller_get(rt, &c) && c.select_victims) {
    size_t cap = dmem_atomic_load_relaxed(&rt->buffer_count);
    if (cap < 64) cap = 64;
    dmem_handle_t *v = malloc(cap * sizeof *v);
    if (!v) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "victim array allocation failed");
    size_t n = 0;
    dmem_status_t st = c.select_victims(c.user, need, v, cap, &n);
    if (st != DMEM_OK) {
      free(v);
      return dmem__error(DMEM_ERR_CALLBACK, "controller select_victims returned %s",
                         dmem_status_name(st));
    }
    if (n != DMEM_VICTIMS_DEFAULT) {
      if (n > cap) n = cap;
      for (size_t i = 0; i < n && ps->freed < need; i++) {
        dmem__buffer_t *b = dmem__table_lookup(rt->table, v[i]);
        if (!b) continue;
        st = spill_victim(rt, b, v[i], ps);
        if (hopeless(st)) {
          free(v);
          return st;
        }
      }
    }
    free(v);
    if (ps->freed >= need) goto done;
  }
  if (!rt->pol_lru) {
    bool scan = false;
    dmem_status_t st = evict_reuse(rt, need, contig, ps, &scan);
    if (st != DMEM_OK || !scan) return st;
    if (ps->freed >= need) goto done;
  }
  {
    /* LRU; or under the default policy, a contiguous range that its first
     * victims do not make (every candidate is looked at, in the order of
     * the policy's tick of each one's last known use), or lists short of
     * memory */
    dmem__victim_t *cand;
    size_t n;
    if (dmem__victims_sorted(rt, spillable, &cand, &n) != DMEM_OK)
      return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "candidate array allocation failed");
    long first_pick = contig ? find_range_maker(rt, cand, n, contig) : -1;
    if (first_pick >= 0) {
      /* One victim that makes the range beats several that do not. */
      dmem_status_t st = spill_victim(rt, cand[first_pick].b, cand[first_pick].h, ps);
      if (hopeless(st)) {
        free(cand);
        return st;
      }
      if (st == DMEM_OK && dmem__pool_fits(rt->pool, contig, NULL)) need = ps->freed;
    }
    if (first_pick >= 0) cand[first_pick].b = NULL; /* done: the batches skip it */
    for (size_t i = 0; i < n && ps->freed < need;) {
      size_t used = 0;
      dmem_status_t st = spill_batch(rt, cand + i, n - i, need, ps, &used);
      i += used;
      if (hopeless(st)) {
        free(cand);
        return st;
      }
      if (st == DMEM_ERR_HOST_OUT_OF_MEMORY || st == DMEM_ERR_IO) break;
    }
    if (ps->freed == 0) note_freed_since_scan(rt, cand, n);
    free(cand);
  }
done:
  return DMEM_OK;
}
