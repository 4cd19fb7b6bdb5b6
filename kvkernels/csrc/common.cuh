// Shared by every kernel module. Compiled by NVRTC (through cupy.RawModule)
// with no CUDA headers at all: the fp16/bf16 conversions are written out here
// so the kernels build wherever CuPy imports, whatever toolkit is (not) installed.
//
// Compile-time configuration comes from #defines prepended by kvkernels/cuda.py:
//   DT  storage dtype of pages/queries: 0 = float32, 1 = float16, 2 = bfloat16

typedef unsigned short u16;
#if DT == 0
typedef float T;
#else
typedef u16 T;
#endif

#define FULL_MASK 0xffffffffu
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(u16 x) {
#if DT == 1
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
  return f;
#else
  return __uint_as_float(((unsigned)x) << 16);  // bf16 is the top half of a float
#endif
}

// Element e of a 32-bit word array holding packed T values (little endian).
__device__ __forceinline__ float word_elem(const unsigned* w, int e) {
#if DT == 0
  return __uint_as_float(w[e]);
#else
  return to_f((u16)((w[e >> 1] >> ((e & 1) * 16)) & 0xffffu));
#endif
}

__device__ __forceinline__ T from_f(float f) {
#if DT == 0
  return f;
#elif DT == 1
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  // Round to nearest even, as torch does; keep NaN a (quiet) NaN.
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0u;
  u += 0x7fffu + ((u >> 16) & 1u);
  return (u16)(u >> 16);
#endif
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(FULL_MASK, x, off);
  return x;
}
