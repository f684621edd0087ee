// The evaluator against the numbers PyTorch computed for the model card (models/demo/quality.json):
// perplexity of the legal domain for the base, the full fine-tune and BitDelta (row and tensor α),
// and math accuracy of the math variant, full and BitDelta. The whole table (`bitdelta eval`, all
// domains) is recorded in bench/RESULTS.md; this test keeps the suite fast with one domain.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "bitdelta/compress.h"
#include "bitdelta/evaluate.h"
#include "test_util.h"

namespace bitdelta {
namespace {

namespace fs = std::filesystem;
const fs::path kDemo = fs::path(BITDELTA_SOURCE_DIR) / "models" / "demo";

TEST(Evaluate, AgreesWithTheModelCard) {
  if (!fs::exists(kDemo / "quality.json")) GTEST_SKIP() << "models/demo is missing";
  std::ifstream in(kDemo / "quality.json");
  const auto q = nlohmann::json::parse(in);
  test::TempDir dir;
  for (const char* v : {"legal", "math"})
    for (AlphaMode m : {AlphaMode::Row, AlphaMode::Tensor}) {
      CompressOptions o;
      o.alpha_mode = m;
      compress(Checkpoint(kDemo / "base"), Checkpoint(kDemo / v),
               dir / (std::string(v) + "_" + std::string(alpha_mode_name(m)) + ".bitdelta"), o);
    }
  Model base(kDemo / "base", 2);
  const Tokenizer tok(kDemo / "base");
  const int legal_row = base.add_variant("legal_row", dir / "legal_row.bitdelta");
  const int legal_tensor = base.add_variant("legal_tensor", dir / "legal_tensor.bitdelta");
  const int math_row = base.add_variant("math_row", dir / "math_row.bitdelta");
  const int math_tensor = base.add_variant("math_tensor", dir / "math_tensor.bitdelta");

  std::ifstream text_in(kDemo / "eval" / "legal.txt", std::ios::binary);
  const std::string text{std::istreambuf_iterator<char>(text_in), {}};
  const auto ids = tok.encode(text, false);
  // float32 on both sides, summed in different orders: agreement to ~1e-5 relative is expected;
  // 1e-4 leaves room without hiding a wrong definition (a chunking off by one moves it by >1e-3).
  const auto& ppl = q["perplexity"]["legal"];
  EXPECT_NEAR(perplexity(base, 0, ids, tok.bos_id()).value, ppl["base"].get<double>(), 1e-4 * ppl["base"].get<double>());
  EXPECT_NEAR(perplexity(base, legal_row, ids, tok.bos_id()).value, ppl["bitdelta_row"].get<double>(),
              1e-4 * ppl["bitdelta_row"].get<double>());
  EXPECT_NEAR(perplexity(base, legal_tensor, ids, tok.bos_id()).value, ppl["bitdelta_tensor"].get<double>(),
              1e-4 * ppl["bitdelta_tensor"].get<double>());
  Model legal_full(kDemo / "legal", 2);
  EXPECT_NEAR(perplexity(legal_full, 0, ids, tok.bos_id()).value, ppl["full"].get<double>(), 1e-4 * ppl["full"].get<double>());

  // Greedy answers can flip only at near-ties: allow one problem in a thousand either way.
  const auto problems = read_math_problems((kDemo / "eval" / "math.jsonl").string());
  const auto& acc = q["math_accuracy"]["math"];
  Model math_full(kDemo / "math", 2);
  EXPECT_NEAR(math_accuracy(math_full, 0, tok, problems), acc["full"].get<double>(), 1.0 / problems.size());
  EXPECT_NEAR(math_accuracy(base, math_row, tok, problems), acc["bitdelta_row"].get<double>(), 1.0 / problems.size());
  EXPECT_NEAR(math_accuracy(base, math_tensor, tok, problems), acc["bitdelta_tensor"].get<double>(), 1.0 / problems.size());
  EXPECT_EQ(math_accuracy(base, 0, tok, problems), q["math_accuracy"]["base"].get<double>());
}

}  // namespace
}  // namespace bitdelta
