// The Python bindings of the fused kernel (see __init__.py for the operands' layouts).
#include "bindings.h"
#include "fused.h"

namespace attnkit_fused {

// Whether the bfloat16 matmul with a packed B operand runs here and is right: a 32 x 32 x 32
// product against a float reference. Where it is not (no oneDNN micro-kernel for this CPU),
// bfloat16 inputs are computed in float32 instead.
bool bfloat16_packed_ok() {
  constexpr int64_t n = 32;
  std::vector<at::BFloat16> a(n * n), packed(n * n);
  std::vector<float> c(n * n), want(n * n, 0.0f), bf(n * n);
  for (int64_t x = 0; x < n * n; x++) {
    a[x] = at::BFloat16(static_cast<float>((x * 7) % 11) - 5.0f);
    bf[x] = static_cast<float>((x * 5) % 13) - 6.0f;
  }
  for (int64_t r = 0; r < n; r += 2) {
    for (int64_t col = 0; col < n; col++) {
      packed[r * n + 2 * col] = at::BFloat16(bf[r * n + col]);
      packed[r * n + 2 * col + 1] = at::BFloat16(bf[(r + 1) * n + col]);
    }
  }
  for (int64_t r = 0; r < n; r++)
    for (int64_t x = 0; x < n; x++)
      for (int64_t col = 0; col < n; col++)
        want[r * n + col] += static_cast<float>(a[r * n + x]) * bf[x * n + col];
  try {
    matmul(n, n, n, a.data(), n, packed.data(), n, c.data(), n, false);
  } catch (const std::exception&) {
    return false;
  }
  for (int64_t x = 0; x < n * n; x++) {
    if (c[x] != want[x]) return false;  // small integers: exact in float
  }
  return true;
}

}  // namespace attnkit_fused

// Every entry point that computes releases the GIL while it runs (``no_gil``; their arguments
// are converted before, with it): other Python threads, such as a server's event loop sending
// the tokens of the step before, run during a step instead of waiting for it to end.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("forward", &attnkit_fused::forward, no_gil, "fused attention forward (writes out, lse)");
  m.def("backward", &attnkit_fused::backward, no_gil,
        "fused attention backward (writes dq^T, dk, dv)");
  m.def("threads_used", &attnkit_fused::threads_used,
        "how many intra-op threads ran part of the latest forward or backward");
  m.def("openmp", []() {
#ifdef _OPENMP
    return true;
#else
    return false;
#endif
  }, "whether the kernel was compiled with OpenMP (at::parallel_for runs in parallel)");
  m.def("bfloat16_packed_ok", &attnkit_fused::bfloat16_packed_ok,
        "whether bfloat16 tiles can use the packed matmul on this CPU");
  attnkit_fused::bind_quant(m);
  attnkit_fused::bind_decode(m);
  attnkit_fused::bind_paged(m);
  attnkit_fused::bind_step(m);
}
