// operator<< for tensors, in PyTorch's format (torch/_tensor_str.py): the formatter's choice
// of fixed, integer or scientific notation over the printed values, summarization beyond
// 1000 elements, lines wrapped at 80 columns, and the device / dtype / requires_grad suffix.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <sstream>

#include "core/tensor.h"

namespace tandem {

namespace {

constexpr int64_t kThreshold = 1000;  // PyTorch's print options
constexpr int64_t kEdgeItems = 3;
constexpr int64_t kLineWidth = 80;
constexpr int kPrecision = 4;

std::string printf_str(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), fmt, v);
  return buf;
}

// Python's str() of a non-finite float: "nan", "inf", "-inf" (glibc may write "-nan").
std::string nonfinite_str(double v) { return std::isnan(v) ? "nan" : v > 0 ? "inf" : "-inf"; }

// PyTorch's _Formatter: one width and notation for all the printed values.
class Formatter {
 public:
  Formatter(const std::vector<double>& values, bool floating) : floating_(floating) {
    if (!floating_) {
      for (double v : values) width_ = std::max(width_, printf_str("%.0f", v).size());
      return;
    }
    std::vector<double> finite;  // the nonzero finite values
    for (double v : values) {
      if (std::isfinite(v) && v != 0) finite.push_back(v);
      if (!std::isfinite(v)) width_ = std::max(width_, nonfinite_str(v).size());
    }
    if (finite.empty()) return;
    double lo = std::abs(finite[0]), hi = lo;
    for (double v : finite) {
      lo = std::min(lo, std::abs(v));
      hi = std::max(hi, std::abs(v));
      if (v != std::ceil(v)) int_mode_ = false;
    }
    sci_ = hi / lo > 1000.0 || hi > 1.0e8 || (!int_mode_ && lo < 1.0e-4);
    for (double v : finite) {
      const size_t w = sci_ ? printf_str("%.4e", v).size()
                       : int_mode_ ? printf_str("%.0f", v).size() + 1
                                   : printf_str("%.4f", v).size();
      width_ = std::max(width_, w);
    }
  }

  size_t width() const { return width_; }

  std::string format(double v) const {
    std::string s;
    if (!floating_) {
      s = printf_str("%.0f", v);
    } else if (!std::isfinite(v)) {
      s = nonfinite_str(v);
    } else if (sci_) {
      s = printf_str("%.4e", v);
    } else if (int_mode_) {
      s = printf_str("%.0f", v) + ".";
    } else {
      s = printf_str("%.4f", v);
    }
    return std::string(width_ > s.size() ? width_ - s.size() : 0, ' ') + s;
  }

 private:
  bool floating_;
  bool int_mode_ = true;
  bool sci_ = false;
  size_t width_ = 1;
};

// The values as doubles, row-major, on the host: int64 beyond 2^53 would round, which
// matters only for printing such a value.
struct HostValues {
  Shape shape;
  std::vector<double> v;
  double at(const std::vector<int64_t>& idx) const {
    int64_t off = 0;
    for (size_t d = 0; d < shape.size(); ++d) off = off * shape[d] + idx[d];
    return v[static_cast<size_t>(off)];
  }
};

// Indices printed along a dim of size n: all of them, or the edge items around a gap (-1).
std::vector<int64_t> printed(int64_t n, bool summarize) {
  std::vector<int64_t> out;
  if (summarize && n > 2 * kEdgeItems) {
    for (int64_t i = 0; i < kEdgeItems; ++i) out.push_back(i);
    out.push_back(-1);
    for (int64_t i = n - kEdgeItems; i < n; ++i) out.push_back(i);
  } else {
    for (int64_t i = 0; i < n; ++i) out.push_back(i);
  }
  return out;
}

// The values that get printed (PyTorch's get_summarized_data), for the formatter.
void collect(const HostValues& h, std::vector<int64_t>& idx, size_t d, bool summarize,
             std::vector<double>& out) {
  if (d == h.shape.size()) {
    out.push_back(h.at(idx));
    return;
  }
  for (int64_t i : printed(h.shape[d], summarize)) {
    if (i < 0) continue;
    idx[d] = i;
    collect(h, idx, d + 1, summarize, out);
  }
}

std::string tensor_str(const HostValues& h, std::vector<int64_t>& idx, size_t d, int64_t indent,
                       bool summarize, const Formatter& f) {
  const size_t nd = h.shape.size();
  std::vector<std::string> parts;
  if (d + 1 == nd) {  // a vector: items wrapped into lines
    for (int64_t i : printed(h.shape[d], summarize)) {
      if (i < 0) {
        parts.push_back(" ...");
        continue;
      }
      idx[d] = i;
      parts.push_back(f.format(h.at(idx)));
    }
    const int64_t per_line =
        std::max<int64_t>(1, (kLineWidth - indent) / static_cast<int64_t>(f.width() + 2));
    std::string out = "[";
    for (size_t i = 0; i < parts.size(); ++i) {
      if (i > 0 && i % static_cast<size_t>(per_line) == 0) {
        out.append(",\n").append(static_cast<size_t>(indent + 1), ' ');
      } else if (i > 0) {
        out += ", ";
      }
      out += parts[i];
    }
    out += "]";
    return out;
  }
  for (int64_t i : printed(h.shape[d], summarize)) {
    if (i < 0) {
      parts.push_back("...");
      continue;
    }
    idx[d] = i;
    parts.push_back(tensor_str(h, idx, d + 1, indent + 1, summarize, f));
  }
  std::string sep = ",";
  sep.append(nd - d - 1, '\n').append(static_cast<size_t>(indent + 1), ' ');
  std::string out = "[";
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += sep;
    out += parts[i];
  }
  out += "]";
  return out;
}

}  // namespace

std::string repr(const Tensor& t) {
  if (!t.defined()) return "[ Tensor (undefined) ]";
  HostValues h{t.shape(), t.numel() == 0 ? std::vector<double>{} : t.to_vector<double>()};
  const bool summarize = t.numel() > kThreshold;
  const bool floating = is_floating(t.dtype());
  const int64_t indent = 7;  // "tensor("
  std::string body;
  if (t.numel() == 0) {
    body = "[]";
  } else {
    std::vector<double> shown;
    std::vector<int64_t> idx(h.shape.size(), 0);
    collect(h, idx, 0, summarize, shown);
    const Formatter f(shown, floating);
    body = t.dim() == 0 ? f.format(h.v[0]) : tensor_str(h, idx, 0, indent, summarize, f);
  }
  std::string out = "tensor(" + body;
  if (t.numel() == 0 && t.dim() != 1) {  // PyTorch's ", size=(0, 3)"
    out += ", size=(";
    for (int64_t d = 0; d < t.dim(); ++d) out += (d > 0 ? ", " : "") + std::to_string(t.size(d));
    out += t.dim() == 1 ? ",)" : ")";
  }
  if (!(t.device().is_cpu() && t.device().index == 0)) out += ", device='" + t.device().str() + "'";
  if (t.dtype() != kFloat32 && t.dtype() != kInt64) {
    out += std::string(", dtype=torch.") + dtype_name(t.dtype());
  }
  if (t.requires_grad()) out += ", requires_grad=True";
  return out + ")";
}

std::ostream& operator<<(std::ostream& out, const Tensor& t) { return out << repr(t); }

}  // namespace tandem
