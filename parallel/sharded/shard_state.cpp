#include "parallel/sharded/shard_state.h"

#include <algorithm>

#include "autograd/grad_mode.h"
#include "core/error.h"

namespace tandem::parallel::sharded {

namespace {

// "state.<i>.<name>" -> (i, name); false when the key is not of that form.
bool split_key(const std::string& key, size_t& i, std::string& name) {
  const size_t dot1 = key.find('.'), dot2 = key.find('.', dot1 + 1);
  if (key.rfind("state.", 0) != 0 || dot2 == std::string::npos || dot2 == dot1 + 1) return false;
  const std::string digits = key.substr(dot1 + 1, dot2 - dot1 - 1);
  if (digits.find_first_not_of("0123456789") != std::string::npos) return false;
  i = std::stoul(digits);
  name = key.substr(dot2 + 1);
  return true;
}

std::string state_key(size_t i, const std::string& name) {
  return "state." + std::to_string(i) + "." + name;
}

// A state entry that is one number for the whole group (a step count), not one per element.
bool is_count(const std::string& name, const Tensor& t, int64_t shard) {
  return name == "step" || !(t.dim() == 1 && t.numel() == shard);
}

}  // namespace

nn::StateDict gather_optimizer_state(const nn::StateDict& local, const std::vector<Tensor>& params,
                                     const std::vector<FlatGroup>& groups,
                                     distributed::ProcessGroup* group, int rank, int to) {
  NoGradGuard no_grad;
  const int world = group != nullptr ? group->size() : 1;
  // Which state each group's shard has: the same kinds on every rank (the shards step together).
  std::vector<std::vector<std::pair<std::string, Tensor>>> per_group(groups.size());
  for (const auto& [key, t] : local) {
    size_t g = 0;
    std::string name;
    TANDEM_CHECK(split_key(key, g, name) && g < groups.size(), Value, "gather_optimizer_state: '",
                 key, "' is not state.<g>.<name> for one of ", groups.size(), " groups");
    per_group[g].emplace_back(name, t);
  }
  // On `to`: per parameter, its tensors in the group's kind order (undefined until filled).
  std::vector<std::vector<Tensor>> out(params.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    const FlatGroup& fg = groups[g];
    const auto& kinds = per_group[g];
    for (size_t k = 0; k < kinds.size(); ++k) {
      const auto& [name, t] = kinds[k];
      if (is_count(name, t, fg.shard)) {
        if (rank == to) {
          for (size_t i : fg.params) out[i].push_back(t.to(kCPU).clone());
        }
        continue;
      }
      if (rank == to) {
        for (size_t i : fg.params)
          out[i].push_back(empty(params[i].shape(), t.dtype(), t.device()));
      }
      for (int r = 0; r < world; ++r) {
        Tensor piece = r == rank || group == nullptr ? t.contiguous()
                                                     : empty({fg.shard}, t.dtype(), t.device());
        if (group != nullptr && r != to) group->broadcast(piece, r)->wait();
        if (rank != to) continue;
        // Rank r's elements [lo, hi) of the group into the parameters they belong to.
        const int64_t lo = r * fg.shard, hi = std::min(lo + fg.shard, fg.numel);
        for (size_t j = 0; j < fg.params.size(); ++j) {
          const size_t i = fg.params[j];
          const int64_t s = std::max(lo, fg.offset[j]),
                        e = std::min(hi, fg.offset[j] + params[i].numel());
          if (s < e) {
            out[i]
                .back()
                .view({-1})
                .slice(0, s - fg.offset[j], e - fg.offset[j])
                .copy_(piece.slice(0, s - lo, e - lo));
          }
        }
      }
    }
  }
  nn::StateDict state;
  if (rank != to) return state;
  // In a plain optimizer's order: parameter by parameter, each one's kinds in its order.
  std::vector<size_t> group_of(params.size(), groups.size());
  for (size_t g = 0; g < groups.size(); ++g)
    for (size_t i : groups[g].params) group_of[i] = g;
  for (size_t i = 0; i < params.size(); ++i) {
    if (group_of[i] == groups.size()) continue;
    const auto& kinds = per_group[group_of[i]];
    for (size_t k = 0; k < out[i].size(); ++k)
      state.insert(state_key(i, kinds[k].first), out[i][k]);
  }
  return state;
}

nn::StateDict shard_optimizer_state(const nn::StateDict& full, const std::vector<Tensor>& params,
                                    const std::vector<FlatGroup>& groups, int rank, int world,
                                    const std::string& who, const std::string& word) {
  NoGradGuard no_grad;
  auto entry = [&](size_t i, const std::string& name) -> const Tensor* {
    return full.find(state_key(i, name));
  };
  // The state kinds, in their first appearance's order.
  std::vector<std::string> kinds;
  for (const auto& [key, t] : full) {
    size_t i = 0;
    std::string name;
    TANDEM_CHECK(split_key(key, i, name), Value, who, ": '", key, "' is not state.<i>.<name>");
    TANDEM_CHECK(i < params.size(), Value, who, ": '", key, "' names parameter ", i, " of ",
                 params.size());
    if (std::find(kinds.begin(), kinds.end(), name) == kinds.end()) kinds.push_back(name);
  }
  nn::StateDict local;
  for (size_t g = 0; g < groups.size(); ++g) {
    const FlatGroup& fg = groups[g];
    const size_t first = fg.params[0];
    const bool has = !kinds.empty() && entry(first, kinds.back()) != nullptr;
    for (size_t i : fg.params) {
      for (const std::string& name : kinds) {
        TANDEM_CHECK((entry(i, name) != nullptr) == has, Value, who, ": parameter ", i,
                     (has ? " lacks '" : " has '"), name, "' but parameter ", first,
                     " of the same ", word, " does not (the shard of a ", word,
                     " has state for all or none)");
      }
    }
    if (!has) continue;
    for (const std::string& name : kinds) {
      const std::string key = state_key(g, name);
      const Tensor& t0 = *entry(first, name);
      if (name == "step" ||
          (t0.dim() == 0 && params[first].dim() != 0)) {  // a count: one per shard
        const double v = t0.to(kCPU).to(kFloat64).item();
        for (size_t i : fg.params) {
          const double vi = entry(i, name)->to(kCPU).to(kFloat64).item();
          TANDEM_CHECK(vi == v, Value, who, ": '", state_key(i, name), "' is ", vi, " but '",
                       state_key(first, name), "' of the same ", word, " is ", v);
        }
        local.insert(key, t0.clone());
        continue;
      }
      Tensor flat = zeros({fg.shard * world}, t0.dtype(), kCPU);
      for (size_t k = 0; k < fg.params.size(); ++k) {
        const Tensor& p = params[fg.params[k]];
        const Tensor& t = *entry(fg.params[k], name);
        TANDEM_CHECK(t.numel() == p.numel(), Shape, who, ": '", state_key(fg.params[k], name),
                     "' has ", t.numel(), " elements but the parameter has ", p.numel());
        flat.slice(0, fg.offset[k], fg.offset[k] + p.numel())
            .copy_(t.to(kCPU).contiguous().view({-1}));
      }
      local.insert(key, flat.slice(0, rank * fg.shard, (rank + 1) * fg.shard).clone());
    }
  }
  return local;
}

}  // namespace tandem::parallel::sharded
