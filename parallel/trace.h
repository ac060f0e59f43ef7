#pragma once
// Trace: a per-step timeline of compute and communication on every device, written as
// Chrome trace JSON that chrome://tracing and Perfetto (ui.perfetto.dev) open.
//
// A span is a pair of timing events recorded on a stream: on a GPU they measure when the
// device actually ran the work (not when the host enqueued it), on a CPU device they are
// host timestamps. Recording costs two event records per span and never synchronizes; only
// json()/write() wait for the events.
//
//   Trace trace(devices);
//   { auto s = trace.span(devices[0], "forward+backward"); ...enqueue work... }
//   { auto s = Trace::scoped(maybe_null_trace, devices[0], "optimizer"); ... }
//   trace.write("step.json");
//
// In the output, one process per device (pid = the device's position in the list, named
// "cuda:1"), one thread per track (tid, named "compute", "comm", ...), one "X" event per span.
// Spans may be opened from any thread (the device workers do).
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/stream.h"

namespace tandem::parallel {

class Trace {
  struct Record {
    size_t rank;
    std::string name, track;
    Event start{true}, end{true};
  };

 public:
  // Synchronizes the devices once and records a time origin on each.
  explicit Trace(std::vector<Device> devices);
  // One process of a multi-process job: its device appears as pid `pid` named `name` ("rank 1
  // cpu"), and times are microseconds of the host's monotonic clock, which every process of a
  // machine shares — so the files of all ranks merge into one timeline by concatenating their
  // events (bench/plot_trace.py does).
  Trace(Device device, int pid, std::string name);

  // Records its end event when destroyed (or at end()).
  class Span {
   public:
    Span() = default;
    Span(Span&& o) noexcept : record_(o.record_), stream_(o.stream_) { o.record_ = nullptr; }
    Span& operator=(Span&& o) noexcept;
    ~Span() { end(); }
    void end();

   private:
    friend class Trace;
    Span(Record* r, Stream s) : record_(r), stream_(s) {}
    Record* record_ = nullptr;
    Stream stream_;
  };

  // A span on the calling thread's current stream of `device` (a device of this trace).
  Span span(Device device, std::string name, std::string track = "compute");
  // A span on an explicit stream.
  Span span(Stream stream, std::string name, std::string track);
  // trace->span(device, name, track), or a span that records nothing (and costs nothing but
  // a null check) when trace is null: code that traces only on request stays one line,
  //   auto span = Trace::scoped(trace_, device, "optimizer");
  static Span scoped(Trace* trace, Device device, std::string_view name, std::string_view track = "compute");
  // A finished span from two events already recorded (timing enabled) on `device`, e.g. by a
  // communication thread or stream that knows when its work really ran.
  void add(Device device, std::string name, std::string track, Event start, Event end);

  // {"traceEvents": [...]}, times in microseconds from the trace's origin. Waits for the
  // events of finished spans; spans still open are left out.
  std::string json() const;
  // Writes json() to path (IOError naming it on failure).
  void write(const std::string& path) const;
  size_t size() const;
  const std::vector<Device>& devices() const { return devices_; }

 private:
  size_t rank_of(Device d) const;

  std::vector<Device> devices_;
  std::vector<Event> origin_;  // per device
  // Multi-process form: pid and name of the one device, and the origin's host clock time.
  int pid_ = -1;
  std::string name_;
  double origin_host_us_ = 0;
  mutable std::mutex mu_;
  std::deque<Record> records_;  // a deque: Span keeps a pointer, push_back must not move it
};

// Writes one Chrome-trace file from several json() texts (the ranks of a multi-process job,
// each with its own pids): their events, concatenated. IOError naming the path on failure;
// FormatError for a text that is not a json() of this class.
void write_merged_trace(const std::string& path, const std::vector<std::string>& jsons);

}  // namespace tandem::parallel
