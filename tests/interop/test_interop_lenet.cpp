// The tandem side of the PyTorch interop test (tests/interop/lenet_interop.py). Hidden: these
// cases run only when that script starts them by tag, with TANDEM_INTEROP_DIR naming the
// folder where both sides exchange their safetensors files.
#include <cstdlib>
#include <filesystem>
#include <string>

#include "autograd/grad_mode.h"
#include "catch.h"
#include "data/fashion_mnist.h"
#include "kernels/ops.h"
#include "nn/models/lenet.h"
#include "nn/serialize.h"

using namespace tandem;

namespace {

std::string exchange_dir() {
  const char* dir = std::getenv("TANDEM_INTEROP_DIR");
  REQUIRE(dir != nullptr);
  return dir;
}

std::string in_dir(const std::string& name) {
  return (std::filesystem::path(exchange_dir()) / name).string();
}

}  // namespace

// Writes tandem_lenet.safetensors (random weights and biases) and tandem_io.safetensors
// (a fixed input and tandem's logits for it).
TEST_CASE("interop: export a LeNet checkpoint and its logits", "[.interop-export]") {
  Generator gen(2024);
  auto net = nn::models::lenet({}, gen);
  // init_cnn zeroes biases; random ones make the comparison check them too.
  for (auto& [name, p] : net->named_parameters()) {
    if (name.size() > 5 && name.substr(name.size() - 5) == ".bias")
      p.copy_(uniform(p.shape(), -0.5, 0.5, kFloat32, kCPU, &gen));
  }
  net->eval();
  const Tensor x = rand({16, 1, 28, 28}, kFloat32, kCPU, &gen);  // [16, 1, 28, 28]
  NoGradGuard no_grad;
  const Tensor logits = (*net)(x);  // [16, 10]
  nn::save(*net, in_dir("tandem_lenet.safetensors"), {{"model", "lenet"}});
  nn::write_safetensors(in_dir("tandem_io.safetensors"), {{"input", x}, {"logits", logits}});
}

// Loads torch_lenet.safetensors (written by PyTorch) and the input of torch_io.safetensors,
// writes tandem's logits to tandem_eval.safetensors and the loaded weights, saved again by
// tandem, to tandem_resaved.safetensors. With TANDEM_INTEROP_DATA set, it also writes the
// predictions for the first 1000 Fashion-MNIST test images.
TEST_CASE("interop: evaluate a LeNet checkpoint written by PyTorch", "[.interop-eval]") {
  auto net = nn::models::lenet();
  nn::load(*net, in_dir("torch_lenet.safetensors"));
  net->eval();
  const nn::SafetensorsFile io = nn::read_safetensors(in_dir("torch_io.safetensors"));
  NoGradGuard no_grad;
  nn::StateDict out{{"logits", (*net)(io.tensors.at("input"))}};
  if (const char* data = std::getenv("TANDEM_INTEROP_DATA")) {
    const data::FashionMnist test = data::load_fashion_mnist(data, /*train=*/false, 1000);
    out.insert("predictions", kernels::argmax((*net)(test.images), 1));  // int64 [1000]
    out.insert("labels", test.labels);
  }
  nn::write_safetensors(in_dir("tandem_eval.safetensors"), out);
  nn::save(*net, in_dir("tandem_resaved.safetensors"));
}
