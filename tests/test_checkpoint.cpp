#include <gtest/gtest.h>

#include "bitdelta/checkpoint.h"
#include "bitdelta/error.h"
#include "test_util.h"

namespace bitdelta {
namespace {

using test::TempDir;

TEST(Checkpoint, SingleFileAndShardedSeeTheSameTensors) {
  TempDir dir;
  const auto m = test::tiny_llama(DType::BF16, 1);
  test::write_checkpoint(dir / "one", m, 1);
  test::write_checkpoint(dir / "three", m, 3);
  Checkpoint one(dir / "one"), three(dir / "three");
  EXPECT_EQ(one.architecture(), "LlamaForCausalLM");
  EXPECT_EQ(one.tensor_names(), three.tensor_names());
  EXPECT_EQ(three.shard_names().size(), 3u);
  for (const auto& name : one.tensor_names()) {
    const auto a = one.tensor(name), b = three.tensor(name);
    EXPECT_EQ(a.shape, b.shape);
    ASSERT_EQ(a.data.size(), m.at(name).bytes.size());
    EXPECT_TRUE(std::equal(a.data.begin(), a.data.end(), b.data.begin())) << name;
  }
  EXPECT_EQ(one.total_tensor_bytes(), three.total_tensor_bytes());
}

TEST(Checkpoint, NotACheckpointIsNamed) {
  TempDir dir;
  auto error_of = [](const std::filesystem::path& p) -> std::string {
    try {
      Checkpoint c(p);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error_of(dir / "missing").find("not a directory"), std::string::npos);
  EXPECT_NE(error_of(dir.path()).find("no config.json"), std::string::npos);
  test::write_text(dir / "config.json", "{}");
  EXPECT_NE(error_of(dir.path()).find("no model.safetensors"), std::string::npos);
  test::write_text(dir / "model.safetensors.index.json", R"({"weight_map": {"w": "gone.safetensors"}})");
  EXPECT_NE(error_of(dir.path()).find("tensor 'w' is in missing shard gone.safetensors"), std::string::npos);
  test::write_text(dir / "model.safetensors.index.json", R"({"weight_map": {"w": "../x.safetensors"}})");
  EXPECT_NE(error_of(dir.path()).find("plain file name"), std::string::npos);
  test::write_text(dir / "config.json", "{not json");
  EXPECT_NE(error_of(dir.path()).find("config.json: invalid JSON"), std::string::npos);
}

TEST(Checkpoint, IndexListingATensorAbsentFromItsShard) {
  TempDir dir;
  test::write_checkpoint(dir.path(), test::tiny_llama(DType::F32, 2, 1), 2);
  auto index = test::read_file(dir / "model.safetensors.index.json");
  index.insert(index.find('{', index.find("weight_map")) + 1, R"("ghost.weight": "model-00001-of-00002.safetensors", )");
  test::write_text(dir / "model.safetensors.index.json", index);
  Checkpoint c(dir.path());
  try {
    c.tensor("ghost.weight");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("tensor 'ghost.weight' is listed in the index but not in the shard"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace bitdelta
