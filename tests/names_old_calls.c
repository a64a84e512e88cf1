/* Compiled (not run) by the test names.old_names_warn: a call of each name
 * from before dmem_noun_verb must warn (-Wdeprecated-declarations), naming
 * the function it was renamed to (tests/names_warn.cmake checks the
 * compiler's output). */
#include <dmem/dmem.h>

dmem_status_t old_calls(dmem_runtime_t *rt, dmem_handle_t h, const dmem_controller_t *c);

dmem_status_t old_calls(dmem_runtime_t *rt, dmem_handle_t h, const dmem_controller_t *c) {
  void *p = NULL;
  size_t n = 0;
  char ipc[DMEM_IPC_HANDLE_SIZE];
  dmem_status_t st = DMEM_OK;
  st |= dmem_alloc(rt, 1, 0, &h);
  st |= dmem_free(rt, h);
  st |= dmem_lock(rt, h, NULL, &p);
  st |= dmem_unlock(rt, h);
  st |= dmem_set_priority(rt, h, 1);
  st |= dmem_spill(rt, h, DMEM_TIER_HOST);
  st |= dmem_unspill(rt, h, NULL);
  st |= dmem_prefetch(rt, &h, 1, NULL);
  st |= dmem_evict(rt, 1, &n);
  st |= dmem_set_controller(rt, c);
  st |= dmem_copy(rt, p, p, 0, NULL);
  st |= dmem_ipc_handle(rt, p, ipc, &n);
  return st;
}
