// Micro-batches: torch.tensor_split's chunk sizes, clear errors, and the loss weights that
// make the accumulated gradient of the chunks the gradient of the whole batch
// (Note [loss scaling for micro-batches]).
#include "parallel/pipeline/microbatch.h"
#include "parallel_test_util.h"

using namespace tandem;
using namespace tandem::parallel::pipeline;

TEST_CASE("micro-batches: tensor_split sizes as views of the batch", "[parallel][pipeline]") {
  CHECK(micro_batch_sizes(8, 4) == std::vector<int64_t>{2, 2, 2, 2});
  CHECK(micro_batch_sizes(7, 3) == std::vector<int64_t>{3, 2, 2});
  CHECK(micro_batch_sizes(10, 4) == std::vector<int64_t>{3, 3, 2, 2});
  CHECK(micro_batch_sizes(5, 1) == std::vector<int64_t>{5});
  CHECK(micro_batch_sizes(3, 3) == std::vector<int64_t>{1, 1, 1});

  Generator gen(3);
  Tensor x = randn({7, 2, 3}, kFloat32, kCPU, &gen);
  const auto chunks = split_micro_batches(x, 3);
  REQUIRE(chunks.size() == 3);
  int64_t start = 0;
  for (const Tensor& c : chunks) {
    CHECK(c.shape()[1] == 2);
    CHECK(test::rel_error(c, x.slice(0, start, start + c.size(0))) == 0.0);
    start += c.size(0);
  }
  CHECK(chunks[0].size(0) == 3);
  CHECK(start == 7);

  const auto w = micro_batch_weights({3, 2, 2});
  CHECK(w == std::vector<double>{3.0 / 7, 2.0 / 7, 2.0 / 7});
}

TEST_CASE("micro-batches: more chunks than rows or none is a clear error", "[parallel][pipeline]") {
  const std::string msg = test::error_message<ValueError>([] { micro_batch_sizes(7, 8); });
  CHECK(test::contains(msg, "8 micro-batches for a batch of 7 rows"));
  CHECK(test::contains(test::error_message<ValueError>([] { micro_batch_sizes(7, 0); }),
                       "num_micro_batches must be >= 1, got 0"));
  Tensor x = zeros({3, 2});
  CHECK(test::contains(test::error_message<ValueError>([&] { split_micro_batches(x, 4); }),
                       "4 micro-batches for a batch of 3 rows"));
  CHECK(test::contains(test::error_message<ShapeError>([] { split_micro_batches(Tensor(), 2); }),
                       "undefined"));
}

TEST_CASE("micro-batch losses weighted by n_m / B give the whole batch's gradient",
          "[parallel][pipeline]") {
  Generator gen(11);
  auto net = test::small_mlp(gen);
  auto [x, y] = test::random_batch(10, {8}, 4, gen);

  net->zero_grad();
  cross_entropy(net->forward(x), y).backward();
  std::vector<Tensor> whole;
  for (const Tensor& p : net->parameters()) whole.push_back(p.grad().clone());

  for (int m : {1, 3, 4, 10}) {  // 10 rows in 3 or 4 chunks: uneven
    net->zero_grad();
    const auto xs = split_micro_batches(x, m), ys = split_micro_batches(y, m);
    std::vector<int64_t> sizes;
    for (const Tensor& c : xs) sizes.push_back(c.size(0));
    const auto w = micro_batch_weights(sizes);
    for (size_t i = 0; i < xs.size(); ++i)
      (cross_entropy(net->forward(xs[i]), ys[i]) * w[i]).backward();
    const auto ps = net->parameters();
    double worst = 0;
    for (size_t k = 0; k < ps.size(); ++k)
      worst = std::max(worst, test::rel_error(ps[k].grad(), whole[k]));
    INFO("M " << m);
    CHECK(worst < 1e-6);

    if (m == 3) {  // weighting every chunk 1/M instead is wrong for uneven chunks
      net->zero_grad();
      for (size_t i = 0; i < xs.size(); ++i)
        (cross_entropy(net->forward(xs[i]), ys[i]) * (1.0 / m)).backward();
      double off = 0;
      for (size_t k = 0; k < ps.size(); ++k)
        off = std::max(off, test::rel_error(ps[k].grad(), whole[k]));
      CHECK(off > 1e-4);
    }
  }
}
