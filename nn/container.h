#pragma once
// Sequential: children applied in order, named "0", "1", ... (a BatchNorm2d and the ReLU after
// it as one op when fuse_bn_relu() is on: Note [batch norm + ReLU] in kernels/backend.h; a
// Conv2d's bias added inside the BatchNorm2d after it when fuse_conv_bias() is on:
// nn::conv_batch_norm; a Linear and the ReLU or Sigmoid after it as one op when
// fuse_linear_activation() is on: Note [linear + activation]; a ReLU or a Sigmoid and the
// pooling module after it as one op when fuse_activation_pool() is on: Note [activation +
// pooling]; a Conv2d before those two leaving its bias for that op to add when fuse_conv_bias()
// is on too: Note [conv bias in activation + pooling] in kernels/ops.h).
//
// As in libtorch, nn::Sequential is the holder (Note [module holders] in nn/module.h) of the
// module class nn::SequentialImpl:
//   nn::Sequential model(nn::Linear(2, 32), nn::ReLU(), nn::Linear(32, 2));
//   model->forward(x);  model(x);  model->parameters();  DistributedDataParallel ddp(model, pg);
// and the shared_ptr style names the module class:
//   auto model = std::make_shared<nn::SequentialImpl>(std::vector<std::shared_ptr<nn::Module>>{...});
//   nn::Sequential held = model;   // the same module
#include <initializer_list>
#include <memory>
#include <type_traits>
#include <vector>

#include "nn/module.h"

namespace tandem::nn {

class SequentialImpl;

namespace detail {
// What Sequential's constructor and push_back take: a shared_ptr to a module, a holder, or a
// module object (a temporary; a named one is refused at compile time).
template <typename T>
struct is_module_ptr : std::false_type {};
template <typename M>
struct is_module_ptr<std::shared_ptr<M>> : std::is_base_of<Module, M> {};
template <typename T>
concept sequential_item = is_module_ptr<std::remove_cvref_t<T>>::value || module_holder<T> ||
                          module_value<T>;
}  // namespace detail

class SequentialImpl : public Cloneable<SequentialImpl> {
 public:
  SequentialImpl() = default;
  SequentialImpl(std::initializer_list<std::shared_ptr<Module>> modules);
  explicit SequentialImpl(const std::vector<std::shared_ptr<Module>>& modules);
  // libtorch's Sequential(nn::Linear(2, 32), nn::ReLU(), ...): each argument a temporary
  // module (moved in), a shared_ptr to one or a holder (shared). One SequentialImpl argument
  // is the copy or move constructor, not a nested Sequential (as in libtorch): push_back it.
  template <detail::sequential_item... Ms>
    requires(sizeof...(Ms) > 0 &&
             !(sizeof...(Ms) == 1 && (std::is_same_v<std::remove_cvref_t<Ms>, SequentialImpl> && ...)))
  explicit SequentialImpl(Ms&&... modules) {
    (push_back(std::forward<Ms>(modules)), ...);
  }
  SequentialImpl(const SequentialImpl&) = default;  // deep copy (Module's)
  SequentialImpl(SequentialImpl&&) = default;

  // Appends m under the name of its index.
  SequentialImpl& push_back(std::shared_ptr<Module> m);
  template <module_holder H>
  SequentialImpl& push_back(const H& holder) {
    return push_back(std::shared_ptr<Module>(holder.ptr()));
  }
  // A temporary module, moved into a new shared one.
  template <module_value M>
  SequentialImpl& push_back(M&& m) {
    static_assert(!std::is_lvalue_reference_v<M>,
                  "Sequential: pass a temporary module (nn::Linear(2, 3)), a shared_ptr or a holder; "
                  "a named module object would be copied, and the copy trained instead of it");
    return push_back(std::shared_ptr<Module>(std::make_shared<std::remove_cvref_t<M>>(std::move(m))));
  }
  size_t size() const { return named_children().size(); }

  // A child's handle: a shared_ptr that can also be called, so `(*seq)[i](x)` reads like
  // PyTorch's `seq[i](x)` (and `(*seq)[i]->name()` still works).
  struct ModulePtr : std::shared_ptr<Module> {
    Tensor operator()(const Tensor& x) const { return (**this)(x); }
  };
  // The i-th module; ValueError when out of range.
  ModulePtr operator[](size_t i) const { return {named_children().item(i).second}; }
  // The i-th module, callable directly: seq->at(i)(x). ValueError when out of range.
  Module& at(size_t i) const { return *(*this)[i]; }
  // The i-th module as an M; ValueError when out of range or of another type.
  template <typename M>
  M& at(size_t i) const {
    static_assert(std::is_base_of_v<Module, M>,
                  "at<M>: M must be a module class (nn::SequentialImpl, not its holder nn::Sequential)");
    auto* m = dynamic_cast<M*>((*this)[i].get());
    TANDEM_CHECK(m != nullptr, Value, "Sequential: module ", i, " is a ", (*this)[i]->name(),
                 ", not the requested type");
    return *m;
  }

  std::string name() const override { return "Sequential"; }

 protected:
  Tensor forward_impl(const Tensor& x) override;
};

// The holder (Note [module holders]): nn::Sequential model(nn::Linear(2, 32), nn::ReLU());
TANDEM_MODULE(Sequential);

}  // namespace tandem::nn
