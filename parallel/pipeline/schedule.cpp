#include "parallel/pipeline/schedule.h"

#include <algorithm>
#include <cctype>
#include <sstream>

#include "core/error.h"

namespace tandem::parallel::pipeline {

namespace {

void check_sizes(const char* who, int num_stages, int num_micro_batches) {
  TANDEM_CHECK(num_stages >= 1, Value, who, ": num_stages must be >= 1, got ", num_stages);
  TANDEM_CHECK(num_micro_batches >= 1, Value, who, ": num_micro_batches must be >= 1, got ",
               num_micro_batches);
}

Action fwd(int s, int m) {
  return {s, m, Action::Forward};
}
Action bwd(int s, int m) {
  return {s, m, Action::Backward};
}

}  // namespace

std::string Action::str() const {
  std::string out(1, kind == Forward ? 'F' : 'B');
  return out += std::to_string(micro_batch);
}

Schedule schedule_gpipe(int num_stages, int num_micro_batches) {
  check_sizes("schedule_gpipe", num_stages, num_micro_batches);
  Schedule out{"GPipe", num_stages, num_micro_batches, {}};
  out.actions.resize(static_cast<size_t>(num_stages));
  for (int s = 0; s < num_stages; ++s) {
    for (int m = 0; m < num_micro_batches; ++m) out.actions[s].push_back(fwd(s, m));
    for (int m = 0; m < num_micro_batches; ++m) out.actions[s].push_back(bwd(s, m));
  }
  return out;
}

Schedule schedule_1f1b(int num_stages, int num_micro_batches) {
  check_sizes("schedule_1f1b", num_stages, num_micro_batches);
  Schedule out{"1F1B", num_stages, num_micro_batches, {}};
  out.actions.resize(static_cast<size_t>(num_stages));
  const int m_total = num_micro_batches;
  for (int s = 0; s < num_stages; ++s) {
    auto& list = out.actions[s];
    const int warmup = std::min(num_stages - 1 - s, m_total);
    int next_f = 0, next_b = 0;
    while (next_f < warmup) list.push_back(fwd(s, next_f++));
    // Steady state: the forward of the next micro-batch, then the backward of the oldest one
    // held (Note [1F1B in-flight bound]).
    while (next_f < m_total) {
      list.push_back(fwd(s, next_f++));
      list.push_back(bwd(s, next_b++));
    }
    while (next_b < m_total) list.push_back(bwd(s, next_b++));  // cool-down
  }
  return out;
}

Schedule schedule_by_name(const std::string& name, int num_stages, int num_micro_batches) {
  std::string n = name;
  for (char& c : n) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (n == "gpipe") return schedule_gpipe(num_stages, num_micro_batches);
  if (n == "1f1b") return schedule_1f1b(num_stages, num_micro_batches);
  TANDEM_THROW(Value, "pipeline schedule '", name, "': expected gpipe or 1f1b");
}

void check_schedule(const Schedule& schedule) {
  const int P = schedule.num_stages, M = schedule.num_micro_batches;
  check_sizes(("check_schedule(" + schedule.name + ")").c_str(), P, M);
  TANDEM_CHECK(static_cast<int>(schedule.actions.size()) == P, Value, "schedule ", schedule.name,
               ": ", schedule.actions.size(), " action lists for ", P, " stages");
  for (int s = 0; s < P; ++s) {
    std::vector<int> forwards(static_cast<size_t>(M), 0), backwards(static_cast<size_t>(M), 0);
    for (const Action& a : schedule.actions[s]) {
      TANDEM_CHECK(a.stage == s, Value, "schedule ", schedule.name, ": stage ", s, "'s list holds ",
                   a.str(), " of stage ", a.stage);
      TANDEM_CHECK(a.micro_batch >= 0 && a.micro_batch < M, Value, "schedule ", schedule.name,
                   ": stage ", s, " has ", a.str(), " but there are ", M, " micro-batches");
      if (a.kind == Action::Forward) {
        TANDEM_CHECK(++forwards[a.micro_batch] == 1, Value, "schedule ", schedule.name, ": stage ",
                     s, " runs ", a.str(), " twice");
      } else {
        TANDEM_CHECK(forwards[a.micro_batch] == 1, Value, "schedule ", schedule.name, ": stage ", s,
                     " runs ", a.str(), " before its forward");
        TANDEM_CHECK(++backwards[a.micro_batch] == 1, Value, "schedule ", schedule.name, ": stage ",
                     s, " runs ", a.str(), " twice");
      }
    }
    for (int m = 0; m < M; ++m) {
      TANDEM_CHECK(backwards[m] == 1, Value, "schedule ", schedule.name, ": stage ", s,
                   " never runs ", (forwards[m] ? bwd(s, m) : fwd(s, m)).str());
    }
  }
  simulate(schedule);  // throws on a deadlock
}

std::vector<std::vector<int>> simulate(const Schedule& schedule, int forward_cost,
                                       int backward_cost) {
  const int P = schedule.num_stages, M = schedule.num_micro_batches;
  TANDEM_CHECK(forward_cost >= 1 && backward_cost >= 1, Value, "simulate: costs must be >= 1, got ",
               forward_cost, " and ", backward_cost);
  TANDEM_CHECK(static_cast<int>(schedule.actions.size()) == P, Value, "simulate: schedule ",
               schedule.name, " has ", schedule.actions.size(), " action lists for ", P, " stages");
  // end[kind][s][m]: when that action finishes, -1 while it has not run.
  std::vector<std::vector<std::vector<int>>> end(
      2, std::vector<std::vector<int>>(P, std::vector<int>(static_cast<size_t>(M), -1)));
  std::vector<std::vector<int>> start(P);
  std::vector<size_t> next(P, 0);
  std::vector<int> free_at(P, 0);
  // Each pass runs, on every stage, as many actions as have their dependencies met; an action
  // starts when both its stage and its inputs are ready, so the pass order does not matter.
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {
      while (next[s] < schedule.actions[s].size()) {
        const Action& a = schedule.actions[s][next[s]];
        int ready = free_at[s];
        if (a.kind == Action::Forward) {
          if (s > 0) ready = std::max(ready, end[Action::Forward][s - 1][a.micro_batch]);
          if (s > 0 && end[Action::Forward][s - 1][a.micro_batch] < 0) break;
        } else {
          const int own = end[Action::Forward][s][a.micro_batch];
          const int from_next = s + 1 < P ? end[Action::Backward][s + 1][a.micro_batch] : 0;
          if (own < 0 || from_next < 0) break;
          ready = std::max({ready, own, from_next});
        }
        start[s].push_back(ready);
        free_at[s] = ready + (a.kind == Action::Forward ? forward_cost : backward_cost);
        end[a.kind][s][a.micro_batch] = free_at[s];
        ++next[s];
        progress = true;
      }
    }
  }
  std::string stuck;
  for (int s = 0; s < P; ++s) {
    if (next[s] < schedule.actions[s].size()) {
      stuck += detail::str(stuck.empty() ? "" : ", ", "stage ", s, " at ",
                           schedule.actions[s][next[s]].str());
    }
  }
  TANDEM_CHECK(stuck.empty(), Value, "schedule ", schedule.name, " deadlocks: ", stuck,
               " wait for each other");
  return start;
}

int makespan(const Schedule& schedule, int forward_cost, int backward_cost) {
  const auto start = simulate(schedule, forward_cost, backward_cost);
  int last = 0;
  for (size_t s = 0; s < start.size(); ++s) {
    for (size_t i = 0; i < start[s].size(); ++i) {
      const bool f = schedule.actions[s][i].kind == Action::Forward;
      last = std::max(last, start[s][i] + (f ? forward_cost : backward_cost));
    }
  }
  return last;
}

int max_in_flight(const Schedule& schedule, int stage) {
  TANDEM_CHECK(stage >= 0 && stage < static_cast<int>(schedule.actions.size()), Value,
               "max_in_flight: stage ", stage, " of a schedule with ", schedule.actions.size(),
               " stages");
  int held = 0, most = 0;
  for (const Action& a : schedule.actions[stage]) {
    held += a.kind == Action::Forward ? 1 : -1;
    most = std::max(most, held);
  }
  return most;
}

double bubble_fraction(int num_stages, int num_micro_batches) {
  check_sizes("bubble_fraction", num_stages, num_micro_batches);
  return double(num_stages - 1) / double(num_micro_batches + num_stages - 1);
}

std::string format_schedule(const Schedule& schedule) {
  const auto start = simulate(schedule);
  int steps = 0;
  for (const auto& s : start) {
    for (int t : s) steps = std::max(steps, t + 1);
  }
  const size_t P = start.size();
  std::vector<std::vector<std::string>> cell(static_cast<size_t>(steps),
                                             std::vector<std::string>(P));
  for (size_t s = 0; s < P; ++s) {
    for (size_t i = 0; i < start[s].size(); ++i)
      cell[start[s][i]][s] = schedule.actions[s][i].str();
  }
  std::ostringstream os;
  auto pad = [](std::string x, size_t w) { return x.append(w > x.size() ? w - x.size() : 0, ' '); };
  std::string line = "step";
  for (size_t s = 0; s < P; ++s) line += "  " + pad("stage " + std::to_string(s), 7);
  while (!line.empty() && line.back() == ' ') line.pop_back();
  os << line << '\n';
  for (int t = 0; t < steps; ++t) {
    std::string num = std::to_string(t);
    line = std::string(4 - std::min<size_t>(4, num.size()), ' ') + num;
    for (size_t s = 0; s < P; ++s) line += "  " + pad(cell[t][s], 7);
    while (!line.empty() && line.back() == ' ') line.pop_back();
    os << line << '\n';
  }
  return os.str();
}

}  // namespace tandem::parallel::pipeline
