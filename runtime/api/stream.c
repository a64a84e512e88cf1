/*
 * runtime/api/stream.c - streams, stream-ordered host functions and copies.
 */
#include "api/api.h"

dmem_status_t dmem_stream_create(dmem_runtime_t *rt, dmem_stream_t *s_out) {
  if (!rt || !s_out) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_stream_create: NULL argument");
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  void *s = NULL;
  st = dmem__fatal_keep(rt, rt->be->stream_create(rt->be, &s));
  if (st != DMEM_OK) return st;
  /* dmem made it: a record of its own, and releases on it may wait for a
   * later event (spill/pending.c) */
  dmem__registry_stream_add(rt, s);
  *s_out = s;
  return DMEM_OK;
}

dmem_status_t dmem_stream_destroy(dmem_runtime_t *rt, dmem_stream_t s) {
  if (!rt || !s) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_stream_destroy: NULL argument");
  dmem_status_t fk = dmem__check_forked(rt);
  if (fk != DMEM_OK) return fk;
  if (dmem__registry_has(rt, s))
    return dmem__error(DMEM_ERR_BUSY,
                       "stream %p still has locked buffers registered: call "
                       "dmem_sync_and_unlock first",
                       s);
  /* its releases still waiting for an event get it now, while it exists */
  dmem__pending_stream_forget(rt, s);
  dmem__registry_forget(rt, s);
  /* the pool must not take a later stream at this address for this one */
  dmem__device_stream_forget(rt, s);
  return dmem__fatal_keep(rt, rt->be->stream_destroy(rt->be, s));
}

dmem_status_t dmem_stream_synchronize(dmem_runtime_t *rt, dmem_stream_t s) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_stream_synchronize: rt is NULL");
  dmem_status_t st = dmem__check_forked(rt);
  if (st != DMEM_OK) return st;
  /* the releases of s that wait for an event: this synchronisation covers
   * them (spill/pending.c) */
  dmem__reg_entry_t *gv;
  size_t gg, gn;
  dmem__pending_take_stream(rt, s, false, &gv, &gg, &gn);
  st = dmem__fatal_keep(rt, rt->be->stream_synchronize(rt->be, s));
  dmem__pending_taken_done(rt, s, gv, gg, st);
  free(gv);
  /* the releases of s (and any other finished ones) unlock now */
  dmem__pending_poll(rt, false);
  return st;
}

dmem_status_t dmem_stream_enqueue_host(dmem_runtime_t *rt, dmem_stream_t s, void (*fn)(void *),
                                       void *user) {
  if (!rt || !fn)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_stream_enqueue_host: NULL argument");
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  return dmem__fatal_keep(rt, rt->be->launch_host_func(rt->be, s, fn, user));
}

dmem_status_t dmem_stream_copy(dmem_runtime_t *rt, void *dst, const void *src, size_t n,
                               dmem_stream_t s) {
  if (!rt) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_stream_copy: rt is NULL");
  if (n == 0) return DMEM_OK;
  if (!dst || !src) return dmem__error(DMEM_ERR_INVALID_ARGUMENT, "dmem_stream_copy: NULL address");
  if (n > UINTPTR_MAX - (uintptr_t)dst || n > UINTPTR_MAX - (uintptr_t)src)
    return dmem__error(DMEM_ERR_INVALID_ARGUMENT,
                       "dmem_stream_copy(%p, %p, %zu): the range passes the end of the "
                       "address space",
                       dst, src, n);
  dmem_status_t st = dmem__check_live(rt);
  if (st != DMEM_OK) return st;
  return dmem__fatal_keep(rt, rt->be->memcpy_async(rt->be, dst, src, n, s));
}
