// Storage::release and Storage::reallocate (Note [releasing a storage] in core/storage.h): the
// bytes go back to the allocator while views still hold the Storage, come back under every
// alias at once, and a kernel that reads a released storage is an error naming the tensor.
#include "autograd/ops.h"
#include "catch.h"
#include "core/allocator.h"
#include "core/error.h"
#include "core/tensor.h"
#include "helpers.h"

using namespace tandem;
using tandem::test::contains;
using tandem::test::error_message;
using tandem::test::values;

TEST_CASE("Storage::release gives the bytes back while views hold the storage", "[core][storage]") {
  const size_t before = allocated_bytes(kCPU);
  Tensor base = zeros({4, 8}, kFloat32);
  Tensor row = base.select(0, 1), col = base.slice(1, 2, 5);
  REQUIRE(allocated_bytes(kCPU) == before + 4 * 8 * 4);
  base.storage()->release();
  CHECK(allocated_bytes(kCPU) == before);     // although three tensors hold the Storage
  for (const Tensor& t : {base, row, col}) {  // the views keep their geometry, not the bytes
    CHECK(t.storage()->released());
    CHECK(t.storage()->nbytes() == 0);
  }
  base.storage()->release();  // again: nothing
  CHECK(allocated_bytes(kCPU) == before);
}

TEST_CASE("Storage::reallocate gives every alias the same new bytes", "[core][storage]") {
  Tensor base = arange(0, 12, 1, kFloat64).view({3, 4});
  Tensor row = base.select(0, 2), tail = base.view({-1}).slice(0, 6, 12), t = base.transpose(0, 1);
  const std::shared_ptr<Storage> storage = base.storage();
  storage->release();
  const size_t before = allocated_bytes(kCPU);
  storage->reallocate(12 * 8);
  CHECK(!storage->released());
  CHECK(storage->nbytes() == 12 * 8);
  CHECK(allocated_bytes(kCPU) == before + 12 * 8);
  CHECK(base.storage() == storage);  // the same object, not a new one
  base.fill_(-1.0);
  row.fill_(5.0);  // written through one view, read through the others
  CHECK(values(base) == std::vector<double>{-1, -1, -1, -1, -1, -1, -1, -1, 5, 5, 5, 5});
  CHECK(values(tail) == std::vector<double>{-1, -1, 5, 5, 5, 5});
  CHECK(values(t.select(0, 3)) == std::vector<double>{-1, -1, 5});
  // Reallocating a storage that holds bytes replaces them (the old block goes first).
  storage->reallocate(12 * 8);
  CHECK(allocated_bytes(kCPU) == before + 12 * 8);
}

TEST_CASE("A kernel on a released storage is a ValueError naming the tensor", "[core][storage]") {
  Tensor a = ones({2, 3});
  Tensor view = a.slice(1, 0, 2);
  a.storage()->release();
  Tensor b = ones({2, 3});
  CHECK(contains(error_message<ValueError>([&] { add(a, b); }), "Tensor[2,3] float32 cpu"));
  CHECK(contains(error_message<ValueError>([&] { add(a, b); }), "storage was released"));
  CHECK(contains(error_message<ValueError>([&] { view.to_vector<float>(); }), "Tensor[2,2]"));
  CHECK(contains(error_message<ValueError>([&] { b.copy_(a); }), "released"));
  CHECK(contains(error_message<ValueError>([&] { a.copy_(b); }), "released"));  // writes too
  CHECK(contains(error_message<ValueError>([&] { matmul(a, b.transpose(0, 1)); }), "[2,3]"));
  // An empty view reads no bytes: not an error.
  CHECK(a.slice(0, 1, 1).to_vector<float>().empty());
  // Once reallocated, the tensors work again.
  a.storage()->reallocate(6 * 4);
  a.fill_(2.0);
  CHECK(values(add(a, b)) == std::vector<double>{3, 3, 3, 3, 3, 3});
  CHECK(values(view) == std::vector<double>{2, 2, 2, 2});
}

// What FSDP's FULL_SHARD relies on: the alias autograd saved of a weight sees the release and
// the bytes written back before backward.
TEST_CASE("Autograd's saved alias of a released weight: an error, then the refilled values",
          "[core][storage]") {
  Tensor w = from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2});
  w.set_requires_grad(true);
  Tensor x = from_vector<float>({1, -1, 2, 0.5f}, {2, 2});
  x.set_requires_grad(true);
  Tensor loss = sum(matmul(x, transpose(w, 0, 1)));  // saves x and (an alias of) w
  const size_t before = allocated_bytes(kCPU);
  w.storage()->release();
  CHECK(allocated_bytes(kCPU) == before - 6 * 4);
  CHECK(contains(error_message<ValueError>([&] { loss.backward(Tensor(), true); }), "released"));
  w.storage()->reallocate(6 * 4);
  w.detach().copy_(from_vector<float>({1, 2, 3, 4, 5, 6}, {3, 2}));
  loss.backward();
  // d/dx of sum(x w^T) is the column sums of w, in every row.
  CHECK(values(x.grad()) == std::vector<double>{9, 12, 9, 12});
  CHECK(values(w.grad()) == std::vector<double>{3, -0.5, 3, -0.5, 3, -0.5});
}
