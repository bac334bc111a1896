// AMX bfloat16 matmul: A packed into 16 x 32 tiles, B into 32-column panels of k-pairs (the
// tile unit's VNNI layout), 2 x 2 tiles of C summed over K in the tile registers.
#include "backends/cpu/amx_matmul.h"

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <vector>

#include "core/error.h"
#include "backends/cpu/onednn_runtime.h"

namespace kiln::cpu {

namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kTileK = 32;    // bfloat16 elements in a tile row of 64 bytes
constexpr int64_t kBlockM = 32;   // rows of C per block: two tiles
constexpr int64_t kPanelN = 32;   // columns of C per panel: two tiles
constexpr int64_t kChunkBytes = int64_t{2} << 20;  // A packed at most this much at once: a thread's scratch
constexpr int64_t kGroupBytes = int64_t{1} << 20;  // and B's panels, where a thread has its own (no claims)
// A row-major A is read in place, not packed, where its row pitch is at most this (a block's 32
// rows then lie in 8 KiB, read in order) or the panels a thread owns are fewer than kPackForPanels
// (each panel loads the block again; packed, the loads are of whole aligned tiles).
constexpr int64_t kInPlacePitchBytes = 256;
constexpr int64_t kPackForPanels = 8;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// The tile unit's state is switched on per process (Linux 5.16+): ask once.
bool cpu_grants_amx() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = (edx >> 22) & 1, amx_tile = (edx >> 24) & 1;
  // The packing and rounding around the tiles are AVX-512 F, BW, VL.
  const bool avx512 = (ebx >> 16) & 1 && (ebx >> 30) & 1 && (ebx >> 31) & 1;
  if (!amx_bf16 || !amx_tile || !avx512) return false;
  if (!__get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) || !((eax >> 5) & 1)) return false;  // AVX512-BF16
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !((ecx >> 27) & 1)) return false;  // OSXSAVE
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if (((xcr0_lo >> 17) & 3) != 3) return false;  // XTILECFG and XTILEDATA enabled by the OS
  if ((xcr0_lo & 0xe6) != 0xe6) return false;     // and the vector state: SSE, AVX, opmask, ZMM
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

std::atomic<bool> g_enabled{true};

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Scratch aligned to cache lines, so that no tile row straddles two.
template <typename T>
struct Aligned {
  std::vector<T> storage;
  T* get(size_t count) {
    const size_t pad = 64 / sizeof(T);
    if (storage.size() < count + pad) storage.resize(count + pad);
    auto address = reinterpret_cast<uintptr_t>(storage.data());
    return reinterpret_cast<T*>((address + 63) & ~uintptr_t{63});
  }
};

// GCC 12's AVX-512 shuffle intrinsics start from _mm512_undefined_epi32(), which its
// -Wmaybe-uninitialized reports where the helpers below are inlined: in the packing functions.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// 16 rows of 16 dwords -> their transpose, in place (three shuffle stages).
__attribute__((target("avx512f"))) inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  __m512i u[16];  // u[4g + j], lane L: rows 4g..4g+3 of column 4L + j
  for (int g = 0; g < 4; ++g) {
    u[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
    u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
    u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v01 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), w01 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i v23 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE), w23 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(v01, w01, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v01, w01, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(v23, w23, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v23, w23, 0xDD);
  }
}

// Two rows of 32 bfloat16 -> their elements alternating, as dwords: kFirstPairs picks columns
// 0-15 of both rows, kLastPairs 16-31 (an index's bit 5 selects the second row).
alignas(64) constexpr uint16_t kFirstPairs[32] = {0, 32, 1, 33, 2,  34, 3,  35, 4,  36, 5,  37, 6,  38, 7,  39,
                                                  8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
alignas(64) constexpr uint16_t kLastPairs[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
__attribute__((target("avx512f,avx512bw"))) inline __m512i pairs(__m512i x0, __m512i x1, const uint16_t* table) {
  return _mm512_permutex2var_epi16(x0, _mm512_load_si512(table), x1);
}

// Rows [0, rows) of A (a at its row 0; element (i, k) at a[i*rs + k*cs]) as tiles of 16 rows x 32
// k: out[(tile_row * Kp/32 + k/32) * 512 + (i % 16) * 32 + k % 32], zero past rows and K.
__attribute__((target("avx512f,avx512bw,avx512vl"))) void pack_a(const uint16_t* a, int64_t rs, int64_t cs,
                                                                  int64_t rows, int64_t K, int64_t Kp, uint16_t* out) {
  const int64_t kt = Kp / kTileK, tile_rows = round_up(rows, kBlockM) / kTileRows;
  for (int64_t tb = 0; tb < tile_rows; ++tb)
    for (int64_t kb = 0; kb < kt; ++kb) {
      uint16_t* tile = out + (tb * kt + kb) * kTileRows * kTileK;
      const int64_t i0 = tb * kTileRows, k0 = kb * kTileK;
      const int64_t ni = std::clamp<int64_t>(rows - i0, 0, kTileRows), nk = std::min(kTileK, K - k0);
      if (ni == 0) {  // the block's padding rows
        std::memset(tile, 0, kTileRows * kTileK * sizeof(uint16_t));
      } else if (rs == 1) {  // column-major: transpose k-pairs, masked past rows and K (a last
                             // layer's 10 rows: a weight gradient's δᵀ)
        const __mmask16 in_rows = ni >= kTileRows ? __mmask16(0xffff) : __mmask16((1u << ni) - 1);
        __m512i r[16];
        for (int kp = 0; kp < 16; ++kp) {
          __m512i x[2];
          for (int h = 0; h < 2; ++h) {
            const int64_t k = k0 + 2 * kp + h;
            x[h] = k < K ? _mm512_zextsi256_si512(_mm256_maskz_loadu_epi16(in_rows, a + i0 + k * cs))
                         : _mm512_setzero_si512();
          }
          r[kp] = pairs(x[0], x[1], kFirstPairs);
        }
        transpose16(r);
        for (int m = 0; m < 16; ++m) _mm512_store_si512(tile + m * kTileK, r[m]);
      } else if (cs == 1) {  // row-major: a masked load per tile row, zero past K and rows
        const __mmask32 mask = nk >= kTileK ? ~__mmask32{0} : (__mmask32{1} << nk) - 1;
        for (int64_t m = 0; m < kTileRows; ++m)
          _mm512_store_si512(tile + m * kTileK,
                             m < ni ? _mm512_maskz_loadu_epi16(mask, a + (i0 + m) * rs + k0) : _mm512_setzero_si512());
      } else {
        for (int64_t m = 0; m < kTileRows; ++m)
          for (int64_t k = 0; k < kTileK; ++k)
            tile[m * kTileK + k] = m < ni && k < nk ? a[(i0 + m) * rs + (k0 + k) * cs] : uint16_t{0};
      }
    }
}

// Columns [0, nn) of B (b at its column 0; element (k, n) at b[k*rs + n*cs]) as a 32-column panel
// of k-pairs: out[kp * 32 + n] holds B[2kp][n] in its low half and B[2kp+1][n] in its high half,
// zero past nn and K.
__attribute__((target("avx512f,avx512bw"))) void pack_b(const uint16_t* b, int64_t rs, int64_t cs, int64_t nn,
                                                         int64_t K, int64_t Kp, uint32_t* out) {
  if (cs == 1) {  // row-major: interleave each pair of rows
    const __mmask32 mask = nn >= 32 ? ~__mmask32{0} : (__mmask32{1} << nn) - 1;
    for (int64_t kp = 0; kp < Kp / 2; ++kp) {
      const int64_t k = 2 * kp;
      const __m512i x0 = k < K ? _mm512_maskz_loadu_epi16(mask, b + k * rs) : _mm512_setzero_si512();
      const __m512i x1 = k + 1 < K ? _mm512_maskz_loadu_epi16(mask, b + (k + 1) * rs) : _mm512_setzero_si512();
      _mm512_store_si512(out + kp * kPanelN, pairs(x0, x1, kFirstPairs));
      _mm512_store_si512(out + kp * kPanelN + 16, pairs(x0, x1, kLastPairs));
    }
    return;
  }
  for (int64_t kb = 0; kb < Kp / kTileK; ++kb) {
    const int64_t k0 = kb * kTileK;
    if (rs == 1 && k0 + kTileK <= K) {  // column-major: k-pairs are dwords; transpose
      for (int h = 0; h < 2; ++h) {
        __m512i r[16];
        for (int j = 0; j < 16; ++j)
          r[j] = 16 * h + j < nn ? _mm512_loadu_si512(b + (16 * h + j) * cs + k0) : _mm512_setzero_si512();
        transpose16(r);
        for (int kp = 0; kp < 16; ++kp) _mm512_store_si512(out + (k0 / 2 + kp) * kPanelN + 16 * h, r[kp]);
      }
      continue;
    }
    for (int64_t kp = 0; kp < 16; ++kp)
      for (int64_t n = 0; n < kPanelN; ++n) {
        const int64_t k = k0 + 2 * kp;
        const uint32_t lo = n < nn && k < K ? b[k * rs + n * cs] : 0;
        const uint32_t hi = n < nn && k + 1 < K ? b[(k + 1) * rs + n * cs] : 0;
        out[(k0 / 2 + kp) * kPanelN + n] = lo | hi << 16;
      }
  }
}

#pragma GCC diagnostic pop

// Rows [0, rows) x columns [0, cols) of a 32 x 32 float block -> bfloat16 by vcvtne2ps2bf16:
// nearest even, a NaN made quiet, as core/dtype.cc rounds. (The instruction reads denormals as
// zero where the software rounding keeps them, but the tile unit has flushed every denormal sum.)
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void store_block(const float* block, int64_t rows,
                                                                         int64_t cols, uint16_t* c, int64_t ldc) {
  const __mmask32 mask = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  for (int64_t i = 0; i < rows; ++i) {
    const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_load_ps(block + i * kPanelN + 16), _mm512_load_ps(block + i * kPanelN));
    _mm512_mask_storeu_epi16(c + i * ldc, mask, reinterpret_cast<const __m512i&>(pair));
  }
}

// Rows [0, rows) x columns [0, cols) of C's block fetched for writing (every CPU with AMX has
// PREFETCHW): a thread that writes only part of each row (the panel split) stores its blocks at
// C's row pitch, which the hardware's prefetchers do not follow. Fetched while the block's tiles
// run, its stores no longer wait for the lines: a 512 x 128 x 784 weight gradient 117 -> 76 us.
// (An asm statement: GCC judged a function of _m_prefetchw calls free of effects and dropped its
// call.)
void prefetch_block(uint16_t* c, int64_t rows, int64_t cols, int64_t ldc) {
  const auto fetch = [](const uint16_t* line) { __asm__ volatile("prefetchw %0" : : "m"(*line)); };
  for (int64_t i = 0; i < rows; ++i) {
    const uint16_t* row = c + i * ldc;
    fetch(row);
    // (A row of the block may straddle two lines.)
    if ((reinterpret_cast<uintptr_t>(row) & 63) + static_cast<uintptr_t>(cols) * 2 > 64) fetch(row + cols - 1);
  }
}

// Where one 32-row block of A's tiles is: its k-tiles [0, full) at top/bottom + kb * step (rows
// `stride` bytes apart: packed tiles, or A's own rows read in place), the rest (one K tail at most)
// at tail_top/tail_bottom, packed.
struct BlockA {
  const uint16_t *top, *bottom;
  int64_t stride, step, full;
  const uint16_t *tail_top, *tail_bottom;
};

// A block against one panel: C's 32 x 32 block summed in tiles 0-3.
__attribute__((target("amx-tile,amx-bf16"))) void multiply_block(const BlockA& a, const uint32_t* panel, int64_t kt,
                                                                  float* block) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < kt; ++kb) {
    if (kb < a.full) {
      _tile_loadd(4, a.top + kb * a.step, a.stride);
      _tile_loadd(5, a.bottom + kb * a.step, a.stride);
    } else {
      _tile_loadd(4, a.tail_top, kTileK * 2);
      _tile_loadd(5, a.tail_bottom, kTileK * 2);
    }
    _tile_loadd(6, panel + kb * 16 * kPanelN, kPanelN * 4);
    _tile_loadd(7, panel + kb * 16 * kPanelN + 16, kPanelN * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, block, kPanelN * 4);
  _tile_stored(1, block + 16, kPanelN * 4);
  _tile_stored(2, block + 16 * kPanelN, kPanelN * 4);
  _tile_stored(3, block + 16 * kPanelN + 16, kPanelN * 4);
}

// Tiles 0-3 hold C, 4-5 A, 6-7 B: all 16 rows of 64 bytes. In static storage: GCC 12 does not see
// that ldtilecfg reads its operand and dropped a local config's stores.
constexpr TileConfig all_tiles_full() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = kTileRows, config.bytes_per_row[t] = 64;
  return config;
}
constexpr TileConfig kTileConfig = all_tiles_full();

__attribute__((target("amx-tile"))) void configure_tiles() { _tile_loadconfig(&kTileConfig); }
__attribute__((target("amx-tile"))) void release_tiles() { _tile_release(); }

// The thread's tiles configured for the scope, released however it is left.
struct TileScope {
  TileScope() { configure_tiles(); }
  ~TileScope() { release_tiles(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

struct Work {
  const uint16_t *a, *b;
  uint16_t* c;
  int64_t as[3], bs[3];
  int64_t batch, M, K, N, Kp, panels;
};

// Rows of A packed at once: at most kChunkBytes of a thread's scratch.
int64_t chunk_rows_of(const Work& w) { return std::max(kBlockM, kChunkBytes / (w.Kp * 2) / kBlockM * kBlockM); }

// Where the panels are split between threads, each of `owners` (the threads asked for) owns
// [panels * t / owners, panels * (t + 1) / owners) of each batch and chunk of rows and claims them
// kClaimPanels at a time from its own counter; with none left it claims the others' (all of them
// where fewer threads came than were asked for: a call from inside another parallel region). Cores
// do not always run at one rate (a hyperthread sibling busy with another process's vector or tile
// work slows them, as do frequency limits), and with a fixed split the slower core kept the other
// waiting at the end of every product; claimed, it does fewer panels. In an even run each thread
// still walks its own columns in order, as it did in the fixed split.
struct PanelClaims {
  std::atomic<int64_t>* next = nullptr;  // `owners` counters per batch and chunk, from each owner's first panel
  int64_t t = 0, owners = 1;
  int64_t chunks = 1;  // chunks of rows per batch that the counters were laid out for
};
// Two panels a claim: one was 7% slower in the MLP's step (A's block is loaded for a single panel;
// and where the threads alternate claims, they write alternate 64-byte pieces of C's rows), and
// more make the last claims too coarse to even out two threads.
constexpr int64_t kClaimPanels = 2;

// One thread's share: panels [p0, p1) and rows [r0, r1) of every batch; with claims, [p0, p1) is
// the range the thread owns, and it runs what it claims.
void run_share(const Work& w, int64_t p0, int64_t p1, int64_t r0, int64_t r1, const PanelClaims& claims = {}) {
  thread_local Aligned<uint16_t> a_scratch, tail_scratch;
  thread_local Aligned<uint32_t> b_scratch;
  thread_local Aligned<float> c_scratch;
  const int64_t kt = w.Kp / kTileK, tile = kTileRows * kTileK;
  const int64_t panel_size = w.Kp / 2 * kPanelN;  // dwords
  const int64_t group = claims.next ? kClaimPanels : std::max<int64_t>(1, kGroupBytes / (panel_size * 4));
  uint32_t* panels = b_scratch.get(static_cast<size_t>((claims.next ? group : std::min(group, p1 - p0)) * panel_size));
  float* block = c_scratch.get(kBlockM * kPanelN);
  // Whole 32-row blocks of a row-major A are read in place, all but a K tail, where the pitch is
  // short or few panels read each block (kInPlacePitchBytes). Otherwise packing pays: 16 rows at a
  // long pitch either straddle cache lines (784 elements) or fall into a few L1 sets (512), and
  // every panel loads them again; packed, the MLP's 128 x 784 x 512 forward took 94 -> 80 us, its
  // 128 x 512 x 784 data gradient 86 -> 71.
  const int64_t rs = w.as[1], cs = w.as[2];
  const bool in_place = cs == 1 && rs >= w.K && (rs * 2 <= kInPlacePitchBytes || p1 - p0 < kPackForPanels);
  const bool partial_rows = p0 > 0 || p1 < w.panels;
  const int64_t k_full = w.K / kTileK;
  const int64_t chunk_rows = chunk_rows_of(w);
  const int64_t chunks = (r1 - r0 + chunk_rows - 1) / chunk_rows;
  KILN_CHECK(!claims.next || (r0 == 0 && chunks == claims.chunks), "matmul",
             "AMX panel claims laid out for {} chunks of rows, run on {}", claims.chunks, chunks);
  TileScope tiles;
  for (int64_t n = 0; n < w.batch; ++n) {
    const uint16_t* a = w.a + n * w.as[0];
    const uint16_t* b = w.b + n * w.bs[0];
    uint16_t* c = w.c + n * w.M * w.N;
    for (int64_t ci = 0; ci < chunks; ++ci) {
      const int64_t chunk = r0 + ci * chunk_rows, rows = std::min(chunk_rows, r1 - chunk);
      const int64_t read_rows = in_place ? rows / kBlockM * kBlockM : 0;
      const uint16_t* tail = nullptr;
      uint16_t* a_tiles = nullptr;
      bool packed_a = false;
      // A is packed on the first panels this thread gets of the chunk: none, no packing.
      auto pack_chunk = [&] {
        if (read_rows > 0 && k_full < kt) {
          uint16_t* packed = tail_scratch.get(static_cast<size_t>(read_rows * kTileK));
          pack_a(a + chunk * rs + k_full * kTileK, rs, cs, read_rows, w.K - k_full * kTileK, kTileK, packed);
          tail = packed;
        }
        if (read_rows < rows) {
          a_tiles = a_scratch.get(static_cast<size_t>(round_up(rows - read_rows, kBlockM) * w.Kp));
          pack_a(a + (chunk + read_rows) * rs, rs, cs, rows - read_rows, w.K, w.Kp, a_tiles);
        }
        packed_a = true;
      };
      // Panels packed a group at a time (a claim's two, or up to kGroupBytes of a thread's own), then
      // each block of rows against all of them: C written a row block at a time, the block's A
      // tiles reused while still in cache.
      auto run_group = [&](int64_t g0, int64_t g1) {
        if (!packed_a) pack_chunk();
        for (int64_t p = g0; p < g1; ++p) {
          const int64_t n0 = p * kPanelN;
          pack_b(b + n0 * w.bs[2], w.bs[1], w.bs[2], std::min(kPanelN, w.N - n0), w.K, w.Kp, panels + (p - g0) * panel_size);
        }
        for (int64_t m0 = 0; m0 < rows; m0 += kBlockM) {
          BlockA block_a;
          if (m0 < read_rows) {
            const uint16_t* top = a + (chunk + m0) * rs;
            const int64_t t = m0 / kTileRows;
            block_a = {top, top + kTileRows * rs, rs * 2, kTileK, k_full,
                       tail ? tail + t * tile : nullptr, tail ? tail + (t + 1) * tile : nullptr};
          } else {
            const uint16_t* top = a_tiles + (m0 - read_rows) / kTileRows * kt * tile;
            block_a = {top, top + kt * tile, kTileK * 2, tile, kt, nullptr, nullptr};
          }
          const int64_t block_rows = std::min(kBlockM, rows - m0);
          for (int64_t p = g0; p < g1; ++p) {
            const int64_t n0 = p * kPanelN, cols = std::min(kPanelN, w.N - n0);
            uint16_t* c_block = c + (chunk + m0) * w.N + n0;
            if (partial_rows) prefetch_block(c_block, block_rows, cols, w.N);
            multiply_block(block_a, panels + (p - g0) * panel_size, kt, block);
            store_block(block, block_rows, cols, c_block, w.N);
          }
        }
      };
      if (!claims.next) {
        for (int64_t g0 = p0; g0 < p1; g0 += group) run_group(g0, std::min(p1, g0 + group));
        continue;
      }
      std::atomic<int64_t>* next = claims.next + (n * chunks + ci) * claims.owners;
      for (int64_t i = 0; i < claims.owners; ++i) {
        const int64_t owner = (claims.t + i) % claims.owners, end = w.panels * (owner + 1) / claims.owners;
        for (int64_t g0; (g0 = next[owner].fetch_add(group, std::memory_order_relaxed)) < end;)
          run_group(g0, std::min(end, g0 + group));
      }
    }
  }
}

bool amx_granted() {
  static const bool granted = cpu_grants_amx();
  return granted;
}

}  // namespace

bool amx_matmul_available() { return amx_granted() && g_enabled.load(std::memory_order_relaxed); }

bool amx_matmul_enable(bool on) { return g_enabled.exchange(on); }

void amx_matmul(const void* a, const int64_t a_strides[3], const void* b, const int64_t b_strides[3], void* c,
                int64_t batch, int64_t M, int64_t K, int64_t N) {
  KILN_CHECK(amx_granted(), "matmul", "the AMX kernel ran on a CPU without AMX-BF16 (check amx_matmul_available)");
  KILN_CHECK(batch >= 0 && M >= 0 && K >= 0 && N >= 0, "matmul", "negative size: batch {}, M {}, K {}, N {}", batch, M,
             K, N);
  if (batch == 0 || M == 0 || N == 0) return;
  if (K == 0) {
    std::memset(c, 0, static_cast<size_t>(batch * M * N) * 2);
    return;
  }
  Work w{static_cast<const uint16_t*>(a), static_cast<const uint16_t*>(b), static_cast<uint16_t*>(c),
         {a_strides[0], a_strides[1], a_strides[2]}, {b_strides[0], b_strides[1], b_strides[2]},
         batch, M, K, N, round_up(K, kTileK), (N + kPanelN - 1) / kPanelN};
  const int64_t blocks = (M + kBlockM - 1) / kBlockM;
  // Small work runs on one thread, as oneDNN's calls do (backends/cpu/onednn_runtime.h).
  const double flops = 2.0 * static_cast<double>(batch) * M * N * K;
  const int threads = flops < kOneThreadFlops ? 1 : static_cast<int>(std::min<int64_t>(omp_get_max_threads(),
                                                                                       std::max(w.panels, blocks)));
  if (threads <= 1) {
    run_share(w, 0, w.panels, 0, M);
    return;
  }
  // Each thread packs the whole of the operand it does not split: split the panels of B where A
  // is the smaller (a layer's products on a batch of 128: M <= N) and there are enough of them,
  // else blocks of rows (a projection of 2048 tokens to 128 or 512 features: M > N).
  const bool split_panels = w.panels >= threads && (M <= N || blocks < threads);
  const int64_t chunk_rows = chunk_rows_of(w), chunks = (M + chunk_rows - 1) / chunk_rows;
  std::vector<std::atomic<int64_t>> next(split_panels ? static_cast<size_t>(batch * chunks * threads) : 0);
  for (size_t i = 0; i < next.size(); ++i)
    next[i].store(w.panels * static_cast<int64_t>(i % threads) / threads, std::memory_order_relaxed);
  std::exception_ptr failure;
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    try {
      if (split_panels)
        run_share(w, w.panels * t / threads, w.panels * (t + 1) / threads, 0, M, {next.data(), t, threads, chunks});
      else
        run_share(w, 0, w.panels, std::min(M, blocks * t / nt * kBlockM), std::min(M, blocks * (t + 1) / nt * kBlockM));
    } catch (...) {
#pragma omp critical(kiln_amx_failure)
      failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace kiln::cpu
