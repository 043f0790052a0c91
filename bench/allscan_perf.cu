// allscan_perf: the All-Scan benchmark, in the conventions of nccl-tests.
//
// One process drives -g GPUs with one host thread per GPU (an All-Scan issues several NCCL group
// calls and kernels in sequence per rank, so one thread cannot drive all ranks); built with
// -DALLSCAN_PERF_MPI=ON it also runs one process per GPU (or per -g GPUs) under mpirun.
//
// For every size it times, side by side and interleaved (repeat r runs every row once):
//   p2p-chain       the floor: allscanNeighborExchange(chain=1), exactly the transfers one scan makes
//   p2p-ring        the same with the ring closed (every rank sends and receives)
//   nccl-allgather  ncclAllGather of the states (the LASP-2 communication)
//   nccl-allreduce  ncclAllReduce of one state
//   scan-pipelined  allscanScan, automatic block count and every fixed -K
//   scan-serial     allscanScan, LASP-1 pattern
//   scan-allgather  allscanScan, LASP-2 pattern
// and checks every row once on the GPU against exactly representable expected values (#wrong).
// See bench/README.md for the columns and the bus-bandwidth factors.

#include <allscan/allscan.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <getopt.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cinttypes>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#ifdef ALLSCAN_PERF_MPI
#include <mpi.h>
#endif

namespace {

const char* kProg = "allscan_perf";

// ------------------------------------------------------------------------------------------------
// Errors
// ------------------------------------------------------------------------------------------------
thread_local int tlsRank = -1;
std::mutex gPrintMutex;

[[noreturn]] void die(const char* fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  {
    std::lock_guard<std::mutex> l(gPrintMutex);
    if (tlsRank >= 0)
      fprintf(stderr, "%s: rank %d: error: %s\n", kProg, tlsRank, msg);
    else
      fprintf(stderr, "%s: error: %s\n", kProg, msg);
    fflush(stderr);
    fflush(stdout);
  }
#ifdef ALLSCAN_PERF_MPI
  int inited = 0;
  MPI_Initialized(&inited);
  if (inited) MPI_Abort(MPI_COMM_WORLD, 1);
#endif
  // Other ranks may be blocked inside NCCL waiting for this one: do not run destructors.
  std::_Exit(1);
}

#define CUDACHECK(cmd)                                                                            \
  do {                                                                                            \
    cudaError_t e_ = (cmd);                                                                       \
    if (e_ != cudaSuccess)                                                                        \
      die("%s:%d: %s failed: %s (%s)", __FILE__, __LINE__, #cmd, cudaGetErrorString(e_),          \
          cudaGetErrorName(e_));                                                                  \
  } while (0)

#define NCCLCHECK(cmd)                                                                            \
  do {                                                                                            \
    ncclResult_t r_ = (cmd);                                                                      \
    if (r_ != ncclSuccess && r_ != ncclInProgress)                                                \
      die("%s:%d: %s failed: %s", __FILE__, __LINE__, #cmd, ncclGetErrorString(r_));             \
  } while (0)

#define ASCHECK(cmd)                                                                              \
  do {                                                                                            \
    allscanResult_t s_ = (cmd);                                                                   \
    if (s_ != allscanSuccess)                                                                     \
      die("%s:%d: %s failed: %s: %s", __FILE__, __LINE__, #cmd, allscanGetErrorString(s_),        \
          allscanGetLastError());                                                                 \
  } while (0)

// ------------------------------------------------------------------------------------------------
// Options (parsed and validated before any CUDA or NCCL call)
// ------------------------------------------------------------------------------------------------
enum Ref { REF_CHAIN = 0, REF_RING = 1, REF_ALLGATHER = 2, REF_ALLREDUCE = 3, REF_COUNT = 4 };
const char* kRefNames[REF_COUNT] = {"chain", "ring", "allgather", "allreduce"};

enum Decay { DECAY_NONE = 0, DECAY_HEAD = 1, DECAY_KEY = 2, DECAY_FULL = 3 };
const char* kDecayNames[4] = {"none", "head", "key", "full"};

enum LinkMode { LINK_CALIBRATE = 0, LINK_NONE = 1, LINK_SET = 2 };

struct Options {
  size_t minBytes = 32u << 20;
  size_t maxBytes = 32u << 20;
  size_t stepBytes = 1u << 20;
  long stepFactor = 1;
  bool stepFactorGiven = false;
  bool stepBytesGiven = false;
  int ngpus = 1;
  int iters = 20;
  int warmup = 5;
  int repeats = 5;
  int check = 1;
  int blocking = 0;
  int graphLaunches = 0;
  allscanDataType_t dtype = allscanFloat32;
  std::vector<int> fixedK;  // fixed block counts (the automatic one is always timed)
  std::vector<allscanMethod_t> methods = {allscanPipelined, allscanSerial, allscanAllGather};
  bool refs[REF_COUNT] = {true, true, true, true};
  int reverse = 0;
  Decay decay = DECAY_KEY;
  int dv = 128;  // trailing dims of the [H, Dk, Dv] view are gcd(count, dv), gcd(count/Dv, dv)
  LinkMode link = LINK_CALIBRATE;
  double linkLatencyUs = 0, linkUsPerByte = 0;
  std::string json;
};

void usage(FILE* f) {
  fprintf(f,
          "Usage: %s [options]\n"
          "All-Scan benchmark (nccl-tests conventions): times the floor (neighbour send/recv of the\n"
          "same bytes), ncclAllGather, ncclAllReduce and allscanScan with each method, side by side.\n"
          "Sizes take K, M, G suffixes (powers of 1024), e.g. 4K, 256M.\n"
          "\n"
          "  -b, --minbytes <size>       smallest state size in bytes per rank (default 32M)\n"
          "  -e, --maxbytes <size>       largest state size (default 32M)\n"
          "  -i, --stepbytes <size>      additive step between sizes when -f is 1 (default 1M)\n"
          "  -f, --stepfactor <int>      multiplicative step between sizes (default 1 = use -i)\n"
          "  -g, --ngpus <n>             GPUs driven by this process, one thread each (default 1)\n"
          "  -n, --iters <n>             timed iterations per measurement (default 20)\n"
          "  -w, --warmup_iters <n>      untimed warm-up iterations per row and size (default 5)\n"
          "  -N, --repeats <n>           interleaved repeats; the median is reported (default 5)\n"
          "  -c, --check <0|1>           count wrong elements on the GPU (default 1)\n"
          "  -d, --datatype <type>       float|half|bfloat16|double (default float)\n"
          "  -z, --blocking <0|1>        synchronise the stream after every iteration (default 0)\n"
          "  -G, --cudagraph <n>         capture the -n iterations in a CUDA graph, time n replays\n"
          "                              (0 = no graph, default 0)\n"
          "  -K, --blocks <list>         pipelined block counts: 'auto' or comma-separated integers\n"
          "                              1..%d; the automatic K is always timed (default auto)\n"
          "  -m, --methods <list>        scan methods: pipelined,serial,allgather or all (default all)\n"
          "  -x, --refs <list>           reference rows: chain,ring,allgather,allreduce, all or none\n"
          "                              (default all; 'chain' is the floor of the vs_floor column)\n"
          "  -r[0|1], --reverse[=0|1]    reverse scan (rank p+1 -> p); -r alone means 1 (default 0)\n"
          "  -D, --decay <form>          none|head|key|full: the decay's shape in the [H, Dk, Dv]\n"
          "                              view of the state (default key, i.e. g is [H, Dk], fp32)\n"
          "  -V, --vdim <n>              Dv and Dk of that view are gcd(count, n), gcd(count/Dv, n)\n"
          "                              (default 128)\n"
          "  -L, --link_model <m>        calibrate | none | <latency_us>,<us_per_byte>: the link model\n"
          "                              that chooses the automatic K (default calibrate)\n"
          "  -j, --json <file>           also write every row as JSON to <file>\n"
          "  -h, --help                  this help\n"
          "\n"
          "Example (2 GPUs): %s -b 4K -e 256M -f 2 -g 2 -j perf.json\n",
          kProg, allscanMaxBlocks, kProg);
}

struct ArgError {
  std::string msg;
};

[[noreturn]] void argError(const std::string& msg) { throw ArgError{msg}; }

// Sizes: digits with an optional K/M/G suffix (powers of 1024) and optional "B"/"iB".
size_t parseSize(const char* flag, const char* s) {
  std::string str(s ? s : "");
  if (str.empty() || !isdigit(static_cast<unsigned char>(str[0])))
    argError(std::string(flag) + ": expected a size in bytes like 4096, 4K, 256M or 1G, got '" + str + "'");
  errno = 0;
  char* end = nullptr;
  unsigned long long v = strtoull(str.c_str(), &end, 10);
  if (errno != 0) argError(std::string(flag) + ": size '" + str + "' is out of range");
  std::string suf(end);
  unsigned long long mult = 1;
  if (!suf.empty()) {
    char c = static_cast<char>(toupper(static_cast<unsigned char>(suf[0])));
    size_t rest = 0;
    if (c == 'K') mult = 1ull << 10, rest = 1;
    else if (c == 'M') mult = 1ull << 20, rest = 1;
    else if (c == 'G') mult = 1ull << 30, rest = 1;
    std::string tail = suf.substr(rest);
    for (auto& ch : tail) ch = static_cast<char>(toupper(static_cast<unsigned char>(ch)));
    if (!(tail.empty() || tail == "B" || (rest == 1 && tail == "IB")))
      argError(std::string(flag) + ": expected a size in bytes like 4096, 4K, 256M or 1G, got '" + str + "'");
  }
  if (v != 0 && mult > ULLONG_MAX / v) argError(std::string(flag) + ": size '" + str + "' is out of range");
  return static_cast<size_t>(v * mult);
}

long parseInt(const char* flag, const char* s, long lo, long hi, const char* what) {
  std::string str(s ? s : "");
  errno = 0;
  char* end = nullptr;
  long v = strtol(str.c_str(), &end, 10);
  if (str.empty() || *end != '\0' || errno != 0 || v < lo || v > hi) {
    argError(std::string(flag) + ": expected " + what + ", got '" + str + "'");
  }
  return v;
}

std::vector<std::string> splitList(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    size_t p = s.find(',', start);
    out.push_back(s.substr(start, p == std::string::npos ? std::string::npos : p - start));
    if (p == std::string::npos) break;
    start = p + 1;
  }
  return out;
}

size_t dtypeSize(allscanDataType_t t) { return allscanDataTypeSize(t); }

const char* dtypeName(allscanDataType_t t) {
  switch (t) {
    case allscanFloat32: return "float";
    case allscanFloat16: return "half";
    case allscanBfloat16: return "bfloat16";
    case allscanFloat64: return "double";
  }
  return "?";
}

const char* methodName(allscanMethod_t m) {
  switch (m) {
    case allscanPipelined: return "pipelined";
    case allscanSerial: return "serial";
    case allscanAllGather: return "allgather";
  }
  return "?";
}

// Returns false when -h was given (usage printed). Throws ArgError on a bad argument.
bool parseArgs(int argc, char** argv, Options* o) {
  static const struct option longopts[] = {
      {"minbytes", required_argument, nullptr, 'b'},   {"maxbytes", required_argument, nullptr, 'e'},
      {"stepbytes", required_argument, nullptr, 'i'},  {"stepfactor", required_argument, nullptr, 'f'},
      {"ngpus", required_argument, nullptr, 'g'},      {"iters", required_argument, nullptr, 'n'},
      {"warmup_iters", required_argument, nullptr, 'w'}, {"repeats", required_argument, nullptr, 'N'},
      {"check", required_argument, nullptr, 'c'},      {"datatype", required_argument, nullptr, 'd'},
      {"blocking", required_argument, nullptr, 'z'},   {"cudagraph", required_argument, nullptr, 'G'},
      {"blocks", required_argument, nullptr, 'K'},     {"methods", required_argument, nullptr, 'm'},
      {"refs", required_argument, nullptr, 'x'},       {"reverse", optional_argument, nullptr, 'r'},
      {"decay", required_argument, nullptr, 'D'},      {"vdim", required_argument, nullptr, 'V'},
      {"link_model", required_argument, nullptr, 'L'}, {"json", required_argument, nullptr, 'j'},
      {"help", no_argument, nullptr, 'h'},             {nullptr, 0, nullptr, 0}};
  const char* shortopts = ":b:e:i:f:g:n:w:N:c:d:z:G:K:m:x:r::D:V:L:j:h";
  opterr = 0;
  optind = 1;
  int c;
  while ((c = getopt_long(argc, argv, shortopts, longopts, nullptr)) != -1) {
    switch (c) {
      case 'b': o->minBytes = parseSize("-b (minbytes)", optarg); break;
      case 'e': o->maxBytes = parseSize("-e (maxbytes)", optarg); break;
      case 'i': o->stepBytes = parseSize("-i (stepbytes)", optarg); o->stepBytesGiven = true; break;
      case 'f':
        o->stepFactor = parseInt("-f (stepfactor)", optarg, 1, 1 << 20, "an integer step factor >= 1");
        o->stepFactorGiven = true;
        break;
      case 'g': o->ngpus = static_cast<int>(parseInt("-g (ngpus)", optarg, 1, 1024, "a GPU count >= 1")); break;
      case 'n': o->iters = static_cast<int>(parseInt("-n (iters)", optarg, 1, 100000000, "an iteration count >= 1")); break;
      case 'w': o->warmup = static_cast<int>(parseInt("-w (warmup_iters)", optarg, 0, 100000000, "an iteration count >= 0")); break;
      case 'N': o->repeats = static_cast<int>(parseInt("-N (repeats)", optarg, 1, 100000, "a repeat count >= 1")); break;
      case 'c': o->check = static_cast<int>(parseInt("-c (check)", optarg, 0, 1, "0 or 1")); break;
      case 'z': o->blocking = static_cast<int>(parseInt("-z (blocking)", optarg, 0, 1, "0 or 1")); break;
      case 'G': o->graphLaunches = static_cast<int>(parseInt("-G (cudagraph)", optarg, 0, 1000000, "a graph launch count >= 0")); break;
      case 'V': o->dv = static_cast<int>(parseInt("-V (vdim)", optarg, 1, 1 << 20, "a dimension >= 1")); break;
      case 'r':
        o->reverse = optarg ? static_cast<int>(parseInt("-r (reverse)", optarg, 0, 1, "0 or 1 (write -r, -r0 or -r1)")) : 1;
        break;
      case 'd': {
        std::string s(optarg);
        if (s == "float" || s == "float32" || s == "fp32") o->dtype = allscanFloat32;
        else if (s == "half" || s == "float16" || s == "fp16") o->dtype = allscanFloat16;
        else if (s == "bfloat16" || s == "bf16") o->dtype = allscanBfloat16;
        else if (s == "double" || s == "float64" || s == "fp64") o->dtype = allscanFloat64;
        else argError("-d (datatype): expected float, half, bfloat16 or double, got '" + s + "'");
        break;
      }
      case 'D': {
        std::string s(optarg);
        bool ok = false;
        for (int k = 0; k < 4; ++k)
          if (s == kDecayNames[k]) o->decay = static_cast<Decay>(k), ok = true;
        if (!ok) argError("-D (decay): expected none, head, key or full, got '" + s + "'");
        break;
      }
      case 'K': {
        o->fixedK.clear();
        for (const auto& t : splitList(optarg)) {
          if (t == "auto") continue;
          o->fixedK.push_back(static_cast<int>(parseInt(
              "-K (blocks)", t.c_str(), 1, allscanMaxBlocks,
              ("'auto' or a block count 1.." + std::to_string(allscanMaxBlocks) + " (comma-separated list allowed)").c_str())));
        }
        break;
      }
      case 'm': {
        o->methods.clear();
        for (const auto& t : splitList(optarg)) {
          if (t == "pipelined") o->methods.push_back(allscanPipelined);
          else if (t == "serial") o->methods.push_back(allscanSerial);
          else if (t == "allgather") o->methods.push_back(allscanAllGather);
          else if (t == "all") o->methods = {allscanPipelined, allscanSerial, allscanAllGather};
          else argError("-m (methods): expected a comma-separated list of pipelined, serial, allgather (or all), got '" + t + "'");
        }
        std::vector<allscanMethod_t> uniq;
        for (auto m : o->methods)
          if (std::find(uniq.begin(), uniq.end(), m) == uniq.end()) uniq.push_back(m);
        o->methods = uniq;
        break;
      }
      case 'x': {
        for (bool& b : o->refs) b = false;
        for (const auto& t : splitList(optarg)) {
          bool ok = false;
          if (t == "all") {
            for (bool& b : o->refs) b = true;
            ok = true;
          } else if (t == "none") {
            ok = true;
          }
          for (int k = 0; k < REF_COUNT; ++k)
            if (t == kRefNames[k]) o->refs[k] = true, ok = true;
          if (!ok) argError("-x (refs): expected a comma-separated list of chain, ring, allgather, allreduce (or all, none), got '" + t + "'");
        }
        break;
      }
      case 'L': {
        std::string s(optarg);
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
        break;
      }
      case 'j': o->json = optarg; if (o->json.empty()) argError("-j (json): expected a file name"); break;
      case 'h': usage(stdout); return false;
      case ':': argError(std::string("option -") + static_cast<char>(optopt) + " needs a value (see -h)");
      case '?':
      default:
        if (optopt) argError(std::string("unknown option -") + static_cast<char>(optopt) + " (see -h)");
        argError(std::string("unknown option '") + argv[optind - 1] + "' (see -h)");
    }
  }
  if (optind < argc) {
    const std::string prev = argv[optind - 1];
    if (prev == "-r" || prev == "--reverse")
      argError(std::string("unexpected argument '") + argv[optind] + "': -r takes its value attached (-r, -r0, -r1 or --reverse=1)");
    argError(std::string("unexpected argument '") + argv[optind] + "' (options take the form -b 4K; see -h)");
  }

  // Cross-argument checks.
  const size_t es = dtypeSize(o->dtype);
  if (o->minBytes == 0) argError("-b (minbytes): must be > 0, got 0");
  if (o->maxBytes == 0) argError("-e (maxbytes): must be > 0, got 0");
  if (o->minBytes < es)
    argError("-b (minbytes): " + std::to_string(o->minBytes) + " bytes is less than one " + dtypeName(o->dtype) +
             " element (" + std::to_string(es) + " bytes)");
  if (o->maxBytes < o->minBytes)
    argError("-e (maxbytes) " + std::to_string(o->maxBytes) + " is smaller than -b (minbytes) " + std::to_string(o->minBytes));
  if (o->stepFactor <= 1 && o->stepBytes == 0 && o->maxBytes > o->minBytes)
    argError("-i (stepbytes): must be > 0 when -f is 1 and -e > -b (the size would never grow)");
  if (o->graphLaunches > 0 && o->blocking)
    argError("-G (cudagraph) and -z 1 (blocking) cannot be combined: a graph replays without host synchronisation");
  if (o->methods.empty()) argError("-m (methods): no method selected");
  return true;
}

// The [H, Dk, Dv] view of a state of `count` elements and the decay's element count for a form.
struct Layout {
  size_t H, Dk, Dv, gCount;
};

Layout layoutFor(size_t count, Decay d, int dv) {
  Layout L;
  L.Dv = std::gcd(count, static_cast<size_t>(dv));
  L.Dk = std::gcd(count / L.Dv, static_cast<size_t>(dv));
  L.H = count / (L.Dv * L.Dk);
  switch (d) {
    case DECAY_NONE: L.gCount = 0; break;
    case DECAY_HEAD: L.gCount = L.H; break;
    case DECAY_KEY: L.gCount = L.H * L.Dk; break;
    case DECAY_FULL: L.gCount = count; break;
  }
  return L;
}

// ------------------------------------------------------------------------------------------------
// Exactly representable inputs and the GPU-side check
//
//   x_p[e] = ((5e + 3p) mod 7) - 3                  in {-3..3}; consecutive ranks cycle through all
//                                                   residues, so a plain prefix sum stays in [-9, 9]
//   g_p[j] = {2, 1/2, 1, 0}[(p + j) mod 4]          powers of two and a zero that cuts the chain
//                                                   every 4 ranks, so |y| <= 3*(1+2+2) = 15
// Every intermediate is a multiple of 1/2 below 32 in magnitude: exact in fp64, fp32, fp16 and bf16,
// at any P, whatever order a method combines in. The expected y is recomputed per element on the GPU.
// ------------------------------------------------------------------------------------------------
__host__ __device__ inline float xval(int rank, size_t e) {
  return static_cast<float>(static_cast<int>((e * 5u + static_cast<size_t>(rank) * 3u) % 7u) - 3);
}
__host__ __device__ inline float gval(int rank, size_t j) {
  switch ((static_cast<size_t>(rank) + j) % 4u) {
    case 0: return 2.0f;
    case 1: return 0.5f;
    case 2: return 1.0f;
    default: return 0.0f;
  }
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

template <typename T>
__global__ void fillXKernel(T* x, size_t count, int rank) {
  for (size_t e = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<size_t>(gridDim.x) * blockDim.x)
    x[e] = fromFloat<T>(xval(rank, e));
}

__global__ void fillGKernel(float* g, size_t count, int rank) {
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < count;
       j += static_cast<size_t>(gridDim.x) * blockDim.x)
    g[j] = gval(rank, j);
}

enum CheckMode { CHK_SCAN = 0, CHK_RECV_CHAIN = 1, CHK_RECV_RING = 2, CHK_ALLGATHER = 3, CHK_ALLREDUCE = 4 };

struct CheckParams {
  int mode;
  int rank, nranks, reverse;
  size_t count;  // elements of one state
  size_t inner;  // state elements per decay element (0: no decay)
};

// Counts the elements of `out` that differ from the expected value (exact comparison; NaN, the
// pre-fill, counts as wrong).
template <typename T>
__global__ void checkKernel(const T* out, CheckParams p, unsigned long long* wrong) {
  const size_t total = p.mode == CHK_ALLGATHER ? p.count * static_cast<size_t>(p.nranks) : p.count;
  unsigned long long bad = 0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    double expect = 0.0;
    switch (p.mode) {
      case CHK_SCAN: {
        // Sequential recurrence from the head of the chain, rounded to T at every rank boundary.
        const size_t j = p.inner ? i / p.inner : 0;
        double y = 0.0;
        if (!p.reverse) {
          for (int q = 0; q < p.rank; ++q) {
            const double g = p.inner ? gval(q, j) : 1.0;
            y = toDouble<T>(fromFloat<T>(static_cast<float>(__dadd_rn(__dmul_rn(g, y), xval(q, i)))));
          }
        } else {
          for (int q = p.nranks - 1; q > p.rank; --q) {
            const double g = p.inner ? gval(q, j) : 1.0;
            y = toDouble<T>(fromFloat<T>(static_cast<float>(__dadd_rn(__dmul_rn(g, y), xval(q, i)))));
          }
        }
        expect = y;
        break;
      }
      case CHK_RECV_CHAIN:
      case CHK_RECV_RING: {
        int src = p.reverse ? p.rank + 1 : p.rank - 1;
        if (src < 0 || src >= p.nranks) {
          if (p.mode == CHK_RECV_CHAIN) continue;  // the chain's head receives nothing
          src = (src + p.nranks) % p.nranks;
        }
        expect = xval(src, i);
        break;
      }
      case CHK_ALLGATHER: {
        const int q = static_cast<int>(i / p.count);
        expect = xval(q, i - static_cast<size_t>(q) * p.count);
        break;
      }
      case CHK_ALLREDUCE: {
        for (int q = 0; q < p.nranks; ++q) expect += xval(q, i);
        break;
      }
    }
    if (!(toDouble<T>(out[i]) == expect)) ++bad;
  }
  if (bad) atomicAdd(wrong, bad);
}

int gridFor(size_t n) {
  size_t blocks = (n + 255) / 256;
  return static_cast<int>(std::max<size_t>(1, std::min<size_t>(blocks, 4096)));
}

void launchFillX(allscanDataType_t t, void* x, size_t count, int rank, cudaStream_t s) {
  const int grid = gridFor(count);
  switch (t) {
    case allscanFloat32: fillXKernel<float><<<grid, 256, 0, s>>>(static_cast<float*>(x), count, rank); break;
    case allscanFloat16: fillXKernel<__half><<<grid, 256, 0, s>>>(static_cast<__half*>(x), count, rank); break;
    case allscanBfloat16: fillXKernel<__nv_bfloat16><<<grid, 256, 0, s>>>(static_cast<__nv_bfloat16*>(x), count, rank); break;
    case allscanFloat64: fillXKernel<double><<<grid, 256, 0, s>>>(static_cast<double*>(x), count, rank); break;
  }
  CUDACHECK(cudaGetLastError());
}

void launchCheck(allscanDataType_t t, const void* out, const CheckParams& p, unsigned long long* wrong, cudaStream_t s) {
  const size_t total = p.mode == CHK_ALLGATHER ? p.count * static_cast<size_t>(p.nranks) : p.count;
  const int grid = gridFor(total);
  switch (t) {
    case allscanFloat32: checkKernel<float><<<grid, 256, 0, s>>>(static_cast<const float*>(out), p, wrong); break;
    case allscanFloat16: checkKernel<__half><<<grid, 256, 0, s>>>(static_cast<const __half*>(out), p, wrong); break;
    case allscanBfloat16: checkKernel<__nv_bfloat16><<<grid, 256, 0, s>>>(static_cast<const __nv_bfloat16*>(out), p, wrong); break;
    case allscanFloat64: checkKernel<double><<<grid, 256, 0, s>>>(static_cast<const double*>(out), p, wrong); break;
  }
  CUDACHECK(cudaGetLastError());
}

ncclDataType_t ncclTypeOf(allscanDataType_t t) { return allscanNcclDataType(t); }

// ------------------------------------------------------------------------------------------------
// Ranks of this process (threads) and, under MPI, of the other processes
// ------------------------------------------------------------------------------------------------
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> l(m_);
    const long gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      ++gen_;
      cv_.notify_all();
    } else {
      cv_.wait(l, [&] { return gen != gen_; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_;
  int count_ = 0;
  long gen_ = 0;
};

struct World {
  int nthreads = 1;  // ranks in this process
  int nprocs = 1;
  int proc = 0;
  int nranks = 1;
  Barrier bar;
  std::vector<double> dslot;
  std::vector<unsigned long long> uslot;
  double dres = 0;
  unsigned long long ures = 0;
  std::vector<std::string> deviceLines;
  explicit World(int n) : nthreads(n), bar(n), dslot(n), uslot(n), deviceLines(n) {}
};

// Host barrier over every rank (local threads, then processes).
void worldBarrier(World& w, int t) {
  w.bar.wait();
#ifdef ALLSCAN_PERF_MPI
  if (t == 0 && w.nprocs > 1) MPI_Barrier(MPI_COMM_WORLD);
#else
  (void)t;
#endif
  w.bar.wait();
}

double allMax(World& w, int t, double v) {
  w.dslot[t] = v;
  w.bar.wait();
  if (t == 0) {
    double m = *std::max_element(w.dslot.begin(), w.dslot.end());
#ifdef ALLSCAN_PERF_MPI
    if (w.nprocs > 1) MPI_Allreduce(MPI_IN_PLACE, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
#endif
    w.dres = m;
  }
  w.bar.wait();
  const double r = w.dres;
  w.bar.wait();
  return r;
}

unsigned long long allSum(World& w, int t, unsigned long long v) {
  w.uslot[t] = v;
  w.bar.wait();
  if (t == 0) {
    unsigned long long s = 0;
    for (auto x : w.uslot) s += x;
#ifdef ALLSCAN_PERF_MPI
    if (w.nprocs > 1) MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
#endif
    w.ures = s;
  }
  w.bar.wait();
  const unsigned long long r = w.ures;
  w.bar.wait();
  return r;
}

// ------------------------------------------------------------------------------------------------
// Rows
// ------------------------------------------------------------------------------------------------
enum OpKind { OP_CHAIN, OP_RING, OP_ALLGATHER, OP_ALLREDUCE, OP_SCAN };

struct Row {
  OpKind kind = OP_SCAN;
  allscanMethod_t method = allscanPipelined;
  int K = 0;         // blocks passed to allscanScan (0 = automatic)
  int Keff = 1;      // block count it uses
  std::string name;  // op column
  std::string skip;  // non-empty: not run at this size (why)
  double busFactor = 1.0;
  std::vector<double> times;  // per repeat, us per iteration, max over ranks
  double median = 0, tmin = 0;
  bool checked = false;
  unsigned long long wrong = 0;
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
};

struct RankCtx {
  int t = 0;     // thread index in this process
  int rank = 0;  // global rank
  int nranks = 1;
  int device = 0;
  const Options* o = nullptr;
  World* w = nullptr;
  ncclComm_t nccl = nullptr;
  allscanComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  size_t es = 4;
  void* x = nullptr;
  void* y = nullptr;
  void* recv = nullptr;
  void* ag = nullptr;
  void* ar = nullptr;
  float* g = nullptr;
  void* ws = nullptr;
  size_t wsBytes = 0;
  unsigned long long* dWrong = nullptr;
};

allscanScanArgs_t scanArgs(const RankCtx& c, const Row& r, size_t count, const Layout& L) {
  allscanScanArgs_t a;
  memset(&a, 0, sizeof(a));
  a.x = c.x;
  a.y = c.y;
  a.count = count;
  a.dtype = c.o->dtype;
  if (c.o->decay != DECAY_NONE) {
    a.g = c.g;
    a.g_count = L.gCount;
    a.g_dtype = allscanFloat32;
  }
  a.init = nullptr;
  a.reverse = c.o->reverse;
  a.inclusive = 0;
  a.num_blocks = r.method == allscanPipelined ? r.K : 0;
  a.method = r.method;
  return a;
}

void launchRow(RankCtx& c, const Row& r, size_t count, const Layout& L) {
  const size_t bytes = count * c.es;
  switch (r.kind) {
    case OP_CHAIN: ASCHECK(allscanNeighborExchange(c.comm, c.x, c.recv, bytes, c.o->reverse, 1, c.stream)); break;
    case OP_RING: ASCHECK(allscanNeighborExchange(c.comm, c.x, c.recv, bytes, c.o->reverse, 0, c.stream)); break;
    case OP_ALLGATHER: NCCLCHECK(ncclAllGather(c.x, c.ag, count, ncclTypeOf(c.o->dtype), c.nccl, c.stream)); break;
    case OP_ALLREDUCE: NCCLCHECK(ncclAllReduce(c.x, c.ar, count, ncclTypeOf(c.o->dtype), ncclSum, c.nccl, c.stream)); break;
    case OP_SCAN: {
      allscanScanArgs_t a = scanArgs(c, r, count, L);
      ASCHECK(allscanScan(c.comm, &a, c.ws, c.wsBytes, c.stream));
      break;
    }
  }
}

std::vector<Row> buildRows(const RankCtx& c, size_t count, const Layout& L) {
  const Options& o = *c.o;
  const int P = c.nranks;
  std::vector<Row> rows;
  auto ref = [&](OpKind k, const char* name, double factor) {
    Row r;
    r.kind = k;
    r.name = name;
    r.busFactor = factor;
    r.Keff = 0;
    rows.push_back(r);
  };
  if (o.refs[REF_CHAIN]) ref(OP_CHAIN, "p2p-chain", 1.0);
  if (o.refs[REF_RING]) ref(OP_RING, "p2p-ring", 1.0);
  if (o.refs[REF_ALLGATHER]) ref(OP_ALLGATHER, "nccl-allgather", static_cast<double>(P - 1));
  if (o.refs[REF_ALLREDUCE]) ref(OP_ALLREDUCE, "nccl-allreduce", 2.0 * (P - 1) / P);
  for (auto m : o.methods) {
    std::vector<int> Ks = {0};
    if (m == allscanPipelined) Ks.insert(Ks.end(), o.fixedK.begin(), o.fixedK.end());
    for (int K : Ks) {
      Row r;
      r.kind = OP_SCAN;
      r.method = m;
      r.K = K;
      r.name = std::string("scan-") + methodName(m);
      r.busFactor = 1.0;
      allscanScanArgs_t a = scanArgs(c, r, count, L);
      if (allscanCheckArgs(c.comm, &a) != allscanSuccess) {
        r.skip = allscanGetLastError();
      }
      if (m == allscanPipelined) {
        if (K == 0) ASCHECK(allscanChooseNumBlocks(c.comm, count * c.es, &r.Keff));
        else r.Keff = K;
      } else {
        r.Keff = 1;
      }
      rows.push_back(r);
    }
  }
  return rows;
}

// ------------------------------------------------------------------------------------------------
// Output
// ------------------------------------------------------------------------------------------------
std::string jsonEscape(const std::string& s) {
  std::string out;
  for (char ch : s) {
    switch (ch) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(ch) < 0x20) {
          char buf[8];
          snprintf(buf, sizeof(buf), "\\u%04x", ch);
          out += buf;
        } else {
          out += ch;
        }
    }
  }
  return out;
}

std::string jnum(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

struct Collected {
  std::vector<std::string> rowsJson;
  unsigned long long wrongTotal = 0;
  bool anyChecked = false;
  double busbwSum = 0;
  int busbwN = 0;
};

std::string kLabel(const Row& r) {
  if (r.kind != OP_SCAN) return "-";
  if (r.method != allscanPipelined) return "1";
  if (r.K == 0) return "auto:" + std::to_string(r.Keff);
  return std::to_string(r.K);
}

void printHeader(const Options& o, const World& w, const RankCtx& c, double lat, double upb, int isSet) {
  int ncclVer = 0;
  ncclGetVersion(&ncclVer);
  printf("# %s: All-Scan benchmark (allscan %d.%d.%d, NCCL %d.%d.%d), nccl-tests conventions\n", kProg,
         ALLSCAN_VERSION_MAJOR, ALLSCAN_VERSION_MINOR, ALLSCAN_VERSION_PATCH, ncclVer / 10000, (ncclVer / 100) % 100,
         ncclVer % 100);
  printf("#  nranks %d (%d process%s x %d GPU%s)  minBytes %zu maxBytes %zu step: %zu(%s)\n", w.nranks, w.nprocs,
         w.nprocs == 1 ? "" : "es", w.nthreads, w.nthreads == 1 ? "" : "s", o.minBytes, o.maxBytes,
         o.stepFactor > 1 ? static_cast<size_t>(o.stepFactor) : o.stepBytes, o.stepFactor > 1 ? "factor" : "bytes");
  printf("#  warmup iters: %d iters: %d repeats: %d (median reported) validation: %d graph: %d blocking: %d\n",
         o.warmup, o.iters, o.repeats, o.check, o.graphLaunches, o.blocking);
  std::string ks = "auto";
  for (int k : o.fixedK) ks += "," + std::to_string(k);
  std::string ms;
  for (auto m : o.methods) ms += (ms.empty() ? "" : ",") + std::string(methodName(m));
  printf("#  dtype %s  reverse %d  decay %s (fp32; state viewed as [H, Dk, Dv], Dv = gcd(count,%d), Dk = gcd(count/Dv,%d))\n",
         dtypeName(o.dtype), o.reverse, kDecayNames[o.decay], o.dv, o.dv);
  printf("#  methods %s  K %s\n", ms.c_str(), ks.c_str());
  if (isSet)
    printf("#  link model (%s): latency %.3f us, %.6g us/byte (%.1f GB/s)\n",
           o.link == LINK_SET ? "-L" : "calibrated", lat, upb, 1e-3 / upb);
  else
    printf("#  link model: none (the automatic K is 1)\n");
  printf("#\n#  Using devices\n");
  for (const auto& l : w.deviceLines) printf("%s\n", l.c_str());
  (void)c;
  printf("#\n");
  printf("# %12s %12s %9s %-15s %8s %10s %8s %8s %8s %8s\n", "size", "count", "type", "op", "K", "time", "algbw",
         "busbw", "#wrong", "vs_floor");
  printf("# %12s %12s %9s %-15s %8s %10s %8s %8s %8s %8s\n", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)",
         "(GB/s)", "", "(x)");
  fflush(stdout);
}

// ------------------------------------------------------------------------------------------------
// One rank
// ------------------------------------------------------------------------------------------------
void runRank(const Options& o, World& w, int t, const ncclUniqueId& id, int device, Collected* out) {
  RankCtx c;
  c.t = t;
  c.o = &o;
  c.w = &w;
  c.rank = w.proc * w.nthreads + t;
  c.nranks = w.nranks;
  c.device = device;
  c.es = dtypeSize(o.dtype);
  tlsRank = c.rank;
  const bool root = c.rank == 0;
  const int P = c.nranks;

  CUDACHECK(cudaSetDevice(device));
  {
    cudaDeviceProp prop;
    CUDACHECK(cudaGetDeviceProperties(&prop, device));
    char host[256] = {0};
    gethostname(host, sizeof(host) - 1);
    char line[1024];
    snprintf(line, sizeof(line), "#  Rank %2d Pid %6d on %10s device %2d [%04x:%02x:%02x.0] %s", c.rank,
             static_cast<int>(getpid()), host, device, prop.pciDomainID, prop.pciBusID, prop.pciDeviceID, prop.name);
    w.deviceLines[t] = line;
  }
  NCCLCHECK(ncclCommInitRank(&c.nccl, P, id, c.rank));
  ASCHECK(allscanCommCreate(c.nccl, &c.comm));
  CUDACHECK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
  CUDACHECK(cudaEventCreate(&c.ev0));
  CUDACHECK(cudaEventCreate(&c.ev1));

  if (o.link == LINK_SET) ASCHECK(allscanSetLinkModel(c.comm, o.linkLatencyUs, o.linkUsPerByte));
  if (o.link == LINK_CALIBRATE && P > 1) ASCHECK(allscanCalibrate(c.comm, c.stream));
  double lat = 0, upb = 0;
  int isSet = 0;
  ASCHECK(allscanGetLinkModel(c.comm, &lat, &upb, &isSet));

  // Buffers at the largest size, allocated once (outside any timed loop).
  const size_t maxCount = o.maxBytes / c.es;
  const size_t maxBytes = maxCount * c.es;
  CUDACHECK(cudaMalloc(&c.x, maxBytes));
  CUDACHECK(cudaMalloc(&c.y, maxBytes));
  if (o.refs[REF_CHAIN] || o.refs[REF_RING]) CUDACHECK(cudaMalloc(&c.recv, maxBytes));
  if (o.refs[REF_ALLGATHER]) CUDACHECK(cudaMalloc(&c.ag, maxBytes * P));
  if (o.refs[REF_ALLREDUCE]) CUDACHECK(cudaMalloc(&c.ar, maxBytes));
  if (o.decay != DECAY_NONE) {
    CUDACHECK(cudaMalloc(&c.g, maxCount * sizeof(float)));
    fillGKernel<<<gridFor(maxCount), 256, 0, c.stream>>>(c.g, maxCount, c.rank);
    CUDACHECK(cudaGetLastError());
  }
  CUDACHECK(cudaMalloc(&c.dWrong, sizeof(unsigned long long)));
  launchFillX(o.dtype, c.x, maxCount, c.rank, c.stream);
  CUDACHECK(cudaStreamSynchronize(c.stream));

  worldBarrier(w, t);
  if (root) printHeader(o, w, c, lat, upb, isSet);

  const bool graph = o.graphLaunches > 0;
  for (size_t size = o.minBytes; size <= o.maxBytes;) {
    const size_t count = size / c.es;
    const size_t bytes = count * c.es;
    const Layout L = layoutFor(count, o.decay, o.dv);
    std::vector<Row> rows = buildRows(c, count, L);

    // Workspace: the largest any scan row needs at this size, allocated before timing.
    size_t need = 0;
    for (const Row& r : rows) {
      if (r.kind != OP_SCAN || !r.skip.empty()) continue;
      allscanScanArgs_t a = scanArgs(c, r, count, L);
      size_t b = 0;
      ASCHECK(allscanWorkspaceSize(c.comm, &a, &b));
      need = std::max(need, b);
    }
    if (need > c.wsBytes) {
      if (c.ws) CUDACHECK(cudaFree(c.ws));
      CUDACHECK(cudaMalloc(&c.ws, need));
      c.wsBytes = need;
    }

    // Warm-up (and graph capture) per row.
    for (Row& r : rows) {
      if (!r.skip.empty()) continue;
      for (int i = 0; i < o.warmup; ++i) launchRow(c, r, count, L);
      if (graph) {
        CUDACHECK(cudaStreamSynchronize(c.stream));
        CUDACHECK(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeThreadLocal));
        for (int i = 0; i < o.iters; ++i) launchRow(c, r, count, L);
        CUDACHECK(cudaStreamEndCapture(c.stream, &r.graph));
        CUDACHECK(cudaGraphInstantiate(&r.exec, r.graph, 0));
        CUDACHECK(cudaGraphLaunch(r.exec, c.stream));  // first replay uploads the graph
      }
    }
    CUDACHECK(cudaStreamSynchronize(c.stream));

    // Timed repeats, every row once per repeat (interleaved).
    for (int rep = 0; rep < o.repeats; ++rep) {
      for (Row& r : rows) {
        if (!r.skip.empty()) continue;
        worldBarrier(w, t);
        CUDACHECK(cudaEventRecord(c.ev0, c.stream));
        if (graph) {
          for (int l = 0; l < o.graphLaunches; ++l) CUDACHECK(cudaGraphLaunch(r.exec, c.stream));
        } else {
          for (int i = 0; i < o.iters; ++i) {
            launchRow(c, r, count, L);
            if (o.blocking) CUDACHECK(cudaStreamSynchronize(c.stream));
          }
        }
        CUDACHECK(cudaEventRecord(c.ev1, c.stream));
        CUDACHECK(cudaEventSynchronize(c.ev1));
        float ms = 0;
        CUDACHECK(cudaEventElapsedTime(&ms, c.ev0, c.ev1));
        const double n = static_cast<double>(o.iters) * (graph ? o.graphLaunches : 1);
        r.times.push_back(allMax(w, t, 1000.0 * ms / n));
      }
    }

    // Check: pre-fill the output with NaN, run once, count wrong elements on the GPU.
    for (Row& r : rows) {
      if (!r.skip.empty()) continue;
      if (o.check) {
        CheckParams p;
        p.rank = c.rank;
        p.nranks = P;
        p.reverse = o.reverse;
        p.count = count;
        p.inner = (r.kind == OP_SCAN && o.decay != DECAY_NONE) ? count / L.gCount : 0;
        const void* outp = nullptr;
        size_t outBytes = bytes;
        switch (r.kind) {
          case OP_CHAIN: p.mode = CHK_RECV_CHAIN; outp = c.recv; break;
          case OP_RING: p.mode = CHK_RECV_RING; outp = c.recv; break;
          case OP_ALLGATHER: p.mode = CHK_ALLGATHER; outp = c.ag; outBytes = bytes * P; break;
          case OP_ALLREDUCE: p.mode = CHK_ALLREDUCE; outp = c.ar; break;
          case OP_SCAN: p.mode = CHK_SCAN; outp = c.y; break;
        }
        CUDACHECK(cudaMemsetAsync(const_cast<void*>(outp), 0xff, outBytes, c.stream));
        CUDACHECK(cudaMemsetAsync(c.dWrong, 0, sizeof(unsigned long long), c.stream));
        launchRow(c, r, count, L);
        if (P == 1 && (r.kind == OP_CHAIN || r.kind == OP_RING)) {
          // One rank: nothing is sent; the ring "receives" its own state trivially. Skip the check.
        } else {
          launchCheck(o.dtype, outp, p, c.dWrong, c.stream);
        }
        unsigned long long h = 0;
        CUDACHECK(cudaMemcpyAsync(&h, c.dWrong, sizeof(h), cudaMemcpyDeviceToHost, c.stream));
        CUDACHECK(cudaStreamSynchronize(c.stream));
        r.wrong = allSum(w, t, h);
        r.checked = true;
      }
      if (r.exec) CUDACHECK(cudaGraphExecDestroy(r.exec));
      if (r.graph) CUDACHECK(cudaGraphDestroy(r.graph));
      r.exec = nullptr;
      r.graph = nullptr;
    }

    // Report (root).
    if (root) {
      double floorUs = 0;
      for (const Row& r : rows) {
        if (!r.skip.empty() || r.times.empty()) continue;
        if (r.kind == OP_CHAIN || (floorUs == 0 && r.kind == OP_RING)) {
          std::vector<double> v = r.times;
          std::sort(v.begin(), v.end());
          floorUs = v[v.size() / 2];
          if (r.kind == OP_CHAIN) break;
        }
      }
      for (Row& r : rows) {
        const std::string K = kLabel(r);
        if (!r.skip.empty()) {
          printf("  %12zu %12zu %9s %-15s %8s %10s   skipped: %s\n", bytes, count, dtypeName(o.dtype), r.name.c_str(),
                 K.c_str(), "-", r.skip.c_str());
          out->rowsJson.push_back("{\"size\":" + std::to_string(bytes) + ",\"count\":" + std::to_string(count) +
                                  ",\"type\":\"" + dtypeName(o.dtype) + "\",\"op\":\"" + r.name +
                                  "\",\"skipped\":\"" + jsonEscape(r.skip) + "\"}");
          continue;
        }
        std::vector<double> v = r.times;
        std::sort(v.begin(), v.end());
        const size_t n = v.size();
        r.median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
        r.tmin = v.front();
        const double algbw = bytes / r.median / 1e3;  // GB/s
        const double busbw = algbw * r.busFactor;
        const double ratio = floorUs > 0 ? r.median / floorUs : NAN;
        char wrongS[32], ratioS[32];
        if (r.checked) snprintf(wrongS, sizeof(wrongS), "%llu", r.wrong);
        else snprintf(wrongS, sizeof(wrongS), "N/A");
        if (std::isfinite(ratio)) snprintf(ratioS, sizeof(ratioS), "%.3f", ratio);
        else snprintf(ratioS, sizeof(ratioS), "-");
        printf("  %12zu %12zu %9s %-15s %8s %10.2f %8.2f %8.2f %8s %8s\n", bytes, count, dtypeName(o.dtype),
               r.name.c_str(), K.c_str(), r.median, algbw, busbw, wrongS, ratioS);
        if (r.checked) {
          out->wrongTotal += r.wrong;
          out->anyChecked = true;
        }
        if (r.kind == OP_SCAN && r.method == allscanPipelined && r.K == 0) {
          out->busbwSum += busbw;
          out->busbwN += 1;
        }
        std::string times;
        for (double x : r.times) times += (times.empty() ? "" : ",") + jnum(x);
        std::string j = "{\"size\":" + std::to_string(bytes) + ",\"count\":" + std::to_string(count) +
                        ",\"type\":\"" + dtypeName(o.dtype) + "\",\"op\":\"" + r.name + "\"";
        if (r.kind == OP_SCAN) {
          j += ",\"method\":\"" + std::string(methodName(r.method)) + "\",\"K\":" + std::to_string(r.Keff) +
               ",\"K_auto\":" + (r.K == 0 ? "true" : "false");
        } else {
          j += ",\"method\":null,\"K\":null,\"K_auto\":false";
        }
        j += ",\"time_us\":" + jnum(r.median) + ",\"time_us_min\":" + jnum(r.tmin) + ",\"time_us_repeats\":[" + times +
             "]" + ",\"algbw_GBps\":" + jnum(algbw) + ",\"busbw_GBps\":" + jnum(busbw) +
             ",\"bus_factor\":" + jnum(r.busFactor) +
             ",\"wrong\":" + (r.checked ? std::to_string(r.wrong) : std::string("null")) +
             ",\"vs_floor\":" + jnum(ratio) + ",\"layout\":[" + std::to_string(L.H) + "," + std::to_string(L.Dk) +
             "," + std::to_string(L.Dv) + "],\"g_count\":" + std::to_string(o.decay == DECAY_NONE ? 0 : L.gCount) +
             "}";
        out->rowsJson.push_back(j);
      }
      fflush(stdout);
    }

    // Next size (nccl-tests rule), guarding against overflow.
    size_t next = o.stepFactor > 1 ? size * static_cast<size_t>(o.stepFactor) : size + o.stepBytes;
    if (next <= size) break;
    size = next;
  }

  worldBarrier(w, t);
  if (c.ws) CUDACHECK(cudaFree(c.ws));
  CUDACHECK(cudaFree(c.x));
  CUDACHECK(cudaFree(c.y));
  if (c.recv) CUDACHECK(cudaFree(c.recv));
  if (c.ag) CUDACHECK(cudaFree(c.ag));
  if (c.ar) CUDACHECK(cudaFree(c.ar));
  if (c.g) CUDACHECK(cudaFree(c.g));
  CUDACHECK(cudaFree(c.dWrong));
  CUDACHECK(cudaEventDestroy(c.ev0));
  CUDACHECK(cudaEventDestroy(c.ev1));
  CUDACHECK(cudaStreamDestroy(c.stream));
  ASCHECK(allscanCommDestroy(c.comm));
  worldBarrier(w, t);
  NCCLCHECK(ncclCommDestroy(c.nccl));
  if (root) {
    // Summary and JSON, with the link model the automatic K came from.
    if (out->busbwN)
      printf("# Avg bus bandwidth (scan-pipelined, auto K) : %g GB/s\n", out->busbwSum / out->busbwN);
    if (out->anyChecked)
      printf("# Out of bounds values : %llu %s\n", out->wrongTotal, out->wrongTotal ? "FAILED" : "OK");
    else
      printf("# Out of bounds values : not checked (-c 0)\n");
    if (!o.json.empty()) {
      FILE* f = fopen(o.json.c_str(), "w");
      if (!f) die("-j (json): cannot open '%s' for writing: %s", o.json.c_str(), strerror(errno));
      int ncclVer = 0;
      ncclGetVersion(&ncclVer);
      std::string ks;
      for (int k : o.fixedK) ks += (ks.empty() ? "" : ",") + std::to_string(k);
      std::string ms;
      for (auto m : o.methods) ms += std::string(ms.empty() ? "" : ",") + "\"" + methodName(m) + "\"";
      std::string devs;
      for (const auto& l : w.deviceLines) devs += (devs.empty() ? "" : ",") + std::string("\"") + jsonEscape(l) + "\"";
      fprintf(f, "{\n\"tool\":\"allscan_perf\",\n\"allscan_version\":\"%d.%d.%d\",\n\"nccl_version\":%d,\n",
              ALLSCAN_VERSION_MAJOR, ALLSCAN_VERSION_MINOR, ALLSCAN_VERSION_PATCH, ncclVer);
      fprintf(f, "\"nranks\":%d,\n\"nprocs\":%d,\n\"gpus_per_proc\":%d,\n\"devices\":[%s],\n", w.nranks, w.nprocs,
              w.nthreads, devs.c_str());
      fprintf(f,
              "\"config\":{\"minbytes\":%zu,\"maxbytes\":%zu,\"stepfactor\":%ld,\"stepbytes\":%zu,\"iters\":%d,"
              "\"warmup\":%d,\"repeats\":%d,\"check\":%d,\"blocking\":%d,\"graph_launches\":%d,\"dtype\":\"%s\","
              "\"reverse\":%d,\"decay\":\"%s\",\"vdim\":%d,\"methods\":[%s],\"fixed_K\":[%s]},\n",
              o.minBytes, o.maxBytes, o.stepFactor, o.stepBytes, o.iters, o.warmup, o.repeats, o.check, o.blocking,
              o.graphLaunches, dtypeName(o.dtype), o.reverse, kDecayNames[o.decay], o.dv, ms.c_str(), ks.c_str());
      fprintf(f, "\"link_model\":{\"set\":%s,\"source\":\"%s\",\"latency_us\":%s,\"us_per_byte\":%s},\n",
              isSet ? "true" : "false", o.link == LINK_SET ? "-L" : (o.link == LINK_CALIBRATE ? "calibrate" : "none"),
              jnum(lat).c_str(), jnum(upb).c_str());
      fprintf(f, "\"wrong_total\":%s,\n\"rows\":[\n", out->anyChecked ? std::to_string(out->wrongTotal).c_str() : "null");
      for (size_t i = 0; i < out->rowsJson.size(); ++i)
        fprintf(f, "%s%s\n", out->rowsJson[i].c_str(), i + 1 < out->rowsJson.size() ? "," : "");
      fprintf(f, "]\n}\n");
      if (fclose(f) != 0) die("-j (json): writing '%s' failed: %s", o.json.c_str(), strerror(errno));
      printf("# Wrote %s\n", o.json.c_str());
    }
    fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  try {
    if (!parseArgs(argc, argv, &o)) return 0;
  } catch (const ArgError& e) {
    fprintf(stderr, "%s: error: %s\n", kProg, e.msg.c_str());
    fprintf(stderr, "Run '%s -h' for usage.\n", kProg);
    return 2;
  }

  World w(o.ngpus);
#ifdef ALLSCAN_PERF_MPI
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_FUNNELED, &provided);
  MPI_Comm_size(MPI_COMM_WORLD, &w.nprocs);
  MPI_Comm_rank(MPI_COMM_WORLD, &w.proc);
  int localRank = 0;
  {
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, w.proc, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &localRank);
    MPI_Comm_free(&local);
  }
#else
  const int localRank = 0;
#endif
  w.nranks = w.nprocs * w.nthreads;

  int ndev = 0;
  {
    cudaError_t e = cudaGetDeviceCount(&ndev);
    if (e != cudaSuccess) die("no usable CUDA device: cudaGetDeviceCount: %s (%s)", cudaGetErrorString(e), cudaGetErrorName(e));
  }
  const int firstDev = localRank * o.ngpus;
  if (firstDev + o.ngpus > ndev)
    die("-g (ngpus) %d: this process needs GPUs %d..%d but sees %d GPU%s", o.ngpus, firstDev, firstDev + o.ngpus - 1,
        ndev, ndev == 1 ? "" : "s");

  ncclUniqueId id;
  if (w.proc == 0) NCCLCHECK(ncclGetUniqueId(&id));
#ifdef ALLSCAN_PERF_MPI
  MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
#endif

  Collected out;
  std::vector<std::thread> threads;
  // Thread 0 runs on the main thread (it is the one that calls MPI).
  for (int t = 1; t < o.ngpus; ++t)
    threads.emplace_back([&, t] { runRank(o, w, t, id, firstDev + t, &out); });
  runRank(o, w, 0, id, firstDev, &out);
  for (auto& th : threads) th.join();

  int rc = (out.anyChecked && out.wrongTotal) ? 1 : 0;
#ifdef ALLSCAN_PERF_MPI
  MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
  MPI_Finalize();
#endif
  return rc;
}
