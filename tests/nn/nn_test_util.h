#pragma once
// Small utilities shared by the nn tests.
#include <string>
#include <vector>

#include <memory>

#include "autograd/ops.h"
#include "catch.h"
#include "helpers.h"
#include "core/generator.h"
#include "core/tensor.h"
#include "nn/module.h"

namespace tandem::test {

// A process-wide on/off setting (kernels/backend.h: set_fuse_bn_relu and fuse_bn_relu, ...),
// restored at the end of a scope.
struct SettingRestore {
  SettingRestore(void (*set)(bool), bool (*get)()) : set(set), prev(get()) {}
  ~SettingRestore() { set(prev); }
  void (*set)(bool);
  bool prev;
};

// How many of `v` are exactly zero (that a fused ReLU did something: some outputs zero, some not).
inline size_t zeros_in(const std::vector<double>& v) {
  size_t n = 0;
  for (double x : v) n += x == 0.0;
  return n;
}

// A training step of `model` with a fusion setting on against one of its clone with it off, on
// device d and in `format`: the same output, parameter gradients and buffers (running
// statistics), bit for bit. The setting is restored.
inline void check_fusion_changes_nothing(const std::shared_ptr<nn::Module>& model, const Tensor& x_cpu,
                                         Device d, void (*set)(bool), bool (*get)(),
                                         MemoryFormat format = MemoryFormat::Contiguous) {
  SettingRestore restore(set, get);
  const std::shared_ptr<nn::Module> plain = model->clone();
  model->to(d).to(format);
  plain->to(d).to(format);
  const Tensor x = x_cpu.to(d).contiguous(format);
  set(true);
  const Tensor y1 = (*model)(x);
  sum(y1).backward();
  set(false);
  const Tensor y0 = (*plain)(x);
  sum(y0).backward();
  REQUIRE(values(y1) == values(y0));
  const auto p1 = model->named_parameters(), p0 = plain->named_parameters();
  REQUIRE(p1.size() == p0.size());
  for (size_t i = 0; i < p1.size(); ++i) {
    INFO(p1.item(i).first);
    CHECK(values(p1.item(i).second.grad()) == values(p0.item(i).second.grad()));
  }
  const auto b1 = model->named_buffers(), b0 = plain->named_buffers();
  for (size_t i = 0; i < b1.size(); ++i) {
    INFO(b1.item(i).first);
    CHECK(values(b1.item(i).second) == values(b0.item(i).second));
  }
}


// A float64 CPU tensor holding `values` (row-major).
inline Tensor f64(const std::vector<double>& values, const Shape& shape) {
  return from_vector<double>(values, shape);
}

// Three parameters ([2, 3], [4], [3]) back to back in one buffer -- a coalesced model, as
// parallel::coalesce leaves one -- their gradients likewise in grad_buffer, and separate
// copies of the parameters (plain_params) for the per-parameter path; on `device`.
struct TwoModels {
  std::vector<Tensor> flat_params, plain_params;
  Tensor grad_buffer;
  std::vector<Tensor> flat_grads;
};

inline TwoModels two_models(Device device = kCPU, DType dtype = kFloat64, Generator* gen = nullptr) {
  const std::vector<Shape> shapes{{2, 3}, {4}, {3}};
  TwoModels m;
  Tensor buffer = uniform({13}, -1.0, 1.0, dtype, kCPU, gen).to(device);
  m.grad_buffer = zeros({13}, dtype, device);
  int64_t offset = 0;
  for (const Shape& s : shapes) {
    const int64_t n = shape_numel(s);
    Tensor p = buffer.slice(0, offset, offset + n).view(s);
    p.set_requires_grad(true);
    m.flat_params.push_back(p);
    m.plain_params.push_back(p.detach().clone().set_requires_grad(true));
    m.flat_grads.push_back(m.grad_buffer.slice(0, offset, offset + n).view(s));
    offset += n;
  }
  return m;
}

// Fresh random gradients, the same for both models; skip_middle leaves the second parameter
// without one (which sends a step down the per-parameter path).
inline void set_grads(TwoModels& m, bool skip_middle = false, Generator* gen = nullptr) {
  m.grad_buffer.copy_(uniform({13}, -1.0, 1.0, m.grad_buffer.dtype(), kCPU, gen));
  for (size_t k = 0; k < m.flat_params.size(); ++k) {
    const bool skip = skip_middle && k == 1;
    m.flat_params[k].set_grad(skip ? Tensor() : m.flat_grads[k]);
    m.plain_params[k].set_grad(skip ? Tensor() : m.flat_grads[k].clone());
  }
}

}  // namespace tandem::test
