#include "parallel/pipeline/split.h"

#include <limits>

#include "core/error.h"
#include "parallel/device_api.h"

namespace tandem::parallel::pipeline {

std::string balance_str(const std::vector<int64_t>& balance) {
  std::string s = "[";
  for (size_t i = 0; i < balance.size(); ++i) s += (i ? ", " : "") + std::to_string(balance[i]);
  return s + "]";
}

std::vector<Stage> split_by_balance(const nn::SequentialImpl& model,
                                    const std::vector<int64_t>& balance,
                                    const std::vector<Device>& devices) {
  const auto layers = static_cast<int64_t>(model.size());
  TANDEM_CHECK(!balance.empty(), Value, "split_by_balance: empty balance");
  TANDEM_CHECK(balance.size() <= model.size(), Value, "split_by_balance: ", balance.size(),
               " stages for a Sequential of ", layers, " layers; every stage needs a layer");
  TANDEM_CHECK(balance.size() == devices.size(), Value, "split_by_balance: balance ",
               balance_str(balance), " has ", balance.size(), " stages but there are ",
               devices.size(), " devices ", devices_str(devices));
  int64_t total = 0;
  for (size_t s = 0; s < balance.size(); ++s) {
    TANDEM_CHECK(balance[s] >= 1, Value, "split_by_balance: balance ", balance_str(balance),
                 " gives stage ", s, " ", balance[s], " layers; every stage needs at least one");
    total += balance[s];
  }
  TANDEM_CHECK(total == layers, Value, "split_by_balance: balance ", balance_str(balance),
               " adds up to ", total, " layers but the Sequential has ", layers);
  check_device_list(devices, "split_by_balance");

  std::vector<Stage> stages;
  size_t begin = 0;
  for (size_t s = 0; s < balance.size(); ++s) {
    const size_t end = begin + static_cast<size_t>(balance[s]);
    auto piece = std::make_shared<nn::SequentialImpl>();
    for (size_t i = begin; i < end; ++i) piece->push_back(model[i]);
    piece->train(model.is_training());
    piece->to(devices[s]);
    stages.push_back({piece, devices[s], begin, end});
    begin = end;
  }
  return stages;
}

std::vector<int64_t> balance_by_parameters(const nn::SequentialImpl& model, int num_stages) {
  const size_t L = model.size();
  TANDEM_CHECK(num_stages >= 1, Value, "balance_by_parameters: num_stages must be >= 1, got ",
               num_stages);
  const auto P = static_cast<size_t>(num_stages);
  TANDEM_CHECK(P <= L, Value, "balance_by_parameters: ", P, " stages for a Sequential of ", L,
               " layers; every stage needs a layer");
  std::vector<int64_t> prefix(L + 1, 0);  // parameters of layers [0, i)
  for (size_t i = 0; i < L; ++i) prefix[i + 1] = prefix[i] + model[i]->num_parameters();

  // best[k][i]: the smallest largest-stage count for layers [0, i) in k stages; cut[k][i]: where
  // the k-th stage starts in that split.
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(P + 1, std::vector<int64_t>(L + 1, kInf));
  std::vector<std::vector<size_t>> cut(P + 1, std::vector<size_t>(L + 1, 0));
  best[0][0] = 0;
  for (size_t k = 1; k <= P; ++k) {
    for (size_t i = k; i <= L; ++i) {
      for (size_t j = k - 1; j < i; ++j) {
        if (best[k - 1][j] == kInf) continue;
        const int64_t v = std::max(best[k - 1][j], prefix[i] - prefix[j]);
        if (v < best[k][i]) {
          best[k][i] = v;
          cut[k][i] = j;
        }
      }
    }
  }
  std::vector<int64_t> balance(P);
  for (size_t k = P, i = L; k >= 1; --k) {
    balance[k - 1] = static_cast<int64_t>(i - cut[k][i]);
    i = cut[k][i];
  }
  return balance;
}

std::vector<Stage> split_by_parameters(const nn::SequentialImpl& model,
                                       const std::vector<Device>& devices) {
  TANDEM_CHECK(!devices.empty(), Value, "split_by_parameters: empty device list");
  return split_by_balance(model, balance_by_parameters(model, static_cast<int>(devices.size())),
                          devices);
}

}  // namespace tandem::parallel::pipeline
