/*
 * spill/read.c - reading a buffer's bytes where they are (dmem_buffer_read),
 * without moving it: a resident buffer is copied device->host, one in the
 * host tier from its pinned copy, one on disk from its extent.
 *
 * The reader takes the buffer's TRANSIT with one CAS, as a mover does, but
 * keeps its state, and ends it without changing anything: while it copies,
 * nothing spills, pushes down or reclaims the buffer (a free marks it, and
 * the end of the read reclaims it), and nothing moves it back. Locks of a
 * resident buffer proceed meanwhile (the lock fast path ignores TRANSIT, as
 * for the staging poller); a lock of a deferred one waits for the read, as
 * for any move. The read does not touch last_use (an unlock's stamp), so it
 * does not make the buffer look recently used to the victim policy, and it
 * counts no spill or unspill.
 */
#include "spill/spill.h"

/* Bytes [off, off + n) of a resident buffer whose TRANSIT we own (word w),
 * copied to dst on the device->host copy stream. The device bytes are final
 * once an unspill copy in flight has completed (UNSPILL_COPY: the copy
 * stream waits for its event; the flag and the event are ours to read
 * while we own TRANSIT). Returns once the copy is done, also on failure
 * (nothing writes dst after it returns). */
static dmem_status_t read_device(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t w, size_t off,
                                 void *dst, size_t n) {
  void *cs = rt->spill_stream, *ev = NULL;
  const char *dev = dmem__bdev(b);
  dmem_status_t st = DMEM_OK;
  if (w & DMEM__F_UNSPILL_COPY)
    st = dmem__fatal_keep(rt, rt->be->stream_wait_event(rt->be, cs, b->unspill_event));
  if (st == DMEM_OK) st = dmem__event_get(rt, &ev);
  if (st != DMEM_OK) return st;
  st = dmem__copy_chunked(rt, dst, dev + off, n, cs);
  if (st == DMEM_OK) st = dmem__fatal_keep(rt, rt->be->event_record(rt->be, ev, cs));
  if (st == DMEM_OK) st = dmem__fatal_keep(rt, rt->be->event_synchronize(rt->be, ev));
  if (st != DMEM_OK) (void)rt->be->stream_synchronize(rt->be, cs); /* chunks already enqueued */
  dmem__event_put(rt, ev);
  return st;
}

dmem_status_t dmem__read(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h, size_t off,
                         void *dst, size_t n) {
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  /* acquire: partner is the releasing CAS of the TRANSIT owner / dmem_buffer_alloc */
  uint64_t w = dmem_atomic_load_acquire(&b->word);
  for (;;) {
    if (!dmem__word_live(w, h)) return dmem__stale(h);
    /* a generation's size never changes; a slot recycled meanwhile fails
     * the re-check (or the TRANSIT CAS) below */
    size_t size = dmem__bsize(b);
    if (off > size || n > size - off) {
      uint64_t again = dmem_atomic_load_acquire(&b->word); /* partner: as above */
      if (again != w) {
        w = again;
        continue;
      }
      return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                         "dmem_buffer_read: bytes [%zu, %zu + %zu) outside handle 0x%016llx "
                         "of %zu bytes",
                         off, off, n, (unsigned long long)h, size);
    }
    if (n == 0) return DMEM_OK;
    unsigned s = dmem__w_state(w);
    bool moving = (w & DMEM__F_TRANSIT) || s == DMEM_STATE_SPILLING || s == DMEM_STATE_UNSPILLING;
    if (moving && dmem__moving_self(rt, h))
      return dmem__error(DMEM_ERR_BUSY,
                         "handle 0x%016llx is being moved by the calling thread's callback",
                         (unsigned long long)h);
    const dmem__tier_ops_t *tier = dmem__tier_of_state(s);
    if (s != DMEM_STATE_RESIDENT && !moving && (!tier || !tier->read))
      return dmem__error(DMEM_ERR_BUSY,
                         "handle 0x%016llx is in the %s tier, which cannot be read in place "
                         "(lock or unspill it)",
                         (unsigned long long)h, tier ? tier->name : "?");
    if (moving) {
      /* wait for the mover (or another reader) to finish, then look again:
       * the buffer may be somewhere else by then */
      dmem__transit_wait(rt, b, w);
      w = dmem_atomic_load_acquire(&b->word); /* partner: dmem__transit_end */
      continue;
    }
    if (!dmem__transit_take(b, &w, s, 0)) continue;
    st = s == DMEM_STATE_RESIDENT ? read_device(rt, b, w, off, dst, n)
                                  : tier->read(rt, b, off, dst, n);
    /* keep state and flags; reclaims the buffer if it was freed meanwhile */
    dmem__move_end(rt, b, (dmem__transit_exit_t){0});
    return st;
  }
}
