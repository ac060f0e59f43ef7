// Pipeline schedules as data: the exact action lists of GPipe and 1F1B against hand-written
// tables, the time steps the simulator gives them, the in-flight bound of 1F1B, the bubble
// formula, and clear errors for bad sizes and orders that cannot run.
#include <string>
#include <vector>

#include "catch.h"
#include "core/error.h"
#include "helpers.h"
#include "parallel/pipeline/schedule.h"

using namespace tandem;
using namespace tandem::parallel::pipeline;

namespace {

// A stage's list as "F0 F1 B0 B1".
std::string row(const Schedule& s, int stage) {
  std::string out;
  for (const Action& a : s.actions[stage]) out += (out.empty() ? "" : " ") + a.str();
  return out;
}

std::vector<std::string> rows(const Schedule& s) {
  std::vector<std::string> out;
  for (int st = 0; st < s.num_stages; ++st) out.push_back(row(s, st));
  return out;
}

using Rows = std::vector<std::string>;

}  // namespace

TEST_CASE("GPipe runs every forward then every backward", "[parallel][pipeline]") {
  CHECK(rows(schedule_gpipe(2, 2)) == Rows{"F0 F1 B0 B1", "F0 F1 B0 B1"});
  CHECK(rows(schedule_gpipe(3, 1)) == Rows{"F0 B0", "F0 B0", "F0 B0"});
  CHECK(rows(schedule_gpipe(1, 3)) == Rows{"F0 F1 F2 B0 B1 B2"});
  const Schedule s = schedule_gpipe(4, 3);
  CHECK(s.name == "GPipe");
  CHECK(s.num_stages == 4);
  CHECK(s.num_micro_batches == 3);
  for (int st = 0; st < 4; ++st) {
    CHECK(row(s, st) == "F0 F1 F2 B0 B1 B2");
    for (const Action& a : s.actions[st]) CHECK(a.stage == st);
  }
}

TEST_CASE("1F1B: warm-up forwards then one forward one backward then cool-down",
          "[parallel][pipeline]") {
  CHECK(rows(schedule_1f1b(2, 2)) == Rows{"F0 F1 B0 B1", "F0 B0 F1 B1"});
  CHECK(rows(schedule_1f1b(2, 4)) == Rows{"F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"});
  CHECK(rows(schedule_1f1b(3, 4)) == Rows{"F0 F1 F2 B0 F3 B1 B2 B3",  //
                                          "F0 F1 B0 F2 B1 F3 B2 B3",  //
                                          "F0 B0 F1 B1 F2 B2 F3 B3"});
  CHECK(rows(schedule_1f1b(4, 8)) == Rows{"F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
                                          "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
                                          "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
                                          "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"});
  // Fewer micro-batches than stages: the warm-up is cut to M, so the early stages are GPipe.
  CHECK(rows(schedule_1f1b(4, 2)) ==
        Rows{"F0 F1 B0 B1", "F0 F1 B0 B1", "F0 F1 B0 B1", "F0 B0 F1 B1"});
  CHECK(rows(schedule_1f1b(3, 1)) == Rows{"F0 B0", "F0 B0", "F0 B0"});
  CHECK(schedule_1f1b(3, 1).name == "1F1B");
}

TEST_CASE("the simulator puts each action at the textbook time step", "[parallel][pipeline]") {
  CHECK(format_schedule(schedule_1f1b(2, 2)) ==
        "step  stage 0  stage 1\n"
        "   0  F0\n"
        "   1  F1       F0\n"
        "   2           B0\n"
        "   3  B0       F1\n"
        "   4           B1\n"
        "   5  B1\n");
  CHECK(format_schedule(schedule_gpipe(3, 2)) ==
        "step  stage 0  stage 1  stage 2\n"
        "   0  F0\n"
        "   1  F1       F0\n"
        "   2           F1       F0\n"
        "   3                    F1\n"
        "   4                    B0\n"
        "   5           B0       B1\n"
        "   6  B0       B1\n"
        "   7  B1\n");
  // Forward 1, backward 2 time units: stage 1 of 1F1B(2, 2) starts B0 at 1 + 1 and F1 at 2 + 2;
  // stage 0 starts B0 when stage 1's B0 ends (4) and B1 when stage 1's B1 ends (7).
  const auto t = simulate(schedule_1f1b(2, 2), 1, 2);
  CHECK(t == std::vector<std::vector<int>>{{0, 1, 4, 7}, {1, 2, 4, 5}});
}

TEST_CASE("1F1B holds at most P - s micro-batches on stage s and GPipe all M with the same bubble",
          "[parallel][pipeline]") {
  for (int P = 1; P <= 5; ++P) {
    for (int M = 1; M <= 9; ++M) {
      const Schedule g = schedule_gpipe(P, M), f = schedule_1f1b(P, M);
      INFO("P " << P << " M " << M);
      check_schedule(g);
      check_schedule(f);
      for (int s = 0; s < P; ++s) {
        CHECK(max_in_flight(g, s) == M);
        CHECK(max_in_flight(f, s) == std::min(P - s, M));
      }
      // Unit costs: each stage works 2M of 2(M + P - 1) steps, idle (P-1)/(M+P-1) of the time.
      CHECK(makespan(g) == 2 * (M + P - 1));
      CHECK(makespan(f) == 2 * (M + P - 1));
      const double idle = 1.0 - 2.0 * M / makespan(f);
      CHECK(std::abs(idle - bubble_fraction(P, M)) < 1e-12);
      // A backward twice as long as a forward: (M + P - 1) (1 + 2) for both.
      CHECK(makespan(g, 1, 2) == 3 * (M + P - 1));
      CHECK(makespan(f, 1, 2) == 3 * (M + P - 1));
    }
  }
  CHECK(bubble_fraction(4, 8) == Approx(3.0 / 11.0));
  CHECK(bubble_fraction(1, 1) == 0.0);
}

TEST_CASE("pipeline schedules: bad sizes and orders are clear errors", "[parallel][pipeline]") {
  CHECK(test::contains(test::error_message<ValueError>([] { schedule_gpipe(0, 4); }),
                       "schedule_gpipe: num_stages must be >= 1, got 0"));
  CHECK(test::contains(test::error_message<ValueError>([] { schedule_1f1b(2, 0); }),
                       "schedule_1f1b: num_micro_batches must be >= 1, got 0"));
  CHECK(test::contains(test::error_message<ValueError>([] { schedule_1f1b(-1, 2); }), "got -1"));
  CHECK(test::contains(test::error_message<ValueError>([] { bubble_fraction(2, 0); }), "got 0"));
  CHECK(test::contains(test::error_message<ValueError>([] { schedule_by_name("zb", 2, 2); }),
                       "pipeline schedule 'zb': expected gpipe or 1f1b"));
  CHECK(schedule_by_name("GPipe", 2, 3).name == "GPipe");

  // Stage 1 waits for F1 of stage 0, which waits for B0 of stage 1, which comes after F1.
  Schedule dead = schedule_1f1b(2, 2);
  dead.actions[0] = {{0, 0, Action::Forward},
                     {0, 0, Action::Backward},
                     {0, 1, Action::Forward},
                     {0, 1, Action::Backward}};
  dead.actions[1] = {{1, 1, Action::Forward},
                     {1, 0, Action::Forward},
                     {1, 0, Action::Backward},
                     {1, 1, Action::Backward}};
  const std::string msg = test::error_message<ValueError>([&] { check_schedule(dead); });
  CHECK(test::contains(msg, "deadlocks: stage 0 at B0, stage 1 at F1"));

  Schedule early = schedule_gpipe(2, 1);
  std::swap(early.actions[1][0], early.actions[1][1]);
  CHECK(test::contains(test::error_message<ValueError>([&] { check_schedule(early); }),
                       "stage 1 runs B0 before its forward"));
  Schedule missing = schedule_gpipe(2, 2);
  missing.actions[0].pop_back();
  CHECK(test::contains(test::error_message<ValueError>([&] { check_schedule(missing); }),
                       "stage 0 never runs B1"));
  Schedule wrong = schedule_gpipe(2, 1);
  wrong.actions[0][0].stage = 1;
  CHECK(test::contains(test::error_message<ValueError>([&] { check_schedule(wrong); }),
                       "stage 0's list holds F0 of stage 1"));
}
