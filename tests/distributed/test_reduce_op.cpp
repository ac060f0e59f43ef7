// One ReduceOp for the kernels and the process groups: a program that uses both namespaces, as
// the examples do, names it without qualification (this file not compiling is the failure).
#include <type_traits>

#include "catch.h"
#include "kernels/ops.h"
#include "parallel/distributed/process_group.h"

using namespace tandem;
using namespace tandem::parallel::distributed;

static_assert(std::is_same_v<ReduceOp, tandem::ReduceOp>);
static_assert(std::is_same_v<tandem::parallel::distributed::ReduceOp, tandem::ReduceOp>);
static_assert(ReduceOp::Avg == ReduceOp::Mean, "Avg is PyTorch's collective name of Mean");

TEST_CASE("ReduceOp is one enum under both namespaces", "[dist]") {
  const ReduceOp sum = ReduceOp::Sum;
  Tensor x = from_vector<float>({1, 2, 3, 6}, {4});
  CHECK(kernels::reduce(sum, x, {0}).item() == 12.0);
  CHECK(kernels::reduce(ReduceOp::Avg, x, {0}).item() == 3.0);
  CHECK(std::string(reduce_op_name(sum)) == "sum");
  CHECK(std::string(reduce_op_name(ReduceOp::Avg)) == "avg");
  CHECK(std::string(reduce_op_name(ReduceOp::Max)) == "max");
}
