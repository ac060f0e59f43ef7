#pragma once
// Pipeline schedules as data: which stage runs which micro-batch's forward or backward, in
// what order (PyTorch's torch.distributed.pipelining ScheduleGPipe and Schedule1F1B).
//
// A schedule is nothing but one ordered list of actions per stage. The executor
// (parallel/pipeline/pipeline.h) runs any such list; how activations travel between stages is
// not the schedule's business, so the same list later drives one process per stage.
//
//   Schedule s = schedule_1f1b(/*num_stages=*/4, /*num_micro_batches=*/8);
//   std::printf("%s", format_schedule(s).c_str());   // one column per stage, one row per step
//
// Dependencies an action has (what simulate() and the executor wait for):
//   F(s, m) needs F(s-1, m)'s output          (s > 0)
//   B(s, m) needs B(s+1, m)'s input gradient  (s < P-1), and F(s, m) earlier on stage s
// Note [1F1B in-flight bound]: on stage s, 1F1B runs min(P-1-s, M) warm-up forwards, then
// alternates one forward and one backward, then drains the remaining backwards; so at most
// P - s micro-batches have run forward but not yet backward on stage s, whatever M is, where
// GPipe holds all M. That count is the number of micro-batches' activations the stage keeps.
#include <string>
#include <vector>

namespace tandem::parallel::pipeline {

struct Action {
  enum Kind { Forward, Backward };
  int stage = 0;
  int micro_batch = 0;
  Kind kind = Forward;

  // "F3" or "B3" (the micro-batch; the stage is the column a table puts it in).
  std::string str() const;
  friend bool operator==(const Action& a, const Action& b) {
    return a.stage == b.stage && a.micro_batch == b.micro_batch && a.kind == b.kind;
  }
};

struct Schedule {
  std::string name;  // "GPipe", "1F1B"
  int num_stages = 0;
  int num_micro_batches = 0;
  std::vector<std::vector<Action>> actions;  // [stage] -> that stage's actions, in order
};

// All M forwards, then all M backwards (micro-batches in ascending order, as PyTorch's
// ScheduleGPipe). ValueError for num_stages < 1 or num_micro_batches < 1.
Schedule schedule_gpipe(int num_stages, int num_micro_batches);
// One-forward-one-backward (Note [1F1B in-flight bound]). ValueError as schedule_gpipe.
Schedule schedule_1f1b(int num_stages, int num_micro_batches);
// schedule_gpipe or schedule_1f1b by name ("gpipe", "1f1b", any case); ValueError naming the
// name otherwise.
Schedule schedule_by_name(const std::string& name, int num_stages, int num_micro_batches);

// Throws ValueError unless every stage s lists exactly one forward and one backward of every
// micro-batch, all with stage == s, the forward before the backward, and the schedule can run
// to the end (simulate() finds no deadlock). The message names the stage and action at fault.
void check_schedule(const Schedule& schedule);

// When each action starts, with every forward costing forward_cost and every backward
// backward_cost time units and a stage running one action at a time, as soon as its
// dependencies are met: start[s][i] for actions[s][i]. ValueError naming the stuck actions
// when the order deadlocks.
std::vector<std::vector<int>> simulate(const Schedule& schedule, int forward_cost = 1,
                                       int backward_cost = 1);
// The time the last action ends under simulate(schedule, forward_cost, backward_cost).
int makespan(const Schedule& schedule, int forward_cost = 1, int backward_cost = 1);
// The most micro-batches that have run forward but not backward on `stage` at any point of
// its list: the activations the stage must hold at once.
int max_in_flight(const Schedule& schedule, int stage);

// The idle fraction of a pipeline of p stages and m equal micro-batches, forward and backward
// each filling the pipe once: (p - 1) / (m + p - 1). ValueError for p < 1 or m < 1.
double bubble_fraction(int num_stages, int num_micro_batches);

// The schedule under unit costs as a table, one column per stage and one row per time step
// (idle steps blank), as PyTorch's _format_pipeline_order prints it:
//   step  stage 0  stage 1
//      0  F0
//      1  F1       F0
std::string format_schedule(const Schedule& schedule);

}  // namespace tandem::parallel::pipeline
