// allscan_perf's harness: what every row set (collective) shares, in the conventions of nccl-tests.
// The harness owns the command line's common options, the ranks (one thread per GPU, processes
// under MPI), the timing (CUDA events, every row once per repeat, interleaved), the floor, the
// #wrong accounting, the table and the JSON. A collective is one file that fills in a Collective
// (its options) and a Bench (one rank's rows: set up, launch, check); see bench/README.md.
#pragma once

#include <allscan/allscan.h>
#include <getopt.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdio>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace perf {

extern const char* const kProg;

// ------------------------------------------------------------------------------------------------
// Errors: argument errors (exit 2, before any CUDA call) and run-time errors (exit 1, every rank)
// ------------------------------------------------------------------------------------------------
struct ArgError {
  std::string msg;
};
[[noreturn]] void argError(const std::string& msg);

// Prints "allscan_perf: rank R: error: ..." and ends the process without running destructors
// (other ranks may be blocked inside NCCL waiting for this one).
[[noreturn]] void die(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

#define CUDACHECK(cmd)                                                                            \
  do {                                                                                            \
    cudaError_t e_ = (cmd);                                                                       \
    if (e_ != cudaSuccess)                                                                        \
      ::perf::die("%s:%d: %s failed: %s (%s)", __FILE__, __LINE__, #cmd, cudaGetErrorString(e_),  \
                  cudaGetErrorName(e_));                                                          \
  } while (0)

#define NCCLCHECK(cmd)                                                                            \
  do {                                                                                            \
    ncclResult_t r_ = (cmd);                                                                      \
    if (r_ != ncclSuccess && r_ != ncclInProgress)                                                \
      ::perf::die("%s:%d: %s failed: %s", __FILE__, __LINE__, #cmd, ncclGetErrorString(r_));     \
  } while (0)

#define ASCHECK(cmd)                                                                              \
  do {                                                                                            \
    allscanResult_t s_ = (cmd);                                                                   \
    if (s_ != allscanSuccess)                                                                     \
      ::perf::die("%s:%d: %s failed: %s: %s", __FILE__, __LINE__, #cmd, allscanGetErrorString(s_), \
                  allscanGetLastError());                                                         \
  } while (0)

// ------------------------------------------------------------------------------------------------
// Parsing helpers (flag names the argument in every error)
// ------------------------------------------------------------------------------------------------
size_t parseSize(const char* flag, const char* s);  // 4096, 4K, 256M, 1G (powers of 1024)
long parseInt(const char* flag, const char* s, long lo, long hi, const char* what);
std::vector<std::string> splitList(const std::string& s);  // "a,b,c"

// ------------------------------------------------------------------------------------------------
// The common options
// ------------------------------------------------------------------------------------------------
struct Collective;

struct Options {
  const Collective* coll = nullptr;  // -o
  size_t minBytes = 32u << 20;
  size_t maxBytes = 32u << 20;
  size_t stepBytes = 1u << 20;
  long stepFactor = 1;
  int ngpus = 1;
  int iters = 20;
  int warmup = 5;
  int repeats = 5;
  int check = 1;
  int blocking = 0;
  int graphLaunches = 0;
  allscanDataType_t dtype = allscanFloat32;
  std::string json;
};

const char* dtypeName(allscanDataType_t t);  // float, half, bfloat16, double
std::string jsonNumber(double v);            // %.6g, null when not finite
inline size_t dtypeSize(allscanDataType_t t) { return allscanDataTypeSize(t); }
inline int gridFor(size_t n) {
  size_t blocks = (n + 255) / 256;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 4096 ? 4096 : blocks));
}

// ------------------------------------------------------------------------------------------------
// Exactly representable inputs: x = ((5e + 3p + salt) mod 7) - 3 is in {-3..3} and exact in fp64,
// fp32, fp16 and bf16; a row's check recomputes the expected value per element on the GPU.
// ------------------------------------------------------------------------------------------------
__host__ __device__ inline float xval(int rank, size_t e, unsigned salt = 0) {
  return static_cast<float>(static_cast<int>((e * 5u + static_cast<size_t>(rank) * 3u + salt) % 7u) - 3);
}

template <typename T> __device__ inline T fromFloat(float v);
template <> __device__ inline float fromFloat<float>(float v) { return v; }
template <> __device__ inline double fromFloat<double>(float v) { return static_cast<double>(v); }
template <> __device__ inline __half fromFloat<__half>(float v) { return __float2half_rn(v); }
template <> __device__ inline __nv_bfloat16 fromFloat<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

template <typename T> __device__ inline double toDouble(T v);
template <> __device__ inline double toDouble<float>(float v) { return v; }
template <> __device__ inline double toDouble<double>(double v) { return v; }
template <> __device__ inline double toDouble<__half>(__half v) { return __half2float(v); }
template <> __device__ inline double toDouble<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

// x_rank[e] for e < count: the state every row set starts from.
void launchFillX(allscanDataType_t t, void* x, size_t count, int rank, cudaStream_t s);

// Calls f(T*) with the buffer cast to the dtype's element type (for dtype-templated launches).
template <typename F>
void dispatchDtype(allscanDataType_t t, F&& f) {
  switch (t) {
    case allscanFloat32: f(static_cast<float*>(nullptr)); break;
    case allscanFloat16: f(static_cast<__half*>(nullptr)); break;
    case allscanBfloat16: f(static_cast<__nv_bfloat16*>(nullptr)); break;
    case allscanFloat64: f(static_cast<double*>(nullptr)); break;
  }
}

// ------------------------------------------------------------------------------------------------
// Rows and ranks
// ------------------------------------------------------------------------------------------------
struct Row {
  // The collective's own description of the row (the harness does not read these).
  int kind = 0;
  int method = 0;
  int K = 0;
  bool unsigned_ = false;  // a chain scan without its in-band signature (-S)
  // What the harness prints.
  std::string name;        // op column
  std::string kLabel = "-";  // K column
  std::string skip;        // non-empty: not run at this size (why)
  double busFactor = 1.0;  // busbw = algbw * busFactor (nccl-tests' factors)
  int floorRank = 0;       // 1: the floor of vs_floor; 2: the floor when no rank-1 row runs; 0: not a floor
  bool inSummary = false;  // counted in the "Avg bus bandwidth" line
  std::string jsonFields;  // JSON fields after "op" (leading comma), e.g. ,"method":"serial"
  std::string jsonTail;    // JSON fields after "vs_floor" (leading comma)
  // Filled in by the harness.
  std::vector<double> times;  // per repeat, us per iteration, max over ranks
  double median = 0, tmin = 0;
  bool checked = false;
  unsigned long long wrong = 0;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

struct World;

// One rank as the harness sets it up before a collective's Bench runs.
struct RankCtx {
  int t = 0;     // thread index in this process
  int rank = 0;  // global rank
  int nranks = 1;
  int device = 0;
  const Options* o = nullptr;
  World* w = nullptr;
  ncclComm_t nccl = nullptr;
  cudaStream_t stream = nullptr;
  size_t es = 4;  // bytes per element of -d
};

// One rank's side of a collective's rows. Everything is enqueued on c.stream.
class Bench {
 public:
  explicit Bench(RankCtx& ctx) : c(ctx) {}
  virtual ~Bench() = default;
  // After the NCCL communicator and the stream exist: communicators, buffers at -e, inputs.
  virtual void setup() = 0;
  // Header lines of the table (root rank, after setup), e.g. "#  dtype float ...".
  virtual std::vector<std::string> header() = 0;
  // Elements of the call at `size` bytes (default: size / element size).
  virtual size_t count(size_t size) { return size / c.es; }
  // The rows at `count` elements, in table order; a row that cannot run at this size has `skip`.
  virtual std::vector<Row> rows(size_t count) = 0;
  // Before timing the rows at this size (e.g. size the workspace).
  virtual void prepare(const std::vector<Row>& rows, size_t count) { (void)rows, (void)count; }
  // One iteration of `row`.
  virtual void launch(const Row& row, size_t count) = 0;
  // Pre-fill the row's output with NaN, run it once and add its wrong elements to *wrong (device,
  // zeroed by the harness).
  virtual void check(const Row& row, size_t count, unsigned long long* wrong) = 0;
  virtual void teardown() = 0;
  // JSON: fields of "config" (leading comma) and top-level fields (each ending ",\n").
  virtual std::string configJson() { return ""; }
  virtual std::string topJson() { return ""; }

 protected:
  RankCtx& c;
};

// One row set, selected with -o <name>.
struct OptionSpec {
  char letter;
  const char* longName;
  int hasArg;           // required_argument or optional_argument (getopt)
  const char* metavar;  // the value in the usage, e.g. "<list>"
  const char* help;     // the usage line(s) after the flag column
};

// -S: the collective's rows with the in-band signature check (the library's default), without it
// (rows named "<name>-nosig", as ALLSCAN_CHECK=trust), or both, interleaved in one run.
struct SignatureRows {
  bool on = true;
  bool off = false;
  const char* label() const { return on ? (off ? "both" : "on") : "off"; }
};
inline constexpr OptionSpec kSignatureOption = {
    'S', "signature", required_argument, "on|off|both",
    "rows with the in-band signature check (on, the library's\n"
    "                              default), without it (off: rows named -nosig), or both (default on)"};
void parseSignatureRows(SignatureRows* s, const char* arg);  // throws ArgError naming -S
// The signature the signed rows pass (any non-zero value equal on every rank).
constexpr unsigned long long kPerfSignature = 0x5ca45ca45ca45ca4ULL;

struct Collective {
  const char* name;          // -o value
  const char* title;         // "All-Scan benchmark": the first header line
  const char* about;         // one usage paragraph: what the rows are
  const char* summaryLabel;  // "Avg bus bandwidth (<label>)", over the rows with inSummary
  std::vector<OptionSpec> options;
  void (*parse)(int letter, const char* arg);  // one of its options (throws ArgError)
  void (*validate)(const Options& o);          // after every option (throws ArgError)
  std::unique_ptr<Bench> (*make)(RankCtx& c);
};

// Every row set: collectives.cpp (a new one is one line there).
const std::vector<const Collective*>& collectives();

}  // namespace perf
