/*
 * spill/summary.c - the once-a-second summary of what moved, logged at info
 * (DMEM_LOG=info): spills, unspills, push-downs to disk and on-demand
 * evictions since the last summary, and where the bytes are now. Never a
 * line per buffer: the thread that counts a move after a second has passed
 * since the last summary logs the next one (a CAS decides which thread),
 * and destroy logs what is left.
 */
#include "spill/spill.h"
#include "spill/summary.h"

static double mib(uint64_t b) { return (double)b / (1024.0 * 1024.0); }

/* Log the moves since the counters in rt->sum_* (then set to the counts now)
 * over `ns`. */
static void summary_emit(dmem_runtime_t *rt, uint64_t ns) {
  uint64_t spills = dmem_atomic_load_relaxed(&rt->spill_count);
  uint64_t sbytes = dmem_atomic_load_relaxed(&rt->bytes_spilled);
  uint64_t unspills = dmem_atomic_load_relaxed(&rt->unspill_count);
  uint64_t ubytes = dmem_atomic_load_relaxed(&rt->bytes_unspilled);
  uint64_t pushdowns = dmem_atomic_load_relaxed(&rt->disk_pushdowns);
  uint64_t evictions = dmem_atomic_load_relaxed(&rt->oom_evictions);
  uint64_t ds = spills - dmem_atomic_exchange_acq_rel(&rt->sum_spills, spills);
  uint64_t dsb = sbytes - dmem_atomic_exchange_acq_rel(&rt->sum_spill_bytes, sbytes);
  uint64_t du = unspills - dmem_atomic_exchange_acq_rel(&rt->sum_unspills, unspills);
  uint64_t dub = ubytes - dmem_atomic_exchange_acq_rel(&rt->sum_unspill_bytes, ubytes);
  uint64_t dp = pushdowns - dmem_atomic_exchange_acq_rel(&rt->sum_pushdowns, pushdowns);
  uint64_t de = evictions - dmem_atomic_exchange_acq_rel(&rt->sum_evictions, evictions);
  if (!ds && !du && !dp && !de) return;
  dmem__log(DMEM_LOG_INFO,
            "last %.2f s: %llu spills (%.1f MiB), %llu unspills (%.1f MiB), %llu push-downs to "
            "disk, %llu on-demand evictions; now device %.1f of %.1f MiB, host tier %.1f MiB, "
            "disk tier %.1f MiB",
            (double)ns * 1e-9, (unsigned long long)ds, mib(dsb), (unsigned long long)du, mib(dub),
            (unsigned long long)dp, (unsigned long long)de, mib(dmem__device_used(rt)),
            mib(rt->limit), mib(dmem_atomic_load_relaxed(&rt->host_used)),
            mib(dmem_atomic_load_relaxed(&rt->disk_used)));
}

void dmem__summary_tick(dmem_runtime_t *rt) {
  uint64_t now = dmem__now_ns();
  uint64_t last = dmem_atomic_load_relaxed(&rt->sum_last_ns);
  if (now - last < 1000000000ull) return;
  if (!dmem_atomic_cas_relaxed(&rt->sum_last_ns, &last, now)) return; /* another thread logs it */
  summary_emit(rt, now - last);
}

void dmem__summary_flush(dmem_runtime_t *rt) {
  if (dmem_atomic_load_relaxed(&rt->log_level) < DMEM_LOG_INFO) return;
  uint64_t now = dmem__now_ns();
  uint64_t last = dmem_atomic_exchange_acq_rel(&rt->sum_last_ns, now);
  summary_emit(rt, now - last);
}
