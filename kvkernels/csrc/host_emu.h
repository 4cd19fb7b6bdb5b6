// Host emulation of the CUDA subset that kvkernels/csrc uses, for CPU-only test
// runs (kvkernels/emulate.py). A thread block runs as ucontext coroutines, one
// per thread; a warp synchronises at every shuffle (double-buffered slots),
// the block at __syncthreads. A shuffle reached by only part of a warp, or a
// barrier some threads skipped, aborts: those are real bugs on a GPU too.
// It checks the kernels' arithmetic and indexing, not the GPU memory model.
#include <ucontext.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <algorithm>
#include <functional>
using std::max; using std::min;
struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
static dim3 threadIdx, blockIdx, blockDim, gridDim;
static char* emu_smem;
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned i; memcpy(&i, &f, 4); return i; }
static inline float emu_h2f(unsigned short x) { _Float16 h; memcpy(&h, &x, 2); return (float)h; }
static inline unsigned short emu_f2h(float f) { _Float16 h = (_Float16)f; unsigned short x; memcpy(&x, &h, 2); return x; }

enum { RUN, SHFL, SYNC, DONE };
struct Lane { ucontext_t ctx; int state; long nshfl; std::vector<char> stack; };
static std::vector<Lane> lanes;
static ucontext_t sched_ctx;
static int cur;
static float slots[64][2][32];   // [warp][parity][lane]
static std::function<void()> body;

static void lane_entry() { body(); lanes[cur].state = DONE; swapcontext(&lanes[cur].ctx, &sched_ctx); }
static void yield_as(int st) { lanes[cur].state = st; swapcontext(&lanes[cur].ctx, &sched_ctx); }

static float shfl_impl(float v, int src) {
  Lane& me = lanes[cur];
  int lane = cur & 31, w = cur >> 5, par = me.nshfl & 1;
  slots[w][par][lane] = v;
  yield_as(SHFL);
  me.nshfl++;
  if (src < 0 || src > 31) { fprintf(stderr, "bad shuffle source %d\n", src); abort(); }
  return slots[w][par][src];
}
static inline float __shfl_xor_sync(unsigned mask, float v, int off) { (void)mask; return shfl_impl(v, (cur & 31) ^ off); }
static inline float __shfl_sync(unsigned mask, float v, int src) { (void)mask; return shfl_impl(v, src); }
static inline void __syncthreads() { yield_as(SYNC); }

static void emu_launch(dim3 grid, dim3 block, size_t smem, std::function<void()> fn) {
  int T = block.x;
  if (T % 32 || T > 2048) { fprintf(stderr, "block size %d\n", T); abort(); }
  gridDim = grid; blockDim = block;
  std::vector<char> shared(smem + 16);
  lanes.resize(T);
  for (auto& l : lanes) l.stack.resize(1 << 18);
  body = fn;
  for (unsigned z = 0; z < grid.z; ++z) for (unsigned y = 0; y < grid.y; ++y) for (unsigned x = 0; x < grid.x; ++x) {
    blockIdx = {x, y, z};
    memset(shared.data(), 0xff, shared.size());   // garbage, like real shared memory
    emu_smem = shared.data();
    for (int t = 0; t < T; ++t) {
      Lane& l = lanes[t];
      getcontext(&l.ctx);
      l.ctx.uc_stack.ss_sp = l.stack.data(); l.ctx.uc_stack.ss_size = l.stack.size(); l.ctx.uc_link = nullptr;
      makecontext(&l.ctx, lane_entry, 0);
      l.state = RUN; l.nshfl = 0;
    }
    for (;;) {
      for (int t = 0; t < T; ++t) if (lanes[t].state == RUN) {
        cur = t; threadIdx = {(unsigned)t, 0, 0};
        swapcontext(&sched_ctx, &lanes[t].ctx);
      }
      bool all_done = true, any_sync = false, all_sync_or_done = true;
      for (int w = 0; w < T / 32; ++w) {
        int shfl = 0, done = 0, sync = 0;
        for (int l = 0; l < 32; ++l) { int s = lanes[w * 32 + l].state; shfl += s == SHFL; done += s == DONE; sync += s == SYNC; }
        if (shfl && shfl != 32) { fprintf(stderr, "divergent shuffle in warp %d (%d/32)\n", w, shfl); abort(); }
        if (shfl == 32) for (int l = 0; l < 32; ++l) lanes[w * 32 + l].state = RUN;
        if (done != 32) all_done = false;
        if (sync) any_sync = true;
        if (shfl) all_sync_or_done = false;
      }
      if (all_done) break;
      bool progressed = false;
      for (int t = 0; t < T; ++t) progressed |= lanes[t].state == RUN;
      if (!progressed) {
        if (any_sync && all_sync_or_done) {
          for (int t = 0; t < T; ++t) if (lanes[t].state == SYNC) lanes[t].state = RUN;
          for (int t = 0; t < T; ++t) if (lanes[t].state == DONE) { fprintf(stderr, "__syncthreads after some threads exited\n"); abort(); }
        } else { fprintf(stderr, "deadlock\n"); abort(); }
      }
    }
  }
}
