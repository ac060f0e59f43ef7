// bfloat16 kernels of the CPU backend against float32: every kernel is defined as the float32
// computation on the (exactly widened) bfloat16 inputs followed by one rounding, so the
// reference is the float32 kernel on x.to(kFloat32), rounded with .to(kBFloat16), and the
// documented tolerance is 0 ulps: the results must be identical bit for bit. Ops without
// bfloat16 kernels must throw a DTypeError naming the op.
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "catch.h"
#include "core/bfloat16.h"
#include "helpers.h"
#include "kernels/backend.h"
#include "kernels/bf16_test_util.h"
#include "kernels/ops.h"

using namespace tandem;
using namespace tandem::test;

TEST_CASE("cpu bfloat16 fill and copies with dtype conversion", "[kernels][bf16]") {
  Tensor t = zeros({5, 6}, kBFloat16);
  t.slice(1, 1, 4).fill_(0.1);  // strided fill
  const std::vector<uint16_t> b = bf16_bits(t);
  CHECK(b[1] == BFloat16(0.1f).bits);
  CHECK(b[0] == 0);
  CHECK(b[4] == 0);
  t.fill_(3.4e38);  // a float32 above bfloat16's largest value + half an ulp: infinity
  CHECK(bf16_bits(t)[7] == 0x7f80);
  t.zero_();
  CHECK(bf16_bits(t)[29] == 0);

  // float32 -> bfloat16 rounds each element like BFloat16(float), also through strided views.
  Tensor x = uniform({9, 7}, -3.0, 3.0, kFloat32);
  set(x, 0, 0, std::bit_cast<float>(0x3f808000u));  // a tie
  set(x, 0, 1, NAN);
  set(x, 0, 2, std::bit_cast<float>(0x00018000u));  // a subnormal tie
  for (const Tensor& src : {x, x.transpose(0, 1)}) {
    const Tensor h = bf16(src);
    const Tensor sc = src.contiguous();
    const std::vector<uint16_t> got = bf16_bits(h);
    const float* p = sc.data<float>();
    for (size_t i = 0; i < got.size(); ++i) {
      INFO("element " << i);
      REQUIRE(ulp_distance(got[i], BFloat16(p[i]).bits) == 0);
    }
  }
  CHECK(bf16_bits(bf16(x))[0] == 0x3f80);
  CHECK(bf16_is_nan(bf16_bits(bf16(x))[1]));
  CHECK(bf16_bits(bf16(x))[2] == 0x0002);

  // bfloat16 -> float32 / float64 is exact; back again is the identity.
  const Tensor h = bf16(x);
  CHECK(bf16_bits(bf16(f32(h))) == bf16_bits(h));
  CHECK(bf16_bits(bf16(h.to(kFloat64))) == bf16_bits(h));
  const Tensor hf = f32(h);
  const std::vector<uint16_t> hb = bf16_bits(h);
  for (size_t i = 0; i < hb.size(); ++i) {
    REQUIRE(std::bit_cast<uint32_t>(hf.data<float>()[i]) == uint32_t{hb[i]} << 16);
  }
  // A strided bfloat16 -> bfloat16 copy.
  CHECK(bf16_bits(h.transpose(0, 1).contiguous()) == bf16_bits(bf16(x.transpose(0, 1))));

  // float64 -> bfloat16 goes through float32 (two roundings, as PyTorch's conversion does):
  // 1 + 2^-8 + 2^-30 is nearer 1 + 2^-7, but float32 first rounds it to the tie 1 + 2^-8,
  // which then rounds to even 1.
  Tensor d =
      from_vector<double>({1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30), -2.75, 1e-39}, {3});
  const std::vector<uint16_t> db = bf16_bits(bf16(d));
  CHECK(db[0] == 0x3f80);
  CHECK(db[1] == BFloat16(-2.75f).bits);
  CHECK(db[2] == BFloat16(1e-39f).bits);

  // int64 <-> bfloat16: 257 is a tie between 256 and 258 (8 significant bits).
  Tensor n = from_vector<int64_t>({0, 1, -7, 255, 257, 259, 1 << 20}, {7});
  CHECK(values(bf16(n)) == std::vector<double>{0, 1, -7, 255, 256, 260, 1 << 20});
  Tensor r = from_vector<float>({2.5f, -2.5f, 300.0f, -0.75f}, {4});
  CHECK(bf16(r).to(kInt64).to_vector<int64_t>() == std::vector<int64_t>{2, -2, 300, 0});
  CHECK(values(bf16(from_vector<uint8_t>({0, 3, 255}, {3}))) == std::vector<double>{0, 3, 255});
  CHECK(bf16(full({2}, 200.0, kBFloat16)).to(kUInt8).to_vector<uint8_t>() ==
        std::vector<uint8_t>{200, 200});
}

TEST_CASE("cpu bfloat16 unary ops equal float32 rounded", "[kernels][bf16]") {
  const UnaryOp ops[] = {UnaryOp::Neg,    UnaryOp::Exp,       UnaryOp::Log,  UnaryOp::Sigmoid,
                         UnaryOp::Relu,   UnaryOp::Tanh,      UnaryOp::Sqrt, UnaryOp::Abs,
                         UnaryOp::Square, UnaryOp::Reciprocal};
  Tensor x = rnd_bf16({13, 17}, -4.0, 4.0);
  set(x, 0, 0, 0.0f);
  set(x, 0, 1, NAN);
  set(x, 0, 2, -INFINITY);
  set(x, 0, 3, 100.0f);  // exp overflows
  for (UnaryOp op : ops) {
    INFO("op " << static_cast<int>(op));
    for (const Tensor& in : {x, x.transpose(0, 1)}) {
      const Tensor got = kernels::unary(op, in);
      REQUIRE(got.dtype() == kBFloat16);
      require_ulps(got, bf16(kernels::unary(op, f32(in))), 0);
    }
  }
  // A result that must round: exp(1) = 2.71828... is 0x402e in bfloat16.
  CHECK(bf16_bits(kernels::unary(UnaryOp::Exp, full({1}, 1.0, kBFloat16)))[0] == 0x402e);
}

TEST_CASE("cpu bfloat16 binary ops equal float32 rounded", "[kernels][bf16]") {
  const BinaryOp ops[] = {BinaryOp::Add,         BinaryOp::Sub,          BinaryOp::Mul,
                          BinaryOp::Div,         BinaryOp::Max,          BinaryOp::Min,
                          BinaryOp::Eq,          BinaryOp::ReluBackward, BinaryOp::SigmoidBackward,
                          BinaryOp::TanhBackward};
  Tensor a = rnd_bf16({11, 19}, -2.0, 2.0);
  Tensor b = rnd_bf16({11, 19}, 0.25, 3.0);
  Tensor row = rnd_bf16({19}, -1.0, 1.0);
  set(a, 1, 1, NAN);
  a.select(0, 2).copy_(b.select(0, 2));  // equal elements for Eq
  for (BinaryOp op : ops) {
    INFO("op " << static_cast<int>(op));
    require_ulps(kernels::binary(op, a, b), bf16(kernels::binary(op, f32(a), f32(b))), 0);
    // Broadcast operand on either side, and a transposed one.
    require_ulps(kernels::binary(op, a, row), bf16(kernels::binary(op, f32(a), f32(row))), 0);
    require_ulps(kernels::binary(op, row, b), bf16(kernels::binary(op, f32(row), f32(b))), 0);
    const Tensor at = a.transpose(0, 1), bt = b.transpose(0, 1);
    require_ulps(kernels::binary(op, at, bt), bf16(kernels::binary(op, f32(at), f32(bt))), 0);
  }
  // In place, with a broadcast right-hand side.
  Tensor c = a.clone(), c32 = f32(a);
  kernels::binary_(BinaryOp::Mul, c, row);
  kernels::binary_(BinaryOp::Mul, c32, f32(row));
  require_ulps(c, bf16(c32), 0);
}

TEST_CASE("cpu bfloat16 scalar ops keep the scalar in float", "[kernels][bf16]") {
  Tensor x = rnd_bf16({400}, 0.2, 3.0);
  const std::pair<ScalarOp, double> cases[] = {
      {ScalarOp::Add, 0.1},  {ScalarOp::Mul, 0.1}, {ScalarOp::Mul, -3.0}, {ScalarOp::RSub, 1.0},
      {ScalarOp::RDiv, 0.3}, {ScalarOp::Pow, 2.0}, {ScalarOp::Pow, 0.5},  {ScalarOp::Pow, -1.0},
      {ScalarOp::Pow, 1.0},  {ScalarOp::Pow, 1.7}};
  for (const auto& [op, s] : cases) {
    INFO("op " << static_cast<int>(op) << " s " << s);
    require_ulps(kernels::scalar(op, x, s), bf16(kernels::scalar(op, f32(x), s)), 0);
  }
  // The scalar is not rounded to bfloat16 first: x * 0.1 differs from x * bf16(0.1) for some x.
  const Tensor rounded_scalar =
      bf16(kernels::scalar(ScalarOp::Mul, f32(x), static_cast<double>(BFloat16(0.1f))));
  const std::vector<uint16_t> got = bf16_bits(kernels::scalar(ScalarOp::Mul, x, 0.1));
  const std::vector<uint16_t> other = bf16_bits(rounded_scalar);
  CHECK(got != other);
}

TEST_CASE("cpu bfloat16 axpby equals float32 rounded", "[kernels][bf16]") {
  const std::pair<double, double> cases[] = {{0.5, 0.0}, {1.0, 1.0}, {0.3, -2.0}};
  const Tensor x = rnd_bf16({7, 9});
  set(x, 1, 1, 1.6796875f);  // with out = 0.251953125: 0.3f * x rounds to 2 * out
  for (const auto& [alpha, beta] : cases) {
    INFO("alpha " << alpha << " beta " << beta);
    Tensor out = rnd_bf16({7, 9});
    if (beta == 0.0) set(out, 0, 0, NAN);  // ignored when beta is 0
    set(out, 1, 1, 0.251953125f);
    Tensor out32 = f32(out);
    kernels::axpby_(alpha, x, beta, out);
    kernels::axpby_(alpha, f32(x), beta, out32);
    require_ulps(out, bf16(out32), 0);
    CHECK_FALSE(bf16_is_nan(bf16_bits(out)[0]));
    // Products and sum rounded separately: the cancellation is exactly +0, the value the CUDA
    // kernel must reproduce (Note [bfloat16 axpby without contraction]).
    if (beta == -2.0) CHECK(bf16_bits(out)[1 * 9 + 1] == 0);
  }
}

TEST_CASE("cpu bfloat16 reductions accumulate in double and round once", "[kernels][bf16]") {
  Tensor x = rnd_bf16({6, 5, 300}, -1.0, 1.0);
  const std::vector<std::vector<int64_t>> dims = {{2}, {0}, {1, 2}, {}};
  for (ReduceOp op : {ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max}) {
    for (const auto& d : dims) {
      INFO("op " << static_cast<int>(op) << " dims " << d.size());
      for (bool keepdim : {false, true}) {
        const Tensor got = kernels::reduce(op, x, d, keepdim);
        REQUIRE(got.dtype() == kBFloat16);
        require_ulps(got, bf16(kernels::reduce(op, f32(x), d, keepdim)), 0);
      }
    }
  }
  // 4096 ones: a bfloat16 accumulator would stop at 256 (256 + 1 rounds back to 256).
  CHECK(values(kernels::reduce(ReduceOp::Sum, ones({4096}, kBFloat16), {}))[0] == 4096.0);
  // Max of an all -inf row is -inf (the identity is -inf, not the lowest finite value), NaN wins.
  Tensor m = full({2, 3}, -INFINITY, kBFloat16);
  set(m, 1, 1, NAN);
  const std::vector<double> mv = values(kernels::reduce(ReduceOp::Max, m, {1}));
  CHECK(mv[0] == -INFINITY);
  CHECK(std::isnan(mv[1]));
  // argmax agrees with float32's.
  CHECK(kernels::argmax(x, 2).to_vector<int64_t>() ==
        kernels::argmax(f32(x), 2).to_vector<int64_t>());
  // sum_to (the broadcast gradient reduction) in bfloat16.
  require_ulps(kernels::sum_to(x, {5, 1}), bf16(kernels::sum_to(f32(x), {5, 1})), 0);
}

TEST_CASE("cpu bfloat16 gemm is float32 gemm rounded", "[kernels][bf16]") {
  Tensor a = rnd_bf16({23, 37}), b = rnd_bf16({37, 19});
  require_ulps(kernels::matmul(a, b), bf16(kernels::matmul(f32(a), f32(b))), 0);
  // Transposed operands, as stored and as views (gemm_operand flips the flag for views).
  Tensor at = rnd_bf16({37, 23}), bt = rnd_bf16({19, 37});
  require_ulps(kernels::matmul(at, bt, true, true),
               bf16(kernels::matmul(f32(at), f32(bt), true, true)), 0);
  require_ulps(kernels::matmul(at.transpose(0, 1), b),
               bf16(kernels::matmul(f32(at).transpose(0, 1), f32(b))), 0);
  // An empty inner dimension gives zeros.
  CHECK(values(kernels::matmul(zeros({3, 0}, kBFloat16), zeros({0, 4}, kBFloat16))) ==
        std::vector<double>(12, 0.0));
  // alpha and beta through the backend: c = 2 a b + 0.5 c.
  Tensor c = rnd_bf16({23, 19}), c32 = f32(c);
  cpu_backend().gemm(false, false, 2.0, a, b, 0.5, c);
  cpu_backend().gemm(false, false, 2.0, f32(a), f32(b), 0.5, c32);
  require_ulps(c, bf16(c32), 0);
  // The result really is rounded: it differs from the float32 product somewhere.
  CHECK(values(kernels::matmul(a, b)) != values(kernels::matmul(f32(a), f32(b))));
}

TEST_CASE("cpu bfloat16 index_select and index_add", "[kernels][bf16]") {
  Tensor x = rnd_bf16({6, 4});
  Tensor idx = from_vector<int64_t>({5, 0, 3, 3}, {4});
  require_ulps(kernels::index_select(x, idx), bf16(kernels::index_select(f32(x), idx)), 0);
  Tensor perm = from_vector<int64_t>({2, 0, 5, 1, 4, 3}, {6});
  require_ulps(kernels::index_add(x, perm, {6, 4}), bf16(kernels::index_add(f32(x), perm, {6, 4})),
               0);
  // Repeated rows add in bfloat16 (each sum rounded), in index order on the CPU.
  Tensor one_row = from_vector<int64_t>({0, 0, 0}, {3});
  Tensor src = from_vector<float>({1.0f, 0.00390625f, 0.00390625f}, {3, 1}).to(kBFloat16);
  CHECK(values(kernels::index_add(src, one_row, {1, 1}))[0] == 1.0);
}

TEST_CASE("ops without bfloat16 kernels throw a DTypeError naming the op", "[kernels][bf16]") {
  const Tensor x = rnd_bf16({2, 3, 6, 6});
  const Tensor logits = rnd_bf16({4, 5});
  const Tensor target = from_vector<int64_t>({0, 1, 2, 3}, {4});
  auto expect = [](const char* op, auto&& fn) {
    INFO(op);
    const std::string msg = error_message<DTypeError>(fn);
    CHECK(contains(msg, op));
    CHECK(contains(msg, "bfloat16"));
  };
  expect("log_softmax", [&] { kernels::log_softmax(logits); });
  expect("cross_entropy", [&] { kernels::cross_entropy(logits, target); });
  // Batch norm of bfloat16 activations keeps float32 parameters and statistics.
  const Tensor c = rnd_bf16({3});
  expect("batch_norm", [&] { kernels::batch_norm_eval(x, c, c, c, c, 1e-5); });
  const Tensor p = rnd_bf16({5}), g = rnd_bf16({5});
  expect("sgd_step", [&] { kernels::sgd_step(p, g, Tensor(), {}); });
  // Mixed dtypes are a DTypeError too, naming both.
  const std::string mixed =
      error_message<DTypeError>([&] { kernels::binary(BinaryOp::Add, p, g.to(kFloat32)); });
  CHECK(contains(mixed, "bfloat16"));
  CHECK(contains(mixed, "float32"));
}
