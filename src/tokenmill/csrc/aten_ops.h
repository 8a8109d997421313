// The ATen subset the native kernels use (tensors, the parallel loop, the few ops they call). Parse cost
// of a one-line unit on a 2-core build machine (another job running): <torch/extension.h> (pybind11 and the
// whole C++ frontend) 31 s, <ATen/ATen.h> (every op) 8 s, <ATen/core/Tensor.h> 3 s. Only cpu_kernels.cpp,
// which binds the module to Python, includes <torch/extension.h>; at::Tensor is the type torch::Tensor names
// there.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/tensor.h>
