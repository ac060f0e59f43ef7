// The environment contract, read through a fake environment.
#include <arpa/inet.h>
#include <netdb.h>
#include <unistd.h>

#include <map>
#include <string>

#include "catch.h"
#include "core/error.h"
#include "helpers.h"
#include "parallel/distributed/env.h"

using namespace tandem;
using namespace tandem::parallel::distributed;
using tandem::test::contains;
using tandem::test::error_message;

namespace {

using Vars = std::map<std::string, std::string>;

DistEnv read(const Vars& vars) {
  return read_dist_env([&](const std::string& name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const Vars& vars) {
  return error_message<DistError>([&] { read(vars); });
}

}  // namespace

TEST_CASE("env: no launcher is rank 0 of 1", "[dist]") {
  DistEnv e = read({});
  REQUIRE(e.source == "none");
  REQUIRE(e.rank == 0);
  REQUIRE(e.world_size == 1);
  REQUIRE(e.local_rank == 0);
  REQUIRE(e.local_world_size == 1);
  REQUIRE(e.master_addr == "127.0.0.1");
  REQUIRE(e.master_port == 29500);
  REQUIRE(e.job_id == "derived:127.0.0.1:29500:1");
  // A lone SLURM_NTASKS (no SLURM_PROCID: not a task of srun) is no launcher either.
  REQUIRE(read({{"SLURM_NTASKS", "4"}}).source == "none");
}

TEST_CASE("env: torchrun's contract", "[dist]") {
  DistEnv e = read({{"RANK", "3"},
                    {"WORLD_SIZE", "4"},
                    {"LOCAL_RANK", "1"},
                    {"LOCAL_WORLD_SIZE", "2"},
                    {"MASTER_ADDR", "node0"},
                    {"MASTER_PORT", "1234"},
                    {"TORCHELASTIC_RUN_ID", "abc"}});
  REQUIRE(e.source == "torchrun");
  REQUIRE(e.rank == 3);
  REQUIRE(e.world_size == 4);
  REQUIRE(e.local_rank == 1);
  REQUIRE(e.local_world_size == 2);
  REQUIRE(e.node_count() == 2);
  REQUIRE(e.master_addr == "node0");
  REQUIRE(e.master_port == 1234);
  REQUIRE(e.job_id == "abc");
  REQUIRE(e.str() == "rank 3 of 4 (local 1 of 2), store node0:1234, job abc, from torchrun");

  SECTION("defaults on one node") {
    DistEnv d = read({{"RANK", "1"}, {"WORLD_SIZE", "2"}});
    REQUIRE(d.local_rank == 1);
    REQUIRE(d.local_world_size == 2);
    REQUIRE(d.master_addr == "127.0.0.1");
    REQUIRE(d.master_port == 29500);
    REQUIRE(d.job_id == "derived:127.0.0.1:29500:2");
  }
  SECTION("torchrun's default run id 'none' does not tell jobs apart") {
    DistEnv d = read({{"RANK", "0"},
                      {"WORLD_SIZE", "2"},
                      {"TORCHELASTIC_RUN_ID", "none"},
                      {"MASTER_PORT", "29600"}});
    REQUIRE(d.job_id == "derived:127.0.0.1:29600:2");
  }
  SECTION("a store the launcher hosts: rank 0 is one of its clients") {
    CHECK(!e.store_hosted);
    Vars v = {{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "20001"}, {"TANDEM_JOB_ID", "j"},
              {"TANDEM_STORE_HOSTED", "1"}};
    DistEnv hosted = read(v);
    CHECK(hosted.store_hosted);
    CHECK(hosted.str() == "rank 0 of 2 (local 0 of 2), store 127.0.0.1:20001 (the launcher's), job j, from torchrun");
    v["TANDEM_STORE_HOSTED"] = "0";
    CHECK(!read(v).store_hosted);
  }
  SECTION("TANDEM_JOB_ID comes first") {
    DistEnv d = read({{"RANK", "0"},
                      {"WORLD_SIZE", "1"},
                      {"TANDEM_JOB_ID", "t1"},
                      {"TORCHELASTIC_RUN_ID", "abc"},
                      {"SLURM_JOB_ID", "77"}});
    REQUIRE(d.job_id == "t1");
  }
  SECTION("torchrun wins over the launchers it runs inside") {
    DistEnv d = read({{"RANK", "1"},
                      {"WORLD_SIZE", "2"},
                      {"SLURM_PROCID", "0"},
                      {"SLURM_NTASKS", "1"},
                      {"OMPI_COMM_WORLD_SIZE", "1"}});
    REQUIRE(d.source == "torchrun");
    REQUIRE(d.rank == 1);
  }
}

TEST_CASE("env: OpenMPI's contract", "[dist]") {
  DistEnv e = read({{"OMPI_COMM_WORLD_RANK", "2"},
                    {"OMPI_COMM_WORLD_SIZE", "4"},
                    {"OMPI_COMM_WORLD_LOCAL_RANK", "0"},
                    {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                    {"MASTER_ADDR", "10.0.0.1"},
                    {"OMPI_MCA_ess_base_jobid", "4242"}});
  REQUIRE(e.source == "openmpi");
  REQUIRE(e.rank == 2);
  REQUIRE(e.world_size == 4);
  REQUIRE(e.local_rank == 0);
  REQUIRE(e.local_world_size == 2);
  REQUIRE(e.master_addr == "10.0.0.1");
  REQUIRE(e.job_id == "4242");
  REQUIRE(contains(error_of({{"OMPI_COMM_WORLD_SIZE", "2"}}),
                   "OMPI_COMM_WORLD_SIZE is set but OMPI_COMM_WORLD_RANK is not"));
}

TEST_CASE("env: Slurm's contract", "[dist]") {
  DistEnv e = read({{"SLURM_PROCID", "5"},
                    {"SLURM_NTASKS", "8"},
                    {"SLURM_LOCALID", "1"},
                    {"SLURM_NTASKS_PER_NODE", "4"},
                    {"MASTER_ADDR", "gpu01"},
                    {"SLURM_JOB_ID", "123"},
                    {"SLURM_STEP_ID", "0"}});
  REQUIRE(e.source == "slurm");
  REQUIRE(e.rank == 5);
  REQUIRE(e.world_size == 8);
  REQUIRE(e.local_rank == 1);
  REQUIRE(e.local_world_size == 4);
  REQUIRE(e.job_id == "123.0");

  SECTION("SLURM_TASKS_PER_NODE's first count when SLURM_NTASKS_PER_NODE is unset") {
    DistEnv d = read({{"SLURM_PROCID", "3"},
                      {"SLURM_NTASKS", "6"},
                      {"SLURM_LOCALID", "1"},
                      {"SLURM_TASKS_PER_NODE", "2(x3)"},
                      {"MASTER_ADDR", "gpu01"},
                      {"SLURM_JOB_ID", "9"}});
    REQUIRE(d.local_world_size == 2);
    REQUIRE(d.node_count() == 3);
    REQUIRE(d.job_id == "9");
    REQUIRE(read({{"SLURM_PROCID", "0"},
                  {"SLURM_NTASKS", "3"},
                  {"SLURM_TASKS_PER_NODE", "2,1"},
                  {"MASTER_ADDR", "a"}})
                .local_world_size == 2);
  }
}

TEST_CASE("env: MASTER_ADDR is required when the job spans nodes", "[dist]") {
  auto msg = error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}});
  REQUIRE(contains(msg, "MASTER_ADDR is not set and the job spans several nodes"));
  // An empty value counts as unset.
  msg = error_of(
      {{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", ""}});
  REQUIRE(contains(msg, "MASTER_ADDR is not set"));
}

TEST_CASE("env: every bad value is named with its value", "[dist]") {
  Vars ok = {{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"}};
  auto with = [&](const std::string& name, const std::string& value) {
    Vars v = ok;
    v[name] = value;
    return error_of(v);
  };
  REQUIRE(contains(with("RANK", "2"), "RANK=2 is not below WORLD_SIZE=2"));
  REQUIRE(contains(with("RANK", "-1"), "RANK=-1 is not a non-negative integer"));
  REQUIRE(contains(with("RANK", "one"), "RANK=one is not a non-negative integer"));
  REQUIRE(contains(with("RANK", "1x"), "RANK=1x is not a non-negative integer"));
  REQUIRE(contains(with("WORLD_SIZE", "0"), "WORLD_SIZE=0 is not at least 1"));
  REQUIRE(contains(with("WORLD_SIZE", "99999999999"),
                   "WORLD_SIZE=99999999999 is not a non-negative integer"));
  REQUIRE(contains(with("LOCAL_RANK", "2"), "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2"));
  REQUIRE(contains(with("LOCAL_RANK", "-3"), "LOCAL_RANK=-3 is not a non-negative integer"));
  REQUIRE(contains(with("LOCAL_WORLD_SIZE", "0"), "LOCAL_WORLD_SIZE=0 is not at least 1"));
  REQUIRE(contains(with("LOCAL_WORLD_SIZE", "3"), "LOCAL_WORLD_SIZE=3 is above WORLD_SIZE=2"));
  REQUIRE(contains(with("MASTER_PORT", "0"), "MASTER_PORT=0 is not a port (1..65535)"));
  REQUIRE(contains(with("MASTER_PORT", "65536"), "MASTER_PORT=65536 is not a port (1..65535)"));
  REQUIRE(contains(with("MASTER_PORT", "http"), "MASTER_PORT=http is not a port (1..65535)"));
  REQUIRE(contains(with("TANDEM_STORE_HOSTED", "2"), "TANDEM_STORE_HOSTED=2 is not 0 or 1"));
  REQUIRE(contains(with("TANDEM_STORE_HOSTED", "yes"), "TANDEM_STORE_HOSTED=yes is not 0 or 1"));
  REQUIRE(read(ok).rank == 1);
  REQUIRE(contains(error_of({{"RANK", "0"}}), "RANK is set but WORLD_SIZE is not"));
  REQUIRE(contains(error_of({{"WORLD_SIZE", "2"}}), "WORLD_SIZE is set but RANK is not"));
  REQUIRE(contains(error_of({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}}),
                   "SLURM_PROCID=4 is not below SLURM_NTASKS=4"));
  REQUIRE(contains(error_of({{"SLURM_PROCID", "0"},
                             {"SLURM_NTASKS", "4"},
                             {"SLURM_TASKS_PER_NODE", "x"},
                             {"MASTER_ADDR", "a"}}),
                   "SLURM_TASKS_PER_NODE=x is not a non-negative integer"));
}

TEST_CASE("env: under torchrun's agent store tandem's store takes the next port", "[dist]") {
  const Vars torchrun = {
      {"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29400"}};
  CHECK(read(torchrun).master_port == 29400);
  Vars agent = torchrun;
  agent["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  CHECK(read(agent).master_port == 29401);
  agent["TANDEM_STORE_PORT"] = "31000";
  CHECK(read(agent).master_port == 31000);
  agent["TANDEM_STORE_PORT"] = "0";
  CHECK(contains(error_of(agent), "TANDEM_STORE_PORT=0"));
  agent.erase("TANDEM_STORE_PORT");
  agent["MASTER_PORT"] = "65535";
  CHECK(contains(error_of(agent), "TANDEM_STORE_PORT"));
}

TEST_CASE("env: a job across nodes may not reach its store through a loopback name", "[dist]") {
  // Debian and Ubuntu map the machine's own name to 127.0.1.1, so MASTER_ADDR=$(hostname) would
  // put the store on loopback, where the other nodes never find it; "localhost" is the same trap.
  Vars v = {
      {"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_WORLD_SIZE", "2"}, {"MASTER_ADDR", "localhost"}};
  auto msg = error_of(v);
  REQUIRE(contains(msg,
                   "MASTER_ADDR=localhost resolves to 127.0.0.1, a loopback address, but the job "
                   "spans several nodes (world size 4, 2 per node)"));
  REQUIRE(contains(msg, "hostname -I"));
  // On one node loopback is right.
  v["LOCAL_WORLD_SIZE"] = "4";
  REQUIRE(read(v).master_addr == "localhost");
  // A numeric loopback address is taken at its word: that is how several "nodes" share one
  // machine in tests.
  v["LOCAL_WORLD_SIZE"] = "2";
  v["MASTER_ADDR"] = "127.0.0.1";
  REQUIRE(read(v).master_addr == "127.0.0.1");
  v["MASTER_ADDR"] = "::1";
  REQUIRE(read(v).master_addr == "::1");
  // MASTER_ADDR=$(hostname): an error exactly where the name lands on loopback.
  char host[256] = "";
  REQUIRE(::gethostname(host, sizeof host - 1) == 0);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host, nullptr, &hints, &res) == 0) {
    bool loopback = false;
    for (addrinfo* a = res; a; a = a->ai_next) {
      if (a->ai_family == AF_INET) {
        loopback =
            (ntohl(reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr.s_addr) >> 24) == 127;
        break;
      }
    }
    ::freeaddrinfo(res);
    v["MASTER_ADDR"] = host;
    if (loopback) {
      REQUIRE(contains(error_of(v), "MASTER_ADDR=" + std::string(host) + " resolves to 127."));
    } else {
      REQUIRE(read(v).master_addr == host);
    }
  }
}
