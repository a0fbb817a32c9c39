// Fiber runtime for running CUDA kernels on the CPU (tests/cuda_emu).
//
// Execution model: the blocks of a grid run one after another. Within a block every CUDA thread is a
// fiber (its own stack) on one OS thread; a fiber runs until it reaches a synchronisation point
// (__syncthreads, a warp shuffle/vote/__syncwarp) or exits, then the scheduler resumes the next
// runnable fiber in the configured order (forward, reverse or seeded random). __syncthreads releases
// when every live thread of the block has arrived; a warp collective completes when every lane named
// by its mask has arrived with the same mask and operation, and each lane then reads the values the
// others had at that instant. Shared memory (the emu_shared section) is filled with 0xFF bytes before
// every block. Deadlocks (a barrier some threads never reach), lanes that exit while named by a
// pending collective, and calls from lanes outside their own mask are reported as launch errors.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "cuda_emu_types.h"

namespace emu {
enum WarpOp { kShflIdx, kShflUp, kShflDown, kShflXor, kBallot, kAny, kAll, kSyncWarp, kReduceAdd,
              kReduceMin, kReduceMax, kMatchAny };
typedef void (*BodyFn)(void* ctx);

uint3 g_block_idx;
dim3 g_block_dim;
dim3 g_grid_dim;

namespace {
enum State { kReady, kAtBarrier, kAtWarp, kDone };

struct Fiber {
  void* sp = nullptr;
  char* stack = nullptr;  // mmap'ed, lowest page is a guard page
  uint3 tid;
  int lane = 0;
  int warp = 0;
  State state = kReady;
  int bar_pred = 0;
  int bar_op = 0;
};

struct Warp {
  unsigned lanes = 0;      // lanes that exist in this warp (a partial last warp has fewer)
  unsigned arrived = 0;    // lanes waiting in a collective
  unsigned mask[32];
  int op[32];
  int arg[32];
  int width[32];
  unsigned long long val[32];
  unsigned long long res[32];
};

constexpr size_t kStackSize = 256 * 1024;
std::vector<Fiber> g_fibers;
std::vector<Warp> g_warps;
Fiber* g_cur = nullptr;
void* g_sched_sp = nullptr;
BodyFn g_body = nullptr;
void* g_ctx = nullptr;
int g_live = 0;
int g_at_barrier = 0;
int g_bar_result = 0;
bool g_failed = false;
std::string g_error;
int g_schedule = 0;  // 0 forward, 1 reverse, 2 random
unsigned g_seed = 0;
long long g_ticks = 0;
}  // namespace
}  // namespace emu

// -- context switch ---------------------------------------------------------------------------
#if defined(__x86_64__)
extern "C" void emu_switch(void** save_sp, void* new_sp);
asm(R"(
.text
.globl emu_switch
.hidden emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch,.-emu_switch
)");
#define EMU_FAST_SWITCH 1
#else
#include <ucontext.h>
#define EMU_FAST_SWITCH 0
#endif

namespace emu {
namespace {

#if !EMU_FAST_SWITCH
std::vector<ucontext_t> g_uctx;
ucontext_t g_sched_uctx;
#endif

[[noreturn]] void fiber_main();

void switch_to_scheduler() {
#if EMU_FAST_SWITCH
  emu_switch(&g_cur->sp, g_sched_sp);
#else
  swapcontext(&g_uctx[g_cur - g_fibers.data()], &g_sched_uctx);
#endif
}

void resume(Fiber& f) {
  g_cur = &f;
#if EMU_FAST_SWITCH
  emu_switch(&g_sched_sp, f.sp);
#else
  swapcontext(&g_sched_uctx, &g_uctx[&f - g_fibers.data()]);
#endif
  g_cur = nullptr;
}

void fail(const std::string& msg) {
  if (!g_failed) {
    g_failed = true;
    char where[160];
    std::snprintf(where, sizeof where, " (block %u,%u,%u thread %u,%u,%u)", g_block_idx.x, g_block_idx.y,
                  g_block_idx.z, g_cur ? g_cur->tid.x : 0u, g_cur ? g_cur->tid.y : 0u, g_cur ? g_cur->tid.z : 0u);
    g_error = msg + (g_cur ? where : "");
  }
}

void fiber_main() {
  g_body(g_ctx);
  g_cur->state = kDone;
  switch_to_scheduler();
  std::abort();  // a finished fiber is never resumed
}

void prepare_fiber(Fiber& f) {
  char* top = f.stack + kStackSize;
#if EMU_FAST_SWITCH
  void** sp = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(top) & ~uintptr_t(15));
  *--sp = nullptr;                                   // fiber_main's (never used) return address
  *--sp = reinterpret_cast<void*>(&fiber_main);      // emu_switch's ret lands here
  for (int i = 0; i < 6; ++i) *--sp = nullptr;       // rbp rbx r12 r13 r14 r15
  const unsigned long long fp_state = 0x1F80ull | (0x037Full << 32);  // mxcsr, x87 control word
  *--sp = reinterpret_cast<void*>(fp_state);
  f.sp = sp;
#else
  ucontext_t& u = g_uctx[&f - g_fibers.data()];
  getcontext(&u);
  u.uc_stack.ss_sp = f.stack + 4096;
  u.uc_stack.ss_size = kStackSize - 4096;
  u.uc_link = nullptr;
  makecontext(&u, (void (*)())fiber_main, 0);
#endif
  f.state = kReady;
}

void ensure_fibers(int n) {
  const size_t have = g_fibers.size();
  if ((size_t)n <= have) return;
  g_fibers.resize(n);
#if !EMU_FAST_SWITCH
  g_uctx.resize(n);
#endif
  for (size_t i = have; i < (size_t)n; ++i) {
    void* mem = mmap(nullptr, kStackSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mem == MAP_FAILED) { std::perror("emu: mmap"); std::abort(); }
    mprotect(mem, 4096, PROT_NONE);  // stack overflow faults instead of corrupting a neighbour
    g_fibers[i].stack = static_cast<char*>(mem);
  }
}

void release_barrier_if_complete() {
  if (g_at_barrier == 0 || g_at_barrier < g_live) return;
  const int n = (int)(g_block_dim.x * g_block_dim.y * g_block_dim.z);
  int count = 0, all = 1, any = 0;
  for (int i = 0; i < n; ++i) {
    Fiber& f = g_fibers[i];
    if (f.state != kAtBarrier) continue;
    count += f.bar_pred != 0;
    all &= f.bar_pred != 0;
    any |= f.bar_pred != 0;
  }
  const int op = g_fibers[0].bar_op;
  g_bar_result = op == 0 ? count : (op == 1 ? all : any);
  for (int i = 0; i < n; ++i) {
    if (g_fibers[i].state == kAtBarrier) g_fibers[i].state = kReady;
  }
  g_at_barrier = 0;
}

void complete_collective(Warp& w, unsigned mask, int warp_index) {
  const int op = w.op[__builtin_ctz(mask)];
  unsigned long long reduced = 0;
  if (op == kBallot) {
    for (int l = 0; l < 32; ++l) if ((mask >> l) & 1u) reduced |= (unsigned long long)(w.val[l] != 0) << l;
  } else if (op == kAny || op == kAll) {
    bool any = false, all = true;
    for (int l = 0; l < 32; ++l) {
      if (!((mask >> l) & 1u)) continue;
      any |= w.val[l] != 0;
      all &= w.val[l] != 0;
    }
    reduced = op == kAny ? any : all;
  } else if (op == kReduceAdd || op == kReduceMin || op == kReduceMax) {
    unsigned acc = op == kReduceAdd ? 0u : (op == kReduceMin ? 0xffffffffu : 0u);
    for (int l = 0; l < 32; ++l) {
      if (!((mask >> l) & 1u)) continue;
      const unsigned v = (unsigned)w.val[l];
      acc = op == kReduceAdd ? acc + v : (op == kReduceMin ? (v < acc ? v : acc) : (v > acc ? v : acc));
    }
    reduced = acc;
  }
  for (int l = 0; l < 32; ++l) {
    if (!((mask >> l) & 1u)) continue;
    const int width = w.width[l];
    int src = l;
    switch (op) {
      case kShflIdx: src = (l & ~(width - 1)) | (w.arg[l] & (width - 1)); break;
      case kShflUp: src = (l & (width - 1)) >= w.arg[l] ? l - w.arg[l] : l; break;
      case kShflDown: src = (l & (width - 1)) + w.arg[l] < width ? l + w.arg[l] : l; break;
      case kShflXor: src = l ^ w.arg[l]; if (src >= ((l / width) + 1) * width) src = l; break;
      default: break;
    }
    if (op <= kShflXor) {
      // Reading a lane outside the mask is undefined on the GPU: hand back garbage.
      w.res[l] = ((mask >> src) & 1u) ? w.val[src] : 0xffffffffffffffffull;
    } else if (op == kMatchAny) {
      unsigned m = 0;
      for (int k = 0; k < 32; ++k) if (((mask >> k) & 1u) && w.val[k] == w.val[l]) m |= 1u << k;
      w.res[l] = m;
    } else {
      w.res[l] = reduced;
    }
    Fiber& f = g_fibers[warp_index * 32 + l];
    if (f.state == kAtWarp) f.state = kReady;
  }
  w.arrived &= ~mask;
}

bool lane_exit_breaks_collective(const Fiber& f) {
  const Warp& w = g_warps[f.warp];
  for (int l = 0; l < 32; ++l) {
    if (((w.arrived >> l) & 1u) && ((w.mask[l] >> f.lane) & 1u)) return true;
  }
  return false;
}

std::string describe_states() {
  const int n = (int)(g_block_dim.x * g_block_dim.y * g_block_dim.z);
  int at_bar = 0, at_warp = 0, done = 0;
  for (int i = 0; i < n; ++i) {
    at_bar += g_fibers[i].state == kAtBarrier;
    at_warp += g_fibers[i].state == kAtWarp;
    done += g_fibers[i].state == kDone;
  }
  char buf[200];
  std::snprintf(buf, sizeof buf, "%d threads at __syncthreads, %d in warp collectives, %d exited", at_bar,
                at_warp, done);
  return buf;
}

void run_block(const std::vector<int>& order) {
  const int n = (int)order.size();
  g_live = n;
  g_at_barrier = 0;
  for (Warp& w : g_warps) w.arrived = 0;
  for (int i = 0; i < n; ++i) prepare_fiber(g_fibers[i]);
  while (g_live > 0 && !g_failed) {
    bool progressed = false;
    for (int k = 0; k < n && !g_failed; ++k) {
      Fiber& f = g_fibers[order[k]];
      if (f.state != kReady) continue;
      progressed = true;
      resume(f);
      if (g_failed) break;
      if (f.state == kDone) {
        --g_live;
        if (lane_exit_breaks_collective(f)) {
          g_cur = &f;
          fail("a lane exited while a warp collective waits for it");
          g_cur = nullptr;
          break;
        }
        g_warps[f.warp].lanes &= ~(1u << f.lane);
        release_barrier_if_complete();
      } else if (f.state == kAtBarrier) {
        ++g_at_barrier;
        release_barrier_if_complete();
      }
    }
    if (!progressed && !g_failed) fail("deadlock: " + describe_states());
  }
}
}  // namespace

const uint3& thread_idx() { return g_cur->tid; }

void fatal(const char* msg) {
  fail(msg);
  switch_to_scheduler();
  std::abort();
}

void syncthreads() {
  g_cur->state = kAtBarrier;
  g_cur->bar_pred = 1;
  g_cur->bar_op = 0;
  switch_to_scheduler();
}

int syncthreads_reduce(int op, int pred) {
  g_cur->state = kAtBarrier;
  g_cur->bar_pred = pred;
  g_cur->bar_op = op;
  switch_to_scheduler();
  return g_bar_result;
}

unsigned active_mask() { return g_warps[g_cur->warp].lanes; }

long long clock_ticks() { return ++g_ticks; }

unsigned long long warp_collective(int op, unsigned mask, unsigned long long bits, int arg, int width) {
  Fiber& f = *g_cur;
  Warp& w = g_warps[f.warp];
  const int lane = f.lane;
  if (!((mask >> lane) & 1u)) fatal("warp intrinsic called by a lane outside its mask");
  if (mask & ~w.lanes) fatal("warp intrinsic names a lane that has exited or does not exist");
  if (width < 1 || width > 32 || (width & (width - 1))) fatal("warp shuffle width must be a power of two <= 32");
  w.mask[lane] = mask;
  w.op[lane] = op;
  w.arg[lane] = arg;
  w.width[lane] = width;
  w.val[lane] = bits;
  w.arrived |= 1u << lane;
  bool complete = (w.arrived & mask) == mask;
  for (int l = 0; complete && l < 32; ++l) {
    if (!((mask >> l) & 1u)) continue;
    if (w.mask[l] != mask) complete = false;
    else if (w.op[l] != op) fatal("lanes of one warp meet at different warp intrinsics");
  }
  if (complete) {
    complete_collective(w, mask, f.warp);
  } else {
    f.state = kAtWarp;
    switch_to_scheduler();
  }
  return w.res[lane];
}

int launch(BodyFn body, void* ctx, dim3 grid, dim3 block, char* shared_lo, char* shared_hi) {
  g_failed = false;
  g_error.clear();
  const long long n = (long long)block.x * block.y * block.z;
  if (n < 1 || n > 1024 || grid.x < 1 || grid.y < 1 || grid.z < 1 || grid.y > 65535 || grid.z > 65535) {
    g_failed = true;
    g_error = "invalid launch configuration";
    return 1;
  }
  ensure_fibers((int)n);
  const int nwarps = (int)((n + 31) / 32);
  g_warps.assign(nwarps, Warp());
  g_block_dim = block;
  g_grid_dim = grid;
  g_body = body;
  g_ctx = ctx;
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) {
    Fiber& f = g_fibers[i];
    f.tid.x = (unsigned)(i % block.x);
    f.tid.y = (unsigned)((i / block.x) % block.y);
    f.tid.z = (unsigned)(i / (block.x * block.y));
    f.lane = i % 32;
    f.warp = i / 32;
    order[i] = g_schedule == 1 ? (int)(n - 1 - i) : i;
  }
  std::mt19937 rng(g_seed);
  for (unsigned z = 0; z < grid.z && !g_failed; ++z) {
    for (unsigned y = 0; y < grid.y && !g_failed; ++y) {
      for (unsigned x = 0; x < grid.x && !g_failed; ++x) {
        g_block_idx.x = x;
        g_block_idx.y = y;
        g_block_idx.z = z;
        if (shared_hi > shared_lo) std::memset(shared_lo, 0xff, (size_t)(shared_hi - shared_lo));
        for (int wi = 0; wi < nwarps; ++wi) {
          const long long lanes = n - 32LL * wi;
          g_warps[wi].lanes = lanes >= 32 ? 0xffffffffu : ((1u << lanes) - 1u);
        }
        if (g_schedule == 2) std::shuffle(order.begin(), order.end(), rng);
        run_block(order);
      }
    }
  }
  return g_failed ? 1 : 0;
}
}  // namespace emu

extern "C" {
const char* emu_last_error() { return emu::g_error.c_str(); }
void emu_set_schedule(int mode, unsigned seed) {
  emu::g_schedule = mode;
  emu::g_seed = seed;
}
}
