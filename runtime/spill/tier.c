/*
 * spill/tier.c - the tier chain as data: one row per tier, saying what
 * the tier does (its ops, spill/spill.h: dmem__tier_ops_t, in its own
 * file: tier_host.c, tier_disk.c, tier_controller.c) and where it sits:
 * its next tier, whether eviction batches go to it, whether retrieves from
 * it are pipelined. move_out.c, pushdown.c and retrieve.c walk the table; none
 * of them names a tier. Also: which tier holds a buffer in which state,
 * and the release of a buffer's pinned host memory.
 */
#include "spill/spill.h"
#include <stdarg.h>
#include <stdio.h>

/*
 * The chain, from the device down. The first row is where evictions go
 * (one by one, or as batches when its row says batch); a store the tier
 * refuses as full goes on to `next`, and past the tier's limit (ops->limit)
 * the push-down moves its least recently used buffers to `next` on the I/O
 * threads. A tier that is not next of any row (the controller) is reached
 * only by an explicit dmem_buffer_spill to it.
 *
 *   device -> host -> disk           controller (dmem_buffer_spill only)
 *
 * Adding a tier takes one file and one row here:
 *  1. spill/tier_<name>.c defines `const dmem__tier_ops_t dmem__tier_<name>`
 *     (store/load/drop/used at least; spill.h says what each op must do),
 *     declared beside the others in spill/spill.h, and is listed with them
 *     in CMakeLists.txt's spill sources.
 *  2. A row below: its ops, its next tier (the row above it names it as its
 *     next, to put it in the chain), batch (only the first row), and its
 *     pipelined predicate (only with ops->load_device). A tier with a limit
 *     (pushed down to its next) must keep its bytes pinned (adopts_staging).
 * Its dmem_tier_t value and DMEM_STATE_DEFERRED_* state are public
 * (include/dmem/types.h), so a tier callers can name (dmem_buffer_spill, events,
 * statistics) also needs a new value of each there (tier values below
 * DMEM__NTIERS, runtime/core/runtime.h), and, to be seen outside, its bytes in
 * dmem_stats_t (runtime/api/stats.c) and its name in Python (pybridge/py_args.c,
 * pybridge/py_runtime.c); the spill code itself needs nothing more.
 * dmem__tier_table_check, run at every dmem_runtime_create
 * (tests/test_tier.c), refuses a table that breaks these rules.
 */
static const dmem__tier_row_t tier_rows[] = {
    {.ops = &dmem__tier_host, .next = &dmem__tier_disk, .batch = true, .pipelined = NULL},
    {.ops = &dmem__tier_disk, .next = NULL, .batch = false, .pipelined = dmem__disk_pipelined},
    {.ops = &dmem__tier_controller, .next = NULL, .batch = false, .pipelined = NULL},
};
#define TIER_ROWS (sizeof tier_rows / sizeof tier_rows[0])

const dmem__tier_row_t *dmem__tier_rows(size_t *n_out) {
  *n_out = TIER_ROWS;
  return tier_rows;
}

static bool why_set(char *why, size_t len, const char *fmt, ...) {
  if (len) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, len, fmt, ap);
    va_end(ap);
  }
  return false;
}

static const dmem__tier_row_t *row_in(const dmem__tier_row_t *rows, size_t n,
                                      const dmem__tier_ops_t *t) {
  for (size_t i = 0; i < n; i++)
    if (rows[i].ops == t) return &rows[i];
  return NULL;
}

bool dmem__tier_table_check(const dmem__tier_row_t *rows, size_t n, char *why, size_t why_len) {
  if (n == 0) return why_set(why, why_len, "no tiers");
  for (size_t i = 0; i < n; i++) {
    const dmem__tier_ops_t *t = rows[i].ops;
    if (!t || !t->name || !t->store || !t->load || !t->drop || !t->used)
      return why_set(why, why_len, "row %zu: no ops, or no name/store/load/drop/used", i);
    if (t->tier == DMEM_TIER_DEVICE || (unsigned)t->tier >= DMEM__NTIERS)
      return why_set(why, why_len, "%s: tier %d is not one of 1..%d", t->name, (int)t->tier,
                     DMEM__NTIERS - 1);
    if (t->state == DMEM_STATE_RESIDENT || t->state == DMEM_STATE_SPILLING ||
        t->state == DMEM_STATE_UNSPILLING || t->state == DMEM__STATE_FREE)
      return why_set(why, why_len, "%s: state %u is not a deferred state", t->name, t->state);
    for (size_t j = 0; j < i; j++)
      if (rows[j].ops->tier == t->tier || rows[j].ops->state == t->state)
        return why_set(why, why_len, "%s and %s share a tier or a state", rows[j].ops->name,
                       t->name);
    if (rows[i].batch && (i != 0 || !t->charge_n || !t->uncharge_n || !t->adopts_staging))
      return why_set(why, why_len,
                     "%s: batches go only to the first row, a tier with charge_n, uncharge_n "
                     "and adopts_staging",
                     t->name);
    if (rows[i].pipelined && !t->load_device)
      return why_set(why, why_len, "%s: pipelined without load_device", t->name);
    if (t->limit && !rows[i].next)
      return why_set(why, why_len, "%s: a limit but no next tier to push down to", t->name);
    if (t->limit && !t->adopts_staging)
      return why_set(why, why_len,
                     "%s: a limit, but only a tier that keeps its bytes pinned (adopts_staging) "
                     "can be pushed down",
                     t->name);
    if (rows[i].next && !row_in(rows, n, rows[i].next))
      return why_set(why, why_len, "%s: its next tier has no row", t->name);
  }
  /* every chain ends: from any row, at most n steps reach a row with no next */
  for (size_t i = 0; i < n; i++) {
    const dmem__tier_row_t *r = &rows[i];
    size_t steps = 0;
    while (r->next) {
      if (++steps > n)
        return why_set(why, why_len, "the chain from %s comes back round (no end)",
                       rows[i].ops->name);
      r = row_in(rows, n, r->next);
    }
  }
  return true;
}

const dmem__tier_row_t *dmem__tier_row(const dmem__tier_ops_t *t) {
  return row_in(tier_rows, TIER_ROWS, t);
}

const dmem__tier_row_t *dmem__tier_row_of_state(unsigned s) {
  for (size_t i = 0; i < TIER_ROWS; i++)
    if (tier_rows[i].ops->state == s) return &tier_rows[i];
  return NULL;
}

const dmem__tier_ops_t *dmem__tier_top(void) { return tier_rows[0].ops; }

const dmem__tier_ops_t *dmem__tier_of(dmem_tier_t tier) {
  for (size_t i = 0; i < TIER_ROWS; i++)
    if (tier_rows[i].ops->tier == tier) return tier_rows[i].ops;
  return NULL;
}

const dmem__tier_ops_t *dmem__tier_of_state(unsigned s) {
  const dmem__tier_row_t *r = dmem__tier_row_of_state(s);
  return r ? r->ops : NULL;
}

dmem_tier_t dmem__tier_public(unsigned s) {
  const dmem__tier_ops_t *t = dmem__tier_of_state(s);
  return t ? t->tier : DMEM_TIER_DEVICE;
}

void dmem__host_copy_release(dmem_runtime_t *rt, dmem__buffer_t *b) {
  if (!b->host) return;
  dmem__hostpool_free(rt->hostpool, b->host);
  b->host = NULL;
}
