/* The public names from before dmem_noun_verb, kept for one version as
 * deprecated aliases (runtime/deprecated.c, DMEM_DEPRECATED_API in
 * dmem/status.h): each old name does what the new one does (the same
 * status for bad input, the same effect for good input), and libdmem.so
 * still exports every old name, so programs built against the old headers
 * keep running. That a call of an old name warns is checked by the test
 * names.old_names_warn (tests/names_old_calls.c). */
#include <dlfcn.h>
#include <stdint.h>

#include "check.h"

/* this file calls the old names on purpose */
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"

#define KiB ((size_t)1 << 10)
#define MiB ((size_t)1 << 20)

static dmem_buffer_info_t info_of(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_buffer_info_t info;
  memset(&info, 0, sizeof info);
  if (dmem_buffer_info(rt, h, &info) != DMEM_OK) info.state = (dmem_state_t)-1;
  return info;
}

TEST_CASE(old_buffer_names_act_as_the_new_ones) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  const size_t n = 64 * KiB;
  dmem_handle_t h = DMEM_HANDLE_NULL, out = DMEM_HANDLE_NULL;
  /* bad input: the statuses of the new names, nothing written */
  CHECK_STATUS(dmem_alloc(rt, 0, 0, &out), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_buffer_alloc(rt, 0, 0, &out), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_UEQ(out, DMEM_HANDLE_NULL);
  CHECK_STATUS(dmem_free(NULL, 1), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_unlock(rt, DMEM_HANDLE_NULL), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_buffer_unlock(rt, DMEM_HANDLE_NULL), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_evict(NULL, 1, NULL), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_prefetch(rt, NULL, 1, NULL), DMEM_ERR_INVALID_ARGUMENT);

  REQUIRE_OK(dmem_alloc(rt, n, 0, &h));
  CHECK_EQ(info_of(rt, h).state, DMEM_STATE_RESIDENT);
  CHECK_UEQ(info_of(rt, h).size, n);
  CHECK_OK(dmem_set_priority(rt, h, 7));
  CHECK_EQ(info_of(rt, h).priority, 7);

  /* the bytes go in through the old lock, unlock and copy */
  void *p = NULL;
  unsigned char *src = malloc(n);
  REQUIRE_TRUE(src != NULL);
  check_fill(src, n, 42);
  REQUIRE_OK(dmem_lock(rt, h, NULL, &p));
  CHECK_EQ(info_of(rt, h).lock_count, 1);
  CHECK_STATUS(dmem_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_BUSY); /* locked */
  CHECK_OK(dmem_copy(rt, p, src, n, NULL));
  CHECK_OK(dmem_stream_synchronize(rt, NULL));
  CHECK_OK(dmem_unlock(rt, h));
  CHECK_EQ(info_of(rt, h).lock_count, 0);

  /* moves */
  CHECK_OK(dmem_spill(rt, h, DMEM_TIER_HOST));
  CHECK_EQ(info_of(rt, h).state, DMEM_STATE_DEFERRED_HOST);
  CHECK_OK(dmem_unspill(rt, h, NULL));
  CHECK_OK(dmem_stream_synchronize(rt, NULL));
  CHECK_EQ(info_of(rt, h).state, DMEM_STATE_RESIDENT);
  CHECK_OK(dmem_spill(rt, h, DMEM_TIER_DISK));
  CHECK_EQ(info_of(rt, h).state, DMEM_STATE_DEFERRED_DISK);
  CHECK_OK(dmem_prefetch(rt, &h, 1, NULL));
  CHECK_OK(dmem_stream_synchronize(rt, NULL));
  CHECK_EQ(info_of(rt, h).state, DMEM_STATE_RESIDENT);
  size_t freed = 0;
  CHECK_OK(dmem_evict(rt, SIZE_MAX, &freed));
  CHECK_UEQ(freed, n);
  CHECK_NE(info_of(rt, h).state, DMEM_STATE_RESIDENT);
  CHECK_UEQ(check_bad_bytes(rt, h, n, 42), 0);
  CHECK_EQ(info_of(rt, h).spill_count, 3);

  /* the old free ends the handle for the new names too */
  CHECK_OK(dmem_free(rt, h));
  CHECK_STATUS(dmem_free(rt, h), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_buffer_lock(rt, h, NULL, &p), DMEM_ERR_STALE_HANDLE);
  CHECK_STATUS(dmem_lock(rt, h, NULL, &p), DMEM_ERR_STALE_HANDLE);
  free(src);
  dmem_runtime_destroy(rt);
}

typedef struct events {
  int allocs, frees;
} events_t;

static void count_event(void *user, const dmem_event_t *e) {
  events_t *ev = user;
  if (e->kind == DMEM_EVENT_ALLOC) ev->allocs++;
  if (e->kind == DMEM_EVENT_FREE) ev->frees++;
}

TEST_CASE(old_controller_copy_and_ipc_names_act_as_the_new_ones) {
  dmem_runtime_t *rt = check_runtime(4 * MiB);
  events_t ev = {0, 0};
  dmem_controller_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = 1; /* too small */
  c.user = &ev;
  c.on_event = count_event;
  CHECK_STATUS(dmem_set_controller(rt, &c), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(dmem_controller_set(rt, &c), DMEM_ERR_INVALID_ARGUMENT);
  c.struct_size = sizeof c;
  CHECK_OK(dmem_set_controller(rt, &c));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, 4096, 0, &h));
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_EQ(ev.allocs, 1);
  CHECK_EQ(ev.frees, 1);
  CHECK_OK(dmem_set_controller(rt, NULL)); /* removed: no more events */
  REQUIRE_OK(dmem_buffer_alloc(rt, 4096, 0, &h));
  CHECK_OK(dmem_buffer_free(rt, h));
  CHECK_EQ(ev.allocs, 1);

  /* dmem_copy between two host arrays, in stream order */
  unsigned char a[256], b[256];
  check_fill(a, sizeof a, 9);
  memset(b, 0, sizeof b);
  CHECK_OK(dmem_copy(rt, b, a, sizeof a, NULL));
  CHECK_OK(dmem_stream_synchronize(rt, NULL));
  CHECK_UEQ(check_verify(b, sizeof b, 9), 0);
  CHECK_STATUS(dmem_copy(rt, NULL, a, 1, NULL), DMEM_ERR_INVALID_ARGUMENT);

  /* dmem_ipc_handle: the new name's answers on this backend */
  void *raw = NULL;
  REQUIRE_OK(dmem_device_malloc(rt, 4096, NULL, &raw));
  unsigned char handle[DMEM_IPC_HANDLE_SIZE];
  size_t off = 77;
  dmem_status_t want = dmem_device_ipc_handle(rt, raw, handle, &off);
  CHECK_STATUS(dmem_ipc_handle(rt, raw, handle, &off), want);
  if (dmem_runtime_backend(rt) == DMEM_BACKEND_HOST) {
    CHECK_STATUS(want, DMEM_ERR_NO_DEVICE);
    CHECK_UEQ(off, 77);
  }
  CHECK_STATUS(dmem_ipc_handle(rt, NULL, handle, &off), DMEM_ERR_INVALID_ARGUMENT);
  CHECK_OK(dmem_device_free(rt, raw, NULL));
  dmem_runtime_destroy(rt);
}

/* What a program built against the old headers finds in libdmem.so: every
 * old name, a function of its own (not the new one's address), and a
 * buffer's life through the old names alone. */
TEST_CASE(old_names_are_exported_by_the_shared_library) {
  static const char *const old_names[] = {
      "dmem_alloc",     "dmem_free",           "dmem_lock",  "dmem_unlock",
      "dmem_set_priority", "dmem_spill",       "dmem_unspill", "dmem_prefetch",
      "dmem_evict",     "dmem_set_controller", "dmem_copy",  "dmem_ipc_handle"};
  static const char *const new_names[] = {
      "dmem_buffer_alloc",   "dmem_buffer_free",    "dmem_buffer_lock",
      "dmem_buffer_unlock",  "dmem_buffer_set_priority", "dmem_buffer_spill",
      "dmem_buffer_unspill", "dmem_buffer_prefetch", "dmem_runtime_evict",
      "dmem_controller_set", "dmem_stream_copy",    "dmem_device_ipc_handle"};
  /* RTLD_NODELETE: the library's fork and exit handlers (and thread-exit
   * destructors of its per-thread records) stay registered for the process,
   * so it must stay mapped after dlclose; under ThreadSanitizer an unloaded
   * copy was called at exit (a SEGV after the case passed). */
  void *lib = dlopen(DMEM_SHARED_LIBRARY, RTLD_NOW | RTLD_LOCAL | RTLD_NODELETE);
  if (!lib) fprintf(stderr, "dlopen %s: %s\n", DMEM_SHARED_LIBRARY, dlerror());
  REQUIRE_TRUE(lib != NULL);
  for (size_t i = 0; i < sizeof old_names / sizeof old_names[0]; i++) {
    void *o = dlsym(lib, old_names[i]), *n = dlsym(lib, new_names[i]);
    if (!o || !n) fprintf(stderr, "%s: %p, %s: %p\n", old_names[i], o, new_names[i], n);
    CHECK_TRUE(o != NULL && n != NULL && o != n);
  }
  /* a buffer's life through the shared library's old names */
  void (*config_init)(dmem_config_t *);
  dmem_status_t (*create)(const dmem_config_t *, dmem_runtime_t **);
  void (*destroy)(dmem_runtime_t *);
  dmem_status_t (*alloc)(dmem_runtime_t *, size_t, unsigned, dmem_handle_t *);
  dmem_status_t (*lock)(dmem_runtime_t *, dmem_handle_t, dmem_stream_t, void **);
  dmem_status_t (*unlock)(dmem_runtime_t *, dmem_handle_t);
  dmem_status_t (*free_)(dmem_runtime_t *, dmem_handle_t);
  /* object pointer -> function pointer through memcpy (ISO C has no cast) */
  void *sym;
#define LOOKUP(var, name)                 \
  do {                                    \
    sym = dlsym(lib, name);               \
    REQUIRE_TRUE(sym != NULL);            \
    memcpy(&(var), &sym, sizeof sym);     \
  } while (0)
  LOOKUP(config_init, "dmem_config_init");
  LOOKUP(create, "dmem_runtime_create");
  LOOKUP(destroy, "dmem_runtime_destroy");
  LOOKUP(alloc, "dmem_alloc");
  LOOKUP(lock, "dmem_lock");
  LOOKUP(unlock, "dmem_unlock");
  LOOKUP(free_, "dmem_free");
#undef LOOKUP
  dmem_config_t cfg;
  config_init(&cfg);
  cfg.backend = DMEM_BACKEND_HOST;
  cfg.device_limit = 4 * MiB;
  dmem_runtime_t *rt = NULL;
  REQUIRE_OK(create(&cfg, &rt));
  dmem_handle_t h = DMEM_HANDLE_NULL;
  void *p = NULL;
  CHECK_OK(alloc(rt, 4096, 0, &h));
  CHECK_OK(lock(rt, h, NULL, &p));
  CHECK_TRUE(p != NULL);
  CHECK_OK(unlock(rt, h));
  CHECK_OK(free_(rt, h));
  CHECK_STATUS(free_(rt, h), DMEM_ERR_STALE_HANDLE);
  destroy(rt);
  dlclose(lib);
}
