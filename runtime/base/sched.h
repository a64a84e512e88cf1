/*
 * runtime/base/sched.h - the schedule fuzzer's points.
 *
 * Built with -DDMEM_SCHED_FUZZ=ON (or linked as the test-only library
 * dmem_fuzz_static), dmem's own mutex, state-word CAS and callback wrappers
 * call DMEM_SCHED_POINT(), which, when the environment sets
 * DMEM_SCHED_SEED to a non-zero number, yields the processor or sleeps for a
 * random while: interleavings that a normal run meets once in millions of
 * tries become common. The choices come from the seed (each thread draws
 * from its own generator, seeded from DMEM_SCHED_SEED and the order in which
 * threads first reach a point), so a failing seed fails again far more often
 * than chance, though the OS scheduler still has the last word.
 *
 *   DMEM_SCHED_SEED=N      0 or unset: the points do nothing (one relaxed load)
 *   DMEM_SCHED_RATE=R      about 1 point in R yields (default 8); 1 in 8R
 *                          sleeps up to 200 us, 1 in 256R up to 2 ms
 *
 * Without DMEM_SCHED_FUZZ the macro is empty: release builds pay nothing.
 * docs/reliability.md ("Schedule fuzzing") says how the model test uses it.
 */
#ifndef DMEM_SCHED_H
#define DMEM_SCHED_H

#include <stdint.h>

#ifdef DMEM_SCHED_FUZZ
/* Maybe yield or sleep (see above). Thread-safe; takes no lock. */
void dmem__sched_point(void);
/* The seed in effect (0: fuzzing off), read once from the environment. */
uint64_t dmem__sched_seed(void);
#define DMEM_SCHED_POINT() dmem__sched_point()
#else
#define DMEM_SCHED_POINT() ((void)0)
#endif

#endif /* DMEM_SCHED_H */
