// What the row sets of every All-Scan flavour share (see chain.h).
#include "chain.h"

#include <getopt.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace perf {

const char* methodName(allscanMethod_t m) {
  switch (m) {
    case allscanPipelined: return "pipelined";
    case allscanSerial: return "serial";
    case allscanAllGather: return "allgather";
    case allscanDevice: return "device";
  }
  return "?";
}

bool parseChainOption(ChainOptions* o, int letter, const char* arg) {
  switch (letter) {
    case 'r':
      o->reverse = arg ? static_cast<int>(parseInt("-r (reverse)", arg, 0, 1, "0 or 1 (write -r, -r0 or -r1)")) : 1;
      return true;
    case 'K': {
      o->fixedK.clear();
      for (const auto& t : splitList(arg)) {
        if (t == "auto") continue;
        o->fixedK.push_back(static_cast<int>(parseInt(
            "-K (blocks)", t.c_str(), 1, allscanMaxBlocks,
            ("'auto' or a block count 1.." + std::to_string(allscanMaxBlocks) + " (comma-separated list allowed)").c_str())));
      }
      return true;
    }
    case 'm': {
      o->methods.clear();
      for (const auto& t : splitList(arg)) {
        if (t == "pipelined") o->methods.push_back(allscanPipelined);
        else if (t == "serial") o->methods.push_back(allscanSerial);
        else if (t == "allgather") o->methods.push_back(allscanAllGather);
        else if (t == "device") o->methods.push_back(allscanDevice);
        else if (t == "all") o->methods = {allscanPipelined, allscanSerial, allscanAllGather};
        else argError("-m (methods): expected a comma-separated list of pipelined, serial, allgather, device (or all: "
                      "the first three), got '" + t + "'");
      }
      std::vector<allscanMethod_t> uniq;
      for (auto m : o->methods)
        if (std::find(uniq.begin(), uniq.end(), m) == uniq.end()) uniq.push_back(m);
      o->methods = uniq;
      return true;
    }
    case 'S':
      parseSignatureRows(&o->signature, arg);
      return true;
    case 'L': {
      std::string s(arg);
      if (s == "calibrate") {
        o->link = LINK_CALIBRATE;
      } else if (s == "none") {
        o->link = LINK_NONE;
      } else {
        auto parts = splitList(s);
        char* e1 = nullptr;
        char* e2 = nullptr;
        double a = parts.size() == 2 ? strtod(parts[0].c_str(), &e1) : -1;
        double b = parts.size() == 2 ? strtod(parts[1].c_str(), &e2) : -1;
        if (parts.size() != 2 || parts[0].empty() || parts[1].empty() || *e1 || *e2 || !(a > 0) || !(b > 0) ||
            !std::isfinite(a) || !std::isfinite(b))
          argError("-L (link_model): expected calibrate, none or <latency_us>,<us_per_byte> (two positive numbers), got '" + s + "'");
        o->link = LINK_SET;
        o->linkLatencyUs = a;
        o->linkUsPerByte = b;
      }
      return true;
    }
  }
  return false;
}

void validateChainOptions(const ChainOptions& o) {
  if (o.methods.empty()) argError("-m (methods): no method selected");
}

LinkModel setupLinkModel(allscanComm_t comm, const ChainOptions& o, int nranks, cudaStream_t stream) {
  if (o.link == LINK_SET) ASCHECK(allscanSetLinkModel(comm, o.linkLatencyUs, o.linkUsPerByte));
  if (o.link == LINK_CALIBRATE && nranks > 1) ASCHECK(allscanCalibrate(comm, stream));
  LinkModel m;
  ASCHECK(allscanGetLinkModel(comm, &m.latencyUs, &m.usPerByte, &m.isSet));
  return m;
}

std::vector<std::string> chainHeader(const ChainOptions& o, const LinkModel& m) {
  std::string ks = "auto";
  for (int k : o.fixedK) ks += "," + std::to_string(k);
  std::string ms;
  for (auto x : o.methods) ms += (ms.empty() ? "" : ",") + std::string(methodName(x));
  std::vector<std::string> lines = {"#  methods " + ms + "  K " + ks + "  signature " + o.signature.label()};
  char buf[256];
  if (m.isSet)
    snprintf(buf, sizeof(buf), "#  link model (%s): latency %.3f us, %.6g us/byte (%.1f GB/s)",
             o.link == LINK_SET ? "-L" : "calibrated", m.latencyUs, m.usPerByte, 1e-3 / m.usPerByte);
  else
    snprintf(buf, sizeof(buf), "#  link model: none (the automatic K is 1)");
  lines.push_back(buf);
  return lines;
}

std::string chainConfigJson(const ChainOptions& o) {
  std::string ks;
  for (int k : o.fixedK) ks += (ks.empty() ? "" : ",") + std::to_string(k);
  std::string ms;
  for (auto m : o.methods) ms += std::string(ms.empty() ? "" : ",") + "\"" + methodName(m) + "\"";
  return ",\"methods\":[" + ms + "],\"fixed_K\":[" + ks + "],\"signature\":\"" + o.signature.label() + "\"";
}

std::string linkModelJson(const ChainOptions& o, const LinkModel& m) {
  const char* source = o.link == LINK_SET ? "-L" : (o.link == LINK_CALIBRATE ? "calibrate" : "none");
  return std::string("\"link_model\":{\"set\":") + (m.isSet ? "true" : "false") + ",\"source\":\"" + source +
         "\",\"latency_us\":" + jsonNumber(m.latencyUs) + ",\"us_per_byte\":" + jsonNumber(m.usPerByte) + "},\n";
}

void labelScanRow(Row* r, allscanMethod_t method, int K, int Kused) {
  if (method != allscanPipelined) r->kLabel = "1";
  else if (K == 0) r->kLabel = "auto:" + std::to_string(Kused);
  else r->kLabel = std::to_string(Kused);
  r->jsonFields = ",\"method\":\"" + std::string(methodName(method)) + "\",\"K\":" + std::to_string(Kused) +
                  ",\"K_auto\":" + (K == 0 ? "true" : "false") + ",\"signature\":" + (r->unsigned_ ? "false" : "true");
}

std::vector<Row> methodRows(const ChainOptions& o, const std::string& prefix, int kind) {
  std::vector<Row> rows;
  for (auto m : o.methods) {
    std::vector<int> Ks = {0};
    if (m == allscanPipelined) Ks.insert(Ks.end(), o.fixedK.begin(), o.fixedK.end());
    for (int K : Ks) {
      for (bool unsig : {false, true}) {
        if (unsig ? !o.signature.off : !o.signature.on) continue;
        Row r;
        r.kind = kind;
        r.method = m;
        r.K = K;
        r.unsigned_ = unsig;
        r.name = prefix + "-" + methodName(m) + (unsig ? "-nosig" : "");
        r.inSummary = m == allscanPipelined && K == 0 && (!unsig || !o.signature.on);
        rows.push_back(r);
      }
    }
  }
  return rows;
}

void ChainBench::setupChain() {
  ASCHECK(allscanCommCreate(c.nccl, &comm_));
  link_ = setupLinkModel(comm_, chain_, c.nranks, c.stream);
}

void ChainBench::teardownChain() {
  for (void* p : {x_, y_, recv_})
    if (p) CUDACHECK(cudaFree(p));
  ws_.release();
  ASCHECK(allscanCommDestroy(comm_));
}

void Workspace::grow(size_t need) {
  if (need <= bytes) return;
  if (ptr) CUDACHECK(cudaFree(ptr));
  CUDACHECK(cudaMalloc(&ptr, need));
  bytes = need;
}

void Workspace::release() {
  if (ptr) CUDACHECK(cudaFree(ptr));
  ptr = nullptr;
  bytes = 0;
}

}  // namespace perf
