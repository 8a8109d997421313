// The ATen subset the native kernels use (tensors, the parallel loop, the few ops they call). Compile time:
// <torch/extension.h> (pybind11 and the whole C++ frontend) costs a translation unit about 20 s and
// <ATen/ATen.h> (every op) about 6; this header about 2. Only cpu_kernels.cpp, which binds the module to
// Python, includes <torch/extension.h>; at::Tensor is the type torch::Tensor names there.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/tensor.h>
