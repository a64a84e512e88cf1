/*
 * spill/spill.h - the spill layer: where a deferred buffer's bytes are kept
 * (tiers), moving a buffer out (move_out.c) and back (retrieve.c), recycling
 * unspill staging (staging.c), reclaim and the end of a move (reclaim.c),
 * stream releases waiting for their event (pending.c), choosing victims
 * (policy.c) and making room when device memory runs short (pressure.c).
 *
 * Spill calls memory, core, the backend table and base; never the API
 * layer above it.
 */
#ifndef DMEM_SPILL_LAYER_H
#define DMEM_SPILL_LAYER_H

#include "memory/memory.h"


/* ---- tiers (tier.c; tier_host.c, tier_disk.c, tier_controller.c) -------------- */

/* What a tier does: where a deferred buffer's bytes are kept, one file per
 * tier. Every function is called by the owner of the buffer's TRANSIT (or
 * by reclaim, which owns the buffer). Where a tier sits in the chain (its
 * next tier, batches, pipelining) is its row in tier.c's table. */
typedef struct dmem__tier_ops {
  dmem_tier_t tier;
  unsigned state; /* the buffer state of a buffer held here */
  const char *name;
  /* The host tier keeps the pinned staging itself as its copy (store adopts
   * `data`, load has nothing to do); the others copy out and in. A tier
   * that adopts keeps the bytes at b->host, so a buffer held there can move
   * on to another tier (move_out.c), and a spill copy into it may still run
   * while the buffer is held there (SPILL_COPY). */
  bool adopts_staging;
  /* The store hands the bytes to code outside dmem that learns of frees
   * from the FREE event (the controller): it runs inside dmem_buffer_free's
   * handshake (core.h: dmem__store_watch), and a buffer freed before it is
   * not stored. */
  bool watch_free;
  /* DMEM_OK when a spill may go to the tier now; else the status such a
   * spill returns (the detail recorded). NULL: always. The controller
   * tier: a controller with store and retrieve is installed. */
  dmem_status_t (*ready)(dmem_runtime_t *rt);
  /* Keep the buffer's size bytes, now at `data` (pinned). The host tier
   * adopts `data` as b->host, charging host_used; past the host limit it
   * kicks the push-down to disk, and it refuses (DMEM_ERR_HOST_OUT_OF_MEMORY:
   * the caller goes on to the row's next tier) a buffer larger than the
   * limit or one that would take the tier more than half the limit past it
   * (host_burst). The others
   * copy it out and leave `data` to the caller; the disk tier's write stops
   * (DMEM_ERR_BUSY) when a lock cancels the move. */
  dmem_status_t (*store)(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h, void *data);
  /* Batch admission (a tier whose row takes eviction batches; NULL
   * otherwise): charge `bytes` of several buffers at once, as store does
   * for one (past the limit it kicks the push-down); false when the tier
   * cannot take them all (nothing charged). uncharge_n gives such a charge
   * back; a buffer committed to the tier is dropped one by one (drop). */
  bool (*charge_n)(dmem_runtime_t *rt, size_t bytes);
  void (*uncharge_n)(dmem_runtime_t *rt, size_t bytes);
  /* Bring the bytes back into pinned memory at b->host (the host tier: they
   * are there already). On failure b->host is as it was. */
  dmem_status_t (*load)(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h);
  /* Or (NULL: load, then one copy from b->host): bring the bytes straight
   * to device memory at dev, with copies enqueued on `stream` (the
   * runtime's host->device stream) piece by piece as they arrive, and
   * return once the last is enqueued; b->host is not used. On failure the
   * tier's copy is as it was; copies of pieces already enqueued may still
   * be running into dev (the caller gives dev back in stream order). The
   * disk tier: its chunks are read into the tier's pinned staging slots
   * (tier_disk.c). Used when the tier's row says pipelined. */
  dmem_status_t (*load_device)(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h, void *dev,
                               void *stream);
  /* Copy n bytes at offset off of the buffer into host memory at dst and
   * leave the tier's copy as it is (dmem_buffer_read; spill/read.c). NULL:
   * the tier cannot be read in place (the controller may drop its copy
   * after a retrieve). */
  dmem_status_t (*read)(dmem_runtime_t *rt, dmem__buffer_t *b, size_t off, void *dst, size_t n);
  /* Forget the buffer: remove its file, uncharge its bytes. Pinned memory at
   * b->host stays (dmem__host_copy_release frees it; a retrieve recycles it
   * as staging). */
  void (*drop)(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h);
  /* Bytes held by the tier. */
  size_t (*used)(dmem_runtime_t *rt);
  /* The tier's target size in bytes (0: none now), past which the
   * push-down (pushdown.c) moves its least recently used buffers to the
   * row's next tier. NULL: never pushed down. */
  size_t (*limit)(const dmem_runtime_t *rt);
} dmem__tier_ops_t;

extern const dmem__tier_ops_t dmem__tier_host, dmem__tier_disk, dmem__tier_controller;

/* One row of the tier chain (tier.c's table, which says how to add a
 * tier). */
typedef struct dmem__tier_row {
  const dmem__tier_ops_t *ops;
  /* The tier below: where the push-down sends bytes past ops->limit, and
   * where a spill goes on when ops->store refuses it as full
   * (DMEM_ERR_HOST_OUT_OF_MEMORY). NULL: the end of the chain. */
  const dmem__tier_ops_t *next;
  /* Eviction batches (dmem__spill_batch) go here, admitted at once by
   * ops->charge_n. At most one row, the first (where evictions go). */
  bool batch;
  /* Whether a retrieve from the tier may be pipelined now (ops->load_device:
   * the pieces copied to the device as they arrive); NULL: never. */
  bool (*pipelined)(const dmem_runtime_t *rt);
} dmem__tier_row_t;

/* The chain's table, rows[0..*n_out): its first row is where evictions go.
 * The table is constant: these lookups are thread-safe and take no lock. */
const dmem__tier_row_t *dmem__tier_rows(size_t *n_out);
/* Check a tier table: every next tier has a row and every next chain ends
 * (no loop), tier and state values unique and below DMEM__NTIERS, batch
 * only on the first row and with charge_n/uncharge_n and adopts_staging,
 * pipelined only with load_device, limit only with a next tier and
 * adopts_staging (tier changes start only from such a tier). Returns
 * true when it holds; else false with what is wrong in why[0..why_len). */
bool dmem__tier_table_check(const dmem__tier_row_t *rows, size_t n, char *why, size_t why_len);
/* The row of a tier / of the tier holding a buffer in state s, or NULL. */
const dmem__tier_row_t *dmem__tier_row(const dmem__tier_ops_t *t);
const dmem__tier_row_t *dmem__tier_row_of_state(unsigned s);
/* The first row's tier: where evictions spill to. */
const dmem__tier_ops_t *dmem__tier_top(void);

/* How far past host_limit the host tier may go while the push-down to disk
 * catches up (tier_host.c): limit * (1 + burst), burst being
 * dmem_config_t.host_burst; the most pinned memory it holds. */
size_t dmem__host_tier_cap(size_t limit, double burst);
/* The tier of a dmem_tier_t with a row (HOST, DISK, CONTROLLER), or NULL
 * (DEVICE, unknown). */
const dmem__tier_ops_t *dmem__tier_of(dmem_tier_t tier);
/* The tier holding a buffer in state s, or NULL (not deferred). */
const dmem__tier_ops_t *dmem__tier_of_state(unsigned s);
/* The public tier of a buffer in state s (DMEM_TIER_DEVICE unless deferred). */
dmem_tier_t dmem__tier_public(unsigned s);
/* Free the pinned memory at b->host, if any (host copy or staging; its
 * accounting went with the tier's drop). */
void dmem__host_copy_release(dmem_runtime_t *rt, dmem__buffer_t *b);
/* The disk tier's file, created on first use. */
dmem_status_t dmem__disk_get(dmem_runtime_t *rt, dmem__disk_t **disk_out);
/* At destroy, once nothing reads the disk tier any more and its copies on
 * rt->unspill_stream are complete: give the staging slots back. */
void dmem__disk_stage_fini(dmem_runtime_t *rt);
/* Give the disk tier's idle staging slots back to the pinned pool: those
 * whose copy is complete, or (wait) all of them after their copies. Slots
 * a read holds now stay. */
void dmem__disk_stage_trim(dmem_runtime_t *rt, bool wait);
/* Whether retrieves from disk read through the staging slots, pipelined
 * (tier_disk.c; the disk row's `pipelined`): always without host_limit; with it, only when the pool's
 * staging allowance holds DMEM__DISK_PIPE_MIN_SLOTS slots twice over. A
 * tighter pool reads each buffer into staging of its own size, freed once
 * its copy is done: slots held between retrieves took the room that spills
 * needed (gpu.kernels.kernels_through_spill_cycles_4_streams, a 64 MiB host
 * limit, failed with DMEM_ERR_HOST_OUT_OF_MEMORY on the H200). */
#define DMEM__DISK_PIPE_MIN_SLOTS 8u
bool dmem__disk_pipelined(const dmem_runtime_t *rt);

/* ---- the disk tier's file (disk.c) ---------------------------------------------- */

/* Make the private directory (0700) under `parent` (NULL: $TMPDIR or /tmp)
 * and open the unnamed spill file (0600) in it. DMEM_ERR_IO (the detail
 * names the directory and the errno) when the parent is not writable.
 * `io` (may be NULL) lends its threads to large reads and writes. */
dmem_status_t dmem__disk_create(const char *parent, dmem__io_t *io, dmem__disk_t **disk_out);
/* Close the file (its blocks go back to the filesystem) and remove the
 * directory. */
void dmem__disk_destroy(dmem__disk_t *disk);
/* Whether the file is read and written with O_DIRECT. */
bool dmem__disk_direct(const dmem__disk_t *disk);
/* Reserve an extent for n bytes; *off_out is its file offset.
 * DMEM_ERR_IO when the filesystem has no room. */
dmem_status_t dmem__disk_alloc(dmem__disk_t *disk, size_t n, uint64_t *off_out);
/* Give back an extent of n bytes at off. It keeps its blocks and is the
 * first reused (dmem__disk_alloc); the blocks go back to the filesystem (a
 * hole punched) on an I/O thread once the file has had no read or write
 * for the quiet time (50 ms), or when an allocation finds the filesystem
 * full; without I/O threads, here. disk NULL: nothing. */
void dmem__disk_free(dmem__disk_t *disk, uint64_t off, size_t n);
/* The I/O threads are gone (dmem_runtime_destroy, after dmem__io_destroy):
 * nothing is punched from now on (the file is closed next). */
void dmem__disk_io_gone(dmem__disk_t *disk);
/* Tests: how long the file must have been quiet before kept extents are
 * punched. */
void dmem__disk_quiet_set(dmem__disk_t *disk, uint64_t ns);
/* Asked between chunks of a write: true stops it (DMEM_ERR_BUSY). Runs on
 * the writing thread or an I/O thread. */
typedef bool (*dmem__disk_cancel_fn)(void *arg);
/* Write / read n bytes at file offset off of an extent, in chunks shared
 * with the I/O threads. DMEM_ERR_IO on a failed or short pread/pwrite;
 * DMEM_ERR_BUSY when `cancel` (may be NULL) said stop. A write starts at
 * the extent's start; a read may start anywhere in it (a ranged read). */
dmem_status_t dmem__disk_write(dmem__disk_t *disk, uint64_t off, const void *data, size_t n,
                               dmem__disk_cancel_fn cancel, void *cancel_arg);
dmem_status_t dmem__disk_read(dmem__disk_t *disk, uint64_t off, void *data, size_t n);

/* The chunk size of the file's I/O: the most one sink buffer receives. */
#define DMEM__DISK_CHUNK ((size_t)8 << 20)

/* Where dmem__disk_read_chunks puts each chunk. Both functions run on the
 * reading thread or an I/O thread, for several chunks at once, with no
 * runtime mutex held; a failure is reported with dmem__error as usual
 * (the read returns it, with its detail, on the calling thread). */
typedef struct dmem__disk_sink {
  /* A buffer for one chunk (DMEM__DISK_CHUNK bytes; page-aligned for
   * O_DIRECT, else the read bounces), and a token for put. */
  dmem_status_t (*get)(void *arg, void **buf_out, void **token_out);
  /* The chunk at byte `at` of the read, len bytes, is in the buffer (ok) or
   * its read failed (!ok: just give the buffer back). */
  dmem_status_t (*put)(void *arg, void *token, size_t at, size_t len, bool ok);
  void *arg;
} dmem__disk_sink_t;
/* Read n bytes at file offset off (block-aligned: an extent's start) chunk
 * by chunk, shared with the I/O threads like dmem__disk_read, each chunk
 * into a buffer from sink->get and handed to sink->put as soon as it is in,
 * in no particular order. Returns once every chunk started has been put.
 * DMEM_ERR_IO on a failed or short pread (chunks not yet started are not
 * read); a sink's status as it gave it. */
dmem_status_t dmem__disk_read_chunks(dmem__disk_t *disk, uint64_t off, size_t n,
                                     const dmem__disk_sink_t *sink);

/* Test hook (internal; tests only, never the public API): called before
 * each disk operation with its kind, file offset and length; a non-zero
 * return is the errno the operation fails with (DIRECT: the file is used
 * buffered, as on a filesystem that rejects O_DIRECT). fn NULL removes
 * it. Process-wide. The fault injector (DMEM_FAULT_INJECT, runtime/backend/
 * fault.h) is asked first at the same points (but DIRECT). */
typedef enum dmem__disk_op {
  DMEM__DISK_OP_DIR,    /* making the private directory */
  DMEM__DISK_OP_OPEN,   /* opening the spill file in it */
  DMEM__DISK_OP_DIRECT, /* turning O_DIRECT on for the file */
  DMEM__DISK_OP_ALLOC,  /* reserving an extent (fallocate) */
  DMEM__DISK_OP_WRITE,  /* one pwrite */
  DMEM__DISK_OP_READ,   /* one pread */
  DMEM__DISK_OP_PUNCH   /* giving a freed extent's blocks back (fallocate
                           PUNCH_HOLE; an error skips it, as a filesystem
                           that cannot punch: the blocks stay till reuse) */
} dmem__disk_op_t;
typedef int (*dmem__disk_hook_fn)(void *user, dmem__disk_op_t op, uint64_t off, size_t len);
void dmem__disk_hook_set(dmem__disk_hook_fn fn, void *user);

/* ---- I/O threads (io.c) ------------------------------------------------------------ */

#define DMEM__IO_THREADS 4

/* A unit of urgent work for the I/O threads; run(t) is called once, on an
 * I/O thread, with no runtime mutex held. */
typedef struct dmem__io_task {
  struct dmem__io_task *next;
  void (*run)(struct dmem__io_task *t);
} dmem__io_task_t;

/* The pool. `background` is the job run after dmem__io_kick (the
 * push-down); it returns whether it wants to run again. No thread starts
 * before work arrives. */
dmem_status_t dmem__io_create(dmem_runtime_t *rt, bool (*background)(dmem_runtime_t *rt),
                              dmem__io_t **io_out);
/* Stop: a background run in progress ends early (dmem__io_stopping), the
 * threads are joined. Tasks still queued never run: a task someone waits
 * for must have been withdrawn (the disk tier's hole punching is left
 * queued and done by dmem__disk_io_gone). */
void dmem__io_destroy(dmem__io_t *io);
/* Queue t. False when the pool is stopping (t is not queued). */
bool dmem__io_submit(dmem__io_t *io, dmem__io_task_t *t);
/* Take t back if no thread has started it (true); false: it has started
 * or finished. */
bool dmem__io_withdraw(dmem__io_t *io, dmem__io_task_t *t);
/* Have the background job run (again). Never blocks on I/O. */
void dmem__io_kick(dmem__io_t *io);
/* True while a task is queued that no thread has taken yet. */
bool dmem__io_queued(dmem__io_t *io);
/* True once destroy began. */
bool dmem__io_stopping(dmem__io_t *io);
/* Wait until no task is queued or running and the background job has
 * nothing left to do (tests, benchmarks). */
void dmem__io_quiesce(dmem__io_t *io);
/* True on an I/O thread while it runs the background job. */
extern _Thread_local bool dmem__io_tl_background;

/* ---- the push-down from tier to tier (pushdown.c) --------------------------------- */

/* The I/O pool's background job: while a tier with a limit and a next tier
 * (the host tier: host_limit, disk) holds more than its limit (not
 * counting the bytes being written down now), move its least recently
 * used buffers (lowest priority first) to the next tier. Returns whether
 * it should run again. */
bool dmem__pushdown_run(dmem_runtime_t *rt);

/* ---- reclaim and the end of moves (reclaim.c) ----------------------------------- */

/* Called exactly once per freed buffer, by the party whose CAS made
 * FREED && count == 0 && !TRANSIT true; w is that word. */
void dmem__reclaim(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t w);
/* After a CAS that cleared the caller's TRANSIT (new word nw): reclaim if
 * the buffer was freed meanwhile, wake waiters. */
void dmem__move_after(dmem_runtime_t *rt, dmem__buffer_t *b, uint64_t nw);
/* dmem__move_after for n buffers whose TRANSIT the caller's CASes cleared
 * (new words nws[i]), with one wake-up of the waiters for all of them. */
void dmem__moves_after(dmem_runtime_t *rt, dmem__buffer_t *const *bs, const uint64_t *nws,
                       size_t n);
/* End the caller's TRANSIT as `exit` says, then dmem__move_after. */
uint64_t dmem__move_end(dmem_runtime_t *rt, dmem__buffer_t *b, dmem__transit_exit_t exit);
/* Drop one lock of h; the last unlock of a freed buffer reclaims it.
 * DMEM_ERR_STALE_HANDLE, DMEM_ERR_NOT_LOCKED. */
dmem_status_t dmem__unlock_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h);
/* dmem__unlock_buffer without the reclaim: when the lock dropped was the
 * last of a freed buffer, *reclaim_w_out is the new word and the caller
 * must call dmem__reclaim(rt, b, *reclaim_w_out) (with no lock held that
 * a tier's drop may need); else it is 0. So that a poll can make a batch's
 * unlocks visible under its lock and reclaim after it (spill/pending.c). */
dmem_status_t dmem__unlock_count(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                 uint64_t *reclaim_w_out);

/* ---- copies in flight (staging.c) ----------------------------------------------- */

/* Remember that b has a copy in flight: UNSPILL_COPY (resident; its staging
 * b->host is recycled once b->unspill_event completes) or SPILL_COPY on a
 * DEFERRED_HOST buffer (b->spill_event goes back to the pool once the copy
 * into the host tier completes). */
void dmem__staging_push(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h);
/* The same for v[0..n), under one acquisition of the staging mutex. */
void dmem__staging_push_n(dmem_runtime_t *rt, const dmem__reg_entry_t *v, size_t n);
/* Staging of size bytes for a spill or a disk load. When the pinned pool
 * has no room, the staging of finished (and finishing) unspill copies is
 * recycled first and the allocation tried once more (retrieve.c does the
 * same around a tier's load); if the pool holds its limit even then, the
 * staging is pageable memory (slower, synchronous copies) rather than a
 * failed move. DMEM_ERR_HOST_OUT_OF_MEMORY: the backend could not pin (or
 * no pageable memory either). */
dmem_status_t dmem__staging_alloc(dmem_runtime_t *rt, size_t size, void **stage_out);
/* Finish the copies that completed (wait_all: wait for all of them), and
 * give the disk tier's idle read staging back (dmem__disk_stage_trim). */
void dmem__staging_poll(dmem_runtime_t *rt, bool wait_all);
void dmem__staging_fini(dmem_runtime_t *rt);

/* ---- stream releases waiting for their event (pending.c) ------------------------ */

/* Unlock entries v[0..n) once `event` completes; takes ownership of v and
 * event. */
dmem_status_t dmem__pending_add(dmem_runtime_t *rt, void *event, dmem__reg_entry_t *v, size_t n);
/* The record of a stream dmem made (rt->sreg), locked (rank stream), or
 * NULL: the stream has none (its registry is in rt->reg's lists, and its
 * releases record an event each). Lock-free until the record's lock. */
static inline dmem__sreg_t *dmem__sreg_lock(dmem_runtime_t *rt, void *stream);
static inline void dmem__sreg_unlock(dmem__sreg_t *s);
/* Under s's lock: register e[0..n) after what s holds; false when the
 * array cannot grow (nothing changed). */
static inline bool dmem__sreg_append(dmem__sreg_t *s, const dmem__reg_entry_t *e, size_t n);
/* Under s's lock: room for `more` entries after v[0..n) (false: none). */
bool dmem__sreg_grow(dmem__sreg_t *s, size_t more);
/* dmem_stream_release's half on a stream with a record, under s's lock:
 * the launches registered since the last release join the open group,
 * O(1), no clock read on most releases. A release that opens a group
 * DMEM__RELEASE_GAP_NS or more after the stream's last release event
 * records an event at once (on failure its launches stay registered); a
 * group that holds DMEM__RELEASE_GROUP releases (or
 * DMEM__RELEASE_MAX_ENTRIES locks), or DMEM__RELEASE_AGE_NS old (looked at
 * every 8th release), gets its event now (on failure it stays open: the
 * next poll tries again). *recorded: an event was recorded. */
#define DMEM__RELEASE_GAP_NS 50000u  /* closer releases are grouped */
#define DMEM__RELEASE_AGE_NS 200000u /* a group older than this records (at a release) */
#define DMEM__RELEASE_GROUP 64u      /* ... or one with this many releases */
dmem_status_t dmem__pending_group(dmem_runtime_t *rt, dmem__sreg_t *s, bool *recorded);
/* Its common case inline, under s's lock: a release that joins an open
 * group and makes it neither due nor due for a look at its age (true:
 * done, nothing recorded); false: call dmem__pending_group. */
static inline bool dmem__pending_join(dmem_runtime_t *rt, dmem__sreg_t *s);
#define DMEM__RELEASE_AGE_EVERY 8u /* releases between looks at a group's age */
#define DMEM__RELEASE_MAX_ENTRIES 65536u /* a group of this many locks records */
/* Record an event on stream now for v[0..n) (an array from malloc, taken on
 * success; on failure nothing changed): a release on a stream without a
 * record. */
dmem_status_t dmem__pending_release_now(dmem_runtime_t *rt, void *stream, dmem__reg_entry_t *v,
                                        size_t n);
/* Unlock the releases whose event completed (wait_all: wait for all),
 * after recording an event for every open group. Returns how many
 * releases completed. */
size_t dmem__pending_poll(dmem_runtime_t *rt, bool wait_all);
/* As dmem__pending_poll(rt, false) without recording: only the events
 * recorded already (dmem_stream_release's own look). */
size_t dmem__pending_poll_recorded(dmem_runtime_t *rt);
/* Test hook (internal; tests only): called by a poll that took finished
 * releases, once their locks are dropped and before their reclaims, with
 * no lock held, so that a test can hold a poll there. fn NULL removes it.
 * Process-wide. */
typedef void (*dmem__pending_hook_fn)(void *user);
void dmem__pending_hook_set(dmem__pending_hook_fn fn, void *user);
/* A synchronisation of `stream` covers its open group: take it before the
 * synchronisation begins, and with_registered, the launches registered on
 * the stream's record too (dmem_sync_and_unlock), as one array from malloc
 * (*v_out; NULL when nothing), the group first: (*v_out)[0..*g_out) the
 * group, [*g_out..*n_out) the registered launches. Then hand the group to
 * dmem__pending_taken_done (which does not free v): unlocked when the
 * synchronisation succeeded (or the context is lost), else back into the
 * stream's group. A group that cannot be taken (no memory) stays. */
void dmem__pending_take_stream(dmem_runtime_t *rt, void *stream, bool with_registered,
                               dmem__reg_entry_t **v_out, size_t *g_out, size_t *n_out);
void dmem__pending_taken_done(dmem_runtime_t *rt, void *stream, dmem__reg_entry_t *v, size_t g,
                              dmem_status_t sync_status);
/* A record for `stream`, made by dmem (dmem_stream_create; the host
 * backend's default stream), holding carry[0..ncarry) registered (what the
 * registry's lists held for that address). Under rt->reg.mu (claims are
 * serialised by it). false: no free record, or no memory (nothing
 * changed: the stream stays in the lists, and records an event a
 * release). */
bool dmem__pending_stream_add(dmem_runtime_t *rt, void *stream, const dmem__reg_entry_t *carry,
                              size_t ncarry);
/* dmem_stream_destroy, before the stream goes: its open group gets its
 * event (or, if none can be recorded, waits for the stream and unlocks),
 * and its record is given back unless launches are registered on it. */
void dmem__pending_stream_forget(dmem_runtime_t *rt, void *stream);
/* At destroy, after dmem__pending_poll(rt, true). */
void dmem__pending_fini(dmem_runtime_t *rt);

/* ---- moving out (move_out.c) and back (retrieve.c) --------------------------------- */

/* Spill b (handle h) to `tier`. by_policy: b is an eviction victim, skipped
 * (BUSY) unless it is still resident. */
dmem_status_t dmem__spill_buffer(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                                 dmem_tier_t tier, bool by_policy);

typedef enum dmem__retrieve_mode {
  DMEM__RETRIEVE_LOCK,    /* bring back and lock (dmem_buffer_lock's slow path) */
  DMEM__RETRIEVE_ONLY,    /* bring back, no lock (dmem_buffer_unspill) */
  DMEM__RETRIEVE_PREFETCH /* bring back, no lock, and leave `stream` alone:
                             the caller orders it after the whole batch */
} dmem__retrieve_mode_t;
/* The one retrieve state machine: wait out other movers, cancel a spill in
 * flight, or bring a deferred buffer back with a copy ordered on `stream`.
 * In DMEM__RETRIEVE_LOCK mode *dev_out is the device address of the now
 * locked buffer; in DMEM__RETRIEVE_ONLY mode dev_out may be NULL. */
dmem_status_t dmem__retrieve(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h,
                             void *stream, dmem__retrieve_mode_t mode, void **dev_out);

/* ---- reading in place (read.c) ---------------------------------------------------- */

/* Copy bytes [off, off + n) of b (handle h) into host memory at dst from
 * wherever they are, leaving the buffer there: the one read state machine
 * behind dmem_buffer_read (statuses as documented there). */
dmem_status_t dmem__read(dmem_runtime_t *rt, dmem__buffer_t *b, dmem_handle_t h, size_t off,
                         void *dst, size_t n);

/* ---- the copy engine (copy.c) and prefetch (prefetch.c) --------------------------- */

/* Enqueue a copy of size bytes on `stream` (one of the runtime's copy
 * streams), in pieces of at most rt->copy_chunk bytes. Returns once
 * enqueued. */
dmem_status_t dmem__copy_chunked(dmem_runtime_t *rt, void *dst, const void *src, size_t size,
                                 void *stream);
/* Bring hs[0..n) back to the device on the host->device stream without
 * locking them, then make `stream` wait for all of the copies with one
 * event. Stops at the first error (the buffers before it stay
 * prefetched); *done_out (may be NULL) counts the buffers handled. */
dmem_status_t dmem__prefetch(dmem_runtime_t *rt, const dmem_handle_t *hs, size_t n,
                             void *stream, size_t *done_out);

/* ---- victims (policy.c) and room (pressure.c) ------------------------------------ */

/* A buffer that could be moved, with what orders it. */
typedef struct dmem__victim {
  int priority;
  uint64_t last_use;
  dmem__buffer_t *b;
  dmem_handle_t h;
} dmem__victim_t;

/* The most victims one spill batch moves under one copy event. A lock that
 * arrives at a victim of a batch before the batch's copies are all
 * enqueued waits for them (then it cancels that victim's spill): this
 * bounds that wait to about this many cudaMemcpyAsync submissions. */
#define DMEM__SPILL_BATCH_MAX 64u

/* What one spill batch did. */
typedef struct dmem__spill_batch_result {
  size_t used;    /* candidates looked at: v[0..used) */
  size_t victims; /* buffers now in the host tier */
  size_t freed;   /* their bytes */
  bool single;    /* nothing was moved: the host tier or the pinned pool
                     cannot take the batch at once; spill v[0..used) one by
                     one (dmem__spill_buffer goes to disk, recycles staging) */
} dmem__spill_batch_result_t;

/* Spill eviction candidates to the host tier as one batch: from v[0..n)
 * (in order; entries with b NULL skipped) the resident, unlocked, not
 * pinned ones, until DMEM__SPILL_BATCH_MAX are taken or their bytes reach
 * `need`. Per batch, not per buffer: one pinned-pool call for the staging,
 * one host-tier charge, one copy event recorded after all the copies
 * (shared by the victims: b->spill_event, one reference each), one pool
 * call giving the device ranges back tagged with it, one staging-list
 * insertion, one stats update, one wake-up of waiters. Each buffer is
 * still its own move: it takes TRANSIT, a lock that arrives once its copy
 * is enqueued cancels its spill alone, and it is DEFERRED_HOST with
 * SPILL_COPY until the shared event is seen complete.
 * Errors (backend failures of the waits, copies, the record): every victim
 * stays resident with its data where it was, none is moved; the status is
 * returned (*res_out still written). */
dmem_status_t dmem__spill_batch(dmem_runtime_t *rt, const dmem__victim_t *v, size_t n,
                                size_t need, dmem__spill_batch_result_t *res_out);

/* The live buffers whose state word w passes want(w, b), in victim order:
 * lowest priority first, then least recently unlocked. *out_v (malloc'd,
 * the caller frees) and *n_out written on success only.
 * DMEM_ERR_HOST_OUT_OF_MEMORY (nothing recorded: the caller reports it). */
dmem_status_t dmem__victims_sorted(dmem_runtime_t *rt,
                                   bool (*want)(uint64_t w, const dmem__buffer_t *b),
                                   dmem__victim_t **out_v, size_t *n_out);

/* ---- the default eviction policy (reuse.c) ---------------------------------------- */

/* What brought a buffer to the policy's notice. */
typedef enum dmem__arrival {
  DMEM__ARRIVE_NEW = 1,  /* allocated (or adopted) */
  DMEM__ARRIVE_BACK = 2, /* retrieved from a tier (a lock, dmem_buffer_unspill, a prefetch) */
  DMEM__ARRIVE_PRIO = 3, /* its priority changed */
  DMEM__ARRIVE_SOON = 4, /* prefetched: about to be locked */
  DMEM__ARRIVE_BACK_SOON = 5, /* (the policy's) a pending BACK that a prefetch brought */
  DMEM__ARRIVE_SOON_USED = 6  /* (the policy's) SOON of a buffer marked used then */
} dmem__arrival_t;

/* At create (after rt->limit is known) and destroy. */
void dmem__policy_init(dmem_runtime_t *rt);
void dmem__policy_fini(dmem_runtime_t *rt);
/* b, a live buffer, came to the device (NEW, BACK: called by the thread
 * that made it resident, after the releasing CAS that publishes it; its
 * mark is reset), changed priority (PRIO) or was prefetched (SOON, after
 * the prefetch's retrieve: a buffer it brought back joins the window,
 * unused until its next unlock; a resident one moves to its list's newest
 * end, to hot if used since it came back: spill/reuse.c). Lock-free: a CAS on
 * the arrivals stack, none when b's arrival is pending already. Nothing
 * under DMEM_EVICTION_LRU. */
void dmem__policy_arrive(dmem_runtime_t *rt, dmem__buffer_t *b, dmem__arrival_t kind);
/* Up to max victims (in the policy's order) whose bytes reach need, into
 * out[] (priority, b, h; last_use not set), each moved to its class's
 * cold list's newest end so that passes running beside this one take
 * others. *entries_out: the buffers on the policy's lists now (a bound on
 * how many victims a pass may look at); *fallback_out: some buffers are
 * on no list (no memory for a priority class), so the caller should scan
 * the table. Takes rt->pol.mu. */
size_t dmem__policy_collect(dmem_runtime_t *rt, size_t need, dmem__victim_t *out, size_t max,
                            size_t *entries_out, bool *fallback_out);

/* Why an eviction pass runs (stats and the DMEM_LOG=info line). */
typedef enum dmem__evict_reason {
  DMEM__EVICT_EXPLICIT, /* dmem_runtime_evict */
  DMEM__EVICT_ON_DEMAND, /* an allocation needed room */
  DMEM__EVICT_AHEAD      /* the spill-ahead thread: use above the high-water mark */
} dmem__evict_reason_t;

/* Spill unlocked buffers (the controller's choice, then by priority and
 * LRU) until `need` bytes were freed or nothing is left. When `contig` is
 * not 0 an allocation of that size needs a contiguous pool range: a victim
 * whose block, with the free ranges beside it, makes such a range is spilled
 * first, alone (one spill that helps rather than several that do not).
 * reason: DMEM__EVICT_ON_DEMAND counts as oom_evictions, DMEM__EVICT_AHEAD
 * as ahead_evictions; DMEM_LOG=info logs one line per pass that spilled
 * something (victims, bytes, reason). *first_error_out (may be NULL): the
 * first error other than BUSY/STALE met on the way. */
dmem_status_t dmem__evict(dmem_runtime_t *rt, size_t need, size_t contig,
                          dmem__evict_reason_t reason, size_t *freed_out,
                          dmem_status_t *first_error_out);
/* A retrieve's offer to trade places (spill/swap.c): an on-demand pass
 * given one takes, instead of spilling it, the first victim it would spill
 * that has `size` bytes, an ordinary pool block and, in `on` mode, no
 * staging of its own (b->host NULL: a victim with staging spills into it,
 * pinning nothing; in pieces mode the swap spills into it), and is not
 * `self`; in pieces mode, only while the host tier has room for it. Taken: b, h and w (the word after the take) are set,
 * the victim's TRANSIT is the caller's (state SPILLING), spills_in_flight
 * is raised for it, and the pass counts its bytes as freed. */
typedef struct dmem__swap {
  size_t size;
  const dmem__buffer_t *self;
  dmem__buffer_t *b;
  dmem_handle_t h;
  uint64_t w;
} dmem__swap_t;
/* dmem__evict(need, contig, DMEM__EVICT_ON_DEMAND) with a swap offer: the
 * pass ends once it has taken the swap's victim. */
dmem_status_t dmem__evict_swap(dmem_runtime_t *rt, size_t need, size_t contig, dmem__swap_t *swap,
                               size_t *freed_out, dmem_status_t *first_error_out);
/* dmem__pressure_alloc(size, stream, DMEM__SRC_POOL) for a retrieve from
 * the host tier: when room must be made, the eviction passes carry the
 * swap offer `sw`. DMEM_OK with *dev_out set: memory was found as usual;
 * DMEM_OK with *dev_out NULL: sw->b was taken instead, and the caller
 * swaps with it (dmem__swap_in) or gives it back (dmem__swap_cancel). */
dmem_status_t dmem__pressure_retrieve(dmem_runtime_t *rt, size_t size, void *stream,
                                      dmem__swap_t *sw, void **dev_out);
/* Trade places (spill/swap.c): r (TRANSIT ours, UNSPILLING from
 * the host tier, its bytes pinned at r->host, size sw->size) takes the
 * device block of sw->b, the victim a pass took (dmem__pressure_retrieve),
 * and the victim's bytes take r's pinned memory, piece by piece through
 * the device bounce buffer on rt->unspill_stream, after `after` (NULL: no
 * wait; r's own spill copy still writing r->host). On success *dev_out is
 * r's device range, its bytes there once rt->unspill_stream reaches its
 * current point; r->host is NULL (r is still charged to the host tier:
 * the caller drops it); the victim is DEFERRED_HOST, charged to the host
 * tier, with SPILL_COPY until its copy is seen complete (spill/staging.c),
 * and its move is over. On failure both are as they were (copies already
 * made are swapped back) and the victim is resident again; statuses:
 * DMEM_ERR_HOST_OUT_OF_MEMORY (the host tier refused the victim's bytes),
 * backend errors. Pieces mode (rt->swap_pieces): the victim's bytes go
 * into pinned memory of their own (its staging, else new) and r keeps
 * r->host (staging once its copy is done, as any retrieve's); a failure
 * while the copies out are enqueued leaves both as they were (HOST OOM:
 * no staging, or the host tier refused), one while the copies in are
 * leaves the victim spilled (DEFERRED_HOST, its copy complete), its block
 * given back, and r as it was. Needs dmem__swap_ready first. */
dmem_status_t dmem__swap_in(dmem_runtime_t *rt, dmem__buffer_t *r,
                            dmem__swap_t *sw, void *after, void **dev_out);
/* Whether retrieves may offer swaps: on (dmem_config_t.retrieve_swap), and
 * the device bounce buffer made (at the first call: when it cannot be,
 * swaps stay off for the runtime); pieces: always (no bounce). Thread-safe. */
bool dmem__swap_ready(dmem_runtime_t *rt);
/* The piece of a pieces swap (rt->swap_piece): 32 MiB, or DMEM_SWAP_PIECE
 * (testing only: a power of two from 64K to 1G, with an optional K or M;
 * anything else: the default). Read once, at runtime create. */
size_t dmem__swap_piece_size(void);
/* Give a taken swap victim back unswapped: resident again, its move over. */
void dmem__swap_cancel(dmem_runtime_t *rt, dmem__swap_t *sw);
/* Device memory for size bytes in stream order on `stream`, spilling (and
 * waiting for moves and stream releases in flight, up to a deadline) when
 * memory runs short: a block of source `src` (memory/memory.h: a pool
 * block, a dedicated block). *ordered_out as for dmem__device_alloc (may be
 * NULL; never set for a dedicated block). DMEM_ERR_OUT_OF_MEMORY when
 * nothing more can be freed. */
dmem_status_t dmem__pressure_alloc(dmem_runtime_t *rt, size_t size, void *stream,
                                   dmem__devsrc_t src, void **dev_out, bool *ordered_out);
/* The same for a stable buffer's range `va` (memory/stable.c): physical
 * memory mapped there, making room as above. */
dmem_status_t dmem__pressure_map(dmem_runtime_t *rt, void *va, void *stream);
/* A new stable buffer's range, reserved and mapped (dmem_buffer_alloc with
 * DMEM_BUFFER_STABLE_ADDRESS); nothing is left reserved on failure. */
dmem_status_t dmem__pressure_stable_alloc(dmem_runtime_t *rt, size_t size, void **va_out);
/* Complete what finished in the background: stream releases, staging. */
void dmem__spill_poll(dmem_runtime_t *rt);
/* A spill from the device (one buffer, or one batch) is over: its device
 * ranges are back in the pool, or it was undone and its victims are
 * spillable again. Count it done, then lower spills_in_flight (release;
 * partner: make_room's acquire loads). */
static inline void dmem__move_finished(dmem_runtime_t *rt) {
  dmem_atomic_add_relaxed(&rt->moves_done, 1);
  dmem_atomic_sub_acq_rel(&rt->spills_in_flight, 1);
}

/* ---- the stream records' lock and lookup (inline: the launch and release
 * paths; the rest is in pending.c) ------------------------------------------------ */

static inline uintptr_t dmem__sreg_key(void *stream) { return (uintptr_t)stream + 1; }

/* The record's spin lock (rank stream). Held for a few loads and stores on
 * the launch and release paths, for an event record, an allocation and
 * pending_mu at most: a waiter spins a little, then yields
 * (dmem__sreg_spin, pending.c). */
void dmem__sreg_spin(dmem__sreg_t *s);
static inline void dmem__sreg_take(dmem__sreg_t *s) {
#ifdef DMEM_DEBUG
  if (dmem__held_ranks >> DMEM__RANK_STREAM) {
    fprintf(stderr, "dmem: lock order violated: taking rank %d while holding ranks 0x%x\n",
            (int)DMEM__RANK_STREAM, dmem__held_ranks);
    abort();
  }
#endif
  DMEM_SCHED_POINT(); /* the schedule fuzzer may yield here (base/sched.h) */
  /* acquire: what the last holder wrote before its release store */
  if (__builtin_expect(dmem_atomic_exchange_acq_rel(&s->lk, 1u) != 0, 0)) dmem__sreg_spin(s);
#ifdef DMEM_DEBUG
  dmem__held_ranks |= 1u << DMEM__RANK_STREAM;
#endif
}

static inline void dmem__sreg_unlock(dmem__sreg_t *s) {
#ifdef DMEM_DEBUG
  DMEM_ASSERT(dmem__held_ranks & (1u << DMEM__RANK_STREAM));
  dmem__held_ranks &= ~(1u << DMEM__RANK_STREAM);
#endif
  dmem_atomic_store_release(&s->lk, 0u); /* partner: dmem__sreg_take's exchange */
  DMEM_SCHED_POINT();
}

static inline dmem__sreg_t *dmem__sreg_lock(dmem_runtime_t *rt, void *stream) {
  uintptr_t key = dmem__sreg_key(stream);
  size_t n = dmem_atomic_load_acquire(&rt->nsreg); /* partner: the claim's release */
  for (size_t i = 0; i < n; i++) {
    dmem__sreg_t *s = &rt->sreg[i];
    /* acquire, partner: the claim's release store of the key */
    if (dmem_atomic_load_acquire(&s->key) != key) continue;
    dmem__sreg_take(s);
    /* given back (and maybe claimed for another stream) since the look */
    if (__builtin_expect(dmem_atomic_load_relaxed(&s->key) == key, 1)) return s;
    dmem__sreg_unlock(s);
    return NULL;
  }
  return NULL;
}

static inline bool dmem__sreg_append(dmem__sreg_t *s, const dmem__reg_entry_t *e, size_t n) {
  if (__builtin_expect(s->n + n > s->cap, 0) && !dmem__sreg_grow(s, n)) return false;
  if (n == 1)
    s->v[s->n] = e[0];
  else if (n > 1)
    memcpy(s->v + s->n, e, n * sizeof *e);
  s->n += n;
  return true;
}

static inline bool dmem__pending_join(dmem_runtime_t *rt, dmem__sreg_t *s) {
  if (s->n == s->g) return true; /* nothing registered since the last release */
  unsigned r = s->releases + 1;
  if (s->g == 0 || r >= rt->release_group || r % DMEM__RELEASE_AGE_EVERY == 0 ||
      s->n >= DMEM__RELEASE_MAX_ENTRIES)
    return false;
  s->g = s->n;
  s->releases = r;
  return true;
}

#endif /* DMEM_SPILL_LAYER_H */
