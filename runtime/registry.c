/*
 * runtime/registry.c - the per-stream lock registry behind dmem_launch_async,
 * dmem_sync_and_unlock and dmem_stream_release, and the list of stream
 * releases waiting for their event.
 */
#include "internal.h"
#include <stdlib.h>
#include <string.h>


dmem_status_t dmem__registry_init(dmem__registry_t *r) {
  memset(r, 0, sizeof *r);
  atomic_init(&r->npending, 0);
  if (pthread_mutex_init(&r->mu, NULL) != 0)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "pthread_mutex_init failed");
  return DMEM_OK;
}

static void unlock_entries(dmem_runtime_t *rt, dmem__reg_entry_t *v, size_t n) {
  for (size_t i = 0; i < n; i++) (void)dmem__unlock_buffer(rt, v[i].b, v[i].h);
}

/* At destroy: wait for pending releases, drop every registration. */
void dmem__registry_fini(dmem_runtime_t *rt) {
  dmem__registry_t *r = &rt->reg;
  (void)dmem__registry_poll(rt, true);
  for (size_t i = 0; i < r->nlists; i++) {
    unlock_entries(rt, r->lists[i].v, r->lists[i].n);
    free(r->lists[i].v);
  }
  free(r->lists);
  r->lists = NULL;
  r->nlists = r->caplists = 0;
  pthread_mutex_destroy(&r->mu);
}

/* Under mu. */
static dmem__reg_list_t *find_list(dmem__registry_t *r, void *stream) {
  for (size_t i = 0; i < r->nlists; i++)
    if (r->lists[i].stream == stream) return &r->lists[i];
  return NULL;
}

dmem_status_t dmem__registry_add(dmem_runtime_t *rt, void *stream, const dmem__reg_entry_t *e,
                                 size_t n) {
  dmem__registry_t *r = &rt->reg;
  pthread_mutex_lock(&r->mu);
  dmem__reg_list_t *l = find_list(r, stream);
  if (!l) {
    if (r->nlists == r->caplists) {
      size_t cap = r->caplists ? r->caplists * 2 : 8;
      dmem__reg_list_t *v = realloc(r->lists, cap * sizeof *v);
      if (!v) goto oom;
      r->lists = v;
      r->caplists = cap;
    }
    l = &r->lists[r->nlists++];
    memset(l, 0, sizeof *l);
    l->stream = stream;
  }
  if (l->n + n > l->cap) {
    size_t cap = l->cap ? l->cap : 16;
    while (cap < l->n + n) cap *= 2;
    dmem__reg_entry_t *v = realloc(l->v, cap * sizeof *v);
    if (!v) goto oom;
    l->v = v;
    l->cap = cap;
  }
  memcpy(l->v + l->n, e, n * sizeof *e);
  l->n += n;
  pthread_mutex_unlock(&r->mu);
  return DMEM_OK;
oom:
  pthread_mutex_unlock(&r->mu);
  return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "lock registry could not grow");
}

dmem_status_t dmem__registry_take(dmem_runtime_t *rt, void *stream, dmem__reg_entry_t **v_out,
                                  size_t *n_out) {
  dmem__registry_t *r = &rt->reg;
  pthread_mutex_lock(&r->mu);
  dmem__reg_list_t *l = find_list(r, stream);
  if (!l) {
    pthread_mutex_unlock(&r->mu);
    *v_out = NULL;
    *n_out = 0;
    return DMEM_OK;
  }
  *v_out = l->v;
  *n_out = l->n;
  *l = r->lists[--r->nlists];
  pthread_mutex_unlock(&r->mu);
  return DMEM_OK;
}

bool dmem__registry_has(dmem_runtime_t *rt, void *stream) {
  pthread_mutex_lock(&rt->reg.mu);
  dmem__reg_list_t *l = find_list(&rt->reg, stream);
  bool has = l && l->n > 0;
  pthread_mutex_unlock(&rt->reg.mu);
  return has;
}

dmem_status_t dmem__registry_release(dmem_runtime_t *rt, void *stream) {
  dmem__reg_entry_t *v;
  size_t n;
  (void)dmem__registry_take(rt, stream, &v, &n);
  if (n == 0) {
    free(v);
    return DMEM_OK;
  }
  dmem__release_t *rel = malloc(sizeof *rel);
  void *ev = NULL;
  dmem_status_t st = rel ? dmem__event_get(rt, &ev)
                         : dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "release node allocation failed");
  if (st == DMEM_OK) st = dmem__be(rt, rt->be->event_record(rt->be, ev, stream));
  if (st != DMEM_OK) {
    /* put the registrations back: nothing is unlocked early */
    if (dmem__registry_add(rt, stream, v, n) != DMEM_OK) {
      /* cannot re-register: keep them locked until the stream is idle */
      (void)rt->be->stream_synchronize(rt->be, stream);
      unlock_entries(rt, v, n);
    }
    free(v);
    free(rel);
    if (ev) dmem__event_put(rt, ev);
    return st;
  }
  rel->event = ev;
  rel->v = v;
  rel->n = n;
  pthread_mutex_lock(&rt->reg.mu);
  rel->next = rt->reg.pending;
  rt->reg.pending = rel;
  dmem_atomic_add_relaxed(&rt->reg.npending, 1);
  pthread_mutex_unlock(&rt->reg.mu);
  return DMEM_OK;
}

size_t dmem__registry_poll(dmem_runtime_t *rt, bool wait_all) {
  dmem__registry_t *r = &rt->reg;
  if (!wait_all && dmem_atomic_load_relaxed(&r->npending) == 0) return 0;
  dmem__release_t *done = NULL;
  pthread_mutex_lock(&r->mu);
  for (dmem__release_t **pp = &r->pending; *pp;) {
    dmem__release_t *rel = *pp;
    dmem_status_t q = wait_all ? rt->be->event_synchronize(rt->be, rel->event)
                               : rt->be->event_query(rt->be, rel->event);
    if (q == DMEM_ERR_BUSY) {
      pp = &rel->next;
      continue;
    }
    /* complete, or failed (the context is gone: the work will never run) */
    (void)dmem__be(rt, q);
    *pp = rel->next;
    rel->next = done;
    done = rel;
    dmem_atomic_sub_relaxed(&r->npending, 1);
  }
  pthread_mutex_unlock(&r->mu);
  size_t count = 0;
  while (done) {
    dmem__release_t *rel = done;
    done = rel->next;
    unlock_entries(rt, rel->v, rel->n);
    dmem__event_put(rt, rel->event);
    free(rel->v);
    free(rel);
    count++;
  }
  return count;
}
