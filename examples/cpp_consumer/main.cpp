// Links allscan::allscan from the installed package and uses the C API. Without a GPU it checks
// what needs none (version, a detached communicator, the block rule, argument errors of both
// collectives, which share one last-error message); with
// `--gpu` and one visible GPU it runs a one-rank NCCL scan and checks the result.
#include <allscan/a2a_chunked.h>
#include <allscan/allscan.h>

#include <cstdio>
#include <cstring>
#include <vector>

#define EXPECT(cond)                                                   \
  do {                                                                 \
    if (!(cond)) {                                                     \
      std::fprintf(stderr, "FAILED: %s (line %d)\n", #cond, __LINE__); \
      return 1;                                                        \
    }                                                                  \
  } while (0)

static int runGpu() {
  ncclComm_t nccl;
  int dev = 0;
  EXPECT(ncclCommInitAll(&nccl, 1, &dev) == ncclSuccess);
  allscanComm_t comm;
  EXPECT(allscanCommCreate(nccl, &comm) == allscanSuccess);
  const size_t n = 1000;
  std::vector<float> hx(n), hinit(n), hy(n);
  for (size_t i = 0; i < n; ++i) { hx[i] = float(i); hinit[i] = 2.0f; }
  float *x, *y, *init, *g;
  cudaMalloc(&x, n * 4); cudaMalloc(&y, n * 4); cudaMalloc(&init, n * 4); cudaMalloc(&g, 4);
  float half = 0.5f;
  cudaMemcpy(x, hx.data(), n * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(init, hinit.data(), n * 4, cudaMemcpyHostToDevice);
  cudaMemcpy(g, &half, 4, cudaMemcpyHostToDevice);
  allscanScanArgs_t a{};
  a.x = x; a.y = y; a.count = n; a.dtype = allscanFloat32;
  a.g = g; a.g_count = 1; a.g_dtype = allscanFloat32; a.init = init; a.inclusive = 1;
  size_t ws = 0;
  EXPECT(allscanWorkspaceSize(comm, &a, &ws) == allscanSuccess);
  EXPECT(allscanScan(comm, &a, nullptr, 0, 0) == allscanSuccess);  // one rank: no workspace
  cudaMemcpy(hy.data(), y, n * 4, cudaMemcpyDeviceToHost);
  for (size_t i = 0; i < n; ++i) EXPECT(hy[i] == 0.5f * 2.0f + float(i));
  allscanCommDestroy(comm);
  ncclCommDestroy(nccl);
  std::printf("gpu scan ok\n");
  return 0;
}

int main(int argc, char** argv) {
  EXPECT(allscanGetVersion() == ALLSCAN_VERSION_MAJOR * 10000 + ALLSCAN_VERSION_MINOR * 100 + ALLSCAN_VERSION_PATCH);
  allscanComm_t comm;
  EXPECT(allscanCommCreateDetached(2, 8, &comm) == allscanSuccess);
  EXPECT(allscanSetLinkModel(comm, 10.0, 1.0 / 300e3) == allscanSuccess);
  int k = 0;
  EXPECT(allscanChooseNumBlocks(comm, 64u << 20, &k) == allscanSuccess);
  EXPECT(k == allscanChooseNumBlocksModel(8, 64u << 20, 10.0, 1.0 / 300e3) && k > 1);
  allscanScanArgs_t a{};
  float dummy[2];
  a.x = &dummy[0]; a.y = &dummy[1]; a.count = 10; a.dtype = allscanFloat32;
  a.g = &dummy[0]; a.g_count = 3; a.g_dtype = allscanFloat32;
  EXPECT(allscanCheckArgs(comm, &a) == allscanInvalidArgument);
  EXPECT(std::strstr(allscanGetLastError(), "g_count") != nullptr);
  std::printf("last error names the argument: %s\n", allscanGetLastError());
  allscanCommDestroy(comm);
  // The chunked all-to-all: head maps on the host, and its errors through the same last error.
  int lo[3], hi[3];
  EXPECT(allscanA2ASplitHeads(0, 8, 3, lo, hi) == allscanSuccess);
  EXPECT(lo[0] == 0 && hi[0] == 3 && lo[1] == 3 && hi[1] == 6 && lo[2] == 6 && hi[2] == 8);
  EXPECT(allscanA2ASplitHeads(0, 8, 0, lo, hi) == allscanInvalidArgument);
  EXPECT(std::strstr(allscanGetLastError(), "nranks") != nullptr);
  EXPECT(std::strcmp(allscanA2AGetLastError(), allscanGetLastError()) == 0);
  std::printf("a2a last error: %s\n", allscanA2AGetLastError());
  if (argc > 1 && std::strcmp(argv[1], "--gpu") == 0) return runGpu();
  const int v = allscanGetVersion();  // MAJOR * 10000 + MINOR * 100 + PATCH
  std::printf("consumer ok (allscan %d.%d.%d)\n", v / 10000, v / 100 % 100, v % 100);
  return 0;
}
