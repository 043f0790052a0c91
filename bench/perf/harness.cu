// allscan_perf's harness (see harness.h): the command line, the ranks, the timing, the table and
// the JSON. The rows of each collective live in their own file (scan.cu, a2a.cu).
#include "harness.h"

#include <getopt.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#ifdef ALLSCAN_PERF_MPI
#include <mpi.h>
#endif

namespace perf {

const char* const kProg = "allscan_perf";

namespace {
thread_local int tlsRank = -1;
std::mutex gPrintMutex;
}  // namespace

void argError(const std::string& msg) { throw ArgError{msg}; }

void die(const char* fmt, ...) {
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
  std::_Exit(1);
}

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

void parseSignatureRows(SignatureRows* s, const char* arg) {
  const std::string v(arg);
  if (v != "on" && v != "off" && v != "both") argError("-S (signature): expected on, off or both, got '" + v + "'");
  s->on = v != "off";
  s->off = v != "on";
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

const char* dtypeName(allscanDataType_t t) {
  switch (t) {
    case allscanFloat32: return "float";
    case allscanFloat16: return "half";
    case allscanBfloat16: return "bfloat16";
    case allscanFloat64: return "double";
  }
  return "?";
}

template <typename T>
__global__ void fillXKernel(T* x, size_t count, int rank) {
  for (size_t e = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; e < count;
       e += static_cast<size_t>(gridDim.x) * blockDim.x)
    x[e] = fromFloat<T>(xval(rank, e));
}

void launchFillX(allscanDataType_t t, void* x, size_t count, int rank, cudaStream_t s) {
  dispatchDtype(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    fillXKernel<T><<<gridFor(count), 256, 0, s>>>(static_cast<T*>(x), count, rank);
  });
  CUDACHECK(cudaGetLastError());
}

// ------------------------------------------------------------------------------------------------
// Options (parsed and validated before any CUDA or NCCL call)
// ------------------------------------------------------------------------------------------------
namespace {

struct CommonOption {
  char letter;
  const char* longName;
  int hasArg;
};
const CommonOption kCommon[] = {
    {'o', "op", required_argument},        {'b', "minbytes", required_argument},
    {'e', "maxbytes", required_argument},  {'i', "stepbytes", required_argument},
    {'f', "stepfactor", required_argument}, {'g', "ngpus", required_argument},
    {'n', "iters", required_argument},     {'w', "warmup_iters", required_argument},
    {'N', "repeats", required_argument},   {'c', "check", required_argument},
    {'d', "datatype", required_argument},  {'z', "blocking", required_argument},
    {'G', "cudagraph", required_argument}, {'j', "json", required_argument},
    {'h', "help", no_argument}};

std::string collectiveNames() {
  std::string s;
  for (const Collective* c : collectives()) s += (s.empty() ? "" : "|") + std::string(c->name);
  return s;
}

void usage(FILE* f) {
  fprintf(f,
          "Usage: %s [options]\n"
          "allscan's collectives against their NCCL floors, nccl-tests conventions: every row is timed\n"
          "side by side (interleaved repeats) and checked on the GPU against exactly representable values.\n"
          "Sizes take K, M, G suffixes (powers of 1024), e.g. 4K, 256M.\n"
          "\n"
          "  -o, --op <name>             the row set: %s (default %s)\n"
          "  -b, --minbytes <size>       smallest size in bytes per rank (default 32M)\n"
          "  -e, --maxbytes <size>       largest size (default 32M)\n"
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
          "  -j, --json <file>           also write every row as JSON to <file>\n"
          "  -h, --help                  this help\n",
          kProg, collectiveNames().c_str(), collectives().front()->name);
  for (const Collective* c : collectives()) {
    fprintf(f, "\n-o %s: %s\n", c->name, c->about);
    for (const OptionSpec& s : c->options) {
      std::string flag = s.hasArg == optional_argument
                             ? std::string("-") + s.letter + "[" + s.metavar + "], --" + s.longName + "[=" + s.metavar + "]"
                             : std::string("-") + s.letter + ", --" + s.longName + " " + s.metavar;
      fprintf(f, "  %-26s  %s\n", flag.c_str(), s.help);
    }
  }
  fprintf(f,
          "\nExample (2 GPUs): %s -b 4K -e 256M -f 2 -g 2 -j perf.json\n"
          "                  %s -o a2a -b 1M -e 256M -f 2 -g 2 -j a2a.json\n",
          kProg, kProg);
}

const Collective* findCollective(const std::string& name) {
  for (const Collective* c : collectives())
    if (name == c->name) return c;
  return nullptr;
}

// Returns false when -h was given (usage printed). Throws ArgError on a bad argument.
bool parseArgs(int argc, char** argv, Options* o) {
  // One getopt table: the common options and every collective's (a letter two collectives share
  // is one entry); a collective's option is handed to it once -o is known.
  std::vector<struct option> longopts;
  std::string shortopts = ":";
  std::vector<char> seen;
  auto add = [&](char letter, const char* name, int hasArg) {
    if (std::find(seen.begin(), seen.end(), letter) != seen.end()) return;
    seen.push_back(letter);
    longopts.push_back({name, hasArg, nullptr, letter});
    shortopts += letter;
    if (hasArg == required_argument) shortopts += ":";
    if (hasArg == optional_argument) shortopts += "::";
  };
  for (const CommonOption& c : kCommon) add(c.letter, c.longName, c.hasArg);
  for (const Collective* coll : collectives())
    for (const OptionSpec& s : coll->options) add(s.letter, s.longName, s.hasArg);
  longopts.push_back({nullptr, 0, nullptr, 0});

  struct Deferred {
    int letter;
    std::string arg;
    bool hasArg;
  };
  std::vector<Deferred> deferred;
  o->coll = collectives().front();
  opterr = 0;
  optind = 1;
  int c;
  while ((c = getopt_long(argc, argv, shortopts.c_str(), longopts.data(), nullptr)) != -1) {
    switch (c) {
      case 'o':
        o->coll = findCollective(optarg);
        if (o->coll == nullptr) argError(std::string("-o (op): expected ") + collectiveNames() + ", got '" + optarg + "'");
        break;
      case 'b': o->minBytes = parseSize("-b (minbytes)", optarg); break;
      case 'e': o->maxBytes = parseSize("-e (maxbytes)", optarg); break;
      case 'i': o->stepBytes = parseSize("-i (stepbytes)", optarg); break;
      case 'f': o->stepFactor = parseInt("-f (stepfactor)", optarg, 1, 1 << 20, "an integer step factor >= 1"); break;
      case 'g': o->ngpus = static_cast<int>(parseInt("-g (ngpus)", optarg, 1, 1024, "a GPU count >= 1")); break;
      case 'n': o->iters = static_cast<int>(parseInt("-n (iters)", optarg, 1, 100000000, "an iteration count >= 1")); break;
      case 'w': o->warmup = static_cast<int>(parseInt("-w (warmup_iters)", optarg, 0, 100000000, "an iteration count >= 0")); break;
      case 'N': o->repeats = static_cast<int>(parseInt("-N (repeats)", optarg, 1, 100000, "a repeat count >= 1")); break;
      case 'c': o->check = static_cast<int>(parseInt("-c (check)", optarg, 0, 1, "0 or 1")); break;
      case 'z': o->blocking = static_cast<int>(parseInt("-z (blocking)", optarg, 0, 1, "0 or 1")); break;
      case 'G': o->graphLaunches = static_cast<int>(parseInt("-G (cudagraph)", optarg, 0, 1000000, "a graph launch count >= 0")); break;
      case 'd': {
        std::string s(optarg);
        if (s == "float" || s == "float32" || s == "fp32") o->dtype = allscanFloat32;
        else if (s == "half" || s == "float16" || s == "fp16") o->dtype = allscanFloat16;
        else if (s == "bfloat16" || s == "bf16") o->dtype = allscanBfloat16;
        else if (s == "double" || s == "float64" || s == "fp64") o->dtype = allscanFloat64;
        else argError("-d (datatype): expected float, half, bfloat16 or double, got '" + s + "'");
        break;
      }
      case 'j': o->json = optarg; if (o->json.empty()) argError("-j (json): expected a file name"); break;
      case 'h': usage(stdout); return false;
      case ':': argError(std::string("option -") + static_cast<char>(optopt) + " needs a value (see -h)");
      case '?':
        if (optopt) argError(std::string("unknown option -") + static_cast<char>(optopt) + " (see -h)");
        argError(std::string("unknown option '") + argv[optind - 1] + "' (see -h)");
      default: deferred.push_back({c, optarg ? optarg : "", optarg != nullptr}); break;
    }
  }
  if (optind < argc) {
    const std::string prev = argv[optind - 1];
    if (prev == "-r" || prev == "--reverse")
      argError(std::string("unexpected argument '") + argv[optind] + "': -r takes its value attached (-r, -r0, -r1 or --reverse=1)");
    argError(std::string("unexpected argument '") + argv[optind] + "' (options take the form -b 4K; see -h)");
  }
  for (const Deferred& d : deferred) {
    bool mine = false;
    for (const OptionSpec& s : o->coll->options) mine = mine || s.letter == d.letter;
    if (!mine) {
      std::string owners;
      for (const Collective* coll : collectives())
        for (const OptionSpec& s : coll->options)
          if (s.letter == d.letter) owners += (owners.empty() ? "-o " : " or -o ") + std::string(coll->name);
      argError(std::string("-") + static_cast<char>(d.letter) + " is an option of " + owners + ", not of -o " +
               o->coll->name + " (see -h)");
    }
    o->coll->parse(d.letter, d.hasArg ? d.arg.c_str() : nullptr);
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
  o->coll->validate(*o);
  return true;
}

}  // namespace

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

namespace {

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

struct Collected {
  std::vector<std::string> rowsJson;
  unsigned long long wrongTotal = 0;
  bool anyChecked = false;
  double busbwSum = 0;
  int busbwN = 0;
};

void printHeader(const Options& o, const World& w, const std::vector<std::string>& lines) {
  int ncclVer = 0;
  ncclGetVersion(&ncclVer);
  printf("# %s: %s (allscan %d.%d.%d, NCCL %d.%d.%d), nccl-tests conventions\n", kProg, o.coll->title,
         ALLSCAN_VERSION_MAJOR, ALLSCAN_VERSION_MINOR, ALLSCAN_VERSION_PATCH, ncclVer / 10000, (ncclVer / 100) % 100,
         ncclVer % 100);
  printf("#  nranks %d (%d process%s x %d GPU%s)  minBytes %zu maxBytes %zu step: %zu(%s)\n", w.nranks, w.nprocs,
         w.nprocs == 1 ? "" : "es", w.nthreads, w.nthreads == 1 ? "" : "s", o.minBytes, o.maxBytes,
         o.stepFactor > 1 ? static_cast<size_t>(o.stepFactor) : o.stepBytes, o.stepFactor > 1 ? "factor" : "bytes");
  printf("#  warmup iters: %d iters: %d repeats: %d (median reported) validation: %d graph: %d blocking: %d\n",
         o.warmup, o.iters, o.repeats, o.check, o.graphLaunches, o.blocking);
  for (const std::string& l : lines) printf("%s\n", l.c_str());
  printf("#\n#  Using devices\n");
  for (const auto& l : w.deviceLines) printf("%s\n", l.c_str());
  printf("#\n");
  printf("# %12s %12s %9s %-15s %8s %10s %8s %8s %8s %8s\n", "size", "count", "type", "op", "K", "time", "algbw",
         "busbw", "#wrong", "vs_floor");
  printf("# %12s %12s %9s %-15s %8s %10s %8s %8s %8s %8s\n", "(B)", "(elements)", "", "", "", "(us)", "(GB/s)",
         "(GB/s)", "", "(x)");
  fflush(stdout);
}

// The table's rows at one size, and their JSON (root rank).
void report(const Options& o, std::vector<Row>& rows, size_t count, size_t bytes, Collected* out) {
  double floorUs = 0;
  int floorRank = 0;
  for (const Row& r : rows) {
    if (!r.skip.empty() || r.times.empty() || r.floorRank == 0) continue;
    if (floorRank == 0 || r.floorRank < floorRank) {
      std::vector<double> v = r.times;
      std::sort(v.begin(), v.end());
      floorUs = v[v.size() / 2];
      floorRank = r.floorRank;
    }
  }
  const std::string head = "{\"size\":" + std::to_string(bytes) + ",\"count\":" + std::to_string(count) +
                           ",\"type\":\"" + dtypeName(o.dtype) + "\",\"op\":\"";
  for (Row& r : rows) {
    if (!r.skip.empty()) {
      printf("  %12zu %12zu %9s %-15s %8s %10s   skipped: %s\n", bytes, count, dtypeName(o.dtype), r.name.c_str(),
             r.kLabel.c_str(), "-", r.skip.c_str());
      out->rowsJson.push_back(head + r.name + "\",\"skipped\":\"" + jsonEscape(r.skip) + "\"}");
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
           r.name.c_str(), r.kLabel.c_str(), r.median, algbw, busbw, wrongS, ratioS);
    if (r.checked) {
      out->wrongTotal += r.wrong;
      out->anyChecked = true;
    }
    if (r.inSummary) {
      out->busbwSum += busbw;
      out->busbwN += 1;
    }
    std::string times;
    for (double x : r.times) times += (times.empty() ? "" : ",") + jsonNumber(x);
    out->rowsJson.push_back(head + r.name + "\"" + r.jsonFields + ",\"time_us\":" + jsonNumber(r.median) +
                            ",\"time_us_min\":" + jsonNumber(r.tmin) + ",\"time_us_repeats\":[" + times + "]" +
                            ",\"algbw_GBps\":" + jsonNumber(algbw) + ",\"busbw_GBps\":" + jsonNumber(busbw) +
                            ",\"bus_factor\":" + jsonNumber(r.busFactor) +
                            ",\"wrong\":" + (r.checked ? std::to_string(r.wrong) : std::string("null")) +
                            ",\"vs_floor\":" + jsonNumber(ratio) + r.jsonTail + "}");
  }
  fflush(stdout);
}

void writeJson(const Options& o, const World& w, Bench& bench, const Collected& out) {
  FILE* f = fopen(o.json.c_str(), "w");
  if (!f) die("-j (json): cannot open '%s' for writing: %s", o.json.c_str(), strerror(errno));
  int ncclVer = 0;
  ncclGetVersion(&ncclVer);
  std::string devs;
  for (const auto& l : w.deviceLines) devs += (devs.empty() ? "" : ",") + std::string("\"") + jsonEscape(l) + "\"";
  fprintf(f, "{\n\"tool\":\"allscan_perf\",\n\"op\":\"%s\",\n\"allscan_version\":\"%d.%d.%d\",\n\"nccl_version\":%d,\n",
          o.coll->name, ALLSCAN_VERSION_MAJOR, ALLSCAN_VERSION_MINOR, ALLSCAN_VERSION_PATCH, ncclVer);
  fprintf(f, "\"nranks\":%d,\n\"nprocs\":%d,\n\"gpus_per_proc\":%d,\n\"devices\":[%s],\n", w.nranks, w.nprocs,
          w.nthreads, devs.c_str());
  fprintf(f,
          "\"config\":{\"minbytes\":%zu,\"maxbytes\":%zu,\"stepfactor\":%ld,\"stepbytes\":%zu,\"iters\":%d,"
          "\"warmup\":%d,\"repeats\":%d,\"check\":%d,\"blocking\":%d,\"graph_launches\":%d,\"dtype\":\"%s\"%s},\n",
          o.minBytes, o.maxBytes, o.stepFactor, o.stepBytes, o.iters, o.warmup, o.repeats, o.check, o.blocking,
          o.graphLaunches, dtypeName(o.dtype), bench.configJson().c_str());
  fprintf(f, "%s", bench.topJson().c_str());
  fprintf(f, "\"wrong_total\":%s,\n\"rows\":[\n", out.anyChecked ? std::to_string(out.wrongTotal).c_str() : "null");
  for (size_t i = 0; i < out.rowsJson.size(); ++i)
    fprintf(f, "%s%s\n", out.rowsJson[i].c_str(), i + 1 < out.rowsJson.size() ? "," : "");
  fprintf(f, "]\n}\n");
  if (fclose(f) != 0) die("-j (json): writing '%s' failed: %s", o.json.c_str(), strerror(errno));
  printf("# Wrote %s\n", o.json.c_str());
}

// ------------------------------------------------------------------------------------------------
// One rank
// ------------------------------------------------------------------------------------------------
void timeRows(RankCtx& c, Bench& bench, std::vector<Row>& rows, size_t count, cudaEvent_t ev0, cudaEvent_t ev1) {
  const Options& o = *c.o;
  const bool graph = o.graphLaunches > 0;
  // Warm-up (and graph capture) per row.
  for (Row& r : rows) {
    if (!r.skip.empty()) continue;
    for (int i = 0; i < o.warmup; ++i) bench.launch(r, count);
    if (graph) {
      CUDACHECK(cudaStreamSynchronize(c.stream));
      CUDACHECK(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeThreadLocal));
      for (int i = 0; i < o.iters; ++i) bench.launch(r, count);
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
      worldBarrier(*c.w, c.t);
      CUDACHECK(cudaEventRecord(ev0, c.stream));
      if (graph) {
        for (int l = 0; l < o.graphLaunches; ++l) CUDACHECK(cudaGraphLaunch(r.exec, c.stream));
      } else {
        for (int i = 0; i < o.iters; ++i) {
          bench.launch(r, count);
          if (o.blocking) CUDACHECK(cudaStreamSynchronize(c.stream));
        }
      }
      CUDACHECK(cudaEventRecord(ev1, c.stream));
      CUDACHECK(cudaEventSynchronize(ev1));
      float ms = 0;
      CUDACHECK(cudaEventElapsedTime(&ms, ev0, ev1));
      const double n = static_cast<double>(o.iters) * (graph ? o.graphLaunches : 1);
      r.times.push_back(allMax(*c.w, c.t, 1000.0 * ms / n));
    }
  }
}

// Check every row once (pre-filled output, one run, wrong elements counted on the GPU).
void checkRows(RankCtx& c, Bench& bench, std::vector<Row>& rows, size_t count, unsigned long long* dWrong) {
  for (Row& r : rows) {
    if (!r.skip.empty()) continue;
    if (c.o->check) {
      CUDACHECK(cudaMemsetAsync(dWrong, 0, sizeof(unsigned long long), c.stream));
      bench.check(r, count, dWrong);
      unsigned long long h = 0;
      CUDACHECK(cudaMemcpyAsync(&h, dWrong, sizeof(h), cudaMemcpyDeviceToHost, c.stream));
      CUDACHECK(cudaStreamSynchronize(c.stream));
      r.wrong = allSum(*c.w, c.t, h);
      r.checked = true;
    }
    if (r.exec) CUDACHECK(cudaGraphExecDestroy(r.exec));
    if (r.graph) CUDACHECK(cudaGraphDestroy(r.graph));
    r.exec = nullptr;
    r.graph = nullptr;
  }
}

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
  NCCLCHECK(ncclCommInitRank(&c.nccl, c.nranks, id, c.rank));
  CUDACHECK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  CUDACHECK(cudaEventCreate(&ev0));
  CUDACHECK(cudaEventCreate(&ev1));
  unsigned long long* dWrong = nullptr;
  CUDACHECK(cudaMalloc(&dWrong, sizeof(unsigned long long)));

  std::unique_ptr<Bench> bench = o.coll->make(c);
  bench->setup();
  CUDACHECK(cudaStreamSynchronize(c.stream));

  worldBarrier(w, t);
  if (root) printHeader(o, w, bench->header());

  for (size_t size = o.minBytes; size <= o.maxBytes;) {
    const size_t count = bench->count(size);
    const size_t bytes = count * c.es;
    std::vector<Row> rows = bench->rows(count);
    bench->prepare(rows, count);
    timeRows(c, *bench, rows, count, ev0, ev1);
    checkRows(c, *bench, rows, count, dWrong);
    if (root) report(o, rows, count, bytes, out);

    // Next size (nccl-tests rule), guarding against overflow.
    size_t next = o.stepFactor > 1 ? size * static_cast<size_t>(o.stepFactor) : size + o.stepBytes;
    if (next <= size) break;
    size = next;
  }

  worldBarrier(w, t);
  bench->teardown();
  CUDACHECK(cudaFree(dWrong));
  CUDACHECK(cudaEventDestroy(ev0));
  CUDACHECK(cudaEventDestroy(ev1));
  CUDACHECK(cudaStreamDestroy(c.stream));
  worldBarrier(w, t);
  NCCLCHECK(ncclCommDestroy(c.nccl));
  if (root) {
    if (out->busbwN)
      printf("# Avg bus bandwidth (%s) : %g GB/s\n", o.coll->summaryLabel, out->busbwSum / out->busbwN);
    if (out->anyChecked)
      printf("# Out of bounds values : %llu %s\n", out->wrongTotal, out->wrongTotal ? "FAILED" : "OK");
    else
      printf("# Out of bounds values : not checked (-c 0)\n");
    if (!o.json.empty()) writeJson(o, w, *bench, *out);
    fflush(stdout);
  }
}

}  // namespace

std::string jsonNumber(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

}  // namespace perf

int main(int argc, char** argv) {
  using namespace perf;
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
