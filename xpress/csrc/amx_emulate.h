// The AMX tile unit in software, for tests on a CPU without it (built only with -DXP_AMX_EMULATE, which
// xpress/kernels.py passes where XPRESS_AMX_EMULATE=1; never the default).
//
// Why: the fused layer's products and attention have a path on AMX tiles (Intel Xeon since Sapphire Rapids)
// that only such a CPU runs. On any other CPU this header replaces the six tile intrinsics fused_cpu.cpp uses
// with functions over a per-thread register file of eight tiles, so that the tests exercise that code (its
// tile configurations, strides, panel layouts and row counts) and check it bit for bit for row invariance and
// against references, as they do on the Xeon. It is slow (scalar loops) and meant for the smoke shapes.
//
// What it follows, from Intel's description of the instructions (Intel 64 and IA-32 Architectures Software
// Developer's Manual, volume 2, LDTILECFG / TILELOADD / TILESTORED / TILEZERO / TDPBF16PS / TILERELEASE):
// - LDTILECFG reads 64 bytes: byte 0 the palette (1), byte 1 start_row, bytes 16..47 colsb[16] (uint16, bytes
//   per row of each tile), bytes 48..63 rows[16]; loading a configuration zeroes every tile;
// - TILELOADD reads rows(t) rows of colsb(t) bytes, row r from base + r * stride, and zeroes the rest of the
//   tile; TILESTORED writes the same rows back; TILEZERO zeroes one tile; TILERELEASE zeroes them all and
//   forgets the configuration (a tile used before LDTILECFG is an error here, a fault on the hardware);
// - TDPBF16PS: for each row m < rows(C) and float32 column n < colsb(C) / 4,
//   C[m][n] += A[m][2k] * B[k][2n], then += A[m][2k + 1] * B[k][2n + 1], for k = 0 .. colsb(A) / 4 - 1 in order;
//   the bf16 products are exact in float32, each sum rounds to nearest even; denormal inputs count as zero
//   and denormal results are flushed to zero.
// Whether the hardware rounds each of the two sums or fuses them is not for this header to decide: tests
// compare the tile path with itself (row invariance) and with float64 references to a tolerance, never with
// the hardware's bits.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace xp_emu {

struct Tiles {
  bool configured = false;
  int rows[8] = {};
  int colsb[8] = {};
  alignas(64) unsigned char t[8][16][64] = {};
};

inline Tiles& tiles() {
  static thread_local Tiles s;
  return s;
}

inline void check(int t) {
  if (!tiles().configured) throw std::runtime_error("AMX emulation: a tile used before _tile_loadconfig");
  if (t < 0 || t > 7) throw std::runtime_error("AMX emulation: no tile register tmm" + std::to_string(t));
}

inline void loadconfig(const void* cfg) {
  const unsigned char* c = static_cast<const unsigned char*>(cfg);
  if (c[0] != 1) throw std::runtime_error("AMX emulation: palette " + std::to_string(c[0]) + ", expected 1");
  Tiles& s = tiles();
  for (int t = 0; t < 8; ++t) {
    uint16_t colsb;
    std::memcpy(&colsb, c + 16 + 2 * t, 2);
    s.rows[t] = c[48 + t];
    s.colsb[t] = colsb;
    if (s.rows[t] > 16 || s.colsb[t] > 64 || s.colsb[t] % 4)
      throw std::runtime_error("AMX emulation: tile " + std::to_string(t) + " configured " + std::to_string(s.rows[t]) +
                               " rows x " + std::to_string(s.colsb[t]) + " bytes (at most 16 x 64, 4-byte columns)");
  }
  std::memset(s.t, 0, sizeof s.t);
  s.configured = true;
}

inline void zero(int t) {
  check(t);
  std::memset(tiles().t[t], 0, sizeof tiles().t[t]);
}

inline void loadd(int t, const void* base, long stride) {
  check(t);
  Tiles& s = tiles();
  std::memset(s.t[t], 0, sizeof s.t[t]);
  for (int r = 0; r < s.rows[t]; ++r) std::memcpy(s.t[t][r], static_cast<const char*>(base) + r * stride, s.colsb[t]);
}

inline void stored(int t, void* base, long stride) {
  check(t);
  Tiles& s = tiles();
  for (int r = 0; r < s.rows[t]; ++r) std::memcpy(static_cast<char*>(base) + r * stride, s.t[t][r], s.colsb[t]);
}

inline float bf16_in(const unsigned char* p) {  // a bf16 operand as float32, denormals as zero
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t u = static_cast<uint32_t>(h) << 16;
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline float flush(float f) {  // a denormal result to zero (its sign kept)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0) u &= 0x80000000u;
  std::memcpy(&f, &u, 4);
  return f;
}

inline void dpbf16ps(int c, int a, int b) {
  check(c);
  check(a);
  check(b);
  Tiles& s = tiles();
  const int M = s.rows[c], N = s.colsb[c] / 4, K = s.colsb[a] / 4;
  if (s.rows[a] != M || s.rows[b] != K || s.colsb[b] != s.colsb[c])
    throw std::runtime_error("AMX emulation: TDPBF16PS shapes do not match (C " + std::to_string(M) + " x " +
                             std::to_string(s.colsb[c]) + ", A " + std::to_string(s.rows[a]) + " x " +
                             std::to_string(s.colsb[a]) + ", B " + std::to_string(s.rows[b]) + " x " +
                             std::to_string(s.colsb[b]) + ")");
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      float acc;
      std::memcpy(&acc, s.t[c][m] + 4 * n, 4);
      for (int k = 0; k < K; ++k) {
        acc = flush(acc + bf16_in(s.t[a][m] + 4 * k) * bf16_in(s.t[b][k] + 4 * n));
        acc = flush(acc + bf16_in(s.t[a][m] + 4 * k + 2) * bf16_in(s.t[b][k] + 4 * n + 2));
      }
      std::memcpy(s.t[c][m] + 4 * n, &acc, 4);
    }
}

inline void release() {
  Tiles& s = tiles();
  std::memset(s.t, 0, sizeof s.t);
  s.configured = false;
}

}  // namespace xp_emu

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbf16ps
#define _tile_loadconfig(cfg) xp_emu::loadconfig(cfg)
#define _tile_loadd(t, base, stride) xp_emu::loadd(t, base, stride)
#define _tile_stored(t, base, stride) xp_emu::stored(t, base, stride)
#define _tile_zero(t) xp_emu::zero(t)
#define _tile_dpbf16ps(c, a, b) xp_emu::dpbf16ps(c, a, b)
#define _tile_release() xp_emu::release()
