/*
 * runtime/memory/pool_tags.c - the device pool's event tags (see
 * pool_parts.h for the pool's files): an event recorded on a stream after
 * the frees it covers, shared by every range freed under it; lazy tags,
 * recorded only when another stream first needs their ranges; and the rules
 * for when a range may be used by a stream or joined with its neighbour.
 * Calls only the backend table (event_create/record/query/synchronize/
 * destroy); no other file of the pool.
 *
 * Stream ordering
 *  - Cached blocks are only ever handed to their own stream key (same
 *    stream: ordered by construction). They leave a cache only by a flush
 *    (overflow, a slow-path allocation, trim, flush, forget; destroy for
 *    large ones). Small ones: the flusher records ONE event on the cache's
 *    stream after taking the entries out and tags every flushed segment
 *    with it (pool_tag_t). Large ones go to the free ranges under the
 *    stream's lazy tag (below), as if they had been freed uncached then:
 *    no event unless another stream wants them. free_after uses the pool's
 *    internal stream (see pool.h). Frees on streams without a cache struct
 *    (cudaStreamPerThread, a full stream table) record an event each.
 *  - Lazy tags: a free that bypasses the caches (large blocks above
 *    large_cache_bytes, small ones over the cache bound) or a large block
 *    leaving its cache, on a stream S with a cache struct, records
 *    nothing. The block goes to the free ranges under S's open lazy tag
 *    (ps->lazy, one per stream, under mu): a tag whose event is NOT recorded
 *    yet. S reuses it at once (same stream), so a same-stream large
 *    alloc+free pair that misses the caches costs two passes under mu and no
 *    event. The first time another stream T needs a range under that tag
 *    (pool_take, pool_take_run), the event is recorded on S then, under mu
 *    (with S's rec_mu and next rec_seq), and T waits on it: every block
 *    under the tag was freed before that record, so it covers their last
 *    uses (and whatever S ran since: conservative, never a host wait). The
 *    tag is then an ordinary one and S's next lazy free opens a new one. Lazy
 *    tags are never queried (no record yet, so never "done"); trim records
 *    them before waiting, stream_forget records its stream's before the
 *    stream can go away, destroy records all before its waits. If a record
 *    fails (the stream destroyed without forget, a broken device), the ranges
 *    under the tag are quarantined. An open lazy tag stays on p->tags even
 *    at refs 0, so a same-stream pair does not touch the tag free list.
 *  - A FREE segment with a tag is handed to the tag's stream at once; to
 *    another stream only if the tag's event has completed (event_query) or
 *    after be->stream_wait_event(stream, tag event) (a lazy tag recorded
 *    first). A tag without pending work (NULL, or done) makes the segment
 *    free for all.
 *  - Coalescing keeps that promise: two free neighbours join when one of
 *    them is settled (the union carries the other's tag), when they carry the
 *    same tag, or when both tags were recorded on the same stream (the
 *    later record, by a per-stream sequence number taken with the record
 *    under rec_mu, covers the earlier). A lazy tag joins only its own ranges
 *    and ranges under a recorded, pending tag of its stream (its record, to
 *    come, covers that one); never a settled range, which would tie bytes
 *    free for every stream to a record that has not happened yet. Otherwise
 *    neighbours stay apart; a request that only a run of such neighbours can
 *    serve takes the run after waiting on each foreign pending event.
 *  - Tags are reference-counted by the segments that carry them; at zero the
 *    tag and its event go back to a free list and the event is recorded
 *    again later. That is safe because a stream wait captures the event's
 *    record at the time of the call (cudaStreamWaitEvent semantics, which
 *    the host backend follows). Events are destroyed only at pool destroy,
 *    after event_synchronize.
 */
#include <stdlib.h>

#include "memory/pool_parts.h"
#include "memory/pool_tags.h"

/* Only its address is used: a key for this thread's cudaStreamPerThread. */
static _Thread_local char pool_tl_anchor;

uintptr_t dmem__pool_thread_key(void) { return (uintptr_t)&pool_tl_anchor; }

/* ---- tags (mu unless noted) ------------------------------------------------- */

/* Off p->tags and onto the free list (its event kept for the next record). */
static void pool_tag_retire(dmem__pool_t *p, pool_tag_t *t) {
  if (t->prev)
    t->prev->next = t->next;
  else
    p->tags = t->next;
  if (t->next) t->next->prev = t->prev;
  pthread_mutex_lock(&p->tag_mu);
  t->prev = NULL;
  t->next = p->free_tags;
  p->free_tags = t;
  pthread_mutex_unlock(&p->tag_mu);
}

void dmem__pool_tag_unref(dmem__pool_t *p, pool_tag_t *t) {
  if (--t->refs) return;
  /* An open lazy tag stays its stream's (ps->lazy) at zero: the next free
   * there takes it again without touching the free list. */
  if (!t->lazy) pool_tag_retire(p, t);
}

/* Publish a freshly recorded tag (refs 1: the recorder's) on p->tags. */
void dmem__pool_tag_link(dmem__pool_t *p, pool_tag_t *t) {
  t->prev = NULL;
  t->next = p->tags;
  if (p->tags) p->tags->prev = t;
  p->tags = t;
}

/* A tag with its event from the free list, or a new one (event_create). Any
 * pool lock but tag_mu may be held. */
static dmem_status_t pool_tag_obtain(dmem__pool_t *p, pool_tag_t **tag_out) {
  pthread_mutex_lock(&p->tag_mu);
  pool_tag_t *t = p->free_tags;
  if (t) p->free_tags = t->next;
  pthread_mutex_unlock(&p->tag_mu);
  if (!t) {
    t = calloc(1, sizeof *t);
    if (!t) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "pool: allocating an event tag failed");
    dmem_status_t st = p->be->event_create(p->be, &t->event);
    if (st != DMEM_OK) {
      free(t);
      return st;
    }
  }
  *tag_out = t;
  return DMEM_OK;
}

/* Record an event on `stream` for blocks freed there before this call. No
 * pool lock held except possibly table_mu; `rec_mu` (NULL: the caller holds
 * the lock that guards *seq, or seq is NULL) orders the record with *seq.
 * The tag comes back private with refs 1; the caller links it under mu. */
dmem_status_t dmem__pool_tag_record(dmem__pool_t *p, pthread_mutex_t *rec_mu, uint64_t *seq,
                                    void *stream, uintptr_t skey, pool_tag_t **tag_out) {
  dmem__backend_t *be = p->be;
  pool_tag_t *t = NULL;
  dmem_status_t obtained = pool_tag_obtain(p, &t);
  if (obtained != DMEM_OK) return obtained;
  if (rec_mu) pthread_mutex_lock(rec_mu);
  dmem_status_t st = be->event_record(be, t->event, stream);
  uint64_t s = 0;
  if (st == DMEM_OK && seq) s = ++*seq;
  if (rec_mu) pthread_mutex_unlock(rec_mu);
  if (st != DMEM_OK) {
    pthread_mutex_lock(&p->tag_mu);
    t->next = p->free_tags;
    p->free_tags = t;
    pthread_mutex_unlock(&p->tag_mu);
    return st;
  }
  t->skey = skey;
  t->seq = s;
  t->refs = 1;
  t->done = false;
  t->lazy = false;
  t->ps = NULL;
  t->stream = NULL;
  t->prev = t->next = NULL;
  *tag_out = t;
  return DMEM_OK;
}

/* mu held. The open lazy tag of ps (stream `stream`), made now if there is
 * none; linked on p->tags with refs 0 (the segments that take it count). */
dmem_status_t dmem__pool_tag_lazy(dmem__pool_t *p, pool_stream_t *ps, void *stream,
                                  pool_tag_t **tag_out) {
  pool_tag_t *t = ps->lazy;
  if (!t) {
    dmem_status_t st = pool_tag_obtain(p, &t);
    if (st != DMEM_OK) return st;
    t->skey = pool_stream_key(p, stream);
    t->seq = 0;
    t->refs = 0;
    t->done = false;
    t->lazy = true;
    t->ps = ps;
    t->stream = stream;
    t->prev = NULL;
    t->next = p->tags;
    if (p->tags) p->tags->prev = t;
    p->tags = t;
    ps->lazy = t;
  }
  *tag_out = t;
  return DMEM_OK;
}

/* mu held; t lazy. Record t's event on its stream now, under the stream's
 * rec_mu and with the next rec_seq: every block freed under t was freed
 * before this call, so the record covers them (and whatever the stream ran
 * since: conservative). t becomes an ordinary tag; the stream's next
 * bypassing free opens a new lazy tag. On failure t stays lazy. */
dmem_status_t dmem__pool_tag_materialise(dmem__pool_t *p, pool_tag_t *t) {
  pool_stream_t *ps = t->ps;
  pthread_mutex_lock(&ps->rec_mu);
  dmem_status_t st = p->be->event_record(p->be, t->event, t->stream);
  if (st == DMEM_OK) t->seq = ++ps->rec_seq;
  pthread_mutex_unlock(&ps->rec_mu);
  if (st != DMEM_OK) return st;
  t->lazy = false;
  t->ps = NULL;
  t->stream = NULL;
  ps->lazy = NULL;
  if (!t->refs) pool_tag_retire(p, t);
  return DMEM_OK;
}

/* mu held; t lazy and refs 0 (nothing carries it): no longer ps's open tag. */
void dmem__pool_tag_close(dmem__pool_t *p, pool_tag_t *t) {
  t->ps->lazy = NULL;
  t->lazy = false;
  t->ps = NULL;
  t->stream = NULL;
  pool_tag_retire(p, t);
}

/* Whether `stream` (key skey) may use a segment tagged t without waiting.
 * Queries the event once more if needed (never a lazy tag's: it has no
 * record yet). */
bool dmem__pool_tag_usable(dmem__pool_t *p, pool_tag_t *t, uintptr_t skey) {
  if (pool_tag_settled(t)) return true;
  if (t->skey && t->skey == skey) return true;
  if (t->lazy) return false;
  if (p->be->event_query(p->be, t->event) == DMEM_OK) {
    t->done = true;
    return true;
  }
  return false;
}

/* Whether free neighbours with tags a and b may become one segment; *keep is
 * the tag the union must carry (see the header comment). */
bool dmem__pool_tags_mergeable(pool_tag_t *a, pool_tag_t *b, pool_tag_t **keep) {
  if (a && b && a != b && (a->lazy || b->lazy)) {
    /* A lazy range joins only pending work of its own stream: its record,
     * still to come, covers every record already made there. It never
     * joins a settled range, which would tie bytes free for every stream to
     * a record that has not happened yet. */
    pool_tag_t *l = a->lazy ? a : b, *o = a->lazy ? b : a;
    if (o->lazy || o->done || !o->skey || o->skey != l->skey) return false;
    *keep = l;
    return true;
  }
  if ((a && a->lazy) || (b && b->lazy)) {
    if (a != b) return false; /* lazy and settled */
    *keep = a;
    return true;
  }
  if (pool_tag_settled(a) && pool_tag_settled(b)) {
    *keep = NULL;
  } else if (pool_tag_settled(a)) {
    *keep = b;
  } else if (pool_tag_settled(b) || a == b) {
    *keep = a;
  } else if (a->skey && a->skey == b->skey && a->seq && b->seq) {
    *keep = a->seq > b->seq ? a : b;
  } else {
    return false;
  }
  return true;
}

static void pool_tag_destroy(dmem__backend_t *be, pool_tag_t *t) {
  (void)be->event_synchronize(be, t->event);
  (void)be->event_destroy(be, t->event);
  free(t);
}

void dmem__pool_tags_destroy(dmem__pool_t *p) {
  dmem__backend_t *be = p->be;
  /* Lazily freed blocks: record their events (their streams are alive:
   * forgotten streams have none) so that the waits below cover them. */
  for (pool_tag_t *t = p->tags, *n; t; t = n) {
    n = t->next;
    if (t->lazy && t->refs) (void)dmem__pool_tag_materialise(p, t);
  }
  for (pool_tag_t *t = p->tags, *n; t; t = n) {
    n = t->next;
    pool_tag_destroy(be, t);
  }
  for (pool_tag_t *t = p->free_tags, *n; t; t = n) {
    n = t->next;
    pool_tag_destroy(be, t);
  }
}
