// `mlacp verify`: correctness against the single-device float64 reference.
//   mlacp verify                    the default matrix on --nproc local ranks (4), plus the
//                                   single-device checks on rank 0
//   mlacp verify --case NAME ...    named cases;  mlacp verify --list   their names
//   mlacp verify --cp 4 --ulysses 2 --strategy latent ...   one ad-hoc case
//   mlacp verify --single-device    only the single-device checks, in this process
//   mlacp verify --checkpoint DIR [--layer N]   the CP check with a HuggingFace checkpoint's config
//                                   and layer N's attention weights
// Under torchrun (RANK/WORLD_SIZE set) it runs as one rank of that launch.
#include <fstream>
#include <map>
#include <iostream>

#include <nlohmann/json.hpp>

#include "check/cp_checks.h"
#include "check/single_device_checks.h"
#include "commands.h"
#include "memory_check.h"
#include "output_file.h"
#include "option_checks.h"
#include "plan_command.h"
#include "core/format.h"
#include "mlacp/checkpoint.h"
#include "mlacp/errors.h"
#include "table.h"

namespace mlacp::tools {
namespace {

void add_adhoc_options(CLI::App* cmd, AdHocCase& a) {
  auto* g = cmd->add_option_group("ad-hoc case", "any of these defines one case (defaults: tiny preset)");
  g->add_option("--preset", a.preset, "tiny | deepseek-v2-lite | deepseek-v3")
      ->each([&a](const std::string&) { a.preset_given = true; });
  g->add_option("--config", a.config_path, "HuggingFace-style config.json instead of a preset")->check(input_file());
  g->add_option("--checkpoint", a.checkpoint,
                "HuggingFace checkpoint folder (config.json + safetensors): its config and the attention weights "
                "of --layer instead of a seeded random draw")
      ->check(input_folder());
  g->add_option("--layer", a.layer, "decoder layer of --checkpoint whose attention is checked (default 0)")
      ->check(int_range(int64_t{0}, int64_t{1} << 30));
  g->add_option("--hidden", a.hidden, "hidden size d");
  g->add_option("--heads", a.heads, "attention heads");
  g->add_option("--q-rank", a.q_rank, "q latent rank Rq (0: none)");
  g->add_option("--kv-rank", a.kv_rank, "kv latent rank Rkv");
  g->add_option("--nope", a.nope, "nope dim Dn");
  g->add_option("--rope", a.rope, "rope dim Dr");
  g->add_option("--value", a.value, "value dim Dv");
  g->add_option("--seq", a.seq, "global sequence length S")->check(int_range(1, 1 << 22));
  g->add_option("--batch", a.batch, "batch B")->check(int_range(1, 65536));
  g->add_option("--dp", a.dp, "data-parallel degree")->check(int_range(1, 65536));
  g->add_option("--cp", a.cp, "context-parallel degree P (default: world / (dp*tp))")->check(int_range(1, 65536));
  g->add_option("--tp", a.tp, "tensor-parallel degree")->check(int_range(1, 65536));
  g->add_option("--ulysses", a.ulysses, "Ulysses degree U (0 or absent: U = P), or auto (the planner's choice)");
  g->add_option("--strategy", a.strategy, "expanded_ulysses | latent_kv_head | auto (the planner's choice)");
  add_plan_hardware_option(g, a.plan_hardware);
  g->add_option("--partition", a.partition, "contiguous | head_tail");
  g->add_option("--causal", a.causal, "true | false")->check(CLI::IsMember({"true", "false", "1", "0"}));
  g->add_option("--doc-ends", a.doc_ends, "packed document ends (global, batch 1)")->delimiter(',');
  g->add_option("--band", a.band, "band mask width (key allowed iff |i-j| < band)")->check(int_range(1, 1 << 22));
  g->add_option("--masked-rows", a.masked_rows, "query rows with no allowed key (with --band)")->delimiter(',');
  g->add_flag("--gate", a.gate, "output gate");
  g->add_option("--kernel", a.kernel, "blockwise | reference (alias naive) | pieces: the CP runtime's attention kernel");
  g->add_option("--reference-kernel", a.reference_kernel, "reference (alias naive) | blockwise: the single-device oracle's kernel");
  g->add_flag("--reference-rank0", a.reference_rank0, "rank 0 alone computes the reference (long sequences)");
  g->add_flag("--kv-recompute", a.kv_recompute,
              "latent strategy: expand K/V a few heads at a time, again in the backward (keeps the latent only)");
  g->add_option("--overlap", a.overlap, "true | false: the overlap schedule (also compared with the plain one)")
      ->check(CLI::IsMember({"true", "false", "1", "0"}));
  g->add_option("--dtype", a.dtype, "float64 | float32 | bfloat16 (autocast)");
  g->add_option("--frozen", a.frozen, "frozen parameter-name prefixes; 'hidden' freezes the input")->delimiter(',');
  g->add_option("--seed", a.seed, "seed of parameters and inputs");
  for (CLI::Option* option : g->get_options()) {
    option->each([&a](const std::string&) { a.given = true; });
  }
}

// The module config and, with --checkpoint, the weights of the ad-hoc case. `read_weights` false:
// the checkpoint is opened and its layer checked (names, shapes, dtypes) without reading tensor data
// (the launcher, before any rank starts).
MlaConfig adhoc_config(const AdHocCase& a, bool read_weights, VerifyCase& base) {
  MLACP_REQUIRE(!a.layer || !a.checkpoint.empty(), "verify", "--layer needs --checkpoint", {got("layer", *a.layer)},
                "add --checkpoint DIR, or drop --layer");
  if (a.checkpoint.empty()) return a.config_path.empty() ? preset_config(a.preset) : load_config_file(a.config_path);
  MLACP_REQUIRE(!a.preset_given && a.config_path.empty(), "verify",
                "--checkpoint takes the config from its config.json: --preset and --config cannot go with it",
                {got("checkpoint", a.checkpoint), got(a.preset_given ? "preset" : "config", a.preset_given ? a.preset : a.config_path)},
                "drop --preset/--config");
  const bool shape_given = a.hidden || a.heads || a.q_rank || a.kv_rank || a.nope || a.rope || a.value || a.gate;
  MLACP_REQUIRE(!shape_given, "verify",
                "--checkpoint fixes the layer's shape: --hidden, --heads, --q-rank, --kv-rank, --nope, --rope, --value "
                "and --gate cannot go with it",
                {got("checkpoint", a.checkpoint)}, "drop them: the checkpoint's config.json and weights decide the shape");
  const HfCheckpoint checkpoint = open_hf_checkpoint(a.checkpoint);
  const int64_t layer = a.layer.value_or(0);
  base.weights_source = "checkpoint " + a.checkpoint + " layer " + std::to_string(layer);
  if (read_weights) {
    base.weights = std::make_shared<const CaseWeights>(checkpoint.read_attention_layer(layer));  // stored dtype
  } else {
    checkpoint.check_attention_layer(layer);
  }
  return checkpoint.config();
}

CpCase build_adhoc(const AdHocCase& a, int64_t world_size, bool read_weights) {
  VerifyCase weights_holder;
  MlaConfig cfg = adhoc_config(a, read_weights, weights_holder);
  if (a.hidden) cfg.hidden_size = *a.hidden;
  if (a.heads) cfg.num_heads = *a.heads;
  if (a.q_rank) cfg.q_lora_rank = *a.q_rank == 0 ? std::nullopt : std::optional<int64_t>(*a.q_rank);
  if (a.kv_rank) cfg.kv_lora_rank = *a.kv_rank;
  if (a.nope) cfg.qk_nope_head_dim = *a.nope;
  if (a.rope) cfg.qk_rope_head_dim = *a.rope;
  if (a.value) cfg.v_head_dim = *a.value;
  cfg.output_gate = cfg.output_gate || a.gate;
  cfg.validate();
  CpCase c;
  c.name = a.checkpoint.empty() ? "adhoc" : "checkpoint-layer" + std::to_string(a.layer.value_or(0));
  c.base = VerifyCase{c.name, cfg};
  c.base.weights = weights_holder.weights;
  c.base.weights_source = weights_holder.weights_source;
  c.base.seq_len = a.seq.value_or(32);
  c.base.batch = a.batch.value_or(a.doc_ends.empty() ? 2 : 1);
  c.base.causal = a.causal;
  c.base.document_ends = a.doc_ends;
  c.base.band_width = a.band.value_or(0);
  c.base.masked_rows = a.masked_rows;
  MLACP_REQUIRE(a.masked_rows.empty() || c.base.band_width > 0, "verify", "--masked-rows needs --band",
                {got("masked_rows", a.masked_rows)}, "add --band W");
  for (int64_t row : a.masked_rows)
    MLACP_REQUIRE(0 <= row && row < c.base.seq_len, "verify", "--masked-rows must be query rows in [0, S)",
                  {got("masked_row", row), got("seq", c.base.seq_len)}, "pass rows between 0 and S-1");
  c.base.seed = static_cast<uint64_t>(a.seed.value_or(0));
  c.mesh.dp = a.dp.value_or(1);
  c.mesh.tp = a.tp.value_or(1);
  c.mesh.cp = a.cp.value_or(std::max<int64_t>(1, world_size / (c.mesh.dp * c.mesh.tp)));
  c.mesh.ulysses = a.ulysses ? parse_count("verify", "ulysses", *a.ulysses) : 0;
  if (a.strategy) c.strategy = parse_strategy(*a.strategy);
  if (a.partition) c.partition = parse_partition(*a.partition);
  if (a.dtype) c.dtype = parse_dtype(*a.dtype);
  c.frozen = a.frozen;
  c.overlap = a.overlap.value_or(true);
  if (a.kernel) c.kernel = parse_kernel(*a.kernel);
  if (a.reference_kernel) c.reference_kernel = parse_kernel(*a.reference_kernel);
  c.reference_on_rank0 = a.reference_rank0;
  c.kv_recompute = a.kv_recompute;
  return c;
}

// The cases of a multi-rank run: the ad-hoc one, the named ones or the default matrix.
// `read_weights` false: a --checkpoint's tensors are checked but not read (the launcher).
std::vector<CpCase> select_cp_cases(const VerifyArgs& args, int64_t world_size, bool read_weights = true) {
  MLACP_REQUIRE(!(args.adhoc.given && !args.cases.empty()), "verify", "--case and ad-hoc case flags are exclusive",
                {got("case", args.cases.front())}, "drop --case to run the ad-hoc case, or drop the case flags");
  if (args.adhoc.given) return {build_adhoc(args.adhoc, world_size, read_weights)};
  return args.cases.empty() ? default_cp_cases(world_size) : find_cp_cases(args.cases, world_size);
}

// One table row per case (its worst errors by quantity); the JSON keeps every check.
struct Report {
  struct CaseLine {
    std::string name;
    std::map<std::string, double> worst;  // column -> worst error
    std::vector<std::string> failed;
  };
  std::vector<CaseLine> lines;
  nlohmann::json rows = nlohmann::json::array();
  int failures = 0;

  static std::string column_of(const std::string& quantity) {
    for (const char* special : {"masked", "frozen", "packed"})
      if (quantity.find(special) != std::string::npos) return "other";
    if (quantity.rfind("fd grad", 0) == 0) return "fd grad (f64)";
    if (quantity.rfind("f32 vs f64", 0) == 0) return "f32 vs f64 (rel)";
    if (quantity.rfind("bf16", 0) == 0) return "bf16 vs f64 (norm rel)";
    if (quantity.find("output") != std::string::npos) return "output";
    if (quantity.find("grad hidden") != std::string::npos || quantity.find("grad input") != std::string::npos)
      return "grad input";
    if (quantity.find("grad") != std::string::npos) return "grad params";
    if (quantity.find("overlap") != std::string::npos) return "overlap on-off";
    if (quantity.find("bytes") != std::string::npos) return "bytes |meas-formula|";
    return "other";
  }
  void add(const CheckRow& row) {
    const bool ok = row.passed();
    failures += ok ? 0 : 1;
    if (lines.empty() || lines.back().name != row.case_name) lines.push_back({row.case_name, {}, {}});
    CaseLine& line = lines.back();
    double& cell = line.worst[column_of(row.quantity)];
    cell = std::max(cell, row.error);
    if (!ok) line.failed.push_back(row.quantity + " " + sci(row.error) + " > " + sci(row.tolerance));
    rows.push_back({{"case", row.case_name}, {"quantity", row.quantity}, {"error", row.error},
                    {"tolerance", row.tolerance}, {"passed", ok}});
  }
  // Prints the table (columns: those used, in a fixed order) and the failures; returns whether all passed.
  bool print() const {
    std::vector<std::string> columns;
    for (const char* col : {"output", "grad input", "grad params", "overlap on-off", "bytes |meas-formula|",
                            "fd grad (f64)", "f32 vs f64 (rel)", "bf16 vs f64 (norm rel)", "other"}) {
      for (const CaseLine& line : lines)
        if (line.worst.count(col)) {
          columns.push_back(col);
          break;
        }
    }
    std::vector<std::string> header{"case"};
    header.insert(header.end(), columns.begin(), columns.end());
    header.push_back("status");
    Table table(header);
    for (const CaseLine& line : lines) {
      std::vector<std::string> cells{line.name};
      for (const auto& col : columns) cells.push_back(line.worst.count(col) ? sci(line.worst.at(col)) : "-");
      cells.push_back(line.failed.empty() ? "ok" : "FAIL");
      table.add(cells);
    }
    table.print(std::cout);
    for (const CaseLine& line : lines)
      for (const auto& f : line.failed) std::cout << "FAIL " << line.name << ": " << f << "\n";
    return failures == 0;
  }
  int finish(const std::string& json_path, const std::string& mode, const nlohmann::json& extra) {
    print();
    std::cout << (failures == 0 ? "verify: all " + std::to_string(rows.size()) + " checks of " +
                                      std::to_string(lines.size()) + " cases passed\n"
                                : "verify: " + std::to_string(failures) + " of " + std::to_string(rows.size()) +
                                      " checks FAILED\n");
    if (!json_path.empty()) {
      nlohmann::json doc{{"mode", mode}, {"passed", failures == 0}, {"rows", rows}};
      if (extra.is_object()) doc.update(extra);
      write_output_file("--json", json_path, doc.dump(2) + "\n");
    }
    return failures == 0 ? 0 : 1;
  }
};

int run_single_device(const VerifyArgs& args) {
  std::vector<VerifyCase> cases;
  if (args.cases.empty()) {
    cases = default_single_device_cases();
  } else {
    for (const auto& name : args.cases) cases.push_back(find_case(name));
  }
  if (args.list) {
    for (const auto& c : cases) std::cout << c.name << "\n";
    return 0;
  }
  Report report;
  for (const VerifyCase& c : cases) {
    std::cerr << "verify: " << c.name << " ...\n";
    for (const CheckRow& row : run_single_device_checks(c)) report.add(row);
  }
  return report.finish(args.json_path, "single-device", {});
}

// The case with the largest memory estimate (cases run one after another); on_device: the CP runs'
// tensors are a GPU's, the host holds the oracle and the results.
MemoryEstimate largest_case_memory(const std::vector<CpCase>& cases, bool on_device) {
  MemoryEstimate largest;
  for (const CpCase& c : cases) {
    const MemoryEstimate m = cp_case_memory(c, on_device);
    if (m.total() > largest.total()) {
      largest = MemoryEstimate{};
      largest.add(m, 1.0, cases.size() > 1 ? "case " + c.name + ": " : "");
    }
  }
  return largest;
}

int run_as_rank(const CommonArgs& common, const VerifyArgs& args) {
  apply_threads(common);
  const WorldInfo world = world_from_env();
  const bool named = !args.cases.empty();
  std::vector<CpCase> cases = select_cp_cases(args, world.size);
  const bool lead = world.rank == 0;
  if (args.list) {
    if (lead)
      for (const auto& c : cases) std::cout << c.describe() << "\n";
    return 0;
  }
  {
    // Before the first collective (a rank of torchrun; mlacp's launcher checked already).
    std::vector<CpCase> valid;
    for (const CpCase& c : cases) {
      try {
        validate_cp_case(c, world.size);
        valid.push_back(c);
      } catch (const Error&) {  // reported as a rejected row below
      }
    }
    check_device_args(args.device, local_world_size(world), "verify");
    // Host memory: on a GPU the CP runs' tensors are the device's, the oracle stays on the host.
    check_run_memory(common, "verify", largest_case_memory(valid, args.device.cuda()), 0);
  }
  const c10::Device device = rank_device(args.device, world);
  Report report;
  if (lead && !named && !args.adhoc.given) {
    Report single;
    for (const VerifyCase& c : default_single_device_cases())
      for (const CheckRow& row : run_single_device_checks(c)) single.add(row);
    std::cout << "Single-device checks (the reference against itself: gradients, precisions, identities)\n";
    single.print();
    std::cout << "\nContext-parallel runs against the single-device float64 reference\n";
    report.rows = single.rows;
    report.failures = single.failures;
  }
  const GroupOptions options = group_options_for(args.device, device, args.timeout_s);
  if (lead && args.device.cuda())
    std::cerr << "verify: CP runs on " << device.type() << " (backend " << args.device.backend
              << "); the float64 oracle on the CPU\n";
  Rendezvous rendezvous = Rendezvous::of(world, options.timeout);
  if (lead && rendezvous.topology().hosts() > 1) std::cerr << "verify: " << rendezvous.topology().describe() << "\n";
  GroupCache group_cache(rendezvous, options);
  nlohmann::json described = nlohmann::json::array();
  for (size_t i = 0; i < cases.size(); ++i) {
    const CpCase& c = cases[i];
    if (lead) std::cerr << "verify: [" << i + 1 << "/" << cases.size() << "] " << c.describe() << "\n";
    described.push_back(c.describe());
    try {
      validate_cp_case(c, world.size);  // no collective: every rank rejects alike
    } catch (const Error& e) {
      if (lead) std::cerr << e.what() << "\n";
      report.add({c.name, std::string("rejected: ") + e.rule(), INFINITY, 0.0});
      continue;
    }
    std::vector<CheckRow> rows;
    try {
      rows = run_cp_case(c, group_cache.get(c.mesh));
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {  // communication faults are mlacp errors already (comm.h)
      std::string cause = e.what();
      cause = cause.substr(0, cause.find('\n'));
      fail_fault("verify", "the case failed on this rank outside any rule mlacp checks",
                 {got("rank", world.rank), got("case", c.name), got("cause", cause)},
                 "report this with the case's flags (mlacp verify --list shows them)");
    }
    for (const CheckRow& row : rows) report.add(row);
  }
  if (!lead) return report.failures == 0 ? 0 : 1;
  return report.finish(args.json_path, "multi-rank", {{"world_size", world.size}, {"cases", described}});
}

}  // namespace

CLI::App* add_verify_command(CLI::App& app, VerifyArgs& args) {
  CLI::App* cmd = app.add_subcommand("verify", "check mlacp against the single-device float64 reference");
  cmd->add_option("--case", args.cases, "case name (repeatable; 'all': the full matrix; 'pieces': its structures through the varlen pieces of CUDA tensors, on 4 ranks); default: the quick matrix")->take_all();
  cmd->add_flag("--list", args.list, "list the cases (with every parameter) and exit");
  cmd->add_flag("--single-device", args.single_device, "only the single-device checks, in this process");
  cmd->add_option("--nproc", args.nproc, "local ranks to launch (ignored under torchrun)")->check(int_range(1, 64));
  add_timeout_option(cmd, args.timeout_s, "collective timeout in seconds (a dead peer is an error after it)");
  cmd->add_option("--json", args.json_path, "also write the results as JSON to this file")->check(output_file());
  add_adhoc_options(cmd, args.adhoc);
  add_device_options(cmd, args.device);
  return cmd;
}

// --strategy auto / --ulysses auto: the planner's choice for the ad-hoc case, among what its
// flags leave open (partition and overlap too when not given). Returns the arguments with the
// choice in place of auto, and the command line the ranks get.
std::pair<VerifyArgs, CommonArgs> resolve_auto(const CommonArgs& common, const VerifyArgs& args, int64_t world_size) {
  const AdHocCase& a = args.adhoc;
  AdHocCase probe = a;  // the case with a placeholder choice, for its shapes and degrees
  probe.strategy = "latent_kv_head";
  probe.ulysses = "0";
  const CpCase c = build_adhoc(probe, world_size, false);
  AutoPlanQuery q;
  q.config = c.base.config;
  q.seq_len = c.base.seq_len;
  q.batch = c.base.batch;
  q.cp = c.mesh.cp;
  q.tp = c.mesh.tp;
  q.dtype = dtype_name(c.dtype);
  q.causal = c.base.causal.value_or(c.base.config.causal);
  if (a.strategy != "auto") q.strategy = parse_strategy(*a.strategy);
  if (a.ulysses != "auto") {
    const int64_t u = a.ulysses ? parse_count("verify", "ulysses", *a.ulysses) : 0;
    q.ulysses = u == 0 ? c.mesh.cp : u;
  }
  if (a.partition) q.partition = c.partition;
  if (a.overlap) q.overlap = c.overlap;
  q.hardware = a.plan_hardware;
  q.memory_bytes_per_rank = auto_plan_memory_per_rank(common, args.device.cuda(), world_size);
  q.cpu_run = !args.device.cuda();
  const PlanReport report = plan_for_auto(q);
  const CandidatePrediction& choice = report.choice();
  if (!launched_as_rank() || world_from_env().rank == 0) std::cout << auto_choice_text(report) << std::flush;
  VerifyArgs chosen = args;
  chosen.adhoc.kv_recompute = a.kv_recompute || choice.spec.kv_recompute;  // the planner's, when memory is short
  chosen.adhoc.strategy = strategy_name(choice.spec.strategy);
  chosen.adhoc.ulysses = std::to_string(choice.spec.ulysses);
  chosen.adhoc.partition = partition_name(choice.spec.partition);
  chosen.adhoc.overlap = choice.spec.overlap;
  chosen.adhoc.plan_hardware.clear();
  CommonArgs with = common;
  const std::vector<std::pair<std::string, std::string>> values = {
      {"--strategy", *chosen.adhoc.strategy},
      {"--ulysses", *chosen.adhoc.ulysses},
      {"--partition", *chosen.adhoc.partition},
      {"--overlap", choice.spec.overlap ? "true" : "false"}};
  with.argv = with_planned_choice(common.argv, values);
  if (chosen.adhoc.kv_recompute) with.argv = with_planned_flag(with.argv, "--kv-recompute");
  return {chosen, with};
}

int run_verify(const CommonArgs& common, const VerifyArgs& args) {
  if (args.adhoc.strategy == "auto" || args.adhoc.ulysses == "auto") {
    MLACP_REQUIRE(!args.single_device && !args.list, "verify", "--strategy/--ulysses auto needs ranks to run on",
                  {}, "drop --single-device / --list, or give the strategy");
    MLACP_REQUIRE(!launched_as_rank() || !args.adhoc.plan_hardware.empty(), "verify",
                  "--strategy/--ulysses auto under torchrun needs --plan-hardware (a calibration per rank could choose "
                  "differently on each)",
                  {}, "write one with mlacp plan --calibrate --save-hardware FILE and pass --plan-hardware FILE");
    const auto [chosen, with] = resolve_auto(common, args, launched_as_rank() ? world_from_env().size : args.nproc);
    return run_verify(with, chosen);
  }
  if (args.single_device) {
    MLACP_REQUIRE(!args.device.cuda(), "verify", "--single-device checks the CPU reference against itself",
                  {got("device", args.device.device)},
                  "drop --device cuda (a GPU's single-device exactness is scripts/gpu-check.sh's), or run ranks");
    MLACP_REQUIRE(args.adhoc.checkpoint.empty(), "verify",
                  "--checkpoint runs on ranks: --single-device takes only --case names",
                  {got("checkpoint", args.adhoc.checkpoint)}, "drop --single-device (use --nproc 1 for one rank)");
    apply_threads(common);
    return run_single_device(args);
  }
  if (launched_as_rank()) return run_as_rank(common, args);
  // Every rule that needs no collective, here, before any rank starts: one clear error (a rank
  // that exits early would otherwise make the launcher stop the others before they print it).
  if (!args.list) {
    const std::vector<CpCase> cases = select_cp_cases(args, args.nproc, /*read_weights=*/false);
    for (const CpCase& c : cases) validate_cp_case(c, args.nproc);
    check_device_args(args.device, args.nproc, "verify");
    check_run_memory(common, "verify", largest_case_memory(cases, args.device.cuda()), args.nproc);
  }
  return relaunch_local(common, args.nproc);
}

}  // namespace mlacp::tools
