#include "parallel/trace.h"

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>

#include "core/error.h"
#include "parallel/device_api.h"

namespace tandem::parallel {

namespace {
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) out += c;
  }
  return out + "\"";
}
}  // namespace

Trace::Trace(std::vector<Device> devices) : devices_(std::move(devices)) {
  check_device_list(devices_, "Trace");
  // One synchronization so that the origins of all devices are the same moment.
  synchronize(devices_);
  for (Device d : devices_) {
    origin_.emplace_back(true);
    origin_.back().record(current_stream(d));
  }
}

Trace::Trace(Device device, int pid, std::string name) : Trace(std::vector<Device>{device}) {
  pid_ = pid;
  name_ = std::move(name);
  origin_host_us_ = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Trace::add(Device device, std::string name, std::string track, Event start, Event end) {
  const size_t rank = rank_of(device);
  std::lock_guard<std::mutex> lock(mu_);
  Record& r = records_.emplace_back();
  r.rank = rank;
  r.name = std::move(name);
  r.track = std::move(track);
  r.start = std::move(start);
  r.end = std::move(end);
}

size_t Trace::rank_of(Device d) const {
  for (size_t r = 0; r < devices_.size(); ++r) {
    if (devices_[r] == d) return r;
  }
  TANDEM_THROW(Device, "Trace: ", d.str(), " is not one of the traced devices ",
               devices_str(devices_));
}

Trace::Span Trace::span(Device device, std::string name, std::string track) {
  return span(current_stream(device), std::move(name), std::move(track));
}

Trace::Span Trace::span(Stream stream, std::string name, std::string track) {
  const size_t rank = rank_of(stream.device());
  Record* r;
  {
    std::lock_guard<std::mutex> lock(mu_);
    r = &records_.emplace_back();
    r->rank = rank;
    r->name = std::move(name);
    r->track = std::move(track);
  }
  r->start.record(stream);
  return Span(r, stream);
}

Trace::Span Trace::scoped(Trace* trace, Device device, std::string_view name, std::string_view track) {
  if (trace == nullptr) return Span();
  return trace->span(device, std::string(name), std::string(track));
}

Trace::Span& Trace::Span::operator=(Span&& o) noexcept {
  if (this != &o) {
    end();
    record_ = o.record_;
    stream_ = o.stream_;
    o.record_ = nullptr;
  }
  return *this;
}

void Trace::Span::end() {
  if (!record_) return;
  try {
    record_->end.record(stream_);
  } catch (const std::exception& e) {
    TANDEM_LOG_ERROR("Trace span '", record_->name, "': ", e.what());
  }
  record_ = nullptr;
}

size_t Trace::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return records_.size();
}

std::string Trace::json() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::ostringstream os;
  os.precision(3);
  os << std::fixed << "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n";
  bool first = true;
  auto sep = [&] {
    if (!first) os << ",\n";
    first = false;
  };
  std::map<std::pair<size_t, std::string>, int> tids;  // (rank, track) -> tid
  auto pid = [&](size_t r) { return pid_ >= 0 ? static_cast<size_t>(pid_) : r; };
  for (size_t r = 0; r < devices_.size(); ++r) {
    sep();
    os << "{\"name\": \"process_name\", \"ph\": \"M\", \"pid\": " << pid(r)
       << ", \"args\": {\"name\": " << quoted(pid_ >= 0 ? name_ : devices_[r].str()) << "}}";
  }
  for (const Record& rec : records_) {
    if (!rec.end.recorded()) continue;
    auto [it, inserted] = tids.try_emplace({rec.rank, rec.track}, static_cast<int>(tids.size()) + 1);
    if (inserted) {
      sep();
      os << "{\"name\": \"thread_name\", \"ph\": \"M\", \"pid\": " << pid(rec.rank)
         << ", \"tid\": " << it->second << ", \"args\": {\"name\": " << quoted(rec.track) << "}}";
    }
    const double start_us = origin_host_us_ + 1000.0 * origin_[rec.rank].elapsed_ms(rec.start);
    const double end_us = origin_host_us_ + 1000.0 * origin_[rec.rank].elapsed_ms(rec.end);
    sep();
    os << "{\"name\": " << quoted(rec.name) << ", \"ph\": \"X\", \"pid\": " << pid(rec.rank)
       << ", \"tid\": " << it->second << ", \"ts\": " << start_us
       << ", \"dur\": " << (end_us - start_us) << "}";
  }
  os << "\n]}\n";
  return os.str();
}

namespace {
void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  TANDEM_CHECK(out.good(), IO, "Trace: cannot open '", path, "' for writing");
  out << text;
  TANDEM_CHECK(out.good(), IO, "Trace: writing '", path, "' failed");
}
}  // namespace

void Trace::write(const std::string& path) const { write_text(path, json()); }

void write_merged_trace(const std::string& path, const std::vector<std::string>& jsons) {
  std::string events;
  for (size_t i = 0; i < jsons.size(); ++i) {
    const std::string& j = jsons[i];
    const size_t open = j.find('['), close = j.rfind(']');
    TANDEM_CHECK(open != std::string::npos && close != std::string::npos && open < close, Format,
                 "write_merged_trace: part ", i, " is not a trace (no traceEvents array)");
    std::string inner = j.substr(open + 1, close - open - 1);
    while (!inner.empty() && (inner.back() == '\n' || inner.back() == ' ')) inner.pop_back();
    while (!inner.empty() && (inner.front() == '\n' || inner.front() == ' ')) inner.erase(0, 1);
    if (inner.empty()) continue;
    events += (events.empty() ? "" : ",\n") + inner;
  }
  write_text(path, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n" + events + "\n]}\n");
}

}  // namespace tandem::parallel
