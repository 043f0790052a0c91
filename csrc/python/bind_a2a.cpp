// Python bindings of the chunked all-to-all (csrc/a2a_chunked): integers in (device pointers,
// cudaStream_t, ncclComm_t, cudaEvent_t), errors out as exceptions. No libtorch.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <allscan/a2a_chunked.h>

#include "python/check.h"

#include <string>
#include <tuple>
#include <vector>

namespace py = pybind11;

namespace {

using allscan_py::check;

// One tensor: (input_ptr, output_ptr, num_heads, head_lo, head_hi, accumulate)
using TensorSpec = std::tuple<uintptr_t, uintptr_t, int, std::vector<int>, std::vector<int>, int>;

struct Built {
  allscanA2AArgs_t args;
  std::vector<std::vector<int>> keep;  // owns the head arrays the args point to
};

Built build(int nranks, int batch, int seq_local, int head_dim, int dtype, const std::vector<TensorSpec>& tensors) {
  if (tensors.empty() || tensors.size() > ALLSCAN_A2A_MAX_TENSORS)
    throw py::value_error("allscan a2a: between 1 and " + std::to_string(ALLSCAN_A2A_MAX_TENSORS) +
                          " tensors per call, got " + std::to_string(tensors.size()));
  Built b{};
  b.args.batch = batch;
  b.args.seq_local = seq_local;
  b.args.head_dim = head_dim;
  b.args.dtype = static_cast<allscanDataType_t>(dtype);
  b.args.num_tensors = static_cast<int>(tensors.size());
  b.keep.reserve(2 * tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) {
    const auto& [in, out, heads, lo, hi, acc] = tensors[t];
    if (static_cast<int>(lo.size()) != nranks || static_cast<int>(hi.size()) != nranks)
      throw py::value_error("allscan a2a: tensor " + std::to_string(t) + " head_lo/head_hi must have one entry per rank (" +
                            std::to_string(nranks) + "), got " + std::to_string(lo.size()) + "/" +
                            std::to_string(hi.size()));
    b.keep.push_back(lo);
    b.keep.push_back(hi);
    allscanA2ATensor_t& x = b.args.tensors[t];
    x.input = reinterpret_cast<const void*>(in);
    x.output = reinterpret_cast<void*>(out);
    x.num_heads = heads;
    x.head_lo = b.keep[2 * t].data();
    x.head_hi = b.keep[2 * t + 1].data();
    x.accumulate = acc;
  }
  return b;
}

}  // namespace

void bindA2A(py::module_& m) {
  m.def(
      "a2a_split_heads",
      [](int h0, int h1, int nranks) {
        std::vector<int> lo(nranks > 0 ? nranks : 0), hi(lo.size());
        check(allscanA2ASplitHeads(h0, h1, nranks, lo.data(), hi.data()));
        return std::make_pair(lo, hi);
      },
      py::arg("h0"), py::arg("h1"), py::arg("nranks"),
      "Uneven split of heads [h0, h1) over nranks -> (head_lo, head_hi).");
  m.def(
      "a2a_kv_heads",
      [](const std::vector<int>& q_lo, const std::vector<int>& q_hi, int q_per_kv) {
        if (q_lo.size() != q_hi.size()) throw py::value_error("a2a_kv_heads: q_lo and q_hi differ in length");
        std::vector<int> lo(q_lo.size()), hi(q_lo.size());
        check(allscanA2AKvHeads(static_cast<int>(q_lo.size()), q_lo.data(), q_hi.data(), q_per_kv, lo.data(), hi.data()));
        return std::make_pair(lo, hi);
      },
      py::arg("q_lo"), py::arg("q_hi"), py::arg("q_per_kv"));
  m.def(
      "a2a_workspace_size",
      [](int nranks, int rank, int direction, int batch, int seq_local, int head_dim, int dtype,
         const std::vector<TensorSpec>& tensors, uintptr_t check_comm, unsigned long long signature) {
        Built b = build(nranks, batch, seq_local, head_dim, dtype, tensors);
        b.args.check_comm = reinterpret_cast<allscanComm*>(check_comm);
        b.args.signature = signature;
        size_t bytes = 0;
        check(allscanA2AWorkspaceSize(nranks, rank, static_cast<allscanA2ADirection_t>(direction), &b.args, &bytes));
        return bytes;
      },
      py::arg("nranks"), py::arg("rank"), py::arg("direction"), py::arg("batch"), py::arg("seq_local"),
      py::arg("head_dim"), py::arg("dtype"), py::arg("tensors"), py::arg("check_comm") = 0, py::arg("signature") = 0,
      "Workspace bytes of one a2a call; tensors are (input_ptr, output_ptr, num_heads, head_lo, head_hi, accumulate).");
  m.def(
      "a2a_check_args",
      [](int nranks, int rank, int direction, int batch, int seq_local, int head_dim, int dtype,
         const std::vector<TensorSpec>& tensors) {
        Built b = build(nranks, batch, seq_local, head_dim, dtype, tensors);
        check(allscanA2ACheckArgs(nranks, rank, static_cast<allscanA2ADirection_t>(direction), &b.args));
      },
      py::arg("nranks"), py::arg("rank"), py::arg("direction"), py::arg("batch"), py::arg("seq_local"),
      py::arg("head_dim"), py::arg("dtype"), py::arg("tensors"));
  m.def(
      "a2a",
      [](uintptr_t comm, int nranks, int direction, int batch, int seq_local, int head_dim, int dtype,
         const std::vector<TensorSpec>& tensors, uintptr_t workspace, size_t workspace_bytes, uintptr_t stream,
         uintptr_t event, uintptr_t check_comm, unsigned long long signature) {
        Built b = build(nranks, batch, seq_local, head_dim, dtype, tensors);
        b.args.done_event = reinterpret_cast<cudaEvent_t>(event);
        b.args.check_comm = reinterpret_cast<allscanComm*>(check_comm);
        b.args.signature = signature;
        allscanResult_t r;
        {
          py::gil_scoped_release release;
          r = allscanA2A(reinterpret_cast<ncclComm_t>(comm), static_cast<allscanA2ADirection_t>(direction), &b.args,
                         reinterpret_cast<void*>(workspace), workspace_bytes, reinterpret_cast<cudaStream_t>(stream));
        }
        check(r);
      },
      py::arg("comm"), py::arg("nranks"), py::arg("direction"), py::arg("batch"), py::arg("seq_local"),
      py::arg("head_dim"), py::arg("dtype"), py::arg("tensors"), py::arg("workspace"), py::arg("workspace_bytes"),
      py::arg("stream"), py::arg("event") = 0, py::arg("check_comm") = 0, py::arg("signature") = 0,
      "Chunked all-to-all (0: scatter-heads, 1: gather-heads) on an NCCL communicator, enqueued on stream.");
}
