#pragma once
// OrderedDict: string keys in insertion order, with lookup by key. Modules keep their
// parameters, buffers and children in these, and state_dict() is one, so every listing
// (parameters(), named_parameters(), state_dict()) has a deterministic order.
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"

namespace tandem::nn {

template <typename V>
class OrderedDict {
 public:
  using Item = std::pair<std::string, V>;

  OrderedDict() = default;
  OrderedDict(std::initializer_list<Item> items) {
    for (const auto& it : items) insert(it.first, it.second);
  }

  // Appends key -> value; throws ValueError when the key is already there.
  V& insert(const std::string& key, V value) {
    TANDEM_CHECK(!contains(key), Value, "OrderedDict: duplicate key '", key, "'");
    index_.emplace(key, items_.size());
    items_.emplace_back(key, std::move(value));
    return items_.back().second;
  }
  // Appends or overwrites.
  V& insert_or_assign(const std::string& key, V value) {
    if (V* v = find(key)) return *v = std::move(value);
    return insert(key, std::move(value));
  }

  V* find(const std::string& key) {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &items_[it->second].second;
  }
  const V* find(const std::string& key) const {
    auto it = index_.find(key);
    return it == index_.end() ? nullptr : &items_[it->second].second;
  }
  bool contains(const std::string& key) const { return index_.count(key) != 0; }
  // Throws ValueError naming the key when it is absent.
  V& at(const std::string& key) {
    V* v = find(key);
    TANDEM_CHECK(v != nullptr, Value, "OrderedDict: no key '", key, "'");
    return *v;
  }
  const V& at(const std::string& key) const {
    const V* v = find(key);
    TANDEM_CHECK(v != nullptr, Value, "OrderedDict: no key '", key, "'");
    return *v;
  }

  // Positional access in insertion order.
  Item& item(size_t i) {
    TANDEM_CHECK(i < items_.size(), Value, "OrderedDict: index ", i, " out of range (size ",
                 items_.size(), ")");
    return items_[i];
  }
  const Item& item(size_t i) const {
    TANDEM_CHECK(i < items_.size(), Value, "OrderedDict: index ", i, " out of range (size ",
                 items_.size(), ")");
    return items_[i];
  }

  std::vector<std::string> keys() const {
    std::vector<std::string> out;
    out.reserve(items_.size());
    for (const auto& it : items_) out.push_back(it.first);
    return out;
  }
  std::vector<V> values() const {
    std::vector<V> out;
    out.reserve(items_.size());
    for (const auto& it : items_) out.push_back(it.second);
    return out;
  }

  size_t size() const { return items_.size(); }
  bool empty() const { return items_.empty(); }
  void clear() {
    items_.clear();
    index_.clear();
  }

  auto begin() { return items_.begin(); }
  auto end() { return items_.end(); }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 private:
  std::vector<Item> items_;
  std::unordered_map<std::string, size_t> index_;
};

}  // namespace tandem::nn
