// HuggingFace checkpoints: the safetensors reader (well-formed files of every float dtype, and
// broken ones, each a clear mlacp error) and checkpoint folders (single file, shards + index),
// loading a layer's attention weights into MlaAttention, and the verify case built from them.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "check/cases.h"
#include "check/single_device_checks.h"
#include "mlacp/checkpoint.h"
#include "model/safetensors.h"
#include "support/error_of.h"
#include "support/hf_test_checkpoint.h"
#include "support/safetensors_writer.h"

namespace mlacp {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using test::error_of;
using test::RawTensor;

// A fresh folder per test, removed afterwards.
class TempFolder {
 public:
  TempFolder() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = ::testing::TempDir() + "mlacp_ckpt_" + info->test_suite_name() + "_" + info->name() + "_" +
            std::to_string(::getpid());
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempFolder() { std::filesystem::remove_all(path_); }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// An mlacp error, and nothing from LibTorch's machinery.
void expect_clean(const std::string& msg) {
  EXPECT_THAT(msg, HasSubstr("mlacp: "));
  EXPECT_THAT(msg, Not(HasSubstr("Exception raised from")));
  EXPECT_THAT(msg, Not(HasSubstr("frame #")));
}

std::string safetensors_error(const TempFolder& dir, const std::string& bytes) {
  const std::string path = dir.file("broken.safetensors");
  test::write_bytes(path, bytes);
  const std::string msg = error_of([&] {
    const SafetensorsFile file = read_safetensors_header(path);
    for (const auto& item : file.tensors) read_safetensors_tensor(file, item.first);
  });
  expect_clean(msg);
  EXPECT_THAT(msg, HasSubstr("file=" + path));
  return msg;
}

const MlaConfig& test_config() {
  static const MlaConfig config = parse_config_json(test::hf_test_config_json());
  return config;
}

// ---------------------------------------------------------------------------------------------
// safetensors files

TEST(Safetensors, ReadsEveryFloatDtypeAsStored) {
  TempFolder dir;
  auto g = at::make_generator<at::CPUGeneratorImpl>(3);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const std::vector<std::pair<std::string, at::Tensor>> tensors = {
      {"a.f32", at::randn({3, 5}, g, f32)},
      {"b.f64", at::randn({2, 2, 3}, g, f32).to(at::kDouble) / 3.0},
      {"c.bf16", at::randn({7}, g, f32).to(at::kBFloat16)},
      {"d.f16", at::randn({4, 1}, g, f32).to(at::kHalf)},
      {"e.i64", at::arange(6, at::TensorOptions().dtype(at::kLong)).view({2, 3})},
      {"f.empty", at::zeros({0, 4}, f32)},
      {"g.scalar", at::full({}, 2.5, f32)},
  };
  const std::string path = dir.file("x.safetensors");
  test::write_bytes(path, test::safetensors_bytes(test::raw_tensors(tensors), {{"format", "pt"}}));
  const SafetensorsFile file = read_safetensors_header(path);
  EXPECT_EQ(file.metadata.at("format"), "pt");
  ASSERT_EQ(file.tensors.size(), tensors.size());
  for (const auto& [name, expected] : tensors) {
    const at::Tensor t = read_safetensors_tensor(file, name);
    EXPECT_EQ(t.scalar_type(), expected.scalar_type()) << name;
    EXPECT_EQ(t.sizes(), expected.sizes()) << name;
    EXPECT_TRUE(at::equal(t, expected)) << name;
  }
  EXPECT_EQ(file.tensors.at("c.bf16").dtype, "BF16");
}

TEST(SafetensorsErrors, ShorterThanTheLengthPrefix) {
  TempFolder dir;
  const std::string msg = safetensors_error(dir, std::string(7, '\0'));
  EXPECT_THAT(msg, HasSubstr("the file is shorter than the 8-byte header length"));
  EXPECT_THAT(msg, HasSubstr("file_size=7"));
  EXPECT_THAT(msg, HasSubstr("truncated"));
}

TEST(SafetensorsErrors, HeaderLengthBeyondTheFile) {
  TempFolder dir;
  std::string bytes = test::safetensors_file_bytes(std::string(1000, ' '), "");
  bytes.resize(40);  // the prefix still says 1000
  const std::string msg = safetensors_error(dir, bytes);
  EXPECT_THAT(msg, HasSubstr("the header length exceeds the file"));
  EXPECT_THAT(msg, HasSubstr("header_length=1000"));
  EXPECT_THAT(msg, HasSubstr("file_size=40"));
}

TEST(SafetensorsErrors, HugeHeaderLength) {
  TempFolder dir;
  std::string bytes(16, '\xff');  // length 2^64 - 1
  const std::string msg = safetensors_error(dir, bytes);
  EXPECT_THAT(msg, HasSubstr("the header length exceeds the file"));
}

TEST(SafetensorsErrors, HeaderIsNotJson) {
  TempFolder dir;
  const std::string msg = safetensors_error(dir, test::safetensors_file_bytes(R"({"a": {"dtype": "F32", )", ""));
  EXPECT_THAT(msg, HasSubstr("the header is not valid JSON"));
  EXPECT_THAT(msg, HasSubstr("parser="));
}

TEST(SafetensorsErrors, HeaderIsNotAnObject) {
  TempFolder dir;
  const std::string msg = safetensors_error(dir, test::safetensors_file_bytes("[1, 2]", ""));
  EXPECT_THAT(msg, HasSubstr("the header must be a JSON object"));
  EXPECT_THAT(msg, HasSubstr("type=array"));
}

TEST(SafetensorsErrors, MalformedEntries) {
  TempFolder dir;
  struct Case {
    const char* header;
    const char* expected;
  };
  const Case cases[] = {
      {R"({"w": 5})", "a tensor entry must be an object"},
      {R"({"w": {"dtype": "F32", "shape": [1]}})", "a tensor entry lacks a required field; got file="},
      {R"({"w": {"dtype": 7, "shape": [1], "data_offsets": [0, 4]}})", "dtype must be a string"},
      {R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", "shape must be an array of non-negative"},
      {R"({"w": {"dtype": "F32", "shape": 4, "data_offsets": [0, 4]}})", "shape must be an array of non-negative"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", "data_offsets must be [begin, end]"},
      {R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}})", "data_offsets must have begin <= end"},
      {R"({"__metadata__": {"format": 1}})", "__metadata__ must be an object of strings"},
  };
  for (const Case& k : cases) {
    const std::string msg = safetensors_error(dir, test::safetensors_file_bytes(k.header, std::string(4, '\0')));
    EXPECT_THAT(msg, HasSubstr(k.expected)) << k.header;
  }
}

TEST(SafetensorsErrors, TruncatedDataIsOutsideTheFile) {
  TempFolder dir;
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  std::string bytes = test::safetensors_bytes(test::raw_tensors({{"first", at::ones({4}, f32)}, {"second", at::ones({8}, f32)}}));
  bytes.resize(bytes.size() - 5);
  const std::string msg = safetensors_error(dir, bytes);
  EXPECT_THAT(msg, HasSubstr("the tensor's data_offsets lie outside the file"));
  EXPECT_THAT(msg, HasSubstr("tensor=second"));
  EXPECT_THAT(msg, HasSubstr("begin=16, end=48, data_bytes=43"));
}

TEST(SafetensorsErrors, ShapeAndByteRangeDisagree) {
  TempFolder dir;
  const std::string msg = safetensors_error(
      dir, test::safetensors_file_bytes(R"({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}})",
                                        std::string(20, '\0')));
  EXPECT_THAT(msg, HasSubstr("the tensor's byte range does not match its shape and dtype"));
  EXPECT_THAT(msg, HasSubstr("tensor=w, dtype=F32, shape=[2, 3], expected_bytes=24, data_offsets_bytes=20"));
}

TEST(SafetensorsErrors, ShapeWhoseSizeOverflows) {
  TempFolder dir;
  const std::string msg = safetensors_error(
      dir, test::safetensors_file_bytes(
               R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 8], "data_offsets": [0, 8]}})", std::string(8, '\0')));
  EXPECT_THAT(msg, HasSubstr("does not match its shape and dtype"));
  EXPECT_THAT(msg, HasSubstr("expected_bytes=overflow"));
}

TEST(SafetensorsErrors, Fp8TensorNamesTheWayOut) {
  TempFolder dir;
  const std::string msg = safetensors_error(
      dir, test::safetensors_file_bytes(R"({"q.weight": {"dtype": "F8_E4M3", "shape": [2, 2], "data_offsets": [0, 4]}})",
                                        std::string(4, '\0')));
  EXPECT_THAT(msg, HasSubstr("fp8 weights are not supported"));
  EXPECT_THAT(msg, HasSubstr("tensor=q.weight, dtype=F8_E4M3"));
  EXPECT_THAT(msg, HasSubstr("dequantise to bf16 first, e.g. with DeepSeek's fp8_cast_bf16.py"));
}

TEST(SafetensorsErrors, UnknownDtypeOpensButIsNotRead) {
  TempFolder dir;
  const std::string path = dir.file("x.safetensors");
  test::write_bytes(path, test::safetensors_file_bytes(R"({"w": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}})",
                                                       std::string(2, '\0')));
  const SafetensorsFile file = read_safetensors_header(path);  // unknown dtypes do not stop the file opening
  const std::string msg = error_of([&] { read_safetensors_tensor(file, "w"); });
  expect_clean(msg);
  EXPECT_THAT(msg, HasSubstr("unsupported tensor dtype"));
  EXPECT_THAT(msg, HasSubstr("tensor=w, dtype=F4"));
  EXPECT_THAT(msg, HasSubstr("mlacp reads F16, BF16, F32, F64"));
}

// ---------------------------------------------------------------------------------------------
// checkpoint folders

TEST(HfCheckpoint, MlaParameterShapesAreTheModulesParameters) {
  std::vector<MlaConfig> configs{preset_config("tiny"), test_config(), preset_config("tiny"), preset_config("tiny")};
  configs[2].q_lora_rank = std::nullopt;
  configs[2].attention_bias = true;
  configs[3].output_gate = true;
  configs[3].up_proj_bias = true;
  for (const MlaConfig& config : configs) {
    MlaAttention module(config);
    std::vector<std::pair<std::string, std::vector<int64_t>>> actual;
    for (const auto& item : module->named_parameters()) actual.emplace_back(item.key(), item.value().sizes().vec());
    EXPECT_EQ(mla_parameter_shapes(config), actual);
  }
}

TEST(HfCheckpoint, SingleFileLoadsEachLayersAttention) {
  TempFolder dir;
  test::write_hf_checkpoint(dir.path(), test::hf_test_config_json(),
                            test::hf_test_tensors(test_config(), 2, 40, at::kBFloat16));
  const HfCheckpoint ckpt = open_hf_checkpoint(dir.path());
  EXPECT_EQ(ckpt.config(), test_config());
  ASSERT_TRUE(ckpt.config().yarn.has_value());
  EXPECT_EQ(ckpt.config().rope_layout, RopeLayout::interleaved);
  EXPECT_EQ(ckpt.hf_config().num_hidden_layers, std::optional<int64_t>(2));
  EXPECT_EQ(ckpt.hf_config().dtype, std::optional<std::string>("bfloat16"));
  EXPECT_TRUE(ckpt.has_tensor("model.embed_tokens.weight"));
  EXPECT_TRUE(ckpt.has_tensor("model.layers.1.self_attn.kv_b_proj.weight"));
  EXPECT_EQ(ckpt.tensor_info("model.layers.0.self_attn.q_b_proj.weight").dtype, "BF16");
  EXPECT_EQ(ckpt.tensor_info("model.layers.0.self_attn.q_b_proj.weight").shape, (std::vector<int64_t>{24, 8}));
  for (int64_t layer : {0, 1}) {
    const auto expected = test::random_attention_weights(test_config(), 40 + layer, at::kBFloat16);
    MlaAttention module(ckpt.config(), at::TensorOptions().dtype(at::kDouble));
    ckpt.load_attention_layer(module, layer);
    auto params = module->named_parameters();
    ASSERT_EQ(params.size(), expected.size());
    for (const auto& [name, value] : expected) {
      EXPECT_EQ(params[name].scalar_type(), at::kDouble) << name;
      EXPECT_TRUE(at::equal(params[name], value.to(at::kDouble))) << "layer " << layer << " " << name;
      EXPECT_TRUE(params[name].requires_grad()) << name;
    }
    const at::Tensor y = module->forward(at::randn({1, 5, 16}, at::TensorOptions().dtype(at::kDouble)));
    EXPECT_TRUE(y.isfinite().all().item<bool>());
  }
}

TEST(HfCheckpoint, ShardedWithIndexReadsTheSameTensors) {
  TempFolder dir;
  const auto tensors = test::hf_test_tensors(test_config(), 2, 7, at::kBFloat16);
  test::write_hf_checkpoint(dir.file("single"), test::hf_test_config_json(), tensors, 1);
  test::write_hf_checkpoint(dir.file("sharded"), test::hf_test_config_json(), tensors, 3);
  ASSERT_TRUE(std::filesystem::exists(dir.file("sharded/model-00003-of-00003.safetensors")));
  const HfCheckpoint single = open_hf_checkpoint(dir.file("single"));
  const HfCheckpoint sharded = open_hf_checkpoint(dir.file("sharded"));
  EXPECT_EQ(single.tensor_names(), sharded.tensor_names());
  EXPECT_THAT(sharded.tensor_info("model.layers.0.self_attn.q_a_proj.weight").file, HasSubstr("-of-00003.safetensors"));
  for (int64_t layer : {0, 1}) {
    const auto a = single.read_attention_layer(layer, at::kFloat);
    const auto b = sharded.read_attention_layer(layer, at::kFloat);
    ASSERT_EQ(a.size(), b.size());
    const auto shapes = mla_parameter_shapes(test_config());
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].first, shapes[i].first);  // the module's parameter order
      EXPECT_EQ(a[i].first, b[i].first);
      EXPECT_EQ(b[i].second.scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(a[i].second, b[i].second)) << a[i].first;
    }
  }
}

TEST(HfCheckpoint, Float32AndFloat64StoredWeights) {
  for (at::ScalarType stored : {at::kFloat, at::kDouble}) {
    TempFolder dir;
    test::write_hf_checkpoint(dir.path(), test::hf_test_config_json(), test::hf_test_tensors(test_config(), 1, 5, stored), 2);
    const HfCheckpoint ckpt = open_hf_checkpoint(dir.path());
    MlaAttention module(ckpt.config());  // float32 parameters
    ckpt.load_attention_layer(module, 0, at::kDouble);  // converted to float64 first, then loaded exactly
    for (const auto& [name, value] : test::random_attention_weights(test_config(), 5, stored)) {
      const at::Tensor p = module->named_parameters()[name];
      EXPECT_EQ(p.scalar_type(), at::kDouble);
      EXPECT_TRUE(at::equal(p, value.to(at::kDouble))) << name;
    }
  }
}

TEST(HfCheckpoint, BiasesAndNoQueryLatent) {
  TempFolder dir;
  const std::string json = test::hf_test_config_json(1, /*attention_bias=*/true, /*q_latent=*/false);
  const MlaConfig config = parse_config_json(json);
  test::write_hf_checkpoint(dir.path(), json, test::hf_test_tensors(config, 1, 9, at::kFloat));
  const HfCheckpoint ckpt = open_hf_checkpoint(dir.path());
  EXPECT_TRUE(ckpt.has_tensor("model.layers.0.self_attn.q_proj.bias"));
  MlaAttention module(ckpt.config());
  ckpt.load_attention_layer(module, 0);
  for (const auto& [name, value] : test::random_attention_weights(config, 9, at::kFloat))
    EXPECT_TRUE(at::equal(module->named_parameters()[name], value)) << name;
}

// The verify case with checkpoint weights: the module holds them (in the check's dtype) and the
// single-device checks pass on it.
TEST(HfCheckpoint, VerifyCaseModuleTakesTheCheckpointWeights) {
  TempFolder dir;
  test::write_hf_checkpoint(dir.path(), test::hf_test_config_json(), test::hf_test_tensors(test_config(), 2, 11, at::kBFloat16));
  const HfCheckpoint ckpt = open_hf_checkpoint(dir.path());
  VerifyCase c{"checkpoint", ckpt.config()};
  c.weights = std::make_shared<const CaseWeights>(ckpt.read_attention_layer(1));
  c.weights_source = "test layer 1";
  const auto expected = test::random_attention_weights(test_config(), 12, at::kBFloat16);
  for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    MlaAttention module = make_case_module(c, dtype);
    for (const auto& [name, value] : expected)
      EXPECT_TRUE(at::equal(module->named_parameters()[name], value.to(dtype))) << name;
  }
  for (const CheckRow& row : run_single_device_checks(c)) EXPECT_TRUE(row.passed()) << row.quantity << " " << row.error;
}

// ---------------------------------------------------------------------------------------------
// checkpoint rejections

// Writes a one-layer checkpoint whose tensors went through `edit`, opens it and loads layer 0.
template <class Edit>
std::string load_error(const TempFolder& dir, Edit edit, int shards = 1) {
  auto tensors = test::hf_test_tensors(test_config(), 1, 3, at::kBFloat16);
  edit(tensors);
  test::write_hf_checkpoint(dir.path(), test::hf_test_config_json(1), tensors, shards);
  const std::string msg = error_of([&] {
    MlaAttention module(test_config());
    open_hf_checkpoint(dir.path()).load_attention_layer(module, 0);
  });
  expect_clean(msg);
  return msg;
}

void erase_tensor(std::vector<RawTensor>& tensors, const std::string& name) {
  const size_t before = tensors.size();
  tensors.erase(std::remove_if(tensors.begin(), tensors.end(), [&](const RawTensor& t) { return t.name == name; }),
                tensors.end());
  ASSERT_EQ(tensors.size() + 1, before) << name;
}

TEST(HfCheckpointErrors, MissingLayerTensor) {
  TempFolder dir;
  const std::string msg =
      load_error(dir, [](auto& t) { erase_tensor(t, "model.layers.0.self_attn.kv_a_layernorm.weight"); });
  EXPECT_THAT(msg, HasSubstr("attention tensors of the layer are missing from the checkpoint"));
  EXPECT_THAT(msg, HasSubstr("missing=[model.layers.0.self_attn.kv_a_layernorm.weight]"));
  EXPECT_THAT(msg, HasSubstr("config.json must describe these weights"));
}

TEST(HfCheckpointErrors, ExtraLayerTensor) {
  TempFolder dir;
  const std::string msg = load_error(dir, [](auto& t) {
    t.push_back(test::raw_tensor("model.layers.0.self_attn.q_a_proj.bias", at::zeros({8}, at::kBFloat16)));
  });
  EXPECT_THAT(msg, HasSubstr("the checkpoint holds attention tensors the layer has no parameter for"));
  EXPECT_THAT(msg, HasSubstr("extra=[model.layers.0.self_attn.q_a_proj.bias]"));
  EXPECT_THAT(msg, HasSubstr("attention_bias"));
}

TEST(HfCheckpointErrors, ShapeMismatch) {
  TempFolder dir;
  const std::string msg = load_error(dir, [](auto& t) {
    for (RawTensor& r : t)
      if (r.name == "model.layers.0.self_attn.kv_b_proj.weight") r = test::raw_tensor(r.name, at::zeros({28, 5}, at::kBFloat16));
  });
  EXPECT_THAT(msg, HasSubstr("an attention tensor's shape does not match the layer's parameter"));
  EXPECT_THAT(msg, HasSubstr("tensor=model.layers.0.self_attn.kv_b_proj.weight, shape=[28, 5], expected=[28, 6]"));
  EXPECT_THAT(msg, HasSubstr("file=" + dir.file("model.safetensors")));
}

TEST(HfCheckpointErrors, Fp8WeightsWithBlockScales) {
  TempFolder dir;
  const std::string msg = load_error(dir, [](auto& t) {
    for (RawTensor& r : t) {
      if (r.name == "model.layers.0.self_attn.kv_b_proj.weight") {
        r.dtype = "F8_E4M3";
        r.bytes = std::string(28 * 6, '\0');
      }
    }
    t.push_back(test::raw_tensor("model.layers.0.self_attn.kv_b_proj.weight_scale_inv", at::ones({1, 1})));
  });
  EXPECT_THAT(msg, HasSubstr("fp8 weights are not supported"));
  EXPECT_THAT(msg, HasSubstr("tensor=model.layers.0.self_attn.kv_b_proj.weight, dtype=F8_E4M3"));
  EXPECT_THAT(msg, HasSubstr("fp8_cast_bf16.py"));
}

TEST(HfCheckpointErrors, LayerOutsideTheModel) {
  TempFolder dir;
  test::write_hf_checkpoint(dir.path(), test::hf_test_config_json(2), test::hf_test_tensors(test_config(), 2, 3, at::kFloat));
  const HfCheckpoint ckpt = open_hf_checkpoint(dir.path());
  std::string msg = error_of([&] { ckpt.check_attention_layer(2); });
  expect_clean(msg);
  EXPECT_THAT(msg, HasSubstr("the layer index is outside the model"));
  EXPECT_THAT(msg, HasSubstr("layer=2, num_hidden_layers=2"));
  msg = error_of([&] { ckpt.read_attention_layer(-1); });
  EXPECT_THAT(msg, HasSubstr("the layer index is outside the model"));
}

TEST(HfCheckpointErrors, LayerWithoutAttentionTensors) {
  TempFolder dir;
  test::write_hf_checkpoint(dir.path(), test::hf_test_config_json(0), test::hf_test_tensors(test_config(), 2, 3, at::kFloat));
  const std::string msg = error_of([&] { open_hf_checkpoint(dir.path()).check_attention_layer(5); });
  expect_clean(msg);
  EXPECT_THAT(msg, HasSubstr("the checkpoint holds no attention tensors for this layer"));
  EXPECT_THAT(msg, HasSubstr("prefix=model.layers.5.self_attn., layers_with_attention=[0, 1]"));
}

TEST(HfCheckpointErrors, ModuleOfAnotherShapeOrShardedOverTp) {
  TempFolder dir;
  test::write_hf_checkpoint(dir.path(), test::hf_test_config_json(1), test::hf_test_tensors(test_config(), 1, 3, at::kFloat));
  const HfCheckpoint ckpt = open_hf_checkpoint(dir.path());
  MlaConfig wider = test_config();
  wider.num_heads = 8;
  MlaAttention other(wider);
  std::string msg = error_of([&] { ckpt.load_attention_layer(other, 0); });
  expect_clean(msg);
  EXPECT_THAT(msg, HasSubstr("tensor=model.layers.0.self_attn.q_b_proj.weight, shape=[24, 8], expected=[48, 8]"));
  MlaAttention sharded(test_config());
  sharded->shard_heads_for_tp(0, 2);
  msg = error_of([&] { ckpt.load_attention_layer(sharded, 0); });
  EXPECT_THAT(msg, HasSubstr("load the checkpoint before sharding heads over TP"));
}

TEST(HfCheckpointErrors, FolderProblems) {
  TempFolder dir;
  std::string msg = error_of([&] { open_hf_checkpoint(dir.file("nope")); });
  EXPECT_THAT(msg, HasSubstr("the checkpoint must be a folder"));

  msg = error_of([&] { open_hf_checkpoint(dir.path()); });
  EXPECT_THAT(msg, HasSubstr("the checkpoint folder has no config.json"));

  test::write_bytes(dir.file("config.json"), test::hf_test_config_json());
  test::write_bytes(dir.file("pytorch_model.bin"), "not read");
  msg = error_of([&] { open_hf_checkpoint(dir.path()); });
  EXPECT_THAT(msg, HasSubstr("no model.safetensors or model.safetensors.index.json in the folder"));
  EXPECT_THAT(msg, HasSubstr("weight_files=[pytorch_model.bin]"));

  test::write_hf_checkpoint(dir.path(), test::hf_test_config_json(), test::hf_test_tensors(test_config(), 2, 1, at::kFloat), 2);
  test::write_bytes(dir.file("model.safetensors"), test::safetensors_bytes({}));
  msg = error_of([&] { open_hf_checkpoint(dir.path()); });
  EXPECT_THAT(msg, HasSubstr("the folder holds both model.safetensors and its sharded form"));

  nlohmann::json bad_rope = nlohmann::json::parse(test::hf_test_config_json());
  bad_rope["rope_parameters"]["rope_type"] = "ntk";
  test::write_bytes(dir.file("config.json"), bad_rope.dump());
  msg = error_of([&] { open_hf_checkpoint(dir.path()); });
  expect_clean(msg);
  EXPECT_THAT(msg, HasSubstr("unsupported rope type"));
  EXPECT_THAT(msg, HasSubstr("file=" + dir.file("config.json")));
}

TEST(HfCheckpointErrors, IndexAndShardsDisagree) {
  TempFolder dir;
  const auto tensors = test::hf_test_tensors(test_config(), 1, 3, at::kFloat);
  const std::string config = test::hf_test_config_json(1);
  const std::string index = dir.file("model.safetensors.index.json");
  auto rewrite_index = [&](const std::function<void(nlohmann::json&)>& edit) {
    test::write_hf_checkpoint(dir.path(), config, tensors, 2);
    std::ifstream in(index);
    nlohmann::json j = nlohmann::json::parse(in);
    edit(j);
    test::write_bytes(index, j.dump());
    const std::string msg = error_of([&] { open_hf_checkpoint(dir.path()); });
    expect_clean(msg);
    return msg;
  };
  std::string msg = rewrite_index([](nlohmann::json& j) {
    j["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors";
  });
  EXPECT_THAT(msg, HasSubstr("a shard named by the index is missing"));
  EXPECT_THAT(msg, HasSubstr("shard=model-00009-of-00009.safetensors, tensor=model.norm.weight"));

  msg = rewrite_index([](nlohmann::json& j) { j["weight_map"]["model.ghost.weight"] = "model-00001-of-00002.safetensors"; });
  EXPECT_THAT(msg, HasSubstr("the index names a tensor its shard does not hold"));
  EXPECT_THAT(msg, HasSubstr("tensor=model.ghost.weight"));

  msg = rewrite_index([](nlohmann::json& j) { j["weight_map"].erase("lm_head.weight"); });
  EXPECT_THAT(msg, HasSubstr("a shard holds a tensor the index does not list for it"));
  EXPECT_THAT(msg, HasSubstr("tensor=lm_head.weight"));
  EXPECT_THAT(msg, HasSubstr("index_says=(not listed)"));

  msg = rewrite_index([](nlohmann::json& j) { j["weight_map"]["lm_head.weight"] = "../model-00001-of-00002.safetensors"; });
  EXPECT_THAT(msg, HasSubstr("the index must map each tensor to a shard file name in the checkpoint folder"));

  msg = rewrite_index([](nlohmann::json& j) { j = nlohmann::json::array(); });
  EXPECT_THAT(msg, HasSubstr("the index must be an object with a weight_map object"));

  test::write_hf_checkpoint(dir.path(), config, tensors, 2);
  test::write_bytes(index, "{\"weight_map\": ");
  msg = error_of([&] { open_hf_checkpoint(dir.path()); });
  EXPECT_THAT(msg, HasSubstr("the index is not valid JSON"));
}

TEST(HfCheckpointErrors, TruncatedShardIsNamedWhenOpening) {
  TempFolder dir;
  test::write_hf_checkpoint(dir.path(), test::hf_test_config_json(1), test::hf_test_tensors(test_config(), 1, 3, at::kFloat), 2);
  const std::string shard = dir.file("model-00002-of-00002.safetensors");
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) - 3);
  const std::string msg = error_of([&] { open_hf_checkpoint(dir.path()); });
  expect_clean(msg);
  EXPECT_THAT(msg, HasSubstr("the tensor's data_offsets lie outside the file"));
  EXPECT_THAT(msg, HasSubstr("file=" + shard));
}

TEST(HfCheckpointErrors, UnknownTensorName) {
  TempFolder dir;
  test::write_hf_checkpoint(dir.path(), test::hf_test_config_json(1), test::hf_test_tensors(test_config(), 1, 3, at::kFloat));
  const std::string msg = error_of([&] { open_hf_checkpoint(dir.path()).read_tensor("model.nope"); });
  EXPECT_THAT(msg, HasSubstr("no tensor of this name in the checkpoint"));
  EXPECT_THAT(msg, HasSubstr("tensor=model.nope"));
}

}  // namespace
}  // namespace mlacp
