/*
 * spill/swap.c - a retrieve that trades places with its victim, or takes
 * its victim's block piece by piece.
 *
 * A buffer brought back from the host tier into a full device needs one
 * victim spilled first. Spilled the usual way, the victim's bytes go into
 * newly pinned memory while the returning buffer's own pinned copy is still
 * held (it is freed only after its copy to the device): for a moment the
 * process pins one buffer more than the host tier holds, and with several
 * retrieves at once, several (a Dask worker's peak RSS, docs/dask.md).
 *
 * A swap moves no byte into new memory. When the first victim an on-demand
 * pass would spill has the returning buffer's size (the same pool block)
 * and no staging of its own, the pass hands it over (spill/policy.c) and
 * the two trade places piece by piece through a small device bounce
 * buffer:
 *
 *   victim's device piece -> bounce        (device to device, unspill stream)
 *   returning pinned piece -> device piece (host to device, unspill stream)
 *   bounce -> returning pinned piece       (device to host, spill stream)
 *
 * The returning buffer then owns the victim's device block, the victim owns
 * the returning buffer's pinned memory (DEFERRED_HOST, SPILL_COPY until the
 * copies are seen complete), and the host tier and the device hold what
 * they held. The bounce buffer has two halves used in turn, each guarded
 * by two events (filled on the unspill stream, emptied on the spill
 * stream), so that one piece's host-to-device copy runs beside the
 * previous piece's device-to-host copy: a swap keeps both directions of
 * the link busy, as a spill and a retrieve on their own streams do.
 *
 * The bounce buffer (2 x DMEM__SWAP_PIECE bytes) and its events are made at
 * the first retrieve from the host tier (dmem__swap_ready), outside the
 * device limit (like the CUDA context, they are the runtime's own), and
 * freed at destroy; when they cannot be made, swaps stay off for the
 * runtime (rt->swap_no_bounce), decided before any victim is taken. One swap at a time
 * enqueues through it (rt->swap_mu, held only while enqueueing); the
 * events order the next swap's use of each half after this one's.
 *
 * A swap that fails part way (a backend error enqueueing a copy) swaps the
 * pieces already traded back (the three copies are their own inverse) and
 * leaves both buffers as they were; the caller then retrieves the usual way.
 *
 * That is DMEM_RETRIEVE_SWAP=on. The default, pieces, takes the victim the
 * same way but trades no memory and needs no bounce: the victim's bytes go
 * out into pinned memory of their own (its staging, else new staging) on
 * the spill stream, and the returning buffer's come in from its own pinned
 * copy on the unspill stream, piece by piece, each piece in once it is out
 * (swap_in_pieces). Spilled first, the victim's whole copy would have to
 * end before any byte came in: one direction of the link idle for a whole
 * buffer's copy at each start of a loop's pipeline.
 */
#include "spill/spill.h"
#include "spill/summary.h"

/* The size of each piece traded; the bounce buffer holds two. */
#define DMEM__SWAP_PIECE ((size_t)8 << 20)

/* How far the trade of one piece got. */
enum { PIECE_UNTOUCHED, PIECE_IN_BOUNCE, PIECE_TRADED };

/* Enqueue the trade of [off, off + n) of the victim's device range `dev` and
 * the pinned memory `host` through half j of the bounce buffer: on
 * rt->unspill_stream (cs), once the half is free, the victim's piece into
 * it and the pinned piece onto the device; on rt->spill_stream (ss), once
 * those are done, the half into the pinned piece. The two halves alternate,
 * so the copies of one direction overlap the other's. *phase_out: how far
 * it got (PIECE_TRADED on success). */
static dmem_status_t trade(dmem_runtime_t *rt, char *dev, char *host, size_t off, size_t n,
                           int j, int *phase_out) {
  void *cs = rt->unspill_stream, *ss = rt->spill_stream;
  char *half = (char *)rt->swap_bounce + (size_t)j * DMEM__SWAP_PIECE;
  void *ready = rt->swap_ev[j], *freed = rt->swap_ev[2 + j];
  dmem__backend_t *be = rt->be;
  *phase_out = PIECE_UNTOUCHED;
  dmem_status_t st = be->stream_wait_event(be, cs, freed);
  if (st == DMEM_OK) st = be->memcpy_async(be, half, dev + off, n, cs);
  if (st == DMEM_OK) st = be->memcpy_async(be, dev + off, host + off, n, cs);
  if (st != DMEM_OK) return dmem__fatal_keep(rt, st);
  *phase_out = PIECE_IN_BOUNCE;
  st = be->event_record(be, ready, cs);
  if (st == DMEM_OK) st = be->stream_wait_event(be, ss, ready);
  if (st == DMEM_OK) st = be->memcpy_async(be, host + off, half, n, ss);
  if (st != DMEM_OK) return dmem__fatal_keep(rt, st);
  *phase_out = PIECE_TRADED;
  /* a failure here leaves the piece traded: the caller synchronises */
  return dmem__fatal_keep(rt, be->event_record(be, freed, ss));
}

/* Trade a piece back, or finish putting one back, on cs alone through half
 * 0 (both streams are idle: the caller synchronised them). */
static dmem_status_t trade_back(dmem_runtime_t *rt, char *dev, char *host, size_t off, size_t n) {
  void *cs = rt->unspill_stream, *half = rt->swap_bounce;
  dmem_status_t st = rt->be->memcpy_async(rt->be, half, dev + off, n, cs);
  if (st == DMEM_OK) st = rt->be->memcpy_async(rt->be, dev + off, host + off, n, cs);
  if (st == DMEM_OK) st = rt->be->memcpy_async(rt->be, host + off, half, n, cs);
  return dmem__fatal_keep(rt, st);
}

/* The copies of one swap, under rt->swap_mu. On failure both streams are
 * synchronised and the pieces traded so far are traded back (a piece half
 * traded is put back), so that both ranges hold what they held. */
static dmem_status_t trade_all(dmem_runtime_t *rt, char *dev, char *host, size_t size) {
  size_t off = 0, n = 0;
  int phase = PIECE_TRADED, j = 0;
  dmem_status_t st = DMEM_OK;
  for (; off < size; off += n, j ^= 1) {
    n = size - off < DMEM__SWAP_PIECE ? size - off : DMEM__SWAP_PIECE;
    st = trade(rt, dev, host, off, n, j, &phase);
    if (st != DMEM_OK) break;
  }
  if (st == DMEM_OK) return DMEM_OK;
  (void)rt->be->stream_synchronize(rt->be, rt->unspill_stream);
  (void)rt->be->stream_synchronize(rt->be, rt->spill_stream);
  /* [off, off + n) got to `phase`: untouched, nothing to do; traded, one
   * more to trade back; in the bounce (the device piece is the pinned
   * one's now), the victim's piece goes back from half j */
  dmem_status_t u = DMEM_OK;
  size_t back_to = phase == PIECE_TRADED ? off + n : off;
  if (phase == PIECE_IN_BOUNCE)
    u = dmem__fatal_keep(rt, rt->be->memcpy_async(rt->be, dev + off,
                                                  (char *)rt->swap_bounce +
                                                      (size_t)j * DMEM__SWAP_PIECE,
                                                  n, rt->unspill_stream));
  for (size_t back = 0; back < back_to && u == DMEM_OK; back += DMEM__SWAP_PIECE) {
    size_t m = back_to - back < DMEM__SWAP_PIECE ? back_to - back : DMEM__SWAP_PIECE;
    u = trade_back(rt, dev, host, back, m);
  }
  if (u == DMEM_OK) u = dmem__fatal_keep(rt, rt->be->stream_synchronize(rt->be, rt->unspill_stream));
  if (u != DMEM_OK)
    DMEM_RT_LOG(rt, DMEM_LOG_ERROR,
                "swap: a copy failed (%s) and trading the %zu bytes already swapped back "
                "failed too (%s): two buffers' bytes are mixed",
                dmem_status_name(st), back_to, dmem_status_name(u));
  return st;
}

/* The bounce buffer and its four events (each half: ready on cs, free on
 * ss), made at the first swap. Under rt->swap_mu. */
static dmem_status_t bounce_get(dmem_runtime_t *rt) {
  if (rt->swap_bounce) return DMEM_OK;
  void *ev[4] = {NULL, NULL, NULL, NULL};
  void *bounce = NULL;
  dmem_status_t st = dmem__fatal_keep(rt, rt->be->device_alloc(rt->be, 2 * DMEM__SWAP_PIECE, &bounce));
  for (int i = 0; i < 4 && st == DMEM_OK; i++)
    st = dmem__fatal_keep(rt, rt->be->event_create(rt->be, &ev[i]));
  if (st != DMEM_OK) {
    for (int i = 0; i < 4; i++)
      if (ev[i]) (void)rt->be->event_destroy(rt->be, ev[i]);
    if (bounce) (void)rt->be->device_free(rt->be, bounce);
    return st;
  }
  for (int i = 0; i < 4; i++) rt->swap_ev[i] = ev[i];
  rt->swap_bounce = bounce;
  return DMEM_OK;
}

bool dmem__swap_ready(dmem_runtime_t *rt) {
  if (rt->swap_pieces) return true; /* no bounce buffer */
  if (rt->swap_off || dmem_atomic_load_acquire(&rt->swap_no_bounce)) return false;
  if (dmem_atomic_load_acquire(&rt->swap_ready)) return true; /* partner: the release below */
  dmem__mutex_lock(&rt->swap_mu, DMEM__RANK_SWAP);
  dmem_status_t st = bounce_get(rt);
  if (st == DMEM_OK) {
    dmem_atomic_store_release(&rt->swap_ready, 1); /* publishes swap_bounce, swap_ev */
  } else {
    /* No bounce buffer (the device is full to its last bytes, or a
     * backend error): retrieves go the usual way from now on. Decided
     * before any victim is taken: a victim taken and given back would
     * reorder the policy's lists at every retrieve. */
    dmem_atomic_store_release(&rt->swap_no_bounce, 1);
    DMEM_RT_LOG(rt, DMEM_LOG_INFO, "swap: no device bounce buffer (%s): retrieves spill first",
                dmem_status_name(st));
  }
  dmem__mutex_unlock(&rt->swap_mu, DMEM__RANK_SWAP);
  return st == DMEM_OK;
}

void dmem__swap_cancel(dmem_runtime_t *rt, dmem__swap_t *sw) {
  if (!sw->b) return;
  dmem__move_end(rt, sw->b, (dmem__transit_exit_t){.to = DMEM__TO(DMEM_STATE_RESIDENT)});
  dmem__move_finished(rt);
  sw->b = NULL;
}

/* Commit a swap's victim: DEFERRED_HOST at v->host, its copy in flight
 * until `ev` completes (NULL: the copies are done). No lock could cancel
 * this spill (SPILL_COPY was never set before now: lockers waited for the
 * move); a free may have come (FREED), which dmem__move_after completes
 * as for any spill. The victim's move is over and sw->b cleared. `traded`:
 * the retrieve took the victim's block (counted in dmem_stats.swaps). */
static void commit_victim(dmem_runtime_t *rt, dmem__swap_t *sw, void *ev, uint64_t t0,
                          bool traded) {
  dmem__buffer_t *v = sw->b;
  dmem_handle_t hv = sw->h;
  size_t size = sw->size;
  dmem_atomic_store_relaxed(&v->spill_event, ev);
  /* acquire: partner is lockers' and freers' CAS */
  uint64_t w = dmem_atomic_load_acquire(&v->word), nw;
  do {
    DMEM_ASSERT(dmem__w_state(w) == DMEM_STATE_SPILLING && (w & DMEM__F_TRANSIT) &&
                dmem__w_count(w) == 0);
    nw = (dmem__w_with_state(w, DMEM_STATE_DEFERRED_HOST) &
          ~(DMEM__F_TRANSIT | DMEM__F_UNSPILL_COPY | DMEM__F_SPILL_COPY)) |
         (ev ? DMEM__F_SPILL_COPY : 0);
    /* release: publishes v->host and v->spill_event; partner is the next
     * mover's acquire */
  } while (!dmem_atomic_cas_acq_rel(&v->word, &w, nw));
  DMEM_SCHED_POINT(); /* the next mover may own the victim from here */
  dmem__spill_counted(v);
  if (ev) dmem__staging_push(rt, v, hv); /* gives ev back once it completes */
  dmem__move_after(rt, v, nw);
  dmem__move_finished(rt);
  sw->b = NULL;
  if (traded) dmem_atomic_add_relaxed(&rt->xs.swaps, 1);
  if (DMEM__TRACE_ON())
    dmem__trace_event(DMEM__TRACK_TIER, DMEM_TIER_HOST, "spill (swap)", t0, dmem__now_ns() - t0,
                      size, 1, hv);
  dmem__stats_spill(rt, DMEM_TIER_HOST, size, dmem__now_ns() - t0);
  if (!(nw & DMEM__F_FREED)) dmem__emit(rt, DMEM_EVENT_SPILL, hv, size, DMEM_TIER_HOST, 0);
}

/* ---- pieces (DMEM_RETRIEVE_SWAP=pieces): no bounce, no trade of memory --------------- */

/* The size of each piece of a pieces swap: 32 MiB leaves the link one
 * direction short for about 0.6 ms at its start (a whole 256 MiB victim
 * spilled first: 5 ms on an H100), at four backend calls a piece. */
#define DMEM__SWAP_PIECES_PIECE ((size_t)32 << 20)

size_t dmem__swap_piece_size(void) {
  return dmem__config_env_pow2("DMEM_SWAP_PIECE", (size_t)64 << 10, (size_t)1 << 30,
                               DMEM__SWAP_PIECES_PIECE);
}

/* The most pieces a swap is cut in: larger buffers get larger pieces. */
#define DMEM__SWAP_PIECES_MAX 64

/* dmem__swap_in in pieces mode. The victim's bytes go into pinned memory
 * of its own, as a spill's do: the staging its last retrieve left (b->host,
 * charged to no tier), else new staging; the retrieved buffer keeps its
 * pinned copy, which copy_back recycles as any retrieve's staging.
 *
 * Two phases, so that a failure never leaves bytes to put back: first
 * every piece's copy out on the spill stream, each followed by an event of
 * its own, then on the unspill stream each piece's wait for its event and
 * its copy in (each piece comes in once it is out). A failure in the first
 * phase leaves the victim resident, untouched (its pinned copy is thrown
 * away); in the second, the victim's copy out is whole: the victim is
 * committed as spilled, its device block goes back to the pool once the
 * copies are done, and the retrieve fails with the retrieved buffer where
 * it was. */
static dmem_status_t swap_in_pieces(dmem_runtime_t *rt, dmem__buffer_t *r, dmem__swap_t *sw,
                                    void *after, void **dev_out) {
  dmem__buffer_t *v = sw->b;
  dmem_handle_t hv = sw->h;
  size_t size = sw->size;
  char *dev = dmem__bdev(v);
  const char *host = r->host;
  void *cs = rt->unspill_stream, *ss = rt->spill_stream;
  dmem__backend_t *be = rt->be;
  void *ev = NULL, *pe[DMEM__SWAP_PIECES_MAX] = {NULL};
  uint64_t t0 = dmem__now_ns();
  DMEM_ASSERT(v && host && dmem__bsize(r) == size && dmem__bsize(v) == size);
  size_t piece = rt->swap_piece;
  if (piece < (size + DMEM__SWAP_PIECES_MAX - 1) / DMEM__SWAP_PIECES_MAX)
    piece = (size + DMEM__SWAP_PIECES_MAX - 1) / DMEM__SWAP_PIECES_MAX;
  size_t n = size ? (size + piece - 1) / piece : 0;

  void *stage = v->host;
  const bool reused = stage != NULL;
  bool charged = false, out = false;
  v->host = NULL;
  dmem_status_t st = reused ? DMEM_OK : dmem__staging_alloc(rt, size, &stage);
  /* the host tier takes the victim's bytes before any is copied */
  if (st == DMEM_OK) {
    st = dmem__tier_host.store(rt, v, hv, stage);
    charged = st == DMEM_OK;
  }
  if (st == DMEM_OK) st = dmem__event_get(rt, &ev);
  for (size_t k = 0; k < n && st == DMEM_OK; k++) st = dmem__event_get(rt, &pe[k]);
  /* the victim's retrieve copy may still write its device range and read
   * its staging */
  if (st == DMEM_OK && (sw->w & DMEM__F_UNSPILL_COPY))
    st = dmem__fatal_keep(rt, be->stream_wait_event(be, ss, v->unspill_event));
  /* phase 1: out */
  out = st == DMEM_OK;
  for (size_t k = 0; k < n && st == DMEM_OK; k++) {
    size_t off = k * piece, m = size - off < piece ? size - off : piece;
    st = be->memcpy_async(be, (char *)stage + off, dev + off, m, ss);
    if (st == DMEM_OK) st = be->event_record(be, pe[k], ss);
    st = dmem__fatal_keep(rt, st);
  }
  /* the victim's bytes are in `stage` once the spill stream gets here */
  if (st == DMEM_OK) st = dmem__fatal_keep(rt, be->event_record(be, ev, ss));
  if (st != DMEM_OK) goto undo;

  /* phase 2: in; r's own spill copy may still write `host` */
  if (after) st = dmem__fatal_keep(rt, be->stream_wait_event(be, cs, after));
  for (size_t k = 0; k < n && st == DMEM_OK; k++) {
    size_t off = k * piece, m = size - off < piece ? size - off : piece;
    st = be->stream_wait_event(be, cs, pe[k]);
    if (st == DMEM_OK) st = be->memcpy_async(be, dev + off, host + off, m, cs);
    st = dmem__fatal_keep(rt, st);
  }
  /* every wait on the piece events is enqueued (or failed): they may go
   * back (a wait takes the record current when it is enqueued) */
  for (size_t k = 0; k < n; k++) dmem__event_put(rt, pe[k]);
  if (st != DMEM_OK) {
    /* the victim's copy out is whole: spilled; its block back to the pool
     * once what was enqueued on it is done */
    (void)be->stream_synchronize(be, cs);
    (void)be->stream_synchronize(be, ss);
    commit_victim(rt, sw, NULL, t0, false);
    dmem__event_put(rt, ev);
    dmem__device_release_after(rt, dev, size, NULL);
    return st;
  }
  commit_victim(rt, sw, ev, t0, true);
  *dev_out = dev;
  return DMEM_OK;

undo:
  /* nothing was copied in: the victim's device bytes are untouched; its
   * pinned copy may still be written (wait, then throw it away) */
  if (out) (void)be->stream_synchronize(be, ss);
  if (charged) dmem__tier_host.drop(rt, v, hv);
  v->host = reused ? stage : NULL;
  if (!reused && stage) dmem__hostpool_free(rt->hostpool, stage);
  if (ev) dmem__event_put(rt, ev);
  for (size_t k = 0; k < n; k++)
    if (pe[k]) dmem__event_put(rt, pe[k]);
  dmem__swap_cancel(rt, sw);
  return st;
}

dmem_status_t dmem__swap_in(dmem_runtime_t *rt, dmem__buffer_t *r,
                            dmem__swap_t *sw, void *after, void **dev_out) {
  if (rt->swap_pieces) return swap_in_pieces(rt, r, sw, after, dev_out);
  dmem__buffer_t *v = sw->b;
  dmem_handle_t hv = sw->h;
  size_t size = sw->size;
  char *dev = dmem__bdev(v), *host = r->host;
  void *cs = rt->unspill_stream;
  void *ev = NULL;
  uint64_t t0 = dmem__now_ns();
  DMEM_ASSERT(v && host && dmem__bsize(r) == size && dmem__bsize(v) == size && !v->host);

  /* the host tier takes the victim's bytes before any is copied */
  dmem_status_t st = dmem__tier_host.store(rt, v, hv, host);
  if (st != DMEM_OK) {
    v->host = NULL;
    dmem__swap_cancel(rt, sw);
    return st;
  }
  st = dmem__event_get(rt, &ev);
  if (st != DMEM_OK) goto undo;
  dmem__mutex_lock(&rt->swap_mu, DMEM__RANK_SWAP);
  DMEM_ASSERT(rt->swap_bounce != NULL); /* dmem__swap_ready made it */
  /* r's own spill copy may still write `host`; the victim's unspill copy
   * may still write its device range (both on other streams or earlier) */
  if (after) st = dmem__fatal_keep(rt, rt->be->stream_wait_event(rt->be, cs, after));
  if (st == DMEM_OK && (sw->w & DMEM__F_UNSPILL_COPY))
    st = dmem__fatal_keep(rt, rt->be->stream_wait_event(rt->be, cs, v->unspill_event));
  if (st == DMEM_OK) st = trade_all(rt, dev, host, size); /* synchronised on failure */
  /* the victim's bytes are in `host` once the spill stream gets here */
  dmem_status_t rec = st == DMEM_OK
                          ? dmem__fatal_keep(rt, rt->be->event_record(rt->be, ev, rt->spill_stream))
                          : DMEM_OK;
  dmem__mutex_unlock(&rt->swap_mu, DMEM__RANK_SWAP);
  if (st != DMEM_OK) goto undo;
  /* Traded: from here on there is no going back. Without the event the
   * copies are waited for instead (the victim's copy is then complete). */
  bool copied = rec != DMEM_OK;
  if (copied) {
    (void)rt->be->stream_synchronize(rt->be, cs);
    (void)rt->be->stream_synchronize(rt->be, rt->spill_stream);
  }

  /* the victim is DEFERRED_HOST at `host` (the host tier took it above) */
  r->host = NULL;
  commit_victim(rt, sw, copied ? NULL : ev, t0, true);
  if (copied) dmem__event_put(rt, ev);
  *dev_out = dev;
  return DMEM_OK;

undo:
  dmem__tier_host.drop(rt, v, hv);
  v->host = NULL;
  if (ev) dmem__event_put(rt, ev);
  dmem__swap_cancel(rt, sw);
  return st;
}
