// tandem-run: start one process per rank with the environment contract, torchrun's flags.
//
//   tandem-run --nproc-per-node 2 build/examples/lenet --device cpu
//   tandem-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --nproc-per-node gpu prog ...
//
// Flags take "--flag value" or "--flag=value", with '-' or '_' inside the name as torchrun does
// (--nproc_per_node). The program is the first argument that is not a flag (or whatever follows
// "--"); everything after it is the program's. A bad flag is one line on stderr and exit code 2.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "parallel/distributed/launch.h"

using tandem::parallel::distributed::LaunchOptions;

namespace {

const char* kUsage = R"(usage: tandem-run [flags] program [args...]

Starts nproc-per-node copies of program with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and TANDEM_JOB_ID set, prefixes each line of their output with
"[rank N] " (their stdout is a pseudo-terminal, so lines arrive as they are printed), and
when one exits non-zero stops the others (SIGTERM, then SIGKILL after the grace period) and
exits 1 naming it. SIGINT, SIGTERM, SIGHUP and SIGQUIT are forwarded to every worker and stop
the job; SIGUSR1 and SIGUSR2 are forwarded and the job goes on. Killed outright, the launcher
takes its workers with it.

flags:
  --nproc-per-node N|gpu  processes on this node; "gpu": one per visible GPU (default 1)
  --nnodes M              nodes in the job (default 1)
  --node-rank R           this node's index, 0..M-1 (default 0); ranks are R*N .. R*N+N-1
  --master-addr ADDR      where rank 0 hosts the store (default 127.0.0.1)
  --master-port PORT      its port (default 29500)
  --standalone            one node; the launcher serves the store on a free port of 127.0.0.1
  --run-id ID             job id every worker gets (default: random on one node,
                          ADDR:PORT:WORLD on several)
  --grace-seconds S       between SIGTERM and SIGKILL when stopping (default 5)
  --no-prefix             the workers write to tandem-run's own stdout and stderr
  --help                  this text

exit code: 0 when every worker exited 0; 1 when one failed; 2 for a bad flag; 127 when the
program cannot be run; 128 + the signal after SIGINT/SIGTERM/SIGHUP/SIGQUIT (130/143/129/131).
)";

struct BadFlag {
  std::string message;
};

int parse_int(const std::string& flag, const std::string& text, int lo, int hi) {
  size_t used = 0;
  long v = 0;
  try {
    v = std::stol(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty())
    throw BadFlag{flag + " expects an integer, got '" + text + "'"};
  if (v < lo || v > hi)
    throw BadFlag{flag + " " + text + " is not in " + std::to_string(lo) + ".." +
                  std::to_string(hi)};
  return static_cast<int>(v);
}

double parse_seconds(const std::string& flag, const std::string& text) {
  size_t used = 0;
  double v = -1;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || text.empty() || !(v >= 0) || v > 86400)
    throw BadFlag{flag + " expects seconds in 0..86400, got '" + text + "'"};
  return v;
}

struct Parsed {
  LaunchOptions options;
  std::vector<std::string> program;
  bool help = false;
};

Parsed parse(int argc, char** argv) {
  Parsed p;
  bool nproc_gpu = false;
  int i = 1;
  for (; i < argc; ++i) {
    std::string arg = argv[i];
    if (arg == "--") {
      ++i;
      break;
    }
    if (arg.size() < 2 || arg[0] != '-') break;  // the program
    std::optional<std::string> inline_value;
    if (const size_t eq = arg.find('='); eq != std::string::npos) {
      inline_value = arg.substr(eq + 1);
      arg = arg.substr(0, eq);
    }
    std::string name = arg;
    for (size_t k = 2; k < name.size(); ++k)
      if (name[k] == '_') name[k] = '-';
    auto value = [&]() -> std::string {
      if (inline_value) return *inline_value;
      if (i + 1 >= argc) throw BadFlag{arg + " needs a value"};
      return argv[++i];
    };
    auto no_value = [&] {
      if (inline_value) throw BadFlag{arg + " takes no value"};
    };
    if (name == "--help" || name == "-h") {
      p.help = true;
      return p;
    } else if (name == "--nproc-per-node") {
      const std::string v = value();
      nproc_gpu = v == "gpu";
      if (!nproc_gpu) p.options.nproc_per_node = parse_int(arg, v, 1, 4096);
    } else if (name == "--nnodes") {
      p.options.nnodes = parse_int(arg, value(), 1, 65536);
    } else if (name == "--node-rank") {
      p.options.node_rank = parse_int(arg, value(), 0, 65535);
    } else if (name == "--master-addr") {
      p.options.master_addr = value();
      if (p.options.master_addr.empty()) throw BadFlag{arg + " needs an address"};
    } else if (name == "--master-port") {
      p.options.master_port = parse_int(arg, value(), 1, 65535);
    } else if (name == "--standalone") {
      no_value();
      p.options.standalone = true;
    } else if (name == "--run-id") {
      p.options.run_id = value();
    } else if (name == "--grace-seconds") {
      const double s = parse_seconds(arg, value());
      p.options.grace = std::chrono::milliseconds(static_cast<int64_t>(s * 1000.0 + 0.5));
    } else if (name == "--no-prefix") {
      no_value();
      p.options.prefix_output = false;
    } else {
      throw BadFlag{"unknown flag " + arg + " (see --help)"};
    }
  }
  for (; i < argc; ++i) p.program.emplace_back(argv[i]);
  if (p.program.empty()) throw BadFlag{"no program to run (see --help)"};
  if (p.options.node_rank >= p.options.nnodes)
    throw BadFlag{"--node-rank " + std::to_string(p.options.node_rank) + " is not below --nnodes " +
                  std::to_string(p.options.nnodes)};
  if (p.options.standalone && p.options.nnodes != 1)
    throw BadFlag{"--standalone is one node, but --nnodes is " + std::to_string(p.options.nnodes)};
  // Counted here, not in a worker: only the launcher looks at the GPUs before starting them.
  if (nproc_gpu) p.options.nproc_per_node = std::max(1, tandem::cuda_device_count());
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  Parsed parsed;
  try {
    parsed = parse(argc, argv);
  } catch (const BadFlag& e) {
    std::cerr << "tandem-run: " << e.message << "\n";
    return 2;
  }
  if (parsed.help) {
    std::cout << kUsage;
    return 0;
  }
  try {
    return tandem::parallel::distributed::launch(parsed.options, parsed.program);
  } catch (const std::exception& e) {
    std::cerr << "tandem-run: error: " << e.what() << "\n";
    return 1;
  }
}
