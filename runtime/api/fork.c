/*
 * runtime/api/fork.c - what fork() means for a runtime.
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
 * dmem__check_forked in runtime/core/runtime.h). The lock fast path reads
 * rt->fatal already, so it refuses at no extra cost. dmem_runtime_destroy
 * of a forked runtime forgets it and releases nothing (see runtime.c).
 *
 * The parent's runtimes are untouched: the child only ever wrote its own
 * copy of their memory.
 */
#include "api/api.h"

/* Not ranked: taken with no runtime mutex held (create, destroy, fork). */
static pthread_mutex_t fork_mu = PTHREAD_MUTEX_INITIALIZER;
static dmem_runtime_t *fork_live; /* under fork_mu */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
/* Live runtimes at each log level (relaxed: counts, no data published with
 * them), so that a level change takes no mutex: dmem_runtime_set_log_level
 * may be called from a controller callback, even while the exit report
 * holds fork_mu. */
static _Atomic int level_count[DMEM_LOG_DEBUG + 1];

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
  for (int l = DMEM_LOG_OFF; l <= DMEM_LOG_DEBUG; l++)
    dmem_atomic_store_relaxed(&level_count[l], 0);
  dmem_atomic_store_relaxed(&dmem__log_level, DMEM_LOG_WARN);
  pthread_mutex_unlock(&fork_mu);
}

static int fork_register_rc; /* written once, under fork_once */
static void fork_register(void) {
  fork_register_rc = pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* dmem__log_level = the most verbose level with a live runtime (warn when
 * none). Racing publishers each check after their store that the counts
 * still give what they stored, so the last one leaves it right. */
static void level_publish(void) {
  for (;;) {
    int level = DMEM_LOG_WARN, any = 0;
    for (int l = DMEM_LOG_DEBUG; l >= DMEM_LOG_OFF; l--)
      if (dmem_atomic_load_relaxed(&level_count[l]) > 0) {
        if (!any) level = l;
        any = 1;
      }
    dmem_atomic_store_relaxed(&dmem__log_level, level);
    int again = DMEM_LOG_WARN, any2 = 0;
    for (int l = DMEM_LOG_DEBUG; l >= DMEM_LOG_OFF && !any2; l--)
      if (dmem_atomic_load_relaxed(&level_count[l]) > 0) {
        again = l;
        any2 = 1;
      }
    if (again == level) return;
  }
}

void dmem__log_level_set(dmem_runtime_t *rt, int level) {
  int old = dmem_atomic_exchange_acq_rel(&rt->log_level, level);
  if (old == level) return;
  dmem_atomic_add_relaxed(&level_count[level], 1);
  dmem_atomic_sub_relaxed(&level_count[old], 1);
  level_publish();
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
  pthread_mutex_unlock(&fork_mu);
  dmem_atomic_add_relaxed(&level_count[dmem_atomic_load_relaxed(&rt->log_level)], 1);
  level_publish();
  return DMEM_OK;
}

void dmem__fork_untrack(dmem_runtime_t *rt) {
  pthread_mutex_lock(&fork_mu);
  if (rt->fork_prev) rt->fork_prev->fork_next = rt->fork_next;
  else if (fork_live == rt) fork_live = rt->fork_next;
  if (rt->fork_next) rt->fork_next->fork_prev = rt->fork_prev;
  rt->fork_prev = rt->fork_next = NULL;
  pthread_mutex_unlock(&fork_mu);
  dmem_atomic_sub_relaxed(&level_count[dmem_atomic_load_relaxed(&rt->log_level)], 1);
  level_publish();
}
