// common.cuh: types, dtype codes and small device helpers shared by every cupyconv kernel.
//
// Strides are in elements and 64-bit everywhere. Inputs whose dtype is not a template
// parameter (weight, bias, states, seq_idx) are passed as `const void*` with a dtype code and
// read through load_as<>(), so one kernel instance serves every combination of those dtypes.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long int64;

// Dtype codes; the Python side has the same table (cupyconv/_dispatch.py: DTYPE_CODES).
enum DtypeCode : int { F32 = 0, F16 = 1, BF16 = 2, F64 = 3, I32 = 4, I64 = 5 };

// Accumulation type: float32, or float64 for float64 data.
template <typename T> struct AccOf { using type = float; };
template <> struct AccOf<double> { using type = double; };

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}
template <typename T> __device__ __forceinline__ T from_acc(double v);
template <> __device__ __forceinline__ double from_acc<double>(double v) { return v; }

// Element i of a float array of run-time dtype `code`, converted to A.
template <typename A>
__device__ __forceinline__ A load_as(const void* p, int code, int64 i) {
    switch (code) {
        case F32: return (A)static_cast<const float*>(p)[i];
        case F16: return (A)__half2float(static_cast<const __half*>(p)[i]);
        case BF16: return (A)__bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
        default: return (A)static_cast<const double*>(p)[i];
    }
}

// Calls f(typed pointer) for the float array p of run-time dtype `code`: lets a fully unrolled
// loop of loads be generated once per dtype instead of a switch per element.
template <typename F>
__device__ __forceinline__ void with_dtype(const void* p, int code, F&& f) {
    switch (code) {
        case F32: f(static_cast<const float*>(p)); break;
        case F16: f(static_cast<const __half*>(p)); break;
        case BF16: f(static_cast<const __nv_bfloat16*>(p)); break;
        default: f(static_cast<const double*>(p)); break;
    }
}

// Element i of an int32 or int64 index array.
__device__ __forceinline__ int64 load_index(const void* p, int code, int64 i) {
    return code == I32 ? (int64)static_cast<const int*>(p)[i] : static_cast<const int64*>(p)[i];
}

// SiLU(z) = z * sigmoid(z). float: fast exp and reciprocal (relative error ~1e-7; exp(-z) = inf
// for z < -88 gives -0, the limit). double: exact.
__device__ __forceinline__ float silu(float z) { return __fdividef(z, 1.0f + __expf(-z)); }
__device__ __forceinline__ double silu(double z) { return z / (1.0 + exp(-z)); }
