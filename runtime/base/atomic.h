/*
 * runtime/base/atomic.h - C11 atomics with the memory order in the name. No file
 * of dmem calls atomic_*_explicit directly: every access goes through these
 * macros, so the order of each one is visible where it is used.
 * Every acquire names its release partner in a comment at the call site.
 */
#ifndef DMEM_ATOMIC_H
#define DMEM_ATOMIC_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "base/sched.h"

#define dmem_atomic_load_relaxed(p) atomic_load_explicit((p), memory_order_relaxed)
#define dmem_atomic_load_acquire(p) atomic_load_explicit((p), memory_order_acquire)
#define dmem_atomic_store_relaxed(p, v) atomic_store_explicit((p), (v), memory_order_relaxed)
#define dmem_atomic_store_release(p, v) atomic_store_explicit((p), (v), memory_order_release)
#define dmem_atomic_add_relaxed(p, v) atomic_fetch_add_explicit((p), (v), memory_order_relaxed)
#define dmem_atomic_sub_relaxed(p, v) atomic_fetch_sub_explicit((p), (v), memory_order_relaxed)
#define dmem_atomic_add_acq_rel(p, v) atomic_fetch_add_explicit((p), (v), memory_order_acq_rel)
#define dmem_atomic_sub_acq_rel(p, v) atomic_fetch_sub_explicit((p), (v), memory_order_acq_rel)
/* Fetch-or: returns the previous value. */
#define dmem_atomic_or_relaxed(p, v) atomic_fetch_or_explicit((p), (v), memory_order_relaxed)
#define dmem_atomic_or_acq_rel(p, v) atomic_fetch_or_explicit((p), (v), memory_order_acq_rel)
#define dmem_atomic_and_acq_rel(p, v) atomic_fetch_and_explicit((p), (v), memory_order_acq_rel)
#define dmem_atomic_exchange_acq_rel(p, v) atomic_exchange_explicit((p), (v), memory_order_acq_rel)
/* Compare-and-swap: acq_rel on success, acquire on failure (the failing load
 * re-reads the word that a partner published with release). These are the
 * state-word transitions: the schedule fuzzer (base/sched.h) may yield
 * before each one. */
#define dmem_atomic_cas_acq_rel(p, expected, desired)                                       \
  (DMEM_SCHED_POINT(),                                                                      \
   atomic_compare_exchange_weak_explicit((p), (expected), (desired), memory_order_acq_rel, \
                                         memory_order_acquire))
#define dmem_atomic_cas_strong_acq_rel(p, expected, desired)                                  \
  (DMEM_SCHED_POINT(),                                                                        \
   atomic_compare_exchange_strong_explicit((p), (expected), (desired), memory_order_acq_rel, \
                                           memory_order_acquire))
/* A full fence: orders a store before a later load of another variable
 * (store-buffering handshakes; each use names its partner fence). */
#define dmem_atomic_fence_seq_cst() atomic_thread_fence(memory_order_seq_cst)
#define dmem_atomic_exchange_relaxed(p, v) atomic_exchange_explicit((p), (v), memory_order_relaxed)
#define dmem_atomic_cas_strong_relaxed(p, expected, desired)                                 \
  atomic_compare_exchange_strong_explicit((p), (expected), (desired), memory_order_relaxed, \
                                          memory_order_relaxed)
/* Relaxed CAS, for counters that order nothing (accounting). */
#define dmem_atomic_cas_relaxed(p, expected, desired)                                      \
  atomic_compare_exchange_weak_explicit((p), (expected), (desired), memory_order_relaxed, \
                                        memory_order_relaxed)

#endif /* DMEM_ATOMIC_H */
