// What the row sets of every All-Scan flavour share (scan.cu, matrix.cu): the options -K, -m, -r and
// -L, the link model that chooses the automatic block count, the scan rows and how they are
// labelled in the table and the JSON, and the scan rows' workspace.
#pragma once

#include <getopt.h>

#include <algorithm>
#include <string>
#include <vector>

#include "harness.h"

namespace perf {

enum LinkMode { LINK_CALIBRATE = 0, LINK_NONE = 1, LINK_SET = 2 };

struct ChainOptions {
  std::vector<int> fixedK;  // fixed block counts (the automatic one is always timed)
  std::vector<allscanMethod_t> methods = {allscanPipelined, allscanSerial, allscanAllGather};
  int reverse = 0;
  LinkMode link = LINK_CALIBRATE;
  double linkLatencyUs = 0, linkUsPerByte = 0;
  SignatureRows signature;  // -S
};

// -K, -m, -r, -S and -L as OptionSpecs (for a Collective's option list).
inline constexpr OptionSpec kBlocksOption = {
    'K', "blocks", required_argument, "<list>",
    "pipelined block counts: 'auto' or comma-separated integers 1..64;\n"
    "                              the automatic K is always timed (default auto)"};
inline constexpr OptionSpec kMethodsOption = {
    'm', "methods", required_argument, "<list>", "scan methods: pipelined,serial,allgather,device or all\n"
    "                              (default all: the first three; device: -o scan only)"};
inline constexpr OptionSpec kReverseOption = {
    'r', "reverse", optional_argument, "0|1", "reverse scan (rank p+1 -> p); -r alone means 1 (default 0)"};
inline constexpr OptionSpec kLinkModelOption = {
    'L', "link_model", required_argument, "<m>",
    "calibrate | none | <latency_us>,<us_per_byte>: the link model\n"
    "                              that chooses the automatic K (default calibrate)"};

// Parses one of -K, -m, -r, -S, -L into *o (throws ArgError naming the flag); false for another letter.
bool parseChainOption(ChainOptions* o, int letter, const char* arg);
// After every option: at least one method.
void validateChainOptions(const ChainOptions& o);

const char* methodName(allscanMethod_t m);  // pipelined, serial, allgather, device

// The link model the automatic K comes from: set (-L a,b), calibrated (collective), or none.
struct LinkModel {
  double latencyUs = 0, usPerByte = 0;
  int isSet = 0;
};
LinkModel setupLinkModel(allscanComm_t comm, const ChainOptions& o, int nranks, cudaStream_t stream);

// Header lines: "#  methods ... K ..." and "#  link model ...".
std::vector<std::string> chainHeader(const ChainOptions& o, const LinkModel& m);
// JSON: the config fields ,"methods":[...],"fixed_K":[...] and the top-level "link_model" entry.
std::string chainConfigJson(const ChainOptions& o);
std::string linkModelJson(const ChainOptions& o, const LinkModel& m);

// A scan row's K column (auto:Kused, Kused for a fixed K, or 1 for serial / all-gather) and JSON
// fields ,"method","K" (Kused, the block count used),"K_auto". K is the one asked for (0: auto);
// Kused may be fewer where the state splits into fewer blocks (the matrix scan).
void labelScanRow(Row* r, allscanMethod_t method, int K, int Kused);

// The scan rows in table order, every method with the automatic K and (pipelined) every fixed -K:
// kind, method, K, name "<prefix>-<method>" and inSummary (pipelined, automatic K) set.
std::vector<Row> methodRows(const ChainOptions& o, const std::string& prefix, int kind);

// The scan rows' workspace, grown before timing (never inside a timed loop) to the most that the
// rows of `kind` that run at this size need: bytesFor(row).
struct Workspace {
  void* ptr = nullptr;
  size_t bytes = 0;
  template <typename BytesFor> void reserve(const std::vector<Row>& rows, int kind, BytesFor bytesFor) {
    size_t need = 0;
    for (const Row& r : rows)
      if (r.kind == kind && r.skip.empty()) need = std::max(need, static_cast<size_t>(bytesFor(r)));
    grow(need);
  }
  void grow(size_t need);  // reallocates when `need` is more than `bytes`
  void release();
};

// A scan flavour's rows: its communicator with the link model, the state, result and floor buffers
// (allocated by the flavour), its workspace, the header's link lines and the JSON's link model.
class ChainBench : public Bench {
 public:
  ChainBench(RankCtx& ctx, const ChainOptions& o) : Bench(ctx), chain_(o) {}
  std::string topJson() override { return linkModelJson(chain_, link_); }

 protected:
  void setupChain();     // the communicator and its link model (setup, before the buffers)
  void teardownChain();  // frees x_, y_, recv_, the workspace and the communicator (teardown)
  std::vector<std::string> chainHeaderLines() const { return chainHeader(chain_, link_); }
  // What a scan row's arguments have in every flavour: x_, y_, reverse, the block count, the method.
  template <typename Args> void setRowArgs(Args* a, const Row& r) const {
    a->x = x_;
    a->y = y_;
    a->reverse = chain_.reverse;
    a->num_blocks = r.method == allscanPipelined ? r.K : 0;
    a->method = static_cast<allscanMethod_t>(r.method);
    a->signature = r.unsigned_ ? 0 : kPerfSignature;
  }

  const ChainOptions& chain_;
  allscanComm_t comm_ = nullptr;
  LinkModel link_;
  void* x_ = nullptr;     // this rank's state
  void* y_ = nullptr;     // the scan's result
  void* recv_ = nullptr;  // the floor's receive buffer (p2p-chain)
  Workspace ws_;
};

}  // namespace perf
