#pragma once
// Finite-difference gradient check in float64.
#include <functional>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tandem::autograd {

struct GradcheckResult {
  bool ok = true;
  double max_abs_error = 0.0;
  double max_rel_error = 0.0;
  std::string message;  // which input and element failed, analytic vs numeric
};

// fn maps the inputs to one output tensor (any shape). Every input that requires grad must be
// a float64 leaf; inputs that do not require grad are held fixed. Inputs may live on any
// device (they are perturbed through a host copy). fn runs 1 + 2 * (elements of the inputs that
// require grad) times. Compares the analytic gradient of sum(output * w) for a fixed random w
// with central differences of step eps. Passes when |a - n| <= atol + rtol * |n| for every element.
GradcheckResult gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& fn,
                          const std::vector<Tensor>& inputs, double eps = 1e-6, double atol = 1e-5,
                          double rtol = 1e-3);

}  // namespace tandem::autograd
