// Argument checks of the ops, shared by the CPU (csrc/cpu) and CUDA
// (csrc/cuda) entry points. Host-only; they run before any write, so a failing
// call leaves the state unchanged.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <optional>

namespace d9d {

// "d9d_kernels.<op>: argument '<arg>' <msg...>"; TypeError for dtypes, ValueError else.
#define D9D_CHECK_TYPE(cond, op, arg, ...) \
  TORCH_CHECK_TYPE(cond, "d9d_kernels.", op, ": argument '", arg, "' ", __VA_ARGS__)
#define D9D_CHECK(cond, op, arg, ...) \
  TORCH_CHECK_VALUE(cond, "d9d_kernels.", op, ": argument '", arg, "' ", __VA_ARGS__)

inline void check_device(const char* op, const char* arg, const at::Tensor& t, const at::Device& dev) {
  D9D_CHECK(t.device() == dev, op, arg, "must be on ", dev, " (the device of the first input), got ", t.device());
}

// A state tensor: float64, contiguous, exactly `shape`, on `dev`.
inline void check_state(const char* op, const char* arg, const at::Tensor& t, at::IntArrayRef shape,
                        const at::Device& dev) {
  D9D_CHECK_TYPE(t.scalar_type() == at::kDouble, op, arg, "must be float64 ", shape, ", got ", t.scalar_type());
  D9D_CHECK(t.sizes() == shape, op, arg, "must be float64 ", shape, ", got shape ", t.sizes());
  check_device(op, arg, t, dev);
  D9D_CHECK(t.is_contiguous(), op, arg, "must be contiguous (it is written in place)");
}

inline void check_floating(const char* op, const char* arg, const at::Tensor& t) {
  D9D_CHECK_TYPE(at::isFloatingType(t.scalar_type()), op, arg,
                 "must be float16/bfloat16/float32/float64, got ", t.scalar_type());
}

// A real-valued input: floating, integral or bool (counts, token numbers).
inline void check_real(const char* op, const char* arg, const at::Tensor& t) {
  D9D_CHECK_TYPE(at::isFloatingType(t.scalar_type()) || at::isIntegralType(t.scalar_type(), /*includeBool=*/true), op,
                 arg, "must be a floating, integer or bool tensor, got ", t.scalar_type());
}

// The dtype an op computes in for inputs of dtype `t`: integers and bools as float64, which holds
// them exactly (to 2^53); a float32 would round counts past 2^24.
inline at::ScalarType real_dtype(at::ScalarType t) { return at::isFloatingType(t) ? t : at::kDouble; }

inline void check_index(const char* op, const char* arg, const at::Tensor& t) {
  D9D_CHECK_TYPE(t.scalar_type() == at::kLong, op, arg, "must be int64, got ", t.scalar_type());
}

inline void check_mask(const char* op, const std::optional<at::Tensor>& mask, at::IntArrayRef shape,
                       const at::Device& dev) {
  if (!mask.has_value()) return;
  D9D_CHECK_TYPE(mask->scalar_type() == at::kBool, op, "mask", "must be bool, got ", mask->scalar_type());
  D9D_CHECK(mask->sizes() == shape, op, "mask", "must have shape ", shape, ", got ", mask->sizes());
  check_device(op, "mask", *mask, dev);
}

inline void check_input_kind(const char* op, int64_t input_kind) {
  D9D_CHECK(input_kind >= 0 && input_kind <= 2, op, "input_kind",
            "must be 0 (probs), 1 (logits) or 2 (auto), got ", input_kind);
}

}  // namespace d9d
