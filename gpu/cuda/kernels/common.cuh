// Shared by every kernel: 64-bit offsets, the 16-bit float types, fp32 conversion, warp
// reductions and the softcap.
//
// The 16-bit floats are carried as their bits and converted with one PTX instruction
// each, so NVRTC needs no CUDA headers. The CPU emulation (tests/cuda_emulator) defines the
// same conversion functions in software, bit for bit, and sets CUDA_EMULATION.
#ifndef INFLIGHT_COMMON_CUH
#define INFLIGHT_COMMON_CUH

typedef long long i64;

// -INF: the score of a masked key (no <cmath> under NVRTC).
#define INF __int_as_float(0x7f800000)

struct half_t { unsigned short bits; };
struct bfloat16_t { unsigned short bits; };

// 16 (or 8) bytes moved by one load or store.
struct alignas(16) bytes16 { unsigned int x, y, z, w; };
struct alignas(8) bytes8 { unsigned int x, y; };
template <int BYTES> struct word_of;
template <> struct word_of<16> { typedef bytes16 type; };
template <> struct word_of<8> { typedef bytes8 type; };

#ifndef CUDA_EMULATION
__device__ __forceinline__ float half_bits_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short float_to_half_bits(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ unsigned short float_to_bfloat16_bits(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bfloat16_bits_to_float(unsigned short h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
#endif

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(half_t x) { return half_bits_to_float(x.bits); }
__device__ __forceinline__ float to_float(bfloat16_t x) { return bfloat16_bits_to_float(x.bits); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ half_t from_float<half_t>(float x) {
    half_t h;
    h.bits = float_to_half_bits(x);
    return h;
}
template <> __device__ __forceinline__ bfloat16_t from_float<bfloat16_t>(float x) {
    bfloat16_t h;
    h.bits = float_to_bfloat16_bits(x);
    return h;
}

// N consecutive elements as loaded: their bits, in 16-byte words (8-byte ones when the
// N elements are just 8 bytes), widened to fp32 when used. Held this way, a load can go
// out well before its values are needed at half the registers of fp32 (16-bit types).
// The address must be aligned to the word.
template <typename T, int N>
struct Raw {
    static constexpr int BYTES = N * sizeof(T) >= 16 ? 16 : 8;
    typedef typename word_of<BYTES>::type word_t;
    static constexpr int WORDS = N * (int)sizeof(T) / BYTES;
    static_assert(N * sizeof(T) % BYTES == 0, "loads are whole words");
    word_t words[WORDS];

    __device__ __forceinline__ void load(const T* __restrict__ src) {
#pragma unroll
        for (int i = 0; i < WORDS; ++i) words[i] = reinterpret_cast<const word_t*>(src)[i];
    }
    __device__ __forceinline__ void clear() {
#pragma unroll
        for (int i = 0; i < WORDS; ++i) words[i] = word_t{};  // all bits zero: 0.0 in every type
    }
    __device__ __forceinline__ void widen(float* dst) const {
        const T* elements = reinterpret_cast<const T*>(words);
#pragma unroll
        for (int j = 0; j < N; ++j) dst[j] = to_float(elements[j]);
    }
};

// N consecutive elements, converted to fp32 (as `Raw` loads them).
template <typename T, int N>
__device__ __forceinline__ void load_as_float(const T* __restrict__ src, float* dst) {
    Raw<T, N> raw;
    raw.load(src);
    raw.widen(dst);
}

__device__ __forceinline__ float warp_max(float x, int width) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        if (offset < width) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

__device__ __forceinline__ float warp_sum(float x, int width) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
        if (offset < width) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// A softcapped score (Gemma 2's): cap * tanh(s / cap). Kept out of a kernel's hot loop
// (in a uniform branch of its own), so the plain path keeps its registers.
__device__ __forceinline__ float capped(float s, float cap) { return cap * tanhf(s / cap); }

#endif  // INFLIGHT_COMMON_CUH
