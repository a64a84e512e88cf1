/*
 * runtime/base/hook.h - a test hook: a function and its user, published as
 * one pair, so that a thread that read the hook just before a test removed
 * or changed it still calls it with its own user. (Two separate atomics let
 * a disk push-down thread call the old hook with the NULL user of its
 * removal: asan in CI.) A pair is rewritten only DMEM__HOOK_SLOTS sets
 * later. Sets come from one test thread; reads from any thread.
 *
 * The function is stored as void (*)(void); the owner casts it back to its
 * own type before calling (C allows the round trip).
 */
#ifndef DMEM_BASE_HOOK_H
#define DMEM_BASE_HOOK_H

#include "base/atomic.h"
#include <stddef.h>

#define DMEM__HOOK_SLOTS 16

typedef struct {
  void (*fn)(void);
  void *user;
} dmem__hook_pair_t;

typedef struct {
  dmem__hook_pair_t slot[DMEM__HOOK_SLOTS];
  unsigned next;
  _Atomic(dmem__hook_pair_t *) cur;
} dmem__hook_t;

/* Publish (fn, user) (fn NULL: remove the hook). One setting thread. */
static inline void dmem__hook_set(dmem__hook_t *h, void (*fn)(void), void *user) {
  dmem__hook_pair_t *p = NULL;
  if (fn) {
    p = &h->slot[h->next++ % DMEM__HOOK_SLOTS];
    p->fn = fn;
    p->user = user;
  }
  /* release: publishes the pair; partner is dmem__hook_get's acquire */
  dmem_atomic_store_release(&h->cur, p);
}

/* The pair in effect, or NULL. Any thread. */
static inline const dmem__hook_pair_t *dmem__hook_get(dmem__hook_t *h) {
  return dmem_atomic_load_acquire(&h->cur); /* partner: dmem__hook_set */
}

#endif /* DMEM_BASE_HOOK_H */
