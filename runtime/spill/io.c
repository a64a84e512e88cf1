/*
 * spill/io.c - the runtime's I/O threads: a small pool (DMEM__IO_THREADS
 * threads at most), started one at a time when work arrives and joined by
 * dmem_runtime_destroy.
 *
 * Two kinds of work, urgent first:
 *  - tasks: helpers that take chunks of one large disk read or write
 *    (spill/disk.c). A helper is optional: the thread that submitted it
 *    works on the same chunks, withdraws the helpers no thread has started,
 *    and waits only for those that run.
 *    Also the disk tier's hole punching of freed extents (spill/disk.c),
 *    which nobody waits for: it waits for the disk to be quiet, and gives
 *    its thread up (queued again behind them) to tasks that want one.
 *  - the background job (the host tier's push-down to disk,
 *    spill/pushdown.c, given at create): run after a kick, on at most
 *    DMEM__IO_THREADS - 1 threads at once, so that one thread stays free for
 *    tasks; each run returns whether it should run again.
 *
 * The pool's mutex is innermost (rank IO): nothing else is taken under it,
 * and no task or background run is called with it held.
 */
#include "spill/spill.h"
#include <string.h>

/* Set on a pool thread while it runs the background job (tier_disk.c counts
 * the writes made there as push-downs). */
_Thread_local bool dmem__io_tl_background;

struct dmem__io {
  dmem_runtime_t *rt;
  bool (*background)(dmem_runtime_t *rt);
  pthread_mutex_t mu;  /* rank IO: everything below */
  pthread_cond_t work; /* threads wait for work */
  pthread_cond_t idle; /* dmem__io_quiesce waits for the pool to go idle */
  dmem__io_task_t *head, *tail;
  pthread_t threads[DMEM__IO_THREADS];
  unsigned nthreads; /* started */
  unsigned waiting;  /* threads waiting on `work` */
  unsigned busy;     /* threads running a task */
  unsigned bg_running;
  bool bg_wanted;    /* kicked and not yet found to have nothing to do */
  uint64_t bg_kicks; /* kicks so far: a run that found nothing to do only
                        clears bg_wanted if no kick came meanwhile and no
                        other run is still going (that one may yet fail) */
  uint64_t bg_kicks_seen; /* bg_kicks when the latest run started: a run
                             starts beside a running one only for a newer
                             kick (no spinning while one writes) */
  bool stop;
  /* Written under mu at destroy; read lock-free (relaxed) by long writes
   * that stop early (dmem__io_stopping). */
  _Atomic int stopping;
};

dmem_status_t dmem__io_create(dmem_runtime_t *rt, bool (*background)(dmem_runtime_t *),
                              dmem__io_t **io_out) {
  dmem__io_t *io = calloc(1, sizeof *io);
  if (!io) return dmem__error(DMEM_ERR_HOST_OUT_OF_MEMORY, "I/O pool allocation failed");
  io->rt = rt;
  io->background = background;
  pthread_mutex_init(&io->mu, NULL);
  pthread_cond_init(&io->work, NULL);
  pthread_cond_init(&io->idle, NULL);
  *io_out = io;
  return DMEM_OK;
}

static void *io_thread(void *arg) {
  dmem__io_t *io = arg;
  dmem__mutex_lock(&io->mu, DMEM__RANK_IO);
  for (;;) {
    if (io->stop) break;
    dmem__io_task_t *t = io->head;
    if (t) {
      io->head = t->next;
      if (!io->head) io->tail = NULL;
      t->next = NULL;
      io->busy++;
      dmem__mutex_unlock(&io->mu, DMEM__RANK_IO);
      t->run(t);
      dmem__mutex_lock(&io->mu, DMEM__RANK_IO);
      io->busy--;
      pthread_cond_broadcast(&io->idle);
      continue;
    }
    if (io->bg_wanted && io->bg_running < DMEM__IO_THREADS - 1 &&
        (io->bg_running == 0 || io->bg_kicks != io->bg_kicks_seen)) {
      uint64_t kicks = io->bg_kicks;
      io->bg_kicks_seen = kicks;
      io->bg_running++;
      dmem__mutex_unlock(&io->mu, DMEM__RANK_IO);
      dmem__io_tl_background = true;
      bool more = io->background(io->rt);
      dmem__io_tl_background = false;
      dmem__mutex_lock(&io->mu, DMEM__RANK_IO);
      io->bg_running--;
      /* Nothing to do for this run. Another run still going may yet fail
       * (and the excess it claimed return): then bg_wanted stays, and the
       * last run to end, seeing a kick newer than its start, runs again. */
      if (more) io->bg_wanted = true;
      else if (io->bg_kicks == kicks && io->bg_running == 0) io->bg_wanted = false;
      pthread_cond_broadcast(&io->idle);
      continue;
    }
    io->waiting++;
    pthread_cond_wait(&io->work, &io->mu);
    io->waiting--;
  }
  dmem__mutex_unlock(&io->mu, DMEM__RANK_IO);
  return NULL;
}

/* Wake a waiting thread, or start one if none waits and the pool is not
 * full. Under mu. False when no thread can take the work now (the pool is
 * full and busy, or a thread could not be started). */
static bool wake_one(dmem__io_t *io) {
  if (io->stop) return false;
  if (io->waiting > 0) {
    pthread_cond_signal(&io->work);
    return true;
  }
  if (io->nthreads == DMEM__IO_THREADS) return false;
  int rc = pthread_create(&io->threads[io->nthreads], NULL, io_thread, io);
  if (rc != 0) {
    DMEM_LOG_AT(DMEM_LOG_WARN, "I/O thread %u not started: pthread_create: %s", io->nthreads,
                strerror(rc));
    return false;
  }
  io->nthreads++;
  return true;
}

bool dmem__io_submit(dmem__io_t *io, dmem__io_task_t *t) {
  if (!io) return false;
  dmem__mutex_lock(&io->mu, DMEM__RANK_IO);
  if (io->stop) {
    dmem__mutex_unlock(&io->mu, DMEM__RANK_IO);
    return false;
  }
  t->next = NULL;
  if (io->tail) io->tail->next = t;
  else io->head = t;
  io->tail = t;
  /* Queued even when no thread is free now: one may become free before
   * the submitter withdraws it. */
  (void)wake_one(io);
  dmem__mutex_unlock(&io->mu, DMEM__RANK_IO);
  return true;
}

bool dmem__io_withdraw(dmem__io_t *io, dmem__io_task_t *t) {
  bool found = false;
  dmem__mutex_lock(&io->mu, DMEM__RANK_IO);
  dmem__io_task_t *prev = NULL;
  for (dmem__io_task_t *p = io->head; p; prev = p, p = p->next) {
    if (p != t) continue;
    if (prev) prev->next = p->next;
    else io->head = p->next;
    if (io->tail == p) io->tail = prev;
    p->next = NULL;
    found = true;
    break;
  }
  if (found) pthread_cond_broadcast(&io->idle);
  dmem__mutex_unlock(&io->mu, DMEM__RANK_IO);
  return found;
}

void dmem__io_kick(dmem__io_t *io) {
  if (!io) return;
  dmem__mutex_lock(&io->mu, DMEM__RANK_IO);
  io->bg_kicks++;
  io->bg_wanted = true;
  if (io->bg_running < DMEM__IO_THREADS - 1) (void)wake_one(io);
  dmem__mutex_unlock(&io->mu, DMEM__RANK_IO);
}

bool dmem__io_queued(dmem__io_t *io) {
  dmem__mutex_lock(&io->mu, DMEM__RANK_IO);
  bool queued = io->head != NULL;
  dmem__mutex_unlock(&io->mu, DMEM__RANK_IO);
  return queued;
}

bool dmem__io_stopping(dmem__io_t *io) {
  return !io || dmem_atomic_load_relaxed(&io->stopping) != 0;
}

void dmem__io_quiesce(dmem__io_t *io) {
  if (!io) return;
  dmem__mutex_lock(&io->mu, DMEM__RANK_IO);
  while (!io->stop && (io->head || io->busy || io->bg_running || (io->bg_wanted && io->nthreads)))
    pthread_cond_wait(&io->idle, &io->mu);
  dmem__mutex_unlock(&io->mu, DMEM__RANK_IO);
}

void dmem__io_destroy(dmem__io_t *io) {
  if (!io) return;
  dmem__mutex_lock(&io->mu, DMEM__RANK_IO);
  io->stop = true;
  dmem_atomic_store_relaxed(&io->stopping, 1);
  pthread_cond_broadcast(&io->work);
  pthread_cond_broadcast(&io->idle);
  unsigned n = io->nthreads;
  dmem__mutex_unlock(&io->mu, DMEM__RANK_IO);
  /* A background run in progress sees dmem__io_stopping and ends after the
   * chunk it is writing. */
  for (unsigned i = 0; i < n; i++) pthread_join(io->threads[i], NULL);
  pthread_cond_destroy(&io->idle);
  pthread_cond_destroy(&io->work);
  pthread_mutex_destroy(&io->mu);
  free(io);
}
