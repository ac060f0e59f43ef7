#include "nn/module.h"

#include <algorithm>
#include <ostream>

#include "autograd/grad_mode.h"
#include "core/error.h"

namespace tandem::nn {

namespace {

// Moves t to d keeping the TensorImpl (and so the handle's identity, its requires_grad flag,
// its hooks and every other handle to it): only storage, strides and offset change.
void move_in_place(const Tensor& t, Device d) {
  if (t.device() == d) return;
  Tensor moved = t.contiguous(suggest_memory_format(t)).to(d);  // dense, in its memory format
  TensorImpl* impl = t.impl();
  impl->storage = moved.storage();
  impl->strides = moved.strides();
  impl->offset = moved.offset();
  Tensor g = t.grad();
  if (g.defined()) t.set_grad(g.to(d));
}

// Lays t out in `format` keeping its TensorImpl, as move_in_place. A channels-last tensor gets
// exactly the channels-last strides (strides_for), even where size-1 dims would let the
// contiguous ones address the same memory: suggest_memory_format, and so the ops, read them.
void reformat_in_place(const Tensor& t, MemoryFormat format) {
  if (t.dim() != 4) return;
  const Tensor laid = restrided(t.detach(), format);
  if (laid.storage() == t.storage()) return;  // already laid out so
  TensorImpl* impl = t.impl();
  impl->storage = laid.storage();
  impl->strides = laid.strides();
  impl->offset = laid.offset();
  if (t.grad().defined()) t.set_grad(Tensor());
}

// A fresh leaf holding a copy of t's values.
Tensor deep_copy(const Tensor& t) {
  Tensor c = t.clone();
  if (t.requires_grad()) c.set_requires_grad(true);
  return c;
}

std::string join(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

}  // namespace

Module::Module(const Module& other) : training_(other.training_), device_(other.device_) {
  for (const auto& [name, p] : other.parameters_) parameters_.insert(name, deep_copy(p));
  for (const auto& [name, b] : other.buffers_) buffers_.insert(name, deep_copy(b));
  for (const auto& [name, c] : other.children_) children_.insert(name, c->clone());
}

// ---- forward ----------------------------------------------------------------------------

Tensor Module::forward(const Tensor& x) {
  check_forward_input(x);
  return forward_impl(x);
}

void Module::check_forward_input(const Tensor& x) const {
  TANDEM_CHECK(x.defined(), Value, name(), ": forward got an undefined input tensor");
  if (device_) {
    TANDEM_CHECK(x.device() == *device_, Device, name(), ": input is on ", x.device().str(),
                 " but the module is on ", device_->str(),
                 " (move the input, or the module with to())");
  }
}

// ---- registration -------------------------------------------------------------------------

void Module::check_new_name(const std::string& name, const char* what) const {
  TANDEM_CHECK(!name.empty(), Value, this->name(), ": empty ", what, " name");
  TANDEM_CHECK(name.find('.') == std::string::npos, Value, this->name(), ": ", what, " name '",
               name, "' contains '.'");
  TANDEM_CHECK(!parameters_.contains(name) && !buffers_.contains(name) && !children_.contains(name),
               Value, this->name(), ": ", what, " name '", name, "' is already registered");
}

void Module::adopt_device(Device d, const std::string& what) {
  if (!device_) {
    device_ = d;
    return;
  }
  TANDEM_CHECK(*device_ == d, Device, name(), ": ", what, " is on ", d.str(),
               " but the module is on ", device_->str());
}

Tensor Module::register_parameter(const std::string& name, Tensor t, bool requires_grad) {
  check_new_name(name, "parameter");
  TANDEM_CHECK(t.defined(), Value, this->name(), ": parameter '", name, "' is undefined");
  TANDEM_CHECK(is_floating(t.dtype()), DType, this->name(), ": parameter '", name, "' is ",
               dtype_name(t.dtype()), ", parameters must be floating");
  TANDEM_CHECK(t.is_leaf(), Value, this->name(), ": parameter '", name,
               "' is the result of an operation; register a leaf (detach() it)");
  adopt_device(t.device(), "parameter '" + name + "'");
  t.set_requires_grad(requires_grad);
  return parameters_.insert(name, std::move(t));
}

Tensor Module::register_buffer(const std::string& name, Tensor t) {
  check_new_name(name, "buffer");
  TANDEM_CHECK(t.defined(), Value, this->name(), ": buffer '", name, "' is undefined");
  adopt_device(t.device(), "buffer '" + name + "'");
  return buffers_.insert(name, std::move(t));
}

void Module::add_child(const std::string& name, std::shared_ptr<Module> m) {
  check_new_name(name, "module");
  TANDEM_CHECK(m != nullptr, Value, this->name(), ": module '", name, "' is null");
  TANDEM_CHECK(m.get() != this, Value, this->name(), ": a module cannot be its own child");
  if (m->device_) adopt_device(*m->device_, "module '" + name + "'");
  children_.insert(name, std::move(m));
}

void Module::replace_child(const std::string& name, std::shared_ptr<Module> m) {
  TANDEM_CHECK(children_.contains(name), Value, this->name(), ": no child module '", name, "' to replace");
  TANDEM_CHECK(m != nullptr, Value, this->name(), ": module '", name, "' is null");
  TANDEM_CHECK(m.get() != this, Value, this->name(), ": a module cannot be its own child");
  if (m->device_) adopt_device(*m->device_, "module '" + name + "'");
  children_.at(name) = std::move(m);
}

// ---- access -------------------------------------------------------------------------------

void Module::collect(const std::string& prefix, bool params, bool recurse, StateDict& out,
                     std::vector<const TensorImpl*>* seen) const {
  for (const auto& [name, t] : params ? parameters_ : buffers_) {
    if (seen) {
      if (std::find(seen->begin(), seen->end(), t.impl()) != seen->end()) continue;
      seen->push_back(t.impl());
    }
    out.insert(join(prefix, name), t);
  }
  if (!recurse) return;
  for (const auto& [name, c] : children_) c->collect(join(prefix, name), params, true, out, seen);
}

StateDict Module::named_parameters(bool recurse) const {
  StateDict out;
  std::vector<const TensorImpl*> seen;
  collect("", true, recurse, out, &seen);
  return out;
}

StateDict Module::named_buffers(bool recurse) const {
  StateDict out;
  std::vector<const TensorImpl*> seen;
  collect("", false, recurse, out, &seen);
  return out;
}

std::vector<Tensor> Module::parameters(bool recurse) const {
  return named_parameters(recurse).values();
}

std::vector<Tensor> Module::buffers(bool recurse) const {
  return named_buffers(recurse).values();
}

std::vector<std::shared_ptr<Module>> Module::children() const {
  return children_.values();
}

void Module::apply(const std::function<void(Module&)>& fn) {
  for (auto& [name, c] : children_) c->apply(fn);
  fn(*this);
}

const Tensor& Module::parameter(const std::string& name) const {
  const Tensor* t = parameters_.find(name);
  TANDEM_CHECK(t != nullptr, Value, this->name(), ": no parameter '", name, "'");
  return *t;
}

const Tensor& Module::buffer(const std::string& name) const {
  const Tensor* t = buffers_.find(name);
  TANDEM_CHECK(t != nullptr, Value, this->name(), ": no buffer '", name, "'");
  return *t;
}

Tensor Module::find_parameter(const std::string& name) const {
  const Tensor* t = parameters_.find(name);
  return t ? *t : Tensor();
}

std::shared_ptr<Module> Module::child(const std::string& name) const {
  const auto* c = children_.find(name);
  TANDEM_CHECK(c != nullptr, Value, this->name(), ": no child module '", name, "'");
  return *c;
}

int64_t Module::num_parameters() const {
  int64_t n = 0;
  for (const auto& p : parameters()) n += p.numel();
  return n;
}

// ---- mode and device ------------------------------------------------------------------------

void Module::train(bool on) {
  training_ = on;
  for (auto& [name, c] : children_) c->train(on);
}

Module& Module::to(Device d) {
  check_device_exists(d);
  for (auto& [name, p] : parameters_) move_in_place(p, d);
  for (auto& [name, b] : buffers_) move_in_place(b, d);
  device_ = d;
  for (auto& [name, c] : children_) c->to(d);
  return *this;
}

Module& Module::to(MemoryFormat format) {
  NoGradGuard no_grad;
  for (auto& [name, p] : parameters_) reformat_in_place(p, format);
  for (auto& [name, b] : buffers_) reformat_in_place(b, format);
  for (auto& [name, c] : children_) c->to(format);
  return *this;
}

void Module::zero_grad(bool set_to_none) {
  for (const auto& p : parameters()) {
    Tensor g = p.grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      p.set_grad(Tensor());
    } else {
      g.zero_();
    }
  }
}

// ---- serialization --------------------------------------------------------------------------

namespace {
// PyTorch's order: per module, its parameters then its buffers, then its children.
void state_into(const Module& m, const std::string& prefix, StateDict& out) {
  for (const auto& [name, p] : m.named_parameters(false))
    out.insert(join(prefix, name), p.detach());
  for (const auto& [name, b] : m.named_buffers(false)) out.insert(join(prefix, name), b.detach());
  for (const auto& [name, c] : m.named_children()) state_into(*c, join(prefix, name), out);
}
}  // namespace

StateDict Module::state_dict() const {
  StateDict out;
  state_into(*this, "", out);
  return out;
}

void Module::load_state_dict(const StateDict& state, bool strict) {
  // Own tensors under every name (as state_dict() lists them), not detached: copy_ writes
  // through to the registered storage.
  StateDict own;
  collect("", true, true, own, nullptr);
  collect("", false, true, own, nullptr);
  for (const auto& [key, t] : own) {
    const Tensor* src = state.find(key);
    TANDEM_CHECK(src != nullptr && src->defined(), Value, name(),
                 ": load_state_dict: missing key '", key, "'");
    TANDEM_CHECK(src->shape() == t.shape(), Shape, name(), ": load_state_dict: key '", key,
                 "' has shape ", shape_str(src->shape()), " but the module expects ",
                 shape_str(t.shape()));
  }
  if (strict) {
    for (const auto& [key, t] : state) {
      TANDEM_CHECK(own.contains(key), Value, name(), ": load_state_dict: unexpected key '", key,
                   "'");
    }
  }
  NoGradGuard no_grad;
  for (const auto& [key, t] : own) t.copy_(state.at(key));
}

// ---- printing ----------------------------------------------------------------------------------

void Module::str_into(std::string& out, int indent) const {
  out += name() + "(" + extra_repr();
  if (children_.empty()) {
    out += ")";
    return;
  }
  out += "\n";
  for (const auto& [name, c] : children_) {
    out += std::string(indent + 2, ' ') + "(" + name + "): ";
    c->str_into(out, indent + 2);
    out += "\n";
  }
  out += std::string(indent, ' ') + ")";
}

std::string Module::str() const {
  std::string out;
  str_into(out, 0);
  return out;
}

std::ostream& operator<<(std::ostream& out, const Module& m) { return out << m.str(); }

void throw_empty_module_holder() {
  TANDEM_THROW(Value, "empty module holder: it was made from nullptr and no module was assigned "
                      "to it since");
}

}  // namespace tandem::nn
