// Runs CUDA C kernels on the host, for checking them on a machine with no GPU.
//
// Included before the unchanged .cu source. Every CUDA thread of a block is a host
// thread; blocks run one after another, so a function-local `static` is exactly one
// block's `__shared__` memory. `__syncthreads` is a barrier over the block's threads,
// `__syncwarp` one over the warp's, and a warp shuffle is an exchange through the
// warp's slots (double-buffered, so one barrier per shuffle). The 16-bit float
// conversions are the hardware's, bit for bit: round to nearest even, subnormals,
// infinities and NaN.
#pragma once
#define CUDA_EMULATION 1

#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

inline thread_local dim3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }

namespace emu {

// Every barrier that opens is progress; a launch that makes none for 300 s (or
// $CUDA_EMULATION_WATCHDOG_S: threads of a block diverged at `__syncthreads` or a
// shuffle, a hang on a GPU) aborts the process rather than hang the tests.
inline std::atomic<unsigned long> progress{0};
inline int watchdog_seconds() {
    const char* value = std::getenv("CUDA_EMULATION_WATCHDOG_S");
    return value ? std::atoi(value) : 300;
}
struct Tick {
    void operator()() noexcept { progress.fetch_add(1, std::memory_order_relaxed); }
};
using Barrier = std::barrier<Tick>;

struct Warp {
    explicit Warp(int lanes) : barrier(lanes) {}
    Barrier barrier;
    std::uint64_t slots[2][32];
};

struct Block {
    explicit Block(int threads) : barrier(threads) {
        for (int w = 0; w < (threads + 31) / 32; ++w) warps.emplace_back(std::make_unique<Warp>(std::min(32, threads - 32 * w)));
    }
    Barrier barrier;
    std::vector<std::unique_ptr<Warp>> warps;
};

inline Block* block = nullptr;
inline thread_local int linear_thread = 0;
inline thread_local int shuffle_phase = 0;

inline Warp& my_warp() { return *block->warps[linear_thread / 32]; }

}  // namespace emu

inline void __syncthreads() { emu::block->barrier.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::my_warp().barrier.arrive_and_wait(); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T value, int lane_mask, int = 32) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    emu::Warp& warp = emu::my_warp();
    std::uint64_t* slots = warp.slots[emu::shuffle_phase];
    emu::shuffle_phase ^= 1;
    const int lane = emu::linear_thread % 32;
    std::memcpy(&slots[lane], &value, sizeof(T));
    warp.barrier.arrive_and_wait();
    T out;
    std::memcpy(&out, &slots[lane ^ lane_mask], sizeof(T));
    return out;
}

// IEEE binary16 and bfloat16, round to nearest even (PTX cvt.rn.f16.f32 / cvt.rn.bf16.f32).
inline unsigned short float_to_half_bits(float f) {
    std::uint32_t x;
    std::memcpy(&x, &f, 4);
    const std::uint32_t sign = (x >> 16) & 0x8000u;
    const std::uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return sign | (a > 0x7f800000u ? 0x7fffu : 0x7c00u);  // NaN, infinity
    if (a >= 0x477ff000u) return sign | 0x7c00u;  // 65520 and up round to infinity
    if (a < 0x38800000u) {  // below 2^-14: a subnormal half (or zero), in units of 2^-24
        const std::uint32_t exponent = a >> 23;
        if (exponent < 102) return sign;  // below 2^-25
        const std::uint32_t mantissa = (a & 0x7fffffu) | 0x800000u;
        const std::uint32_t shift = 126 - exponent;
        std::uint32_t r = mantissa >> shift;
        const std::uint32_t rest = mantissa & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (r & 1))) ++r;
        return sign | r;
    }
    std::uint32_t r = a - (112u << 23);  // rebias the exponent, 127 -> 15
    r += 0xfffu + ((r >> 13) & 1);
    return sign | (r >> 13);
}

inline float half_bits_to_float(unsigned short h) {
    const std::uint32_t sign = (std::uint32_t)(h & 0x8000u) << 16;
    const std::uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ffu;
    std::uint32_t x;
    if (exponent == 0) {
        const float f = std::ldexp((float)mantissa, -24);
        std::memcpy(&x, &f, 4);
        x |= sign;
    } else if (exponent == 31) {
        x = sign | 0x7f800000u | (mantissa << 13);
    } else {
        x = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    return __uint_as_float(x);
}

inline unsigned short float_to_bfloat16_bits(float f) {
    std::uint32_t x;
    std::memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return 0x7fffu;  // NaN (the hardware's canonical one)
    x += 0x7fffu + ((x >> 16) & 1);
    return (unsigned short)(x >> 16);
}

inline float bfloat16_bits_to_float(unsigned short h) { return __uint_as_float((std::uint32_t)h << 16); }

namespace emu {

template <typename... Params, std::size_t... I>
void call(void (*kernel)(Params...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<Params>*>(args[I])...);
}

inline std::mutex launch_mutex;  // one launch at a time: the shared memory is static

// cuLaunchKernel's calling convention: `args[i]` points at the i-th parameter.
template <typename... Params>
void launch(void (*kernel)(Params...), const unsigned* grid, const unsigned* threads, void** args) {
    std::lock_guard<std::mutex> one_at_a_time(launch_mutex);
    gridDim = dim3{grid[0], grid[1], grid[2]};
    blockDim = dim3{threads[0], threads[1], threads[2]};
    const int count = threads[0] * threads[1] * threads[2];
    Block shared_state(count);
    block = &shared_state;
    auto run = [&](int t) {
        linear_thread = t;
        threadIdx = dim3{t % threads[0], t / threads[0] % threads[1], t / (threads[0] * threads[1])};
        for (unsigned z = 0; z < grid[2]; ++z)
            for (unsigned y = 0; y < grid[1]; ++y)
                for (unsigned x = 0; x < grid[0]; ++x) {
                    blockIdx = dim3{x, y, z};
                    shuffle_phase = 0;
                    call(kernel, args, std::index_sequence_for<Params...>{});
                    block->barrier.arrive_and_wait();  // the next block reuses the shared memory
                }
    };
    std::mutex watch_mutex;
    std::condition_variable finished;
    bool done = false;
    std::thread watchdog([&, seconds = watchdog_seconds()] {
        std::unique_lock<std::mutex> lock(watch_mutex);
        unsigned long seen = progress.load();
        while (!finished.wait_for(lock, std::chrono::seconds(seconds), [&] { return done; })) {
            if (progress.load() == seen) {
                std::fprintf(stderr, "cuda emulation: no barrier opened in %d s; a block's threads diverged\n", seconds);
                std::abort();
            }
            seen = progress.load();
        }
    });
    std::vector<std::thread> pool;
    for (int t = 1; t < count; ++t) pool.emplace_back(run, t);
    run(0);
    for (auto& thread : pool) thread.join();
    {
        std::lock_guard<std::mutex> lock(watch_mutex);
        done = true;
    }
    finished.notify_one();
    watchdog.join();
    block = nullptr;
}

}  // namespace emu
