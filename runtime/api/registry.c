/*
 * runtime/api/registry.c - the per-stream lock registry behind dmem_launch_async,
 * dmem_sync_and_unlock and dmem_stream_release. A stream dmem made has a
 * record of its own (rt->sreg, spill/pending.c: its registered launches
 * and its open release group, under the record's spin lock, found without
 * a runtime-wide mutex); other streams have a list here, under reg.mu. A
 * released stream's list waits for its event in spill/pending.c.
 */
#include "api/api.h"
#include <stdlib.h>
#include <string.h>


dmem_status_t dmem__registry_init(dmem_runtime_t *rt) {
  dmem__registry_t *r = &rt->reg;
  memset(r, 0, sizeof *r);
  /* when stream releases are grouped (spill/pending.c) */
  rt->release_gap_ns = DMEM__RELEASE_GAP_NS;
  rt->release_age_ns = DMEM__RELEASE_AGE_NS;
  rt->release_group = DMEM__RELEASE_GROUP;
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
  (void)dmem__pending_poll(rt, true);
  dmem__pending_fini(rt);
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
  dmem__sreg_t *s = dmem__sreg_lock(rt, stream);
  if (s) { /* a stream dmem made: its own record */
    bool ok = dmem__sreg_append(s, e, n);
    dmem__sreg_unlock(s);
    if (ok) return DMEM_OK;
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "lock registry could not grow");
  }
  dmem__registry_t *r = &rt->reg;
  dmem__mutex_lock(&r->mu, DMEM__RANK_REGISTRY);
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
  dmem__mutex_unlock(&r->mu, DMEM__RANK_REGISTRY);
  return DMEM_OK;
oom:
  dmem__mutex_unlock(&r->mu, DMEM__RANK_REGISTRY);
  return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "lock registry could not grow");
}

void dmem__registry_commit(dmem_runtime_t *rt, void *stream, const dmem__reg_entry_t *e,
                           size_t n) {
  if (dmem__registry_add(rt, stream, e, n) == DMEM_OK) return;
  /* No memory to register them: their work is on the stream already, so
   * they may only be unlocked once it has run. Wait for it here. */
  DMEM_LOG_AT(DMEM_LOG_WARN, "lock registry could not grow: waiting for stream %p before unlocking "
              "%zu buffers", stream, n);
  (void)rt->be->stream_synchronize(rt->be, stream);
  unlock_entries(rt, (dmem__reg_entry_t *)e, n);
}

dmem_status_t dmem__registry_take(dmem_runtime_t *rt, void *stream, dmem__reg_entry_t **v_out,
                                  size_t *n_out) {
  dmem__registry_t *r = &rt->reg;
  dmem__mutex_lock(&r->mu, DMEM__RANK_REGISTRY);
  dmem__reg_list_t *l = find_list(r, stream);
  if (!l) {
    dmem__mutex_unlock(&r->mu, DMEM__RANK_REGISTRY);
    *v_out = NULL;
    *n_out = 0;
    return DMEM_OK;
  }
  *v_out = l->v;
  *n_out = l->n;
  *l = r->lists[--r->nlists];
  dmem__mutex_unlock(&r->mu, DMEM__RANK_REGISTRY);
  return DMEM_OK;
}

bool dmem__registry_has(dmem_runtime_t *rt, void *stream) {
  dmem__sreg_t *s = dmem__sreg_lock(rt, stream);
  if (s) {
    bool has = s->n > s->g;
    dmem__sreg_unlock(s);
    if (has) return true;
  }
  dmem__mutex_lock(&rt->reg.mu, DMEM__RANK_REGISTRY);
  dmem__reg_list_t *l = find_list(&rt->reg, stream);
  bool has = l && l->n > 0;
  dmem__mutex_unlock(&rt->reg.mu, DMEM__RANK_REGISTRY);
  return has;
}

dmem_status_t dmem__registry_release_list(dmem_runtime_t *rt, void *stream, bool *recorded) {
  *recorded = false;
  dmem__registry_t *r = &rt->reg;
  dmem__mutex_lock(&r->mu, DMEM__RANK_REGISTRY);
  dmem__reg_list_t *l = find_list(r, stream);
  if (!l || l->n == 0) {
    dmem__mutex_unlock(&r->mu, DMEM__RANK_REGISTRY);
    return DMEM_OK;
  }
  /* An event now: the entries go with it. */
  dmem__reg_entry_t *v = l->v;
  size_t n = l->n;
  *l = r->lists[--r->nlists];
  dmem__mutex_unlock(&r->mu, DMEM__RANK_REGISTRY);
  dmem_status_t st = dmem__pending_release_now(rt, stream, v, n);
  if (st != DMEM_OK) {
    /* put the registrations back: nothing is unlocked early */
    if (dmem__registry_add(rt, stream, v, n) != DMEM_OK) {
      /* cannot re-register: keep them locked until the stream is idle */
      (void)rt->be->stream_synchronize(rt->be, stream);
      unlock_entries(rt, v, n);
    }
    free(v);
    return st;
  }
  *recorded = true;
  return DMEM_OK;
}

void dmem__registry_stream_add(dmem_runtime_t *rt, void *stream) {
  dmem__registry_t *r = &rt->reg;
  dmem__mutex_lock(&r->mu, DMEM__RANK_REGISTRY);
  dmem__reg_list_t *l = find_list(r, stream);
  /* launches registered at this address before (a stream of the caller's
   * that was destroyed with launches registered) move into the record */
  if (dmem__pending_stream_add(rt, stream, l ? l->v : NULL, l ? l->n : 0) && l) {
    free(l->v);
    *l = r->lists[--r->nlists];
  }
  dmem__mutex_unlock(&r->mu, DMEM__RANK_REGISTRY);
}

void dmem__registry_forget(dmem_runtime_t *rt, void *stream) {
  dmem__registry_t *r = &rt->reg;
  dmem__mutex_lock(&r->mu, DMEM__RANK_REGISTRY);
  dmem__reg_list_t *l = find_list(r, stream);
  if (l && l->n == 0) {
    free(l->v);
    *l = r->lists[--r->nlists];
  }
  dmem__mutex_unlock(&r->mu, DMEM__RANK_REGISTRY);
}
