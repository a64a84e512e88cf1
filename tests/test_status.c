/* Status names, messages and the thread-local error detail. */
#include <pthread.h>

#include "check.h"

TEST_CASE(names_and_messages) {
  CHECK_STR(dmem_status_name(DMEM_OK), "DMEM_OK");
  CHECK_STR(dmem_status_name(DMEM_ERR_BUSY), "DMEM_ERR_BUSY");
  CHECK_STR(dmem_status_name(DMEM_ERR_DEVICE_FATAL), "DMEM_ERR_DEVICE_FATAL");
  CHECK_STR(dmem_status_name(DMEM_ERR_FORKED), "DMEM_ERR_FORKED");
  CHECK_STR(dmem_status_name((dmem_status_t)-999), "DMEM_UNKNOWN_STATUS");
  CHECK_STR(dmem_status_string((dmem_status_t)-999), "unknown status");
  CHECK_EQ(DMEM_OK, 0);
  /* every code in the table has a distinct name and a non-empty message */
  static const dmem_status_t all[] = {
#define X(name, value, msg) DMEM_##name,
      DMEM_STATUS_MAP(X)
#undef X
  };
  size_t n = sizeof all / sizeof all[0];
  CHECK_EQ(n, 14);
  for (size_t i = 0; i < n; i++) {
    if (i > 0) CHECK_LT(all[i], 0);
    CHECK_TRUE(strncmp(dmem_status_name(all[i]), "DMEM_", 5) == 0);
    CHECK_GT(strlen(dmem_status_string(all[i])), 3);
    for (size_t j = 0; j < i; j++) {
      CHECK_NE(all[i], all[j]);
      CHECK_TRUE(strcmp(dmem_status_name(all[i]), dmem_status_name(all[j])) != 0);
    }
  }
}

static void *other_thread(void *arg) {
  (void)arg;
  dmem_runtime_t *rt = check_runtime(1 << 20);
  dmem_handle_t h;
  (void)dmem_buffer_alloc(rt, 0, 0, &h); /* fails: records a detail on this thread */
  dmem_runtime_destroy(rt);
  return NULL;
}

TEST_CASE(detail_is_thread_local) {
  dmem_runtime_t *rt = check_runtime(1 << 20);
  dmem_handle_t h = 0;
  CHECK_STATUS(dmem_buffer_free(rt, (dmem_handle_t)0x1234), DMEM_ERR_STALE_HANDLE);
  CHECK_TRUE(strstr(dmem_last_error_detail(), "0x0000000000001234") != NULL);
  char saved[256];
  snprintf(saved, sizeof saved, "%s", dmem_last_error_detail());
  pthread_t t;
  pthread_create(&t, NULL, other_thread, NULL);
  pthread_join(t, NULL);
  CHECK_STR(dmem_last_error_detail(), saved);
  /* a success leaves the detail as it was */
  CHECK_OK(dmem_buffer_alloc(rt, 64, 0, &h));
  CHECK_STR(dmem_last_error_detail(), saved);
  CHECK_OK(dmem_buffer_free(rt, h));
  dmem_runtime_destroy(rt);
}
