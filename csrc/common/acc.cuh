// The accumulation type of each storage dtype and the conversions to and from it, for the kernels
// of every collective: fp32 arithmetic for fp32/fp16/bf16 storage, fp64 for fp64; round to nearest
// even on the way back.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace allscan {
namespace detail {

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type toAcc(T v) { return static_cast<typename Acc<T>::type>(v); }
template <> __device__ __forceinline__ float toAcc<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float toAcc<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T fromAcc(typename Acc<T>::type v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half fromAcc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 fromAcc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

}  // namespace detail
}  // namespace allscan
