// The diagonal All-Scan's one operation, g*y + x in the accumulation dtype, for every kernel that
// computes it (the NCCL combine and fold, the device path).
#pragma once

namespace allscan {
namespace detail {

// A separate multiply and add (no FMA contraction), so the CPU/torch reference, which computes the
// same two rounded operations, is bitwise equal. A decay of exactly zero stops the state: y is read
// as 0 where it is inf or NaN, because IEEE's 0 * inf and 0 * NaN are NaN, which would carry a
// non-finite state past a reset (a packed sequence's start) that one process never reads across.
// Reading 0 (not returning x) keeps the reference's signed zero: g * 0 + x.
__device__ __forceinline__ float combineDecay(float g, float y, float x) {
  return __fadd_rn(__fmul_rn(g, g == 0.0f && !isfinite(y) ? 0.0f : y), x);
}
__device__ __forceinline__ double combineDecay(double g, double y, double x) {
  return __dadd_rn(__dmul_rn(g, g == 0.0 && !isfinite(y) ? 0.0 : y), x);
}

}  // namespace detail
}  // namespace allscan
