// Helpers for the server tests: a tiny model family built in a temp directory (SentencePiece
// tokenizer trained on the spot, random Llama base, four fine-tunes compressed to deltas), and a
// `bitdelta serve` child process on a free loopback port.
#pragma once

#include <fcntl.h>
#include <httplib.h>
#include <sentencepiece_trainer.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "bitdelta/compress.h"
#include "bitdelta/model.h"
#include "bitdelta/model_config.h"
#include "test_util.h"

namespace bitdelta::test {

using nlohmann::json;

inline const char* kDemoChatTemplate =
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}";

inline json tiny_server_config() {
  return {{"architectures", {"LlamaForCausalLM"}},
          {"model_type", "llama"},
          {"vocab_size", 300},
          {"hidden_size", 32},
          {"intermediate_size", 64},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"head_dim", 8},
          {"max_position_embeddings", 256},
          {"rms_norm_eps", 1e-5},
          {"rope_theta", 10000.0},
          {"tie_word_embeddings", false},
          {"hidden_act", "silu"},
          {"bos_token_id", 1},
          {"eos_token_id", 2}};
}

// base/ (checkpoint + tokenizer), finetunes/<name>/ and variants/<name>.bitdelta.
struct TinyFamily {
  TempDir dir;
  fs::path base, variants;
  std::vector<std::string> names = {"coder", "math", "writer", "legal"};

  fs::path delta(const std::string& name) const { return variants / (name + ".bitdelta"); }

  TinyFamily() {
    base = dir / "base";
    variants = dir / "variants";
    fs::create_directories(base);
    fs::create_directories(variants);
    // A deterministic corpus of word salad; enough for a 300-piece BPE with byte fallback.
    const char* words[] = {"the", "quick", "brown",  "fox",     "jumps", "over",   "lazy",
                           "dog", "def",   "return", "license", "shall", "number", "sum",
                           "of",  "and",   "to",     "poem",    "sea",   "wind"};
    std::mt19937_64 rng(7);
    std::string corpus;
    for (int line = 0; line < 400; ++line) {
      for (int w = 0; w < 12; ++w)
        corpus += std::string(w ? " " : "") + words[rng() % std::size(words)];
      corpus += " 12+7=19 x = f(y)\n";
    }
    write_text(dir / "corpus.txt", corpus);
    const auto status = sentencepiece::SentencePieceTrainer::Train(
        "--input=" + (dir / "corpus.txt").string() + " --model_prefix=" + (dir / "tok").string() +
        " --vocab_size=300 --model_type=bpe --byte_fallback=true --character_coverage=1.0"
        " --user_defined_symbols=<|system|>,<|user|>,<|assistant|> --unk_id=0 --bos_id=1 "
        "--eos_id=2 --pad_id=-1"
        " --minloglevel=2 --num_threads=1");
    if (!status.ok())
      throw std::runtime_error("sentencepiece training failed: " + status.ToString());
    fs::copy_file(dir / "tok.model", base / "tokenizer.model");
    const json config = tiny_server_config();
    const ModelConfig c = ModelConfig::from_json(config, "tiny");
    TensorMap weights;
    uint64_t s = 100;
    for (const auto& spec : weight_table(c)) {
      const bool norm = spec.shape.size() == 1;
      auto v = random_floats(numel(spec.shape), s++, norm ? 0.1f : 0.4f);
      if (norm)
        for (auto& x : v) x += 1.0f;
      weights[spec.name] = HostTensor::from_floats(DType::BF16, spec.shape, v);
    }
    const auto write_model = [&](const fs::path& d, const TensorMap& w) {
      write_checkpoint(d, w);
      write_text(d / "config.json", config.dump());
      write_text(d / "tokenizer_config.json", json{{"chat_template", kDemoChatTemplate}}.dump());
      if (d != base) fs::copy_file(base / "tokenizer.model", d / "tokenizer.model");
    };
    write_model(base, weights);
    uint64_t seed = 1000;
    for (const auto& name : names) {
      TensorMap ft = weights;
      for (auto& [tname, t] : ft) {
        if (t.shape.size() != 2 || tname.find(".layers.") == std::string::npos) continue;
        auto v = t.floats();
        const auto noise = random_floats(v.size(), seed++, 0.15f);
        for (size_t i = 0; i < v.size(); ++i) v[i] += noise[i];
        t = HostTensor::from_floats(t.dtype, t.shape, v);
      }
      const fs::path ftdir = dir / "finetunes" / name;
      write_model(ftdir, ft);
      CompressOptions options;
      options.threads = 1;
      compress(Checkpoint(base), Checkpoint(ftdir), delta(name), options);
    }
  }
};

// Runs a shell command, capturing stdout and stderr.
inline CommandResult run_command(const std::string& command, const fs::path& scratch) {
  const auto out = scratch / "cmd.out", err = scratch / "cmd.err";
  const int status = std::system((command + " >" + out.string() + " 2>" + err.string()).c_str());
  CommandResult r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_file(out), read_file(err)};
  fs::remove(out);
  fs::remove(err);
  return r;
}

// A `bitdelta serve` child process; killed (SIGTERM, then SIGKILL) when this goes out of scope.
class ServerProcess {
 public:
  ServerProcess(const std::vector<std::string>& args, const fs::path& log) : log_(log) {
    std::vector<std::string> argv = {BITDELTA_CLI, "serve"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.push_back("--port");
    argv.push_back("0");
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive a test process that crashed
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> cargv;
      for (auto& a : argv) cargv.push_back(a.data());
      cargv.push_back(nullptr);
      ::execv(cargv[0], cargv.data());
      ::_exit(127);
    }
    try {
      wait_ready();
    } catch (...) {
      stop();  // a constructor that throws gets no destructor: do not leave the child running
      throw;
    }
  }
  ~ServerProcess() { stop(); }

 private:
  void wait_ready() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    const std::regex listening(R"(listening on http://[^:]+:(\d+))");
    while (std::chrono::steady_clock::now() < deadline) {
      std::smatch m;
      const std::string text = read_file(log_);
      if (std::regex_search(text, m, listening)) {
        port_ = std::stoi(m[1]);
        break;
      }
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        throw std::runtime_error("bitdelta serve exited early:\n" + text);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    if (port_ == 0) throw std::runtime_error("bitdelta serve did not start:\n" + read_file(log_));
    for (int i = 0; i < 500; ++i) {
      auto r = client().Get("/health");
      if (r && r->status == 200) return;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    throw std::runtime_error("bitdelta serve does not answer /health:\n" + read_file(log_));
  }

 public:
  // SIGTERM and wait; returns the exit status (-1 if it had to be killed).
  int stop() {
    if (pid_ <= 0) return exit_status_;
    ::kill(pid_, SIGTERM);
    for (int i = 0; i < 1000; ++i) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        exit_status_ = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        return exit_status_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    return -1;
  }

  int port() const { return port_; }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60);
    return c;
  }
  std::string log() const { return read_file(log_); }

 private:
  fs::path log_;
  pid_t pid_ = -1;
  int port_ = 0;
  int exit_status_ = -1;
};

}  // namespace bitdelta::test
