// What the row sets of every All-Scan flavour share (scan.cu, matrix.cu): the options -K, -m, -r and
// -L, the link model that chooses the automatic block count, and how a scan row is labelled in the
// table and the JSON.
#pragma once

#include <getopt.h>

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
};

// -K, -m, -r and -L as OptionSpecs (for a Collective's option list).
inline constexpr OptionSpec kBlocksOption = {
    'K', "blocks", required_argument, "<list>",
    "pipelined block counts: 'auto' or comma-separated integers 1..64;\n"
    "                              the automatic K is always timed (default auto)"};
inline constexpr OptionSpec kMethodsOption = {
    'm', "methods", required_argument, "<list>", "scan methods: pipelined,serial,allgather or all (default all)"};
inline constexpr OptionSpec kReverseOption = {
    'r', "reverse", optional_argument, "0|1", "reverse scan (rank p+1 -> p); -r alone means 1 (default 0)"};
inline constexpr OptionSpec kLinkModelOption = {
    'L', "link_model", required_argument, "<m>",
    "calibrate | none | <latency_us>,<us_per_byte>: the link model\n"
    "                              that chooses the automatic K (default calibrate)"};

// Parses one of -K, -m, -r, -L into *o (throws ArgError naming the flag); false for another letter.
bool parseChainOption(ChainOptions* o, int letter, const char* arg);
// After every option: at least one method.
void validateChainOptions(const ChainOptions& o);

const char* methodName(allscanMethod_t m);  // pipelined, serial, allgather

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

// A scan row's K column (auto:k, the fixed K, or 1 for serial / all-gather) and JSON fields
// ,"method","K" (the block count used),"K_auto".
void labelScanRow(Row* r, allscanMethod_t method, int K, int Kused);

}  // namespace perf
