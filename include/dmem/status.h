/*
 * dmem/status.h - the one status type every dmem call returns.
 *
 * Codes are grouped by how broken things are:
 *    0          success
 *   -1 .. -9    the caller's mistake (argument, handle, lock state)
 *  -10 .. -19   resources (device, host memory, disk)
 *  -20 .. -29   callbacks supplied by the caller failed
 *  -30 .. -39   configuration and environment
 *  -40 .. -49   the device or driver failed; the runtime is still usable
 *  -50 ..       the runtime refuses further work: its device context is lost,
 *               or it was inherited through fork()
 */
#ifndef DMEM_STATUS_H
#define DMEM_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_WIN32)
#define DMEM_API
#else
#define DMEM_API __attribute__((visibility("default")))
#endif

/* DMEM_DEPRECATED_API(new_name) declares a public function under the name it
 * had before it was renamed to new_name (dmem_noun_verb), kept for one
 * version: still exported with the same signature and behaviour (it calls
 * new_name), so programs built against older headers keep running, and a
 * call compiles with a -Wdeprecated-declarations warning "use new_name".
 * Define DMEM_NO_DEPRECATION_WARNINGS before including dmem's headers to
 * silence the warnings. */
#if defined(DMEM_NO_DEPRECATION_WARNINGS)
#define DMEM_DEPRECATED_API(new_name) DMEM_API
#elif defined(__GNUC__) || defined(__clang__)
#define DMEM_DEPRECATED_API(new_name) DMEM_API __attribute__((deprecated("use " #new_name)))
#elif defined(_MSC_VER)
#define DMEM_DEPRECATED_API(new_name) DMEM_API __declspec(deprecated("use " #new_name))
#else
#define DMEM_DEPRECATED_API(new_name) DMEM_API
#endif

/* X(name, value, message): the single table that generates the enum, the
 * names and the messages. */
#define DMEM_STATUS_MAP(X)                                                        \
  X(OK, 0, "success")                                                             \
  X(ERR_INVALID_ARGUMENT, -1, "invalid argument")                                 \
  X(ERR_STALE_HANDLE, -2, "handle is zero, freed or forged")                      \
  X(ERR_BUSY, -3, "buffer is locked, pinned or in use")                           \
  X(ERR_NOT_LOCKED, -4, "buffer is not locked")                                   \
  X(ERR_OUT_OF_MEMORY, -10, "out of device memory after every possible eviction") \
  X(ERR_HOST_OUT_OF_MEMORY, -11, "out of host memory for spilled data")           \
  X(ERR_IO, -12, "disk tier I/O failed")                                          \
  X(ERR_CALLBACK, -20, "a caller-supplied callback failed")                       \
  X(ERR_CONFIG, -30, "invalid configuration or environment variable")             \
  X(ERR_NO_DEVICE, -40, "no usable device or driver")                             \
  X(ERR_DEVICE, -41, "device or driver call failed")                              \
  X(ERR_DEVICE_FATAL, -50, "device context lost; runtime refuses further work")   \
  X(ERR_FORKED, -51, "runtime inherited through fork(); refused in the child")

/** Status returned by every fallible dmem call. DMEM_OK is 0, errors are
 *  negative. */
typedef enum dmem_status {
#define DMEM_STATUS_ENUM_(name, value, msg) DMEM_##name = value,
  DMEM_STATUS_MAP(DMEM_STATUS_ENUM_)
#undef DMEM_STATUS_ENUM_
} dmem_status_t;

/**
 * Name of a status, e.g. "DMEM_ERR_BUSY"; "DMEM_UNKNOWN_STATUS" for a value
 * outside the table. Never NULL. Thread-safe; the string is static.
 */
DMEM_API const char *dmem_status_name(dmem_status_t status);

/**
 * One-line human message for a status. Never NULL. Thread-safe; the string is
 * static.
 */
DMEM_API const char *dmem_status_string(dmem_status_t status);

/**
 * Detail of the last failure on the calling thread: which call failed and why
 * (for example "cudaMalloc(1073741824): cudaErrorMemoryAllocation"). Written
 * by the code that first detects an error; successful calls leave it as it
 * was. Empty string if no failure was recorded. Never NULL. The string is
 * thread-local and valid until the next failing dmem call on this thread.
 */
DMEM_API const char *dmem_last_error_detail(void);

#ifdef __cplusplus
}
#endif
#endif /* DMEM_STATUS_H */
