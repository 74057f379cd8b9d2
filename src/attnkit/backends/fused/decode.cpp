// One decoding step of attention over a KV cache (see attnkit.backends.fused.decode).
#include <torch/extension.h>

namespace attnkit_fused {

void bind_decode(pybind11::module_& m) {}

}  // namespace attnkit_fused
