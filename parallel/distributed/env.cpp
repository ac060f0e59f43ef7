#include "parallel/distributed/env.h"

#include <charconv>
#include <cstdlib>

#include "core/error.h"
#include "parallel/distributed/store.h"

namespace tandem::parallel::distributed {

namespace {

// The variables one launcher sets; the first launcher whose size variable is present wins.
struct Contract {
  const char* source;
  const char* rank;
  const char* world_size;
  const char* local_rank;
  const char* local_world_size;
};

constexpr Contract kTorchrun{"torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"};
constexpr Contract kOpenMpi{"openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"};
constexpr Contract kSlurm{"slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID",
                          "SLURM_NTASKS_PER_NODE"};

// An unset and an empty variable mean the same: launchers and shells export empty ones.
std::optional<std::string> lookup_nonempty(const EnvLookup& lookup, const std::string& name) {
  auto v = lookup(name);
  if (v && v->empty()) return std::nullopt;
  return v;
}

// Strict decimal: "2" yes; "-1", "2x", " 2", "" no.
int parse_count(const std::string& name, const std::string& value, int64_t max = 1 << 30) {
  int64_t v = -1;
  auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
  TANDEM_CHECK(ec == std::errc() && end == value.data() + value.size() && v >= 0 && v <= max, Dist,
               name, "=", value, " is not a non-negative integer");
  return static_cast<int>(v);
}

// SLURM_TASKS_PER_NODE looks like "2(x3),1": the first count is this job's tasks per node
// when the job is launched evenly.
std::optional<int> slurm_tasks_per_node(const EnvLookup& lookup) {
  auto v = lookup_nonempty(lookup, "SLURM_TASKS_PER_NODE");
  if (!v) return std::nullopt;
  std::string first = v->substr(0, v->find_first_of("(,"));
  return parse_count("SLURM_TASKS_PER_NODE", first);
}

std::optional<std::string> env_get(const std::string& name) {
  const char* v = std::getenv(name.c_str());
  if (v == nullptr) return std::nullopt;
  return std::string(v);
}

// The first id a launcher gives all processes of one job, else "".
std::string launcher_job_id(const EnvLookup& lookup) {
  if (auto v = lookup_nonempty(lookup, "TANDEM_JOB_ID")) return *v;
  // torchrun's default --rdzv-id is the literal "none", shared by every job started without
  // one: it tells two jobs apart no better than nothing, so we derive ours instead.
  if (auto v = lookup_nonempty(lookup, "TORCHELASTIC_RUN_ID"); v && *v != "none") return *v;
  if (auto v = lookup_nonempty(lookup, "OMPI_MCA_ess_base_jobid")) return *v;
  if (auto v = lookup_nonempty(lookup, "SLURM_JOB_ID")) {
    auto step = lookup_nonempty(lookup, "SLURM_STEP_ID");
    return step ? *v + "." + *step : *v;
  }
  return "";
}

}  // namespace

bool launched_by_launcher() {
  return env_get("RANK") || env_get("WORLD_SIZE") || env_get("OMPI_COMM_WORLD_SIZE") ||
         (env_get("SLURM_NTASKS") && env_get("SLURM_PROCID"));
}

DistEnv read_dist_env() {
  return read_dist_env(env_get);
}

DistEnv read_dist_env(const EnvLookup& lookup) {
  DistEnv env;
  const Contract* c = nullptr;
  if (lookup_nonempty(lookup, "RANK") || lookup_nonempty(lookup, "WORLD_SIZE")) {
    c = &kTorchrun;
  } else if (lookup_nonempty(lookup, "OMPI_COMM_WORLD_SIZE")) {
    c = &kOpenMpi;
  } else if (lookup_nonempty(lookup, "SLURM_NTASKS") && lookup_nonempty(lookup, "SLURM_PROCID")) {
    c = &kSlurm;
  }
  env.source = c ? c->source : "none";

  if (c) {
    auto rank = lookup_nonempty(lookup, c->rank);
    auto world = lookup_nonempty(lookup, c->world_size);
    TANDEM_CHECK(rank && world, Dist, world ? c->world_size : c->rank, " is set but ",
                 world ? c->rank : c->world_size, " is not (", env.source, " contract)");
    env.rank = parse_count(c->rank, *rank);
    env.world_size = parse_count(c->world_size, *world);
    TANDEM_CHECK(env.world_size >= 1, Dist, c->world_size, "=", *world, " is not at least 1");
    TANDEM_CHECK(env.rank < env.world_size, Dist, c->rank, "=", *rank, " is not below ",
                 c->world_size, "=", *world);

    // Without a local size the job is taken to be on one node (what a hand-set RANK and
    // WORLD_SIZE usually mean); without a local rank, the local rank is the rank.
    std::string local_size_name = c->local_world_size;
    std::optional<std::string> local_size = lookup_nonempty(lookup, c->local_world_size);
    if (!local_size && c == &kSlurm) {
      if (auto n = slurm_tasks_per_node(lookup)) {
        local_size = std::to_string(*n);
        local_size_name = "SLURM_TASKS_PER_NODE";
      }
    }
    env.local_world_size = local_size ? parse_count(local_size_name, *local_size) : env.world_size;
    TANDEM_CHECK(env.local_world_size >= 1, Dist, local_size_name, "=", *local_size,
                 " is not at least 1");
    TANDEM_CHECK(env.local_world_size <= env.world_size, Dist, local_size_name, "=",
                 env.local_world_size, " is above ", c->world_size, "=", env.world_size);

    auto local_rank = lookup_nonempty(lookup, c->local_rank);
    env.local_rank =
        local_rank ? parse_count(c->local_rank, *local_rank) : env.rank % env.local_world_size;
    TANDEM_CHECK(env.local_rank < env.local_world_size, Dist, c->local_rank, "=", env.local_rank,
                 " is not below ", local_size_name, "=", env.local_world_size);
  }

  auto parse_port = [](const char* name, const std::string& text) {
    int64_t v = -1;
    auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
    TANDEM_CHECK(ec == std::errc() && end == text.data() + text.size() && v >= 1 && v <= 65535,
                 Dist, name, "=", text, " is not a port (1..65535)");
    return static_cast<uint16_t>(v);
  };
  if (auto port = lookup_nonempty(lookup, "MASTER_PORT"))
    env.master_port = parse_port("MASTER_PORT", *port);
  // Note [under torchrun's own store]: recent torchrun agents serve MASTER_PORT themselves with
  // PyTorch's store (and say so with TORCHELASTIC_USE_AGENT_STORE=True), whose protocol is not
  // ours; tandem's store then listens on the next port. TANDEM_STORE_PORT picks one explicitly.
  if (auto port = lookup_nonempty(lookup, "TANDEM_STORE_PORT")) {
    env.master_port = parse_port("TANDEM_STORE_PORT", *port);
  } else if (auto agent = lookup_nonempty(lookup, "TORCHELASTIC_USE_AGENT_STORE");
             agent && (*agent == "True" || *agent == "true" || *agent == "1")) {
    TANDEM_CHECK(env.master_port < 65535, Dist,
                 "MASTER_PORT=65535 under torchrun's agent store leaves no port for "
                 "tandem's store; set TANDEM_STORE_PORT");
    env.master_port = static_cast<uint16_t>(env.master_port + 1);
  }

  if (auto addr = lookup_nonempty(lookup, "MASTER_ADDR")) {
    env.master_addr = *addr;
  } else {
    // On one node every process can reach rank 0 through the loopback; across nodes only the
    // user knows rank 0's address.
    TANDEM_CHECK(env.local_world_size == env.world_size, Dist,
                 "MASTER_ADDR is not set and the job spans several nodes (world size ",
                 env.world_size, ", ", env.local_world_size,
                 " per node): set it to the address of rank 0's node");
  }
  // Note [the store's address]: MASTER_ADDR=$(hostname) lands on loopback on Debian and Ubuntu.
  check_store_address(env.master_addr, env.world_size, env.local_world_size,
                      "MASTER_ADDR=" + env.master_addr);

  if (auto hosted = lookup_nonempty(lookup, "TANDEM_STORE_HOSTED")) {
    TANDEM_CHECK(*hosted == "0" || *hosted == "1", Dist, "TANDEM_STORE_HOSTED=", *hosted,
                 " is not 0 or 1");
    env.store_hosted = *hosted == "1";
  }

  env.job_id = launcher_job_id(lookup);
  if (env.job_id.empty()) {
    // Every process of one job computes the same id; another job on the same address and
    // port with another world size does not.
    env.job_id = "derived:" + env.master_addr + ":" + std::to_string(env.master_port) + ":" +
                 std::to_string(env.world_size);
  }
  return env;
}

std::string DistEnv::str() const {
  return "rank " + std::to_string(rank) + " of " + std::to_string(world_size) + " (local " +
         std::to_string(local_rank) + " of " + std::to_string(local_world_size) + "), store " +
         master_addr + ":" + std::to_string(master_port) + (store_hosted ? " (the launcher's)" : "") + ", job " + job_id + ", from " + source;
}

}  // namespace tandem::parallel::distributed
