// A Llama decoder layer for one sequence on an x86 CPU with AVX2 and FMA, in one call: float32 throughout,
// or with bf16 weights whose products run on AMX tiles or, on a CPU without tiles, with AVX512-BF16
// (everything else float32).
//
// Built and loaded by xpress/kernels.py (torch.utils.cpp_extension); used by xpress/runtime.py where
// `target.runtime` resolves to "fused". Why: at batch 1 on two cores, a Python decoder layer issues
// about sixty small operations, whose dispatch costs as much as the layer's arithmetic; here a layer is
// one call.
//
// Exactness by construction: every quantity a row produces is computed by the same sequence of float
// operations whatever the number of rows n in the call (a one-token step, a 16-token verify, a prefill
// chunk), so a verify reproduces the steps bit for bit:
// - linear(): each output element is acc = fma(x[m][k], w[k][j], acc) for k = 0..K-1 in order, from 0;
//   the row blocking only decides how many rows share a weight load; the bf16 products (AMX) likewise
//   accumulate each element over the input features in a fixed order, a tile row from its own row of x;
// - rms norm, RoPE, SiLU: per row, in a fixed order;
// - attention: query row i (absolute position L + i) reads cache columns 0..L+i only; the scores, the
//   softmax maximum, the denominator (lane by lane, then hsum) and the value sum run over those columns
//   in one fixed order; exp is a polynomial evaluated the same way in every lane (exp8).
// Compiled with -ffp-contract=off so that the compiler fuses nothing the source does not.
//
// The dFlash drafter's layers at inference (draft_layer, draft_context: one block of one sequence) use the
// same frame and products; they propose tokens that the target verifies, so they need no row invariance.
//
// Shapes: n rows (tokens), H hidden, I intermediate, nh / nkv query / key-value heads of width hd,
// g = nh / nkv; weights packed by pack(): [N / 16, K, 16] for a [N, K] nn.Linear weight (float32), or by
// pack_bf16(): [N / 16, K / 2, 16, 2] (bf16). The MLP's gate and up weights come as one [2 I, H] weight whose
// rows alternate in blocks of 16 (16 gate rows, the same 16 up rows, ...: xpress.runtime.interleave_gate_up).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <vector>

namespace {

// A buffer of at least n elements, one per thread and per use (Slot), kept between calls: no allocation and
// no zeroing once it has its size (fresh vectors of a few hundred KB per layer went to mmap, page faults and
// memset on every call: about 1.5 ms of a 16-token verify of SmolLM2-135M). Contents are left over: callers
// write before they read.
template <class T, int Slot>
T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// ------------------------------------------------------------------------------------------ linear
#ifndef XP_PREFETCH
#define XP_PREFETCH 1
#endif

// MR rows x NP panels of 16 output columns; w points at the first panel, panels K * 16 floats apart.
// With XP_PREFETCH, kernels of one or two panels (three rows or more) fetch the next panels while computing
// these: two streams from memory, not one (one sequential stream per core left a 4- or 8-row product
// waiting on memory; the one-row kernel already reads four panels at once, and prefetching slowed it).
// SPREAD: the kernel instead prefetches the `lines` cache lines (16 floats each) from `pf` on, one at the start
// of each of `lines` equal chunks of its K steps (a panel's row blocks share the next panel: linear_into).
template <int MR, int NP, bool SPREAD = false>
inline void micro(const float* x, int64_t ldx, const float* w, int64_t K, float* out, int64_t ldo,
                  const float* pf = nullptr, int64_t lines = 0) {
  __m256 acc[MR][NP][2];
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) acc[m][p][0] = acc[m][p][1] = _mm256_setzero_ps();
  const int64_t ps = K * 16;
  const int64_t chunks = SPREAD && lines > 0 ? lines : 1;
  for (int64_t c = 0; c < chunks; ++c) {  // k = 0 .. K-1 in order, whatever the chunks
    if (SPREAD && lines > 0) _mm_prefetch(reinterpret_cast<const char*>(pf + c * 16), _MM_HINT_T0);
    for (int64_t k = c * K / chunks, k1 = (c + 1) * K / chunks; k < k1; ++k) {
      __m256 w0[NP], w1[NP];
#pragma GCC unroll 8
      for (int p = 0; p < NP; ++p) {
        w0[p] = _mm256_loadu_ps(w + p * ps + k * 16);
        w1[p] = _mm256_loadu_ps(w + p * ps + k * 16 + 8);
        if (XP_PREFETCH && NP <= 2 && !SPREAD)
          _mm_prefetch(reinterpret_cast<const char*>(w + (p + NP) * ps + k * 16), _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
#pragma GCC unroll 8
        for (int p = 0; p < NP; ++p) {
          acc[m][p][0] = _mm256_fmadd_ps(xb, w0[p], acc[m][p][0]);
          acc[m][p][1] = _mm256_fmadd_ps(xb, w1[p], acc[m][p][1]);
        }
      }
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int p = 0; p < NP; ++p) {
      _mm256_storeu_ps(out + m * ldo + p * 16, acc[m][p][0]);
      _mm256_storeu_ps(out + m * ldo + p * 16 + 8, acc[m][p][1]);
    }
}

// Panels p0..p1-1 for one block of MR rows: NP panels at a time, the rest in halves (NP = 4: 4s, a 2, a 1).
template <int MR, int NP>
void panels(const float* x, int64_t K, const float* W, int64_t p0, int64_t p1, float* o, int64_t N) {
  int64_t p = p0;
  for (; p + NP <= p1; p += NP) micro<MR, NP>(x, K, W + p * K * 16, K, o + p * 16, N);
  if constexpr (NP > 1) panels<MR, NP / 2>(x, K, W, p, p1, o, N);
}

constexpr int64_t PANELS_PER_TASK = 4;  // 64 output columns: what one row's kernel covers (micro<1, 4>)
constexpr int64_t PANEL_MAJOR_X = 32768;  // floats of x (128 KB) up to which a product of > 6 rows goes panel by panel

// Rows m .. m+5 of x (fewer at the end) against panels p0..p1-1, NP panels at a time.
inline void row_block(const float* x, int64_t M, int64_t m, int64_t K, const float* W, int64_t p0, int64_t p1,
                      float* o, int64_t N) {
  const float* xm = x + m * K;
  float* om = o + m * N;
  switch (std::min<int64_t>(6, M - m)) {
    case 6: panels<6, 1>(xm, K, W, p0, p1, om, N); break;
    case 5: panels<5, 1>(xm, K, W, p0, p1, om, N); break;
    case 4: panels<4, 1>(xm, K, W, p0, p1, om, N); break;
    case 3: panels<3, 2>(xm, K, W, p0, p1, om, N); break;
    case 2: panels<2, 3>(xm, K, W, p0, p1, om, N); break;
    default: panels<1, 4>(xm, K, W, p0, p1, om, N); break;
  }
}

// Every block of 6 rows (fewer at the end) against the one panel at w, each block prefetching its share of
// the K lines of the next panel, so that memory streams the next panel while all the rows use this one.
inline void panel_all_rows(const float* x, int64_t M, int64_t K, const float* w, float* o, int64_t N) {
  const int64_t blocks = (M + 5) / 6;
  const float* next = w + K * 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t m = 6 * b, l0 = b * K / blocks, lines = (b + 1) * K / blocks - l0;
    const float* xm = x + m * K;
    float* om = o + m * N;
    const float* pf = next + l0 * 16;
    switch (std::min<int64_t>(6, M - m)) {
      case 6: micro<6, 1, true>(xm, K, w, K, om, N, pf, lines); break;
      case 5: micro<5, 1, true>(xm, K, w, K, om, N, pf, lines); break;
      case 4: micro<4, 1, true>(xm, K, w, K, om, N, pf, lines); break;
      case 3: micro<3, 1, true>(xm, K, w, K, om, N, pf, lines); break;
      case 2: micro<2, 1, true>(xm, K, w, K, om, N, pf, lines); break;
      default: micro<1, 1, true>(xm, K, w, K, om, N, pf, lines); break;
    }
  }
}

// out[M, N] = x[M, K] @ W.T for W packed [N / 16, K, 16]; threads split the output columns. Up to 6 rows
// (a step, a short verify) the tasks are groups of PANELS_PER_TASK panels, at::parallel_for handing each
// thread a run of whole groups. Past 6 rows, while x fits in cache (a verify of 8 or 16 rows), each panel
// serves every row block before the next one (panel_all_rows), so that memory streams the next panel while
// the rows use this one, and the threads take equal runs of panels (36 panels go 18 + 18, not 5 + 4 groups).
// Larger products (regeneration's batches) walk a group of panels once per row block, from cache. No order
// changes a single output element's sequence of operations. (Equal runs at one row measured slower: the
// runs' ends fall off the four-panel kernel.)
// done(p0, p1): called on each thread once its run of panels p0..p1-1 is written for every row (an epilogue
// on those output columns, without another parallel region); its runs are whole pairs of panels where
// `pairs` (PANELS_PER_TASK is even).
struct NoEpilogue {
  void operator()(int64_t, int64_t) const {}
};

template <class Done = NoEpilogue>
void linear_into(const float* x, int64_t M, int64_t K, const float* W, int64_t N, float* o, bool pairs = false,
                 Done done = {}) {
  const int64_t P = N / 16, u = pairs ? 2 : 1;
  if (M > 6 && M * K <= PANEL_MAJOR_X) {
    at::parallel_for(0, P / u, PANELS_PER_TASK / u, [&](int64_t u0, int64_t u1) {
      for (int64_t p = u0 * u; p < u1 * u; ++p) panel_all_rows(x, M, K, W + p * K * 16, o + p * 16, N);
      done(u0 * u, u1 * u);
    });
    return;
  }
  at::parallel_for(0, (P + PANELS_PER_TASK - 1) / PANELS_PER_TASK, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t p0 = g * PANELS_PER_TASK, p1 = std::min(P, p0 + PANELS_PER_TASK);
      for (int64_t m = 0; m < M; m += 6) row_block(x, M, m, K, W, p0, p1, o, N);  // panels stay in cache
    }
    done(g0 * PANELS_PER_TASK, std::min(P, g1 * PANELS_PER_TASK));
  });
}

// ------------------------------------------------------------------------------- bf16 products (AMX)
// On a CPU with AMX-BF16 (Intel Xeon since Sapphire Rapids) a bf16 weight runs on the tile unit: x is rounded
// to bf16 (to nearest even) and out[m][j] is accumulated in float32 by TDPBF16PS over the input features in
// tiles of 32, in order, from zero. The instruction computes every row of a tile from that row of A alone, so
// a row's bits do not depend on how many rows share the tile (a one-token step uses a tile of one row, a
// 16-token verify one of 16): row-invariant by construction, like linear_into. Weights packed by
// pack_bf16(): [N / 16, K / 2, 16, 2] (a panel of 16 output columns, pairs of input features adjacent: the
// layout TDPBF16PS reads as B). At 16 rows the tile unit's arithmetic is a small fraction of the time it
// takes to stream the weights, so a 16-token verify costs about what a one-token step does.
#if defined(__x86_64__) && (defined(__clang__) || __GNUC__ >= 11)
#define XP_AMX 1
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
#ifdef XP_AMX_EMULATE
#include "amx_emulate.h"  // the tile intrinsics in software, for tests on a CPU without tiles
#endif
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0-3: C (r rows x 16 float32), tmm4: A (r rows x 32 bf16), tmm5-7: B (16 pairs x 16 columns)
inline void amx_config(int r) {
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(t < 5 ? r : 16);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// r rows of x (bf16, rows K apart; r as configured) against NP panels from w (panels ps elements apart)
template <int NP>
inline void amx_block(const uint16_t* x, int64_t K, const uint16_t* w, int64_t ps, float* out, int64_t ldo) {
  _tile_zero(0);
  if constexpr (NP > 1) _tile_zero(1);
  if constexpr (NP > 2) _tile_zero(2);
  if constexpr (NP > 3) _tile_zero(3);
  for (int64_t kt = 0; kt < K / 32; ++kt) {  // input features 32 kt .. 32 kt + 31, in order
    const uint16_t* wk = w + kt * 512;
    _tile_loadd(4, x + kt * 32, K * 2);
    _tile_loadd(5, wk, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NP > 1) { _tile_loadd(6, wk + ps, 64); _tile_dpbf16ps(1, 4, 6); }
    if constexpr (NP > 2) { _tile_loadd(7, wk + 2 * ps, 64); _tile_dpbf16ps(2, 4, 7); }
    if constexpr (NP > 3) { _tile_loadd(5, wk + 3 * ps, 64); _tile_dpbf16ps(3, 4, 5); }
  }
  _tile_stored(0, out, ldo * 4);
  if constexpr (NP > 1) _tile_stored(1, out + 16, ldo * 4);
  if constexpr (NP > 2) _tile_stored(2, out + 32, ldo * 4);
  if constexpr (NP > 3) _tile_stored(3, out + 48, ldo * 4);
}

// x [M, K] float32 rounded to bf16 (to nearest even), K a multiple of 32
inline void to_bf16(const float* x, int64_t n, uint16_t* y) {
  for (int64_t j = 0; j < n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + j)));
}

// Two blocks of rows (16 in tmm4, r1 in tmm5) against NP <= 2 panels (tmm6, tmm7): each weight tile loaded once
// serves 32 rows (C: tmm0 / tmm1 for the first block, tmm2 / tmm3 for the second). Same per-element order.
template <int NP>
inline void amx_block2(const uint16_t* x, int64_t K, const uint16_t* w, int64_t ps, float* out, int64_t ldo) {
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NP > 1) { _tile_zero(1); _tile_zero(3); }
  for (int64_t kt = 0; kt < K / 32; ++kt) {
    const uint16_t* wk = w + kt * 512;
    _tile_loadd(4, x + kt * 32, K * 2);
    _tile_loadd(5, x + 16 * K + kt * 32, K * 2);
    _tile_loadd(6, wk, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (NP > 1) { _tile_loadd(7, wk + ps, 64); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(3, 5, 7); }
  }
  _tile_stored(0, out, ldo * 4);
  _tile_stored(2, out + 16 * ldo, ldo * 4);
  if constexpr (NP > 1) { _tile_stored(1, out + 16, ldo * 4); _tile_stored(3, out + 16 * ldo + 16, ldo * 4); }
}

inline void amx_config2(int r1) {  // tmm0, tmm1, tmm4: 16 rows; tmm2, tmm3, tmm5: r1 rows; tmm6, tmm7: 16
  TileConfig c;
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(t == 2 || t == 3 || t == 5 ? r1 : 16);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// The frame of both bf16 products: x [M, K] rounded to bf16 once (xb), the threads take equal runs of the
// N / 16 panels (whole pairs where `pairs`; 36 panels go 18 + 18), each run walked in groups of `group`
// panels, block(xb, p0, p1) computing every row for panels p0..p1-1; then, on each thread, finish() and
// done(q0, q1) for its run (done, pairs: as linear_into's).
template <class Block, class Finish, class Done>
void bf16_panel_runs(const float* x, int64_t M, int64_t K, int64_t N, int64_t group, bool pairs, Block block,
                     Finish finish, Done done) {
  uint16_t* xb = scratch<uint16_t, 0>(static_cast<size_t>(M * K));
  to_bf16(x, M * K, xb);
  const int64_t u = pairs ? 2 : 1;
  at::parallel_for(0, N / 16 / u, 1, [&](int64_t u0, int64_t u1) {
    const int64_t q0 = u0 * u, q1 = u1 * u;
    for (int64_t p0 = q0; p0 < q1; p0 += group) block(static_cast<const uint16_t*>(xb), p0, std::min(q1, p0 + group));
    finish();
    done(q0, q1);
  });
}

// out[M, N] = bf16(x[M, K]) @ W.T in float32, W packed by pack_bf16(); the threads take equal runs of panels,
// each group of four serving every block of rows before the next group (its weights come from memory once):
// pairs of blocks first (amx_block2: 16 rows and up to 16 more, so 17-31 rows left take one pass over the
// weights, not two), then what is left, at most 16 rows, in one block (amx_block).
// done, pairs: as linear_into's.
template <class Done = NoEpilogue>
void linear_bf16_into(const float* x, int64_t M, int64_t K, const uint16_t* W, int64_t N, float* o,
                      bool pairs = false, Done done = {}) {
  const int64_t ps = K * 16;
  auto block = [&](const uint16_t* xb, int64_t p0, int64_t p1) {
    int64_t m = 0;
    for (int configured = 0; M - m > 16; m += 32) {  // 16 rows and up to 16 more: one pass over the weights
      const int r1 = static_cast<int>(std::min<int64_t>(16, M - m - 16));
      if (r1 != configured) { amx_config2(r1); configured = r1; }
      for (int64_t p = p0; p < p1;) {
        float* om = o + m * N + p * 16;
        if (p + 2 <= p1) { amx_block2<2>(xb + m * K, K, W + p * ps, ps, om, N); p += 2; }
        else { amx_block2<1>(xb + m * K, K, W + p * ps, ps, om, N); p += 1; }
      }
    }
    for (; m < M; m += 16) {
      amx_config(static_cast<int>(std::min<int64_t>(16, M - m)));
      const uint16_t* xm = xb + m * K;
      for (int64_t p = p0; p < p1;) {
        float* om = o + m * N + p * 16;
        if (p + 4 <= p1) { amx_block<4>(xm, K, W + p * ps, ps, om, N); p += 4; }
        else if (p + 2 <= p1) { amx_block<2>(xm, K, W + p * ps, ps, om, N); p += 2; }
        else { amx_block<1>(xm, K, W + p * ps, ps, om, N); p += 1; }
      }
    }
  };
  bf16_panel_runs(x, M, K, N, PANELS_PER_TASK, pairs, block, [] { _tile_release(); }, done);
}

// ------------------------------------------------------------------ bf16 products on AVX512-BF16 (no AMX)
// A CPU with AVX512-BF16 but no tiles (AMD EPYC since Zen 4) multiplies the same packed weights with
// VDPBF16PS on 16 lanes: a panel's 16 columns x 2 features of one feature pair are one 512-bit load, the
// row's 2 features one broadcast 32-bit word. out[m][j] is accumulated in float32 over the feature pairs in
// order, from zero, each row by the same sequence of instructions whatever the number of rows or which block
// it falls in: row-invariant by construction. Products of several rows take blocks of 8 rows x 3 panels (24
// accumulators: 11 loads for 24 VDPBF16PS), the full row blocks sharing out the prefetch of the next 3 panels,
// and the rows left over in blocks of 4, 2 and 1 on the same panels; one row takes 4 panels (4 independent chains).
// Products of 2-4 rows (a verify of k = 1-3 drafts) take 4 panels in blocks of up to 4 rows, a block of 4
// prefetching each panel 1 KB (16 feature pairs) ahead of its loads (PF_AHEAD).
// Measured on a 2-core AVX512-BF16 EPYC (SmolLM2-135M's products and LM head, random weights, medians):
// 16 rows 14.5 ms with 16 x 1 blocks, 8.7 with 8 x 3, 8.1-8.3 with the prefetch; 8 x 2, 4 x 4, 6 x 4 in between.
// The 2-4 row blocks were chosen the same way, by probes that switch variants inside one process (their
// timings were not kept: between separate runs this VM's one-row step alone moves by 20-40%). The last one
// (2026-12-04, Zen 5, the target's 4-token verify after 200 tokens, 150-250 interleaved repeats, a placebo
// variant within 0.2%): 1 KB ahead 1.8-3.3% sooner than 4 KB in three runs, 1.5 KB 2.4%, 512 B and 8 KB no
// better; 4 x 6 blocks 15-25% slower than 4 x 4, 4 x 3 prefetching the next panels 3%, 4 x 2 no better; and for
// one row any prefetch made the step 4-6% slower. 2026-12-05, the same CPU, all of SmolLM2-135M's products in
// bf16 (random weights, 15-21 interleaved repeats, medians): the next group's prefetch shared out over the row
// blocks instead of issued by the first, 16 rows 7.1-7.4 ms for 7.8-8.2 (24 rows 9.4 for 10.3, 128 rows 3% less);
// the alternative, K in chunks of 32 or 64 pairs with every row block on a chunk before the next, was faster at 12
// and 16 rows in some runs and slower in others, and 8-20% slower at 32 and 128.
enum Prefetch { PF_NONE, PF_NEXT, PF_AHEAD };  // none; the next NP panels at the same depth; 16 pairs ahead
constexpr int64_t PF_PAIRS = 16;  // PF_AHEAD's distance in feature pairs (64 bytes each in a panel)
// PF_NEXT: only the feature pairs kp with kp % pf_blocks == pf_block (the row blocks of one group share out the
// next group's lines, so that memory streams while every block computes, not only while the first does).
template <int MR, int NP, int PF = PF_NONE>
inline void dp_block(const uint16_t* x, int64_t K, const uint16_t* w, int64_t ps, float* out, int64_t ldo,
                     int64_t pf_blocks = 1, int64_t pf_block = 0) {
  __m512 acc[MR][NP];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_setzero_ps();
  const int32_t* xi = reinterpret_cast<const int32_t*>(x);  // row m's pair kp: xi[m * K / 2 + kp]
  const int64_t K2 = K / 2;
  for (int64_t kp = 0; kp < K2; ++kp) {
    __m512bh wv[NP];
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) {
      wv[p] = (__m512bh)_mm512_loadu_si512(w + p * ps + kp * 32);
      if constexpr (PF == PF_NEXT) if (kp % pf_blocks == pf_block) _mm_prefetch(reinterpret_cast<const char*>(w + (p + NP) * ps + kp * 32), _MM_HINT_T0);
      if constexpr (PF == PF_AHEAD) _mm_prefetch(reinterpret_cast<const char*>(w + p * ps + (kp + PF_PAIRS) * 32), _MM_HINT_T0);
    }
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(xi[m * K2 + kp]);
#pragma GCC unroll 4
      for (int p = 0; p < NP; ++p) acc[m][p] = _mm512_dpbf16_ps(acc[m][p], xb, wv[p]);
    }
  }
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int p = 0; p < NP; ++p) _mm512_storeu_ps(out + m * ldo + p * 16, acc[m][p]);
}

// Panels p0..p1-1 (NP at a time, the rest one by one) for rows m0..M-1 in blocks of MR, the rows left over in
// blocks of MR / 2, MR / 4, ..., 1 on the same panels: each group of NP panels serves every row block (from cache).
// PF: PF_NEXT, while there is a next group: every full block of rows prefetches its share of that group's lines
// (one block fetching it all left memory idle while the others computed: a 16-row product 9% slower, 24 rows 9%,
// 12 rows 2.5%); PF_AHEAD: the first full block of rows on each group of panels prefetches.
template <int MR, int NP, int PF = PF_NONE>
inline void dp_group(const uint16_t* xb, int64_t m0, int64_t M, int64_t K, const uint16_t* W, int64_t ps, int64_t p0,
                     int64_t p1, float* o, int64_t N) {
  int64_t p = p0;
  const int64_t blocks = (M - m0) / MR;  // full blocks of rows
  for (; p + NP <= p1; p += NP) {
    int64_t m = m0;
    for (; m + MR <= M; m += MR) {
      if (PF == PF_NEXT && p + 2 * NP <= p1)
        dp_block<MR, NP, PF_NEXT>(xb + m * K, K, W + p * ps, ps, o + m * N + p * 16, N, blocks, (m - m0) / MR);
      else if (PF == PF_AHEAD && m == m0) dp_block<MR, NP, PF_AHEAD>(xb + m * K, K, W + p * ps, ps, o + m * N + p * 16, N);
      else dp_block<MR, NP>(xb + m * K, K, W + p * ps, ps, o + m * N + p * 16, N);
    }
    if constexpr (MR > 1) if (m < M) dp_group<MR / 2 >= 1 ? MR / 2 : 1, NP>(xb, m, M, K, W, ps, p, p + NP, o, N);
  }
  if constexpr (NP > 1) if (p < p1) dp_group<MR, 1, PF == PF_AHEAD ? PF_AHEAD : PF_NONE>(xb, m0, M, K, W, ps, p, p1, o, N);
}

// out[M, N] = bf16(x[M, K]) @ W.T in float32 with VDPBF16PS, W packed by pack_bf16(); the threads take equal
// runs of panels, each run one dp_group (each group of NP panels serving every block of rows before the next,
// from cache, and prefetching the next across the whole run: runs cut into groups of 12 panels left every
// fourth group unprefetched, and 8, 16 and 24 rows 6-12% slower). 3 and 5-7 rows take one prefetching block of
// their own size: in the 4 x 4 or 8 x 3 blocks they had no full block, so no row block prefetched and the
// remainders waited on memory (scripts/bf16_rows_ab.py --against bafceba, results/archive/cpu/kernel_ab/: Zen 5, all of
// SmolLM2-135M's products, 3 rows 7.5% and 5-7 rows 13-18% sooner, the same bits; in a one-off probe of an
// intermediate build a prefetching block of 2 rows was 3% slower than the unprefetched one, so 2 rows stay).
// done, pairs: as linear_into's.
constexpr int64_t DP_PANELS = int64_t{1} << 30;  // panels per dp_group call: the whole run
template <class Done = NoEpilogue>
void linear_bf16_dp_into(const float* x, int64_t M, int64_t K, const uint16_t* W, int64_t N, float* o,
                         bool pairs = false, Done done = {}) {
  const int64_t ps = K * 16;
  auto block = [&](const uint16_t* xb, int64_t p0, int64_t p1) {
    if (M == 1) dp_group<1, 4>(xb, 0, M, K, W, ps, p0, p1, o, N);
    else if (M == 3) dp_group<3, 4, PF_AHEAD>(xb, 0, M, K, W, ps, p0, p1, o, N);
    else if (M <= 4) dp_group<4, 4, PF_AHEAD>(xb, 0, M, K, W, ps, p0, p1, o, N);  // 2 rows: one block of 2, unprefetched
    else if (M == 5) dp_group<5, 4, PF_AHEAD>(xb, 0, M, K, W, ps, p0, p1, o, N);
    else if (M == 6) dp_group<6, 4, PF_AHEAD>(xb, 0, M, K, W, ps, p0, p1, o, N);
    else if (M == 7) dp_group<7, 3, PF_AHEAD>(xb, 0, M, K, W, ps, p0, p1, o, N);
    else dp_group<8, 3, PF_NEXT>(xb, 0, M, K, W, ps, p0, p1, o, N);
  };
  bf16_panel_runs(x, M, K, N, DP_PANELS, pairs, block, [] {}, done);
}
#pragma GCC pop_options
#endif

// Whether this CPU has every AVX-512 extension the code after `#pragma GCC target` may use (F, BW, VL,
// BF16): the row loops then take 16 lanes at a time (the same values as 8)
inline bool wide() {
#ifdef XP_AMX
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

// True where the CPU has AMX-BF16 tiles and every AVX-512 extension the code around them uses (wide(): the
// conversions to bf16, the softmax), and Linux grants the tile state (asked once per process). The permission
// alone is not enough: a VM may grant tile state yet hide AMX-BF16 or AVX512-BF16, and the tiles' path would
// then stop on an illegal instruction instead of falling back.
bool amx_ready() {
#ifdef XP_AMX_EMULATE
  return wide();  // amx_emulate.h stands in for the tiles; the code around them still needs AVX-512
#elif defined(XP_AMX)
  static const bool ok = wide() && __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
                         syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
#else
  return false;
#endif
}

// Whether bf16 products run here: on AMX tiles (amx_ready) or, without them, with AVX512-BF16 (wide).
// XPRESS_BF16_DOT=0 in the environment turns the AVX512-BF16 path off (the path before, for A/B runs).
bool bf16_ready() {
  static const bool dot = [] { const char* e = std::getenv("XPRESS_BF16_DOT"); return !(e && e[0] == '0'); }();
  return amx_ready() || (dot && wide());
}

// out[M, N] = x[M, K] @ W.T for W packed by pack() (float32) or pack_bf16() (bf16: AMX tiles, else AVX512-BF16);
// then done(p0, p1) on each thread for its run of panels (whole pairs of panels where `pairs`)
template <class Done = NoEpilogue>
void product(const float* x, int64_t M, int64_t K, const torch::Tensor& W, int64_t N, float* o, bool pairs = false,
             Done done = {}) {
  if (W.scalar_type() == torch::kFloat32) return linear_into(x, M, K, W.data_ptr<float>(), N, o, pairs, done);
#ifdef XP_AMX
  TORCH_CHECK(bf16_ready() && K % 32 == 0, "bf16 products need AMX tiles or AVX512-BF16, and K % 32 == 0");
  const uint16_t* w = reinterpret_cast<const uint16_t*>(W.data_ptr());
  if (amx_ready()) linear_bf16_into(x, M, K, w, N, o, pairs, done);
  else linear_bf16_dp_into(x, M, K, w, N, o, pairs, done);
#else
  TORCH_CHECK(false, "bf16 products need AMX (this build has none)");
#endif
}

// -------------------------------------------------------------------------------------- row helpers
inline float hsum(__m256 v) {  // a fixed order: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y = x / sqrt(mean(x^2) + eps) * w for one row of H (a multiple of 8)
inline void rms_row(const float* x, const float* w, float* y, int64_t H, float eps) {
  __m256 a = _mm256_setzero_ps();
  for (int64_t j = 0; j < H; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    a = _mm256_fmadd_ps(v, v, a);
  }
  const float r = 1.0f / std::sqrt(hsum(a) / static_cast<float>(H) + eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (int64_t j = 0; j < H; j += 8)
    _mm256_storeu_ps(y + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + j), rv), _mm256_loadu_ps(w + j)));
}

// exp(x) on 8 lanes (Cephes' expf: x = k ln2 + r, a degree-6 polynomial in r, times 2^k); relative error
// about 2e-7; exp(-inf) = 0. The same operations for every lane, so a lane's value does not depend on the others.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.0f));
  __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(k, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// ------------------------------------------------------------------------------------------ attention
// What a query row computes depends on that row alone: its scores, maximum, numerators, denominator and value
// sums each run over its own columns 0..L+i in one fixed order, whichever rows share the call.
constexpr int64_t COLS = 64;  // columns per tile: 64 keys of width 64 are 16 KB

// s[c] = (q . k_c) * scale for c in [c0, c1): lane l sums q[8d + l] k_c[8d + l] over the chunks d in order,
// then hsum. DC > 0: the head width is 8 * DC, and q stays in registers.
template <int DC>
inline void scores_fixed(const float* q, const float* kb, int64_t c0, int64_t c1, float scale, float* s) {
  __m256 qv[DC];
#pragma GCC unroll 16
  for (int d = 0; d < DC; ++d) qv[d] = _mm256_loadu_ps(q + d * 8);
  for (int64_t c = c0; c < c1; ++c) {
    const float* kc = kb + c * DC * 8;
    __m256 a = _mm256_mul_ps(qv[0], _mm256_loadu_ps(kc));
#pragma GCC unroll 16
    for (int d = 1; d < DC; ++d) a = _mm256_fmadd_ps(qv[d], _mm256_loadu_ps(kc + d * 8), a);
    s[c] = hsum(a) * scale;
  }
}

inline void scores(const float* q, const float* kb, int64_t hd, int64_t c0, int64_t c1, float scale, float* s) {
  if (hd == 64) return scores_fixed<8>(q, kb, c0, c1, scale, s);
  if (hd == 128) return scores_fixed<16>(q, kb, c0, c1, scale, s);
  const int64_t D = hd / 8;  // the same operations, q read from memory
  for (int64_t c = c0; c < c1; ++c) {
    const float* kc = kb + c * hd;
    __m256 a = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_loadu_ps(kc));
    for (int64_t d = 1; d < D; ++d) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d * 8), _mm256_loadu_ps(kc + d * 8), a);
    s[c] = hsum(a) * scale;
  }
}

// s[c] <- exp(s[c] - max_c s) for c < cols; returns their sum, accumulated lane by lane (c mod 8) in order
// of c and then hsum (the padding of the last chunk is exp(-inf) = 0)
inline float softmax_numerators(float* s, int64_t cols) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int64_t c = 0;
  for (; c + 8 <= cols; c += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + c));
  float top = -INFINITY;
  alignas(32) float t[8];
  _mm256_store_ps(t, top8);
  for (int u = 0; u < 8; ++u) top = std::max(top, t[u]);
  for (int64_t u = c; u < cols; ++u) top = std::max(top, s[u]);
  const __m256 tv = _mm256_set1_ps(top);
  __m256 sum = _mm256_setzero_ps();
  for (c = 0; c + 8 <= cols; c += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + c), tv));
    _mm256_storeu_ps(s + c, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (c < cols) {
    for (int u = 0; u < 8; ++u) t[u] = c + u < cols ? s[c + u] - top : -INFINITY;
    const __m256 e = exp8(_mm256_load_ps(t));
    _mm256_store_ps(t, e);
    for (int u = 0; c + u < cols; ++u) s[c + u] = t[u];
    sum = _mm256_add_ps(sum, e);
  }
  return hsum(sum);
}

// num[h][:] += p[h][c] * v_c[:] for c in [c0, c1) in order, for NR heads at once (p rows ldp apart, num rows
// hd apart); the accumulators of four chunks of 8 per head stay in registers over the tile
template <int NR>
inline void value_sums(const float* p, int64_t ldp, const float* vb, int64_t hd, int64_t c0, int64_t c1, float* num) {
  const int64_t D = hd / 8;
  int64_t d0 = 0;
  for (; d0 + 4 <= D; d0 += 4) {
    __m256 acc[NR][4];
#pragma GCC unroll 4
    for (int h = 0; h < NR; ++h)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) acc[h][u] = _mm256_loadu_ps(num + h * hd + (d0 + u) * 8);
    for (int64_t c = c0; c < c1; ++c) {
      const float* vc = vb + c * hd + d0 * 8;
#pragma GCC unroll 4
      for (int h = 0; h < NR; ++h) {
        const __m256 pb = _mm256_broadcast_ss(p + h * ldp + c);
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) acc[h][u] = _mm256_fmadd_ps(pb, _mm256_loadu_ps(vc + u * 8), acc[h][u]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < NR; ++h)
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) _mm256_storeu_ps(num + h * hd + (d0 + u) * 8, acc[h][u]);
  }
  for (; d0 < D; ++d0) {  // widths that are not a multiple of 32
    __m256 acc[NR];
    for (int h = 0; h < NR; ++h) acc[h] = _mm256_loadu_ps(num + h * hd + d0 * 8);
    for (int64_t c = c0; c < c1; ++c)
      for (int h = 0; h < NR; ++h)
        acc[h] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + h * ldp + c), _mm256_loadu_ps(vb + c * hd + d0 * 8), acc[h]);
    for (int h = 0; h < NR; ++h) _mm256_storeu_ps(num + h * hd + d0 * 8, acc[h]);
  }
}

void check(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), name,
              ": a contiguous float32 CPU tensor is required");
}

// a packed weight: float32 from pack() or bf16 from pack_bf16()
void check_weight(const torch::Tensor& t, const char* name) {
  TORCH_CHECK((t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16) && t.is_contiguous() &&
              t.device().is_cpu(), name, ": a contiguous packed float32 or bf16 CPU tensor is required");
}

// Attention of rows r0..r1-1 of one sequence for key-value head kh: row i sits at cache column L + i and
// reads columns 0..L+i of kb / vb (that head's keys and values, [cap, hd]); its g query heads are at
// qkv + i * Q + (kh * g + j) * hd, its outputs go to att + i * nh * hd + (kh * g + j) * hd. Each pass walks the
// columns in tiles of COLS, so that a tile of keys or values stays in L1 while every row of the block reads it.
void attend(const float* qkv, int64_t Q, const float* kb, const float* vb, int64_t hd, int64_t L, int64_t r0,
            int64_t r1, int64_t kh, int64_t g, int64_t nh, float* att) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t D = hd / 8, R = (r1 - r0) * g;
  const int64_t width = L + r1;  // columns the last row of the block sees
  float* s = scratch<float, 1>(static_cast<size_t>(R * width));
  float* num = scratch<float, 2>(static_cast<size_t>(R * hd));
  float* den = scratch<float, 3>(static_cast<size_t>(R));
  std::fill(num, num + R * hd, 0.0f);
  for (int64_t c0 = 0; c0 < width; c0 += COLS)  // scores s[r][c] = q_r . k_c * scale
    for (int64_t i = r0; i < r1; ++i) {
      const int64_t c1 = std::min(c0 + COLS, L + i + 1);
      for (int64_t j = 0; c0 < c1 && j < g; ++j)
        scores(qkv + i * Q + (kh * g + j) * hd, kb, hd, c0, c1, scale, s + ((i - r0) * g + j) * width);
    }
  for (int64_t i = r0; i < r1; ++i)  // s[r][c] <- exp(s[r][c] - max), den[r] = their sum
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = (i - r0) * g + j;
      den[r] = softmax_numerators(s + r * width, L + i + 1);
    }
  for (int64_t c0 = 0; c0 < width; c0 += COLS)  // num[r] += s[r][c] * v_c, the g heads of a row together
    for (int64_t i = r0; i < r1; ++i) {
      const int64_t c1 = std::min(c0 + COLS, L + i + 1);
      for (int64_t j = 0; c0 < c1 && j < g; j += 3) {
        const int64_t r = (i - r0) * g + j;
        switch (std::min<int64_t>(3, g - j)) {
          case 3: value_sums<3>(s + r * width, width, vb, hd, c0, c1, num + r * hd); break;
          case 2: value_sums<2>(s + r * width, width, vb, hd, c0, c1, num + r * hd); break;
          default: value_sums<1>(s + r * width, width, vb, hd, c0, c1, num + r * hd); break;
        }
      }
    }
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t r = (i - r0) * g + j;
      const __m256 inv = _mm256_set1_ps(1.0f / den[r]);
      float* o = att + i * nh * hd + (kh * g + j) * hd;
      for (int64_t d = 0; d < D; ++d) _mm256_storeu_ps(o + d * 8, _mm256_mul_ps(_mm256_loadu_ps(num + r * hd + d * 8), inv));
    }
}

#ifdef XP_AMX
// ----------------------------------------------------------------------------- attention on AMX tiles
// With bf16 weights on AMX, attention's two products run on the tiles too: q . k and p . v with bf16
// operands (rounded to nearest even) and float32 sums, what a bf16 model's attention computes. Each score
// and each output element is one TDPBF16PS sum over its own row of A and column of B, in order over the head
// width (scores) or the key columns (outputs), from zero; so a query row's bits do not depend on the other
// rows of its tile. The softmax is attend()'s, in float32, over the row's own columns 0..L+i; its numerators
// are rounded to bf16, and zero past L+i (the rows of a verify see later columns than a step, whose extra
// products are exact zeros: x + 0 * v = x). The cache stays float32 [cap, hd]; the keys and values are read
// rounded to bf16 in the tiles' layouts (keys: blocks of 16 columns, pairs of head features adjacent; values:
// pairs of key columns adjacent), which a one-sequence cache keeps (layer()'s key_tiles, value_tiles: each call
// lays out only its new columns; without that store, a pass over the whole cache per call cost a one-token step
// at 1,000 tokens 10% more than float32 attention). On a CPU without tiles, attend_bf16() computes the same
// products with VDPBF16PS.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")

// exp8()'s operations on 16 lanes: the same value in every lane as exp8 gives it
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)), _mm512_set1_ps(-88.0f));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(k, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(k, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

// lanes 0..left-1 set (left in 0..16)
inline __mmask16 first(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(0, left)) - 1);
}

// The tiles' softmax of one row: s[c] <- s[c] * scale, then exp(s[c] - max) for c < cols; returns their sum,
// accumulated lane by lane (c mod 16) in order of c, then over the lanes in a fixed order
inline float softmax_numerators16(float* s, int64_t cols, float scale) {
  const __m512 sv = _mm512_set1_ps(scale);
  __m512 top = _mm512_set1_ps(-INFINITY);
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 k = first(cols - c);
    const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + c), sv);
    _mm512_mask_storeu_ps(s + c, k, v);
    top = _mm512_mask_max_ps(top, k, top, v);
  }
  const __m512 tv = _mm512_set1_ps(_mm512_reduce_max_ps(top));  // a maximum: exact in any order
  __m512 sum = _mm512_setzero_ps();
  for (int64_t c = 0; c < cols; c += 16) {
    const __mmask16 k = first(cols - c);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + c), tv)));
    _mm512_mask_storeu_ps(s + c, k, e);
    sum = _mm512_add_ps(sum, e);
  }
  alignas(64) float t[16];
  _mm512_store_ps(t, sum);
  float total = 0.0f;
  for (int u = 0; u < 16; ++u) total += t[u];
  return total;
}

// act[j] = gate[j] / (1 + exp(-gate[j])) * up[j], 16 at a time: the operations of the 8-lane loop in
// decoder_layer, so the same values
inline void silu16(const float* gate, const float* up, float* act, int64_t I) {
  for (int64_t j = 0; j < I; j += 16) {
    const __mmask16 k = first(I - j);
    const __m512 gt = _mm512_maskz_loadu_ps(k, gate + j);
    const __m512 en = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gt));
    const __m512 a = _mm512_mul_ps(_mm512_div_ps(gt, _mm512_add_ps(_mm512_set1_ps(1.0f), en)),
                                   _mm512_maskz_loadu_ps(k, up + j));
    _mm512_mask_storeu_ps(act + j, k, a);
  }
}

// the 16 x 16 matrix of 32-bit elements in r, transposed in place
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + q]: element 4 l + q of rows i..i+3, in 128-bit lane l
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int q = 0; q < 4; ++q) {
    const __m512i a01 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0x44), a23 = _mm512_shuffle_i32x4(r[q], r[4 + q], 0xEE);
    const __m512i b01 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0x44);
    const __m512i b23 = _mm512_shuffle_i32x4(r[8 + q], r[12 + q], 0xEE);
    t[q] = _mm512_shuffle_i32x4(a01, b01, 0x88);
    t[4 + q] = _mm512_shuffle_i32x4(a01, b01, 0xDD);
    t[8 + q] = _mm512_shuffle_i32x4(a23, b23, 0x88);
    t[12 + q] = _mm512_shuffle_i32x4(a23, b23, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// 32 floats (hi: the upper 16) -> 32 bf16 in order
inline __m512i bf16x32(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

// Keys kb [cap, hd] columns 0..width-1 (zero past them, up to W, a multiple of 16) -> kt: for each block of
// 16 columns and each 32 head features, a B tile [16 feature pairs][16 columns][2] (1 KB); the blocks from the
// one holding column `from` on (those before it are left as they are)
inline void keys_to_tiles(const float* kb, int64_t hd, int64_t width, int64_t W, uint16_t* kt, int64_t from = 0) {
  const int64_t KT = hd / 32;
  for (int64_t cb = from / 16; cb < W / 16; ++cb)
    for (int64_t k = 0; k < KT; ++k) {
      __m512i r[16];
      for (int c = 0; c < 16; ++c) {
        const int64_t col = cb * 16 + c;
        if (col < width) {
          const float* src = kb + col * hd + k * 32;
          r[c] = bf16x32(_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16));
        } else {
          r[c] = _mm512_setzero_si512();
        }
      }
      transpose16(r);
      uint16_t* dst = kt + (cb * KT + k) * 512;
      for (int p = 0; p < 16; ++p) _mm512_storeu_si512(dst + p * 32, r[p]);
    }
}

// Values vb [cap, hd] columns 0..width-1 (zero past them, up to W, a multiple of 32) -> vt: for each block of
// 32 columns and each 16 head features, a B tile [16 column pairs][16 features][2] (1 KB); from: as keys_to_tiles
inline void values_to_tiles(const float* vb, int64_t hd, int64_t width, int64_t W, uint16_t* vt, int64_t from = 0) {
  const int64_t DT = hd / 16;
  alignas(64) static const uint16_t inter[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(inter);
  for (int64_t c = from / 32 * 32; c < W; c += 2) {  // columns c, c + 1: row (c % 32) / 2 of the block's tiles
    const float* a = vb + c * hd;
    uint16_t* dst = vt + (c / 32) * DT * 512 + ((c % 32) / 2) * 32;
    for (int64_t d = 0; d < DT; ++d) {
      const __m512 x = c < width ? _mm512_loadu_ps(a + d * 16) : _mm512_setzero_ps();
      const __m512 y = c + 1 < width ? _mm512_loadu_ps(a + hd + d * 16) : _mm512_setzero_ps();
      _mm512_storeu_si512(dst + d * 512, _mm512_permutexvar_epi16(idx, bf16x32(x, y)));
    }
  }
}

// The nkv heads' keys and values (kp, vp [nkv, cap, hd]) columns 0..width-1 in the tiles' layouts, head by
// head, `stride` elements a head (at least W * hd, W: width rounded up to 32), the threads taking heads: what
// attend_bf16() reads where several of its calls share a head, or a cache's own store of the
// layouts (from: the first column not laid out there yet; the blocks before its own are kept)
void heads_to_tiles(const float* kp, const float* vp, int64_t nkv, int64_t cap, int64_t hd, int64_t width,
                    uint16_t* kt, uint16_t* vt, int64_t stride, int64_t from = 0) {
  const int64_t W = (width + 31) / 32 * 32;
  at::parallel_for(0, nkv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t kh = h0; kh < h1; ++kh) {
      keys_to_tiles(kp + kh * cap * hd, hd, width, W, kt + kh * stride, from);
      values_to_tiles(vp + kh * cap * hd, hd, width, W, vt + kh * stride, from);
    }
  });
}

// The tiles' attention products on a CPU without them (attend_bf16 with amx false): the same bf16 operands in
// the same layouts (keys_to_tiles, values_to_tiles), each product VDPBF16PS on 16 lanes. A score (16 columns a
// vector) sums its head's feature pairs in order from zero; an output (16 features a vector) sums its column
// pairs in order from zero, the numerators past the row's own columns exact zeros: so whatever the rows in the
// call, each row computes the same instructions on the same values (row-invariant). The blocks of rows (4, 2, 1)
// and of columns only decide how many vectors share a load.
template <int MR, int NC>
inline void dp_scores(const uint16_t* qb, int64_t hd, const uint16_t* kt, int64_t cb, float* s, int64_t W) {
  const int64_t KT = hd / 32, H2 = hd / 2;
  const int32_t* q = reinterpret_cast<const int32_t*>(qb);  // row m's feature pair kp: q[m * H2 + kp]
  __m512 acc[MR][NC];
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < KT; ++k)
    for (int64_t p = 0; p < 16; ++p) {
      __m512bh kv[NC];
      for (int c = 0; c < NC; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kt + ((cb + c) * KT + k) * 512 + p * 32);
      for (int m = 0; m < MR; ++m) {
        const __m512bh x = (__m512bh)_mm512_set1_epi32(q[m * H2 + k * 16 + p]);
        for (int c = 0; c < NC; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], x, kv[c]);
      }
    }
  for (int m = 0; m < MR; ++m)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(s + m * W + (cb + c) * 16, acc[m][c]);
}

template <int MR>
inline void dp_scores_rows(const uint16_t* qb, int64_t m, int64_t R, int64_t hd, const uint16_t* kt, float* s, int64_t W) {
  for (; m + MR <= R; m += MR) {
    int64_t cb = 0;
    for (; cb + 4 <= W / 16; cb += 4) dp_scores<MR, 4>(qb + m * hd, hd, kt, cb, s + m * W, W);
    for (; cb < W / 16; ++cb) dp_scores<MR, 1>(qb + m * hd, hd, kt, cb, s + m * W, W);
  }
  if constexpr (MR > 1) if (m < R) dp_scores_rows<MR / 2>(qb, m, R, hd, kt, s, W);
}

// num[m][d0 .. d0 + 16 ND) for MR rows: sum over the columns of p (bf16 numerators, rows W apart) times values
template <int MR, int ND>
inline void dp_values(const uint16_t* pb, int64_t W, const uint16_t* vt, int64_t DT, int64_t d0, float* num, int64_t hd) {
  const int32_t* p = reinterpret_cast<const int32_t*>(pb);  // row m's column pair cp: p[m * W / 2 + cp]
  __m512 acc[MR][ND];
  for (int m = 0; m < MR; ++m)
    for (int d = 0; d < ND; ++d) acc[m][d] = _mm512_setzero_ps();
  for (int64_t cp = 0; cp < W / 2; ++cp) {
    const uint16_t* b = vt + ((cp / 16) * DT + d0) * 512 + (cp % 16) * 32;
    __m512bh vv[ND];
    for (int d = 0; d < ND; ++d) vv[d] = (__m512bh)_mm512_loadu_si512(b + d * 512);
    for (int m = 0; m < MR; ++m) {
      const __m512bh x = (__m512bh)_mm512_set1_epi32(p[m * (W / 2) + cp]);
      for (int d = 0; d < ND; ++d) acc[m][d] = _mm512_dpbf16_ps(acc[m][d], x, vv[d]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int d = 0; d < ND; ++d) _mm512_storeu_ps(num + m * hd + (d0 + d) * 16, acc[m][d]);
}

template <int MR>
inline void dp_values_rows(const uint16_t* pb, int64_t m, int64_t R, int64_t W, const uint16_t* vt, int64_t hd, float* num) {
  const int64_t DT = hd / 16;
  for (; m + MR <= R; m += MR) {
    int64_t d = 0;
    for (; d + 4 <= DT; d += 4) dp_values<MR, 4>(pb + m * W, W, vt, DT, d, num + m * hd, hd);
    for (; d < DT; ++d) dp_values<MR, 1>(pb + m * W, W, vt, DT, d, num + m * hd, hd);
  }
  if constexpr (MR > 1) if (m < R) dp_values_rows<MR / 2>(pb, m, R, W, vt, hd, num);
}

// attend() with bf16 products: the same rows, heads and outputs; on the AMX tiles (amx) or with VDPBF16PS
// (dp_scores_rows, dp_values_rows). kt0 / vt0: this head's keys and values already in the tiles' layouts
// (heads_to_tiles(), or a cache's store, over at least columns 0..L+r1-1; columns past a row's own are read
// only as zero numerators), or nullptr to lay them out here.
void attend_bf16(bool amx, const float* qkv, int64_t Q, const float* kb, const float* vb, int64_t hd, int64_t L,
                 int64_t r0, int64_t r1, int64_t kh, int64_t g, int64_t nh, float* att, const uint16_t* kt0 = nullptr,
                 const uint16_t* vt0 = nullptr) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t R = (r1 - r0) * g, width = L + r1, W = (width + 31) / 32 * 32, KT = hd / 32;
  uint16_t* qb = scratch<uint16_t, 10>(static_cast<size_t>(R * hd));   // [R, hd]: row (i - r0) g + j
  const uint16_t* kt = kt0;  // keys_to_tiles, here unless given
  const uint16_t* vt = vt0;  // values_to_tiles, here unless given
  float* s = scratch<float, 1>(static_cast<size_t>(R * W));            // [R, W] scores, then numerators
  uint16_t* pb = scratch<uint16_t, 13>(static_cast<size_t>(R * W));    // [R, W] numerators in bf16
  float* num = scratch<float, 2>(static_cast<size_t>(R * hd));         // [R, hd]
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = 0; j < g; ++j) {
      const float* q = qkv + i * Q + (kh * g + j) * hd;
      uint16_t* dst = qb + ((i - r0) * g + j) * hd;
      for (int64_t d = 0; d < hd; d += 32)
        _mm512_storeu_si512(dst + d, bf16x32(_mm512_loadu_ps(q + d), _mm512_loadu_ps(q + d + 16)));
    }
  if (kt == nullptr) {
    uint16_t* k = scratch<uint16_t, 11>(static_cast<size_t>(W * hd));
    uint16_t* v = scratch<uint16_t, 12>(static_cast<size_t>(W * hd));
    keys_to_tiles(kb, hd, width, W, k);
    values_to_tiles(vb, hd, width, W, v);
    kt = k;
    vt = v;
  }
  // GCC's _tile_loadd is an asm statement that names no memory it reads: the barriers keep the stores that fill
  // qb, kt, vt (and pb below) before the tile loads that read them
  asm volatile("" ::: "memory");
  if (amx) {
    for (int64_t m = 0; m < R; m += 16) {  // scores: 16 rows x 64 columns a pass (tmm0-3), over the head width
      const int r = static_cast<int>(std::min<int64_t>(16, R - m));
      amx_config(r);
      for (int64_t cb = 0; cb < W / 16; cb += 4) {
        const int nb = static_cast<int>(std::min<int64_t>(4, W / 16 - cb));
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t k = 0; k < KT; ++k) {
          _tile_loadd(4, qb + m * hd + k * 32, hd * 2);
          const uint16_t* b = kt + (cb * KT + k) * 512;
          _tile_loadd(5, b, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (nb > 1) { _tile_loadd(6, b + KT * 512, 64); _tile_dpbf16ps(1, 4, 6); }
          if (nb > 2) { _tile_loadd(7, b + 2 * KT * 512, 64); _tile_dpbf16ps(2, 4, 7); }
          if (nb > 3) { _tile_loadd(5, b + 3 * KT * 512, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        float* o = s + m * W + cb * 16;
        _tile_stored(0, o, W * 4);
        if (nb > 1) _tile_stored(1, o + 16, W * 4);
        if (nb > 2) _tile_stored(2, o + 32, W * 4);
        if (nb > 3) _tile_stored(3, o + 48, W * 4);
      }
    }
  } else {
    dp_scores_rows<4>(qb, 0, R, hd, kt, s, W);
  }
  float* den = scratch<float, 3>(static_cast<size_t>(R));
  for (int64_t i = r0; i < r1; ++i)  // per row: softmax over its columns 0..L+i, numerators to bf16 (0 past)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t row = (i - r0) * g + j, cols = L + i + 1;
      float* sr = s + row * W;
      den[row] = softmax_numerators16(sr, cols, scale);
      uint16_t* pr = pb + row * W;
      for (int64_t c = 0; c < W; c += 32)
        _mm512_storeu_si512(pr + c, bf16x32(_mm512_maskz_loadu_ps(first(cols - c), sr + c),
                                            _mm512_maskz_loadu_ps(first(cols - c - 16), sr + c + 16)));
    }
  asm volatile("" ::: "memory");
  if (amx) {
    for (int64_t m = 0; m < R; m += 16) {  // outputs: 16 rows x 64 features a pass (tmm0-3), over the columns
      amx_config(static_cast<int>(std::min<int64_t>(16, R - m)));
      for (int64_t d0 = 0; d0 < hd; d0 += 64) {
        const int nd = static_cast<int>(std::min<int64_t>(4, (hd - d0) / 16));
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t c = 0; c < W; c += 32) {
          _tile_loadd(4, pb + m * W + c, W * 2);
          const uint16_t* b = vt + ((c / 32) * (hd / 16) + d0 / 16) * 512;
          _tile_loadd(5, b, 64);
          _tile_dpbf16ps(0, 4, 5);
          if (nd > 1) { _tile_loadd(6, b + 512, 64); _tile_dpbf16ps(1, 4, 6); }
          if (nd > 2) { _tile_loadd(7, b + 1024, 64); _tile_dpbf16ps(2, 4, 7); }
          if (nd > 3) { _tile_loadd(5, b + 1536, 64); _tile_dpbf16ps(3, 4, 5); }
        }
        float* o = num + m * hd + d0;
        _tile_stored(0, o, hd * 4);
        if (nd > 1) _tile_stored(1, o + 16, hd * 4);
        if (nd > 2) _tile_stored(2, o + 32, hd * 4);
        if (nd > 3) _tile_stored(3, o + 48, hd * 4);
      }
    }
    _tile_release();
  } else {
    dp_values_rows<4>(pb, 0, R, W, vt, hd, num);
  }
  for (int64_t i = r0; i < r1; ++i)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t row = (i - r0) * g + j;
      const __m512 inv = _mm512_set1_ps(1.0f / den[row]);
      float* o = att + i * nh * hd + (kh * g + j) * hd;
      for (int64_t d = 0; d < hd; d += 16) _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(num + row * hd + d), inv));
    }
}
#pragma GCC pop_options
#endif

// act[0..15] = SiLU(gate) * up for one pair of panels: gate = gu[0..15], up = gu[16..31]; exp8()'s arithmetic,
// 16 lanes at a time where the CPU has them (the same values)
inline void silu_panel(const float* gu, float* act) {
#ifdef XP_AMX
  if (wide()) return silu16(gu, gu + 16, act, 16);
#endif
  for (int h = 0; h < 16; h += 8) {
    const __m256 g = _mm256_loadu_ps(gu + h);
    const __m256 en = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(act + h, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), en)),
                                            _mm256_loadu_ps(gu + 16 + h)));
  }
}

// attend() or attend_bf16() (tiles: bf16 weights on AMX tiles or with AVX512-BF16, the head width a multiple of 32)
inline void attend_any(bool tiles, const float* qkv, int64_t Q, const float* kb, const float* vb, int64_t hd,
                       int64_t L, int64_t r0, int64_t r1, int64_t kh, int64_t g, int64_t nh, float* att,
                       const uint16_t* kt = nullptr, const uint16_t* vt = nullptr) {
#ifdef XP_AMX
  if (tiles) return attend_bf16(amx_ready(), qkv, Q, kb, vb, hd, L, r0, r1, kh, g, nh, att, kt, vt);
#endif
  attend(qkv, Q, kb, vb, hd, L, r0, r1, kh, g, nh, att);
}

// RoPE on row i's nh + nkv query and key heads (hd floats each, adjacent) with rot [n, hd / 2, 2] (cos, sin)
// of each row's position, the q / k weight rows reordered so that each rotated pair is adjacent: (a + ib)(c + is),
// 4 pairs at a time. Written with intrinsics: GCC 12 at -O3 turned the scalar loop into vfmaddsub (a fused
// multiply-add) despite -ffp-contract=off.
inline void rope_pairs(float* row, const float* r, int64_t heads, int64_t hd) {
  for (int64_t head = 0; head < heads; ++head) {
    float* v = row + head * hd;
    for (int64_t j = 0; j < hd; j += 8) {  // (a c - b s, b c + a s): each product rounded, then the sum
      const __m256 ab = _mm256_loadu_ps(v + j), cs = _mm256_loadu_ps(r + j);
      const __m256 ac_bc = _mm256_mul_ps(ab, _mm256_moveldup_ps(cs));
      const __m256 bs_as = _mm256_mul_ps(_mm256_permute_ps(ab, 0xB1), _mm256_movehdup_ps(cs));
      _mm256_storeu_ps(v + j, _mm256_addsub_ps(ac_bc, bs_as));
    }
  }
}

// One decoder layer on the residual stream h [n, H] (a new tensor is returned) around three callbacks:
// rotate(i, row) turns row i's projected q / k / v [Q] into what attention reads (RoPE, and any q / k norm),
// put_kv(i, k, v) stores row i's nkv rotated keys and values (hd floats each, heads adjacent), and
// attention(qkv, Q, att) fills att [n, nh hd] from the rows' rotated q / k / v [n, Q]. Every other step is
// per row in a fixed order, and the products are row-invariant (linear_into).
template <class Rotate, class PutKV, class Attention>
torch::Tensor decoder_layer(const torch::Tensor& h_in, const torch::Tensor& ln1, const torch::Tensor& wqkv,
                            const torch::Tensor& wo, const torch::Tensor& ln2, const torch::Tensor& wgu,
                            const torch::Tensor& wd, int64_t nh, int64_t nkv, int64_t hd, double eps,
                            Rotate rotate, PutKV put_kv, Attention attention) {
  const int64_t n = h_in.size(0), H = h_in.size(1);
  const int64_t Q = (nh + 2 * nkv) * hd, I = wgu.size(0) * 8;
  TORCH_CHECK(hd % 8 == 0 && hd <= 256 && wqkv.size(0) * 16 == Q && I % 16 == 0, "layer: shapes");
  for (const torch::Tensor* t : {&wqkv, &wo, &wgu, &wd}) {
    check_weight(*t, "layer weight");
    TORCH_CHECK(t->scalar_type() == wqkv.scalar_type(), "layer: the four weights must share a dtype");
  }
  TORCH_CHECK(wd.size(0) * 16 == H && wo.size(0) * 16 == H, "layer: shapes");
  const float fe = static_cast<float>(eps);
  auto h = h_in.clone();
  float* hp = h.data_ptr<float>();
  float* x = scratch<float, 4>(static_cast<size_t>(n * H));
  float* qkv = scratch<float, 5>(static_cast<size_t>(n * Q));
  float* att = scratch<float, 6>(static_cast<size_t>(n * nh * hd));
  float* big = scratch<float, 7>(static_cast<size_t>(n * 2 * I));
  float* down = scratch<float, 8>(static_cast<size_t>(n * H));
  // attention block. The per-row work is split over the threads by rows (each row's arithmetic unchanged);
  // at::parallel_for runs a range of one row inline.
  auto rows = [n](auto&& f) { at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) { for (int64_t i = i0; i < i1; ++i) f(i); }); };
  rows([&](int64_t i) { rms_row(hp + i * H, ln1.data_ptr<float>(), x + i * H, H, fe); });
  product(x, n, H, wqkv, Q, qkv);
  rows([&](int64_t i) {
    float* row = qkv + i * Q;
    rotate(i, row);
    put_kv(i, row + nh * hd, row + (nh + nkv) * hd);
  });
  attention(qkv, Q, att);
  product(att, n, nh * hd, wo, H, x);
  // MLP block
  rows([&](int64_t i) {
    for (int64_t j = i * H; j < (i + 1) * H; ++j) hp[j] += x[j];
    rms_row(hp + i * H, ln2.data_ptr<float>(), x + i * H, H, fe);
  });
  // gate and up come interleaved by panels (16 gate columns, then the same 16 up columns: see LeanModel), so
  // the thread that computed a pair of panels applies SiLU(gate) * up = gate / (1 + exp(-gate)) * up to them
  // (into act, not x: the other thread may still be reading x)
  float* act = scratch<float, 10>(static_cast<size_t>(n * I));
  product(x, n, H, wgu, 2 * I, big, true, [&](int64_t p0, int64_t p1) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t p = p0; p < p1; p += 2) silu_panel(big + i * 2 * I + p * 16, act + i * I + p * 8);
  });
  product(act, n, I, wd, H, down, false, [&](int64_t p0, int64_t p1) {  // the residual, on the thread's columns
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = i * H + p0 * 16; j < i * H + p1 * 16; ++j) hp[j] += down[j];
  });
  return h;
}

}  // namespace

// [N, K] -> [N / 16, K, 16]: each panel of 16 output columns contiguous over k
torch::Tensor pack(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % 16 == 0 && w.size(1) % 8 == 0, "pack: [N, K] with N % 16 == 0, K % 8 == 0");
  const auto N = w.size(0), K = w.size(1);
  return w.to(torch::kFloat32).contiguous().view({N / 16, 16, K}).transpose(1, 2).contiguous();
}

// [N, K] -> [N / 16, K / 2, 16, 2] bf16 (rounded to nearest even): panels of 16 output columns, each a run of
// K / 2 rows of 16 (column, feature pair) entries, the B operand of TDPBF16PS
torch::Tensor pack_bf16(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.size(0) % 16 == 0 && w.size(1) % 32 == 0, "pack_bf16: [N, K] with N % 16 == 0, K % 32 == 0");
  const auto N = w.size(0), K = w.size(1);
  return w.to(torch::kBFloat16).contiguous().view({N / 16, 16, K / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

// x [M, K] float32 @ W.T -> [M, N] float32, W packed by pack() (float32) or pack_bf16() (bf16: AMX)
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& wp) {
  check(x, "x");
  check_weight(wp, "w");
  const bool bf = wp.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && wp.dim() == (bf ? 4 : 3) && wp.size(1) * (bf ? 2 : 1) == x.size(1) && wp.size(2) == 16,
              "linear: shapes");
  const int64_t M = x.size(0), K = x.size(1), N = wp.size(0) * 16;
  auto out = torch::empty({M, N}, x.options());
  product(x.data_ptr<float>(), M, K, wp, N, out.data_ptr<float>());
  return out;
}

// rows of x [M, H] normalised and scaled by w [H]
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check(x, "x");
  check(w, "w");
  const int64_t M = x.size(0), H = x.size(1);
  TORCH_CHECK(x.dim() == 2 && w.numel() == H && H % 8 == 0, "rms_norm: shapes");
  auto y = torch::empty_like(x);
  for (int64_t m = 0; m < M; ++m)
    rms_row(x.data_ptr<float>() + m * H, w.data_ptr<float>(), y.data_ptr<float>() + m * H, H, static_cast<float>(eps));
  return y;
}

// tiles (attention's products in bf16: on AMX tiles, else with AVX512-BF16) asks for bf16 weights, bf16_ready()
// and a head width that is a multiple of 32
void check_tiles(bool tiles, const torch::Tensor& wqkv, int64_t hd) {
  TORCH_CHECK(!tiles || (wqkv.scalar_type() == torch::kBFloat16 && hd % 32 == 0 && bf16_ready()),
              "bf16 attention (AMX tiles or AVX512-BF16) needs bf16 weights, bf16_ready() and a head width that is a multiple of 32");
}

// One decoder layer on the residual stream h [n, H] (returned updated, a new tensor); writes the n new keys
// and values into columns L..L+n-1 of keys / values [nkv, cap, hd]. rot [n, hd / 2, 2] holds (cos, sin) of
// each row's position, the q / k weight rows reordered so that each rotated pair is adjacent. tiles: the
// attention's products in bf16 (attend_bf16: on AMX tiles, else with AVX512-BF16), else in float32 (attend);
// key_tiles, value_tiles, tiles_from: the cache's store of the bf16 layouts (see below), or empty tensors.
torch::Tensor layer(const torch::Tensor& h_in, const torch::Tensor& ln1, const torch::Tensor& wqkv,
                    const torch::Tensor& wo, const torch::Tensor& ln2, const torch::Tensor& wgu,
                    const torch::Tensor& wd, const torch::Tensor& rot, torch::Tensor keys, torch::Tensor values,
                    int64_t L, int64_t nh, int64_t nkv, double eps, bool tiles, torch::Tensor key_tiles,
                    torch::Tensor value_tiles, int64_t tiles_from) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&h_in, &ln1, &ln2, &rot, &keys, &values})
    check(*t, "layer input");  // the weights: decoder_layer
  const int64_t n = h_in.size(0), hd = keys.size(2), cap = keys.size(1), g = nh / nkv;
  TORCH_CHECK(L + n <= cap && keys.size(0) == nkv, "layer: shapes");
  check_tiles(tiles, wqkv, hd);
  // the cache's own store of the tiles' layouts (key_tiles, value_tiles [nkv, S] int16, S >= (L + n rounded up
  // to 32) hd; empty: none), valid for columns 0..tiles_from-1: this call lays out the columns from there on
  const bool stored = tiles && key_tiles.numel() > 0;
  const int64_t stride = stored ? key_tiles.size(1) : 0;
  if (stored)
    TORCH_CHECK(key_tiles.scalar_type() == torch::kInt16 && value_tiles.scalar_type() == torch::kInt16 &&
                key_tiles.is_contiguous() && value_tiles.is_contiguous() && key_tiles.sizes() == value_tiles.sizes() &&
                key_tiles.size(0) == nkv && stride >= (L + n + 31) / 32 * 32 * hd && 0 <= tiles_from && tiles_from <= L,
                "layer: key_tiles / value_tiles must be contiguous int16 [nkv, S >= (L + n rounded up to 32) hd], "
                "tiles_from in 0..L");
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  auto put_kv = [&](int64_t i, const float* k, const float* v) {
    for (int64_t kh = 0; kh < nkv; ++kh) {
      std::copy(k + kh * hd, k + (kh + 1) * hd, kp + (kh * cap + L + i) * hd);
      std::copy(v + kh * hd, v + (kh + 1) * hd, vp + (kh * cap + L + i) * hd);
    }
  };
  // one task per key-value head and block of rows; on the tiles with several blocks, each head's keys and
  // values are laid out for them once, before the tasks (heads_to_tiles), not once per task
  auto attention = [&](const float* qkv, int64_t Q, float* att) {
    const int64_t RB = std::max<int64_t>(1, (n + 1) / 2);
    const int64_t blocks = (n + RB - 1) / RB, W = (L + n + 31) / 32 * 32;
    uint16_t *kt = nullptr, *vt = nullptr;
    int64_t per_head = W * hd;
#ifdef XP_AMX
    if (stored) {  // the new columns only (and the rest of their blocks); by each head's task where it has one
      kt = reinterpret_cast<uint16_t*>(key_tiles.data_ptr());
      vt = reinterpret_cast<uint16_t*>(value_tiles.data_ptr());
      per_head = stride;
      if (blocks > 1) heads_to_tiles(kp, vp, nkv, cap, hd, L + n, kt, vt, stride, tiles_from);
    } else if (tiles && blocks > 1) {
      static std::vector<uint16_t> laid;  // one forward at a time (the GIL is held)
      if (laid.size() < static_cast<size_t>(2 * nkv * W * hd)) laid.resize(static_cast<size_t>(2 * nkv * W * hd));
      kt = laid.data();
      vt = kt + nkv * W * hd;
      heads_to_tiles(kp, vp, nkv, cap, hd, L + n, kt, vt, W * hd);
    }
#endif
    at::parallel_for(0, nkv * blocks, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t kh = t / blocks, r0 = (t % blocks) * RB, r1 = std::min(n, r0 + RB);
#ifdef XP_AMX
        if (stored && blocks == 1) {  // one parallel region fewer per layer for a one-token step
          keys_to_tiles(kp + kh * cap * hd, hd, L + n, W, kt + kh * stride, tiles_from);
          values_to_tiles(vp + kh * cap * hd, hd, L + n, W, vt + kh * stride, tiles_from);
        }
#endif
        attend_any(tiles, qkv, Q, kp + kh * cap * hd, vp + kh * cap * hd, hd, L, r0, r1, kh, g, nh, att,
                   kt ? kt + kh * per_head : nullptr, vt ? vt + kh * per_head : nullptr);
      }
    });
  };
  TORCH_CHECK(rot.size(0) == n, "layer: shapes");
  const float* rp = rot.data_ptr<float>();
  auto rotate = [&](int64_t i, float* row) { rope_pairs(row, rp + i * hd, nh + nkv, hd); };
  return decoder_layer(h_in, ln1, wqkv, wo, ln2, wgu, wd, nh, nkv, hd, eps, rotate, put_kv, attention);
}

// One decoder layer for m new tokens, every sequence with its own cache row: token i belongs to row rows[i] of
// keys / values [B, nkv, cap, hd], whose first lengths[i] columns are its context; its key and value go to
// column lengths[i]. Every token's key and value are written before any attention, and token i attends to
// columns 0..lengths[i] of its row: a row may repeat at distinct lengths (L, L + 1, ..: a causal block of
// several tokens of one sequence); the tasks write distinct outputs and columns. Token i's arithmetic is
// exactly that of layer() for its sequence alone (the same attend(), row-invariant products), so a batch of
// sequences decodes each one bit for bit as a one-sequence step or verify would, with any number of others
// beside it and no padding.
torch::Tensor layer_rows(const torch::Tensor& h_in, const torch::Tensor& ln1, const torch::Tensor& wqkv,
                         const torch::Tensor& wo, const torch::Tensor& ln2, const torch::Tensor& wgu,
                         const torch::Tensor& wd, const torch::Tensor& rot, torch::Tensor keys, torch::Tensor values,
                         const torch::Tensor& rows, const torch::Tensor& lengths, int64_t nh, int64_t nkv, double eps,
                         bool tiles) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&h_in, &ln1, &ln2, &rot, &keys, &values})
    check(*t, "layer_rows input");  // the weights: decoder_layer
  const int64_t m = h_in.size(0), B = keys.size(0), cap = keys.size(2), hd = keys.size(3), g = nh / nkv;
  TORCH_CHECK(keys.dim() == 4 && keys.size(1) == nkv && rows.scalar_type() == torch::kInt64 &&
              lengths.scalar_type() == torch::kInt64 && rows.numel() == m && lengths.numel() == m &&
              rows.is_contiguous() && lengths.is_contiguous(), "layer_rows: shapes");
  check_tiles(tiles, wqkv, hd);
  const int64_t* rp = rows.data_ptr<int64_t>();
  const int64_t* lp = lengths.data_ptr<int64_t>();
  for (int64_t i = 0; i < m; ++i)
    TORCH_CHECK(rp[i] >= 0 && rp[i] < B && lp[i] >= 0 && lp[i] < cap, "layer_rows: a row or length out of range");
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  auto head = [&](float* base, int64_t i, int64_t kh) { return base + ((rp[i] * nkv + kh) * cap) * hd; };
  auto put_kv = [&](int64_t i, const float* k, const float* v) {
    for (int64_t kh = 0; kh < nkv; ++kh) {
      std::copy(k + kh * hd, k + (kh + 1) * hd, head(kp, i, kh) + lp[i] * hd);
      std::copy(v + kh * hd, v + (kh + 1) * hd, head(vp, i, kh) + lp[i] * hd);
    }
  };
  auto attention = [&](const float* qkv, int64_t Q, float* att) {  // one task per sequence and key-value head
    at::parallel_for(0, m * nkv, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t i = t / nkv, kh = t % nkv;
        attend_any(tiles, qkv + i * Q, Q, head(kp, i, kh), head(vp, i, kh), hd, lp[i], 0, 1, kh, g, nh, att + i * nh * hd);
      }
    });
  };
  TORCH_CHECK(rot.size(0) == m, "layer_rows: shapes");
  const float* rot_p = rot.data_ptr<float>();
  auto rotate = [&](int64_t i, float* row) { rope_pairs(row, rot_p + i * hd, nh + nkv, hd); };
  return decoder_layer(h_in, ln1, wqkv, wo, ln2, wgu, wd, nh, nkv, hd, eps, rotate, put_kv, attention);
}

// ------------------------------------------------------------------------------------- the drafter's layer
// Attention of a drafted block's n rows for key-value head kh, every row over all the context's L columns
// (kc / vc: that head's [L, hd]) and all n of the block's (kb / vb: [n, hd]), as the dFlash drafter attends at
// inference (one block after a context wholly before its anchor: no mask). Same scores, softmax and value sums
// as attend(), over the context's columns and then the block's.
void attend_block(const float* qkv, int64_t Q, const float* kc, const float* vc, int64_t L, const float* kb,
                  const float* vb, int64_t n, int64_t hd, int64_t kh, int64_t g, int64_t nh, float* att) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t D = hd / 8, R = n * g, width = L + n;
  float* s = scratch<float, 1>(static_cast<size_t>(R * width));
  float* num = scratch<float, 2>(static_cast<size_t>(R * hd));
  std::fill(num, num + R * hd, 0.0f);
  for (int64_t r = 0; r < R; ++r) {
    const float* q = qkv + (r / g) * Q + (kh * g + r % g) * hd;
    float* sr = s + r * width;
    scores(q, kc, hd, 0, L, scale, sr);
    scores(q, kb, hd, 0, n, scale, sr + L);
    const float den = softmax_numerators(sr, width);
    value_sums<1>(sr, width, vc, hd, 0, L, num + r * hd);
    value_sums<1>(sr + L, width, vb, hd, 0, n, num + r * hd);
    const __m256 inv = _mm256_set1_ps(1.0f / den);
    float* o = att + (r / g) * nh * hd + (kh * g + r % g) * hd;
    for (int64_t d = 0; d < D; ++d) _mm256_storeu_ps(o + d * 8, _mm256_mul_ps(_mm256_loadu_ps(num + r * hd + d * 8), inv));
  }
}

// A head of width hd (a multiple of 16, at most 256) in place: RMSNorm by w, then half-split RoPE,
// x * cos + roll(x, hd / 2) * sin with sin's first half negated (xpress.drafter.rope / apply_rope): each
// product rounded, then the sum, as PyTorch's two multiplications and addition.
inline void norm_rope_half(float* v, const float* w, const float* cos, const float* sin, int64_t hd, float eps) {
  alignas(32) float t[256];
  rms_row(v, w, t, hd, eps);
  const int64_t half = hd / 2;
  for (int64_t j = 0; j < hd; j += 8) {
    const int64_t jr = j < half ? j + half : j - half;
    _mm256_storeu_ps(v + j, _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(t + j), _mm256_loadu_ps(cos + j)),
                                          _mm256_mul_ps(_mm256_loadu_ps(t + jr), _mm256_loadu_ps(sin + j))));
  }
}

// One dFlash drafter layer (Qwen3's: q / k RMSNorm over each head before RoPE) for one block of n rows after
// a context of L entries: h [n, H] -> the new residual stream. wqkv: [q; k; v] packed as they are (no
// reordering: half-split RoPE, cos / sin [n, hd] with sin's first half negated, xpress.drafter.rope); qn, kn
// [hd] the norms' weights; ctx_k / ctx_v [nkv, L, hd] the context's rotated keys and values. The block's keys
// and values are attended, not kept. Per element the same operations as the drafter's PyTorch forward at
// inference, except attention and SiLU (summed and evaluated in this file's orders).
torch::Tensor draft_layer(const torch::Tensor& h_in, const torch::Tensor& ln1, const torch::Tensor& wqkv,
                          const torch::Tensor& qn, const torch::Tensor& kn, const torch::Tensor& wo,
                          const torch::Tensor& ln2, const torch::Tensor& wgu, const torch::Tensor& wd,
                          const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& ctx_k,
                          const torch::Tensor& ctx_v, int64_t nh, int64_t nkv, double eps) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&h_in, &ln1, &ln2, &qn, &kn, &cos, &sin,
                                                                           &ctx_k, &ctx_v})
    check(*t, "draft_layer input");  // the weights: decoder_layer
  const int64_t n = h_in.size(0), hd = qn.numel(), L = ctx_k.size(1), g = nh / nkv;
  TORCH_CHECK(ctx_k.dim() == 3 && ctx_k.size(0) == nkv && ctx_k.size(2) == hd && ctx_v.sizes() == ctx_k.sizes() &&
              kn.numel() == hd && cos.size(0) == n && cos.size(1) == hd && sin.sizes() == cos.sizes() && hd % 16 == 0,
              "draft_layer: shapes");
  const float fe = static_cast<float>(eps);
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* kb = scratch<float, 11>(static_cast<size_t>(2 * nkv * n * hd));  // the block's keys, then values: [nkv, n, hd]
  float* vb = kb + nkv * n * hd;
  auto rotate = [&](int64_t i, float* row) {  // per q and k head: its norm, then RoPE
    for (int64_t head = 0; head < nh + nkv; ++head)
      norm_rope_half(row + head * hd, (head < nh ? qn : kn).data_ptr<float>(), cp + i * hd, sp + i * hd, hd, fe);
  };
  auto put_kv = [&](int64_t i, const float* k, const float* v) {
    for (int64_t kh = 0; kh < nkv; ++kh) {
      std::copy(k + kh * hd, k + (kh + 1) * hd, kb + (kh * n + i) * hd);
      std::copy(v + kh * hd, v + (kh + 1) * hd, vb + (kh * n + i) * hd);
    }
  };
  const float *kcp = ctx_k.data_ptr<float>(), *vcp = ctx_v.data_ptr<float>();
  auto attention = [&](const float* qkv, int64_t Q, float* att) {  // one task per key-value head
    at::parallel_for(0, nkv, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t kh = t0; kh < t1; ++kh)
        attend_block(qkv, Q, kcp + kh * L * hd, vcp + kh * L * hd, L, kb + kh * n * hd, vb + kh * n * hd, n, hd, kh,
                     g, nh, att);
    });
  };
  return decoder_layer(h_in, ln1, wqkv, wo, ln2, wgu, wd, nh, nkv, hd, eps, rotate, put_kv, attention);
}

// The drafter's context entries for n new target states, all its layers in one call: features [n, F] ->
// ctx = hidden_norm(fc(features)) [n, H], then per layer l the keys (k_norm, then RoPE) and values of
// ctx: [nkv, n, hd] each, returned as keys_0, values_0, keys_1, ... (xpress.drafter.DFlashDraftModel.
// encode_context at inference). wkv: per layer [k; v] packed; kn: per layer the k norm's weight [hd].
std::vector<torch::Tensor> draft_context(const torch::Tensor& features, const torch::Tensor& fc,
                                         const torch::Tensor& hn, const std::vector<torch::Tensor>& wkv,
                                         const std::vector<torch::Tensor>& kn, const torch::Tensor& cos,
                                         const torch::Tensor& sin, int64_t nkv, double eps) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&features, &hn, &cos, &sin})
    check(*t, "draft_context input");
  check_weight(fc, "draft_context weight");
  const int64_t n = features.size(0), F = features.size(1), H = hn.numel(), hd = cos.size(1);
  TORCH_CHECK(wkv.size() == kn.size() && fc.size(0) * 16 == H && cos.size(0) == n && sin.sizes() == cos.sizes() &&
              hd % 16 == 0 && hd <= 256 && H % 8 == 0, "draft_context: shapes");
  const float fe = static_cast<float>(eps);
  float* x = scratch<float, 4>(static_cast<size_t>(n * H));
  product(features.data_ptr<float>(), n, F, fc, H, x);
  for (int64_t i = 0; i < n; ++i) rms_row(x + i * H, hn.data_ptr<float>(), x + i * H, H, fe);
  float* kv = scratch<float, 5>(static_cast<size_t>(n * 2 * nkv * hd));
  std::vector<torch::Tensor> out;
  for (size_t l = 0; l < wkv.size(); ++l) {
    check_weight(wkv[l], "draft_context weight");
    check(kn[l], "draft_context input");
    TORCH_CHECK(wkv[l].size(0) * 16 == 2 * nkv * hd && kn[l].numel() == hd, "draft_context: shapes");
    product(x, n, H, wkv[l], 2 * nkv * hd, kv);
    auto keys = torch::empty({nkv, n, hd}, features.options()), values = torch::empty({nkv, n, hd}, features.options());
    float *kp = keys.data_ptr<float>(), *vp = values.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t kh = 0; kh < nkv; ++kh) {
        float* k = kv + i * 2 * nkv * hd + kh * hd;
        norm_rope_half(k, kn[l].data_ptr<float>(), cos.data_ptr<float>() + i * hd, sin.data_ptr<float>() + i * hd, hd, fe);
        std::copy(k, k + hd, kp + (kh * n + i) * hd);
        std::copy(k + nkv * hd, k + (nkv + 1) * hd, vp + (kh * n + i) * hd);
      }
    out.push_back(keys);
    out.push_back(values);
  }
  return out;
}

// ------------------------------------------------------------------------------------- the xPress refiner
// argmax_v (a[v] + b[v]) over V entries, each sum rounded to float32: the first index on ties, NaN counting as
// the maximum (torch.argmax's rules)
inline int64_t argmax_plus(const float* a, const float* b, int64_t V) {
  int64_t best = 0;
  float top = -INFINITY;
  for (int64_t v = 0; v < V; ++v) {
    const float x = a[v] + b[v];
    if (x > top || (std::isnan(x) && !std::isnan(top))) {
      top = x;
      best = v;
    }
    if (std::isnan(top)) break;
  }
  return best;
}

// One T=0 Jacobi pass of the folded xPress refiner over the first k positions of one block
// (xpress.heads.FoldedRefiner.choose): for position i, with e_j = table[idx[j]] (the previous tokens' folded
// embeddings, [r] each),
//   c_i = u_i + sum_{j < k} mixer[:, i, j] * e_j      (Mix; the mixer [r, P, P] is I + L, zero above i)
//   z_i = c_i + W2 silu(W1 c_i)                       (Trans)
//   token_i = argmax_v (base[i][v] + (W_r z_i)_v)      (Read, the first index on ties)
// u [k, r]: the block's mixed token-independent part; w1 / w2 / wr packed [2r, r] / [r, 2r] / [Vd, r]; base
// [k, Vd]. Returns tokens [k] int64. The products are linear()'s; the mixing sums j in order and SiLU is this
// file's, so logits agree with the PyTorch pass to float32 rounding, not bit for bit.
torch::Tensor refine_pass(const torch::Tensor& idx, const torch::Tensor& u, const torch::Tensor& mixer,
                          const torch::Tensor& table, const torch::Tensor& w1, const torch::Tensor& w2,
                          const torch::Tensor& wr, const torch::Tensor& base) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&u, &mixer, &table, &base})
    check(*t, "refine_pass input");
  for (const torch::Tensor* t : {&w1, &w2, &wr}) check_weight(*t, "refine_pass weight");
  const int64_t k = u.size(0), r = u.size(1), P = mixer.size(1), V = base.size(1), rows = table.size(0);
  TORCH_CHECK(idx.scalar_type() == torch::kInt64 && idx.is_contiguous() && idx.numel() == k && mixer.dim() == 3 &&
              mixer.size(0) == r && mixer.size(2) == P && k <= P && table.size(1) == r && base.size(0) == k &&
              w1.size(0) * 16 == 2 * r && w2.size(0) * 16 == r && wr.size(0) * 16 == V && r % 16 == 0,
              "refine_pass: shapes");
  const int64_t* ip = idx.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j) TORCH_CHECK(ip[j] >= 0 && ip[j] < rows, "refine_pass: an index out of range");
  const float *up = u.data_ptr<float>(), *mp = mixer.data_ptr<float>(), *tp = table.data_ptr<float>();
  float* c = scratch<float, 12>(static_cast<size_t>(k * r));
  for (int64_t i = 0; i < k; ++i)
    for (int64_t d = 0; d < r; ++d) {
      float acc = up[i * r + d];
      const float* m = mp + (d * P + i) * P;
      for (int64_t j = 0; j < k; ++j) acc += m[j] * tp[ip[j] * r + d];
      c[i * r + d] = acc;
    }
  float* h = scratch<float, 13>(static_cast<size_t>(k * 2 * r));
  product(c, k, r, w1, 2 * r, h);
  float* a = scratch<float, 14>(static_cast<size_t>(k * 2 * r));
  for (int64_t j = 0; j < k * 2 * r; j += 8) {
    const __m256 g = _mm256_loadu_ps(h + j);
    const __m256 en = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(a + j, _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), en)));
  }
  float* z = scratch<float, 15>(static_cast<size_t>(k * r));
  product(a, k, 2 * r, w2, r, z);
  for (int64_t j = 0; j < k * r; ++j) z[j] += c[j];
  float* logits = scratch<float, 16>(static_cast<size_t>(k * V));
  product(z, k, r, wr, V, logits);
  auto tokens = torch::empty({k}, idx.options());
  int64_t* out = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < k; ++i) out[i] = argmax_plus(logits + i * V, base.data_ptr<float>() + i * V, V);
  return tokens;
}

// The folded xPress refiner's token-independent part for one block (xpress.heads.XPressRefiner.fold): with
// s_j = A_h h_j + A_g mean(h) for the block's P drafter states h [P, H] (A_h, A_g packed [r, H]),
// u_i = sum_j mixer[:, i, j] * s_j, [P, r]. The mean sums the rows in order; the mixing sums j in order.
torch::Tensor refine_fold(const torch::Tensor& h, const torch::Tensor& a_h, const torch::Tensor& a_g,
                          const torch::Tensor& mixer) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&h, &mixer}) check(*t, "refine_fold input");
  for (const torch::Tensor* t : {&a_h, &a_g}) check_weight(*t, "refine_fold weight");
  const int64_t P = h.size(0), H = h.size(1), r = mixer.size(0);
  TORCH_CHECK(mixer.dim() == 3 && mixer.size(1) == P && mixer.size(2) == P && a_h.size(0) * 16 == r &&
              a_g.size(0) * 16 == r && H % 8 == 0, "refine_fold: shapes");
  const float* hp = h.data_ptr<float>();
  float* mean = scratch<float, 12>(static_cast<size_t>(H));
  for (int64_t d = 0; d < H; ++d) {
    float acc = 0.0f;
    for (int64_t j = 0; j < P; ++j) acc += hp[j * H + d];
    mean[d] = acc / static_cast<float>(P);
  }
  float* sv = scratch<float, 13>(static_cast<size_t>(P * r));
  float* g = scratch<float, 14>(static_cast<size_t>(r));
  product(hp, P, H, a_h, r, sv);
  product(mean, 1, H, a_g, r, g);
  for (int64_t j = 0; j < P; ++j)
    for (int64_t d = 0; d < r; ++d) sv[j * r + d] += g[d];
  auto u = torch::empty({P, r}, h.options());
  float* up = u.data_ptr<float>();
  const float* mp = mixer.data_ptr<float>();
  for (int64_t i = 0; i < P; ++i)
    for (int64_t d = 0; d < r; ++d) {
      const float* m = mp + (d * P + i) * P;
      float acc = 0.0f;
      for (int64_t j = 0; j < P; ++j) acc += m[j] * sv[j * r + d];
      up[i * r + d] = acc;
    }
  return u;
}

// The Markov head's T=0 decode of one block (xpress.jacobi.sequential_refine with xpress.heads.MarkovHead):
// k dependent steps, token_i = argmax_v (base[i][v] + (W2 W1[x_{i-1}])_v), x_{-1} the anchor (its row
// anchor_row of W1: [Vd+1, r]), then each chosen draft id (its own row). w2 packed [Vd, r]; base [k, Vd].
// Returns tokens [k] int64 (the first index on ties; NaN counts as the maximum, as torch.argmax).
torch::Tensor markov_steps(int64_t anchor_row, const torch::Tensor& w1, const torch::Tensor& w2,
                           const torch::Tensor& base) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&w1, &base}) check(*t, "markov_steps input");
  check_weight(w2, "markov_steps weight");
  const int64_t k = base.size(0), V = base.size(1), r = w1.size(1);
  TORCH_CHECK(w1.size(0) == V + 1 && w2.size(0) * 16 == V && anchor_row >= 0 && anchor_row <= V, "markov_steps: shapes");
  auto tokens = torch::empty({k}, torch::TensorOptions().dtype(torch::kInt64));
  int64_t* out = tokens.data_ptr<int64_t>();
  float* logits = scratch<float, 12>(static_cast<size_t>(V));
  int64_t row = anchor_row;
  for (int64_t i = 0; i < k; ++i) {
    product(w1.data_ptr<float>() + row * r, 1, r, w2, V, logits);
    out[i] = argmax_plus(logits, base.data_ptr<float>() + i * V, V);
    row = out[i];
  }
  return tokens;
}

// ------------------------------------------------------------------------------------- machine roof
// Seconds for every torch thread to run body(t) once at the same time (t: the thread's index, 0..T-1): the
// frame of the register-chain rates below
template <class Body>
double on_every_thread(Body body) {
  const auto t0 = std::chrono::steady_clock::now();
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t a, int64_t b) {
    for (int64_t t = a; t < b; ++t) body(t);
  });
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Float32 multiply-adds per second that every thread together sustains on twelve independent FMA chains
// held in registers (no memory traffic): the arithmetic roof of linear(), which no float32 product exceeds.
double fma_rate(int64_t iters) {
  const int64_t T = at::get_num_threads();
  std::vector<float> sink(static_cast<size_t>(T * 8));
  const double seconds = on_every_thread([&](int64_t t) {
    const __m256 x = _mm256_set1_ps(1.0000001f), y = _mm256_set1_ps(0.9999999f);
    __m256 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i + t));
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm256_fmadd_ps(x, y, acc[i]);
    }
    __m256 s = acc[0];
    for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, acc[i]);
    _mm256_storeu_ps(sink.data() + t * 8, s);
  });
  volatile float keep = sink[0];  // the chains' results are used
  (void)keep;
  return static_cast<double>(T) * static_cast<double>(iters) * 12.0 * 8.0 / seconds;
}

// Multiply-adds per second that every thread together sustains with VDPBF16PS (16 lanes x 2 bf16 products each)
// on twelve independent chains held in registers: the arithmetic roof of the AVX512-BF16 products; 0 on a CPU
// without AVX512-BF16 (wide()).
#ifdef XP_AMX
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma")
double bf16_dot_rate_wide(int64_t iters) {
  const int64_t T = at::get_num_threads();
  std::vector<float> sink(static_cast<size_t>(T * 16));
  const double seconds = on_every_thread([&](int64_t t) {
    const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80), y = (__m512bh)_mm512_set1_epi32(0x00010001);
    __m512 acc[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i + t));
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], x, y);
    }
    __m512 s = acc[0];
    for (int i = 1; i < 12; ++i) s = _mm512_add_ps(s, acc[i]);
    _mm512_storeu_ps(sink.data() + t * 16, s);
  });
  volatile float keep = sink[0];
  (void)keep;
  return static_cast<double>(T) * static_cast<double>(iters) * 12.0 * 32.0 / seconds;
}
#pragma GCC pop_options
#endif

double bf16_dot_rate(int64_t iters) {
#ifdef XP_AMX
  if (wide()) return bf16_dot_rate_wide(iters);
#endif
  return 0.0;
}

// Bytes per second that every thread together reads from a buffer of `bytes` (written once first, so that its
// pages exist): each thread a contiguous share, read as four streams side by side (one 64-byte line of each in
// turn, as the one-row product reads four panels: one stream per thread reached 45 GB/s where four reached 74
// on a 2-core EPYC), summed in eight 8-lane accumulators; the best of `repeats` passes. With `bytes` well over
// the last-level cache: about the memory bandwidth a one-token step, which reads every weight once, can use.
double read_rate(int64_t bytes, int64_t repeats) {
  const int64_t T = at::get_num_threads();
  const int64_t lines = std::max<int64_t>(bytes / 64 / (4 * T), 1);  // per stream
  const int64_t n = lines * 16 * 4 * T;                              // floats
  std::vector<float> buf(static_cast<size_t>(n), 1.0f);
  std::vector<float> sink(static_cast<size_t>(T * 8), 0.0f);
  double best = 0.0;
  for (int64_t r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    at::parallel_for(0, T, 1, [&](int64_t a, int64_t b) {
      for (int64_t t = a; t < b; ++t) {
        const float* base = buf.data() + t * lines * 16 * 4;
        __m256 s[8];
        for (int k = 0; k < 8; ++k) s[k] = _mm256_setzero_ps();
        for (int64_t i = 0; i < lines * 16; i += 16)
          for (int k = 0; k < 4; ++k) {
            const float* line = base + k * lines * 16 + i;
            s[2 * k] = _mm256_add_ps(s[2 * k], _mm256_loadu_ps(line));
            s[2 * k + 1] = _mm256_add_ps(s[2 * k + 1], _mm256_loadu_ps(line + 8));
          }
        for (int k = 1; k < 8; ++k) s[0] = _mm256_add_ps(s[0], s[k]);
        _mm256_storeu_ps(sink.data() + t * 8, s[0]);
      }
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(n) * 4.0 / seconds);
  }
  volatile float keep = sink[0];
  (void)keep;
  return best;
}

// ------------------------------------------------------------------------------------------ training loss
// The per-row terms of the co-training loss (xpress/train/losses.py, Eq. 14) and their gradients, for rows of
// V logits z (a block position's draft vocabulary), each row one task that reads its V entries a few times
// while they sit in L1. Autograd over the same formula in PyTorch ops runs a dozen passes over [rows, V]
// tensors (log_softmax, gather, exp, subtract, abs and their backward: sign, products, zero fills), each
// through memory. Per row, with p = softmax(z) and p^t the target's distribution:
//   ce = logsumexp(z) - z_y where the label y >= 0, else 0
//   l1 = sum_v |p_v - p^t_v| + max(0, 1 - sum_v p^t_v)
//   d ce / d z = p - onehot(y) (0 where y < 0);   d l1 / d z_j = p_j (s_j - S), s = sign(p - p^t), S = sum_v s_v p_v
// (sign(0) = 0, as the derivative PyTorch gives |x| at 0). Forward returns ce, l1 [N] and keeps p and
// u = p (s - S) [N, V] for the backward: g = gce (p - onehot(y)) + gl1 u. The same function as the PyTorch
// ops to float32 rounding (exp is exp8; the sums run lane by lane over the row, then hsum). Deterministic: a row's
// values do not depend on the number of threads. V a multiple of 8; z float32 or bf16, p^t float32.
inline __m256 load8_as_float(const float* z) { return _mm256_loadu_ps(z); }
inline __m256 load8_as_float(const at::BFloat16* z) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(z));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hmax(__m256 v) {
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  float m = t[0];
  for (int u = 1; u < 8; ++u) m = std::max(m, t[u]);
  return m;
}

template <class T>
void loss_rows(const T* z, const int64_t* labels, const float* pt, int64_t N, int64_t V, float* ce, float* l1,
               float* p, float* u) {
  at::parallel_for(0, N, 8, [&](int64_t r0, int64_t r1) {
    const __m256 sign_bit = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t r = r0; r < r1; ++r) {
      const T* zr = z + r * V;
      const float* tr = pt + r * V;
      float* pr = p + r * V;
      float* ur = u + r * V;
      __m256 mx = _mm256_set1_ps(-INFINITY);
      for (int64_t v = 0; v < V; v += 8) mx = _mm256_max_ps(mx, load8_as_float(zr + v));
      const float m = hmax(mx);
      const __m256 mv = _mm256_set1_ps(m);
      __m256 sum = zero;
      for (int64_t v = 0; v < V; v += 8) {
        const __m256 e = exp8(_mm256_sub_ps(load8_as_float(zr + v), mv));
        _mm256_storeu_ps(pr + v, e);
        sum = _mm256_add_ps(sum, e);
      }
      const float total = hsum(sum);
      const int64_t y = labels[r];
      ce[r] = y >= 0 ? (m + std::log(total)) - static_cast<float>(zr[y]) : 0.0f;
      const __m256 inv = _mm256_set1_ps(1.0f / total);
      __m256 dist = zero, dot = zero, mass = zero;
      for (int64_t v = 0; v < V; v += 8) {
        const __m256 pv = _mm256_mul_ps(_mm256_loadu_ps(pr + v), inv);
        const __m256 tv = _mm256_loadu_ps(tr + v);
        const __m256 d = _mm256_sub_ps(pv, tv);
        const __m256 s = _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(d, zero, _CMP_GT_OQ), one),
                                       _mm256_and_ps(_mm256_cmp_ps(d, zero, _CMP_LT_OQ), one));
        _mm256_storeu_ps(pr + v, pv);
        _mm256_storeu_ps(ur + v, s);
        dist = _mm256_add_ps(dist, _mm256_andnot_ps(sign_bit, d));
        dot = _mm256_add_ps(dot, _mm256_mul_ps(s, pv));
        mass = _mm256_add_ps(mass, tv);
      }
      l1[r] = hsum(dist) + std::max(0.0f, 1.0f - hsum(mass));
      const __m256 S = _mm256_set1_ps(hsum(dot));
      for (int64_t v = 0; v < V; v += 8)
        _mm256_storeu_ps(ur + v, _mm256_mul_ps(_mm256_loadu_ps(pr + v), _mm256_sub_ps(_mm256_loadu_ps(ur + v), S)));
    }
  });
}

// logits [N, V] float32 or bf16, labels [N] int64 (< 0: no cross-entropy), p_target [N, V] float32 ->
// (ce [N], l1 [N], p [N, V], u [N, V]); see loss_rows
std::vector<torch::Tensor> loss_forward(torch::Tensor logits, torch::Tensor labels, torch::Tensor p_target) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && p_target.sizes() == logits.sizes() &&
              p_target.is_contiguous() && p_target.scalar_type() == torch::kFloat32, "loss_forward: logits and p_target [N, V], contiguous");
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == logits.size(0) && labels.scalar_type() == torch::kInt64 &&
              labels.is_contiguous(), "loss_forward: labels [N] int64");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V % 8 == 0, "loss_forward: V must be a multiple of 8");
  const int64_t* lab = labels.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) TORCH_CHECK(lab[r] < V, "loss_forward: a label is out of range");
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  torch::Tensor ce = torch::empty({N}, f32), l1 = torch::empty({N}, f32);
  torch::Tensor p = torch::empty({N, V}, f32), u = torch::empty({N, V}, f32);
  if (logits.scalar_type() == torch::kBFloat16)
    loss_rows(logits.data_ptr<at::BFloat16>(), lab, p_target.data_ptr<float>(), N, V, ce.data_ptr<float>(),
              l1.data_ptr<float>(), p.data_ptr<float>(), u.data_ptr<float>());
  else {
    TORCH_CHECK(logits.scalar_type() == torch::kFloat32, "loss_forward: logits float32 or bfloat16");
    loss_rows(logits.data_ptr<float>(), lab, p_target.data_ptr<float>(), N, V, ce.data_ptr<float>(),
              l1.data_ptr<float>(), p.data_ptr<float>(), u.data_ptr<float>());
  }
  return {ce, l1, p, u};
}

// The gradient of sum_r gce[r] ce[r] + gl1[r] l1[r] with respect to the logits: g = gce (p - onehot(y)) + gl1 u
torch::Tensor loss_backward(torch::Tensor p, torch::Tensor u, torch::Tensor labels, torch::Tensor gce, torch::Tensor gl1) {
  const int64_t N = p.size(0), V = p.size(1);
  TORCH_CHECK(p.is_contiguous() && u.is_contiguous() && gce.is_contiguous() && gl1.is_contiguous() &&
              gce.scalar_type() == torch::kFloat32 && gl1.scalar_type() == torch::kFloat32 && gce.numel() == N &&
              gl1.numel() == N && V % 8 == 0, "loss_backward: p, u [N, V] and gce, gl1 [N] float32, contiguous");
  torch::Tensor g = torch::empty({N, V}, p.options());
  const float *pp = p.data_ptr<float>(), *up = u.data_ptr<float>(), *a = gce.data_ptr<float>(), *b = gl1.data_ptr<float>();
  const int64_t* lab = labels.data_ptr<int64_t>();
  float* gp = g.data_ptr<float>();
  at::parallel_for(0, N, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float ar = lab[r] >= 0 ? a[r] : 0.0f;
      const __m256 av = _mm256_set1_ps(ar), bv = _mm256_set1_ps(b[r]);
      for (int64_t v = 0; v < V; v += 8)
        _mm256_storeu_ps(gp + r * V + v, _mm256_add_ps(_mm256_mul_ps(av, _mm256_loadu_ps(pp + r * V + v)),
                                                       _mm256_mul_ps(bv, _mm256_loadu_ps(up + r * V + v))));
      if (lab[r] >= 0) gp[r * V + lab[r]] -= ar;
    }
  });
  return g;
}

// ------------------------------------------------------------------------------------------ training attention
// The dFlash drafter's attention over a training batch (xpress/drafter.py, Attention): b sequences, nb blocks of B
// rows each, query heads nh over kv heads nkv (g = nh / nkv query heads share one), head width hd. Row i of block j
// attends the first lim[b][j] context keys (the valid ones before the block's anchor) and the B keys of its own
// block, nothing else. PyTorch's scaled_dot_product_attention computes it over a dense mask of every context key
// and every block's keys; here each row reads only the columns it attends, about a third of them at 32 blocks.
// Forward: o = softmax(scale q k^T) v per row over its columns, and the row's log-sum-exp for the backward.
// Backward: with p_c = exp(scale q.k_c - lse), dp_c = do.v_c, D = do.o, ds_c = p_c (dp_c - D):
//   dq = scale sum_c ds_c k_c,  dk_c += scale ds_c q,  dv_c += p_c do.
// float32 throughout; each sum runs over its columns (or rows) in one fixed order, so the results do not depend
// on the number of threads. Shapes: q, o, do [b, nh, n, hd]; ctx k/v [b, nkv, L, hd]; block k/v [b, nkv, n, hd];
// lim [b, nb] int64; lse [b, nh, n]; hd 16, 32, 64 or 128, n = nb * B.
namespace tattn {

inline float dot(const float* a, const float* b, int64_t hd) {
  __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(a), _mm256_loadu_ps(b));
  for (int64_t d = 8; d < hd; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  return hsum(acc);
}

inline void axpy(float a, const float* x, float* y, int64_t hd) {  // y += a x
  const __m256 av = _mm256_set1_ps(a);
  for (int64_t d = 0; d < hd; d += 8)
    _mm256_storeu_ps(y + d, _mm256_fmadd_ps(av, _mm256_loadu_ps(x + d), _mm256_loadu_ps(y + d)));
}

// s[c] <- exp(s[c]) for c < n (exp8; the last partial group through a padded copy)
inline void exp_inplace(float* s, int64_t n) {
  int64_t c = 0;
  for (; c + 8 <= n; c += 8) _mm256_storeu_ps(s + c, exp8(_mm256_loadu_ps(s + c)));
  if (c < n) {
    alignas(32) float t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t u = c; u < n; ++u) t[u - c] = s[u];
    _mm256_store_ps(t, exp8(_mm256_load_ps(t)));
    for (int64_t u = c; u < n; ++u) s[u] = t[u - c];
  }
}

// the key (or value) of column c of a row of block j: context column c < lim, else block column c - lim
inline const float* col(const float* ctx, const float* blk, int64_t lim, int64_t j, int64_t B, int64_t c, int64_t hd) {
  return c < lim ? ctx + c * hd : blk + (j * B + (c - lim)) * hd;
}

}  // namespace tattn

// One row of the forward: o = sum_c p_c v_c / z over the row's columns in order, its DV lanes of 8 in registers
template <int DV>
void attend_row(const float* qi, const float* ctxk, const float* ctxv, const float* blkk, const float* blkv, int64_t lim_j,
                int64_t j, int64_t B, float sc, float* s, float* oi, float* lse) {
  using namespace tattn;
  constexpr int64_t hd = 8 * DV;
  const int64_t cols = lim_j + B;
  float m = -INFINITY;
  for (int64_t c = 0; c < cols; ++c) {
    s[c] = dot(qi, col(ctxk, blkk, lim_j, j, B, c, hd), hd) * sc;
    m = std::max(m, s[c]);
  }
  for (int64_t c = 0; c < cols; ++c) s[c] -= m;
  exp_inplace(s, cols);
  float z = 0.0f;
  for (int64_t c = 0; c < cols; ++c) z += s[c];
  __m256 acc[DV];
  for (int d = 0; d < DV; ++d) acc[d] = _mm256_setzero_ps();
  for (int64_t c = 0; c < cols; ++c) {
    const __m256 pc = _mm256_set1_ps(s[c]);
    const float* vc = col(ctxv, blkv, lim_j, j, B, c, hd);
#pragma GCC unroll 16
    for (int d = 0; d < DV; ++d) acc[d] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(vc + 8 * d), acc[d]);
  }
  const __m256 inv = _mm256_set1_ps(1.0f / z);
  for (int d = 0; d < DV; ++d) _mm256_storeu_ps(oi + 8 * d, _mm256_mul_ps(acc[d], inv));
  *lse = m + std::log(z);
}

// One block's rows of one kv head in the backward (R = g B rows, in the order h, then i): first each row's
// probabilities P, score gradients DS and its dq (in registers, over the columns in order); then each column's dk and
// dv, read once, summed over the rows in that order in registers, written once. The same sums in the same order as
// updating dq, dk_c and dv_c row by row and column by column in memory.
template <int DV>
void block_grads(const float* const* qr, const float* const* dor, const float* D, const float* l, float* const* dqr,
                 int64_t R, const float* ck, const float* cv, const float* bk, const float* bv, float* dck, float* dcv,
                 float* dbk, float* dbv, int64_t lim_j, int64_t j, int64_t B, float sc, float* P, float* DS) {
  using namespace tattn;
  constexpr int64_t hd = 8 * DV;
  const int64_t cols = lim_j + B;
  for (int64_t r = 0; r < R; ++r) {
    float *pr = P + r * cols, *dsr = DS + r * cols;
    for (int64_t c = 0; c < cols; ++c) pr[c] = dot(qr[r], col(ck, bk, lim_j, j, B, c, hd), hd) * sc - l[r];
    exp_inplace(pr, cols);
    __m256 acc[DV];
    for (int d = 0; d < DV; ++d) acc[d] = _mm256_loadu_ps(dqr[r] + 8 * d);
    for (int64_t c = 0; c < cols; ++c) {
      dsr[c] = pr[c] * (dot(dor[r], col(cv, bv, lim_j, j, B, c, hd), hd) - D[r]) * sc;
      const __m256 ds = _mm256_set1_ps(dsr[c]);
      const float* kc = col(ck, bk, lim_j, j, B, c, hd);
#pragma GCC unroll 16
      for (int d = 0; d < DV; ++d) acc[d] = _mm256_fmadd_ps(ds, _mm256_loadu_ps(kc + 8 * d), acc[d]);
    }
    for (int d = 0; d < DV; ++d) _mm256_storeu_ps(dqr[r] + 8 * d, acc[d]);
  }
  for (int64_t c = 0; c < cols; ++c) {
    float* dk = const_cast<float*>(col(dck, dbk, lim_j, j, B, c, hd));
    float* dv = const_cast<float*>(col(dcv, dbv, lim_j, j, B, c, hd));
    __m256 ak[DV], av[DV];
    for (int d = 0; d < DV; ++d) {
      ak[d] = _mm256_loadu_ps(dk + 8 * d);
      av[d] = _mm256_loadu_ps(dv + 8 * d);
    }
    for (int64_t r = 0; r < R; ++r) {
      const __m256 ds = _mm256_set1_ps(DS[r * cols + c]), pc = _mm256_set1_ps(P[r * cols + c]);
#pragma GCC unroll 16
      for (int d = 0; d < DV; ++d) {
        ak[d] = _mm256_fmadd_ps(ds, _mm256_loadu_ps(qr[r] + 8 * d), ak[d]);
        av[d] = _mm256_fmadd_ps(pc, _mm256_loadu_ps(dor[r] + 8 * d), av[d]);
      }
    }
    for (int d = 0; d < DV; ++d) {
      _mm256_storeu_ps(dk + 8 * d, ak[d]);
      _mm256_storeu_ps(dv + 8 * d, av[d]);
    }
  }
}

#define XP_HEAD_WIDTHS(F) \
  switch (hd) {           \
    case 16: F(2); break; \
    case 32: F(4); break; \
    case 64: F(8); break; \
    case 128: F(16); break; \
    default: TORCH_CHECK(false, "block attention: head width 16, 32, 64 or 128"); \
  }

std::vector<torch::Tensor> block_attention_forward(torch::Tensor q, torch::Tensor ck, torch::Tensor cv, torch::Tensor bk,
                                                   torch::Tensor bv, torch::Tensor lim, int64_t B, double scale) {
  const int64_t b = q.size(0), nh = q.size(1), n = q.size(2), hd = q.size(3), nkv = ck.size(1), L = ck.size(2);
  const int64_t nb = n / B, g = nh / nkv;
  TORCH_CHECK(q.is_contiguous() && ck.is_contiguous() && cv.is_contiguous() && bk.is_contiguous() && bv.is_contiguous() &&
              q.scalar_type() == torch::kFloat32 && n % B == 0 && nh % nkv == 0 &&
              lim.sizes() == torch::IntArrayRef({b, nb}) && lim.scalar_type() == torch::kInt64 && lim.is_contiguous(),
              "block_attention_forward: float32 contiguous q [b, nh, n, hd], k / v [b, nkv, L or n, hd], lim [b, n / B]");
  torch::Tensor o = torch::empty_like(q), lse = torch::empty({b, nh, n}, q.options());
  const float *qp = q.data_ptr<float>(), *ckp = ck.data_ptr<float>(), *cvp = cv.data_ptr<float>();
  const float *bkp = bk.data_ptr<float>(), *bvp = bv.data_ptr<float>();
  const int64_t* lp = lim.data_ptr<int64_t>();
  float *op = o.data_ptr<float>(), *lsep = lse.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, b * nh * nb, 1, [&](int64_t t0, int64_t t1) {
    float* s = scratch<float, 0>(static_cast<size_t>(L + B));
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bi = t / (nh * nb), h = (t / nb) % nh, j = t % nb, kv = h / g;
      const int64_t lim_j = std::min(std::max<int64_t>(lp[bi * nb + j], 0), L);
      const int64_t oc = (bi * nkv + kv) * L * hd, ob = (bi * nkv + kv) * n * hd;
      for (int64_t i = j * B; i < (j + 1) * B; ++i) {
        const int64_t row = (bi * nh + h) * n + i;
#define XP_ROW(DV) attend_row<DV>(qp + row * hd, ckp + oc, cvp + oc, bkp + ob, bvp + ob, lim_j, j, B, sc, s, op + row * hd, lsep + row)
        XP_HEAD_WIDTHS(XP_ROW)
#undef XP_ROW
      }
    }
  });
  return {o, lse};
}

// gradients of q, the context keys and values and the block keys and values; each task one (sequence, kv head),
// so that the context keys' gradients it sums over all its rows are its own
std::vector<torch::Tensor> block_attention_backward(torch::Tensor dout, torch::Tensor q, torch::Tensor ck, torch::Tensor cv,
                                                    torch::Tensor bk, torch::Tensor bv, torch::Tensor lim, torch::Tensor o,
                                                    torch::Tensor lse, int64_t B, double scale) {
  using namespace tattn;
  const int64_t b = q.size(0), nh = q.size(1), n = q.size(2), hd = q.size(3), nkv = ck.size(1), L = ck.size(2);
  const int64_t nb = n / B, g = nh / nkv;
  TORCH_CHECK(dout.is_contiguous() && dout.sizes() == q.sizes() && dout.scalar_type() == torch::kFloat32,
              "block_attention_backward: do float32 contiguous, q's shape");
  torch::Tensor dq = torch::zeros_like(q), dck = torch::zeros_like(ck), dcv = torch::zeros_like(cv);
  torch::Tensor dbk = torch::zeros_like(bk), dbv = torch::zeros_like(bv);
  const float *qp = q.data_ptr<float>(), *ckp = ck.data_ptr<float>(), *cvp = cv.data_ptr<float>();
  const float *bkp = bk.data_ptr<float>(), *bvp = bv.data_ptr<float>(), *dop = dout.data_ptr<float>();
  const float *op = o.data_ptr<float>(), *lsep = lse.data_ptr<float>();
  const int64_t* lp = lim.data_ptr<int64_t>();
  float *dqp = dq.data_ptr<float>(), *dckp = dck.data_ptr<float>(), *dcvp = dcv.data_ptr<float>();
  float *dbkp = dbk.data_ptr<float>(), *dbvp = dbv.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const int64_t R = g * B;
  at::parallel_for(0, b * nkv, 1, [&](int64_t t0, int64_t t1) {
    float* P = scratch<float, 0>(static_cast<size_t>(R * (L + B)));
    float* DS = scratch<float, 1>(static_cast<size_t>(R * (L + B)));
    std::vector<const float*> qr(R), dor(R);
    std::vector<float*> dqr(R);
    std::vector<float> D(R), l(R);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bi = t / nkv, kv = t % nkv;
      const int64_t oc = (bi * nkv + kv) * L * hd, ob = (bi * nkv + kv) * n * hd;
      for (int64_t j = 0; j < nb; ++j) {
        const int64_t lim_j = std::min(std::max<int64_t>(lp[bi * nb + j], 0), L);
        int64_t r = 0;
        for (int64_t h = kv * g; h < (kv + 1) * g; ++h)
          for (int64_t i = j * B; i < (j + 1) * B; ++i, ++r) {
            const int64_t row = (bi * nh + h) * n + i;
            qr[r] = qp + row * hd;
            dor[r] = dop + row * hd;
            dqr[r] = dqp + row * hd;
            D[r] = dot(dor[r], op + row * hd, hd);
            l[r] = lsep[row];
          }
#define XP_BLOCK(DV) block_grads<DV>(qr.data(), dor.data(), D.data(), l.data(), dqr.data(), R, ckp + oc, cvp + oc, bkp + ob, \
                                     bvp + ob, dckp + oc, dcvp + oc, dbkp + ob, dbvp + ob, lim_j, j, B, sc, P, DS)
        XP_HEAD_WIDTHS(XP_BLOCK)
#undef XP_BLOCK
      }
    }
  });
  return {dq, dck, dcv, dbk, dbv};
}
#undef XP_HEAD_WIDTHS

// How many of torch's threads ran the bodies of one at::parallel_for over n items: at::get_num_threads()
// where the module was built with OpenMP, 1 where it was not (ATen's parallel_for is an OpenMP region
// written in its headers, so it runs serially in code compiled without -fopenmp).
int64_t parallel_threads(int64_t n) {
  std::vector<int> ran(static_cast<size_t>(at::get_num_threads()), 0);
  at::parallel_for(0, n, 1, [&](int64_t, int64_t) { ran[static_cast<size_t>(at::get_thread_num())] = 1; });
  int64_t used = 0;
  for (int r : ran) used += r;
  return used;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "[N, K] float32 weight -> [N / 16, K, 16]");
  m.def("pack_bf16", &pack_bf16, "[N, K] weight -> [N / 16, K / 2, 16, 2] bf16, the AMX products' layout");
  m.def("amx_ready", &amx_ready, "whether bf16 products can run on AMX tiles here (CPU, kernel and build)");
  m.def("amx_emulated", [] {
#ifdef XP_AMX_EMULATE
    return true;
#else
    return false;
#endif
  }, "whether this build runs the tile intrinsics in software (amx_emulate.h; XPRESS_AMX_EMULATE=1, tests only)");
  m.def("bf16_ready", &bf16_ready, "whether bf16 products run here: on AMX tiles, or with AVX512-BF16 without them");
  m.def("linear", &linear, "x [M, K] @ W.T with W packed by pack() or pack_bf16()");
  m.def("rms_norm", &rms_norm, "row-wise RMSNorm of x [M, H] by w [H]");
  m.def("layer", &layer, "one Llama decoder layer for one sequence (see the file's header)");
  m.def("markov_steps", &markov_steps, "the Markov head's T=0 decode of one block (see markov_steps)");
  m.def("refine_fold", &refine_fold, "the folded xPress refiner's token-independent part for one block (see refine_fold)");
  m.def("refine_pass", &refine_pass, "one T=0 Jacobi pass of the folded xPress refiner over one block (see refine_pass)");
  m.def("draft_context", &draft_context, "the dFlash drafter's context keys and values of new target states (see draft_context)");
  m.def("draft_layer", &draft_layer, "one dFlash drafter layer for one block after its context (see draft_layer)");
  m.def("layer_rows", &layer_rows, "one Llama decoder layer for one new token of each of several cached sequences");
  m.def("parallel_threads", &parallel_threads, "threads that ran one at::parallel_for over n items");
  m.def("fma_rate", &fma_rate, "float32 multiply-adds per second on all threads, FMA chains in registers");
  m.def("bf16_dot_rate", &bf16_dot_rate, "bf16 multiply-adds per second on all threads with VDPBF16PS (0 without AVX512-BF16)");
  m.def("loss_forward", &loss_forward, "the co-training loss's per-row terms, softmax and L1 gradient direction (see loss_rows)");
  m.def("loss_backward", &loss_backward, "the co-training loss's gradient with respect to the logits (see loss_rows)");
  m.def("block_attention_forward", &block_attention_forward, "the drafter's training attention over its blocks (see block_attention_forward)");
  m.def("block_attention_backward", &block_attention_backward, "its gradients (see block_attention_backward)");
  m.def("read_rate", &read_rate, "bytes per second all threads read from a buffer of the given size");
}
