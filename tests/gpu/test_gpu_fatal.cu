/*
 * tests/gpu/test_gpu_fatal.cu - a sticky context error (a kernel writes to
 * an illegal address) makes the runtime refuse further work with
 * DMEM_ERR_DEVICE_FATAL, and destroying it afterwards neither crashes nor
 * hangs. The context of the process is lost for good, so this binary is
 * apart from the others and each case runs in its own process (CTest runs
 * one case per process). Not run under compute-sanitizer.
 */
#include "check.h"
#include "gpu_check.cuh"

__global__ void wild_write(int *p) { p[threadIdx.x] = 1; }

static dmem_status_t launch_wild(void *user, dmem_stream_t s, void *const *ptrs, size_t n) {
  (void)user;
  (void)ptrs;
  (void)n;
  wild_write<<<1, 32, 0, (cudaStream_t)s>>>((int *)(uintptr_t)16); /* not mapped */
  return gpu_launched("wild_write");
}

static void expect_refused(dmem_runtime_t *rt, dmem_handle_t h) {
  dmem_handle_t h2 = 0;
  void *p;
  dmem_stream_t s2;
  CHECK_STATUS(dmem_buffer_alloc(rt, MiB, 0, &h2), DMEM_ERR_DEVICE_FATAL);
  CHECK_EQ(h2, 0);
  CHECK_STATUS(dmem_buffer_lock(rt, h, NULL, &p), DMEM_ERR_DEVICE_FATAL);
  CHECK_STATUS(dmem_buffer_spill(rt, h, DMEM_TIER_HOST), DMEM_ERR_DEVICE_FATAL);
  CHECK_STATUS(dmem_buffer_unspill(rt, h, NULL), DMEM_ERR_DEVICE_FATAL);
  CHECK_STATUS(dmem_stream_create(rt, &s2), DMEM_ERR_DEVICE_FATAL);
  CHECK_STATUS(dmem_runtime_poll(rt), DMEM_ERR_DEVICE_FATAL);
  CHECK_STATUS(dmem_stream_synchronize(rt, NULL), DMEM_ERR_DEVICE_FATAL);
  CHECK_STATUS(dmem_lock_and_launch(rt, &h, 1, launch_wild, NULL), DMEM_ERR_DEVICE_FATAL);
  size_t freed = 0;
  CHECK_STATUS(dmem_runtime_evict(rt, MiB, &freed), DMEM_ERR_DEVICE_FATAL);
  /* what needs no device still answers */
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  dmem_stats_t st;
  CHECK_OK(dmem_stats(rt, &st));
  CHECK_STR(dmem_status_name(DMEM_ERR_DEVICE_FATAL), "DMEM_ERR_DEVICE_FATAL");
}

/* The error surfaces at dmem_sync_and_unlock. */
TEST_CASE(illegal_address_is_sticky) {
  dmem_runtime_t *rt = gpu_runtime(0, 0);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t h, other;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &other));
  REQUIRE_OK(dmem_buffer_spill(rt, other, DMEM_TIER_HOST)); /* bytes held on the host */
  CHECK_OK(dmem_launch_async(rt, s, &h, 1, launch_wild, NULL)); /* the launch itself succeeds */
  CHECK_STATUS(dmem_sync_and_unlock(rt, s), DMEM_ERR_DEVICE_FATAL);
  const char *d = dmem_last_error_detail();
  fprintf(stderr, "detail: %s\n", d);
  CHECK_TRUE(strstr(d, "cudaErrorIllegalAddress") != NULL ||
             strstr(d, "CUDA_ERROR_ILLEGAL_ADDRESS") != NULL);
  expect_refused(rt, h);
  CHECK_STATUS(dmem_sync_and_unlock(rt, s), DMEM_ERR_DEVICE_FATAL);
  CHECK_STATUS(dmem_stream_release(rt, s), DMEM_ERR_DEVICE_FATAL);
  CHECK_OK(dmem_buffer_free(rt, other));
  dmem_runtime_destroy(rt); /* the buffers, the host pool, the registry: no crash, no hang */
}

/* The error surfaces at the poll that looks for finished stream releases. */
TEST_CASE(illegal_address_found_by_release_poll) {
  dmem_runtime_t *rt = gpu_runtime(0, 0);
  dmem_stream_t s;
  REQUIRE_OK(dmem_stream_create(rt, &s));
  dmem_handle_t h;
  REQUIRE_OK(dmem_buffer_alloc(rt, MiB, 0, &h));
  CHECK_OK(dmem_launch_async(rt, s, &h, 1, launch_wild, NULL));
  CHECK_OK(dmem_stream_release(rt, s));
  dmem_status_t st = DMEM_OK;
  double t0 = gpu_now();
  while (st == DMEM_OK && gpu_now() - t0 < 10) {
    st = dmem_runtime_poll(rt);
    struct timespec ts = {0, 1000 * 1000};
    nanosleep(&ts, NULL);
  }
  CHECK_STATUS(st, DMEM_ERR_DEVICE_FATAL);
  /* the release is complete as far as it can be: the buffer is unlocked */
  dmem_buffer_info_t info;
  CHECK_OK(dmem_buffer_info(rt, h, &info));
  CHECK_EQ(info.lock_count, 0);
  expect_refused(rt, h);
  dmem_runtime_destroy(rt);
}
