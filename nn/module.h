#pragma once
// Module: the base of every layer and model (PyTorch's nn.Module, in C++).
//
// A module owns named parameters (leaf tensors that require grad), named buffers (state that
// is saved and moved with the module but not trained, e.g. BatchNorm's running statistics)
// and named child modules. Everything is kept in insertion order, so parameters() lists
// parameters depth-first in registration order and names them like PyTorch
// ("features.0.weight").
//
// forward() is non-virtual: it checks the input (defined, on the module's device) and then
// calls the virtual forward_impl(), so every layer gets the same checks (Caffe's
// Layer::Forward / tiny-cuda-nn's object.h pattern).
//
// Note [registry is the source of truth]: a layer does not keep its own Tensor or
// shared_ptr<Module> members; it reads them back from the registry (weight() is
// parameter("weight"), Residual::conv1() is child<Conv2d>("conv1")). That makes the copy
// constructor below a correct deep copy for every module type without per-layer code:
// Cloneable<Derived>::clone() is make_shared<Derived>(*this), the base copy constructor
// gives the copy fresh parameter and buffer storage and clones every child, and the
// derived part only holds plain configuration (sizes, strides, eps).
//
// Device: a module's device is the device of its tensors. A module with no tensors anywhere
// (ReLU, Flatten) accepts input on any device until to() pins it. to(d) moves parameters and
// buffers *in place* (the same Tensor handles now point at storage on d), so parameters stay
// the same leaves, keep requires_grad and their gradient hooks, and an optimizer built
// earlier keeps working.
//
// Note [zero_grad sets to none]: zero_grad() makes gradients undefined by default, as
// PyTorch does now: the next backward writes fresh gradients instead of adding into zeros,
// which saves a fill per parameter, and optimizers skip parameters without a gradient.
// zero_grad(false) fills existing gradients with zeros instead, keeping their storage
// (what a captured CUDA graph needs, since its addresses must not change).
#include <concepts>
#include <cstddef>
#include <functional>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "nn/ordered_dict.h"

namespace tandem::nn {

// Name -> tensor, in order: parameters and buffers of a module tree.
using StateDict = OrderedDict<Tensor>;

class Module;
template <typename Impl>
class ModuleHolder;

// A ModuleHolder<Impl> or a class derived from one (nn::Sequential, a TANDEM_MODULE).
template <typename H>
concept module_holder = requires { typename std::remove_cvref_t<H>::ContainedType; } &&
                        std::is_base_of_v<ModuleHolder<typename std::remove_cvref_t<H>::ContainedType>,
                                          std::remove_cvref_t<H>>;
// A module object itself (nn::Linear(2, 3)), not a pointer or holder to one.
template <typename M>
concept module_value = std::is_base_of_v<Module, std::remove_cvref_t<M>>;

class Module {
 public:
  virtual ~Module() = default;
  Module& operator=(const Module&) = delete;

  // ---- forward ------------------------------------------------------------------------
  // Throws ValueError for an undefined input and DeviceError (naming both devices) for an
  // input that is not on the module's device, then runs forward_impl.
  Tensor forward(const Tensor& x);
  Tensor operator()(const Tensor& x) { return forward(x); }

  // ---- identity -----------------------------------------------------------------------
  // A deep copy: same structure, same values, new storage, same device and mode.
  virtual std::shared_ptr<Module> clone() const = 0;
  // The type name used in messages and str(): "Linear".
  virtual std::string name() const { return "Module"; }
  // The configuration shown by str(): "in_features=400, out_features=120, bias=true".
  virtual std::string extra_repr() const { return ""; }
  // A PyTorch-style printout of the module tree.
  std::string str() const;

  // ---- registration -------------------------------------------------------------------
  // Names are non-empty, contain no '.', and are unique across parameters, buffers and
  // children of one module (ValueError otherwise). A parameter must be a floating leaf on
  // the module's device (DeviceError otherwise); it is marked requires_grad.
  Tensor register_parameter(const std::string& name, Tensor t, bool requires_grad = true);
  Tensor register_buffer(const std::string& name, Tensor t);
  template <typename M>
  std::shared_ptr<M> register_module(const std::string& name, std::shared_ptr<M> m) {
    add_child(name, m);
    return m;
  }
  // Puts m in the place of the child `name` (libtorch's replace_module): same name, same
  // position in every listing. ValueError when there is no such child or m is null.
  template <typename M>
  std::shared_ptr<M> replace_module(const std::string& name, std::shared_ptr<M> m) {
    replace_child(name, m);
    return m;
  }
  // libtorch's register_module("fc", nn::Sequential(...)): registers the held module and
  // returns the holder (sharing it).
  template <module_holder H>
  std::remove_cvref_t<H> register_module(const std::string& name, H&& holder) {
    add_child(name, holder.ptr());
    return std::forward<H>(holder);
  }
  // register_module("fc", nn::Linear(2, 3)): the temporary moved into a new shared module.
  template <module_value M>
  std::shared_ptr<std::remove_cvref_t<M>> register_module(const std::string& name, M&& m) {
    static_assert(!std::is_lvalue_reference_v<M>,
                  "register_module: pass a temporary module (nn::Linear(2, 3)) or a shared_ptr; "
                  "a named module object would be copied, and the copy registered");
    auto p = std::make_shared<std::remove_cvref_t<M>>(std::move(m));
    add_child(name, p);
    return p;
  }

  // ---- access -------------------------------------------------------------------------
  // Depth-first, registration order: this module's own entries, then each child's.
  // A tensor registered in two places is listed once (the first time it is met).
  std::vector<Tensor> parameters(bool recurse = true) const;
  StateDict named_parameters(bool recurse = true) const;
  std::vector<Tensor> buffers(bool recurse = true) const;
  StateDict named_buffers(bool recurse = true) const;
  std::vector<std::shared_ptr<Module>> children() const;
  const OrderedDict<std::shared_ptr<Module>>& named_children() const { return children_; }
  // Calls fn on every module of the tree, children first (as PyTorch's apply).
  void apply(const std::function<void(Module&)>& fn);

  // This module's own entries by name; ValueError naming the module and key when absent.
  const Tensor& parameter(const std::string& name) const;
  const Tensor& buffer(const std::string& name) const;
  // Own parameter or an undefined tensor (e.g. the bias of a bias-free layer).
  Tensor find_parameter(const std::string& name) const;
  std::shared_ptr<Module> child(const std::string& name) const;
  // The child `name` as an M; ValueError when absent or of another type.
  template <typename M>
  M& child_as(const std::string& name) const {
    static_assert(std::is_base_of_v<Module, M>,
                  "child_as<M>: M must be a module class (nn::SequentialImpl, not its holder nn::Sequential)");
    auto* m = dynamic_cast<M*>(child(name).get());
    TANDEM_CHECK(m != nullptr, Value, this->name(), ": child '", name, "' is a ",
                 child(name)->name(), ", not the requested type");
    return *m;
  }

  int64_t num_parameters() const;

  // ---- mode and device ----------------------------------------------------------------
  // Sets training mode on the whole tree (BatchNorm uses batch statistics when training).
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }

  // Moves every parameter and buffer of the tree to d in place (see the header note) and pins
  // every module of the tree to d. Throws DeviceError for a device that does not exist.
  Module& to(Device d);
  // Lays out every 4-D parameter and buffer of the tree in `format`, in place like to(d)
  // (PyTorch's module.to(memory_format=torch.channels_last)). A convolution whose weight is
  // channels-last runs channels-last and writes channels-last activations, and the layers
  // after it keep that format (Note [memory formats] in core/tensor.h). Gradients are dropped.
  Module& to(MemoryFormat format);
  // The device of the module's tensors (cpu:0 for a module that has none and was never moved).
  Device device() const { return device_.value_or(kCPU); }

  // Clears the gradients of all parameters (see Note [zero_grad sets to none]).
  void zero_grad(bool set_to_none = true);

  // ---- serialization ------------------------------------------------------------------
  // Parameters and buffers of the whole tree, named as named_parameters(). The tensors alias
  // the module's (detached, no copy): copy them to keep a snapshot.
  StateDict state_dict() const;
  // Copies values in (any device/dtype is converted). Checks everything before copying
  // anything: a missing key (ValueError), a shape mismatch (ShapeError) and, when strict,
  // an unexpected key (ValueError) are errors that name the key.
  void load_state_dict(const StateDict& state, bool strict = true);

 protected:
  Module() = default;
  // Deep copy (see Note [registry is the source of truth]).
  Module(const Module& other);
  // Takes other's registry (the same tensors and children, no copy): how a temporary layer
  // passed by value (nn::Sequential(nn::Linear(2, 3))) becomes a shared module.
  Module(Module&& other) = default;

  virtual Tensor forward_impl(const Tensor& x) = 0;
  // forward()'s checks: ValueError for an undefined input, DeviceError for one on another device.
  void check_forward_input(const Tensor& x) const;

 private:
  void check_new_name(const std::string& name, const char* what) const;
  void add_child(const std::string& name, std::shared_ptr<Module> m);
  void replace_child(const std::string& name, std::shared_ptr<Module> m);
  void adopt_device(Device d, const std::string& what);
  void collect(const std::string& prefix, bool params, bool recurse, StateDict& out,
               std::vector<const TensorImpl*>* seen) const;  // null: keep duplicates
  void str_into(std::string& out, int indent) const;

  OrderedDict<Tensor> parameters_;
  OrderedDict<Tensor> buffers_;
  OrderedDict<std::shared_ptr<Module>> children_;
  bool training_ = true;
  std::optional<Device> device_;
};

// clone() for a module type whose state is all in the registry plus copyable configuration:
//   class Linear : public Cloneable<Linear> { ... };
template <typename Derived>
class Cloneable : public Module {
 public:
  std::shared_ptr<Module> clone() const override {
    return std::make_shared<Derived>(static_cast<const Derived&>(*this));
  }

 protected:
  Cloneable() = default;
  Cloneable(const Cloneable&) = default;
  Cloneable(Cloneable&&) = default;
};

// A PyTorch-style printout of the module tree (Module::str()).
std::ostream& operator<<(std::ostream& out, const Module& m);

// Note [module holders]
// libtorch's module holders: nn::Sequential is a ModuleHolder<SequentialImpl>, a value that
// wraps a std::shared_ptr<SequentialImpl>. Copying a holder shares the module (as copying a
// shared_ptr does); `->` and `*` reach the module; calling it runs forward. A holder converts
// to std::shared_ptr<M> for any base M of Impl (nn::Module included), so it goes where
// tandem takes a shared module (DistributedDataParallel, DataParallel, replicate) without
// spelling the type, and to Impl& (so nn::Module&: save, load, ...). Both styles name the
// same objects: Sequential(std::shared_ptr<SequentialImpl>) wraps an existing module, and
// holder.ptr() is the shared_ptr. An empty holder (Sequential(nullptr)) throws ValueError
// when used.
//
// Layers stay module classes (std::make_shared<nn::Linear>(2, 3) is a shared module, and
// nn::Linear(2, 3) a temporary that a Sequential or register_module takes over): tandem's
// layers read their state from the registry (Note [registry is the source of truth]), so
// they need no holder to be shared.
template <typename Impl>
class ModuleHolder {
  static_assert(std::is_base_of_v<Module, Impl>, "ModuleHolder<Impl>: Impl must derive from nn::Module");

 public:
  using ContainedType = Impl;

  // A default-constructed Impl (when it has a default constructor).
  ModuleHolder()
    requires std::is_default_constructible_v<Impl>
      : impl_(std::make_shared<Impl>()) {}
  // Empty: holds no module until one is assigned.
  ModuleHolder(std::nullptr_t) {}
  // Shares an existing module.
  ModuleHolder(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
  // A new Impl from Impl's constructor arguments.
  template <typename Head, typename... Tail>
    requires(!(sizeof...(Tail) == 0 &&
               (std::is_base_of_v<ModuleHolder, std::remove_cvref_t<Head>> ||
                std::is_convertible_v<Head, std::shared_ptr<Impl>> ||
                std::is_same_v<std::remove_cvref_t<Head>, std::nullptr_t>)) &&
             std::is_constructible_v<Impl, Head, Tail...>)
  explicit ModuleHolder(Head&& head, Tail&&... tail)
      : impl_(std::make_shared<Impl>(std::forward<Head>(head), std::forward<Tail>(tail)...)) {}

  Impl* operator->() const { return get(); }
  Impl& operator*() const { return *get(); }
  // The module; ValueError when the holder is empty.
  Impl* get() const {
    if (!impl_) throw_empty();
    return impl_.get();
  }
  const std::shared_ptr<Impl>& ptr() const {
    if (!impl_) throw_empty();
    return impl_;
  }
  bool is_empty() const { return impl_ == nullptr; }
  explicit operator bool() const { return impl_ != nullptr; }

  // model(x) runs model->forward(x).
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) const {
    return (*get())(std::forward<Args>(args)...);
  }

  template <typename M>
    requires std::is_base_of_v<M, Impl>
  operator std::shared_ptr<M>() const {
    return ptr();
  }
  operator Impl&() const { return *get(); }

 private:
  [[noreturn]] static void throw_empty();

  std::shared_ptr<Impl> impl_;
};

[[noreturn]] void throw_empty_module_holder();  // ValueError: "empty module holder ..."

template <typename Impl>
void ModuleHolder<Impl>::throw_empty() {
  throw_empty_module_holder();
}

template <typename Impl>
std::ostream& operator<<(std::ostream& out, const ModuleHolder<Impl>& m) {
  return out << static_cast<const Module&>(*m);
}

}  // namespace tandem::nn

// libtorch's TORCH_MODULE(Name): defines the holder class Name for a module class NameImpl,
//   class NetImpl : public nn::Cloneable<NetImpl> { ... };
//   TANDEM_MODULE(Net);   // Net net(args...); net->forward(x); DDP ddp(net, group);
#define TANDEM_MODULE(Name)                                \
  class Name : public ::tandem::nn::ModuleHolder<Name##Impl> { \
   public:                                                 \
    using ::tandem::nn::ModuleHolder<Name##Impl>::ModuleHolder; \
  }
