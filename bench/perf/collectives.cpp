// The row sets allscan_perf knows (-o <name>), the first the default. A new collective is a new
// file in bench/perf/ defining a perf::Collective, and one line in each list below.
#include "harness.h"

namespace perf {

extern const Collective kScanCollective;  // scan.cu
extern const Collective kA2ACollective;   // a2a.cu
extern const Collective kMatrixCollective;  // matrix.cu

const std::vector<const Collective*>& collectives() {
  static const std::vector<const Collective*> all = {
      &kScanCollective,
      &kA2ACollective,
      &kMatrixCollective,
  };
  return all;
}

}  // namespace perf
