// The AMX tile unit (Intel), for the CPU kernels that multiply bfloat16 on it: where the
// build has it (-march=native on such a CPU) this defines INFLIGHT_AMX, and `amx::granted`
// and `amx::configure` set a thread up for it.
//
// A tile is up to 16 rows of 64 bytes; TDPBF16PS adds into a 16 x 16 fp32 tile the products
// of a 16 x 32 bfloat16 tile and a 16 x 16 tile of bfloat16 pairs (a row of the right
// operand holds, for each column, two consecutive entries of the reduction).
#pragma once

#include "cpu_vector_math.h"

#if defined(INFLIGHT_AVX512BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define INFLIGHT_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace amx {

constexpr int ROWS = 16;  // of a tile; its 64 bytes hold 16 fp32 or 16 pairs of bfloat16

struct alignas(64) Config {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Linux gives the tile state only to a process that asks for it (once; torch's oneDNN asks
// too). False where the kernel refuses: the kernels then run their AVX-512 paths.
inline bool granted() {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    static const bool ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return ok;
}

// All eight tiles as 16 rows of 64 bytes. Per thread, before its first tile instruction
// (oneDNN, in the same threads, loads its own configuration before its own).
inline void configure() {
    Config config{};
    config.palette = 1;
    for (int t = 0; t < 8; ++t) {
        config.colsb[t] = 64;
        config.rows[t] = ROWS;
    }
    _tile_loadconfig(&config);
}

}  // namespace amx
#endif
