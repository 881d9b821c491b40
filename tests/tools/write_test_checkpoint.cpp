// Writes a small HuggingFace checkpoint folder for the CLI tests (tests/tools/checkpoint_verify_test.sh,
// tests/tools/train_hf_checkpoint_test.sh):
//   write_test_checkpoint DIR [--shards N] [--fp8] [--decoder [--vocab V]]
// config.json in the transformers 5 form (2 layers, YaRN, interleaved rope), bf16 weights of every
// decoder tensor in N shards (default 2) with model.safetensors.index.json; --fp8 stores layer 0's
// kv_b_proj weight as F8_E4M3 with a weight_scale_inv beside it (DeepSeek-V3's release format).
// --decoder: instead, the dense decoder of mlacp train's "test" preset shapes with vocab_size V
// (default 256, the byte tokenizer's), to train from (tests/support/hf_test_checkpoint.h).
#include <cstdlib>
#include <iostream>
#include <string>

#include "mlacp/config.h"
#include "support/hf_test_checkpoint.h"
#include "support/safetensors_writer.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: write_test_checkpoint DIR [--shards N] [--fp8] [--decoder [--vocab V]]\n";
    return 2;
  }
  const std::string folder = argv[1];
  int shards = 2;
  bool fp8 = false, decoder = false;
  int64_t vocab = 256;
  for (int i = 2; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--shards" && i + 1 < argc) {
      shards = std::atoi(argv[++i]);
    } else if (arg == "--fp8") {
      fp8 = true;
    } else if (arg == "--decoder") {
      decoder = true;
    } else if (arg == "--vocab" && i + 1 < argc) {
      vocab = std::atoll(argv[++i]);
    } else {
      std::cerr << "write_test_checkpoint: unknown argument " << arg << "\n";
      return 2;
    }
  }
  if (decoder) {
    if (fp8) {
      std::cerr << "write_test_checkpoint: --fp8 and --decoder do not go together\n";
      return 2;
    }
    const std::string config_json = mlacp::test::hf_test_decoder_config_json(vocab);
    const auto tensors = mlacp::test::hf_test_decoder_tensors(
        mlacp::parse_config_json(config_json), mlacp::test::kHfTestDecoderLayers,
        mlacp::test::kHfTestDecoderIntermediate, vocab, 2025, at::kBFloat16);
    mlacp::test::write_hf_checkpoint(folder, config_json, tensors, shards);
    std::cout << folder << "\n";
    return 0;
  }
  const std::string config_json = mlacp::test::hf_test_config_json(2);
  const mlacp::MlaConfig config = mlacp::parse_config_json(config_json);
  auto tensors = mlacp::test::hf_test_tensors(config, 2, 2024, at::kBFloat16);
  if (fp8) {
    for (auto& t : tensors) {
      if (t.name != "model.layers.0.self_attn.kv_b_proj.weight") continue;
      t.dtype = "F8_E4M3";
      t.bytes.resize(t.bytes.size() / 2);  // one byte per element
    }
    tensors.push_back(mlacp::test::raw_tensor("model.layers.0.self_attn.kv_b_proj.weight_scale_inv", at::ones({1, 1})));
  }
  mlacp::test::write_hf_checkpoint(folder, config_json, tensors, shards);
  std::cout << folder << "\n";
  return 0;
}
