// Matrix products with weights kept in GGUF's quantised block formats (see attnkit.quant).
#include <torch/extension.h>

namespace attnkit_fused {

void bind_quant(pybind11::module_& m) {}

}  // namespace attnkit_fused
