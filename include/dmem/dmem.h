/*
 * dmem/dmem.h - umbrella header of dmem, a runtime for deferrable
 * (spillable) GPU memory.
 *
 * Conventions: every fallible call returns dmem_status_t (DMEM_OK = 0, errors
 * negative); outputs come last, end in _out, and are written only on success;
 * every function is thread-safe unless its documentation says otherwise.
 */
#ifndef DMEM_DMEM_H
#define DMEM_DMEM_H

#define DMEM_VERSION_MAJOR 0
#define DMEM_VERSION_MINOR 1
#define DMEM_VERSION_PATCH 0

#include "dmem/status.h"
#include "dmem/types.h"
#include "dmem/config.h"
#include "dmem/runtime.h"
#include "dmem/buffer.h"
#include "dmem/launch.h"
#include "dmem/stream.h"
#include "dmem/spill.h"
#include "dmem/stats.h"
#include "dmem/controller.h"
#include "dmem/device.h"

#endif /* DMEM_DMEM_H */
