// cuda_emu.h: the CUDA C++ that cupyconv's kernels use, on the CPU, so that the tests can run
// the kernels themselves without a GPU (tests/emulation.py builds and drives them).
//
// A launch runs its blocks one after another. A block's threads are fibers: each runs
// until it reaches a barrier or a warp-wide operation, and such an operation completes when
// every thread it names has reached it (a thread blocked on one that can never complete is
// reported as a deadlock). Warp-wide operations (shuffles, votes, ldmatrix, stmatrix, movmatrix,
// mma.sync) are computed from all their lanes' operands at once, as the hardware does; cp.async
// lands at the wait_group that covers it (its destination holds NaN bytes until then, and a store
// into it meanwhile fails the launch: on the GPU the copy may land before or after that store).
// Shared memory is filled with NaN bytes (0xff)
// before each block, so that a value read before it is written shows in the results, and the
// bytes past the launch's dynamic shared memory are checked to be untouched after each block.
// Inline PTX lives in kernels/ptx.cuh, which the build replaces with tests/emulator/ptx.cuh.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __restrict__ __restrict
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static  // a block's threads share it; blocks run one at a time
#define __CUDA_ARCH__ CPC_ARCH  // the architecture emulated (800 or 900), set by the build

// ---- vector types ---------------------------------------------------------------------------

#define CPC_VECTOR2(T, N, A) \
    struct __attribute__((aligned(A))) N { T x, y; }; \
    inline N make_##N(T x, T y) { return N{x, y}; }
#define CPC_VECTOR4(T, N, A) \
    struct __attribute__((aligned(A))) N { T x, y, z, w; }; \
    inline N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }
CPC_VECTOR2(unsigned, uint2, 8)
CPC_VECTOR4(unsigned, uint4, 16)
CPC_VECTOR2(int, int2, 8)
CPC_VECTOR4(int, int4, 16)
CPC_VECTOR2(float, float2, 8)
CPC_VECTOR4(float, float4, 16)
CPC_VECTOR2(double, double2, 16)
CPC_VECTOR2(long long, longlong2, 16)
#undef CPC_VECTOR2
#undef CPC_VECTOR4

struct dim3 { unsigned x = 1, y = 1, z = 1; };
constexpr int warpSize = 32;

// ---- 16-bit floats --------------------------------------------------------------------------

namespace cpc {
inline unsigned f2u(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float u2f(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
// float to bfloat16 bits, round to nearest even (NaN stays NaN).
inline unsigned short bf16_bits(float f) {
    const unsigned u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
// double to float rounded to odd: rounding that to fewer bits rounds the double correctly.
inline float to_float_odd(double d) {
    float f = (float)d;
    if ((double)f != d && std::isfinite(f) && !(f2u(f) & 1)) f = std::nextafter(f, (float)(d > (double)f ? INFINITY : -INFINITY));
    return f;
}
}  // namespace cpc

struct __nv_bfloat16 {
    unsigned short x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : x(cpc::bf16_bits(f)) {}
    __nv_bfloat16(double d) : x(cpc::bf16_bits(cpc::to_float_odd(d))) {}
    __nv_bfloat16(int i) : x(cpc::bf16_bits((float)i)) {}
    operator float() const { return cpc::u2f((unsigned)x << 16); }
};
struct __half {
    _Float16 h;
    __half() = default;
    __half(float f) : h((_Float16)f) {}
    __half(double d) : h((_Float16)d) {}
    __half(int i) : h((_Float16)i) {}
    operator float() const { return (float)h; }
};
struct __nv_bfloat162 { __nv_bfloat16 x, y; };
struct __half2 { __half x, y; };

inline float __bfloat162float(__nv_bfloat16 v) { return (float)v; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 v) { return v.x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { __nv_bfloat16 v; v.x = u; return v; }
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) { return {__nv_bfloat16(a), __nv_bfloat16(b)}; }
inline float2 __bfloat1622float2(__nv_bfloat162 v) { return {(float)v.x, (float)v.y}; }
inline float __half2float(__half v) { return (float)v; }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half(d); }
inline unsigned short __half_as_ushort(__half v) { unsigned short u; std::memcpy(&u, &v, 2); return u; }
inline __half __ushort_as_half(unsigned short u) { __half v; std::memcpy(&v, &u, 2); return v; }
inline __half2 __floats2half2_rn(float a, float b) { return {__half(a), __half(b)}; }
inline float2 __half22float2(__half2 v) { return {(float)v.x, (float)v.y}; }

// ---- scalar intrinsics ----------------------------------------------------------------------

inline unsigned __float_as_uint(float f) { return cpc::f2u(f); }
inline float __uint_as_float(unsigned u) { return cpc::u2f(u); }
inline int __float_as_int(float f) { return (int)cpc::f2u(f); }
inline float __int_as_float(int i) { return cpc::u2f((unsigned)i); }
inline double __longlong_as_double(long long u) { double d; std::memcpy(&d, &u, 8); return d; }
inline long long __double_as_longlong(double d) { long long u; std::memcpy(&u, &d, 8); return u; }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long v = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
inline float __expf(float a) { return std::exp(a); }
inline float __fdividef(float a, float b) { return a / b; }
template <typename T> inline T __ldg(const T* p) { return *p; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __clz(int v) { return v ? __builtin_clz((unsigned)v) : 32; }
template <typename A, typename B> inline std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <typename A, typename B> inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
using std::isfinite;
using std::isinf;
using std::isnan;
inline void __threadfence() {}
template <typename T> inline T atomicAdd(T* p, T v) { const T old = *p; *p = old + v; return old; }

// ---- threads, blocks and the scheduler ------------------------------------------------------

namespace cpc {

// A fiber's saved context. x86-64 switches by hand (the callee-saved registers and the stack
// pointer); elsewhere ucontext, whose swapcontext also saves the signal mask (a system call).
#if defined(__x86_64__)
struct Context {
    void* sp = nullptr;
};
extern "C" void cpc_switch(void** save, void* load);
asm(".text\n.globl cpc_switch\n.hidden cpc_switch\n.type cpc_switch, @function\ncpc_switch:\n"
    "pushq %rbp\npushq %rbx\npushq %r12\npushq %r13\npushq %r14\npushq %r15\n"
    "movq %rsp, (%rdi)\nmovq %rsi, %rsp\n"
    "popq %r15\npopq %r14\npopq %r13\npopq %r12\npopq %rbx\npopq %rbp\nret\n");
inline void switch_to(Context& from, Context& to) { cpc_switch(&from.sp, to.sp); }
// `c` starts `entry` (which never returns) on the stack at `stack`.
inline void start(Context& c, char* stack, size_t size, void (*entry)()) {
    void** sp = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15));
    *--sp = nullptr;                                   // entry begins as if called: rsp = 8 mod 16
    *--sp = reinterpret_cast<void*>(entry);            // cpc_switch's return address
    for (int i = 0; i < 6; ++i) *--sp = nullptr;       // rbp, rbx, r12 .. r15
    c.sp = sp;
}
#else
struct Context {
    ucontext_t uc;
};
inline void switch_to(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void start(Context& c, char* stack, size_t size, void (*entry)()) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack;
    c.uc.uc_stack.ss_size = size;
    c.uc.uc_link = nullptr;
    makecontext(&c.uc, entry, 0);
}
#endif

enum Op { NONE, SYNCWARP, SHFL, SHFL_XOR, SHFL_UP, SHFL_DOWN, VOTE_ANY, LDMATRIX, STMATRIX, MOVMATRIX, MMA };
enum State { RUNNING, AT_WARP_OP, AT_BARRIER, DONE };

struct Thread {
    Context ctx;
    dim3 tid;
    int linear = 0;
    State state = RUNNING;
    // the warp-wide operation it waits at: kind, lanes, operands, results
    Op op = NONE;
    unsigned mask = 0;
    int arg = 0;       // shuffle source / xor mask, matrix count, ...
    bool trans = false;
    const void* addr = nullptr;
    unsigned long long in[8] = {};
    unsigned long long out[4] = {};
    // its cp.async copies not yet waited for: (destination, source, bytes, size, group; 0 until
    // committed), and the groups committed
    struct Copy { unsigned char* dst; const void* src; int bytes, size, group; };
    std::vector<Copy> copies;
    int committed = 0;
    // the barrier it waits at
    int barrier = 0, expected = 0;
    long arrival = 0;
    int pred = 0;
};

struct Block {
    std::vector<Thread> threads;
    std::vector<char*> stacks;
    Context scheduler;
    Thread* current = nullptr;
    dim3 block_idx, block_dim, grid_dim;
    long arrivals = 0;
    void (*body)(void*) = nullptr;
    void* body_arg = nullptr;
    std::string error;
};
inline Block block;

constexpr size_t STACK_BYTES = 1 << 20;
constexpr size_t ARENA_BYTES = 256 * 1024;
// Dynamic shared memory, and the anchor of the 32-bit shared-memory addresses: a block's static
// __shared__ arrays are this library's statics too, within 2 GiB of it.
alignas(1024) inline unsigned char arena[ARENA_BYTES + 4096];

inline unsigned shared_address(const void* p) {
    return (unsigned)(uintptr_t)((const unsigned char*)p - arena);
}
inline unsigned char* shared_pointer(unsigned a) { return arena + (int)a; }

[[noreturn]] inline void fail(const std::string& what) { throw std::runtime_error(what); }

// The byte ranges [begin, end) of the arrays a launch may touch (tests/emulation.py sets them
// before each launch through cpc_set_arrays): a cp.async that reads outside every one fails.
inline std::vector<std::pair<uintptr_t, uintptr_t>> arrays;
inline bool inside_an_array(const void* p, int bytes) {
    const uintptr_t a = (uintptr_t)p;
    for (const auto& [begin, end] : arrays)
        if (a >= begin && a + bytes <= end) return true;
    return false;
}

inline void wait_here() { switch_to(block.current->ctx, block.scheduler); }

// This thread reaches warp-wide operation `op` of the lanes in `mask`.
inline Thread& warp_op(Op op, unsigned mask) {
    Thread& t = *block.current;
    if (!(mask >> (t.linear & 31) & 1)) fail("a warp-wide operation whose mask leaves out the calling lane");
    t.op = op;
    t.mask = mask;
    t.state = AT_WARP_OP;
    wait_here();
    return t;
}

inline void barrier(int id, int expected, int pred = 0) {
    Thread& t = *block.current;
    t.barrier = id;
    t.expected = expected;
    t.pred = pred;
    t.arrival = block.arrivals++;
    t.state = AT_BARRIER;
    wait_here();
}

inline unsigned lo16(unsigned w, int h) { return h ? w >> 16 : w & 0xffffu; }

// An 8x8 matrix of 16-bit values as a warp holds it (lane 4 g + tg: row g, columns 2 tg, 2 tg + 1).
inline void matrix_from_fragments(const unsigned (&w)[32], unsigned short (&m)[8][8]) {
    for (int lane = 0; lane < 32; ++lane)
        for (int h = 0; h < 2; ++h) m[lane >> 2][2 * (lane & 3) + h] = (unsigned short)lo16(w[lane], h);
}
inline void fragments_from_matrix(const unsigned short (&m)[8][8], bool trans, unsigned (&w)[32]) {
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane >> 2, c = 2 * (lane & 3);
        const unsigned a = trans ? m[c][g] : m[g][c], b = trans ? m[c + 1][g] : m[g][c + 1];
        w[lane] = a | b << 16;
    }
}

inline float mma_in(unsigned w, int h, bool bf16) {
    const unsigned short v = (unsigned short)lo16(w, h);
    if (bf16) return u2f((unsigned)v << 16);
    _Float16 f;
    std::memcpy(&f, &v, 2);
    return (float)f;
}

// Completes the warp-wide operation that lanes `lanes` (the mask) of warp `w` all wait at.
inline void complete(Thread* warp, unsigned lanes) {
    Thread& first = warp[__builtin_ctz(lanes)];
    const Op op = first.op;
    auto each = [&](auto f) {
        for (int l = 0; l < 32; ++l)
            if (lanes >> l & 1) f(warp[l], l);
    };
    switch (op) {
        case SYNCWARP: break;
        case SHFL:
        case SHFL_XOR:
        case SHFL_UP:
        case SHFL_DOWN: {
            unsigned long long v[32];
            for (int l = 0; l < 32; ++l) v[l] = warp[l].in[0];
            each([&](Thread& t, int l) {
                const int width = (int)t.in[1], base = l & ~(width - 1);
                const int src = op == SHFL ? base + (t.arg & (width - 1))
                                : op == SHFL_XOR ? l ^ t.arg
                                : op == SHFL_UP ? l - t.arg
                                : l + t.arg;
                const int from = src < base || src >= base + width ? l : src;
                if (!(lanes >> from & 1)) fail("a shuffle reads a lane outside its mask");
                t.out[0] = v[from];
            });
            break;
        }
        case VOTE_ANY: {
            int any = 0;
            each([&](Thread& t, int) { any |= t.pred; });
            each([&](Thread& t, int) { t.out[0] = any; });
            break;
        }
        case LDMATRIX: {  // lanes 8 q .. 8 q + 7 address matrix q's rows
            if (lanes != 0xffffffffu) fail("ldmatrix needs the whole warp");
            for (int q = 0; q < first.arg; ++q) {
                unsigned short m[8][8];
                for (int r = 0; r < 8; ++r) {
                    const unsigned char* row = (const unsigned char*)warp[8 * q + r].addr;
                    if ((uintptr_t)row % 16) fail("ldmatrix: a row address that is not 16-byte aligned");
                    std::memcpy(m[r], row, 16);
                }
                unsigned w[32];
                fragments_from_matrix(m, first.trans, w);
                for (int l = 0; l < 32; ++l) warp[l].out[q] = w[l];
            }
            break;
        }
        case STMATRIX: {  // stmatrix.x4.trans: matrix q's row j at lane 8 q + j's address
            if (lanes != 0xffffffffu) fail("stmatrix needs the whole warp");
            for (int q = 0; q < 4; ++q) {
                unsigned w[32];
                for (int l = 0; l < 32; ++l) w[l] = (unsigned)warp[l].in[q];
                unsigned short m[8][8], mt[8][8];
                matrix_from_fragments(w, m);
                for (int r = 0; r < 8; ++r)
                    for (int c = 0; c < 8; ++c) mt[r][c] = m[c][r];
                for (int r = 0; r < 8; ++r) {
                    unsigned char* row = (unsigned char*)warp[8 * q + r].addr;
                    if ((uintptr_t)row % 16) fail("stmatrix: a row address that is not 16-byte aligned");
                    std::memcpy(row, mt[r], 16);
                }
            }
            break;
        }
        case MOVMATRIX: {
            if (lanes != 0xffffffffu) fail("movmatrix needs the whole warp");
            unsigned w[32];
            for (int l = 0; l < 32; ++l) w[l] = (unsigned)warp[l].in[0];
            unsigned short m[8][8];
            matrix_from_fragments(w, m);
            fragments_from_matrix(m, true, w);
            for (int l = 0; l < 32; ++l) warp[l].out[0] = w[l];
            break;
        }
        case MMA: {  // m16n8k16, A row-major (4 words a lane), B column-major (2), C / D float32 (4)
            if (lanes != 0xffffffffu) fail("mma.sync needs the whole warp");
            const bool bf16 = first.arg;
            float a[16][16], b[16][8], c[16][8];
            for (int l = 0; l < 32; ++l) {
                const Thread& t = warp[l];
                const int g = l >> 2, k = 2 * (l & 3);
                for (int h = 0; h < 2; ++h) {
                    a[g][k + h] = mma_in((unsigned)t.in[0], h, bf16);
                    a[g + 8][k + h] = mma_in((unsigned)t.in[1], h, bf16);
                    a[g][k + 8 + h] = mma_in((unsigned)t.in[2], h, bf16);
                    a[g + 8][k + 8 + h] = mma_in((unsigned)t.in[3], h, bf16);
                    b[k + h][g] = mma_in((unsigned)t.in[4], h, bf16);
                    b[k + 8 + h][g] = mma_in((unsigned)t.in[5], h, bf16);
                    c[g][k + h] = u2f((unsigned)(t.in[6] >> (32 * h)));
                    c[g + 8][k + h] = u2f((unsigned)(t.in[7] >> (32 * h)));
                }
            }
            for (int l = 0; l < 32; ++l) {
                const int g = l >> 2, n = 2 * (l & 3);
                for (int i = 0; i < 4; ++i) {
                    const int row = g + 8 * (i >> 1), col = n + (i & 1);
                    double s = c[row][col];  // products exact, summed wider than float32
                    for (int k = 0; k < 16; ++k) s += (double)a[row][k] * b[k][col];
                    warp[l].out[i] = f2u((float)s);
                }
            }
            break;
        }
        default: fail("unknown warp-wide operation");
    }
    each([](Thread& t, int) {
        t.op = NONE;
        t.state = RUNNING;
    });
}

// Completes the warp-wide operations of the warp at `warp` (`size` threads) whose lanes have all
// arrived. Returns whether any was.
inline bool resolve_warp(Thread* warp, int size) {
    bool any = false;
    for (int l = 0; l < size; ++l) {
        Thread& t = warp[l];
        if (t.state != AT_WARP_OP) continue;
        bool ready = true;
        for (int j = 0; j < 32 && ready; ++j) {
            if (!(t.mask >> j & 1)) continue;
            if (j >= size) fail("a warp-wide operation names a lane the block does not have");
            const Thread& u = warp[j];
            if (u.state == DONE) fail("a warp-wide operation names a lane that has exited");
            ready = u.state == AT_WARP_OP && u.op == t.op && u.mask == t.mask;
        }
        if (ready) {
            complete(warp, t.mask);
            any = true;
        }
    }
    return any;
}

// Completes the barriers whose threads have all arrived (__syncthreads, id 0: every thread that
// has not exited). Returns whether any was.
inline bool resolve_barriers() {
    bool any = false;
    std::vector<Thread>& ts = block.threads;
    int live = 0;
    for (const Thread& t : ts) live += t.state != DONE;
    for (int id = 0; id < 16; ++id) {
        std::vector<Thread*> at;
        for (Thread& t : ts)
            if (t.state == AT_BARRIER && t.barrier == id) at.push_back(&t);
        if (at.empty()) continue;
        std::sort(at.begin(), at.end(), [](Thread* a, Thread* b) { return a->arrival < b->arrival; });
        const int expected = id == 0 ? live : at.front()->expected;
        if ((int)at.size() < expected) continue;
        int pred = 0;
        for (int i = 0; i < expected; ++i) pred |= at[i]->pred;
        for (int i = 0; i < expected; ++i) {
            at[i]->out[0] = pred;
            at[i]->state = RUNNING;
        }
        any = true;
    }
    return any;
}

inline void thread_entry() {
    try {
        block.body(block.body_arg);
    } catch (const std::exception& e) {
        if (block.error.empty()) block.error = e.what();
    }
    block.current->state = DONE;
    wait_here();  // never resumed
}

// Runs one block of body(arg): every thread to its end.
inline void run_block(void (*body)(void*), void* arg, int threads) {
    Block& b = block;
    b.body = body;
    b.body_arg = arg;
    b.threads.assign(threads, Thread());
    while ((int)b.stacks.size() < threads) b.stacks.push_back(new char[STACK_BYTES]);
    for (int i = 0; i < threads; ++i) {
        Thread& t = b.threads[i];
        t.linear = i;
        t.tid.x = i % b.block_dim.x;
        t.tid.y = i / b.block_dim.x;
        t.tid.z = 0;
        start(t.ctx, b.stacks[i], STACK_BYTES, thread_entry);
    }
    // Each warp in turn runs as far as it can (its lanes one after another, each to its next
    // warp-wide operation or barrier), so that warps drift as far apart as the barriers allow
    // and a missing barrier shows as a read of data not yet written (NaN) or overwritten; the
    // warps go in order in even blocks and in reverse in odd ones.
    const int warps = (threads + 31) / 32;
    for (;;) {
        bool progress = false;
        for (int i = 0; i < warps; ++i) {
            const int w = b.block_idx.x % 2 ? warps - 1 - i : i;
            Thread* warp = &b.threads[32 * w];
            const int size = std::min(32, threads - 32 * w);
            for (;;) {
                bool ran = false;
                for (int l = 0; l < size; ++l) {
                    Thread& t = warp[l];
                    if (t.state != RUNNING) continue;
                    b.current = &t;
                    switch_to(b.scheduler, t.ctx);
                    ran = true;
                    if (!b.error.empty()) {
                        const std::string what = b.error;
                        b.error.clear();
                        fail(what);
                    }
                }
                if (!resolve_warp(warp, size) && !ran) break;
                progress = true;
            }
        }
        bool done = true;
        for (const Thread& t : b.threads) done &= t.state == DONE;
        if (done) return;
        if (!resolve_barriers() && !progress) {
            std::string what = "deadlock: threads wait at";
            for (const Thread& t : b.threads)
                if (t.state == AT_WARP_OP) what += " t" + std::to_string(t.linear) + ":op" + std::to_string(t.op);
                else if (t.state == AT_BARRIER) what += " t" + std::to_string(t.linear) + ":bar" + std::to_string(t.barrier);
            fail(what.substr(0, 2000));
        }
    }
}

// The kernel's parameters from the packed buffer (ParamBlock: 8-byte words, no padding).
template <typename... A>
std::tuple<std::decay_t<A>...> unpack(const long long* words, int n) {
    std::tuple<std::decay_t<A>...> args;
    size_t at = 0;
    std::apply([&](auto&... a) { ((std::memcpy(&a, (const char*)words + at, sizeof a), at += sizeof a), ...); }, args);
    if (at != 8 * (size_t)n) fail("the parameter block's size does not match the kernel's parameters");
    return args;
}

template <typename... A>
void launch(void (*kernel)(A...), const long long* words, int n, unsigned grid, unsigned bx, unsigned by, unsigned smem) {
    if (smem > ARENA_BYTES) fail("dynamic shared memory beyond the emulated arena");
    using Args = std::tuple<std::decay_t<A>...>;
    Args values = unpack<A...>(words, n);
    struct Call {
        void (*kernel)(A...);
        Args* values;
        static void run(void* p) {
            Call* c = static_cast<Call*>(p);
            std::apply(c->kernel, *c->values);
        }
    } call{kernel, &values};
    block.grid_dim = dim3{grid, 1, 1};
    block.block_dim = dim3{bx, by, 1};
    for (unsigned i = 0; i < grid; ++i) {
        block.block_idx = dim3{i, 0, 0};
        std::memset(arena, 0xff, sizeof arena);
        run_block(&Call::run, &call, (int)(bx * by));
        for (size_t j = smem; j < sizeof arena; ++j)
            if (arena[j] != 0xff) fail("a write to shared memory past the launch's " + std::to_string(smem) + " bytes");
    }
}

}  // namespace cpc

#define threadIdx (cpc::block.current->tid)
#define blockIdx (cpc::block.block_idx)
#define blockDim (cpc::block.block_dim)
#define gridDim (cpc::block.grid_dim)

inline unsigned char* cpc_dynamic_shared() { return cpc::arena; }

// ---- warp-wide operations and barriers ------------------------------------------------------

inline void __syncwarp(unsigned mask = 0xffffffffu) { cpc::warp_op(cpc::SYNCWARP, mask); }
inline void __syncthreads() { cpc::barrier(0, 0); }
inline int __syncthreads_or(int pred) {
    cpc::barrier(0, 0, pred != 0);
    return (int)cpc::block.current->out[0];
}
template <typename T>
inline T cpc_shuffle(cpc::Op op, unsigned mask, T v, int arg, int width) {
    static_assert(sizeof(T) <= 8, "a shuffled value of at most 8 bytes");
    cpc::Thread& t = *cpc::block.current;
    t.in[0] = 0;
    std::memcpy(&t.in[0], &v, sizeof v);
    t.in[1] = (unsigned)width;
    t.arg = arg;
    cpc::warp_op(op, mask);
    T r;
    std::memcpy(&r, &t.out[0], sizeof r);
    return r;
}
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    return cpc_shuffle(cpc::SHFL, mask, v, src, width);
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
    return cpc_shuffle(cpc::SHFL_XOR, mask, v, lane_mask, width);
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cpc_shuffle(cpc::SHFL_UP, mask, v, (int)delta, width);
}
template <typename T> inline T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
    return cpc_shuffle(cpc::SHFL_DOWN, mask, v, (int)delta, width);
}
inline int __any_sync(unsigned mask, int pred) {
    cpc::Thread& t = *cpc::block.current;
    t.pred = pred != 0;
    cpc::warp_op(cpc::VOTE_ANY, mask);
    return (int)t.out[0];
}
