// The CP exactness matrix (docs/DESIGN.md §9) as one test per case: the cases `mlacp verify --case all`
// runs (exactness_cp_cases), each on its own forked world of dp*cp*tp ranks, every CheckRow
// (output, input and parameter gradients, overlap on == off, frozen contract, bytes) within its
// tolerance. A failure names the case and prints the failing rows.
#include <cctype>
#include <ostream>

#include <gtest/gtest.h>

#include "check/cp_checks.h"
#include "support/multiprocess.h"

namespace mlacp {

// GoogleTest prints a parameter with PrintTo (found by ADL): the case's one-line description.
void PrintTo(const CpCase& c, std::ostream* os) { *os << c.describe(); }

namespace {

// "latent-u2-head_tail-packed" -> "latent_u2_head_tail_packed" (GoogleTest names: [A-Za-z0-9_]).
std::string test_name_of(const std::string& case_name) {
  std::string name = case_name;
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return name;
}

class CpMatrix : public ::testing::TestWithParam<CpCase> {};

TEST_P(CpMatrix, EveryCheckPasses) {
  const CpCase c = GetParam();
  SCOPED_TRACE(c.describe());
  const int world = static_cast<int>(c.mesh.dp * c.mesh.cp * c.mesh.tp);
  EXPECT_TRUE(test::run_ranks(world, [&c](int rank, int world_size, const std::string& store) {
    validate_cp_case(c, world_size);  // no collective: every rank rejects alike
    ParallelGroups groups = test::make_groups(rank, world_size, store, c.mesh);
    const std::vector<CheckRow> rows = run_cp_case(c, groups);
    // The errors are max-reduced over the world: every rank holds the same rows, rank 0 judges.
    if (rank != 0) return;
    EXPECT_FALSE(rows.empty()) << "no checks for " << c.name;
    for (const CheckRow& row : rows) {
      EXPECT_TRUE(row.passed()) << row.case_name << " / " << row.quantity << ": error " << row.error
                                << " > tolerance " << row.tolerance;
    }
  }));
}

INSTANTIATE_TEST_SUITE_P(Exactness, CpMatrix, ::testing::ValuesIn(exactness_cp_cases()),
                         [](const ::testing::TestParamInfo<CpCase>& info) { return test_name_of(info.param.name); });
// Every structure of the matrix again through the varlen pieces: the CUDA path's planning, gathers
// and log-sum-exp combination on real ranks, on the CPU (docs/DESIGN.md §16).
INSTANTIATE_TEST_SUITE_P(Pieces, CpMatrix, ::testing::ValuesIn(pieces_cp_cases()),
                         [](const ::testing::TestParamInfo<CpCase>& info) { return test_name_of(info.param.name); });

}  // namespace
}  // namespace mlacp
