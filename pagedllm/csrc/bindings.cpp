// The Python module (its name, TORCH_EXTENSION_NAME, is given by the build: csrc/build.py).
// wrap_pybind_function_no_gil turns a failed TORCH_CHECK into the Python exception torch raises
// and releases the GIL while the kernel runs (as torch's own ops do; the kernels touch no Python
// object): the threads beside a step, the KV connector's pulls and its KV server, run during it
// instead of waiting for its end (a decode step in decode_layers is tens of milliseconds). Only
// this file includes torch/extension.h (pybind11, Python.h, the C++ frontend): the kernels'
// files need torch/types.h alone, which compiles in a fraction of the time.
#include <torch/extension.h>

#include "decode_step.h"
#include "ops.h"

// The ISA level the compiler's flags enabled in this build (csrc/build.py VARIANTS): the tests
// check each variant is what its name says.
static const char* compiled_isa() {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BF16__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return "avx2";
#else
  return "native";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // k_scale / v_scale: only with an int8 / fp8 cache (None otherwise, the default)
  m.def("paged_decode", torch::wrap_pybind_function_no_gil(paged_decode), "paged_decode", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("seq_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("window"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none());
  m.def("paged_prefill", torch::wrap_pybind_function_no_gil(paged_prefill), "paged_prefill");
  m.def("linear_small", torch::wrap_pybind_function_no_gil(linear_small), "linear_small");
  m.def("bf16_pair_pack", torch::wrap_pybind_function_no_gil(bf16_pair_pack), "bf16_pair_pack");
  m.def("bf16_pair_linear", torch::wrap_pybind_function_no_gil(bf16_pair_linear), "bf16_pair_linear");
  m.def("bf16_pair_rows", torch::wrap_pybind_function_no_gil(bf16_pair_rows), "bf16_pair_rows");
  m.def("rms_norm", torch::wrap_pybind_function_no_gil(rms_norm), "rms_norm");
  m.def("silu_and_mul", torch::wrap_pybind_function_no_gil(silu_and_mul), "silu_and_mul");
  m.def("rotary_embedding_", torch::wrap_pybind_function_no_gil(rotary_embedding_), "rotary_embedding_");
  m.def("quant_linear", torch::wrap_pybind_function_no_gil(quant_linear), "quant_linear");
  m.def("quant_dequantize", torch::wrap_pybind_function_no_gil(quant_dequantize), "quant_dequantize");
  m.def("quant_activations", torch::wrap_pybind_function_no_gil(quant_activations), "quant_activations");
  m.def("gguf_linear", torch::wrap_pybind_function_no_gil(gguf_linear), "gguf_linear");
  m.def("gguf_dequantize_rows", torch::wrap_pybind_function_no_gil(gguf_dequantize_rows),
        "gguf_dequantize_rows");
  m.def("argmax_rows", torch::wrap_pybind_function_no_gil(argmax_rows), "argmax_rows");
  m.def("compiled_isa", compiled_isa, "compiled_isa");
  m.def("decode_layers", torch::wrap_pybind_function_no_gil(decode_layers), "decode_layers");
  m.def("gguf_decode_step_applies", &gguf_decode_step_applies, "gguf_decode_step_applies");
}
