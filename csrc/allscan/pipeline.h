// The pipelined and serial schedules' two steps on NCCL, shared by every scan flavour (internal):
// the chain head sends every block in one group call, and every other rank relays block by block.
// What a block is and how it is combined is the flavour's; the NCCL calls and their order are here.
#pragma once

#include <nccl.h>

#include <cstddef>
#include <string>

#include "comm.h"
#include "common/error.h"
#include "head_result.h"
#include "common/signature.h"

namespace allscan {
namespace detail {

// The chain head: send(i, nc, next) (block i's ncclSend to rank `next` on `nc`) for the blocks
// i < n, all in one group call (in order on the same peer connection, so the successor receives
// block 0 first and starts on it while the rest is in flight), with the head's own result `own`
// written beside it. With a signature (signature.h) it goes ahead of block 0.
template <typename SendBlock>
allscanResult_t headSend(const allscanComm* comm, int reverse, size_t n, HeadResult& own, const SigSlots& sig,
                         SendBlock send, cudaStream_t stream) {
  ncclComm_t nc = comm->nccl;
  const int next = chainPos(comm, reverse).next;
  ALLSCAN_CHECK(own.fork());
  ncclResult_t nr = ncclGroupStart();
  if (sig.on() && nr == ncclSuccess) nr = ncclSend(sig.send, 1, ncclUint64, next, nc, stream);
  for (size_t i = 0; i < n && nr == ncclSuccess; ++i) nr = send(i, nc, next);
  if (nr == ncclSuccess) nr = own.inGroup(nc);
  ncclResult_t ne = ncclSettle(nc, ncclGroupEnd());
  if (nr == ncclSuccess) nr = ne;
  allscanResult_t st = allscanSuccess;
  if (nr != ncclSuccess) st = setError(ncclFailure(nr), std::string("ncclSend (chain head): ") + ncclGetErrorString(nr));
  ALLSCAN_CHECK(own.join());
  if (st != allscanSuccess) return st;
  return own.inSeries();
}

// Block i of a buffer as NCCL moves it: where it starts and its element count.
struct BlockRef {
  void* p;
  size_t count;
};

// Inner and tail ranks: receive block i (into recvAt(i)) while sending block i-1 on (from
// sendAt(i-1); only when the rank has a successor), one group call a block, then combine(i) (what
// the rank does with a received block, if anything); the last block is sent on after the loop.
// With a signature, the first group also sends this rank's on and receives the predecessor's, each
// ahead of block 0 on its connection.
template <typename SendAt, typename RecvAt, typename Combine>
allscanResult_t relayBlocks(const allscanComm* comm, int reverse, size_t n, ncclDataType_t nt, const SigSlots& sig,
                            SendAt sendAt, RecvAt recvAt, Combine combine, cudaStream_t stream) {
  const ChainPos pos = chainPos(comm, reverse);
  ncclComm_t nc = comm->nccl;
  for (size_t i = 0; i < n; ++i) {
    ALLSCAN_NCCL_CHECK(nc, ncclGroupStart());
    if (i == 0 && sig.on()) {
      if (pos.has_next) ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclSend(sig.send, 1, ncclUint64, pos.next, nc, stream));
      ALLSCAN_NCCL_CHECK_IN_GROUP(
          nc, ncclRecv(const_cast<unsigned long long*>(sig.check.recv), 1, ncclUint64, pos.prev, nc, stream));
    }
    if (pos.has_next && i > 0) {
      const BlockRef s = sendAt(i - 1);
      ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclSend(s.p, s.count, nt, pos.next, nc, stream));
    }
    const BlockRef r = recvAt(i);
    ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclRecv(r.p, r.count, nt, pos.prev, nc, stream));
    ALLSCAN_NCCL_CHECK(nc, ncclGroupEnd());
    ALLSCAN_CHECK(combine(i));
  }
  if (pos.has_next) {
    const BlockRef s = sendAt(n - 1);
    ALLSCAN_NCCL_CHECK(nc, ncclGroupStart());
    ALLSCAN_NCCL_CHECK_IN_GROUP(nc, ncclSend(s.p, s.count, nt, pos.next, nc, stream));
    ALLSCAN_NCCL_CHECK(nc, ncclGroupEnd());
  }
  return allscanSuccess;
}

}  // namespace detail
}  // namespace allscan
