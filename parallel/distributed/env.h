#pragma once
// The environment contract: how a process learns its place in a job.
//
// torchrun's variables first, then OpenMPI's, then Slurm's, so the same program runs under
// tandem-run, torchrun, `mpirun -np 2 prog` and `srun prog` unchanged:
//
//   what              torchrun / tandem-run   OpenMPI                          Slurm
//   rank              RANK                    OMPI_COMM_WORLD_RANK             SLURM_PROCID
//   world size        WORLD_SIZE              OMPI_COMM_WORLD_SIZE             SLURM_NTASKS
//   local rank        LOCAL_RANK              OMPI_COMM_WORLD_LOCAL_RANK       SLURM_LOCALID
//   local world size  LOCAL_WORLD_SIZE        OMPI_COMM_WORLD_LOCAL_SIZE       SLURM_NTASKS_PER_NODE
//                                                                              (or SLURM_TASKS_PER_NODE's first count)
//   store address     MASTER_ADDR, MASTER_PORT (all launchers; see below)
//   job id            TANDEM_JOB_ID, else TORCHELASTIC_RUN_ID, OMPI_MCA_ess_base_jobid,
//                     SLURM_JOB_ID (+ SLURM_STEP_ID), else derived (see below)
//
// MASTER_ADDR defaults to "127.0.0.1" only when the whole job is on one node (local world size
// == world size); otherwise it must be set (DistError saying so). MASTER_PORT defaults to 29500
// as in PyTorch. When no launcher sets a job id, one is derived from MASTER_ADDR:MASTER_PORT
// and WORLD_SIZE (a different job on the same port with another world size is still refused).
//
// Under torchrun, whose agent may serve MASTER_PORT with PyTorch's own store
// (TORCHELASTIC_USE_AGENT_STORE=True), tandem's store takes MASTER_PORT + 1; TANDEM_STORE_PORT
// sets the store's port explicitly in any case (Note [under torchrun's own store]).
//
// TANDEM_STORE_HOSTED=1 says the launcher itself serves the store at MASTER_ADDR:MASTER_PORT
// (tandem-run --standalone does): rank 0 then connects to it as every other rank does instead
// of hosting it.
//
// Bad values are one clear DistError naming the variable and its value: RANK >= WORLD_SIZE,
// a negative or non-numeric value, LOCAL_RANK >= LOCAL_WORLD_SIZE, a port outside 1..65535.
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

namespace tandem::parallel::distributed {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  uint16_t master_port = 29500;
  std::string job_id;
  bool store_hosted = false;  // TANDEM_STORE_HOSTED=1: the launcher serves the store
  std::string source;  // which contract it came from: "torchrun", "openmpi", "slurm" or "none"

  int node_count() const { return world_size / local_world_size; }  // when launched evenly
  std::string str() const;  // "rank 1 of 2 (local 1 of 2), store 127.0.0.1:29500, job ..."
};

// True when the environment holds a launcher's contract (any of RANK/WORLD_SIZE,
// OMPI_COMM_WORLD_SIZE, SLURM_NTASKS with SLURM_PROCID): the program was started by a launcher.
bool launched_by_launcher();

// Reads the contract from the process environment. A variable lookup can be replaced for tests
// (getenv-like: return nullopt when unset).
using EnvLookup = std::function<std::optional<std::string>(const std::string& name)>;
DistEnv read_dist_env();
DistEnv read_dist_env(const EnvLookup& lookup);

}  // namespace tandem::parallel::distributed
