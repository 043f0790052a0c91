/*
 * allscan: the All-Scan collective on NCCL (C API).
 *
 * Ranks 0..P-1 of an NCCL communicator, in communicator-rank order. Rank p holds a state x_p of
 * `count` elements and an optional decay g_p of `g_count` elements, where g_count divides count and
 * g_p is broadcast over the trailing count/g_count elements (a prefix shape of the state).
 *
 *   forward:  y_0     = init (zeros when init == NULL)   y_{p+1} = g_p * y_p + x_p
 *   reverse:  y_{P-1} = init (zeros when init == NULL)   y_{p-1} = g_p * y_p + x_p
 *
 * With no init the head of the chain sends x_p itself (y = 0, so g_p does not enter). A decay of
 * exactly zero reads an inf or NaN y_p as 0 (IEEE's 0 * inf is NaN): the result is x_p there, so a
 * non-finite state does not cross a reset such as a packed sequence's start.
 * The exclusive result on rank p is y_p (the state entering p); the inclusive one is g_p*y_p + x_p.
 * Arithmetic is fp32 (fp64 for fp64 states), written as a separate multiply and add (no FMA
 * contraction) and rounded to the storage dtype at every rank boundary, in every method, so every
 * method and the Python reference give bitwise the same answer.
 *
 * Everything is enqueued on the caller's stream: no host synchronisation, no allocation; safe to
 * capture in a CUDA graph. The caller provides a device workspace of allscanWorkspaceSize() bytes.
 * All ranks must call with the same count, g_count, dtypes, flags, method and block count
 * (NCCL would hang otherwise; the Python layer checks this across ranks). Like NCCL, one host
 * thread at a time per communicator.
 *
 * No libtorch here: raw device pointers, element counts, cudaStream_t and ncclComm_t.
 */
#ifndef ALLSCAN_ALLSCAN_H_
#define ALLSCAN_ALLSCAN_H_

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>
#include <nccl.h>

#include <allscan/common.h> /* allscanResult_t, allscanDataType_t, ALLSCAN_API, allscanGetLastError */

#ifdef __cplusplus
extern "C" {
#endif

#define ALLSCAN_VERSION_MAJOR 0
#define ALLSCAN_VERSION_MINOR 1
#define ALLSCAN_VERSION_PATCH 0

typedef enum {
  /* receive block k, combine it with one fused kernel, send it on while receiving block k+1 */
  allscanPipelined = 0,
  /* LASP-1 pattern: receive the whole state, combine, send the whole state */
  allscanSerial = 1,
  /* LASP-2 pattern: all-gather every rank's state and decay, combine locally */
  allscanAllGather = 2,
  /* device-initiated (diagonal scans only): one kernel per rank reads the incoming state from its
     NCCL window and stores its result straight into the next rank's window over NVLink (NCCL's
     device API, LSA pointers); where every rank is not load/store accessible, or the loaded NCCL
     is not the one compiled against, or ALLSCAN_DEVICE_PATH=off: allscanPipelined
     (allscanDevicePath says which and why). num_blocks is its CTA count (0: one per 64 KiB, at
     most 128). The first call, and one with a larger state than any before, is collective and
     synchronising (it registers the window): make it eagerly before capturing a graph. A
     neighbour that never publishes fails the call after ALLSCAN_DEVICE_TIMEOUT_S (default 600)
     seconds with allscanTimeout on a later call. */
  allscanDevice = 3,
} allscanMethod_t;

/* One call's arguments. Zero-initialise and fill in; unused pointers stay NULL. */
typedef struct {
  const void* x;              /* [count] local state, storage dtype `dtype` */
  void* y;                    /* [count] result, same dtype; may not alias x */
  size_t count;               /* elements of the state (0 is allowed: nothing is sent) */
  allscanDataType_t dtype;    /* storage dtype of x, y, init */
  const void* g;              /* [g_count] decay, or NULL for 1 (plain prefix sum) */
  size_t g_count;             /* must divide count; ignored when g == NULL */
  allscanDataType_t g_dtype;  /* allscanFloat32 or the state's dtype */
  const void* init;           /* [count] initial state, read on the chain head only (the all-gather
                                 method broadcasts it from there), or NULL for zeros; non-NULL on
                                 every rank or on none */
  int reverse;                /* 0: rank p-1 -> p; 1: rank p+1 -> p */
  int inclusive;              /* 0: y_p; 1: g_p*y_p + x_p */
  int num_blocks;             /* pipeline blocks K (at most allscanMaxBlocks are used); 0 = choose
                                 from the link model */
  allscanMethod_t method;
  unsigned long long signature; /* 0, or a hash of every argument that must agree across ranks: the
                                 pipelined and serial methods send it ahead of the first block and a
                                 receiver whose predecessor sent another writes NaN over its results
                                 and fails later calls with allscanMismatch (see allscanCommStatus) */
} allscanScanArgs_t;

/* A communicator wrapper: the NCCL communicator (borrowed, never destroyed here), its rank and
 * size, and the link model used to choose the block count. */
typedef struct allscanComm* allscanComm_t;

ALLSCAN_API int allscanGetVersion(void); /* major*10000 + minor*100 + patch */

ALLSCAN_API allscanResult_t allscanCommCreate(ncclComm_t nccl, allscanComm_t* comm);
/* Build a communicator with an explicit rank/size and no NCCL (for choosing blocks, workspace
 * sizes and argument checks without a GPU). Calls that need NCCL fail on it. */
ALLSCAN_API allscanResult_t allscanCommCreateDetached(int rank, int nranks, allscanComm_t* comm);
ALLSCAN_API allscanResult_t allscanCommDestroy(allscanComm_t comm);
/* The NCCL communicator is gone (aborted or destroyed): allscanCommDestroy then frees what allscan
 * holds without calling NCCL (the device path's windows went with it). */
ALLSCAN_API allscanResult_t allscanCommForgetNccl(allscanComm_t comm);
/* Every later call on `comm` that needs NCCL returns `code` (allscanTimeout, allscanMismatch or
 * allscanRemoteError) with `reason` in allscanGetLastError: for a communicator whose NCCL
 * communicator failed, so that calls made with it still report why once its watch is destroyed
 * (allscanWatchCreate says when it must be). The first failure stays. Fail it before destroying the
 * watch; when the NCCL communicator is gone, also allscanCommForgetNccl (this call leaves it). */
ALLSCAN_API allscanResult_t allscanCommFail(allscanComm_t comm, allscanResult_t code, const char* reason);
ALLSCAN_API allscanResult_t allscanCommRank(allscanComm_t comm, int* rank);
ALLSCAN_API allscanResult_t allscanCommSize(allscanComm_t comm, int* nranks);
/* allscanSuccess; the failure given to allscanCommFail; or allscanMismatch (message in
 * allscanGetLastError) once a call on this rank received another signature than its own
 * (allscanScanArgs_t.signature); every later scan on the communicator fails the same way. A host
 * read, no synchronisation. */
ALLSCAN_API allscanResult_t allscanCommStatus(allscanComm_t comm);

/* The link model: one message of n bytes between neighbours costs latency_us + n * us_per_byte.
 * Default: none set (auto block count is 1 until a model is set or calibrated). */
ALLSCAN_API allscanResult_t allscanSetLinkModel(allscanComm_t comm, double latency_us, double us_per_byte);
ALLSCAN_API allscanResult_t allscanGetLinkModel(allscanComm_t comm, double* latency_us, double* us_per_byte, int* is_set);
/* Collective and synchronising (setup only, not for the hot path nor under capture): time
 * neighbour send/recv at two sizes on `stream`, fit the model, take the max over ranks so every
 * rank picks the same block count, and set it. */
ALLSCAN_API allscanResult_t allscanCalibrate(allscanComm_t comm, cudaStream_t stream);

/* The block count the pipelined method uses for a state of `bytes` bytes at this communicator's
 * size: the K minimising (P - 2 + K) * (latency + bytes/K * us_per_byte) (see DESIGN.md), at
 * least 1, at most allscanMaxBlocks, and no more than bytes/allscanMinBlockBytes. */
ALLSCAN_API allscanResult_t allscanChooseNumBlocks(allscanComm_t comm, size_t bytes, int* num_blocks);
/* The same rule for any (P, model), so other runtimes (the torch.distributed path) share it. */
ALLSCAN_API int allscanChooseNumBlocksModel(int nranks, size_t bytes, double latency_us, double us_per_byte);

#define allscanMaxBlocks 64
#define allscanMinBlockBytes 4096

/* Bytes of device workspace one call with these arguments needs on this rank (it depends on the
 * rank's place in the chain: e.g. the tail of an exclusive pipelined scan receives straight into y
 * and needs 0). */
ALLSCAN_API allscanResult_t allscanWorkspaceSize(allscanComm_t comm, const allscanScanArgs_t* args, size_t* bytes);
/* Check the arguments without running anything (also works on a detached communicator). */
ALLSCAN_API allscanResult_t allscanCheckArgs(allscanComm_t comm, const allscanScanArgs_t* args);

/* The All-Scan. Enqueued on `stream`; collective over the communicator.
 * The chain head's own result (zeros, init, or x for an inclusive scan without init) is written in
 * the same NCCL group call as its send, as a send/recv to itself, for states up to 8 MiB, so the
 * head runs one kernel as the bare send does; above, by a few CTAs on a side stream beside the send
 * (in series after it when its buffers are not 16-byte aligned). Zeros come from a zeroed buffer
 * the communicator allocates (8 MiB, or the state's size when larger) on the
 * first call that needs it: one cudaMalloc and one synchronisation of `stream`, never under stream
 * capture (a call captured before it exists takes the side path). A CUDA graph holding a scan must
 * not outlive the communicator (as with NCCL's). Environment, read by allscanCommCreate (a value
 * that does not parse fails it with allscanInvalidArgument naming the variable):
 * ALLSCAN_HEAD_FILL=auto|self|side|series, ALLSCAN_SELF_FILL_MAX_BYTES (auto's switch, default
 * 8388608, at most 1 GiB), ALLSCAN_FILL_CTAS (the side fill's CTAs, default 8; 0 = in series). */
ALLSCAN_API allscanResult_t allscanScan(allscanComm_t comm, const allscanScanArgs_t* args, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream);

/* Whether allscanDevice runs device-initiated on this communicator: *state 1 (yes), 0 (not tried
 * yet: no allscanDevice call so far), -1 (no: it falls back to allscanPipelined, *reason says why;
 * "" otherwise). A host read. */
ALLSCAN_API allscanResult_t allscanDevicePath(allscanComm_t comm, int* state, const char** reason);

/* The device path's floor: allscanNeighborExchange's transfers done as allscanDevice does them
 * (stores into the neighbour's window and a flag per 64 KiB, `num_ctas` CTAs, 0: as the scan
 * chooses), no combine. Collective; allscanInvalidArgument when the path is not available. */
ALLSCAN_API allscanResult_t allscanDeviceNeighborExchange(allscanComm_t comm, const void* sendbuf, void* recvbuf,
                                              size_t bytes, int reverse, int chain, int num_ctas,
                                              cudaStream_t stream);

/* The floor the benchmarks compare with: every rank sends `bytes` to its successor and receives as
 * many from its predecessor (a ring shift; `reverse` flips it), one NCCL group call. With
 * `chain` != 0 the ring is cut at the ends (rank P-1 sends nothing, rank 0 receives nothing), which
 * is the set of transfers one All-Scan makes (and the halo exchange of the layers' short
 * convolutions). Watched like a scan, and like a scan it returns the communicator's failure or a
 * signature mismatch a scan's kernels found, without sending. */
ALLSCAN_API allscanResult_t allscanNeighborExchange(allscanComm_t comm, const void* sendbuf, void* recvbuf,
                                        size_t bytes, int reverse, int chain, cudaStream_t stream);

/* ------------------------------------------------------------------------------------------------
 * The matrix-transition All-Scan (delta-rule layers: Gated DeltaNet, KDA). Rank p holds a state
 * x_p [batch, k, v] and a transition M_p [batch, k, k] (row-major; one per batch entry):
 *
 *   forward:  y_0     = init (zeros when init == NULL)   y_{p+1} = M_p @ y_p + x_p
 *   reverse:  y_{P-1} = init (zeros when init == NULL)   y_{p-1} = M_p @ y_p + x_p
 *
 * exclusive: y_p; inclusive: M_p @ y_p + x_p. With no init the head sends x_p itself. A row of M_p
 * (of M_p^T with transpose_m) that is all zeros takes nothing from y_p: that row of the result is
 * x_p's even where y_p is inf or NaN, as a zero decay in allscanScan. Arithmetic is
 * fp32 FFMA (fp64 for fp64 states), rounded to the storage dtype at every rank boundary. Unlike the
 * diagonal scan the methods are not bitwise equal to each other (a GEMM's summation order is its
 * own), but each matches a float64 chain to the accuracy of fp32 dot products. Same rules as
 * allscanScan otherwise: caller's stream, caller's workspace, no host synchronisation (except the
 * head's zero buffer, allocated once, as allscanScan's), capturable, same arguments on every rank.
 * Pipeline blocks: whole batch entries while there are at least as many as blocks (contiguous);
 * more blocks split the v columns of every entry, staged through the workspace.
 * ------------------------------------------------------------------------------------------------ */
typedef struct {
  const void* x;              /* [batch, k, v] local state, storage dtype `dtype` */
  void* y;                    /* [batch, k, v] result; may not alias x, m or init */
  size_t batch;               /* leading dims flattened (0 is allowed: nothing is sent) */
  size_t k;                   /* rows of the state = order of the transition */
  size_t v;                   /* columns of the state */
  allscanDataType_t dtype;    /* storage dtype of x, y, init */
  const void* m;              /* [batch, k, k] transition, never NULL for a non-empty state */
  allscanDataType_t m_dtype;  /* allscanFloat32 or the state's dtype */
  int transpose_m;            /* 1: use M_p^T (the backward) without materialising it */
  const void* init;           /* [batch, k, v] initial state, read on the chain head only, or NULL */
  int reverse;                /* 0: rank p-1 -> p; 1: rank p+1 -> p */
  int inclusive;              /* 0: y_p; 1: M_p @ y_p + x_p */
  int num_blocks;             /* pipeline blocks (0 = from the link model, as allscanScan) */
  allscanMethod_t method;     /* pipelined, serial, or allgather (all-gather x and M, fold locally) */
  unsigned long long signature; /* as allscanScanArgs_t.signature */
} allscanMatrixScanArgs_t;

/* The pipeline's blocks for a requested block count (every rank computes the same): the number of
 * blocks and the v columns per block (v when blocks are whole batch entries). */
ALLSCAN_API allscanResult_t allscanMatrixBlocks(size_t batch, size_t k, size_t v, int num_blocks, int* blocks,
                                                size_t* cols_per_block);
ALLSCAN_API allscanResult_t allscanMatrixCheckArgs(allscanComm_t comm, const allscanMatrixScanArgs_t* args);
ALLSCAN_API allscanResult_t allscanMatrixWorkspaceSize(allscanComm_t comm, const allscanMatrixScanArgs_t* args,
                                                       size_t* bytes);
ALLSCAN_API allscanResult_t allscanMatrixScan(allscanComm_t comm, const allscanMatrixScanArgs_t* args,
                                              void* workspace, size_t workspace_bytes, cudaStream_t stream);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* ALLSCAN_ALLSCAN_H_ */
