// gemini_dcp CPU ops: multi-threaded byte copy, CRC-32C (Castagnoli) and a fused
// copy + CRC-32C, plus the CPU kernel of the "xsum64" checksum whose CUDA kernel
// lives in cuda/gemini_cuda.cu.
//
// Registered as torch.ops.gemini_dcp.* (TORCH_LIBRARY below); the Python side is
// gemini_dcp/ext.py, which JIT-builds this file and falls back to pure torch /
// the `crc32c` package when it cannot.
//
// The ops run with the GIL released: torch.ops calls drop the GIL before they
// enter the dispatcher, so a checkpoint copy on a background thread does not
// stall the training thread.
//
// CRC-32C layout
//   * "raw" functions work on the CRC register without the initial/final
//     inversion; crc32c(value, buf) = ~raw(~value, buf), which matches the
//     `crc32c` Python package (and iSCSI / ext4 / RFC 3720).
//   * x86-64, two kernels, both selected at run time (__builtin_cpu_supports) and
//     compiled with target attributes (no -msse4.2/-mpclmul for the rest of the file):
//       - PCLMULQDQ folding: four 128-bit accumulators folded by carry-less
//         multiplication, the last 16 bytes and the tail through crc32;
//       - SSE4.2 `crc32` on 8-byte words, three independent streams over adjacent
//         blocks merged with a "shift by N zero bytes" operator (multiplication
//         by x^(8N) mod P, tabulated per byte), which hides the instruction's
//         3-cycle latency where it is pipelined.
//     Which is faster depends on the core, so the first use times both on an
//     in-cache buffer and keeps the faster (build_info() reports the figures).
//   * elsewhere: slicing-by-8 tables (AArch64 uses its CRC32C instructions when
//     the compiler targets them).
//   * combining CRCs of consecutive pieces: crc(A||B) = shift_{|B|}(crc(A)) ^ crc(B)
//     (this holds for the inverted CRC as well), which lets several threads
//     checksum disjoint pieces of one buffer.

#include <torch/library.h>
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#define GEMINI_X86 1
#include <nmmintrin.h>
#include <smmintrin.h>
#include <wmmintrin.h>
#endif
#if defined(__aarch64__) && defined(__ARM_FEATURE_CRC32)
#define GEMINI_ARM_CRC 1
#include <arm_acle.h>
#endif

namespace gemini_dcp {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC-32C, reflected
constexpr size_t kMinBytesPerThread = size_t(8) << 20;
constexpr int kMaxDefaultThreads = 4;

// ------------------------------------------------------------------ GF(2) math

// a(x) * b(x) mod P in the reflected representation (bit 31 holds x^0).
uint32_t gf2_mul(uint32_t a, uint32_t b) {
  uint32_t prod = 0;
  for (int i = 0; i < 32; ++i) {
    if (a & (0x80000000u >> i)) prod ^= b;
    b = (b & 1u) ? (b >> 1) ^ kPoly : (b >> 1);  // b *= x
  }
  return prod;
}

// x^nbits mod P.
uint32_t x_pow_bits(uint64_t nbits) {
  uint32_t result = 0x80000000u;  // x^0
  uint32_t base = 0x40000000u;    // x^1
  while (nbits) {
    if (nbits & 1) result = gf2_mul(result, base);
    base = gf2_mul(base, base);
    nbits >>= 1;
  }
  return result;
}

// x^(8 * nbytes) mod P: the operator that appends `nbytes` zero bytes to a raw CRC.
uint32_t x_pow_8n(uint64_t nbytes) {
  uint32_t result = x_pow_bits(8 * (nbytes & ((uint64_t(1) << 60) - 1)));
  for (uint64_t hi = nbytes >> 60; hi; --hi) result = gf2_mul(result, x_pow_bits(uint64_t(8) << 60));
  return result;
}

// crc32c(A||B) from crc32c(A), crc32c(B) and |B|.
uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return gf2_mul(x_pow_8n(len_b), crc_a) ^ crc_b;
}

// A fixed shift operator, tabulated per byte of the register (it is linear).
struct ShiftTable {
  std::array<std::array<uint32_t, 256>, 4> t;
  explicit ShiftTable(uint64_t nbytes) {
    const uint32_t op = x_pow_8n(nbytes);
    for (int k = 0; k < 4; ++k)
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = gf2_mul(op, b << (8 * k));
  }
  uint32_t operator()(uint32_t crc) const {
    return t[0][crc & 0xff] ^ t[1][(crc >> 8) & 0xff] ^ t[2][(crc >> 16) & 0xff] ^ t[3][crc >> 24];
  }
};

// ------------------------------------------------------------------ software CRC

struct Slice8 {
  uint32_t t[8][256];
  Slice8() {
    for (uint32_t b = 0; b < 256; ++b) {
      uint32_t c = b;
      for (int k = 0; k < 8; ++k) c = (c & 1u) ? (c >> 1) ^ kPoly : (c >> 1);
      t[0][b] = c;
    }
    for (int k = 1; k < 8; ++k)
      for (uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8) ^ t[0][t[k - 1][b] & 0xff];
  }
};

const Slice8& slice8() {
  static const Slice8 tables;
  return tables;
}

inline uint64_t load_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

uint32_t crc_raw_sw(uint32_t crc, const uint8_t* p, size_t n) {
  const auto& T = slice8().t;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  while (n >= 8) {
    const uint64_t w = load_u64(p) ^ crc;
    crc = T[7][w & 0xff] ^ T[6][(w >> 8) & 0xff] ^ T[5][(w >> 16) & 0xff] ^ T[4][(w >> 24) & 0xff] ^
          T[3][(w >> 32) & 0xff] ^ T[2][(w >> 40) & 0xff] ^ T[1][(w >> 48) & 0xff] ^ T[0][w >> 56];
    p += 8;
    n -= 8;
  }
#endif
  while (n--) crc = (crc >> 8) ^ T[0][(crc ^ *p++) & 0xff];
  return crc;
}

// ------------------------------------------------------------------ hardware CRC

// Bytes per stream of the 3-way interleaved loops (long for big buffers, short
// for the remainder). 3 x 8 KiB stays in L1.
constexpr size_t kLong = 8192;
constexpr size_t kShort = 256;
// Buffers from this size on use the PCLMULQDQ folding path where the CPU has it.
constexpr size_t kPclmulMin = 256;
// Testing/benchmark knob (crc32c_path): 0 = the calibrated choice, 1 = force the
// crc32-instruction loop, 2 = force PCLMULQDQ folding (where the CPU has it).
std::atomic<int> g_crc_override{0};

const ShiftTable& shift_long() {
  static const ShiftTable t(kLong);
  return t;
}
const ShiftTable& shift_short() {
  static const ShiftTable t(kShort);
  return t;
}

#if defined(GEMINI_X86)
__attribute__((target("sse4.2"))) uint32_t crc_raw_hw(uint32_t crc32, const uint8_t* p, size_t n) {
  uint64_t crc = crc32;
  // Align the main loop's loads to 8 bytes (not required by the instruction, but cheaper).
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = _mm_crc32_u8(static_cast<uint32_t>(crc), *p++);
    --n;
  }
  if (n >= 3 * kLong) {
    const ShiftTable& sh = shift_long();
    do {
      uint64_t c0 = crc, c1 = 0, c2 = 0;
      const uint8_t* const end = p + kLong;
      do {
        c0 = _mm_crc32_u64(c0, load_u64(p));
        c1 = _mm_crc32_u64(c1, load_u64(p + kLong));
        c2 = _mm_crc32_u64(c2, load_u64(p + 2 * kLong));
        p += 8;
      } while (p < end);
      crc = sh(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
      crc = sh(static_cast<uint32_t>(crc)) ^ static_cast<uint32_t>(c2);
      p += 2 * kLong;
      n -= 3 * kLong;
    } while (n >= 3 * kLong);
  }
  if (n >= 3 * kShort) {
    const ShiftTable& sh = shift_short();
    do {
      uint64_t c0 = crc, c1 = 0, c2 = 0;
      const uint8_t* const end = p + kShort;
      do {
        c0 = _mm_crc32_u64(c0, load_u64(p));
        c1 = _mm_crc32_u64(c1, load_u64(p + kShort));
        c2 = _mm_crc32_u64(c2, load_u64(p + 2 * kShort));
        p += 8;
      } while (p < end);
      crc = sh(static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
      crc = sh(static_cast<uint32_t>(crc)) ^ static_cast<uint32_t>(c2);
      p += 2 * kShort;
      n -= 3 * kShort;
    } while (n >= 3 * kShort);
  }
  while (n >= 8) {
    crc = _mm_crc32_u64(crc, load_u64(p));
    p += 8;
    n -= 8;
  }
  while (n--) crc = _mm_crc32_u8(static_cast<uint32_t>(crc), *p++);
  return static_cast<uint32_t>(crc);
}

bool cpu_has_sse42() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return has;
}

bool cpu_has_pclmul() {
  static const bool has = [] {
    __builtin_cpu_init();
    return cpu_has_sse42() && __builtin_cpu_supports("pclmul") != 0;
  }();
  return has;
}

// Carry-less multiplication folding (the "PCLMULQDQ" method) for long buffers. On
// CPUs whose crc32 instruction is not pipelined (several AMD Zen generations take
// 3 cycles per crc32 whatever the interleaving) this is several times faster than
// the 3-way crc32 loop; on others it is on par.
//
// Frame: a 128-bit little-endian chunk X = (lo, hi) in the reflected domain is the
// polynomial A*x^64 + B with A = lo, B = hi (bit k of a lane is x^(63-k)). Moving X
// forward by D bits needs Y == X*x^D (mod P) of degree < 128:
//   Y = A*(x^(64+D) mod P) + B*(x^D mod P).
// clmul of two reflected 64-bit values yields their product divided by x in the
// 128-bit frame, hence the constants hold x^(64+D-1) and x^(D-1), 32-bit reflected
// values placed in the upper half of a qword.
struct FoldConst {
  uint64_t lo, hi;
  explicit FoldConst(uint64_t dbits)
      : lo(uint64_t(x_pow_bits(64 + dbits - 1)) << 32), hi(uint64_t(x_pow_bits(dbits - 1)) << 32) {}
};

const FoldConst& fold512() {
  static const FoldConst k(512);
  return k;
}
const FoldConst& fold128() {
  static const FoldConst k(128);
  return k;
}

__attribute__((target("sse4.2,pclmul"))) inline __m128i fold(__m128i x, __m128i k) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, k, 0x00), _mm_clmulepi64_si128(x, k, 0x11));
}

__attribute__((target("sse4.2,pclmul"))) inline __m128i load128(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Requires n >= 64.
__attribute__((target("sse4.2,pclmul"))) uint32_t crc_raw_pclmul(uint32_t crc, const uint8_t* p, size_t n) {
  const FoldConst& c512 = fold512();
  const FoldConst& c128 = fold128();
  const __m128i k512 = _mm_set_epi64x(static_cast<long long>(c512.hi), static_cast<long long>(c512.lo));
  const __m128i k128 = _mm_set_epi64x(static_cast<long long>(c128.hi), static_cast<long long>(c128.lo));
  // The initial register value enters as an XOR into the first 4 bytes.
  __m128i x0 = _mm_xor_si128(load128(p), _mm_cvtsi32_si128(static_cast<int>(crc)));
  __m128i x1 = load128(p + 16), x2 = load128(p + 32), x3 = load128(p + 48);
  p += 64;
  n -= 64;
  while (n >= 64) {
    x0 = _mm_xor_si128(fold(x0, k512), load128(p));
    x1 = _mm_xor_si128(fold(x1, k512), load128(p + 16));
    x2 = _mm_xor_si128(fold(x2, k512), load128(p + 32));
    x3 = _mm_xor_si128(fold(x3, k512), load128(p + 48));
    p += 64;
    n -= 64;
  }
  x1 = _mm_xor_si128(fold(x0, k128), x1);
  x2 = _mm_xor_si128(fold(x1, k128), x2);
  x3 = _mm_xor_si128(fold(x2, k128), x3);
  while (n >= 16) {
    x3 = _mm_xor_si128(fold(x3, k128), load128(p));
    p += 16;
    n -= 16;
  }
  // The CRC of the 16 folded bytes, with a zero register, then the tail.
  uint64_t r = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x3)));
  r = _mm_crc32_u64(r, static_cast<uint64_t>(_mm_extract_epi64(x3, 1)));
  return crc_raw_hw(static_cast<uint32_t>(r), p, n);
}

__attribute__((target("sse4.2,pclmul"))) inline void store128(uint8_t* q, __m128i v, bool stream) {
  if (stream)
    _mm_stream_si128(reinterpret_cast<__m128i*>(q), v);
  else
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q), v);
}

uint64_t count_nonfinite_raw(int64_t kind, const uint8_t* p, size_t n);

// The screen of one 16-byte vector of whole values of kind K (see count_nonfinite_raw): the
// lane-wise maximum of the values' exponent bits, two vector operations (and, max; 64-bit values,
// which have no unsigned max in SSE, take a compare and an or). A piece whose maximum is the
// all-ones exponent holds a non-finite value and is counted exactly (a second pass, only then).
template <int K>
__attribute__((target("sse4.2,pclmul"))) inline __m128i screen_vec(__m128i acc, __m128i v) {
  if constexpr (K == 1) {
    return _mm_max_epu32(acc, _mm_and_si128(v, _mm_set1_epi32(0x7F800000)));
  } else if constexpr (K == 2) {
    const __m128i m = _mm_set1_epi64x(0x7FF0000000000000LL);
    return _mm_or_si128(acc, _mm_cmpeq_epi64(_mm_and_si128(v, m), m));
  } else {
    return _mm_max_epu16(acc, _mm_and_si128(v, _mm_set1_epi16(static_cast<short>(K == 3 ? 0x7C00 : 0x7F80))));
  }
}

template <int K>
__attribute__((target("sse4.2,pclmul"))) inline bool screen_hit(__m128i acc) {
  if constexpr (K == 1) {
    const __m128i m = _mm_set1_epi32(0x7F800000);
    return _mm_movemask_epi8(_mm_cmpeq_epi32(acc, m)) != 0;
  } else if constexpr (K == 2) {
    return _mm_movemask_epi8(acc) != 0;
  } else {
    const __m128i m = _mm_set1_epi16(static_cast<short>(K == 3 ? 0x7C00 : 0x7F80));
    return _mm_movemask_epi8(_mm_cmpeq_epi16(acc, m)) != 0;
  }
}

// One pass: every 64 bytes are loaded once, stored to dst and folded into the CRC. With K > 0 the
// pass also screens the bytes it loads for non-finite values of kind K (two more vector operations
// per 16 bytes) and adds their count to *count: 0 when the screen saw none, else an exact count of
// src (a second pass over a piece that holds some); the bytes must then start at a value boundary.
// K = 0 is the plain copy + CRC (no screen, `count` unused). Requires n >= 64; with `stream`
// (non-temporal stores, which skip reading dst's lines into the cache first) dst must be 16-byte
// aligned.
template <int K>
__attribute__((target("sse4.2,pclmul"))) uint32_t copy_crc_count_raw_pclmul(uint32_t crc, uint8_t* d, const uint8_t* p,
                                                                             size_t n, bool stream, uint64_t* count) {
  const FoldConst& c512 = fold512();
  const FoldConst& c128 = fold128();
  const __m128i k512 = _mm_set_epi64x(static_cast<long long>(c512.hi), static_cast<long long>(c512.lo));
  const __m128i k128 = _mm_set_epi64x(static_cast<long long>(c128.hi), static_cast<long long>(c128.lo));
  [[maybe_unused]] __m128i acc = _mm_setzero_si128();
  [[maybe_unused]] const uint8_t* const p0 = p;
  [[maybe_unused]] const size_t n0 = n;
  __m128i a0 = load128(p), a1 = load128(p + 16), a2 = load128(p + 32), a3 = load128(p + 48);
  store128(d, a0, stream);
  store128(d + 16, a1, stream);
  store128(d + 32, a2, stream);
  store128(d + 48, a3, stream);
  if constexpr (K != 0) acc = screen_vec<K>(screen_vec<K>(screen_vec<K>(screen_vec<K>(acc, a0), a1), a2), a3);
  __m128i x0 = _mm_xor_si128(a0, _mm_cvtsi32_si128(static_cast<int>(crc))), x1 = a1, x2 = a2, x3 = a3;
  p += 64;
  d += 64;
  n -= 64;
  while (n >= 64) {
    a0 = load128(p);
    a1 = load128(p + 16);
    a2 = load128(p + 32);
    a3 = load128(p + 48);
    store128(d, a0, stream);
    store128(d + 16, a1, stream);
    store128(d + 32, a2, stream);
    store128(d + 48, a3, stream);
    x0 = _mm_xor_si128(fold(x0, k512), a0);
    x1 = _mm_xor_si128(fold(x1, k512), a1);
    x2 = _mm_xor_si128(fold(x2, k512), a2);
    x3 = _mm_xor_si128(fold(x3, k512), a3);
    if constexpr (K != 0) {
      acc = screen_vec<K>(screen_vec<K>(screen_vec<K>(screen_vec<K>(acc, a0), a1), a2), a3);
      _mm_prefetch(reinterpret_cast<const char*>(p + 1024), _MM_HINT_T0);  // more loads in flight (the screen's ops)
    }
    p += 64;
    d += 64;
    n -= 64;
  }
  x1 = _mm_xor_si128(fold(x0, k128), x1);
  x2 = _mm_xor_si128(fold(x1, k128), x2);
  x3 = _mm_xor_si128(fold(x2, k128), x3);
  while (n >= 16) {
    a0 = load128(p);
    store128(d, a0, stream);
    x3 = _mm_xor_si128(fold(x3, k128), a0);
    if constexpr (K != 0) acc = screen_vec<K>(acc, a0);
    p += 16;
    d += 16;
    n -= 16;
  }
  if (stream) _mm_sfence();
  if constexpr (K != 0) {
    if (screen_hit<K>(acc)) {
      *count += count_nonfinite_raw(K, p0, n0);  // the whole piece, tail included
    } else {
      *count += count_nonfinite_raw(K, p, n);  // the tail (< 16 bytes) the vectors did not see
    }
  }
  uint64_t r = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x3)));
  r = _mm_crc32_u64(r, static_cast<uint64_t>(_mm_extract_epi64(x3, 1)));
  std::memcpy(d, p, n);
  return crc_raw_hw(static_cast<uint32_t>(r), d, n);
}

// The plain copy + CRC pass (no screen).
__attribute__((target("sse4.2,pclmul"))) uint32_t copy_crc_raw_pclmul(uint32_t crc, uint8_t* d, const uint8_t* p,
                                                                       size_t n, bool stream) {
  return copy_crc_count_raw_pclmul<0>(crc, d, p, n, stream, nullptr);
}
#elif defined(GEMINI_ARM_CRC)
uint32_t crc_raw_hw(uint32_t crc, const uint8_t* p, size_t n) {
  while (n >= 8) {
    crc = __crc32cd(crc, load_u64(p));
    p += 8;
    n -= 8;
  }
  while (n--) crc = __crc32cb(crc, *p++);
  return crc;
}
#endif

#if defined(GEMINI_X86)
// Which x86 kernel is faster depends on the core: where crc32 is pipelined (most
// Intel cores, recent AMD) the 3-way crc32 loop wins; where it is not (the AMD EPYC
// of this project's CI: 3 cycles per crc32 regardless of interleaving) folding
// wins by ~1.5x. So the first use times both on a 64 KiB in-cache buffer (~1 ms)
// and keeps the faster.
struct Calibration {
  bool use_pclmul = false;
  double pclmul_gbps = 0, crc32_gbps = 0;
};

template <typename Fn>
double time_gbps(Fn&& fn, const uint8_t* buf, size_t n) {
  volatile uint32_t sink = 0;
  double best = 1e30;
  for (int rep = 0; rep < 7; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 8; ++i) sink = sink + fn(static_cast<uint32_t>(i), buf, n);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (rep > 0) best = std::min(best, dt);  // rep 0 warms up
  }
  (void)sink;
  return best > 0 ? 8.0 * n / best / 1e9 : 0.0;
}

const Calibration& calibration() {
  static const Calibration cal = [] {
    Calibration c;
    if (!cpu_has_pclmul()) return c;
    std::vector<uint8_t> buf(64 << 10);
    for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
    c.crc32_gbps = time_gbps(crc_raw_hw, buf.data(), buf.size());
    c.pclmul_gbps = time_gbps(crc_raw_pclmul, buf.data(), buf.size());
    c.use_pclmul = c.pclmul_gbps > 1.05 * c.crc32_gbps;
    return c;
  }();
  return cal;
}

bool use_pclmul() {
  const int o = g_crc_override.load(std::memory_order_relaxed);
  if (o == 1) return false;
  if (o == 2) return cpu_has_pclmul();
  return calibration().use_pclmul;
}
#endif

uint32_t crc_raw(uint32_t crc, const uint8_t* p, size_t n) {
#if defined(GEMINI_X86)
  if (n >= kPclmulMin && use_pclmul()) return crc_raw_pclmul(crc, p, n);
  if (cpu_has_sse42()) return crc_raw_hw(crc, p, n);
#elif defined(GEMINI_ARM_CRC)
  return crc_raw_hw(crc, p, n);
#endif
  return crc_raw_sw(crc, p, n);
}

inline uint32_t crc32c_update(uint32_t value, const uint8_t* p, size_t n) {
  return ~crc_raw(~value, p, n);
}

std::string crc_impl_name() {
#if defined(GEMINI_X86)
  if (use_pclmul()) return "pclmul-fold";
  return cpu_has_sse42() ? "sse4.2-3way" : "slice8";
#elif defined(GEMINI_ARM_CRC)
  return "armv8-crc";
#else
  return "slice8";
#endif
}

std::string calibration_info() {
#if defined(GEMINI_X86)
  const Calibration& c = calibration();
  if (c.crc32_gbps > 0) {
    char buf[128];
    std::snprintf(buf, sizeof(buf), "calibrated: pclmul %.1f GB/s, crc32 3-way %.1f GB/s per core", c.pclmul_gbps,
                  c.crc32_gbps);
    return buf;
  }
#endif
  return "not calibrated";
}

// ------------------------------------------------------------------ helpers

void check_bytes(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kByte, op, ": ", name, " must be uint8, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1, op, ": ", name, " must be 1-D, got ", t.dim(), "-D");
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_pair(const at::Tensor& dst, const at::Tensor& src, const char* op) {
  check_bytes(dst, op, "dst");
  check_bytes(src, op, "src");
  TORCH_CHECK(dst.numel() == src.numel(), op, ": size mismatch, dst has ", dst.numel(), " bytes, src ",
              src.numel());
  if (dst.numel() == 0) return;
  const auto d = reinterpret_cast<uintptr_t>(dst.data_ptr());
  const auto s = reinterpret_cast<uintptr_t>(src.data_ptr());
  const auto n = static_cast<uintptr_t>(dst.numel());
  TORCH_CHECK(d == s || d + n <= s || s + n <= d, op, ": dst and src overlap");
}

// Threads to use for n bytes: an explicit request is honored (capped so that each
// thread gets >= 1 byte); 0 means min(4, torch threads, n / 8 MiB), at least 1.
int pick_threads(int64_t requested, size_t n) {
  TORCH_CHECK(requested >= 0, "num_threads must be >= 0, got ", requested);
  size_t t;
  if (requested > 0) {
    t = static_cast<size_t>(requested);
  } else {
    t = static_cast<size_t>(std::min(kMaxDefaultThreads, std::max(1, at::get_num_threads())));
    t = std::min(t, std::max<size_t>(1, n / kMinBytesPerThread));
  }
  t = std::min<size_t>(t, std::max<size_t>(1, n));
  return static_cast<int>(std::min<size_t>(t, 64));
}

// Runs fn(i) for i in [0, threads); i = 0 runs on the calling thread.
template <typename Fn>
void run_threads(int threads, Fn&& fn) {
  if (threads <= 1) {
    fn(0);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads - 1);
  for (int i = 1; i < threads; ++i) pool.emplace_back([&fn, i] { fn(i); });
  fn(0);
  for (auto& th : pool) th.join();
}

// Runs fn(i, begin, end) over `threads` contiguous pieces of [0, n), each
// starting at a multiple of 64 bytes (some trailing pieces may be empty).
template <typename Fn>
void run_split(size_t n, int threads, Fn&& fn) {
  size_t per = (n + threads - 1) / std::max(1, threads);
  per = (per + 63) & ~size_t(63);
  run_threads(threads, [&](int i) {
    const size_t b = std::min(n, per * i), e = std::min(n, per * (i + 1));
    fn(i, b, e);
  });
}

// ------------------------------------------------------------------ ops

void copy_bytes(at::Tensor dst, const at::Tensor& src, int64_t num_threads) {
  check_pair(dst, src, "gemini_dcp::copy_bytes");
  const size_t n = static_cast<size_t>(src.numel());
  if (n == 0 || dst.data_ptr() == src.data_ptr()) return;
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  const auto* s = static_cast<const uint8_t*>(src.data_ptr());
  run_split(n, pick_threads(num_threads, n), [&](int, size_t b, size_t e) {
    if (e > b) std::memcpy(d + b, s + b, e - b);
  });
}

// num_threads = 1 (the default): one pass on the calling thread. Otherwise (0 = the default
// count of pick_threads) each thread checksums a contiguous piece and the CRCs are combined:
// the device-to-host copy (save/device_copy.py) lands pieces faster than one core checksums them.
int64_t crc32c(const at::Tensor& buf, int64_t value, int64_t num_threads) {
  check_bytes(buf, "gemini_dcp::crc32c", "buf");
  TORCH_CHECK(value >= 0 && value <= 0xFFFFFFFFLL, "gemini_dcp::crc32c: value must be a uint32, got ", value);
  const auto* p = static_cast<const uint8_t*>(buf.data_ptr());
  const auto seed = static_cast<uint32_t>(value);
  const size_t n = static_cast<size_t>(buf.numel());
  const int threads = num_threads == 1 ? 1 : pick_threads(num_threads, n);
  if (threads <= 1) return crc32c_update(seed, p, n);
  std::vector<uint32_t> crcs(threads, 0);
  std::vector<size_t> lens(threads, 0);
  run_split(n, threads, [&](int i, size_t b, size_t e) {
    lens[i] = e > b ? e - b : 0;
    crcs[i] = lens[i] ? crc32c_update(0, p + b, lens[i]) : 0;
  });
  uint32_t crc = crcs[0];
  for (int i = 1; i < threads; ++i)
    if (lens[i]) crc = crc32c_combine(crc, crcs[i], lens[i]);
  return seed ? crc32c_combine(seed, crc, n) : crc;
}

// Fused copy + CRC of one piece; returns the (inverted) CRC-32C of the piece.
//   * x86 with PCLMULQDQ: one pass, each 64 bytes loaded once, stored and folded.
//     Used whatever the calibration chose for crc32c alone: measured 1.5x faster
//     than copy-blocks-then-CRC both on the AMD EPYC here (5.5 vs 3.5 GB/s per
//     CPU-second) and on a Xeon where the crc32 loop wins for CRC alone (6.9 vs 4.6 GB/s);
//     pieces of >= 1 MiB use non-temporal stores (dst is not read back soon: it is
//     the tier on save, the live tensor on load, and the stores then skip the read
//     of dst's cache lines).
//   * otherwise: copy blocks small enough to stay in L2 and checksum each block
//     from the destination right after it lands (no second pass over memory).
constexpr size_t kFusedBlock = 3 * kLong * 4;  // 96 KiB
constexpr size_t kStreamMin = size_t(1) << 20;
constexpr size_t kStreamPieceMin = size_t(4) << 10;  // a piece of a large group (copy_crc32c_count_many)
std::atomic<bool> g_fused_blocks{false};  // knob: force the block path (tests, benchmarks)

// stream_min: the piece size from which dst is written with streaming stores (it will not be read
// back soon: the slot is in the page cache, not the CPU's); a group of many small pieces that is
// large in total passes a small one (copy_crc32c_count_many).
uint32_t copy_crc_piece(uint8_t* d, const uint8_t* s, size_t n, size_t stream_min = kStreamMin) {
#if defined(GEMINI_X86)
  if (n >= kPclmulMin && cpu_has_pclmul() && g_crc_override.load() != 1 && !g_fused_blocks) {
    uint32_t raw = 0xFFFFFFFFu;
    const bool stream = n >= stream_min;
    if (stream) {  // align dst to 16 bytes for the streaming stores
      const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
      std::memcpy(d, s, head);
      raw = crc_raw_hw(raw, d, head);
      d += head;
      s += head;
      n -= head;
    }
    return ~copy_crc_raw_pclmul(raw, d, s, n, stream);
  }
#endif
  uint32_t crc = 0;
  for (size_t off = 0; off < n; off += kFusedBlock) {
    const size_t len = std::min(kFusedBlock, n - off);
    std::memcpy(d + off, s + off, len);
    crc = crc32c_update(crc, d + off, len);
  }
  return crc;
}

// `value` continues a running CRC (the CRC-32C of the bytes before these), so a
// copy paced block by block is still one pass: crc(A||B) = combine(crc(A), crc(B), |B|).
int64_t copy_with_crc32c(at::Tensor dst, const at::Tensor& src, int64_t num_threads, int64_t value) {
  check_pair(dst, src, "gemini_dcp::copy_with_crc32c");
  TORCH_CHECK(value >= 0 && value <= 0xFFFFFFFFLL, "gemini_dcp::copy_with_crc32c: value must be a uint32");
  const auto seed = static_cast<uint32_t>(value);
  const size_t n = static_cast<size_t>(src.numel());
  if (n == 0) return seed;
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  const auto* s = static_cast<const uint8_t*>(src.data_ptr());
  if (d == s) return crc32c_update(seed, s, n);
  const int threads = pick_threads(num_threads, n);
  std::vector<uint32_t> crcs(threads, 0);
  std::vector<size_t> lens(threads, 0);
  run_split(n, threads, [&](int i, size_t b, size_t e) {
    lens[i] = e > b ? e - b : 0;
    crcs[i] = lens[i] ? copy_crc_piece(d + b, s + b, lens[i]) : 0;
  });
  uint32_t crc = crcs[0];
  for (int i = 1; i < threads; ++i)
    if (lens[i]) crc = crc32c_combine(crc, crcs[i], lens[i]);
  return seed ? crc32c_combine(seed, crc, n) : crc;
}

// ------------------------------------------------------------------ non-finite counts

// Non-finite values (NaN, +-Inf) of a floating-point item, counted in the save's own pass
// (gemini_dcp/health/count.py): a value is non-finite when its exponent bits are all ones.
// `kind`: 0 none (not counted), 1 float32, 2 float64, 3 float16, 4 bfloat16 (complex items
// count their real and imaginary parts as floats of their component type).
template <typename U>
uint64_t count_exp_ones(const uint8_t* p, size_t n, U mask) {
  const size_t m = n / sizeof(U);
  uint64_t total = 0;
  if (reinterpret_cast<uintptr_t>(p) % alignof(U) == 0) {
    // Same-width lanes (compare, then subtract the all-ones result), vectorized by the compiler;
    // the per-block counter of U's width cannot overflow within 32768 values.
    const U* __restrict q = reinterpret_cast<const U*>(p);
    for (size_t b = 0; b < m; b += 32768) {
      const size_t e = std::min(m, b + 32768);
      U c = 0;
      for (size_t i = b; i < e; ++i) c = static_cast<U>(c + static_cast<U>((q[i] & mask) == mask));
      total += c;
    }
    return total;
  }
  for (size_t i = 0; i < m; ++i) {  // a misaligned buffer: value by value
    U v;
    std::memcpy(&v, p + i * sizeof(U), sizeof(U));
    total += (v & mask) == mask;
  }
  return total;
}

uint64_t count_nonfinite_raw(int64_t kind, const uint8_t* p, size_t n) {
  switch (kind) {
    case 1: return count_exp_ones<uint32_t>(p, n, 0x7F800000u);
    case 2: return count_exp_ones<uint64_t>(p, n, 0x7FF0000000000000ull);
    case 3: return count_exp_ones<uint16_t>(p, n, 0x7C00u);
    case 4: return count_exp_ones<uint16_t>(p, n, 0x7F80u);
    default: return 0;
  }
}

// copy_crc_piece that also counts the piece's non-finite values of `kind` into *count, in the
// same pass: on x86 with PCLMULQDQ inside the folding loop (copy_crc_count_raw_pclmul), else each
// 96 KiB block is counted from dst right after it is copied and checksummed (in cache).
uint32_t copy_crc_count_piece(uint8_t* d, const uint8_t* s, size_t n, int64_t kind, uint64_t* count,
                              size_t stream_min = kStreamMin) {
  uint64_t c = 0;
  if (kind == 0) {  // nothing to count
    *count = 0;
    return copy_crc_piece(d, s, n, stream_min);
  }
#if defined(GEMINI_X86)
  if (kind >= 1 && kind <= 4 && n >= kPclmulMin && cpu_has_pclmul() && g_crc_override.load() != 1 && !g_fused_blocks) {
    uint32_t raw = 0xFFFFFFFFu;
    const size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;
    const bool stream = n >= stream_min && head % 8 == 0;  // the vectors must hold whole values
    if (stream && head) {
      c += count_nonfinite_raw(kind, s, head);
      std::memcpy(d, s, head);
      raw = crc_raw_hw(raw, d, head);
      d += head;
      s += head;
      n -= head;
    }
    switch (kind) {
      case 1: raw = copy_crc_count_raw_pclmul<1>(raw, d, s, n, stream, &c); break;
      case 2: raw = copy_crc_count_raw_pclmul<2>(raw, d, s, n, stream, &c); break;
      case 3: raw = copy_crc_count_raw_pclmul<3>(raw, d, s, n, stream, &c); break;
      default: raw = copy_crc_count_raw_pclmul<4>(raw, d, s, n, stream, &c); break;
    }
    *count = c;
    return ~raw;
  }
#endif
  uint32_t crc = 0;
  for (size_t off = 0; off < n; off += kFusedBlock) {
    const size_t len = std::min(kFusedBlock, n - off);
    std::memcpy(d + off, s + off, len);
    crc = crc32c_update(crc, d + off, len);
    c += count_nonfinite_raw(kind, d + off, len);
  }
  *count = c;
  return crc;
}

// copy_with_crc32c that also counts src's non-finite values of type `kind`: (crc, count).
std::tuple<int64_t, int64_t> copy_crc32c_count(at::Tensor dst, const at::Tensor& src, int64_t kind,
                                               int64_t num_threads, int64_t value) {
  check_pair(dst, src, "gemini_dcp::copy_crc32c_count");
  TORCH_CHECK(value >= 0 && value <= 0xFFFFFFFFLL, "gemini_dcp::copy_crc32c_count: value must be a uint32");
  TORCH_CHECK(kind >= 0 && kind <= 4, "gemini_dcp::copy_crc32c_count: kind must be 0..4, got ", kind);
  const auto seed = static_cast<uint32_t>(value);
  const size_t n = static_cast<size_t>(src.numel());
  if (n == 0) return {static_cast<int64_t>(seed), 0};
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  const auto* s = static_cast<const uint8_t*>(src.data_ptr());
  if (d == s) return {static_cast<int64_t>(crc32c_update(seed, s, n)), static_cast<int64_t>(count_nonfinite_raw(kind, s, n))};
  const int threads = pick_threads(num_threads, n);
  std::vector<uint32_t> crcs(threads, 0);
  std::vector<uint64_t> counts(threads, 0);
  std::vector<size_t> lens(threads, 0);
  run_split(n, threads, [&](int i, size_t b, size_t e) {  // pieces start at multiples of 64: whole values
    lens[i] = e > b ? e - b : 0;
    crcs[i] = lens[i] ? copy_crc_count_piece(d + b, s + b, lens[i], kind, &counts[i]) : 0;
  });
  uint32_t crc = crcs[0];
  uint64_t total = counts[0];
  for (int i = 1; i < threads; ++i) {
    total += counts[i];
    if (lens[i]) crc = crc32c_combine(crc, crcs[i], lens[i]);
  }
  return {static_cast<int64_t>(seed ? crc32c_combine(seed, crc, n) : crc), static_cast<int64_t>(total)};
}

// copy_crc32c_count over many pairs in one call, each on the calling thread (num_threads = 1, value
// = 0): (crcs, counts). One call for a group of small items instead of one per item: the per-call
// cost of the dispatcher and of releasing the GIL (~4 us) exceeds copying a small item.
std::tuple<std::vector<int64_t>, std::vector<int64_t>> copy_crc32c_count_many(at::TensorList dst, at::TensorList src,
                                                                              at::IntArrayRef kinds) {
  const char* op = "gemini_dcp::copy_crc32c_count_many";
  TORCH_CHECK(dst.size() == src.size() && src.size() == kinds.size(), op, ": dst, src and kinds differ in length (",
              dst.size(), ", ", src.size(), ", ", kinds.size(), ")");
  for (size_t i = 0; i < dst.size(); ++i) {
    check_pair(dst[i], src[i], op);
    TORCH_CHECK(kinds[i] >= 0 && kinds[i] <= 4, op, ": kind must be 0..4, got ", kinds[i]);
  }
  size_t total = 0;
  for (const auto& t : src) total += static_cast<size_t>(t.numel());
  // A large group is written with streaming stores however small its pieces (above one cache line's
  // worth of vectors): the destination would only evict the cache, as one large piece's would.
  const size_t stream_min = total >= kStreamMin ? kStreamPieceMin : kStreamMin;
  std::vector<int64_t> crcs(dst.size(), 0), counts(dst.size(), 0);
  for (size_t i = 0; i < dst.size(); ++i) {
    const size_t n = static_cast<size_t>(src[i].numel());
    if (n == 0) continue;
    auto* d = static_cast<uint8_t*>(dst[i].data_ptr());
    const auto* s = static_cast<const uint8_t*>(src[i].data_ptr());
    uint64_t c = 0;
    if (d == s) {
      crcs[i] = static_cast<int64_t>(crc32c_update(0, s, n));
      c = count_nonfinite_raw(kinds[i], s, n);
    } else {
      crcs[i] = static_cast<int64_t>(copy_crc_count_piece(d, s, n, kinds[i], &c, stream_min));
    }
    counts[i] = static_cast<int64_t>(c);
  }
  return {std::move(crcs), std::move(counts)};
}

int64_t count_nonfinite(const at::Tensor& buf, int64_t kind, int64_t num_threads) {
  check_bytes(buf, "gemini_dcp::count_nonfinite", "buf");
  TORCH_CHECK(kind >= 0 && kind <= 4, "gemini_dcp::count_nonfinite: kind must be 0..4, got ", kind);
  const auto* p = static_cast<const uint8_t*>(buf.data_ptr());
  const size_t n = static_cast<size_t>(buf.numel());
  const int threads = num_threads == 1 ? 1 : pick_threads(num_threads, n);
  std::vector<uint64_t> counts(threads, 0);
  run_split(n, threads, [&](int i, size_t b, size_t e) {
    if (e > b) counts[i] = count_nonfinite_raw(kind, p + b, e - b);
  });
  uint64_t total = 0;
  for (uint64_t v : counts) total += v;
  return static_cast<int64_t>(total);
}

// ------------------------------------------------------------------ xsum64

// xsum64: the checksum computed on the GPU by gpu_checksum (see cuda/gemini_cuda.cu
// and gemini_dcp.ext.xsum64_reference, which define it identically):
//   w_i = little-endian 64-bit word i of the bytes, the last one zero-padded
//   S   = sum_i mix64(w_i ^ ((i + 1) * K))            (mod 2^64)
//   xsum64 = mix64(S ^ nbytes ^ SEED)
// with mix64 the splitmix64 finalizer. Order-sensitive (each word is keyed by its
// index), and the sum makes it trivially parallel.
constexpr uint64_t kXsumK = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kXsumSeed = 0x6A09E667F3BCC909ull;

inline uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z;
}

// The sum term of xsum64 over the n bytes at p, keyed from word `base` on (a trailing partial word
// zero-padded), over `threads` threads splitting on word boundaries.
uint64_t xsum64_terms(const uint8_t* p, uint64_t n, uint64_t base, int threads) {
  const uint64_t full = n / 8;
  const uint64_t words = (n + 7) / 8;
  std::vector<uint64_t> sums(threads, 0);
  const uint64_t per = (words + threads - 1) / std::max(1, threads);
  run_threads(threads, [&](int i) {
    const uint64_t b = std::min(words, per * i), e = std::min(words, per * (i + 1));
    uint64_t acc = 0;
    for (uint64_t w = b; w < e; ++w) {
      uint64_t v = 0;
      if (w < full) {
        v = load_u64(p + 8 * w);
      } else {
        for (uint64_t j = 0; 8 * w + j < n; ++j) v |= uint64_t(p[8 * w + j]) << (8 * j);
      }
      acc += mix64(v ^ ((base + w + 1) * kXsumK));
    }
    sums[i] = acc;
  });
  uint64_t s = 0;
  for (uint64_t v : sums) s += v;
  return s;
}

int64_t xsum64_cpu(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "gemini_dcp::xsum64: expected a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "gemini_dcp::xsum64: tensor must be contiguous");
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  const uint64_t n = static_cast<uint64_t>(t.nbytes());
  return static_cast<int64_t>(mix64(xsum64_terms(p, n, 0, pick_threads(0, n)) ^ n ^ kXsumSeed));
}

// The sum term of xsum64 over t's words keyed from word `word_offset` on (t is a piece of a larger
// buffer starting at byte 8 * word_offset; only the last piece of a buffer may have a length that is
// not a multiple of 8). xsum64 of the whole buffer is mix64((sum of the pieces' terms) ^ nbytes ^
// SEED): the CPU checks, piece by piece, a checksum the GPU computed in one pass
// (gemini_dcp/core/checksum.py).
int64_t xsum64_sum(const at::Tensor& t, int64_t word_offset, int64_t num_threads) {
  TORCH_CHECK(t.device().is_cpu(), "gemini_dcp::xsum64_sum: expected a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "gemini_dcp::xsum64_sum: tensor must be contiguous");
  TORCH_CHECK(word_offset >= 0, "gemini_dcp::xsum64_sum: word_offset must be >= 0, got ", word_offset);
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  const uint64_t n = static_cast<uint64_t>(t.nbytes());
  const int threads = num_threads == 1 ? 1 : pick_threads(num_threads, n);
  return static_cast<int64_t>(xsum64_terms(p, n, static_cast<uint64_t>(word_offset), threads));
}

// Testing/benchmark knob: "" queries, "crc32" / "pclmul" force that x86 kernel,
// "blocks" makes copy_with_crc32c copy blocks then checksum them (instead of one
// pass), "auto" restores the defaults. Returns the implementation now in use.
std::string crc32c_path(const std::string& path) {
  if (path == "crc32") {
    g_crc_override = 1;
  } else if (path == "pclmul") {
    g_crc_override = 2;
  } else if (path == "blocks") {
    g_fused_blocks = true;
  } else if (path == "auto") {
    g_crc_override = 0;
    g_fused_blocks = false;
  } else {
    TORCH_CHECK(path.empty(), "gemini_dcp::crc32c_path: expected '', 'auto', 'crc32', 'pclmul' or 'blocks', got '",
                path, "'");
  }
  std::string s = crc_impl_name();
  if (g_fused_blocks) s += "+fused-blocks";
  return s;
}

std::string build_info() {
  std::string s = "crc32c=";
  s += crc_impl_name();
  s += " (" + calibration_info() + ")";
  s += "; copy threads default min(4, torch threads, n / 8 MiB)";
  return s;
}

}  // namespace

TORCH_LIBRARY(gemini_dcp, m) {
  m.def("copy_bytes(Tensor(a!) dst, Tensor src, int num_threads=0) -> ()");
  m.def("crc32c(Tensor buf, int value=0, int num_threads=1) -> int");
  m.def("copy_with_crc32c(Tensor(a!) dst, Tensor src, int num_threads=0, int value=0) -> int");
  m.def("copy_crc32c_count(Tensor(a!) dst, Tensor src, int kind, int num_threads=0, int value=0) -> (int, int)");
  m.def("copy_crc32c_count_many(Tensor(a!)[] dst, Tensor[] src, int[] kinds) -> (int[], int[])");
  m.def("count_nonfinite(Tensor buf, int kind, int num_threads=1) -> int");
  m.def("xsum64(Tensor t) -> int");
  m.def("xsum64_sum(Tensor t, int word_offset=0, int num_threads=1) -> int");
  m.def("build_info() -> str", &build_info);
  m.def("crc32c_path(str path=\"\") -> str", &crc32c_path);
}

TORCH_LIBRARY_IMPL(gemini_dcp, CPU, m) {
  m.impl("copy_bytes", &copy_bytes);
  m.impl("crc32c", &crc32c);
  m.impl("copy_with_crc32c", &copy_with_crc32c);
  m.impl("copy_crc32c_count", &copy_crc32c_count);
  m.impl("copy_crc32c_count_many", &copy_crc32c_count_many);
  m.impl("count_nonfinite", &count_nonfinite);
  m.impl("xsum64", &xsum64_cpu);
  m.impl("xsum64_sum", &xsum64_sum);
}

}  // namespace gemini_dcp
