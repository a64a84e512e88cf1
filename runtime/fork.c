/*
 * runtime/fork.c - what fork() means for a runtime.
 *
 * A child made by fork() gets a copy of every runtime's memory but none of
 * its threads (the host backend's stream workers, the I/O threads, the
 * spill-ahead thread, the pinned pool's grower), no usable CUDA context,
 * and every mutex that a parent thread held at the fork stays locked in the
 * child for good. Nothing the child does with such a runtime can work, and
 * much of it would wait forever. So the process keeps a list of its live
 * runtimes, and a pthread_atfork child handler marks each of them forked
 * (rt->fatal = DMEM__FORKED) before the child runs any code of its own:
 * every call on them then returns DMEM_ERR_FORKED before it takes a mutex,
 * calls the backend or waits for anything (dmem__check_live and
 * dmem__check_forked in runtime/internal.h). The lock fast path reads
 * rt->fatal already, so it refuses at no extra cost. dmem_runtime_destroy
 * of a forked runtime forgets it and releases nothing (see runtime.c).
 *
 * The parent's runtimes are untouched: the child only ever wrote its own
 * copy of their memory.
 */
#include "internal.h"

/* Not ranked: taken with no runtime mutex held (create, destroy, fork). */
static pthread_mutex_t fork_mu = PTHREAD_MUTEX_INITIALIZER;
static dmem_runtime_t *fork_live; /* under fork_mu */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

/* fork() holds fork_mu across the fork, so that the child's copy of the
 * list is whole. */
static void fork_prepare(void) { pthread_mutex_lock(&fork_mu); }
static void fork_parent(void) { pthread_mutex_unlock(&fork_mu); }

/* The child runs on the forking thread, alone: no lock needed beyond the one
 * it holds since fork_prepare. */
static void fork_child(void) {
  for (dmem_runtime_t *rt = fork_live; rt; rt = rt->fork_next)
    dmem_atomic_store_relaxed(&rt->fatal, DMEM__FORKED);
  fork_live = NULL; /* the child's own runtimes start a new list */
  pthread_mutex_unlock(&fork_mu);
}

static int fork_register_rc; /* written once, under fork_once */
static void fork_register(void) {
  fork_register_rc = pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* The most verbose level of the live runtimes (under fork_mu). */
static void log_level_update_locked(void) {
  int level = fork_live ? DMEM_LOG_OFF : DMEM_LOG_WARN;
  for (dmem_runtime_t *rt = fork_live; rt; rt = rt->fork_next) {
    int l = dmem_atomic_load_relaxed(&rt->log_level);
    if (l > level) level = l;
  }
  dmem_atomic_store_relaxed(&dmem__log_level, level);
}

void dmem__log_level_update(void) {
  pthread_mutex_lock(&fork_mu);
  log_level_update_locked();
  pthread_mutex_unlock(&fork_mu);
}

void dmem__fork_each(void (*fn)(dmem_runtime_t *rt, void *arg), void *arg) {
  pthread_mutex_lock(&fork_mu);
  for (dmem_runtime_t *rt = fork_live; rt; rt = rt->fork_next) fn(rt, arg);
  pthread_mutex_unlock(&fork_mu);
}

dmem_status_t dmem__fork_track(dmem_runtime_t *rt) {
  pthread_once(&fork_once, fork_register);
  if (fork_register_rc != 0)
    return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "pthread_atfork failed: %d", fork_register_rc);
  pthread_mutex_lock(&fork_mu);
  rt->fork_prev = NULL;
  rt->fork_next = fork_live;
  if (fork_live) fork_live->fork_prev = rt;
  fork_live = rt;
  log_level_update_locked();
  pthread_mutex_unlock(&fork_mu);
  return DMEM_OK;
}

void dmem__fork_untrack(dmem_runtime_t *rt) {
  pthread_mutex_lock(&fork_mu);
  if (rt->fork_prev) rt->fork_prev->fork_next = rt->fork_next;
  else if (fork_live == rt) fork_live = rt->fork_next;
  if (rt->fork_next) rt->fork_next->fork_prev = rt->fork_prev;
  rt->fork_prev = rt->fork_next = NULL;
  log_level_update_locked();
  pthread_mutex_unlock(&fork_mu);
}
