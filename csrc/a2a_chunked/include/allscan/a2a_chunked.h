/*
 * allscan: chunked all-to-all for Ulysses sequence parallelism (C API).
 *
 * Ranks 0..P-1 of an NCCL communicator, in communicator-rank order. Rank p holds shard p of the
 * sequence of tensors laid out [B, S_local, H, D] (contiguous, S_local the same on every rank).
 * Every tensor of a call comes with a head map: for each rank r a range of heads
 * [head_lo[r], head_hi[r]) of [0, H). The ranges of different ranks may be empty, uneven, and (for
 * grouped-query attention's replicated k/v heads) may overlap.
 *
 *   scatter-heads: input  [B, S_local, H, D]           (sequence shard `rank`, all heads)
 *                  output [B, P*S_local, n_rank, D]     (whole sequence, heads [lo[rank], hi[rank]))
 *                  output[b, p*S_local + s, j, :] = input_of_rank_p[b, s, lo[rank] + j, :]
 *
 *   gather-heads:  input  [B, P*S_local, n_rank, D]     (whole sequence, this rank's heads)
 *                  output [B, S_local, H, D]            (sequence shard `rank`)
 *                  output[b, s, h, :] = sum over ranks r with lo[r] <= h < hi[r] of
 *                                       input_of_rank_r[b, rank*S_local + s, h - lo[r], :]
 *                  (one term when the ranges are disjoint: then gather is the exact inverse of
 *                  scatter; with overlapping ranges it is scatter's adjoint, i.e. its backward).
 *                  Heads no rank holds are left untouched. With `accumulate` the result is added
 *                  to what the output holds (sums in fp32, fp64 for fp64).
 *
 * Up to ALLSCAN_A2A_MAX_TENSORS tensors (q, k and v of one head chunk) are moved in one call: one
 * fused pack kernel, one NCCL group (ncclGroupStart/End of send/recv pairs), one fused unpack kernel.
 * Pieces that are already contiguous in the source (gather with B == 1) are sent from the source,
 * pieces whose destination is contiguous (scatter with B == 1) are received in place; this rank's
 * own piece is copied inside the pack kernel. No host synchronisation, no allocation: the caller
 * gives a device workspace of allscanA2AWorkspaceSize() bytes. Safe to capture in a CUDA graph.
 *
 * All ranks must make the same calls with the same B, S_local, D, dtype, H and head maps (NCCL would
 * hang otherwise; the Python layer checks this across ranks). With `signature` and `check_comm` set,
 * each rank sends the signature to every peer ahead of its data and one kernel after the call
 * compares what arrived: on a difference every output of the call is NaN and the communicator
 * wrapper's status (allscanCommStatus) turns to allscanMismatch, as for the scan.
 * No libtorch here: raw device pointers, cudaStream_t and ncclComm_t.
 */
#ifndef ALLSCAN_A2A_CHUNKED_H_
#define ALLSCAN_A2A_CHUNKED_H_

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include <allscan/common.h> /* allscanResult_t, allscanDataType_t, ALLSCAN_API */

#ifdef __cplusplus
extern "C" {
#endif

#define ALLSCAN_A2A_MAX_TENSORS 4
#define ALLSCAN_A2A_MAX_RANKS 4096

typedef enum {
  allscanA2AScatterHeads = 0, /* sequence-sharded, all heads -> whole sequence, this rank's heads */
  allscanA2AGatherHeads = 1,  /* the inverse (adjoint with overlapping head maps) */
} allscanA2ADirection_t;

typedef struct {
  const void* input;   /* device pointer, layout above (may be NULL for size queries) */
  void* output;        /* device pointer, must not overlap input */
  int num_heads;       /* H of the sequence-sharded layout */
  const int* head_lo;  /* host array [nranks]: rank r holds heads [head_lo[r], head_hi[r]) */
  const int* head_hi;  /* host array [nranks]; hi == lo is an empty range */
  int accumulate;      /* gather only: output += result instead of output = result */
} allscanA2ATensor_t;

/* One call's arguments. Zero-initialise and fill in. */
typedef struct {
  int batch;                 /* B >= 1 */
  int seq_local;             /* S_local >= 0 (0: nothing moves) */
  int head_dim;              /* D >= 1 */
  allscanDataType_t dtype;   /* storage dtype of every tensor of the call */
  int num_tensors;           /* 1..ALLSCAN_A2A_MAX_TENSORS */
  allscanA2ATensor_t tensors[ALLSCAN_A2A_MAX_TENSORS];
  cudaEvent_t done_event;    /* optional: recorded on the stream once the call's work is enqueued */
  struct allscanComm* check_comm; /* optional: the allscan communicator (allscanCommCreate on the same
                                 NCCL communicator) whose signature table the check uses; when
                                 set, a failure given to it (allscanCommFail) is returned first */
  unsigned long long signature;   /* 0 (no check) or a hash of the arguments, equal on every rank
                                 (allscanScanArgs_t.signature); needs check_comm; adds nranks * 8
                                 bytes to the workspace */
} allscanA2AArgs_t;

/* The message of the last error of an allscan call on this thread (names the argument); the same
 * as allscanGetLastError. */
ALLSCAN_API const char* allscanA2AGetLastError(void);

/* The uneven split of heads [h0, h1) over nranks: rank r gets (h1-h0)/nranks heads, the first
 * (h1-h0)%nranks ranks one more, in rank order. Fills head_lo/head_hi [nranks]. */
ALLSCAN_API allscanResult_t allscanA2ASplitHeads(int h0, int h1, int nranks, int* head_lo, int* head_hi);

/* Grouped-query attention: the k/v heads each rank needs for its query heads, query head h using
 * k/v head h / q_per_kv. An empty query range gives an empty k/v range. Ranks share (replicate) a
 * k/v head when their query heads use the same one. */
ALLSCAN_API allscanResult_t allscanA2AKvHeads(int nranks, const int* q_lo, const int* q_hi, int q_per_kv,
                                  int* kv_lo, int* kv_hi);

/* Check the arguments without running anything (no GPU, no NCCL needed). */
ALLSCAN_API allscanResult_t allscanA2ACheckArgs(int nranks, int rank, allscanA2ADirection_t direction,
                                    const allscanA2AArgs_t* args);

/* Bytes of device workspace one call with these arguments needs (0 is possible). */
ALLSCAN_API allscanResult_t allscanA2AWorkspaceSize(int nranks, int rank, allscanA2ADirection_t direction,
                                        const allscanA2AArgs_t* args, size_t* bytes);

/* The chunked all-to-all. Enqueued on `stream`; collective over `comm`. The workspace must be 256-byte
 * aligned and not in use by other work that may run concurrently. */
ALLSCAN_API allscanResult_t allscanA2A(ncclComm_t comm, allscanA2ADirection_t direction, const allscanA2AArgs_t* args,
                           void* workspace, size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ALLSCAN_A2A_CHUNKED_H_ */
