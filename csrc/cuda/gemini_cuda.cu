// gemini_dcp CUDA ops, compiled only when the extension is built with CUDA
// (gemini_dcp/ext.py adds this file to the sources then).
//
//   host_register(Tensor t) -> ()          cudaHostRegister a CPU tensor's memory
//   host_unregister(Tensor t) -> ()        (e.g. an mmap of a tmpfs file) so GPU->tier
//   host_registered_bytes() -> int         copies are DMA with no staging buffer
//   copy_d2h_chunked(Tensor(a!) dst, Tensor src, int chunk_bytes) -> int
//       chunked cudaMemcpyAsync on a dedicated lowest-priority stream, ordered
//       after the caller's current stream; returns the stream handle so the
//       Python side can record a torch.cuda.Event on it
//   xsum64(Tensor t) -> int                CUDA kernel of the xsum64 checksum
//                                          (definition in ../gemini_ops.cpp)
//   xsum64_accumulate(Tensor t, Tensor(a!) acc, int index, int kind) -> ()
//       the same kernel with no readback: adds the sum into acc[index][0] and the
//       count of non-finite values of `kind` into acc[index][1], so a save (or a
//       restore) reads every tensor's checksum back in one copy

#include <torch/library.h>
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

namespace gemini_dcp {
namespace {

// ------------------------------------------------------------------ host registration

struct Registration {
  size_t nbytes;
  bool owned;  // false: the range was already registered by someone else
};

std::mutex g_reg_mu;
std::map<uintptr_t, Registration> g_regs;

void host_register(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "gemini_dcp::host_register: expected a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), "gemini_dcp::host_register: tensor must be contiguous");
  const size_t n = t.nbytes();
  if (n == 0) return;
  const auto key = reinterpret_cast<uintptr_t>(t.data_ptr());
  std::lock_guard<std::mutex> lk(g_reg_mu);
  auto it = g_regs.find(key);
  if (it != g_regs.end()) {
    TORCH_CHECK(it->second.nbytes >= n, "gemini_dcp::host_register: ", n, " bytes at ", t.data_ptr(),
                " but ", it->second.nbytes, " bytes are registered there; unregister first");
    return;  // idempotent
  }
  const cudaError_t err = cudaHostRegister(t.data_ptr(), n, cudaHostRegisterDefault);
  if (err == cudaErrorHostMemoryAlreadyRegistered) {
    (void)cudaGetLastError();  // clear the sticky-free error state
    g_regs.emplace(key, Registration{n, false});
    return;
  }
  C10_CUDA_CHECK(err);
  g_regs.emplace(key, Registration{n, true});
}

void host_unregister(const at::Tensor& t) {
  TORCH_CHECK(t.device().is_cpu(), "gemini_dcp::host_unregister: expected a CPU tensor, got ", t.device());
  if (t.nbytes() == 0) return;
  const auto key = reinterpret_cast<uintptr_t>(t.data_ptr());
  std::lock_guard<std::mutex> lk(g_reg_mu);
  auto it = g_regs.find(key);
  if (it == g_regs.end()) return;  // idempotent
  const bool owned = it->second.owned;
  g_regs.erase(it);
  if (owned) {
    const cudaError_t err = cudaHostUnregister(reinterpret_cast<void*>(key));
    if (err == cudaErrorHostMemoryNotRegistered) {
      (void)cudaGetLastError();
      return;
    }
    C10_CUDA_CHECK(err);
  }
}

int64_t host_registered_bytes() {
  std::lock_guard<std::mutex> lk(g_reg_mu);
  int64_t total = 0;
  for (const auto& kv : g_regs) total += static_cast<int64_t>(kv.second.nbytes);
  return total;
}

// ------------------------------------------------------------------ chunked D2H

struct D2HStream {
  cudaStream_t stream = nullptr;
  cudaEvent_t ready = nullptr;  // reused to order the stream after the producer
};

std::mutex g_stream_mu;
std::vector<D2HStream> g_streams;

// The dedicated copy stream of `device`: non-blocking, lowest priority, created
// once and kept for the life of the process.
D2HStream& d2h_stream(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lk(g_stream_mu);
  if (g_streams.size() <= static_cast<size_t>(device)) g_streams.resize(device + 1);
  D2HStream& s = g_streams[device];
  if (!s.stream) {
    int least = 0, greatest = 0;
    C10_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    C10_CUDA_CHECK(cudaStreamCreateWithPriority(&s.stream, cudaStreamNonBlocking, least));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&s.ready, cudaEventDisableTiming));
  }
  return s;
}

int64_t copy_d2h_chunked(at::Tensor dst, const at::Tensor& src, int64_t chunk_bytes) {
  TORCH_CHECK(src.is_cuda(), "gemini_dcp::copy_d2h_chunked: src must be a CUDA tensor, got ", src.device());
  TORCH_CHECK(dst.device().is_cpu(), "gemini_dcp::copy_d2h_chunked: dst must be a CPU tensor, got ", dst.device());
  TORCH_CHECK(src.is_contiguous() && dst.is_contiguous(), "gemini_dcp::copy_d2h_chunked: tensors must be contiguous");
  TORCH_CHECK(src.nbytes() == dst.nbytes(), "gemini_dcp::copy_d2h_chunked: size mismatch, dst has ", dst.nbytes(),
              " bytes, src ", src.nbytes());
  TORCH_CHECK(chunk_bytes > 0, "gemini_dcp::copy_d2h_chunked: chunk_bytes must be > 0, got ", chunk_bytes);
  const c10::DeviceIndex dev = src.device().index();
  c10::cuda::CUDAGuard guard(dev);
  D2HStream& s = d2h_stream(dev);
  {
    // Order after whatever the caller's current stream has queued (the producer of src).
    std::lock_guard<std::mutex> lk(g_stream_mu);
    C10_CUDA_CHECK(cudaEventRecord(s.ready, c10::cuda::getCurrentCUDAStream(dev).stream()));
    C10_CUDA_CHECK(cudaStreamWaitEvent(s.stream, s.ready, 0));
  }
  const size_t n = src.nbytes();
  auto* d = static_cast<uint8_t*>(dst.data_ptr());
  const auto* p = static_cast<const uint8_t*>(src.data_ptr());
  const size_t chunk = static_cast<size_t>(chunk_bytes);
  for (size_t off = 0; off < n; off += chunk) {
    const size_t len = std::min(chunk, n - off);
    C10_CUDA_CHECK(cudaMemcpyAsync(d + off, p + off, len, cudaMemcpyDeviceToHost, s.stream));
  }
  if (n) {
    // Keep src's block from being reused by the caching allocator before the copy ends.
    c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(),
                                                  c10::cuda::getStreamFromExternal(s.stream, dev));
  }
  return static_cast<int64_t>(reinterpret_cast<uintptr_t>(s.stream));
}

// ------------------------------------------------------------------ xsum64 kernel

constexpr uint64_t kXsumK = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kXsumSeed = 0x6A09E667F3BCC909ull;

__host__ __device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z ^= z >> 30;
  z *= 0xBF58476D1CE4E5B9ull;
  z ^= z >> 27;
  z *= 0x94D049BB133111EBull;
  z ^= z >> 31;
  return z;
}

__device__ __forceinline__ uint64_t word_at(const uint8_t* p, uint64_t i, uint64_t n, bool aligned) {
  const uint64_t base = i * 8;
  if (aligned && base + 8 <= n) return __ldg(reinterpret_cast<const unsigned long long*>(p) + i);
  uint64_t v = 0;
  for (uint64_t j = 0; j < 8 && base + j < n; ++j) v |= uint64_t(__ldg(p + base + j)) << (8 * j);
  return v;
}

constexpr int kThreads = 256;

// Non-finite values (exponent bits all ones) of one 64-bit word read as elements of `KIND`
// (1 float32, 2 float64, 3 float16, 4 bfloat16, as gemini_dcp.health.count.KINDS; 0 counts nothing).
// A zero-padded last word adds zeros, which are finite.
template <int KIND>
__device__ __forceinline__ uint64_t nonfinite_in(uint64_t w) {
  if constexpr (KIND == 1) {
    return uint64_t((w & 0x7F800000ull) == 0x7F800000ull) + uint64_t(((w >> 32) & 0x7F800000ull) == 0x7F800000ull);
  } else if constexpr (KIND == 2) {
    return uint64_t((w & 0x7FF0000000000000ull) == 0x7FF0000000000000ull);
  } else if constexpr (KIND == 3 || KIND == 4) {
    constexpr uint64_t m = KIND == 3 ? 0x7C00ull : 0x7F80ull;
    uint64_t c = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) c += uint64_t(((w >> (16 * j)) & m) == m);
    return c;
  } else {
    return 0;
  }
}

__device__ __forceinline__ uint64_t warp_sum(uint64_t v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

// out[0] += S (the xsum64 sum before its final mix), out[1] += the non-finite values of KIND (KIND > 0).
template <int KIND>
__global__ void xsum64_kernel(const uint8_t* __restrict__ p, uint64_t n, bool aligned,
                              unsigned long long* __restrict__ out) {
  const uint64_t words = (n + 7) / 8;
  const uint64_t stride = uint64_t(gridDim.x) * blockDim.x;
  uint64_t acc = 0, bad = 0;
  uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  // Two words per step when 16-byte loads are possible.
  if (aligned && (reinterpret_cast<uintptr_t>(p) & 15) == 0) {
    const uint64_t pairs = n / 16;
    const auto* q = reinterpret_cast<const ulonglong2*>(p);
    for (uint64_t k = i; k < pairs; k += stride) {
      const ulonglong2 v = __ldg(q + k);
      acc += mix64(v.x ^ ((2 * k + 1) * kXsumK));
      acc += mix64(v.y ^ ((2 * k + 2) * kXsumK));
      if constexpr (KIND != 0) bad += nonfinite_in<KIND>(v.x) + nonfinite_in<KIND>(v.y);
    }
    for (uint64_t w = 2 * pairs + i; w < words; w += stride) {
      const uint64_t v = word_at(p, w, n, aligned);
      acc += mix64(v ^ ((w + 1) * kXsumK));
      if constexpr (KIND != 0) bad += nonfinite_in<KIND>(v);
    }
  } else {
    for (uint64_t w = i; w < words; w += stride) {
      const uint64_t v = word_at(p, w, n, aligned);
      acc += mix64(v ^ ((w + 1) * kXsumK));
      if constexpr (KIND != 0) bad += nonfinite_in<KIND>(v);
    }
  }
  acc = warp_sum(acc);
  if constexpr (KIND != 0) bad = warp_sum(bad);
  __shared__ uint64_t warp_sums[kThreads / 32];
  __shared__ uint64_t warp_bad[kThreads / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    warp_sums[warp] = acc;
    warp_bad[warp] = bad;
  }
  __syncthreads();
  if (warp == 0) {
    acc = warp_sum(lane < (kThreads / 32) ? warp_sums[lane] : 0);
    if constexpr (KIND != 0) bad = warp_sum(lane < (kThreads / 32) ? warp_bad[lane] : 0);
    if (lane == 0) {
      atomicAdd(out, static_cast<unsigned long long>(acc));
      if constexpr (KIND != 0) atomicAdd(out + 1, static_cast<unsigned long long>(bad));
    }
  }
}

// Queue the kernel over t's bytes on the current stream, adding into out[0] (and out[1]).
void launch_xsum64(const at::Tensor& t, int64_t kind, unsigned long long* out) {
  const uint64_t n = t.nbytes();
  const auto* p = static_cast<const uint8_t*>(t.data_ptr());
  const bool aligned = (reinterpret_cast<uintptr_t>(p) & 7) == 0;
  const uint64_t words = (n + 7) / 8;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, t.device().index()));
  const uint64_t want = (words + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(std::max<uint64_t>(1, std::min<uint64_t>(want, uint64_t(sms) * 8)));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
  switch (kind) {
    case 0: xsum64_kernel<0><<<blocks, kThreads, 0, stream>>>(p, n, aligned, out); break;
    case 1: xsum64_kernel<1><<<blocks, kThreads, 0, stream>>>(p, n, aligned, out); break;
    case 2: xsum64_kernel<2><<<blocks, kThreads, 0, stream>>>(p, n, aligned, out); break;
    case 3: xsum64_kernel<3><<<blocks, kThreads, 0, stream>>>(p, n, aligned, out); break;
    case 4: xsum64_kernel<4><<<blocks, kThreads, 0, stream>>>(p, n, aligned, out); break;
    default: TORCH_CHECK(false, "gemini_dcp::xsum64: kind must be 0..4, got ", kind);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t xsum64_cuda(const at::Tensor& t) {
  TORCH_CHECK(t.is_cuda(), "gemini_dcp::xsum64: expected a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "gemini_dcp::xsum64: tensor must be contiguous");
  const uint64_t n = t.nbytes();
  if (n == 0) return static_cast<int64_t>(mix64(0 ^ n ^ kXsumSeed));
  c10::cuda::CUDAGuard guard(t.device());
  auto acc = at::zeros({1}, t.options().dtype(at::kLong));
  launch_xsum64(t, 0, reinterpret_cast<unsigned long long*>(acc.data_ptr<int64_t>()));
  const uint64_t s = static_cast<uint64_t>(acc.item<int64_t>());
  return static_cast<int64_t>(mix64(s ^ n ^ kXsumSeed));
}

// No synchronization: acc[index][0] += S of t's bytes, acc[index][1] += its non-finite values of
// `kind`; the caller reads acc back once for many tensors and finishes each S (xsum64_finish).
void xsum64_accumulate(const at::Tensor& t, at::Tensor acc, int64_t index, int64_t kind) {
  TORCH_CHECK(t.is_cuda(), "gemini_dcp::xsum64_accumulate: expected a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), "gemini_dcp::xsum64_accumulate: tensor must be contiguous");
  TORCH_CHECK(acc.is_cuda() && acc.device() == t.device(), "gemini_dcp::xsum64_accumulate: acc must be on ", t.device());
  TORCH_CHECK(acc.scalar_type() == at::kLong && acc.is_contiguous() && acc.dim() == 2 && acc.size(1) == 2,
              "gemini_dcp::xsum64_accumulate: acc must be a contiguous int64 tensor of shape [k, 2]");
  TORCH_CHECK(index >= 0 && index < acc.size(0), "gemini_dcp::xsum64_accumulate: index ", index, " outside acc's ",
              acc.size(0), " rows");
  TORCH_CHECK(kind >= 0 && kind <= 4, "gemini_dcp::xsum64_accumulate: kind must be 0..4, got ", kind);
  if (t.nbytes() == 0) return;
  c10::cuda::CUDAGuard guard(t.device());
  launch_xsum64(t, kind, reinterpret_cast<unsigned long long*>(acc.data_ptr<int64_t>() + 2 * index));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gemini_dcp, m) {
  m.def("host_register(Tensor t) -> ()");
  m.def("host_unregister(Tensor t) -> ()");
  m.def("host_registered_bytes() -> int", &host_registered_bytes);
  m.def("copy_d2h_chunked(Tensor(a!) dst, Tensor src, int chunk_bytes) -> int");
  m.def("xsum64_accumulate(Tensor t, Tensor(a!) acc, int index, int kind) -> ()");
  m.def("cuda_build_info() -> str",
        [] { return std::string("cuda_ops=host_register,copy_d2h_chunked,xsum64,xsum64_accumulate"); });
}

TORCH_LIBRARY_IMPL(gemini_dcp, CPU, m) {
  m.impl("host_register", &host_register);
  m.impl("host_unregister", &host_unregister);
}

TORCH_LIBRARY_IMPL(gemini_dcp, CUDA, m) {
  m.impl("copy_d2h_chunked", &copy_d2h_chunked);
  m.impl("xsum64", &xsum64_cuda);
  m.impl("xsum64_accumulate", &xsum64_accumulate);
}

}  // namespace gemini_dcp
