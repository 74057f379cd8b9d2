// The Python bindings of the quantised products (quant.cpp), the decode attention step
// (decode.cpp), the paged attention (paged.cpp) and the quantised Llama steps (step.cpp), for
// module.cpp (and a build of quant.cpp alone). Only the translation unit that makes the module
// includes pybind11 and torch's Tensor casters: the kernels' own files include ATen alone, which
// compiles in a third of the time <torch/extension.h> takes.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include "fused.h"

namespace attnkit_fused {

inline void bind_quant(pybind11::module_& m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("dequantize", &dequantize, no_gil, pybind11::arg("w"), pybind11::arg("kind"),
        pybind11::arg("k"),
        "rows of GGUF blocks (uint8 (n, row_bytes)) to float32 (n, k), as gguf.quants.dequantize");
  m.def("qmatmul", &qmatmul, no_gil, pybind11::arg("x"), pybind11::arg("w"),
        pybind11::arg("kind"), pybind11::arg("out"),
        "out (m, n) = x (m, k) @ dequantize(w)^T, float32 accumulation, W kept in its blocks");
  m.def("embedding", &embedding, no_gil, pybind11::arg("ids"), pybind11::arg("w"),
        pybind11::arg("kind"), pybind11::arg("k"),
        "rows ids of dequantize(w): float32 (len(ids), k)");
  m.def("interleave", &interleave, no_gil, pybind11::arg("w"), pybind11::arg("kind"),
        "Q4_0, Q4_1 or Q8_0 rows (uint8 (n, row_bytes), n a multiple of 8) interleaved by 8: "
        "the same bytes rearranged, for kind 256 + kind in dequantize, qmatmul and the steps");
  m.def("interleaves", &interleaves,
        "whether this build's decoding step multiplies rows interleaved by 8 faster (AVX2)");
}

inline void bind_decode(pybind11::module_& m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("decode", &decode, no_gil, "one decoding step over a KV cache (writes out)",
        pybind11::arg("q"), pybind11::arg("key"), pybind11::arg("value"), pybind11::arg("length"),
        pybind11::arg("scale"), pybind11::arg("key_mask"), pybind11::arg("out"));
}

inline void bind_paged(pybind11::module_& m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged", &paged, no_gil,
        "attention over a paged KV cache through block tables (writes out)", pybind11::arg("q"),
        pybind11::arg("key_pool"), pybind11::arg("value_pool"), pybind11::arg("block_tables"),
        pybind11::arg("lengths"), pybind11::arg("starts"), pybind11::arg("scale"),
        pybind11::arg("out"));
}

inline void bind_step(pybind11::module_& m) {
  const auto no_gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("llama_step", &llama_step, no_gil, pybind11::arg("ids"), pybind11::arg("positions"),
        pybind11::arg("embed"), pybind11::arg("embed_kind"), pybind11::arg("weights"),
        pybind11::arg("kinds"), pybind11::arg("parts"), pybind11::arg("norms"),
        pybind11::arg("keys"), pybind11::arg("values"), pybind11::arg("cos"),
        pybind11::arg("sin"), pybind11::arg("key_mask"), pybind11::arg("sizes"),
        pybind11::arg("numbers"), pybind11::arg("logits"),
        "one decoding step of a quantised Llama decoder (writes the caches at length, logits)");
  m.def("step_rows", &step_rows,
        "rows up to which a step's products take the row kernels (the same bits for any "
        "number of rows; more take the tile path, whose sums round otherwise)");
  m.def("llama_paged_step", &llama_paged_step, no_gil, pybind11::arg("ids"),
        pybind11::arg("positions"), pybind11::arg("slots"), pybind11::arg("block_tables"),
        pybind11::arg("lengths"), pybind11::arg("starts"), pybind11::arg("out_rows"),
        pybind11::arg("embed"), pybind11::arg("embed_kind"), pybind11::arg("weights"),
        pybind11::arg("kinds"), pybind11::arg("parts"), pybind11::arg("norms"),
        pybind11::arg("key_pools"), pybind11::arg("value_pools"), pybind11::arg("cos"),
        pybind11::arg("sin"), pybind11::arg("sizes"), pybind11::arg("numbers"),
        pybind11::arg("logits"),
        "one forward step of a quantised Llama decoder over a paged KV cache (writes the pools "
        "at slots, logits of out_rows)");
}

}  // namespace attnkit_fused
